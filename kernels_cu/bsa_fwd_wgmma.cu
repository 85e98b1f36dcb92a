// Paged block-sparse attention forward on Hopper wgmma (sm_90a): the BSA baseline's contract, with
// S = Q Kᵀ and O += P V on warpgroup MMA instead of mma.sync.
//
// Same work list and outputs as bsa_fwd.cu (any owner='q' TilePlan whose tile is 128 × 128): one CTA
// per (work item, batch) owns 128 query rows (8 Q pages, own_pages, -1 padded) and streams its K/V
// pages (stream_pages[stream_indptr[w] .. stream_indptr[w+1]]) in stages of 128 keys (8 pages; a
// stage past the end of the list is never loaded, pages past the end inside the last stage are
// zero-filled with mask 0 and contribute nothing).
//
// Two consumer warpgroups (256 threads); warpgroup w owns query rows 64w .. 64w + 63 of the tile:
// * S (64 × 128 fp32 per warpgroup) = Q Kᵀ: wgmma.m64n128k16, A = Q and B = K both from shared memory
//   (K-major), HEAD_DIM / 16 k-steps;
// * exact per-key-column mask (-inf), online softmax in registers on the accumulator layout
//   (lane holds rows 16·warp + lane/4 (+8), columns 8j + 2·(lane%4) (+1)), exp2 with a log2(e)-scaled scale;
// * O (64 × HEAD_DIM fp32) += P V: wgmma.m64n{HEAD_DIM}k16 with P from registers (the bf16-converted
//   S fragments are exactly the A register fragments) and V from shared memory, MN-major (transposed B);
//   one 16-row page of V is one k-step.
//
// Shared-memory tiles use wgmma's canonical 128-byte-swizzle layout: the head dimension is cut into
// 64-element (128-byte) column blocks, each stored ROWS × 128 B, and 16-byte chunk c of row r sits at
// chunk position c ^ (r % 8). Tiles start 1024-byte aligned, so a 16-row page lands at any 16-row
// offset without breaking the pattern. K/V pages are gathered with 16-byte cp.async (invalid rows and
// pages past the list zero-filled, never read from HBM) into a ring of NBUF stage buffers; K and V
// of a stage are separate cp.async groups. Each thread makes its cp.async data visible to the
// tensor cores' async proxy with fence.proxy.async before the barrier that precedes the wgmma.
//
// Two schedules (template flag OVERLAP):
// * false (2 buffers, 3 barriers per stage): stage s + 1 loads while stage s runs S = Q Kᵀ, softmax,
//   O += P V, each waited before the next;
// * true (3 buffers, 1 barrier per stage): after S = Q Kᵀ of stage s is issued, O += P V of stage
//   s - 1 is issued behind it, and runs on the tensor cores during stage s's softmax; O is rescaled
//   and the new P packed once both are done. Stage s + 1 loads during stage s.
//
// Page ids and row masks of stage s live in shared-memory slot s % NBUF; threads 0..7 load the
// metadata of stage s + 2 into registers one stage early and store it once its slot is free.
//
// Outputs: O bf16 [batch, heads, q_slots, HEAD_DIM]; LSE fp32 [batch, heads, q_slots], natural log.
// A valid query row with no valid key gets O = 0 and LSE = -inf. Invalid query rows are not stored.
#include "paged_attn_common.cuh"

// Tile geometry (mirrored in sparseattn/kernels/bsa_forward_wgmma.py).
#define BSA_WG_TILE_M 128
#define BSA_WG_TILE_N 128
#define BSA_WG_THREADS 256

