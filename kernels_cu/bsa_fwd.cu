// Paged block-sparse attention forward (the BSA baseline; the same skeleton runs any owner='q' plan).
//
// One CTA per (work item, batch). A work item owns TILE_M query rows given as TILE_M/16 Q pages
// (own_pages, -1 padded) and streams a list of K/V pages (stream_pages[stream_indptr[w] ..
// stream_indptr[w+1]]) that the plan packs into tiles of TILE_N keys. For the BSA plan the owned
// pages are one logical Q block and each tile is one selected K block; a KPage plan packs pages
// of several blocks into one tile, and this kernel needs no change for it.
//
// FlashAttention-2 structure on mma.sync.m16n8k16 (bf16 in, fp32 accumulate). The streamed pages
// are consumed in stages of STAGE_N = min(TILE_N, 64) keys (4 pages); a 128-key tile is two
// stages, a stage past the end of the page list is never loaded. Each warp owns WARP_M query rows
// (32 for 128-row tiles: every K/V fragment read from shared memory feeds two m16 tiles; 16 for
// 64-row tiles, with Q fragments cached in registers). S = Q Kᵀ and O += P V on tensor cores,
// online softmax in registers with exp2 and a log2(e)-prescaled scale. K/V pages are gathered
// with 16-byte cp.async into 128-byte-swizzled shared tiles, 2-3 stage buffers (the next stages' K
// and V load while this one computes; K and V are separate groups so S starts before V lands).
// Invalid rows are zero-filled in shared memory (never read from HBM), so padding slots may hold
// anything; their key columns are masked to -inf and their query rows are not stored.
//
// Outputs: O bf16 [batch, heads, q_slots, HEAD_DIM]; LSE fp32 [batch, heads, q_slots], natural
// log. A valid query row with no valid key gets O = 0 and LSE = -inf. Invalid rows are untouched.
#include "paged_attn_common.cuh"

// Keys per pipeline stage and query rows per warp (mirrored in sparseattn/kernels/bsa_mma_forward.py).
#define BSA_FWD_STAGE_KEYS 64
#define BSA_FWD_WARP_M_LARGE 32

namespace {

template <int HEAD_DIM, int TILE_M, int TILE_N>
struct FwdTile {
    static constexpr int WARP_M = TILE_M >= 128 ? BSA_FWD_WARP_M_LARGE : WARP_ROWS;
    static constexpr int MT = WARP_M / 16;                      // m16 tiles per warp
    static constexpr int WARPS = TILE_M / WARP_M;
    static constexpr int THREADS = WARPS * 32;
    static constexpr int STAGE_N = TILE_N < BSA_FWD_STAGE_KEYS ? TILE_N : BSA_FWD_STAGE_KEYS;
    static constexpr int STAGE_PAGES = STAGE_N / PAGE_ROWS;
    static constexpr int PAGES_M = TILE_M / PAGE_ROWS;          // Q pages per work item
    static constexpr int Q_ELEMS = TILE_M * HEAD_DIM;
    static constexpr int KV_ELEMS = STAGE_N * HEAD_DIM;
    static constexpr bool Q_IN_REGS = MT == 1;
    // K/V stage buffers: 3 for 64-row tiles (short stages need a deeper prefetch to cover HBM
    // latency), 2 for 128-row tiles (two CTAs per SM still fit).
    static constexpr int NBUF = TILE_M >= 128 ? 2 : 3;
    // Page ids and row masks of stage s are copied (cp.async, riding with the K group of stage
    // s - NBUF) into shared memory NBUF stages ahead and live until stage s is computed.
    static constexpr int META_SLOTS = 2 * NBUF;
    // sQ | sK[NBUF] | sV[NBUF] (bf16), then page ids (int) and row masks (uint32) per metadata slot.
    static constexpr int SMEM_BYTES = (Q_ELEMS + 2 * NBUF * KV_ELEMS) * 2 + META_SLOTS * STAGE_PAGES * 8;
    static_assert(TILE_N % STAGE_N == 0, "a tile is a whole number of stages");
    static_assert(NBUF >= 2 && NBUF <= 3, "wait_async_groups covers up to 2 stages ahead");
};

// cp.async.wait_group with a run-time count (0..5): all but the `pending` newest groups complete.
__device__ __forceinline__ void wait_async_groups(int pending) {
    switch (pending) {
        case 0: paged::cp_async_wait<0>(); break;
        case 1: paged::cp_async_wait<1>(); break;
        case 2: paged::cp_async_wait<2>(); break;
        case 3: paged::cp_async_wait<3>(); break;
        case 4: paged::cp_async_wait<4>(); break;
        default: paged::cp_async_wait<5>(); break;
    }
}

}  // namespace

