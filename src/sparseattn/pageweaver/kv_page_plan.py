"""The direct KV-page union's plan: work split by KV page, partial outputs merged by LSE.

The comparison design to the ID-aware union. Every (query, selected page) pair of a capture is an
*entry*; entries are ordered by page, then query, and each page's entries are cut into items of at
most :data:`~.union_plan.MEMBER_SLOTS` = 8 queries. A CTA work item loads one page once and computes
its (up to 8) queries against it — the same tile rows (member ``m`` of query head ``h`` is row
``h·8 + m``) and per-query masking as the union kernel — and writes one normalised partial output and
LSE per entry. A reduction then merges each query's partials by their LSE. Fields:

* ``ids``        int32 ``[num_entries]``: the entries' query ids (ascending page, then query);
* ``offsets``    int32 ``[num_items + 1]``: item ``i`` holds entries ``offsets[i] .. offsets[i+1]``;
* ``item_pages`` int32 ``[num_items]``: the page of item ``i``;
* ``slot_entry`` int32 ``[num_queries, k]``: the entry of ``pages[q, j]`` (``-1``: no page).

:func:`emulate_kv_page` is its float64 model: per-entry partials, then the merge; it equals
:func:`~.reference.paged_attention_reference`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .captures import Capture
from .reference import check_paged_qkv
from .union_plan import MEMBER_SLOTS


@dataclass(frozen=True, eq=False)
class KvPagePlan:
    """Entries grouped by page into items of at most 8 queries (see the module docstring)."""

    ids: np.ndarray
    offsets: np.ndarray
    item_pages: np.ndarray
    slot_entry: np.ndarray
    num_pages: int

    @property
    def num_entries(self) -> int:
        return int(self.ids.shape[0])

    @property
    def num_items(self) -> int:
        return int(self.item_pages.shape[0])

    @cached_property
    def entry_pages(self) -> np.ndarray:
        """int32 ``[num_entries]``: the page of each entry."""
        return np.repeat(self.item_pages, np.diff(self.offsets))


def build_kv_page_plan(capture: Capture, members: int = MEMBER_SLOTS) -> KvPagePlan:
    """The capture's distinct (query, page) pairs by page, in items of at most ``members`` queries."""
    if not isinstance(capture, Capture):
        raise TypeError(f"capture must be a Capture, got {type(capture).__name__}")
    if not 1 <= int(members) <= MEMBER_SLOTS:
        raise ValueError(f"members must lie in [1, {MEMBER_SLOTS}], got {members}")
    pages = np.asarray(capture.pages)
    nq, k = pages.shape
    num_pages = capture.num_pages
    query, slot = np.nonzero(pages >= 0)  # a capture holds no repeated page in a row
    page = pages[query, slot].astype(np.int64)
    order = np.lexsort((query, page))
    query, slot, page = query[order], slot[order], page[order]
    num_entries = len(order)
    slot_entry = np.full((nq, k), -1, dtype=np.int32)
    slot_entry[query, slot] = np.arange(num_entries, dtype=np.int32)
    per_page = np.bincount(page, minlength=num_pages)
    page_start = np.concatenate([[0], np.cumsum(per_page)[:-1]])
    items_per_page = -(-per_page // members)
    item_start = np.concatenate([[0], np.cumsum(items_per_page)])
    rank = np.arange(num_entries) - page_start[page]
    item_of_entry = item_start[page] + rank // members
    num_items = int(item_start[-1])
    offsets = np.searchsorted(item_of_entry, np.arange(num_items + 1)).astype(np.int32)
    item_pages = np.repeat(np.arange(num_pages, dtype=np.int32), items_per_page)
    return KvPagePlan(query.astype(np.int32), offsets, item_pages, slot_entry, num_pages)


def emulate_kv_page(plan: KvPagePlan, capture: Capture, q, k, v, scale=None):
    """(o ``[q_heads, Q, d]``, lse ``[q_heads, Q]``) in float64: every entry's partial, then the merge."""
    q, k, v = check_paged_qkv(q, k, v, capture)
    hq, _, d = q.shape
    G = hq // k.shape[0]
    scale = 1.0 / np.sqrt(d) if scale is None else float(scale)
    P = capture.page_size
    entry_pages = plan.entry_pages
    keys = entry_pages[:, None].astype(np.int64) * P + np.arange(P)  # [E, P]
    valid = keys < capture.context
    if capture.causal:
        valid &= keys <= capture.positions[plan.ids][:, None]
    keys = np.minimum(keys, capture.context - 1)
    part_o = np.zeros((hq, plan.num_entries, d))
    part_lse = np.full((hq, plan.num_entries), -np.inf)
    for h in range(hq):
        kk, vv = k[h // G].astype(np.float64), v[h // G].astype(np.float64)
        s = np.einsum("ed,epd->ep", q[h, plan.ids].astype(np.float64), kk[keys]) * scale
        s = np.where(valid, s, -np.inf)
        m = s.max(axis=1, keepdims=True)
        p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
        l = p.sum(axis=1)
        has = l > 0
        part_o[h] = np.einsum("ep,epd->ed", p, vv[keys]) / np.where(has, l, 1.0)[:, None]
        part_lse[h] = np.where(has, m[:, 0] + np.log(np.where(has, l, 1.0)), -np.inf)
    entry = plan.slot_entry  # [Q, k]
    taken = entry >= 0
    lse_q = np.where(taken, part_lse[:, np.maximum(entry, 0)], -np.inf)  # [hq, Q, k]
    m = lse_q.max(axis=2, keepdims=True)
    w = np.exp(lse_q - np.where(np.isfinite(m), m, 0.0))  # 0 for untaken or empty entries
    l = w.sum(axis=2)
    has = l > 0
    o = np.einsum("hqj,hqjd->hqd", w, part_o[:, np.maximum(entry, 0)]) / np.where(has, l, 1.0)[..., None]
    lse = np.where(has, m[..., 0] + np.log(np.where(has, l, 1.0)), -np.inf)
    return o, lse
