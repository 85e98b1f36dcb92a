"""Per-query page selection in torch (Quest scores, sink + local + top budgets) against brute-force
definitions on small random inputs, and its output as a valid PageWeaver capture."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from sparseattn.pageweaver.captures import Capture
from sparseattn.pageweaver.page_select import page_extremes, quest_scores, select_pages


def test_quest_bound_is_the_max_over_each_page_of_the_per_dimension_products():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(4, 7, 16, generator=g)  # 4 heads on 2 KV heads
    k = torch.randn(2, 45, 16, generator=g)
    kmax, kmin = page_extremes(k, 8)
    got = quest_scores(q, kmax, kmin)
    want = np.zeros((7, kmax.shape[1]))
    for h in range(4):
        kv = k[h // 2].numpy()
        for i in range(7):
            for p in range(kmax.shape[1]):
                keys = kv[p * 8 : (p + 1) * 8]
                want[i, p] += np.maximum(q[h, i].numpy() * keys.max(0), q[h, i].numpy() * keys.min(0)).sum()
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-4)
    # the bound holds: no key of a page scores above it (summed over heads, each head's own max)
    for p in range(kmax.shape[1]):
        per_head = torch.stack([(q[h] @ k[h // 2, p * 8 : (p + 1) * 8].T).amax(1) for h in range(4)]).sum(0)
        assert torch.all(per_head <= got[:, p] + 1e-4)


@pytest.mark.parametrize("budget", [(1, 2, 3), (0, 1, 5), (2, 0, 0)], ids=lambda b: "s{}l{}t{}".format(*b))
def test_selection_is_sink_local_and_top_pages_under_causality(budget):
    sink, local, top = budget
    g = torch.Generator().manual_seed(1)
    n, ps = 200, 16
    q = torch.randn(4, n, 32, generator=g)
    k = torch.randn(2, n, 32, generator=g)
    pos = torch.arange(n)
    pages = select_pages(q, k, pos, ps, sink, local, top).numpy()
    scores = quest_scores(q, *page_extremes(k, ps)).numpy()
    num_pages = -(-n // ps)
    for i in range(n):
        own = i // ps
        allowed = np.flatnonzero(np.arange(num_pages) * ps <= i)
        fixed = {p for p in allowed if p < sink or own - local < p <= own}
        rest = [p for p in allowed if p not in fixed]
        best = set(sorted(rest, key=lambda p: -scores[i, p])[:top])
        row = pages[i][pages[i] >= 0]
        assert list(row) == sorted(fixed | best), i
    cap = Capture(pages=pages, positions=pos.numpy(), context=n, page_size=ps)  # a valid capture
    assert cap.num_queries == n


@pytest.mark.parametrize(
    "budget", [(1, 2, 13), (3, 1, 40), (0, 0, 4), (20, 3, 0)], ids=lambda b: "s{}l{}t{}".format(*b)
)
def test_prefill_chunks_select_what_explicit_positions_select(monkeypatch, budget):
    """``positions=None`` (query i at i) scores chunks of queries on their causal pages only; the pages are
    those of the whole-row path with explicit positions, including budgets larger than the pages a query
    may take and chunk edges inside a page."""
    from sparseattn.pageweaver import page_select

    monkeypatch.setattr(page_select, "QUERY_CHUNK", 37)
    g = torch.Generator().manual_seed(2)
    n, ps = 300, 16
    q = torch.randn(8, n, 32, generator=g)
    k = torch.randn(2, n, 32, generator=g)
    chunked = select_pages(q, k, None, ps, *budget)
    whole = select_pages(q, k, torch.arange(n), ps, *budget)
    assert chunked.dtype == torch.int32 and chunked.shape == (n, sum(budget))
    assert torch.equal(chunked, whole)


def test_half_precision_queries_score_as_their_float32_values():
    """The clamps run in q's dtype (exact) and the head sums in float32: bf16 q scores as q.float() does."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(6, 50, 32, generator=g).bfloat16()
    k = torch.randn(3, 70, 32, generator=g).bfloat16()
    kmax, kmin = page_extremes(k, 8)
    torch.testing.assert_close(
        quest_scores(q, kmax, kmin), quest_scores(q.float(), kmax, kmin), rtol=1e-6, atol=1e-5
    )
