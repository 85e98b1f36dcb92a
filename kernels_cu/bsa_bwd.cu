// BSA backward: FlashAttention-2-style backward of block-sparse attention with exact masking,
// K/V-owned (plans.bsa_plan(graph, owner="kv")).
//
// One CTA per (work item, batch). A work item owns the BLOCK_K rows (BLOCK_K / 16 pages) of one
// K/V block of one head and streams the Q pages of every Q block that selected it, BLOCK_Q rows
// (BLOCK_Q / 16 pages) per step, computed SUB_Q columns at a time (register budget). Warp w owns
// K/V rows 16w..16w+15 (= owned page w) and keeps their dK and dV in fp32 registers for the whole
// stream; they are written once at the end (bf16).
// dQ contributions (dS · K) go to an fp32 buffer dq_accum [batch, heads, q_slots, HEAD_DIM] with
// vector atomics; bsa_bwd_postprocess turns it into bf16 dQ (times the softmax scale).
//
// Per streamed tile (transposed FA2 formulation, everything from the owned rows' point of view):
//   Sᵀ = K Qᵀ            (16 x SUB_Q per warp)
//   Pᵀ = exp(scale·Sᵀ − LSE[q])  (0 where the K row or the Q row is invalid)
//   dV += Pᵀ dO
//   dPᵀ = V dOᵀ
//   dSᵀ = Pᵀ ∘ (dPᵀ − Δ[q]),  Δ = rowsum(dO ∘ O) from bsa_bwd_preprocess
//   dK += dSᵀ Q           (scaled by `scale` at the end)
//   dQ[q] += dS K         (dSᵀ through shared memory; warps split dQ's rows and columns)
//
// Masking: invalid rows (page mask bits) of K, V, Q and dO are zero-filled in shared memory (never
// read from HBM), invalid Q rows get LSE = +inf (so P = 0) and Δ = 0, invalid K rows have P forced
// to 0. A valid row with LSE = -inf (no valid key) contributes nothing. So garbage or NaN in padding
// slots of any input never reaches a valid output.
#include "paged_attn_common.cuh"

// Per (head_dim, BLOCK_K): Q rows streamed per step (BLOCK_Q), Q rows computed at once (SUB_Q) and
// the CTAs per SM the register budget is cut for (MIN_BLOCKS). The dK/dV accumulators
// (2 x HEAD_DIM / 2 fp32 per thread) plus Sᵀ/dPᵀ (2 x SUB_Q / 2) live in registers; shared memory
// must let MIN_BLOCKS CTAs share an SM. Mirrored in src/sparseattn/kernels/bsa_backward.py (TILES).
#define BSA_BWD_TILES_HD64_BK64 64, 64, 2
#define BSA_BWD_TILES_HD64_BK128 64, 64, 1
#define BSA_BWD_TILES_HD128_BK64 32, 32, 2
#define BSA_BWD_TILES_HD128_BK128 64, 64, 1

namespace bsa_bwd {

using bf16 = __nv_bfloat16;

__device__ __forceinline__ float inf() { return __int_as_float(0x7f800000); }

// Element offset of (row, 16-byte chunk) in the swizzled dSᵀ tile [rows, COLS] (bf16).
// COLS >= 64: chunk ^ (row & 7); COLS = 32 (64-byte rows, two rows per 128-byte line):
// chunk ^ ((row >> 1) & 3). Either way ldmatrix of 8 consecutive rows at one chunk and the
// accumulator stores (8 rows x 4 words) hit 8 distinct 16-byte bank groups.
template <int COLS>
__device__ __forceinline__ int ds_offset(int row, int chunk) {
    static_assert(COLS == 32 || COLS % 64 == 0, "dS tile width must be 32 or a multiple of 64");
    if constexpr (COLS % 64 == 0) {
        return row * COLS + ((chunk ^ (row & 7)) << 3);
    } else {
        return row * COLS + ((chunk ^ ((row >> 1) & 3)) << 3);
    }
}

// b[0], b[1]: B operand (k16 x n8) of one n8 tile from a [k rows, HEAD_DIM] swizzled tile,
// k rows k0..k0+15, head-dim columns 8*dtile..8*dtile+7 (x2 variant of load_b_frags_trans).
template <int HEAD_DIM>
__device__ __forceinline__ void load_b_frag_trans_x2(uint32_t (&b)[2], const bf16* tile, int k0, int dtile) {
    const int lane = threadIdx.x & 31;
    const int row = k0 + (lane & 7) + ((lane >> 3) & 1) * 8;
    paged::ldmatrix_x2_trans(b, tile + paged::swizzle_offset<HEAD_DIM>(row, dtile));
}

// Two fp32 adds to consecutive addresses as one vector reduction (sm_90).
__device__ __forceinline__ void red_add_v2(float* addr, float a, float b) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" :: "l"(addr), "f"(a), "f"(b) : "memory");
}

