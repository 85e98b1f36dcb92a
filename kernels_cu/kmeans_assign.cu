// k-means assignment on Hopper (sm_90a): the nearest centroid of every token, S = X·Cᵀ on wgmma with a
// running row-wise argmin of |c|² − 2·x·c in place of attention's softmax (and no P·V).
//
// X: bf16 [N, tokens, HEAD_DIM], C: bf16 [N, k, HEAD_DIM] (the centroids rounded to bf16), csq: fp32
// [N, k] (|c|² of the rounded centroids), labels: int64 [N, tokens]. With ACCUMULATE, each token is also
// added (fp32) into its cluster's sum, sums fp32 [N, k, HEAD_DIM], and counted, counts fp32 [N, k], by
// atomics (their order, so the last bits of the sums, may change from run to run); with `presum` a CTA
// first sums each cluster's tokens among its own and adds one partial sum per cluster.
//
// A CTA takes ROWS tokens of one row n (ROWS / 64 warpgroups of 64: the wgmma M) and streams the row's
// centroids in chunks of 128 (wgmma N), double-buffered with cp.async into 128-byte-swizzled tiles: the
// chunk after next loads while the current one multiplies. Tokens past `tokens` and centroids past `k` are
// zero-filled (never read from memory); a centroid past k has |c|² = +inf and is never nearest. Ties go to
// the lower centroid index (as the Triton kernel and torch's argmin). ROWS 128: two CTAs per SM (98 KB of
// shared memory each at HEAD_DIM 128), so one's loads and argmin run under the other's MMAs. ROWS 256: one
// CTA of four warpgroups per SM (130 KB), each centroid chunk read from L2 once per 256 tokens, not 128.
// Every step ends at a barrier of the whole CTA, unless RING: then the chunks go round three buffers with
// mbarriers (full: the eight loading warps' copies landed; empty: all sixteen warps read it), the loading
// warps fill a buffer as soon as every warp has released it, and each warpgroup runs its MMAs and argmin
// at its own pace, so one's argmin overlaps another's MMAs.
#include "hopper_wgmma.cuh"

// Geometry mirrored in sparseattn/kernels/kmeans_assign.py (the tokens per CTA, ROWS, and RING are the
// kernel's template arguments: 128 or 256 tokens with 2 · ROWS threads).
#define KMEANS_CHUNK 128  // centroids per step
#define KMEANS_LOADERS (KMEANS_CHUNK / PAGE_ROWS)  // warps that copy a centroid chunk, a page each

namespace {

__device__ __forceinline__ uint32_t rows_mask(int rows_left) {
    return rows_left >= PAGE_ROWS ? 0xffffu : rows_left > 0 ? (1u << rows_left) - 1u : 0u;
}

template <int HEAD_DIM, int ROWS, bool RING>
struct KmeansSmem {
    static constexpr int NBUF = RING ? 3 : 2;                    // centroid chunk buffers
    static constexpr int X_BYTES = ROWS * HEAD_DIM * 2;          // the X tile
    static constexpr int C_BYTES = KMEANS_CHUNK * HEAD_DIM * 2;  // each centroid chunk
    static constexpr int CSQ_BYTES = 4 * NBUF * KMEANS_CHUNK;    // |c|² of each buffered chunk
    static constexpr int BAR_BYTES = RING ? 16 * NBUF : 0;       // full[NBUF], empty[NBUF]
    static constexpr int BYTES = 1024 + X_BYTES + C_BYTES * NBUF + CSQ_BYTES + BAR_BYTES;
    static_assert(CSQ_BYTES >= 4 * ROWS, "the |c|² buffers hold the presum's labels");
};

}  // namespace

