// Paged attention backward on wgmma (sm_90a), K/V-owned: the same plan, arguments and results as
// bsa_bwd_kernel (bsa_bwd.cu), whose preprocess (Δ = rowsum(dO ∘ O)) and postprocess (dQ = bf16(scale ·
// dq_accum)) kernels it shares.
//
// One CTA per (work item, batch). A work item owns the BLOCK_K rows (BLOCK_K / 16 pages) of one K/V
// block of one head; each consumer warpgroup owns 64 of them and keeps their dK and dV in fp32
// registers for the whole stream. The Q pages of every Q block that selected the block stream through
// in steps of 64 rows (4 pages), double-buffered with cp.async into the 128-byte-swizzle tiles wgmma
// reads. Per step, per warpgroup (transposed formulation, from the owned rows' point of view):
//   Sᵀ  = K·Qᵀ                     wgmma SS, 64 x 64
//   dPᵀ = V·dOᵀ                    wgmma SS, 64 x 64
//   Pᵀ  = exp2(Sᵀ·scale·log2e − LSE₂[q])   0 for invalid K rows; invalid Q rows have LSE₂ = +inf
//   dSᵀ = Pᵀ ∘ (dPᵀ − Δ[q])
//   dV += Pᵀ·dO                    wgmma RS (Pᵀ from registers), 64 x HEAD_DIM
//   dK += dSᵀ·Q                    wgmma RS (dSᵀ from registers)
//   dQ += dS·K                     dSᵀ (bf16) through shared memory; wgmma SS with both operands
//                                  transposed, 64 x 64 per head-dim half, fp32 vector atomics
// dK is scaled by `scale` at the end, dQ by the postprocess. Invalid rows of K, V, Q and dO are
// zero-filled in shared memory and never read, so NaN in padding never reaches a valid output.
//
// Simple synchronous structure: every thread copies and computes, one __syncthreads per step; the
// prefetch of step t + 1 overlaps the GEMMs of step t.
//
// Q_SPLIT = 2 (64-row owned tiles only): two warpgroups share the 64 owned rows and split each step's
// 128 streamed rows, 64 each; each keeps its own dK/dV partial, and warpgroup 1 hands its partial to
// warpgroup 0 through shared memory at the end. Q_SPLIT = 1 is version 1 (H200-verified at aba13e4).
//
// DQ_MODE selects how dQ partials reach the accumulator:
//   0 (DQ_ATOMIC): fp32 vector atomics (red.global.add.v2.f32) per row;
//   1 (DQ_BULK): each step's dQ partial is staged in fp32 over the step's Q and dO buffers (free once every
//     GEMM of the step has finished), one 16-row page contiguous per 16·HEAD_DIM·4 bytes, and one thread
//     adds each page to dq_accum with one bulk asynchronous reduction (cp.reduce.async.bulk .add.f32)
//     instead of 16·HEAD_DIM / 2 vector atomics per page. Invalid rows of a page hold exactly 0;
//   2 (DQ_FIXED, deterministic): every partial is rounded once to a 64-bit fixed-point integer and added
//     with integer atomics (red.global.add.u64). Integer addition is associative, so dQ is bit-identical
//     whatever order the CTAs and steps add in. The fixed-point unit 2^-F comes from a bound on |dQ|
//     (paged_bwd::fixed_point_scale): |Σ_j dS_ij K_jc| ≤ Σ_j P_ij (|dP_ij| + |Δ_i|) |K_jc| ≤ 2·d·|dO|·|V|·|K|
//     (maxima over valid rows, Σ_j P_ij = 1), scaled to stay under 2^60;
//   3 (DQ_NONE): no dQ at all (no dSᵀ store, no dQ GEMM): paged_bwd_dq_kernel computes dQ in a Q-owned
//     pass of its own, with no atomics.
//
// PAGED_BWD_WG_DQ (opt-in, paged_bwd_ws_kernel only): each consumer warpgroup computes the dQ of its own 64
// owned rows over every head-dim column (dQ_w = dS_w · K_w, K-dim 64) and has its own fp32 staging buffer,
// reduced by producer warp 2 + w; LSE₂ and Δ are staged per warpgroup. The two warpgroups then share no
// barrier inside the loop (only 128-thread barriers of their own), at twice the dQ reduction traffic on the
// steps both see (a pair step one half sees no page of is skipped by that half and its reducing warp alike).
// PAGED_BWD_WG_OFFSET (with PAGED_BWD_WG_DQ): warpgroup 1 starts its loop once warpgroup 0 has issued its first
// step's dV and dK, so that the two run half a step apart.
// PAGED_BWD_WG_SUM (with PAGED_BWD_WG_DQ): one staging buffer: warpgroup 0 stores its dQ partial, warpgroup 1
// adds its own to it (a named barrier between them per step), warp 3 reduces the sum: PAGED_BWD_WG_DQ's
// reduction traffic, not twice it, and 32 KB less shared memory.
// PAGED_BWD_TOKENS (the token-order build, beside the slot-order one): q, k, v, dO, dK and dV are
// [batch, tokens, tok_heads, HEAD_DIM] and slot s of (batch · head) row bh is token q_map / k_map[map row
// + s] (-1: padding) of batch bh / tok_heads, head bh % tok_heads (the forward's PAGED_FWD_TOKENS maps;
// map row bh · slots when maps_per_row, else 0). paged_bwd_kernel and paged_bwd_ws_kernel gather their
// pages by token and store each valid dK / dV row to its token; LSE, Δ and dq_accum stay in slot order;
// tokens_bwd_preprocess / tokens_bwd_postprocess read O and dO / write dQ by token.
#include "hopper_wgmma.cuh"

#define PB_Q_ROWS 64  // streamed Q rows per warpgroup and step

#ifdef PAGED_BWD_TOKENS
#define PAGED_BWD_TOKEN_PARAMS                                                                               \
    , const int* __restrict__ q_map, const int* __restrict__ k_map, int q_tokens, int k_tokens, int tok_heads, \
        int maps_per_row
#define PAGED_BWD_TOKEN_TYPES , const int*, const int*, int, int, int, int
#else
#define PAGED_BWD_TOKEN_PARAMS
#define PAGED_BWD_TOKEN_TYPES
#endif

namespace paged_bwd {

enum DqMode { DQ_ATOMIC = 0, DQ_BULK = 1, DQ_FIXED = 2, DQ_NONE = 3 };

template <int HEAD_DIM, int BLOCK_K, int Q_SPLIT = 1, int DQ_MODE = DQ_ATOMIC>
struct Config {
    static constexpr int kKvWGs = BLOCK_K / 64;              // warpgroups along the owned rows
    static constexpr int kConsumerWGs = kKvWGs * Q_SPLIT;
    static constexpr int kThreads = 128 * kConsumerWGs;
    static constexpr int kWarps = kThreads / 32;
    static constexpr int kOwnPages = BLOCK_K / PAGE_ROWS;
    static constexpr int kQStep = PB_Q_ROWS * Q_SPLIT;        // streamed rows per step
    static constexpr int kStreamPages = kQStep / PAGE_ROWS;
    static constexpr int kKBytes = BLOCK_K * HEAD_DIM * 2;    // K or V (owned), canonical swizzled tile
    static constexpr int kQBytes = kQStep * HEAD_DIM * 2;     // one Q or dO buffer
    static constexpr int kSBytes = BLOCK_K * PB_Q_ROWS * 2;   // dSᵀ [BLOCK_K][64] bf16 of one Q slice
    static constexpr int kMetaBytes = 3 * 2 * kQStep * 4;     // LSE₂, Δ, slot per streamed row, x2
    static constexpr int kSmemBytes = 1024 + 2 * kKBytes + 4 * kQBytes + Q_SPLIT * kSBytes + kMetaBytes;
    static_assert(BLOCK_K == 64 || BLOCK_K == 128, "owned tile of 64 or 128 rows");
    static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "head dim 64 or 128");
    static_assert(Q_SPLIT == 1 || (Q_SPLIT == 2 && BLOCK_K == 64), "the Q split is for 64-row owned tiles");
    static_assert(Q_SPLIT == 1 || 4 * kQBytes >= 2 * 64 * HEAD_DIM * 4, "the dK/dV hand-off must fit Q and dO");
    static constexpr int kPageBytesF32 = PAGE_ROWS * HEAD_DIM * 4;  // one staged dQ page
    static_assert(DQ_MODE != DQ_BULK || 2 * kQBytes == kStreamPages * kPageBytesF32, "dQ staging fills Q and dO");
    static_assert(DQ_MODE >= DQ_ATOMIC && DQ_MODE <= DQ_NONE, "dQ mode 0, 1, 2 or 3");
    static_assert(kSmemBytes <= 227 * 1024, "over the per-block shared-memory limit");
};

__device__ __forceinline__ void bulk_reduce_add_f32(float* gmem, uint32_t smem, uint32_t bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(gmem), "r"(smem),
                 "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// The bulk operations issued so far have finished reading shared memory.
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
// ... and have completed.
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

__device__ __forceinline__ void red_add_v2(float* addr, float a, float b) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(addr), "f"(a), "f"(b) : "memory");
}

// Fixed-point accumulation (DQ_FIXED): x is rounded once to an integer multiple of 1 / unit.
__device__ __forceinline__ void red_add_fixed(unsigned long long* addr, float x, float unit) {
    const long long i = __float2ll_rn(x * unit);
    asm volatile("red.global.add.u64 [%0], %1;\n" ::"l"(addr), "l"(static_cast<unsigned long long>(i)) : "memory");
}

// Exponent e with |x| < 2^e for a bf16 magnitude (bits without sign; 0 -> -200).
__device__ __forceinline__ int bf16_exponent_bound(unsigned int bits) {
    const int field = static_cast<int>(bits >> 7) & 0xff;
    return bits == 0u ? -200 : (field == 0 ? -125 : field - 126);
}

// The fixed-point unit 2^(60 - e) for the bound 2·d·|dO|·|V|·|K| < 2^e; absmax: bf16 magnitude bits of
// the valid rows' maxima of dO, V and K (bwd_absmax_bf16). The unit stays a normal float.
__device__ __forceinline__ float fixed_point_scale(const unsigned int* __restrict__ absmax, int head_dim) {
    const int log2_2d = head_dim == 64 ? 7 : 8;
    int e = bf16_exponent_bound(absmax[0]) + bf16_exponent_bound(absmax[1]) + bf16_exponent_bound(absmax[2]) + log2_2d;
    e = max(-66, min(e, 186));
    return ldexpf(1.f, 60 - e);
}


// S = A·Bᵀ for 64 rows of an A tile (A_ROWS rows: its column-block stride) against the 64 rows starting at
// bRows of a B_ROWS-row tile (K-major operands): issue_qk for a B slice of a taller tile.
template <int HEAD_DIM, int B_ROWS>
__device__ __forceinline__ void issue_qk_slice(float (&s)[32], uint32_t aRows, int a_rows, uint32_t bRows) {
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
        const uint32_t col = static_cast<uint32_t>(kk & 3) * 32u;
        const uint64_t da = hopper::smem_desc(aRows + (kk >> 2) * (a_rows * 128) + col, 16, 1024);
        const uint64_t db = hopper::smem_desc(bRows + (kk >> 2) * (B_ROWS * 128) + col, 16, 1024);
        hopper::wgmma_ss<64>(s, da, db, kk > 0);
    }
}

// O += P·B over 64 k-rows starting at bRows of a B_ROWS-row tile (MN-major B), P from registers.
template <int HEAD_DIM, int B_ROWS>
__device__ __forceinline__ void issue_pv_slice(float (&o)[HEAD_DIM / 2], const uint32_t (&pa)[4][4], uint32_t bRows) {
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        const uint64_t db = hopper::smem_desc(bRows + p * (PAGE_ROWS * 128), B_ROWS * 128, 1024);
        hopper::wgmma_rs_tb<HEAD_DIM>(o, pa[p], db);
    }
}


// dQ[:, 64 columns] = dS · K[:, 64 columns] for 64 streamed rows: A = the [BLOCK_K][64] dSᵀ tile, B = one
// 64-column block of the BLOCK_K-row K tile (both MN-major), K-dim = the BLOCK_K owned rows.
template <int BLOCK_K>
__device__ __forceinline__ void issue_dq(float (&dq)[32], uint32_t tdS, uint32_t tKcols) {
#pragma unroll
    for (int kk = 0; kk < BLOCK_K / 16; ++kk) {
        const uint64_t da = hopper::smem_desc(tdS + kk * (PAGE_ROWS * 128), BLOCK_K * 128, 1024);
        const uint64_t db = hopper::smem_desc(tKcols + kk * (PAGE_ROWS * 128), BLOCK_K * 128, 1024);
        hopper::wgmma_ss_tt<64>(dq, da, db, kk > 0);
    }
}

