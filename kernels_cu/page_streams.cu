// Page streams of per-row layouts (SVG2's per-call plans), one warp per work item: the CUDA form of the
// Triton kernels of src/sparseattn/planning/page_streams.py (_lengths_kernel, _write_kernel), writing the
// same bytes. The launch side is src/sparseattn/kernels/page_streams.py.
//
// A work item is (row r, owner block or owner group i), item = r * n_owner + i. It selects block j of the
// other side when sel[r, i, j] != 0, or with GROUPED when sel[r, i, group[r, j]] != 0 (a group outside
// [0, n_groups) selects nothing). sel is read as bytes at r * s_r + i * s_i + col * s_j (any strides: the
// backward passes a transposed view); full, part, rows, group are int32 [R, n_other], contiguous.
//   page_stream_lengths: out[item] = Σ_j selected(r, i, j) · (full[r, j] + part[r, j]), int64.
//   page_stream_write:   the item's stream from position start[item] on. Pass 1: for each selected block j
//     in block order, pages p < full[r, j] (and p < P), page id r · row_page_stride + j · P + p. SPLIT (the
//     forward): each entry the int32 pair (page, 0xFFFF), written as one 8-byte store; then pass 2, after
//     all full pages: one (page, mask) entry per selected block with part[r, j] > 0, page
//     r · row_page_stride + j · P + full[r, j], mask (1 << (rows[r, j] % 16)) − 1. Non-split (the
//     backward): the int32 page id alone.
// Nothing is written at a position >= capacity (the callers count the cut entries in their status).
//
// A warp walks the other side's blocks 32 at a time, lane l holding block j0 + l; a warp inclusive scan of
// the lanes' page counts places every block's pages, and the chunk's entries are then written by
// consecutive lanes at consecutive positions, each lane finding its entry's block by a binary search over
// the lanes' inclusive sums. The next chunk's group, selection and page counts are loaded before the current
// chunk's entries are written (the walk is a chain of dependent loads otherwise).
//
// The callers' page counts are full in [0, P], part in {0, 1}, rows >= 0; a chunk's pages are summed in
// 32-bit. Positions and offsets are 64-bit, as in the Triton kernels.
//
// NVRTC-compatible: no host headers.

#include "tile_config.cuh"

// Geometry mirrored in sparseattn/kernels/page_streams.py.
#define PS_WARP 32
#define PS_WARPS 8  // work items (warps) per CTA
#define PS_THREADS (PS_WARPS * PS_WARP)
// Row mask of a page whose PAGE_ROWS rows are all valid.
#define PS_FULL_MASK 0xFFFF
#define PS_ALL_LANES 0xffffffffu

