// PageWeaver grouping search: the bounded affinity search that emits query-id groups.
//
// The algorithm (and its numpy reference, which this kernel equals exactly) is documented in
// src/sparseattn/pageweaver/grouping.py. Queries are cut into windows of `window` consecutive
// queries; one CTA per window, one thread per candidate query. Each query's selected pages are a
// bitset in shared memory, so the overlap of a candidate with the group's union is a popcount.
// Per step the CTA assigns exactly one query:
//   * no open group (or no eligible candidate): seed a group with the lowest-index ungrouped query;
//   * else add the ungrouped candidate with the smallest key
//       added << 42 | (PW_OV_MAX - overlap) << 21 | index,   added = |S_c| - |U ∩ S_c|,
//     among those keeping |U| + added <= max_union; a group closes at group_size members.
// Outputs (CSR): ids [Q] (group by group, windows in order); pw_group_offsets turns the per-window
// group starts into offsets [num_groups + 1] and num_groups [1] on the device (no host sync).
//
// NVRTC-compatible: no host headers.

#define PW_KEY_INDEX_BITS 21
#define PW_KEY_ADDED_SHIFT 42
#define PW_OV_MAX ((1u << 20) - 1u)
#define PW_MAX_WINDOW 1024
#define PW_NO_KEY 0xFFFFFFFFFFFFFFFFull

typedef unsigned int pw_u32;
typedef unsigned long long pw_u64;

__device__ __forceinline__ pw_u64 pw_warp_min(pw_u64 v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const pw_u64 x = __shfl_down_sync(0xffffffffu, v, o);
    v = x < v ? x : v;
  }
  return v;
}

// Block-wide minimum of two keys; every thread receives both (red: 66 entries of shared memory).
__device__ __forceinline__ void pw_block_min2(pw_u64& a, pw_u64& b, pw_u64* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = (blockDim.x + 31) >> 5;
  a = pw_warp_min(a);
  b = pw_warp_min(b);
  if (lane == 0) {
    red[warp] = a;
    red[32 + warp] = b;
  }
  __syncthreads();
  if (warp == 0) {
    pw_u64 x = lane < nwarps ? red[lane] : PW_NO_KEY;
    pw_u64 y = lane < nwarps ? red[32 + lane] : PW_NO_KEY;
    x = pw_warp_min(x);
    y = pw_warp_min(y);
    if (lane == 0) {
      red[64] = x;
      red[65] = y;
    }
  }
  __syncthreads();
  a = red[64];
  b = red[65];
}

