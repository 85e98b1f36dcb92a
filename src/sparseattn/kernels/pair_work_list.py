"""Pair work lists: two 64-row Q blocks in one 128-row item over the ordered union of their K pages.

KPage's 64-row route runs a Q block with at most four live pages as a 64-row item whose two consumer
warpgroups split the key chunks. Every K/V byte it loads then serves 64 query rows, and the route is
bound by K/V traffic. A *pair item* joins two such Q blocks, A and B (blocks 2i and 2i + 1 of one head),
into one 128-row item:
- A's pages own rows 0–63 and B's rows 64–127;
- the stream is the union of the K pages the two select, ordered [A only | shared | B only], each part in
  K block order;
- bits 16 and 17 of an entry's row mask say which half sees it (bit 16: rows 0–63, bit 17: rows 64–127).

A row half computes only the key chunks that hold pages it sees, and masks the other pages inside its
boundary chunk. So the tensor work stays near the two 64-row items' (waste only in boundary chunks),
while the shared pages are loaded once for 128 rows.

The float64 emulator (:func:`sparseattn.emulator.emulate_work_list`) and
:meth:`WorkList.executed_pairs` follow the visibility bits. The forward kernel does not yet, and its
launch path refuses such lists (``check_work_list``).
"""

from __future__ import annotations

import numpy as np

from ..constants import PAGE_ROWS
from ..graph import SparseGraph
from ..plans import kpage_plan, kpage_route_of_block
from .validate import KernelTypeError
from .work_list import OWN_PAGES, VIS_HALF0, VIS_HALF1, WorkList, chunk_for, work_list


def pair_blocks(graph: SparseGraph) -> np.ndarray:
    """int64 ``[P]``: first Q block b of each pair (b, b + 1). Both blocks must be on the 64-row route
    (1–4 live pages); b is even."""
    live = graph.q.live_pages.astype(np.int64)
    small = (kpage_route_of_block(live) == 0) & (live > 0)
    first = np.arange(0, graph.q.num_blocks - 1, 2)
    return first[small[first] & small[first + 1]]


def pair_work_list(graph: SparseGraph, order: str | None = None) -> WorkList:
    """The KPage forward work list of ``graph`` with every pair of neighbouring 64-row Q blocks joined
    into one 128-row pair item (see the module docstring); the other items are the KPage plan's.

    Args:
        graph: a :class:`SparseGraph` (one layout for every head).
        order: as :func:`sparseattn.kernels.work_list.work_list`.
    """
    if not isinstance(graph, SparseGraph):
        raise KernelTypeError(f"graph must be a SparseGraph, got {type(graph).__name__}")
    plan = kpage_plan(graph, owner="q")
    base = work_list(plan, order=order)
    firsts = pair_blocks(graph)
    nb = graph.q.num_blocks
    paired = np.zeros((graph.heads, nb), dtype=bool)
    paired[:, firsts] = True
    paired[:, firsts + 1] = True
    keep = ~paired[plan.work_head.astype(np.int64), plan.work_block.astype(np.int64)]

    q_ppb, k_ppb = graph.q.pages_per_block, graph.k.pages_per_block
    q_live = graph.q.page_live.reshape(nb, q_ppb)
    k_live = graph.k.page_live.reshape(-1, k_ppb)
    q_mask, k_mask = graph.q.page_mask.astype(np.uint32), graph.k.page_mask.astype(np.uint32)

    info, own, own_mask, stream, stream_mask = [], [], [], [], []
    offset = 0
    for h in range(graph.heads):
        for b in firsts:
            rows = (h * nb + b, h * nb + b + 1)
            sel = [graph.indices[graph.indptr[r] : graph.indptr[r + 1]].astype(np.int64) for r in rows]
            a_only = np.setdiff1d(sel[0], sel[1])
            shared = np.intersect1d(sel[0], sel[1])
            b_only = np.setdiff1d(sel[1], sel[0])
            pages, vis = [], []
            for blocks, bits in ((a_only, VIS_HALF0), (shared, VIS_HALF0 | VIS_HALF1), (b_only, VIS_HALF1)):
                for kb in blocks:
                    p = np.flatnonzero(k_live[kb]) + kb * k_ppb
                    pages.append(p)
                    vis.append(np.full(p.size, bits, dtype=np.uint32))
            pages = np.concatenate([*pages, np.zeros(0, np.int64)])
            vis = np.concatenate([*vis, np.zeros(0, np.uint32)])
            o = np.full(OWN_PAGES, -1, dtype=np.int64)
            for half, qb in enumerate((b, b + 1)):  # A's live pages own rows 0-63, B's rows 64-127
                live = np.flatnonzero(q_live[qb]) + qb * q_ppb
                o[half * OWN_PAGES // 2 : half * OWN_PAGES // 2 + live.size] = live
            info.append((h, offset, pages.size, 128))
            own.append(o)
            own_mask.append(np.where(o >= 0, q_mask[np.maximum(o, 0)], 0))
            stream.append(pages)
            stream_mask.append(k_mask[pages] | vis)
            offset += pages.size

    # the plan's other items, their streams re-based after the pairs'
    kept = np.flatnonzero(keep)  # the base list's items are the plan's, in the plan's order
    b_info = base.work_info[kept].astype(np.int64)
    segs = [base.stream_pages[s : s + n] for s, n in zip(b_info[:, 1], b_info[:, 2])]
    seg_masks = [base.stream_mask[s : s + n] for s, n in zip(b_info[:, 1], b_info[:, 2])]
    starts = offset + np.concatenate([[0], np.cumsum(b_info[:, 2])[:-1]]).astype(np.int64)
    b_info[:, 1] = starts
    all_info = np.concatenate([np.asarray(info, dtype=np.int64).reshape(-1, 4), b_info])
    chunk = chunk_for([plan])
    cost = all_info[:, 3] * -(-all_info[:, 2] // (chunk // PAGE_ROWS))
    index = np.arange(all_info.shape[0])
    return WorkList(
        work_info=all_info.astype(np.int32),
        work_order=np.lexsort((index, -cost, all_info[:, 0])).astype(np.int32),
        own_pages=np.concatenate(
            [np.asarray(own, np.int64).reshape(-1, OWN_PAGES), base.own_pages[kept]]
        ).astype(np.int32),
        own_mask=np.concatenate(
            [np.asarray(own_mask, np.uint32).reshape(-1, OWN_PAGES), base.own_mask[kept]]
        ).astype(np.uint32),
        stream_pages=np.concatenate([*stream, *segs, np.zeros(0, np.int64)]).astype(np.int32),
        stream_mask=np.concatenate([*stream_mask, *seg_masks, np.zeros(0, np.uint32)]).astype(np.uint32),
        heads=graph.heads,
        chunk=chunk,
    )