namespace {

typedef long long ps_i64;

// A warp's work item, item = r * n_owner + i: (r, its offset r * n_other into the [R, n_other] arrays, its
// selection's offset r * s_r + i * s_i).
struct PsItem {
    ps_i64 r, row_off, sel_base;
};

__device__ __forceinline__ ps_i64 ps_item_index() {
    return static_cast<ps_i64>(blockIdx.x) * PS_WARPS + threadIdx.x / PS_WARP;
}

__device__ __forceinline__ PsItem ps_item(ps_i64 item, int n_owner, int n_other, long long s_r, long long s_i) {
    const ps_i64 r = item / n_owner;
    const ps_i64 i = item - r * n_owner;
    return PsItem{r, r * n_other, r * s_r + i * s_i};
}

// Whether item (r, i) selects block j (j < n_other).
template <bool GROUPED>
__device__ __forceinline__ bool ps_selects(const unsigned char* __restrict__ sel, const int* __restrict__ group,
                                           ps_i64 row_off, ps_i64 sel_base, ps_i64 s_j, int j, int n_groups) {
    ps_i64 col = j;
    if (GROUPED) {
        const int g = group[row_off + j];
        if (g < 0 || g >= n_groups) return false;
        col = g;
    }
    return sel[sel_base + col * s_j] != 0;
}

// Inclusive sum over the warp's lanes.
__device__ __forceinline__ int ps_inclusive_scan(int v, int lane) {
#pragma unroll
    for (int d = 1; d < PS_WARP; d <<= 1) {
        const int u = __shfl_up_sync(PS_ALL_LANES, v, d);
        if (lane >= d) v += u;
    }
    return v;
}

// The lane holding entry e of a chunk: the first lane whose inclusive sum exceeds e (e below the chunk's
// total; every lane calls it).
__device__ __forceinline__ int ps_owner_lane(int incl, int e) {
    int lo = 0;
#pragma unroll
    for (int step = PS_WARP / 2; step >= 1; step >>= 1) {
        if (__shfl_sync(PS_ALL_LANES, incl, lo + step - 1) <= e) lo += step;
    }
    return lo;
}

// A chunk's pages: lane l holds block j0 + l with n pages (p < n), written as entries by consecutive lanes
// at consecutive positions from off (each lane finding its entry's block by ps_owner_lane); pages p >= P
// and positions >= capacity are skipped. SPLIT: each entry the pair (page, PS_FULL_MASK), one 8-byte store;
// else the page id. Returns the chunk's page count (every lane).
template <bool SPLIT>
__device__ __forceinline__ int ps_write_chunk_pages(int n, int lane, int j0, ps_i64 off, ps_i64 base, int P,
                                                    ps_i64 capacity, int* __restrict__ out) {
    const int incl = ps_inclusive_scan(n, lane);
    const int excl = incl - n;
    const int chunk = __shfl_sync(PS_ALL_LANES, incl, PS_WARP - 1);
    for (int e0 = 0; e0 < chunk; e0 += PS_WARP) {
        const int e = e0 + lane;
        const int owner = ps_owner_lane(incl, e);
        const int p = e - __shfl_sync(PS_ALL_LANES, excl, owner);
        const ps_i64 pos = off + e;
        if (e < chunk && p < P && pos < capacity) {
            const int page = static_cast<int>(base + static_cast<ps_i64>(j0 + owner) * P + p);
            if (SPLIT)
                reinterpret_cast<int2*>(out)[pos] = make_int2(page, PS_FULL_MASK);
            else
                out[pos] = page;
        }
    }
    return chunk;
}

// The lengths kernels' body: out[item] = Σ_j selected · (full + part)[r, j] and with PARTIALS partials[item] =
// Σ_j selected · part[r, j].
template <bool GROUPED, bool PARTIALS>
__device__ __forceinline__ void ps_item_lengths(const unsigned char* __restrict__ sel,
                                                const int* __restrict__ group, const int* __restrict__ full,
                                                const int* __restrict__ part, long long* __restrict__ out,
                                                long long* __restrict__ partials, long long items, int n_owner,
                                                int n_other, int n_groups, long long s_r, long long s_i,
                                                long long s_j) {
    const int lane = threadIdx.x % PS_WARP;
    const ps_i64 item = ps_item_index();
    if (item >= items) return;
    const auto [r, row_off, sel_base] = ps_item(item, n_owner, n_other, s_r, s_i);
    ps_i64 total = 0, parts = 0;
#pragma unroll 4
    for (int j = lane; j < n_other; j += PS_WARP) {
        if (ps_selects<GROUPED>(sel, group, row_off, sel_base, s_j, j, n_groups)) {
            const int q = part[row_off + j];
            total += full[row_off + j] + q;
            if (PARTIALS) parts += q;
        }
    }
#pragma unroll
    for (int d = PS_WARP / 2; d >= 1; d >>= 1) {
        total += __shfl_xor_sync(PS_ALL_LANES, total, d);
        if (PARTIALS) parts += __shfl_xor_sync(PS_ALL_LANES, parts, d);
    }
    if (lane == 0) {
        out[item] = total;
        if (PARTIALS) partials[item] = parts;
    }
}

}  // namespace

// One warp per item: out[item] = the item's stream entries (full + partial pages of its selected blocks).
template <bool GROUPED>
__global__ void __launch_bounds__(PS_THREADS)
    page_stream_lengths(const unsigned char* __restrict__ sel, const int* __restrict__ group,
                        const int* __restrict__ full, const int* __restrict__ part, long long* __restrict__ out,
                        long long items, int n_owner, int n_other, int n_groups, long long s_r, long long s_i,
                        long long s_j) {
    ps_item_lengths<GROUPED, false>(sel, group, full, part, out, nullptr, items, n_owner, n_other, n_groups, s_r,
                                    s_i, s_j);
}

// One warp per item: the item's stream at start[item] (see the header). out: int32 [capacity (+ 1), 2]
// (SPLIT, 8-byte aligned) or [capacity (+ 1)].
template <bool SPLIT, bool GROUPED>
__global__ void __launch_bounds__(PS_THREADS)
    page_stream_write(const unsigned char* __restrict__ sel, const int* __restrict__ group,
                      const int* __restrict__ full, const int* __restrict__ part, const int* __restrict__ rows,
                      const long long* __restrict__ start, int* __restrict__ out, long long items, int n_owner,
                      int n_other, int n_groups, long long s_r, long long s_i, long long s_j, long long capacity,
                      long long row_page_stride, int P) {
    const int lane = threadIdx.x % PS_WARP;
    const ps_i64 item = ps_item_index();
    if (item >= items) return;
    const auto [r, row_off, sel_base] = ps_item(item, n_owner, n_other, s_r, s_i);
    const ps_i64 base = r * row_page_stride;
    int2* __restrict__ pairs = reinterpret_cast<int2*>(out);
    ps_i64 off = start[item];

    // pass 1: full pages (SPLIT) or every live page, block by block
    bool s_next = lane < n_other && ps_selects<GROUPED>(sel, group, row_off, sel_base, s_j, lane, n_groups);
    int f_next = lane < n_other ? full[row_off + lane] : 0;
    for (int j0 = 0; j0 < n_other; j0 += PS_WARP) {
        const int n = s_next ? f_next : 0;
        const int jn = j0 + lane + PS_WARP;
        s_next = jn < n_other && ps_selects<GROUPED>(sel, group, row_off, sel_base, s_j, jn, n_groups);
        f_next = jn < n_other ? full[row_off + jn] : 0;
        off += ps_write_chunk_pages<SPLIT>(n, lane, j0, off, base, P, capacity, out);
    }
    if (!SPLIT) return;

    // pass 2: the partial page of each selected block that has one, after all full pages
    s_next = lane < n_other && ps_selects<GROUPED>(sel, group, row_off, sel_base, s_j, lane, n_groups);
    f_next = lane < n_other ? part[row_off + lane] : 0;
    for (int j0 = 0; j0 < n_other; j0 += PS_WARP) {
        const int j = j0 + lane;
        const int n = s_next ? f_next : 0;
        const int jn = j + PS_WARP;
        s_next = jn < n_other && ps_selects<GROUPED>(sel, group, row_off, sel_base, s_j, jn, n_groups);
        f_next = jn < n_other ? part[row_off + jn] : 0;
        const int incl = ps_inclusive_scan(n, lane);
        const ps_i64 pos = off + (incl - n);
        if (n > 0 && pos < capacity) {
            const int page = static_cast<int>(base + static_cast<ps_i64>(j) * P + full[row_off + j]);
            const int mask = (1 << (rows[row_off + j] % PAGE_ROWS)) - 1;
            pairs[pos] = make_int2(page, mask);
        }
        off += __shfl_sync(PS_ALL_LANES, incl, PS_WARP - 1);
    }
}

