// PageWeaver's ID-aware union attention forward on Hopper (sm_90a): FP8 (e4m3) paged K/V, bf16 Q.
//
// A work item is (KV head h, a pack of `pack` consecutive query groups). A group is a CSR slice of query
// ids (ids[offsets[g] .. offsets[g+1]), at most 8 members); nothing is reordered on the host. A grouping
// made on the GPU may hold its group count on the device (group_count; groups past it are empty).
//
// The item runs as one or more tiles. A tile holds groups [lo, hi) of the pack: its rows are (group,
// query head of h, member): row r = 8·vh + m with vh = gi·G + hl holds query head h·G + hl of member m of
// group lo + gi (G = q_heads / kv_heads ≤ 16). 64 rows (8·G·pack ≤ 64: the two consumer warpgroups split
// the keys) or 128 (G > 8, pack 1: they split the rows), the routes of the KPage skeleton (paged_fwd.cu),
// whose consumer loop this kernel runs. Packing fills the tile at small G: with pack = 8 / G, the 64 rows
// hold 8 / G groups that stream the union of their unions once, instead of 8·G live rows each.
//
// The producer warpgroup builds the tile's union itself: it ORs the members' selected pages into one page
// bitset in shared memory, compacts it into an ascending page list, then gives each page a 64-bit member
// mask (bit 8·gi + m: member m of group gi selected it; the page's position in the list is the rank of
// its bit). A union longer than the list (PW_MAX_UNION pages) halves the tile's groups until it fits; one
// group (8 members × 64 pages) always fits. The union's keys — the pages back to back, PAGE keys each —
// stream in chunks of 64 keys: cp.async copies the e4m3 rows into a staging ring (PW_NSTAGE chunks in
// flight, each thread later reads only the bytes it copied itself), and the same thread converts them
// into the 128-byte-swizzled K/V chunk buffers the wgmma consumers read. Per chunk the producer also
// publishes, per 16 keys, the key position of the first key (−1: no key) and the member mask; a consumer
// row keeps key j iff its member's bit is set, j < context and, causal, j ≤ positions[id]: each member
// attends exactly to its own pages although the tile computes the union. Each tile's row map (query id,
// entry, head, member bit per row) is published with its Q tile.
//
// Each query's O row (bf16 [q_heads, num_queries, 128]) and LSE (fp32 [q_heads, num_queries], natural
// log) are written once, by id, by the CTA that owns its group: no partial outputs. A query without a
// valid key gets O = 0, LSE = −inf. Every id, page and row is range-checked before use.
#include "hopper_wgmma.cuh"

// Geometry mirrored in sparseattn/kernels/pageweaver.py.
#define PW_THREADS 384
#define PW_HEAD_DIM 128
#define PW_Q_ROWS 128        // Q tile rows (8 members x up to 16 query heads)
#define PW_CHUNK 64          // keys per chunk
#ifndef PW_NBUF
#define PW_NBUF 4            // bf16 K and V chunk buffers
#endif
#ifndef PW_NSTAGE
#define PW_NSTAGE 3          // e4m3 chunks in flight (staging ring)
#endif
#define PW_MEMBERS 8         // query ids per group
#define PW_MAX_PACK 8        // groups per tile (64 rows / 8 rows at G = 1)
#define PW_MAX_SELECTED 64   // columns of the capture's page table the kernel reads per query
#define PW_MAX_PAGES 8192    // pages per head the union bitsets cover
#define PW_PRODUCER_REGS 72
// Operands are f16 (-DPW_BF16_OPERANDS: the bf16 path, dequantised with the scales, kept for comparison;
// 10-13% slower on the H200). K and V convert from e4m3 to f16 exactly (one cvt per pair, no scale); Q converts in place from bf16 to f16 after a per-row
// power-of-two prescale σ_r, which keeps the row maximum under 2^14, so the conversion is exact. The K
// scale and 1/σ_r then multiply S. The V scale enters P as the ratio to the chunk's largest V scale R,
// and that reference scale rides on the online-softmax rescale of O (O = R · O_acc).
#define PW_CONSUMER_REGS 208

