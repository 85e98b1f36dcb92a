// k-means assignment on Hopper (sm_90a): the nearest centroid of every token, S = X·Cᵀ on wgmma with a
// running row-wise argmin of |c|² − 2·x·c in place of attention's softmax (and no P·V).
//
// X: bf16 [N, tokens, HEAD_DIM], C: bf16 [N, k, HEAD_DIM] (the centroids rounded to bf16), csq: fp32
// [N, k] (|c|² of the rounded centroids), labels: int64 [N, tokens]. With ACCUMULATE, each token is also
// added (fp32) into its cluster's sum, sums fp32 [N, k, HEAD_DIM], and counted, counts fp32 [N, k], by
// atomics (their order, so the last bits of the sums, may change from run to run). `sum_method` says how a
// CTA forms them: SUMS_ATOMICS, one atomic per token; SUMS_PRESUM, each cluster's tokens of the CTA summed
// first by ballots and a member loop, one partial sum per cluster; SUMS_MMA, the same partial sums as one
// product on the tensor cores (P = A·X, A the one-hot [token rows × 128 tokens] matrix of equal labels, in
// attention's P·V shape), sent by each cluster's first token.
//
// A CTA takes 128 tokens of one row n (two warpgroups of 64: the wgmma M) and streams the row's centroids
// in chunks of 128 (wgmma N), double-buffered with cp.async into 128-byte-swizzled tiles: the chunk after
// next loads while the current one multiplies. Tokens past `tokens` and centroids past `k` are zero-filled
// (never read from memory); a centroid past k has |c|² = +inf and is never nearest. Ties go to the lower
// centroid index (as the Triton kernel and torch's argmin). Two CTAs per SM (98 KB of shared memory each
// at HEAD_DIM 128), so one's loads and argmin run under the other's MMAs.
//
// PACKED_ARGMAX: the argmin as a maximum of −|x − c|²/2: S starts at −|c|²/2 − |x|²/2 (|x|² of the CTA's
// tokens summed once from the X tile) and the MMA adds x·c. Each score carries its column among the lane's
// 32 of the chunk in its 5 low mantissa bits, so a row's running best is a chain of max instructions alone
// (four chains a row, for independent instructions) and the column is read back from the winner's bits.
// Two scores within 2⁻¹⁸ of each other (relative to the half-distance) may then be taken in either order,
// where the exact build (PACKED_ARGMAX false) resolves float32 ties to the lower index. (Without the |x|²
// shift the resolution was relative to |x|²/2, coarser than the gaps between centroids on data far from
// the origin.) The host's default (sparseattn/kernels/kmeans_assign.py).
//
// NARROW_TAIL: a last chunk of at most 64 centroids (k mod 128 in 1..64, e.g. SVG2's 300 Q clusters: 44)
// multiplies and scans 64 columns (wgmma N = 64 over the first half of its tile) instead of 128, of which
// the rest are padding that never wins: the same scores for the same columns, so the same labels, with a
// sixth less MMA work at 300 clusters (in the host's default build).
//
// LOOP_RING (with PACKED_ARGMAX): the two chunk buffers on mbarriers instead of two CTA barriers per chunk:
// each warp releases a buffer once its MMA has read it, and chunk c + 2 loads while chunk c's scan runs.
#include "hopper_wgmma.cuh"

// Geometry mirrored in sparseattn/kernels/kmeans_assign.py.
#define KMEANS_THREADS 256
#define KMEANS_ROWS 128   // tokens per CTA
#define KMEANS_CHUNK 128  // centroids per step
#define KMEANS_NBUF 2
// sum_method (ACCUMULATE): mirrored in sparseattn/kernels/kmeans_assign.py
#define SUMS_ATOMICS 0
#define SUMS_PRESUM 1
#define SUMS_MMA 2
// LOOP: how the chunk loop runs (mirrored in sparseattn/kernels/kmeans_assign.py)
#define LOOP_BARRIERS 0     // two CTA barriers per chunk
#define LOOP_RING 1         // the buffers on mbarriers

