"""One launch of the forward's slot-order, token-order or Q/O token build on the same plan, for ncu (lab
script, GPU, torch).

The workload and token order as in ``token_order_ab.py``; three warm-up calls, then one call between
``cudaProfilerStart`` / ``Stop``, so that ``ncu --profile-from-start off`` profiles that launch alone
(tensors already in the order each build reads: no move is profiled).

.. code-block:: text

    ncu --clock-control none --profile-from-start off --set full -o tokens \\
        python data/bench/experiments/ncu_token_order.py tokens wan13b_sta_480p tiles
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import token_order_ab

import sparseattn.torch as st
from sparseattn.kernels.forward import torch_graph_forward, torch_token_forward
from sparseattn.torch_ops import _slot_indices


def main(build: str, workload: str, order: str) -> None:
    graph, head_dim = token_order_ab.workload_graph(workload, order)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    shape = lambda lay: (1, lay.num_tokens, graph.heads, head_dim)
    q = torch.randn(shape(graph.q), device=dev, generator=g).bfloat16()
    k, v = (torch.randn(shape(graph.k), device=dev, generator=g).bfloat16() for _ in range(2))
    q_map, k_map = _slot_indices(graph.q, dev)[0], _slot_indices(graph.k, dev)[0]
    qs = st.tokens_to_slots(graph.q, q)[0]
    ks, vs = st.tokens_to_slots(graph.k, k, v)
    calls = {
        "slot": lambda: torch_graph_forward(qs, ks, vs, graph),
        "tokens": lambda: torch_token_forward(q, k, v, graph, q_map, k_map),
        "qo": lambda: torch_token_forward(q, ks, vs, graph, q_map, None, kv_in_slots=True),
    }
    call = calls[build]
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled", build, workload, order)


if __name__ == "__main__":
    main(*sys.argv[1:4])
