"""compute-sanitizer memcheck / racecheck target (lab script, GPU): the token-order forward and backward builds
on static graphs with permuted token orders and on device plans of a VSA top-k; the tile-major token build
(k and v by TMA) on tile-major video layouts with partial tiles, static graphs and device plans.

    PYTORCH_CUDA_ALLOC_CONF= compute-sanitizer --tool memcheck --error-exitcode 9 \
        python data/bench/experiments/token_memcheck.py

(torch's expandable segments call cuMemCreate, which the sanitizer refuses: leave them off.)
"""

import dataclasses
import sys

import numpy as np
import torch

sys.path.insert(0, "tests")
from small_cases import random_ragged_graph

import sparseattn.torch as st
from sparseattn.graph import SparseGraph
from sparseattn.kernels.forward import torch_token_forward
from sparseattn.layouts import video_layout
from sparseattn.torch_ops import _slot_indices

dev = torch.device("cuda")
rng = np.random.default_rng(1)
for seed in range(3):
    base = random_ragged_graph(rng)
    ql = dataclasses.replace(base.q, token_slot=rng.permutation(base.q.token_slot))
    kl = dataclasses.replace(base.k, token_slot=rng.permutation(base.k.token_slot))
    g = SparseGraph.from_block_mask(ql, kl, base.block_mask())
    for d in (64, 128):
        q = torch.randn(2, ql.num_tokens, g.heads, d, device=dev).bfloat16()
        k = torch.randn(2, kl.num_tokens, g.heads, d, device=dev).bfloat16()
        for route in ("auto", 0, 1):
            torch_token_forward(q, k, k, g, _slot_indices(ql, dev)[0], _slot_indices(kl, dev)[0], route=route)
lay = video_layout((6, 10, 12), (2, 4, 4), 64)
q = torch.randn(2, lay.num_tokens, 3, 128, device=dev).bfloat16()
with torch.no_grad():
    idx, num = st.vsa_topk_tokens(q, q, lay, 5)
    st.token_order_attention(q, q, q, st.planner_for(lay), idx, num)
torch.cuda.synchronize()
print("token-order memcheck target done")

# the backward's token-order build (static graph and device plans)
from sparseattn.kernels.backward import torch_token_backward
from sparseattn.kernels.forward import torch_token_forward as fwd

for seed in range(2):
    base = random_ragged_graph(rng)
    ql = dataclasses.replace(base.q, token_slot=rng.permutation(base.q.token_slot))
    kl = dataclasses.replace(base.k, token_slot=rng.permutation(base.k.token_slot))
    g = SparseGraph.from_block_mask(ql, kl, base.block_mask())
    q = torch.randn(2, ql.num_tokens, g.heads, 128, device=dev).bfloat16()
    k = torch.randn(2, kl.num_tokens, g.heads, 128, device=dev).bfloat16()
    qm, km = _slot_indices(ql, dev)[0], _slot_indices(kl, dev)[0]
    o, lse = fwd(q, k, k, g, qm, km)
    assert torch_token_backward(q, k, k, o, lse, torch.randn_like(q), g, qm, km) is not None
p = st.planner_for(lay)
q = torch.randn(2, lay.num_tokens, 3, 128, device=dev).bfloat16()
idx, num = st.vsa_topk_tokens(q, q, lay, 5)
plans = p.plan(idx, num)
m = _slot_indices(lay, dev)[0]
o, lse = fwd(q, q, q, plans, m, m)
assert torch_token_backward(q, q, q, o, lse, torch.randn_like(q), plans, m, m) is not None
torch.cuda.synchronize()
print("token-order backward memcheck target done")

# the tile-major token build: static graphs (every route) and device plans over tile-major video layouts
from sparseattn.layouts import tile_major_tokens

for grid, tile, block in (((5, 7, 9), (2, 4, 4), 64), ((6, 10, 13), (4, 4, 8), 128)):
    tl = tile_major_tokens(video_layout(grid, tile, block))
    mask = rng.random((2, tl.num_blocks, tl.num_blocks)) < 0.4
    g = SparseGraph.from_block_mask(tl, tl, mask)
    m = _slot_indices(tl, dev)[0]
    for d in (64, 128):
        q = torch.randn(2, tl.num_tokens, 2, d, device=dev).bfloat16()
        for route in ("auto", 0, 1):
            fwd(q, q, q, g, m, m, route=route, kv_tma=True)
    plans = st.planner_for(tl).plan(mask=torch.as_tensor(mask[None].repeat(2, 0), device=dev), backward=False)
    fwd(q, q, q, plans, m, m, kv_tma=True)
torch.cuda.synchronize()
print("tile-major token build memcheck target done")
