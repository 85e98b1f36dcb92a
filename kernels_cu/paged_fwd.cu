// Paged sparse attention forward on Hopper (sm_90a): one persistent, warp-specialized kernel for every
// tile route of a TilePlan — KPage's (64, 256) and (128, 128) tiles and the BSA baseline's (64, 64) and
// (128, 128) — so that KPage and BSA differ only in the plan they execute.
//
// Work items (one per owner tile of the plan, × batch) are taken longest-first from a global counter.
// An item owns M = 64 or 128 query rows (own_pages: (page id, row mask) of its 16-row Q pages) and
// streams its K/V pages (stream_pages: (page id, row mask) entries) in key chunks of CHUNK keys (CHUNK / 16 pages packed back to back, pages from several
// logical blocks sharing a chunk).
//
// Threads: three warpgroups.
// * Producer (warpgroup 0, registers lowered with setmaxnreg): thread 0 takes the next item from the
//   counter and publishes it in a two-entry item ring; every producer warp then gathers its share of the
//   item's Q pages and of each chunk's K and V pages with 16-byte cp.async into swizzled shared memory
//   (invalid rows zero-filled, never read), each buffer completing on an mbarrier that also tracks the
//   copies (cp.async.mbarrier.arrive). K and V have separate rings of NBUF chunk buffers, so a K buffer
//   is released as soon as S = Q·Kᵀ has read it.
// * Two consumer warpgroups (registers raised). Each computes 64 query rows against whole key chunks:
//   S = Q·Kᵀ (wgmma m64nCHUNKk16, Q and K from shared memory), exact per-key masking (-inf), online
//   softmax in registers, O += P·V (wgmma, P from registers, one 16-key page per k-step), with the P·V of
//   the warpgroup's previous chunk issued right behind the next S = Q·Kᵀ. (ptxas places that P·V's wait
//   ahead of the softmax's exponentials, since pack_p writes the P·V's operand registers; so a warpgroup's
//   softmax runs under the other warpgroup's GEMMs. Packing P into other registers before the wait let
//   ptxas reuse the in-flight operand's registers: wrong results, and slower; NOTES_kpage_fwd.md, v23.)
//   - M = 128 ("row split"): warpgroup w owns rows 64w .. 64w + 63 and consumes every chunk.
//   - M = 64 ("key split"): both warpgroups own the same 64 rows and take alternate chunks (w, w + 2,
//     ...); at the end warpgroup 1 hands its (O, max, sum) to warpgroup 0 through the Q buffer, which
//     merges the two softmax states and stores the rows.
// PAIR = true (pair and packed work lists, sparseattn.planning.pair_forward / packed_forward): bit 16 + s of a stream entry's mask
// says the rows of owned page slot s (rows 16s .. 16s + 15, one warp's) see the page (no bit: every row).
// Each warp masks the pages its slot does not see; a warpgroup skips chunks none of its slots sees,
// releasing their buffers once loaded; its pending P·V runs behind its next S unless a skipped chunk's
// load waits for that P·V's V buffer. An item marked plain (kPlainItem, set by the host's pair and packed
// lists on their items without visibility bits) skips that per-chunk decode, as the default build does.
// Outputs: O bf16 [batch, heads, q_slots, HEAD_DIM] and LSE fp32 [batch, heads, q_slots] (natural log)
// for the valid rows of each owned page; a valid row without any valid key gets O = 0, LSE = -inf.
// Invalid query rows are never stored. Every page id is range-checked before use.
// PAGED_FWD_TMA (opt-in variant): K pages, and V pages whose 16 rows are all valid, are loaded by the
// tensor-memory accelerator (one [16 × 64] box per page and 64 columns, lane 0 of each producer warp,
// tensor maps tmK / tmV over [batch · heads · k_slots, HEAD_DIM]); partial and empty V pages keep the
// zero-filling cp.async; K columns of invalid rows are masked, so their stale rows are never used.
// PAGED_FWD_PINGPONG (opt-in): the consumer warpgroups issue their GEMMs in turns (kPingPong).
// PAGED_FWD_REGS_232 (opt-in, with PAGED_FWD_TMA): 40 registers for the producer, 232 for the consumers.
// PAGED_FWD_TOKENS (the token-order build): Q, K, V and O stay in token order, [batch, tokens, tok_heads,
// HEAD_DIM] (the layout a model's projections produce), and slot s of (batch · head) row bh is token
// q_map / k_map[map row + s] (-1: a padding slot, a zero row) of batch bh / tok_heads, head bh % tok_heads;
// the map row is bh · slots when maps_per_row, else 0 (one layout for every row). The producer gathers the
// K and V rows in the lane-rows form (hopper::warp_copy_lane_rows: each lane loads its own consecutive rows'
// tokens, no shuffles; the producer's instruction count per page is what bounds this build); the epilogue
// stores O rows to their tokens. LSE stays in slot order. No tensor moves into or out of slot order.
// PAGED_FWD_TOKENS_QO (the Q/O token build): Q and O in token order as above, K and V in slot order
// ([batch · heads, k_slots, HEAD_DIM], as the slot-order build reads them; k_map and k_tokens unused): the
// tensors streamed per chunk keep their contiguous pages, the ones read or written once per item do not move.
// PAGED_FWD_TOKENS_TMA (the tile-major token build): Q and O by token as above, K and V token-major
// ([batch, k_tokens, tok_heads, HEAD_DIM]) loaded by the tensor-memory accelerator through 3-D maps tmK, tmV
// ([64 × 1 × 16] boxes): for layouts whose every live K page holds consecutive tokens from its first slot's
// (k_map of that slot), as when a model keeps its tokens tile-major; one box per page and 64 columns, issued
// by one lane, where a token gather computes an address per row.
#include "hopper_wgmma.cuh"

