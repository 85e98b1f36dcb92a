// Hopper (sm_90a) building blocks shared by the warp-specialized paged attention kernels:
// wgmma wrappers and shared-memory matrix descriptors, the 128-byte-swizzle tile layout, mbarriers,
// named barriers and register reallocation.
//
// Tile layout (what wgmma's 128-byte-swizzle descriptors expect): a ROWS x COLS bf16 tile is cut into
// 64-element (128-byte) column blocks, each stored ROWS x 128 B; 16-byte chunk c of row r sits at chunk
// position c ^ (r % 8) of its row. Tiles start 1024-byte aligned, so a 16-row page (two 8-row swizzle
// atoms) lands at any 16-row offset without breaking the pattern.
#pragma once
#include "paged_attn_common.cuh"

namespace hopper {

// ---- tile addressing and matrix descriptors -----------------------------------------------------

// Byte offset of (row, 16-byte chunk) in a ROWS-row tile of the canonical 128-byte-swizzle layout.
template <int ROWS>
__device__ __forceinline__ uint32_t tile_offset(int row, int chunk) {
    return static_cast<uint32_t>((chunk >> 3) * (ROWS * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
}

// Shared-memory matrix descriptor, 128-byte swizzle. K-major operands: the leading offset is unused
// (a k-step stays inside one 128-byte row), the stride offset is the distance between 8-row groups
// (1024 B). MN-major (transposed) operands: the leading offset is the distance between 64-element
// column blocks, the stride offset the distance between 8-row (k) groups.
// The low word holds the start address and the leading offset, the high word the stride offset and the
// swizzle mode. Inside one tile a descriptor steps by adding (bytes >> 4) to its low word: shared-memory
// addresses stay below 2^18, so the 14-bit address field never carries into the leading offset.
__device__ __forceinline__ uint32_t smem_desc_lo(uint32_t addr, uint32_t lead_bytes) {
    return ((addr & 0x3FFFFu) >> 4) | ((lead_bytes >> 4) << 16);
}
__host__ __device__ constexpr uint32_t smem_desc_hi(uint32_t stride_bytes) { return (stride_bytes >> 4) | (1u << 30); }
__device__ __forceinline__ uint64_t desc_words(uint32_t lo, uint32_t hi) {
    return static_cast<uint64_t>(lo) | (static_cast<uint64_t>(hi) << 32);
}
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lead_bytes, uint32_t stride_bytes) {
    return desc_words(smem_desc_lo(addr, lead_bytes), smem_desc_hi(stride_bytes));
}

// ---- wgmma (bf16 inputs, fp32 accumulators; the accumulator layout of m64nN: thread t of the warpgroup
// holds rows 16·(t/32) + (t%32)/4 and +8, columns 8j + 2·(t%4) and +1, as d[4j..4j+3]) ---------------

#define HW_ACC8(b) "+f"(d[b + 0]), "+f"(d[b + 1]), "+f"(d[b + 2]), "+f"(d[b + 3]), \
                   "+f"(d[b + 4]), "+f"(d[b + 5]), "+f"(d[b + 6]), "+f"(d[b + 7])
#define HW_ACC32 HW_ACC8(0), HW_ACC8(8), HW_ACC8(16), HW_ACC8(24)
#define HW_ACC64 HW_ACC32, HW_ACC8(32), HW_ACC8(40), HW_ACC8(48), HW_ACC8(56)
#define HW_REGS32 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23," \
                  "%24,%25,%26,%27,%28,%29,%30,%31}"
#define HW_REGS64 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23," \
                  "%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45," \
                  "%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"

// The wgmma shapes the kernels use, for operand type TY (bf16 or f16), as explicit specializations:
// NAME<N>(d, desc_a, desc_b, accumulate): d (m64 x nN) {=, +=} A (64 x 16, shared, K-major) · B (nN x 16,
// shared, K-major)ᵀ; NAME<N>(d, a, desc_b): d += A (64 x 16, registers) · B (16 x nN, shared, MN-major).
// TRANS: "imm-trans-a, imm-trans-b" ("0, 0": both operands K-major; "1, 1": both MN-major)
#define HW_WGMMA_SS(NAME, N, TY, ACC, REGS, IA, IB, IP, TRANS)                                            \
    template <>                                                                                             \
    __device__ __forceinline__ void NAME<N>(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int accumulate) { \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #IP ", 0;\n"                                       \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " REGS ", %" #IA ", %" #IB \
                     ", p, 1, 1, " TRANS ";\n}\n"                                                            \
                     : ACC                                                                                  \
                     : "l"(desc_a), "l"(desc_b), "r"(accumulate));                                          \
    }
#define HW_WGMMA_RS_TB(NAME, N, TY, ACC, REGS, I0, I1, I2, I3, IB, IP)                                      \
    template <>                                                                                             \
    __device__ __forceinline__ void NAME<N>(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b) {      \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #IP ", 0;\n"                                       \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " REGS ", {%" #I0 ",%" #I1 \
                     ",%" #I2 ",%" #I3 "}, %" #IB ", p, 1, 1, 1;\n}\n"                                         \
                     : ACC                                                                                  \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));                    \
    }

// NAME<N>(d, desc_a, desc_b): d = A · Bᵀ (SS, both operands as TRANS), d written only: a chain's first
// k-step without reading d's previous (undefined) values, which would keep them live before the chain.
#define HW_ACC8_OUT(b) "=f"(d[b + 0]), "=f"(d[b + 1]), "=f"(d[b + 2]), "=f"(d[b + 3]), \
                       "=f"(d[b + 4]), "=f"(d[b + 5]), "=f"(d[b + 6]), "=f"(d[b + 7])
