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
// Simple synchronous structure (version 1): every thread copies and computes, one __syncthreads per
// step; the prefetch of step t + 1 overlaps the GEMMs of step t.
#include "hopper_wgmma.cuh"

#define PB_Q_ROWS 64  // streamed Q rows per step

namespace paged_bwd {

template <int HEAD_DIM, int BLOCK_K>
struct Config {
    static constexpr int kConsumerWGs = BLOCK_K / 64;
    static constexpr int kThreads = 128 * kConsumerWGs;
    static constexpr int kWarps = kThreads / 32;
    static constexpr int kOwnPages = BLOCK_K / PAGE_ROWS;
    static constexpr int kStreamPages = PB_Q_ROWS / PAGE_ROWS;
    static constexpr int kKBytes = BLOCK_K * HEAD_DIM * 2;    // K or V (owned), canonical swizzled tile
    static constexpr int kQBytes = PB_Q_ROWS * HEAD_DIM * 2;  // one Q or dO buffer
    static constexpr int kSBytes = BLOCK_K * PB_Q_ROWS * 2;   // dSᵀ [BLOCK_K][64] bf16
    static constexpr int kMetaBytes = 3 * 2 * PB_Q_ROWS * 4;  // LSE₂, Δ, slot per streamed row, x2
    static constexpr int kSmemBytes = 1024 + 2 * kKBytes + 4 * kQBytes + kSBytes + kMetaBytes;
    static_assert(BLOCK_K == 64 || BLOCK_K == 128, "owned tile of 64 or 128 rows");
    static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "head dim 64 or 128");
    static_assert(kSmemBytes <= 227 * 1024, "over the per-block shared-memory limit");
};

__device__ __forceinline__ void red_add_v2(float* addr, float a, float b) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(addr), "f"(a), "f"(b) : "memory");
}

}  // namespace paged_bwd

// Grid (work items [work_offset, work_offset + gridDim.x) of one route, batch), block Config::kThreads,
// dynamic shared memory Config::kSmemBytes. Arguments as bsa_bwd_kernel.
template <int HEAD_DIM, int BLOCK_K>
__global__ void __launch_bounds__(paged_bwd::Config<HEAD_DIM, BLOCK_K>::kThreads, 1)
paged_bwd_kernel(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                 const __nv_bfloat16* __restrict__ v, const __nv_bfloat16* __restrict__ dout,
                 const float* __restrict__ lse, const float* __restrict__ delta, float* __restrict__ dq_accum,
                 __nv_bfloat16* __restrict__ dk, __nv_bfloat16* __restrict__ dv, const int* __restrict__ work_head,
                 const int* __restrict__ own_pages, int max_own, const int* __restrict__ stream_indptr,
                 const int* __restrict__ stream_pages, const uint16_t* __restrict__ k_page_mask,
                 const uint16_t* __restrict__ q_page_mask, int work_offset, int heads, int q_slots, int k_slots,
                 float scale, float scale_log2) {
    using namespace hopper;
    using Cfg = paged_bwd::Config<HEAD_DIM, BLOCK_K>;
    constexpr int D = HEAD_DIM;

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const uint32_t base = (paged::smem_u32(smem_raw) + 1023u) & ~1023u;
    unsigned char* const smem = smem_raw + (base - paged::smem_u32(smem_raw));
    const uint32_t tK = base;
    const uint32_t tV = tK + Cfg::kKBytes;
    const uint32_t tQ0 = tV + Cfg::kKBytes;         // [2] Q buffers
    const uint32_t tdO0 = tQ0 + 2 * Cfg::kQBytes;   // [2] dO buffers
    const uint32_t tdS = tdO0 + 2 * Cfg::kQBytes;   // dSᵀ
    const int meta_off = 2 * Cfg::kKBytes + 4 * Cfg::kQBytes + Cfg::kSBytes;
    float* sLse = reinterpret_cast<float*>(smem + meta_off);  // [2][64], log2 units, +inf = no keys
    float* sDelta = sLse + 2 * PB_Q_ROWS;                      // [2][64]
    int* sSlot = reinterpret_cast<int*>(sDelta + 2 * PB_Q_ROWS);  // [2][64], -1 = invalid row

    const int tid = threadIdx.x;
    const int warp = tid >> 5;
    const int lane = tid & 31;
    const int wg = tid >> 7;         // consumer warpgroup: owned rows 64·wg ..
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
    float* dq_bh = dq_accum + bh * q_slots * D;
    const int q_pages = q_slots / PAGE_ROWS;
    const int k_pages = k_slots / PAGE_ROWS;
    const int* own = own_pages + static_cast<size_t>(work) * max_own;
    const int stream_begin = stream_indptr[work];
    const int stream_len = stream_indptr[work + 1] - stream_begin;
    const int num_tiles = (stream_len + Cfg::kStreamPages - 1) / Cfg::kStreamPages;

    // owned K and V pages: warp w copies pages w, w + kWarps, ... of the 2·kOwnPages
    for (int i = warp; i < 2 * Cfg::kOwnPages; i += Cfg::kWarps) {
        const int p = i % Cfg::kOwnPages;
        const int page[1] = {own[p]};
        const uint32_t mask[1] = {paged::load_page_mask(k_page_mask, page[0], k_pages)};
        warp_copy_pages<D, BLOCK_K, 1>(i < Cfg::kOwnPages ? tK : tV, p * PAGE_ROWS,
                                       (i < Cfg::kOwnPages ? k : v) + bh * k_slots * D, k_pages, page, mask);
    }
    const uint32_t own_mask = paged::load_page_mask(k_page_mask, own[wg * 4 + wq], k_pages);
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
            warp_copy_pages<D, PB_Q_ROWS, 1>((is_q ? tQ0 : tdO0) + buf * Cfg::kQBytes, p * PAGE_ROWS,
                                             is_q ? q_bh : do_bh, q_pages, page, mask);
        }
        for (int row = tid; row < PB_Q_ROWS; row += Cfg::kThreads) {
            const int p = row / PAGE_ROWS;
            const int page = p < npages ? pages[p] : -1;
            const bool valid = paged::page_row_valid(paged::load_page_mask(q_page_mask, page, q_pages), row % PAGE_ROWS);
            const int slot = page * PAGE_ROWS + row % PAGE_ROWS;
            const float l = valid ? lse_bh[slot] : -INFINITY;
            sLse[buf * PB_Q_ROWS + row] = l > -INFINITY ? l * paged::kLog2e : INFINITY;
            sDelta[buf * PB_Q_ROWS + row] = valid ? delta_bh[slot] : 0.f;
            sSlot[buf * PB_Q_ROWS + row] = valid ? slot : -1;
        }
    };

    if (num_tiles > 0) load_stream_tile(0, 0);
    paged::cp_async_commit();

    float acc_dk[D / 2];
    float acc_dv[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) acc_dk[i] = acc_dv[i] = 0.f;
    const uint32_t aK = tK + wg * 64 * 128;  // this warpgroup's 64 owned rows (inside each column block)
    const uint32_t aV = tV + wg * 64 * 128;