#if defined(PAGED_FWD_TMA) || defined(PAGED_FWD_TOKENS_TMA)
#define PAGED_FWD_TMA_PARAMS \
    , const __grid_constant__ hopper::TmaMap tmK, const __grid_constant__ hopper::TmaMap tmV
#else
#define PAGED_FWD_TMA_PARAMS
#endif

#if defined(PAGED_FWD_TOKENS) && defined(PAGED_FWD_TOKENS_QO)
#error "PAGED_FWD_TOKENS_QO is the Q/O token build; PAGED_FWD_TOKENS the build with K and V by token too"
#endif
#if (defined(PAGED_FWD_TOKENS) + defined(PAGED_FWD_TOKENS_QO) + defined(PAGED_FWD_TOKENS_TMA)) > 1
#error "PAGED_FWD_TOKENS, PAGED_FWD_TOKENS_QO and PAGED_FWD_TOKENS_TMA are three builds"
#endif
#if defined(PAGED_FWD_TOKENS) || defined(PAGED_FWD_TOKENS_QO) || defined(PAGED_FWD_TOKENS_TMA)
#define PAGED_FWD_Q_TOKENS
#endif
#ifdef PAGED_FWD_Q_TOKENS
#ifdef PAGED_FWD_TMA
#error "the token builds gather rows by token: the TMA build's tensor maps are over slot-ordered rows"
#endif
#define PAGED_FWD_TOKEN_PARAMS                                                                               \
    , const int* __restrict__ q_map, const int* __restrict__ k_map, int q_tokens, int k_tokens, int tok_heads, \
        int maps_per_row
#else
#define PAGED_FWD_TOKEN_PARAMS
#endif

// Geometry mirrored in sparseattn/kernels/forward.py.
#define PAGED_FWD_THREADS 384
#define PAGED_FWD_Q_ROWS 128          // Q tile rows (the largest route's M)
#define PAGED_FWD_Q_PAGES 8           // own_pages columns the kernel reads per work item
#ifdef PAGED_FWD_REGS_232
// (opt-in) the consumers' code uses up to R222 at 224: 232 for them, 40 for the producer, which only the
// TMA build's producer fits without spills
#ifndef PAGED_FWD_TMA
#error "PAGED_FWD_REGS_232 needs PAGED_FWD_TMA (the cp.async producer spills at 40 registers)"
#endif
#define PAGED_FWD_PRODUCER_REGS 40
#define PAGED_FWD_CONSUMER_REGS 232
#else
#define PAGED_FWD_PRODUCER_REGS 56
#define PAGED_FWD_CONSUMER_REGS 224
#endif
static_assert(PAGED_FWD_PRODUCER_REGS * 128 + PAGED_FWD_CONSUMER_REGS * 256 <= 168 * PAGED_FWD_THREADS,
              "the register split must fit the CTA's launch allocation (168 registers x 384 threads)");
#define PAGED_FWD_SMEM_LIMIT (227 * 1024)
#define PAGED_FWD_SMALL_BYTES 1280    // barriers, chunk page masks, item ring, merge statistics
#define PAGED_FWD_MAX_NBUF 8

namespace {

constexpr int kProducerThreads = 128;
constexpr int kConsumerWarps = 8;
// Lanes of a consumer warp that read a chunk's page masks (lane t4 computes the column bits of quad
// position t4) and arrive on its K buffer's empty barrier: an arrival releases only its own lane's reads,
// so every read is ordered before the producer's next store to the slot (racecheck-clean; the form where
// all 32 lanes read the masks and lane 0 released the buffer was not).
constexpr int kMaskReaders = 4;
#ifdef PAGED_FWD_PINGPONG
// The consumer warpgroups issue their GEMMs in turns (named barrier kTurnBarrier + cw: this warpgroup's
// turn), so one's softmax runs under the other's GEMMs. Every chunk iteration takes a turn, skipped pair
// chunks included, and on a key split the warpgroup with one chunk fewer takes an empty turn: both take the
// same number per item, which keeps the alternation across items.
constexpr bool kPingPong = true;
#else
constexpr bool kPingPong = false;
#endif
constexpr int kTurnBarrier = 3;

template <int HEAD_DIM, int CHUNK>
struct FwdConfig {
    static constexpr int PAGES = CHUNK / PAGE_ROWS;  // pages per key chunk
    static constexpr int PPW = PAGES / 4;            // pages per producer warp
    static constexpr int Q_BYTES = PAGED_FWD_Q_ROWS * HEAD_DIM * 2;
    static constexpr int KV_BYTES = CHUNK * HEAD_DIM * 2;
    static constexpr int NBUF_FIT = (PAGED_FWD_SMEM_LIMIT - 1024 - PAGED_FWD_SMALL_BYTES - Q_BYTES) / (2 * KV_BYTES);
    static constexpr int NBUF = NBUF_FIT < PAGED_FWD_MAX_NBUF ? NBUF_FIT : PAGED_FWD_MAX_NBUF;
    static constexpr int SMEM_BYTES = 1024 + Q_BYTES + 2 * NBUF * KV_BYTES + PAGED_FWD_SMALL_BYTES;
    static constexpr int OREG = HEAD_DIM / 2;        // O accumulator floats per consumer thread
    static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "HEAD_DIM 64 or 128");
    static_assert(CHUNK == 64 || CHUNK == 128, "CHUNK 64 or 128 keys");
    static_assert(NBUF >= 3, "at least three K/V chunk buffers (the P·V of a chunk overlaps the next S)");
    static_assert(SMEM_BYTES <= PAGED_FWD_SMEM_LIMIT, "over the per-block shared-memory limit");
    // the merge staging of the key-split route (64 rows x HEAD_DIM fp32) reuses the Q buffer
    static_assert(64 * HEAD_DIM * 4 <= Q_BYTES, "merge staging must fit the Q buffer");
    static_assert(8 * (4 * NBUF + 6) + 4 * NBUF * PAGES + 16 + 2 * 64 * 4 <= PAGED_FWD_SMALL_BYTES,
                  "small shared region too small");
};

