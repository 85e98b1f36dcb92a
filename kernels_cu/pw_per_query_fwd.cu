// PageWeaver's per-query paged baseline on Hopper: FP8 (e4m3) paged K/V, bf16 Q, mma.sync m16n8k16.
//
// The FlashInfer-path design: every query loads its own selected pages. A work item is (query, KV head)
// and belongs to one warp; its 16 tile rows are the query's G ≤ 16 query heads of that KV head (rows
// past G are zero and never stored), the fewest rows an mma tile has. A CTA holds PQ_WARPS independent
// warps; nothing is shared between them.
//
// The item streams its selected pages in steps of 16 keys (one 16-row part of a page). Steps that hold
// no key the query may see (past the context, or past its position when causal) are neither loaded nor
// computed. The warp copies each step's e4m3 K and V rows with cp.async into a PQ_NSTAGE-deep ring of
// per-warp staging buffers (128-byte XOR swizzle; rows past the context are zero-filled, never read),
// with the page's two scales. The MMA operands come straight from the e4m3 bytes:
// * S = Q·Kᵀ: ldmatrix (8 keys × 16 bytes viewed as b16) hands lane (g, t) the 4 bytes of key g at
//   dims 16c + 4t … 16c + 4t + 3, which become the B fragment's (k = 2t, 2t+1) and (2t+8, 2t+9). The
//   contraction order over the head dimension is free, so Q's A fragment is loaded from global memory
//   in the same permuted order: a0 = Q[g][16c + 4t + {0,1}], a2 = Q[g][16c + 4t + {2,3}].
// * O += P·V: ldmatrix.trans of two 8-key blocks gives lane (g, t) keys 2t, 2t+1 (and + 8) at dims
//   16c + 2g, 16c + 2g + 1; a byte permute splits them into the B fragments of two n8 tiles, "even"
//   (column g = dim 16c + 2g) and "odd" (dim 16c + 2g + 1). O's lane then holds dims 16c + 4t … + 3.
// Dequantisation is bf16(float32(e4m3) · scale), as in the union kernel (hopper::dequant_e4m3x4).
//
// O (bf16 [q_heads, num_queries, 128]) and LSE (fp32, natural log) rows are written by the item's warp;
// a query without a valid key gets O = 0, LSE = −inf. Ids, pages and rows are range-checked.
#include "hopper_wgmma.cuh"

// Geometry mirrored in sparseattn/kernels/pageweaver.py.
#define PQ_HEAD_DIM 128
#define PQ_WARPS 12          // independent warps (work items in flight) per CTA
#define PQ_STEP_KEYS 16      // keys per pipeline step (a 16-row page part)
#ifndef PQ_NSTAGE
#define PQ_NSTAGE 4          // steps in flight per warp
#endif
// Operands are f16 (-DPQ_BF16_OPERANDS: the bf16 path, kept for comparison; ~1.4x slower on the H200).
// K and V convert from e4m3 to f16 exactly, with no scale. Q's fragments are multiplied per row by a power of two σ that keeps the row
// maximum below 2^14, then converted to f16, exactly. S is multiplied by k_scale(page) / σ(row). A step
// is one page, so its V scale rides on the online-softmax rescale of O (O = v_scale · O_acc); P keeps
// its value.
#ifdef PQ_BF16_OPERANDS
constexpr bool kF16 = false;
#else
constexpr bool kF16 = true;
#endif

namespace {

constexpr int kStepBytes = PQ_STEP_KEYS * PQ_HEAD_DIM;  // one e4m3 K or V step
constexpr int kWarpBytes = PQ_NSTAGE * (2 * kStepBytes + 8);
constexpr int kSmemBytes = PQ_WARPS * kWarpBytes;
static_assert(kSmemBytes <= 227 * 1024, "over the per-block shared-memory limit");

// Byte offset of (row, 16-byte chunk) in a swizzled 16-row e4m3 step buffer.
__device__ __forceinline__ uint32_t step_offset(int row, int chunk) {
    return static_cast<uint32_t>(row * PQ_HEAD_DIM + ((chunk ^ (row & 7)) << 4));
}

// One MMA step in the build's operand type.
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    if constexpr (kF16)
        paged::mma_f16_16816(c, a, b0, b1);
    else
        paged::mma_bf16_16816(c, a, b0, b1);
}

