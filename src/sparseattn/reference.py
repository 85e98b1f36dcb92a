"""Float64 numpy reference of block-sparse attention over a :class:`SparseGraph`.

Semantics (docs/accuracy.md, docs/counting.md): inside a selected (Q block, K block) pair every valid query row attends to
every valid key row. Invalid (padding) K/V slots never contribute, whatever they hold (even NaN).
Padded query rows, and valid rows whose selection holds no valid key, give ``O = 0`` and
``LSE = -inf``. ``LSE`` is the natural log of ``Σ exp(scale · q·k)``; ``scale`` (positive, as the kernels
require) defaults to ``1/sqrt(head_dim)``.

Memory stays bounded: the work runs one (head, Q block) at a time, gathering only the valid key
slots of the selected K blocks, so a 75,600-token head needs ``batch · Bq · selected keys`` floats of
scratch beyond the float64 copies of one head's Q/K/V.
"""

from __future__ import annotations

import numpy as np

from .graph import SparseGraph
from .planning.tile_plan import gather_segments


class ReferenceError(ValueError):
    """An argument of the reference model is invalid; the message names it."""


class ReferenceTypeError(TypeError):
    """An argument of the reference model has the wrong type or dtype; the message names it."""


def _as_float_array(name: str, x) -> np.ndarray:
    """``x`` as a numpy array of a float dtype (float16/32/64, or ml_dtypes such as bfloat16)."""
    if x is None:
        raise ReferenceTypeError(f"{name} must be an array, got None")
    if hasattr(x, "get") and not isinstance(x, np.ndarray):  # a cupy array passed by mistake
        raise ReferenceTypeError(f"{name} must be a numpy array (call .get() on device arrays)")
    arr = np.asarray(x)
    if arr.dtype.kind in "biucOSUM" or arr.dtype == np.bool_:
        raise ReferenceTypeError(f"{name} must hold floating-point values, got dtype {arr.dtype}")
    return arr


def _check_scale(scale, head_dim: int) -> float:
    """``1/sqrt(head_dim)`` when ``None``; else a finite positive number (as the kernels require)."""
    if scale is None:
        return 1.0 / float(np.sqrt(head_dim))
    if isinstance(scale, (str, bytes, bool, np.bool_)):
        raise ReferenceTypeError(f"scale must be a real number, got {scale!r}")
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise ReferenceTypeError(f"scale must be a real number, got {scale!r}") from None
    if not np.isfinite(value) or value <= 0.0:
        raise ReferenceError(f"scale must be finite and positive, got {scale!r}")
    return value


def _check_heads(heads, num_heads: int) -> np.ndarray:
    if heads is None:
        return np.arange(num_heads, dtype=np.int64)
    arr = np.asarray(heads).ravel()
    if arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise ReferenceError(f"heads must be a non-empty list of head indices, got {heads!r}")
    if int(arr.min()) < 0 or int(arr.max()) >= num_heads:  # in the given dtype: no wrap-around
        raise ReferenceError(f"heads must lie in [0, {num_heads}), got {arr.tolist()}")
    arr = arr.astype(np.int64)
    if np.unique(arr).size != arr.size:
        raise ReferenceError(f"heads must not repeat, got {arr.tolist()}")
    return arr


def _check_qkv(q, k, v, graph):
    if not isinstance(graph, SparseGraph):
        raise ReferenceTypeError(f"graph must be a SparseGraph, got {type(graph).__name__}")
    q, k, v = _as_float_array("q", q), _as_float_array("k", k), _as_float_array("v", v)
    for name, arr in (("q", q), ("k", k), ("v", v)):
        if arr.ndim != 4:
            raise ReferenceError(f"{name} must be [batch, heads, slots, head_dim], got shape {arr.shape}")
    b, h, sq, d = q.shape
    if h != graph.heads:
        raise ReferenceError(f"q has {h} heads but graph has {graph.heads}")
    if sq != graph.q.num_slots:
        raise ReferenceError(f"q has {sq} slots but graph.q has {graph.q.num_slots}")
    if k.shape != (b, h, graph.k.num_slots, d):
        raise ReferenceError(f"k must have shape {(b, h, graph.k.num_slots, d)}, got {k.shape}")
    if v.shape[:3] != k.shape[:3]:
        raise ReferenceError(f"v must have shape {k.shape[:3]} + (head_dim_v,), got {v.shape}")
    return q, k, v