namespace {

constexpr int kProducerThreads = 128;
constexpr int kConsumerWarps = 8;
constexpr int kWords = PW_MAX_PAGES / 32;                // bitset words per member
constexpr int kMaxUnion = PW_MEMBERS * PW_MAX_SELECTED;  // union pages per tile: one group always fits
constexpr int kQBytes = PW_Q_ROWS * PW_HEAD_DIM * 2;
constexpr int kTileBytes = PW_CHUNK * PW_HEAD_DIM * 2;   // one bf16 K or V chunk
constexpr int kStageBytes = PW_CHUNK * PW_HEAD_DIM;      // one e4m3 K or V chunk
constexpr int kSubPages = PW_CHUNK / PAGE_ROWS;          // 16-key parts of a chunk
constexpr uint32_t kAllKeys = (1u << (PW_CHUNK / 4)) - 1u;  // online_softmax's col_bits: every column
constexpr int kSmallBytes =
    8 * (4 * PW_NBUF + 6) + 16 * PW_NBUF * kSubPages + 16 + 2 * 64 * 4 + 32 + 8 * PW_NBUF * kSubPages + 4 * PW_Q_ROWS;
// union list: member masks (u64), row map (int4), page bitset, its word ranks, pages (int)
constexpr int kListBytes = 8 * kMaxUnion + 16 * PW_Q_ROWS + 4 * kWords + 4 * kWords + 4 * kMaxUnion;
#ifdef PW_BF16_OPERANDS
constexpr bool kF16 = false;
#else
constexpr bool kF16 = true;
#endif
constexpr int kScaleBytes = PW_NSTAGE * kProducerThreads * 8;  // (k, v) scale of each thread's staged row
constexpr int kSmemBytes = 1024 + kQBytes + 2 * PW_NBUF * kTileBytes + 2 * PW_NSTAGE * kStageBytes + kScaleBytes +
                           kListBytes + kSmallBytes;
static_assert(kSmemBytes <= 227 * 1024, "over the per-block shared-memory limit");
static_assert(64 * PW_HEAD_DIM * 4 <= kQBytes, "the key-split merge staging must fit the Q buffer");
static_assert(kWords == 2 * kProducerThreads, "the union compaction gives each producer thread two words");
static_assert(PW_Q_ROWS == kProducerThreads, "each producer thread writes one row of the tile's row map");
static_assert(PW_MEMBERS * PW_MAX_PACK <= 64, "member masks are 64-bit");
static_assert(kSubPages == kProducerThreads / 32, "producer warp p publishes the scales of 16-key part p");

// Shared-memory map: [1024-aligned] Q | K ring | V ring | staging | staged scales | union list | small
struct UnionSmem {
    uint32_t q, k, v, stage, scales, bars;
    unsigned char* base;       // generic pointer of `q`
    unsigned long long* umask; // [kMaxUnion] member mask of each union page
    int4* rowinfo;             // [PW_Q_ROWS] the tile's rows: (query id or -1, entry, head in group, member bit)
    uint32_t* bits;            // [kWords] the union's page bitset
    int* wrank;                // [kWords] list position of each bitset word's first page
    int* upage;                // [kMaxUnion] union pages, ascending
    int4* kinfo;               // [PW_NBUF][kSubPages] (first key position or -1, member mask lo, hi, 0)
    volatile int* items;       // [2] item ring
    float* stats;              // [2][64] max and sum of the key-split merge
    int* scan;                 // [4] warp totals of the compaction
    volatile int* ulen;        // union length of the tile whose Q tile is loaded, -1: no more tiles
    volatile int* tile_head;   // its KV head (both guarded by q_full/q_empty)
    float2* kscale;            // [PW_NBUF][kSubPages] (k, v) scale of each 16-key part (f16 path)
    float* qinv;               // [PW_Q_ROWS] 1/σ_r of the converted Q rows (f16 path)

    __device__ __forceinline__ UnionSmem(unsigned char* raw_ptr) {
        const uint32_t raw = paged::smem_u32(raw_ptr);
        q = (raw + 1023u) & ~1023u;
        base = raw_ptr + (q - raw);
        k = q + kQBytes;
        v = k + PW_NBUF * kTileBytes;
        stage = v + PW_NBUF * kTileBytes;
        scales = stage + 2 * PW_NSTAGE * kStageBytes;
        unsigned char* list = base + (scales + kScaleBytes - q);
        umask = reinterpret_cast<unsigned long long*>(list);
        rowinfo = reinterpret_cast<int4*>(umask + kMaxUnion);
        bits = reinterpret_cast<uint32_t*>(rowinfo + PW_Q_ROWS);
        wrank = reinterpret_cast<int*>(bits + kWords);
        upage = wrank + kWords;
        bars = scales + kScaleBytes + kListBytes;
        unsigned char* small = base + (bars - q);
        kinfo = reinterpret_cast<int4*>(small + 8 * (4 * PW_NBUF + 6));
        items = reinterpret_cast<volatile int*>(kinfo + PW_NBUF * kSubPages);
        stats = reinterpret_cast<float*>(small + 8 * (4 * PW_NBUF + 6) + 16 * PW_NBUF * kSubPages + 16);
        scan = reinterpret_cast<int*>(stats + 2 * 64);
        ulen = scan + 4;
        tile_head = scan + 5;
        kscale = reinterpret_cast<float2*>(small + 8 * (4 * PW_NBUF + 6) + 16 * PW_NBUF * kSubPages + 16 + 2 * 64 * 4 + 32);
        qinv = reinterpret_cast<float*>(kscale + PW_NBUF * kSubPages);
    }
    __device__ __forceinline__ uint32_t k_full(int i) const { return bars + 8 * i; }
    __device__ __forceinline__ uint32_t k_empty(int i) const { return bars + 8 * (PW_NBUF + i); }
    __device__ __forceinline__ uint32_t v_full(int i) const { return bars + 8 * (2 * PW_NBUF + i); }
    __device__ __forceinline__ uint32_t v_empty(int i) const { return bars + 8 * (3 * PW_NBUF + i); }
    __device__ __forceinline__ uint32_t q_full() const { return bars + 8 * (4 * PW_NBUF); }
    __device__ __forceinline__ uint32_t q_empty() const { return bars + 8 * (4 * PW_NBUF + 1); }
    __device__ __forceinline__ uint32_t item_full(int i) const { return bars + 8 * (4 * PW_NBUF + 2 + i); }
    __device__ __forceinline__ uint32_t item_empty(int i) const { return bars + 8 * (4 * PW_NBUF + 4 + i); }
    __device__ __forceinline__ uint32_t stage_k(int s) const { return stage + s * 2 * kStageBytes; }
    __device__ __forceinline__ uint32_t stage_v(int s) const { return stage + s * 2 * kStageBytes + kStageBytes; }
    __device__ __forceinline__ uint32_t stage_scale(int s, int t) const { return scales + (s * kProducerThreads + t) * 8; }
};

// Group `grp`'s members: ids[first .. first + size) (groups past `live` are empty; clamped to the ids).
__device__ __forceinline__ void group_span(int grp, int live, const int* __restrict__ offsets, int num_ids,
                                           int& first, int& size) {
    int a = 0, b = 0;
    if (grp < live) {
        a = offsets[grp];
        b = offsets[grp + 1];
    }
    first = min(max(a, 0), num_ids);
    size = min(max(b - first, 0), min(PW_MEMBERS, num_ids - first));
}

// The 16-key part `sub` of chunk c: (position of its first key or -1, member mask, page).
struct SubPage {
    int base;
    unsigned long long mask;
    int page;
};

__device__ __forceinline__ SubPage sub_page(const UnionSmem& sm, int union_len, int c, int sub, int log2_page) {
    const int u0 = c * PW_CHUNK + sub * PAGE_ROWS;
    const int e = u0 >> log2_page;
    SubPage sp{-1, 0ull, 0};
    if (e < union_len) {
        sp.page = sm.upage[e];
        sp.mask = sm.umask[e];
        sp.base = (sp.page << log2_page) + (u0 & ((1 << log2_page) - 1));
    }
    return sp;
}

// Keys the two rows of a consumer thread may not see (bit 2j / 2j + 1 of c0, c1: its columns of 8-key
// group j, as online_softmax reads col_bits) set to -inf.
template <int KEYS>
__device__ __forceinline__ void mask_rows(float (&s)[KEYS / 2], uint32_t c0, uint32_t c1) {
#pragma unroll
    for (int j = 0; j < KEYS / 8; ++j) {
        if (!((c0 >> (2 * j)) & 1u)) s[4 * j] = -INFINITY;
        if (!((c0 >> (2 * j + 1)) & 1u)) s[4 * j + 1] = -INFINITY;
        if (!((c1 >> (2 * j)) & 1u)) s[4 * j + 2] = -INFINITY;
        if (!((c1 >> (2 * j + 1)) & 1u)) s[4 * j + 3] = -INFINITY;
    }
}

}  // namespace

