"""KPage and BSA backward on the graph's K/V-owned plan.

:func:`kpage_backward` runs the K/V-owned KPage plan (``kpage_plan(graph, owner="kv")``: each CTA owns
the live 16-row pages of a K/V block, routed to a 64- or 128-row tile, and streams the live Q pages of
every Q block that selects it, packed across blocks), :func:`bsa_backward` the K/V-owned logical-block
BSA plan (``bsa_plan(graph, owner="kv")``), :func:`paged_backward` either plan; both take a
:class:`~sparseattn.graph.HeadStack` (per-head layouts) as the forwards do. The kernel is
the K/V-owned backward of :mod:`.bsa_backward` (dK/dV accumulated by the owning CTA, dQ by fp32 atomics
or bulk reductions, or by 64-bit fixed-point integer atomics with ``deterministic=True``), on wgmma
(``kernels_cu/paged_bwd.cu``) by default or on ``mma.sync`` (``impl="mma"``).

Inputs are CuPy arrays or torch CUDA tensors (bf16 ``q, k, v, o, do``, float32 ``lse``; torch tensors
come back, computed on torch's current stream without copies).
"""

from __future__ import annotations

import os

import numpy as np

from ..constants import PAGE_ROWS
from ..graph import HeadStack, SparseGraph
from ..planning.cache import cached, check_graph_matches, plan_of
from ..planning.device import DevicePlans
from ..planning.layout_pairs import backward_pairs_pay
from ..planning.tile_plan import TilePlan, stack_head_plans
from . import launch
from .bsa_backward import plan_backward, torch_plan_backward, uses_dq_pass
from .validate import KernelTypeError, KernelValueError

KINDS = ("kpage", "bsa")


#: The routes a KPage backward of a graph takes (:func:`paged_backward`).
BACKWARD_ROUTES = ("auto", 0, 1, "pair")


def paged_backward(
    q,
    k,
    v,
    o,
    lse,
    do,
    graph_or_plan,
    scale=None,
    out=None,
    *,
    kind: str = "kpage",
    route="auto",
    impl=None,
    deterministic=False,
):
    """Gradients ``(dq, dk, dv)`` of sparse attention for the loss ``Σ do · o``.

    Args:
        q, k, v: the forward's inputs; o, lse: its outputs; do: the gradient of ``o`` (bf16 like ``o``).
        graph_or_plan: a :class:`SparseGraph` (its ``kind`` plan, owner ``"kv"``), an owner-``"kv"``
            :class:`TilePlan`, a :class:`HeadStack` (or list of per-head graphs: SVG2's per-head
            layouts; one launch per route on the stacked per-head plans), or the
            :class:`~sparseattn.planning.device.DevicePlans` of a selection on the GPU (its kind and
            route are the planner's).
        route: KPage's routes (``"auto"``, 0, 1), or ``"pair"``: 64-row K/V blocks joined two by two into
            128-row pair items (:mod:`sparseattn.planning.pair_backward`; per head on a HeadStack,
            the default ``impl`` without ``deterministic``). ``"auto"`` takes pair items where
            :func:`backward_route` says so (64-row K/V blocks, the default kernel).
        scale, out, impl, deterministic: as :func:`sparseattn.kernels.bsa_backward.plan_backward`
            (``impl``: ``"wgmma"`` (default), another wgmma variant or the ``"mma"`` main kernel;
            ``deterministic``: dQ bit-identical from run to run, by the Q-owned dQ pass or fixed-point
            integer atomics).
    """
    if kind not in KINDS:
        raise KernelValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if route not in BACKWARD_ROUTES:
        raise KernelValueError(
            f"route must be one of {BACKWARD_ROUTES} for the backward, got {route!r}"
            + (" ('packed' is a forward route)" if route == "packed" else "")
        )
    if isinstance(graph_or_plan, DevicePlans):
        if graph_or_plan.backward is None:
            raise KernelValueError("graph_or_plan: these device plans were made without the backward")
        if launch.is_torch_tensor(q):
            return _torch_backward(
                q, k, v, o, lse, do, graph_or_plan, scale, out, impl=impl, deterministic=deterministic
            )
        return _device_plans_backward(q, k, v, o, lse, do, graph_or_plan, scale, out, impl, deterministic)
    if isinstance(graph_or_plan, HeadStack) or (isinstance(graph_or_plan, (list, tuple)) and graph_or_plan):
        stack = HeadStack.of(graph_or_plan)
        route = backward_route(stack, kind, route, impl, deterministic)
        if launch.is_torch_tensor(q):
            return _torch_backward(q, k, v, o, lse, do, stack, scale, out, kind, route, impl, deterministic)
        return _head_stack_backward(q, k, v, o, lse, do, stack, scale, out, kind, route, impl, deterministic)
    plan, dq_plan = graph_or_plan, None
    if isinstance(graph_or_plan, SparseGraph):
        qs, ks = getattr(q, "shape", ()), getattr(k, "shape", ())
        if len(qs) == 4 and len(ks) == 4:  # other shapes: the kernel wrapper names the argument
            check_graph_matches(graph_or_plan, int(qs[1]), int(qs[2]), int(ks[2]))
        route = backward_route(graph_or_plan, kind, route, impl, deterministic)
        plan = plan_of(graph_or_plan, kind, route, owner="kv")
        if uses_dq_pass(impl, plan):
            dq_plan = plan_of(graph_or_plan, kind, _q_owned_route(route), owner="q")
    elif not isinstance(graph_or_plan, TilePlan):
        raise KernelTypeError(
            f"graph_or_plan must be a SparseGraph or a TilePlan, got {type(graph_or_plan).__name__}"
        )
    if launch.is_torch_tensor(q):
        return _torch_backward(
            q, k, v, o, lse, do, plan, scale, out, kind, route, impl, deterministic, dq_plan
        )
    return plan_backward(
        q,
        k,
        v,
        o,
        lse,
        do,
        plan,
        scale=scale,
        out=out,
        impl=impl,
        deterministic=deterministic,
        dq_plan=dq_plan,
    )


