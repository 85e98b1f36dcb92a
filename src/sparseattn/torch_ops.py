"""The ``torch.library`` operators behind :mod:`sparseattn.torch` (namespace ``sparseattn``).

Operators, their fake (meta) implementations for ``torch.compile`` and their autograd formulas:

* ``kpage_fwd(q, k, v, graph, route, scale, deterministic) -> (o, lse)`` and ``kpage_bwd`` (its
  gradients): a static :class:`~sparseattn.graph.SparseGraph`, passed as an opaque integer handle
  (:func:`handle`); its plans are built once and cached.
* ``dynamic_fwd(q, k, v, q2k_idx?, q2k_num?, mask?, planner, scale, plan_backward) -> (o, lse, plans)``
  and ``dynamic_bwd``: a selection on the GPU, planned on the device each call by the
  :class:`~sparseattn.planning.device.DevicePlanner` ``planner`` (a handle). ``plans`` (uint8 bytes) is the
  device memory of the call's plans, which the backward reads: no host state passes between the two.
* ``tokens_to_slots(xs, layout) -> ys`` and ``slots_to_tokens(y, layout)``: ``[B, tokens, heads, d]`` <->
  ``[B, heads, slots, d]`` in a layout's slot order (padding slots zero), each the other's gradient.

Layouts, graphs and planners are constants of a call site: they enter an operator as the integer of
:func:`handle`, which ``torch.compile`` treats as a constant and a CUDA graph never sees. The CUDA
implementations launch the KPage kernels on torch's current stream; the CPU implementations compute
the same graph with dense masked attention in float32 (small problems: tests, and tracing on any
machine).
"""

from __future__ import annotations

import itertools
import math
import weakref

import numpy as np
import torch

_LIB = torch.library.Library("sparseattn", "DEF")
_LIB.define(
    "kpage_fwd(Tensor q, Tensor k, Tensor v, int graph, str route, float scale, bool deterministic)"
    " -> (Tensor, Tensor)"
)
_LIB.define(
    "kpage_bwd(Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor do, int graph, str route,"
    " float scale, bool deterministic) -> (Tensor, Tensor, Tensor)"
)
_LIB.define(
    "dynamic_fwd(Tensor q, Tensor k, Tensor v, Tensor? q2k_idx, Tensor? q2k_num, Tensor? mask, int planner,"
    " float scale, bool plan_backward) -> (Tensor, Tensor, Tensor)"
)
_LIB.define(
    "dynamic_bwd(Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor do, Tensor plans, Tensor? q2k_idx,"
    " Tensor? q2k_num, Tensor? mask, int planner, float scale, bool deterministic) -> (Tensor, Tensor, Tensor)"
)
_LIB.define("tokens_to_slots(Tensor[] xs, int layout) -> Tensor[]")
_LIB.define("slots_to_tokens(Tensor y, int layout) -> Tensor")

OPS = torch.ops.sparseattn

# ---- handles: call-site constants as integers ----------------------------------------------------------

_HANDLES: dict[int, tuple] = {}  # id(obj) -> (weak reference, handle)
_OBJECTS: dict[int, weakref.ref] = {}  # handle -> weak reference
_NEXT = itertools.count(1)


@torch.compiler.assume_constant_result
def handle(obj) -> int:
    """The integer that names ``obj`` (a graph, layout or planner) in the operators, as long as it lives."""
    entry = _HANDLES.get(id(obj))
    if entry is not None and entry[0]() is obj:
        return entry[1]
    h = next(_NEXT)
    key = id(obj)

    def forget(_ref, key=key, h=h):
        _OBJECTS.pop(h, None)
        if _HANDLES.get(key, (None, None))[1] == h:
            del _HANDLES[key]

    ref = weakref.ref(obj, forget)
    _HANDLES[key], _OBJECTS[h] = (ref, h), ref
    return h


def resolve(h: int):
    """The object of handle ``h``."""
    ref = _OBJECTS.get(int(h))
    obj = None if ref is None else ref()
    if obj is None:
        raise ValueError(f"handle {h} names no live graph, layout or planner (it was freed)")
    return obj