// dQ (64 streamed rows x HEAD_DIM) = dS_w · K_w over one warpgroup's 64 owned rows: A = its 64-row half
// of the [BLOCK_K][64] dSᵀ tile (from tdSRows), B = the 64 owned rows of the BLOCK_K-row K tile (from
// tKRows), both MN-major, K-dim 64 (PAGED_BWD_WG_DQ).
template <int HEAD_DIM, int BLOCK_K>
__device__ __forceinline__ void issue_dq_own(float (&dq)[HEAD_DIM / 2], uint32_t tdSRows, uint32_t tKRows) {
#pragma unroll
    for (int kk = 0; kk < 64 / PAGE_ROWS; ++kk) {
        const uint64_t da = hopper::smem_desc(tdSRows + kk * (PAGE_ROWS * 128), BLOCK_K * 128, 1024);
        const uint64_t db = hopper::smem_desc(tKRows + kk * (PAGE_ROWS * 128), BLOCK_K * 128, 1024);
        if (kk == 0)
            hopper::wgmma_ss_tt_first<HEAD_DIM>(dq, da, db);
        else
            hopper::wgmma_ss_tt<HEAD_DIM>(dq, da, db, 1);
    }
}

// The owned pages of one work item, both matrices (K and V, or Q and dO; element offset bh_offset of the
// (batch, head)): warp w of WARPS copies pages w, w + WARPS, ... of the 2 · ROWS / 16 into tiles tA and tB
// (ROWS-row swizzled).
template <int HEAD_DIM, int ROWS, int WARPS>
__device__ __forceinline__ void load_owned_pages(uint32_t tA, uint32_t tB, const __nv_bfloat16* a,
                                                 const __nv_bfloat16* b, size_t bh_offset, const int* own,
                                                 const uint16_t* __restrict__ page_mask, int num_pages, int warp) {
    constexpr int kOwnPages = ROWS / PAGE_ROWS;
    for (int i = warp; i < 2 * kOwnPages; i += WARPS) {
        const int p = i % kOwnPages;
        const int page[1] = {own[p]};
        const uint32_t mask[1] = {paged::load_page_mask(page_mask, page[0], num_pages)};
        hopper::warp_copy_pages<HEAD_DIM, ROWS, 1>(i < kOwnPages ? tA : tB, p * PAGE_ROWS,
                                                   (i < kOwnPages ? a : b) + bh_offset, num_pages, page, mask);
    }
}

// Pᵀ and dSᵀ in place of Sᵀ and dPᵀ (accumulator layout: owned rows g / g + 8 of the warp, streamed
// columns 8j + 2·t4 (+1)): P = exp2(S·scale_log2 − LSE₂[col]), 0 for invalid owned rows; dS = P ∘ (dP − Δ[col]).
__device__ __forceinline__ void p_and_ds(float (&s)[PB_Q_ROWS / 2], float (&dp)[PB_Q_ROWS / 2], bool kvalid_lo,
                                         bool kvalid_hi, const float* t_lse, const float* t_delta, float scale_log2,
                                         int t4) {
#pragma unroll
    for (int j = 0; j < PB_Q_ROWS / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int col = 8 * j + 2 * t4 + (e & 1);
            const bool kvalid = e < 2 ? kvalid_lo : kvalid_hi;
            const float p = kvalid ? exp2f(fmaf(s[4 * j + e], scale_log2, -t_lse[col])) : 0.f;
            s[4 * j + e] = p;
            dp[4 * j + e] = p * (dp[4 * j + e] - t_delta[col]);
        }
    }
}

// One step of paged_bwd_ws_kernel's consumer warpgroup up to its A fragments: Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ
// (wgmma SS over its 64 owned rows aK / aV and the step's 64 streamed rows tQ / tdO), `during_gemms()`
// while they run (global loads), then Pᵀ and dSᵀ (p_and_ds) packed into pa and pds. WRITE_FIRST: the
// chains' first k-step writes the accumulators without reading them.
template <int HEAD_DIM, int BLOCK_K, bool WRITE_FIRST, class DuringGemms>
__device__ __forceinline__ void step_p_ds(uint32_t (&pa)[PB_Q_ROWS / PAGE_ROWS][4],
                                          uint32_t (&pds)[PB_Q_ROWS / PAGE_ROWS][4], uint32_t aK, uint32_t aV,
                                          uint32_t tQ, uint32_t tdO, bool kvalid_lo, bool kvalid_hi,
                                          const float* t_lse, const float* t_delta, float scale_log2, int t4,
                                          DuringGemms&& during_gemms) {
    constexpr int QS = PB_Q_ROWS;
    float s[QS / 2];
    float dp[QS / 2];
    hopper::wgmma_fence();
    hopper::issue_qk<HEAD_DIM, QS, BLOCK_K, false, false, QS, WRITE_FIRST>(s, aK, tQ);
    hopper::wgmma_commit();
    hopper::issue_qk<HEAD_DIM, QS, BLOCK_K, false, false, QS, WRITE_FIRST>(dp, aV, tdO);
    hopper::wgmma_commit();
    during_gemms();
    hopper::wgmma_wait<0>();
    hopper::pin_registers(s);
    hopper::pin_registers(dp);
    p_and_ds(s, dp, kvalid_lo, kvalid_hi, t_lse, t_delta, scale_log2, t4);
    hopper::pack_p<QS>(pa, s);
    hopper::pack_p<QS>(pds, dp);
}

// dV += Pᵀ·dO and dK += dSᵀ·Q (wgmma RS, the A fragments from registers), committed apart.
template <int HEAD_DIM>
__device__ __forceinline__ void issue_dv_dk(float (&acc_dv)[HEAD_DIM / 2], float (&acc_dk)[HEAD_DIM / 2],
                                            const uint32_t (&pa)[PB_Q_ROWS / PAGE_ROWS][4],
                                            const uint32_t (&pds)[PB_Q_ROWS / PAGE_ROWS][4], uint32_t tQ,
                                            uint32_t tdO) {
    hopper::wgmma_fence();
    hopper::issue_pv<HEAD_DIM, PB_Q_ROWS>(acc_dv, pa, tdO);
    hopper::wgmma_commit();
    hopper::issue_pv<HEAD_DIM, PB_Q_ROWS>(acc_dk, pds, tQ);
    hopper::wgmma_commit();
}

// dSᵀ (bf16 A fragments) -> shared: owned row r, streamed column c at (r, chunk c / 8) of the
// [BLOCK_K][64] tile; the rows of warp wq of the warpgroup owning rows 64·kvp ...
template <int BLOCK_K>
__device__ __forceinline__ void store_ds(uint32_t tdS, const uint32_t (&pds)[PB_Q_ROWS / PAGE_ROWS][4], int kvp,
                                         int wq, int g, int t4) {
#pragma unroll
    for (int j = 0; j < PB_Q_ROWS / 8; ++j) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = kvp * 64 + 16 * wq + g + 8 * half;
            const uint32_t addr = tdS + hopper::tile_offset<BLOCK_K>(row, j) + 4u * t4;
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(pds[j >> 1][(j & 1) * 2 + half]) : "memory");
        }
    }
}

// Register blocks of a 64-column accumulator slice permuted so that v[4j ..] holds column block j ^ (g & 3)
// (two conditional swaps, bits 0 and 1 of g): the store order of stage_dq_page and stage_dq_rows.
__device__ __forceinline__ void swap_column_blocks(float (&v)[32], int g) {
#pragma unroll
    for (int bit = 1; bit <= 2; bit <<= 1) {
        const bool swap = (g & bit) != 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            if (j & bit) continue;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float a = v[4 * j + e], b = v[4 * (j ^ bit) + e];
                v[4 * j + e] = swap ? b : a;
                v[4 * (j ^ bit) + e] = swap ? a : b;
            }
        }
    }
}

// This warp's dQ rows (16 streamed rows, 64 head-dim columns from col0) into a staged fp32 page
// (HEAD_DIM floats per row). The unpadded rows all start on bank 0, and a half-warp's st.shared.v2 covers
// rows g = 0-3 (or 4-7): storing the same 32-byte column block j in all four would hit the same 8 banks.
// So in store j a thread writes column block j ^ (g & 3) instead: four blocks, 32 distinct banks. Its
// fragments are first permuted to match by two conditional swaps of register blocks (bits 0 and 1 of g);
// the page's contents are the same.
template <int HEAD_DIM>
__device__ __forceinline__ void stage_dq_page(uint32_t page, const float (&dq)[32], int col0, int g, int t4) {
    static_assert(HEAD_DIM % 32 == 0, "a row of 32-float multiples starts on bank 0");
    float v[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) v[i] = dq[i];
    swap_column_blocks(v, g);
    const uint32_t xg = static_cast<uint32_t>(g & 3);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const uint32_t block = static_cast<uint32_t>(j) ^ xg;  // v[4j ..] holds column block j ^ (g & 3)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const uint32_t addr = page + ((g + 8 * half) * HEAD_DIM + col0 + 8 * block + 2 * t4) * 4u;
            asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(v[4 * j + 2 * half]),
                         "f"(v[4 * j + 2 * half + 1])
                         : "memory");
        }
    }
}

// This warp's dQ rows over every head-dim column (a 64 x HEAD_DIM accumulator) into a staged fp32 page:
// stage_dq_page's bank-conflict-free order (store j of a thread writes column block j ^ (g & 3)), addressed
// from one register: pages are 1 KB-aligned, so bits 5-7 of a row's address are its 32-byte column block;
// the register holds g & 3 there and store j's address is that register XOR j << 5 (plus an immediate).
// ADD: add the rows to the page's values instead (PAGED_BWD_WG_SUM: the second warpgroup's partial).
template <int HEAD_DIM, bool ADD = false>
__device__ __forceinline__ void stage_dq_rows(uint32_t page, const float (&dq)[HEAD_DIM / 2], int g, int t4) {
    static_assert(HEAD_DIM % 32 == 0, "a row of 32-float multiples starts on bank 0");
    const int xg = g & 3;
    uint32_t row_base = page + (g * HEAD_DIM + 2 * t4) * 4u + static_cast<uint32_t>(xg << 5);
    asm volatile("" : "+r"(row_base));  // opaque per call: ptxas otherwise keeps 8 addresses live across the loop
#pragma unroll
    for (int h = 0; h < HEAD_DIM / 64; ++h) {
        float v[32];
#pragma unroll
        for (int i = 0; i < 32; ++i) v[i] = dq[32 * h + i];
        swap_column_blocks(v, g);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const uint32_t addr =
                    (row_base ^ static_cast<uint32_t>(j << 5)) + static_cast<uint32_t>((8 * half * HEAD_DIM + 64 * h) * 4);
                float a = v[4 * j + 2 * half], b = v[4 * j + 2 * half + 1];
                if constexpr (ADD) {
                    float x, y;
                    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(x), "=f"(y) : "r"(addr) : "memory");
                    a += x;
                    b += y;
                }
                asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(a), "f"(b) : "memory");
            }
        }
    }
}

// dK (times scale) and dV of this warp's rows (warp wq of the warpgroup owning rows 64·kvp ..) as bf16
// into the K / V tiles.
template <int HEAD_DIM, int BLOCK_K>
__device__ __forceinline__ void stage_dk_dv(uint32_t tK, uint32_t tV, const float (&acc_dk)[HEAD_DIM / 2],
                                            const float (&acc_dv)[HEAD_DIM / 2], float scale, int kvp, int wq, int g,
                                            int t4) {
#pragma unroll
    for (int j = 0; j < HEAD_DIM / 8; ++j) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = kvp * 64 + 16 * wq + g + 8 * half;
            const uint32_t off = hopper::tile_offset<BLOCK_K>(row, j) + 4u * t4;
            const uint32_t kbits =
                paged::pack_bf16x2(acc_dk[4 * j + 2 * half] * scale, acc_dk[4 * j + 2 * half + 1] * scale);
            const uint32_t vbits = paged::pack_bf16x2(acc_dv[4 * j + 2 * half], acc_dv[4 * j + 2 * half + 1]);
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(tK + off), "r"(kbits) : "memory");
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(tV + off), "r"(vbits) : "memory");
        }
    }
}