// Four e4m3 bytes -> two operand words: bf16(e4m3 · scale), or f16(e4m3) exactly.
__device__ __forceinline__ void operand_x4(uint32_t& lo, uint32_t& hi, uint32_t w, float scale) {
    if constexpr (kF16)
        hopper::e4m3x4_to_f16(lo, hi, w);
    else
        hopper::dequant_e4m3x4(lo, hi, w, scale);
}

__device__ __forceinline__ uint32_t pack_operand(float lo, float hi) {
    return kF16 ? hopper::pack_f16x2(lo, hi) : paged::pack_bf16x2(lo, hi);
}

__device__ __forceinline__ uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t sel) {
    uint32_t d;
    asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

}  // namespace

__global__ void __launch_bounds__(PQ_WARPS * 32, 1)
pw_per_query_fwd_kernel(const __nv_bfloat16* __restrict__ Q, const uint8_t* __restrict__ K,
                        const uint8_t* __restrict__ V, const float* __restrict__ k_scale,
                        const float* __restrict__ v_scale, __nv_bfloat16* __restrict__ O, float* __restrict__ LSE,
                        const int* __restrict__ pages, const int* __restrict__ positions, int kv_heads, int gqa,
                        int num_queries, int selected, int num_pages, int log2_page, int context, int causal,
                        float scale_log2) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t4 = lane & 3;
    const uint32_t ring = paged::smem_u32(smem_raw) + warp * kWarpBytes;  // [stage][K step | V step]
    const uint32_t scales = ring + PQ_NSTAGE * 2 * kStepBytes;              // [stage] (k, v) scale
    const int q_heads = kv_heads * gqa;
    const int parts = 1 << (log2_page - 4);  // 16-key steps per page
    const int steps = selected * parts;
    const int kv_rows = num_pages << log2_page;
    const long long items = static_cast<long long>(num_queries) * kv_heads;

    for (long long item = static_cast<long long>(blockIdx.x) * PQ_WARPS + warp; item < items;
         item += static_cast<long long>(gridDim.x) * PQ_WARPS) {
        const int query = static_cast<int>(item / kv_heads);
        const int head = static_cast<int>(item - static_cast<long long>(query) * kv_heads);
        int limit = context - 1;  // last key position the query may see
        if (causal) limit = min(limit, positions[query]);
        const int* my_pages = pages + static_cast<size_t>(query) * selected;
        const uint8_t* Kh = K + static_cast<size_t>(head) * kv_rows * PQ_HEAD_DIM;
        const uint8_t* Vh = V + static_cast<size_t>(head) * kv_rows * PQ_HEAD_DIM;

        // first key of step i (-1: the step holds no key the query may see)
        auto step_base = [&](int i) {
            const int p = my_pages[i / parts];
            const int base = (p << log2_page) + 16 * (i % parts);
            return static_cast<unsigned>(p) < static_cast<unsigned>(num_pages) && base <= limit ? base : -1;
        };
        // Copy step i into stage s: lane l copies 16-byte chunk l % 8 of rows l / 8 + 4j of K and V.
        auto issue = [&](int i, int s) {
            const int base = step_base(i);
            if (base < 0) return;
            const uint32_t k_dst = ring + s * 2 * kStepBytes;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int row = (lane >> 3) + 4 * j;
                const int ch = lane & 7;
                const bool ok = base + row < context;
                const size_t src = (static_cast<size_t>(ok ? base + row : 0)) * PQ_HEAD_DIM + ch * 16;
                paged::cp_async_16_zfill(k_dst + step_offset(row, ch), Kh + src, ok);
                paged::cp_async_16_zfill(k_dst + kStepBytes + step_offset(row, ch), Vh + src, ok);
            }
            if (lane < 2) {
                const float* sc = lane == 0 ? k_scale : v_scale;
                paged::cp_async_4_zfill(scales + s * 8 + 4 * lane,
                                        sc + static_cast<size_t>(head) * num_pages + (base >> log2_page), true);
            }
        };

        // Q A fragments in the permuted head-dim order (see the header): qa[c] for dim chunk c.
        uint32_t qa[PQ_HEAD_DIM / 16][4];
        {
            const int hl0 = g, hl1 = g + 8;
#pragma unroll
            for (int c = 0; c < PQ_HEAD_DIM / 16; ++c) {
                uint2 r0 = make_uint2(0u, 0u), r1 = make_uint2(0u, 0u);
                if (hl0 < gqa)
                    r0 = *reinterpret_cast<const uint2*>(
                        Q + ((static_cast<size_t>(head) * gqa + hl0) * num_queries + query) * PQ_HEAD_DIM + 16 * c + 4 * t4);
                if (hl1 < gqa)
                    r1 = *reinterpret_cast<const uint2*>(
                        Q + ((static_cast<size_t>(head) * gqa + hl1) * num_queries + query) * PQ_HEAD_DIM + 16 * c + 4 * t4);
                qa[c][0] = r0.x;
                qa[c][1] = r1.x;
                qa[c][2] = r0.y;
                qa[c][3] = r1.y;
            }
        }
        float qinv[2] = {1.f, 1.f};  // 1/σ of rows g and g + 8 (f16 path)
        if constexpr (kF16) {
            auto lo = [](uint32_t w) { return __uint_as_float(w << 16); };
            auto hi = [](uint32_t w) { return __uint_as_float(w & 0xffff0000u); };
            float amax[2] = {0.f, 0.f};
#pragma unroll
            for (int c = 0; c < PQ_HEAD_DIM / 16; ++c) {
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    amax[j & 1] = fmaxf(amax[j & 1], fmaxf(fabsf(lo(qa[c][j])), fabsf(hi(qa[c][j]))));
            }
            float sigma[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                hopper::f16_prescale(paged::quad_max(amax[r]), sigma[r], qinv[r]);
            }
#pragma unroll
            for (int c = 0; c < PQ_HEAD_DIM / 16; ++c) {
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    qa[c][j] = hopper::pack_f16x2(lo(qa[c][j]) * sigma[j & 1], hi(qa[c][j]) * sigma[j & 1]);
            }
        }
        float v_ref = 0.f;  // the V scale O's accumulator is in (f16 path)

        float o[PQ_HEAD_DIM / 8][4];