def default_scale(scale, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def parse_route(route: str):
    """``"0"``/``"1"`` -> 0/1; ``"auto"``/``"pair"`` unchanged (routes pass to the operators as strings)."""
    return int(route) if route in ("0", "1") else route


# ---- static graphs ------------------------------------------------------------------------------------


@torch.library.register_fake("sparseattn::kpage_fwd")
def _kpage_fwd_fake(q, k, v, graph, route, scale, deterministic):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


def _kpage_fwd_cuda(q, k, v, graph, route, scale, deterministic):
    from .kernels.forward import torch_graph_forward

    return torch_graph_forward(q, k, v, resolve(graph), parse_route(route), scale)


@torch.library.register_fake("sparseattn::kpage_bwd")
def _kpage_bwd_fake(q, k, v, o, lse, do, graph, route, scale, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _kpage_bwd_cuda(q, k, v, o, lse, do, graph, route, scale, deterministic):
    from .kernels.backward import kpage_backward

    q, k, v, o, lse, do = (x.contiguous() for x in (q, k, v, o, lse, do))
    return tuple(
        kpage_backward(
            q,
            k,
            v,
            o,
            lse,
            do,
            resolve(graph),
            route=parse_route(route),
            scale=scale,
            deterministic=deterministic,
        )
    )


def _kpage_setup(ctx, inputs, output):
    q, k, v, graph, route, scale, deterministic = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.args = (graph, route, scale, deterministic)


def _kpage_backward(ctx, do, _dlse):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = OPS.kpage_bwd.default(q, k, v, o, lse, do.contiguous(), *ctx.args)
    return dq, dk, dv, None, None, None, None


torch.library.register_autograd("sparseattn::kpage_fwd", _kpage_backward, setup_context=_kpage_setup)


class KPageFunction(torch.autograd.Function):
    """The same forward and backward implementations as ``kpage_fwd`` / ``kpage_bwd`` behind a plain
    ``autograd.Function`` (no dispatcher, no ``register_autograd`` wrapper): what an eager call would cost
    without the operator. ``python -m sparseattn.host_cost`` times both; ``torch.compile`` needs the
    operator. Arguments as ``kpage_fwd``; returns ``o``."""

    @staticmethod
    def forward(ctx, q, k, v, graph, route, scale, deterministic):
        impl = _kpage_fwd_cuda if q.is_cuda else _kpage_fwd_cpu
        o, lse = impl(q, k, v, graph, route, scale, deterministic)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (graph, route, scale, deterministic)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        impl = _kpage_bwd_cuda if q.is_cuda else _kpage_bwd_cpu
        dq, dk, dv = impl(q, k, v, o, lse, do.contiguous(), *ctx.args)
        return dq, dk, dv, None, None, None, None


# ---- selections planned on the device ------------------------------------------------------------------


def plans_bytes(planner, batch: int, heads: int, width: int, plan_backward: bool) -> int:
    """Size of one call's plans (the ``plans`` output of ``dynamic_fwd``; symbolic sizes are specialised:
    the buffers' layout is not linear in them)."""
    return planner.arena_bytes(int(batch) * int(heads), int(width), bool(plan_backward))


def selection_width(planner, q2k_idx, mask) -> int:
    """The selection's width: ``q2k_idx``'s last dimension, or what a block mask may select per row."""
    if q2k_idx is not None:
        return int(q2k_idx.shape[-1])
    return planner.mask_width()


@torch.library.register_fake("sparseattn::dynamic_fwd")
def _dynamic_fwd_fake(q, k, v, q2k_idx, q2k_num, mask, planner, scale, plan_backward):
    p = resolve(planner)
    n = plans_bytes(p, q.shape[0], q.shape[1], selection_width(p, q2k_idx, mask), plan_backward)
    o, lse = _kpage_fwd_fake(q, k, v, 0, "", scale, False)
    return o, lse, q.new_empty((n,), dtype=torch.uint8)


def _padding_rows(layout, device):
    """int64 ``[padding slots]`` on ``device``: the slots of ``layout`` that hold no token (cached)."""
    from .planning.cache import cached

    build = lambda: torch.as_tensor(np.flatnonzero(~layout.valid), dtype=torch.int64, device=device)
    return cached(layout, ("padding rows", str(device)), build)


def plan_selection(planner, batch: int, heads: int, q2k_idx, q2k_num, mask, backward: bool, device):
    """``(plans, memory)``: ``planner``'s plans of one selection, made on torch's current stream in one new
    uint8 device tensor (``memory``: keep it as long as the plans are used)."""
    from .kernels import launch

    n = plans_bytes(planner, batch, heads, selection_width(planner, q2k_idx, mask), backward)
    memory = torch.empty((n,), dtype=torch.uint8, device=device)
    with launch.torch_stream():
        plans = planner.plan(q2k_idx, q2k_num, mask=mask, backward=backward, memory=memory)
    return plans, memory


def _dynamic_fwd_cuda(q, k, v, q2k_idx, q2k_num, mask, planner, scale, plan_backward):
    from .kernels.forward import _torch_fast_forward, kpage_forward

    p = resolve(planner)
    q, k, v = (x.contiguous() for x in (q, k, v))
    plans, memory = plan_selection(p, q.shape[0], q.shape[1], q2k_idx, q2k_num, mask, plan_backward, q.device)
    # a device plan writes every valid row of its Q layout: only the padding slots of o need zeros
    fast = _torch_fast_forward(q, k, v, plans, "auto", scale, None, zero_rows=_padding_rows(p.q, q.device))
    o, lse = fast if fast is not None else kpage_forward(q, k, v, plans, scale=scale)
    return o, lse, memory


@torch.library.register_fake("sparseattn::dynamic_bwd")
def _dynamic_bwd_fake(q, k, v, o, lse, do, plans, q2k_idx, q2k_num, mask, planner, scale, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _dynamic_bwd_cuda(q, k, v, o, lse, do, plans, q2k_idx, q2k_num, mask, planner, scale, deterministic):
    from .kernels.backward import kpage_backward

    p = resolve(planner)
    q, k, v, o, lse, do = (x.contiguous() for x in (q, k, v, o, lse, do))
    device_plans = p.plans_in(plans, q.shape[0], q.shape[1], selection_width(p, q2k_idx, mask))
    return tuple(
        kpage_backward(
            q, k, v, o, lse, do, device_plans, scale=scale, impl=p.impl, deterministic=deterministic
        )
    )


def _dynamic_setup(ctx, inputs, output):
    q, k, v, q2k_idx, q2k_num, mask, planner, scale, plan_backward = inputs
    o, lse, plans = output
    ctx.save_for_backward(q, k, v, o, lse, plans, q2k_idx, q2k_num, mask)
    ctx.args = (planner, scale, resolve(planner).deterministic)
    ctx.planned = plan_backward


def _dynamic_backward(ctx, do, _dlse, _dplans):
    if not ctx.planned:
        raise RuntimeError(
            "sparseattn: these plans were made without the backward (no input required grad when "
            "block_sparse_attention ran)"
        )
    q, k, v, o, lse, plans, q2k_idx, q2k_num, mask = ctx.saved_tensors
    dq, dk, dv = OPS.dynamic_bwd.default(
        q, k, v, o, lse, do.contiguous(), plans, q2k_idx, q2k_num, mask, *ctx.args
    )
    return dq, dk, dv, None, None, None, None, None, None


torch.library.register_autograd("sparseattn::dynamic_fwd", _dynamic_backward, setup_context=_dynamic_setup)


# ---- tokens <-> slots ----------------------------------------------------------------------------------


@torch.library.register_fake("sparseattn::tokens_to_slots")
def _tokens_to_slots_fake(xs, layout):
    n_slots = resolve(layout).num_slots
    return [x.new_empty((x.shape[0], x.shape[2], n_slots, x.shape[3]), dtype=torch.bfloat16) for x in xs]


@torch.library.register_fake("sparseattn::slots_to_tokens")
def _slots_to_tokens_fake(y, layout):
    n_tokens = resolve(layout).num_tokens
    return y.new_empty((y.shape[0], n_tokens, y.shape[1], y.shape[3]), dtype=torch.bfloat16)


def _tokens_to_slots_cuda(xs, layout):
    from .kernels.slots import slots_from_tokens

    lay = resolve(layout)
    xs = [x.contiguous() for x in xs]
    if not _fast_slots(xs):
        return _tokens_to_slots_cpu(xs, layout)
    b, n, h, d = xs[0].shape
    return _move(slots_from_tokens, xs, lay, (b, h, lay.num_slots, d), (b, n, h, lay.num_slots, d))


def _slots_to_tokens_cuda(y, layout):
    from .kernels.slots import tokens_from_slots

    lay = resolve(layout)
    y = y.contiguous()
    if not _fast_slots([y]):
        return _slots_to_tokens_cpu(y, layout)
    b, h, s, d = y.shape
    return _move(tokens_from_slots, [y], lay, (b, lay.num_tokens, h, d), (b, lay.num_tokens, h, s, d))[0]


def _fast_slots(tensors) -> bool:
    return all(x.dtype == torch.bfloat16 and x.shape[-1] % 8 == 0 for x in tensors)


def _slot_indices(layout, device):
    """int32 ``(slot_token [slots] (-1 for padding), token_slot [tokens])`` on ``device``, uploaded once;
    ``slot_token`` knows from the host whether its pages hold consecutive tokens (the tile-major build's
    check then never reads it back)."""
    from .kernels.forward import pages_consecutive, remember_consecutive_pages
    from .planning.cache import cached

    def build():
        slot_token = torch.as_tensor(layout.slot_token.astype(np.int32), device=device)
        remember_consecutive_pages(slot_token, pages_consecutive(layout.slot_token))
        return slot_token, torch.as_tensor(layout.token_slot.astype(np.int32), device=device)

    return cached(layout, ("slot indices", str(device)), build)


def _move(kernel, sources, layout, out_shape, sizes):
    """``kernel`` (slots_from_tokens / tokens_from_slots) over ``sources``, into new tensors of ``out_shape``."""
    from .kernels import launch, slots

    outs = [torch.empty(out_shape, dtype=torch.bfloat16, device=sources[0].device) for _ in sources]
    slot_token, token_slot = _slot_indices(layout, sources[0].device)
    index = slot_token if kernel is slots.slots_from_tokens else token_slot
    ptr = lambda x: np.uint64(x.data_ptr())
    with launch.torch_stream():
        kernel([ptr(x) for x in sources], [ptr(y) for y in outs], ptr(index), *sizes)
    return outs


def token_slot_index(layout, device):
    """int64 ``token_slot`` of ``layout`` on ``device`` (uploaded once)."""
    from .planning.cache import cached

    return cached(
        layout, ("token slots", str(device)), lambda: torch.tensor(layout.token_slot, device=device)
    )


def _tokens_to_slots_cpu(xs, layout):
    lay = resolve(layout)
    slots = token_slot_index(lay, xs[0].device)
    outs = []
    for x in xs:
        x = x.transpose(1, 2)
        out = x.new_zeros(x.shape[0], x.shape[1], lay.num_slots, x.shape[3], dtype=torch.bfloat16)
        outs.append(out.index_copy(2, slots, x.to(torch.bfloat16)))
    return outs


def _slots_to_tokens_cpu(y, layout):
    slots = token_slot_index(resolve(layout), y.device)
    return y.index_select(2, slots).transpose(1, 2).to(torch.bfloat16).contiguous()


def _tokens_to_slots_setup(ctx, inputs, output):
    ctx.layout = inputs[1]
    ctx.dtypes = [x.dtype for x in inputs[0]]


def _tokens_to_slots_backward(ctx, grads):
    grads = [g.contiguous() for g in grads]
    return [OPS.slots_to_tokens.default(g, ctx.layout).to(dt) for g, dt in zip(grads, ctx.dtypes)], None


def _slots_to_tokens_setup(ctx, inputs, output):
    ctx.layout, ctx.dtype = inputs[1], inputs[0].dtype


def _slots_to_tokens_backward(ctx, grad):
    return OPS.tokens_to_slots.default([grad.contiguous()], ctx.layout)[0].to(ctx.dtype), None


torch.library.register_autograd(
    "sparseattn::tokens_to_slots", _tokens_to_slots_backward, setup_context=_tokens_to_slots_setup
)
torch.library.register_autograd(
    "sparseattn::slots_to_tokens", _slots_to_tokens_backward, setup_context=_slots_to_tokens_setup
)


# ---- CPU: the same graphs by dense masked attention (float32) -------------------------------------------


def _slot_mask(block_mask: torch.Tensor, q_layout, k_layout) -> torch.Tensor:
    """bool ``[..., q_slots, k_slots]`` of a block mask ``[..., q_blocks, k_blocks]``: valid slot pairs only."""
    qb = torch.as_tensor(np.arange(q_layout.num_slots) // q_layout.block_size)
    kb = torch.as_tensor(np.arange(k_layout.num_slots) // k_layout.block_size)
    m = block_mask[..., qb, :][..., kb]
    return m & torch.tensor(q_layout.valid)[:, None] & torch.tensor(k_layout.valid)[None, :]


def masked_attention(q, k, v, mask, scale):
    """``(o, lse)`` of attention restricted to ``mask`` (bool, broadcast to ``[B, H, q_slots, k_slots]``),
    in float32: rows without keys give ``o = 0``, ``lse = -inf``; ``o`` in ``q``'s dtype."""
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0.0)[..., None]).masked_fill(~mask, 0.0)
    return (p @ v.float()).to(q.dtype), lse


def _masked_grads(q, k, v, do, mask, scale):
    with torch.enable_grad():
        leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
        o, _ = masked_attention(*leaves, mask, scale)
        grads = torch.autograd.grad(o, leaves, do.float())
    return tuple(g.to(x.dtype).contiguous() for g, x in zip(grads, (q, k, v)))


def _graph_mask(graph) -> torch.Tensor:
    from .planning.cache import cached

    return cached(
        graph, ("slot mask cpu",), lambda: _slot_mask(torch.as_tensor(graph.block_mask()), graph.q, graph.k)
    )


def _kpage_fwd_cpu(q, k, v, graph, route, scale, deterministic):
    return masked_attention(q, k, v, _graph_mask(resolve(graph))[None], scale)


def _kpage_bwd_cpu(q, k, v, o, lse, do, graph, route, scale, deterministic):
    return _masked_grads(q, k, v, do, _graph_mask(resolve(graph))[None], scale)


def selection_block_mask(q2k_idx, q2k_num, mask, k_blocks: int) -> torch.Tensor:
    """bool ``[B, H, q_blocks, k_blocks]`` of a top-k selection (or the mask itself)."""
    if mask is not None:
        return mask
    used = torch.arange(q2k_idx.shape[-1], device=q2k_idx.device) < q2k_num[..., None]
    out = torch.zeros(*q2k_idx.shape[:3], k_blocks, dtype=torch.int32, device=q2k_idx.device)
    return out.scatter_add_(3, q2k_idx.long(), used.to(torch.int32)) > 0


def _dynamic_mask(p, q2k_idx, q2k_num, mask):
    return _slot_mask(selection_block_mask(q2k_idx, q2k_num, mask, p.k_blocks), p.q, p.k)


def _dynamic_fwd_cpu(q, k, v, q2k_idx, q2k_num, mask, planner, scale, plan_backward):
    p = resolve(planner)
    o, lse = masked_attention(q, k, v, _dynamic_mask(p, q2k_idx, q2k_num, mask), scale)
    n = plans_bytes(p, q.shape[0], q.shape[1], selection_width(p, q2k_idx, mask), plan_backward)
    return o, lse, torch.zeros((n,), dtype=torch.uint8)  # no plans: the CPU backward reads the selection


def _dynamic_bwd_cpu(q, k, v, o, lse, do, plans, q2k_idx, q2k_num, mask, planner, scale, deterministic):
    return _masked_grads(q, k, v, do, _dynamic_mask(resolve(planner), q2k_idx, q2k_num, mask), scale)


# the implementations, registered under their dispatch keys (plain functions: callable by name too)
torch.library.impl("sparseattn::kpage_fwd", "CUDA", _kpage_fwd_cuda)
torch.library.impl("sparseattn::kpage_bwd", "CUDA", _kpage_bwd_cuda)
torch.library.impl("sparseattn::dynamic_fwd", "CUDA", _dynamic_fwd_cuda)
torch.library.impl("sparseattn::dynamic_bwd", "CUDA", _dynamic_bwd_cuda)
torch.library.impl("sparseattn::tokens_to_slots", "CUDA", _tokens_to_slots_cuda)
torch.library.impl("sparseattn::slots_to_tokens", "CUDA", _slots_to_tokens_cuda)
torch.library.impl("sparseattn::tokens_to_slots", "CPU", _tokens_to_slots_cpu)
torch.library.impl("sparseattn::slots_to_tokens", "CPU", _slots_to_tokens_cpu)
torch.library.impl("sparseattn::kpage_fwd", "CPU", _kpage_fwd_cpu)
torch.library.impl("sparseattn::kpage_bwd", "CPU", _kpage_bwd_cpu)
torch.library.impl("sparseattn::dynamic_fwd", "CPU", _dynamic_fwd_cpu)
torch.library.impl("sparseattn::dynamic_bwd", "CPU", _dynamic_bwd_cpu)