// The staged dK / dV tiles to the owned pages (valid page ids only), 16 bytes per thread and step.
template <int HEAD_DIM, int BLOCK_K, int THREADS>
__device__ __forceinline__ void store_dk_dv(uint32_t tK, uint32_t tV, const int* own, int k_pages,
                                            __nv_bfloat16* dk_bh, __nv_bfloat16* dv_bh, int ctid) {
    constexpr int kChunksPerRow = HEAD_DIM / 8;
#pragma unroll 4
    for (int c = ctid; c < BLOCK_K * kChunksPerRow; c += THREADS) {
        const int row = c / kChunksPerRow;
        const int chunk = c % kChunksPerRow;
        const int page = own[row / PAGE_ROWS];
        if (static_cast<unsigned>(page) < static_cast<unsigned>(k_pages)) {
            const size_t dst = (static_cast<size_t>(page) * PAGE_ROWS + row % PAGE_ROWS) * HEAD_DIM + chunk * 8;
            const uint32_t off = hopper::tile_offset<BLOCK_K>(row, chunk);
            uint4 kk, vv;
            asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                         : "=r"(kk.x), "=r"(kk.y), "=r"(kk.z), "=r"(kk.w) : "r"(tK + off));
            asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                         : "=r"(vv.x), "=r"(vv.y), "=r"(vv.z), "=r"(vv.w) : "r"(tV + off));
            *reinterpret_cast<uint4*>(dk_bh + dst) = kk;
            *reinterpret_cast<uint4*>(dv_bh + dst) = vv;
        }
    }
}

#ifdef PAGED_BWD_TOKENS
// load_owned_pages with each row read from its token (rows: where the (batch, head)'s tokens start).
template <int HEAD_DIM, int ROWS, int WARPS>
__device__ __forceinline__ void load_owned_token_pages(uint32_t tA, uint32_t tB, const __nv_bfloat16* a,
                                                       const __nv_bfloat16* b, hopper::TokenRows rows, int num_tokens,
                                                       const int* __restrict__ map, const int* own,
                                                       const uint16_t* __restrict__ page_mask, int num_pages, int warp) {
    constexpr int kOwnPages = ROWS / PAGE_ROWS;
    for (int i = warp; i < 2 * kOwnPages; i += WARPS) {
        const int p = i % kOwnPages;
        const int page[1] = {own[p]};
        const uint32_t mask[1] = {paged::load_page_mask(page_mask, page[0], num_pages)};
        int tok[1];
        hopper::page_tokens<1>(tok, map, num_pages, page);
        hopper::warp_copy_token_pages<HEAD_DIM, ROWS, 1>(i < kOwnPages ? tA : tB, p * PAGE_ROWS,
                                                         (i < kOwnPages ? a : b) + rows.base, rows.stride, num_tokens,
                                                         num_pages, tok, page, mask);
    }
}

// store_dk_dv to tokens: each owned row whose slot holds a token (map) goes to it; padding rows are not
// stored.
template <int HEAD_DIM, int BLOCK_K, int THREADS>
__device__ __forceinline__ void store_dk_dv_tokens(uint32_t tK, uint32_t tV, const int* own, int k_pages,
                                                   const int* __restrict__ map, int num_tokens, __nv_bfloat16* dk_rows,
                                                   __nv_bfloat16* dv_rows, uint32_t stride, int ctid) {
    constexpr int kChunksPerRow = HEAD_DIM / 8;
#pragma unroll 4
    for (int c = ctid; c < BLOCK_K * kChunksPerRow; c += THREADS) {
        const int row = c / kChunksPerRow;
        const int chunk = c % kChunksPerRow;
        const int page = own[row / PAGE_ROWS];
        if (static_cast<unsigned>(page) >= static_cast<unsigned>(k_pages)) continue;
        const int t = map[page * PAGE_ROWS + row % PAGE_ROWS];
        if (static_cast<unsigned>(t) >= static_cast<unsigned>(num_tokens)) continue;
        const uint32_t dst = static_cast<uint32_t>(t) * stride + chunk * 8;
        const uint32_t off = hopper::tile_offset<BLOCK_K>(row, chunk);
        uint4 kk, vv;
        asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(kk.x), "=r"(kk.y), "=r"(kk.z), "=r"(kk.w) : "r"(tK + off));
        asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(vv.x), "=r"(vv.y), "=r"(vv.z), "=r"(vv.w) : "r"(tV + off));
        *reinterpret_cast<uint4*>(dk_rows + dst) = kk;
        *reinterpret_cast<uint4*>(dv_rows + dst) = vv;
    }
}
#endif

}  // namespace paged_bwd