namespace {

// ---- wgmma wrappers (operands: 64-bit shared-memory matrix descriptors, fp32 accumulators) ------

// d (m64 x n128 fp32) {= or +=} A (64 x 16, shared, K-major) * B (n128 x 16, shared, K-major)
__device__ __forceinline__ void wgmma_ss_n128(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// d (m64 x n128 fp32) += A (64 x 16 bf16, registers) * B (16 x n128, shared, MN-major: transposed)
__device__ __forceinline__ void wgmma_rs_n128_tb(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

// d (m64 x n64 fp32) += A (64 x 16 bf16, registers) * B (16 x n64, shared, MN-major: transposed)
__device__ __forceinline__ void wgmma_rs_n64_tb(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(PENDING) : "memory");
}
// generic-proxy writes (cp.async) to shared memory -> visible to async-proxy reads (wgmma)
__device__ __forceinline__ void fence_async_proxy() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Ties accumulator registers to this point: the compiler may not move their reads or writes across
// a wgmma wait (the wgmma asm statements alone do not order ordinary code around the async MMA).
template <int N>
__device__ __forceinline__ void pin_registers(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i]) :: "memory");
}

// Shared-memory matrix descriptor, 128-byte swizzle: start address, leading and stride byte offsets.
// K-major: the leading offset is unused (one k-step stays inside a 128-byte row); the stride offset
// is the distance between 8-row groups (1024 B). MN-major (transposed B): the leading offset is the
// distance between 64-element column blocks, the stride offset between 8-row (k) groups.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lead_bytes, uint32_t stride_bytes) {
    return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) | (static_cast<uint64_t>(lead_bytes >> 4) << 16) |
           (static_cast<uint64_t>(stride_bytes >> 4) << 32) | (1ull << 62);
}

// Byte offset of (row, 16-byte chunk) in a ROWS-row tile of the canonical 128-byte-swizzle layout.
template <int ROWS>
__device__ __forceinline__ uint32_t tile_offset(int row, int chunk) {
    return static_cast<uint32_t>((chunk >> 3) * (ROWS * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
}

// Gather ROWS/16 pages of a [slots, HEAD_DIM] bf16 matrix into a ROWS-row swizzled tile with 16-byte
// cp.async, all THREADS threads cooperating; page_of(slot) / mask_of(slot) give the page id and its
// 16-bit row mask. Invalid rows and ids outside [0, num_pages) are zero-filled and never read.
// Thread t copies chunk t % CPR of rows t / CPR + i·RPI: its swizzled chunk position is constant.
template <int ROWS, int HEAD_DIM, int THREADS, typename PageOf, typename MaskOf>
__device__ __forceinline__ void gather_tile(uint32_t tile, const __nv_bfloat16* __restrict__ matrix, int num_pages,
                                            PageOf page_of, MaskOf mask_of) {
    constexpr int CPR = HEAD_DIM / 8;   // 16-byte chunks per row
    constexpr int RPI = THREADS / CPR;  // rows per step
    static_assert(THREADS % CPR == 0 && RPI % 8 == 0 && ROWS % RPI == 0, "gather_tile: bad thread layout");
    const int tid = threadIdx.x;
    const int row0 = tid / CPR;
    const int chunk = tid % CPR;
    const uint32_t dst0 = tile + tile_offset<ROWS>(row0, chunk);  // (row0 + i·RPI) % 8 == row0 % 8
#pragma unroll
    for (int i = 0; i < ROWS / RPI; ++i) {
        const int row = i * RPI + row0;
        const int slot = row / PAGE_ROWS;
        const int r = row % PAGE_ROWS;
        const int page = page_of(slot);
        const bool valid = paged::page_row_valid(mask_of(slot), r) &&
                           static_cast<unsigned>(page) < static_cast<unsigned>(num_pages);
        const uint32_t elem = static_cast<uint32_t>(page) * (PAGE_ROWS * HEAD_DIM) +
                              static_cast<uint32_t>(r * HEAD_DIM + chunk * 8);
        paged::cp_async_16_zfill(dst0 + static_cast<uint32_t>(i * RPI * 128), valid ? matrix + elem : matrix, valid);
    }
}

template <int HEAD_DIM, bool OVERLAP>
struct WgTile {
    static constexpr int TILE_M = BSA_WG_TILE_M;
    static constexpr int TILE_N = BSA_WG_TILE_N;
    static constexpr int THREADS = BSA_WG_THREADS;
    // K/V stage buffers (and metadata slots): 2 for the sequential schedule; 3 when O += P V of stage
    // s - 1 runs during stage s (its V buffer is still read while stage s + 1 loads).
    static constexpr int NBUF = OVERLAP ? 3 : 2;
    static constexpr int STAGE_PAGES = TILE_N / PAGE_ROWS;
    static constexpr int Q_BYTES = TILE_M * HEAD_DIM * 2;
    static constexpr int KV_BYTES = TILE_N * HEAD_DIM * 2;
    // 1 KB of slack to align the tiles to 1024 B | Q | K[NBUF] | V[NBUF] | page ids, row masks [NBUF][8]
    static constexpr int SMEM_BYTES = 1024 + Q_BYTES + 2 * NBUF * KV_BYTES + NBUF * STAGE_PAGES * 8;
    static_assert(TILE_M == 2 * 64 && TILE_N == 128, "two m64 warpgroups x n128 key stages");
    static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "HEAD_DIM 64 or 128");
    static_assert(SMEM_BYTES <= 227 * 1024, "dynamic shared memory over the H200's per-block limit");
};

template <int HEAD_DIM>
__device__ __forceinline__ void wgmma_pv(float (&o)[HEAD_DIM / 2], const uint32_t (&a)[4], uint64_t desc_v);
template <>
__device__ __forceinline__ void wgmma_pv<128>(float (&o)[64], const uint32_t (&a)[4], uint64_t desc_v) {
    wgmma_rs_n128_tb(o, a, desc_v);
}
template <>
__device__ __forceinline__ void wgmma_pv<64>(float (&o)[32], const uint32_t (&a)[4], uint64_t desc_v) {
    wgmma_rs_n64_tb(o, a, desc_v);
}

// S = Q Kᵀ for this warpgroup's 64 rows (Q tile rows at aQwg) and the 128 keys of a K stage buffer.
template <int HEAD_DIM>
__device__ __forceinline__ void issue_qk(float (&s)[64], uint32_t aQwg, uint32_t tK) {
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
        const uint32_t col = static_cast<uint32_t>(kk & 3) * 32u;  // k-step inside a 128-byte column block
        const uint64_t da = smem_desc(aQwg + (kk >> 2) * (BSA_WG_TILE_M * 128) + col, 16, 1024);
        const uint64_t db = smem_desc(tK + (kk >> 2) * (BSA_WG_TILE_N * 128) + col, 16, 1024);
        wgmma_ss_n128(s, da, db, kk > 0);
    }
}