#define HW_ACC32_OUT HW_ACC8_OUT(0), HW_ACC8_OUT(8), HW_ACC8_OUT(16), HW_ACC8_OUT(24)
#define HW_ACC64_OUT HW_ACC32_OUT, HW_ACC8_OUT(32), HW_ACC8_OUT(40), HW_ACC8_OUT(48), HW_ACC8_OUT(56)
#define HW_WGMMA_SS_FIRST(NAME, N, TY, ACC, REGS, IA, IB, TRANS)                                          \
    template <>                                                                                             \
    __device__ __forceinline__ void NAME<N>(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b) {           \
        asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " REGS ", %" #IA ", %" #IB \
                     ", 0, 1, 1, " TRANS ";\n"                                                               \
                     : ACC                                                                                  \
                     : "l"(desc_a), "l"(desc_b));                                                           \
    }

template <int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int accumulate);
template <int N>
__device__ __forceinline__ void wgmma_ss_first(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b);
template <int N>
__device__ __forceinline__ void wgmma_ss_tt_first(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b);
template <int N>
__device__ __forceinline__ void wgmma_rs_tb(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b);
template <int N>
__device__ __forceinline__ void wgmma_ss_f16(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int accumulate);
template <int N>
__device__ __forceinline__ void wgmma_rs_tb_f16(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b);

HW_WGMMA_SS(wgmma_ss, 128, "bf16", HW_ACC64, HW_REGS64, 64, 65, 66, "0, 0")
HW_WGMMA_SS(wgmma_ss, 64, "bf16", HW_ACC32, HW_REGS32, 32, 33, 34, "0, 0")
HW_WGMMA_RS_TB(wgmma_rs_tb, 128, "bf16", HW_ACC64, HW_REGS64, 64, 65, 66, 67, 68, 69)
HW_WGMMA_RS_TB(wgmma_rs_tb, 64, "bf16", HW_ACC32, HW_REGS32, 32, 33, 34, 35, 36, 37)
// f16 operands (PageWeaver's f16 path: e4m3 converts to f16 exactly)
HW_WGMMA_SS(wgmma_ss_f16, 128, "f16", HW_ACC64, HW_REGS64, 64, 65, 66, "0, 0")
HW_WGMMA_SS(wgmma_ss_f16, 64, "f16", HW_ACC32, HW_REGS32, 32, 33, 34, "0, 0")
HW_WGMMA_RS_TB(wgmma_rs_tb_f16, 128, "f16", HW_ACC64, HW_REGS64, 64, 65, 66, 67, 68, 69)
HW_WGMMA_RS_TB(wgmma_rs_tb_f16, 64, "f16", HW_ACC32, HW_REGS32, 32, 33, 34, 35, 36, 37)

// d (m64 x nN) {=, +=} A · B with both operands in shared memory MN-major (transposed): A stored as
// 16 k-rows of 64 m-elements, B as 16 k-rows of N n-elements (the backward's dQ = dSᵀ·K).
template <int N>
__device__ __forceinline__ void wgmma_ss_tt(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int accumulate);
HW_WGMMA_SS(wgmma_ss_tt, 64, "bf16", HW_ACC32, HW_REGS32, 32, 33, 34, "1, 1")
HW_WGMMA_SS(wgmma_ss_tt, 128, "bf16", HW_ACC64, HW_REGS64, 64, 65, 66, "1, 1")
HW_WGMMA_SS_FIRST(wgmma_ss_first, 64, "bf16", HW_ACC32_OUT, HW_REGS32, 32, 33, "0, 0")
HW_WGMMA_SS_FIRST(wgmma_ss_tt_first, 64, "bf16", HW_ACC32_OUT, HW_REGS32, 32, 33, "1, 1")
HW_WGMMA_SS_FIRST(wgmma_ss_tt_first, 128, "bf16", HW_ACC64_OUT, HW_REGS64, 64, 65, "1, 1")

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(PENDING) : "memory");
}

// Ties registers to this point: the compiler may not move their reads or writes across a wgmma wait
// (the wgmma asm statements alone do not order ordinary code around the asynchronous MMA).
template <int N>
__device__ __forceinline__ void pin_registers(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// Generic-proxy writes to shared memory (cp.async, st.shared) -> visible to async-proxy reads (wgmma).
__device__ __forceinline__ void fence_async_proxy() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// ---- mbarriers (32-bit shared-window addresses) -------------------------------------------------

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// Arrive (release semantics: this thread's earlier shared-memory writes are visible to the waiters).
__device__ __forceinline__ void mbar_arrive(uint32_t bar, uint32_t count = 1) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// The barrier's current phase also waits for every cp.async this thread issued so far (net-zero
// pending count: pair it with an mbar_arrive of the same thread).
__device__ __forceinline__ void mbar_track_cp_async(uint32_t bar) {
    asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// Wait until the phase of parity `parity` has completed (acquire semantics).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    asm volatile(
        "{\n.reg .pred P1;\nHW_WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
        "@P1 bra HW_DONE;\nbra HW_WAIT;\nHW_DONE:\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}

// ---- named barriers and register reallocation ---------------------------------------------------

__device__ __forceinline__ void named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Arrive on a named barrier without waiting (a scheduling hand-off: it orders no memory for racecheck).
__device__ __forceinline__ void named_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

template <int REGS>
__device__ __forceinline__ void regs_release() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
}
template <int REGS>
__device__ __forceinline__ void regs_claim() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
}