// Grid (work items [work_offset, work_offset + gridDim.x) of one route, batch), block Config::kThreads,
// dynamic shared memory Config::kSmemBytes. Arguments as bsa_bwd_kernel, plus dq_absmax (DQ_FIXED only:
// three bf16 magnitudes from bwd_absmax_bf16; dq_accum then holds int64 fixed-point values).
template <int HEAD_DIM, int BLOCK_K, int Q_SPLIT, int DQ_MODE>
__global__ void __launch_bounds__(paged_bwd::Config<HEAD_DIM, BLOCK_K, Q_SPLIT, DQ_MODE>::kThreads, 1)
paged_bwd_kernel(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                 const __nv_bfloat16* __restrict__ v, const __nv_bfloat16* __restrict__ dout,
                 const float* __restrict__ lse, const float* __restrict__ delta, float* __restrict__ dq_accum,
                 __nv_bfloat16* __restrict__ dk, __nv_bfloat16* __restrict__ dv, const int* __restrict__ work_head,
                 const int* __restrict__ own_pages, int max_own, const int* __restrict__ stream_indptr,
                 const int* __restrict__ stream_pages, const uint16_t* __restrict__ k_page_mask,
                 const uint16_t* __restrict__ q_page_mask, int work_offset, int heads, int q_slots, int k_slots,
                 float scale, float scale_log2, const unsigned int* __restrict__ dq_absmax PAGED_BWD_TOKEN_PARAMS) {
    using namespace hopper;
    using namespace paged_bwd;
    using Cfg = Config<HEAD_DIM, BLOCK_K, Q_SPLIT, DQ_MODE>;
    constexpr int D = HEAD_DIM;
    constexpr int QS = Cfg::kQStep;

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const uint32_t base = (paged::smem_u32(smem_raw) + 1023u) & ~1023u;
    unsigned char* const smem = smem_raw + (base - paged::smem_u32(smem_raw));
    const uint32_t tK = base;
    const uint32_t tV = tK + Cfg::kKBytes;
    const uint32_t tQ0 = tV + Cfg::kKBytes;         // [2] Q buffers
    const uint32_t tdO0 = tQ0 + 2 * Cfg::kQBytes;   // [2] dO buffers
    const uint32_t tdS0 = tdO0 + 2 * Cfg::kQBytes;  // [Q_SPLIT] dSᵀ tiles
    const int meta_off = 2 * Cfg::kKBytes + 4 * Cfg::kQBytes + Q_SPLIT * Cfg::kSBytes;
    float* sLse = reinterpret_cast<float*>(smem + meta_off);  // [2][QS], log2 units, +inf = no keys
    float* sDelta = sLse + 2 * QS;                             // [2][QS]
    int* sSlot = reinterpret_cast<int*>(sDelta + 2 * QS);      // [2][QS], -1 = invalid row

    const int tid = threadIdx.x;
    const int warp = tid >> 5;
    const int lane = tid & 31;
    const int wg = tid >> 7;         // consumer warpgroup
    const int kvp = Q_SPLIT == 1 ? wg : wg % Cfg::kKvWGs;  // its owned rows: 64·kvp ..
    const int qp = Q_SPLIT == 1 ? 0 : wg / Cfg::kKvWGs;    // its streamed rows of each step: 64·qp ..
    const int wq = warp & 3;         // warp in its warpgroup: accumulator rows 16·wq + g (+8)
    const int g = lane >> 2;
    const int t4 = lane & 3;

    const int work = blockIdx.x + work_offset;
    const int head = work_head[work];
    const size_t bh = static_cast<size_t>(blockIdx.y) * heads + head;
    const __nv_bfloat16* q_bh = q + bh * q_slots * D;
    const __nv_bfloat16* do_bh = dout + bh * q_slots * D;
    const float* lse_bh = lse + bh * q_slots;
    const float* delta_bh = delta + bh * q_slots;
    float* dq_bh = dq_accum + bh * q_slots * D * (DQ_MODE == DQ_FIXED ? 2 : 1);  // int64 elements in DQ_FIXED
    const int q_pages = q_slots / PAGE_ROWS;
    const int k_pages = k_slots / PAGE_ROWS;
    const int* own = own_pages + static_cast<size_t>(work) * max_own;
    const int stream_begin = stream_indptr[work];
    const int stream_len = stream_indptr[work + 1] - stream_begin;
    const int num_tiles = (stream_len + Cfg::kStreamPages - 1) / Cfg::kStreamPages;

#ifdef PAGED_BWD_TOKENS
    const TokenRows tq = token_rows(bh, tok_heads, q_tokens, D);
    const TokenRows tk = token_rows(bh, tok_heads, k_tokens, D);
    const int* qmap = q_map + (maps_per_row ? bh * q_slots : 0);
    const int* kmap = k_map + (maps_per_row ? bh * k_slots : 0);
    load_owned_token_pages<D, BLOCK_K, Cfg::kWarps>(tK, tV, k, v, tk, k_tokens, kmap, own, k_page_mask, k_pages, warp);
#else
    // owned K and V pages (load_owned_pages, written out: this kernel's code is the H200-verified one)
    for (int i = warp; i < 2 * Cfg::kOwnPages; i += Cfg::kWarps) {
        const int p = i % Cfg::kOwnPages;
        const int page[1] = {own[p]};
        const uint32_t mask[1] = {paged::load_page_mask(k_page_mask, page[0], k_pages)};
        warp_copy_pages<D, BLOCK_K, 1>(i < Cfg::kOwnPages ? tK : tV, p * PAGE_ROWS,
                                       (i < Cfg::kOwnPages ? k : v) + bh * k_slots * D, k_pages, page, mask);
    }
#endif
    const uint32_t own_mask = paged::load_page_mask(k_page_mask, own[kvp * 4 + wq], k_pages);
    const bool kvalid_lo = paged::page_row_valid(own_mask, g);
    const bool kvalid_hi = paged::page_row_valid(own_mask, g + 8);

    auto load_stream_tile = [&](int tile, int buf) {
        const int* pages = stream_pages + stream_begin + tile * Cfg::kStreamPages;
        const int npages = min(Cfg::kStreamPages, stream_len - tile * Cfg::kStreamPages);
        for (int i = warp; i < 2 * Cfg::kStreamPages; i += Cfg::kWarps) {
            const int p = i % Cfg::kStreamPages;
            const int page[1] = {p < npages ? pages[p] : -1};
            const uint32_t mask[1] = {paged::load_page_mask(q_page_mask, page[0], q_pages)};
            const bool is_q = i < Cfg::kStreamPages;
#ifdef PAGED_BWD_TOKENS
            int tok[1];
            page_tokens<1>(tok, qmap, q_pages, page);
            warp_copy_token_pages<D, QS, 1>((is_q ? tQ0 : tdO0) + buf * Cfg::kQBytes, p * PAGE_ROWS,
                                            (is_q ? q : dout) + tq.base, tq.stride, q_tokens, q_pages, tok, page, mask);
#else
            warp_copy_pages<D, QS, 1>((is_q ? tQ0 : tdO0) + buf * Cfg::kQBytes, p * PAGE_ROWS,
                                      is_q ? q_bh : do_bh, q_pages, page, mask);
#endif
        }
        for (int row = tid; row < QS; row += Cfg::kThreads) {
            const int p = row / PAGE_ROWS;
            const int page = p < npages ? pages[p] : -1;
            const bool valid = paged::page_row_valid(paged::load_page_mask(q_page_mask, page, q_pages), row % PAGE_ROWS);
            const int slot = page * PAGE_ROWS + row % PAGE_ROWS;
            const float l = valid ? lse_bh[slot] : -INFINITY;
            sLse[buf * QS + row] = l > -INFINITY ? l * paged::kLog2e : INFINITY;
            sDelta[buf * QS + row] = valid ? delta_bh[slot] : 0.f;
            sSlot[buf * QS + row] = valid ? slot : -1;
        }
    };

    if (num_tiles > 0) load_stream_tile(0, 0);
    paged::cp_async_commit();

    float acc_dk[D / 2];
    float acc_dv[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) acc_dk[i] = acc_dv[i] = 0.f;
    const uint32_t aK = tK + kvp * 64 * 128;  // this warpgroup's 64 owned rows (inside each column block)
    const uint32_t aV = tV + kvp * 64 * 128;
    const uint32_t tdS = tdS0 + qp * Cfg::kSBytes;  // the dSᵀ tile of this warpgroup's Q slice

#pragma unroll 1
    for (int tile = 0; tile < num_tiles; ++tile) {
        const int buf = tile & 1;
        if (DQ_MODE == DQ_BULK && tid == 0) paged_bwd::bulk_wait_read();  // step tile - 1's dQ staging is read
        paged::cp_async_wait<0>();
        fence_async_proxy();
        __syncthreads();  // step tile - 1 is done everywhere: its buffers and dSᵀ may be overwritten
        fence_async_proxy();
        if (tile + 1 < num_tiles) load_stream_tile(tile + 1, buf ^ 1);
        paged::cp_async_commit();
        const uint32_t tQ = tQ0 + buf * Cfg::kQBytes;
        const uint32_t tdO = tdO0 + buf * Cfg::kQBytes;
        const float* tLse = sLse + buf * QS + qp * PB_Q_ROWS;
        const float* tDelta = sDelta + buf * QS + qp * PB_Q_ROWS;

        float s[PB_Q_ROWS / 2];
        float dp[PB_Q_ROWS / 2];
        wgmma_fence();
        if constexpr (Q_SPLIT == 1) {
            issue_qk<D, PB_Q_ROWS, BLOCK_K>(s, aK, tQ);
            wgmma_commit();
            issue_qk<D, PB_Q_ROWS, BLOCK_K>(dp, aV, tdO);
            wgmma_commit();
        } else {  // B = this warpgroup's 64-row slice of a QS-row tile
            paged_bwd::issue_qk_slice<D, QS>(s, aK, BLOCK_K, tQ + qp * 64 * 128);
            wgmma_commit();
            paged_bwd::issue_qk_slice<D, QS>(dp, aV, BLOCK_K, tdO + qp * 64 * 128);
            wgmma_commit();
        }
        wgmma_wait<0>();
        pin_registers(s);
        pin_registers(dp);

        p_and_ds(s, dp, kvalid_lo, kvalid_hi, tLse, tDelta, scale_log2, t4);
        uint32_t pa[PB_Q_ROWS / PAGE_ROWS][4];
        uint32_t pds[PB_Q_ROWS / PAGE_ROWS][4];
        pack_p<PB_Q_ROWS>(pa, s);
        pack_p<PB_Q_ROWS>(pds, dp);
        if constexpr (DQ_MODE != DQ_NONE) store_ds<BLOCK_K>(tdS, pds, kvp, wq, g, t4);
        wgmma_fence();
        if constexpr (Q_SPLIT == 1) {
            issue_pv<D, PB_Q_ROWS>(acc_dv, pa, tdO);
            wgmma_commit();
            issue_pv<D, PB_Q_ROWS>(acc_dk, pds, tQ);
            wgmma_commit();
        } else {
            paged_bwd::issue_pv_slice<D, QS>(acc_dv, pa, tdO + qp * 64 * 128);
            wgmma_commit();
            paged_bwd::issue_pv_slice<D, QS>(acc_dk, pds, tQ + qp * 64 * 128);
            wgmma_commit();
        }
        if constexpr (DQ_MODE == DQ_BULK) wgmma_wait<0>();  // then after the barrier no GEMM reads this step's Q / dO
        if constexpr (DQ_MODE != DQ_NONE) {
            fence_async_proxy();
            __syncthreads();  // every warpgroup's dSᵀ rows are in shared memory
        }

        // dQ[:, 64·h .. 64·h + 63] = dS · K[:, 64·h ..], K-dim = the BLOCK_K owned rows
        constexpr int kHalfPages = Cfg::kStreamPages / 2;  // staged dQ pages over the Q (then dO) buffer
#pragma unroll 1
        for (int h = kvp; h < (DQ_MODE == DQ_NONE ? 0 : D / 64); h += Cfg::kKvWGs) {
            float dq[32];
            wgmma_fence();
            paged_bwd::issue_dq<BLOCK_K>(dq, tdS, tK + h * (BLOCK_K * 128));
            wgmma_commit();
            wgmma_wait<0>();
            pin_registers(dq);
            if constexpr (DQ_MODE == DQ_BULK) {
                const int pg = qp * 4 + wq;  // warp wq's 16 accumulator rows are page wq of its Q slice
                const uint32_t stage = (pg < kHalfPages ? tQ : tdO) + (pg % kHalfPages) * Cfg::kPageBytesF32;
                stage_dq_page<D>(stage, dq, 64 * h, g, t4);
            } else {
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int slot = sSlot[buf * QS + qp * PB_Q_ROWS + 16 * wq + g + 8 * half];
                    if (slot >= 0) {
                        const size_t at = static_cast<size_t>(slot) * D + 64 * h + 2 * t4;
                        if constexpr (DQ_MODE == DQ_FIXED) {
                            unsigned long long* row_ptr = reinterpret_cast<unsigned long long*>(dq_bh) + at;
                            const float unit = fixed_point_scale(dq_absmax, D);
#pragma unroll
                            for (int j = 0; j < 8; ++j) {
                                red_add_fixed(row_ptr + 8 * j, dq[4 * j + 2 * half], unit);
                                red_add_fixed(row_ptr + 8 * j + 1, dq[4 * j + 2 * half + 1], unit);
                            }
                        } else {
                            float* row_ptr = dq_bh + at;
#pragma unroll
                            for (int j = 0; j < 8; ++j)
                                red_add_v2(row_ptr + 8 * j, dq[4 * j + 2 * half], dq[4 * j + 2 * half + 1]);
                        }
                    }
                }
            }
        }
        if constexpr (DQ_MODE == DQ_BULK) {  // one bulk reduction per staged page
            fence_async_proxy();
            __syncthreads();
            if (tid == 0) {
                const int* pages = stream_pages + stream_begin + tile * Cfg::kStreamPages;
                const int npages = min(Cfg::kStreamPages, stream_len - tile * Cfg::kStreamPages);
                for (int p = 0; p < npages; ++p) {
                    const int page = pages[p];
                    if (static_cast<unsigned>(page) < static_cast<unsigned>(q_pages))
                        paged_bwd::bulk_reduce_add_f32(dq_bh + static_cast<size_t>(page) * PAGE_ROWS * D,
                                                       (p < kHalfPages ? tQ : tdO) + (p % kHalfPages) * Cfg::kPageBytesF32,
                                                       Cfg::kPageBytesF32);
                }
                paged_bwd::bulk_commit();
            }
        }
        wgmma_wait<0>();
        pin_registers(acc_dk);
        pin_registers(acc_dv);
    }

    // dK (scaled) and dV: staged bf16 in the K / V tiles, then 16-byte stores of every owned row
    if (DQ_MODE == DQ_BULK && tid == 0) paged_bwd::bulk_wait();  // before the Q/dO buffers are reused and the CTA exits
    paged::cp_async_wait<0>();
    __syncthreads();
    if constexpr (Q_SPLIT == 2) {  // warpgroup 1's partial joins warpgroup 0's, through the Q/dO buffers
        float* staging = reinterpret_cast<float*>(smem + 2 * Cfg::kKBytes);  // [2][D / 2][128] fp32
        const int wtid = tid & 127;
        if (qp == 1) {
#pragma unroll
            for (int i = 0; i < D / 2; ++i) {
                staging[i * 128 + wtid] = acc_dk[i];
                staging[(D / 2 + i) * 128 + wtid] = acc_dv[i];
            }
        }
        __syncthreads();
        if (qp == 0) {
#pragma unroll
            for (int i = 0; i < D / 2; ++i) {
                acc_dk[i] += staging[i * 128 + wtid];
                acc_dv[i] += staging[(D / 2 + i) * 128 + wtid];
            }
        }
    }
    if (Q_SPLIT == 1 || qp == 0)  // the warpgroup(s) holding the whole dK / dV stage it as bf16
        stage_dk_dv<D, BLOCK_K>(tK, tV, acc_dk, acc_dv, scale, kvp, wq, g, t4);
    __syncthreads();
    // (the bulk variants re-derive the owned-page list and the (batch, head) offset: keeping them across
    // the loop spills them)
    const int* own_out = DQ_MODE == DQ_BULK ? own_pages + static_cast<size_t>(blockIdx.x + work_offset) * max_own : own;
    const size_t bh_out =
        DQ_MODE == DQ_BULK ? static_cast<size_t>(blockIdx.y) * heads + work_head[blockIdx.x + work_offset] : bh;
#ifdef PAGED_BWD_TOKENS
    const TokenRows tk_out = token_rows(bh_out, tok_heads, k_tokens, D);
    store_dk_dv_tokens<D, BLOCK_K, Cfg::kThreads>(tK, tV, own_out, k_pages,
                                                  k_map + (maps_per_row ? bh_out * k_slots : 0), k_tokens,
                                                  dk + tk_out.base, dv + tk_out.base, tk_out.stride, tid);
#else
    store_dk_dv<D, BLOCK_K, Cfg::kThreads>(tK, tV, own_out, k_pages, dk + bh_out * k_slots * D,
                                           dv + bh_out * k_slots * D, tid);
#endif
}

// ---- warp-specialized variant for 128-row owned tiles (v4 candidate) -------------------------------------

// paged_bwd_ws_kernel: the computation of paged_bwd_kernel<D, 128, 1, DQ_BULK> with FlashAttention-3's
// division of labour instead of block-wide barriers. 384 threads:
// * producer warpgroup (registers lowered): warp 0 gathers each step's 4 Q pages, warp 1 its 4 dO pages
//   (cp.async into a 2-stage ring, completion tracked on the stage's full mbarrier); warp 3 adds each
//   step's staged fp32 dQ pages to dq_accum with one cp.reduce.async.bulk per contiguous page (the
//   consumers' stores are ordered against bank conflicts, stage_dq_page), then frees the staging buffer;
//   warp 2 idles;
// * the consumers stage the next step's LSE₂ (warpgroup 0) and Δ (warpgroup 1) themselves, 64 threads
//   each, ordered by the per-step named barrier: racecheck does not see the mbarrier hand-off of plain
//   shared-memory stores (it reported the producer-written version of these rows as 1536-hazard races);
// * two consumer warpgroups (registers raised), one per 64 owned K/V rows: S, dP (wgmma SS), P and dS in
//   registers, dSᵀ to its half of a double-buffered shared tile, dV += P·dO and dK += dS·Q (wgmma RS),
//   one named barrier between the two consumer warpgroups (both dSᵀ halves written), then the dQ GEMM of
//   its 64 head-dim columns, released Q/dO stage, dQ staged for warp 3.
// No __syncthreads inside the loop: a consumer warpgroup waits only for its data, the other consumer's
// dSᵀ half and the previous step's dQ staging to be read.
namespace paged_bwd_ws {

constexpr int kBlockK = 128;
constexpr int kThreads = 384;
// setmaxnreg moves registers within the CTA's launch allocation (168 per thread at 384 threads): the
// consumers' increase waits for the producer's release, so a split past it deadlocks. At 224 consumer
// registers ptxas serialized every wgmma of the d = 128 consumer (C7512).
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
// pair items (PAIR): the consumers' page-visibility bookkeeping spills at 232 (NVRTC 13.0)
constexpr int kPairProducerRegs = 24;
constexpr int kPairConsumerRegs = 240;
constexpr int kConsumerWarps = 8;
constexpr int kLoadThreads = 64;  // producer warps 0-1 arrive on a stage's full barrier
#ifdef PAGED_BWD_WG_DQ
constexpr bool kWgDq = true;
#else
constexpr bool kWgDq = false;
#endif
constexpr int kGroupBarrier = 2;  // kWgDq: + w, consumer warpgroup w's own 128-thread barrier
#ifdef PAGED_BWD_WG_OFFSET
#ifndef PAGED_BWD_WG_DQ
#error "PAGED_BWD_WG_OFFSET needs PAGED_BWD_WG_DQ"
#endif
constexpr bool kWgOffset = true;
#else
constexpr bool kWgOffset = false;
#endif
constexpr int kOffsetBarrier = 4;  // kWgOffset: warpgroup 1 starts once warpgroup 0 has issued its first dV, dK
#ifdef PAGED_BWD_WG_SUM
#ifndef PAGED_BWD_WG_DQ
#error "PAGED_BWD_WG_SUM needs PAGED_BWD_WG_DQ"
#endif
constexpr bool kWgSum = true;
#else
constexpr bool kWgSum = false;
#endif
constexpr int kSumBarrier = 5;  // kWgSum: warpgroup 0's dQ partial is staged, warpgroup 1 may add its own
// kWgSum: warpgroup 1 has read the staging (its add is done), warpgroup 0 may write the next step's. The
// reducer's mbarriers order it too, but racecheck does not see mbarrier hand-offs of plain shared loads.
constexpr int kSumReadBarrier = 6;
// dQ staging buffers, and the consumer warps that arrive on one's dq_full barrier per step
constexpr int kDqBuffers = kWgDq && !kWgSum ? 2 : 1;
constexpr int kDqArrivals = kWgDq ? 4 : kConsumerWarps;
static_assert(kProducerRegs * 128 + kConsumerRegs * 256 <= (65536 / kThreads) / 8 * 8 * kThreads &&
                  kPairProducerRegs * 128 + kPairConsumerRegs * 256 <= (65536 / kThreads) / 8 * 8 * kThreads,
              "register split past the launch allocation: setmaxnreg.inc would wait forever");

template <int HEAD_DIM, bool PAIR = false>
struct Config {
    // LSE₂ (and kWgDq: Δ) copies: pair items and kWgDq one per consumer warpgroup
    static constexpr int kMetaCopies = PAIR || kWgDq ? 2 : 1;
    static constexpr int kKBytes = kBlockK * HEAD_DIM * 2;         // K or V (owned)
    static constexpr int kQBytes = PB_Q_ROWS * HEAD_DIM * 2;       // one Q or dO stage
    static constexpr int kSBytes = kBlockK * PB_Q_ROWS * 2;        // one dSᵀ buffer
    static constexpr int kSBuffers = kWgDq ? 1 : 2;                // kWgDq: each warpgroup's barrier orders reuse
    // dQ staging: 64 fp32 rows in contiguous pages, one bulk reduction per page; stage_dq_page orders its
    // stores so that a half-warp's four rows hit 32 distinct banks (kWgDq: one buffer per warpgroup)
    static constexpr int kPageBytesF32 = PAGE_ROWS * HEAD_DIM * 4;
    static constexpr int kDqBytes = PB_Q_ROWS * HEAD_DIM * 4;
    static constexpr int kDqBuffers = paged_bwd_ws::kDqBuffers;
    // LSE₂ and Δ copies per stage; PAIR: + the seen-row ballot words [2 stages][4 warps]
    static constexpr int kMetaBytes = 2 * 2 * kMetaCopies * PB_Q_ROWS * 4 + (PAIR ? 2 * 4 * 4 : 0);
    static constexpr int kBarBytes = 8 * 8;  // q_full[2], q_empty[2], (dq_full, dq_empty)[2] (one pair unless kWgDq)
    static constexpr int kSmemBytes = 1024 + 2 * kKBytes + 4 * kQBytes + kSBuffers * kSBytes +
                                      kDqBuffers * kDqBytes + kMetaBytes + kBarBytes;
    static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "head dim 64 or 128");
    static_assert(kSmemBytes <= 227 * 1024, "over the per-block shared-memory limit");
};

}  // namespace paged_bwd_ws

