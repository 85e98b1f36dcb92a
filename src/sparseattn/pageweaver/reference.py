"""Float64 reference of per-query paged sparse attention over a capture (PageWeaver's semantics).

Query ``i`` of a :class:`~.captures.Capture` attends to every key of the pages it selected, except keys
at or past ``context`` and, for a causal capture, keys after its own position ``positions[i]``. Under
GQA the ``G = q_heads / kv_heads`` query heads ``hk·G … hk·G + G − 1`` share KV head ``hk`` and its
selection. A query without any valid key gets ``O = 0``, ``LSE = −inf``; ``LSE`` is the natural log of
``Σ exp(scale · q·k)``.

Shapes: ``q`` ``[q_heads, num_queries, d]``; ``k``, ``v`` ``[kv_heads, rows ≥ context, d]`` (the values
attended over: for an FP8 cache, :meth:`.fp8.Fp8KVCache.dequantized`). Work runs in chunks of queries
against every key of the context under a boolean mask (dense BLAS products; the chunk shrinks with
the context so a chunk's scores stay around 4M entries).
"""

from __future__ import annotations

import numpy as np

from ..bf16 import bf16_bits_to_float, float_to_bf16_bits
from .captures import Capture

_CHUNK = 256
_DENSE_ENTRIES = 1 << 22  # score entries per chunk (queries · heads · context)


def key_index(capture: Capture, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(keys int64 ``[n, k·P]``, valid bool ``[n, k·P]``): the key rows each query attends to."""
    P = capture.page_size
    pages = capture.pages[queries].astype(np.int64)  # [n, k]
    keys = (np.maximum(pages, 0)[:, :, None] * P + np.arange(P)).reshape(len(queries), -1)
    valid = np.repeat(pages >= 0, P, axis=1) & (keys < capture.context)
    if capture.causal:
        valid &= keys <= capture.positions[queries][:, None]
    return keys, valid


def _bf16(x: np.ndarray) -> np.ndarray:
    return bf16_bits_to_float(float_to_bf16_bits(x)).astype(np.float64)


def check_paged_qkv(q, k, v, capture: Capture, error=ValueError):
    """``q``, ``k``, ``v`` as arrays after the shape checks every paged model shares (raises ``error``)."""
    q, k, v = (np.asarray(x) for x in (q, k, v))
    if q.ndim != 3 or k.ndim != 3 or v.shape != k.shape:
        raise error(
            f"q must be [q_heads, Q, d] and k, v [kv_heads, rows, d]; got {q.shape}, {k.shape}, {v.shape}"
        )
    hq, nq, d = q.shape
    hkv = k.shape[0]
    if hkv < 1 or hq % hkv or k.shape[2] != d:
        raise error(f"q heads ({hq}) must be a multiple of kv heads ({hkv}) with the same head_dim")
    if nq != capture.num_queries or k.shape[1] < capture.context:
        raise error(
            f"q must hold the capture's {capture.num_queries} queries and k at least {capture.context} rows"
        )
    return q, k, v


def paged_attention_reference(
    q, k, v, capture: Capture, scale=None, queries=None, emulate_bf16: bool = False
):
    """(o float64 ``[q_heads, n, d]``, lse float64 ``[q_heads, n]``) for ``queries`` (default: all).

    ``emulate_bf16``: the bf16-rounding emulation of a kernel (P rounded to bf16 before P·V, O rounded
    to bf16; pass bf16-rounded K/V) — the yardstick of the kernels' error rule.
    """
    if not isinstance(capture, Capture):
        raise TypeError(f"capture must be a Capture, got {type(capture).__name__}")
    q, k, v = check_paged_qkv(q, k, v, capture)
    hq, nq, d = q.shape
    hkv = k.shape[0]
    scale = 1.0 / np.sqrt(d) if scale is None else float(scale)
    queries = np.arange(nq) if queries is None else np.asarray(queries, dtype=np.int64)
    G = hq // hkv
    L = capture.context
    chunk = max(1, min(_CHUNK, _DENSE_ENTRIES // (G * L)))
    o = np.zeros((hq, len(queries), d))
    lse = np.full((hq, len(queries)), -np.inf)
    for a in range(0, len(queries), chunk):
        sel = queries[a : a + chunk]
        keys, valid = key_index(capture, sel)
        mask = np.zeros((len(sel), L), dtype=bool)  # [n, context]: the keys each query attends to
        rows = np.broadcast_to(np.arange(len(sel))[:, None], keys.shape)
        mask[rows[valid], keys[valid]] = True
        for hk in range(hkv):
            kk = k[hk, :L].astype(np.float64)
            vv = v[hk, :L].astype(np.float64)
            qq = q[hk * G : (hk + 1) * G][:, sel].astype(np.float64)  # [G, n, d]
            s = np.where(mask, scale * np.matmul(qq, kk.T), -np.inf)  # [G, n, context]
            m = s.max(axis=-1, keepdims=True)
            has = np.isfinite(m)
            p = np.exp(s - np.where(has, m, 0.0))
            l = p.sum(axis=-1, keepdims=True)
            safe = np.where(l > 0, l, 1.0)
            pv = np.matmul(_bf16(p) if emulate_bf16 else p, vv) / safe
            o[hk * G : (hk + 1) * G, a : a + len(sel)] = _bf16(pv) if emulate_bf16 else pv
            lse[hk * G : (hk + 1) * G, a : a + len(sel)] = np.where(
                l[..., 0] > 0, m[..., 0] + np.log(safe[..., 0]), -np.inf
            )
    return o, lse