// ---- page gathers ---------------------------------------------------------------------------------

// All 16 rows of a page valid (bits 0-15 of its mask; higher bits are the pair route's slot visibility).
__device__ __forceinline__ bool page_is_full(uint32_t mask) { return (mask & 0xffffu) == 0xffffu; }

// One warp copies PPW 16-row pages of a [slots, HEAD_DIM] bf16 matrix (page ids `page`, 16-bit row
// masks `mask`, identical in every lane) into rows row0 .. row0 + 16·PPW − 1 of a TILE_ROWS-row
// swizzled tile, with 16-byte cp.async. Invalid rows, and every row of an id outside [0, num_pages),
// are zero-filled and never read. Lane l copies 16-byte chunk l % CPR of rows l / CPR + i·RS
// (RS = 32 / CPR); a row's swizzled chunk position is (chunk ^ (l / CPR)) ^ (i·RS % 8), so each copy
// costs a few integer operations on per-page bases (few live registers: the producer runs lean).
// Requires num_pages · 16 · HEAD_DIM < 2^31 (checked by the host).
template <int HEAD_DIM, int TILE_ROWS, int PPW, bool SKIP_FULL = false>
__device__ __forceinline__ void warp_copy_pages(uint32_t tile, int row0, const __nv_bfloat16* __restrict__ matrix,
                                                int num_pages, const int (&page)[PPW], const uint32_t (&mask)[PPW]) {
    constexpr int CPR = HEAD_DIM / 8;  // 16-byte chunks per row
    constexpr int RS = 32 / CPR;       // rows per step
    static_assert(32 % CPR == 0 && PAGE_ROWS % RS == 0 && 8 % RS == 0, "warp_copy_pages: HEAD_DIM 64 or 128");
    const int lane = threadIdx.x & 31;
    const int chunk = lane % CPR;
    const int r0 = lane / CPR;
    uint32_t pos = static_cast<uint32_t>((chunk & 7) ^ r0);  // swizzled chunk position of rows r0 (mod 8)
    asm volatile("" : "+r"(pos));  // computed per call: keeps the per-copy addresses out of long-lived registers
#pragma unroll
    for (int p = 0; p < PPW; ++p) {
        const bool in_range = static_cast<unsigned>(page[p]) < static_cast<unsigned>(num_pages);
        if (SKIP_FULL && in_range && page_is_full(mask[p])) continue;  // loaded by warp_tma_pages
        const uint32_t rows = in_range ? (mask[p] >> r0) : 0u;  // bit i·RS: row r0 + i·RS is valid
        const __nv_bfloat16* src =
            matrix + (static_cast<uint32_t>(in_range ? page[p] : 0) * PAGE_ROWS + static_cast<uint32_t>(r0)) * HEAD_DIM +
            chunk * 8;
        const uint32_t dst = tile + static_cast<uint32_t>((chunk >> 3) * (TILE_ROWS * 128) +
                                                          (row0 + p * PAGE_ROWS + r0) * 128);
#pragma unroll
        for (int i = 0; i < PAGE_ROWS / RS; ++i) {
            const int ri = i * RS;
            const bool valid = (rows >> ri) & 1u;
            paged::cp_async_16_zfill(dst + ri * 128 + ((pos ^ static_cast<uint32_t>(ri & 7)) << 4), src + ri * HEAD_DIM,
                                     valid);
        }
    }
}

// ---- pages gathered by token (the token-order builds: PAGED_FWD_TOKENS, PAGED_BWD_TOKENS) -----------

// Where (batch · head) row bh's tokens are in a [batch, tokens, tok_heads, d] tensor: element offset of
// token 0, and between consecutive tokens (tokens · tok_heads · d < 2^31, checked by the host).
struct TokenRows {
    size_t base;
    uint32_t stride;
};

__device__ __forceinline__ TokenRows token_rows(size_t bh, int tok_heads, int tokens, int head_dim) {
    const size_t b = bh / static_cast<size_t>(tok_heads);
    const size_t h = bh - b * static_cast<size_t>(tok_heads);
    return {(b * static_cast<size_t>(tokens) * tok_heads + h) * head_dim, static_cast<uint32_t>(tok_heads * head_dim)};
}

// tok[p] of lane l: the token of row l % 16 of page page[p] (map: the row's slot -> token map; -1 where
// the page is outside [0, num_pages)). One load per lane and page, issued together.
template <int PPW>
__device__ __forceinline__ void page_tokens(int (&tok)[PPW], const int* __restrict__ map, int num_pages,
                                            const int (&page)[PPW]) {
    const int r = threadIdx.x & 15;
#pragma unroll
    for (int p = 0; p < PPW; ++p)
        tok[p] = static_cast<unsigned>(page[p]) < static_cast<unsigned>(num_pages) ? __ldg(map + page[p] * PAGE_ROWS + r)
                                                                                   : -1;
}

