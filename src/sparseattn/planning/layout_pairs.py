"""The pair items the device planner makes: candidates from the layout, matches from the selection.

The host pair builders match blocks over every pair that shares selected pages (a greedy matching over
the whole graph). The device planner narrows the candidates to what the layout says are neighbours, so
that a head's matching is a few passes over a short, fixed edge list:

* forward, full 64-row Q blocks (4 live pages): every head matches its own blocks greedily by the K
  blocks they both select, over the edges of :func:`candidate_edges` (a video layout's 26 spatial
  neighbours, else the next blocks in order), heaviest first; the blocks left are paired two by two in
  block order (:func:`forward_matched_pairs`);
* forward, partial 64-row Q blocks (1–3 live pages): grouped by proximity into halves of at most four
  pages and items of two halves on a video layout (:func:`neighbourhood_groups`), else packed in block
  order (a half closes when the next block does not fit), the halves two by two
  (:func:`forward_layout_groups`), the same in every head;
* backward (:func:`backward_layout_pairs`): 64-row K/V blocks (1–4 live pages) as neighbours (2i, 2i + 1)
  first, then the others two by two in block order, the same in every head.

Counted on VSA 480p (8 heads): the forward pair list with neighbour candidates streams 1.015x the chunks
of the host's matching over all pairs (1.09x with fixed neighbour pairs), and 1.03x with the packed halves
in block order. With the partial blocks grouped by proximity, the device's forward list streams 1.001x
(480p) and 1.010x (720p) the host's pages over all 40 heads
(``data/bench/experiments/device_planner_work_counts_proximity.txt``).
"""

from __future__ import annotations

import itertools

import numpy as np

from .tile_plan import kpage_route_of_block

#: Owned page slots of a 64-row half of a pair item.
HALF_PAGES = 4


def small_blocks(layout) -> np.ndarray:
    """bool ``[blocks]``: the blocks of a :class:`~sparseattn.layouts.BlockLayout` on KPage's 64-row
    route (1–4 live pages): the blocks pair items join."""
    live = layout.live_pages.astype(np.int64)
    return (kpage_route_of_block(live) == 0) & (live > 0)


def neighbour_firsts(small: np.ndarray) -> np.ndarray:
    """int64: the even blocks b with ``small[b]`` and ``small[b + 1]``."""
    first = np.arange(0, small.size - 1, 2)
    return first[small[first] & small[first + 1]]