// Shared-memory map: [1024-aligned] Q | K ring | V ring | barriers | chunk masks | item ring | stats
template <int HEAD_DIM, int CHUNK>
struct FwdSmem {
    using C = FwdConfig<HEAD_DIM, CHUNK>;
    uint32_t q, k, v, bars;
    unsigned char* base;  // generic pointer of `q`
    uint32_t* kmask;      // [NBUF][PAGES] row masks of the pages of each K chunk buffer
    volatile int* items;  // [2] item ring
    float* stats;         // [2][64] max and sum of the key-split merge

    __device__ __forceinline__ FwdSmem(unsigned char* raw_ptr) {
        const uint32_t raw = paged::smem_u32(raw_ptr);
        q = (raw + 1023u) & ~1023u;  // the swizzle pattern is anchored at 1024-byte boundaries
        base = raw_ptr + (q - raw);
        k = q + C::Q_BYTES;
        v = k + C::NBUF * C::KV_BYTES;
        bars = v + C::NBUF * C::KV_BYTES;
        unsigned char* small = base + (bars - q);
        kmask = reinterpret_cast<uint32_t*>(small + 8 * (4 * C::NBUF + 6));
        items = reinterpret_cast<volatile int*>(kmask + C::NBUF * C::PAGES);
        stats = reinterpret_cast<float*>(small + 8 * (4 * C::NBUF + 6) + 4 * C::NBUF * C::PAGES + 16);
    }
    __device__ __forceinline__ uint32_t k_full(int i) const { return bars + 8 * i; }
    __device__ __forceinline__ uint32_t k_empty(int i) const { return bars + 8 * (C::NBUF + i); }
    __device__ __forceinline__ uint32_t v_full(int i) const { return bars + 8 * (2 * C::NBUF + i); }
    __device__ __forceinline__ uint32_t v_empty(int i) const { return bars + 8 * (3 * C::NBUF + i); }
    __device__ __forceinline__ uint32_t q_full() const { return bars + 8 * (4 * C::NBUF); }
    __device__ __forceinline__ uint32_t q_empty() const { return bars + 8 * (4 * C::NBUF + 1); }
    __device__ __forceinline__ uint32_t item_full(int i) const { return bars + 8 * (4 * C::NBUF + 2 + i); }
    __device__ __forceinline__ uint32_t item_empty(int i) const { return bars + 8 * (4 * C::NBUF + 4 + i); }
};

// One work item as both roles decode it: work_info[w] = (head, stream begin, stream length, rows M), M's
// word with kPlainItem set on an item of a pair list whose entries carry no visibility bits (every owned
// row sees every entry; sparseattn.planning.work_list.PLAIN_ITEM): the pair instantiation then runs it as
// the default one does, without the per-chunk decode of the entries' visibility.
constexpr int kPlainItem = 1 << 16;
struct WorkItem {
    int w, batch, head, begin, len, rows, chunks;
    bool ok;   // head in range: anything else is never loaded or stored
    bool vis;  // (pair instantiation) decode the entries' visibility bits per chunk
};

// O += P·V of the chunk in V buffer `buf` (its load completes phase `par` of v_full), then this warp's
// release of the buffer (`release` arrivals; lane 0).
template <int HEAD_DIM, int CHUNK>
__device__ __forceinline__ void finish_pv(const FwdSmem<HEAD_DIM, CHUNK>& sm, float (&o)[HEAD_DIM / 2],
                                          const uint32_t (&pa)[CHUNK / PAGE_ROWS][4], int buf, uint32_t par,
                                          uint32_t release, int lane) {
    using C = FwdConfig<HEAD_DIM, CHUNK>;
    hopper::mbar_wait(sm.v_full(buf), par);
    hopper::fence_async_proxy();
    hopper::wgmma_fence();
    hopper::issue_pv<HEAD_DIM, CHUNK>(o, pa, sm.v + buf * C::KV_BYTES);
    hopper::wgmma_commit();
    hopper::wgmma_wait<0>();
    hopper::pin_registers(o);
    if (lane == 0) hopper::mbar_arrive(sm.v_empty(buf), release);
}

