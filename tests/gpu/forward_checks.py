"""Checking a GPU forward against the float64 reference with FlashAttention's error rule.

The kernel's error must be at most twice that of a bf16-rounding emulation of the same computation
(float64 softmax, P rounded to bf16 before P·V, O rounded to bf16), both in norm over all valid rows
and as the largest per-row error, so one wrong row fails even when the norm hides it. Inputs are
fresh random bf16 values with NaN in every padding slot; outputs are NaN-poisoned before the launch,
so an unwritten valid element shows up and a written padding row too.
"""

from __future__ import annotations

import numpy as np

from sparseattn.graph import HeadStack, SparseGraph
from sparseattn.kernels.validate import bf16_bits_to_float, float_to_bf16_bits

BF16_NAN = 0x7FC0
LSE_ABS_TOL = 1e-3
ERR_FACTOR = 2.0
ERR_FLOOR = 1e-5  # absolute slack for outputs whose emulated error happens to be ~0


def heads_of(graph) -> list[SparseGraph]:
    """Single-head graphs, one per head (a HeadStack's own, or the heads of one graph)."""
    return list(HeadStack.of(graph).graphs)


def slots_of(graph) -> tuple[int, int, int]:
    stack = HeadStack.of(graph)
    return stack.heads, stack.q_slots, stack.k_slots


def q_valid_of(graph) -> np.ndarray:
    """bool [heads, q_slots]."""
    return HeadStack.of(graph).q_valid()


def random_inputs(rng, graph, batch: int, head_dim: int):
    """bf16 bits (numpy uint16) of random Q, K, V with NaN in every padding slot of every head."""
    h, sq, sk = slots_of(graph)
    out = []
    for side, slots in (("q", sq), ("k", sk), ("k", sk)):
        x = float_to_bf16_bits(rng.standard_normal((batch, h, slots, head_dim), dtype=np.float32))
        for head, g in enumerate(heads_of(graph)):
            layout = g.q if side == "q" else g.k
            valid = np.zeros(slots, dtype=bool)
            valid[: layout.num_slots] = layout.valid
            x[:, head, ~valid] = BF16_NAN
        out.append(x)
    return out


def _bf16_round(x: np.ndarray) -> np.ndarray:
    return bf16_bits_to_float(float_to_bf16_bits(x)).astype(np.float64)


def reference_and_emulation(q, k, v, graph, scale: float):
    """(o_ref, lse_ref, o_emul) float64 over [batch, heads, q_slots(, d)]: the exact result and the
    bf16-rounding emulation; rows a head does not have are NaN."""
    b, h, sq, d = q.shape
    o_ref = np.full((b, h, sq, d), np.nan)
    o_emul = np.full((b, h, sq, d), np.nan)
    lse_ref = np.full((b, h, sq), np.nan)
    for head, g in enumerate(heads_of(graph)):
        nq, nk = g.q.num_slots, g.k.num_slots
        mask = g.token_mask(0)  # [nq, nk]
        qh = np.nan_to_num(q[:, head, :nq].astype(np.float64))
        kh = np.nan_to_num(k[:, head, :nk].astype(np.float64))
        vh = np.nan_to_num(v[:, head, :nk].astype(np.float64))
        s = scale * np.matmul(qh, kh.transpose(0, 2, 1))
        s = np.where(mask[None], s, -np.inf)
        m = s.max(axis=-1, keepdims=True)
        has = np.isfinite(m)
        p = np.exp(s - np.where(has, m, 0.0))
        l = p.sum(axis=-1, keepdims=True)
        safe_l = np.where(l > 0, l, 1.0)
        o_ref[:, head, :nq] = np.matmul(p, vh) / safe_l
        o_emul[:, head, :nq] = _bf16_round(np.matmul(_bf16_round(p), vh) / safe_l)
        lse_ref[:, head, :nq] = np.where(l[..., 0] > 0, m[..., 0] + np.log(safe_l[..., 0]), -np.inf)
    return o_ref, lse_ref, o_emul


def check_forward(o_bits, lse, q, k, v, graph, scale: float) -> dict:
    """Assert the kernel's (o, lse) against the reference; returns the error figures."""
    qf, kf, vf = (bf16_bits_to_float(x) for x in (q, k, v))
    o_ref, lse_ref, o_emul = reference_and_emulation(qf, kf, vf, graph, scale)
    valid = q_valid_of(graph)  # [heads, sq]
    got = bf16_bits_to_float(o_bits).astype(np.float64)
    vo, vr, ve = got[:, valid], o_ref[:, valid], o_emul[:, valid]  # [batch, rows, d]
    assert not np.isnan(vo).any(), "NaN (unwritten or leaked) in a valid output row"
    assert not np.isnan(lse[:, valid]).any(), "NaN in a valid LSE entry"
    norm = max(np.linalg.norm(vr), 1e-30)
    rel, rel_emul = np.linalg.norm(vo - vr) / norm, np.linalg.norm(ve - vr) / norm
    row_err, row_err_emul = np.abs(vo - vr).max(axis=-1), np.abs(ve - vr).max(axis=-1)
    worst = np.unravel_index(np.argmax(row_err), row_err.shape)
    assert rel <= ERR_FACTOR * rel_emul + ERR_FLOOR, (
        f"‖o − ref‖/‖ref‖ = {rel:.2e} > 2 × emulation {rel_emul:.2e}"
    )
    assert row_err.max() <= ERR_FACTOR * row_err_emul.max() + ERR_FLOOR, (
        f"row {worst}: max |o − ref| = {row_err.max():.2e} > 2 × emulation's worst row {row_err_emul.max():.2e}"
    )
    lv, lr = lse[:, valid].astype(np.float64), lse_ref[:, valid]
    empty = np.isneginf(lr)
    assert np.array_equal(np.isneginf(lv), empty), "LSE is -inf exactly where a row has no key"
    assert np.all(vo[empty] == 0.0), "rows without keys must have o = 0"
    lse_err = float(np.abs(lv[~empty] - lr[~empty]).max()) if (~empty).any() else 0.0
    assert lse_err < LSE_ABS_TOL, f"max |lse − ref| = {lse_err:.3e}"
    pad = ~valid
    assert np.all(o_bits[:, pad] == BF16_NAN), "a padding query row of o was written"
    assert np.isnan(lse[:, pad]).all(), "a padding query row of lse was written"
    return {
        "rel": float(rel),
        "rel_emul": float(rel_emul),
        "row_max": float(row_err.max()),
        "row_max_emul": float(row_err_emul.max()),
        "lse_err": lse_err,
        "empty_rows": int(empty.sum()),
    }
