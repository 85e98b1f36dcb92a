"""The float64 reference against dense masked attention computed the plain way."""

from __future__ import annotations

import numpy as np
import pytest
from small_cases import SMALL_CASES, make_graph, rel_err, small_layouts

from sparseattn.graph import SparseGraph
from sparseattn.layouts import slot_layout, video_layout
from sparseattn.reference import (
    ReferenceError,
    ReferenceTypeError,
    attention_backward,
    attention_forward,
)

RTOL = 1e-12


def make_tensors(q_layout, k_layout, batch, heads, d, seed, dv=None):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, heads, q_layout.num_slots, d))
    k = rng.standard_normal((batch, heads, k_layout.num_slots, d))
    v = rng.standard_normal((batch, heads, k_layout.num_slots, dv or d))
    return q, k, v


def dense_forward(q, k, v, graph, scale):
    """Plain dense masked softmax over all slots (small cases only)."""
    b, heads, sq, _ = q.shape
    o = np.zeros((b, heads, sq, v.shape[-1]))
    lse = np.full((b, heads, sq), -np.inf)
    for h in range(heads):
        mask = graph.token_mask(h)
        rows = mask.any(axis=1)
        s = scale * np.einsum("bqd,bkd->bqk", q[:, h], k[:, h])
        s = np.where(mask, s, -np.inf)[:, rows]
        m = s.max(axis=-1, keepdims=True)
        p = np.exp(s - m)
        l_sum = p.sum(axis=-1, keepdims=True)
        o[:, h, rows] = np.einsum("bqk,bkd->bqd", p / l_sum, np.where(graph.k.valid[:, None], v[:, h], 0))
        lse[:, h, rows] = (m + np.log(l_sum))[..., 0]
    return o, lse


def dense_backward(q, k, v, do, graph, scale):
    """Textbook softmax-attention gradients on the dense masked problem."""
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    _, lse = dense_forward(q, k, v, graph, scale)
    for h in range(q.shape[1]):
        mask = graph.token_mask(h)
        s = scale * np.einsum("bqd,bkd->bqk", q[:, h], k[:, h])
        p = np.where(mask, np.exp(s - np.where(np.isfinite(lse[:, h]), lse[:, h], 0)[..., None]), 0.0)
        dv[:, h] = np.einsum("bqk,bqd->bkd", p, do[:, h])
        dp = np.einsum("bqd,bkd->bqk", do[:, h], v[:, h])
        ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
        dq[:, h] = scale * np.einsum("bqk,bkd->bqd", ds, k[:, h])
        dk[:, h] = scale * np.einsum("bqk,bqd->bkd", ds, q[:, h])
    return dq, dk, dv


@pytest.mark.parametrize("case", SMALL_CASES)
def test_forward_matches_dense_masked_softmax(case):
    ql, kl = small_layouts(case)
    graph = make_graph(ql, kl, heads=2, density=0.35, seed=1)
    q, k, v = make_tensors(ql, kl, batch=2, heads=2, d=8, seed=2)
    o, lse = attention_forward(q, k, v, graph)
    o_ref, lse_ref = dense_forward(q, k, v, graph, 1 / np.sqrt(8))
    assert np.array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    assert rel_err(o, o_ref) < RTOL and rel_err(lse, lse_ref) < RTOL
    assert not np.isnan(o).any() and not np.isnan(lse).any()


@pytest.mark.parametrize("case", SMALL_CASES)
def test_backward_matches_dense_formula(case):
    ql, kl = small_layouts(case)
    graph = make_graph(ql, kl, heads=2, density=0.35, seed=3)
    q, k, v = make_tensors(ql, kl, batch=2, heads=2, d=8, seed=4)
    o, lse = attention_forward(q, k, v, graph, scale=0.3)
    do = np.random.default_rng(5).standard_normal(o.shape)
    got = attention_backward(q, k, v, o, lse, do, graph, scale=0.3)
    want = dense_backward(q, k, v, do, graph, 0.3)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert rel_err(g, w) < RTOL, name