// The kernel body of both designs. kKvPage = false: the union kernel (pages = the capture's page table,
// O/LSE bf16/fp32 rows by query id). kKvPage = true: the direct KV-page union, one page per group, pack 1
// (pages[group] = its page; ids = the entries' query ids, grouped by page), writing each entry's
// normalised partial O (fp32 [q_heads, num_entries, 128]) and LSE (fp32 [q_heads, num_entries]) at the
// entry's index; pw_lse_merge_kernel merges the partials of a query by LSE.
template <bool kKvPage>
__device__ __forceinline__ void union_attention(
    const __nv_bfloat16* __restrict__ Q, const uint8_t* __restrict__ K, const uint8_t* __restrict__ V,
    const float* __restrict__ k_scale, const float* __restrict__ v_scale, void* __restrict__ O_out,
    float* __restrict__ LSE, const int* __restrict__ ids, const int* __restrict__ offsets,
    const int* __restrict__ group_count, const int* __restrict__ pages, const int* __restrict__ positions,
    int* __restrict__ item_counter, int num_groups, int kv_heads, int gqa, int num_queries, int selected,
    int num_pages, int log2_page, int context, int causal, float scale_log2, int num_entries, int pack) {
    using namespace hopper;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const UnionSmem sm(smem_raw);
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    // groups per tile: 8·G·pack rows must fit the 64-row tile (G > 8: the 128-row tile of one group)
    pack = (kKvPage || gqa > PW_MAX_PACK) ? 1 : min(max(pack, 1), PW_MAX_PACK / gqa);
    const int items_per_head = (num_groups + pack - 1) / pack;
    const int total_items = items_per_head * kv_heads;
    const int kv_rows = num_pages << log2_page;
    const int q_heads = kv_heads * gqa;
    const int rows = PW_MEMBERS * gqa * pack;  // rows a tile may use
    const int num_ids = kKvPage ? num_entries : num_queries;  // length of ids
    const int live = kKvPage || !group_count ? num_groups : min(*group_count, num_groups);  // a device grouping's count

    if (tid == 0) {
        for (int i = 0; i < PW_NBUF; ++i) {
            mbar_init(sm.k_full(i), kProducerThreads);
            mbar_init(sm.v_full(i), kProducerThreads);
            mbar_init(sm.k_empty(i), 32 * kConsumerWarps);  // every lane that read the chunk's kinfo arrives
            mbar_init(sm.v_empty(i), kConsumerWarps);
        }
        mbar_init(sm.q_full(), kProducerThreads);
        mbar_init(sm.q_empty(), 32 * kConsumerWarps);  // every consumer lane, once per tile
        for (int i = 0; i < 2; ++i) {
            mbar_init(sm.item_full(i), 1);
            mbar_init(sm.item_empty(i), kProducerThreads / 32);
        }
    }
    __syncthreads();

    const int role = __shfl_sync(0xffffffffu, tid / 128, 0);
    if (role == 0) {
        // ================================ producer ================================
        regs_release<PW_PRODUCER_REGS>();
        const int pwarp = tid >> 5;
        const int words = min((num_pages + 31) >> 5, kWords);
        const int crow = tid >> 1;  // K/V chunk row this thread copies and dequantises (half `chalf`)
        const int chalf = tid & 1;
        int chunk_count = 0;
        int tiles = 0;

        // entry e of groups [lo, hi) (group gi of the tile, member m, selected column): its page or -1
        auto entry_page = [&](int lo, int e, int& gi, int& m) {
            const int per_group = PW_MEMBERS * selected;
            gi = e / per_group;
            const int r = e - gi * per_group;
            m = r / selected;
            int first, size;
            group_span(lo + gi, live, offsets, num_ids, first, size);
            if (m >= size) return -1;
            const int id = ids[first + m];
            if (static_cast<unsigned>(id) >= static_cast<unsigned>(num_queries)) return -1;
            const int p = pages[static_cast<size_t>(id) * selected + (r - m * selected)];
            return static_cast<unsigned>(p) < static_cast<unsigned>(num_pages) ? p : -1;
        };
        // the union bitset of groups [lo, hi) and each word's list position; returns the union's length
        auto union_bits = [&](int lo, int hi) {
            named_sync(3, kProducerThreads);  // every thread is done with the previous list, bitset and scan
            for (int w = tid; w < words; w += kProducerThreads) sm.bits[w] = 0u;
            named_sync(3, kProducerThreads);
            for (int e = tid; e < (hi - lo) * PW_MEMBERS * selected; e += kProducerThreads) {
                int gi, m;
                const int p = entry_page(lo, e, gi, m);
                if (p >= 0) atomicOr(sm.bits + (p >> 5), 1u << (p & 31));
            }
            named_sync(3, kProducerThreads);
            uint32_t uw[2];
#pragma unroll
            for (int j = 0; j < 2; ++j) uw[j] = 2 * tid + j < words ? sm.bits[2 * tid + j] : 0u;
            const int count = __popc(uw[0]) + __popc(uw[1]);
            int incl = count;
#pragma unroll
            for (int d = 1; d < 32; d <<= 1) {
                const int n = __shfl_up_sync(0xffffffffu, incl, d);
                if (lane >= d) incl += n;
            }
            if (lane == 31) sm.scan[pwarp] = incl;
            named_sync(3, kProducerThreads);
            int at = incl - count;
            for (int w = 0; w < pwarp; ++w) at += sm.scan[w];
            sm.wrank[2 * tid] = at;
            sm.wrank[2 * tid + 1] = at + __popc(uw[0]);
            return sm.scan[0] + sm.scan[1] + sm.scan[2] + sm.scan[3];
        };

        for (int k = 0;; ++k) {
            const int islot = k & 1;
            const uint32_t ipar = (k >> 1) & 1;
            if (tid == 0) {
                const int ticket = atomicAdd(item_counter, 1);
                mbar_wait(sm.item_empty(islot), ipar ^ 1u);
                sm.items[islot] = ticket < total_items ? ticket : -1;
                mbar_arrive(sm.item_full(islot));
            }
            mbar_wait(sm.item_full(islot), ipar);
            const int item = __shfl_sync(0xffffffffu, sm.items[islot], 0);
            __syncwarp();
            if (lane == 0) mbar_arrive(sm.item_empty(islot));
            if (item < 0) break;
            const int head = item / items_per_head;
            const int g0 = (item - head * items_per_head) * pack;
            const int g_end = min(g0 + pack, live);

            for (int lo = g0; lo < g_end; ++tiles) {
                int hi = g_end;
                int union_len;
                if constexpr (kKvPage) {
                    // ---- the group's one page, selected by every member
                    hi = lo + 1;
                    int first, size;
                    group_span(lo, live, offsets, num_ids, first, size);
                    const int p = pages[lo];
                    const bool ok = static_cast<unsigned>(p) < static_cast<unsigned>(num_pages) && size > 0;
                    union_len = ok ? 1 : 0;
                    named_sync(3, kProducerThreads);  // every thread is done with the previous list
                    if (tid == 0) {
                        sm.upage[0] = ok ? p : 0;
                        sm.umask[0] = (1ull << size) - 1ull;
                    }
                    named_sync(3, kProducerThreads);
                } else {
                    // ---- the tile's union: the bitset (halving the groups until it fits the list), the
                    // ascending page list, then each page's member mask by the rank of its bit
                    for (;;) {
                        union_len = union_bits(lo, hi);
                        if (union_len <= kMaxUnion || hi - lo == 1) break;
                        hi = lo + (hi - lo) / 2;
                    }
                    union_len = min(union_len, kMaxUnion);
#pragma unroll
                    for (int j = 0; j < 2; ++j) {
                        const int w = 2 * tid + j;
                        if (w >= words) continue;
                        uint32_t rest = sm.bits[w];
                        int at = sm.wrank[w];
                        while (rest) {
                            const int b = __ffs(rest) - 1;
                            rest &= rest - 1u;
                            if (at < kMaxUnion) {
                                sm.upage[at] = 32 * w + b;
                                sm.umask[at] = 0ull;
                            }
                            ++at;
                        }
                    }
                    named_sync(3, kProducerThreads);
                    for (int e = tid; e < (hi - lo) * PW_MEMBERS * selected; e += kProducerThreads) {
                        int gi, m;
                        const int p = entry_page(lo, e, gi, m);
                        if (p < 0) continue;
                        const int w = p >> 5;
                        const int at = sm.wrank[w] + __popc(sm.bits[w] & ((1u << (p & 31)) - 1u));
                        if (at < kMaxUnion) atomicOr(sm.umask + at, 1ull << (gi * PW_MEMBERS + m));
                    }
                    named_sync(3, kProducerThreads);
                }

                // ---- the tile's row map, then its Q rows by id: thread t copies 16-byte chunk t % 16 of
                // rows t / 16 + 8i
                mbar_wait(sm.q_empty(), (tiles & 1) ^ 1u);
                {
                    const int vh = tid >> 3, m = tid & 7;
                    const int gi = vh / gqa;
                    int id = -1, entry = -1;
                    if (tid < rows && gi < hi - lo) {
                        int first, size;
                        group_span(lo + gi, live, offsets, num_ids, first, size);
                        if (m < size) {
                            entry = first + m;
                            const int qid = ids[entry];
                            if (static_cast<unsigned>(qid) < static_cast<unsigned>(num_queries)) id = qid;
                        }
                    }
                    sm.rowinfo[tid] = make_int4(id, entry, vh - gi * gqa, (gi * PW_MEMBERS + m) & 63);
                }
                if (tid == 0) {
                    *sm.ulen = union_len;
                    *sm.tile_head = head;
                }
                named_sync(3, kProducerThreads);
                {
                    const int ch = tid & 15;
#pragma unroll 4
                    for (int i = 0; i < PW_Q_ROWS / 8; ++i) {
                        const int r = (tid >> 4) + 8 * i;
                        const int4 info = sm.rowinfo[r];
                        const bool valid = info.x >= 0;
                        const __nv_bfloat16* src =
                            valid ? Q + ((static_cast<size_t>(head) * gqa + info.z) * num_queries + info.x) * PW_HEAD_DIM + ch * 8
                                  : Q;
                        paged::cp_async_16_zfill(sm.q + tile_offset<PW_Q_ROWS>(r, ch), src, valid);
                    }
                }
                paged::cp_async_commit();
                mbar_track_cp_async(sm.q_full());
                mbar_arrive(sm.q_full());

                // ---- K/V chunks through the staging ring
                const int chunks = ((union_len << log2_page) + PW_CHUNK - 1) / PW_CHUNK;
                const size_t head_rows = static_cast<size_t>(head) * kv_rows;
                // this thread's key row of chunk c (-1: none) and its page's scale entry
                auto row_of = [&](int c, int& scale_at) {
                    const SubPage sp = sub_page(sm, union_len, c, crow >> 4, log2_page);
                    const int pos = sp.base + (crow & 15);
                    const bool ok = sp.base >= 0 && pos < context && static_cast<unsigned>(sp.page) < static_cast<unsigned>(num_pages);
                    scale_at = head * num_pages + (ok ? sp.page : 0);
                    return ok ? pos : -1;
                };
                // chunk c's e4m3 row half and its two scales into staging slot c % PW_NSTAGE (read back by this
                // thread only, once its own cp.async group has completed)
                auto issue_stage = [&](int c) {
                    int scale_at;
                    const int pos = row_of(c, scale_at);
                    const int s = c % PW_NSTAGE;
#ifndef PW_NO_LOAD
                    const size_t src = (head_rows + static_cast<size_t>(pos < 0 ? 0 : pos)) * PW_HEAD_DIM + chalf * 64;
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const uint32_t off = crow * 128 + ((((chalf << 2) + i) ^ (crow & 7)) << 4);
                        paged::cp_async_16_zfill(sm.stage_k(s) + off, K + src + 16 * i, pos >= 0);
                        paged::cp_async_16_zfill(sm.stage_v(s) + off, V + src + 16 * i, pos >= 0);
                    }
#endif
                    paged::cp_async_4_zfill(sm.stage_scale(s, tid), k_scale + scale_at, pos >= 0);
                    paged::cp_async_4_zfill(sm.stage_scale(s, tid) + 4, v_scale + scale_at, pos >= 0);
                };
                auto dequant = [&](int s, uint32_t staged, uint32_t tile, int which) {
#ifndef PW_NO_DEQUANT
                    float scale;
                    asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(scale) : "r"(sm.stage_scale(s, tid) + 4 * which));
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const uint32_t off = crow * 128 + ((((chalf << 2) + i) ^ (crow & 7)) << 4);
                        uint32_t w[4];
                        asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
                                     : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                                     : "r"(staged + off));
                        uint32_t out[8];
#pragma unroll
                        for (int j = 0; j < 4; ++j) {
                            if constexpr (kF16)
                                e4m3x4_to_f16(out[2 * j], out[2 * j + 1], w[j]);
                            else
                                dequant_e4m3x4(out[2 * j], out[2 * j + 1], w[j], scale);
                        }
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const uint32_t dst = tile + tile_offset<PW_CHUNK>(crow, chalf * 8 + 2 * i + h);
                            asm volatile("st.shared.v4.b32 [%0], {%1,%2,%3,%4};\n" ::"r"(dst), "r"(out[4 * h]),
                                         "r"(out[4 * h + 1]), "r"(out[4 * h + 2]), "r"(out[4 * h + 3])
                                         : "memory");
                        }
                    }
