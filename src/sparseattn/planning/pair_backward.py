"""Pair backward plans: two 64-row K/V blocks in one 128-row K/V-owned item over the union of their Q pages.

The backward's mirror of :mod:`.pair_forward`. KPage's K/V-owned plan runs a K/V block with at most
four live pages as a 64-row item that streams every Q page selecting it, so each Q and dO byte it loads
serves 64 owned rows, and on VSA's 64-row plans the backward is bound by that traffic. A pair item joins
two such K/V blocks of one head, A and B (neighbours 2i and 2i + 1, else two 64-row blocks selected by
the same Q pages: :func:`pair_partners`):
- A's pages own rows 0–63 and B's rows 64–127 (one consumer warpgroup each in
  ``paged_bwd_ws_kernel<D, true>``);
- the stream is the union of the Q pages of the Q blocks selecting A or B, ordered
  [A only | shared | B only], each part in Q block order;
- ``TilePlan.stream_vis`` says which half sees each entry (bit 0: rows 0–63, bit 1: rows 64–127); the
  kernel gives a half's unseen rows LSE = +inf, so their P and dS are 0.

The shared Q pages are then loaded once for 128 owned rows. The tensor work follows the union (a half
computes its unseen entries as zeros), so it grows by the union's excess over the two selections.

``SPARSEATTN_PAIR_BWD_ORDER=alternate`` (an A/B knob of host plans, read at import; the device planner keeps
the block order) orders each item's stream by :func:`alternate_one_half_chunks` instead: whole kernel steps
of A-only and B-only entries alternated, so that a kernel whose warpgroups do not meet every step
(``paged_bwd.cu``'s ``PAGED_BWD_WG_DQ``) runs one-half steps of the two halves side by side.
"""

from __future__ import annotations

import os

import numpy as np

from ..constants import KPAGE_ROUTES
from ..graph import SparseGraph
from .layout_pairs import backward_layout_pairs
from .pair_forward import PARTNERS, pair_items, pair_partners
from .tile_plan import (
    TilePlan,
    gather_segments,
    head_major_launch_order,
    hidden_item_first,
    items_hiding_an_entry,
    kpage_plan,
)
from .work_list import OWN_PAGES, VIS_HALF0, VIS_HALF1

# KernelTypeError (sparseattn.kernels.validate) is imported where raised: `import sparseattn` loads no
# kernel module.

#: Route of the pair items in the KPage plan's routes: (128 owned rows, 128 streamed).
PAIR_ROUTE = KPAGE_ROUTES.index((128, 128))
#: Stream order of the pair items: ``"blocks"`` ([A only | shared | B only]) or ``"alternate"``
#: (:func:`alternate_one_half_chunks`); ``SPARSEATTN_PAIR_BWD_ORDER``.
ORDERS = ("blocks", "alternate")
ORDER = os.environ.get("SPARSEATTN_PAIR_BWD_ORDER", "") or "blocks"
#: Q pages per step of the pair backward kernel (paged_bwd.cu's PB_Q_ROWS / 16).
STEP_PAGES = 4


def alternate_one_half_chunks(vis: np.ndarray, lengths: np.ndarray, step: int = STEP_PAGES) -> np.ndarray:
    """The order of the concatenated item streams (``vis`` per entry: 1 A only, 2 B only, 3 both; items of
    ``lengths`` entries back to back) in which each item runs whole ``step``-entry chunks of its A-only and
    B-only entries alternated, A first, while both kinds have a whole chunk left, then the rest as it was:
    the remaining A-only entries, the shared ones, the remaining B-only ones (each kind in its own order).
    Returns indices into the entries."""
    order = np.empty(vis.size, dtype=np.int64)
    start = 0
    for n in np.asarray(lengths, dtype=np.int64):
        seg = vis[start : start + n]
        a, c = np.flatnonzero(seg == 1), np.flatnonzero(seg == 2)
        rest = np.flatnonzero((seg != 1) & (seg != 2))
        k = min(a.size, c.size) // step * step
        paired = np.stack([a[:k].reshape(-1, step), c[:k].reshape(-1, step)], axis=1).reshape(-1)
        order[start : start + n] = start + np.concatenate([paired, a[k:], rest, c[k:]])
        start += n
    return order