namespace {

__device__ __forceinline__ uint32_t rows_mask(int rows_left) {
    return rows_left >= PAGE_ROWS ? 0xffffu : rows_left > 0 ? (1u << rows_left) - 1u : 0u;
}

// v with its 5 low mantissa bits replaced by `column` (0..31): one LOP3, (v & keep) | column, with `keep`
// (~31) in a register.
__device__ __forceinline__ float pack_column(float v, uint32_t keep, int column) {
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(__float_as_uint(v)), "r"(keep), "r"(column));
    return __uint_as_float(r);
}

// max.f32 without flush to zero: a packed score near 0 is a subnormal whose bits carry its column.
__device__ __forceinline__ float max_keep_bits(float a, float b) {
    float m;
    asm("max.f32 %0, %1, %2;" : "=f"(m) : "f"(a), "f"(b));
    return m;
}

// −|x|²/2 of tile rows `row` and row + 8 (fp32 sums of the bf16 values), the quad's four lanes (t4) each
// summing every fourth 16-byte chunk of the two rows, then adding their partial sums.
template <int HEAD_DIM>
__device__ __forceinline__ void half_xsq_of_rows(float (&out)[2], const unsigned char* x_tile, int row, int t4) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float acc = 0.f;
#pragma unroll
        for (int i = 0; i < HEAD_DIM / 32; ++i) {
            const uint4 w = *reinterpret_cast<const uint4*>(x_tile + hopper::tile_offset<KMEANS_ROWS>(row + 8 * r, t4 + 4 * i));
            const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int q = 0; q < 4; ++q) {  // a bf16 is the high half of its float32
                const float lo = __uint_as_float(words[q] << 16), hi = __uint_as_float(words[q] & 0xffff0000u);
                acc = fmaf(lo, lo, acc);
                acc = fmaf(hi, hi, acc);
            }
        }
        acc += __shfl_xor_sync(0xffffffffu, acc, 1);
        acc += __shfl_xor_sync(0xffffffffu, acc, 2);
        out[r] = -0.5f * acc;
    }
}

// Packed maximum: S of N centroids starts at −|c|²/2 − |x|²/2 (cq: their −|c|²/2), so the MMA leaves
// −|x − c|²/2 and the packing's resolution is relative to the distance, not to |x|².
template <int N>
__device__ __forceinline__ void init_packed(float (&s)[N / 2], const float* cq, const float (&half_xsq)[2], int t4) {
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
        const float2 h = *reinterpret_cast<const float2*>(cq + 8 * j + 2 * t4);
#pragma unroll
        for (int e = 0; e < 4; ++e) s[4 * j + e] = ((e & 1) ? h.y : h.x) + half_xsq[e >> 1];
    }
}

// Packed maximum: each row's best over the N scores of chunk c, into best / best_i (the chunk; the column
// in the best score's low bits).
template <int N>
__device__ __forceinline__ void scan_packed(const float (&s)[N / 2], int c, float (&best)[2], int (&best_i)[2]) {
    static_assert(N >= 32, "four chains a row");
    float chain[2][4];  // per row, four running maxima over the columns j ≡ 0, 1, 2, 3 (mod 4)
    uint32_t keep_bits;
    asm volatile("mov.b32 %0, 0xffffffe0;" : "=r"(keep_bits));  // a register, so the LOP3 takes it
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float packed = pack_column(s[4 * j + e], keep_bits, 2 * j + (e & 1));
            float& m = chain[e >> 1][j & 3];
            m = (j < 4 && (e & 1) == 0) ? packed : max_keep_bits(m, packed);
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float m = max_keep_bits(max_keep_bits(chain[r][0], chain[r][1]),
                                      max_keep_bits(chain[r][2], chain[r][3]));
        if (m > best[r]) {  // strict: an earlier chunk keeps an equal score
            best[r] = m;
            best_i[r] = c;  // the chunk; its column is in m's low bits
        }
    }
}