// warp_copy_pages of one page with each row read from its token: row r of the page is token `tok` of lane
// src_lane0 + r, at rows + token · stride. A row is copied when its mask bit is set and its token lies in
// [0, num_tokens); any other row is zero-filled.
template <int HEAD_DIM, int TILE_ROWS>
__device__ __forceinline__ void warp_copy_token_page(uint32_t tile, int row0, const __nv_bfloat16* __restrict__ rows,
                                                     uint32_t stride, int num_tokens, int num_pages, int tok,
                                                     int src_lane0, int page, uint32_t mask) {
    constexpr int CPR = HEAD_DIM / 8;  // 16-byte chunks per row
    constexpr int RS = 32 / CPR;       // rows per step
    static_assert(32 % CPR == 0 && PAGE_ROWS % RS == 0 && 8 % RS == 0, "warp_copy_token_page: HEAD_DIM 64 or 128");
    const int lane = threadIdx.x & 31;
    const int chunk = lane % CPR;
    const int r0 = lane / CPR;
    uint32_t pos = static_cast<uint32_t>((chunk & 7) ^ r0);
    asm volatile("" : "+r"(pos));
    const bool in_range = static_cast<unsigned>(page) < static_cast<unsigned>(num_pages);
    const uint32_t valid_rows = in_range ? (mask >> r0) : 0u;
    const uint32_t dst = tile + static_cast<uint32_t>((chunk >> 3) * (TILE_ROWS * 128) + (row0 + r0) * 128);
#pragma unroll
    for (int i = 0; i < PAGE_ROWS / RS; ++i) {
        const int ri = i * RS;
        const int t = __shfl_sync(0xffffffffu, tok, src_lane0 + r0 + ri);
        const bool valid = ((valid_rows >> ri) & 1u) && static_cast<unsigned>(t) < static_cast<unsigned>(num_tokens);
        const __nv_bfloat16* src = rows + (valid ? static_cast<uint32_t>(t) * stride : 0u) + chunk * 8;
        paged::cp_async_16_zfill(dst + ri * 128 + ((pos ^ static_cast<uint32_t>(ri & 7)) << 4), src, valid);
    }
}

// warp_copy_pages with each row read from its token (tok: page_tokens' registers).
template <int HEAD_DIM, int TILE_ROWS, int PPW>
__device__ __forceinline__ void warp_copy_token_pages(uint32_t tile, int row0, const __nv_bfloat16* __restrict__ rows,
                                                      uint32_t stride, int num_tokens, int num_pages,
                                                      const int (&tok)[PPW], const int (&page)[PPW],
                                                      const uint32_t (&mask)[PPW]) {
#pragma unroll
    for (int p = 0; p < PPW; ++p)
        warp_copy_token_page<HEAD_DIM, TILE_ROWS>(tile, row0 + p * PAGE_ROWS, rows, stride, num_tokens, num_pages,
                                                  tok[p], 0, page[p], mask[p]);
}

// The lane-rows form of the token gathers (PAGED_FWD_TOKEN_LANE_ROWS): lane l copies chunk l % CPR of the
// NR = 16 / RS consecutive rows (l / CPR)·NR .. (l / CPR)·NR + NR − 1 of each page, so the tokens of its rows
// are NR consecutive map entries, which it loads itself (NR / 4 16-byte loads per page, no shuffles; the
// map's pages start at multiples of 64 bytes). A row is copied when its mask bit is set, its page in
// [0, num_pages); any other row is zero-filled. A token outside [0, num_tokens) is clamped into the tensor
// (the hosts' map checks refuse such maps: -1 marks padding slots, whose mask bits are clear).
template <int HEAD_DIM, int TILE_ROWS, int PPW>
__device__ __forceinline__ void warp_copy_lane_rows(uint32_t tile, int row0, const __nv_bfloat16* __restrict__ rows,
                                                    uint32_t stride, int num_tokens, const int* __restrict__ map,
                                                    int num_pages, const int (&page)[PPW], const uint32_t (&mask)[PPW]) {
    constexpr int CPR = HEAD_DIM / 8;                // 16-byte chunks per row
    constexpr int NR = PAGE_ROWS * CPR / 32;         // rows per lane and page: 8 (d = 128) or 4 (d = 64)
    static_assert(32 % CPR == 0 && NR % 4 == 0 && NR <= 8, "warp_copy_lane_rows: HEAD_DIM 64 or 128");
    const int lane = threadIdx.x & 31;
    const int chunk = lane % CPR;
    const int g = lane / CPR;
    // Row g·NR + i of a page sits at swizzled chunk position (chunk & 7) ^ ((g·NR + i) & 7). Its shared
    // address is ((row base + 16·position of row g·NR) ^ 16·i) + 128·i: the XOR flips bits 4-6 only (row
    // bases are multiples of 128), and 128·i is the copy's immediate offset.
    const uint32_t lane_dst = static_cast<uint32_t>((chunk >> 3) * (TILE_ROWS * 128) + g * NR * 128 +
                                                    (((chunk & 7) ^ ((g * NR) & 7)) << 4));
    const uint64_t base = reinterpret_cast<uint64_t>(rows + chunk * 8);
    const uint32_t row_bytes = stride * 2u;  // between consecutive tokens
    const uint32_t last = static_cast<uint32_t>(num_tokens - 1);
#pragma unroll 1  // one page at a time: the producer runs at few registers
    for (int p = 0; p < PPW; ++p) {
        const bool in_range = static_cast<unsigned>(page[p]) < static_cast<unsigned>(num_pages);
        const uint32_t bits = in_range ? (mask[p] >> (g * NR)) : 0u;
        const int4* m = reinterpret_cast<const int4*>(map + (in_range ? page[p] : 0) * PAGE_ROWS + g * NR);
        uint32_t dst = tile + static_cast<uint32_t>((row0 + p * PAGE_ROWS) * 128) + lane_dst;
        asm volatile("" : "+r"(dst));  // one register per page; the rows' addresses derive from it
#pragma unroll
        for (int j = 0; j < NR / 4; ++j) {  // four rows per 16-byte load of their tokens
            const int4 t4 = __ldg(m + j);
            const int tok[4] = {t4.x, t4.y, t4.z, t4.w};
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int i = 4 * j + r;
                uint64_t src;  // base + token · row_bytes in one wide multiply-add
                asm("mad.wide.u32 %0, %1, %2, %3;" : "=l"(src) : "r"(min(static_cast<uint32_t>(tok[r]), last)),
                    "r"(row_bytes), "l"(base));
                paged::cp_async_16_zfill((dst ^ static_cast<uint32_t>(i << 4)) + i * 128,
                                         reinterpret_cast<const void*>(src), (bits >> i) & 1u);
            }
        }
    }
}

