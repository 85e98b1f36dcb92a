"""Pair backward plans (CPU): two 64-row K/V blocks per 128-row item over the ordered union of their Q
pages, each owned half seeing only its own block's pages; executed by the float64 plan emulator exactly
as the kernel reads them, and equal to the float64 reference."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from small_cases import SMALL_CASES, make_graph, small_layouts

from sparseattn import builders
from sparseattn.emulator import EmulationError, emulate_backward, validate_plan
from sparseattn.graph import SparseGraph
from sparseattn.kernels.validate import KernelValueError, check_plan
from sparseattn.layouts import video_layout
from sparseattn.planning.cache import plan_of
from sparseattn.planning.pair_backward import PAIR_ROUTE, pair_backward_plan
from sparseattn.planning.tile_plan import stack_head_plans
from sparseattn.reference import attention_backward, attention_forward


def _gradients(plan, graph, rng, batch=2, d=16):
    nq, nk = graph.q.num_slots, graph.k.num_slots
    q, do = (rng.standard_normal((batch, graph.heads, nq, d)) for _ in range(2))
    k, v = (rng.standard_normal((batch, graph.heads, nk, d)) for _ in range(2))
    o, lse = attention_forward(q, k, v, graph)
    ref = attention_backward(q, k, v, o, lse, do, graph)
    return emulate_backward(plan, q, k, v, o, lse, do), ref


def _assert_close(got, ref, graph):
    for name, a, b, valid in zip("qkv", got, ref, (graph.q.valid, graph.k.valid, graph.k.valid)):
        err = np.abs(a[:, :, valid] - b[:, :, valid]).max()
        assert err < 1e-10, f"d{name}: {err}"


@pytest.mark.parametrize("case", [c for c in SMALL_CASES if "B32" not in c and "B16" not in c])
def test_pair_backward_plan_equals_reference(case, seed):
    """Every pair item's halves see exactly their own block's Q pages: the float64 emulation of the pair
    plan equals the reference."""
    q_lay, k_lay = small_layouts(case)
    graph = make_graph(q_lay, k_lay, heads=3, density=0.4, seed=seed)
    plan = pair_backward_plan(graph)
    validate_plan(plan)
    check_plan(plan, q_lay.num_pages, k_lay.num_pages, 3, owner="kv")
    _assert_close(*_gradients(plan, graph, np.random.default_rng(seed)), graph)


def test_pair_backward_plan_shares_q_pages():
    """Neighbouring cubes are selected by overlapping Q blocks: pair items stream each shared Q page once
    for 128 owned rows, and ignoring the halves' visibility breaks the gradients."""
    layout = video_layout((6, 9, 10), (4, 4, 4), block_size=64)
    mask = np.zeros((2, layout.num_blocks, layout.num_blocks), dtype=bool)
    for i in range(layout.num_blocks):
        mask[:, max(0, i - 6) : i + 7, i] = True  # K block i is selected by a window of Q blocks
    graph = SparseGraph.from_block_mask(layout, layout, mask)
    base, pairs = plan_of(graph, "kpage", "auto", owner="kv"), pair_backward_plan(graph)
    assert (pairs.work_route == PAIR_ROUTE).sum() > 0
    assert pairs.stream_pages.size < 0.75 * base.stream_pages.size
    assert np.any(pairs.stream_vis == 3) and np.any(pairs.stream_vis != 3)
    rng = np.random.default_rng(0)
    _assert_close(*_gradients(pairs, graph, rng), graph)
    blind = dataclasses.replace(pairs, stream_vis=np.full_like(pairs.stream_vis, 3))
    got, ref = _gradients(blind, graph, np.random.default_rng(0))
    assert np.abs(got[1] - ref[1])[:, :, layout.valid].max() > 1e-3


