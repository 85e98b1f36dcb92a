"""KPage and BSA backward on the graph's K/V-owned plan.

:func:`kpage_backward` runs the K/V-owned KPage plan (``kpage_plan(graph, owner="kv")``: each CTA owns
the live 16-row pages of a K/V block, routed to a 64- or 128-row tile, and streams the live Q pages of
every Q block that selects it, packed across blocks), :func:`paged_backward` either plan. The kernel is
the K/V-owned backward of :mod:`.bsa_backward` (``mma.sync``; dK/dV accumulated by the owning CTA, dQ by
fp32 atomics); a wgmma backward on the forward's skeleton is the next step.

Inputs are CuPy arrays or torch CUDA tensors (bf16 ``q, k, v, o, do``, float32 ``lse``; torch tensors
come back, computed on torch's current stream without copies).
"""

from __future__ import annotations

from ..graph import HeadStack, SparseGraph
from ..plans import TilePlan, bsa_plan, kpage_plan, kpage_route_of_block
from . import launch
from .bsa_backward import bsa_backward
from .forward import _cached
from .plan_cache import check_graph_matches
from .validate import KernelTypeError, KernelValueError

KINDS = ("kpage", "bsa")


def kv_plan_of(graph: SparseGraph, kind: str = "kpage", route="auto") -> TilePlan:
    """The graph's K/V-owned ``"kpage"`` or ``"bsa"`` plan, built once per graph."""

    def build():
        if kind == "kpage":
            kpage_route_of_block(graph.k.live_pages[:0], route)  # validates `route`
            return kpage_plan(graph, route=route, owner="kv")
        return bsa_plan(graph, owner="kv")

    return _cached(graph, ("kv plan", kind, route), build)


def paged_backward(
    q, k, v, o, lse, do, graph_or_plan, scale=None, out=None, *, kind: str = "kpage", route="auto"
):
    """Gradients ``(dq, dk, dv)`` of sparse attention for the loss ``Σ do · o``.

    Args:
        q, k, v: the forward's inputs; o, lse: its outputs; do: the gradient of ``o`` (bf16 like ``o``).
        graph_or_plan: a :class:`SparseGraph` (its ``kind`` plan, owner ``"kv"``) or an owner-``"kv"``
            :class:`TilePlan`.
        scale, out: as :func:`sparseattn.kernels.bsa_backward.bsa_backward`.
    """
    if kind not in KINDS:
        raise KernelValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if isinstance(graph_or_plan, HeadStack) or (isinstance(graph_or_plan, (list, tuple)) and graph_or_plan):
        raise KernelValueError(
            "graph_or_plan: heads with their own layouts (a HeadStack) have no backward yet"
        )
    plan = graph_or_plan
    if isinstance(graph_or_plan, SparseGraph):
        qs, ks = getattr(q, "shape", ()), getattr(k, "shape", ())
        if len(qs) == 4 and len(ks) == 4:  # other shapes: the kernel wrapper names the argument
            check_graph_matches(graph_or_plan, int(qs[1]), int(qs[2]), int(ks[2]))
        plan = kv_plan_of(graph_or_plan, kind, route)
    elif not isinstance(graph_or_plan, TilePlan):
        raise KernelTypeError(
            f"graph_or_plan must be a SparseGraph or a TilePlan, got {type(graph_or_plan).__name__}"
        )
    if launch.is_torch_tensor(q):
        return _torch_backward(q, k, v, o, lse, do, plan, scale, out)
    return bsa_backward(q, k, v, o, lse, do, plan, scale=scale, out=out)


def _torch_backward(q, k, v, o, lse, do, plan, scale, out):
    import torch

    names = ("q", "k", "v", "o", "lse", "do")
    tensors = (q, k, v, o, lse, do)
    for name, x in zip(names, tensors):
        if not launch.is_torch_tensor(x):
            raise KernelTypeError(f"{name} must be a torch tensor like q, got {type(x).__name__}")
    if out is None:
        out = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    elif (
        not isinstance(out, (tuple, list)) or len(out) != 3 or not all(launch.is_torch_tensor(x) for x in out)
    ):
        raise KernelTypeError("out must be a tuple (dq, dk, dv) of torch tensors")
    views = [launch.torch_to_cupy(n, x) for n, x in zip(names, tensors)]
    out_views = tuple(launch.torch_to_cupy(f"out[{i}]", x) for i, x in enumerate(out))
    with launch.torch_stream():
        bsa_backward(*views, plan, scale=scale, out=out_views)
    return tuple(out)


def kpage_backward(q, k, v, o, lse, do, graph_or_plan, route="auto", scale=None, out=None):
    """KPage backward (K/V-owned KPage plan); arguments and results as :func:`paged_backward`."""
    return paged_backward(q, k, v, o, lse, do, graph_or_plan, scale, out, kind="kpage", route=route)
