"""Host time per call of the KPage entry points (``python -m sparseattn.host_cost``).

A loop of calls on a tiny graph (batch 1, 2 heads, 256 slots of 128 dims: the GPU work is a few
microseconds, so the loop measures the Python and driver work of a call), wall time per call after a
warm-up, the median of ``--reps`` loops of ``--calls`` calls. The loop is not synchronised inside; its
``synced_us`` (the same loop ended by a device synchronisation) says whether the GPU kept up (when it did
not, the launch queue fills and the host time is the GPU's).

Records (bench format, ``--out``): ``impl`` ``torch`` (:mod:`sparseattn.torch`'s entry points, autograd
included: the ``torch.library`` operators, or for an eager differentiated KPage call the same
implementations behind a plain ``autograd.Function``; the runs up to
``experiments/host_cost_h200_20261202_1940dad`` called this ``torch_op`` and took the operator throughout) or ``cupy`` (:func:`~sparseattn.kernels.forward.kpage_forward`
and :func:`~sparseattn.kernels.backward.kpage_backward` on CuPy arrays) or ``torch_tokens``
(:func:`sparseattn.torch.token_order_attention` on token-ordered tensors: the forward's token-order build,
and both passes in token order for the forward + backward); ``pass`` ``host_fwd`` or
``host_fwdbwd``; ``workload`` ``host_static`` (a cached :class:`~sparseattn.graph.SparseGraph`) or
``host_dynamic`` (a top-k selection planned on the device each call: torch only); ``time_us``. The floor
of the same machine, workload ``host_floor``: torch's own SDPA at the same sizes (impl ``torch_sdpa``)
and a Python ``torch.library`` operator that only allocates its output (``torch_noop_op``). Workload
``host_graph``: the ``torch`` forward and forward + backward captured once in a CUDA graph, the host time
of a replay (what a model step captured in a graph pays per call; no target: a replay is not a call
through the operator). Where the
time goes, workload ``host_layers``: the operators called directly (``torch_op_direct``, no autograd),
their implementations (``torch_impl``), forward and backward (pass ``host_bwd``) apart, the operator with
its autograd (``torch_op_autograd``, what ``torch.compile`` and CUDA graphs run) and the same
implementations behind a plain ``autograd.Function`` (``torch_function``).
``--profile DIR`` also writes a cProfile of each loop.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np

#: Targets per call (µs): the forward, and forward + backward, through the torch op.
TARGET_US = {"host_fwd": 20.0, "host_fwdbwd": 50.0}


def tiny_problem():
    """``(graph, layout, q2k_idx, q2k_num)``: 2 heads over a 4 x 4 x 16 token grid in 4 x 4 x 4 tiles (4 blocks
    of 64), each Q block selecting itself and the next block."""
    import torch

    from .graph import SparseGraph
    from .layouts import video_layout

    layout = video_layout((4, 4, 16), (4, 4, 4), 64)
    nb = layout.num_blocks
    mask = np.zeros((2, nb, nb), dtype=bool)
    for i in range(nb):
        mask[:, i, [i, (i + 1) % nb]] = True
    graph = SparseGraph.from_block_mask(layout, layout, mask, name="host cost")
    idx = torch.tensor([[i, (i + 1) % nb] for i in range(nb)], dtype=torch.int32, device="cuda")
    idx = idx.expand(1, 2, nb, 2).contiguous()
    num = torch.full((1, 2, nb), 2, dtype=torch.int32, device="cuda")
    return graph, layout, idx, num


def _noop_operator():
    """A ``torch.library`` operator with a Python CUDA implementation that only allocates its output, and
    an autograd formula that only allocates the gradient: the floor of any Python operator's host time."""
    import torch

    name = "sparseattn_probe::noop"
    if not hasattr(torch.ops, "sparseattn_probe") or not hasattr(torch.ops.sparseattn_probe, "noop"):
        lib = _noop_operator.lib = torch.library.Library("sparseattn_probe", "DEF")
        lib.define("noop(Tensor q) -> Tensor")
        torch.library.impl(name, ("CPU", "CUDA"), lambda q: torch.empty_like(q), lib=lib)
        torch.library.register_fake(name, lambda q: torch.empty_like(q), lib=lib)
        torch.library.register_autograd(
            name,
            lambda ctx, grad: torch.empty_like(grad),
            setup_context=lambda ctx, inputs, output: None,
            lib=lib,
        )
    return torch.ops.sparseattn_probe.noop