// Grid (work items [work_offset, work_offset + gridDim.x) of a 128-row route, batch), block 384 threads,
// dynamic shared memory Config::kSmemBytes. Arguments as paged_bwd_kernel (dq_accum fp32), except the
// last: PAIR (pair items, kernels/pair_backward_plan.py): pair_pages, int32 [stream entries][3], entry
// e's page id, then its page id where owned rows 0-63 see it and where rows 64-127 do, else -1 (a half's
// unseen rows get LSE₂ = +inf, so P = dS = 0). Without PAIR it is unused.
template <int HEAD_DIM, bool PAIR>
__global__ void __launch_bounds__(paged_bwd_ws::kThreads, 1)
paged_bwd_ws_kernel(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                    const __nv_bfloat16* __restrict__ v, const __nv_bfloat16* __restrict__ dout,
                    const float* __restrict__ lse, const float* __restrict__ delta, float* __restrict__ dq_accum,
                    __nv_bfloat16* __restrict__ dk, __nv_bfloat16* __restrict__ dv, const int* __restrict__ work_head,
                    const int* __restrict__ own_pages, int max_own, const int* __restrict__ stream_indptr,
                    const int* __restrict__ stream_pages, const uint16_t* __restrict__ k_page_mask,
                    const uint16_t* __restrict__ q_page_mask, int work_offset, int heads, int q_slots, int k_slots,
                    float scale, float scale_log2, const unsigned int* __restrict__ pair_pages PAGED_BWD_TOKEN_PARAMS) {
    using namespace hopper;
    using namespace paged_bwd_ws;
    using Cfg = Config<HEAD_DIM, PAIR>;
    constexpr int D = HEAD_DIM;
    constexpr int BK = kBlockK;
    constexpr int QS = PB_Q_ROWS;
    constexpr int SP = QS / PAGE_ROWS;  // streamed pages per step

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const uint32_t base = (paged::smem_u32(smem_raw) + 1023u) & ~1023u;
    unsigned char* const smem = smem_raw + (base - paged::smem_u32(smem_raw));
    const uint32_t tK = base;
    const uint32_t tV = tK + Cfg::kKBytes;
    const uint32_t tQ0 = tV + Cfg::kKBytes;        // [2] Q stages
    const uint32_t tdO0 = tQ0 + 2 * Cfg::kQBytes;  // [2] dO stages
    const uint32_t tdS0 = tdO0 + 2 * Cfg::kQBytes;              // [kSBuffers] dSᵀ buffers
    const uint32_t tDq = tdS0 + Cfg::kSBuffers * Cfg::kSBytes;  // [kDqBuffers] dQ staging
    const int meta_off = static_cast<int>(tDq - base) + Cfg::kDqBuffers * Cfg::kDqBytes;
    constexpr int MS = Cfg::kMetaCopies * QS;                  // one stage of LSE₂ (or Δ)
    float* sLse = reinterpret_cast<float*>(smem + meta_off);  // [2][copies][QS], log2 units, +inf = no keys
    float* sDelta = sLse + 2 * MS;                             // [2][copies][QS], copy 0 used
    const uint32_t bars = base + meta_off + Cfg::kMetaBytes;
    auto q_full = [&](int s) { return bars + 8 * s; };
    auto q_empty = [&](int s) { return bars + 8 * (2 + s); };
    auto dq_full = [&](int w) { return bars + 8 * (4 + 2 * w); };
    auto dq_empty = [&](int w) { return bars + 8 * (5 + 2 * w); };

    const int tid = threadIdx.x;
    const int warp = tid >> 5;
    const int lane = tid & 31;
    const int work = blockIdx.x + work_offset;
    const int head = work_head[work];
    const size_t bh = static_cast<size_t>(blockIdx.y) * heads + head;
    const int q_pages = q_slots / PAGE_ROWS;
    const int k_pages = k_slots / PAGE_ROWS;
    const int* own = own_pages + static_cast<size_t>(work) * max_own;
    const int stream_begin = stream_indptr[work];
    const int stream_len = stream_indptr[work + 1] - stream_begin;
    const int num_tiles = (stream_len + SP - 1) / SP;

    if (tid == 0) {
        for (int s = 0; s < 2; ++s) {
            mbar_init(q_full(s), kLoadThreads);
            mbar_init(q_empty(s), kConsumerWarps);
        }
        for (int w = 0; w < Cfg::kDqBuffers; ++w) {
            mbar_init(dq_full(w), kDqArrivals);
            mbar_init(dq_empty(w), 1);
        }
    }
#ifdef PAGED_BWD_TOKENS
    paged_bwd::load_owned_token_pages<D, BK, kThreads / 32>(tK, tV, k, v, token_rows(bh, tok_heads, k_tokens, D),
                                                            k_tokens, k_map + (maps_per_row ? bh * k_slots : 0), own,
                                                            k_page_mask, k_pages, warp);
#else
    paged_bwd::load_owned_pages<D, BK, kThreads / 32>(tK, tV, k, v, bh * k_slots * D, own, k_page_mask, k_pages,
                                                      warp);
#endif
    paged::cp_async_commit();
    paged::cp_async_wait<0>();
    fence_async_proxy();
    __syncthreads();  // owned tiles and barriers ready

    const int* pages_all = stream_pages + stream_begin;
    const int role = __shfl_sync(0xffffffffu, tid / 128, 0);
    if (role == 0) {
        // ================================ producer ================================
        regs_release<PAIR ? kPairProducerRegs : kProducerRegs>();
        if (warp < 2) {  // Q (warp 0) or dO (warp 1): each step's 4 pages
#ifdef PAGED_BWD_TOKENS
            const TokenRows tq = token_rows(bh, tok_heads, q_tokens, D);
            const __nv_bfloat16* rows = (warp == 0 ? q : dout) + tq.base;  // this warp's matrix, token 0
            const int* qmap = q_map + (maps_per_row ? bh * q_slots : 0);
#endif
            // Lane p < SP holds page p of the coming steps, its two dependent loads a step apart: in step t
            // the mask of step t + 1 (page known) and the page id of step t + 2, so a step's copies issue
            // as soon as its buffer is free instead of after two global-load round trips.
            auto page_id = [&](int t) -> int {
                const int e = t * SP + lane;
                return lane < SP && t < num_tiles && e < stream_len ? pages_all[e] : -1;
            };
            int page1 = page_id(0);  // step t's page (lane p: page p)
            uint32_t mask1 = paged::load_page_mask(q_page_mask, page1, q_pages);
            int page2 = page_id(1);  // step t + 1's
#pragma unroll 1
            for (int t = 0; t < num_tiles; ++t) {
                const int st = t & 1;
                const uint32_t par = (t >> 1) & 1;
                const int cur_page = page1;
                const uint32_t cur_mask = mask1;
                page1 = page2;
                mask1 = paged::load_page_mask(q_page_mask, page2, q_pages);  // first used in step t + 1
                page2 = page_id(t + 2);                                       // first used in step t + 1
#ifdef PAGED_BWD_TOKENS
                // the step's 4 pages' tokens in two registers, loaded before the wait: lane l holds row l % 16
                // of page l / 16 (tok_lo) and of page l / 16 + 2 (tok_hi)
                const int pg_lo = __shfl_sync(0xffffffffu, cur_page, lane >> 4);
                const int pg_hi = __shfl_sync(0xffffffffu, cur_page, (lane >> 4) + 2);
                // (range-checked here, so the copies below only test the sign: one register less there)
                int tok_lo = static_cast<unsigned>(pg_lo) < static_cast<unsigned>(q_pages)
                                 ? __ldg(qmap + pg_lo * PAGE_ROWS + (lane & 15)) : -1;
                int tok_hi = static_cast<unsigned>(pg_hi) < static_cast<unsigned>(q_pages)
                                 ? __ldg(qmap + pg_hi * PAGE_ROWS + (lane & 15)) : -1;
                tok_lo = static_cast<unsigned>(tok_lo) < static_cast<unsigned>(q_tokens) ? tok_lo : -1;
                tok_hi = static_cast<unsigned>(tok_hi) < static_cast<unsigned>(q_tokens) ? tok_hi : -1;
#endif
                mbar_wait(q_empty(st), par ^ 1u);
#pragma unroll
                for (int p = 0; p < SP; ++p) {  // page by page: two live registers, the producer runs at 24
                    const int page[1] = {__shfl_sync(0xffffffffu, cur_page, p)};
                    const uint32_t mask[1] = {__shfl_sync(0xffffffffu, cur_mask, p)};
#ifdef PAGED_BWD_TOKENS
                    warp_copy_token_page<D, QS>((warp == 0 ? tQ0 : tdO0) + st * Cfg::kQBytes, p * PAGE_ROWS, rows,
                                                tq.stride, 0x7fffffff, q_pages, p < 2 ? tok_lo : tok_hi, (p & 1) * 16,
                                                page[0], mask[0]);
#else
                    warp_copy_pages<D, QS, 1>((warp == 0 ? tQ0 : tdO0) + st * Cfg::kQBytes, p * PAGE_ROWS,
                                              (warp == 0 ? q : dout) + bh * q_slots * D, q_pages, page, mask);
#endif
                }
                mbar_track_cp_async(q_full(st));
                mbar_arrive(q_full(st));
            }
            paged::cp_async_wait<0>();
        } else if (warp == 3 || (kDqBuffers == 2 && warp == 2)) {  // each step's dQ pages, one bulk reduction each
            const int w = kDqBuffers == 2 ? warp - 2 : 0;  // kWgDq: warp 2 + w reduces consumer warpgroup w's staging
            const uint32_t staging = tDq + w * Cfg::kDqBytes;
            float* dq_bh = dq_accum + bh * q_slots * D;
            int staged = 0;  // two stagings, PAIR: the steps warpgroup w staged (not those its half sees no page of)
#pragma unroll 1
            for (int t = 0; t < num_tiles; ++t) {
                if constexpr (kDqBuffers == 2 && PAIR) {  // a step half w sees no page of: w staged nothing
                    const int e = t * SP + lane;
                    const bool seen = lane < SP && e < stream_len &&
                                      static_cast<int>(pair_pages[3 * static_cast<size_t>(stream_begin + e) + 1 + w]) >= 0;
                    if (__ballot_sync(0xffffffffu, seen) == 0u) continue;
                }
                mbar_wait(dq_full(w), (kDqBuffers == 2 && PAIR ? staged++ : t) & 1);
                if (lane == 0) {
                    const int npages = min(SP, stream_len - t * SP);
                    for (int p = 0; p < npages; ++p) {
                        const int page = pages_all[t * SP + p];
                        if (static_cast<unsigned>(page) < static_cast<unsigned>(q_pages))
                            paged_bwd::bulk_reduce_add_f32(dq_bh + static_cast<size_t>(page) * PAGE_ROWS * D,
                                                           staging + p * Cfg::kPageBytesF32, Cfg::kPageBytesF32);
                    }
                    paged_bwd::bulk_commit();
                    paged_bwd::bulk_wait_read();
                    mbar_arrive(dq_empty(w));
                }
                __syncwarp();
            }
            if (lane == 0) paged_bwd::bulk_wait();
        }
        return;
    }

    // ================================ consumers ================================
    regs_claim<PAIR ? kPairConsumerRegs : kConsumerRegs>();
    const int kvp = role - 1;        // owned rows 64·kvp ..
    const int ctid = tid - 128;      // 0 .. 255
    const int wq = warp & 3;
    const int g = lane >> 2;
    const int t4 = lane & 3;
    const uint32_t own_mask = paged::load_page_mask(k_page_mask, own[kvp * 4 + wq], k_pages);
    const bool kvalid_lo = paged::page_row_valid(own_mask, g);
    const bool kvalid_hi = paged::page_row_valid(own_mask, g + 8);
    const uint32_t aK = tK + kvp * 64 * 128;
    const uint32_t aV = tV + kvp * 64 * 128;

    // LSE₂ (warpgroup 0) or Δ (warpgroup 1) of streamed row meta_row, staged by threads 0-63 of each
    // consumer warpgroup one step ahead. Its three dependent loads are spread over three steps, so none
    // stalls a step: in step t the value of step t + 1 (slot known), the page mask of step t + 2 (page
    // known), the page id of step t + 3. PAIR: each warpgroup b stages its own LSE₂ copy (threads 0-63),
    // holding the rows half b sees and the others as absent pages (LSE₂ = +inf); warpgroup 1's threads
    // 64-127 stage Δ, one copy over the union (where P is 0, so is dS).
    // kWgDq: every warpgroup stages (and reads) its own copies of both, LSE₂ by warps 0-1, Δ by warps 2-3.
    constexpr bool kHalfRows = PAIR || kWgDq;  // 64 staging threads per value and warpgroup
    const int meta_row = kHalfRows ? (ctid & 63) : (ctid & 127);
    const bool meta_thread = kWgDq || (PAIR ? kvp == 1 || (ctid & 127) < 64 : meta_row < QS);  // warp-uniform
    const bool meta_is_lse = kHalfRows ? (ctid & 127) < 64 : kvp == 0;
    float* const lse_copy = sLse + (kHalfRows ? kvp * QS : 0);  // the LSE₂ this warpgroup reads (and stages)
    float* const delta_copy = sDelta + (kWgDq ? kvp * QS : 0);  // the Δ it reads
    float* const sMeta = meta_is_lse ? lse_copy : delta_copy;
    const float* const meta_src = (meta_is_lse ? lse : delta) + bh * q_slots;
    // PAIR: pair_pages columns (union, seen by half 0, seen by half 1): Δ takes the union
    constexpr int kMetaStep = PAIR ? 3 : 1;
    const int* const meta_pages =
        PAIR ? reinterpret_cast<const int*>(pair_pages) + 3 * static_cast<size_t>(stream_begin) +
                   (meta_is_lse ? 1 + kvp : 0)
             : pages_all;
    auto meta_page = [&](int u) -> int {
        const int p = meta_row / PAGE_ROWS;
        return u < num_tiles && p < min(SP, stream_len - u * SP) ? meta_pages[(u * SP + p) * kMetaStep] : -1;
    };
    auto meta_slot = [&](uint32_t mask, int page) -> int {  // -1: padding or no page
        return paged::page_row_valid(mask, meta_row % PAGE_ROWS) ? page * PAGE_ROWS + meta_row % PAGE_ROWS : -1;
    };
    auto meta_value = [&](float raw, int slot) -> float {
        if (meta_is_lse) return slot >= 0 && raw > -INFINITY ? raw * paged::kLog2e : INFINITY;
        return slot >= 0 ? raw : 0.f;
    };
    int slot1 = -1, page2 = -1;  // step t + 1's slot, step t + 2's page
    bool seen1 = false;          // kWgDq: the half sees step t + 1's page of this row
    // PAIR: per stage, which of its 32 rows each LSE₂-staging warp gave a finite LSE₂ (ballot words
    // [stage][half][warp 0-1 of the half's warpgroup]); a half whose two words are 0 sees nothing in the step.
    // kWgDq: which rows lie on a page the half sees (page_seen), the rule warp 2 + w applies from pair_pages
    // alone to pass by the steps whose dQ staging warpgroup w skips
    uint32_t* const sSeen = reinterpret_cast<uint32_t*>(sDelta + 2 * MS);
    auto stage_meta = [&](int stage, float value, bool page_seen) {
        sMeta[stage * MS + meta_row] = value;
        if constexpr (PAIR) {
            if (meta_is_lse) {  // warps 0-1 of warpgroup kvp
                const uint32_t seen = __ballot_sync(0xffffffffu, kWgDq ? page_seen : value != INFINITY);
                if (lane == 0) sSeen[stage * 4 + 2 * kvp + wq] = seen;
            }
        }
    };
    if (meta_thread) {
        const int page0 = meta_page(0);
        const int slot0 = meta_slot(paged::load_page_mask(q_page_mask, page0, q_pages), page0);
        if (num_tiles > 0) stage_meta(0, meta_value(meta_src[max(slot0, 0)], slot0), page0 >= 0);
        const int page1 = meta_page(1);
        slot1 = meta_slot(paged::load_page_mask(q_page_mask, page1, q_pages), page1);
        seen1 = page1 >= 0;
        page2 = meta_page(2);
    }
    named_sync(1, 256);

    float acc_dk[D / 2];
    float acc_dv[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) acc_dk[i] = acc_dv[i] = 0.f;

    if constexpr (kWgDq) {
        // Per step, warpgroup-local: S, dP; P, dS; dV, dK issued; barrier (every warp's dQ GEMM of the
        // previous step has read the single dSᵀ tile); dSᵀ half stored; next LSE₂ / Δ staged; barrier; dV, dK
        // waited (P and dS registers free); dQ of every column over the own 64 keys; staged for warp 2 + kvp.
        // A PAIR step this half does not see is one branch of its own (no GEMM in flight where the two meet).
        const int bar = kGroupBarrier + kvp;
        const uint32_t tdSRows = tdS0 + kvp * 64 * 128;
        const uint32_t tKRows = tK + kvp * 64 * 128;
        const uint32_t staging = tDq + (kWgSum ? 0 : kvp * Cfg::kDqBytes) + wq * Cfg::kPageBytesF32;
        // kWgOffset: the two warpgroups start half a step apart (nothing in the loop pulls them back together
        // but their shared data): warpgroup 1 waits until warpgroup 0 has passed its first step's exponentials
        if (kWgOffset && kvp == 1 && num_tiles > 0) named_sync(kOffsetBarrier, 256);
        int staged = 0;  // steps whose dQ this warpgroup staged (a PAIR step it skips stages none)
#pragma unroll 1
        for (int t = 0; t < num_tiles; ++t) {
            const int st = t & 1;
            const uint32_t tQ = tQ0 + st * Cfg::kQBytes;
            const uint32_t tdO = tdO0 + st * Cfg::kQBytes;
            const float* tLse = lse_copy + st * MS;
            const float* tDelta = delta_copy + st * MS;
            mbar_wait(q_full(st), (t >> 1) & 1);
            fence_async_proxy();

            float raw1 = 0.f;
            uint32_t mask2 = 0;
            int page3 = -1;
            auto load_meta = [&]() {  // loads only: their results are first used in stage_next_meta
                if (meta_thread) {
                    raw1 = meta_src[max(slot1, 0)];
                    mask2 = paged::load_page_mask(q_page_mask, page2, q_pages);
                    page3 = meta_page(t + 3);
                }
            };
            // stage t + 1's buffer was last read by step t - 1's p_and_ds, before its second barrier; this
            // barrier also publishes the step's dSᵀ half
            auto stage_next_meta = [&]() {
                if (meta_thread) {
                    if (t + 1 < num_tiles) stage_meta(st ^ 1, meta_value(raw1, slot1), seen1);
                    slot1 = meta_slot(mask2, page2);
                    seen1 = page2 >= 0;
                    page2 = page3;
                }
                fence_async_proxy();
                named_sync(bar, 128);
            };
            auto release_q = [&]() {
                __syncwarp();
                if (lane == 0) mbar_arrive(q_empty(st));
            };
            auto release_partner = [&]() {
                if (kWgOffset && kvp == 0 && t == 0) named_arrive(kOffsetBarrier, 256);
            };
            // PAIR: a half that sees no page of the step skips it: no GEMM, no dQ staging (warp 2 + kvp passes
            // the step by on the same rule, from pair_pages)
            if (PAIR && (sSeen[st * 4 + 2 * kvp] | sSeen[st * 4 + 2 * kvp + 1]) == 0u) {
                release_partner();
                load_meta();
                stage_next_meta();
                release_q();
                if constexpr (kWgSum) {  // the shared staging's hand-off goes on: warpgroup 0 writes zeros
                    if (kvp == 0) {
                        if (t > 0) named_sync(kSumReadBarrier, 256);
                        mbar_wait(dq_empty(0), (t & 1) ^ 1u);
#pragma unroll
                        for (int i = lane; i < Cfg::kPageBytesF32 / 16; i += 32)
                            asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};\n" ::"r"(staging + 16 * i), "r"(0)
                                         : "memory");
                        fence_async_proxy();
                        named_arrive(kSumBarrier, 256);
                    } else {
                        named_sync(kSumBarrier, 256);
                        named_arrive(kSumReadBarrier, 256);
                        __syncwarp();
                        if (lane == 0) mbar_arrive(dq_full(0));
                    }
                }
            } else {
                uint32_t pa[QS / PAGE_ROWS][4];
                uint32_t pds[QS / PAGE_ROWS][4];
                paged_bwd::step_p_ds<D, BK, true>(pa, pds, aK, aV, tQ, tdO, kvalid_lo, kvalid_hi, tLse, tDelta,
                                                  scale_log2, t4, load_meta);
                paged_bwd::issue_dv_dk<D>(acc_dv, acc_dk, pa, pds, tQ, tdO);
                release_partner();
                named_sync(bar, 128);
                paged_bwd::store_ds<BK>(tdS0, pds, kvp, wq, g, t4);
                stage_next_meta();
                wgmma_wait<0>();  // dV and dK: P and dS registers free
                pin_registers(acc_dk);
                pin_registers(acc_dv);
                float dq[D / 2];
                wgmma_fence();
                paged_bwd::issue_dq_own<D, BK>(dq, tdSRows, tKRows);
                wgmma_commit();
                wgmma_wait<0>();  // Q, dO and the dSᵀ half are read
                pin_registers(dq);
                pin_registers(acc_dk);
                pin_registers(acc_dv);
                release_q();
                if (!kWgSum || kvp == 0) {
                    if (kWgSum && t > 0) named_sync(kSumReadBarrier, 256);
                    mbar_wait(dq_empty(kWgSum ? 0 : kvp), ((kWgSum ? t : staged) & 1) ^ 1u);
                    paged_bwd::stage_dq_rows<D, false>(staging, dq, g, t4);
                } else {  // kWgSum: warpgroup 1 adds its partial once warpgroup 0's is in
                    named_sync(kSumBarrier, 256);
                    paged_bwd::stage_dq_rows<D, true>(staging, dq, g, t4);
                    named_arrive(kSumReadBarrier, 256);
                }
                fence_async_proxy();  // generic-proxy stores -> the bulk copy's async-proxy reads
                __syncwarp();
                if (kWgSum && kvp == 0)
                    named_arrive(kSumBarrier, 256);
                else if (lane == 0)
                    mbar_arrive(dq_full(kWgSum ? 0 : kvp));
                ++staged;
            }
        }
        if (kWgSum && kvp == 0 && num_tiles > 0) named_sync(kSumReadBarrier, 256);  // the last step's arrival
    } else {
#pragma unroll 1
    for (int t = 0; t < num_tiles; ++t) {
        const int st = t & 1;
        const uint32_t tQ = tQ0 + st * Cfg::kQBytes;
        const uint32_t tdO = tdO0 + st * Cfg::kQBytes;
        const uint32_t tdS = tdS0 + st * Cfg::kSBytes;
        const float* tLse = lse_copy + st * MS;
        const float* tDelta = sDelta + st * MS;
        mbar_wait(q_full(st), (t >> 1) & 1);
        fence_async_proxy();

        float raw1 = 0.f;
        uint32_t mask2 = 0;
        int page3 = -1;
        // PAIR: a half that sees none of the step's rows skips its four GEMMs and leaves zeros as its dSᵀ
        if (PAIR && (sSeen[st * 4 + 2 * kvp] | sSeen[st * 4 + 2 * kvp + 1]) == 0u) {
            if (meta_thread) {
                raw1 = meta_src[max(slot1, 0)];
                mask2 = paged::load_page_mask(q_page_mask, page2, q_pages);
                page3 = meta_page(t + 3);
            }
            const uint32_t zero_ds[QS / PAGE_ROWS][4] = {};
            paged_bwd::store_ds<BK>(tdS, zero_ds, kvp, wq, g, t4);
        } else {
            float s[QS / 2];
            float dp[QS / 2];
            wgmma_fence();
            issue_qk<D, QS, BK>(s, aK, tQ);
            wgmma_commit();
            issue_qk<D, QS, BK>(dp, aV, tdO);
            wgmma_commit();
            if (meta_thread) {  // loads only: their results are first used at the end of the step
                raw1 = meta_src[max(slot1, 0)];
                mask2 = paged::load_page_mask(q_page_mask, page2, q_pages);
                page3 = meta_page(t + 3);
            }
            wgmma_wait<0>();
            pin_registers(s);
            pin_registers(dp);
            paged_bwd::p_and_ds(s, dp, kvalid_lo, kvalid_hi, tLse, tDelta, scale_log2, t4);
            uint32_t pa[QS / PAGE_ROWS][4];
            uint32_t pds[QS / PAGE_ROWS][4];
            pack_p<QS>(pa, s);
            pack_p<QS>(pds, dp);
            paged_bwd::store_ds<BK>(tdS, pds, kvp, wq, g, t4);
            wgmma_fence();
            issue_pv<D, QS>(acc_dv, pa, tdO);
            wgmma_commit();
            issue_pv<D, QS>(acc_dk, pds, tQ);
            wgmma_commit();
        }
        // stage t + 1's buffer was last read by step t - 1's p_and_ds, before the previous named barrier
        if (meta_thread) {
            if (t + 1 < num_tiles) stage_meta(st ^ 1, meta_value(raw1, slot1), true);
            slot1 = meta_slot(mask2, page2);
            page2 = page3;
        }
        fence_async_proxy();
        named_sync(1, 256);  // both dSᵀ halves of this step and step t + 1's LSE₂ and Δ are in shared memory

        // dQ[:, 64·kvp ..] = dS · K[:, 64·kvp ..] (at d = 64 warpgroup 0 alone)
        const bool has_dq = D == 128 || kvp == 0;
        float dq[32];
        wgmma_fence();
        if (has_dq) {
            paged_bwd::issue_dq<BK>(dq, tdS, tK + kvp * (BK * 128));
            wgmma_commit();
        }
        wgmma_wait<0>();  // dV, dK and dQ of this step: Q, dO and dSᵀ are read
        pin_registers(dq);
        pin_registers(acc_dk);
        pin_registers(acc_dv);
        __syncwarp();
        if (lane == 0) mbar_arrive(q_empty(st));

        // dQ partial -> staging (page wq of the step: rows 16·wq .., contiguous fp32 page), for warp 3
        mbar_wait(dq_empty(0), (t & 1) ^ 1u);
        if (has_dq)
            paged_bwd::stage_dq_page<D>(tDq + wq * Cfg::kPageBytesF32, dq, 64 * kvp, g, t4);
        fence_async_proxy();  // generic-proxy stores -> the bulk copy's async-proxy reads
        __syncwarp();
        if (lane == 0) mbar_arrive(dq_full(0));
    }
    }

    // dK (scaled) and dV: staged bf16 in the K / V tiles once neither consumer reads them, then 16-byte stores
    named_sync(1, 256);
    paged_bwd::stage_dk_dv<D, BK>(tK, tV, acc_dk, acc_dv, scale, kvp, wq, g, t4);
    named_sync(1, 256);