// ---- page loads by the tensor-memory accelerator (PAGED_FWD_TMA) ---------------------------------

// The 128 bytes of a CUtensorMap, passed by value as a __grid_constant__ kernel parameter
// (sparseattn/kernels/tensor_map.py encodes it: a row-major bf16 [rows, HEAD_DIM] matrix, [16 × 64] boxes,
// 128-byte swizzle).
struct alignas(64) TmaMap {
    unsigned long long opaque[16];
};

__device__ __forceinline__ void tma_prefetch(const TmaMap* map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Announce `bytes` more of asynchronous copies on the barrier's current phase (no arrival).
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// One box of the map at element column x, row y into shared memory at dst, completing on `bar`.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const TmaMap* map, int x, int y, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
            dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar)
        : "memory");
}

// One box of a 3-D map (column x, head h, token row y) into shared memory at dst, completing on `bar`.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const TmaMap* map, int x, int h, int y, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
        "[%5];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(h), "r"(y), "r"(bar)
        : "memory");
}

// Lane 0's part of a page load by TMA: announce on `bar` the bytes of the pages `load` marks (no arrival:
// the caller's arrivals close the phase, so the announcement precedes them), then box(p, cb, dst) issues
// page p's 64-column block cb into dst. With the 128-byte swizzle a box written at a 1024-byte-aligned
// tile + (row0 + 16p)·128 lands exactly where tile_offset puts the rows (64-column blocks of TILE_ROWS ×
// 128 B). `fence`: earlier generic-proxy writes of this buffer (cp.async) before the async-proxy ones.
template <int HEAD_DIM, int TILE_ROWS, int PPW, class Box>
__device__ __forceinline__ void tma_page_boxes(uint32_t tile, int row0, const bool (&load)[PPW], uint32_t bar,
                                               bool fence, Box box) {
    constexpr uint32_t kPageBytes = PAGE_ROWS * HEAD_DIM * 2;
    uint32_t bytes = 0;
#pragma unroll
    for (int p = 0; p < PPW; ++p) bytes += load[p] ? kPageBytes : 0u;
    if (bytes == 0) return;
    if (fence) fence_async_proxy();
    mbar_expect_tx(bar, bytes);
#pragma unroll
    for (int p = 0; p < PPW; ++p) {
        if (!load[p]) continue;
#pragma unroll
        for (int cb = 0; cb < HEAD_DIM / 64; ++cb)
            box(p, cb, tile + static_cast<uint32_t>(cb * (TILE_ROWS * 128) + (row0 + p * PAGE_ROWS) * 128));
    }
}

// The first token of each of a warp's pages (lane 0 only, the lane that issues their boxes; 0 for a page
// outside [0, num_pages)): map_tokens[16 · page], loaded before the producer waits for the chunk's buffer.
template <int PPW>
__device__ __forceinline__ void page_first_tokens(int (&first)[PPW], const int* __restrict__ map_tokens,
                                                  int num_pages, const int (&page)[PPW]) {
#pragma unroll
    for (int p = 0; p < PPW; ++p)
        first[p] = (threadIdx.x & 31) == 0 && static_cast<unsigned>(page[p]) < static_cast<unsigned>(num_pages)
                       ? max(__ldg(map_tokens + page[p] * PAGE_ROWS), 0)
                       : 0;
}

// warp_tma_pages over a token-major [tokens, heads, HEAD_DIM] tensor (a 3-D map, [64 × 1 × 16] boxes; the
// tile-major token build, PAGED_FWD_TOKENS_TMA): page p's 16 rows are the 16 tokens from `first[p]`
// (page_first_tokens) on, plus token_row0 (the batch entry's first row), of head `head`. The host checks
// that every live page of the layout holds consecutive tokens from its first slot's; rows past a page's
// valid ones are then real tokens of the next tile (masked, or multiplied by P = 0) or, past the tensor,
// zeros. Pages outside [0, num_pages) are not loaded, or with ALL loaded from token row 0 (V: a finite row
// under P = 0, where a stale row could be NaN).
template <int HEAD_DIM, int TILE_ROWS, int PPW, bool ALL>
__device__ __forceinline__ void warp_tma_token_pages(uint32_t tile, int row0, const TmaMap* map, int head,
                                                     int token_row0, const int (&first)[PPW], int num_pages,
                                                     const int (&page)[PPW], uint32_t bar) {
    if ((threadIdx.x & 31) != 0) return;
    bool load[PPW];
#pragma unroll
    for (int p = 0; p < PPW; ++p) load[p] = ALL || static_cast<unsigned>(page[p]) < static_cast<unsigned>(num_pages);
    tma_page_boxes<HEAD_DIM, TILE_ROWS, PPW>(tile, row0, load, bar, false, [&](int p, int cb, uint32_t dst) {
        tma_load_3d(dst, map, cb * 64, head, token_row0 + first[p], bar);
    });
}