#endif
                };
#pragma unroll 1
                for (int c = 0; c < PW_NSTAGE - 1; ++c) {
                    if (c < chunks) issue_stage(c);
                    paged::cp_async_commit();
                }
#pragma unroll 1
                for (int c = 0; c < chunks; ++c, ++chunk_count) {
                    if (c + PW_NSTAGE - 1 < chunks) issue_stage(c + PW_NSTAGE - 1);
                    paged::cp_async_commit();
                    paged::cp_async_wait<PW_NSTAGE - 1>();  // this thread's copies of chunk c have landed
                    const int buf = chunk_count % PW_NBUF;
                    const uint32_t par = (chunk_count / PW_NBUF) & 1;
                    mbar_wait(sm.k_empty(buf), par ^ 1u);
                    if (tid < kSubPages) {
                        const SubPage sp = sub_page(sm, union_len, c, tid, log2_page);
                        sm.kinfo[buf * kSubPages + tid] = make_int4(sp.base, static_cast<int>(sp.mask & 0xffffffffu),
                                                                    static_cast<int>(sp.mask >> 32), 0);
                    }
                    if (kF16 && (tid & 31) == 0) {  // row 16·pwarp, the first of 16-key part pwarp: its staged scales
                        float2 kv;
                        asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n"
                                     : "=f"(kv.x), "=f"(kv.y)
                                     : "r"(sm.stage_scale(c % PW_NSTAGE, tid)));
                        sm.kscale[buf * kSubPages + pwarp] = kv;
                    }
                    dequant(c % PW_NSTAGE, sm.stage_k(c % PW_NSTAGE), sm.k + buf * kTileBytes, 0);
                    fence_async_proxy();
                    mbar_arrive(sm.k_full(buf));
                    mbar_wait(sm.v_empty(buf), par ^ 1u);
                    dequant(c % PW_NSTAGE, sm.stage_v(c % PW_NSTAGE), sm.v + buf * kTileBytes, 1);
                    fence_async_proxy();
                    mbar_arrive(sm.v_full(buf));
                }
                lo = hi;
            }
        }
        // no more tiles: an empty one with union length -1
        mbar_wait(sm.q_empty(), (tiles & 1) ^ 1u);
        if (tid == 0) *sm.ulen = -1;
        mbar_arrive(sm.q_full());
        paged::cp_async_wait<0>();
    } else {
        // ================================ consumers ================================
        regs_claim<PW_CONSUMER_REGS>();
        const int cw = role - 1;
        const int wtid = (tid - kProducerThreads) & 127;
        const int wq = wtid >> 5;
        const int g = lane >> 2;  // rows 16wq + g and + 8 of this warpgroup's 64
        const int t4 = lane & 3;
        const bool row_split = rows > 64;
        const uint32_t release = row_split ? 1u : 2u;
        const uint32_t aQrows = sm.q + (row_split ? cw * 64 * 128 : 0);
        const int r0 = (row_split ? 64 * cw : 0) + 16 * wq + g;  // this thread's first row of the tile
        int chunk_base = 0;
        for (int t = 0;; ++t) {
            mbar_wait(sm.q_full(), t & 1);
            fence_async_proxy();
            const int union_len = __shfl_sync(0xffffffffu, *sm.ulen, 0);  // published with the Q tile
            if (union_len < 0) break;
            const int head = __shfl_sync(0xffffffffu, *sm.tile_head, 0);
            int4 rmap[2];   // (query id or -1, entry, head in group, member bit) of rows r0 and r0 + 8
            int limit[2];  // the last key position each row's member may see (-1: no member)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                rmap[r] = sm.rowinfo[r0 + 8 * r];
                limit[r] = rmap[r].x >= 0 ? context - 1 : -1;
                if (rmap[r].x >= 0 && causal) limit[r] = min(limit[r], positions[rmap[r].x]);
            }
            float qinv[2] = {1.f, 1.f};  // 1/σ of this thread's rows (f16 path)
            if constexpr (kF16) {
                // This warpgroup converts its share of the Q rows in place: 32 of the shared 64 (key split)
                // or its own 64 (row split); 128/R threads per row, 16/(128/R) chunks each.
                const int wg_rows = row_split ? 64 : 32;
                const int tpr = 128 / wg_rows;
                const int row = (row_split ? 64 * cw : 32 * cw) + wtid / tpr;
                const int per = 16 / tpr;
                const int ch0 = (wtid % tpr) * per;
                float amax = 0.f;
                for (int c = ch0; c < ch0 + per; ++c) {
                    uint32_t w[4];
                    asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
                                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                                 : "r"(sm.q + tile_offset<PW_Q_ROWS>(row, c)));
#pragma unroll
                    for (int j = 0; j < 4; ++j)
                        amax = fmaxf(amax, fmaxf(fabsf(__uint_as_float(w[j] << 16)), fabsf(__uint_as_float(w[j] & 0xffff0000u))));
                }
                for (int d = 1; d < tpr; d <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, d));
                float sigma, inv_sigma;
                f16_prescale(amax, sigma, inv_sigma);
                for (int c = ch0; c < ch0 + per; ++c) {
                    const uint32_t at = sm.q + tile_offset<PW_Q_ROWS>(row, c);
                    uint32_t w[4];
                    asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
                                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                                 : "r"(at));