template <int HEAD_DIM, int TILE_M, int TILE_N>
__global__ void __launch_bounds__(FwdTile<HEAD_DIM, TILE_M, TILE_N>::THREADS, 2)
bsa_fwd_kernel(const __nv_bfloat16* __restrict__ Q, const __nv_bfloat16* __restrict__ K,
               const __nv_bfloat16* __restrict__ V, __nv_bfloat16* __restrict__ O, float* __restrict__ LSE,
               const int* __restrict__ work_head, const int* __restrict__ own_pages, int own_stride,
               const int* __restrict__ stream_indptr, const int* __restrict__ stream_pages,
               const uint16_t* __restrict__ own_page_mask, const uint32_t* __restrict__ stream_entry_mask,
               int work_begin, int heads, int q_slots, int k_slots, float scale_log2) {
    using T = FwdTile<HEAD_DIM, TILE_M, TILE_N>;
    constexpr int MT = T::MT;
    constexpr int DK = HEAD_DIM / 16;        // k-steps of S = Q Kᵀ
    // pages per softmax chunk: 2 when a warp holds 32 rows of a d=128 O (register budget), else the stage
    constexpr int CHUNK_PAGES = (MT * HEAD_DIM > 128 && T::STAGE_PAGES > 2) ? 2 : T::STAGE_PAGES;
    constexpr int CNT = CHUNK_PAGES * 2;     // n8 accumulator tiles of one S chunk
    constexpr int KK_UNROLL = T::Q_IN_REGS ? DK : 4;
    constexpr int DT = HEAD_DIM / 8;         // n8 accumulator tiles of O

    extern __shared__ __align__(128) unsigned char smem_raw[];
    __nv_bfloat16* sQ = reinterpret_cast<__nv_bfloat16*>(smem_raw);
    int* sPage = reinterpret_cast<int*>(sQ + T::Q_ELEMS + 2 * T::NBUF * T::KV_ELEMS);
    uint32_t* sMask = reinterpret_cast<uint32_t*>(sPage + T::META_SLOTS * T::STAGE_PAGES);
    // 32-bit shared-window addresses of the tiles (ldmatrix / cp.async operands)
    const uint32_t aQ = paged::smem_u32(smem_raw);
    const uint32_t aK = aQ + T::Q_ELEMS * 2;
    const uint32_t aV = aK + T::NBUF * T::KV_ELEMS * 2;
    const uint32_t aPage = paged::smem_u32(sPage);
    const uint32_t aMask = paged::smem_u32(sMask);

    const int work = work_begin + blockIdx.x;
    const int batch = blockIdx.y;
    const int head = work_head[work];
    if (static_cast<unsigned>(head) >= static_cast<unsigned>(heads)) return;  // plan checked on host; never index with it
    const int q_pages = q_slots / PAGE_ROWS;
    const int k_pages = k_slots / PAGE_ROWS;
    const size_t bh = static_cast<size_t>(batch) * heads + head;
    const __nv_bfloat16* Qh = Q + bh * q_slots * HEAD_DIM;
    const __nv_bfloat16* Kh = K + bh * k_slots * HEAD_DIM;
    const __nv_bfloat16* Vh = V + bh * k_slots * HEAD_DIM;
    const int* my_own = own_pages + static_cast<size_t>(work) * own_stride;
    const int stream_begin = stream_indptr[work];
    const int stream_len = stream_indptr[work + 1] - stream_begin;
    const int* my_stream = stream_pages + stream_begin;
    const int num_stages = (stream_len + T::STAGE_PAGES - 1) / T::STAGE_PAGES;

    const int tid = threadIdx.x;
    const int warp = tid >> 5;
    const int lane = tid & 31;
    const int g = lane >> 2;
    const int t4 = lane & 3;
    const int warp_row0 = warp * T::WARP_M;

    // Metadata of stage `stage` (thread tid < STAGE_PAGES: one page): page id and row mask copied
    // asynchronously into its slot; entries past the list are zero-filled (mask 0: never read).
    // stream_entry_mask[i] is the row mask of stream_pages[i] (uint32, precomputed on the host).
    auto copy_meta = [&](int stage) {
        const int idx = stage * T::STAGE_PAGES + tid;
        const bool in_list = idx < stream_len;
        const int slot = (stage % T::META_SLOTS) * T::STAGE_PAGES + tid;
        paged::cp_async_4_zfill(aPage + slot * 4, my_stream + (in_list ? idx : 0), in_list);
        paged::cp_async_4_zfill(aMask + slot * 4, stream_entry_mask + stream_begin + (in_list ? idx : 0), in_list);
    };
    // K and V of stage `stage` (its metadata is already in shared memory); the K group also carries
    // the metadata of stage + NBUF, so it is visible by the time that stage is issued.
    auto issue_stage = [&](int stage) {
        const int buf = stage % T::NBUF;
        const int meta = (stage % T::META_SLOTS) * T::STAGE_PAGES;
        paged::gather_pages_staged<T::STAGE_N, HEAD_DIM, T::THREADS>(aK + buf * T::KV_ELEMS * 2, Kh, sPage + meta,
                                                                     sMask + meta, k_pages);
        if (tid < T::STAGE_PAGES) copy_meta(stage + T::NBUF);
        paged::cp_async_commit();
        paged::gather_pages_staged<T::STAGE_N, HEAD_DIM, T::THREADS>(aV + buf * T::KV_ELEMS * 2, Vh, sPage + meta,
                                                                     sMask + meta, k_pages);
        paged::cp_async_commit();
    };

    if (tid < T::STAGE_PAGES) {
#pragma unroll
        for (int st = 0; st < T::NBUF; ++st) copy_meta(st);
    }
    paged::cp_async_commit();
    paged::gather_pages<TILE_M, HEAD_DIM, T::THREADS>(aQ, Qh, my_own, T::PAGES_M, own_page_mask, q_pages);
    paged::cp_async_commit();
    paged::cp_async_wait<1>();  // the metadata of the first NBUF stages has landed (Q may be in flight)
    __syncthreads();
#pragma unroll
    for (int st = 0; st < T::NBUF - 1; ++st)
        if (st < num_stages) issue_stage(st);

    uint32_t qreg[T::Q_IN_REGS ? DK : 1][4];  // Q fragments of a 16-row warp, loaded once
    float acc[MT][DT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < DT; ++j) acc[mt][j][0] = acc[mt][j][1] = acc[mt][j][2] = acc[mt][j][3] = 0.f;
    float row_max[MT][2];  // running max of raw scores, rows g and g + 8 of each m16 tile
    float row_sum[MT][2];  // this lane's partial sums of exp2(...)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        row_max[mt][0] = row_max[mt][1] = -INFINITY;
        row_sum[mt][0] = row_sum[mt][1] = 0.f;
    }

    for (int stage = 0; stage < num_stages; ++stage) {
        const int buf = stage % T::NBUF;
        const int meta = (stage % T::META_SLOTS) * T::STAGE_PAGES;
        if (stage + T::NBUF - 1 < num_stages) issue_stage(stage + T::NBUF - 1);
        // stages issued after this one (their K and V groups may stay in flight)
        const int ahead = min(T::NBUF - 1, num_stages - 1 - stage);
        wait_async_groups(2 * ahead + 1);  // K of this stage has landed; its V may still be in flight
        __syncthreads();
        if constexpr (T::Q_IN_REGS) {
            if (stage == 0) {
#pragma unroll
                for (int kk = 0; kk < DK; ++kk) paged::load_a_frag<HEAD_DIM>(qreg[kk], aQ, warp_row0, kk);
            }
        }
        const int stage_pages = min(T::STAGE_PAGES, stream_len - stage * T::STAGE_PAGES);
        const uint32_t tK = aK + buf * T::KV_ELEMS * 2;
        const uint32_t tV = aV + buf * T::KV_ELEMS * 2;

        // The stage is processed in chunks of CHUNK_PAGES pages (S stays at MT * CHUNK_PAGES * 8
        // registers per lane): S = Q Kᵀ, exact per-key-column mask, online softmax, O += P V.
#pragma unroll 1
        for (int chunk = 0; chunk < T::STAGE_PAGES / CHUNK_PAGES; ++chunk) {
            const int p0 = chunk * CHUNK_PAGES;
            if (p0 >= stage_pages) break;  // uniform: stage_pages is the same for the whole CTA

            // S = Q Kᵀ: each K fragment feeds the MT m16 tiles of this warp
            float s[MT][CNT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int j = 0; j < CNT; ++j) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.f;
            // (Q fragments from registers need a fully unrolled k loop; from shared memory, a
            // 4-step unroll leaves ptxas the registers to keep the loop free of spills)
#pragma unroll KK_UNROLL
            for (int kk = 0; kk < DK; ++kk) {
                uint32_t a[MT][4];
                if constexpr (T::Q_IN_REGS) {
#pragma unroll
                    for (int r = 0; r < 4; ++r) a[0][r] = qreg[kk][r];
                } else {
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) paged::load_a_frag<HEAD_DIM>(a[mt], aQ, warp_row0 + 16 * mt, kk);
                }
                // No per-page branch here: pages past the list are zero-filled with mask 0, so they
                // contribute exactly nothing, and straight-line code lets ptxas hoist the ldmatrix
                // loads ahead of the mma chain (a branch per page serialized them).
#pragma unroll
                for (int p = 0; p < CHUNK_PAGES; ++p) {
                    uint32_t b[4];
                    paged::load_bt_frags<HEAD_DIM>(b, tK, (p0 + p) * PAGE_ROWS, kk);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        paged::mma_bf16_16816(s[mt][2 * p], a[mt], b[0], b[1]);
                        paged::mma_bf16_16816(s[mt][2 * p + 1], a[mt], b[2], b[3]);
                    }
                }
            }

            // exact per-key-column mask, then the online softmax update