// O += P V over the 8 pages (k-steps) of a V stage buffer; P as A register fragments.
template <int HEAD_DIM>
__device__ __forceinline__ void issue_pv(float (&o)[HEAD_DIM / 2], const uint32_t (&pa)[8][4], uint32_t tV) {
#pragma unroll
    for (int p = 0; p < 8; ++p)
        wgmma_pv<HEAD_DIM>(o, pa[p], smem_desc(tV + p * (PAGE_ROWS * 128), BSA_WG_TILE_N * 128, 1024));
}

// This lane's part of the online softmax over one 128-key stage (rows g and g + 8 of its warp,
// columns 8j + 2·t4 (+1)): invalid key columns (row masks of the stage's 8 pages) -> -inf, running
// max and sum updated, S replaced by exp2(S·scale_log2 − max·scale_log2). alpha[r] rescales O.
__device__ __forceinline__ void online_softmax(float (&s)[64], const uint32_t* masks, int t4, float scale_log2,
                                               float (&row_max)[2], float (&row_sum)[2], float (&alpha)[2]) {
#pragma unroll
    for (int p = 0; p < 8; ++p) {
        const uint32_t m16 = masks[p];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint32_t bits = (m16 >> (h * 8 + 2 * t4)) & 3u;
            float* sj = s + 4 * (2 * p + h);
            if (!(bits & 1u)) { sj[0] = -INFINITY; sj[2] = -INFINITY; }
            if (!(bits & 2u)) { sj[1] = -INFINITY; sj[3] = -INFINITY; }
        }
    }
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        tile_max[0] = fmaxf(tile_max[0], fmaxf(s[4 * j], s[4 * j + 1]));
        tile_max[1] = fmaxf(tile_max[1], fmaxf(s[4 * j + 2], s[4 * j + 3]));
    }
    float base_l2[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float new_max = fmaxf(row_max[r], paged::quad_max(tile_max[r]));
        base_l2[r] = new_max == -INFINITY ? 0.f : new_max * scale_log2;
        alpha[r] = exp2f(row_max[r] * scale_log2 - base_l2[r]);  // 0 when row_max was -inf
        row_max[r] = new_max;
        row_sum[r] *= alpha[r];
    }