def neighbours_then_in_order(small: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int64 ``(firsts, seconds)``: the blocks with ``small`` set paired as neighbours (2i, 2i + 1) first,
    then the rest two by two in block order (one may be left over)."""
    small = np.array(small, dtype=bool)
    firsts = neighbour_firsts(small)
    small[firsts] = False
    small[firsts + 1] = False
    rest = np.flatnonzero(small)
    rest = rest[: rest.size - rest.size % 2]
    return np.concatenate([firsts, rest[0::2]]), np.concatenate([firsts + 1, rest[1::2]])


def packed_in_order(blocks: np.ndarray, live: np.ndarray, room: int = HALF_PAGES) -> list[np.ndarray]:
    """``blocks`` (sorted) cut, in order, into groups of at most ``room`` live pages (``live[b]``): a group
    closes when the next block does not fit."""
    groups, current, used = [], [], 0
    for b in np.asarray(blocks, dtype=np.int64).tolist():
        if current and used + int(live[b]) > room:
            groups.append(np.asarray(current, dtype=np.int64))
            current, used = [], 0
        current.append(b)
        used += int(live[b])
    if current:
        groups.append(np.asarray(current, dtype=np.int64))
    return groups


def full_blocks(layout) -> np.ndarray:
    """bool ``[blocks]``: 64-row blocks with four live pages (the forward matches them in pairs)."""
    return small_blocks(layout) & (layout.live_pages == HALF_PAGES)


def forward_layout_groups(layout) -> tuple[list, list]:
    """The forward's packed halves of a Q layout: ``(halves_a, halves_b)``, lists of int64 block arrays of
    its partial 64-row blocks (an item's B half empty where it has one half only). A video layout groups
    them by proximity (:func:`neighbourhood_groups`), any other packs them in block order, halves two by
    two."""
    live = layout.live_pages.astype(np.int64)
    blocks = np.flatnonzero(small_blocks(layout) & (live < HALF_PAGES))
    if layout.tile_grid is not None and 1 < blocks.size <= NEIGHBOURHOOD_GROUPING_MAX:
        return neighbourhood_groups(layout, blocks)
    groups = packed_in_order(blocks, live)
    return groups[0::2], groups[1::2] + [np.zeros(0, np.int64)] * (len(groups) % 2)


#: Chebyshev radius (in tiles) of the neighbourhood :func:`neighbourhood_groups` compares.
NEIGHBOURHOOD_RADIUS = 1
#: Above this many partial blocks a layout keeps block order (the grouping's pair weights grow with n²).
NEIGHBOURHOOD_GROUPING_MAX = 8192


def neighbourhood_groups(layout, blocks: np.ndarray) -> tuple[list, list]:
    """Partial blocks of a video layout (``tile_grid``) grouped by proximity, the same in every head:
    ``(halves_a, halves_b)`` as :func:`forward_layout_groups`.

    Three levels of greedy matching merge units (one block each to start) into units of at most 2, then 4
    pages (a half), then two halves (an item); a pair's weight is how many tiles within
    :data:`NEIGHBOURHOOD_RADIUS` of the two units' tiles coincide (nearby blocks select nearly the same K
    blocks, so an item of neighbours streams few pages its members do not all need); the units a level
    leaves are paired in order where they fit. Counted on VSA (every head): the partial blocks stream
    0.84x (480p) and 0.87x (720p) the K pages of block order, fewer than the host's packing by selection
    (0.92x / 0.94x), with as many items (``data/bench/experiments/NOTES_device_planner.md``, v13).
    """
    from scipy import sparse

    blocks = np.asarray(blocks, dtype=np.int64)
    live = layout.live_pages.astype(np.int64)
    nt, nh, nw, per_tile = layout.tile_grid
    grid = np.asarray((nt, nh, nw))
    coords = np.stack(np.unravel_index(blocks // per_tile, (nt, nh, nw)), axis=1)
    steps = np.asarray(
        list(itertools.product(range(-NEIGHBOURHOOD_RADIUS, NEIGHBOURHOOD_RADIUS + 1), repeat=3))
    )
    near = coords[:, None, :] + steps[None, :, :]  # [blocks, steps, 3]
    inside = ((near >= 0) & (near < grid)).all(axis=2)
    rows = np.broadcast_to(np.arange(blocks.size)[:, None], inside.shape)[inside]
    cols = np.ravel_multi_index(near[inside].T, (nt, nh, nw))
    features = sparse.csr_matrix(
        (np.ones(rows.size, np.float32), (rows, cols)), shape=(blocks.size, nt * nh * nw)
    )
    units = [np.asarray([b]) for b in blocks]
    for cap in (2, HALF_PAGES):  # units of at most 2 pages, then halves of at most 4
        groups = _merge_level(features, live, units, cap)
        rows = np.repeat(np.arange(len(groups)), [len(g) for g in groups])
        merge = sparse.csr_matrix(
            (np.ones(rows.size, np.float32), (rows, np.concatenate(groups))), shape=(len(groups), len(units))
        )
        features = ((merge @ features) > 0).astype(np.float32)
        units = [np.sort(np.concatenate([units[i] for i in g])) for g in groups]
    empty = np.zeros(0, np.int64)
    items = [  # the halves two by two
        (units[g[0]], units[g[1]] if len(g) > 1 else empty)
        for g in _merge_level(features, live, units, 2 * HALF_PAGES)
    ]
    items.sort(key=lambda item: int(item[0].min()))
    return [a for a, _ in items], [b for _, b in items]


def _merge_level(features, live: np.ndarray, units: list, cap: int) -> list[list[int]]:
    """One level of :func:`neighbourhood_groups`: the units (block arrays, ``features`` their neighbourhood
    tiles) as groups of one unit or two (lower index first, groups in the order of it): the greedy
    matching by shared tiles among pairs whose live pages fit ``cap``, then the units left paired in
    block order where they fit."""
    n = len(units)
    pages = np.asarray([int(live[u].sum()) for u in units], dtype=np.int64)
    shared = (features @ features.T).tocoo()
    a, b, w = shared.row.astype(np.int64), shared.col.astype(np.int64), shared.data
    keep = (a < b) & (w > 0) & (pages[a] + pages[b] <= cap)
    a, b, w = a[keep], b[keep], w[keep]
    chosen = greedy_matching(a, b, w, n)
    partner = np.full(n, -1, dtype=np.int64)
    partner[a[chosen]], partner[b[chosen]] = b[chosen], a[chosen]
    rest = [i for i in np.argsort([int(u.min()) for u in units], kind="stable").tolist() if partner[i] < 0]
    k = 0
    while k + 1 < len(rest):
        if pages[rest[k]] + pages[rest[k + 1]] <= cap:
            partner[rest[k]], partner[rest[k + 1]] = rest[k + 1], rest[k]
            k += 2
        else:
            k += 1
    return [[i] if partner[i] < 0 else [i, int(partner[i])] for i in range(n) if not 0 <= partner[i] < i]


#: Tile steps (t, h, w) to a neighbour a pair may join: half of the 26-neighbourhood (the other half gives
#: the same edges reversed).
NEIGHBOUR_STEPS = tuple(step for step in itertools.product((-1, 0, 1), repeat=3) if step > (0, 0, 0))
#: Without a tile grid, each block's candidates are the next blocks of its class in block order.
ORDER_WINDOW = 4


def candidate_edges(layout, eligible: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int64 ``(a, b)``: the edges a matching may take between blocks with ``eligible`` set (a < b, sorted):
    for a video layout (``tile_grid``), the same block of every neighbouring tile (:data:`NEIGHBOUR_STEPS`);
    else each eligible block and the next :data:`ORDER_WINDOW` eligible ones."""
    eligible = np.asarray(eligible, dtype=bool)
    if layout.tile_grid is None:
        ids = np.flatnonzero(eligible)
        pairs = [(ids[:-w], ids[w:]) for w in range(1, ORDER_WINDOW + 1) if ids.size > w]
    else:
        nt, nh, nw, per_tile = layout.tile_grid
        blocks = np.arange(layout.num_blocks)
        tile, rank = blocks // per_tile, blocks % per_tile
        coords = np.stack(np.unravel_index(tile, (nt, nh, nw)), axis=1)
        pairs = []
        for step in NEIGHBOUR_STEPS:
            to = coords + np.asarray(step)
            inside = ((to >= 0) & (to < (nt, nh, nw))).all(axis=1)
            other = np.ravel_multi_index(to[inside].T, (nt, nh, nw)) * per_tile + rank[inside]
            pairs.append((blocks[inside], other))
    a = np.concatenate([p[0] for p in pairs]) if pairs else np.zeros(0, np.int64)
    b = np.concatenate([p[1] for p in pairs]) if pairs else np.zeros(0, np.int64)
    keep = eligible[a] & eligible[b] & (a != b)
    a, b = np.minimum(a[keep], b[keep]), np.maximum(a[keep], b[keep])
    key = np.unique(a * layout.num_blocks + b)
    return key // layout.num_blocks, key % layout.num_blocks


def greedy_matching(a: np.ndarray, b: np.ndarray, weight: np.ndarray, n: int) -> np.ndarray:
    """int64 ``[M]``: the edges (``a[i]``, ``b[i]``; vertices in ``[0, n)``, a ≠ b) of the greedy matching
    that takes the heaviest edge first (ties: smaller ``a``, then smaller ``b``) unless one of its ends is
    taken. Computed in rounds: every edge that ranks first at both its free ends joins at once, which
    gives exactly the sequential greedy's matching in a few vectorized passes (the device's too)."""
    rank_order = np.lexsort((b, a, -weight))
    a, b = np.asarray(a, dtype=np.int64)[rank_order], np.asarray(b, dtype=np.int64)[rank_order]
    used = np.zeros(n, dtype=bool)
    live = np.arange(a.size)  # candidate edges by rank
    chosen = []
    while live.size:
        best = np.full(n, a.size, dtype=np.int64)
        np.minimum.at(best, a[live], live)
        np.minimum.at(best, b[live], live)
        win = live[(best[a[live]] == live) & (best[b[live]] == live)]
        chosen.append(win)
        used[a[win]] = used[b[win]] = True
        live = live[~(used[a[live]] | used[b[live]])]
    return np.sort(rank_order[np.concatenate(chosen)]) if chosen else np.zeros(0, dtype=np.int64)


#: Bits of an edge key (``plan_pair_weights``): the shared K blocks (capped), a hash of the two slots that
#: breaks ties (so that equal weights along a row of blocks do not chain the matching's rounds), and the
#: two slots (the key is unique).
KEY_WEIGHT_MAX, KEY_TIE_BITS, KEY_SLOT_BITS = 4095, 12, 20


def edge_keys(a: np.ndarray, b: np.ndarray, shared: np.ndarray) -> np.ndarray:
    """uint64 keys of edges between slots ``a < b`` sharing ``shared`` selected blocks: larger = taken first
    (more shared blocks, then a hash of (a, b), then lower a, then lower b); 0 for edges sharing none."""
    a, b = np.asarray(a, dtype=np.uint64), np.asarray(b, dtype=np.uint64)
    mask32 = np.uint64(0xFFFFFFFF)
    mix = ((a * np.uint64(0x9E3779B1)) & mask32) ^ ((b * np.uint64(0x85EBCA77)) & mask32)
    tie = (mix >> np.uint64(20)) & np.uint64((1 << KEY_TIE_BITS) - 1)
    top = np.uint64((1 << KEY_SLOT_BITS) - 1)
    weight = np.minimum(np.asarray(shared, dtype=np.uint64), np.uint64(KEY_WEIGHT_MAX))
    key = (weight << np.uint64(52)) | (tie << np.uint64(40)) | ((top - a) << np.uint64(20)) | (top - b)
    return np.where(np.asarray(shared) > 0, key, np.uint64(0))


def greedy_matching_by_key(a: np.ndarray, b: np.ndarray, key: np.ndarray, n: int) -> np.ndarray:
    """int64: the edges of the greedy matching that takes the largest (unique) ``key`` first, as
    :func:`greedy_matching`."""
    order = np.argsort(np.asarray(key, dtype=np.uint64))[::-1]
    rank = np.empty(order.size, dtype=np.int64)
    rank[order] = np.arange(order.size)
    return greedy_matching(a, b, -rank.astype(np.float64), n)


def forward_matched_pairs(layout, selects: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One head's pairs of full 64-row Q blocks: int64 ``(firsts, seconds)`` (first < second), in order of
    the first. ``selects``: bool ``[q_blocks, k_blocks]``, what each Q block selects. The greedy matching
    over :func:`candidate_edges` by the number of K blocks both select (:func:`edge_keys`; edges sharing none
    are left out), then the blocks left two by two in block order."""
    eligible = full_blocks(layout)
    a, b = candidate_edges(layout, eligible)
    selects = np.asarray(selects, dtype=bool)
    shared = (selects[a] & selects[b]).sum(axis=1) if a.size else np.zeros(0, np.int64)
    keep = shared > 0
    slot = np.cumsum(eligible) - 1  # the key ranks slots (blocks in order), as the device does
    keys = edge_keys(slot[a[keep]], slot[b[keep]], shared[keep])
    chosen = greedy_matching_by_key(a[keep], b[keep], keys, layout.num_blocks)
    firsts, seconds = a[keep][chosen], b[keep][chosen]
    free = eligible.copy()
    free[firsts] = free[seconds] = False
    rest = np.flatnonzero(free)
    rest = rest[: rest.size - rest.size % 2]
    firsts, seconds = np.concatenate([firsts, rest[0::2]]), np.concatenate([seconds, rest[1::2]])
    order = np.argsort(firsts, kind="stable")
    return firsts[order], seconds[order]


def backward_layout_pairs(layout) -> tuple[np.ndarray, np.ndarray]:
    """The backward's pair items of a K/V layout: ``(firsts, seconds)`` (int64): its 64-row blocks as
    neighbours first, then two by two in block order."""
    return neighbours_then_in_order(small_blocks(layout))


def forward_pairs_pay(layout) -> bool:
    """The device planner's ``route="auto"`` rule for the forward: pair items where at least half of
    the Q layout's blocks with live pages are 64-row blocks (VSA's cubes; not SSTA's 128-row tiles or
    SVG2's clusters, where the host's page count keeps the per-block routes too)."""
    live = layout.live_pages.astype(np.int64)
    alive = int(np.count_nonzero(live))
    small = int(np.count_nonzero(small_blocks(layout)))
    return small >= 2 and 2 * small >= alive


def backward_pairs_pay(layout) -> bool:
    """``route="auto"``'s rule for the backward (host and device): pair items where the K/V layout has
    two or more 64-row blocks."""
    return int(np.count_nonzero(small_blocks(layout))) >= 2