// One chunk of N centroids (128, or 64 for a narrow last chunk) against the CTA's tokens: S = X·Cᵀ on
// wgmma (packed argmax: from −|c|²/2 − |x|²/2) over the first N rows of the chunk's 128-row tile, then
// each row's running best over the chunk's columns (best_i: the index, or for the packed argmax the chunk,
// its column in the best score's low bits).
// `after_mma()` runs once the MMA has read the chunk's tiles, before the scan (the ring build releases the
// buffer there).
template <int HEAD_DIM, int N, bool PACKED_ARGMAX, class AfterMma>
__device__ __forceinline__ void chunk_step(float (&s)[N / 2], uint32_t a_rows, uint32_t tile, const float* cq,
                                           const float (&half_xsq)[2], int c, int t4, float (&best)[2],
                                           int (&best_i)[2], AfterMma after_mma) {
    static_assert(N == KMEANS_CHUNK || N == KMEANS_CHUNK / 2, "full chunks, or a narrow last one");
    if constexpr (PACKED_ARGMAX) init_packed<N>(s, cq, half_xsq, t4);
    hopper::wgmma_fence();
    hopper::issue_qk<HEAD_DIM, N, KMEANS_ROWS, false, PACKED_ARGMAX, KMEANS_CHUNK>(s, a_rows, tile);
    hopper::wgmma_commit();
    hopper::wgmma_wait<0>();
    after_mma();
    if constexpr (PACKED_ARGMAX) {
        scan_packed<N>(s, c, best, best_i);
    } else {
#pragma unroll
        for (int j = 0; j < N / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = 8 * j + 2 * t4 + (e & 1);
                const float d = cq[col] - 2.f * s[4 * j + e];
                if (d < best[e >> 1]) {  // strict: the lower index keeps a tie
                    best[e >> 1] = d;
                    best_i[e >> 1] = c * KMEANS_CHUNK + col;
                }
            }
        }
    }
}

template <int HEAD_DIM>
struct KmeansSmem {
    static constexpr int TILE_BYTES = KMEANS_ROWS * HEAD_DIM * 2;  // the X tile and each centroid chunk
    static constexpr int CSQ_BYTES = 4 * KMEANS_NBUF * KMEANS_CHUNK;
    // 1 KB of alignment, the X tile, the chunk buffers, their |c|² terms, the ring build's mbarriers (64 B)
    static constexpr int BYTES = 1024 + TILE_BYTES * (1 + KMEANS_NBUF) + CSQ_BYTES + 64;
    static_assert(KMEANS_ROWS == KMEANS_CHUNK, "X tile and centroid chunks share the tile size");
};

}  // namespace