template <int HEAD_DIM, int BLOCK_K, int BLOCK_Q, int SUB_Q, int MIN_BLOCKS>
struct Config {
    static constexpr int kWarps = BLOCK_K / 16;
    static constexpr int kThreads = kWarps * 32;
    static constexpr int kOwnPages = BLOCK_K / PAGE_ROWS;
    static constexpr int kStreamPages = BLOCK_Q / PAGE_ROWS;
    static constexpr int kSubSteps = BLOCK_Q / SUB_Q;
    static constexpr int kNTiles = SUB_Q / 8;           // n8 tiles of Sᵀ per warp and sub-step
    static constexpr int kDTiles = HEAD_DIM / 8;        // n8 tiles of dK / dV per warp
    // dQ = dS K (BLOCK_Q x HEAD_DIM) on a kDqWarpsM x kDqWarpsN warp grid, chosen to load the fewest
    // ldmatrix fragments per warp (one x4 per m16 tile of dS, one x4 per two n8 tiles of K).
    __host__ __device__ static constexpr int dq_cost(int wm) {
        const int wn = kWarps / wm;
        const int n_tiles = HEAD_DIM / wn / 8;
        const bool ok = (BLOCK_Q / 16) % wm == 0 && kWarps % wm == 0 && (HEAD_DIM / wn) % 8 == 0 &&
                        (n_tiles == 1 || n_tiles % 2 == 0);
        return ok ? 2 * (BLOCK_Q / 16 / wm) + n_tiles : 1 << 30;
    }
    __host__ __device__ static constexpr int dq_warps_m() {
        int best = 1;
        for (int wm = 2; wm <= kWarps; wm *= 2)
            if (dq_cost(wm) < dq_cost(best)) best = wm;
        return best;
    }
#ifdef BSA_BWD_DQ_WARPS_M  // tuning override (benchmark sweeps only)
    static constexpr int kDqWarpsM = BSA_BWD_DQ_WARPS_M;
#else
    static constexpr int kDqWarpsM = dq_warps_m();
#endif
    static constexpr int kDqWarpsN = kWarps / kDqWarpsM;
    static constexpr int kDqMTiles = BLOCK_Q / 16 / kDqWarpsM;  // m16 tiles of dQ per warp
    static constexpr int kDqCols = HEAD_DIM / kDqWarpsN;        // dQ columns per warp
    static constexpr int kDqTiles = kDqCols / 8;
    // shared memory: K, V (owned), Q, dO, dSᵀ (double-buffered), then per-row LSE, Δ, slot
    static constexpr int kSmemK = BLOCK_K * HEAD_DIM;
    static constexpr int kSmemQ = BLOCK_Q * HEAD_DIM;
    static constexpr int kSmemS = BLOCK_K * BLOCK_Q;
    static constexpr int kSmemBf16 = 2 * kSmemK + 4 * kSmemQ + 2 * kSmemS;
    static constexpr int kSmemBytes = kSmemBf16 * 2 + 2 * BLOCK_Q * 3 * 4;
    static constexpr int kMinBlocks = MIN_BLOCKS;
    static_assert(dq_cost(kDqWarpsM) < (1 << 30), "dQ warp grid does not divide the tile");
    static_assert(SUB_Q % 32 == 0 && BLOCK_Q % SUB_Q == 0 && BLOCK_K % 16 == 0, "tile sizes");
};

}  // namespace bsa_bwd

