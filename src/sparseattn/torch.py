"""Torch interop: ``kpage_attention`` as a ``torch.autograd.Function`` over the KPage forward and
backward kernels (torch bf16 CUDA tensors in and out, no copies, on torch's current stream).

>>> o = sparseattn.torch.kpage_attention(q, k, v, graph)   # q, k, v: [batch, heads, slots, d] bf16
>>> o.backward(do)                                          # dq, dk, dv in q.grad, k.grad, v.grad

Rows of padding slots of ``o`` are zero, and padding rows get zero gradients.
"""

from __future__ import annotations

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