#pragma unroll 1
    for (int tile = 0; tile < num_tiles; ++tile) {
        const int buf = tile & 1;
        paged::cp_async_wait<0>();
        fence_async_proxy();
        __syncthreads();  // step tile - 1 is done everywhere: its buffers and dSᵀ may be overwritten
        fence_async_proxy();
        if (tile + 1 < num_tiles) load_stream_tile(tile + 1, buf ^ 1);
        paged::cp_async_commit();
        const uint32_t tQ = tQ0 + buf * Cfg::kQBytes;
        const uint32_t tdO = tdO0 + buf * Cfg::kQBytes;
        const float* tLse = sLse + buf * PB_Q_ROWS;
        const float* tDelta = sDelta + buf * PB_Q_ROWS;

        float s[PB_Q_ROWS / 2];
        float dp[PB_Q_ROWS / 2];
        wgmma_fence();
        issue_qk<D, PB_Q_ROWS, BLOCK_K>(s, aK, tQ);
        wgmma_commit();
        issue_qk<D, PB_Q_ROWS, BLOCK_K>(dp, aV, tdO);
        wgmma_commit();
        wgmma_wait<0>();
        pin_registers(s);
        pin_registers(dp);

#pragma unroll
        for (int j = 0; j < PB_Q_ROWS / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = 8 * j + 2 * t4 + (e & 1);
                const bool kvalid = e < 2 ? kvalid_lo : kvalid_hi;
                const float p = kvalid ? exp2f(fmaf(s[4 * j + e], scale_log2, -tLse[col])) : 0.f;
                s[4 * j + e] = p;
                dp[4 * j + e] = p * (dp[4 * j + e] - tDelta[col]);
            }
        }
        uint32_t pa[PB_Q_ROWS / PAGE_ROWS][4];
        uint32_t pds[PB_Q_ROWS / PAGE_ROWS][4];
        pack_p<PB_Q_ROWS>(pa, s);
        pack_p<PB_Q_ROWS>(pds, dp);
        // dSᵀ -> shared: owned row r, streamed column c at (r, chunk c / 8) of the [BLOCK_K][64] tile