#pragma unroll
    for (int j = 0; j < 16; ++j) {
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

// P (bf16) as the A register fragments of the 8 k-steps (pages) of O += P V: the accumulator
// layout of S is the A fragment layout (rows g / g + 8, k columns 2·t4 (+1) and 8 + 2·t4 (+1)).
__device__ __forceinline__ void pack_p(uint32_t (&pa)[8][4], const float (&s)[64]) {
#pragma unroll
    for (int p = 0; p < 8; ++p) {
        pa[p][0] = paged::pack_bf16x2(s[8 * p], s[8 * p + 1]);
        pa[p][1] = paged::pack_bf16x2(s[8 * p + 2], s[8 * p + 3]);
        pa[p][2] = paged::pack_bf16x2(s[8 * p + 4], s[8 * p + 5]);
        pa[p][3] = paged::pack_bf16x2(s[8 * p + 6], s[8 * p + 7]);
    }
}

}  // namespace

// OVERLAP = false: per stage, S = Q Kᵀ, softmax, O += P V, each waited before the next (2 buffers).
// OVERLAP = true: O += P V of stage s - 1 is issued right after S = Q Kᵀ of stage s and runs on the
// tensor cores while stage s's softmax runs; one barrier per stage (3 buffers).
template <int HEAD_DIM, bool OVERLAP>
__global__ void __launch_bounds__(BSA_WG_THREADS, 1)
bsa_fwd_wgmma_kernel(const __nv_bfloat16* __restrict__ Q, const __nv_bfloat16* __restrict__ K,
                     const __nv_bfloat16* __restrict__ V, __nv_bfloat16* __restrict__ O, float* __restrict__ LSE,
                     const int* __restrict__ work_head, const int* __restrict__ own_pages, int own_stride,
                     const int* __restrict__ stream_indptr, const int* __restrict__ stream_pages,
                     const uint16_t* __restrict__ own_page_mask, const uint32_t* __restrict__ stream_entry_mask,
                     int work_begin, int heads, int q_slots, int k_slots, float scale_log2) {
    using T = WgTile<HEAD_DIM, OVERLAP>;
    constexpr int OREG = HEAD_DIM / 2;  // O accumulator floats per thread (64 × HEAD_DIM / 128 threads)
    constexpr int SP = T::STAGE_PAGES;
    constexpr int NBUF = T::NBUF;

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const uint32_t raw = paged::smem_u32(smem_raw);
    const uint32_t aQ = (raw + 1023u) & ~1023u;  // the swizzle pattern is anchored at 1024-byte boundaries
    unsigned char* base = smem_raw + (aQ - raw);
    const uint32_t aK = aQ + T::Q_BYTES;
    const uint32_t aV = aK + NBUF * T::KV_BYTES;
    int* sPage = reinterpret_cast<int*>(base + T::Q_BYTES + 2 * NBUF * T::KV_BYTES);
    uint32_t* sMask = reinterpret_cast<uint32_t*>(sPage + NBUF * SP);

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
    const int num_stages = (stream_len + SP - 1) / SP;

    const int tid = threadIdx.x;
    const int warp = tid >> 5;  // rows 16·warp .. 16·warp + 15 of the tile (one Q page)
    const int lane = tid & 31;
    const int g = lane >> 2;
    const int t4 = lane & 3;
    const int wg = tid >> 7;    // warpgroup: rows 64·wg .. 64·wg + 63

    // Metadata: slot st % NBUF holds the page ids / row masks of stage st. Threads tid < SP keep the
    // entry of stage st + 2 in registers and store it once slot (st + 2) % NBUF is free.
    auto stream_meta = [&](int idx, int& page, uint32_t& mask) {  // past the list: id -1, mask 0 (never read)
        const bool in_list = idx < stream_len;
        page = in_list ? my_stream[idx] : -1;
        mask = in_list ? stream_entry_mask[stream_begin + idx] : 0u;
    };
    int next_page = -1;
    uint32_t next_mask = 0u;
    auto store_next_meta = [&](int stage) {  // metadata of stage + 2 into its slot, load stage + 3's
        if (tid < SP) {
            const int slot = ((stage + 2) % NBUF) * SP + tid;
            sPage[slot] = next_page;
            sMask[slot] = next_mask;
            stream_meta((stage + 3) * SP + tid, next_page, next_mask);
        }
    };
    if (tid < SP) {
#pragma unroll
        for (int st = 0; st < 2; ++st) {
            int p;
            uint32_t m;
            stream_meta(st * SP + tid, p, m);
            sPage[st * SP + tid] = p;
            sMask[st * SP + tid] = m;
        }
        stream_meta(2 * SP + tid, next_page, next_mask);
    }
    gather_tile<T::TILE_M, HEAD_DIM, T::THREADS>(
        aQ, Qh, q_pages, [&](int slot) { return my_own[slot]; },
        [&](int slot) { return paged::load_page_mask(own_page_mask, my_own[slot], q_pages); });
    __syncthreads();  // metadata of stages 0 and 1 visible

    // K of stage `stage` (one cp.async group), then V (another), into buffers stage % NBUF
    auto issue_stage = [&](int stage) {
        const int buf = stage % NBUF;
        const int* pages = sPage + buf * SP;
        const uint32_t* masks = sMask + buf * SP;
        auto page_of = [&](int slot) { return pages[slot]; };
        auto mask_of = [&](int slot) { return masks[slot]; };
        gather_tile<T::TILE_N, HEAD_DIM, T::THREADS>(aK + buf * T::KV_BYTES, Kh, k_pages, page_of, mask_of);
        paged::cp_async_commit();
        gather_tile<T::TILE_N, HEAD_DIM, T::THREADS>(aV + buf * T::KV_BYTES, Vh, k_pages, page_of, mask_of);
        paged::cp_async_commit();
    };
    // the next stage, or two empty groups (the cp.async wait counts below stay fixed)
    auto issue_next = [&](int stage) {
        if (stage + 1 < num_stages) {
            issue_stage(stage + 1);
        } else {
            paged::cp_async_commit();
            paged::cp_async_commit();
        }
    };
    issue_stage(0);  // the first group carries Q too

    float o[OREG];
#pragma unroll
    for (int i = 0; i < OREG; ++i) o[i] = 0.f;
    float row_max[2] = {-INFINITY, -INFINITY};  // running max of raw scores, rows g and g + 8
    float row_sum[2] = {0.f, 0.f};              // this lane's partial sums of exp2(...)
    const uint32_t aQwg = aQ + wg * 64 * 128;   // this warpgroup's 64 rows (1024-byte aligned)
    float s[64];                                // S (then P in fp32) of the current stage
    uint32_t pa[SP][4];                         // P (bf16 A fragments) of the stage whose O += P V is next
    float alpha[2];

    if constexpr (!OVERLAP) {
#pragma unroll 1
        for (int stage = 0; stage < num_stages; ++stage) {
            const int buf = stage % NBUF;
            issue_next(stage);
            paged::cp_async_wait<3>();  // K (and Q) of this stage landed; its V and the next stage may be in flight
            fence_async_proxy();
            __syncthreads();
            wgmma_fence();
            issue_qk<HEAD_DIM>(s, aQwg, aK + buf * T::KV_BYTES);
            wgmma_commit();
            wgmma_wait<0>();
            pin_registers(s);
            online_softmax(s, sMask + buf * SP, t4, scale_log2, row_max, row_sum, alpha);
            rescale_rows(o, alpha);
            pack_p(pa, s);
            paged::cp_async_wait<2>();  // V of this stage landed
            fence_async_proxy();
            __syncthreads();            // also: every thread is past this stage's mask reads
            store_next_meta(stage);
            wgmma_fence();
            issue_pv<HEAD_DIM>(o, pa, aV + buf * T::KV_BYTES);
            wgmma_commit();
            wgmma_wait<0>();
            pin_registers(o);
            __syncthreads();  // buffers `buf` are refilled and slot `buf` is read by the next iteration's prefetch
        }
    } else {
#pragma unroll 1
        for (int stage = 0; stage < num_stages; ++stage) {
            const int buf = stage % NBUF;
            paged::cp_async_wait<1>();  // K of this stage and V of the previous one landed
            fence_async_proxy();
            __syncthreads();  // ... and every warpgroup is done with stage - 2's buffers and stage - 1's masks
            issue_next(stage);
            store_next_meta(stage);
            wgmma_fence();
            issue_qk<HEAD_DIM>(s, aQwg, aK + buf * T::KV_BYTES);
            wgmma_commit();
            if (stage > 0) {
                issue_pv<HEAD_DIM>(o, pa, aV + ((stage + NBUF - 1) % NBUF) * T::KV_BYTES);
                wgmma_commit();
                wgmma_wait<1>();  // S landed; O += P V of the previous stage may still run
            } else {
                wgmma_wait<0>();
            }
            pin_registers(s);
            online_softmax(s, sMask + buf * SP, t4, scale_log2, row_max, row_sum, alpha);
            wgmma_wait<0>();
            pin_registers(o);
            rescale_rows(o, alpha);
            pack_p(pa, s);
        }
        if (num_stages > 0) {  // O += P V of the last stage
            paged::cp_async_wait<0>();
            fence_async_proxy();
            __syncthreads();
            wgmma_fence();
            issue_pv<HEAD_DIM>(o, pa, aV + ((num_stages - 1) % NBUF) * T::KV_BYTES);
            wgmma_commit();
            wgmma_wait<0>();
            pin_registers(o);
        }
    }

    // ---- epilogue: normalize, stage this warp's 16 rows (its Q page) in the Q tile, store valid rows
    paged::cp_async_wait<0>();
    __syncthreads();
    __nv_bfloat16* sO = reinterpret_cast<__nv_bfloat16*>(base);
    constexpr int CPR = HEAD_DIM / 8;
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        row_sum[r] = paged::quad_sum(row_sum[r]);
        inv[r] = row_sum[r] > 0.f ? 1.f / row_sum[r] : 0.f;
    }
    const int tile_row0 = warp * PAGE_ROWS;
#pragma unroll
    for (int j = 0; j < OREG / 4; ++j) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = tile_row0 + g + 8 * r;
            *reinterpret_cast<uint32_t*>(sO + paged::swizzle_offset<HEAD_DIM>(row, j) + 2 * t4) =
                paged::pack_bf16x2(o[4 * j + 2 * r] * inv[r], o[4 * j + 2 * r + 1] * inv[r]);
        }
    }
    __syncwarp();
    const int page = my_own[warp];
    const uint32_t own_mask = paged::load_page_mask(own_page_mask, page, q_pages);
    if (own_mask == 0u) return;  // padding page or no page: nothing to store
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
                LSE[row0 + rr] = row_sum[r] > 0.f ? (row_max[r] * scale_log2 + log2f(row_sum[r])) * paged::kLn2
                                                  : -INFINITY;
        }
    }
}