// warp_copy_pages' pages by TMA (tma_page_boxes: one [16 × 64] box per page and 64-column block). Pages outside
// [0, num_pages) are not loaded (their columns are masked, or, FULL_ONLY, warp_copy_pages zero-fills
// them), nor with FULL_ONLY pages with an invalid row (their stale or NaN rows must be zeros for P·V).
// map_row0: the map row of page 0 (the (batch, head)'s first slot).
template <int HEAD_DIM, int TILE_ROWS, int PPW, bool FULL_ONLY>
__device__ __forceinline__ void warp_tma_pages(uint32_t tile, int row0, const TmaMap* map, int map_row0,
                                               int num_pages, const int (&page)[PPW], const uint32_t (&mask)[PPW],
                                               uint32_t bar) {
    if ((threadIdx.x & 31) != 0) return;
    bool load[PPW];
#pragma unroll
    for (int p = 0; p < PPW; ++p)
        load[p] = static_cast<unsigned>(page[p]) < static_cast<unsigned>(num_pages) &&
                  (!FULL_ONLY || page_is_full(mask[p]));
    tma_page_boxes<HEAD_DIM, TILE_ROWS, PPW>(tile, row0, load, bar, true, [&](int p, int cb, uint32_t dst) {
        tma_load_2d(dst, map, cb * 64, map_row0 + page[p] * PAGE_ROWS, bar);
    });
}

// ---- the two GEMMs of one key chunk ---------------------------------------------------------------

// S = Q·Kᵀ for 64 query rows (starting at aQrows of a Q_ROWS-row Q tile) and one CHUNK-key K tile
// (bf16 operands, or f16 with F16); with ADD_TO_S, S += Q·Kᵀ (s holds the initial values). K_ROWS: the rows of
// the K tile's layout (its column blocks' stride), of which the first CHUNK are read (default: all).
// WRITE_FIRST (bf16, not ADD_TO_S): the first k-step only writes s (wgmma_ss_first).
template <int HEAD_DIM, int CHUNK, int Q_ROWS, bool F16 = false, bool ADD_TO_S = false, int K_ROWS = CHUNK,
          bool WRITE_FIRST = false>
__device__ __forceinline__ void issue_qk(float (&s)[CHUNK / 2], uint32_t aQrows, uint32_t tK) {
    // the tiles' descriptors once, then constant steps (tile_offset's column blocks, 32-byte k-steps)
    const uint32_t a_lo = smem_desc_lo(aQrows, 16), b_lo = smem_desc_lo(tK, 16);
    constexpr uint32_t hi = smem_desc_hi(1024);
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
        const uint32_t col = static_cast<uint32_t>(kk & 3) * 32u;  // k-step inside a 128-byte column block
        const uint64_t da = desc_words(a_lo + (((kk >> 2) * (Q_ROWS * 128) + col) >> 4), hi);
        const uint64_t db = desc_words(b_lo + (((kk >> 2) * (K_ROWS * 128) + col) >> 4), hi);
        if constexpr (F16)
            wgmma_ss_f16<CHUNK>(s, da, db, ADD_TO_S || kk > 0);
        else if constexpr (WRITE_FIRST) {
            if (kk == 0)
                wgmma_ss_first<CHUNK>(s, da, db);
            else
                wgmma_ss<CHUNK>(s, da, db, 1);
        } else
            wgmma_ss<CHUNK>(s, da, db, ADD_TO_S || kk > 0);
    }
}

// O += P·V over the 16-key k-steps of one CHUNK-key V tile; P as A register fragments.
template <int HEAD_DIM, int CHUNK, bool F16 = false>
__device__ __forceinline__ void issue_pv(float (&o)[HEAD_DIM / 2], const uint32_t (&pa)[CHUNK / PAGE_ROWS][4],
                                         uint32_t tV) {
    const uint32_t b_lo = smem_desc_lo(tV, CHUNK * 128);
    constexpr uint32_t hi = smem_desc_hi(1024);
#pragma unroll
    for (int p = 0; p < CHUNK / PAGE_ROWS; ++p) {
        const uint64_t db = desc_words(b_lo + ((p * (PAGE_ROWS * 128)) >> 4), hi);
        if constexpr (F16)
            wgmma_rs_tb_f16<HEAD_DIM>(o, pa[p], db);
        else
            wgmma_rs_tb<HEAD_DIM>(o, pa[p], db);
    }
}

// ---- FP8 operands ----------------------------------------------------------------------------------

// Four e4m3 values (the bytes of `w`, lowest first) -> bf16(float32(e4m3) · scale), packed as two bf16x2
// words in the same order. e4m3 -> f16 is exact; the one rounding is float32 -> bf16 (nearest even).
__device__ __forceinline__ void dequant_e4m3x4(uint32_t& lo, uint32_t& hi, uint32_t w, float scale) {
    float f[4];
    asm("{\n.reg .b16 a, b, h0, h1, h2, h3;\n.reg .b32 x, y;\n"
        "mov.b32 {a, b}, %4;\n"
        "cvt.rn.f16x2.e4m3x2 x, a;\n"
        "cvt.rn.f16x2.e4m3x2 y, b;\n"
        "mov.b32 {h0, h1}, x;\n"
        "mov.b32 {h2, h3}, y;\n"
        "cvt.f32.f16 %0, h0;\ncvt.f32.f16 %1, h1;\ncvt.f32.f16 %2, h2;\ncvt.f32.f16 %3, h3;\n}\n"
        : "=f"(f[0]), "=f"(f[1]), "=f"(f[2]), "=f"(f[3])
        : "r"(w));
    lo = paged::pack_bf16x2(f[0] * scale, f[1] * scale);
    hi = paged::pack_bf16x2(f[2] * scale, f[3] * scale);
}