#ifdef PAGED_BWD_TOKENS
    const TokenRows tk = token_rows(bh, tok_heads, k_tokens, D);
    paged_bwd::store_dk_dv_tokens<D, BK, 256>(tK, tV, own, k_pages, k_map + (maps_per_row ? bh * k_slots : 0), k_tokens,
                                              dk + tk.base, dv + tk.base, tk.stride, ctid);
#else
    paged_bwd::store_dk_dv<D, BK, 256>(tK, tV, own, k_pages, dk + bh * k_slots * D, dv + bh * k_slots * D, ctid);
#endif
}

#define PAGED_BWD_WS_INSTANTIATE(D, PAIR)                                                                   \
    template __global__ void paged_bwd_ws_kernel<D, PAIR>(                                                  \
        const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, const float*, \
        const float*, float*, __nv_bfloat16*, __nv_bfloat16*, const int*, const int*, int, const int*,        \
        const int*, const uint16_t*, const uint16_t*, int, int, int, int, float, float,                       \
        const unsigned int* PAGED_BWD_TOKEN_TYPES);
PAGED_BWD_WS_INSTANTIATE(64, false)
PAGED_BWD_WS_INSTANTIATE(128, false)
PAGED_BWD_WS_INSTANTIATE(64, true)
PAGED_BWD_WS_INSTANTIATE(128, true)

