// Device planner: a block selection on the GPU -> the work lists and plans the paged kernels read.
//
// The algorithm, its arrays and their numpy twin are documented in src/sparseattn/planning/device.py
// (the launch side) and src/sparseattn/planning/device_emulation.py (the same steps in numpy, which
// these kernels equal bit for bit). In short, per call:
//   1. the selection becomes one bitmap row per (head, owner block): bit c = owner block selects
//      stream block c (plan_bitmap_from_topk / plan_bitmap_from_mask; plan_bitmap_transpose gives
//      the K/V-owned backward its rows);
//   2. every work item of a layout-fixed template (per head: its owner pages, up to eight member
//      blocks with the owned page slots each covers, a stream order mode) counts the live pages it
//      streams (plan_items, count pass);
//   3. offsets by an exclusive scan (plan_scan), item order by a per-segment sort (plan_segment_sort);
//   4. every item writes its stream at its offset (plan_items, write pass).
// The forward work list runs 2-4 as one pass (plan_items_fused: each item counts, takes its offset by a
// look-back over the items before it, and writes), then its sort.
// Nothing here reads or writes out of bounds, whatever the selection holds: indices outside the
// block range are ignored (and counted in `invalid`), and a stream past the buffer's capacity is cut
// (and counted in `overflow`).
//
// NVRTC-compatible: no host headers.

#include "tile_config.cuh"

// Owned page slots of a work item (the largest route's M / PAGE_ROWS) and member blocks at most.
#define PLAN_SLOTS 8
// Row mask of a page whose PAGE_ROWS rows are all valid.
#define PLAN_FULL_PAGE 0xFFFFu
// Visibility bits of a work-list entry: bit PLAN_VIS_SHIFT + s = owned page slot s sees the page.
#define PLAN_VIS_SHIFT 16
#define PLAN_HALF0 0x0Fu
#define PLAN_HALF1 0xF0u

// Stream order of an item's entries (what its template says):
//   PLAIN        stream blocks in order, each block's live pages in order;
//   FULL_FIRST   the same, all full pages first, then all partial ones (forward KPage items);
//   HALVES       [seen by half A only | by both | by half B only], each part in order (backward pairs);
//   INTERLEAVED  HALVES with whole chunks of A-only and B-only pages alternated ahead (forward pairs).
#define PLAN_MODE_PLAIN 0
#define PLAN_MODE_FULL_FIRST 1
#define PLAN_MODE_HALVES 2
#define PLAN_MODE_INTERLEAVED 3

// Output formats of the write pass.
#define PLAN_OUT_WORK_LIST 0  // the forward kernel's: work_info int4, own and stream entries int2
#define PLAN_OUT_TILE_PLAN 1  // the backward kernels': work_head, own_pages, stream_pages (+ pair pages)

// Staged write pass: each warp's stage in shared memory holds a group's entries in stream order, as
// page id | owner lane << PLAN_STAGE_LANE_SHIFT (page ids below 2^26).
#define PLAN_STAGE_LANE_SHIFT 26
// Largest stage whose groups of several blocks the write pass counts in packed 10-bit fields.
#define PLAN_STAGE_FIELD 1023
#define PLAN_STAGE_PAGE_MASK ((1u << PLAN_STAGE_LANE_SHIFT) - 1u)

// The write pass's store form: staged (the default), or for A/B runs PLAN_WRITE_PER_BLOCK (each lane
// stores its block's pages) or PLAN_WRITE_COALESCED (lanes take consecutive entries of each class run,
// found by a search over the lanes' prefix); NOTES_device_planner v8 and v15.
#if defined(PLAN_WRITE_PER_BLOCK)
#define PLAN_WRITE_STAGED 0
#define PLAN_WRITE_FORM 1
#elif defined(PLAN_WRITE_COALESCED)
#define PLAN_WRITE_STAGED 0
#define PLAN_WRITE_FORM 2
#else
#define PLAN_WRITE_STAGED 1
#endif

// Segment sort: at most this many items per segment (keys in shared memory).
#define PLAN_SORT_MAX 16384
#define PLAN_KEY_LEN 0   // longest stream first
#define PLAN_KEY_COST 1  // largest M * chunks first

typedef unsigned int plan_u32;
typedef unsigned long long plan_u64;

__device__ __forceinline__ bool plan_bit(const plan_u32* __restrict__ bits, int i) {
    return (bits[i >> 5] >> (i & 31)) & 1u;
}

// ---- 1. selections -> bitmaps ----------------------------------------------------------------------

// One thread per index entry. idx [rows, k] (entries at or past num[row] ignored), num [rows];
// bitmap [rows, words], zeroed before. Rows are (head, owner block) pairs, head-major.
extern "C" __global__ void plan_bitmap_from_topk(const int* __restrict__ idx, const int* __restrict__ num,
                                                 long long rows, int k, int row_blocks, int cols, int words,
                                                 const plan_u32* __restrict__ row_alive,
                                                 const plan_u32* __restrict__ col_alive,
                                                 plan_u32* __restrict__ bitmap, int* __restrict__ invalid) {
    const long long t = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (t >= rows * k) return;
    const long long r = t / k;
    const int e = static_cast<int>(t - r * k);
    const int n = num[r];
    if (e == 0 && (n < 0 || n > k)) atomicAdd(invalid, 1);
    if (e >= min(max(n, 0), k)) return;
    const int c = idx[t];
    if (static_cast<unsigned>(c) >= static_cast<unsigned>(cols)) {
        atomicAdd(invalid, 1);
        return;
    }
    const int b = static_cast<int>(r % row_blocks);
    if (!plan_bit(row_alive, b) || !plan_bit(col_alive, c)) return;  // blocks without valid rows
    atomicOr(bitmap + r * words + (c >> 5), 1u << (c & 31));
}

// The same bitmap, one warp per row: the row's words are built in the warp's part of shared memory
// (words <= PLAN_TOPK_ROW_WORDS; dynamic shared memory 4 * words per warp) and stored whole, so the bitmap
// needs no zeroing first and global memory sees no atomics. Same bits, same invalid count.
#define PLAN_TOPK_ROW_WORDS 1024
extern "C" __global__ void plan_bitmap_from_topk_rows(const int* __restrict__ idx, const int* __restrict__ num,
                                                      long long rows, int k, int row_blocks, int cols, int words,
                                                      const plan_u32* __restrict__ row_alive,
                                                      const plan_u32* __restrict__ col_alive,
                                                      plan_u32* __restrict__ bitmap, int* __restrict__ invalid) {
    extern __shared__ plan_u32 plan_row_bits[];
    const int lane = threadIdx.x & 31;
    plan_u32* mine = plan_row_bits + (threadIdx.x >> 5) * words;
    const long long warps = (static_cast<long long>(gridDim.x) * blockDim.x) >> 5;
    for (long long r = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; r < rows; r += warps) {
        for (int w = lane; w < words; w += 32) mine[w] = 0u;
        __syncwarp();
        const int n = num[r];
        int bad = lane == 0 && (n < 0 || n > k) ? 1 : 0;
        const int used = min(max(n, 0), k);
        const bool row_ok = plan_bit(row_alive, static_cast<int>(r % row_blocks));
        for (int e = lane; e < used; e += 32) {
            const int c = idx[r * k + e];
            if (static_cast<unsigned>(c) >= static_cast<unsigned>(cols)) {
                ++bad;
            } else if (row_ok && plan_bit(col_alive, c)) {
                atomicOr(mine + (c >> 5), 1u << (c & 31));
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) bad += __shfl_xor_sync(0xffffffffu, bad, o);
        if (lane == 0 && bad) atomicAdd(invalid, bad);
        __syncwarp();
        for (int w = lane; w < words; w += 32) bitmap[r * words + w] = mine[w];
        __syncwarp();
    }
}

// One thread per bitmap word. mask: bool bytes [rows, cols].
extern "C" __global__ void plan_bitmap_from_mask(const unsigned char* __restrict__ mask, long long rows,
                                                 int row_blocks, int cols, int words,
                                                 const plan_u32* __restrict__ row_alive,
                                                 const plan_u32* __restrict__ col_alive,
                                                 plan_u32* __restrict__ bitmap) {
    const long long t = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (t >= rows * words) return;
    const long long r = t / words;
    const int w = static_cast<int>(t - r * words);
    const unsigned char* m = mask + r * cols + w * 32;
    const int n = min(32, cols - w * 32);
    plan_u32 bits = 0;
    for (int i = 0; i < n; ++i) bits |= static_cast<plan_u32>(m[i] != 0) << i;
    if (!plan_bit(row_alive, static_cast<int>(r % row_blocks))) bits = 0;
    bitmap[t] = bits & col_alive[w];
}

// in [heads, rows, in_words] (bits over cols) -> out [heads, cols, out_words] (bits over rows).
// One warp per 32 x 32 tile of bits.
extern "C" __global__ void plan_bitmap_transpose(const plan_u32* __restrict__ in, int heads, int rows, int cols,
                                                 int in_words, int out_words, plan_u32* __restrict__ out) {
    const long long warp = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (warp >= static_cast<long long>(heads) * out_words * in_words) return;  // warp-uniform
    const int cw = static_cast<int>(warp % in_words);
    const long long hr = warp / in_words;
    const int rw = static_cast<int>(hr % out_words);
    const int h = static_cast<int>(hr / out_words);
    const int r = rw * 32 + lane;
    const plan_u32 word = r < rows ? in[(static_cast<long long>(h) * rows + r) * in_words + cw] : 0u;
    plan_u32 mine = 0;
#pragma unroll
    for (int c = 0; c < 32; ++c) {
        const plan_u32 b = __ballot_sync(0xffffffffu, (word >> c) & 1u);
        if (lane == c) mine = b;
    }
    const int col = cw * 32 + lane;
    if (col < cols) out[(static_cast<long long>(h) * cols + col) * out_words + rw] = mine;
}

// ---- 2 and 4. work items: count, then write ------------------------------------------------------

__device__ __forceinline__ int plan_warp_incl(int v, int lane) {
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int x = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += x;
    }
    return v;
}