// Δ[b, h, s] = Σ_d dO[b, h, s, d] · O[b, h, s, d] (fp32), for every slot (padding included; the
// main kernel ignores padding rows). HEAD_DIM / 8 consecutive threads share one row.
template <int HEAD_DIM>
__global__ void __launch_bounds__(256) bsa_bwd_preprocess(const __nv_bfloat16* __restrict__ out,
                                                          const __nv_bfloat16* __restrict__ dout,
                                                          float* __restrict__ delta, long long rows) {
    constexpr int kLanesPerRow = HEAD_DIM / 8;
    const long long gid = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    const long long row = gid / kLanesPerRow;
    const int part = static_cast<int>(gid % kLanesPerRow);
    float acc = 0.f;
    if (row < rows) acc = paged::dot8_bf16(out + row * HEAD_DIM + part * 8, dout + row * HEAD_DIM + part * 8, acc);
#pragma unroll
    for (int off = kLanesPerRow / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (row < rows && part == 0) delta[row] = acc;
}

// dq[i] = bf16(dq_accum[i] · scale), 4 elements per thread.
__global__ void __launch_bounds__(256) bsa_bwd_postprocess(const float* __restrict__ dq_accum,
                                                           __nv_bfloat16* __restrict__ dq, float scale,
                                                           long long n4) {
    const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= n4) return;
    const float4 a = reinterpret_cast<const float4*>(dq_accum)[i];
    uint2 packed;
    packed.x = paged::pack_bf16x2(a.x * scale, a.y * scale);
    packed.y = paged::pack_bf16x2(a.z * scale, a.w * scale);
    reinterpret_cast<uint2*>(dq)[i] = packed;
}

// Grid (work items [work_offset, work_offset + gridDim.x) of one route, batch), block
// Config::kThreads, dynamic shared memory Config::kSmemBytes.
// Tensors: q, dout [B, H, q_slots, D]; k, v, dk, dv [B, H, k_slots, D] (bf16); lse, delta
// [B, H, q_slots] fp32; dq_accum [B, H, q_slots, D] fp32 (zeroed by the caller).
// Plan arrays (owner "kv"): work_head [W], own_pages [W, max_own] (K pages, -1 padded),
// stream_indptr [W + 1], stream_pages (Q pages), k_page_mask [k_slots/16], q_page_mask [q_slots/16].
template <int HEAD_DIM, int BLOCK_K, int BLOCK_Q, int SUB_Q, int MIN_BLOCKS>
__global__ void __launch_bounds__(bsa_bwd::Config<HEAD_DIM, BLOCK_K, BLOCK_Q, SUB_Q, MIN_BLOCKS>::kThreads,
                                  MIN_BLOCKS)
