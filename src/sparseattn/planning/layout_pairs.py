"""Pair items chosen by a rule of the layout alone: what the device planner pairs.

The host pair builders match blocks by the pages their selections share (a greedy matching over the
graph), which needs the selection before the pairs. The device planner fixes its pairs per call site
instead, from the layout, so that a call's pair items are known before its selection and every head
and batch entry pairs the same blocks:

* forward (:func:`forward_layout_pairs`): full 64-row Q blocks (4 live pages) as neighbours (2i, 2i + 1)
  first, then the other full ones two by two in block order; partial 64-row blocks (1–3 live pages)
  packed in block order into halves of at most four pages (a half closes when the next block does not
  fit), and the halves two by two;
* backward (:func:`backward_layout_pairs`): 64-row K/V blocks (1–4 live pages) as neighbours first, then
  the others two by two in block order.

Measured on VSA 480p (3 heads, host plans): the forward pair list streams 0.56x the pages of the
per-block routes with these pairs and 0.50x with the matched ones; the time of the pair kernel follows
each half's steps, which the pairing leaves unchanged (NOTES_kpage_fwd, v13: matching instead of
neighbour pairs changed VSA's forward by about 1%).
"""

from __future__ import annotations

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


def forward_layout_pairs(layout):
    """The forward's pair items of a Q layout: ``(firsts, seconds, halves_a, halves_b)``: pairs of full
    64-row blocks (int64 arrays), and pairs of packed halves of partial blocks (lists of int64 block
    arrays; the last B half is empty when the halves are odd)."""
    live = layout.live_pages.astype(np.int64)
    small = small_blocks(layout)
    partial = small & (live < HALF_PAGES)
    firsts, seconds = neighbours_then_in_order(small & ~partial)
    groups = packed_in_order(np.flatnonzero(partial), live)
    halves_b = groups[1::2] + [np.zeros(0, np.int64)] * (len(groups) % 2)
    return firsts, seconds, groups[0::2], halves_b


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