class _SlotIndex:
    """Valid slots of every Q and K block of a graph (CSR over blocks) and per-row K gathers."""

    def __init__(self, graph: SparseGraph):
        self.graph = graph
        q, k = graph.q, graph.k
        self.q_ptr = np.concatenate([[0], np.cumsum(q.valid_rows)])
        self.q_slots = np.flatnonzero(q.valid)
        self.k_ptr = np.concatenate([[0], np.cumsum(k.valid_rows)])
        self.k_slots = np.flatnonzero(k.valid)

    def q_rows(self, block: int) -> np.ndarray:
        return self.q_slots[self.q_ptr[block] : self.q_ptr[block + 1]]

    def k_cols(self, head: int, block: int) -> np.ndarray:
        """Valid K slots of every K block selected by Q block ``block`` of ``head`` (unique, sorted)."""
        sel = self.graph.row(head, block).astype(np.int64)
        cols, _ = gather_segments(self.k_ptr, self.k_slots, sel)
        return cols


def _block_forward(qb, kb, vb, scale):
    """Dense softmax of one Q block over its gathered keys: qb ``[b, n, d]``, kb/vb ``[b, m, d]``."""
    s = scale * np.matmul(qb, kb.transpose(0, 2, 1))
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - m)
    l_sum = p.sum(axis=-1, keepdims=True)
    o = np.matmul(p, vb) / l_sum
    return o, (m + np.log(l_sum))[..., 0]


def attention_forward(q, k, v, graph: SparseGraph, scale=None, heads=None):
    """Block-sparse attention forward in float64.

    Args:
        q: ``[batch, heads, graph.q.num_slots, d]`` (any float dtype).
        k, v: ``[batch, heads, graph.k.num_slots, d]`` (v may have its own last dimension ``dv``).
        graph: the selected block pairs; ``graph.heads == heads``.
        scale: softmax scale (default ``1/sqrt(d)``).
        heads: optional subset of head indices to compute (outputs hold only those, in that order).

    Returns:
        ``(o, lse)``: float64 ``[batch, H, sq, dv]`` and ``[batch, H, sq]`` with ``H = len(heads)``
        (all heads by default). Rows without any attended key hold ``o = 0``, ``lse = -inf``.
    """
    q, k, v = _check_qkv(q, k, v, graph)
    b, _, sq, d = q.shape
    scale = _check_scale(scale, d)
    head_ids = _check_heads(heads, graph.heads)
    index = _SlotIndex(graph)
    o = np.zeros((b, head_ids.size, sq, v.shape[-1]), dtype=np.float64)
    lse = np.full((b, head_ids.size, sq), -np.inf, dtype=np.float64)
    for out_h, h in enumerate(head_ids):
        qh, kh, vh = (x[:, h].astype(np.float64) for x in (q, k, v))
        for i in range(graph.q.num_blocks):
            rows = index.q_rows(i)
            cols = index.k_cols(h, i)
            if rows.size == 0 or cols.size == 0:
                continue
            ob, lb = _block_forward(qh[:, rows], kh[:, cols], vh[:, cols], scale)
            o[:, out_h, rows] = ob
            lse[:, out_h, rows] = lb
    return o, lse


def _check_like(name: str, arr, shape) -> np.ndarray:
    arr = _as_float_array(name, arr)
    if arr.shape != shape:
        raise ReferenceError(f"{name} must have shape {shape}, got {arr.shape}")
    return arr