def test_pair_backward_plan_items_and_routes():
    """Pair items own A's live pages in slots 0-3 and B's in 4-7 on the 128-row route, work items stay
    sorted by route, and the plan is cached per graph under route='pair'."""
    layout = video_layout((6, 8, 8), (4, 4, 4), block_size=64)
    graph = builders.random_graph(layout, layout, heads=2, density=0.3, seed=5)
    plan = plan_of(graph, "kpage", "pair", owner="kv")
    assert plan is plan_of(graph, "kpage", "pair", owner="kv")
    assert np.all(np.diff(plan.work_route.astype(int)) >= 0)
    pair = plan.work_route == PAIR_ROUTE
    own = plan.own_pages[pair]
    ppb = layout.pages_per_block
    block = plan.work_block[pair, None]
    assert pair.any() and np.all(own[:, 0] >= 0) and np.all(own[:, 4] >= 0)
    assert np.all((own[:, :4] // ppb == block) | (own[:, :4] < 0))
    second = own[:, 4:5] // ppb  # B: one other block (neighbours here: every block is a 64-row block)
    assert np.all((own[:, 4:] // ppb == second) | (own[:, 4:] < 0))
    assert np.all(second[:, 0] == block[:, 0] + 1)
    with pytest.raises(KernelValueError, match="owner='kv'"):
        plan_of(graph, "kpage", "pair", owner="q")
    with pytest.raises(KernelValueError, match="kind='kpage'"):
        plan_of(graph, "bsa", "pair", owner="kv")


def test_pair_visibility_is_checked():
    """stream_vis must cover stream_pages with 1-3, and only 128-row items may hide entries."""
    layout = video_layout((6, 8, 8), (4, 4, 4), block_size=64)
    graph = builders.random_graph(layout, layout, heads=1, density=0.3, seed=2)
    plan = pair_backward_plan(graph)
    pages = layout.num_pages
    short = dataclasses.replace(plan, stream_vis=plan.stream_vis[:-1])
    with pytest.raises(KernelValueError, match="stream_vis must have"):
        check_plan(short, pages, pages, 1, owner="kv")
    vis = plan.stream_vis.copy()
    vis[0] = 0
    zero = dataclasses.replace(plan, stream_vis=vis)
    with pytest.raises(KernelValueError, match="stream_vis holds 0"):
        check_plan(zero, pages, pages, 1, owner="kv")
    base = plan_of(graph, "kpage", "auto", owner="kv")
    hidden = dataclasses.replace(base, stream_vis=np.full(base.stream_pages.size, 1, dtype=np.uint32))
    with pytest.raises(KernelValueError, match="128-row work items only"):
        check_plan(hidden, pages, pages, 1, owner="kv")
    with pytest.raises(EmulationError, match="128-row work items only"):
        validate_plan(hidden)


def test_pair_partners_join_scattered_64_row_blocks():
    """128-slot blocks: the 64-row K/V blocks are the partial ones (at most four live pages), rarely
    neighbours. Neighbour pairs come first, the others pair two by two in block order; every 64-row block
    is in at most one pair, and the plan still equals the reference."""
    from sparseattn.planning.pair_forward import pair_partners
    from sparseattn.planning.tile_plan import kpage_route_of_block

    layout = video_layout((7, 9, 11), (4, 4, 8), block_size=128)
    graph = builders.random_graph(layout, layout, heads=2, density=0.4, seed=6)
    firsts, seconds = pair_partners(graph.transpose())
    live = layout.live_pages.astype(np.int64)
    small = np.flatnonzero((kpage_route_of_block(live) == 0) & (live > 0))
    joined = np.concatenate([firsts, seconds])
    assert firsts.size == small.size // 2 and np.unique(joined).size == joined.size
    assert np.isin(joined, small).all()
    assert np.any(seconds != firsts + 1)  # some pairs are not neighbours
    plan = pair_backward_plan(graph)
    assert (plan.work_route == PAIR_ROUTE).sum() >= graph.heads * firsts.size
    check_plan(plan, layout.num_pages, layout.num_pages, 2, owner="kv")
    _assert_close(*_gradients(plan, graph, np.random.default_rng(1)), graph)


def test_pair_plans_stack_per_head():
    """Per-head layouts (a HeadStack): each head's pair plan laid end to end keeps its visibility (a plain
    plan's entries count as seen by both halves), and the stacked plan, run by the emulator on the heads'
    tensors viewed as one head, equals each head's reference."""
    rng = np.random.default_rng(2)
    layouts = [
        video_layout((6, 8, 8), (4, 4, 4), block_size=64),
        video_layout((7, 9, 11), (4, 4, 8), block_size=128),
    ]
    graphs = [
        builders.random_graph(lay, lay, heads=1, density=0.35, seed=3 + i) for i, lay in enumerate(layouts)
    ]
    pages = max(lay.num_pages for lay in layouts)
    slots = pages * 16
    plans = [
        pair_backward_plan(graphs[0]),
        pair_backward_plan(graphs[1]),
        plan_of(graphs[0], "kpage", "auto", owner="kv"),
    ]
    stacked = stack_head_plans(plans, pages, pages)
    assert stacked.stream_vis is not None and np.any(stacked.stream_vis != 3)
    n_plain = plans[2].stream_pages.size
    assert (stacked.stream_vis == 3).sum() >= n_plain
    heads = graphs + [graphs[0]]
    batch, d = 2, 16
    x = {n: np.zeros((batch, len(heads), slots, d)) for n in ("q", "k", "v", "o", "do")}
    lse = np.full((batch, len(heads), slots), np.inf)
    refs = []
    for h, g in enumerate(heads):
        n = g.q.num_slots
        for name in ("q", "k", "v", "do"):
            x[name][:, h, :n] = rng.standard_normal((batch, n, d))
        o, l = attention_forward(
            x["q"][:, h : h + 1, :n], x["k"][:, h : h + 1, :n], x["v"][:, h : h + 1, :n], g
        )
        x["o"][:, h : h + 1, :n], lse[:, h : h + 1, :n] = o, l
        refs.append(
            attention_backward(
                *(x[m][:, h : h + 1, :n] for m in ("q", "k", "v", "o")),
                lse[:, h : h + 1, :n],
                x["do"][:, h : h + 1, :n],
                g,
            )
        )
    one = {m: a.reshape(batch, 1, len(heads) * slots, d) for m, a in x.items()}
    got = emulate_backward(
        stacked, one["q"], one["k"], one["v"], one["o"], lse.reshape(batch, 1, -1), one["do"]
    )
    for h, g in enumerate(heads):
        n = g.q.num_slots
        for i, valid in enumerate((g.q.valid, g.k.valid, g.k.valid)):
            part = got[i].reshape(batch, len(heads), slots, d)[:, h : h + 1, :n]
            assert np.abs(part[:, :, valid] - refs[h][i][:, :, valid]).max() < 1e-10


def test_pair_executed_pairs_count_the_halves_that_run():
    """The pair backward's executed pairs count 64 × 64 per step and half that sees one of the step's
    entries: at least the useful pairs, at most both halves on every step; with every entry seen by both
    halves, the plain 128-row count."""
    from sparseattn.kernels.backward import _pair_executed_pairs, backward_executed_pairs

    layout = video_layout((6, 9, 10), (4, 4, 4), block_size=64)
    graph = builders.random_graph(layout, layout, heads=2, density=0.3, seed=3)
    _, i, j = graph.pairs
    useful = int((layout.valid_rows[i] * layout.valid_rows[j]).sum())
    plan = pair_backward_plan(graph)
    got = backward_executed_pairs(graph, 128, "kpage", "wgmma", route="pair")
    steps = -(-plan.stream_lengths() // 4)
    both = int((plan.tile_shapes()[:, 0] * steps * 64).sum())
    assert useful <= got < both
    all_seen = dataclasses.replace(plan, stream_vis=np.full_like(plan.stream_vis, 3))
    assert _pair_executed_pairs(all_seen, 64) == both


def test_pair_route_without_pairs_takes_the_forward_plan_for_dq():
    """A graph with no two neighbouring 64-row K/V blocks: the pair plan is the plain KPage plan, whose
    64-row tiles run the Q-owned dQ pass over the forward's plan (route 'pair' has no Q-owned plan);
    the call gets as far as checking the tensors."""
    from sparseattn.kernels.backward import paged_backward
    from sparseattn.kernels.validate import KernelTypeError

    layout = video_layout((4, 4, 4), (4, 4, 4), block_size=64)
    graph = builders.random_graph(layout, layout, heads=1, density=1.0, seed=0)
    assert (pair_backward_plan(graph).work_route == PAIR_ROUTE).sum() == 0
    with pytest.raises((KernelTypeError, KernelValueError), match="^q "):
        paged_backward(None, None, None, None, None, None, graph, route="pair")


def test_sharing_pairs_join_blocks_selected_by_the_same_q_blocks():
    """The greedy matching pairs the K/V blocks that share the most Q pages (summed over heads), each block
    once; blocks sharing nothing with a free block are left for the block-order pairing."""
    from sparseattn.planning.pair_forward import _sharing_pairs

    layout = video_layout((8, 4, 8), (1, 4, 8), block_size=64)  # 8 full 64-row blocks
    selected_by = {0: [0, 1], 1: [5, 6], 2: [0, 1, 2], 3: [5, 6, 7], 4: [3], 5: [4]}  # K block: Q blocks
    mask = np.zeros((2, layout.num_blocks, layout.num_blocks), dtype=bool)
    for kb, qbs in selected_by.items():
        mask[:, qbs, kb] = True
    graph = SparseGraph.from_block_mask(layout, layout, mask)
    blocks = np.array(sorted(selected_by))
    a, b, left = _sharing_pairs(graph.transpose(), blocks)
    assert list(zip(a.tolist(), b.tolist())) == [(0, 2), (1, 3)]
    assert left.tolist() == [4, 5]


def test_pair_plans_launch_plain_items_on_the_plain_kernel():
    """A pair plan's 128-row route is launched in two parts: the plan's own 128-row items (every entry
    seen by both halves) on the plain warp-specialized kernel, from the first item hiding an entry on,
    the pair kernel; a route without pair items is one launch."""
    from sparseattn.kernels.bsa_backward import _launch_ranges, first_pair_items

    layout = video_layout((7, 9, 11), (4, 4, 8), block_size=128)
    graph = builders.random_graph(layout, layout, heads=2, density=0.4, seed=6)
    plan = pair_backward_plan(graph)
    base = plan_of(graph, "kpage", "auto", owner="kv")
    firsts = first_pair_items(plan)
    (s0, e0), (s1, e1) = plan.route_ranges()
    kept_128 = int((base.work_route == PAIR_ROUTE).sum())
    assert firsts[0] == e0 and s1 <= firsts[1] <= s1 + kept_128 < e1
    hidden = [
        np.any(plan.stream_vis[plan.stream_indptr[w] : plan.stream_indptr[w + 1]] != 3) for w in range(e1)
    ]
    assert not any(hidden[s1 : firsts[1]]) and hidden[firsts[1]]
    ranges = list(_launch_ranges(plan, {"first_pair_item": firsts}))
    assert (
        ranges
        == [(0, s0, e0, False), (1, s1, int(firsts[1]), False), (1, int(firsts[1]), e1, True)][
            0 if e0 > s0 else 1 :
        ]
    )
    assert list(_launch_ranges(base, {"first_pair_item": None})) == [
        (r, a, b, False) for r, (a, b) in enumerate(base.route_ranges()) if b > a
    ]


def test_stacked_pair_plans_put_plain_items_first():
    """Stacked per-head pair plans order each route's plain items before its pair items, so one launch of
    the plain kernel takes every head's plain items."""
    from sparseattn.kernels.bsa_backward import first_pair_items

    layout = video_layout((7, 9, 11), (4, 4, 8), block_size=128)
    graphs = [builders.random_graph(layout, layout, heads=1, density=0.4, seed=s) for s in (6, 7)]
    stacked = stack_head_plans([pair_backward_plan(g) for g in graphs], layout.num_pages, layout.num_pages)
    firsts = first_pair_items(stacked)
    start, stop = stacked.route_ranges()[PAIR_ROUTE]
    hidden = [
        np.any(stacked.stream_vis[stacked.stream_indptr[w] : stacked.stream_indptr[w + 1]] != 3)
        for w in range(start, stop)
    ]
    cut = int(firsts[PAIR_ROUTE]) - start
    assert 0 < cut < len(hidden) and not any(hidden[:cut]) and all(hidden[cut:])


def test_launch_order_groups_launches_and_runs_each_tail_longest_first():
    """Items sorted by launch key (stable: head by head, block order), then each launch's last ``tail``
    items longest first, so no long item starts among the last of a launch."""
    from sparseattn.planning.tile_plan import launch_order

    key = np.array([1, 0, 1, 0, 0, 1, 0, 1])
    lengths = np.array([5, 1, 9, 7, 3, 2, 8, 4])
    order = launch_order(key, lengths, tail=2)
    # key 0: items 1, 3, 4, 6 -> head 1, 3, then the tail (4, 6) longest first: 6, 4
    # key 1: items 0, 2, 5, 7 -> 0, 2, then (5, 7) longest first: 7, 5
    np.testing.assert_array_equal(order, [1, 3, 6, 4, 0, 2, 7, 5])
    whole = launch_order(key, lengths, tail=10)
    np.testing.assert_array_equal(whole, [6, 3, 4, 1, 2, 0, 7, 5])
    np.testing.assert_array_equal(launch_order(key, lengths, tail=0), np.argsort(key, kind="stable"))


def test_pair_plans_run_each_launch_tail_longest_first():
    """The pair plan and stacked pair plans keep their launches (route, then plain before pair items) and
    order each launch's last items longest first; the emulation still equals the reference."""
    from sparseattn.kernels.bsa_backward import _launch_ranges, first_pair_items

    layout = video_layout((7, 9, 11), (4, 4, 4), block_size=64)
    graph = builders.random_graph(layout, layout, heads=2, density=0.4, seed=8)
    plan = pair_backward_plan(graph)
    lengths = plan.stream_lengths()
    from sparseattn.planning.tile_plan import TAIL_ITEMS

    for _, start, stop, _ in _launch_ranges(plan, {"first_pair_item": first_pair_items(plan)}):
        tail = lengths[max(start, stop - TAIL_ITEMS) : stop]
        assert np.all(np.diff(tail) <= 0)
    got, ref = _gradients(plan, graph, np.random.default_rng(8))
    _assert_close(got, ref, graph)


@pytest.mark.parametrize(
    "block_size, impl, deterministic, expected",
    [
        (64, None, False, "pair"),
        (64, "wgmma_ws", False, "pair"),
        (64, None, True, "auto"),
        (64, "mma", False, "auto"),
        (128, None, False, "auto"),
    ],
    ids=["64-rows", "64-rows-ws", "64-rows-deterministic", "64-rows-mma", "128-rows"],
)
def test_backward_auto_route_pairs_64_row_blocks(block_size, impl, deterministic, expected):
    """KPage's backward ``route="auto"`` runs pair items where the K/V layout has 64-row blocks and the
    default kernel runs; ``executed pairs`` follow the resolved route; BSA and explicit routes are kept."""
    from sparseattn.graph import HeadStack
    from sparseattn.kernels.backward import backward_executed_pairs, backward_route

    layout = video_layout((8, 8, 8), (4, 4, 4) if block_size == 64 else (4, 4, 8), block_size=block_size)
    graph = builders.random_graph(layout, layout, heads=2, density=0.4, seed=1)
    assert backward_route(graph, "kpage", "auto", impl, deterministic) == expected
    assert backward_route(graph, "kpage", 1, impl, deterministic) == 1
    assert backward_route(graph, "bsa", "auto", impl, deterministic) == "auto"
    if not deterministic:
        assert backward_executed_pairs(graph, 128, "kpage", impl) == backward_executed_pairs(
            graph, 128, "kpage", impl, route=expected
        )
    big_layout = video_layout((8, 8, 8), (4, 4, 8), block_size=128)  # full 128-row blocks only
    big = builders.random_graph(big_layout, big_layout, heads=1, density=0.4, seed=2)
    stack = HeadStack.of([graph.select_heads([0]), big])
    assert backward_route(stack, "kpage", "auto", impl, deterministic) == expected


def test_pair_launch_starts_with_an_item_hiding_an_entry():
    """The pair kernel's launch starts at the first item hiding an entry (``first_pair_items``); the plan
    puts such an item first, so pair items whose entries both halves see stay in the pair launch instead
    of running at the end of the plain one."""
    from sparseattn.planning.pair_forward import pair_partners, small_blocks
    from sparseattn.planning.tile_plan import first_pair_items, hidden_item_first

    key = np.array([2, 3, 3, 3, 3, 3])
    hidden = np.array([False, False, False, True, False, True])
    np.testing.assert_array_equal(hidden_item_first(np.arange(6), key, hidden), [0, 3, 1, 2, 4, 5])
    np.testing.assert_array_equal(hidden_item_first(np.arange(6), key, ~hidden & (key == 2)), np.arange(6))

    # two partial (64-row) K/V blocks every Q block selects: their pair item hides nothing and streams the
    # most pages, so it sorts first among the pair items
    layout = video_layout((7, 9, 11), (4, 4, 8), block_size=128)
    mask = np.random.default_rng(0).random((2, layout.num_blocks, layout.num_blocks)) < 0.3
    mask[:, :, np.flatnonzero(small_blocks(layout))[:2]] = True
    graph = SparseGraph.from_block_mask(layout, layout, mask)
    plan = pair_backward_plan(graph)
    firsts, _ = pair_partners(graph.transpose())
    is_pair = np.isin(plan.work_block, firsts) & (plan.work_route == PAIR_ROUTE)
    start, stop = plan.route_ranges()[PAIR_ROUTE]
    cut = int(first_pair_items(plan)[PAIR_ROUTE])
    assert not is_pair[start:cut].any() and is_pair[cut:stop].all()
    got, ref = _gradients(plan, graph, np.random.default_rng(1))
    _assert_close(got, ref, graph)


def test_pair_launch_runs_head_by_head_longest_first():
    """Before its tail, the pair launch takes one head's items after another, longest first within a head
    (as the plain K/V-owned items run): the CTAs running at once share one head's Q and dO in L2."""
    from sparseattn.kernels.bsa_backward import _launch_ranges, first_pair_items
    from sparseattn.planning.tile_plan import TAIL_ITEMS

    layout = video_layout((28, 40, 40), (4, 4, 4), block_size=64)
    graph = builders.random_graph(layout, layout, heads=4, density=0.03, seed=3)
    plan = pair_backward_plan(graph)
    lengths, heads = plan.stream_lengths(), plan.work_head.astype(np.int64)
    launches = list(_launch_ranges(plan, {"first_pair_item": first_pair_items(plan)}))
    start, stop = launches[-1][1], launches[-1][2]
    assert stop - start > TAIL_ITEMS + 100  # the launch has items before its tail
    body = slice(start, stop - TAIL_ITEMS)
    assert np.all(np.diff(heads[body]) >= 0)
    for h in np.unique(heads[body]):
        assert np.all(np.diff(lengths[body][heads[body] == h]) <= 0)


def test_alternated_order_runs_one_half_chunks_side_by_side():
    """SPARSEATTN_PAIR_BWD_ORDER=alternate: per item, whole 4-entry chunks of A-only and B-only entries
    alternate while both kinds have one left, then the rest in block order; a permutation within items."""
    from sparseattn.planning.pair_backward import alternate_one_half_chunks

    vis = np.array([1] * 9 + [3] * 2 + [2] * 6 + [1, 2] + [3, 3], dtype=np.uint32)
    order = alternate_one_half_chunks(vis, np.array([17, 2, 2]))
    assert order[:17].tolist() == [0, 1, 2, 3, 11, 12, 13, 14, 4, 5, 6, 7, 8, 9, 10, 15, 16]
    assert order[17:].tolist() == [17, 18, 19, 20]  # items with less than a chunk of each keep their order
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 30, 50)
    vis = np.concatenate([np.sort(rng.choice([1, 3, 2], n)) for n in lengths]).astype(np.uint32)
    order = alternate_one_half_chunks(vis, lengths)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    assert np.array_equal(np.sort(order), np.arange(vis.size))
    assert np.all((order >= starts) & (order < starts + np.repeat(lengths, lengths)))


def test_alternated_pair_plan_equals_reference(monkeypatch, seed):
    """The alternated order changes only the order of each item's entries: the float64 emulation of the plan
    still equals the reference, with the same entries per item as the block order."""
    from sparseattn.planning import pair_backward

    layout = video_layout((6, 9, 10), (4, 4, 4), block_size=64)
    graph = builders.random_graph(layout, layout, heads=2, density=0.35, seed=seed)
    blocks = pair_backward_plan(graph)
    monkeypatch.setattr(pair_backward, "ORDER", "alternate")
    alternated = pair_backward_plan(graph)
    validate_plan(alternated)
    assert np.array_equal(alternated.stream_indptr, blocks.stream_indptr)
    assert not np.array_equal(alternated.stream_pages, blocks.stream_pages)
    for w in range(alternated.work_route.size):
        lo, hi = alternated.stream_indptr[w], alternated.stream_indptr[w + 1]
        got = sorted(zip(alternated.stream_pages[lo:hi], alternated.stream_vis[lo:hi]))
        assert got == sorted(zip(blocks.stream_pages[lo:hi], blocks.stream_vis[lo:hi]))
    _assert_close(*_gradients(alternated, graph, np.random.default_rng(seed)), graph)
    monkeypatch.setattr(pair_backward, "ORDER", "nope")
    with pytest.raises(KernelValueError, match="SPARSEATTN_PAIR_BWD_ORDER"):
        pair_backward_plan(graph)