def _device_plans_backward(q, k, v, o, lse, do, plans: DevicePlans, scale, out, impl, deterministic):
    """The backward of a device planner's plans: ``[batch, heads, ...]`` tensors run as one batch of
    ``batch · heads`` heads, each with its own selection."""
    for name, x in (("q", q), ("k", k), ("v", v), ("o", o), ("do", do)):
        if getattr(x, "ndim", 0) != 4:
            raise KernelValueError(
                f"{name} must be [batch, heads, slots, d], got shape {getattr(x, 'shape', None)}"
            )
    b, h, sq, _ = q.shape
    if (b, h) != (plans.batch, plans.heads):
        raise KernelValueError(
            f"the plans were made for batch {plans.batch} x {plans.heads} heads, q has {b} x {h}"
        )
    if (sq, k.shape[2]) != (plans.q_slots, plans.k_slots):
        raise KernelValueError(
            f"the plans' layouts have {plans.q_slots} Q / {plans.k_slots} K slots, q has {sq} and k {k.shape[2]}"
        )
    if out is None:
        import cupy

        with cupy.cuda.Device(q.device.id):
            out = (cupy.empty_like(q), cupy.empty_like(k), cupy.empty_like(v))
    elif not isinstance(out, (tuple, list)) or len(out) != 3:
        raise KernelTypeError("out must be a tuple (dq, dk, dv) of preallocated arrays")

    def one(x):  # [batch, heads, slots, ...] as one batch of batch · heads heads (a view when contiguous)
        return x.reshape(1, b * h, *x.shape[2:])

    plan_backward(
        *(one(x) for x in (q, k, v, o, lse, do)),
        plans.backward,
        scale=scale,
        out=tuple(one(x) for x in out),
        impl=impl,
        deterministic=deterministic,
        dq_plan=plans.dq,
    )
    return tuple(out)


def backward_route(graph_or_stack, kind: str = "kpage", route="auto", impl=None, deterministic=False):
    """The route a backward of ``graph_or_stack`` (a :class:`SparseGraph` or :class:`HeadStack`) runs:
    ``route``, except that KPage's ``"auto"`` becomes ``"pair"`` (64-row K/V blocks joined two by two
    into 128-row pair items) where some K/V layout has two or more 64-row blocks and the default kernel
    runs (``impl`` None, ``"wgmma"`` or ``"wgmma_ws"``, not ``deterministic``). Measured at ad52a35 (H200,
    backward, ms, per-block routes → pair items): ssta 94.1 → 92.3, SVG2 283.7 → 271.9, VSA 480p
    24.6 → 20.7; without such blocks the two plans are the same."""
    from .bsa_backward import default_impl

    if route != "auto" or kind != "kpage" or deterministic:
        return route
    if (default_impl() if impl is None else impl) not in ("wgmma", "wgmma_ws"):
        return route
    return (
        "pair" if cached(graph_or_stack, "pairable K/V blocks", lambda: _pairable(graph_or_stack)) else route
    )


def _pairable(graph_or_stack) -> bool:
    """Whether some K/V layout of a graph or HeadStack has two or more 64-row blocks."""
    graphs = graph_or_stack.graphs if isinstance(graph_or_stack, HeadStack) else (graph_or_stack,)
    return any(isinstance(g, SparseGraph) and backward_pairs_pay(g.k) for g in graphs)