// ---- dQ in a Q-owned pass (DQ_NONE's partner): no atomics, deterministic ------------------------------

namespace paged_bwd_dq {

template <int HEAD_DIM, int BLOCK_Q>
struct Config {
    static constexpr int kWGs = BLOCK_Q / 64;  // one consumer warpgroup per 64 owned Q rows
    static constexpr int kThreads = 128 * kWGs;
    static constexpr int kWarps = kThreads / 32;
    static constexpr int kOwnPages = BLOCK_Q / PAGE_ROWS;
    static constexpr int kKeys = 64;                              // streamed K/V rows per step
    static constexpr int kStreamPages = kKeys / PAGE_ROWS;
    static constexpr int kQBytes = BLOCK_Q * HEAD_DIM * 2;         // Q or dO (owned)
    static constexpr int kKBytes = kKeys * HEAD_DIM * 2;           // one K or V buffer
    static constexpr int kMetaBytes = 2 * kStreamPages * 4;        // K page masks, x2
    static constexpr int kSmemBytes = 1024 + 2 * kQBytes + 4 * kKBytes + kMetaBytes;
    static_assert(BLOCK_Q == 64 || BLOCK_Q == 128, "owned tile of 64 or 128 rows");
    static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "head dim 64 or 128");
    static_assert(kSmemBytes <= 227 * 1024, "over the per-block shared-memory limit");
};

}  // namespace paged_bwd_dq

// dQ of the Q rows a work item of an owner-"q" plan owns (the forward's plan layout: own_pages = Q pages,
// stream_pages = K/V pages of every selected K block), with Δ from bsa_bwd_preprocess. Per step of 64
// streamed keys, per warpgroup (64 owned rows):
//   S  = Q·Kᵀ, dP = dO·Vᵀ          wgmma SS, 64 x 64
//   P  = exp2(S·scale·log2e − LSE₂) 0 for invalid keys; invalid rows have LSE₂ = +inf
//   dS = P ∘ (dP − Δ)
//   dQ += dS·K                      wgmma RS (dS from registers), 64 x HEAD_DIM, fp32 in registers
// then dQ = bf16(scale · dQ) for every row of the owned pages (0 for padding rows). Grid (work items
// [work_offset, work_offset + gridDim.x) of one route, batch), block Config::kThreads, dynamic shared
// memory Config::kSmemBytes. Synchronous like paged_bwd_kernel: one __syncthreads per step, the next
// step's K/V prefetched with cp.async during this step's GEMMs.
template <int HEAD_DIM, int BLOCK_Q>
__global__ void __launch_bounds__(paged_bwd_dq::Config<HEAD_DIM, BLOCK_Q>::kThreads, 1)
paged_bwd_dq_kernel(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                    const __nv_bfloat16* __restrict__ v, const __nv_bfloat16* __restrict__ dout,
                    const float* __restrict__ lse, const float* __restrict__ delta, __nv_bfloat16* __restrict__ dq,
                    const int* __restrict__ work_head, const int* __restrict__ own_pages, int max_own,
                    const int* __restrict__ stream_indptr, const int* __restrict__ stream_pages,
                    const uint16_t* __restrict__ q_page_mask, const uint16_t* __restrict__ k_page_mask,
                    int work_offset, int heads, int q_slots, int k_slots, float scale, float scale_log2) {
    using namespace hopper;
    using Cfg = paged_bwd_dq::Config<HEAD_DIM, BLOCK_Q>;
    constexpr int D = HEAD_DIM;
    constexpr int KEYS = Cfg::kKeys;

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const uint32_t base = (paged::smem_u32(smem_raw) + 1023u) & ~1023u;
    unsigned char* const smem = smem_raw + (base - paged::smem_u32(smem_raw));
    const uint32_t tQ = base;
    const uint32_t tdO = tQ + Cfg::kQBytes;
    const uint32_t tK0 = tdO + Cfg::kQBytes;          // [2] K buffers
    const uint32_t tV0 = tK0 + 2 * Cfg::kKBytes;      // [2] V buffers
    uint32_t* sKmask = reinterpret_cast<uint32_t*>(smem + 2 * Cfg::kQBytes + 4 * Cfg::kKBytes);  // [2][pages]

    const int tid = threadIdx.x;
    const int warp = tid >> 5;
    const int lane = tid & 31;
    const int wg = tid >> 7;
    const int wq = warp & 3;
    const int g = lane >> 2;
    const int t4 = lane & 3;

    const int work = blockIdx.x + work_offset;
    const int head = work_head[work];
    const size_t bh = static_cast<size_t>(blockIdx.y) * heads + head;
    const __nv_bfloat16* k_bh = k + bh * k_slots * D;
    const __nv_bfloat16* v_bh = v + bh * k_slots * D;
    const int q_pages = q_slots / PAGE_ROWS;
    const int k_pages = k_slots / PAGE_ROWS;
    const int* own = own_pages + static_cast<size_t>(work) * max_own;
    const int stream_begin = stream_indptr[work];
    const int stream_len = stream_indptr[work + 1] - stream_begin;
    const int num_tiles = (stream_len + Cfg::kStreamPages - 1) / Cfg::kStreamPages;

    paged_bwd::load_owned_pages<D, BLOCK_Q, Cfg::kWarps>(tQ, tdO, q, dout, bh * q_slots * D, own, q_page_mask,
                                                         q_pages, warp);
    // this thread's two rows (g, g + 8 of its warp's page): LSE₂ (+inf when invalid or without keys) and Δ
    const int my_page = own[wg * 4 + wq];
    const uint32_t my_mask = paged::load_page_mask(q_page_mask, my_page, q_pages);
    float row_lse[2], row_delta[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = g + 8 * half;
        const bool valid = paged::page_row_valid(my_mask, r);
        const size_t slot = static_cast<size_t>(valid ? my_page : 0) * PAGE_ROWS + r;
        const float l = valid ? lse[bh * q_slots + slot] : -INFINITY;
        row_lse[half] = l > -INFINITY ? l * paged::kLog2e : INFINITY;
        row_delta[half] = valid ? delta[bh * q_slots + slot] : 0.f;
    }

    auto load_stream_tile = [&](int tile, int buf) {
        const int* pages = stream_pages + stream_begin + tile * Cfg::kStreamPages;
        const int npages = min(Cfg::kStreamPages, stream_len - tile * Cfg::kStreamPages);
        for (int i = warp; i < 2 * Cfg::kStreamPages; i += Cfg::kWarps) {
            const int p = i % Cfg::kStreamPages;
            const int page[1] = {p < npages ? pages[p] : -1};
            const uint32_t mask[1] = {paged::load_page_mask(k_page_mask, page[0], k_pages)};
            const bool is_k = i < Cfg::kStreamPages;
            warp_copy_pages<D, KEYS, 1>((is_k ? tK0 : tV0) + buf * Cfg::kKBytes, p * PAGE_ROWS, is_k ? k_bh : v_bh,
                                        k_pages, page, mask);
        }
        if (tid < Cfg::kStreamPages) {
            const int page = tid < npages ? pages[tid] : -1;
            sKmask[buf * Cfg::kStreamPages + tid] = paged::load_page_mask(k_page_mask, page, k_pages);
        }
    };

    if (num_tiles > 0) load_stream_tile(0, 0);
    paged::cp_async_commit();

    float acc_dq[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) acc_dq[i] = 0.f;
    const uint32_t aQ = tQ + wg * 64 * 128;  // this warpgroup's 64 owned rows (inside each column block)
    const uint32_t adO = tdO + wg * 64 * 128;

#pragma unroll 1
    for (int tile = 0; tile < num_tiles; ++tile) {
        const int buf = tile & 1;
        paged::cp_async_wait<0>();
        fence_async_proxy();
        __syncthreads();  // step tile - 1 is done everywhere: its buffers may be overwritten
        if (tile + 1 < num_tiles) load_stream_tile(tile + 1, buf ^ 1);
        paged::cp_async_commit();
        const uint32_t tK = tK0 + buf * Cfg::kKBytes;
        const uint32_t tV = tV0 + buf * Cfg::kKBytes;

        float s[KEYS / 2];
        float dp[KEYS / 2];
        wgmma_fence();
        issue_qk<D, KEYS, BLOCK_Q>(s, aQ, tK);
        wgmma_commit();
        issue_qk<D, KEYS, BLOCK_Q>(dp, adO, tV);
        wgmma_commit();
        wgmma_wait<0>();
        pin_registers(s);
        pin_registers(dp);

        const uint32_t col_bits = column_bits<KEYS>(sKmask + buf * Cfg::kStreamPages, t4);
#pragma unroll
        for (int j = 0; j < KEYS / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int half = e >> 1;
                const bool kvalid = (col_bits >> (2 * j + (e & 1))) & 1u;
                const float p = kvalid ? exp2f(fmaf(s[4 * j + e], scale_log2, -row_lse[half])) : 0.f;
                dp[4 * j + e] = p * (dp[4 * j + e] - row_delta[half]);
            }
        }
        uint32_t pds[KEYS / PAGE_ROWS][4];
        pack_p<KEYS>(pds, dp);
        wgmma_fence();
        issue_pv<D, KEYS>(acc_dq, pds, tK);
        wgmma_commit();
        wgmma_wait<0>();
        pin_registers(acc_dq);
    }

    // dQ = bf16(scale · acc) for both rows of every owned page (0 for padding rows)
    if (static_cast<unsigned>(my_page) < static_cast<unsigned>(q_pages)) {
        __nv_bfloat16* dq_page = dq + (bh * q_pages + my_page) * PAGE_ROWS * D;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = g + 8 * half;
            const float f = paged::page_row_valid(my_mask, r) ? scale : 0.f;
            uint32_t* row = reinterpret_cast<uint32_t*>(dq_page + r * D);
#pragma unroll
            for (int j = 0; j < D / 8; ++j)
                row[(8 * j + 2 * t4) / 2] = paged::pack_bf16x2(acc_dq[4 * j + 2 * half] * f, acc_dq[4 * j + 2 * half + 1] * f);
        }
    }
}