template <int HEAD_DIM, bool ACCUMULATE, bool PACKED_ARGMAX, bool NARROW_TAIL, int LOOP>
__global__ void __launch_bounds__(KMEANS_THREADS, 2)
kmeans_assign_kernel(const __nv_bfloat16* __restrict__ X, const __nv_bfloat16* __restrict__ C,
                     const float* __restrict__ csq, long long* __restrict__ labels, float* __restrict__ sums,
                     float* __restrict__ counts, int tokens, int k, int sum_method) {
    static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "HEAD_DIM 64 or 128");
    // the ring reloads a chunk's |c|² terms once its MMA has run: only the packed maximum reads them before
    static_assert(LOOP == LOOP_BARRIERS || PACKED_ARGMAX, "the ring builds take the packed maximum");
    using S = KmeansSmem<HEAD_DIM>;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const uint32_t raw = paged::smem_u32(smem_raw);
    const uint32_t xs = (raw + 1023u) & ~1023u;  // the swizzle pattern is anchored at 1024-byte boundaries
    const uint32_t cs = xs + S::TILE_BYTES;
    float* csq_s = reinterpret_cast<float*>(smem_raw + (cs + KMEANS_NBUF * S::TILE_BYTES - raw));

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;  // warp w copies page w of every tile (16 rows)
    const int wg = warp >> 2;   // warpgroup: tokens 64·wg .. 64·wg + 63 of the CTA
    const int wq = warp & 3;    // rows 16·wq .. 16·wq + 15 of the warpgroup's 64
    const int g = lane >> 2;
    const int t4 = lane & 3;
    const int n = blockIdx.y;
    const int row0 = blockIdx.x * KMEANS_ROWS;
    const __nv_bfloat16* Xn = X + static_cast<size_t>(n) * tokens * HEAD_DIM;
    const __nv_bfloat16* Cn = C + static_cast<size_t>(n) * k * HEAD_DIM;
    const float* csq_n = csq + static_cast<size_t>(n) * k;
    const int x_pages = (tokens + PAGE_ROWS - 1) / PAGE_ROWS;
    const int c_pages = (k + PAGE_ROWS - 1) / PAGE_ROWS;
    const int chunks = (k + KMEANS_CHUNK - 1) / KMEANS_CHUNK;

    {  // the CTA's tokens
        const int page[1] = {row0 / PAGE_ROWS + warp};
        const uint32_t mask[1] = {rows_mask(tokens - page[0] * PAGE_ROWS)};
        hopper::warp_copy_pages<HEAD_DIM, KMEANS_ROWS, 1>(xs, PAGE_ROWS * warp, Xn, x_pages, page, mask);
    }
    auto load_chunk = [&](int c) {
        const int buf = c % KMEANS_NBUF;
        const int page[1] = {c * (KMEANS_CHUNK / PAGE_ROWS) + warp};
        const uint32_t mask[1] = {rows_mask(k - page[0] * PAGE_ROWS)};
        hopper::warp_copy_pages<HEAD_DIM, KMEANS_CHUNK, 1>(cs + buf * S::TILE_BYTES, PAGE_ROWS * warp, Cn, c_pages,
                                                           page, mask);
        if (tid < KMEANS_CHUNK) {  // |c|² (argmin), or −|c|²/2 (packed argmax); centroids past k never win
            const int j = c * KMEANS_CHUNK + tid;
            if constexpr (PACKED_ARGMAX)
                csq_s[buf * KMEANS_CHUNK + tid] = j < k ? -0.5f * csq_n[j] : -3.0e38f;  // finite: its bits pack
            else
                csq_s[buf * KMEANS_CHUNK + tid] = j < k ? csq_n[j] : INFINITY;
        }
    };
    if constexpr (LOOP == LOOP_BARRIERS) {
        load_chunk(0);
        paged::cp_async_commit();
    }

    float best[2] = {PACKED_ARGMAX ? -INFINITY : INFINITY, PACKED_ARGMAX ? -INFINITY : INFINITY};
    int best_i[2] = {0, 0};  // the index (argmin), or the chunk (packed argmax)
    float half_xsq[2] = {0.f, 0.f};  // packed argmax: −|x|²/2 of the thread's two rows
    const uint32_t a_rows = xs + wg * 64 * 128;  // this warpgroup's 64 rows of the X tile
    // NARROW_TAIL: a last chunk of at most 64 centroids runs after the loop (peeled, so that each wgmma
    // sequence keeps its own accumulators: in one loop body with the full chunks' ptxas serializes them)
    const bool narrow_tail = NARROW_TAIL && k - (chunks - 1) * KMEANS_CHUNK <= KMEANS_CHUNK / 2;
    const int full_chunks = narrow_tail ? chunks - 1 : chunks;
    // the ring builds' barriers: each chunk buffer's `full` and `empty`
    const uint32_t bars = cs + KMEANS_NBUF * S::TILE_BYTES + S::CSQ_BYTES;
    auto full = [&](int b) { return bars + 8u * b; };
    auto empty = [&](int b) { return bars + 8u * (KMEANS_NBUF + b); };
    // chunk c's buffer has landed (cp.async, everyone's) and is visible to wgmma; its |c|² terms
    auto chunk_ready = [&](int c) {
        if constexpr (LOOP == LOOP_BARRIERS)
            __syncthreads();  // everyone's copies (and the |c|² stores)
        else
            hopper::mbar_wait(full(c % KMEANS_NBUF), (c / KMEANS_NBUF) & 1);
        hopper::fence_async_proxy();  // cp.async writes (generic proxy) -> wgmma reads (async proxy)
        if constexpr (PACKED_ARGMAX) {
            if (c == 0) half_xsq_of_rows<HEAD_DIM>(half_xsq, smem_raw + (xs - raw), 64 * wg + 16 * wq + g, t4);
        }
        return csq_s + (c % KMEANS_NBUF) * KMEANS_CHUNK;
    };
    auto nothing = [] {};
    if constexpr (LOOP != LOOP_BARRIERS) {
        // Each buffer completes on `full` (every thread's copies tracked, the |c|² stores released by its
        // arrive) and is released on `empty` by each warp once its MMA has read the chunk: no CTA barrier in
        // the loop, and chunk c + 2 loads while chunk c's scan runs.
        if (tid == 0) {
            for (int b = 0; b < KMEANS_NBUF; ++b) {
                hopper::mbar_init(full(b), KMEANS_THREADS);
                hopper::mbar_init(empty(b), KMEANS_THREADS / 32);
            }
        }
        __syncthreads();
        auto load_ring = [&](int c) {  // (chunk 0's arrive also covers the X tile's copies, issued before it)
            load_chunk(c);
            hopper::mbar_track_cp_async(full(c % KMEANS_NBUF));
            hopper::mbar_arrive(full(c % KMEANS_NBUF));
        };
        load_ring(0);
        if (chunks > 1) load_ring(1);
        auto release = [&](int c) {
            __syncwarp();
            if (lane == 0) hopper::mbar_arrive(empty(c % KMEANS_NBUF));
            if (c + KMEANS_NBUF < chunks) {  // once every warp has read chunk c, chunk c + 2 into its buffer
                hopper::mbar_wait(empty(c % KMEANS_NBUF), (c / KMEANS_NBUF) & 1);
                load_ring(c + KMEANS_NBUF);
            }
        };
#pragma unroll 1
        for (int c = 0; c < full_chunks; ++c) {
            const float* cq = chunk_ready(c);
            float s[KMEANS_CHUNK / 2];
            chunk_step<HEAD_DIM, KMEANS_CHUNK, PACKED_ARGMAX>(s, a_rows, cs + (c % KMEANS_NBUF) * S::TILE_BYTES,
                                                              cq, half_xsq, c, t4, best, best_i,
                                                              [&] { release(c); });
        }
        if (narrow_tail) {
            const int c = chunks - 1;
            const float* cq = chunk_ready(c);
            float s[KMEANS_CHUNK / 4];
            chunk_step<HEAD_DIM, KMEANS_CHUNK / 2, PACKED_ARGMAX>(s, a_rows, cs + (c % KMEANS_NBUF) * S::TILE_BYTES,
                                                                  cq, half_xsq, c, t4, best, best_i, nothing);
        }
        __syncthreads();  // every warp's |c|² reads are done: the epilogue may reuse their buffer
    } else {
#pragma unroll 1
        for (int c = 0; c < full_chunks; ++c) {
            if (c + 1 < chunks) load_chunk(c + 1);  // into the buffer the previous step released
            paged::cp_async_commit();
            paged::cp_async_wait<1>();  // this thread's copies of X and of chunk c have landed
            const float* cq = chunk_ready(c);
            float s[KMEANS_CHUNK / 2];
            chunk_step<HEAD_DIM, KMEANS_CHUNK, PACKED_ARGMAX>(s, a_rows, cs + (c % KMEANS_NBUF) * S::TILE_BYTES, cq,
                                                              half_xsq, c, t4, best, best_i, nothing);
            __syncthreads();  // chunk c's tiles are read: the next step may load chunk c + 2 into them
        }
        if (narrow_tail) {  // its copies were issued by the loop's last step, or before the loop
            const int c = chunks - 1;
            paged::cp_async_wait<0>();
            const float* cq = chunk_ready(c);
            float s[KMEANS_CHUNK / 4];
            chunk_step<HEAD_DIM, KMEANS_CHUNK / 2, PACKED_ARGMAX>(s, a_rows, cs + (c % KMEANS_NBUF) * S::TILE_BYTES,
                                                                  cq, half_xsq, c, t4, best, best_i, nothing);
            __syncthreads();  // its |c|² terms are read: the epilogue may reuse their buffer
        }
    }
    paged::cp_async_wait<0>();

    if constexpr (PACKED_ARGMAX) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {  // the column out of the score's low bits; the distance's order back
            const uint32_t local = __float_as_uint(best[r]) & 31u;  // 2·j + (e & 1)
            best_i[r] = best_i[r] * KMEANS_CHUNK + 8 * static_cast<int>(local >> 1) + 2 * t4 + (local & 1);
            best[r] = -best[r];
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // the quad's four column sets: the nearest, the lower index on a tie
#pragma unroll
        for (int off = 1; off <= 2; off <<= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best[r], off);
            const int oi = __shfl_xor_sync(0xffffffffu, best_i[r], off);
            if (ov < best[r] || (ov == best[r] && oi < best_i[r])) {
                best[r] = ov;
                best_i[r] = oi;
            }
        }
    }
    const int warp_row0 = row0 + 64 * wg + 16 * wq;  // the token of this warp's row 0
    if (t4 == 0) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int t = warp_row0 + g + 8 * r;
            if (t < tokens) labels[static_cast<size_t>(n) * tokens + t] = best_i[r];
        }
    }
    if constexpr (ACCUMULATE) {
        constexpr int PER_LANE = HEAD_DIM / 32;  // 4 (HEAD_DIM 128) or 2 (64) contiguous columns a lane
        if (sum_method == SUMS_MMA) {
            // Row r of the warpgroup's A is token 64·wg + r's cluster over the CTA's 128 tokens (1 where a
            // token has its label), so row r of P = A·X is that cluster's sum of the CTA's tokens; the
            // cluster's first token (its leader) sends it. bf16 ones times bf16 tokens, fp32 accumulation:
            // the partial sums are exact but for float32 rounding, as the member loop's.
            int* lab_s = reinterpret_cast<int*>(csq_s);  // [KMEANS_ROWS]; the |c|² buffers are free after the loop
            int my_label[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) my_label[r] = warp_row0 + g + 8 * r < tokens ? best_i[r] : -1;
            if (t4 == 0) {
#pragma unroll
                for (int r = 0; r < 2; ++r) lab_s[64 * wg + 16 * wq + g + 8 * r] = my_label[r];
            }
            __syncthreads();
            uint32_t pa[KMEANS_ROWS / PAGE_ROWS][4];  // A fragments, k-step p: tokens 16p .. 16p + 15
            int first[2] = {KMEANS_ROWS, KMEANS_ROWS};  // the lowest token of the row's cluster, this lane's columns
            int size[2] = {0, 0};
            constexpr uint32_t ONE_LO = 0x3F80u, ONE_HI = 0x3F800000u;  // bf16 1.0 in a bf16x2's low / high half
#pragma unroll
            for (int p = 0; p < KMEANS_ROWS / PAGE_ROWS; ++p) {
                const int c0 = PAGE_ROWS * p + 2 * t4;  // this lane's columns: c0, c0 + 1, c0 + 8, c0 + 9
                const int2 lo = *reinterpret_cast<const int2*>(lab_s + c0);
                const int2 hi = *reinterpret_cast<const int2*>(lab_s + c0 + 8);
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int L = my_label[r];
                    const bool e0 = lo.x == L, e1 = lo.y == L, e2 = hi.x == L, e3 = hi.y == L;
                    pa[p][r] = (e0 ? ONE_LO : 0u) | (e1 ? ONE_HI : 0u);      // a0 (row g), a1 (row g + 8)
                    pa[p][2 + r] = (e2 ? ONE_LO : 0u) | (e3 ? ONE_HI : 0u);  // a2, a3: columns + 8
                    size[r] += e0 + e1 + e2 + e3;
                    const int f = e0 ? c0 : e1 ? c0 + 1 : e2 ? c0 + 8 : e3 ? c0 + 9 : KMEANS_ROWS;
                    first[r] = min(first[r], f);
                }
            }
            bool leads[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {  // the quad's four column sets
                size[r] += __shfl_xor_sync(0xffffffffu, size[r], 1);
                size[r] += __shfl_xor_sync(0xffffffffu, size[r], 2);
                first[r] = min(first[r], __shfl_xor_sync(0xffffffffu, first[r], 1));
                first[r] = min(first[r], __shfl_xor_sync(0xffffffffu, first[r], 2));
                leads[r] = my_label[r] >= 0 && first[r] == 64 * wg + 16 * wq + g + 8 * r;
            }
            float o[HEAD_DIM / 2];
#pragma unroll
            for (int i = 0; i < HEAD_DIM / 2; ++i) o[i] = 0.f;
            hopper::wgmma_fence();
            hopper::issue_pv<HEAD_DIM, KMEANS_ROWS>(o, pa, xs);
            hopper::wgmma_commit();
            hopper::wgmma_wait<0>();
            // Lanes t4 and t4 ^ 1 hold columns 8j + 2·(t4 & 2) .. + 3 of rows g and g + 8: after one exchange
            // the even lane sends four consecutive columns of row g, the odd lane of row g + 8 (float4 atomics).
            const bool odd = t4 & 1;  // selects, not an index: a dynamic index would put the arrays in local memory
            const int label = odd ? my_label[1] : my_label[0];
            const bool sends = odd ? leads[1] : leads[0];
            const int count = odd ? size[1] : size[0];
            float* dst = sums + (static_cast<size_t>(n) * k + (label < 0 ? 0 : label)) * HEAD_DIM + 2 * (t4 & 2);
#pragma unroll
            for (int j = 0; j < HEAD_DIM / 8; ++j) {
                const float give0 = odd ? o[4 * j] : o[4 * j + 2], give1 = odd ? o[4 * j + 1] : o[4 * j + 3];
                const float got0 = __shfl_xor_sync(0xffffffffu, give0, 1);
                const float got1 = __shfl_xor_sync(0xffffffffu, give1, 1);
                const float4 v = odd ? make_float4(got0, got1, o[4 * j + 2], o[4 * j + 3])
                                     : make_float4(o[4 * j], o[4 * j + 1], got0, got1);
                if (sends) atomicAdd(reinterpret_cast<float4*>(dst + 8 * j), v);
            }
            if (sends && (t4 >> 1) == 0)
                atomicAdd(counts + static_cast<size_t>(n) * k + label, static_cast<float>(count));
        } else if (sum_method == SUMS_PRESUM) {
            // Each cluster's tokens of this CTA summed here first, so one float4 atomic per lane goes out per
            // cluster present, not per token (the host asks for it with few clusters, whose atomics collide).
            // The token with the lowest index of a cluster (its leader) owns the sum: its warp finds the
            // members by four ballots over the CTA's labels and adds their rows from the X tile in index order.
            int* lab_s = reinterpret_cast<int*>(csq_s);  // [KMEANS_ROWS]; the |c|² buffers are free after the loop
            if (t4 == 0) {
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int row = 64 * wg + 16 * wq + g + 8 * r;
                    lab_s[row] = row0 + row < tokens ? best_i[r] : -1;
                }
            }
            __syncthreads();
            static_assert(KMEANS_ROWS == 128, "four ballots of 32 labels cover the CTA's tokens");
            const unsigned char* x_tile = smem_raw + (xs - raw);
            int mine[4];  // labels of tokens lane, 32 + lane, 64 + lane, 96 + lane: ballot w is member word w
#pragma unroll
            for (int w = 0; w < 4; ++w) mine[w] = lab_s[32 * w + lane];
            const uint32_t col_byte = static_cast<uint32_t>(PER_LANE * 2 * lane);  // this lane's first column, bytes
#pragma unroll 1
            for (int i = 0; i < PAGE_ROWS; ++i) {
                const int row = 16 * warp + i;
                const int label = lab_s[row];
                if (label < 0) continue;  // past `tokens` (warp-uniform)
                uint32_t member[4];  // bit b of word w: token 32·w + b has this label
#pragma unroll
                for (int w = 0; w < 4; ++w) member[w] = __ballot_sync(0xffffffffu, mine[w] == label);
                const int first = member[0] ? __ffs(member[0]) - 1
                                  : member[1] ? 32 + __ffs(member[1]) - 1
                                  : member[2] ? 64 + __ffs(member[2]) - 1
                                              : 96 + __ffs(member[3]) - 1;
                if (first != row) continue;  // an earlier token leads this cluster
                float acc[PER_LANE];
#pragma unroll
                for (int e = 0; e < PER_LANE; ++e) acc[e] = 0.f;
                int size = 0;
#pragma unroll
                for (int w = 0; w < 4; ++w) {
                    uint32_t bits = member[w];
                    size += __popc(bits);
                    while (bits) {
                        const int j = 32 * w + __ffs(bits) - 1;
                        bits &= bits - 1u;
                        const uint32_t off = hopper::tile_offset<KMEANS_ROWS>(j, col_byte >> 4) + (col_byte & 15u);
                        if constexpr (PER_LANE == 4) {
                            const uint2 raw4 = *reinterpret_cast<const uint2*>(x_tile + off);
                            const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw4.x));
                            const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw4.y));
                            acc[0] += a.x;
                            acc[1] += a.y;
                            acc[2] += b.x;
                            acc[3] += b.y;
                        } else {
                            const uint32_t raw2 = *reinterpret_cast<const uint32_t*>(x_tile + off);
                            const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw2));
                            acc[0] += a.x;
                            acc[1] += a.y;
                        }
                    }
                }
                float* dst = sums + (static_cast<size_t>(n) * k + label) * HEAD_DIM + PER_LANE * lane;
                if constexpr (PER_LANE == 4)
                    atomicAdd(reinterpret_cast<float4*>(dst), make_float4(acc[0], acc[1], acc[2], acc[3]));
                else
                    atomicAdd(reinterpret_cast<float2*>(dst), make_float2(acc[0], acc[1]));
                if (lane == 0) atomicAdd(counts + static_cast<size_t>(n) * k + label, static_cast<float>(size));
            }
        } else {  // each of the warp's 16 tokens into its cluster's sum and count
#pragma unroll 1
            for (int i = 0; i < PAGE_ROWS; ++i) {
                const int label = __shfl_sync(0xffffffffu, (i >> 3) ? best_i[1] : best_i[0], 4 * (i & 7));
                const int t = warp_row0 + i;
                if (t >= tokens) break;
                const __nv_bfloat16* x = Xn + static_cast<size_t>(t) * HEAD_DIM + PER_LANE * lane;
                float* dst = sums + (static_cast<size_t>(n) * k + label) * HEAD_DIM + PER_LANE * lane;
                if constexpr (PER_LANE == 4) {
                    const uint2 raw4 = *reinterpret_cast<const uint2*>(x);
                    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw4.x));
                    const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw4.y));
                    atomicAdd(reinterpret_cast<float4*>(dst), make_float4(a.x, a.y, b.x, b.y));
                } else {
                    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(x));
                    atomicAdd(reinterpret_cast<float2*>(dst), a);
                }
                if (lane == 0) atomicAdd(counts + static_cast<size_t>(n) * k + label, 1.f);
            }
        }
    }
}
