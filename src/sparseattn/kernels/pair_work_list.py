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

The float64 emulator (:func:`sparseattn.emulator.emulate_work_list`), :meth:`WorkList.executed_pairs`
and the forward kernel's pair instantiation (``paged_fwd_kernel<D, 128, true>``, ``route="pair"``)
follow the visibility bits.
"""

from __future__ import annotations

import numpy as np

from ..constants import PAGE_ROWS
from ..graph import SparseGraph
from ..plans import gather_segments, kpage_route_of_block
from .plan_cache import plan_of
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
    plan = plan_of(graph, "kpage", "auto", owner="q")  # the forward's cached KPage plan
    base = work_list(plan, order=order)
    firsts = pair_blocks(graph)
    nb = graph.q.num_blocks
    paired = np.zeros((graph.heads, nb), dtype=bool)
    paired[:, firsts] = True
    paired[:, firsts + 1] = True
    keep = ~paired[plan.work_head.astype(np.int64), plan.work_block.astype(np.int64)]

    info, own, own_mask, stream, stream_mask = pair_items(graph, firsts)

    # the plan's other items (the base list's items are the plan's, in the plan's order, streams back to
    # back), their streams re-based after the pairs'
    kept = np.flatnonzero(keep)
    base_info = base.work_info.astype(np.int64)
    base_indptr = np.concatenate([base_info[:, 1], [base.stream_pages.size]])
    kept_pages, kept_len = gather_segments(base_indptr, base.stream_pages.astype(np.int64), kept)
    kept_masks, _ = gather_segments(base_indptr, base.stream_mask.astype(np.uint32), kept)
    b_info = base_info[kept]
    b_info[:, 1] = stream.size + np.concatenate([[0], np.cumsum(kept_len)[:-1]]).astype(np.int64)
    all_info = np.concatenate([info, b_info])
    chunk = chunk_for([plan])
    cost = all_info[:, 3] * -(-all_info[:, 2] // (chunk // PAGE_ROWS))
    index = np.arange(all_info.shape[0])
    return WorkList(
        work_info=all_info.astype(np.int32),
        work_order=np.lexsort((index, -cost, all_info[:, 0])).astype(np.int32),
        own_pages=np.concatenate([own, base.own_pages[kept]]).astype(np.int32),
        own_mask=np.concatenate([own_mask, base.own_mask[kept]]).astype(np.uint32),
        stream_pages=np.concatenate([stream, kept_pages]).astype(np.int32),
        stream_mask=np.concatenate([stream_mask, kept_masks]).astype(np.uint32),
        heads=graph.heads,
        chunk=chunk,
    )


def pair_items(graph: SparseGraph, firsts: np.ndarray, seconds: np.ndarray | None = None):
    """Pair items of every head (vectorized): ``(info [P, 4], own [P, 8], own_mask [P, 8], stream [S],
    stream_mask [S])``, pairs head-major, streams back to back from entry 0. Pair i joins blocks
    ``firsts[i]`` (A) and ``seconds[i]`` (B; default ``firsts + 1``) of every head."""
    heads, nb = graph.heads, graph.q.num_blocks
    seconds = firsts + 1 if seconds is None else seconds
    pair_row = (np.arange(heads)[:, None] * nb + firsts[None, :]).ravel()  # block A's CSR row per pair
    second_row = (np.arange(heads)[:, None] * nb + seconds[None, :]).ravel()
    n_pairs = pair_row.size
    # every (pair, selected K block) as one sorted key per side (CSR rows are sorted), then their union
    # per pair in stream order with a tag: 1 = A selects the block, 2 = B does, 3 = both
    nkb = graph.k.num_blocks
    keys = []
    for rows in (pair_row, second_row):
        kb, counts = gather_segments(graph.indptr.astype(np.int64), graph.indices.astype(np.int64), rows)
        keys.append(np.repeat(np.arange(n_pairs, dtype=np.int64) * nkb, counts) + kb)
    union, tags = _ordered_union(keys[0], keys[1], n_pairs, nkb)
    u_pair, u_block = union // nkb, union % nkb
    # K blocks -> their live pages, in order
    k_live = graph.k.page_live
    k_pages = np.flatnonzero(k_live).astype(np.int64)
    k_indptr = np.concatenate([[0], np.cumsum(graph.k.live_pages)]).astype(np.int64)
    stream, lengths = gather_segments(k_indptr, k_pages, u_block)
    vis = np.repeat(np.where(tags & 1, VIS_HALF0, 0) | np.where(tags & 2, VIS_HALF1, 0), lengths)
    stream_mask = graph.k.page_mask.astype(np.uint32)[stream] | vis.astype(np.uint32)
    per_pair = np.bincount(u_pair, weights=lengths, minlength=n_pairs).astype(np.int64)
    begin = np.cumsum(per_pair) - per_pair  # (no pairs: empty, as every other array)
    info = np.stack([pair_row // nb, begin, per_pair, np.full(n_pairs, 128)], axis=1).astype(np.int64)
    # owned Q pages: A's live pages in slots 0-3, B's in 4-7
    q_ppb = graph.q.pages_per_block
    q_live = graph.q.page_live.reshape(nb, q_ppb)
    own = np.full((n_pairs, OWN_PAGES), -1, dtype=np.int64)
    for half, blocks in enumerate((firsts, seconds)):
        qb = np.tile(blocks, heads)
        live = q_live[qb]  # [P, ppb]
        rank = np.cumsum(live, axis=1) - 1
        pid, col = np.nonzero(live)
        own[pid, half * OWN_PAGES // 2 + rank[pid, col]] = qb[pid] * q_ppb + col
    own_mask = np.where(own >= 0, graph.q.page_mask.astype(np.uint32)[np.maximum(own, 0)], 0).astype(
        np.uint32
    )
    return info, own, own_mask, stream, stream_mask


def _ordered_union(key_a: np.ndarray, key_b: np.ndarray, n_pairs: int, nkb: int):
    """The union of two sorted key arrays (``pair · nkb + block``, each key once per side) ordered pair by
    pair as [A only | shared | B only], block order within each part, and each key's tag (1 A only,
    3 shared, 2 B only). Linear-time placement instead of a sort of the union."""
    pos = np.searchsorted(key_a, key_b)
    shared_b = pos < key_a.size
    shared_b[shared_b] = key_a[pos[shared_b]] == key_b[shared_b]
    shared_a = np.zeros(key_a.size, dtype=bool)
    shared_a[pos[shared_b]] = True
    parts = (key_a[~shared_a], key_a[shared_a], key_b[~shared_b])
    counts = np.stack([np.bincount(p // nkb, minlength=n_pairs) for p in parts])  # [3, pairs]
    first_of_pair = np.cumsum(counts, axis=1) - counts  # each part's index of a pair's first key
    start = np.cumsum(counts.sum(axis=0)) - counts.sum(axis=0)  # a pair's first stream position
    union = np.empty(sum(p.size for p in parts), dtype=np.int64)
    tags = np.empty(union.size, dtype=np.int64)
    before = np.zeros(n_pairs, dtype=np.int64)  # keys of the earlier parts of the pair
    for part, tag, count, first in zip(parts, (1, 3, 2), counts, first_of_pair):
        pair = part // nkb
        dest = start[pair] + before[pair] + np.arange(part.size) - first[pair]
        union[dest] = part
        tags[dest] = tag
        before += count
    return union, tags
