// Building blocks shared by the paged attention kernels (forward and backward, BSA and KPage plans).
//
// Conventions:
// * Tensors are bf16 [batch, heads, slots, HEAD_DIM], contiguous; a "page" is 16 consecutive slots.
// * Shared-memory tiles hold ROWS x HEAD_DIM bf16 in 16-byte chunks (8 elements); chunk c of row r
//   is stored at chunk position (c ^ (r & 7)) of that row: the 128-byte XOR swizzle, so ldmatrix of
//   8 rows at one logical chunk touches 8 different bank groups. A 16-row page can land at any
//   16-row offset of a tile without breaking the pattern.
// * Page masks are uint16 per page: bit r set <=> row r of the page is a valid token.
// * mma.sync m16n8k16 bf16 -> fp32 fragments follow the PTX ISA layouts: with g = lane / 4 and
//   t = lane % 4, an accumulator c[4] holds (row g, cols 2t, 2t+1) and (row g + 8, cols 2t, 2t+1).
#pragma once
#include <cuda_bf16.h>
#if defined(__CUDACC_RTC__)  // NVRTC ships no <stdint.h>; these are the sizes on every CUDA target
typedef unsigned long long uint64_t;
typedef unsigned int uint32_t;
typedef unsigned short uint16_t;
typedef unsigned char uint8_t;
typedef int int32_t;
#else
#include <stdint.h>
#endif
#include "tile_config.cuh"

#ifndef INFINITY  // NVRTC has no <math.h> macros
#define INFINITY __int_as_float(0x7f800000)
#endif

