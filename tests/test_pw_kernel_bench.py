"""The PageWeaver kernel benchmark's work counts (CPU): physical steps and chunks against brute force."""

from __future__ import annotations

import pytest
from test_pw_union_plan import PAGE_SIZES, random_capture

from sparseattn.pageweaver.grouping import adjacent_groups
from sparseattn.pageweaver.kernel_bench import per_query_steps, union_chunks


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("P", PAGE_SIZES, ids=lambda p: f"P{p}")
def test_per_query_steps_count_the_visible_page_parts(P, causal):
    cap = random_capture(P, causal)
    expected = 0
    for q in range(cap.num_queries):
        limit = min(cap.context - 1, int(cap.positions[q])) if cap.causal else cap.context - 1
        for p in cap.pages[q]:
            if p >= 0:
                expected += sum(1 for s in range(0, P, 16) if p * P + s <= limit)
    assert per_query_steps(cap) == expected


@pytest.mark.parametrize("pack", [1, 3, 8], ids=lambda n: f"pack{n}")
@pytest.mark.parametrize("P", PAGE_SIZES, ids=lambda p: f"P{p}")
def test_union_chunks_count_64_key_chunks_of_each_union(P, pack):
    """Σ over tiles of ⌈|union of the tile's groups| · P / 64⌉, a tile = ``pack`` consecutive groups."""
    cap = random_capture(P, True)
    grouping = adjacent_groups(cap.num_queries, 8)
    expected = 0
    starts = list(range(0, grouping.num_groups, pack))
    for t in starts:
        a, b = grouping.offsets[t], grouping.offsets[min(t + pack, grouping.num_groups)]
        union = {int(p) for q in grouping.ids[a:b] for p in cap.pages[q] if p >= 0}
        expected += -(-len(union) * P // 64)
    assert union_chunks(cap, grouping, pack) == expected