// grid = num_windows, block = window rounded up to a multiple of 32 (<= 1024),
// dynamic shared memory = 4 * (window * (words | 1) + words + window) bytes.
extern "C" __global__ void pw_affinity_group(
    const int* __restrict__ pages,     // [num_queries, k] page ids, -1 padded
    int num_queries, int k, int num_pages,
    int words,                         // ceil(num_pages / 32)
    int window, int group_size,
    long long max_union,               // union cap in pages
    int* __restrict__ ids,             // [num_queries] out: query ids group by group
    int* __restrict__ group_start,     // [num_queries] out: window w's group g starts at ids[w*window + group_start[w*window + g]]
    int* __restrict__ window_groups) { // [num_windows] out: groups of each window
  extern __shared__ pw_u32 pw_smem[];
  __shared__ pw_u64 red[66];
  __shared__ int st_glen, st_usize, st_cnt, st_ngroups;

  const int stride = words | 1;  // odd row stride: thread t reads word w from bank (t*stride + w) % 32
  pw_u32* bits = pw_smem;                     // [window][stride]
  pw_u32* uni = bits + window * stride;       // [words] union of the open group
  int* qsize = (int*)(uni + words);           // [window] |S_q|

  const int t = threadIdx.x;
  const int q0 = blockIdx.x * window;
  const int wlen = min(window, num_queries - q0);

  for (int i = t; i < window * stride + words; i += blockDim.x) pw_smem[i] = 0u;
  __syncthreads();
  for (int i = t; i < wlen * k; i += blockDim.x) {
    const int q = i / k;
    const int p = pages[(long long)q0 * k + i];
    if ((unsigned)p < (unsigned)num_pages) atomicOr(&bits[q * stride + (p >> 5)], 1u << (p & 31));
  }
  __syncthreads();

  bool avail = t < wlen;
  int mysize = 0;
  if (avail) {
    const pw_u32* b = bits + t * stride;
    for (int w = 0; w < words; ++w) mysize += __popc(b[w]);
    qsize[t] = mysize;
  }
  if (t == 0) {
    st_glen = 0;
    st_usize = 0;
    st_cnt = 0;
    st_ngroups = 0;
  }
  __syncthreads();

  for (int it = 0; it < wlen; ++it) {
    const int glen = st_glen;
    const long long usize = st_usize;
    pw_u64 ckey = PW_NO_KEY, skey = PW_NO_KEY;
    if (avail) {
      skey = (pw_u64)t;
      if (glen > 0) {
        const pw_u32* b = bits + t * stride;
        int ov = 0;
        for (int w = 0; w < words; ++w) ov += __popc(uni[w] & b[w]);
        const int added = mysize - ov;
        if (usize + added <= max_union)
          ckey = ((pw_u64)added << PW_KEY_ADDED_SHIFT) | ((pw_u64)(PW_OV_MAX - (pw_u32)ov) << PW_KEY_INDEX_BITS) |
                 (pw_u64)t;
      }
    }
    pw_block_min2(ckey, skey, red);
    const bool member = ckey != PW_NO_KEY;
    const int chosen = member ? (int)(ckey & ((1ull << PW_KEY_INDEX_BITS) - 1ull)) : (int)skey;
    if (t == chosen) avail = false;
    if (t == 0) {
      const int cnt = st_cnt;
      ids[q0 + cnt] = q0 + chosen;
      int g = glen;
      if (member) {
        g += 1;
        st_usize = (int)(usize + (long long)(ckey >> PW_KEY_ADDED_SHIFT));
      } else {
        group_start[q0 + st_ngroups] = cnt;
        st_ngroups += 1;
        g = 1;
        st_usize = qsize[chosen];
      }
      st_glen = g >= group_size ? 0 : g;
      st_cnt = cnt + 1;
    }
    const pw_u32* b = bits + chosen * stride;
    for (int w = t; w < words; w += blockDim.x) uni[w] = member ? (uni[w] | b[w]) : b[w];
    __syncthreads();
  }
  if (t == 0 && wlen > 0) window_groups[blockIdx.x] = st_ngroups;
}

// One CTA (blockDim.x threads, a power of two <= 1024): exclusive scan of window_groups, then the
// CSR offsets [num_groups + 1] of the groups in window order, and num_groups[0].
extern "C" __global__ void pw_group_offsets(
    const int* __restrict__ window_groups,  // [num_windows]
    const int* __restrict__ group_start,    // [num_queries] (see pw_affinity_group)
    int num_windows, int window, int num_queries,
    int* __restrict__ offsets,              // [num_queries + 1] out (first num_groups + 1 entries)
    int* __restrict__ num_groups) {         // [1] out
  __shared__ int scan[PW_MAX_WINDOW];
  __shared__ int carry;
  const int t = threadIdx.x, n = blockDim.x;
  if (t == 0) carry = 0;
  __syncthreads();
  for (int base = 0; base < num_windows; base += n) {
    const int w = base + t;
    const int c = w < num_windows ? window_groups[w] : 0;
    scan[t] = c;
    __syncthreads();
    for (int off = 1; off < n; off <<= 1) {
      const int v = t >= off ? scan[t - off] : 0;
      __syncthreads();
      scan[t] += v;
      __syncthreads();
    }
    const int first = carry + scan[t] - c;
    for (int g = 0; g < c; ++g)
      offsets[first + g] = w * window + group_start[(long long)w * window + g];
    __syncthreads();
    if (t == n - 1) carry += scan[t];
    __syncthreads();
  }
  if (t == 0) {
    offsets[carry] = num_queries;
    num_groups[0] = carry;
  }
}