def _loop(call, calls: int, reps: int, warmup: int, profile: Path | None, label: str) -> dict:
    import torch

    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    host, synced = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) / calls * 1e6)
        synced.append((t2 - t0) / calls * 1e6)
    if profile is not None:
        profile.mkdir(parents=True, exist_ok=True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            call()
        prof.disable()
        torch.cuda.synchronize()
        with open(profile / f"{label}.txt", "w") as f:
            pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(40)
    return dict(time_us=statistics.median(host), synced_us=statistics.median(synced), calls=calls, reps=reps)


def _captured(step, grads=()):
    """A callable replaying ``step`` captured in a CUDA graph (warmed up on a side stream first, as
    ``torch.cuda.graph`` asks; ``grads``' tensors get their ``.grad`` made inside the capture, so each
    replay rewrites them instead of accumulating), or one raising the capture's error when it fails (the
    loop records it)."""

    def reset_grads():
        for x in grads:
            x.grad = None

    try:
        from .torch import capture_cuda_graph

        captured, _ = capture_cuda_graph(step, warmup=3, before_capture=reset_grads)
    except Exception as exc:  # noqa: BLE001 - the record says why; the other cases still run
        error = RuntimeError(f"capture failed: {type(exc).__name__}: {exc}")

        def failed():
            raise error

        return failed
    return captured.replay


def measure(calls: int = 200, reps: int = 7, warmup: int = 50, profile: Path | None = None) -> list[dict]:
    import cupy
    import torch

    import sparseattn.torch as st

    from .kernels import launch
    from .kernels.backward import kpage_backward
    from .kernels.forward import kpage_forward

    graph, layout, idx, num = tiny_problem()
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (1, 2, layout.num_slots, 128)
    q, k, v, do = (torch.randn(shape, device="cuda", generator=g).bfloat16() for _ in range(4))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    qc, kc, vc, doc = (cupy.from_dlpack(x.view(torch.int16)).view(cupy.uint16) for x in (q, k, v, do))

    def torch_fwd():
        with torch.no_grad():
            st.kpage_attention(q, k, v, graph)

    def torch_fwdbwd():
        st.kpage_attention(qg, kg, vg, graph).backward(do)

    def cupy_fwd():
        kpage_forward(qc, kc, vc, graph)

    def cupy_fwdbwd():
        o, lse = kpage_forward(qc, kc, vc, graph)
        kpage_backward(qc, kc, vc, o, lse, doc, graph)

    def dynamic_fwd():
        with torch.no_grad():
            st.block_sparse_attention(q, k, v, layout, idx, num)

    def dynamic_fwdbwd():
        st.block_sparse_attention(qg, kg, vg, layout, idx, num)[0].backward(do)

    # the token-order builds on [1, tokens, heads, d] tensors (token_order_attention)
    qt, kt, vt, dot = (
        torch.randn(1, layout.num_tokens, 2, 128, device="cuda", generator=g).bfloat16() for _ in range(4)
    )
    qtg, ktg, vtg = (x.clone().requires_grad_() for x in (qt, kt, vt))

    def tokens_fwd():
        with torch.no_grad():
            st.token_order_attention(qt, kt, vt, graph)

    def tokens_fwdbwd():  # both passes in token order (what SPARSEATTN_TOKEN_BACKWARD=1 selects)
        st._TokenOrderFunction.apply(qtg, ktg, vtg, graph, None, None, None, "auto", None).backward(dot)

    noop = _noop_operator()

    def sdpa_fwd():
        with torch.no_grad():
            torch.nn.functional.scaled_dot_product_attention(q, k, v)

    def sdpa_fwdbwd():
        torch.nn.functional.scaled_dot_product_attention(qg, kg, vg).backward(do)

    def noop_fwd():
        with torch.no_grad():
            noop(q)

    def noop_fwdbwd():
        noop(qg).backward(do)

    # the layers of one torch forward / backward, each timed alone (where the host time goes)
    from .kernels.forward import torch_graph_forward
    from .torch_ops import OPS, handle

    h, scale = handle(graph), 128**-0.5
    o, lse = torch_graph_forward(q, k, v, graph)

    from .torch_ops import KPageFunction

    def function_fwd():
        with torch.no_grad():
            KPageFunction.apply(q, k, v, h, "auto", scale, False)

    def function_fwdbwd():
        KPageFunction.apply(qg, kg, vg, h, "auto", scale, False).backward(do)

    def op_fwd():
        with torch.no_grad():
            OPS.kpage_fwd.default(q, k, v, h, "auto", scale, False)

    def impl_fwd():
        torch_graph_forward(q, k, v, graph, "auto", scale)

    def op_fwdbwd():
        OPS.kpage_fwd.default(qg, kg, vg, h, "auto", scale, False)[0].backward(do)

    def op_bwd():
        OPS.kpage_bwd.default(q, k, v, o, lse, do, h, "auto", scale, False)

    def impl_bwd():
        kpage_backward(q, k, v, o, lse, do, graph, scale=scale)

    graph_fwd = _captured(lambda: torch_fwd())
    graph_fwdbwd = _captured(lambda: torch_fwdbwd(), grads=(qg, kg, vg))

    cases = [
        ("host_floor", "torch_sdpa", "host_fwd", sdpa_fwd),
        ("host_floor", "torch_sdpa", "host_fwdbwd", sdpa_fwdbwd),
        ("host_floor", "torch_noop_op", "host_fwd", noop_fwd),
        ("host_floor", "torch_noop_op", "host_fwdbwd", noop_fwdbwd),
        ("host_static", "torch", "host_fwd", torch_fwd),
        ("host_static", "torch", "host_fwdbwd", torch_fwdbwd),
        ("host_static", "torch_tokens", "host_fwd", tokens_fwd),
        ("host_static", "torch_tokens", "host_fwdbwd", tokens_fwdbwd),
        ("host_static", "cupy", "host_fwd", cupy_fwd),
        ("host_static", "cupy", "host_fwdbwd", cupy_fwdbwd),
        ("host_layers", "torch_function", "host_fwd", function_fwd),
        ("host_layers", "torch_function", "host_fwdbwd", function_fwdbwd),
        ("host_layers", "torch_op_autograd", "host_fwdbwd", op_fwdbwd),
        ("host_layers", "torch_op_direct", "host_fwd", op_fwd),
        ("host_layers", "torch_impl", "host_fwd", impl_fwd),
        ("host_layers", "torch_op_direct", "host_bwd", op_bwd),
        ("host_layers", "torch_impl", "host_bwd", impl_bwd),
        ("host_dynamic", "torch", "host_fwd", dynamic_fwd),
        ("host_dynamic", "torch", "host_fwdbwd", dynamic_fwdbwd),
        ("host_graph", "torch", "host_fwd", graph_fwd),
        ("host_graph", "torch", "host_fwdbwd", graph_fwdbwd),
    ]
    records = []
    with launch.torch_stream():  # CuPy's calls on torch's stream, like the op's
        for workload, impl, pass_, call in cases:
            label = f"{workload}_{impl}_{pass_}"
            print(f"  {label} ...", file=sys.stderr, flush=True)
            try:
                rec = _loop(call, calls, reps, warmup, profile, label)
            except Exception as e:  # noqa: BLE001 - recorded, the other cases still run
                rec = dict(error=f"{type(e).__name__}: {e}")
            target = TARGET_US[pass_] if workload == "host_static" else None
            records.append(
                dict(
                    workload=workload,
                    impl=impl,
                    pass_=pass_,
                    **rec,
                    target_us=target,
                    tokens=layout.num_tokens,
                    heads=2,
                    head_dim=128,
                )
            )
    for r in records:
        r["pass"] = r.pop("pass_")
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sparseattn.host_cost", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--profile", type=Path, default=None, help="write a cProfile of every loop here")
    parser.add_argument("--out", default=None, help="JSON path (default data/bench/host_cost_<date>.json)")
    args = parser.parse_args(argv)
    from .bench import run_path, write_run

    records = measure(args.calls, args.reps, args.warmup, args.profile)
    out = write_run(run_path(args.out, "host_cost"), "python -m sparseattn.host_cost", argv, records)
    print(f"{'workload':<13} {'impl':<9} {'pass':<12} {'host µs':>8} {'synced µs':>9} {'target':>7}")
    for r in records:
        if "error" in r:
            print(f"{r['workload']:<13} {r['impl']:<9} {r['pass']:<12} {r['error']}")
            continue
        target = "" if r["target_us"] is None else f"{r['target_us']:.0f}"
        print(
            f"{r['workload']:<13} {r['impl']:<9} {r['pass']:<12} {r['time_us']:8.1f} {r['synced_us']:9.1f} {target:>7}"
        )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