#pragma unroll
                    for (int j = 0; j < 4; ++j)
                        w[j] = pack_f16x2(__uint_as_float(w[j] << 16) * sigma, __uint_as_float(w[j] & 0xffff0000u) * sigma);
                    asm volatile("st.shared.v4.b32 [%0], {%1,%2,%3,%4};\n" ::"r"(at), "r"(w[0]), "r"(w[1]), "r"(w[2]),
                                 "r"(w[3])
                                 : "memory");
                }
                if (wtid % tpr == 0) sm.qinv[row] = inv_sigma;
                fence_async_proxy();
                if (row_split)
                    named_sync(5 + cw, 128);
                else
                    named_sync(4, 256);
                qinv[0] = sm.qinv[r0];
                qinv[1] = sm.qinv[r0 + 8];
            }
            float v_ref = 0.f;  // the reference V scale R of O's accumulator (f16 path)
            const int chunks = ((union_len << log2_page) + PW_CHUNK - 1) / PW_CHUNK;
            float o[PW_HEAD_DIM / 2];
#pragma unroll
            for (int i = 0; i < PW_HEAD_DIM / 2; ++i) o[i] = 0.f;
            float row_max[2] = {-INFINITY, -INFINITY};
            float row_sum[2] = {0.f, 0.f};
            float alpha[2];
            float s[PW_CHUNK / 2];
            uint32_t pa[kSubPages][4];
            int prev = -1;
            uint32_t prev_par = 0;
