"""PageWeaver grouping: adjacent baseline, affinity search (hand-built optima, a brute-force spec), properties."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from small_cases import page_table

from sparseattn.pageweaver.captures import Capture
from sparseattn.pageweaver.grouping import (
    Grouping,
    GroupingError,
    adjacent_groups,
    affinity_groups,
    query_bitsets,
    union_sizes,
    validate_grouping,
)


def _capture(rows, num_pages=None, causal=False, page_size=16):
    """Capture from python lists of page ids (rows padded with -1)."""
    pages = page_table(rows)
    n = num_pages or int(pages.max()) + 1
    context = n * page_size
    positions = np.full(len(rows), context - 1) if not causal else np.arange(len(rows))
    return Capture(pages, positions, context, page_size, causal=causal)


def _groups(g: Grouping) -> list[list[int]]:
    return [g.ids[a:b].tolist() for a, b in zip(g.offsets[:-1], g.offsets[1:])]


def brute_force_affinity(cap: Capture, G: int, W: int, cap_pages=None) -> list[list[int]]:
    """The search as specified, with Python sets (the spec both implementations must equal)."""
    sets = [{int(p) for p in row if p >= 0} for row in cap.pages]
    out = []
    for w0 in range(0, cap.num_queries, W):
        left = list(range(w0, min(w0 + W, cap.num_queries)))
        while left:
            group = [left.pop(0)]
            union = set(sets[group[0]])
            while len(group) < G:
                best = None
                for c in left:
                    ov = len(union & sets[c])
                    added = len(sets[c]) - ov
                    if cap_pages is not None and len(union) + added > cap_pages:
                        continue
                    key = (added, -ov, c)
                    best = key if best is None or key < best else best
                if best is None:
                    break
                group.append(best[2])
                left.remove(best[2])
                union |= sets[best[2]]
            out.append(group)
    return out


def test_adjacent_groups_hand_computed():
    g = adjacent_groups(10, 4)
    assert _groups(g) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert g.padded().tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, -1, -1]]
    assert g.group_of().tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]


def test_interleaved_topics_give_known_optimal_groups():
    """16 queries, query q follows topic q % 4 (disjoint page sets): the optimum groups by topic."""
    topics = [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    cap = _capture([topics[q % 4] for q in range(16)])
    aff = affinity_groups(cap, group_size=4, window=16)
    assert _groups(aff) == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert union_sizes(cap, aff).tolist() == [3, 3, 3, 3]
    assert union_sizes(cap, adjacent_groups(16, 4)).tolist() == [12, 12, 12, 12]


def test_window_bounds_the_candidates():
    """With a window of 4 the interleaved topics cannot meet: the groups are the adjacent ones."""
    topics = [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    cap = _capture([topics[q % 4] for q in range(16)])
    assert _groups(affinity_groups(cap, 4, window=4)) == _groups(adjacent_groups(16, 4))


def test_tie_breaking_and_union_cap_hand_computed():
    # q0 = {0,1}; q1 = {0,2} (adds 1, overlap 1); q2 = {0,1,3} (adds 1, overlap 2: preferred over q1);
    # q3 = {5,6} (adds 2, overlap 0).
    cap = _capture([[0, 1], [0, 2], [0, 1, 3], [5, 6]], num_pages=8)
    assert _groups(affinity_groups(cap, 3, 4)) == [[0, 2, 1], [3]]
    # cap 3 pages: after {0,1} + q2 = {0,1,3} nothing fits (q1 would make 4) -> the group closes early.
    assert _groups(affinity_groups(cap, 3, 4, max_union=3)) == [[0, 2], [1], [3]]


def test_equal_keys_choose_the_lower_index():
    cap = _capture([[0], [1], [1], [1]], num_pages=2)
    assert _groups(affinity_groups(cap, 2, 4)) == [[0, 1], [2, 3]]


@st.composite
def captures(draw):
    queries = draw(st.integers(1, 80))
    num_pages = draw(st.integers(1, 70))
    k = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    page_size = 16
    positions = np.sort(rng.integers(0, num_pages * page_size, queries))
    cur = positions // page_size
    score = rng.random((queries, num_pages))
    score[np.arange(num_pages)[None, :] > cur[:, None]] = -1
    top = np.argsort(-score, axis=1)[:, :k]
    ok = np.take_along_axis(score, top, axis=1) >= 0
    pages = np.sort(np.where(ok, top, num_pages), axis=1)
    pages = np.where(pages < num_pages, pages, -1).astype(np.int32)
    return Capture(pages, positions, num_pages * page_size, page_size, causal=True)


@settings(deadline=None, max_examples=60)
@given(
    cap=captures(),
    G=st.integers(1, 9),
    W=st.integers(1, 40),
    cap_extra=st.one_of(st.none(), st.integers(0, 12)),
)
def test_affinity_properties_and_brute_force_equality(cap, G, W, cap_extra):
    max_union = None if cap_extra is None else cap.k + cap_extra
    g = affinity_groups(cap, G, W, max_union)
    validate_grouping(g, cap.num_queries, G)  # every query exactly once, no group above G
    assert _groups(g) == brute_force_affinity(cap, G, W, max_union)
    members = g.padded()
    assert np.all((members < 0) | (members // W == members[:, :1] // W)), "a group crosses a window"
    u = union_sizes(cap, g)
    for grp, size in zip(_groups(g), u):
        union = set().union(*(set(cap.pages[q][cap.pages[q] >= 0].tolist()) for q in grp))
        assert size == len(union)
        for q in grp:  # the union holds every member's selection
            assert set(cap.pages[q][cap.pages[q] >= 0].tolist()) <= union
        if max_union is not None:
            assert size <= max_union


@settings(deadline=None, max_examples=30)
@given(n=st.integers(0, 200), G=st.integers(1, 20))
def test_adjacent_properties(n, G):
    g = adjacent_groups(n, G)
    validate_grouping(g, n, G)
    assert g.num_groups == -(-n // G)


def test_query_bitsets_match_pages():
    pages = np.array([[0, 63, 64, -1], [127, 5, -1, -1]], np.int32)
    bits = query_bitsets(pages, 130)
    assert bits.shape == (2, 3)
    assert bits[0].tolist() == [1 | (1 << 63), 1, 0]
    assert bits[1].tolist() == [1 << 5, 1 << 63, 0]


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        pytest.param({"group_size": 0}, GroupingError, "group_size", id="group-size-0"),
        pytest.param({"window": 2000}, GroupingError, "window", id="window-too-large"),
        pytest.param({"window": 2.5}, TypeError, "window", id="window-float"),
        pytest.param({"max_union": 1}, GroupingError, "max_union", id="cap-below-k"),
    ],
)
def test_affinity_rejects_bad_parameters(kwargs, error, match):
    cap = _capture([[0, 1], [1, 2]])
    with pytest.raises(error, match=match):
        affinity_groups(cap, **kwargs)


def test_affinity_rejects_non_capture():
    with pytest.raises(TypeError, match="capture"):
        affinity_groups(np.zeros((2, 2), np.int32))


@pytest.mark.parametrize(
    "ids,offsets,match",
    [
        pytest.param([0, 1, 1], [0, 2, 3], "more than one group", id="duplicate"),
        pytest.param([0, 1, 2], [0, 3], "more than 2", id="too-large"),
        pytest.param([0, 1, 2], [0, 1, 1, 3], "empty", id="empty-group"),
        pytest.param([0, 1], [0, 2], "shape", id="missing-query"),
    ],
)
def test_validate_grouping_names_the_problem(ids, offsets, match):
    g = Grouping(np.array(ids, np.int32), np.array(offsets, np.int32), 2)
    with pytest.raises(GroupingError, match=match):
        validate_grouping(g, 3, 2)
