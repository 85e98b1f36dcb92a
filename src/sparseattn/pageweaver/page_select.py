"""Per-query page selection on the tensors' device, in torch: Quest-style page scores from a layer's own
Q and K, and NSA/DSA-like budgets (sink pages + local pages + the top-scoring others).

Quest bounds the attention score of a query ``q`` on a page by ``Σ_d max(q_d · kmax_d, q_d · kmin_d)``,
``kmax`` / ``kmin`` the elementwise extremes of the page's keys; that is ``relu(q) · kmax + min(q, 0) ·
kmin``. A query's score of a page is this bound summed over the query heads (GQA: query head ``h`` reads
KV head ``h // G``; being linear in ``relu(q)`` and ``min(q, 0)``, the sum is one matrix product over
``kv_heads · 2d``), so every head of a query shares its selection, as a
PageWeaver capture does (:class:`~sparseattn.pageweaver.captures.Capture`: ``pages [Q, k]``, valid ids
first, ``-1`` padding, no duplicates).

Causal: a query at position ``t`` may select the pages that start at or before ``t``. Its budget: the first
``sink`` pages, the ``local`` pages ending at its own page, then the ``top`` highest-scoring pages among the
rest. Shapes are static (``[Q, sink + local + top]``) and nothing synchronises
with the host.
"""

from __future__ import annotations

import torch


def page_extremes(k: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kmax, kmin)`` float32 ``[kv_heads, pages, d]`` of ``k`` ``[kv_heads, L, d]`` by pages of ``page_size``
    keys (the last page may be short)."""
    hkv, n, d = k.shape
    pages = -(-n // page_size)
    pad = pages * page_size - n
    kf = k.float()
    hi = torch.nn.functional.pad(kf, (0, 0, 0, pad), value=float("-inf")).view(hkv, pages, page_size, d)
    lo = torch.nn.functional.pad(kf, (0, 0, 0, pad), value=float("inf")).view(hkv, pages, page_size, d)
    return hi.amax(2), lo.amin(2)


def quest_scores(q: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor) -> torch.Tensor:
    """float32 ``[Q, pages]``: Quest's bound of every query on every page, summed over the query heads.
    ``q`` ``[heads, Q, d]``; ``kmax`` / ``kmin`` ``[kv_heads, pages, d]`` (``heads`` a multiple of
    ``kv_heads``)."""
    hq, nq, d = q.shape
    hkv = kmax.shape[0]
    if hq % hkv:
        raise ValueError(f"q has {hq} heads, not a multiple of the {hkv} KV heads")
    g = hq // hkv
    # The bound is linear in relu(q) and min(q, 0), so the sum over a KV head's G query heads goes in
    # first, and the sum over KV heads is the inner dimension of one product:
    # [Q, kv_heads · 2d] @ [kv_heads · 2d, pages], no [heads, Q, pages] intermediate.
    qf = q.float().reshape(hkv, g, nq, d)
    a = torch.cat([qf.clamp(min=0).sum(1), qf.clamp(max=0).sum(1)], -1)  # [kv_heads, Q, 2d]
    b = torch.cat([kmax.float(), kmin.float()], -1)  # [kv_heads, pages, 2d]
    pages = b.shape[1]
    return a.permute(1, 0, 2).reshape(nq, hkv * 2 * d) @ b.permute(0, 2, 1).reshape(hkv * 2 * d, pages)


def select_pages(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    page_size: int,
    sink: int,
    local: int,
    top: int,
) -> torch.Tensor:
    """int32 ``[Q, sink + local + top]``: each query's pages (ascending, ``-1`` padding at the end).

    Args:
        q: ``[heads, Q, d]`` queries; k: ``[kv_heads, L, d]`` keys of the context (``L`` tokens).
        positions: int ``[Q]``: each query's position in the context (causal).
        page_size: keys per page; sink, local, top: the budget's parts (pages).
    """
    if min(sink, local, top) < 0 or sink + local + top < 1:
        raise ValueError(f"sink, local and top must be >= 0 with a positive sum, got {sink}, {local}, {top}")
    kmax, kmin = page_extremes(k, page_size)
    pages = kmax.shape[1]
    scores = quest_scores(q, kmax, kmin)  # [Q, pages]
    pos = positions.long().to(q.device)
    page = torch.arange(pages, device=q.device)
    own = (pos // page_size).unsqueeze(1)  # [Q, 1]
    allowed = page * page_size <= pos.unsqueeze(1)
    fixed = allowed & ((page < sink) | ((page <= own) & (page > own - local)))
    others = allowed & ~fixed
    t = min(top, pages)
    ranked = scores.masked_fill(~others, float("-inf"))
    best = ranked.topk(t, dim=1) if t else None
    chosen = fixed.clone()
    if best is not None:  # the top pages that exist (a -inf score is a page the query may not take)
        chosen |= torch.zeros_like(chosen).scatter_(1, best.indices, torch.isfinite(best.values))
    width = sink + local + top
    # the chosen page ids first, ascending; -1 after them
    key = torch.where(chosen, page, pages + page)  # distinct per row: the smallest are the chosen ids
    key = key.topk(min(width, pages), dim=1, largest=False, sorted=True).values
    out = torch.where(key < pages, key, -1).to(torch.int32)
    if out.shape[1] < width:
        out = torch.nn.functional.pad(out, (0, width - out.shape[1]), value=-1)
    return out