template <int PAGES, bool PAIR>
__device__ __forceinline__ WorkItem decode_item(int item, int num_work, const int4* __restrict__ work_info,
                                                const int* __restrict__ work_order, int heads, int stream_total) {
    WorkItem it;
    it.batch = item / num_work;
    it.w = __shfl_sync(0xffffffffu, work_order[item - it.batch * num_work], 0);
    int4 info = work_info[it.w];
    // broadcast: the compiler then treats everything derived from the item as warp-uniform, so the
    // wgmma issue paths are not considered divergent (which would serialize the MMAs)
    info.x = __shfl_sync(0xffffffffu, info.x, 0);
    info.y = __shfl_sync(0xffffffffu, info.y, 0);
    info.z = __shfl_sync(0xffffffffu, info.z, 0);
    info.w = __shfl_sync(0xffffffffu, info.w, 0);
    it.head = info.x;
    it.ok = static_cast<unsigned>(info.x) < static_cast<unsigned>(heads);
    it.begin = min(max(info.y, 0), stream_total);
    it.len = it.ok ? min(max(info.z, 0), stream_total - it.begin) : 0;
    if constexpr (PAIR) {
        it.rows = (info.w & (kPlainItem - 1)) > 64 ? 128 : 64;
        it.vis = !(info.w & kPlainItem);
    } else {
        it.rows = info.w > 64 ? 128 : 64;
        it.vis = false;
    }
    it.chunks = (it.len + PAGES - 1) / PAGES;
    return it;
}

// An item with no stream entry and no owned page (on device plans, the slot of a block that joined its
// neighbour's pair item) computes and stores nothing. With PAGED_FWD_SKIP_VOID both roles pass it by
// without the Q buffer's hand-off, which otherwise costs a round trip between the warpgroups per item.
// Warp-uniform; every lane of the warp calls it.
__device__ __forceinline__ bool void_item(const WorkItem& it, const int2* __restrict__ own_pages, int q_pages,
                                          int lane) {
#ifdef PAGED_FWD_SKIP_VOID
    if (it.len > 0) return false;
    int page = -1;
    if (it.ok && lane < PAGED_FWD_Q_PAGES) page = own_pages[it.w * PAGED_FWD_Q_PAGES + lane].x;
    return !__any_sync(0xffffffffu, static_cast<unsigned>(page) < static_cast<unsigned>(q_pages));
#else
    return false;
#endif
}


}  // namespace