#pragma unroll
        for (int i = 0; i < PQ_HEAD_DIM / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
        float row_max[2] = {-INFINITY, -INFINITY};
        float row_sum[2] = {0.f, 0.f};

#pragma unroll 1
        for (int i = 0; i < PQ_NSTAGE - 1; ++i) {
            if (i < steps) issue(i, i);
            paged::cp_async_commit();
        }
#pragma unroll 1
        for (int i = 0; i < steps; ++i) {
            const int s = i % PQ_NSTAGE;
            if (i + PQ_NSTAGE - 1 < steps) issue(i + PQ_NSTAGE - 1, (i + PQ_NSTAGE - 1) % PQ_NSTAGE);
            paged::cp_async_commit();
            const int base = step_base(i);
            if (base < 0) continue;  // uniform over the warp: nothing was copied for this step
            paged::cp_async_wait<PQ_NSTAGE - 1>();
            __syncwarp();  // every lane's copies of step i are visible to the warp
            const uint32_t kbuf = ring + s * 2 * kStepBytes;
            const uint32_t vbuf = kbuf + kStepBytes;
            float ks, vs;
            asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(ks), "=f"(vs) : "r"(scales + s * 8));

            // ---- S = Q·Kᵀ for the step's 16 keys: n8 tiles nt = 0, 1 (keys 8nt .. 8nt + 7)
            float sacc[2][4];
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                sacc[nt][0] = sacc[nt][1] = sacc[nt][2] = sacc[nt][3] = 0.f;
#pragma unroll
                for (int c0 = 0; c0 < PQ_HEAD_DIM / 16; c0 += 4) {
                    uint32_t w[4];
                    paged::ldmatrix_x4(w, kbuf + step_offset(8 * nt + (lane & 7), c0 + (lane >> 3)));
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        uint32_t b0, b1;
                        operand_x4(b0, b1, w[j], ks);
                        mma_16816(sacc[nt], qa[c0 + j], b0, b1);
                    }
                }
            }

            if constexpr (kF16) {  // S · k_scale / σ(row)
#pragma unroll
                for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) sacc[nt][e] *= ks * qinv[e >> 1];
                }
            }

            // ---- masked online softmax (rows g and g + 8; columns 8nt + 2t4 + e)
            float m_new[2] = {row_max[0], row_max[1]};
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = base + 8 * nt + 2 * t4 + (e & 1);
                    float v = key <= limit ? sacc[nt][e] : -INFINITY;
                    sacc[nt][e] = v;
                    m_new[e >> 1] = fmaxf(m_new[e >> 1], v);
                }
            }
            float alpha[2], m_l2[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                m_new[r] = paged::quad_max(m_new[r]);
                alpha[r] = row_max[r] == -INFINITY ? 0.f : exp2f((row_max[r] - m_new[r]) * scale_log2);
                row_max[r] = m_new[r];
                m_l2[r] = m_new[r] == -INFINITY ? 0.f : m_new[r] * scale_log2;
                row_sum[r] *= alpha[r];
            }
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float p = exp2f(sacc[nt][e] * scale_log2 - m_l2[e >> 1]);
                    sacc[nt][e] = p;
                    row_sum[e >> 1] += p;
                }
            }
            if constexpr (kF16) {  // O's accumulator moves to this page's V scale
                const float carry = v_ref > 0.f && vs > 0.f ? v_ref / vs : 1.f;
                if (vs > 0.f) v_ref = vs;
                alpha[0] *= carry;
                alpha[1] *= carry;
            }