namespace paged {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ---- shared-memory addressing --------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Element offset of (row, 16-byte chunk) in a swizzled ROWS x HEAD_DIM bf16 tile.
template <int HEAD_DIM>
__device__ __forceinline__ int swizzle_offset(int row, int chunk) {
    static_assert(HEAD_DIM % 64 == 0, "HEAD_DIM must be a multiple of 64 (8 chunks of 16 bytes)");
    return row * HEAD_DIM + ((chunk ^ (row & 7)) << 3);
}

// Byte offset of (row, 16-byte chunk) in a swizzled bf16 tile (for 32-bit shared addresses).
template <int HEAD_DIM>
__device__ __forceinline__ uint32_t swizzle_bytes(int row, int chunk) {
    return static_cast<uint32_t>(swizzle_offset<HEAD_DIM>(row, chunk)) * 2u;
}

// ---- asynchronous copies -------------------------------------------------------------------

// 16-byte cp.async; when !valid, nothing is read and the 16 shared bytes are zero-filled.
// Shared addresses may be given as 32-bit shared-window addresses (cheaper: no 64-bit arithmetic).
__device__ __forceinline__ void cp_async_16_zfill(uint32_t smem_dst, const void* gmem_src, bool valid) {
    const int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_dst), "l"(gmem_src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void cp_async_16_zfill(void* smem_dst, const void* gmem_src, bool valid) {
    cp_async_16_zfill(smem_u32(smem_dst), gmem_src, valid);
}

// 4-byte cp.async (metadata such as page ids); when !valid the 4 shared bytes are zero-filled.
__device__ __forceinline__ void cp_async_4_zfill(uint32_t smem_dst, const void* gmem_src, bool valid) {
    const int src_bytes = valid ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
                 :: "r"(smem_dst), "l"(gmem_src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(PENDING) : "memory");
}

// ---- page masks ----------------------------------------------------------------------------

__device__ __forceinline__ bool page_row_valid(uint32_t mask16, int row_in_page) {
    return (mask16 >> row_in_page) & 1u;
}

// Mask of page id `page` (0 when the id is outside [0, num_pages): such a page is never read).
__device__ __forceinline__ uint32_t load_page_mask(const uint16_t* __restrict__ masks, int page, int num_pages) {
    return (static_cast<unsigned>(page) < static_cast<unsigned>(num_pages)) ? static_cast<uint32_t>(masks[page]) : 0u;
}

// Gather up to ROWS/16 pages (ids pages[0..npages), each page's 16 rows) of one [slots, HEAD_DIM]
// bf16 matrix into a swizzled ROWS x HEAD_DIM shared tile (32-bit shared address `tile`) with
// 16-byte cp.async, all THREADS threads cooperating. Invalid rows, pages past npages and
// out-of-range page ids are zero-filled and never read from global memory. The caller commits.
template <int ROWS, int HEAD_DIM, int THREADS>
__device__ __forceinline__ void gather_pages(uint32_t tile, const __nv_bfloat16* __restrict__ matrix,
                                             const int* __restrict__ pages, int npages,
                                             const uint16_t* __restrict__ masks, int num_pages) {
    constexpr int CHUNKS_PER_ROW = HEAD_DIM / 8;
    constexpr int CHUNKS = ROWS * CHUNKS_PER_ROW;
    static_assert(CHUNKS % THREADS == 0, "tile chunks must divide evenly among threads");
    const int tid = threadIdx.x;
#pragma unroll
    for (int i = 0; i < CHUNKS / THREADS; ++i) {
        const int c = tid + i * THREADS;
        const int row = c / CHUNKS_PER_ROW;
        const int chunk = c % CHUNKS_PER_ROW;
        const int slot = row / PAGE_ROWS;
        const int r = row % PAGE_ROWS;
        const int page = slot < npages ? pages[slot] : -1;
        const bool valid = page_row_valid(load_page_mask(masks, page, num_pages), r);
        const __nv_bfloat16* src = valid ? matrix + (static_cast<size_t>(page) * PAGE_ROWS + r) * HEAD_DIM + chunk * 8
                                         : matrix;
        cp_async_16_zfill(tile + swizzle_bytes<HEAD_DIM>(row, chunk), src, valid);
    }
}

template <int ROWS, int HEAD_DIM, int THREADS>
__device__ __forceinline__ void gather_pages(__nv_bfloat16* __restrict__ tile,
                                             const __nv_bfloat16* __restrict__ matrix,
                                             const int* __restrict__ pages, int npages,
                                             const uint16_t* __restrict__ masks, int num_pages) {
    gather_pages<ROWS, HEAD_DIM, THREADS>(smem_u32(tile), matrix, pages, npages, masks, num_pages);
}

// As gather_pages, with the page ids and 16-bit row masks already staged in shared memory
// (s_pages[ROWS/16], s_masks[ROWS/16]; a page with mask 0 or an id outside [0, num_pages) is never
// read). Staging the metadata ahead keeps dependent global loads off the copy-issue path.
// Thread t copies chunk t % CPR of rows t / CPR + i * RPI (RPI = THREADS / CPR rows per step), so
// its swizzled chunk and both offsets are per-thread constants plus compile-time steps: the copy
// issue keeps three registers live, not one pointer per chunk.
// Requires num_pages * PAGE_ROWS * HEAD_DIM < 2^31 (32-bit element offsets).
template <int ROWS, int HEAD_DIM, int THREADS>
__device__ __forceinline__ void gather_pages_staged(uint32_t tile, const __nv_bfloat16* __restrict__ matrix,
                                                    const int* s_pages, const uint32_t* s_masks, int num_pages) {
    constexpr int CPR = HEAD_DIM / 8;       // 16-byte chunks per row
    constexpr int RPI = THREADS / CPR;      // rows per step
    static_assert(THREADS % CPR == 0 && RPI % 8 == 0 && PAGE_ROWS % RPI == 0 && ROWS % RPI == 0,
                  "gather_pages_staged: THREADS / (HEAD_DIM / 8) must be 8 or 16");
    const int tid = threadIdx.x;
    const int row0 = tid / CPR;             // < RPI
    const int chunk0 = tid % CPR;
    const uint32_t dst0 = tile + swizzle_bytes<HEAD_DIM>(row0, chunk0);  // (row0 + i*RPI) & 7 == row0 & 7
    const uint32_t elem0 = static_cast<uint32_t>(row0 * HEAD_DIM + chunk0 * 8);
#pragma unroll
    for (int i = 0; i < ROWS / RPI; ++i) {
        const int slot = (i * RPI) / PAGE_ROWS;
        const int r = (i * RPI) % PAGE_ROWS + row0;
        const int page = s_pages[slot];
        const bool valid = page_row_valid(s_masks[slot], r) && static_cast<unsigned>(page) < static_cast<unsigned>(num_pages);
        const uint32_t elem = static_cast<uint32_t>(page) * (PAGE_ROWS * HEAD_DIM) +
                              static_cast<uint32_t>(((i * RPI) % PAGE_ROWS) * HEAD_DIM) + elem0;
        cp_async_16_zfill(dst0 + static_cast<uint32_t>(i * RPI * HEAD_DIM * 2), valid ? matrix + elem : matrix, valid);
    }
}

// ---- ldmatrix ------------------------------------------------------------------------------

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) { ldmatrix_x4(r, smem_u32(smem)); }

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) { ldmatrix_x4_trans(r, smem_u32(smem)); }

__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], const void* smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(smem_u32(smem)));
}

__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], const void* smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(smem_u32(smem)));
}

// A operand (16 x 16, row-major) of an m16n8k16 mma from a swizzled tile: rows row0..row0+15,
// columns 16*kstep..16*kstep+15. Result order a0..a3 as mma expects.
template <int HEAD_DIM>
__device__ __forceinline__ void load_a_frag(uint32_t (&a)[4], uint32_t tile, int row0, int kstep) {
    const int lane = threadIdx.x & 31;
    const int row = row0 + (lane & 7) + ((lane >> 3) & 1) * 8;
    const int chunk = kstep * 2 + (lane >> 4);
    ldmatrix_x4(a, tile + swizzle_bytes<HEAD_DIM>(row, chunk));
}