// Four e4m3 values (the bytes of `w`, lowest first) -> f16, exactly (no scale), as two f16x2 words in the
// same order as dequant_e4m3x4.
__device__ __forceinline__ void e4m3x4_to_f16(uint32_t& lo, uint32_t& hi, uint32_t w) {
    asm("{\n.reg .b16 a, b;\nmov.b32 {a, b}, %2;\n"
        "cvt.rn.f16x2.e4m3x2 %0, a;\ncvt.rn.f16x2.e4m3x2 %1, b;\n}\n"
        : "=r"(lo), "=r"(hi)
        : "r"(w));
}

// The power of two σ (and 1/σ) that brings a row's largest magnitude `amax` below 2^14, so bf16 values
// of the row times σ are exact in f16 (amax = 0: σ = 1).
__device__ __forceinline__ void f16_prescale(float amax, float& sigma, float& inv_sigma) {
    int e = 0;
    if (amax > 0.f) frexpf(amax, &e);  // amax = m · 2^e, m in [0.5, 1)
    e = max(min(14 - e, 110), -110);
    sigma = __int_as_float((e + 127) << 23);
    inv_sigma = __int_as_float((127 - e) << 23);
}

// Two floats -> f16x2 (round to nearest even), `lo` in the low half.
__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
    uint32_t d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// ---- masked online softmax on the wgmma accumulator layout ----------------------------------------

template <int KEYS>
__device__ __forceinline__ uint32_t column_bits(const uint32_t* page_masks, int t4) {
    static_assert(KEYS <= 128, "32 column-pair bits hold at most 128 keys");
    uint32_t bits = 0;
#pragma unroll
    for (int p = 0; p < KEYS / PAGE_ROWS; ++p) {
        const uint32_t m = page_masks[p];
        bits |= ((m >> (2 * t4)) & 3u) << (4 * p);
        bits |= ((m >> (8 + 2 * t4)) & 3u) << (4 * p + 2);
    }
    return bits;
}

// This thread's part of the online softmax over one key tile (KEYS columns, rows g and g + 8 of its
// warp's 16): invalid key columns -> -inf; running max (quad-reduced) and this lane's partial sums
// updated; S replaced by exp2(S·scale_log2 − max·scale_log2); alpha[r] rescales O. A tile whose columns
// are all valid for this thread (full pages) skips the masking selects (about a quarter of the
// softmax's instructions).
template <int KEYS>
__device__ __forceinline__ void online_softmax(float (&s)[KEYS / 2], uint32_t col_bits, float scale_log2,
                                               float (&row_max)[2], float (&row_sum)[2], float (&alpha)[2]) {
    constexpr uint32_t kAllColumns = KEYS / 4 >= 32 ? 0xffffffffu : (1u << (KEYS / 4)) - 1u;
    if (col_bits != kAllColumns) {
#pragma unroll
        for (int j = 0; j < KEYS / 8; ++j) {
            if (!((col_bits >> (2 * j)) & 1u)) { s[4 * j] = -INFINITY; s[4 * j + 2] = -INFINITY; }
            if (!((col_bits >> (2 * j + 1)) & 1u)) { s[4 * j + 1] = -INFINITY; s[4 * j + 3] = -INFINITY; }
        }
    }
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < KEYS / 8; ++j) {
        tile_max[0] = fmaxf(tile_max[0], fmaxf(s[4 * j], s[4 * j + 1]));
        tile_max[1] = fmaxf(tile_max[1], fmaxf(s[4 * j + 2], s[4 * j + 3]));
    }
    float base_l2[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float new_max = fmaxf(row_max[r], paged::quad_max(tile_max[r]));
        base_l2[r] = new_max == -INFINITY ? 0.f : new_max * scale_log2;
        alpha[r] = exp2f(row_max[r] * scale_log2 - base_l2[r]);  // 0 when row_max was -inf
        row_max[r] = new_max;
        row_sum[r] *= alpha[r];
    }
#pragma unroll
    for (int j = 0; j < KEYS / 8; ++j) {
        s[4 * j] = exp2f(fmaf(s[4 * j], scale_log2, -base_l2[0]));
        s[4 * j + 1] = exp2f(fmaf(s[4 * j + 1], scale_log2, -base_l2[0]));
        s[4 * j + 2] = exp2f(fmaf(s[4 * j + 2], scale_log2, -base_l2[1]));
        s[4 * j + 3] = exp2f(fmaf(s[4 * j + 3], scale_log2, -base_l2[1]));
        row_sum[0] += s[4 * j] + s[4 * j + 1];
        row_sum[1] += s[4 * j + 2] + s[4 * j + 3];
    }
}

template <int OREG>
__device__ __forceinline__ void rescale_rows(float (&o)[OREG], const float (&alpha)[2]) {
#pragma unroll
    for (int j = 0; j < OREG / 4; ++j) {
        o[4 * j] *= alpha[0];
        o[4 * j + 1] *= alpha[0];
        o[4 * j + 2] *= alpha[1];
        o[4 * j + 3] *= alpha[1];
    }
}