#pragma unroll
            for (int i = 0; i < PQ_HEAD_DIM / 8; ++i) {
                o[i][0] *= alpha[0];
                o[i][1] *= alpha[0];
                o[i][2] *= alpha[1];
                o[i][3] *= alpha[1];
            }
            uint32_t pa[4];
            pa[0] = pack_operand(sacc[0][0], sacc[0][1]);
            pa[1] = pack_operand(sacc[0][2], sacc[0][3]);
            pa[2] = pack_operand(sacc[1][0], sacc[1][1]);
            pa[3] = pack_operand(sacc[1][2], sacc[1][3]);
            if (kF16 && vs == 0.f) pa[0] = pa[1] = pa[2] = pa[3] = 0u;  // an all-zero V page adds nothing

            // ---- O += P·V: dim chunks c, c + 1 per ldmatrix.x4.trans; o[2c] even / o[2c + 1] odd dims
#pragma unroll
            for (int c = 0; c < PQ_HEAD_DIM / 16; c += 2) {
                uint32_t r[4];
                paged::ldmatrix_x4_trans(r, vbuf + step_offset((lane & 7) + ((lane >> 3) & 1) * 8, c + (lane >> 4)));
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    uint32_t b0, b1;
                    operand_x4(b0, b1, byte_perm(r[2 * h], r[2 * h + 1], 0x6420), vs);
                    mma_16816(o[2 * (c + h)], pa, b0, b1);
                    operand_x4(b0, b1, byte_perm(r[2 * h], r[2 * h + 1], 0x7531), vs);
                    mma_16816(o[2 * (c + h) + 1], pa, b0, b1);
                }
            }
            __syncwarp();  // every lane is done with stage s before it is refilled
        }
        paged::cp_async_wait<0>();
        __syncwarp();

        // ---- O and LSE rows of the item's query heads
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int hl = g + 8 * r;
            const float sum = paged::quad_sum(row_sum[r]);
            if (hl >= gqa) continue;
            const int hq = head * gqa + hl;
            if (hq >= q_heads) continue;
            const float inv = sum > 0.f ? (kF16 ? v_ref : 1.f) / sum : 0.f;  // f16 path: O = v_scale · O_acc
            const size_t at = static_cast<size_t>(hq) * num_queries + query;
            uint2* dst = reinterpret_cast<uint2*>(O + at * PQ_HEAD_DIM + 4 * t4);
#pragma unroll
            for (int c = 0; c < PQ_HEAD_DIM / 16; ++c) {
                const float* ev = o[2 * c];
                const float* od = o[2 * c + 1];
                dst[4 * c] = make_uint2(paged::pack_bf16x2(ev[2 * r] * inv, od[2 * r] * inv),
                                        paged::pack_bf16x2(ev[2 * r + 1] * inv, od[2 * r + 1] * inv));
            }
            if (t4 == 0) LSE[at] = sum > 0.f ? (row_max[r] * scale_log2 + log2f(sum)) * paged::kLn2 : -INFINITY;
        }
    }
}