def pair_backward_plan(
    graph: SparseGraph, *, base: TilePlan | None = None, partners: str = "shared"
) -> TilePlan:
    """The K/V-owned KPage plan of ``graph`` with its 64-row K/V blocks joined two by two into 128-row
    pair items (:func:`pair_partners`; see the module docstring); the other items are the plan's.

    Args:
        graph: a :class:`SparseGraph`.
        base: ``kpage_plan(graph, owner="kv")`` (route ``"auto"``) if already built, else built here
            (:func:`sparseattn.planning.cache.plan_of` passes its cached plan).
        partners: ``"shared"`` (neighbours first, then matched by the Q pages they share) or ``"layout"``
            (neighbours first, then in block order: the device planner's pairs,
            :func:`~sparseattn.planning.layout_pairs.backward_layout_pairs`).

    Returns:
        a :class:`TilePlan` (owner ``"kv"``, KPage routes) whose ``stream_vis`` is set; work items in
        :func:`~sparseattn.planning.tile_plan.head_major_launch_order` by route, the plan's own 128-row
        items first, then the pair items, each group head by head and longest first within a head.
    """
    if not isinstance(graph, SparseGraph):
        from ..kernels.validate import KernelTypeError

        raise KernelTypeError(f"graph must be a SparseGraph, got {type(graph).__name__}")
    if partners not in PARTNERS:
        from ..kernels.validate import KernelValueError

        raise KernelValueError(f"partners must be one of {PARTNERS}, got {partners!r}")
    base = kpage_plan(graph, route="auto", owner="kv") if base is None else base
    kv_rows = graph.transpose()  # rows are K/V blocks, columns the Q blocks selecting them
    firsts, seconds = backward_layout_pairs(graph.k) if partners == "layout" else pair_partners(kv_rows)
    nb = kv_rows.q.num_blocks
    info, own, _, stream, stream_mask = pair_items(kv_rows, firsts, seconds)
    vis = (((stream_mask & VIS_HALF0) != 0) | (((stream_mask & VIS_HALF1) != 0) << 1)).astype(np.uint32)
    if ORDER == "alternate":
        by_chunks = alternate_one_half_chunks(vis, info[:, 2])
        stream, vis = stream[by_chunks], vis[by_chunks]
    elif ORDER not in ORDERS:
        from ..kernels.validate import KernelValueError

        raise KernelValueError(f"SPARSEATTN_PAIR_BWD_ORDER must be one of {ORDERS}, got {ORDER!r}")

    paired = np.zeros((graph.heads, nb), dtype=bool)
    paired[:, firsts] = True
    paired[:, seconds] = True
    kept = np.flatnonzero(~paired[base.work_head.astype(np.int64), base.work_block.astype(np.int64)])
    kept_pages, kept_len = gather_segments(
        base.stream_indptr.astype(np.int64), base.stream_pages.astype(np.int64), kept
    )
    width = max(OWN_PAGES, base.own_pages.shape[1])
    own_all = np.full((kept.size + own.shape[0], width), -1, dtype=np.int64)
    own_all[: kept.size, : base.own_pages.shape[1]] = base.own_pages[kept]
    own_all[kept.size :, : own.shape[1]] = own

    route = np.concatenate([base.work_route[kept].astype(np.int64), np.full(info.shape[0], PAIR_ROUTE)])
    # the kept streams, then the pair streams, back to back: one CSR over both
    indptr = np.concatenate([[0], np.cumsum(np.concatenate([kept_len, info[:, 2]]))]).astype(np.int64)
    pages_all = np.concatenate([kept_pages, stream])
    vis_all = np.concatenate([np.full(kept_pages.size, 3, dtype=np.uint32), vis])

    # one launch per route; in the pair route the kept 128-row items first (the plain kernel runs them),
    # then every pair item, also those whose entries both halves see (measured at d02a471: moving those
    # to the plain kernel made VSA 480p's backward 21.3 instead of 20.3 ms)
    is_pair = np.concatenate([np.zeros(kept.size, dtype=np.int64), np.ones(info.shape[0], dtype=np.int64)])
    key = 2 * route + is_pair
    # the plain K/V-owned plans' order (block order was 2.6% slower on VSA 480p's backward: NOTES v17)
    head_all = np.concatenate([base.work_head[kept], info[:, 0]]).astype(np.int64)
    order = hidden_item_first(
        head_major_launch_order(key, head_all, np.diff(indptr)),
        key,
        items_hiding_an_entry(vis_all, indptr[:-1], indptr[1:]),
    )
    entries, seg_len = gather_segments(indptr, np.arange(pages_all.size), order)
    seg_pages, seg_vis = pages_all[entries], vis_all[entries]
    return TilePlan(
        kind="kpage",
        owner="kv",
        routes=base.routes,
        work_route=route[order].astype(np.int8),
        work_head=np.concatenate([base.work_head[kept], info[:, 0]])[order].astype(np.int32),
        work_block=np.concatenate([base.work_block[kept], np.tile(firsts, graph.heads)])[order].astype(
            np.int32
        ),
        own_pages=own_all[order].astype(np.int32),
        stream_indptr=np.concatenate([[0], np.cumsum(seg_len)]).astype(np.int32),
        stream_pages=seg_pages.astype(np.int32),
        own_page_mask=base.own_page_mask,
        stream_page_mask=base.stream_page_mask,
        heads=graph.heads,
        stream_vis=seg_vis.astype(np.uint32),
    )