// P (bf16) as the A register fragments of O += P·V, one per 16-key page (k-step): the accumulator
// layout of S is the A fragment layout (rows g / g + 8, k columns 2·t4 (+1) and 8 + 2·t4 (+1)).
template <int KEYS, bool F16 = false>
__device__ __forceinline__ void pack_p(uint32_t (&pa)[KEYS / PAGE_ROWS][4], const float (&s)[KEYS / 2]) {
#pragma unroll
    for (int p = 0; p < KEYS / PAGE_ROWS; ++p) {
#pragma unroll
        for (int i = 0; i < 4; ++i)
            pa[p][i] = F16 ? pack_f16x2(s[8 * p + 2 * i], s[8 * p + 2 * i + 1])
                           : paged::pack_bf16x2(s[8 * p + 2 * i], s[8 * p + 2 * i + 1]);
    }
}

// ---- key split: two warpgroups that took alternate key chunks of one tile combine their states ----

// Warpgroup 1 parks its O accumulator (staging [OREG][128] fp32, over a buffer neither reads any more)
// and its rows' max (exp2 domain) and sum (stats [2][64]). Thread (wq, g, t4) of the warpgroup holds
// rows 16·wq + g and + 8; wtid is its index in the warpgroup.
template <int OREG>
__device__ __forceinline__ void park_softmax_state(float* staging, float* stats, const float (&o)[OREG],
                                                   const float (&m_l2)[2], const float (&sum)[2], int wtid, int wq,
                                                   int g, int t4) {
#pragma unroll
    for (int i = 0; i < OREG; ++i) staging[i * 128 + wtid] = o[i];
    if (t4 == 0) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            stats[wq * 16 + g + 8 * r] = m_l2[r];
            stats[64 + wq * 16 + g + 8 * r] = sum[r];
        }
    }
}

// Warpgroup 0 folds the parked state into its own O, max and sum (after the hand-off barrier).
template <int OREG>
__device__ __forceinline__ void merge_softmax_state(float (&o)[OREG], float (&m_l2)[2], float (&sum)[2],
                                                    const float* staging, const float* stats, int wtid, int wq,
                                                    int g) {
    float a0[2], a1[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float m1 = stats[wq * 16 + g + 8 * r];
        const float l1 = stats[64 + wq * 16 + g + 8 * r];
        const float mm = fmaxf(m_l2[r], m1);
        a0[r] = mm == -INFINITY ? 0.f : exp2f(m_l2[r] - mm);
        a1[r] = mm == -INFINITY ? 0.f : exp2f(m1 - mm);
        sum[r] = sum[r] * a0[r] + l1 * a1[r];
        m_l2[r] = mm;
    }
#pragma unroll
    for (int j = 0; j < OREG / 4; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = e >> 1;
            o[4 * j + e] = o[4 * j + e] * a0[r] + staging[(4 * j + e) * 128 + wtid] * a1[r];
        }
    }
}

// ---- O / LSE rows from the accumulator layout -----------------------------------------------------

// Store this thread's part of one 16-row O page (rows g, g + 8; columns 8j + 2·t4 (+1)), scaled by
// inv[r], and the two LSE values (lanes t4 == 0), for the rows `mask` marks valid. `o_page` and
// `lse_page` point at row 0 of the page.
template <int HEAD_DIM>
__device__ __forceinline__ void store_o_page(__nv_bfloat16* __restrict__ o_page, float* __restrict__ lse_page,
                                             uint32_t mask, const float (&o)[HEAD_DIM / 2], const float (&inv)[2],
                                             const float (&lse)[2]) {
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t4 = lane & 3;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = g + 8 * r;
        if (!paged::page_row_valid(mask, row)) continue;
        uint32_t* dst = reinterpret_cast<uint32_t*>(o_page + row * HEAD_DIM + 2 * t4);
#pragma unroll
        for (int j = 0; j < HEAD_DIM / 8; ++j)
            dst[4 * j] = paged::pack_bf16x2(o[4 * j + 2 * r] * inv[r], o[4 * j + 2 * r + 1] * inv[r]);
        if (t4 == 0) lse_page[row] = lse[r];
    }
}

// store_o_page with each row written to its token: row r of the page is token map[r] at rows + token ·
// stride (a token outside [0, num_tokens) is not stored); LSE stays in slot order. (A separate copy of
// store_o_page's loop: folding the two into one changed the slot-order build's code.)
template <int HEAD_DIM>
__device__ __forceinline__ void store_o_token_page(__nv_bfloat16* __restrict__ rows, uint32_t stride, int num_tokens,
                                                   const int* __restrict__ map, float* __restrict__ lse_page,
                                                   uint32_t mask, const float (&o)[HEAD_DIM / 2], const float (&inv)[2],
                                                   const float (&lse)[2]) {
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t4 = lane & 3;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = g + 8 * r;
        if (!paged::page_row_valid(mask, row)) continue;
        const int t = map[row];
        if (static_cast<unsigned>(t) < static_cast<unsigned>(num_tokens)) {
            uint32_t* dst = reinterpret_cast<uint32_t*>(rows + static_cast<uint32_t>(t) * stride + 2 * t4);
#pragma unroll
            for (int j = 0; j < HEAD_DIM / 8; ++j)
                dst[4 * j] = paged::pack_bf16x2(o[4 * j + 2 * r] * inv[r], o[4 * j + 2 * r + 1] * inv[r]);
        }
        if (t4 == 0) lse_page[row] = lse[r];
    }
}

}  // namespace hopper