#pragma unroll
            for (int p = 0; p < CHUNK_PAGES; ++p) {
                const uint32_t m16 = sMask[meta + p0 + p];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const uint32_t bits = paged::acc_col_bits(m16, 2 * p + h);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        float* sj = s[mt][2 * p + h];
                        if (!(bits & 1u)) { sj[0] = -INFINITY; sj[2] = -INFINITY; }
                        if (!(bits & 2u)) { sj[1] = -INFINITY; sj[3] = -INFINITY; }
                    }
                }
            }
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
                for (int j = 0; j < CNT; ++j) {
                    tile_max[0] = fmaxf(tile_max[0], fmaxf(s[mt][j][0], s[mt][j][1]));
                    tile_max[1] = fmaxf(tile_max[1], fmaxf(s[mt][j][2], s[mt][j][3]));
                }
                float base[2], alpha[2];
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const float new_max = fmaxf(row_max[mt][r], paged::quad_max(tile_max[r]));
                    base[r] = new_max == -INFINITY ? 0.f : new_max * scale_log2;
                    alpha[r] = exp2f(row_max[mt][r] * scale_log2 - base[r]);  // 0 when row_max was -inf
                    row_max[mt][r] = new_max;
                    row_sum[mt][r] *= alpha[r];
                }
                // rescale O only when some row of the warp saw a new maximum (warp-uniform branch)
                if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
                    for (int j = 0; j < DT; ++j) {
                        acc[mt][j][0] *= alpha[0];
                        acc[mt][j][1] *= alpha[0];
                        acc[mt][j][2] *= alpha[1];
                        acc[mt][j][3] *= alpha[1];
                    }
                }