#pragma unroll
        for (int j = 0; j < PB_Q_ROWS / 8; ++j) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = wg * 64 + 16 * wq + g + 8 * half;
                const uint32_t addr = tdS + tile_offset<BLOCK_K>(row, j) + 4u * t4;
                asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(pds[j >> 1][(j & 1) * 2 + half]) : "memory");
            }
        }
        wgmma_fence();
        issue_pv<D, PB_Q_ROWS>(acc_dv, pa, tdO);
        wgmma_commit();
        issue_pv<D, PB_Q_ROWS>(acc_dk, pds, tQ);
        wgmma_commit();
        fence_async_proxy();
        __syncthreads();  // every warpgroup's dSᵀ rows are in shared memory

        // dQ[:, 64·h .. 64·h + 63] = dS · K[:, 64·h ..], K-dim = the BLOCK_K owned rows
#pragma unroll 1
        for (int h = wg; h < D / 64; h += Cfg::kConsumerWGs) {
            float dq[32];
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BLOCK_K / 16; ++kk) {
                const uint64_t da = smem_desc(tdS + kk * (PAGE_ROWS * 128), BLOCK_K * 128, 1024);
                const uint64_t db = smem_desc(tK + h * (BLOCK_K * 128) + kk * (PAGE_ROWS * 128), BLOCK_K * 128, 1024);
                wgmma_ss_tt<64>(dq, da, db, kk > 0);
            }
            wgmma_commit();
            wgmma_wait<0>();
            pin_registers(dq);
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int slot = sSlot[buf * PB_Q_ROWS + 16 * wq + g + 8 * half];
                if (slot >= 0) {
                    float* row_ptr = dq_bh + static_cast<size_t>(slot) * D + 64 * h + 2 * t4;
#pragma unroll
                    for (int j = 0; j < 8; ++j)
                        paged_bwd::red_add_v2(row_ptr + 8 * j, dq[4 * j + 2 * half], dq[4 * j + 2 * half + 1]);
                }
            }
        }
        wgmma_wait<0>();
        pin_registers(acc_dk);
        pin_registers(acc_dv);
    }

    // dK (scaled) and dV: staged bf16 in the K / V tiles, then 16-byte stores of every owned row
    paged::cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = wg * 64 + 16 * wq + g + 8 * half;
            const uint32_t off = tile_offset<BLOCK_K>(row, j) + 4u * t4;
            const uint32_t kbits = paged::pack_bf16x2(acc_dk[4 * j + 2 * half] * scale, acc_dk[4 * j + 2 * half + 1] * scale);
            const uint32_t vbits = paged::pack_bf16x2(acc_dv[4 * j + 2 * half], acc_dv[4 * j + 2 * half + 1]);
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(tK + off), "r"(kbits) : "memory");
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(tV + off), "r"(vbits) : "memory");
        }
    }
    __syncthreads();
    __nv_bfloat16* dk_bh = dk + bh * k_slots * D;
    __nv_bfloat16* dv_bh = dv + bh * k_slots * D;
    constexpr int kChunksPerRow = D / 8;
#pragma unroll 4
    for (int c = tid; c < BLOCK_K * kChunksPerRow; c += Cfg::kThreads) {
        const int row = c / kChunksPerRow;
        const int chunk = c % kChunksPerRow;
        const int page = own[row / PAGE_ROWS];
        if (static_cast<unsigned>(page) < static_cast<unsigned>(k_pages)) {
            const size_t dst = (static_cast<size_t>(page) * PAGE_ROWS + row % PAGE_ROWS) * D + chunk * 8;
            const uint32_t off = tile_offset<BLOCK_K>(row, chunk);
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

#define PAGED_BWD_INSTANTIATE(D, BK)                                                                   \
    template __global__ void paged_bwd_kernel<D, BK>(                                                  \
        const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*,        \
        const float*, const float*, float*, __nv_bfloat16*, __nv_bfloat16*, const int*, const int*, int, \
        const int*, const int*, const uint16_t*, const uint16_t*, int, int, int, int, float, float);
PAGED_BWD_INSTANTIATE(64, 64)
PAGED_BWD_INSTANTIATE(64, 128)
PAGED_BWD_INSTANTIATE(128, 64)
PAGED_BWD_INSTANTIATE(128, 128)