bsa_bwd_kernel(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
               const __nv_bfloat16* __restrict__ v, const __nv_bfloat16* __restrict__ dout,
               const float* __restrict__ lse, const float* __restrict__ delta,
               float* __restrict__ dq_accum, __nv_bfloat16* __restrict__ dk, __nv_bfloat16* __restrict__ dv,
               const int* __restrict__ work_head, const int* __restrict__ own_pages, int max_own,
               const int* __restrict__ stream_indptr, const int* __restrict__ stream_pages,
               const uint16_t* __restrict__ k_page_mask, const uint16_t* __restrict__ q_page_mask,
               int work_offset, int heads, int q_slots, int k_slots, float scale, float scale_log2) {
    using namespace bsa_bwd;
    using Cfg = Config<HEAD_DIM, BLOCK_K, BLOCK_Q, SUB_Q, MIN_BLOCKS>;
    constexpr int D = HEAD_DIM;

    extern __shared__ __align__(128) unsigned char smem_raw[];
    bf16* sK = reinterpret_cast<bf16*>(smem_raw);
    bf16* sV = sK + Cfg::kSmemK;
    bf16* sQ = sV + Cfg::kSmemK;           // [2][BLOCK_Q * D]
    bf16* sdO = sQ + 2 * Cfg::kSmemQ;      // [2][BLOCK_Q * D]
    bf16* sdS = sdO + 2 * Cfg::kSmemQ;     // [2][BLOCK_K][BLOCK_Q]
    float* sLse = reinterpret_cast<float*>(sdS + 2 * Cfg::kSmemS);  // [2][BLOCK_Q], log2 units
    float* sDelta = sLse + 2 * BLOCK_Q;                              // [2][BLOCK_Q]
    int* sSlot = reinterpret_cast<int*>(sDelta + 2 * BLOCK_Q);       // [2][BLOCK_Q], -1 = invalid

    const int tid = threadIdx.x;
    const int warp = tid >> 5;
    const int lane = tid & 31;
    const int g = lane >> 2;
    const int t = lane & 3;

    const int work = blockIdx.x + work_offset;
    const int head = work_head[work];
    const size_t bh = static_cast<size_t>(blockIdx.y) * heads + head;
    const bf16* q_bh = q + bh * q_slots * D;
    const bf16* do_bh = dout + bh * q_slots * D;
    const bf16* k_bh = k + bh * k_slots * D;
    const bf16* v_bh = v + bh * k_slots * D;
    const float* lse_bh = lse + bh * q_slots;
    const float* delta_bh = delta + bh * q_slots;
    float* dq_bh = dq_accum + bh * q_slots * D;
    const int q_pages = q_slots / PAGE_ROWS;
    const int k_pages = k_slots / PAGE_ROWS;

    const int* own = own_pages + static_cast<size_t>(work) * max_own;
    const int stream_begin = stream_indptr[work];
    const int stream_len = stream_indptr[work + 1] - stream_begin;
    const int num_tiles = (stream_len + Cfg::kStreamPages - 1) / Cfg::kStreamPages;

    // owned K/V pages (the warp's rows are exactly owned page `warp`)
    paged::gather_pages<BLOCK_K, D, Cfg::kThreads>(sK, k_bh, own, Cfg::kOwnPages, k_page_mask, k_pages);
    paged::gather_pages<BLOCK_K, D, Cfg::kThreads>(sV, v_bh, own, Cfg::kOwnPages, k_page_mask, k_pages);
    const uint32_t own_mask = paged::load_page_mask(k_page_mask, own[warp], k_pages);
    const bool kvalid_lo = paged::page_row_valid(own_mask, g);
    const bool kvalid_hi = paged::page_row_valid(own_mask, g + 8);

    auto load_stream_tile = [&](int tile, int buf) {
        const int* pages = stream_pages + stream_begin + tile * Cfg::kStreamPages;
        const int npages = min(Cfg::kStreamPages, stream_len - tile * Cfg::kStreamPages);
        paged::gather_pages<BLOCK_Q, D, Cfg::kThreads>(sQ + buf * Cfg::kSmemQ, q_bh, pages, npages,
                                                       q_page_mask, q_pages);
        paged::gather_pages<BLOCK_Q, D, Cfg::kThreads>(sdO + buf * Cfg::kSmemQ, do_bh, pages, npages,
                                                       q_page_mask, q_pages);
        for (int row = tid; row < BLOCK_Q; row += Cfg::kThreads) {
            const int p = row / PAGE_ROWS;
            const int r = row % PAGE_ROWS;
            const int page = p < npages ? pages[p] : -1;
            const bool valid = paged::page_row_valid(paged::load_page_mask(q_page_mask, page, q_pages), r);
            const int slot = page * PAGE_ROWS + r;
            const float l = valid ? lse_bh[slot] : -inf();
            sLse[buf * BLOCK_Q + row] = l > -inf() ? l * paged::kLog2e : inf();
            sDelta[buf * BLOCK_Q + row] = valid ? delta_bh[slot] : 0.f;
            sSlot[buf * BLOCK_Q + row] = valid ? slot : -1;
        }
    };

    if (num_tiles > 0) load_stream_tile(0, 0);
    paged::cp_async_commit();

    float acc_dk[Cfg::kDTiles][4];
    float acc_dv[Cfg::kDTiles][4];
#pragma unroll
    for (int i = 0; i < Cfg::kDTiles; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dk[i][e] = acc_dv[i][e] = 0.f;

    // Two barriers per step: after the top one every thread is done with step tile-1, so the
    // prefetch may overwrite its buffers; dSᵀ is double-buffered, so the dQ phase of this step
    // needs no barrier after it.
    for (int tile = 0; tile < num_tiles; ++tile) {
        const int buf = tile & 1;
        paged::cp_async_wait<0>();
        __syncthreads();
        if (tile + 1 < num_tiles) load_stream_tile(tile + 1, buf ^ 1);
        paged::cp_async_commit();
        const bf16* tQ = sQ + buf * Cfg::kSmemQ;
        const bf16* tdO = sdO + buf * Cfg::kSmemQ;
        const float* tLse = sLse + buf * BLOCK_Q;
        const float* tDelta = sDelta + buf * BLOCK_Q;
        bf16* tdS = sdS + buf * Cfg::kSmemS;

#pragma unroll 1
        for (int sub = 0; sub < Cfg::kSubSteps; ++sub) {
            const int c0 = sub * SUB_Q;  // first streamed row (column of Sᵀ) of this sub-step
            // Sᵀ = K Qᵀ and dPᵀ = V dOᵀ (16 owned rows x SUB_Q streamed columns per warp)
            float s[Cfg::kNTiles][4];
            float dp[Cfg::kNTiles][4];
#pragma unroll
            for (int n = 0; n < Cfg::kNTiles; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.f;
#pragma unroll
            for (int ks = 0; ks < D / 16; ++ks) {
                uint32_t ak[4];
                paged::load_a_frag<D>(ak, sK, warp * 16, ks);
#pragma unroll
                for (int np = 0; np < Cfg::kNTiles / 2; ++np) {
                    uint32_t bq[4];
                    paged::load_bt_frags<D>(bq, tQ, c0 + np * 16, ks);
                    paged::mma_bf16_16816(s[2 * np], ak, bq[0], bq[1]);
                    paged::mma_bf16_16816(s[2 * np + 1], ak, bq[2], bq[3]);
                }
            }
#pragma unroll
            for (int ks = 0; ks < D / 16; ++ks) {
                uint32_t av[4];
                paged::load_a_frag<D>(av, sV, warp * 16, ks);
#pragma unroll
                for (int np = 0; np < Cfg::kNTiles / 2; ++np) {
                    uint32_t bdo[4];
                    paged::load_bt_frags<D>(bdo, tdO, c0 + np * 16, ks);
                    paged::mma_bf16_16816(dp[2 * np], av, bdo[0], bdo[1]);
                    paged::mma_bf16_16816(dp[2 * np + 1], av, bdo[2], bdo[3]);
                }
            }

            // Pᵀ (in s) and dSᵀ (in dp)
#pragma unroll
            for (int n = 0; n < Cfg::kNTiles; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int col = c0 + n * 8 + 2 * t + (e & 1);
                    const bool kvalid = (e < 2) ? kvalid_lo : kvalid_hi;
                    const float p = kvalid ? exp2f(fmaf(s[n][e], scale_log2, -tLse[col])) : 0.f;
                    s[n][e] = p;
                    dp[n][e] = p * (dp[n][e] - tDelta[col]);
                }
            }

            // dV += Pᵀ dO, dK += dSᵀ Q (k = streamed rows)
#pragma unroll
            for (int kk = 0; kk < SUB_Q / 16; ++kk) {
                uint32_t ap[4];
                paged::acc_to_a_frag(ap, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
                for (int dt = 0; dt < Cfg::kDTiles / 2; ++dt) {
                    uint32_t bdo[4];
                    paged::load_b_frags_trans<D>(bdo, tdO, c0 + kk * 16, dt * 2);
                    paged::mma_bf16_16816(acc_dv[2 * dt], ap, bdo[0], bdo[1]);
                    paged::mma_bf16_16816(acc_dv[2 * dt + 1], ap, bdo[2], bdo[3]);
                }
            }
#pragma unroll
            for (int kk = 0; kk < SUB_Q / 16; ++kk) {
                uint32_t ads[4];
                paged::acc_to_a_frag(ads, dp[2 * kk], dp[2 * kk + 1]);
#pragma unroll
                for (int dt = 0; dt < Cfg::kDTiles / 2; ++dt) {
                    uint32_t bq[4];
                    paged::load_b_frags_trans<D>(bq, tQ, c0 + kk * 16, dt * 2);
                    paged::mma_bf16_16816(acc_dk[2 * dt], ads, bq[0], bq[1]);
                    paged::mma_bf16_16816(acc_dk[2 * dt + 1], ads, bq[2], bq[3]);
                }
            }

            // dSᵀ -> shared (bf16)
#pragma unroll
            for (int n = 0; n < Cfg::kNTiles; ++n) {
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int row = warp * 16 + g + half * 8;
                    *reinterpret_cast<uint32_t*>(tdS + ds_offset<BLOCK_Q>(row, c0 / 8 + n) + 2 * t) =
                        paged::pack_bf16x2(dp[n][2 * half], dp[n][2 * half + 1]);
                }
            }
        }
        __syncthreads();

        // dQ = dS K (BLOCK_Q x D) on the Cfg::kDqWarpsM x kDqWarpsN warp grid
        float dq[Cfg::kDqMTiles][Cfg::kDqTiles][4];
#pragma unroll
        for (int m = 0; m < Cfg::kDqMTiles; ++m)
#pragma unroll
            for (int n = 0; n < Cfg::kDqTiles; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) dq[m][n][e] = 0.f;
        const int mtile0 = (warp / Cfg::kDqWarpsN) * Cfg::kDqMTiles;
        const int dtile0 = (warp % Cfg::kDqWarpsN) * Cfg::kDqTiles;
#pragma unroll
        for (int kk = 0; kk < BLOCK_K / 16; ++kk) {
            uint32_t bk[Cfg::kDqTiles][2];
            if constexpr (Cfg::kDqTiles == 1) {
                load_b_frag_trans_x2<D>(bk[0], sK, kk * 16, dtile0);
            } else {
#pragma unroll
                for (int n = 0; n < Cfg::kDqTiles; n += 2) {
                    uint32_t b4[4];
                    paged::load_b_frags_trans<D>(b4, sK, kk * 16, dtile0 + n);
                    bk[n][0] = b4[0];
                    bk[n][1] = b4[1];
                    bk[n + 1][0] = b4[2];
                    bk[n + 1][1] = b4[3];
                }
            }
#pragma unroll
            for (int m = 0; m < Cfg::kDqMTiles; ++m) {
                // A = dS (q rows x kv cols) read transposed from dSᵀ [kv][q]
                uint32_t a[4];
                const int kv_row = kk * 16 + (lane & 7) + (lane >> 4) * 8;
                const int q_chunk = (mtile0 + m) * 2 + ((lane >> 3) & 1);
                paged::ldmatrix_x4_trans(a, tdS + ds_offset<BLOCK_Q>(kv_row, q_chunk));
#pragma unroll
                for (int n = 0; n < Cfg::kDqTiles; ++n)
                    paged::mma_bf16_16816(dq[m][n], a, bk[n][0], bk[n][1]);
            }
        }
        const int* tSlot = sSlot + buf * BLOCK_Q;
#pragma unroll
        for (int m = 0; m < Cfg::kDqMTiles; ++m) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int slot = tSlot[(mtile0 + m) * 16 + g + half * 8];
                if (slot >= 0) {
                    float* row_ptr = dq_bh + static_cast<size_t>(slot) * D + 2 * t;
#pragma unroll
                    for (int n = 0; n < Cfg::kDqTiles; ++n)
                        red_add_v2(row_ptr + (dtile0 + n) * 8, dq[m][n][2 * half], dq[m][n][2 * half + 1]);
                }
            }
        }
    }

    // Write dK (scaled) and dV once: stage bf16 in the K/V tiles, then 16-byte coalesced stores of
    // every row of the owned pages (invalid rows hold 0).
    paged::cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int dt = 0; dt < Cfg::kDTiles; ++dt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = warp * 16 + g + half * 8;
            const int off = paged::swizzle_offset<D>(row, dt) + 2 * t;
            *reinterpret_cast<uint32_t*>(sK + off) =
                paged::pack_bf16x2(acc_dk[dt][2 * half] * scale, acc_dk[dt][2 * half + 1] * scale);
            *reinterpret_cast<uint32_t*>(sV + off) =
                paged::pack_bf16x2(acc_dv[dt][2 * half], acc_dv[dt][2 * half + 1]);
        }
    }
    __syncthreads();
    bf16* dk_bh = dk + bh * k_slots * D;
    bf16* dv_bh = dv + bh * k_slots * D;
    constexpr int kChunksPerRow = D / 8;
