"""The direct KV-page union's plan: entries against a Python-set spec, item structure, and the float64
emulator (per-entry partials merged by LSE) against the per-query reference."""

from __future__ import annotations

import numpy as np
import pytest
from test_pw_union_plan import HEAD_DIM, KV_HEADS, PAGE_SIZES, _capture, random_capture

from sparseattn.pageweaver.kv_page_plan import build_kv_page_plan, emulate_kv_page
from sparseattn.pageweaver.reference import paged_attention_reference
from sparseattn.pageweaver.union_plan import MEMBER_SLOTS

CASES = [
    pytest.param(P, causal, id=f"P{P}-{'causal' if causal else 'noncausal'}")
    for P in PAGE_SIZES
    for causal in (True, False)
]


@pytest.mark.parametrize("P,causal", CASES)
def test_entries_are_the_distinct_query_page_pairs_grouped_by_page(P, causal):
    cap = random_capture(P, causal)
    plan = build_kv_page_plan(cap)
    spec = sorted({(int(p), q) for q in range(cap.num_queries) for p in cap.pages[q] if p >= 0})
    got = list(zip(plan.entry_pages.tolist(), plan.ids.tolist()))
    assert got == spec
    sizes = np.diff(plan.offsets)
    assert sizes.min() >= 1 and sizes.max() <= MEMBER_SLOTS
    assert np.all(np.diff(plan.item_pages) >= 0)
    # a page's items are full but for its last one
    last_of_page = np.append(plan.item_pages[1:] != plan.item_pages[:-1], True)
    assert np.all(sizes[~last_of_page] == MEMBER_SLOTS)
    # slot_entry points every selection at its entry, padding at -1
    for q in range(cap.num_queries):
        for j, p in enumerate(cap.pages[q]):
            e = plan.slot_entry[q, j]
            assert e == -1 if p < 0 else (plan.ids[e] == q and plan.entry_pages[e] == p)


def test_small_plan_by_hand():
    cap = _capture([[2, 0], [], [1], [0, 1, 2]], positions=[40, 5, 20, 47], context=48)
    plan = build_kv_page_plan(cap, members=1)
    assert list(zip(plan.entry_pages.tolist(), plan.ids.tolist())) == [
        (0, 0),
        (0, 3),
        (1, 2),
        (1, 3),
        (2, 0),
        (2, 3),
    ]
    assert plan.item_pages.tolist() == [0, 0, 1, 1, 2, 2]
    assert plan.slot_entry.tolist() == [[4, 0, -1], [-1, -1, -1], [2, -1, -1], [1, 3, 5]]


@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("P,causal", CASES)
def test_emulator_equals_the_reference(P, causal, gqa):
    cap = random_capture(P, causal)
    rng = np.random.default_rng(7 * P + gqa + causal)
    q = rng.standard_normal((KV_HEADS * gqa, cap.num_queries, HEAD_DIM))
    k = rng.standard_normal((KV_HEADS, cap.context, HEAD_DIM))
    v = rng.standard_normal((KV_HEADS, cap.context, HEAD_DIM))
    ro, rlse = paged_attention_reference(q, k, v, cap, 0.3)
    o, lse = emulate_kv_page(build_kv_page_plan(cap), cap, q, k, v, 0.3)
    assert np.array_equal(np.isneginf(lse), np.isneginf(rlse))
    np.testing.assert_allclose(o, ro, rtol=0, atol=1e-10)
    np.testing.assert_allclose(lse, rlse, rtol=0, atol=1e-10)


def test_bad_arguments():
    cap = random_capture(16, True)
    with pytest.raises(TypeError, match="capture"):
        build_kv_page_plan(cap.pages)
    with pytest.raises(ValueError, match="members"):
        build_kv_page_plan(cap, members=9)