#pragma unroll
                for (int j = 0; j < CNT; ++j) {
                    s[mt][j][0] = exp2f(fmaf(s[mt][j][0], scale_log2, -base[0]));
                    s[mt][j][1] = exp2f(fmaf(s[mt][j][1], scale_log2, -base[0]));
                    s[mt][j][2] = exp2f(fmaf(s[mt][j][2], scale_log2, -base[1]));
                    s[mt][j][3] = exp2f(fmaf(s[mt][j][3], scale_log2, -base[1]));
                    row_sum[mt][0] += s[mt][j][0] + s[mt][j][1];
                    row_sum[mt][1] += s[mt][j][2] + s[mt][j][3];
                }
            }

            if (chunk == 0) {  // V of this stage must have landed (the prefetched K, V may stay in flight)
                wait_async_groups(2 * ahead);
                __syncthreads();
            }
            // O += P V: one page of keys is one k-step; each V fragment feeds the MT m16 tiles
#pragma unroll
            for (int p = 0; p < CHUNK_PAGES; ++p) {
                uint32_t a[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) paged::acc_to_a_frag(a[mt], s[mt][2 * p], s[mt][2 * p + 1]);
#pragma unroll
                for (int dt = 0; dt < DT / 2; ++dt) {
                    uint32_t b[4];
                    paged::load_b_frags_trans<HEAD_DIM>(b, tV, (p0 + p) * PAGE_ROWS, 2 * dt);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        paged::mma_bf16_16816(acc[mt][2 * dt], a[mt], b[0], b[1]);
                        paged::mma_bf16_16816(acc[mt][2 * dt + 1], a[mt], b[2], b[3]);
                    }
                }
            }
        }
        __syncthreads();  // buffer `buf` is refilled by the next iteration's prefetch
    }

    // ---- epilogue: normalize, stage this warp's rows in sQ, store valid rows with 16-byte writes
    paged::cp_async_wait<0>();
    __syncthreads();
    __nv_bfloat16* sO = sQ;  // each warp overwrites only its own rows of sQ
    constexpr int CPR = HEAD_DIM / 8;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        float inv[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            row_sum[mt][r] = paged::quad_sum(row_sum[mt][r]);
            inv[r] = row_sum[mt][r] > 0.f ? 1.f / row_sum[mt][r] : 0.f;
        }
        const int tile_row0 = warp_row0 + 16 * mt;
