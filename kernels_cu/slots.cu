// Tokens <-> slots: a model's [batch, tokens, heads, d] activations into a layout's slot order
// [batch, heads, slots, d] (padding slots zero) and back, for up to three tensors in one launch.
// Each thread moves 16 bytes (8 bf16); d is a multiple of 8.
//
// NVRTC-compatible: no host headers.

// y_i[b, h, s, :] = x_i[b, slot_token[s], h, :], or 0 where slot_token[s] < 0 (padding).
// One thread per 16-byte chunk of y, in y's order (coalesced stores, 16-byte loads of whole rows).
extern "C" __global__ void slots_from_tokens(const uint4* __restrict__ x0, const uint4* __restrict__ x1,
                                             const uint4* __restrict__ x2, uint4* __restrict__ y0,
                                             uint4* __restrict__ y1, uint4* __restrict__ y2, int tensors,
                                             const int* __restrict__ slot_token, int batch, int tokens, int heads,
                                             int slots, int chunks) {
    const long long t = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (t >= static_cast<long long>(batch) * heads * slots * chunks) return;
    const int c = static_cast<int>(t % chunks);
    const long long row = t / chunks;  // (b, h, s)
    const int s = static_cast<int>(row % slots);
    const long long bh = row / slots;
    const int h = static_cast<int>(bh % heads);
    const int b = static_cast<int>(bh / heads);
    const int tok = slot_token[s];
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    const long long src = ((static_cast<long long>(b) * tokens + tok) * heads + h) * chunks + c;
    y0[t] = tok >= 0 ? x0[src] : zero;
    if (tensors > 1) y1[t] = tok >= 0 ? x1[src] : zero;
    if (tensors > 2) y2[t] = tok >= 0 ? x2[src] : zero;
}

// x_i[b, t, h, :] = y_i[b, h, token_slot[t], :]. One thread per 16-byte chunk of x, in x's order.
extern "C" __global__ void tokens_from_slots(const uint4* __restrict__ y0, const uint4* __restrict__ y1,
                                             const uint4* __restrict__ y2, uint4* __restrict__ x0,
                                             uint4* __restrict__ x1, uint4* __restrict__ x2, int tensors,
                                             const int* __restrict__ token_slot, int batch, int tokens, int heads,
                                             int slots, int chunks) {
    const long long t = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (t >= static_cast<long long>(batch) * tokens * heads * chunks) return;
    const int c = static_cast<int>(t % chunks);
    const long long row = t / chunks;  // (b, token, h)
    const int h = static_cast<int>(row % heads);
    const long long bt = row / heads;
    const int tok = static_cast<int>(bt % tokens);
    const int b = static_cast<int>(bt / tokens);
    const long long src = ((static_cast<long long>(b) * heads + h) * slots + token_slot[tok]) * chunks + c;
    x0[t] = y0[src];
    if (tensors > 1) x1[t] = y1[src];
    if (tensors > 2) x2[t] = y2[src];
}