template <int HEAD_DIM, int CHUNK, bool PAIR = false>
__global__ void __launch_bounds__(PAGED_FWD_THREADS, 1)
paged_fwd_kernel(const __nv_bfloat16* __restrict__ Q, const __nv_bfloat16* __restrict__ K,
                 const __nv_bfloat16* __restrict__ V, __nv_bfloat16* __restrict__ O, float* __restrict__ LSE,
                 const int4* __restrict__ work_info, const int* __restrict__ work_order,
                 const int2* __restrict__ own_pages, const int2* __restrict__ stream_pages,
                 int* __restrict__ item_counter, int num_work, int batch, int heads, int q_slots, int k_slots,
                 int stream_total, float scale_log2 PAGED_FWD_TMA_PARAMS PAGED_FWD_TOKEN_PARAMS) {
    using C = FwdConfig<HEAD_DIM, CHUNK>;
    constexpr int PAGES = C::PAGES;
    constexpr int NBUF = C::NBUF;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const FwdSmem<HEAD_DIM, CHUNK> sm(smem_raw);

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int q_pages = q_slots / PAGE_ROWS;
    const int k_pages = k_slots / PAGE_ROWS;
    const int total_items = num_work * batch;

    if (tid == 0) {
        for (int i = 0; i < NBUF; ++i) {
            hopper::mbar_init(sm.k_full(i), kProducerThreads);
            hopper::mbar_init(sm.v_full(i), kProducerThreads);
            hopper::mbar_init(sm.k_empty(i), kConsumerWarps * kMaskReaders);
            hopper::mbar_init(sm.v_empty(i), kConsumerWarps);
        }
        hopper::mbar_init(sm.q_full(), kProducerThreads);
        hopper::mbar_init(sm.q_empty(), kConsumerWarps);
        for (int i = 0; i < 2; ++i) {
            hopper::mbar_init(sm.item_full(i), 1);
            hopper::mbar_init(sm.item_empty(i), kConsumerWarps + kProducerThreads / 32);
        }
    }
    __syncthreads();

    const int role = __shfl_sync(0xffffffffu, tid / 128, 0);  // warpgroup index, warp-uniform
    if (role == 0) {
        // ================================ producer ================================
        hopper::regs_release<PAGED_FWD_PRODUCER_REGS>();
        const int pwarp = tid >> 5;
#if defined(PAGED_FWD_TMA) || defined(PAGED_FWD_TOKENS_TMA)
        if (tid == 0) {
            hopper::tma_prefetch(&tmK);
            hopper::tma_prefetch(&tmV);
        }
#endif
        int chunk_count = 0;  // chunks issued so far (ring position)
        int q_items = 0;      // items through the Q buffer so far (void items skip it)
        for (int k = 0;; ++k) {
            const int islot = k & 1;
            const uint32_t ipar = (k >> 1) & 1;
            if (tid == 0) {
                const int ticket = atomicAdd(item_counter, 1);
                hopper::mbar_wait(sm.item_empty(islot), ipar ^ 1u);
                sm.items[islot] = ticket < total_items ? ticket : -1;
                hopper::mbar_arrive(sm.item_full(islot));
            }
            hopper::mbar_wait(sm.item_full(islot), ipar);
            const int item = __shfl_sync(0xffffffffu, sm.items[islot], 0);
            __syncwarp();
            if (lane == 0) hopper::mbar_arrive(sm.item_empty(islot));
            if (item < 0) break;
            const WorkItem it = decode_item<PAGES, PAIR>(item, num_work, work_info, work_order, heads, stream_total);
            if (void_item(it, own_pages, q_pages, lane)) continue;
            const size_t bh = static_cast<size_t>(it.batch) * heads + (it.ok ? it.head : 0);
#ifdef PAGED_FWD_TOKENS
            const hopper::TokenRows tk = hopper::token_rows(bh, tok_heads, k_tokens, HEAD_DIM);
            const int* kmap = k_map + (maps_per_row ? bh * k_slots : 0);
#elif defined(PAGED_FWD_TOKENS_TMA)
            const int kv_head = static_cast<int>(bh % static_cast<size_t>(tok_heads));
            const int kv_row0 = static_cast<int>(bh / static_cast<size_t>(tok_heads)) * k_tokens;  // < 2^31 (host)
            const int* kmap = k_map + (maps_per_row ? bh * k_slots : 0);
#else
            const __nv_bfloat16* Vh = V + bh * k_slots * HEAD_DIM;
#endif
#ifdef PAGED_FWD_TMA
            const int map_row0 = static_cast<int>(bh) * k_slots;  // K through tmK; < 2^31 (checked by the host)
#elif !defined(PAGED_FWD_TOKENS) && !defined(PAGED_FWD_TOKENS_TMA)
            const __nv_bfloat16* Kh = K + bh * k_slots * HEAD_DIM;
#endif

            // Q: warp pw gathers own pages 2pw, 2pw + 1 (rows 32pw .. 32pw + 31)
            hopper::mbar_wait(sm.q_empty(), (q_items & 1) ^ 1u);
            if (2 * pwarp < it.rows / PAGE_ROWS) {
                int qp = -1;
                uint32_t qm = 0u;
                if (lane < 2 && it.ok) {
                    const int2 e = own_pages[it.w * PAGED_FWD_Q_PAGES + 2 * pwarp + lane];
                    qp = e.x;
                    qm = static_cast<uint32_t>(e.y);
                }
                const int page[2] = {__shfl_sync(0xffffffffu, qp, 0), __shfl_sync(0xffffffffu, qp, 1)};
                const uint32_t mask[2] = {__shfl_sync(0xffffffffu, qm, 0), __shfl_sync(0xffffffffu, qm, 1)};
#ifdef PAGED_FWD_Q_TOKENS
                const hopper::TokenRows tq = hopper::token_rows(bh, tok_heads, q_tokens, HEAD_DIM);
                const int* qmap = q_map + (maps_per_row ? bh * q_slots : 0);
                int tok[2];
                hopper::page_tokens<2>(tok, qmap, q_pages, page);
                hopper::warp_copy_token_pages<HEAD_DIM, PAGED_FWD_Q_ROWS, 2>(sm.q, 32 * pwarp, Q + tq.base, tq.stride,
                                                                           q_tokens, q_pages, tok, page, mask);
#else
                hopper::warp_copy_pages<HEAD_DIM, PAGED_FWD_Q_ROWS, 2>(sm.q, 32 * pwarp, Q + bh * q_slots * HEAD_DIM,
                                                                     q_pages, page, mask);
#endif
            }
            hopper::mbar_track_cp_async(sm.q_full());
            hopper::mbar_arrive(sm.q_full());
            ++q_items;

            // K/V chunks: warp pw gathers pages pw·PPW .. of each chunk; lanes < PPW hold the entries of
            // the next chunk (loaded while this chunk's copies are issued)
            auto entry = [&](int c, int& page, uint32_t& mask) {
                const int e = c * PAGES + pwarp * C::PPW + lane;
                int2 entry = make_int2(-1, 0);
                if (lane < C::PPW && e < it.len) entry = stream_pages[it.begin + e];
                page = entry.x;
                mask = static_cast<uint32_t>(entry.y);
            };
            int next_page;
            uint32_t next_mask;
            entry(0, next_page, next_mask);
            for (int c = 0; c < it.chunks; ++c, ++chunk_count) {
                const int buf = chunk_count % NBUF;
                const uint32_t par = (chunk_count / NBUF) & 1;
                int page[C::PPW];
                uint32_t mask[C::PPW];
#pragma unroll
                for (int p = 0; p < C::PPW; ++p) {
                    page[p] = __shfl_sync(0xffffffffu, next_page, p);
                    mask[p] = __shfl_sync(0xffffffffu, next_mask, p);
                }
#if !defined(PAGED_FWD_TMA) && !defined(PAGED_FWD_TOKENS_TMA)
                const uint32_t my_mask = next_mask;
#endif
#ifdef PAGED_FWD_TOKENS_TMA
                int first[C::PPW];  // lane 0: each page's first token (loaded before the waits)
                hopper::page_first_tokens<C::PPW>(first, kmap, k_pages, page);
#endif
                entry(c + 1, next_page, next_mask);
                hopper::mbar_wait(sm.k_empty(buf), par ^ 1u);
#ifdef PAGED_FWD_TMA
                // The lane that issues the warp's boxes writes its masks too (the phase may complete by
                // those boxes' bytes; racecheck then orders only that lane's writes before the waiters'
                // reads). A page the TMA does not load keeps stale rows: its columns are masked.
                if (lane == 0) {
#pragma unroll
                    for (int p = 0; p < C::PPW; ++p)
                        sm.kmask[buf * PAGES + pwarp * C::PPW + p] =
                            static_cast<unsigned>(page[p]) < static_cast<unsigned>(k_pages) ? mask[p] : 0u;
                }
                hopper::warp_tma_pages<HEAD_DIM, CHUNK, C::PPW, false>(sm.k + buf * C::KV_BYTES, pwarp * C::PPW * PAGE_ROWS,
                                                                     &tmK, map_row0, k_pages, page, mask, sm.k_full(buf));
                hopper::mbar_arrive(sm.k_full(buf));
                hopper::mbar_wait(sm.v_empty(buf), par ^ 1u);
                hopper::warp_tma_pages<HEAD_DIM, CHUNK, C::PPW, true>(sm.v + buf * C::KV_BYTES, pwarp * C::PPW * PAGE_ROWS,
                                                                    &tmV, map_row0, k_pages, page, mask, sm.v_full(buf));
                hopper::warp_copy_pages<HEAD_DIM, CHUNK, C::PPW, true>(sm.v + buf * C::KV_BYTES, pwarp * C::PPW * PAGE_ROWS,
                                                                     Vh, k_pages, page, mask);
#elif defined(PAGED_FWD_TOKENS_TMA)
                // (as in the TMA build: the lane that issues the boxes writes the masks)
                if (lane == 0) {
#pragma unroll
                    for (int p = 0; p < C::PPW; ++p)
                        sm.kmask[buf * PAGES + pwarp * C::PPW + p] =
                            static_cast<unsigned>(page[p]) < static_cast<unsigned>(k_pages) ? mask[p] : 0u;
                }
                hopper::warp_tma_token_pages<HEAD_DIM, CHUNK, C::PPW, false>(
                    sm.k + buf * C::KV_BYTES, pwarp * C::PPW * PAGE_ROWS, &tmK, kv_head, kv_row0, first, k_pages, page,
                    sm.k_full(buf));
                hopper::mbar_arrive(sm.k_full(buf));
                hopper::mbar_wait(sm.v_empty(buf), par ^ 1u);
                hopper::warp_tma_token_pages<HEAD_DIM, CHUNK, C::PPW, true>(
                    sm.v + buf * C::KV_BYTES, pwarp * C::PPW * PAGE_ROWS, &tmV, kv_head, kv_row0, first, k_pages, page,
                    sm.v_full(buf));
#elif defined(PAGED_FWD_TOKENS)
                if (lane < C::PPW) sm.kmask[buf * PAGES + pwarp * C::PPW + lane] = my_mask;
                hopper::warp_copy_lane_rows<HEAD_DIM, CHUNK, C::PPW>(sm.k + buf * C::KV_BYTES, pwarp * C::PPW * PAGE_ROWS,
                                                                   K + tk.base, tk.stride, k_tokens, kmap, k_pages, page,
                                                                   mask);
                hopper::mbar_track_cp_async(sm.k_full(buf));
                hopper::mbar_arrive(sm.k_full(buf));
                hopper::mbar_wait(sm.v_empty(buf), par ^ 1u);
                hopper::warp_copy_lane_rows<HEAD_DIM, CHUNK, C::PPW>(sm.v + buf * C::KV_BYTES, pwarp * C::PPW * PAGE_ROWS,
                                                                   V + tk.base, tk.stride, k_tokens, kmap, k_pages, page,
                                                                   mask);
#else
                if (lane < C::PPW) sm.kmask[buf * PAGES + pwarp * C::PPW + lane] = my_mask;
                hopper::warp_copy_pages<HEAD_DIM, CHUNK, C::PPW>(sm.k + buf * C::KV_BYTES, pwarp * C::PPW * PAGE_ROWS,
                                                               Kh, k_pages, page, mask);
                hopper::mbar_track_cp_async(sm.k_full(buf));
                hopper::mbar_arrive(sm.k_full(buf));
                hopper::mbar_wait(sm.v_empty(buf), par ^ 1u);
                hopper::warp_copy_pages<HEAD_DIM, CHUNK, C::PPW>(sm.v + buf * C::KV_BYTES, pwarp * C::PPW * PAGE_ROWS,
                                                               Vh, k_pages, page, mask);
#endif
                hopper::mbar_track_cp_async(sm.v_full(buf));
                hopper::mbar_arrive(sm.v_full(buf));
            }
        }
        paged::cp_async_wait<0>();
    } else {
        // ================================ consumers ================================
        hopper::regs_claim<PAGED_FWD_CONSUMER_REGS>();
        const int cw = role - 1;                       // consumer warpgroup 0 or 1
        if (kPingPong && cw == 1) hopper::named_arrive(kTurnBarrier, 256);  // warpgroup 0 goes first
        auto wait_turn = [&] { hopper::named_sync(kTurnBarrier + cw, 256); };
        auto pass_turn = [&] { hopper::named_arrive(kTurnBarrier + (cw ^ 1), 256); };
        const int wtid = (tid - kProducerThreads) & 127;
        const int wq = wtid >> 5;                      // warp inside the warpgroup: rows 16wq .. 16wq + 15
        const int g = lane >> 2;
        const int t4 = lane & 3;
        int chunk_base = 0;  // ring position of the current item's chunk 0
        int q_items = 0;     // items through the Q buffer so far (void items skip it)
        for (int k = 0;; ++k) {
            const int islot = k & 1;
            hopper::mbar_wait(sm.item_full(islot), (k >> 1) & 1);
            const int item = __shfl_sync(0xffffffffu, sm.items[islot], 0);
            __syncwarp();
            if (lane == 0) hopper::mbar_arrive(sm.item_empty(islot));
            if (item < 0) break;
            const WorkItem it = decode_item<PAGES, PAIR>(item, num_work, work_info, work_order, heads, stream_total);
            if (void_item(it, own_pages, q_pages, lane)) continue;
            const bool row_split = it.rows > 64;
            const uint32_t release = row_split ? 1u : 2u;  // arrivals per warp on an empty barrier
            const uint32_t aQrows = sm.q + (row_split ? cw * 64 * 128 : 0);

            hopper::mbar_wait(sm.q_full(), q_items & 1);
            ++q_items;
            hopper::fence_async_proxy();
            float o[C::OREG];
#pragma unroll
            for (int i = 0; i < C::OREG; ++i) o[i] = 0.f;
            float row_max[2] = {-INFINITY, -INFINITY};
            float row_sum[2] = {0.f, 0.f};
            float alpha[2];
            float s[CHUNK / 2];
            uint32_t pa[PAGES][4];
            int prev = -1;  // V buffer of this warpgroup's previous chunk (its P·V is pending)
            uint32_t prev_par = 0;
            int prev_pos = 0;  // its ring position
#pragma unroll 1
            for (int c = row_split ? 0 : cw; c < it.chunks; c += row_split ? 1 : 2) {
                const int pos = chunk_base + c;
                const int buf = pos % NBUF;
                const uint32_t par = (pos / NBUF) & 1;
                hopper::mbar_wait(sm.k_full(buf), par);
                uint32_t seen_cols = 0xffffffffu;  // decode: the column bits of the pages this warp's rows see
                uint32_t page_mask[PAGES];              // decode: the chunk's entry masks, read once
                const bool decode = PAIR && it.vis;     // (false at compile time without PAIR)
                if (decode) {
                    // bit 16 + s of a page's mask: owned page slot s sees it (none set: every slot does);
                    // this warpgroup's slots are 4·cw .. 4·cw + 3 (0..3 on a key split), this warp's is one.
                    // Branch-free: this decode sits between the chunk's arrival and its S = Q·Kᵀ issue.
                    // (only the kMaskReaders lanes read them, the others hold zeros: the skip decision is a
                    // warp vote, and the readers fold the page sets into the column bits they hand out)
                    static_assert(PAGES % 4 == 0 && PAGES <= 16, "pair chunks read their page masks 16 bytes at a time");
                    const uint4* words = reinterpret_cast<const uint4*>(sm.kmask + buf * PAGES);
#pragma unroll
                    for (int w = 0; w < PAGES / 4; ++w) {
                        const uint4 q4 = lane < kMaskReaders ? words[w] : make_uint4(0u, 0u, 0u, 0u);
                        page_mask[4 * w] = q4.x;
                        page_mask[4 * w + 1] = q4.y;
                        page_mask[4 * w + 2] = q4.z;
                        page_mask[4 * w + 3] = q4.w;
                    }
                    const int slot0 = row_split ? 4 * cw : 0;
                    const uint32_t group_slots = 0xfu << slot0, warp_slot = 1u << (slot0 + wq);
                    uint32_t seen = 0, warp_seen = 0;
#pragma unroll
                    for (int p = 0; p < PAGES; ++p) {
                        const uint32_t m = page_mask[p];
                        const uint32_t vis = (m >> 16) & 0xffu;
                        const uint32_t sees = (m & 0xffffu) ? (vis ? vis : 0xffu) : 0u;  // slots seeing page p
                        seen |= (sees & group_slots) ? 1u << p : 0u;
                        warp_seen |= (sees & warp_slot) ? 1u << p : 0u;
                    }
                    const bool skip = !__any_sync(0xffffffffu, seen != 0u);
                    if (skip) {  // nothing for these rows: release the chunk once it has landed
                        // The pending P·V stays pending (it runs behind this warpgroup's next S) unless
                        // the skipped chunk's load needs its V buffer, which the producer frees in ring
                        // order: finishing it then keeps the wait below from waiting on ourselves.
                        if (prev >= 0 && pos - prev_pos >= NBUF) {
                            finish_pv(sm, o, pa, prev, prev_par, release, lane);
                            prev = -1;
                        }
                        // (kPingPong: the turn before the wait: this V buffer may be freed by the other
                        // warpgroup's next GEMM issue, which waits for this turn)
                        if (kPingPong) {
                            wait_turn();
                            pass_turn();
                        }
                        hopper::mbar_wait(sm.v_full(buf), par);
                        __syncwarp();
                        if (lane < kMaskReaders) hopper::mbar_arrive(sm.k_empty(buf), release);
                        if (lane == 0) hopper::mbar_arrive(sm.v_empty(buf), release);
                        continue;
                    }
                    seen_cols = 0u;
#pragma unroll
                    for (int p = 0; p < PAGES; ++p) seen_cols |= ((warp_seen >> p) & 1u) ? (0xfu << (4 * p)) : 0u;
                }
                if (prev >= 0) hopper::mbar_wait(sm.v_full(prev), prev_par);  // (nearly always landed long ago)
                uint32_t col_bits;
                hopper::fence_async_proxy();  // cp.async writes (generic proxy) -> wgmma reads (async proxy)
                if (kPingPong) wait_turn();
                // S = Q·Kᵀ of this chunk, then O += P·V of the previous one right behind it: no control
                // flow between the two issues, so the tensor cores run them back to back
                hopper::wgmma_fence();
                hopper::issue_qk<HEAD_DIM, CHUNK, PAGED_FWD_Q_ROWS>(s, aQrows, sm.k + buf * C::KV_BYTES);
                hopper::wgmma_commit();
                if (prev >= 0) {
                    hopper::issue_pv<HEAD_DIM, CHUNK>(o, pa, sm.v + prev * C::KV_BYTES);
                    hopper::wgmma_commit();
                    if (kPingPong) pass_turn();
                    hopper::wgmma_wait<1>();  // S landed; the previous chunk's P·V may still run
                } else {
                    if (kPingPong) pass_turn();
                    hopper::wgmma_wait<0>();
                }
                // the column mask, off the path to the S issue (decode: from the masks read above; else from
                // shared memory, before this warp releases the K buffer the masks belong to)
                uint32_t quad_bits = 0u;  // lane t4 < 4: the column bits of quad position t4
                if (decode) {
                    quad_bits = hopper::column_bits<CHUNK>(page_mask, lane & 3) & seen_cols;
                } else {
                    if (lane < kMaskReaders) quad_bits = hopper::column_bits<CHUNK>(sm.kmask + buf * PAGES, lane);
                }
                col_bits = __shfl_sync(0xffffffffu, quad_bits, t4);
                hopper::pin_registers(s);
                if (lane < kMaskReaders) hopper::mbar_arrive(sm.k_empty(buf), release);
                hopper::online_softmax<CHUNK>(s, col_bits, scale_log2, row_max, row_sum, alpha);
                hopper::pin_registers(s);  // (ptxas hoists the wait below above the softmax: see the header)
                hopper::wgmma_wait<0>();
                hopper::pin_registers(o);
                if (prev >= 0 && lane == 0) hopper::mbar_arrive(sm.v_empty(prev), release);
                hopper::rescale_rows(o, alpha);
                hopper::pack_p<CHUNK>(pa, s);
                prev = buf;
                prev_par = par;
                prev_pos = pos;
            }
            if (kPingPong && !row_split && cw == 1 && (it.chunks & 1)) {  // the empty turn (see kPingPong)
                wait_turn();
                pass_turn();
            }
            if (row_split) {  // Q is no longer read: the producer may load the next item's
                __syncwarp();
                if (lane == 0) hopper::mbar_arrive(sm.q_empty(), 1u);
            }
            if (prev >= 0) finish_pv(sm, o, pa, prev, prev_par, release, lane);  // the last chunk's P·V
            chunk_base += it.chunks;

            // ---- epilogue
            float sum[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) sum[r] = paged::quad_sum(row_sum[r]);
            float m_l2[2];  // row max in the exp2 domain (-inf when the row saw no valid key)
#pragma unroll
            for (int r = 0; r < 2; ++r) m_l2[r] = row_max[r] == -INFINITY ? -INFINITY : row_max[r] * scale_log2;
            float* staging = reinterpret_cast<float*>(sm.base);  // key split: [OREG][128] fp32 over the Q buffer
            if (!row_split && cw == 1) {
                hopper::named_sync(1, 256);  // warpgroup 0 no longer reads Q
                hopper::park_softmax_state(staging, sm.stats, o, m_l2, sum, wtid, wq, g, t4);
                hopper::named_sync(2, 256);  // bar.sync on both sides: racecheck flags a bar.arrive hand-off
                continue;
            }
            if (!row_split) {  // warpgroup 0 merges warpgroup 1's softmax state into its own
                hopper::named_sync(1, 256);
                hopper::named_sync(2, 256);
                hopper::merge_softmax_state(o, m_l2, sum, staging, sm.stats, wtid, wq, g);
            }
            float inv[2], lse[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                inv[r] = sum[r] > 0.f ? 1.f / sum[r] : 0.f;
                lse[r] = sum[r] > 0.f ? (m_l2[r] + log2f(sum[r])) * paged::kLn2 : -INFINITY;
            }
            const int own_slot = (row_split ? 4 * cw : 0) + wq;
            const int2 own = it.ok ? own_pages[it.w * PAGED_FWD_Q_PAGES + own_slot] : make_int2(-1, 0);
            const int page = own.x;
            if (static_cast<unsigned>(page) < static_cast<unsigned>(q_pages)) {
                const uint32_t mask = static_cast<uint32_t>(own.y);
                const size_t bh = static_cast<size_t>(it.batch) * heads + it.head;
                const size_t row0 = bh * q_slots + static_cast<size_t>(page) * PAGE_ROWS;
#ifdef PAGED_FWD_Q_TOKENS
                const hopper::TokenRows tq = hopper::token_rows(bh, tok_heads, q_tokens, HEAD_DIM);
                const int* qmap = q_map + (maps_per_row ? bh * q_slots : 0) + static_cast<size_t>(page) * PAGE_ROWS;
                hopper::store_o_token_page<HEAD_DIM>(O + tq.base, tq.stride, q_tokens, qmap, LSE + row0, mask, o, inv,
                                                     lse);
#else
                hopper::store_o_page<HEAD_DIM>(O + row0 * HEAD_DIM, LSE + row0, mask, o, inv, lse);
#endif
            }
            if (!row_split) {  // the staging (Q buffer) is read: release it for both warpgroups
                __syncwarp();
                if (lane == 0) hopper::mbar_arrive(sm.q_empty(), 2u);
            }
        }
    }
}