#pragma unroll
        for (int j = 0; j < DT; ++j) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int row = tile_row0 + g + 8 * r;
                *reinterpret_cast<uint32_t*>(sO + paged::swizzle_offset<HEAD_DIM>(row, j) + 2 * t4) =
                    paged::pack_bf16x2(acc[mt][j][2 * r] * inv[r], acc[mt][j][2 * r + 1] * inv[r]);
            }
        }
        __syncwarp();
        const int page = my_own[tile_row0 / PAGE_ROWS];
        const uint32_t own_mask = paged::load_page_mask(own_page_mask, page, q_pages);
        if (own_mask == 0u) continue;  // padding page or no page: nothing to store
        const size_t row0 = bh * q_slots + static_cast<size_t>(page) * PAGE_ROWS;
#pragma unroll
        for (int i = 0; i < PAGE_ROWS * CPR / 32; ++i) {
            const int c = lane + 32 * i;
            const int r = c / CPR;
            const int chunk = c % CPR;
            if (paged::page_row_valid(own_mask, r)) {
                const uint4 v = *reinterpret_cast<const uint4*>(sO + paged::swizzle_offset<HEAD_DIM>(tile_row0 + r, chunk));
                *reinterpret_cast<uint4*>(O + (row0 + r) * HEAD_DIM + chunk * 8) = v;
            }
        }
        if (t4 == 0) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int rr = g + 8 * r;
                if (paged::page_row_valid(own_mask, rr))
                    LSE[row0 + rr] = row_sum[mt][r] > 0.f
                                         ? (row_max[mt][r] * scale_log2 + log2f(row_sum[mt][r])) * paged::kLn2
                                         : -INFINITY;
            }
        }
    }
}