template <int HEAD_DIM>
__device__ __forceinline__ void load_a_frag(uint32_t (&a)[4], const __nv_bfloat16* tile, int row0, int kstep) {
    load_a_frag<HEAD_DIM>(a, smem_u32(tile), row0, kstep);
}

// B operands of two adjacent n8 tiles for S = A · Bᵀ where B's rows (keys) are tile rows
// n0..n0+15 and k is the head dimension (16*kstep..+15): b[0],b[1] -> keys n0..n0+7,
// b[2],b[3] -> keys n0+8..n0+15.
template <int HEAD_DIM>
__device__ __forceinline__ void load_bt_frags(uint32_t (&b)[4], uint32_t tile, int n0, int kstep) {
    const int lane = threadIdx.x & 31;
    const int row = n0 + (lane & 7) + (lane >> 4) * 8;
    const int chunk = kstep * 2 + ((lane >> 3) & 1);
    ldmatrix_x4(b, tile + swizzle_bytes<HEAD_DIM>(row, chunk));
}

template <int HEAD_DIM>
__device__ __forceinline__ void load_bt_frags(uint32_t (&b)[4], const __nv_bfloat16* tile, int n0, int kstep) {
    load_bt_frags<HEAD_DIM>(b, smem_u32(tile), n0, kstep);
}

// B operands of two adjacent n8 tiles for O = P · V where V's rows k0..k0+15 are the k dimension
// and the columns are head-dim 8*dtile..8*dtile+15: b[0],b[1] -> dtile, b[2],b[3] -> dtile + 1.
template <int HEAD_DIM>
__device__ __forceinline__ void load_b_frags_trans(uint32_t (&b)[4], uint32_t tile, int k0, int dtile) {
    const int lane = threadIdx.x & 31;
    const int row = k0 + (lane & 7) + ((lane >> 3) & 1) * 8;
    const int chunk = dtile + (lane >> 4);
    ldmatrix_x4_trans(b, tile + swizzle_bytes<HEAD_DIM>(row, chunk));
}

template <int HEAD_DIM>
__device__ __forceinline__ void load_b_frags_trans(uint32_t (&b)[4], const __nv_bfloat16* tile, int k0, int dtile) {
    load_b_frags_trans<HEAD_DIM>(b, smem_u32(tile), k0, dtile);
}

// ---- tensor-core mma -----------------------------------------------------------------------

// c (16x8 fp32) += a (16x16 bf16, row) * b (16x8 bf16, col)
__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// c (16x8 fp32) += a (16x16 f16, row) * b (16x8 f16, col)
__device__ __forceinline__ void mma_f16_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// acc + Σ of the products of 8 bf16 pairs (16 bytes of each row at a and b), in fp32: one lane's share of a
// row's dot product (the backward's Δ = rowsum(dO ∘ O)).
__device__ __forceinline__ float dot8_bf16(const __nv_bfloat16* a, const __nv_bfloat16* b, float acc) {
    const uint4 x = *reinterpret_cast<const uint4*>(a);
    const uint4 y = *reinterpret_cast<const uint4*>(b);
    const __nv_bfloat162* x2 = reinterpret_cast<const __nv_bfloat162*>(&x);
    const __nv_bfloat162* y2 = reinterpret_cast<const __nv_bfloat162*>(&y);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 xf = __bfloat1622float2(x2[i]);
        const float2 yf = __bfloat1622float2(y2[i]);
        acc = fmaf(xf.x, yf.x, fmaf(xf.y, yf.y, acc));
    }
    return acc;
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

// A operand (16 x 16) of P · V from two fp32 accumulators of adjacent n8 tiles (cols 16k..16k+15).
__device__ __forceinline__ void acc_to_a_frag(uint32_t (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
    a[0] = pack_bf16x2(lo[0], lo[1]);
    a[1] = pack_bf16x2(lo[2], lo[3]);
    a[2] = pack_bf16x2(hi[0], hi[1]);
    a[3] = pack_bf16x2(hi[2], hi[3]);
}

// ---- quad reductions (the 4 lanes holding one accumulator row) --------------------------------

__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Valid-column bits of accumulator n8 tile `ntile` for this lane: bit0 = col 2t, bit1 = col 2t+1,
// given the 16-bit mask of the page holding the tile (two n8 tiles per page).
__device__ __forceinline__ uint32_t acc_col_bits(uint32_t page_mask16, int ntile) {
    const int t = threadIdx.x & 3;
    return (page_mask16 >> ((ntile & 1) * 8 + 2 * t)) & 3u;
}

}  // namespace paged