@pytest.mark.parametrize("case", SMALL_CASES[:4])
def test_backward_bf16_emulation_rounds_where_a_kernel_does(case):
    """The emulation (the GPU backward's yardstick) differs from the exact gradients by bf16 rounding
    only: outputs are bf16 values, the difference is small and not zero."""
    from sparseattn.bf16 import bf16_bits_to_float, float_to_bf16_bits

    ql, kl = small_layouts(case)
    graph = make_graph(ql, kl, heads=2, density=0.35, seed=3)
    q, k, v = make_tensors(ql, kl, batch=1, heads=2, d=16, seed=4)
    o, lse = attention_forward(q, k, v, graph)
    do = np.random.default_rng(5).standard_normal(o.shape)
    exact = attention_backward(q, k, v, o, lse, do, graph)
    emul = attention_backward(q, k, v, o, lse, do, graph, emulate_bf16=True)
    for name, g, w in zip(("dq", "dk", "dv"), emul, exact):
        assert np.array_equal(g, bf16_bits_to_float(float_to_bf16_bits(g))), f"{name}: not bf16 values"
        assert 1e-5 < rel_err(g, w) < 2e-2, name


def test_empty_selections_give_zero_output_and_neg_inf_lse():
    lay = video_layout((3, 10, 10), (2, 8, 8), 64)  # edge tiles leave whole 64-slot blocks empty
    empty_k = np.flatnonzero(lay.valid_rows == 0)
    assert empty_k.size
    mask = np.zeros((1, lay.num_blocks, lay.num_blocks), dtype=bool)
    mask[0, 0, 0] = True  # Q block 0: one real block
    mask[0, 1, empty_k] = True  # Q block 1: only empty K blocks; the rest: nothing selected
    graph = SparseGraph.from_block_mask(lay, lay, mask, drop_empty=False)
    q, k, v = make_tensors(lay, lay, 1, 1, 4, seed=0)
    o, lse = attention_forward(q, k, v, graph)
    rows0 = np.flatnonzero(lay.valid[:64])
    assert np.isfinite(lse[0, 0, rows0]).all()
    rest = np.ones(lay.num_slots, dtype=bool)
    rest[rows0] = False
    assert (o[0, 0, rest] == 0).all() and np.isneginf(lse[0, 0, rest]).all()
    dq, dk, dv = attention_backward(q, k, v, o, lse, np.ones_like(o), graph)
    assert (dq[0, 0, rest] == 0).all() and (dk[0, 0, 64:] == 0).all() and (dv[0, 0, 64:] == 0).all()
    assert not any(np.isnan(x).any() for x in (o, lse, dq, dk, dv))


def test_padding_contents_never_matter():
    ql, kl = small_layouts("video-5x7x9-tile2x4x4-B64-inplace")
    graph = make_graph(ql, kl, 2, 0.5, seed=8)
    q, k, v = make_tensors(ql, kl, 1, 2, 8, seed=9)
    o, lse = attention_forward(q, k, v, graph)
    do = np.random.default_rng(10).standard_normal(o.shape)
    grads = attention_backward(q, k, v, o, lse, do, graph)
    poisoned = [x.copy() for x in (q, k, v)]
    for x, lay in zip(poisoned, (ql, kl, kl)):
        x[:, :, ~lay.valid] = np.nan
    do_p = do.copy()
    do_p[:, :, ~ql.valid] = np.nan
    o_p, lse_p = attention_forward(*poisoned, graph)
    assert np.array_equal(o_p, o) and np.array_equal(lse_p, lse)
    for g, w in zip(attention_backward(*poisoned, o_p, lse_p, do_p, graph), grads):
        assert np.array_equal(g, w)


def test_backward_matches_finite_differences():
    lay = slot_layout(np.array([1] * 10 + [0] * 6 + [1] * 3 + [0] * 13, dtype=bool), 16)
    klay = slot_layout(np.array([0] * 4 + [1] * 12 + [1] * 16 + [0] * 9 + [1] * 7, dtype=bool), 16)
    graph = SparseGraph.from_block_mask(lay, klay, np.array([[1, 0, 1], [1, 1, 0]], dtype=bool))
    q, k, v = make_tensors(lay, klay, 1, 1, 3, seed=11)
    w = np.random.default_rng(12).standard_normal((1, 1, lay.num_slots, 3))

    def loss(qq, kk, vv):
        return float((attention_forward(qq, kk, vv, graph)[0] * w).sum())

    o, lse = attention_forward(q, k, v, graph)
    grads = attention_backward(q, k, v, o, lse, w, graph)
    eps = 1e-6
    for x, g in zip((q, k, v), grads):
        fd = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            old = x[idx]
            x[idx] = old + eps
            up = loss(q, k, v)
            x[idx] = old - eps
            down = loss(q, k, v)
            x[idx] = old
            fd[idx] = (up - down) / (2 * eps)
        np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-8)