#pragma unroll
    for (int i = 0; i < BLOCK_K * kChunksPerRow / Cfg::kThreads; ++i) {
        const int c = tid + i * Cfg::kThreads;
        const int row = c / kChunksPerRow;
        const int chunk = c % kChunksPerRow;
        const int page = own[row / PAGE_ROWS];
        if (static_cast<unsigned>(page) < static_cast<unsigned>(k_pages)) {
            const size_t dst = (static_cast<size_t>(page) * PAGE_ROWS + row % PAGE_ROWS) * D + chunk * 8;
            const int src = paged::swizzle_offset<D>(row, chunk);
            *reinterpret_cast<uint4*>(dk_bh + dst) = *reinterpret_cast<const uint4*>(sK + src);
            *reinterpret_cast<uint4*>(dv_bh + dst) = *reinterpret_cast<const uint4*>(sV + src);
        }
    }
}

// Explicit instantiations (NVRTC callers name the same ones through name_expressions).
template __global__ void bsa_bwd_preprocess<64>(const __nv_bfloat16*, const __nv_bfloat16*, float*,
                                                 long long);
template __global__ void bsa_bwd_preprocess<128>(const __nv_bfloat16*, const __nv_bfloat16*, float*,
                                                  long long);

#define BSA_BWD_INSTANTIATE(D, BK, ...)                                                                  \
    template __global__ void bsa_bwd_kernel<D, BK, __VA_ARGS__>(                                        \
        const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*,        \
        const float*, const float*, float*, __nv_bfloat16*, __nv_bfloat16*, const int*, const int*, int, \
        const int*, const int*, const uint16_t*, const uint16_t*, int, int, int, int, float, float);
BSA_BWD_INSTANTIATE(64, 64, BSA_BWD_TILES_HD64_BK64)
BSA_BWD_INSTANTIATE(64, 128, BSA_BWD_TILES_HD64_BK128)
BSA_BWD_INSTANTIATE(128, 64, BSA_BWD_TILES_HD128_BK64)
BSA_BWD_INSTANTIATE(128, 128, BSA_BWD_TILES_HD128_BK128)
