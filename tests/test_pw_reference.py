"""PageWeaver float64 reference of paged sparse attention vs a brute-force dense masked softmax."""

from __future__ import annotations

import numpy as np
import pytest
from small_cases import page_table

from sparseattn.pageweaver.captures import Capture, GeneratorConfig, generate_capture
from sparseattn.pageweaver.reference import key_index, paged_attention_reference


def _capture(rows, positions, context, page_size=16, causal=True):
    pages = page_table(rows)
    return Capture(pages, np.asarray(positions), context, page_size, causal=causal)


def hand_capture(causal):
    """6 queries, 6 pages of 16, context 91 (page 5 partial); query 4 selects nothing."""
    rows = [[0, 1, 2], [1, 2, 3], [5], [2, 4], [], [0, 5]]
    return _capture(rows, [40, 60, 85, 70, 10, 90], context=91, causal=causal)


def small_random_capture(causal):
    cfg = GeneratorConfig(
        context=300, page_size=16, num_queries=40, budget_tokens=96, sink_tokens=16, local_tokens=32, seed=5
    )
    cap = generate_capture(cfg)
    pages = cap.pages.copy()
    pages[7] = -1
    return Capture(pages, cap.positions, cap.context, 16, causal=causal)


def dense_mask(cap: Capture) -> np.ndarray:
    """bool [Q, context] from the definition, one key at a time."""
    mask = np.zeros((cap.num_queries, cap.context), bool)
    P = cap.page_size
    for i in range(cap.num_queries):
        for p in cap.pages[i]:
            if p < 0:
                continue
            for t in range(p * P, min((p + 1) * P, cap.context)):
                if not cap.causal or t <= cap.positions[i]:
                    mask[i, t] = True
    return mask


def dense_attention(q, k, v, mask, scale):
    """Masked softmax attention over every key, float64; rows without a key: o = 0, lse = -inf."""
    hq, G = q.shape[0], q.shape[0] // k.shape[0]
    ctx = mask.shape[1]
    o = np.zeros(q.shape)
    lse = np.full(q.shape[:2], -np.inf)
    for h in range(hq):
        s = scale * q[h] @ k[h // G, :ctx].T  # [Q, context]
        for i in range(q.shape[1]):
            if not mask[i].any():
                continue
            si = s[i][mask[i]]
            m = si.max()
            w = np.exp(si - m)
            o[h, i] = w @ v[h // G, :ctx][mask[i]] / w.sum()
            lse[h, i] = m + np.log(w.sum())
    return o, lse


CAPTURES = {
    "hand-causal": lambda: hand_capture(True),
    "hand-noncausal": lambda: hand_capture(False),
    "random-causal": lambda: small_random_capture(True),
    "random-noncausal": lambda: small_random_capture(False),
}


@pytest.mark.parametrize("scale", [None, 0.7], ids=["default-scale", "scale0.7"])
@pytest.mark.parametrize("gqa", [1, 2], ids=["gqa1", "gqa2"])
@pytest.mark.parametrize("name", list(CAPTURES))
def test_reference_equals_dense_masked_attention(name, gqa, scale):
    cap = CAPTURES[name]()
    rng = np.random.default_rng(gqa)
    d = 8
    q = rng.standard_normal((2 * gqa, cap.num_queries, d))
    k = rng.standard_normal((2, cap.context, d))  # exactly context rows (the last page is partial)
    v = rng.standard_normal((2, cap.context, d))
    o, lse = paged_attention_reference(q, k, v, cap, scale=scale)
    mask = dense_mask(cap)
    want_o, want_lse = dense_attention(q, k, v, mask, 1 / np.sqrt(d) if scale is None else scale)
    empty = ~mask.any(axis=1)
    assert empty.any()  # the capture has a row without a key
    assert np.isneginf(lse[:, empty]).all() and not o[:, empty].any()
    assert np.array_equal(np.isneginf(lse), np.isneginf(want_lse))
    np.testing.assert_allclose(o, want_o, rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=0, atol=1e-12)


def test_causal_mask_inside_the_own_page():
    """Query at position 40 selecting its own page 2 sees keys 32..40 only; non-causal, all of 32..47."""
    for causal, last in ((True, 40), (False, 47)):
        cap = _capture([[2]], [40], context=64, causal=causal)
        keys, valid = key_index(cap, np.array([0]))
        assert keys.tolist() == [list(range(32, 48))]
        assert np.flatnonzero(valid[0]).tolist() == list(range(last - 31))


def test_queries_subset_matches_the_full_run():
    cap = small_random_capture(True)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((4, cap.num_queries, 8))
    k = rng.standard_normal((2, cap.context, 8))
    v = rng.standard_normal((2, cap.context, 8))
    o, lse = paged_attention_reference(q, k, v, cap)
    sel = np.array([39, 0, 7, 12])
    o2, lse2 = paged_attention_reference(q, k, v, cap, queries=sel)
    np.testing.assert_array_equal(o2, o[:, sel])
    np.testing.assert_array_equal(lse2, lse[:, sel])


def test_emulate_bf16_rounds_the_output():
    cap = hand_capture(True)
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, cap.num_queries, 8))
    k = rng.standard_normal((1, cap.context, 8))
    v = rng.standard_normal((1, cap.context, 8))
    o, lse = paged_attention_reference(q, k, v, cap)
    ob, lseb = paged_attention_reference(q, k, v, cap, emulate_bf16=True)
    np.testing.assert_array_equal(lseb, lse)
    np.testing.assert_array_equal(ob.astype(np.float32).astype(np.float64), ob)
    assert (ob.view(np.uint64) & ((1 << 45) - 1) == 0).all()  # at most 8 significant bits: bf16 values
    np.testing.assert_allclose(ob, o, atol=2e-2)


@pytest.mark.parametrize(
    "change,error,match",
    [
        pytest.param(
            dict(capture=np.zeros((6, 3))), TypeError, "capture must be a Capture", id="not-a-capture"
        ),
        pytest.param(dict(q=np.zeros((3, 6, 8))), ValueError, r"q heads \(3\)", id="q-heads"),
        pytest.param(dict(q=np.zeros((2, 5, 8))), ValueError, "6 queries", id="q-queries"),
        pytest.param(
            dict(k=np.zeros((2, 90, 8)), v=np.zeros((2, 90, 8))), ValueError, "91 rows", id="k-short"
        ),
        pytest.param(dict(v=np.zeros((2, 91, 4))), ValueError, "k, v", id="v-shape"),
    ],
)
def test_reference_rejects_bad_arguments(change, error, match):
    args = dict(
        q=np.zeros((2, 6, 8)), k=np.zeros((2, 91, 8)), v=np.zeros((2, 91, 8)), capture=hand_capture(True)
    )
    args.update(change)
    with pytest.raises(error, match=match):
        paged_attention_reference(**args)
