"""Which gradient rows the backward's wrappers must clear before the kernels run (CPU): the owner pages
no work item owns (``bsa_backward.uncovered_k_pages``) and whether any of them holds a valid row
(``uncovered_rows_valid``, what decides whether the token-order backward allocates dK and dV as zeros),
against the K layout's tokens directly."""

from __future__ import annotations

import numpy as np
import pytest
from small_cases import random_ragged_graph

from sparseattn.graph import SparseGraph
from sparseattn.kernels.bsa_backward import uncovered_k_pages, uncovered_rows_valid
from sparseattn.layouts import video_layout
from sparseattn.planning.cache import plan_of
from sparseattn.planning.work_list import PAGE_ROWS


def _holds_tokens(layout, heads_pages) -> bool:
    """Whether any of the (head, page) pairs holds a token of ``layout`` (from its token -> slot map)."""
    holding = np.zeros(layout.num_slots // PAGE_ROWS, dtype=bool)
    holding[np.asarray(layout.token_slot) // PAGE_ROWS] = True
    return bool(holding[heads_pages[1]].any())


def _check(graph: SparseGraph, route) -> tuple[int, bool]:
    plan = plan_of(graph, "kpage", route, owner="kv")
    uncovered = uncovered_k_pages(plan, graph.k.num_slots // PAGE_ROWS)
    want = _holds_tokens(graph.k, uncovered)
    assert uncovered_rows_valid(plan, uncovered[1]) == want
    return uncovered[0].size, want


@pytest.mark.parametrize("seed", range(40), ids=lambda s: f"ragged{s}")
def test_uncovered_pages_with_valid_rows_match_the_layout(seed):
    graph = random_ragged_graph(np.random.default_rng(1200 + seed))
    for route in (0, 1) + (("pair",) if graph.k.block_size == 64 == graph.q.block_size else ()):
        _check(graph, route)


def test_a_key_block_nobody_selects():
    """A K block no Q block selects: whether its pages get an owner is the planner's choice; where they get
    none, their valid rows must be reported (the token-order backward then zeroes dK and dV)."""
    lay = video_layout((4, 8, 8), (2, 4, 4), 64)
    mask = np.ones((2, lay.num_blocks, lay.num_blocks), dtype=bool)
    mask[:, :, 3] = False
    for route in (0, 1, "pair"):
        _check(SparseGraph.from_block_mask(lay, lay, mask), route)


def test_an_item_dropped_from_the_plan_leaves_valid_rows():
    """The same check where the answer is yes: a plan with one owned page taken away (as a plan built
    elsewhere may leave it)."""
    import dataclasses

    lay = video_layout((4, 8, 8), (2, 4, 4), 64)
    graph = SparseGraph.from_block_mask(lay, lay, np.ones((1, lay.num_blocks, lay.num_blocks), dtype=bool))
    plan = plan_of(graph, "kpage", 1, owner="kv")
    own = plan.own_pages.copy()
    item, slot = np.argwhere(own >= 0)[0]  # the first owned page (it holds tokens: a block's first page)
    own[item, slot] = -1
    dropped = dataclasses.replace(plan, own_pages=own)
    uncovered = uncovered_k_pages(dropped, lay.num_slots // PAGE_ROWS)
    assert _holds_tokens(lay, uncovered) and uncovered_rows_valid(dropped, uncovered[1])


@pytest.mark.parametrize("seed", range(20), ids=lambda s: f"ragged{s}")
def test_the_device_templates_answer_matches_the_layout(seed):
    """The device planner's backward template (``ItemTemplate.uncovered_rows_valid``, what a device plan's
    ``uncovered_valid`` holds) against the K layout's tokens."""
    from sparseattn.planning.templates import backward_template

    graph = random_ragged_graph(np.random.default_rng(1300 + seed))
    for route in ("auto", 0, 1):
        t = backward_template(graph.q, graph.k, "kpage", route)
        pages = t.uncovered_pages(t.owner_mask.size)
        assert t.uncovered_rows_valid() == _holds_tokens(graph.k, (None, pages))


def test_wan_480p_vsa_cubes_leave_only_padding_unowned():
    """Wan2.1 480p's 4 x 4 x 4 cubes: 442 owner pages without an item, every one of them padding (so the
    token-order backward allocates dK and dV without zeroing them)."""
    from sparseattn.planning.templates import backward_template

    lay = video_layout((21, 30, 52), (4, 4, 4), 64)
    for route in ("auto", 0, 1):
        t = backward_template(lay, lay, "kpage", route)
        assert t.uncovered_pages(t.owner_mask.size).size > 0
        assert not t.uncovered_rows_valid()