template <int HEAD_DIM, bool ACCUMULATE, int ROWS, bool RING>
__global__ void __launch_bounds__(2 * ROWS, 256 / ROWS)
kmeans_assign_kernel(const __nv_bfloat16* __restrict__ X, const __nv_bfloat16* __restrict__ C,
                     const float* __restrict__ csq, long long* __restrict__ labels, float* __restrict__ sums,
                     float* __restrict__ counts, int tokens, int k, int presum) {
    static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "HEAD_DIM 64 or 128");
    static_assert(ROWS == 128 || ROWS == 256, "ROWS 128 or 256");
    static_assert(!RING || ROWS == 256, "the ring is built for four warpgroups");
    using S = KmeansSmem<HEAD_DIM, ROWS, RING>;
    constexpr int NBUF = S::NBUF;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const uint32_t raw = paged::smem_u32(smem_raw);
    const uint32_t xs = (raw + 1023u) & ~1023u;  // the swizzle pattern is anchored at 1024-byte boundaries
    const uint32_t cs = xs + S::X_BYTES;
    float* csq_s = reinterpret_cast<float*>(smem_raw + (cs + NBUF * S::C_BYTES - raw));
    const uint32_t bars = cs + NBUF * S::C_BYTES + S::CSQ_BYTES;  // RING: full[b] at bars + 8b, empty[b] after
    auto full = [&](int b) { return bars + 8u * static_cast<uint32_t>(b); };
    auto empty = [&](int b) { return bars + 8u * static_cast<uint32_t>(NBUF + b); };

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;  // warp w copies page w of the X tile and of every chunk (16 rows)
    const int wg = warp >> 2;   // warpgroup: tokens 64·wg .. 64·wg + 63 of the CTA
    const int wq = warp & 3;    // rows 16·wq .. 16·wq + 15 of the warpgroup's 64
    const int g = lane >> 2;
    const int t4 = lane & 3;
    const int n = blockIdx.y;
    const int row0 = blockIdx.x * ROWS;
    const __nv_bfloat16* Xn = X + static_cast<size_t>(n) * tokens * HEAD_DIM;
    const __nv_bfloat16* Cn = C + static_cast<size_t>(n) * k * HEAD_DIM;
    const float* csq_n = csq + static_cast<size_t>(n) * k;
    const int x_pages = (tokens + PAGE_ROWS - 1) / PAGE_ROWS;
    const int c_pages = (k + PAGE_ROWS - 1) / PAGE_ROWS;
    const int chunks = (k + KMEANS_CHUNK - 1) / KMEANS_CHUNK;

    if constexpr (RING) {
        if (tid == 0) {
            for (int b = 0; b < NBUF; ++b) {
                hopper::mbar_init(full(b), 32 * KMEANS_LOADERS);
                hopper::mbar_init(empty(b), 2 * ROWS / 32);
            }
        }
        __syncthreads();  // the barriers are initialised before any warp uses them
    }
    {  // the CTA's tokens
        const int page[1] = {row0 / PAGE_ROWS + warp};
        const uint32_t mask[1] = {rows_mask(tokens - page[0] * PAGE_ROWS)};
        hopper::warp_copy_pages<HEAD_DIM, ROWS, 1>(xs, PAGE_ROWS * warp, Xn, x_pages, page, mask);
    }
    auto load_chunk = [&](int c) {
        const int buf = c % NBUF;
        if (warp < KMEANS_LOADERS) {  // (with ROWS 256 the upper eight warps copy no centroids)
            const int page[1] = {c * (KMEANS_CHUNK / PAGE_ROWS) + warp};
            const uint32_t mask[1] = {rows_mask(k - page[0] * PAGE_ROWS)};
            hopper::warp_copy_pages<HEAD_DIM, KMEANS_CHUNK, 1>(cs + buf * S::C_BYTES, PAGE_ROWS * warp, Cn,
                                                               c_pages, page, mask);
        }
        if (tid < KMEANS_CHUNK) {
            const int j = c * KMEANS_CHUNK + tid;
            csq_s[buf * KMEANS_CHUNK + tid] = j < k ? csq_n[j] : INFINITY;
        }
    };
    // RING: a loading warp fills chunk c's buffer once every warp has released its previous chunk, and
    // the buffer's full barrier completes when the warp's copies (and |c|² stores) have landed.
    auto ring_load = [&](int c) {
        const int buf = c % NBUF;
        hopper::mbar_wait(empty(buf), ((c / NBUF) & 1) ^ 1);  // a fresh barrier passes its first wait
        load_chunk(c);
        hopper::mbar_track_cp_async(full(buf));
        hopper::mbar_arrive(full(buf));
    };
    if constexpr (RING) {
        paged::cp_async_commit();  // the X tile
        if (warp < KMEANS_LOADERS)
            for (int c = 0; c < NBUF - 1 && c < chunks; ++c) ring_load(c);
        paged::cp_async_wait<0>();  // the X tile's group (the ring's copies are tracked by its barriers)
        __syncthreads();            // everyone's copies of the X tile
    } else {
        load_chunk(0);
        paged::cp_async_commit();
    }

    float best[2] = {INFINITY, INFINITY};
    int best_i[2] = {0, 0};
    float s[KMEANS_CHUNK / 2];
    const uint32_t a_rows = xs + wg * 64 * 128;  // this warpgroup's 64 rows of the X tile
