"""Pair backward plans: two 64-row K/V blocks in one 128-row K/V-owned item over the union of their Q pages.

The backward's mirror of :mod:`.pair_work_list`. KPage's K/V-owned plan runs a K/V block with at most
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
"""

from __future__ import annotations

import numpy as np

from ..constants import KPAGE_ROUTES
from ..graph import SparseGraph
from ..plans import TilePlan, gather_segments, kpage_route_of_block
from .pair_work_list import pair_blocks, pair_items
from .plan_cache import plan_of
from .validate import KernelTypeError
from .work_list import OWN_PAGES, VIS_HALF0

#: Route of the pair items in the KPage plan's routes: (128 owned rows, 128 streamed).
PAIR_ROUTE = KPAGE_ROUTES.index((128, 128))


def pair_backward_plan(graph: SparseGraph) -> TilePlan:
    """The K/V-owned KPage plan of ``graph`` with its 64-row K/V blocks joined two by two into 128-row
    pair items (:func:`pair_partners`; see the module docstring); the other items are the plan's.

    Returns:
        a :class:`TilePlan` (owner ``"kv"``, KPage routes) whose ``stream_vis`` is set; work items sorted
        by route, the plan's own 128-row items first, then the pair items head by head in block order
        (neighbouring items share most of their Q pages, so they meet in L2).
    """
    if not isinstance(graph, SparseGraph):
        raise KernelTypeError(f"graph must be a SparseGraph, got {type(graph).__name__}")
    base = plan_of(graph, "kpage", "auto", owner="kv")  # the backward's cached KPage plan
    kv_rows = graph.transpose()  # rows are K/V blocks, columns the Q blocks selecting them
    firsts, seconds = pair_partners(kv_rows)
    nb = kv_rows.q.num_blocks
    info, own, _, stream, stream_mask = pair_items(kv_rows, firsts, seconds)
    vis = ((stream_mask // VIS_HALF0) & 3).astype(np.uint32)

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
    lengths = np.concatenate([kept_len, info[:, 2]]).astype(np.int64)
    starts = np.concatenate([np.cumsum(kept_len) - kept_len, kept_len.sum() + info[:, 1]]).astype(np.int64)
    pages_all = np.concatenate([kept_pages, stream])
    vis_all = np.concatenate([np.full(kept_pages.size, 3, dtype=np.uint32), vis])

    order = np.argsort(route, kind="stable")  # launches take work items route by route
    seg_pages, seg_len = _segments(starts, lengths, pages_all, order)
    seg_vis, _ = _segments(starts, lengths, vis_all, order)
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


def pair_partners(kv_rows: SparseGraph) -> tuple[np.ndarray, np.ndarray]:
    """int64 ``(firsts [P], seconds [P])``: the K/V blocks each pair item joins (``kv_rows``: the graph's
    transpose). Neighbours (2i, 2i + 1) both on the 64-row route first (:func:`pair_blocks`); then the
    other 64-row blocks with live pages by the Q pages they share (:func:`_sharing_pairs`: SVG2's
    cluster remainders, the partial blocks at a video's edges); the rest two by two in block order.
    Every 64-row block is in at most one pair; one may be left over."""
    firsts = pair_blocks(kv_rows)
    live = kv_rows.q.live_pages.astype(np.int64)
    small = (kpage_route_of_block(live) == 0) & (live > 0)
    small[firsts] = False
    small[firsts + 1] = False
    shared_a, shared_b, rest = _sharing_pairs(kv_rows, np.flatnonzero(small))
    rest = rest[: rest.size - rest.size % 2]
    return (
        np.concatenate([firsts, shared_a, rest[0::2]]),
        np.concatenate([firsts + 1, shared_b, rest[1::2]]),
    )


#: Candidate pairs the greedy matching considers at most (those sharing the most Q pages).
MAX_PAIR_CANDIDATES = 200_000


def _sharing_pairs(kv_rows: SparseGraph, blocks: np.ndarray):
    """Greedy matching of ``blocks`` (sorted K/V block ids) by the Q pages two blocks are both selected by,
    summed over heads: the pair sharing most first, each block in one pair at most. Returns ``(a, b,
    left)``: the pairs (a < b, in order of a) and the blocks that share no page with another free block.

    A shared Q page is loaded once for both halves and its steps keep both consumer warpgroups busy; on
    SVG2's cluster remainders this streams 0.60–0.64× the pages of the unpaired blocks, where pairing in
    block order streams 0.90–0.96× (heads 0–2 of svg2_wan14b_720p)."""
    import scipy.sparse as sp

    n = blocks.size
    if n < 2:
        return blocks[:0], blocks[:0], blocks
    heads, nb, nq = kv_rows.heads, kv_rows.q.num_blocks, kv_rows.k.num_blocks
    q_pages = kv_rows.k.live_pages.astype(np.float64)
    indptr, indices = kv_rows.indptr.astype(np.int64), kv_rows.indices.astype(np.int64)
    rows, cols = [], []
    for h in range(heads):  # columns: (head, Q block), so heads add up
        sel, counts = gather_segments(indptr, indices, h * nb + blocks)
        rows.append(np.repeat(np.arange(n), counts))
        cols.append(h * nq + sel)
    rows, cols = np.concatenate(rows), np.concatenate(cols)
    selects = sp.csr_matrix((np.ones(rows.size), (rows, cols)), shape=(n, heads * nq))
    weighted = sp.csr_matrix((q_pages[cols % nq], (rows, cols)), shape=(n, heads * nq))
    shared = sp.triu(weighted @ selects.T, k=1).tocoo()
    r, c, v = shared.row, shared.col, shared.data
    if v.size > MAX_PAIR_CANDIDATES:
        top = np.argpartition(-v, MAX_PAIR_CANDIDATES)[:MAX_PAIR_CANDIDATES]
        r, c, v = r[top], c[top], v[top]
    used = np.zeros(n, dtype=bool)
    a, b = [], []
    for i in np.lexsort((c, r, -v)):  # most shared first, ties in block order
        x, y = r[i], c[i]
        if not (used[x] or used[y]):
            used[x] = used[y] = True
            a.append(x)
            b.append(y)
    a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
    order = np.argsort(a, kind="stable")
    return blocks[a[order]], blocks[b[order]], blocks[~used]


def _segments(starts: np.ndarray, lengths: np.ndarray, values: np.ndarray, order: np.ndarray):
    """``values[starts[i] : starts[i] + lengths[i]]`` for i in ``order``, back to back, and their lengths."""
    lens = lengths[order]
    idx = np.repeat(starts[order] - (np.cumsum(lens) - lens), lens) + np.arange(lens.sum())
    return values[idx], lens
