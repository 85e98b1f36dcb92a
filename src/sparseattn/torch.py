"""Torch interop: autograd ops over the KPage forward and backward kernels (torch bf16 CUDA tensors in
and out, no copies, on torch's current stream).

>>> o = sparseattn.torch.kpage_attention(q, k, v, graph)   # q, k, v: [batch, heads, slots, d] bf16
>>> o.backward(do)                                          # dq, dk, dv in q.grad, k.grad, v.grad

For selections made per call on the GPU (VSA's top-k, a learned selection): :func:`block_sparse_attention`
(top-k indices and counts, the VSA kernel's arguments) and :func:`block_sparse_attention_mask` (a block
mask) plan every call on the device (:mod:`sparseattn.planning.device`); :func:`vsa_topk` is VSA's
selection, :func:`tokens_to_slots` / :func:`slots_to_tokens` move activations into a layout's slot order.

Rows of padding slots of ``o`` are zero, and padding rows get zero gradients.
"""

from __future__ import annotations

import numpy as np
import torch

from .kernels.backward import kpage_backward
from .kernels.forward import kpage_forward


class KPageAttention(torch.autograd.Function):
    """Exact sparse attention of ``graph`` with the KPage plans (forward: Q-owned, backward: K/V-owned)."""

    @staticmethod
    def forward(ctx, q, k, v, graph, route, scale, deterministic):
        q, k, v = (x.contiguous() for x in (q, k, v))
        o, lse = kpage_forward(q, k, v, graph, route=route, scale=scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.graph, ctx.route, ctx.scale, ctx.deterministic = graph, route, scale, deterministic
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = kpage_backward(
            q,
            k,
            v,
            o,
            lse,
            do.contiguous(),
            ctx.graph,
            route=ctx.route,
            scale=ctx.scale,
            deterministic=ctx.deterministic,
        )
        return dq, dk, dv, None, None, None, None


def kpage_attention(q, k, v, graph, route="auto", scale=None, deterministic=False):
    """Sparse attention output ``o`` (bf16 ``[batch, heads, q_slots, d]``) with autograd.

    Args:
        q, k, v: torch bf16 CUDA tensors ``[batch, heads, slots, d]`` in ``graph``'s slot layouts.
        graph: a :class:`~sparseattn.graph.SparseGraph` (its plans are built once and cached).
        route: KPage route (``"auto"``, 0 = 64×256, 1 = 128×128, or ``"pair"``: 64-row blocks joined
            two by two in both passes, not with ``deterministic``; ``"auto"`` takes them where they pay:
            the backward on 64-row K/V blocks, the forward on VSA-like selections); scale: default
            ``1/sqrt(d)``.
        deterministic: gradients bit-identical from run to run (the Q-owned dQ pass, or dQ added in
            64-bit fixed point).
    """
    return KPageAttention.apply(q, k, v, graph, route, scale, deterministic)


# ---- dynamic selections: planned on the GPU per call --------------------------------------------------


def planner_for(q_layout, k_layout=None, **options):
    """The :class:`~sparseattn.planning.device.DevicePlanner` of a call site (layouts and options), built
    once and kept as long as ``q_layout`` lives."""
    from .planning.cache import cached
    from .planning.device import DevicePlanner

    k_layout = q_layout if k_layout is None else k_layout
    key = ("device planner", id(k_layout), tuple(sorted(options.items())))
    planner = cached(q_layout, key, lambda: DevicePlanner(q_layout, k_layout, **options))
    if planner.k is not k_layout:  # another layout took the id of a freed one
        planner = DevicePlanner(q_layout, k_layout, **options)
    return planner


class DynamicSparseAttention(torch.autograd.Function):
    """Exact sparse attention of a selection on the GPU: plans built on the device each call (forward
    work list, backward plans), the KPage (or BSA) kernels, autograd."""

    @staticmethod
    def forward(ctx, q, k, v, planner, q2k_idx, q2k_num, mask, scale, deterministic, needs_grad):
        from .kernels import launch

        q, k, v = (x.contiguous() for x in (q, k, v))
        with launch.torch_context():
            plans = planner.plan(q2k_idx, q2k_num, mask=mask, backward=needs_grad)
        o, lse = kpage_forward(q, k, v, plans, scale=scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.plans, ctx.scale, ctx.deterministic = plans, scale, deterministic
        ctx.impl = planner.impl
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = kpage_backward(
            q,
            k,
            v,
            o,
            lse,
            do.contiguous(),
            ctx.plans,
            scale=ctx.scale,
            impl=ctx.impl,
            deterministic=ctx.deterministic,
        )
        return dq, dk, dv, None, None, None, None, None, None, None


def _needs_grad(*tensors) -> bool:
    """Whether autograd will ask for gradients (decided outside the Function: its forward runs without
    grad mode): the backward's plans are made only then."""
    return torch.is_grad_enabled() and any(x.requires_grad for x in tensors)


def _planner(layout, k_layout, kind, route, deterministic, max_selected):
    from .planning.device import DevicePlanner

    if isinstance(layout, DevicePlanner):
        return layout
    return planner_for(
        layout, k_layout, kind=kind, route=route, deterministic=bool(deterministic), max_selected=max_selected
    )


def block_sparse_attention(
    q,
    k,
    v,
    layout,
    q2k_idx,
    q2k_num,
    *,
    k_layout=None,
    kind="kpage",
    route="auto",
    scale=None,
    deterministic=False,
):
    """Sparse attention of a top-k block selection made on the GPU, with autograd: the argument meaning of
    the VSA kernel's ``block_sparse_attn_from_indices(q, k, v, q2k_idx, q2k_num, variable_block_sizes)``,
    with the slot layout in place of the block sizes. Every call plans on the device (no host
    synchronisation; capturable in a CUDA graph).

    Args:
        q, k, v: torch bf16 CUDA ``[batch, heads, slots, d]`` in the layouts' slot order.
        layout: the :class:`~sparseattn.layouts.BlockLayout` of q (and of k, v unless ``k_layout``), e.g.
            ``video_layout(grid, (4, 4, 4), 64)`` for VSA's cubes (valid tokens a prefix of each cube, as
            ``variable_block_sizes`` says); or a :class:`~sparseattn.planning.device.DevicePlanner`.
        q2k_idx: int32 ``[batch, heads, q_blocks, topk]``: the K blocks each Q block selects.
        q2k_num: int32 ``[batch, heads, q_blocks]``: how many of them are used.
        kind, route: ``"kpage"`` (or ``"bsa"``) and its route (``"auto"``: by a rule of the layout).
        scale: softmax scale (default ``1/sqrt(d)``); deterministic: as :func:`kpage_attention`.

    Returns:
        ``(o, lse)``: ``o`` like ``q`` (padding rows zero), ``lse`` float32 ``[batch, heads, q_slots]``.
    """
    planner = _planner(layout, k_layout, kind, route, deterministic, None)
    return DynamicSparseAttention.apply(
        q, k, v, planner, q2k_idx, q2k_num, None, scale, deterministic, _needs_grad(q, k, v)
    )


def block_sparse_attention_mask(
    q,
    k,
    v,
    layout,
    mask,
    *,
    k_layout=None,
    kind="kpage",
    route="auto",
    scale=None,
    deterministic=False,
    max_selected=None,
):
    """:func:`block_sparse_attention` of a block mask: bool ``[batch, heads, q_blocks, k_blocks]`` on the GPU.
    ``max_selected``: the most blocks a Q block selects (sizes the plan buffers; default all)."""
    planner = _planner(layout, k_layout, kind, route, deterministic, max_selected)
    return DynamicSparseAttention.apply(
        q, k, v, planner, None, None, mask, scale, deterministic, _needs_grad(q, k, v)
    )


def _block_weights(layout, device):
    """``(1 / valid rows [1, 1, blocks, 1] (0 for empty blocks), alive [blocks])`` on ``device``, uploaded
    once per layout and device (a call then copies nothing from the host)."""
    from .planning.cache import cached

    def build():
        rows = torch.as_tensor(layout.valid_rows, dtype=torch.float32, device=device)
        alive = rows > 0
        return torch.where(alive, 1.0 / rows.clamp(min=1), torch.zeros_like(rows))[None, None, :, None], alive

    return cached(layout, ("block weights", str(device)), build)


def vsa_topk(q, k, layout, topk: int):
    """VSA's selection on the device: per (batch, head) and Q block, the ``topk`` K blocks of highest
    ``mean(q_block) · mean(k_block)`` (means over each block's valid tokens; blocks without valid rows
    never selected), as ``block_sparse_attention``'s ``(q2k_idx, q2k_num)``.

    Args:
        q, k: torch ``[batch, heads, slots, d]`` in ``layout``'s slot order, padding slots zero.
        layout: their :class:`~sparseattn.layouts.BlockLayout`.
        topk: blocks per Q block (at most the blocks with valid rows).

    Returns:
        int32 ``q2k_idx [batch, heads, q_blocks, topk']`` and ``q2k_num [batch, heads, q_blocks]``, with
        ``topk' = min(topk, blocks with valid rows)``.
    """
    b, h, slots, d = q.shape
    nb, bs = layout.num_blocks, layout.block_size
    if slots != layout.num_slots or k.shape[2] != layout.num_slots:
        raise ValueError(
            f"q and k must have the layout's {layout.num_slots} slots, got {slots} and {k.shape[2]}"
        )
    weight, alive = _block_weights(layout, q.device)
    qm = q.reshape(b, h, nb, bs, d).sum(3, dtype=torch.float32) * weight  # fp32 sums, no fp32 copy of q
    km = k.reshape(b, h, nb, bs, d).sum(3, dtype=torch.float32) * weight
    scores = (qm @ km.transpose(-1, -2)).masked_fill(~alive, float("-inf"))
    kept = min(int(topk), int(np.count_nonzero(layout.valid_rows)))
    idx = scores.topk(kept, dim=-1).indices.to(torch.int32)
    num = torch.full((b, h, nb), kept, dtype=torch.int32, device=q.device)
    return idx.contiguous(), num


# ---- tokens <-> slots ------------------------------------------------------------------------------


def _slot_indices(layout, device):
    """int32 ``(slot_token [slots] (-1 for padding), token_slot [tokens])`` on ``device``, uploaded once."""
    from .planning.cache import cached

    def build():
        return (
            torch.as_tensor(layout.slot_token.astype(np.int32), device=device),
            torch.as_tensor(layout.token_slot.astype(np.int32), device=device),
        )

    return cached(layout, ("slot indices", str(device)), build)


def _fast_slots(tensors) -> bool:
    return all(
        x.is_cuda and x.dtype == torch.bfloat16 and x.is_contiguous() and x.shape[-1] % 8 == 0
        for x in tensors
    )


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


class TokensToSlots(torch.autograd.Function):
    """``[B, tokens, heads, d]`` tensors -> ``[B, heads, slots, d]`` in a layout's slot order (padding slots
    zero), in one launch; the gradients go back the other way."""

    @staticmethod
    def forward(ctx, layout, *xs):
        from .kernels.slots import slots_from_tokens

        b, n, h, d = xs[0].shape
        ctx.layout, ctx.sizes = layout, (b, n, h, layout.num_slots, d)
        return tuple(_move(slots_from_tokens, xs, layout, (b, h, layout.num_slots, d), ctx.sizes))

    @staticmethod
    def backward(ctx, *grads):
        from .kernels.slots import tokens_from_slots

        b, n, h, _s, d = ctx.sizes
        grads = [g.contiguous() for g in grads]
        return (None, *_move(tokens_from_slots, grads, ctx.layout, (b, n, h, d), ctx.sizes))


class SlotsToTokens(torch.autograd.Function):
    """``[B, heads, slots, d]`` in a layout's slot order -> ``[B, tokens, heads, d]`` (padding dropped)."""

    @staticmethod
    def forward(ctx, layout, y):
        from .kernels.slots import tokens_from_slots

        b, h, s, d = y.shape
        ctx.layout, ctx.sizes = layout, (b, layout.num_tokens, h, s, d)
        return _move(tokens_from_slots, [y], layout, (b, layout.num_tokens, h, d), ctx.sizes)[0]

    @staticmethod
    def backward(ctx, grad):
        from .kernels.slots import slots_from_tokens

        b, _n, h, s, d = ctx.sizes
        return None, _move(slots_from_tokens, [grad.contiguous()], ctx.layout, (b, h, s, d), ctx.sizes)[0]


def tokens_to_slots(layout, *xs):
    """Token-ordered ``[B, tokens, heads, d]`` tensors in ``layout``'s slot order ``[B, heads, slots, d]``,
    bf16, padding slots zero, with autograd (one fused launch for bf16 CUDA tensors; torch ops otherwise)."""
    if _fast_slots(xs):
        return TokensToSlots.apply(layout, *xs)
    slots = torch.as_tensor(layout.token_slot, device=xs[0].device)
    outs = []
    for x in xs:
        x = x.transpose(1, 2)
        out = x.new_zeros(x.shape[0], x.shape[1], layout.num_slots, x.shape[3], dtype=torch.bfloat16)
        outs.append(out.index_copy(2, slots, x.to(torch.bfloat16)))
    return tuple(outs)


def slots_to_tokens(layout, y):
    """:func:`tokens_to_slots`'s inverse for one ``[B, heads, slots, d]`` tensor: ``[B, tokens, heads, d]``."""
    if _fast_slots((y,)):
        return SlotsToTokens.apply(layout, y)
    slots = torch.as_tensor(layout.token_slot, device=y.device)
    return y.index_select(2, slots).transpose(1, 2)