#pragma unroll 1
    for (int c = 0; c < chunks; ++c) {
        const int buf = c % NBUF;
        if constexpr (RING) {
            if (warp < KMEANS_LOADERS && c + NBUF - 1 < chunks) ring_load(c + NBUF - 1);
            hopper::mbar_wait(full(buf), (c / NBUF) & 1);
        } else {
            if (c + 1 < chunks) load_chunk(c + 1);  // into the buffer the previous step released
            paged::cp_async_commit();
            paged::cp_async_wait<1>();  // this thread's copies of X and of chunk c have landed
            __syncthreads();            // everyone's (and the |c|² stores)
        }
        hopper::fence_async_proxy();  // cp.async writes (generic proxy) -> wgmma reads (async proxy)
        hopper::wgmma_fence();
        hopper::issue_qk<HEAD_DIM, KMEANS_CHUNK, ROWS>(s, a_rows, cs + buf * S::C_BYTES);
        hopper::wgmma_commit();
        hopper::wgmma_wait<0>();
        const float* cq = csq_s + buf * KMEANS_CHUNK;
#pragma unroll
        for (int j = 0; j < KMEANS_CHUNK / 8; ++j) {
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
        if constexpr (RING) {
            __syncwarp();
            if (lane == 0) hopper::mbar_arrive(empty(buf));  // this warp has read chunk c's buffers
        } else {
            __syncthreads();  // chunk c's tiles are read: the next step may load chunk c + 2 into them
        }
    }
    paged::cp_async_wait<0>();
    if constexpr (RING) __syncthreads();  // every warp is past its last |c|² read (the presum reuses them)

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
        if (presum) {
            // Each cluster's tokens of this CTA summed here first, so one float4 atomic per lane goes out per
            // cluster present, not per token (the host asks for it with few clusters, whose atomics collide).
            // The token with the lowest index of a cluster (its leader) owns the sum: its warp finds the
            // members by four ballots over the CTA's labels and adds their rows from the X tile in index order.
            int* lab_s = reinterpret_cast<int*>(csq_s);  // [ROWS]; the |c|² buffers are free after the loop
            if (t4 == 0) {
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int row = 64 * wg + 16 * wq + g + 8 * r;
                    lab_s[row] = row0 + row < tokens ? best_i[r] : -1;
                }
            }
            __syncthreads();
            constexpr int WORDS = ROWS / 32;  // ballots of 32 labels that cover the CTA's tokens
            const unsigned char* x_tile = smem_raw + (xs - raw);
            int mine[WORDS];  // labels of tokens lane, 32 + lane, 64 + lane, ...: ballot w is member word w
#pragma unroll
            for (int w = 0; w < WORDS; ++w) mine[w] = lab_s[32 * w + lane];
            const uint32_t col_byte = static_cast<uint32_t>(PER_LANE * 2 * lane);  // this lane's first column, bytes
#pragma unroll 1
            for (int i = 0; i < PAGE_ROWS; ++i) {
                const int row = 16 * warp + i;
                const int label = lab_s[row];
                if (label < 0) continue;  // past `tokens` (warp-uniform)
                uint32_t member[WORDS];  // bit b of word w: token 32·w + b has this label
#pragma unroll
                for (int w = 0; w < WORDS; ++w) member[w] = __ballot_sync(0xffffffffu, mine[w] == label);
                int first = -1;  // the lowest member (the row itself is one)
#pragma unroll
                for (int w = WORDS - 1; w >= 0; --w)
                    if (member[w]) first = 32 * w + __ffs(member[w]) - 1;
                if (first != row) continue;  // an earlier token leads this cluster
                float acc[PER_LANE];
#pragma unroll
                for (int e = 0; e < PER_LANE; ++e) acc[e] = 0.f;
                int size = 0;
#pragma unroll
                for (int w = 0; w < WORDS; ++w) {
                    uint32_t bits = member[w];
                    size += __popc(bits);
                    while (bits) {
                        const int j = 32 * w + __ffs(bits) - 1;
                        bits &= bits - 1u;
                        const uint32_t off = hopper::tile_offset<ROWS>(j, col_byte >> 4) + (col_byte & 15u);
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