def _round_bf16(x: np.ndarray) -> np.ndarray:
    from .bf16 import bf16_bits_to_float, float_to_bf16_bits

    return bf16_bits_to_float(float_to_bf16_bits(x)).astype(np.float64)


def attention_backward(
    q, k, v, o, lse, do, graph: SparseGraph, scale=None, heads=None, emulate_bf16: bool = False
):
    """Exact gradients of :func:`attention_forward` for the loss ``Σ do · o``, in float64.

    Args:
        q, k, v, graph, scale, heads: as in :func:`attention_forward`.
        emulate_bf16: the bf16-rounding emulation of a backward kernel instead. ``P`` is rounded to bf16
            before ``dV = Pᵀ·dO``, and ``dS`` before ``dQ = dS·K`` and ``dK = dSᵀ·Q``. Accumulation stays
            exact, and dQ, dK, dV are rounded to bf16 at the end. This is the yardstick of the kernels'
            error rule (their error at most twice the emulation's).
        o, lse: the forward outputs ``[batch, H, sq, dv]`` / ``[batch, H, sq]`` for the computed heads
            (``H = len(heads)``, all heads by default); ``None`` for both recomputes them.
        do: ``[batch, H, sq, dv]``, the gradient of the loss w.r.t. ``o``.

    Returns:
        ``(dq, dk, dv)`` float64 with q/k/v's shapes restricted to the computed heads. Invalid slots,
        and rows without any attended key, get zero gradients. Uses ``D = rowsum(do · o)``.
    """
    q, k, v = _check_qkv(q, k, v, graph)
    b, _, sq, d = q.shape
    scale = _check_scale(scale, d)
    head_ids = _check_heads(heads, graph.heads)
    out_shape = (b, head_ids.size, sq, v.shape[-1])
    if (o is None) != (lse is None):
        raise ReferenceError("o and lse must both be given or both be None")
    if o is None:
        o, lse = attention_forward(q, k, v, graph, scale, heads=head_ids)
    o = _check_like("o", o, out_shape)
    lse = _check_like("lse", lse, out_shape[:3])
    do = _check_like("do", do, out_shape)
    index = _SlotIndex(graph)
    dq = np.zeros((b, head_ids.size, sq, d), dtype=np.float64)
    dk = np.zeros((b, head_ids.size, k.shape[2], d), dtype=np.float64)
    dv = np.zeros((b, head_ids.size, k.shape[2], v.shape[-1]), dtype=np.float64)
    for out_h, h in enumerate(head_ids):
        qh, kh, vh = (x[:, h].astype(np.float64) for x in (q, k, v))
        oh, lseh, doh = (x[:, out_h].astype(np.float64) for x in (o, lse, do))
        for i in range(graph.q.num_blocks):
            rows = index.q_rows(i)
            cols = index.k_cols(h, i)
            if rows.size == 0 or cols.size == 0:
                continue
            qb, kb, vb, dob = qh[:, rows], kh[:, cols], vh[:, cols], doh[:, rows]
            lb = lseh[:, rows, None]
            s = scale * np.matmul(qb, kb.transpose(0, 2, 1))
            p = np.where(np.isfinite(lb), np.exp(s - np.where(np.isfinite(lb), lb, 0.0)), 0.0)
            delta = (dob * oh[:, rows]).sum(axis=-1, keepdims=True)
            ds = p * (np.matmul(dob, vb.transpose(0, 2, 1)) - delta)
            if emulate_bf16:
                p, ds = _round_bf16(p), _round_bf16(ds)
            dq[:, out_h, rows] = scale * np.matmul(ds, kb)
            # K slots are unique within one Q block's gather, so fancy-index += is exact
            dk[:, out_h, cols] += scale * np.matmul(ds.transpose(0, 2, 1), qb)
            dv[:, out_h, cols] += np.matmul(p.transpose(0, 2, 1), dob)
    if emulate_bf16:
        dq, dk, dv = (_round_bf16(x) for x in (dq, dk, dv))
    return dq, dk, dv