#pragma unroll 1
            for (int c = row_split ? 0 : cw; c < chunks; c += row_split ? 1 : 2) {
                const int pos = chunk_base + c;
                const int buf = pos % PW_NBUF;
                const uint32_t par = (pos / PW_NBUF) & 1;
                mbar_wait(sm.k_full(buf), par);
                if (prev >= 0) mbar_wait(sm.v_full(prev), prev_par);
                uint32_t col_bits[2] = {0u, 0u};
                float2 kvs[kSubPages];
#pragma unroll
                for (int p = 0; p < kSubPages; ++p) {
                    if constexpr (kF16) kvs[p] = sm.kscale[buf * kSubPages + p];
                    const int4 info = sm.kinfo[buf * kSubPages + p];
                    if (info.x >= 0) {
                        const int b0 = info.x + 2 * t4;
#pragma unroll
                        for (int r = 0; r < 2; ++r) {
                            const uint32_t word = static_cast<uint32_t>(rmap[r].w < 32 ? info.y : info.z);
                            if ((word >> (rmap[r].w & 31)) & 1u)
                                col_bits[r] |= (static_cast<uint32_t>(b0 <= limit[r]) |
                                                (static_cast<uint32_t>(b0 + 1 <= limit[r]) << 1) |
                                                (static_cast<uint32_t>(b0 + 8 <= limit[r]) << 2) |
                                                (static_cast<uint32_t>(b0 + 9 <= limit[r]) << 3))
                                               << (4 * p);
                        }
                    }
                }
                fence_async_proxy();
                wgmma_fence();
#ifndef PW_NO_MMA
                issue_qk<PW_HEAD_DIM, PW_CHUNK, PW_Q_ROWS, kF16>(s, aQrows, sm.k + buf * kTileBytes);
#endif
                wgmma_commit();
                if (prev >= 0) {
#ifndef PW_NO_MMA
                    issue_pv<PW_HEAD_DIM, PW_CHUNK, kF16>(o, pa, sm.v + prev * kTileBytes);
#endif
                    wgmma_commit();
                    wgmma_wait<1>();
                } else {
                    wgmma_wait<0>();
                }
                pin_registers(s);
                mbar_arrive(sm.k_empty(buf), release);  // each lane has read this chunk's kinfo itself
                float v_ratio[kSubPages];
                if constexpr (kF16) {
#pragma unroll
                    for (int p = 0; p < kSubPages; ++p) {  // S · k_scale(column) / σ(row)
#pragma unroll
                        for (int i = 0; i < 8; ++i) s[8 * p + i] *= kvs[p].x * qinv[(i >> 1) & 1];
                    }
                    float chunk_ref = 0.f;
#pragma unroll
                    for (int p = 0; p < kSubPages; ++p) chunk_ref = fmaxf(chunk_ref, kvs[p].y);
                    const float carry = (v_ref > 0.f && chunk_ref > 0.f) ? v_ref / chunk_ref : 1.f;
#pragma unroll
                    for (int p = 0; p < kSubPages; ++p) v_ratio[p] = chunk_ref > 0.f ? kvs[p].y / chunk_ref : 0.f;
                    if (chunk_ref > 0.f) v_ref = chunk_ref;
                    if ((col_bits[0] & col_bits[1]) != kAllKeys) mask_rows<PW_CHUNK>(s, col_bits[0], col_bits[1]);
                    online_softmax<PW_CHUNK>(s, kAllKeys, scale_log2, row_max, row_sum, alpha);
                    alpha[0] *= carry;
                    alpha[1] *= carry;
#pragma unroll
                    for (int p = 0; p < kSubPages; ++p) {
#pragma unroll
                        for (int i = 0; i < 8; ++i) s[8 * p + i] *= v_ratio[p];
                    }
                } else {
                    if ((col_bits[0] & col_bits[1]) != kAllKeys) mask_rows<PW_CHUNK>(s, col_bits[0], col_bits[1]);
                    online_softmax<PW_CHUNK>(s, kAllKeys, scale_log2, row_max, row_sum, alpha);
                }
                pin_registers(s);
                wgmma_wait<0>();
                pin_registers(o);
                if (prev >= 0 && lane == 0) mbar_arrive(sm.v_empty(prev), release);
                rescale_rows(o, alpha);
                pack_p<PW_CHUNK, kF16>(pa, s);
                prev = buf;
                prev_par = par;
            }
            if (row_split) mbar_arrive(sm.q_empty(), 1u);
            if (prev >= 0) {
                mbar_wait(sm.v_full(prev), prev_par);
                fence_async_proxy();
                wgmma_fence();
                issue_pv<PW_HEAD_DIM, PW_CHUNK, kF16>(o, pa, sm.v + prev * kTileBytes);
                wgmma_commit();
                wgmma_wait<0>();
                pin_registers(o);
                if (lane == 0) mbar_arrive(sm.v_empty(prev), release);
            }
            chunk_base += chunks;
            if constexpr (kF16) {  // O = R · O_acc
#pragma unroll
                for (int i = 0; i < PW_HEAD_DIM / 2; ++i) o[i] *= v_ref;
            }

            // ---- epilogue (the key-split merge of paged_fwd.cu, then rows stored by id)
            float sum[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) sum[r] = paged::quad_sum(row_sum[r]);
            float m_l2[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) m_l2[r] = row_max[r] == -INFINITY ? -INFINITY : row_max[r] * scale_log2;
            float* staging = reinterpret_cast<float*>(sm.base);
            if (!row_split && cw == 1) {
                named_sync(1, 256);
                park_softmax_state(staging, sm.stats, o, m_l2, sum, wtid, wq, g, t4);
                named_sync(2, 256);  // bar.sync on both sides: racecheck flagged the bar.arrive hand-off
                // Every lane releases the Q buffer for its own reads (ulen, rowinfo, Q); the phase also
                // needs the other warpgroup's arrivals, after its merge has read the staging (= the Q tile).
                mbar_arrive(sm.q_empty(), 1u);
                continue;
            }
            if (!row_split) {
                named_sync(1, 256);
                named_sync(2, 256);
                merge_softmax_state(o, m_l2, sum, staging, sm.stats, wtid, wq, g);
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int hq = head * gqa + rmap[r].z;
                if (rmap[r].x < 0 || hq >= q_heads) continue;
                const float inv = sum[r] > 0.f ? 1.f / sum[r] : 0.f;
                if constexpr (kKvPage) {  // the entry's partial row, fp32
                    const size_t at = static_cast<size_t>(hq) * num_entries + rmap[r].y;
                    float2* dst = reinterpret_cast<float2*>(static_cast<float*>(O_out) + at * PW_HEAD_DIM + 2 * t4);
#pragma unroll
                    for (int j = 0; j < PW_HEAD_DIM / 8; ++j)
                        dst[4 * j] = make_float2(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
                    if (t4 == 0) LSE[at] = sum[r] > 0.f ? (m_l2[r] + log2f(sum[r])) * paged::kLn2 : -INFINITY;
                } else {
                    const size_t at = static_cast<size_t>(hq) * num_queries + rmap[r].x;
                    uint32_t* dst =
                        reinterpret_cast<uint32_t*>(static_cast<__nv_bfloat16*>(O_out) + at * PW_HEAD_DIM + 2 * t4);
#pragma unroll
                    for (int j = 0; j < PW_HEAD_DIM / 8; ++j)
                        dst[4 * j] = paged::pack_bf16x2(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
                    if (t4 == 0) LSE[at] = sum[r] > 0.f ? (m_l2[r] + log2f(sum[r])) * paged::kLn2 : -INFINITY;
                }
            }
            if (!row_split) mbar_arrive(sm.q_empty(), 1u);
        }
    }
}

