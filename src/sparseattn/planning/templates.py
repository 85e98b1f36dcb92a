"""What a device plan takes from the layouts alone: work-item templates and stream tables (numpy).

The device planner (:mod:`.device`, its numpy twin :mod:`.device_emulation`) splits a plan in two. What
depends only on the Q and K layouts is fixed per call site and built here once, on the host:

* a :class:`StreamTable` of the streamed side: each block's pages (its live pages for KPage, all of them
  for BSA), how many are full, and every page's row mask;
* an :class:`ItemTemplate`: the work items of one head — their owned pages, their route (tile rows
  ``M``), the member blocks whose selections they stream (one block, or the two blocks / packed halves of
  a pair item, each with the owned page slots it covers), the order their stream takes (``MODE_*``) and
  the launch each belongs to.

Which items exist never depends on the selection: every owner block with valid rows has its tiles (a
block that selects nothing still writes its rows: ``o = 0``, ``lse = -inf``), and pair items join blocks
by a rule of the layout (:mod:`.layout_pairs`). The selection only decides what each item streams, which
the device computes per call. The template is the same for every head and batch entry: a call with
``heads`` rows of selections (batch · heads) runs ``heads`` copies of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..constants import KPAGE_ROUTES, PAGE_ROWS
from ..layouts import BlockLayout
from .layout_pairs import (
    HALF_PAGES,
    backward_layout_pairs,
    backward_pairs_pay,
    candidate_edges,
    forward_layout_groups,
    forward_pairs_pay,
    full_blocks,
)
from .tile_plan import PlanError, kpage_route_of_block, pages_hold_rows
from .work_list import OWN_PAGES

#: Stream orders of an item (``kernels_cu/planner.cu``'s PLAN_MODE_*): the selected stream blocks' pages in
#: block order; the same with full pages first; [half A only | both | half B only]; that with whole chunks
#: of A-only and B-only pages alternated ahead (:func:`~.pair_forward.interleave_exclusive_chunks`).
MODE_PLAIN, MODE_FULL_FIRST, MODE_HALVES, MODE_INTERLEAVED = 0, 1, 2, 3
#: Owned page slots covered by a member: all, rows 0–63 (half A), rows 64–127 (half B).
ALL_SLOTS, HALF_A, HALF_B = 0xFF, 0x0F, 0xF0
#: Items of one head in one launch the device's sort takes (``PLAN_SORT_MAX``).
MAX_SEGMENT_ITEMS = 16384
#: Route of the backward's pair items (128 owned rows, 128 streamed).
PAIR_ROUTE = KPAGE_ROUTES.index((128, 128))
KINDS = ("kpage", "bsa")


@dataclass(frozen=True, eq=False)
class StreamTable:
    """The streamed side's pages, block by block, as the device planner reads them.

    Attributes:
        first: int32 ``[blocks + 1]``: block j's pages are ``pages[first[j]:first[j + 1]]``.
        pages: int32: page ids, each block's in order (live pages for KPage, every page for BSA).
        full: int32 ``[blocks]``: pages of block j whose 16 rows are all valid.
        mask: uint16 ``[layout pages]``: row mask of every page.
        alive: bool ``[blocks]``: blocks with valid rows (a selection of another block is dropped).
    """

    first: np.ndarray
    pages: np.ndarray
    full: np.ndarray
    mask: np.ndarray
    alive: np.ndarray

    @classmethod
    def of(cls, layout: BlockLayout, kind: str = "kpage") -> StreamTable:
        ppb = layout.pages_per_block
        if kind == "kpage":
            pages = np.flatnonzero(layout.page_live)
            counts = layout.live_pages
        else:
            pages = np.arange(layout.num_pages)
            counts = np.full(layout.num_blocks, ppb)
        first = np.concatenate([[0], np.cumsum(counts)])
        block_of_page = np.repeat(np.arange(layout.num_blocks), counts)
        full_page = layout.page_mask[pages] == 0xFFFF
        full = np.bincount(block_of_page, weights=full_page, minlength=layout.num_blocks)
        return cls(
            first=first.astype(np.int32),
            pages=pages.astype(np.int32),
            full=np.asarray(full, dtype=np.int32),
            mask=layout.page_mask.astype(np.uint16),
            alive=layout.valid_rows > 0,
        )

    @property
    def num_blocks(self) -> int:
        return self.first.size - 1

    @cached_property
    def block_pages(self) -> np.ndarray:
        """int64 ``[blocks]``: pages block j streams."""
        return np.diff(self.first.astype(np.int64))


@dataclass(frozen=True, eq=False)
class ItemTemplate:
    """The work items of one head, one orientation, repeated for every head of a call.

    Attributes:
        owner: ``"q"`` (items own Q rows: the forward, the backward's dQ pass) or ``"kv"``.
        kind: ``"kpage"`` or ``"bsa"``.
        routes: tile shapes ``(M, N)``; ``route`` indexes them.
        info: int32 ``[I, 4]``: stream mode (``MODE_*``), owned rows ``M``, member blocks, launch key
            (``2 · route + pair`` for plans launched by route; 0 for the forward's single launch).
        members, bits: int32 ``[I, 8]``: member owner blocks (``-1`` past the item's members) and the owned
            page slots each covers (bit s = slot s).
        own: int32 ``[I, 8]``: owned page ids, ``-1`` padded.
        block, tile: int32 ``[I]``: the first member and which of its tiles the item is.
        route: int8 ``[I]``.
        owner_mask: uint16 ``[owner pages]``: the owner side's row masks.
        owner_alive: bool ``[owner blocks]``.
        stream: the streamed side's :class:`StreamTable`.
        chunk: keys per chunk of the forward kernel (64 when every route is 64 keys wide, else 128).
        matched: items ``[0, matched)`` are the slots of the forward's full 64-row blocks (block order),
            which every head matches in pairs per call: a slot becomes its block's pair item with the
            block it matched (the lower block's slot), nothing (the higher's), or the block alone; their
            rows here are the block alone.
        edges: int32 ``[E, 2]``: the slots (a < b) a matching may join (:func:`~.layout_pairs.candidate_edges`).
    """

    owner: str
    kind: str
    routes: tuple
    info: np.ndarray
    members: np.ndarray
    bits: np.ndarray
    own: np.ndarray
    block: np.ndarray
    tile: np.ndarray
    route: np.ndarray
    owner_mask: np.ndarray
    owner_alive: np.ndarray
    stream: StreamTable
    chunk: int
    matched: int = 0
    edges: np.ndarray | None = None

    @property
    def num_items(self) -> int:
        return self.info.shape[0]

    @property
    def mode(self) -> np.ndarray:
        return self.info[:, 0]

    @property
    def rows(self) -> np.ndarray:
        return self.info[:, 1]

    @property
    def key(self) -> np.ndarray:
        return self.info[:, 3]

    @property
    def owner_blocks(self) -> int:
        return self.owner_alive.size

    @property
    def has_pairs(self) -> bool:
        """Whether items may hold two halves (the kernels' pair instantiations run them): pair items of the
        template, or matched slots, which become pair items per call."""
        return self.matched > 0 or bool(np.isin(self.mode, (MODE_HALVES, MODE_INTERLEAVED)).any())

    @cached_property
    def launches(self) -> tuple[tuple[int, int, int, bool], ...]:
        """``(key, first item, items, pair)`` of each launch key of one head, in key order: the items of a
        key are contiguous; ``pair``: the launch runs pair items (odd keys)."""
        keys = self.key.astype(np.int64)
        out, start = [], 0
        for k in np.unique(keys):
            n = int(np.count_nonzero(keys == k))
            out.append((int(k), start, n, bool(k % 2)))
            start += n
        return tuple(out)

    def uncovered_pages(self, owner_pages: int) -> np.ndarray:
        """int64: owner pages no item owns (their gradients are zeroed by the wrapper)."""
        covered = np.zeros(owner_pages, dtype=bool)
        own = self.own[self.own >= 0]
        covered[own] = True
        return np.flatnonzero(~covered)

    def uncovered_rows_valid(self) -> bool:
        """Whether a page no item owns holds a valid row (else those pages are all padding)."""
        return pages_hold_rows(self.owner_mask, self.uncovered_pages(self.owner_mask.size))

    def stream_slices(self, row_selections: int) -> np.ndarray:
        """int64 ``[items + 1]``: the forward items' slices of one head's part of the stream buffer (offsets;
        a head's part holds ``[-1]`` entries) when every Q block selects at most ``row_selections`` K blocks:
        each item's bound as in :meth:`stream_capacity`, a matched slot's that of two blocks (it may become
        its block's pair item with another)."""
        if self.owner != "q":
            raise ValueError("stream slices are the forward's (items that own Q rows)")
        members = self.info[:, 2].astype(np.int64).copy()
        members[: self.matched] = np.maximum(members[: self.matched], 2)
        per_item = np.minimum(self._whole_pages(), members * self._biggest_pages(row_selections))
        return np.concatenate([[0], np.cumsum(per_item)]).astype(np.int64)

    def _whole_pages(self) -> int:
        return int(self.stream.block_pages.sum())

    def _biggest_pages(self, row_selections: int) -> int:
        """The live pages of the ``row_selections`` largest live streamed blocks."""
        pages = self.stream.block_pages
        k = min(row_selections, int(np.count_nonzero(self.stream.alive)))
        return int(np.sort(pages)[::-1][:k].sum()) if k else 0

    def stream_capacity(self, heads: int, row_selections: int) -> int:
        """Stream entries the plans of ``heads`` heads can need at most when every Q block selects at
        most ``row_selections`` K blocks (the top-k's k; a mask: every block)."""
        pages = self.stream.block_pages
        whole = self._whole_pages()
        if self.owner == "q":  # an item streams the union of its members' selections
            biggest = self._biggest_pages(row_selections)
            per_item = np.minimum(whole, self.info[:, 2].astype(np.int64) * biggest)
            return int(heads * per_item.sum())
        # K/V-owned: a Q block's pages reach each item of every K block it selects, and no more
        k = min(row_selections, self.owner_blocks)
        items_per_block = np.bincount(self.members[self.members >= 0], minlength=self.owner_blocks)
        bound = int(pages.sum()) * k * int(items_per_block.max(initial=1))
        return int(heads * min(bound, whole * self.num_items))


def _owned_pages(layout: BlockLayout, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """CSR (first, pages) over blocks of the pages an owner block owns: live ones (KPage) or all (BSA)."""
    table = StreamTable.of(layout, kind)
    return table.first.astype(np.int64), table.pages.astype(np.int64)


def _per_block_items(layout: BlockLayout, kind: str, route, mode: int, key_of_route):
    """Columns of per-block items: one per tile of every block with valid rows, block order."""
    first, pages = _owned_pages(layout, kind)
    count = np.diff(first)
    if kind == "kpage":
        block_route = kpage_route_of_block(layout.live_pages.astype(np.int64), route)
        rows = np.asarray(KPAGE_ROUTES, dtype=np.int64)[block_route, 0]
    else:
        block_route = np.zeros(layout.num_blocks, dtype=np.int64)
        rows = np.full(layout.num_blocks, layout.block_size, dtype=np.int64)
    tiles = np.where(layout.valid_rows > 0, -(-count * PAGE_ROWS // rows), 0)
    items = []
    for b in np.flatnonzero(tiles):
        per_tile = int(rows[b]) // PAGE_ROWS
        for t in range(int(tiles[b])):
            own = pages[first[b] + t * per_tile : first[b] + min(count[b], (t + 1) * per_tile)]
            items.append(
                _item(mode, int(rows[b]), [b], [ALL_SLOTS], own, b, t, int(block_route[b]), key_of_route)
            )
    return items


def _item(mode, rows, members, bits, own, block, tile, route, key_of_route):
    return dict(
        mode=mode,
        rows=rows,
        members=list(members),
        bits=list(bits),
        own=np.asarray(own, dtype=np.int64),
        block=int(block),
        tile=int(tile),
        route=int(route),
        key=int(key_of_route(route)),
    )


def _pair_item(layout: BlockLayout, half_a, half_b, mode: int, key: int):
    """A 128-row item whose half A owns the live pages of the blocks ``half_a`` (slots 0–3) and half B
    those of ``half_b`` (slots 4–7); each member covers the slots of its own pages."""
    live = layout.page_live.reshape(layout.num_blocks, layout.pages_per_block)
    own = np.full(OWN_PAGES, -1, dtype=np.int64)
    members, bits = [], []
    for half, group in enumerate((half_a, half_b)):
        slot = half * HALF_PAGES
        for b in np.asarray(group, dtype=np.int64).tolist():
            ids = b * layout.pages_per_block + np.flatnonzero(live[b])
            own[slot : slot + ids.size] = ids
            members.append(b)
            bits.append(((1 << ids.size) - 1) << slot)
            slot += ids.size
    first = int(np.concatenate([np.asarray(half_a), np.asarray(half_b)])[0])
    return dict(
        mode=mode,
        rows=128,
        members=members,
        bits=bits,
        own=own,
        block=first,
        tile=0,
        route=PAIR_ROUTE,
        key=key,
    )


def _assemble(
    owner,
    kind,
    routes,
    items,
    own_layout: BlockLayout,
    stream_layout: BlockLayout,
    matched: int = 0,
    edges=None,
) -> ItemTemplate:
    n = len(items)
    info = np.zeros((n, 4), dtype=np.int32)
    members = np.full((n, OWN_PAGES), -1, dtype=np.int32)
    bits = np.zeros((n, OWN_PAGES), dtype=np.int32)
    own = np.full((n, OWN_PAGES), -1, dtype=np.int32)
    for i, it in enumerate(items):
        m = len(it["members"])
        info[i] = (it["mode"], it["rows"], m, it["key"])
        members[i, :m] = it["members"]
        bits[i, :m] = it["bits"]
        own[i, : it["own"].size] = it["own"]
    used = {tuple(routes[r]) for r in {it["route"] for it in items}}
    chunk = 64 if used and all(n_ == 64 for _, n_ in used) else 128
    template = ItemTemplate(
        owner=owner,
        kind=kind,
        routes=tuple(tuple(int(v) for v in r) for r in routes),
        info=info,
        members=members,
        bits=bits,
        own=own,
        block=np.array([it["block"] for it in items], dtype=np.int32),
        tile=np.array([it["tile"] for it in items], dtype=np.int32),
        route=np.array([it["route"] for it in items], dtype=np.int8),
        owner_mask=own_layout.page_mask.astype(np.uint16),
        owner_alive=own_layout.valid_rows > 0,
        stream=StreamTable.of(stream_layout, kind),
        chunk=chunk,
        matched=matched,
        edges=edges,
    )
    for _, _, count, _ in template.launches:
        if count > MAX_SEGMENT_ITEMS:
            raise PlanError(
                f"the device planner sorts at most {MAX_SEGMENT_ITEMS} items of one head per launch; this "
                f"layout has {count} (owner blocks: {own_layout.num_blocks}); plan it on the host"
            )
    return template


def _check(q: BlockLayout, k: BlockLayout, kind: str, route) -> None:
    for name, layout in (("q_layout", q), ("k_layout", k)):
        if not isinstance(layout, BlockLayout):
            raise PlanError(f"{name} must be a BlockLayout, got {type(layout).__name__}")
    if kind not in KINDS:
        raise PlanError(f"kind must be one of {KINDS}, got {kind!r}")
    if route not in ("auto", 0, 1, "pair"):
        raise PlanError(f"route must be 'auto', 0 (64x256), 1 (128x128) or 'pair', got {route!r}")
    if kind == "bsa":
        if route == "pair":
            raise PlanError("route='pair' pairs KPage's 64-row blocks (kind='kpage'), not BSA tiles")
        if q.block_size not in (64, 128) or k.block_size not in (64, 128):
            raise PlanError(f"BSA plans take blocks of 64 or 128 rows, got {q.block_size} / {k.block_size}")


def forward_route(q: BlockLayout, kind: str = "kpage", route="auto"):
    """The route the device forward runs: ``route``, or for KPage's ``"auto"`` ``"pair"`` where
    :func:`~.layout_pairs.forward_pairs_pay` (a rule of the Q layout), else ``"auto"``."""
    if kind == "kpage" and route == "auto" and forward_pairs_pay(q):
        return "pair"
    return route


def backward_route(k: BlockLayout, kind: str = "kpage", route="auto", pairs_allowed: bool = True):
    """The route the device backward runs: ``route``, or for KPage's ``"auto"`` ``"pair"`` where the K
    layout has 64-row blocks to pair and the kernel runs pair items (``pairs_allowed``)."""
    if kind == "kpage" and route == "auto" and pairs_allowed and backward_pairs_pay(k):
        return "pair"
    return route


def forward_template(q: BlockLayout, k: BlockLayout, kind: str = "kpage", route="auto") -> ItemTemplate:
    """Q-owned items of the forward (``route`` as the device runs it: see :func:`forward_route`).

    KPage's per-block routes stream full pages first (``MODE_FULL_FIRST``), BSA's every page of every
    selected block; ``"pair"``'s pair items stream their halves' union, A-only and B-only chunks
    alternated (``MODE_INTERLEAVED``): first one slot per full 64-row block, matched per head and call
    (``matched``, ``edges``), then the packed halves of the partial ones, then ``"auto"``'s per-block items
    of the other blocks."""
    _check(q, k, kind, route)
    route = forward_route(q, kind, route)
    mode = MODE_FULL_FIRST if kind == "kpage" else MODE_PLAIN
    routes = KPAGE_ROUTES if kind == "kpage" else ((q.block_size, k.block_size),)
    one_launch = lambda r: 0
    if route != "pair":
        return _assemble("q", kind, routes, _per_block_items(q, kind, route, mode, one_launch), q, k)
    eligible = full_blocks(q)
    per_block = _per_block_items(q, kind, "auto", mode, one_launch)
    items = [it for it in per_block if eligible[it["block"]]]  # the matched slots, block order
    halves_a, halves_b = forward_layout_groups(q)
    items += [_pair_item(q, a, b, MODE_INTERLEAVED, 0) for a, b in zip(halves_a, halves_b)]
    placed = eligible.copy()
    for item in items:
        placed[item["members"]] = True
    items += [it for it in per_block if not placed[it["block"]]]
    slot = np.cumsum(eligible) - 1
    a, b = candidate_edges(q, eligible)
    edges = np.stack([slot[a], slot[b]], axis=1).astype(np.int32).reshape(-1, 2)
    return _assemble("q", kind, routes, items, q, k, matched=int(eligible.sum()), edges=edges)


def backward_template(
    q: BlockLayout, k: BlockLayout, kind: str = "kpage", route="auto", pairs_allowed: bool = True
) -> ItemTemplate:
    """K/V-owned items of the backward: per K/V block tile, streaming the Q pages of the Q blocks that
    select it in block order (``MODE_PLAIN``); with ``"pair"`` (:func:`backward_route`), 64-row K/V
    blocks joined two by two (``MODE_HALVES``). Items are grouped by launch key ``2 · route + pair``,
    each group in block (pair) order."""
    _check(q, k, kind, route)
    route = backward_route(k, kind, route, pairs_allowed)
    routes = KPAGE_ROUTES if kind == "kpage" else ((k.block_size, q.block_size),)
    if route != "pair":
        items = _per_block_items(k, kind, route, MODE_PLAIN, lambda r: 2 * r)
    else:
        firsts, seconds = backward_layout_pairs(k)
        paired = np.zeros(k.num_blocks, dtype=bool)
        paired[firsts] = paired[seconds] = True
        items = [
            it
            for it in _per_block_items(k, kind, "auto", MODE_PLAIN, lambda r: 2 * r)
            if not paired[it["block"]]
        ]
        items += [_pair_item(k, [a], [b], MODE_HALVES, 2 * PAIR_ROUTE + 1) for a, b in zip(firsts, seconds)]
    items.sort(key=lambda it: it["key"])  # stable: block order (pair order) within a launch
    return _assemble("kv", kind, routes, items, k, q)


def dq_template(q: BlockLayout, k: BlockLayout, kind: str = "kpage", route="auto") -> ItemTemplate:
    """Q-owned per-block items of the backward's dQ pass (the forward's per-block routes; never pair
    items), grouped by launch key = route."""
    _check(q, k, kind, route)
    route = "auto" if route == "pair" else route
    mode = MODE_FULL_FIRST if kind == "kpage" else MODE_PLAIN
    routes = KPAGE_ROUTES if kind == "kpage" else ((q.block_size, k.block_size),)
    items = _per_block_items(q, kind, route, mode, lambda r: 2 * r)
    items.sort(key=lambda it: it["key"])
    return _assemble("q", kind, routes, items, q, k)