#define PAGED_BWD_DQ_INSTANTIATE(D, BQ)                                                                       \
    template __global__ void paged_bwd_dq_kernel<D, BQ>(                                                      \
        const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, const float*, \
        const float*, __nv_bfloat16*, const int*, const int*, int, const int*, const int*, const uint16_t*,    \
        const uint16_t*, int, int, int, int, float, float);
PAGED_BWD_DQ_INSTANTIATE(64, 64)
PAGED_BWD_DQ_INSTANTIATE(64, 128)
PAGED_BWD_DQ_INSTANTIATE(128, 64)
PAGED_BWD_DQ_INSTANTIATE(128, 128)
// Magnitude bits (bf16, sign cleared) of the largest finite element over the valid rows of x
// [outer, slots, head_dim] (page_mask over the slots), atomically max-ed into *out. Grid-stride, 8 elements
// (16 bytes) per thread and step.
__global__ void __launch_bounds__(256) bwd_absmax_bf16(const uint4* __restrict__ x, long long n8, int head_dim,
                                                       int slots, const uint16_t* __restrict__ page_mask,
                                                       unsigned int* __restrict__ out) {
    unsigned int m = 0u;
    const int chunks = head_dim / 8;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n8;
         i += static_cast<long long>(gridDim.x) * blockDim.x) {
        const int slot = static_cast<int>((i / chunks) % slots);
        if (!((page_mask[slot / PAGE_ROWS] >> (slot % PAGE_ROWS)) & 1u)) continue;
        const uint4 v = x[i];
        const unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const unsigned int lo = w[k] & 0x7fffu, hi = (w[k] >> 16) & 0x7fffu;
            if (lo < 0x7f80u) m = max(m, lo);  // finite only
            if (hi < 0x7f80u) m = max(m, hi);
        }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, off));
    if ((threadIdx.x & 31) == 0 && m) atomicMax(out, m);
}

// dQ = bf16(scale · accum / unit) from the DQ_FIXED int64 accumulator (n2 pairs of elements).
__global__ void __launch_bounds__(256) bwd_fixed_postprocess(const long long* __restrict__ dq_accum,
                                                             __nv_bfloat16* __restrict__ dq, float scale,
                                                             const unsigned int* __restrict__ dq_absmax,
                                                             int head_dim, long long n2) {
    const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= n2) return;
    const double f = static_cast<double>(scale) / static_cast<double>(paged_bwd::fixed_point_scale(dq_absmax, head_dim));
    const longlong2 a = reinterpret_cast<const longlong2*>(dq_accum)[i];
    const float x = static_cast<float>(static_cast<double>(a.x) * f);
    const float y = static_cast<float>(static_cast<double>(a.y) * f);
    reinterpret_cast<uint32_t*>(dq)[i] = paged::pack_bf16x2(x, y);
}

#define PAGED_BWD_INSTANTIATE(D, BK, QSPLIT, MODE)                                                     \
    template __global__ void paged_bwd_kernel<D, BK, QSPLIT, MODE>(                                    \
        const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*,        \
        const float*, const float*, float*, __nv_bfloat16*, __nv_bfloat16*, const int*, const int*, int, \
        const int*, const int*, const uint16_t*, const uint16_t*, int, int, int, int, float, float,     \
        const unsigned int* PAGED_BWD_TOKEN_TYPES);
PAGED_BWD_INSTANTIATE(64, 64, 1, 0)
PAGED_BWD_INSTANTIATE(64, 128, 1, 0)
PAGED_BWD_INSTANTIATE(128, 64, 1, 0)
PAGED_BWD_INSTANTIATE(128, 128, 1, 0)
PAGED_BWD_INSTANTIATE(64, 64, 2, 0)
PAGED_BWD_INSTANTIATE(128, 64, 2, 0)
PAGED_BWD_INSTANTIATE(64, 64, 1, 1)
PAGED_BWD_INSTANTIATE(64, 128, 1, 1)
PAGED_BWD_INSTANTIATE(128, 64, 1, 1)
PAGED_BWD_INSTANTIATE(128, 128, 1, 1)
PAGED_BWD_INSTANTIATE(64, 64, 2, 1)
PAGED_BWD_INSTANTIATE(128, 64, 2, 1)
PAGED_BWD_INSTANTIATE(64, 64, 1, 2)
PAGED_BWD_INSTANTIATE(64, 128, 1, 2)
PAGED_BWD_INSTANTIATE(128, 64, 1, 2)
PAGED_BWD_INSTANTIATE(128, 128, 1, 2)
PAGED_BWD_INSTANTIATE(64, 64, 2, 2)
PAGED_BWD_INSTANTIATE(128, 64, 2, 2)
PAGED_BWD_INSTANTIATE(64, 64, 1, 3)
PAGED_BWD_INSTANTIATE(64, 128, 1, 3)
PAGED_BWD_INSTANTIATE(128, 64, 1, 3)
PAGED_BWD_INSTANTIATE(128, 128, 1, 3)

#ifdef PAGED_BWD_TOKENS
// The token-order build's preprocess: Δ[row] = rowsum(dO ∘ O) of the token slot row holds (0 for a padding
// slot), rows = batch · heads · q_slots in slot order; O and dO [batch, q_tokens, tok_heads, HEAD_DIM].
template <int HEAD_DIM>
__global__ void __launch_bounds__(256) tokens_bwd_preprocess(const __nv_bfloat16* __restrict__ out,
                                                             const __nv_bfloat16* __restrict__ dout,
                                                             float* __restrict__ delta, long long rows, int q_slots,
                                                             const int* __restrict__ q_map, int q_tokens, int tok_heads,
                                                             int maps_per_row) {
    constexpr int kLanesPerRow = HEAD_DIM / 8;
    const long long gid = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    const long long row = gid / kLanesPerRow;
    const int part = static_cast<int>(gid % kLanesPerRow);
    float acc = 0.f;
    if (row < rows) {
        const long long bh = row / q_slots;
        const int slot = static_cast<int>(row - bh * q_slots);
        const int t = q_map[(maps_per_row ? bh * q_slots : 0) + slot];
        if (static_cast<unsigned>(t) < static_cast<unsigned>(q_tokens)) {
            const hopper::TokenRows tr = hopper::token_rows(static_cast<size_t>(bh), tok_heads, q_tokens, HEAD_DIM);
            const size_t at = tr.base + static_cast<size_t>(static_cast<uint32_t>(t) * tr.stride) + part * 8;
            acc = paged::dot8_bf16(out + at, dout + at, acc);
        }
    }
#pragma unroll
    for (int off = kLanesPerRow / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (row < rows && part == 0) delta[row] = acc;
}

// The token-order build's postprocess: each slot row's dQ = bf16(scale · dq_accum) to the token it holds
// (padding slots: nothing), 4 elements per thread; dq [batch, q_tokens, tok_heads, HEAD_DIM].
template <int HEAD_DIM>
__global__ void __launch_bounds__(256) tokens_bwd_postprocess(const float* __restrict__ dq_accum,
                                                              __nv_bfloat16* __restrict__ dq, float scale, long long n4,
                                                              int q_slots, const int* __restrict__ q_map, int q_tokens,
                                                              int tok_heads, int maps_per_row) {
    constexpr int kQuadsPerRow = HEAD_DIM / 4;
    const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= n4) return;
    const long long row = i / kQuadsPerRow;
    const int part = static_cast<int>(i - row * kQuadsPerRow);
    const long long bh = row / q_slots;
    const int slot = static_cast<int>(row - bh * q_slots);
    const int t = q_map[(maps_per_row ? bh * q_slots : 0) + slot];
    if (static_cast<unsigned>(t) >= static_cast<unsigned>(q_tokens)) return;
    const float4 a = reinterpret_cast<const float4*>(dq_accum)[i];
    uint2 packed;
    packed.x = paged::pack_bf16x2(a.x * scale, a.y * scale);
    packed.y = paged::pack_bf16x2(a.z * scale, a.w * scale);
    const hopper::TokenRows tr = hopper::token_rows(static_cast<size_t>(bh), tok_heads, q_tokens, HEAD_DIM);
    *reinterpret_cast<uint2*>(dq + tr.base + static_cast<size_t>(static_cast<uint32_t>(t) * tr.stride) + part * 4) = packed;
}

template __global__ void tokens_bwd_preprocess<64>(const __nv_bfloat16*, const __nv_bfloat16*, float*, long long, int,
                                                   const int*, int, int, int);
template __global__ void tokens_bwd_preprocess<128>(const __nv_bfloat16*, const __nv_bfloat16*, float*, long long, int,
                                                    const int*, int, int, int);
template __global__ void tokens_bwd_postprocess<64>(const float*, __nv_bfloat16*, float, long long, int, const int*, int,
                                                    int, int);
template __global__ void tokens_bwd_postprocess<128>(const float*, __nv_bfloat16*, float, long long, int, const int*,
                                                     int, int, int);
#endif
