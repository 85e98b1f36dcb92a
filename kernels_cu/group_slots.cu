// The slots of a partition layout by counting, without a sort: token t of row n goes to slot
//     group_start[n, g] + (tokens of group g before t in row n),        g = labels[n, t],
// where group_start is the group's first slot (groups one after another in id order, each padded to whole
// blocks; sparseattn.svg2_device.partition_slots). Two kernels over chunks of CHUNK_TOKENS tokens, one CTA
// a (chunk, row), between them a few torch ops on the counts:
//   group_chunk_counts  counts[n, c, g]: the tokens of group g in chunk c of row n;
//   group_token_slots   token_slot[n, t] from base[n, c, g] = group_start[n, g] + Σ_{c' < c} counts[n, c', g].
// Inside a chunk each warp takes WARP_TOKENS consecutive tokens. A warp counts its tokens per group in its
// own shared-memory row (lanes of one label found by __match_any_sync; the lowest adds them), the rows are
// turned into each warp's first slot per group (the CTA's base plus the warps before it), and the warp then
// walks its tokens 32 at a time in order: a token's slot is its warp's running count plus the lanes before
// it with the same label. So the order inside a group is the token order (the stable sort's).
// Labels outside [0, groups) are not counted and get slot -1 (partition_slots leaves them unchecked).
//
// NVRTC-compatible: no host headers.

#define GROUP_SLOTS_WARPS 8
#define GROUP_SLOTS_THREADS (32 * GROUP_SLOTS_WARPS)
#define WARP_TOKENS 256                                  // tokens a warp takes in a chunk
#define CHUNK_TOKENS (WARP_TOKENS * GROUP_SLOTS_WARPS)  // mirrored in sparseattn/kernels/group_slots.py

namespace {

// Each warp's count of every group over its tokens of chunk `chunk` (into rows[warp][g], zeroed first).
__device__ __forceinline__ void count_warp_tokens(int* rows, const long long* __restrict__ row_labels, int tokens,
                                                  int chunk, int groups) {
    for (int i = threadIdx.x; i < GROUP_SLOTS_WARPS * groups; i += GROUP_SLOTS_THREADS) rows[i] = 0;
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int* mine = rows + warp * groups;
    const int first = chunk * CHUNK_TOKENS + warp * WARP_TOKENS;
    for (int j = 0; j < WARP_TOKENS; j += 32) {
        const int t = first + j + lane;
        const long long label = t < tokens ? row_labels[t] : -1;
        const bool inside = label >= 0 && label < groups;
        const unsigned peers = __match_any_sync(0xffffffffu, inside ? static_cast<int>(label) : -1);
        if (inside && (__ffs(peers) - 1) == lane) mine[label] += __popc(peers);
        __syncwarp();
    }
    __syncthreads();
}

}  // namespace

// counts: int32 [rows, chunks, groups]. Grid (chunks, rows); dynamic shared memory WARPS · groups ints.
extern "C" __global__ void __launch_bounds__(GROUP_SLOTS_THREADS)
    group_chunk_counts(const long long* __restrict__ labels, int* __restrict__ counts, int tokens, int groups) {
    extern __shared__ int rows[];
    const int chunk = blockIdx.x, n = blockIdx.y;
    count_warp_tokens(rows, labels + static_cast<long long>(n) * tokens, tokens, chunk, groups);
    int* out = counts + (static_cast<long long>(n) * gridDim.x + chunk) * groups;
    for (int g = threadIdx.x; g < groups; g += GROUP_SLOTS_THREADS) {
        int sum = 0;
#pragma unroll
        for (int w = 0; w < GROUP_SLOTS_WARPS; ++w) sum += rows[w * groups + g];
        out[g] = sum;
    }
}

// token_slot: int64 [rows, tokens]; base: int32 [rows, chunks, groups], the first slot of each group's
// tokens in each chunk. Grid (chunks, rows); dynamic shared memory WARPS · groups ints.
extern "C" __global__ void __launch_bounds__(GROUP_SLOTS_THREADS)
    group_token_slots(const long long* __restrict__ labels, const int* __restrict__ base,
                      long long* __restrict__ token_slot, int tokens, int groups) {
    extern __shared__ int rows[];
    const int chunk = blockIdx.x, n = blockIdx.y;
    const long long* row_labels = labels + static_cast<long long>(n) * tokens;
    count_warp_tokens(rows, row_labels, tokens, chunk, groups);
    // each warp's row: its first slot per group (the chunk's base, then the warps before it)
    const int* chunk_base = base + (static_cast<long long>(n) * gridDim.x + chunk) * groups;
    for (int g = threadIdx.x; g < groups; g += GROUP_SLOTS_THREADS) {
        int next = chunk_base[g];
#pragma unroll
        for (int w = 0; w < GROUP_SLOTS_WARPS; ++w) {
            const int here = rows[w * groups + g];
            rows[w * groups + g] = next;
            next += here;
        }
    }
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int* mine = rows + warp * groups;
    const int first = chunk * CHUNK_TOKENS + warp * WARP_TOKENS;
    const unsigned before = (1u << lane) - 1u;
    for (int j = 0; j < WARP_TOKENS; j += 32) {
        const int t = first + j + lane;
        const long long label = t < tokens ? row_labels[t] : -1;
        const bool inside = label >= 0 && label < groups;
        const unsigned peers = __match_any_sync(0xffffffffu, inside ? static_cast<int>(label) : -1);
        if (t < tokens) {
            token_slot[static_cast<long long>(n) * tokens + t] = inside ? mine[label] + __popc(peers & before) : -1;
        }
        __syncwarp();
        if (inside && (__ffs(peers) - 1) == lane) mine[label] += __popc(peers);
        __syncwarp();
    }
}