__global__ void __launch_bounds__(PW_THREADS, 1)
pw_union_fwd_kernel(const __nv_bfloat16* __restrict__ Q, const uint8_t* __restrict__ K, const uint8_t* __restrict__ V,
                    const float* __restrict__ k_scale, const float* __restrict__ v_scale,
                    __nv_bfloat16* __restrict__ O, float* __restrict__ LSE, const int* __restrict__ ids,
                    const int* __restrict__ offsets, const int* __restrict__ group_count,
                    const int* __restrict__ pages, const int* __restrict__ positions,
                    int* __restrict__ item_counter, int num_groups, int kv_heads, int gqa, int num_queries,
                    int selected, int num_pages, int log2_page, int context, int causal, float scale_log2,
                    int num_entries, int pack) {
    union_attention<false>(Q, K, V, k_scale, v_scale, O, LSE, ids, offsets, group_count, pages, positions,
                           item_counter, num_groups, kv_heads, gqa, num_queries, selected, num_pages, log2_page,
                           context, causal, scale_log2, num_entries, pack);
}

// Direct KV-page union: num_groups items per KV head, item g = page pages[g] with the entries
// ids[offsets[g] .. offsets[g+1]) (at most 8 queries that selected it); O / LSE are the partials.
__global__ void __launch_bounds__(PW_THREADS, 1)
pw_kvpage_fwd_kernel(const __nv_bfloat16* __restrict__ Q, const uint8_t* __restrict__ K, const uint8_t* __restrict__ V,
                     const float* __restrict__ k_scale, const float* __restrict__ v_scale,
                     float* __restrict__ O, float* __restrict__ LSE, const int* __restrict__ ids,
                     const int* __restrict__ offsets, const int* __restrict__ group_count,
                     const int* __restrict__ pages, const int* __restrict__ positions,
                     int* __restrict__ item_counter, int num_groups, int kv_heads, int gqa, int num_queries,
                     int selected, int num_pages, int log2_page, int context, int causal, float scale_log2,
                     int num_entries, int pack) {
    union_attention<true>(Q, K, V, k_scale, v_scale, O, LSE, ids, offsets, group_count, pages, positions,
                          item_counter, num_groups, kv_heads, gqa, num_queries, selected, num_pages, log2_page,
                          context, causal, scale_log2, num_entries, pack);
}

