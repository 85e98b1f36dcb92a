"""PageWeaver analysis: the counting rules of docs/counting.md, hand-computed, and the built-in table."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sparseattn.pageweaver.analysis import (
    PER_QUERY_TILE_ROWS,
    analyze_capture,
    analyze_captures,
    grouping_counts,
    main,
    union_tile_rows,
)
from sparseattn.pageweaver.captures import Capture
from sparseattn.pageweaver.grouping import Grouping, adjacent_groups

REQUIRED = {
    "capture",
    "context",
    "page_size",
    "k",
    "queries",
    "grouping",
    "page_loads",
    "physical_pairs",
    "useful_pairs",
    "occupancy",
    "mean_union",
    "p50_union",
    "p90_union",
    "load_ratio_vs_per_query",
    "physical_ratio_vs_per_query",
    "grouping_ms_cpu",
}


def _interleaved(n_queries=16, page_size=64):
    """Query q selects topic q % 4's three pages (disjoint topics), positions at the end of the context."""
    topics = np.array([[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]], np.int32)
    pages = topics[np.arange(n_queries) % 4]
    context = 12 * page_size
    return Capture(pages, np.full(n_queries, context - 1), context, page_size, name="interleaved")


def test_counts_hand_computed():
    cap = _interleaved()
    P = 64
    pq = grouping_counts(cap, None)
    assert pq["useful_pairs"] == 16 * 3 * P
    assert pq["page_loads"] == 48
    assert pq["physical_pairs"] == PER_QUERY_TILE_ROWS * 16 * 3 * P  # R = 16 rows per query
    adj = grouping_counts(cap, adjacent_groups(16, 4))
    assert adj["page_loads"] == 4 * 12  # each adjacent group meets all four topics
    assert adj["physical_pairs"] == 4 * 16 * 12 * P  # M_g = 16 for groups of 4
    rows = analyze_capture(cap, group_size=4, window=16)
    aff = rows[2]
    assert aff["grouping"] == "affinity"
    assert aff["page_loads"] == 4 * 3 and aff["physical_pairs"] == 4 * 16 * 3 * P
    assert aff["occupancy"] == pytest.approx(16 * 3 * P / (4 * 16 * 3 * P))
    assert aff["load_ratio_vs_per_query"] == pytest.approx(4.0)
    assert aff["load_ratio_vs_adjacent"] == pytest.approx(4.0)
    assert aff["mean_union"] == 3 and aff["p90_union"] == 3
    assert REQUIRED <= set(aff)


@pytest.mark.parametrize(
    "sizes,rows", [([1, 8, 16], [16, 16, 16]), ([17, 32, 33], [32, 32, 48])], ids=["G<=16", "G>16"]
)
def test_union_tile_rows_pad_to_16(sizes, rows):
    assert union_tile_rows(np.array(sizes)).tolist() == rows


def test_groups_above_16_pay_32_rows():
    cap = _interleaved(n_queries=20)
    g = Grouping(np.arange(20, dtype=np.int32), np.array([0, 20], np.int32), 20)
    counts = grouping_counts(cap, g)
    assert counts["page_loads"] == 12 and counts["physical_pairs"] == 32 * 12 * 64


def test_analyze_accepts_a_user_capture_path(tmp_path):
    path = _interleaved().save(tmp_path / "mine.npz")
    rows = analyze_captures([path], group_size=4, window=16)
    assert [r["grouping"] for r in rows] == ["per_query", "adjacent", "affinity"]
    assert rows[0]["capture"] == "interleaved" and rows[0]["queries"] == 16


def test_builtin_table_and_json(tmp_path):
    rows = analyze_captures()
    assert len(rows) == 18
    by = {(r["capture"], r["grouping"]): r for r in rows}
    for name in {r["capture"] for r in rows}:
        pq, adj, aff = by[name, "per_query"], by[name, "adjacent"], by[name, "affinity"]
        assert aff["page_loads"] <= adj["page_loads"] < pq["page_loads"]
        assert pq["useful_pairs"] == adj["useful_pairs"] == aff["useful_pairs"]
        assert pq["occupancy"] == pytest.approx(1 / PER_QUERY_TILE_ROWS)
    out = tmp_path / "a.json"
    main(["nsa_8k", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("python -m sparseattn.pageweaver.analysis") and len(doc["rows"]) == 3
