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


#: Queries per chunk of a prefill's selection (``positions=None``): each chunk scores only the pages
#: that start at or before its last query, about half of a causal prefill's [Q, pages] product and top-k.
QUERY_CHUNK = 4096


def quest_operands(
    q: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a, b)`` float32, ``a`` ``[Q, kv_heads · 2d]`` and ``b`` ``[kv_heads · 2d, pages]``, with ``a @ b`` the
    Quest bound of :func:`quest_scores`. The bound is linear in ``relu(q)`` and ``min(q, 0)``, so the sum
    over a KV head's G query heads goes in first and the sum over KV heads is the inner dimension of one
    product (no ``[heads, Q, pages]`` intermediate); the clamps run in ``q``'s dtype (exact) and only the
    sums are float32."""
    hq, nq, d = q.shape
    hkv = kmax.shape[0]
    if hq % hkv:
        raise ValueError(f"q has {hq} heads, not a multiple of the {hkv} KV heads")
    qg = q.reshape(hkv, hq // hkv, nq, d)
    pos = qg.clamp(min=0).sum(1, dtype=torch.float32)
    neg = qg.clamp(max=0).sum(1, dtype=torch.float32)
    a = torch.cat([pos, neg], -1).permute(1, 0, 2).reshape(nq, hkv * 2 * d)  # [Q, kv_heads · 2d]
    b = torch.cat([kmax.float(), kmin.float()], -1)  # [kv_heads, pages, 2d]
    return a, b.permute(0, 2, 1).reshape(hkv * 2 * d, b.shape[1])


def quest_scores(q: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor) -> torch.Tensor:
    """float32 ``[Q, pages]``: Quest's bound of every query on every page, summed over the query heads.
    ``q`` ``[heads, Q, d]``; ``kmax`` / ``kmin`` ``[kv_heads, pages, d]`` (``heads`` a multiple of
    ``kv_heads``)."""
    a, b = quest_operands(q, kmax, kmin)
    return a @ b


def _select_rows(scores, pos, page_size: int, sink: int, local: int, top: int) -> torch.Tensor:
    """int32 ``[n, sink + local + top]`` of queries at ``pos`` ``[n]`` from their ``scores`` ``[n, P]`` on the
    first ``P`` pages (every page a query may take among them): sink pages, local pages, the top others."""
    n, num = scores.shape
    dev = scores.device
    page = torch.arange(num, device=dev)
    own = (pos // page_size).unsqueeze(1)  # [n, 1]
    allowed = page <= own  # a page starting at or before the query: page · page_size <= pos
    fixed = allowed & ((page < sink) | (page > own - local))
    t = min(top, num)
    parts = []
    if sink:  # sink pages that exist for the query
        ids = torch.arange(sink, device=dev).expand(n, sink)
        parts.append(torch.where(ids <= own, ids, -1))
    if local:  # the local pages ending at its own page, those not already sink pages
        ids = own - torch.arange(local, device=dev)
        parts.append(torch.where(ids >= sink, ids, -1))
    if t:  # the top others that exist (a -inf score is a page the query may not take)
        best = scores.masked_fill(~(allowed & ~fixed), float("-inf")).topk(t, dim=1)
        parts.append(torch.where(torch.isfinite(best.values), best.indices, -1))
    ids = torch.cat(parts, 1) if parts else torch.empty(n, 0, dtype=torch.long, device=dev)
    big = torch.iinfo(torch.int64).max
    ids = torch.where(ids >= 0, ids, big).sort(dim=1).values  # distinct ids ascending, then the -1s
    out = torch.where(ids != big, ids, -1).to(torch.int32)
    width = sink + local + top
    if out.shape[1] < width:
        out = torch.nn.functional.pad(out, (0, width - out.shape[1]), value=-1)
    return out


def select_pages(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor | None,
    page_size: int,
    sink: int,
    local: int,
    top: int,
) -> torch.Tensor:
    """int32 ``[Q, sink + local + top]``: each query's pages (ascending, ``-1`` padding at the end).

    Args:
        q: ``[heads, Q, d]`` queries; k: ``[kv_heads, L, d]`` keys of the context (``L`` tokens).
        positions: int ``[Q]``: each query's position in the context (causal); None: query ``i`` at
            position ``i`` (a prefill), scored by chunks of :data:`QUERY_CHUNK` queries against the pages
            each chunk may take only.
        page_size: keys per page; sink, local, top: the budget's parts (pages).
    """
    if min(sink, local, top) < 0 or sink + local + top < 1:
        raise ValueError(f"sink, local and top must be >= 0 with a positive sum, got {sink}, {local}, {top}")
    kmax, kmin = page_extremes(k, page_size)
    pages = kmax.shape[1]
    a, b = quest_operands(q, kmax, kmin)
    nq = q.shape[1]
    if positions is not None:
        pos = positions.long().to(q.device)
        return _select_rows(a @ b, pos, page_size, sink, local, top)
    out = torch.empty(nq, sink + local + top, dtype=torch.int32, device=q.device)
    for start in range(0, nq, QUERY_CHUNK):
        stop = min(nq, start + QUERY_CHUNK)
        num = min(
            pages, (stop - 1) // page_size + 1
        )  # the pages starting at or before the chunk's last query
        pos = torch.arange(start, stop, device=q.device)
        out[start:stop] = _select_rows(a[start:stop] @ b[:, :num], pos, page_size, sink, local, top)
    return out