def test_heads_subset_and_recompute():
    ql, kl = small_layouts("partition-Q32-K64-independent")
    graph = make_graph(ql, kl, 3, 0.4, seed=13)
    q, k, v = make_tensors(ql, kl, 2, 3, 8, seed=14, dv=5)
    o, lse = attention_forward(q, k, v, graph)
    o2, lse2 = attention_forward(q, k, v, graph, heads=[2, 0])
    assert np.array_equal(o2, o[:, [2, 0]]) and np.array_equal(lse2, lse[:, [2, 0]])
    do = np.random.default_rng(15).standard_normal(o.shape)
    full = attention_backward(q, k, v, o, lse, do, graph)
    sub = attention_backward(q, k, v, None, None, do[:, [2, 0]], graph, heads=[2, 0])
    for g, w in zip(sub, full):
        assert np.array_equal(g, w[:, [2, 0]])


def test_low_precision_inputs_are_computed_in_float64():
    ql, kl = small_layouts("video-5x7x9-tile2x4x4-B32-prefix")
    graph = make_graph(ql, kl, 1, 0.4, seed=16)
    q, k, v = (x.astype(np.float16) for x in make_tensors(ql, kl, 1, 1, 16, seed=17))
    o, lse = attention_forward(q, k, v, graph)
    o64, lse64 = attention_forward(*(x.astype(np.float64) for x in (q, k, v)), graph)
    assert o.dtype == np.float64 and np.array_equal(o, o64) and np.array_equal(lse, lse64)


@pytest.mark.parametrize(
    "mutate, error, match",
    [
        (lambda a: a.update(q=a["q"][:, :1]), ReferenceError, "q has 1 heads"),
        (lambda a: a.update(q=a["q"][:, :, :16]), ReferenceError, "q has 16 slots"),
        (lambda a: a.update(k=a["k"][..., :4]), ReferenceError, "k must have shape"),
        (lambda a: a.update(v=a["v"][:, :, :16]), ReferenceError, "v must have shape"),
        (lambda a: a.update(q=a["q"].astype(np.int32)), ReferenceTypeError, "q must hold floating"),
        (lambda a: a.update(graph="graph"), ReferenceTypeError, "graph must be a SparseGraph"),
        (lambda a: a.update(scale=0.0), ReferenceError, "scale must be finite"),
        (lambda a: a.update(heads=[5]), ReferenceError, "heads must lie in"),
    ],
    ids=["heads", "slots", "k-dim", "v-slots", "int-dtype", "graph-type", "scale", "head-subset"],
)
def test_forward_rejects_bad_arguments(mutate, error, match):
    ql, kl = small_layouts("video-5x7x9-tile2x4x4-B32-prefix")
    q, k, v = make_tensors(ql, kl, 1, 2, 8, seed=0)
    graph = make_graph(ql, kl, 2, 0.3, seed=0)
    args = {"q": q, "k": k, "v": v, "graph": graph, "scale": None, "heads": None}
    mutate(args)
    with pytest.raises(error, match=match):
        attention_forward(**args)


def test_backward_rejects_mismatched_outputs():
    ql, kl = small_layouts("video-5x7x9-tile2x4x4-B32-prefix")
    q, k, v = make_tensors(ql, kl, 1, 2, 8, seed=0)
    graph = make_graph(ql, kl, 2, 0.3, seed=0)
    o, lse = attention_forward(q, k, v, graph)
    with pytest.raises(ReferenceError, match="do must have shape"):
        attention_backward(q, k, v, o, lse, o[:, :1], graph)
    with pytest.raises(ReferenceError, match="lse must have shape"):
        attention_backward(q, k, v, o, lse[..., :-1], o, graph)
    with pytest.raises(ReferenceError, match="both be given"):
        attention_backward(q, k, v, o, None, o, graph)