// One warp per item: out[item] as page_stream_lengths, and partials[item] = Σ_j selected(r, i, j) · part[r, j],
// the item's partial-page entries (page_stream_write_one_walk writes them after the item's out − partials
// full pages).
template <bool GROUPED>
__global__ void __launch_bounds__(PS_THREADS)
    page_stream_lengths_split(const unsigned char* __restrict__ sel, const int* __restrict__ group,
                              const int* __restrict__ full, const int* __restrict__ part,
                              long long* __restrict__ out, long long* __restrict__ partials, long long items,
                              int n_owner, int n_other, int n_groups, long long s_r, long long s_i, long long s_j) {
    ps_item_lengths<GROUPED, true>(sel, group, full, part, out, partials, items, n_owner, n_other, n_groups, s_r,
                                   s_i, s_j);
}

// One warp per item: page_stream_write<true, GROUPED>'s bytes (the forward's split streams) in one walk of the
// other side's blocks instead of two. The item's partial-page entries start after its full pages, at
// start[item] + lengths[item] − partials[item] (page_stream_lengths_split), so each chunk writes its full pages
// and its partial pages together: the second walk's loads (selection, group, part) are the first's.
template <bool GROUPED>
__global__ void __launch_bounds__(PS_THREADS)
    page_stream_write_one_walk(const unsigned char* __restrict__ sel, const int* __restrict__ group,
                               const int* __restrict__ full, const int* __restrict__ part,
                               const int* __restrict__ rows, const long long* __restrict__ start,
                               const long long* __restrict__ lengths, const long long* __restrict__ partials,
                               int* __restrict__ out, long long items, int n_owner, int n_other, int n_groups,
                               long long s_r, long long s_i, long long s_j, long long capacity,
                               long long row_page_stride, int P) {
    const int lane = threadIdx.x % PS_WARP;
    const ps_i64 item = ps_item_index();
    if (item >= items) return;
    const auto [r, row_off, sel_base] = ps_item(item, n_owner, n_other, s_r, s_i);
    const ps_i64 base = r * row_page_stride;
    int2* __restrict__ pairs = reinterpret_cast<int2*>(out);
    ps_i64 off = start[item];
    ps_i64 off_part = off + lengths[item] - partials[item];

    bool s_next = lane < n_other && ps_selects<GROUPED>(sel, group, row_off, sel_base, s_j, lane, n_groups);
    int f_next = lane < n_other ? full[row_off + lane] : 0;
    int q_next = lane < n_other ? part[row_off + lane] : 0;
    for (int j0 = 0; j0 < n_other; j0 += PS_WARP) {
        const int f = f_next;
        const int n = s_next ? f : 0;
        const int m = s_next ? q_next : 0;
        const int jn = j0 + lane + PS_WARP;
        s_next = jn < n_other && ps_selects<GROUPED>(sel, group, row_off, sel_base, s_j, jn, n_groups);
        f_next = jn < n_other ? full[row_off + jn] : 0;
        q_next = jn < n_other ? part[row_off + jn] : 0;

        // the chunk's partial pages, one entry per block with one, in block order
        const int incl_m = ps_inclusive_scan(m, lane);
        const ps_i64 pos_m = off_part + (incl_m - m);
        if (m > 0 && pos_m < capacity) {
            const int j = j0 + lane;
            const int page = static_cast<int>(base + static_cast<ps_i64>(j) * P + f);
            const int mask = (1 << (rows[row_off + j] % PAGE_ROWS)) - 1;
            pairs[pos_m] = make_int2(page, mask);
        }
        off_part += __shfl_sync(PS_ALL_LANES, incl_m, PS_WARP - 1);

        off += ps_write_chunk_pages<true>(n, lane, j0, off, base, P, capacity, out);  // its full pages
    }
}
