// Tokens <-> slots: a model's [batch, tokens, heads, d] activations into a layout's slot order
// [batch, heads, slots, d] (padding slots zero) and back, for up to three tensors in one launch.
// Each thread moves 16 bytes (8 bf16) of each tensor; d is a multiple of 8.
// Grid: x over one (batch, head) matrix's (slots_from_tokens) or one batch entry's (tokens_from_slots)
// 16-byte chunks, y over the (batch, head) pairs or the batch entries (strided when there are more than
// the grid holds), so a thread's index arithmetic is 32-bit.
//
// NVRTC-compatible: no host headers.

// y_i[b, h, s, :] = x_i[b, slot_token[s], h, :], or 0 where slot_token[s] < 0 (padding).
// One thread per 16-byte chunk of y, in y's order (coalesced stores, 16-byte loads of whole rows).
extern "C" __global__ void slots_from_tokens(const uint4* __restrict__ x0, const uint4* __restrict__ x1,
                                             const uint4* __restrict__ x2, uint4* __restrict__ y0,
                                             uint4* __restrict__ y1, uint4* __restrict__ y2, int tensors,
                                             const int* __restrict__ slot_token, int batch, int tokens, int heads,
                                             int slots, int chunks) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;  // chunk of one (b, h) matrix: < slots · chunks
    if (t >= slots * chunks) return;
    const int s = t / chunks;
    const int c = t - s * chunks;
    const int tok = slot_token[s];
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    for (int bh = blockIdx.y; bh < batch * heads; bh += gridDim.y) {
        const int b = bh / heads;
        const int h = bh - b * heads;
        const long long dst = (static_cast<long long>(bh) * slots + s) * chunks + c;
        const long long src = ((static_cast<long long>(b) * tokens + tok) * heads + h) * chunks + c;
        y0[dst] = tok >= 0 ? x0[src] : zero;
        if (tensors > 1) y1[dst] = tok >= 0 ? x1[src] : zero;
        if (tensors > 2) y2[dst] = tok >= 0 ? x2[src] : zero;
    }
}

// x_i[b, t, h, :] = y_i[b, h, token_slot[t], :]. One thread per 16-byte chunk of x, in x's order.
extern "C" __global__ void tokens_from_slots(const uint4* __restrict__ y0, const uint4* __restrict__ y1,
                                             const uint4* __restrict__ y2, uint4* __restrict__ x0,
                                             uint4* __restrict__ x1, uint4* __restrict__ x2, int tensors,
                                             const int* __restrict__ token_slot, int batch, int tokens, int heads,
                                             int slots, int chunks) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;  // chunk of one batch entry: < tokens · heads · chunks
    if (t >= tokens * heads * chunks) return;
    const int row = t / chunks;  // (token, h)
    const int c = t - row * chunks;
    const int tok = row / heads;
    const int h = row - tok * heads;
    const int slot = token_slot[tok];
    for (int b = blockIdx.y; b < batch; b += gridDim.y) {
        const long long dst = static_cast<long long>(b) * tokens * heads * chunks + t;
        const long long src = ((static_cast<long long>(b) * heads + h) * slots + slot) * chunks + c;
        x0[dst] = y0[src];
        if (tensors > 1) x1[dst] = y1[src];
        if (tensors > 2) x2[dst] = y2[src];
    }
}