__device__ __forceinline__ int plan_warp_sum(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Position of the r-th page of category cat (0 = A only, 1 = both halves, 2 = B only) in an
// INTERLEAVED stream with na / ns A-only / shared pages and `runs` alternated chunk pairs of P pages.
__device__ __forceinline__ int plan_interleaved(int cat, int r, int na, int ns, int runs, int P) {
    const int moved = runs * P;
    if (cat == 1) return 2 * moved + (na - moved) + r;
    if (r < moved) return 2 * P * (r / P) + (cat == 2 ? P : 0) + r % P;
    return 2 * moved + (cat == 0 ? 0 : (na - moved) + ns) + (r - moved);
}

// One stream entry at position out: the work list's (page, row mask | visibility bits), or the tile
// plan's page with, for pair plans, the page or -1 as each half sees it (cat: 0 A only, 1 both, 2 B only).
__device__ __forceinline__ void plan_store(int out_format, long long out, int page, plan_u32 mask, plan_u32 vis,
                                           int cat, int2* __restrict__ stream_entries,
                                           int* __restrict__ stream_pages, int* __restrict__ pair_pages) {
    if (out_format == PLAN_OUT_WORK_LIST) {
        stream_entries[out] = make_int2(page, static_cast<int>(mask | (vis << PLAN_VIS_SHIFT)));
        return;
    }
    stream_pages[out] = page;
    if (pair_pages != nullptr) {
        pair_pages[3 * out] = page;
        pair_pages[3 * out + 1] = cat != 2 ? page : -1;
        pair_pages[3 * out + 2] = cat != 0 ? page : -1;
    }
}

// The fused forward pass's offsets: a decoupled look-back over the items in position order. The pass
// claims positions in order (an atomic counter), so every earlier position belongs to a running warp, which
// publishes its stream length before it looks back itself: no wait can close a circle.
// status[p] = flag << 62 | value: flag 1 = p's own stream length, 2 = the lengths of positions 0..p summed.
#define PLAN_LB_AGG (1ull << 62)
#define PLAN_LB_INCL (2ull << 62)
#define PLAN_LB_VALUE ((1ull << 62) - 1ull)

__device__ __forceinline__ void plan_lb_store(plan_u64* p, plan_u64 v) {
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ plan_u64 plan_lb_load(const plan_u64* p) {
    plan_u64 v;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// Nanoseconds a look-back sleeps before it reads a window again whose positions have not all counted yet
// (NOTES_device_planner: the spin rounds take issue slots from the working warps); SPARSEATTN_PLAN_LB_SLEEP_NS.
#ifndef PLAN_LB_SLEEP_NS
#define PLAN_LB_SLEEP_NS 32
#endif
// The sleep doubles after every round that waited, up to this many nanoseconds (the default: no growth);
// SPARSEATTN_PLAN_LB_SLEEP_MAX_NS.
#ifndef PLAN_LB_SLEEP_MAX_NS
#define PLAN_LB_SLEEP_MAX_NS PLAN_LB_SLEEP_NS
#endif

// The stream lengths of the positions before pos summed (len: pos's own), the warp's lanes reading 32
// earlier positions at a time back to the nearest one that holds a sum from position 0.
__device__ __forceinline__ long long plan_lookback(plan_u64* status, long long pos, long long len, int lane) {
    if (lane == 0) plan_lb_store(status + pos, (pos == 0 ? PLAN_LB_INCL : PLAN_LB_AGG) | static_cast<plan_u64>(len));
    long long before = 0;
#if PLAN_LB_SLEEP_MAX_NS > PLAN_LB_SLEEP_NS
    unsigned sleep_ns = PLAN_LB_SLEEP_NS;
#endif
    for (long long look = pos - 1; look >= 0; look -= 32) {
        const long long j = look - lane;
        plan_u64 s;
        unsigned pending, incl;
        int stop;
        do {
            s = j >= 0 ? plan_lb_load(status + j) : PLAN_LB_INCL;
            incl = __ballot_sync(0xffffffffu, (s >> 62) == 2);
            stop = incl ? __ffs(incl) - 1 : 31;  // the nearest lane holding a sum from 0, else the whole window
            const unsigned need = stop == 31 ? 0xffffffffu : (2u << stop) - 1u;
            pending = __ballot_sync(0xffffffffu, (s >> 62) == 0) & need;
#if PLAN_LB_SLEEP_MAX_NS > PLAN_LB_SLEEP_NS
            if (pending) {
                __nanosleep(sleep_ns);
                sleep_ns = min(2u * sleep_ns, static_cast<unsigned>(PLAN_LB_SLEEP_MAX_NS));
            }
#else
            if (pending) __nanosleep(PLAN_LB_SLEEP_NS);
#endif
        } while (pending);
        long long v = lane <= stop ? static_cast<long long>(s & PLAN_LB_VALUE) : 0;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        before += v;
        if (incl) break;
    }
    if (lane == 0 && pos > 0) plan_lb_store(status + pos, PLAN_LB_INCL | static_cast<plan_u64>(before + len));
    return before;
}

// One warp per work item. Items: `heads` x `items` (head-major, the template repeated per head); with
// `perm` the warp at position p handles item perm[p] (the backward's sorted order) and writes its
// per-item outputs at p.
//
// Template (per head): it_info [items][4] = (mode, M rows, members, 0); it_members / it_bits
// [items][8] = member owner blocks and the owned slots each covers (bit s = slot s); it_own [items][8]
// = owned page ids (-1 padded). Stream side: t_first [blocks + 1] offsets of t_pages (each block's
// live pages in order, or all its pages for BSA), t_nfull [blocks] its full pages, t_mask [pages];
// o_mask [pages] the owner side's row masks.
//
// Count pass (write == 0): cnt[item] = (entries, c1, c2, M): c1 = full pages (FULL_FIRST) or A-only
// pages (HALVES, INTERLEAVED), c2 = pages seen by both halves, M the item's rows.
// Write pass: base[p] = the item's first entry (forward: begin[item], template order; backward: the
// CSR offsets of the sorted order), entries past cap are cut (overflow).
// FUSED (the forward work list, no perm): both in one call; the item counts, finds its offset by
// plan_lookback and writes it to begin_out[p] (and the last position begin_out[total], as plan_scan does).
template <bool FUSED>
__device__ __forceinline__ void plan_item(
    long long pos, int lane, const plan_u32* __restrict__ bitmap, int row_blocks, int words, int items,
    const int4* __restrict__ it_info, const int* __restrict__ it_members, const int* __restrict__ it_bits,
    const int* __restrict__ it_own, int matched, const int4* __restrict__ m_info,
    const int* __restrict__ m_members, const int* __restrict__ m_bits, const int* __restrict__ m_own, const int* __restrict__ t_first, const int* __restrict__ t_pages,
    const int* __restrict__ t_nfull, const unsigned short* __restrict__ t_mask,
    const unsigned short* __restrict__ o_mask, int chunk_pages, int write, int out_format,
    int4* __restrict__ cnt, const int* __restrict__ base, const int* __restrict__ perm, long long cap,
    int4* __restrict__ work_info, int2* __restrict__ own_entries, int2* __restrict__ stream_entries,
    int* __restrict__ work_head, int* __restrict__ own_pages, int* __restrict__ stream_pages,
    int* __restrict__ pair_pages, int* __restrict__ overflow, int* __restrict__ void_counts,
    plan_u32* __restrict__ stage, int stage_blocks, int stage_cap, plan_u64* __restrict__ lookback,
    const long long* __restrict__ slices, int* __restrict__ begin_out, long long total) {
    const int item = perm != nullptr ? perm[pos] : static_cast<int>(pos);
    const int bh = item / items;
    const int it = item - bh * items;
    // a matched slot's item is this head's (plan_pair_match), the others the template's
    const bool slot = it < matched;
    const long long at8 = slot ? (static_cast<long long>(bh) * matched + it) * PLAN_SLOTS : it * PLAN_SLOTS;
    const int4 info = slot ? m_info[static_cast<long long>(bh) * matched + it] : it_info[it];
    const int* members_of = slot ? m_members : it_members;
    const int* bits_of = slot ? m_bits : it_bits;
    const int* own_of = slot ? m_own : it_own;
    const int mode = info.x, members = min(max(info.z, 0), PLAN_SLOTS);
    const bool halves = mode == PLAN_MODE_HALVES || mode == PLAN_MODE_INTERLEAVED;
    // every lane holds every member: its bitmap row and the owned slots it covers
    const int my_member = lane < members ? members_of[at8 + lane] : 0;
    const int my_bits = lane < members ? bits_of[at8 + lane] : 0;
    // member m's bitmap row (bh * row_blocks + block) and owned slots, shuffled from lane m where used (the
    // whole warp present) rather than held in 16 registers through the item
    auto member_row = [&](int m) {
        return bh * row_blocks + min(max(__shfl_sync(0xffffffffu, my_member, m), 0), row_blocks - 1);
    };
    auto member_bits = [&](int m) { return static_cast<plan_u32>(__shfl_sync(0xffffffffu, my_bits, m)); };

    // the write pass places pages from the item's totals (the count pass's)
    int4 totals = make_int4(0, 0, 0, 0);
    long long first = 0;
    int len = 0;
    if (write && !FUSED) {
        totals = cnt[item];
        first = base[pos];
        len = static_cast<int>(max(0LL, min(static_cast<long long>(totals.x), cap - first)));
        if (lane == 0 && len < totals.x) atomicAdd(overflow, 1);
    }
    int na = totals.y, ns = totals.z;
    // the work list's entries by block (its pair items' interleaved order gains nothing from coalescing),
    // the tile plans' by class runs (see NOTES_device_planner v8)
#if PLAN_WRITE_STAGED
    // groups of stage_blocks selected blocks (as many as fit their pages in the stage; at least 1; a stage
    // of more than PLAN_STAGE_FIELD entries takes one block at a time, see the packed prefix below)
    const int group = write ? (stage_cap <= PLAN_STAGE_FIELD ? max(stage_blocks, 1) : 1) : 32;
    int run_done[3] = {0, 0, 0};  // entries of earlier groups in the stream's first, second and third class run
#else
    const bool per_block_writes = PLAN_WRITE_FORM == 1;
    const int group = 32;
#endif
    int runs = mode == PLAN_MODE_INTERLEAVED ? min(na, totals.x - na - ns) / chunk_pages : 0;

    // this lane's word w of each member (word[m]); a = selected by a slot of rows 0-63, b = of rows 64-127
    auto member_words = [&](int w, plan_u32* word, plan_u32& a, plan_u32& b) {
        a = b = 0;
#pragma unroll
        for (int m = 0; m < PLAN_SLOTS; ++m) {
            const long long r = member_row(m);
            const plan_u32 mb = member_bits(m);
            word[m] = (m < members && w < words) ? bitmap[r * words + w] : 0u;
            if (!halves || (mb & PLAN_HALF0)) a |= word[m];
            if (!halves || (mb & PLAN_HALF1)) b |= word[m];
        }
    };
    // Count: cnt[item] = (entries, c1, c2, M, or -1 for a void item; see below), each lane summing its
    // words' selected blocks bit by bit.
    auto count = [&]() {
        int acc_len = 0, acc_c1 = 0, acc_c2 = 0;
        for (int w = lane; w < ((words + 31) & ~31); w += 32) {
            plan_u32 word[PLAN_SLOTS], a, b;
            member_words(w, word, a, b);
            for (plan_u32 rest = a | b; rest; rest &= rest - 1) {
                const plan_u32 bit = rest & (0u - rest);
                const int j = w * 32 + __ffs(rest) - 1;
                const int pages = t_first[j + 1] - t_first[j];
                acc_len += pages;
                if (mode == PLAN_MODE_FULL_FIRST) acc_c1 += t_nfull[j];
                if (halves && (a & bit) && !(b & bit)) acc_c1 += pages;
                if (halves && (a & bit) && (b & bit)) acc_c2 += pages;
            }
        }
        const int l = plan_warp_sum(acc_len), c1 = plan_warp_sum(acc_c1), c2 = plan_warp_sum(acc_c2);
        // a void item (no stream entry, no owned page: the slot of a block that joined its neighbour's pair
        // item) is marked by M = -1 and counted per head, for plan_segment_sort to put it before every
        // live item (the launch then starts the kernel's item counter past them)
        const int owns = lane < PLAN_SLOTS ? own_of[at8 + lane] : -1;
        const bool is_void = void_counts != nullptr && l == 0 && !__any_sync(0xffffffffu, owns >= 0);
        const int4 c = make_int4(l, c1, c2, is_void ? -1 : info.y);
        if (lane == 0) {
            cnt[item] = c;
            if (is_void) atomicAdd(void_counts + bh, 1);
        }
        return c;
    };
#if !PLAN_WRITE_STAGED
    int carry[5] = {0, 0, 0, 0, 0};  // write pass: pages of earlier blocks, by class
#endif
    if (!write) {
        count();
        return;
    }
    if (FUSED) {  // counted here: the offset, then the write
        totals = count();
        if (slices != nullptr) {  // the item's slice of the buffer: its offset needs no other item's count
            const long long start = bh * slices[items] + slices[it];
            first = min(start, cap);
            const long long room = min(slices[it + 1] - slices[it], cap - first);
            len = static_cast<int>(max(0LL, min(static_cast<long long>(totals.x), room)));
            if (lane == 0) {
                begin_out[pos] = static_cast<int>(first);
                if (len < totals.x) atomicAdd(overflow, 1);
                if (pos == total - 1) begin_out[total] = static_cast<int>(min(start + room, cap));
            }
        } else {
            const long long before = plan_lookback(lookback, pos, totals.x, lane);
            first = min(before, cap);
            len = static_cast<int>(max(0LL, min(static_cast<long long>(totals.x), cap - first)));
            if (lane == 0) {
                begin_out[pos] = static_cast<int>(first);
                if (len < totals.x) atomicAdd(overflow, 1);
                if (pos == total - 1) {
                    const long long all = before + totals.x;
                    begin_out[total] = static_cast<int>(min(all, cap));
                    if (all > cap) atomicAdd(overflow, 1);
                }
            }
        }
        na = totals.y;
        ns = totals.z;
        runs = mode == PLAN_MODE_INTERLEAVED ? min(na, totals.x - na - ns) / chunk_pages : 0;
    }
    for (int w0 = 0; w0 < words; w0 += 32) {
        plan_u32 word[PLAN_SLOTS], a, b;
        member_words(w0 + lane, word, a, b);
        const plan_u32 any = a | b;
        // Write: the selected blocks of these 32 words, 32 at a time, one per lane, in block order (each
        // lane then writes its block's pages: balanced over lanes, nearby positions per store).
        const int bits_incl = plan_warp_incl(__popc(any), lane);
        const int bits_excl = bits_incl - __popc(any);
        const int bits_total = __shfl_sync(0xffffffffu, bits_incl, 31);
        for (int t0 = 0; t0 < bits_total; t0 += group) {
            const int t = t0 + lane;
            int owner = 0;  // the lane whose word holds selected block t: the last one starting at or before t
#pragma unroll
            for (int step = 16; step > 0; step >>= 1) {
                if (__shfl_sync(0xffffffffu, bits_excl, owner + step) <= t) owner += step;
            }
            const plan_u32 o_any = __shfl_sync(0xffffffffu, any, owner);
            const plan_u32 o_a = __shfl_sync(0xffffffffu, a, owner);
            const plan_u32 o_b = __shfl_sync(0xffffffffu, b, owner);
            const int o_first = __shfl_sync(0xffffffffu, bits_excl, owner);
#if !PLAN_WRITE_STAGED
            plan_u32 o_word[PLAN_SLOTS], mbits[PLAN_SLOTS];
#pragma unroll
            for (int m = 0; m < PLAN_SLOTS; ++m) {
                o_word[m] = mode == PLAN_MODE_INTERLEAVED ? __shfl_sync(0xffffffffu, word[m], owner) : 0u;
                mbits[m] = member_bits(m);
            }
#endif
            const bool valid = t < bits_total && lane < group;
            int j = 0, cat = 1, pages = 0, full = 0;
            plan_u32 vis = 0;  // the owned slots that see block j (INTERLEAVED work lists carry them)
            if (valid) {
                const int pos = __fns(o_any, 0, t - o_first + 1);
                const plan_u32 bit = 1u << pos;
                j = (w0 + owner) * 32 + pos;
                cat = !halves ? 1 : ((o_a & bit) ? ((o_b & bit) ? 1 : 0) : 2);
                pages = t_first[j + 1] - t_first[j];
                full = t_nfull[j];
#if !PLAN_WRITE_STAGED
#pragma unroll
                for (int m = 0; m < PLAN_SLOTS; ++m) vis |= (o_word[m] & bit) ? mbits[m] : 0u;
#endif
            }
#if PLAN_WRITE_STAGED
            // read again from the bitmap (L1) rather than kept in registers through the group
            if (mode == PLAN_MODE_INTERLEAVED) {
#pragma unroll
                for (int m = 0; m < PLAN_SLOTS; ++m) {
                    const long long r = member_row(m);
                    const plan_u32 mb = member_bits(m);
                    if (valid && m < members && plan_bit(bitmap + r * words, j)) vis |= mb;
                }
            }
#endif
#if PLAN_WRITE_STAGED
            // The item's stream is a sequence of class runs: PLAIN one (all pages), FULL_FIRST two (full, then
            // partial), HALVES and INTERLEAVED three (A only, both, B only); this group's pages in each run
            // follow the earlier groups'. The lanes place the group's pages in the warp's stage in stream
            // order (a page's place: its run's start in the group, the pages of lower lanes in that run, its
            // rank in its block), then store 32 consecutive entries at a time. A group of more than
            // stage_cap pages (a block larger than the stage) goes through in windows of that many.
            const bool ff = mode == PLAN_MODE_FULL_FIRST;
            const int nA = !halves ? (ff ? full : pages) : (cat == 0 ? pages : 0);
            const int nB = !halves ? (ff ? pages - full : 0) : (cat == 1 ? pages : 0);
            const int nC = halves && cat == 2 ? pages : 0;
            // the three runs' prefixes over the lanes: one scan of the counts packed in 10-bit fields (a group of
            // several blocks holds at most stage_cap <= PLAN_STAGE_FIELD pages), none for a group of one block
            int iA = nA, iB = nB, iC = nC;
            if (group > 1) {
                const int incl = plan_warp_incl(nA | (nB << 10) | (nC << 20), lane);
                iA = incl & PLAN_STAGE_FIELD;
                iB = (incl >> 10) & PLAN_STAGE_FIELD;
                iC = incl >> 20;
            }
            const int last = group > 1 ? 31 : 0;
            const int tA = __shfl_sync(0xffffffffu, iA, last), tB = __shfl_sync(0xffffffffu, iB, last);
            const int tC = __shfl_sync(0xffffffffu, iC, last);
            const int group_total = tA + tB + tC;
            for (int win = 0; win < group_total; win += stage_cap) {
                if (valid) {
                    int qa = iA - nA - win, qb = tA + iB - nB - win, qc = tA + tB + iC - nC - win;
                    for (int e = t_first[j]; e < t_first[j + 1]; ++e) {
                        const int page = t_pages[e];
                        int q;
                        if (ff) q = t_mask[page] == PLAN_FULL_PAGE ? qa++ : qb++;
                        else if (!halves || cat == 0) q = qa++;
                        else q = cat == 1 ? qb++ : qc++;
                        if (q >= 0 && q < stage_cap) {
                            stage[q] = static_cast<plan_u32>(page) | (static_cast<plan_u32>(lane) << PLAN_STAGE_LANE_SHIFT);
                        }
                    }
                }
                __syncwarp();
                const int in_window = min(group_total - win, stage_cap);
                for (int k0 = 0; k0 < in_window; k0 += 32) {
                    const int q = win + k0 + lane;  // the entry's place in the group
                    const plan_u32 v = k0 + lane < in_window ? stage[k0 + lane] : 0u;
                    const plan_u32 ovis = __shfl_sync(0xffffffffu, vis, static_cast<int>(v >> PLAN_STAGE_LANE_SHIFT));
                    if (k0 + lane >= in_window) continue;
                    const int page = static_cast<int>(v & PLAN_STAGE_PAGE_MASK);
                    const int r = q < tA ? 0 : (q < tA + tB ? 1 : 2);  // its run
                    const int idx = r == 0 ? run_done[0] + q : (r == 1 ? run_done[1] + q - tA : run_done[2] + q - tA - tB);
                    int at;
                    if (!halves) {
                        at = r == 0 ? idx : totals.y + idx;  // FULL_FIRST's partial pages after its full ones
                    } else if (mode == PLAN_MODE_HALVES) {
                        at = r == 0 ? idx : (r == 1 ? na + idx : na + ns + idx);
                    } else {
                        at = plan_interleaved(r, idx, na, ns, runs, chunk_pages);
                    }
                    if (at >= len) continue;  // past the capacity (counted above)
                    const plan_u32 mask = out_format == PLAN_OUT_WORK_LIST ? t_mask[page] : PLAN_FULL_PAGE;
                    plan_store(out_format, first + at, page, mask, ovis, halves ? r : 1, stream_entries, stream_pages,
                               pair_pages);
                }
                __syncwarp();
            }
            run_done[0] += tA;
            run_done[1] += tB;
            run_done[2] += tC;
#else
            // this block's pages by class: 0 A only (all, when not halves), 1 both, 2 B only, 3 full, 4 partial
            int n[5];
            n[0] = !halves ? pages : (cat == 0 ? pages : 0);
            n[1] = halves && cat == 1 ? pages : 0;
            n[2] = halves && cat == 2 ? pages : 0;
            n[3] = !halves ? full : 0;
            n[4] = !halves ? pages - full : 0;
            if (per_block_writes) {
                // each lane writes its own block's pages (positions 32 lanes apart: one sector per store)
                int before[5];
#pragma unroll
                for (int c = 0; c < 5; ++c) {
                    const int incl = plan_warp_incl(n[c], lane);
                    before[c] = carry[c] + incl - n[c];
                    carry[c] += __shfl_sync(0xffffffffu, incl, 31);
                }
                if (!valid) continue;
                for (int e = t_first[j]; e < t_first[j + 1]; ++e) {
                    const int page = t_pages[e];
                    const plan_u32 mask = t_mask[page];
                    int at;
                    if (mode == PLAN_MODE_PLAIN) {
                        at = before[0]++;
                    } else if (mode == PLAN_MODE_FULL_FIRST) {
                        at = mask == PLAN_FULL_PAGE ? before[3]++ : totals.y + before[4]++;
                    } else if (mode == PLAN_MODE_HALVES) {
                        at = cat == 0 ? before[0]++ : (cat == 1 ? na + before[1]++ : na + ns + before[2]++);
                    } else {
                        const int r = cat == 0 ? before[0]++ : (cat == 1 ? before[1]++ : before[2]++);
                        at = plan_interleaved(cat, r, na, ns, runs, chunk_pages);
                    }
                    if (at >= len) continue;  // past the capacity (counted above)
                    plan_store(out_format, first + at, page, mask, vis, cat, stream_entries, stream_pages, pair_pages);
                }
            } else {
                // Coalesced: class by class, the lanes take consecutive entries of the class's run for this
                // group (entry k belongs to the lane whose block holds it: a search over the class's prefix).
                int excl[5], total[5], base[5];
#pragma unroll
                for (int c = 0; c < 5; ++c) {
                    const int incl = plan_warp_incl(n[c], lane);
                    excl[c] = incl - n[c];
                    total[c] = __shfl_sync(0xffffffffu, incl, 31);
                    base[c] = carry[c];
                    carry[c] += total[c];
                }
#pragma unroll
                for (int c = 0; c < 5; ++c) {
                    const bool used =
                        mode == PLAN_MODE_PLAIN ? c == 0 : (mode == PLAN_MODE_FULL_FIRST ? c >= 3 : c <= 2);
                    if (!used) continue;
                    for (int k0 = 0; k0 < total[c]; k0 += 32) {
                        const int k = k0 + lane;
                        int o = 0;  // the last lane whose run of this class starts at or before k
#pragma unroll
                        for (int step = 16; step > 0; step >>= 1) {
                            if (__shfl_sync(0xffffffffu, excl[c], o + step) <= k) o += step;
                        }
                        const int oj = __shfl_sync(0xffffffffu, j, o);
                        const int ocat = __shfl_sync(0xffffffffu, cat, o);
                        const plan_u32 ovis = __shfl_sync(0xffffffffu, vis, o);
                        const int r = k - __shfl_sync(0xffffffffu, excl[c], o);
                        if (k >= total[c]) continue;
                        const int e0 = t_first[oj], e1 = t_first[oj + 1];
                        int e = e0 + r;
                        if (c >= 3) {  // the r-th full (3) or partial (4) page of the block, in table order
                            int seen = 0;
                            for (e = e0; e < e1; ++e) {
                                if ((t_mask[t_pages[e]] == PLAN_FULL_PAGE) == (c == 3) && seen++ == r) break;
                            }
                        }
                        if (e >= e1) continue;  // a table that disagrees with its counts: nothing written
                        const int page = t_pages[e];
                        const plan_u32 mask = t_mask[page];
                        const int idx = base[c] + k;
                        int at;
                        if (mode == PLAN_MODE_PLAIN) {
                            at = idx;
                        } else if (mode == PLAN_MODE_FULL_FIRST) {
                            at = c == 3 ? idx : totals.y + idx;
                        } else if (mode == PLAN_MODE_HALVES) {
                            at = c == 0 ? idx : (c == 1 ? na + idx : na + ns + idx);
                        } else {
                            at = plan_interleaved(c, idx, na, ns, runs, chunk_pages);
                        }
                        if (at >= len) continue;  // past the capacity (counted above)
                        plan_store(out_format, first + at, page, mask, ovis, ocat, stream_entries, stream_pages,
                                   pair_pages);
                    }
                }
            }
#endif
        }
    }
    // the item's own outputs, at its position
    const int own = lane < PLAN_SLOTS ? own_of[at8 + lane] : -1;
    if (out_format == PLAN_OUT_WORK_LIST) {
        if (lane < PLAN_SLOTS) {
            own_entries[pos * PLAN_SLOTS + lane] = make_int2(own, own >= 0 ? static_cast<int>(o_mask[own]) : 0);
        }
        if (lane == 0) work_info[pos] = make_int4(bh, static_cast<int>(first), len, info.y);
    } else {
        if (lane < PLAN_SLOTS) own_pages[pos * PLAN_SLOTS + lane] = own;
        if (lane == 0) work_head[pos] = bh;
    }
}

// Stream tables of at most this many bytes are staged in shared memory.
#define PLAN_SMEM_TABLES_MAX (96 * 1024)
// Blocks of plan_items the launch puts on each SM (its register budget: 65536 / (256 * blocks)).
#ifndef PLAN_ITEMS_MIN_BLOCKS
#define PLAN_ITEMS_MIN_BLOCKS 4
#endif

// dst[0, n) = src[0, n) by the block's threads, four loads in flight per thread (one at a time, each store
// waited for its load: a tenth of a write pass's time went there, NOTES_device_planner v16).
template <typename T>
__device__ __forceinline__ void plan_copy_to_shared(T* dst, const T* __restrict__ src, int n) {
    const int step = blockDim.x;
    int i = threadIdx.x;
    for (; i + 3 * step < n; i += 4 * step) {
        const T a = src[i], b = src[i + step], c = src[i + 2 * step], d = src[i + 3 * step];
        dst[i] = a;
        dst[i + step] = b;
        dst[i + 2 * step] = c;
        dst[i + 3 * step] = d;
    }
    for (; i < n; i += step) dst[i] = src[i];
}

// The item passes' arguments (plan_items and plan_items_fused take the same).
#define PLAN_ITEMS_PARAMS                                                                                          \
    const plan_u32 *__restrict__ bitmap, int row_blocks, int words, int heads, int items,                          \
        const int4 *__restrict__ it_info, const int *__restrict__ it_members, const int *__restrict__ it_bits,     \
        const int *__restrict__ it_own, const int *__restrict__ t_first, const int *__restrict__ t_pages,          \
        const int *__restrict__ t_nfull, const unsigned short *__restrict__ t_mask,                                \
        const unsigned short *__restrict__ o_mask, int chunk_pages, int write, int out_format,                     \
        int4 *__restrict__ cnt, const int *__restrict__ base, const int *__restrict__ perm, long long cap,         \
        int4 *__restrict__ work_info, int2 *__restrict__ own_entries, int2 *__restrict__ stream_entries,           \
        int *__restrict__ work_head, int *__restrict__ own_pages, int *__restrict__ stream_pages,                  \
        int *__restrict__ pair_pages, int *__restrict__ overflow, int stream_blocks, int stream_list,              \
        int stream_page_count, int smem_tables, int matched, const int4 *__restrict__ m_info,                      \
        const int *__restrict__ m_members, const int *__restrict__ m_bits, const int *__restrict__ m_own,          \
        int *__restrict__ void_counts, int stage_blocks, int stage_cap

// Every (head, item): one warp per item. With smem_tables the streamed side's tables (t_first, t_nfull,
// t_pages, t_mask: stream_blocks blocks, stream_list listed pages, stream_pages pages) are read from shared
// memory, loaded once per block. FUSED: positions claimed in order from *claim (zeroed before), each
// counted and written in one call (plan_item<true>); otherwise the warps stride over the positions.
template <bool FUSED>
__device__ __forceinline__ void plan_items_body(PLAN_ITEMS_PARAMS, plan_u64* __restrict__ lookback,
                                                const long long* __restrict__ slices, int* __restrict__ claim,
                                                int* __restrict__ begin_out) {
    extern __shared__ __align__(16) int plan_tables[];
    const int* first = t_first;
    const int* full = t_nfull;
    const int* listed = t_pages;
    const unsigned short* masks = t_mask;
    if (smem_tables) {
        int* s_first = plan_tables;
        int* s_full = s_first + stream_blocks + 1;
        int* s_listed = s_full + stream_blocks;
        unsigned short* s_masks = reinterpret_cast<unsigned short*>(s_listed + stream_list);
        plan_copy_to_shared(s_first, t_first, stream_blocks + 1);
        plan_copy_to_shared(s_full, t_nfull, stream_blocks);
        plan_copy_to_shared(s_listed, t_pages, stream_list);
        plan_copy_to_shared(s_masks, t_mask, stream_page_count);
        __syncthreads();
        first = s_first;
        full = s_full;
        listed = s_listed;
        masks = s_masks;
    }
    // staged write pass: each warp's stage after the tables (16-byte aligned)
    plan_u32* stage = nullptr;
    if (PLAN_WRITE_STAGED && write) {
        stage_cap = max(stage_cap, 1);
        const int table_ints = smem_tables ? 2 * stream_blocks + 1 + stream_list + (stream_page_count + 1) / 2 : 0;
        stage = reinterpret_cast<plan_u32*>(plan_tables + ((table_ints + 3) & ~3)) + (threadIdx.x >> 5) * static_cast<long long>(stage_cap);
    }
    const int lane = threadIdx.x & 31;
    const long long total = static_cast<long long>(heads) * items;
    const long long warps = (static_cast<long long>(gridDim.x) * blockDim.x) >> 5;
    auto next = [&](long long pos) -> long long {
        if (!FUSED) return pos + warps;
        int p = 0;
        if (lane == 0) p = atomicAdd(claim, 1);
        return __shfl_sync(0xffffffffu, p, 0);
    };
    for (long long pos = FUSED ? next(0) : (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
         pos < total; pos = next(pos)) {
        plan_item<FUSED>(pos, lane, bitmap, row_blocks, words, items, it_info, it_members, it_bits, it_own,
                         matched, m_info, m_members, m_bits, m_own, first, listed, full, masks, o_mask, chunk_pages,
                         write, out_format, cnt, base, perm, cap, work_info, own_entries, stream_entries, work_head,
                         own_pages, stream_pages, pair_pages, overflow, void_counts, stage, stage_blocks, stage_cap,
                         lookback, slices, begin_out, total);
    }
}

#define PLAN_ITEMS_ARGS                                                                                             \
    bitmap, row_blocks, words, heads, items, it_info, it_members, it_bits, it_own, t_first, t_pages, t_nfull,      \
        t_mask, o_mask, chunk_pages, write, out_format, cnt, base, perm, cap, work_info, own_entries,              \
        stream_entries, work_head, own_pages, stream_pages, pair_pages, overflow, stream_blocks, stream_list,       \
        stream_page_count, smem_tables, matched, m_info, m_members, m_bits, m_own, void_counts, stage_blocks,      \
        stage_cap

// The count pass (write == 0) or the write pass (write == 1).
extern "C" __global__ void __launch_bounds__(256, PLAN_ITEMS_MIN_BLOCKS) plan_items(PLAN_ITEMS_PARAMS) {
    plan_items_body<false>(PLAN_ITEMS_ARGS, nullptr, nullptr, nullptr, nullptr);
}

// The forward work list's count, offsets (in place of plan_scan: begin_out [heads * items + 1]) and write
// in one pass (write == 1, perm null); lookback int64 [heads * items] and *claim zeroed before.
// slices (null: the offsets by look-back, the streams back to back): int64 [items + 1], each template
// item's slice of a head's part of the buffer (a head's part: slices[items] entries), layout-fixed bounds;
// each item writes at its slice's start, so no item waits for another's count (the streams then have gaps).
extern "C" __global__ void __launch_bounds__(256, PLAN_ITEMS_MIN_BLOCKS)
    plan_items_fused(PLAN_ITEMS_PARAMS, plan_u64* __restrict__ lookback, int* __restrict__ claim,
                     int* __restrict__ begin_out, const long long* __restrict__ slices) {
    plan_items_body<true>(PLAN_ITEMS_ARGS, lookback, slices, claim, begin_out);
}

// ---- the forward's matched pairs ---------------------------------------------------------------------

// keys[bh, e] of every candidate edge e = (slot a, slot b), a < b, of every head (as layout_pairs.edge_keys):
// min(shared, 4095) << 52 | tie << 40 | (0xFFFFF - a) << 20 | (0xFFFFF - b), shared = the K blocks both
// blocks select (popcount of their rows' AND), tie = a 12-bit hash of (a, b) that breaks equal weights
// (without it, equal weights along a row of blocks chain the matching's rounds); 0 when they share none.
extern "C" __global__ void plan_pair_weights(const plan_u32* __restrict__ bitmap, int row_blocks, int words,
                                             int heads, const int2* __restrict__ edges, int n_edges,
                                             const int* __restrict__ slot_block, plan_u64* __restrict__ keys) {
    const long long t = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (t >= static_cast<long long>(heads) * n_edges) return;
    const int bh = static_cast<int>(t / n_edges);
    const int2 e = edges[t - static_cast<long long>(bh) * n_edges];
    const plan_u32* ra = bitmap + (static_cast<long long>(bh) * row_blocks + slot_block[e.x]) * words;
    const plan_u32* rb = bitmap + (static_cast<long long>(bh) * row_blocks + slot_block[e.y]) * words;
    int shared = 0;
    for (int w = 0; w < words; ++w) shared += __popc(ra[w] & rb[w]);
    const plan_u32 tie = (((static_cast<plan_u32>(e.x) * 0x9E3779B1u) ^ (static_cast<plan_u32>(e.y) * 0x85EBCA77u)) >> 20) &
                         0xFFFu;
    keys[t] = shared ? (static_cast<plan_u64>(min(shared, 4095)) << 52) | (static_cast<plan_u64>(tie) << 40) |
                           (static_cast<plan_u64>(0xFFFFF - e.x) << 20) | static_cast<plan_u64>(0xFFFFF - e.y)
                     : 0ull;
}

// One block per head: the greedy matching of its slots by key (in rounds: an edge joins when it is the
// largest key at both its free ends, which gives the sequential greedy's matching), the slots left two
// by two in order, then each slot's item: the pair of its block and its partner's (the lower slot), nothing
// (the higher) or its block alone. slot_own: [slots][8] the blocks' owned pages (4 live pages).
// SMEM: the head's keys and edges (edge ends as 16-bit slots), partners and best keys in shared memory
// (plan_pair_match_smem, where they fit: kernels/planner.py's pair_match_smem_bytes); otherwise partner
// and best live in global memory (any number of slots), read past L1 (__ldcg), and the atomics update them
// in L2. The two forms run the same rounds on the same keys: the same matching.

template <bool SMEM>
__device__ __forceinline__ void plan_pair_match_body(
    const plan_u64* __restrict__ keys_g, const int2* __restrict__ edges_g, int n_edges, int slots,
    const int* __restrict__ slot_block, const int* __restrict__ slot_own, int* partner, plan_u64* best,
    int4* __restrict__ m_info, int* __restrict__ m_members, int* __restrict__ m_bits, int* __restrict__ m_own,
    int* __restrict__ partner_out) {
    extern __shared__ __align__(16) unsigned char plan_match_smem[];
    __shared__ int any;
    const long long bh = blockIdx.x;
    keys_g += bh * n_edges;
    const plan_u64* keys = keys_g;
    const plan_u32* ends = nullptr;  // SMEM: edge e's slots, a | b << 16
    if constexpr (SMEM) {
        plan_u64* k_s = reinterpret_cast<plan_u64*>(plan_match_smem);
        best = k_s + n_edges;
        plan_u32* e_s = reinterpret_cast<plan_u32*>(best + slots);
        partner = reinterpret_cast<int*>(e_s + n_edges);
        for (int e = threadIdx.x; e < n_edges; e += blockDim.x) {
            k_s[e] = keys_g[e];
            const int2 ed = edges_g[e];
            e_s[e] = static_cast<plan_u32>(ed.x) | (static_cast<plan_u32>(ed.y) << 16);
        }
        keys = k_s;
        ends = e_s;
    } else {
        partner += bh * slots;
        best += bh * slots;
    }
    auto ld_partner = [&](int i) { return SMEM ? partner[i] : __ldcg(partner + i); };
    auto ld_best = [&](int i) { return SMEM ? best[i] : __ldcg(best + i); };
    auto edge = [&](int e) {
        if constexpr (SMEM) {
            const plan_u32 v = ends[e];
            return make_int2(static_cast<int>(v & 0xFFFFu), static_cast<int>(v >> 16));
        } else {
            return edges_g[e];
        }
    };
    for (int s = threadIdx.x; s < slots; s += blockDim.x) partner[s] = -1;
    __syncthreads();
    while (true) {
        for (int s = threadIdx.x; s < slots; s += blockDim.x) {
            if (ld_partner(s) < 0) best[s] = 0ull;
        }
        if (threadIdx.x == 0) any = 0;
        __syncthreads();
        for (int e = threadIdx.x; e < n_edges; e += blockDim.x) {
            const plan_u64 key = keys[e];
            const int2 ed = edge(e);
            if (key && ld_partner(ed.x) < 0 && ld_partner(ed.y) < 0) {
                atomicMax(best + ed.x, key);
                atomicMax(best + ed.y, key);
                any = 1;
            }
        }
        __syncthreads();
        if (!any) break;
        for (int e = threadIdx.x; e < n_edges; e += blockDim.x) {
            const plan_u64 key = keys[e];
            const int2 ed = edge(e);
            // the edge is the largest at both ends: no other edge touching them joins in this round. (A slot
            // matched in an earlier round keeps its edge's key as its best, so only that edge passes there, and
            // writes the same partners again; no partner is read in this loop, which other threads write.)
            if (key && ld_best(ed.x) == key && ld_best(ed.y) == key) {
                partner[ed.x] = ed.y;
                partner[ed.y] = ed.x;
            }
        }
        __syncthreads();
    }
    // The slots left, two by two in slot order: the r-th unmatched slot (a block-wide scan of the
    // unmatched flags, 1024 slots a step) pairs with the (r + 1)-th for every even r. `best` is free
    // now: it holds the unmatched slots in order (order[r] = slot).
    int* order = reinterpret_cast<int*>(best);
    __shared__ int warp_sums[32];
    __shared__ int unmatched;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    if (threadIdx.x == 0) unmatched = 0;
    __syncthreads();
    for (int s0 = 0; s0 < slots; s0 += blockDim.x) {
        const int s = s0 + threadIdx.x;
        const int left = (s < slots && ld_partner(s) < 0) ? 1 : 0;
        const int incl = plan_warp_incl(left, lane);
        if (lane == 31) warp_sums[warp] = incl;
        __syncthreads();
        if (warp == 0) {
            const int v = lane < nwarps ? warp_sums[lane] : 0;
            const int w_incl = plan_warp_incl(v, lane);
            if (lane < nwarps) warp_sums[lane] = w_incl;
        }
        __syncthreads();
        const int rank = unmatched + (warp > 0 ? warp_sums[warp - 1] : 0) + incl - left;
        if (left) order[rank] = s;
        __syncthreads();  // every thread has read `unmatched` and the warp sums
        if (threadIdx.x == 0) unmatched += warp_sums[nwarps - 1];
        __syncthreads();
    }
    for (int r = 2 * threadIdx.x; r + 1 < unmatched; r += 2 * blockDim.x) {
        const int a = SMEM ? order[r] : __ldcg(order + r), b = SMEM ? order[r + 1] : __ldcg(order + r + 1);
        partner[a] = b;
        partner[b] = a;
    }
    __syncthreads();
    for (int s = threadIdx.x; s < slots; s += blockDim.x) {
        const int p = ld_partner(s);
        const long long at = bh * slots + s;
        if constexpr (SMEM) partner_out[at] = p;  // the global form's partner array, for the tests
        int4 info;
        int members[PLAN_SLOTS], bits[PLAN_SLOTS], own[PLAN_SLOTS];
#pragma unroll
        for (int i = 0; i < PLAN_SLOTS; ++i) {
            members[i] = -1;
            bits[i] = 0;
            own[i] = -1;
        }
        if (p > s) {  // the pair: this block's pages own rows 0-63, the partner's rows 64-127
            info = make_int4(PLAN_MODE_INTERLEAVED, 128, 2, 0);
            members[0] = slot_block[s];
            members[1] = slot_block[p];
            bits[0] = PLAN_HALF0;
            bits[1] = PLAN_HALF1;
#pragma unroll
            for (int i = 0; i < PLAN_SLOTS / 2; ++i) {
                own[i] = slot_own[s * PLAN_SLOTS + i];
                own[PLAN_SLOTS / 2 + i] = slot_own[p * PLAN_SLOTS + i];
            }
        } else if (p >= 0) {  // the partner's item holds this block
            info = make_int4(PLAN_MODE_PLAIN, 64, 0, 0);
        } else {  // alone: the block's own 64-row item
            info = make_int4(PLAN_MODE_FULL_FIRST, 64, 1, 0);
            members[0] = slot_block[s];
            bits[0] = 0xFF;
#pragma unroll
            for (int i = 0; i < PLAN_SLOTS; ++i) own[i] = slot_own[s * PLAN_SLOTS + i];
        }
        m_info[at] = info;
#pragma unroll
        for (int i = 0; i < PLAN_SLOTS; ++i) {
            m_members[at * PLAN_SLOTS + i] = members[i];
            m_bits[at * PLAN_SLOTS + i] = bits[i];
            m_own[at * PLAN_SLOTS + i] = own[i];
        }
    }
}

extern "C" __global__ void __launch_bounds__(1024) plan_pair_match(
    const plan_u64* __restrict__ keys, const int2* __restrict__ edges, int n_edges, int slots,
    const int* __restrict__ slot_block, const int* __restrict__ slot_own, int* __restrict__ partner,
    plan_u64* __restrict__ best, int4* __restrict__ m_info, int* __restrict__ m_members, int* __restrict__ m_bits,
    int* __restrict__ m_own) {
    plan_pair_match_body<false>(keys, edges, n_edges, slots, slot_block, slot_own, partner, best, m_info, m_members,
                                m_bits, m_own, nullptr);
}

// The same, everything of the head in shared memory (12 bytes per edge and per slot of dynamic shared memory;
// slots < 65,536): the rounds' loads and atomics stay on the SM instead of going to L2. The partners
// are written to `partner` ([heads, slots]) at the end, as the global form leaves them.
extern "C" __global__ void __launch_bounds__(1024) plan_pair_match_smem(
    const plan_u64* __restrict__ keys, const int2* __restrict__ edges, int n_edges, int slots,
    const int* __restrict__ slot_block, const int* __restrict__ slot_own, int* __restrict__ partner,
    int4* __restrict__ m_info, int* __restrict__ m_members, int* __restrict__ m_bits, int* __restrict__ m_own) {
    plan_pair_match_body<true>(keys, edges, n_edges, slots, slot_block, slot_own, nullptr, nullptr, m_info,
                               m_members, m_bits, m_own, partner);
}

// ---- 3. offsets and order --------------------------------------------------------------------------

// Exclusive scan of the items' stream lengths (cnt[item].x) in position order (item = perm[p], or p):
// out[p] for p in [0, n], each clamped to cap (a stream past the capacity is cut: overflow).
// One block of 1024 threads; warp w owns positions [w * span, (w + 1) * span) and reads them 32 at a
// time, one per lane (coalesced), first to sum them, then, after the block's scan of the warp sums, to
// scan and write them.
__device__ __forceinline__ long long plan_scan_len(const int4* __restrict__ cnt, const int* __restrict__ perm,
                                                  int p, int n) {
    return p < n ? cnt[perm != nullptr ? perm[p] : p].x : 0;
}

extern "C" __global__ void __launch_bounds__(1024) plan_scan(const int4* __restrict__ cnt,
                                                             const int* __restrict__ perm, int n,
                                                             long long cap, int* __restrict__ out,
                                                             int* __restrict__ overflow) {
    __shared__ long long warp_sums[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const int span = ((n + nwarps - 1) / nwarps + 31) & ~31;
    const int lo = min(n, warp * span), hi = min(n, lo + span);
    long long mine = 0;
#pragma unroll 4
    for (int p = lo + lane; p < hi; p += 32) mine += plan_scan_len(cnt, perm, p, hi);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mine += __shfl_xor_sync(0xffffffffu, mine, o);
    if (lane == 0) warp_sums[warp] = mine;
    __syncthreads();
    if (warp == 0) {
        long long s = lane < nwarps ? warp_sums[lane] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const long long x = __shfl_up_sync(0xffffffffu, s, o);
            if (lane >= o) s += x;
        }
        warp_sums[lane] = s;  // inclusive over warps
    }
    __syncthreads();
    long long run = warp > 0 ? warp_sums[warp - 1] : 0;  // before this warp's first position
    for (int p0 = lo; p0 < hi; p0 += 32) {
        const long long v = plan_scan_len(cnt, perm, p0 + lane, hi);
        long long incl = v;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const long long x = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += x;
        }
        if (p0 + lane < hi) out[p0 + lane] = static_cast<int>(min(run + incl - v, cap));
        run += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (threadIdx.x == blockDim.x - 1) {
        const long long total = warp_sums[nwarps - 1];
        out[n] = static_cast<int>(min(total, cap));
        if (total > cap) atomicAdd(overflow, 1);
    }
}

// One block per segment: segs[s] = (src, dst, n, 0). The segment's items are src + l (or
// indirect[src + l]) for l < n; they are sorted by key (PLAN_KEY_LEN: stream length, PLAN_KEY_COST:
// rows M x chunks of chunk_pages, from the count pass's cnt, both largest first), ties in segment order,
// and written to out[dst + r].
// With void_counts (the forward work list: one segment per head, void_counts[s] its void items, marked
// M = -1 by the count pass), the order is global instead: every segment's void items first (segment by
// segment, in segment order), then every segment's live items (segment by segment, sorted); dst is
// ignored, and block 0 writes the number of void items to *first_live, where the kernel's item counter
// starts.
// Dynamic shared memory: 8 * (n rounded up to a power of two) bytes.
extern "C" __global__ void __launch_bounds__(1024) plan_segment_sort(
    const int4* __restrict__ segs, const int4* __restrict__ cnt, const int* __restrict__ indirect, int key_kind,
    int chunk_pages, int* __restrict__ out, const int* __restrict__ void_counts, int* __restrict__ first_live) {
    extern __shared__ plan_u64 keys[];
    __shared__ long long before[2];  // void items before this segment; live items before it
    __shared__ long long all_voids, all_items;
    const int4 seg = segs[blockIdx.x];
    const int n = min(seg.z, PLAN_SORT_MAX);
    constexpr plan_u64 kVoidKey = 0xFFFFFFFEull << 32;  // after every live key (<= 0x7FFFFFFF << 32 | l)
    if (void_counts != nullptr) {
        if (threadIdx.x == 0) {
            before[0] = before[1] = all_voids = all_items = 0;
        }
        __syncthreads();
        long long v_before = 0, l_before = 0, v_all = 0, n_all = 0;
        for (int s = threadIdx.x; s < gridDim.x; s += blockDim.x) {
            const int v = void_counts[s];
            v_all += v;
            n_all += min(segs[s].z, PLAN_SORT_MAX);
            if (s < blockIdx.x) {
                v_before += v;
                l_before += min(segs[s].z, PLAN_SORT_MAX) - v;
            }
        }
        if (v_before) atomicAdd(reinterpret_cast<unsigned long long*>(&before[0]), v_before);
        if (l_before) atomicAdd(reinterpret_cast<unsigned long long*>(&before[1]), l_before);
        if (v_all) atomicAdd(reinterpret_cast<unsigned long long*>(&all_voids), v_all);
        if (n_all) atomicAdd(reinterpret_cast<unsigned long long*>(&all_items), n_all);
    }
    int size = 1;
    while (size < n) size <<= 1;
    for (int l = threadIdx.x; l < size; l += blockDim.x) {
        plan_u64 key = ~0ull;
        if (l < n) {
            const int item = indirect != nullptr ? indirect[seg.x + l] : seg.x + l;
            const int4 c = cnt[item];
            long long metric = c.x;
            if (key_kind == PLAN_KEY_COST) {  // rows M (the count pass's .w) x chunks
                metric = static_cast<long long>(c.w) * ((c.x + chunk_pages - 1) / chunk_pages);
            }
            key = (static_cast<plan_u64>(0x7FFFFFFFll - min(metric, 0x7FFFFFFFll)) << 32) | static_cast<plan_u32>(l);
            if (void_counts != nullptr && c.w < 0) key = kVoidKey | static_cast<plan_u32>(l);
        }
        keys[l] = key;
    }
    __syncthreads();
    for (int k = 2; k <= size; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int t = threadIdx.x; t < size; t += blockDim.x) {
                const int u = t ^ j;
                if (u > t) {
                    const plan_u64 x = keys[t], y = keys[u];
                    if ((x > y) == ((t & k) == 0)) {
                        keys[t] = y;
                        keys[u] = x;
                    }
                }
            }
            __syncthreads();
        }
    }
    if (void_counts == nullptr) {
        for (int r = threadIdx.x; r < n; r += blockDim.x) {
            const int l = static_cast<int>(keys[r] & 0xFFFFFFFFull);
            out[seg.y + r] = indirect != nullptr ? indirect[seg.x + l] : seg.x + l;
        }
        return;
    }
    // live keys sort first within the segment: rank r < live is live item r, the rest void item r - live
    const int live = n - min(max(void_counts[blockIdx.x], 0), n);
    for (int r = threadIdx.x; r < n; r += blockDim.x) {
        const int l = static_cast<int>(keys[r] & 0xFFFFFFFFull);
        const long long at = r < live ? all_voids + before[1] + r : before[0] + (r - live);
        if (at < all_items) out[at] = indirect != nullptr ? indirect[seg.x + l] : seg.x + l;
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) *first_live = static_cast<int>(all_voids);
}

// ---- outputs no item owns ---------------------------------------------------------------------------

// Zero the listed pages of every head: x [heads, pages per head, PAGE_ROWS, d] bf16, one thread per 16
// bytes; page_elems = PAGE_ROWS * d (a multiple of 8).
extern "C" __global__ void plan_zero_pages(unsigned short* __restrict__ x, int heads, long long head_elems,
                                           int page_elems, const int* __restrict__ pages, int n) {
    const long long t = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    const int chunks = page_elems / 8;
    if (t >= static_cast<long long>(heads) * n * chunks) return;
    const int c = static_cast<int>(t % chunks);
    const long long hi = t / chunks;
    const int i = static_cast<int>(hi % n);
    const int h = static_cast<int>(hi / n);
    uint4* dst = reinterpret_cast<uint4*>(x + h * head_elems + static_cast<long long>(pages[i]) * page_elems);
    dst[c] = make_uint4(0u, 0u, 0u, 0u);
}