// The KV-page union's reduction: one warp per (query head, query) row merges the row's partials
// (slot_entry[query, j] = its entry for selection column j, -1: none) by their LSE into bf16 O and LSE.
// Lane l owns columns 4l .. 4l + 3.
__global__ void __launch_bounds__(256)
pw_lse_merge_kernel(const float* __restrict__ O_part, const float* __restrict__ LSE_part,
                    const int* __restrict__ slot_entry, __nv_bfloat16* __restrict__ O, float* __restrict__ LSE,
                    int q_heads, int num_queries, int selected, int num_entries) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x & 31;
    if (row >= q_heads * num_queries) return;
    const int hq = row / num_queries;
    const int query = row - hq * num_queries;
    float m = -INFINITY, l = 0.f;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int j = 0; j < selected; ++j) {
        const int e = slot_entry[static_cast<size_t>(query) * selected + j];
        if (static_cast<unsigned>(e) >= static_cast<unsigned>(num_entries)) continue;
        const size_t at = static_cast<size_t>(hq) * num_entries + e;
        const float lse_j = LSE_part[at];
        if (lse_j == -INFINITY) continue;
        const float4 oj = *reinterpret_cast<const float4*>(O_part + at * PW_HEAD_DIM + 4 * lane);
        const float mm = fmaxf(m, lse_j);
        const float a = expf(m - mm), b = expf(lse_j - mm);
        acc[0] = acc[0] * a + oj.x * b;
        acc[1] = acc[1] * a + oj.y * b;
        acc[2] = acc[2] * a + oj.z * b;
        acc[3] = acc[3] * a + oj.w * b;
        l = l * a + b;
        m = mm;
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    uint2 packed;
    packed.x = paged::pack_bf16x2(acc[0] * inv, acc[1] * inv);
    packed.y = paged::pack_bf16x2(acc[2] * inv, acc[3] * inv);
    *reinterpret_cast<uint2*>(O + static_cast<size_t>(row) * PW_HEAD_DIM + 4 * lane) = packed;
    if (lane == 0) LSE[row] = l > 0.f ? m + logf(l) : -INFINITY;
}
