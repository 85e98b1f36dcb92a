"""Tile plans: the flat int32 work lists a paged attention kernel executes.

Everything is counted in 16-row pages (page ``p`` covers slots ``[16p, 16p + 16)`` of its side).
A *work item* is one CTA tile: it owns up to ``M`` rows given as a list of pages of the owner side
(Q pages in forward; K/V pages in the K/V-owned backward) and streams a list of the other side's
pages, packed back to back into tiles of ``N`` columns (``N / 16`` pages per tile; only the last
tile of a work item may be partly empty).

* :func:`bsa_plan` — the logical-block baseline: owned pages are *all* pages of one block, streamed
  pages are *all* pages of each selected block, ``M = N = block_size``. Physical pairs = |G|·Bq·Bk.
* :func:`kpage_plan` — KPage: only live pages, packed across block boundaries, each Q block routed
  to a (64, 256) or a (128, 128) tile (or a fixed route).

Masks travel as one uint16 per page (bit r = row r valid); kernels mask invalid key columns to −inf
and never store invalid query rows, so both plans compute exactly the graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..constants import KPAGE_ROUTES, KPAGE_SMALL_ROUTE_MAX_QROWS, PAGE_ROWS
from ..graph import SparseGraph
from ..layouts import BlockLayout

OWNERS = ("q", "kv")
INT32_MAX = np.iinfo(np.int32).max
#: Row mask of a page whose 16 rows are all valid.
FULL_PAGE_MASK = (1 << PAGE_ROWS) - 1


class PlanError(ValueError):
    """A plan argument is invalid; the message names the argument."""


class PlanTypeError(PlanError, TypeError):
    """A plan argument has the wrong type; the message names the argument."""


def gather_segments(indptr: np.ndarray, values: np.ndarray, segments: np.ndarray):
    """Concatenate ``values[indptr[s]:indptr[s+1]]`` for each ``s`` in ``segments`` (vectorized).

    Returns ``(out, lengths)`` with ``lengths[n]`` the size of the n-th gathered segment.
    """
    segments = np.asarray(segments, dtype=np.int64)
    starts = indptr[segments]
    lengths = indptr[segments + 1] - starts
    total = int(lengths.sum())
    if total == 0:
        return values[:0].copy(), lengths
    seg_first = np.cumsum(lengths) - lengths
    return values[np.repeat(starts - seg_first, lengths) + np.arange(total, dtype=np.int64)], lengths


#: Work items at the end of each launch that run longest first: CTAs start in item order, so a long item
#: among the last would run alone while the other SMs idle (about eight waves of a 132-SM GPU).
TAIL_ITEMS = 1024


def launch_order(key: np.ndarray, lengths: np.ndarray, tail: int = TAIL_ITEMS) -> np.ndarray:
    """int64 permutation of work items: sorted by ``key`` (one launch per key value; stable, so items keep
    their order, head by head), then each launch's last ``tail`` items sorted by stream length, longest
    first. ``key``, ``lengths``: ``[W]``."""
    order = np.argsort(np.asarray(key), kind="stable")
    k, lengths = np.asarray(key)[order], np.asarray(lengths)[order]
    ends = np.flatnonzero(np.diff(k, append=np.inf)) + 1  # one past each launch's last item
    for end in ends:
        start = end - min(tail, end - (np.searchsorted(k, k[end - 1], side="left")))
        order[start:end] = order[start:end][np.argsort(-lengths[start:end], kind="stable")]
    return order


def head_major_launch_order(key, head, lengths, ties=()) -> np.ndarray:
    """int64 permutation of work items in the backward's grid order: by launch ``key``, head by head (the
    CTAs running at once share one head's streamed pages in L2), longest stream first within a head (then
    by ``ties``, least significant first, then item order), and each launch's tail as
    :func:`launch_order` sorts it. ``key``, ``head``, ``lengths`` and each of ``ties``: ``[W]``."""
    key, lengths = np.asarray(key), np.asarray(lengths)
    first = np.lexsort((*ties, -lengths, np.asarray(head), key))
    return first[launch_order(key[first], lengths[first])]


def hidden_item_first(order: np.ndarray, key: np.ndarray, has_hidden: np.ndarray) -> np.ndarray:
    """``order`` (a :func:`launch_order`) with, in each launch of odd ``key`` (a route's pair items), the
    first item that hides an entry from one half moved to the launch's front. :func:`first_pair_items`
    starts the pair kernel's launch at that item, so any item before it would run at the end of the
    plain launch: in ssta's plan the longest pair item (6980 Q pages) did, and its launch then ran
    that one item alone at the end. ``key``, ``has_hidden``: ``[W]``, by item."""
    order = np.array(order)
    k = np.asarray(key)[order]
    starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
    for start, stop in zip(starts, np.r_[starts[1:], k.size]):
        if k[start] % 2 == 0:
            continue
        hits = np.flatnonzero(np.asarray(has_hidden)[order[start:stop]])
        if hits.size and hits[0] > 0:
            j = start + int(hits[0])
            order[start : j + 1] = np.r_[order[j], order[start:j]]
    return order


def items_hiding_an_entry(stream_vis: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """bool ``[W]``: whether item w's stream entries ``starts[w] .. stops[w]`` include one hidden from a
    row half (``stream_vis`` ≠ 3: a pair item's)."""
    hidden = np.concatenate([[0], np.cumsum(np.asarray(stream_vis) != 3)])
    return hidden[stops] > hidden[starts]


def pages_hold_rows(page_mask: np.ndarray, pages: np.ndarray) -> bool:
    """Whether any of ``pages`` has a valid row in ``page_mask`` (uint16 row masks per page; pages past its
    end are padding)."""
    pages = np.asarray(pages)
    return bool(np.any(page_mask[pages[pages < page_mask.size]] != 0))


def first_pair_items(plan: TilePlan) -> np.ndarray:
    """int64 ``[routes]``: per route, the first work item with an entry hidden from one half (a pair
    item; the route's end if none). Items before it run on the plain kernel, the rest on the pair
    kernel (plans with ``stream_vis``)."""
    indptr = plan.stream_indptr.astype(np.int64)
    has_hidden = items_hiding_an_entry(plan.stream_vis, indptr[:-1], indptr[1:])
    firsts = []
    for start, stop in plan.route_ranges():
        idx = np.flatnonzero(has_hidden[start:stop])
        firsts.append(start + int(idx[0]) if idx.size else stop)
    return np.asarray(firsts, dtype=np.int64)


def _live_page_csr(layout: BlockLayout):
    """CSR over blocks of the live page ids of each block."""
    live = layout.page_live
    pages = np.flatnonzero(live).astype(np.int64)
    indptr = np.concatenate([[0], np.cumsum(layout.live_pages)])
    return indptr, pages


def _all_page_csr(layout: BlockLayout):
    ppb = layout.pages_per_block
    return np.arange(layout.num_blocks + 1, dtype=np.int64) * ppb, np.arange(layout.num_pages, dtype=np.int64)


@dataclass(frozen=True, eq=False)
class TilePlan:
    """A work list for a paged attention kernel.

    Attributes:
        kind: ``"bsa"`` or ``"kpage"``.
        owner: ``"q"`` (forward: a CTA owns Q rows) or ``"kv"`` (backward: a CTA owns K/V rows).
        routes: tuple of tile shapes ``(M, N)``; ``work_route`` indexes it.
        work_route: int8 ``[W]``.
        work_head: int32 ``[W]``.
        work_block: int32 ``[W]``, the owner side's logical block of each work item.
        own_pages: int32 ``[W, max_own_pages]``, owned page ids, ``-1`` padded.
        stream_indptr: int32 ``[W + 1]``.
        stream_pages: int32 ``[S]``, streamed page ids of the other side.
        own_page_mask, stream_page_mask: uint16 ``[num_pages]`` of each side.
        heads: heads of the graph.
        stream_vis: ``None``, or uint32 ``[S]`` for pair items (two 64-row owner blocks in one 128-row
            item): bit 0 set where the entry is seen by owned rows 0–63, bit 1 by rows 64–127.
    """

    kind: str
    owner: str
    routes: tuple
    work_route: np.ndarray
    work_head: np.ndarray
    work_block: np.ndarray
    own_pages: np.ndarray
    stream_indptr: np.ndarray
    stream_pages: np.ndarray
    own_page_mask: np.ndarray
    stream_page_mask: np.ndarray
    heads: int
    stream_vis: np.ndarray | None = None

    @property
    def num_work(self) -> int:
        return self.work_head.size

    @property
    def q_page_mask(self) -> np.ndarray:
        return self.own_page_mask if self.owner == "q" else self.stream_page_mask

    @property
    def k_page_mask(self) -> np.ndarray:
        return self.stream_page_mask if self.owner == "q" else self.own_page_mask

    def stream_lengths(self) -> np.ndarray:
        return np.diff(self.stream_indptr).astype(np.int64)

    def tile_shapes(self) -> np.ndarray:
        """int64 ``[W, 2]``: (M, N) of each work item."""
        return np.asarray(self.routes, dtype=np.int64)[self.work_route]

    def tiles_per_work(self) -> np.ndarray:
        """int64 ``[W]``: N-wide tiles each work item iterates."""
        n = self.tile_shapes()[:, 1]
        return -(-(self.stream_lengths() * PAGE_ROWS) // n)

    def physical_pairs(self) -> int:
        """Σ over work items of M · N · (tiles streamed): what the tensor cores compute."""
        mn = self.tile_shapes()
        return int((mn[:, 0] * mn[:, 1] * self.tiles_per_work()).sum())

    def route_ranges(self) -> list[tuple[int, int]]:
        """Work items are sorted by route: ``[(start, stop)]`` per route, for one launch each."""
        bounds = np.searchsorted(self.work_route, np.arange(len(self.routes) + 1))
        return [(int(bounds[r]), int(bounds[r + 1])) for r in range(len(self.routes))]

    def device_arrays(self) -> dict[str, np.ndarray]:
        """The arrays a kernel reads, contiguous and in their kernel dtypes."""
        return {
            "work_route": np.ascontiguousarray(self.work_route, dtype=np.int32),
            "work_head": np.ascontiguousarray(self.work_head, dtype=np.int32),
            "own_pages": np.ascontiguousarray(self.own_pages, dtype=np.int32),
            "stream_indptr": np.ascontiguousarray(self.stream_indptr, dtype=np.int32),
            "stream_pages": np.ascontiguousarray(self.stream_pages, dtype=np.int32),
            "own_page_mask": np.ascontiguousarray(self.own_page_mask, dtype=np.uint16),
            "stream_page_mask": np.ascontiguousarray(self.stream_page_mask, dtype=np.uint16),
            **(
                {}
                if self.stream_vis is None
                else {"stream_vis": np.ascontiguousarray(self.stream_vis, dtype=np.uint32)}
            ),
        }


def stable_partition(first: np.ndarray, indptr: np.ndarray) -> np.ndarray:
    """int64 ``[S]``: each entry's position once every item's entries with ``first`` set are moved ahead of
    its other entries, both groups keeping their order. ``first``: bool ``[S]``; ``indptr``: ``[items + 1]``
    offsets of the items' entries, back to back from 0."""
    first = np.asarray(first, dtype=bool)
    indptr = np.asarray(indptr, dtype=np.int64)
    lengths = np.diff(indptr)
    starts = np.repeat(indptr[:-1], lengths)
    upto = np.concatenate([[0], np.cumsum(first)])  # flagged entries before each position
    rank = upto[:-1] - np.repeat(upto[indptr[:-1]], lengths)  # ... before it in its item
    flagged = np.repeat(upto[indptr[1:]] - upto[indptr[:-1]], lengths)  # ... in its item
    entry = np.arange(first.size) - starts
    return starts + np.where(first, rank, flagged + entry - rank)


def full_pages_first(
    stream_pages: np.ndarray, stream_indptr: np.ndarray, page_mask: np.ndarray
) -> np.ndarray:
    """``stream_pages`` with every item's full pages first and its partial pages last, each group in
    stream order. A key chunk of full pages needs no column masking in the forward kernels' softmax;
    grouping the partial pages (one per cluster or block end) masks a few chunks per item instead of
    nearly all. ``stream_indptr``: ``[items + 1]`` offsets; ``page_mask``: uint16 ``[pages]``."""
    full = np.asarray(page_mask)[stream_pages] == FULL_PAGE_MASK
    if full.all():
        return stream_pages
    out = np.empty_like(stream_pages)
    out[stable_partition(full, stream_indptr)] = stream_pages
    return out


def row_work(graph: SparseGraph, own_layout: BlockLayout, own_count, stream_count, tile_rows):
    """Per CSR row of ``graph`` (rows are owner blocks, head-major): ``(owned pages, owner tiles,
    streamed pages)``, int64 ``[rows]`` each. ``own_count`` / ``stream_count``: pages each owner / streamed
    block contributes (``[blocks]``); ``tile_rows``: owned rows per tile of each row (``[rows]``). A row
    without valid rows has no tiles; every tile streams the pages of all the blocks its row selects."""
    own_block = np.arange(graph.num_rows, dtype=np.int64) % own_layout.num_blocks
    owned = np.asarray(own_count, dtype=np.int64)[own_block]
    tiles = np.where(own_layout.valid_rows[own_block] > 0, -(-owned * PAGE_ROWS // tile_rows), 0)
    weights = np.asarray(stream_count, dtype=np.float64)[graph.indices]
    streamed = np.bincount(graph.row_of_nnz, weights=weights, minlength=graph.num_rows).astype(np.int64)
    return owned, tiles, streamed


def _build(
    kind: str,
    owner: str,
    graph: SparseGraph,
    own_csr,
    stream_csr,
    routes,
    route_of_row,
    own_layout: BlockLayout,
    stream_layout: BlockLayout,
) -> TilePlan:
    """Shared plan builder; rows are CSR rows of ``graph`` (already oriented so rows are owners)."""
    nb_own = own_layout.num_blocks
    rows = np.arange(graph.num_rows, dtype=np.int64)
    own_block = rows % nb_own
    routes_arr = np.asarray(routes, dtype=np.int64)
    own_count, tiles_per_row, row_stream_len = row_work(
        graph, own_layout, np.diff(own_csr[0]), np.diff(stream_csr[0]), routes_arr[route_of_row, 0]
    )

    # stream pages of every row: concatenation of the streamed pages of each selected block
    stream_of_nnz, _ = gather_segments(stream_csr[0], stream_csr[1], graph.indices.astype(np.int64))
    row_stream_indptr = np.concatenate([[0], np.cumsum(row_stream_len)])

    # one work item per (row, owner tile)
    work_row = np.repeat(rows, tiles_per_row)
    work_tile = np.arange(work_row.size) - np.repeat(np.cumsum(tiles_per_row) - tiles_per_row, tiles_per_row)
    work_route = route_of_row[work_row]
    if owner == "kv":
        # the backward's grid takes items in plan order
        order = head_major_launch_order(
            work_route, work_row // nb_own, row_stream_len[work_row], ties=(work_tile, work_row)
        )
    else:
        # by route, then longest stream first (largest work first balances the grid)
        order = np.lexsort((work_tile, work_row, -row_stream_len[work_row], work_route))
    work_row, work_tile, work_route = work_row[order], work_tile[order], work_route[order]

    max_own = int(routes_arr[:, 0].max()) // PAGE_ROWS
    own_pages = np.full((work_row.size, max_own), -1, dtype=np.int64)
    per_tile = routes_arr[work_route, 0] // PAGE_ROWS
    for slot in range(max_own):
        idx = work_tile * per_tile + slot
        blk = own_block[work_row]
        ok = (slot < per_tile) & (idx < own_count[work_row])
        own_pages[ok, slot] = own_csr[1][own_csr[0][blk[ok]] + idx[ok]]

    stream_pages, stream_len = gather_segments(row_stream_indptr, stream_of_nnz, work_row)
    stream_indptr = np.concatenate([[0], np.cumsum(stream_len)])
    if kind == "kpage" and owner == "q":
        stream_pages = full_pages_first(stream_pages, stream_indptr, stream_layout.page_mask)
    if stream_indptr[-1] > INT32_MAX:
        raise PlanError(
            f"plan streams {int(stream_indptr[-1])} pages, more than int32 indexing allows; "
            "split the heads into several plans"
        )
    return TilePlan(
        kind=kind,
        owner=owner,
        routes=tuple(tuple(int(v) for v in r) for r in routes),
        work_route=work_route.astype(np.int8),
        work_head=(work_row // nb_own).astype(np.int32),
        work_block=(work_row % nb_own).astype(np.int32),
        own_pages=own_pages.astype(np.int32),
        stream_indptr=stream_indptr.astype(np.int32),
        stream_pages=stream_pages.astype(np.int32),
        own_page_mask=own_layout.page_mask,
        stream_page_mask=stream_layout.page_mask,
        heads=graph.heads,
    )


def _oriented(graph: SparseGraph, owner: str) -> SparseGraph:
    if not isinstance(graph, SparseGraph):
        raise PlanTypeError(f"graph must be a SparseGraph, got {type(graph).__name__}")
    if not isinstance(owner, str) or owner not in OWNERS:
        raise PlanError(f"owner must be one of {OWNERS}, got {owner!r}")
    return graph if owner == "q" else graph.transpose()


def bsa_plan(graph: SparseGraph, owner: str = "q") -> TilePlan:
    """Logical-block plan: one Bq×Bk tile per selected block pair (dead pages included, masked)."""
    g = _oriented(graph, owner)
    if g.q.block_size > 128 or g.k.block_size > 256:
        raise PlanError(f"bsa_plan supports block sizes up to 128, got {g.q.block_size}/{g.k.block_size}")
    routes = ((g.q.block_size, g.k.block_size),)
    route_of_row = np.zeros(g.num_rows, dtype=np.int64)
    return _build("bsa", owner, g, _all_page_csr(g.q), _all_page_csr(g.k), routes, route_of_row, g.q, g.k)


def kpage_route_of_block(live_pages: np.ndarray, route="auto") -> np.ndarray:
    """int64 ``[num_blocks]``: KPage route index per owner block (0 = 64×256, 1 = 128×128)."""
    if route == "auto":
        return np.where(live_pages * PAGE_ROWS <= KPAGE_SMALL_ROUTE_MAX_QROWS, 0, 1).astype(np.int64)
    if route in (0, 1):
        return np.full(live_pages.shape, route, dtype=np.int64)
    raise PlanError(f"route must be 'auto', 0 (64x256) or 1 (128x128), got {route!r}")


def kpage_plan(graph: SparseGraph, route="auto", owner: str = "q") -> TilePlan:
    """KPage plan: live owner pages routed to a tile; live streamed pages packed across blocks."""
    g = _oriented(graph, owner)
    block_route = kpage_route_of_block(g.q.live_pages, route)
    route_of_row = np.tile(block_route, g.heads)
    return _build(
        "kpage", owner, g, _live_page_csr(g.q), _live_page_csr(g.k), KPAGE_ROUTES, route_of_row, g.q, g.k
    )


def stack_head_plans(plans, own_pages: int, stream_pages: int) -> TilePlan:
    """Single-head plans of heads with their own layouts (a HeadStack) as ONE single-head plan over
    their slot spaces laid end to end: head ``h``'s owned pages become ``h · own_pages + p`` and its
    streamed pages ``h · stream_pages + p``, and the page masks are concatenated (pages past a head's
    layout have mask 0). A kernel runs it on the heads' tensors viewed as one head,
    ``[batch, 1, heads · slots, d]``.

    Args:
        plans: one single-head :class:`TilePlan` per head, all of one kind, owner and route set.
        own_pages, stream_pages: pages per head of the owner side and of the streamed side (the
            tensors' slots / 16; at least each head's layout).

    Returns:
        a :class:`TilePlan` with ``heads == 1``, its work items in :func:`launch_order` by route (with
        pair items: a route's plain items, then its pair items); ``stream_vis`` set when any plan has
        pair items (entries of the others: seen by both halves).
    """
    plans = list(plans)
    if not plans:
        raise PlanError("stack_head_plans needs at least one plan")
    first = plans[0]
    for i, p in enumerate(plans):
        if not isinstance(p, TilePlan):
            raise PlanTypeError(f"plans[{i}] must be a TilePlan, got {type(p).__name__}")
        if p.heads != 1:
            raise PlanError(f"plans[{i}] holds {p.heads} heads; stack_head_plans takes single-head plans")
        if (p.kind, p.owner, tuple(p.routes)) != (first.kind, first.owner, tuple(first.routes)):
            raise PlanError(f"plans[{i}] differs from plans[0] in kind, owner or routes")
        if p.own_page_mask.size > own_pages or p.stream_page_mask.size > stream_pages:
            raise PlanError(
                f"plans[{i}] has {p.own_page_mask.size} / {p.stream_page_mask.size} pages, more than "
                f"own_pages={own_pages} / stream_pages={stream_pages}"
            )
    width = max(p.own_pages.shape[1] for p in plans)
    own = []
    for h, p in enumerate(plans):
        o = np.full((p.num_work, width), -1, dtype=np.int64)
        o[:, : p.own_pages.shape[1]] = np.where(
            p.own_pages >= 0, p.own_pages.astype(np.int64) + h * own_pages, -1
        )
        own.append(o)
    own = np.concatenate(own)
    route = np.concatenate([p.work_route for p in plans])
    block = np.concatenate([p.work_block for p in plans])
    lengths = np.concatenate([p.stream_lengths() for p in plans])
    streams = [p.stream_pages.astype(np.int64) + h * stream_pages for h, p in enumerate(plans)]
    bases = np.concatenate([[0], np.cumsum([x.size for x in streams])])
    starts = np.concatenate([p.stream_indptr[:-1].astype(np.int64) + bases[h] for h, p in enumerate(plans)])
    flat = np.concatenate(streams)
    paired = any(p.stream_vis is not None for p in plans)  # pair items: every entry's visibility, 3 = both
    vis = (
        np.concatenate(
            [np.full(p.stream_pages.size, 3) if p.stream_vis is None else p.stream_vis for p in plans]
        )
        if paired
        else None
    )
    # kernels launch route by route; with pair items, a route's plain items first (they may run on a plain
    # kernel), then its pair items: each head's items keep the launch its own plan gives them
    # (first_pair_items); each launch's tail longest first
    key = route.astype(np.int64)
    if vis is not None:
        in_pair_launch = []
        for p in plans:
            item = np.arange(p.num_work)
            if p.stream_vis is None:
                in_pair_launch.append(np.zeros(p.num_work, dtype=bool))
            else:
                in_pair_launch.append(item >= first_pair_items(p)[p.work_route.astype(np.int64)])
        key = 2 * key + np.concatenate(in_pair_launch)
    order = launch_order(key, lengths)
    if vis is not None:
        order = hidden_item_first(order, key, items_hiding_an_entry(vis, starts, starts + lengths))
    lengths = lengths[order]
    indptr = np.concatenate([[0], np.cumsum(lengths)])
    # entry e of sorted item j comes from flat[starts[order[j]] + (e - indptr[j])]
    gather = np.repeat(starts[order] - indptr[:-1], lengths) + np.arange(int(indptr[-1]))

    def masks(attr, pages):
        out = np.zeros(len(plans) * pages, dtype=np.uint16)
        for h, p in enumerate(plans):
            m = getattr(p, attr)
            out[h * pages : h * pages + m.size] = m
        return out

    return TilePlan(
        kind=first.kind,
        owner=first.owner,
        routes=tuple(first.routes),
        work_route=route[order].astype(first.work_route.dtype),
        work_head=np.zeros(order.size, dtype=np.int32),
        work_block=block[order].astype(np.int32),
        own_pages=own[order].astype(np.int32),
        stream_indptr=indptr.astype(np.int32),
        stream_pages=flat[gather].astype(np.int32),
        own_page_mask=masks("own_page_mask", own_pages),
        stream_page_mask=masks("stream_page_mask", stream_pages),
        heads=1,
        stream_vis=None if vis is None else vis[gather].astype(np.uint32),
    )