def _q_owned_route(route):
    """The route of the Q-owned plan the dQ pass runs beside a K/V-owned plan of ``route``: the same, but
    the forward's ``"auto"`` for pair items (they are K/V-owned only)."""
    return "auto" if route == "pair" else route


def _head_stack_backward(
    q, k, v, o, lse, do, stack: HeadStack, scale, out, kind, route, impl=None, deterministic=False
):
    """Heads with their own layouts (SVG2). Slots past a head's layout get zero gradients.

    Contiguous tensors run in one launch per route: the heads' per-head plans laid end to end
    (:func:`~sparseattn.planning.tile_plan.stack_head_plans`) on the tensors viewed as one head. Otherwise (or
    past the kernels' 32-bit page offsets) one launch per head, on contiguous copies of its slots.
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("o", o), ("do", do)):
        if getattr(x, "ndim", 0) != 4:
            raise KernelValueError(
                f"{name} must be [batch, heads, slots, d], got shape {getattr(x, 'shape', None)}"
            )
    if getattr(lse, "ndim", 0) != 3:
        raise KernelValueError(
            f"lse must be [batch, heads, q_slots], got shape {getattr(lse, 'shape', None)}"
        )
    _, heads, sq, _ = q.shape
    sk = k.shape[2]
    if heads != stack.heads:
        raise KernelValueError(f"the HeadStack has {stack.heads} heads but q has {heads}")
    if sq < stack.q_slots or sk < stack.k_slots:
        raise KernelValueError(
            f"the HeadStack's largest layouts have {stack.q_slots} Q / {stack.k_slots} K slots, "
            f"q has {sq} and k {sk}"
        )
    if out is None:
        import cupy

        out = (cupy.zeros_like(q), cupy.zeros_like(k), cupy.zeros_like(v))
    elif not isinstance(out, (tuple, list)) or len(out) != 3:
        raise KernelTypeError("out must be a tuple (dq, dk, dv) of preallocated arrays")
    dq, dk, dv = out
    for name, buf, like in (("out[0] (dq)", dq, q), ("out[1] (dk)", dk, k), ("out[2] (dv)", dv, v)):
        if getattr(buf, "shape", None) != like.shape or getattr(buf, "dtype", None) != like.dtype:
            raise KernelValueError(f"{name} must be shaped and typed like its input {tuple(like.shape)}")
    b, d = q.shape[0], q.shape[3]
    tensors = (q, k, v, o, lse, do, dq, dk, dv)
    if (
        os.environ.get("SPARSEATTN_BWD_HEADSTACK", "stacked") != "per_head"  # A/B knob for the old path
        and sq % PAGE_ROWS == 0
        and sk % PAGE_ROWS == 0
        and heads * max(sq, sk) * d < 2**31
        and all(getattr(getattr(x, "flags", None), "c_contiguous", False) for x in tensors)
    ):

        def stacked(owner, own_pages, stream_pages):  # the heads' plans end to end, built once per stack
            r = _q_owned_route(route) if owner == "q" else route
            return cached(
                stack,
                (f"stacked plan {owner}", kind, r, sq, sk),
                lambda: stack_head_plans(
                    [plan_of(g, kind, r, owner=owner) for g in stack.graphs], own_pages, stream_pages
                ),
            )

        plan = stacked("kv", sk // PAGE_ROWS, sq // PAGE_ROWS)
        dq_plan = stacked("q", sq // PAGE_ROWS, sk // PAGE_ROWS) if uses_dq_pass(impl, plan) else None

        def one(x):  # [batch, heads, slots, ...] viewed as one head (no copy)
            return x.reshape(b, 1, heads * x.shape[2], *x.shape[3:])

        plan_backward(
            *(one(x) for x in (q, k, v, o, lse, do)),
            plan,
            scale=scale,
            out=(one(dq), one(dk), one(dv)),
            impl=impl,
            deterministic=deterministic,
            dq_plan=dq_plan,
        )
        return dq, dk, dv
    import cupy

    for h, graph in enumerate(stack.graphs):
        nq, nk = graph.q.num_slots, graph.k.num_slots
        ins = [
            cupy.ascontiguousarray(x[:, h : h + 1, :n])
            for x, n in ((q, nq), (k, nk), (v, nk), (o, nq), (lse, nq), (do, nq))
        ]
        grads = paged_backward(
            *ins, graph, scale=scale, kind=kind, route=route, impl=impl, deterministic=deterministic
        )
        for buf, g, n in ((dq, grads[0], nq), (dk, grads[1], nk), (dv, grads[2], nk)):
            buf[:, h : h + 1, :n] = g
            buf[:, h : h + 1, n:] = 0
    return dq, dk, dv


def _torch_backward(
    q,
    k,
    v,
    o,
    lse,
    do,
    plan,
    scale,
    out,
    kind="kpage",
    route="auto",
    impl=None,
    deterministic=False,
    dq_plan=None,
):
    import torch

    if out is None and not isinstance(plan, HeadStack):
        fast = _torch_fast_backward(q, k, v, o, lse, do, plan, scale, impl, deterministic, dq_plan)
        if fast is not None:
            return fast
    if out is None:
        out = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    with launch.torch_context():  # the views too: DLPack then exchanges no event with another stream
        inputs, outputs = launch.torch_views(
            dict(q=q, k=k, v=v, o=o, lse=lse, do=do), out, ("out[0]", "out[1]", "out[2]"), "(dq, dk, dv)"
        )
        if isinstance(plan, DevicePlans):
            _device_plans_backward(*inputs, plan, scale, tuple(outputs), impl, deterministic)
        elif isinstance(plan, HeadStack):
            _head_stack_backward(*inputs, plan, scale, tuple(outputs), kind, route, impl, deterministic)
        else:
            plan_backward(
                *inputs,
                plan,
                scale=scale,
                out=tuple(outputs),
                impl=impl,
                deterministic=deterministic,
                dq_plan=dq_plan,
            )
    return tuple(out)


def _torch_fast_backward(q, k, v, o, lse, do, plan, scale, impl, deterministic, dq_plan):
    """:func:`~.bsa_backward.torch_plan_backward` of a K/V-owned plan or of device plans (their
    ``[batch, heads]`` run as ``batch · heads`` heads); None to take the general path."""
    if not isinstance(plan, DevicePlans):
        return torch_plan_backward(q, k, v, o, lse, do, plan, scale, impl, deterministic, dq_plan)
    try:
        b, h = q.shape[:2]
        if (b, h, q.shape[2], k.shape[2]) != (plan.batch, plan.heads, plan.q_slots, plan.k_slots):
            return None
        flat = [x.reshape(1, b * h, *x.shape[2:]) for x in (q, k, v, o, lse, do)]
    except (AttributeError, TypeError, ValueError, RuntimeError):
        return None
    grads = torch_plan_backward(*flat, plan.backward, scale, impl, deterministic, plan.dq)
    if grads is None:
        return None
    return tuple(g.view(x.shape) for g, x in zip(grads, (q, k, v)))


def kpage_backward(
    q, k, v, o, lse, do, graph_or_plan, route="auto", scale=None, out=None, impl=None, deterministic=False
):
    """KPage backward (K/V-owned KPage plan); arguments and results as :func:`paged_backward`."""
    return paged_backward(
        q,
        k,
        v,
        o,
        lse,
        do,
        graph_or_plan,
        scale,
        out,
        kind="kpage",
        route=route,
        impl=impl,
        deterministic=deterministic,
    )


def bsa_backward(q, k, v, o, lse, do, graph_or_plan, scale=None, out=None, impl=None, deterministic=False):
    """BSA backward (K/V-owned BSA plan, the kernels :func:`kpage_backward` runs); a
    :class:`HeadStack` as for :func:`kpage_backward`; arguments and results as :func:`paged_backward`."""
    return paged_backward(
        q,
        k,
        v,
        o,
        lse,
        do,
        graph_or_plan,
        scale,
        out,
        kind="bsa",
        impl=impl,
        deterministic=deterministic,
    )


def backward_executed_pairs(
    graph, head_dim: int, kind: str = "kpage", impl=None, route="auto", deterministic=False
) -> int:
    """Query–key pairs the backward kernel computes for one batch entry: per work item of the K/V-owned
    plan, its owned rows × its streamed rows rounded up to the kernel's step (a :class:`HeadStack`: the
    sum over its heads). Pair items (``route="pair"``) count 64 owned rows per half and step that the
    half computes: the kernel skips a half's steps without a page it sees."""

    from .bsa_backward import TILES, WGMMA_Q_ROWS, default_impl, wgmma_variant

    route = backward_route(graph, kind, route, impl, deterministic)
    impl = default_impl() if impl is None else impl
    graphs = graph.graphs if isinstance(graph, HeadStack) else (graph,)
    total = 0
    for g in graphs:
        plan = plan_of(g, kind, route, owner="kv")
        rows = plan.tile_shapes()[:, 0]
        step = np.array(
            [
                TILES[head_dim, int(m)][0]
                if impl == "mma"
                else WGMMA_Q_ROWS * max(1, wgmma_variant(impl, int(m))[0])
                for m in rows
            ]
        )
        streamed = plan.stream_lengths() * PAGE_ROWS
        if plan.stream_vis is not None:  # pair items: 64 × 64 per (step, half that sees a page of it)
            total += _pair_executed_pairs(plan, WGMMA_Q_ROWS)
            continue
        total += int((rows * (-(-streamed // step) * step)).sum())
    return total


def _pair_executed_pairs(plan, step_rows: int) -> int:
    """Σ over the steps of every work item (``step_rows`` streamed rows each) of 64 owned rows × the step
    for each 64-row half that sees one of the step's entries (all halves of items without pair
    visibility)."""

    lengths = plan.stream_lengths()
    item = np.repeat(np.arange(plan.num_work), lengths)
    position = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    step = position // (step_rows // PAGE_ROWS)
    halves = plan.tile_shapes()[:, 0] // 64
    vis = plan.stream_vis.astype(np.int64) & np.where(halves[item] > 1, 3, 1)
    steps_per_item = -(-lengths // (step_rows // PAGE_ROWS))
    key = (np.cumsum(steps_per_item) - steps_per_item)[item] + step
    seen = np.zeros(int(steps_per_item.sum()), dtype=np.int64)
    np.bitwise_or.at(seen, key, vis)
    return int(((seen & 1) + (seen >> 1 & 1)).sum()) * 64 * step_rows


def torch_token_backward(q, k, v, o, lse, do, graph_or_plans, q_map, k_map, route="auto", scale=None):
    """KPage's backward on token-ordered torch tensors (``PAGED_BWD_TOKENS``: each page gathered by token,
    dK / dV / dQ rows stored to their tokens): ``(dq, dk, dv)`` like ``q``, ``k``, ``v``, or None where the
    token-order build does not run this plan (the caller then moves to slot order).

    Args:
        q, o, do: bf16 CUDA ``[batch, q_tokens, heads, d]``; k, v: ``[batch, k_tokens, heads, d]``;
        lse: float32 ``[batch, heads, q_slots]`` (the token-order forward's, slot order).
        graph_or_plans: the forward's :class:`SparseGraph` (its K/V-owned plan, ``route`` as
            :func:`kpage_backward`; never the Q-owned dQ pass) or :class:`DevicePlans` made with the backward.
        q_map, k_map, scale: as :func:`sparseattn.kernels.forward.torch_token_forward` took them.
    """
    import torch

    from .bsa_backward import default_impl, torch_token_plan_backward
    from .forward import check_token_tensors
    from .validate import check_scale

    b, nq, h, d, nk, sq, sk, per_row = check_token_tensors(q, k, v, q_map, k_map, (("o", o), ("do", do)))
    if (
        not isinstance(lse, torch.Tensor)
        or lse.dtype != torch.float32
        or lse.shape != (b, h, sq)
        or lse.device != q.device
    ):
        raise KernelValueError(
            f"lse must be float32 [{b}, {h}, {sq}] on q's device (the token-order forward's)"
        )
    impl = default_impl()
    if isinstance(graph_or_plans, DevicePlans):
        plans = graph_or_plans
        if plans.backward is None:
            raise KernelValueError("graph_or_plans: these device plans were made without the backward")
        if (b, h, sq, sk) != (plans.batch, plans.heads, plans.q_slots, plans.k_slots):
            raise KernelValueError(
                f"the plans are for batch {plans.batch} x {plans.heads} heads over {plans.q_slots} Q / "
                f"{plans.k_slots} K slots; the tensors and maps give {b} x {h} over {sq} / {sk}"
            )
        plan, sizes = plans.backward, (1, b * h, sq, sk, d)
    elif isinstance(graph_or_plans, SparseGraph):
        check_graph_matches(graph_or_plans, h, sq, sk)
        plan = plan_of(
            graph_or_plans, "kpage", backward_route(graph_or_plans, "kpage", route, impl), owner="kv"
        )
        sizes = (b, h, sq, sk, d)
    else:
        raise KernelTypeError(
            f"graph_or_plans must be a SparseGraph or DevicePlans, got {type(graph_or_plans).__name__}"
        )
    q, k, v, o, lse, do, q_map, k_map = (x.contiguous() for x in (q, k, v, o, lse, do, q_map, k_map))
    tokens = (nq, nk, h, int(per_row))
    return torch_token_plan_backward(
        q, k, v, o, lse, do, plan, q_map, k_map, sizes, tokens, check_scale(scale, d), impl
    )
