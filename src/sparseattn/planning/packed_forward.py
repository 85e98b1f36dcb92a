"""Packed work lists: the partial 64-row Q blocks of a head packed into shared 64-row items.

KPage's per-block forward gives every Q block its own item. A Q block with 1–3 live pages (an SVG2
cluster's remainder, a video's border cube) still costs a whole 64-row item: wgmma's M is 64 per
warpgroup, so its padding pages are computed on every key chunk it streams. A *packed item* holds up
to four live pages of several such blocks (:func:`~.pair_forward.packed_groups`: blocks that select
alike), one 64-row item whose two consumer warpgroups split the key chunks as on the 64-row route:

- owned page slot s holds a live page of one of the blocks;
- the item streams the union of the K pages its blocks select, in K block order, and bit 16 + s of an
  entry's row mask says that slot s's block selects it (the kernel masks the rest per warp, as in pair
  items, :mod:`.pair_forward`).

So the padding rows' pages go, and pages the blocks share are loaded once. The other items are the
per-block plan's. The kernel runs such a list in its pair instantiation (any visibility bit).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..graph import HeadStack, SparseGraph
from .layout_pairs import small_blocks
from .pair_forward import group_items, packed_groups, with_base_items
from .tile_plan import TilePlan, kpage_plan
from .work_list import OWN_PAGES, WorkList, chunk_for, stack_head_lists, work_list


def packed_blocks(graph: SparseGraph) -> np.ndarray:
    """int64: the Q blocks a packed list may pack: on the 64-row route with fewer than four live pages."""
    live = graph.q.live_pages.astype(np.int64)
    return np.flatnonzero(small_blocks(graph.q) & (live < OWN_PAGES // 2))


def packed_work_list(
    graph: SparseGraph,
    order: str | None = None,
    *,
    base_of: Callable[[SparseGraph], TilePlan] | None = None,
) -> WorkList:
    """The KPage forward work list of ``graph`` with its partial 64-row Q blocks packed into shared 64-row
    items (module docstring); groups of one block keep their own item. Every head packs its own blocks
    (heads select differently), items head by head.

    Args:
        graph: a :class:`SparseGraph` (per-head layouts: :func:`stacked_packed_work_list`).
        order: as :func:`sparseattn.planning.work_list.work_list`.
        base_of: ``base_of(g)`` returns the KPage plan (owner ``"q"``, route ``"auto"``) of ``g``, one head
            of ``graph``; default: built by :func:`kpage_plan`.
    """
    if not isinstance(graph, SparseGraph):
        from ..kernels.validate import KernelTypeError

        raise KernelTypeError(f"graph must be a SparseGraph, got {type(graph).__name__}")

    def one_head(g: SparseGraph) -> WorkList:
        return _one_head_packed_work_list(g, None if base_of is None else base_of(g))

    if graph.heads == 1:
        return one_head(graph)
    lists = [one_head(graph.select_heads([h])) for h in range(graph.heads)]
    return stack_head_lists(lists, order)


def _one_head_packed_work_list(graph: SparseGraph, plan: TilePlan | None = None) -> WorkList:
    plan = kpage_plan(graph, route="auto", owner="q") if plan is None else plan
    base = work_list(plan)
    groups = [g for g in packed_groups(graph, packed_blocks(graph)) if g.size > 1]
    packed = np.zeros((graph.heads, graph.q.num_blocks), dtype=bool)
    for group in groups:
        packed[:, group] = True
    keep = ~packed[plan.work_head.astype(np.int64), plan.work_block.astype(np.int64)]
    return with_base_items(base, keep, group_items(graph, groups), chunk_for([plan]), graph.heads)


def stacked_packed_work_list(
    stack: HeadStack, order: str | None = None, *, base_of: Callable[[SparseGraph], TilePlan] | None = None
) -> WorkList:
    """Packed work lists of per-head layouts (a :class:`HeadStack`) as one list, head h's items with head h
    (as :func:`~.pair_forward.stacked_pair_work_list`). ``base_of`` as :func:`packed_work_list`'s."""
    if not isinstance(stack, HeadStack):
        from ..kernels.validate import KernelTypeError

        raise KernelTypeError(f"stack must be a HeadStack, got {type(stack).__name__}")
    lists = [packed_work_list(g, base_of=base_of) for g in stack.graphs]
    return stack_head_lists(lists, order)
