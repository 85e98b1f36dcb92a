"""The paged forward kernel's work list (CPU): built from BSA/KPage plans and HeadStacks, executed by
the numpy work-list emulator exactly as the kernel reads it, and equal to the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest
from small_cases import SMALL_CASES, make_graph, random_ragged_graph, small_layouts

from sparseattn import builders
from sparseattn.emulator import emulate_work_list
from sparseattn.graph import HeadStack, SparseGraph
from sparseattn.kernels.forward import executed_pairs, plan_of, resolve_work
from sparseattn.kernels.validate import KernelTypeError, KernelValueError
from sparseattn.layouts import contiguous_layout, partition_layout, video_layout
from sparseattn.planning.tile_plan import bsa_plan, kpage_plan
from sparseattn.planning.work_list import OWN_PAGES, chunk_for, work_list
from sparseattn.reference import attention_forward

ROUTES = [("kpage", "auto"), ("kpage", 0), ("kpage", 1), ("bsa", "auto")]
ROUTE_IDS = ["kpage-auto", "kpage-64x256", "kpage-128x128", "bsa"]


def _check_against_reference(work, graph_or_heads, rng, heads_slots):
    h, sq, sk = heads_slots
    q, k, v = (rng.standard_normal((2, h, n, 16)) for n in (sq, sk, sk))
    o, lse = emulate_work_list(work, q, k, v)
    graphs = graph_or_heads if isinstance(graph_or_heads, list) else None
    if graphs is None:
        o_ref, lse_ref = attention_forward(q, k, v, graph_or_heads)
        valid = np.broadcast_to(graph_or_heads.q.valid, (h, sq))
    else:
        o_ref = np.full_like(o, np.nan)
        lse_ref = np.full_like(lse, np.nan)
        valid = np.zeros((h, sq), dtype=bool)
        for head, g in enumerate(graphs):
            nq, nk = g.q.num_slots, g.k.num_slots
            oh, lh = attention_forward(
                q[:, head : head + 1, :nq], k[:, head : head + 1, :nk], v[:, head : head + 1, :nk], g
            )
            o_ref[:, head, :nq], lse_ref[:, head, :nq] = oh[:, 0], lh[:, 0]
            valid[head, :nq] = g.q.valid
    assert not np.isnan(o[:, valid]).any(), "a valid row was not written"
    assert np.isnan(o[:, ~valid]).all(), "a padding row was written"
    np.testing.assert_allclose(o[:, valid], o_ref[:, valid], atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse[:, valid]), np.isneginf(lse_ref[:, valid]))
    fin = np.isfinite(lse_ref[:, valid])
    np.testing.assert_allclose(lse[:, valid][fin], lse_ref[:, valid][fin], atol=1e-12)


@pytest.mark.parametrize("kind, route", ROUTES, ids=ROUTE_IDS)
@pytest.mark.parametrize("case", [c for c in SMALL_CASES if "B32" not in c and "B16" not in c])
def test_work_list_equals_reference(case, kind, route, seed):
    q_lay, k_lay = small_layouts(case)
    graph = make_graph(q_lay, k_lay, heads=3, density=0.4, seed=seed)
    if kind == "bsa" and (q_lay.block_size not in (64, 128) or k_lay.block_size not in (64, 128)):
        pytest.skip("the kernel runs BSA tiles of 64 or 128 rows")
    work = work_list(plan_of(graph, kind, route))
    _check_against_reference(work, graph, np.random.default_rng(seed), (3, q_lay.num_slots, k_lay.num_slots))


@pytest.mark.parametrize("kind, route", ROUTES, ids=ROUTE_IDS)
def test_head_stack_runs_every_head_with_its_own_layouts(kind, route, rng):
    graphs = []
    for _ in range(3):
        n = int(rng.integers(300, 700))
        q = partition_layout(rng.integers(0, int(rng.integers(2, 7)), n), 64)
        k = partition_layout(rng.integers(0, int(rng.integers(2, 9)), n), 64)
        graphs.append(SparseGraph.from_block_mask(q, k, rng.random((1, q.num_blocks, k.num_blocks)) < 0.5))
    stack = HeadStack.of(graphs)
    work = resolve_work(stack, kind, route, stack.heads, stack.q_slots, stack.k_slots)
    assert work.heads == 3 and set(np.unique(work.work_info[:, 0])) <= {0, 1, 2}
    _check_against_reference(work, graphs, rng, (3, stack.q_slots, stack.k_slots))


def test_chunk_and_executed_pairs_follow_the_routes():
    layout = video_layout((6, 9, 10), (4, 4, 4), block_size=64)
    graph = builders.random_graph(layout, layout, heads=2, density=0.3, seed=3)
    bsa, kpage = work_list(bsa_plan(graph)), work_list(kpage_plan(graph))
    assert bsa.chunk == 64 and kpage.chunk == 128
    # BSA: exactly the plan's count; KPage: 128-key chunks never pay more than the 256-wide tiles count
    assert bsa.executed_pairs() == bsa_plan(graph).physical_pairs()
    assert kpage.executed_pairs() <= kpage_plan(graph).physical_pairs()
    _, i, j = graph.pairs
    assert kpage.executed_pairs() >= int((layout.valid_rows[i] * layout.valid_rows[j]).sum())
    assert executed_pairs(kpage_plan(graph), "kpage") == kpage.executed_pairs()


def test_work_order_is_largest_first_permutation():
    """order="cost": largest M·chunks first over all heads; order="head": head by head, largest first."""
    layout = contiguous_layout(64 * 50, 64)
    mask = np.random.default_rng(0).random((2, 50, 50)) < np.linspace(0.05, 0.9, 50)[None, :, None]
    plan = kpage_plan(SparseGraph.from_block_mask(layout, layout, mask))
    work = work_list(plan, order="cost")
    assert sorted(work.work_order) == list(range(work.num_work))
    cost = work.work_info[:, 3].astype(np.int64) * work.chunks_per_item()
    assert np.all(np.diff(cost[work.work_order]) <= 0)
    assert work.own_pages.shape == (work.num_work, OWN_PAGES)
    by_head = work_list(plan, order="head")
    heads = by_head.work_info[by_head.work_order, 0]
    assert np.all(np.diff(heads) >= 0)
    for h in (0, 1):
        assert np.all(np.diff(cost[by_head.work_order][heads == h]) <= 0)


def test_routes_the_kernel_cannot_run_are_refused():
    q = contiguous_layout(32 * 8, 32)
    graph = SparseGraph.from_block_mask(q, q, np.ones((1, 8, 8), dtype=bool))
    with pytest.raises(KernelValueError, match="M in"):
        chunk_for([bsa_plan(graph)])


def test_resolve_work_names_the_mismatch():
    layout = contiguous_layout(128 * 4, 128)
    graph = SparseGraph.from_block_mask(layout, layout, np.ones((2, 4, 4), dtype=bool))
    with pytest.raises(KernelValueError, match="heads"):
        resolve_work(graph, "kpage", "auto", 3, 512, 512)
    with pytest.raises(KernelValueError, match="slots"):
        resolve_work(graph, "kpage", "auto", 2, 1024, 512)
    with pytest.raises(KernelValueError, match="multiple of 16"):
        resolve_work(graph, "kpage", "auto", 2, 500, 512)
    with pytest.raises(KernelTypeError, match="graph_or_plan"):
        resolve_work("graph", "kpage", "auto", 2, 512, 512)
    with pytest.raises(KernelValueError, match="owner"):
        resolve_work(bsa_plan(graph, owner="kv"), "kpage", "auto", 2, 512, 512)


# --- the K/V-owned backward's work list ----------------------------------------------------------


@pytest.mark.parametrize("block", [64, 128])
@pytest.mark.parametrize("route", ["auto", 0, 1], ids=["auto", "64x256", "128x128"])
def test_backward_work_list_runs_every_head_with_its_own_layouts(block, route, rng):
    """Per-head K/V-owned KPage plans as one backward work list: the float64 execution of its entries
    equals the exact gradients of every head, padding slots untouched."""
    from small_cases import assert_head_stack_gradients, head_stack_backward_problem, head_stack_graphs

    from sparseattn.emulator import emulate_backward_work_list
    from sparseattn.planning.work_list import BACKWARD_STEP_ROWS, backward_work_list

    graphs = head_stack_graphs(rng, 3, block)
    stack = HeadStack.of(graphs)
    work = backward_work_list([kpage_plan(g, route=route, owner="kv") for g in graphs])
    assert work.chunk == BACKWARD_STEP_ROWS and work.heads == 3
    inputs, refs = head_stack_backward_problem(rng, graphs, 2, 16, stack.q_slots, stack.k_slots)
    assert_head_stack_gradients(emulate_backward_work_list(work, *inputs), graphs, refs)


def test_backward_work_list_refuses_forward_plans():
    from sparseattn.planning.work_list import backward_work_list

    lay = contiguous_layout(256, 64)
    graph = make_graph(lay, lay, heads=1, density=0.5, seed=0)
    with pytest.raises(KernelValueError, match="owner='kv'"):
        backward_work_list(kpage_plan(graph))
    with pytest.raises(KernelValueError, match="owner='q'"):
        work_list(kpage_plan(graph, owner="kv"))


@pytest.mark.parametrize("impl", ["wgmma", "wgmma_qsplit", "wgmma_ws", "mma"])
def test_backward_executed_pairs_count_the_kernel_steps(impl):
    """The backward's executed pairs: owned rows × streamed rows rounded up to the kernel's step, between
    the useful pairs and the plan's tile count; a HeadStack counts every head. (The warp-specialized
    kernels' ``route="auto"`` runs these 64-row blocks as pair items: counted as that route.)"""
    from sparseattn.kernels.backward import backward_executed_pairs, backward_route

    layout = video_layout((6, 9, 10), (4, 4, 4), block_size=64)
    graph = builders.random_graph(layout, layout, heads=2, density=0.3, seed=3)
    plan = kpage_plan(graph, owner="kv")
    if backward_route(graph, "kpage", "auto", impl) == "pair":
        assert impl in ("wgmma", "wgmma_ws")
        paired = backward_executed_pairs(graph, 128, "kpage", impl)
        assert paired == backward_executed_pairs(graph, 128, "kpage", impl, route="pair")
        impl = "wgmma_sync"  # the per-block plan on the wgmma kernel's steps
    got = backward_executed_pairs(graph, 128, "kpage", impl)
    _, i, j = graph.pairs
    assert int((layout.valid_rows[i] * layout.valid_rows[j]).sum()) <= got <= plan.physical_pairs()
    # streamed rows per step at d = 128, by owned tile height (paged_bwd.cu / bsa_bwd.cu)
    steps = {
        "wgmma_sync": {64: 64, 128: 64},
        "wgmma_qsplit": {64: 128, 128: 64},
        "wgmma_ws": {64: 64, 128: 64},
        "mma": {64: 32, 128: 64},
    }[impl]
    rows = plan.tile_shapes()[:, 0]
    step = np.array([steps[int(m)] for m in rows])
    assert got == int((rows * (-(-(plan.stream_lengths() * 16) // step)) * step).sum())
    stack = HeadStack.of([graph.select_heads([0]), graph.select_heads([1])])
    assert backward_executed_pairs(stack, 128, "kpage", impl) == got


@pytest.mark.parametrize(
    "block_size, dq_plan_available, expected",
    [(64, True, "wgmma_dq_pass"), (64, False, "wgmma"), (128, True, "wgmma")],
    ids=["64-rows-graph", "64-rows-plan-only", "128-rows"],
)
def test_default_backward_resolves_per_plan(block_size, dq_plan_available, expected):
    """``"wgmma"`` runs the Q-owned dQ pass only on plans whose routes are all 64-row tiles, and only
    when the Q-owned plan can be had; explicit implementations are kept."""
    from sparseattn.kernels.bsa_backward import resolve_impl, uses_dq_pass

    layout = video_layout((6, 8, 8), (4, 4, 4) if block_size == 64 else (4, 4, 8), block_size=block_size)
    graph = builders.random_graph(layout, layout, heads=2, density=0.4, seed=1)
    plan = bsa_plan(graph, owner="kv")
    assert {int(m) for m in plan.tile_shapes()[:, 0]} == {block_size}
    assert resolve_impl("wgmma", plan, dq_plan_available) == expected
    assert uses_dq_pass("wgmma", plan, dq_plan_available) == (expected == "wgmma_dq_pass")
    assert resolve_impl("wgmma_sync", plan) == "wgmma_sync"
    assert not uses_dq_pass("wgmma", None)


# --- pair items: two 64-row Q blocks over the ordered union of their K pages ----------------------------
@pytest.mark.parametrize("case", [c for c in SMALL_CASES if "B32" not in c and "B16" not in c])
def test_pair_work_list_equals_reference(case, seed):
    """Every pair item's halves see exactly their own block's K pages: the float64 emulation of the
    pair list equals the reference, padding rows stay unwritten."""
    from sparseattn.planning.pair_forward import pair_work_list

    q_lay, k_lay = small_layouts(case)
    graph = make_graph(q_lay, k_lay, heads=3, density=0.4, seed=seed)
    work = pair_work_list(graph)
    _check_against_reference(work, graph, np.random.default_rng(seed), (3, q_lay.num_slots, k_lay.num_slots))


def test_pair_work_list_on_ragged_random_graphs_equals_reference():
    """The GPU suite's 200 random cases of route 'pair' come from this generator (ragged slot layouts,
    block sizes 64/128, independent Q/K partitions, Q blocks without a selection): the float64
    emulation of the pair list equals the reference on 100 of its graphs."""
    from sparseattn.planning.pair_forward import pair_work_list

    rng = np.random.default_rng(11)
    paired = 0
    for _ in range(100):
        graph = random_ragged_graph(rng)
        work = pair_work_list(graph)
        paired += int((work.work_info[:, 3] == 128).sum() and work.has_visibility())
        shape = (graph.heads, graph.q.num_slots, graph.k.num_slots)
        _check_against_reference(work, graph, rng, shape)
    assert paired > 10  # the generator's 64-slot graphs do give pair items


def test_pair_work_list_shares_pages_and_keeps_the_tensor_work():
    """Neighbouring cubes select overlapping K blocks: pair items load each shared page once and, with
    the stream ordered [A only | shared | B only], compute no more than the two 64-row items plus the
    boundary chunks."""
    from sparseattn.planning.pair_forward import pair_blocks, pair_work_list

    layout = video_layout((6, 9, 10), (4, 4, 4), block_size=64)
    mask = np.zeros((2, layout.num_blocks, layout.num_blocks), dtype=bool)
    for i in range(layout.num_blocks):  # each cube selects a window of neighbours in block order
        mask[:, i, max(0, i - 6) : i + 7] = True
    graph = SparseGraph.from_block_mask(layout, layout, mask)
    base, pairs = work_list(kpage_plan(graph)), pair_work_list(graph)
    n_items = int((pairs.work_info[:, 3] == 128).sum())
    assert n_items >= graph.heads * pair_blocks(graph).size // 2 > 0
    assert pairs.stream_pages.size < 0.75 * base.stream_pages.size
    boundary = n_items * 2 * 64 * pairs.chunk
    assert pairs.executed_pairs() <= base.executed_pairs() + boundary
    _check_against_reference(pairs, graph, np.random.default_rng(0), (2, layout.num_slots, layout.num_slots))


@pytest.mark.parametrize("pages", [4, 8])
def test_interleave_exclusive_chunks_alternates_whole_chunks(pages):
    """Pair streams [A only | shared | B only] become [a0, b0, a1, b1, ..., A rest | shared | B rest]: whole
    chunks of each half's own entries alternate, every part keeps its order, nothing is lost."""
    from sparseattn.planning.pair_forward import interleave_exclusive_chunks
    from sparseattn.planning.work_list import VIS_HALF0, VIS_HALF1

    rng = np.random.default_rng(pages)
    parts = rng.integers(0, 3 * pages, size=(12, 3))  # A only, shared, B only per item
    parts[0] = 0  # an empty item
    length = parts.sum(1)
    begin = np.cumsum(length) - length
    mask = np.concatenate(
        [np.repeat([VIS_HALF0, VIS_HALF0 | VIS_HALF1, VIS_HALF1], p) for p in parts]
    ).astype(np.uint32)
    order = interleave_exclusive_chunks(mask, begin, length, pages)
    np.testing.assert_array_equal(np.sort(order), np.arange(mask.size))
    for (n_a, n_s, n_b), b in zip(parts, begin):
        a, s, bb = np.split(np.arange(b, b + n_a + n_s + n_b), [n_a, n_a + n_s])
        runs = min(n_a, n_b) // pages
        alternated = [
            x
            for r in range(runs)
            for x in (*a[r * pages : (r + 1) * pages], *bb[r * pages : (r + 1) * pages])
        ]
        expect = np.array([*alternated, *a[runs * pages :], *s, *bb[runs * pages :]], dtype=np.int64)
        np.testing.assert_array_equal(order[b : b + expect.size], expect)


def test_pair_work_list_packs_partial_blocks_into_halves():
    """A video's partial border cubes (1-3 live pages) are packed into 64-row halves of at most four pages
    each, every partial block in exactly one group; each owned page slot sees exactly its own block's K
    pages (the emulation equals the reference), and the list computes fewer pairs than the per-block one."""
    from sparseattn.planning.pair_forward import packed_groups, pair_work_list, small_blocks
    from sparseattn.planning.work_list import VIS_SLOTS

    layout = video_layout((9, 10, 14), (4, 4, 4), block_size=64)  # partial cubes on three faces
    mask = np.zeros((2, layout.num_blocks, layout.num_blocks), dtype=bool)
    for i in range(layout.num_blocks):
        mask[:, i, max(0, i - 5) : i + 6] = True
    graph = SparseGraph.from_block_mask(layout, layout, mask)
    partial = np.flatnonzero(small_blocks(layout) & (layout.live_pages < 4))
    groups = packed_groups(graph, partial)
    members = np.concatenate(groups)
    assert partial.size > 8 and np.array_equal(np.sort(members), partial)
    assert all(layout.live_pages[g].sum() <= 4 for g in groups) and max(len(g) for g in groups) > 1
    work = pair_work_list(graph)
    # a slot sees an entry iff its block selects the entry's K block
    k_block = work.stream_pages // (layout.block_size // 16)
    for w in np.flatnonzero(work.work_info[:, 3] == 128):
        head, begin, length, _ = work.work_info[w]
        for slot, page in enumerate(work.own_pages[w]):
            if page < 0:
                continue
            vis = work.stream_mask[begin : begin + length] & VIS_SLOTS
            seen = (vis == 0) | ((vis >> (16 + slot)) & 1).astype(bool)
            selects = mask[head, page // (layout.block_size // 16)][k_block[begin : begin + length]]
            np.testing.assert_array_equal(seen, selects)
    assert work.executed_pairs() < work_list(kpage_plan(graph)).executed_pairs()
    _check_against_reference(work, graph, np.random.default_rng(1), (2, layout.num_slots, layout.num_slots))


def test_pair_work_list_without_pairs_is_the_kpage_list():
    """A layout with no two neighbouring 64-row Q blocks (all 128-row blocks) gives the KPage plan's items
    unchanged (the 720p STA/SSTA workloads)."""
    from sparseattn.planning.pair_forward import pair_blocks, pair_work_list

    layout = video_layout((8, 8, 8), (4, 4, 8), block_size=128)
    graph = builders.random_graph(layout, layout, heads=2, density=0.4, seed=2)
    assert pair_blocks(graph).size == 0
    pairs, base = pair_work_list(graph), work_list(kpage_plan(graph))
    assert not pairs.has_visibility()
    assert pairs.executed_pairs() == base.executed_pairs()
    np.testing.assert_array_equal(np.sort(pairs.stream_pages), np.sort(base.stream_pages))


def test_pair_route_on_a_head_stack_pairs_per_head():
    """Per-head layouts (a HeadStack): each head's 64-row Q blocks are paired within the head, the lists
    stacked with their heads and visibility bits, and the emulation equals each head's reference."""
    from sparseattn.kernels.forward import work_of

    layouts = [
        video_layout((6, 8, 8), (4, 4, 4), block_size=64),
        video_layout((7, 9, 11), (4, 4, 8), block_size=128),
    ]
    graphs = [
        builders.random_graph(lay, lay, heads=1, density=0.35, seed=3 + i) for i, lay in enumerate(layouts)
    ]
    stack = HeadStack.of(graphs)
    pair = work_of(stack, "kpage", "pair")
    assert pair.has_visibility() and set(np.unique(pair.work_info[:, 0])) == {0, 1}
    assert pair.stream_pages.size < work_of(stack, "kpage", "auto").stream_pages.size
    rng = np.random.default_rng(0)
    _check_against_reference(pair, graphs, rng, (2, stack.q_slots, stack.k_slots))


def test_pair_work_list_pairs_each_head_by_its_own_selection():
    """Every head matches its own 64-row Q blocks by the K pages they share: head 1 selects the windows
    of shuffled block positions, so its partners are not neighbours, yet each pair item's two blocks
    share most of their K blocks; the list equals the stacked one-head lists and the reference."""
    from sparseattn.planning.pair_forward import pair_work_list

    layout = video_layout((8, 16, 20), (4, 4, 4), block_size=64)  # 40 full cubes
    nb = layout.num_blocks
    position = np.stack([np.arange(nb), np.random.default_rng(4).permutation(nb)])
    mask = np.abs(position[:, :, None] - position[:, None, :]) <= 6  # [heads, q block, k block]
    graph = SparseGraph.from_block_mask(layout, layout, mask)
    work = pair_work_list(graph)
    ppb = layout.block_size // 16
    items = np.flatnonzero(work.work_info[:, 3] == 128)
    for head in (0, 1):
        mine = items[work.work_info[items, 0] == head]
        a, b = work.own_pages[mine, 0] // ppb, work.own_pages[mine, OWN_PAGES // 2] // ppb
        overlap = (mask[head, a] & mask[head, b]).sum(1) / mask[head, a].sum(1)
        assert mine.size >= nb // 2 - 1 and np.median(overlap) >= 0.8
    assert np.mean(np.abs(a - b) == 1) < 0.5  # head 1's partners are mostly not neighbours
    ones = [pair_work_list(graph.select_heads([head])) for head in (0, 1)]
    assert work.executed_pairs() == sum(one.executed_pairs() for one in ones)
    np.testing.assert_array_equal(work.stream_pages, np.concatenate([one.stream_pages for one in ones]))
    _check_against_reference(work, graph, np.random.default_rng(2), (2, layout.num_slots, layout.num_slots))


def test_greedy_matching_equals_the_sequential_greedy():
    """The vectorized rounds give the sequential greedy's matching (heaviest edge first, ties by the
    smaller ends), ties and all."""
    from sparseattn.planning.pair_forward import greedy_matching

    rng = np.random.default_rng(0)
    for n in (2, 7, 60):
        a, b = np.triu_indices(n, 1)
        keep = rng.random(a.size) < 0.5
        a, b = a[keep], b[keep]
        weight = rng.integers(0, 4, a.size).astype(float)  # many ties
        used, expect = np.zeros(n, bool), []
        for i in np.lexsort((b, a, -weight)):
            if not (used[a[i]] or used[b[i]]):
                used[a[i]] = used[b[i]] = True
                expect.append(i)
        np.testing.assert_array_equal(greedy_matching(a, b, weight, n), np.sort(expect))


def test_pair_work_list_pairs_scattered_64_row_blocks():
    """128-slot blocks: the partial Q blocks (64-row route) pair with each other wherever they are, and
    the pair list still equals the reference."""
    from sparseattn.planning.pair_forward import pair_blocks, pair_partners, pair_work_list

    layout = video_layout((7, 9, 11), (4, 4, 8), block_size=128)
    graph = builders.random_graph(layout, layout, heads=2, density=0.4, seed=6)
    firsts, seconds = pair_partners(graph)
    assert pair_blocks(graph).size < firsts.size and np.any(seconds != firsts + 1)
    pairs = pair_work_list(graph)
    assert pairs.has_visibility()
    _check_against_reference(pairs, graph, np.random.default_rng(1), (2, layout.num_slots, layout.num_slots))


def test_pair_lists_need_128_key_chunks():
    """Only the 128-key-chunk kernel has a pair instantiation: a pair list with 64-key chunks is refused,
    and route='pair' builds (and caches) the graph's pair list."""
    import dataclasses

    from sparseattn.kernels.forward import check_work_list, kernel_name, work_of
    from sparseattn.planning.pair_forward import pair_work_list

    layout = video_layout((6, 9, 10), (4, 4, 4), block_size=64)
    graph = builders.random_graph(layout, layout, heads=1, density=0.3, seed=1)
    pairs = pair_work_list(graph)
    assert pairs.has_visibility() and pairs.chunk == 128
    assert check_work_list(pairs, layout.num_pages, layout.num_pages, 1) is pairs
    with pytest.raises(KernelValueError, match="pair work list"):
        check_work_list(dataclasses.replace(pairs, chunk=64), layout.num_pages, layout.num_pages, 1)
    assert work_of(graph, "kpage", "pair") is work_of(graph, "kpage", "pair")
    assert work_of(graph, "kpage", "pair").has_visibility()
    assert kernel_name(128, 128, pair=True) == "paged_fwd_kernel<128, 128, true>"
    with pytest.raises(KernelValueError, match="route='pair'"):
        work_of(graph, "bsa", "pair")


def _packed_items_see_their_blocks(work, graph, block_mask) -> int:
    """Every 64-row item with visibility bits owns pages of at most four slots from two blocks or more,
    and slot s sees an entry iff its block selects the entry's K block. Returns the packed items."""
    from sparseattn.planning.work_list import VIS_SLOTS

    ppb = graph.q.block_size // 16
    k_block = work.stream_pages // (graph.k.block_size // 16)
    packed = 0
    for w in np.flatnonzero(work.work_info[:, 3] == 64):
        head, begin, length, _ = work.work_info[w]
        vis = work.stream_mask[begin : begin + length] & VIS_SLOTS
        if not vis.any():
            continue
        packed += 1
        own = work.own_pages[w]
        assert (own[4:] < 0).all() and np.unique(own[own >= 0] // ppb).size > 1
        for slot in np.flatnonzero(own >= 0):
            seen = ((vis >> (16 + slot)) & 1).astype(bool)
            np.testing.assert_array_equal(
                seen, block_mask[head, own[slot] // ppb][k_block[begin : begin + length]]
            )
    return packed


def test_packed_work_list_packs_partial_blocks_into_64_row_items():
    """A video's partial border cubes (1-3 live pages) share 64-row items of at most four pages, every
    partial block owned once; each slot sees exactly its own block's K pages, the emulation equals the
    reference, and the list computes and streams less than the per-block one."""
    from sparseattn.planning.packed_forward import packed_blocks, packed_work_list

    layout = video_layout((9, 10, 14), (4, 4, 4), block_size=64)
    mask = np.zeros((2, layout.num_blocks, layout.num_blocks), dtype=bool)
    for i in range(layout.num_blocks):
        mask[:, i, max(0, i - 5) : i + 6] = True
    graph = SparseGraph.from_block_mask(layout, layout, mask)
    work, base = packed_work_list(graph), work_list(kpage_plan(graph))
    assert _packed_items_see_their_blocks(work, graph, mask) > 4
    owned_blocks = work.own_pages[work.own_pages >= 0] // 4
    partial = packed_blocks(graph)
    assert partial.size > 8 and np.array_equal(np.unique(owned_blocks), np.arange(layout.num_blocks))
    assert work.own_pages[work.own_pages >= 0].size == 2 * layout.live_pages.sum()  # every page once a head
    assert work.executed_pairs() < base.executed_pairs()
    assert work.stream_pages.size < base.stream_pages.size
    _check_against_reference(work, graph, np.random.default_rng(2), (2, layout.num_slots, layout.num_slots))


def test_packed_work_list_on_ragged_random_graphs_equals_reference():
    """The GPU suite's random cases of route 'packed' come from this generator: the float64 emulation of
    the packed list equals the reference on 100 of its graphs, and some of them pack."""
    from sparseattn.planning.packed_forward import packed_work_list

    rng = np.random.default_rng(12)
    packed = 0
    for _ in range(100):
        graph = random_ragged_graph(rng)
        work = packed_work_list(graph)
        packed += _packed_items_see_their_blocks(work, graph, graph.block_mask())
        _check_against_reference(work, graph, rng, (graph.heads, graph.q.num_slots, graph.k.num_slots))
    assert packed > 10


def test_packed_route_on_a_head_stack_packs_per_head():
    """Per-head SVG2-like cluster layouts (a HeadStack): each head packs its own cluster remainders,
    route='packed' builds and caches the stacked list, and the emulation equals each head's reference."""
    from sparseattn.kernels.forward import work_of

    rng = np.random.default_rng(5)
    graphs = []
    for _ in range(3):
        n = int(rng.integers(900, 1500))
        q = partition_layout(rng.integers(0, 9, n), 128)
        k = partition_layout(rng.integers(0, 7, n), 128)
        graphs.append(SparseGraph.from_block_mask(q, k, rng.random((1, q.num_blocks, k.num_blocks)) < 0.6))
    stack = HeadStack.of(graphs)
    packed = work_of(stack, "kpage", "packed")
    assert packed is work_of(stack, "kpage", "packed")
    assert packed.has_visibility() and set(np.unique(packed.work_info[:, 0])) == {0, 1, 2}
    assert packed.executed_pairs() < work_of(stack, "kpage", "auto").executed_pairs()
    _check_against_reference(packed, graphs, rng, (3, stack.q_slots, stack.k_slots))
    with pytest.raises(KernelValueError, match="route='packed'"):
        work_of(stack, "bsa", "packed")


def test_device_arrays_mark_the_plain_items_of_lists_with_visibility():
    """The arrays the kernel reads: in a packed (or pair) list, the rows word of every item without
    visibility bits carries PLAIN_ITEM and the rows themselves are unchanged; a list without any visibility
    bits is handed over as it is."""
    from sparseattn.planning.packed_forward import packed_work_list
    from sparseattn.planning.work_list import PLAIN_ITEM, VIS_SLOTS

    layout = video_layout((9, 10, 14), (4, 4, 4), block_size=64)
    graph = builders.random_graph(layout, layout, heads=2, density=0.3, seed=8)
    packed = packed_work_list(graph)
    info = packed.device_arrays()["work_info"]
    np.testing.assert_array_equal(info[:, :3], packed.work_info[:, :3])
    np.testing.assert_array_equal(info[:, 3] & (PLAIN_ITEM - 1), packed.work_info[:, 3])
    plain = (info[:, 3] & PLAIN_ITEM) != 0
    for w, (head, begin, length, _) in enumerate(packed.work_info):
        assert plain[w] == (not (packed.stream_mask[begin : begin + length] & VIS_SLOTS).any())
    assert 0 < plain.sum() < packed.num_work
    base = work_list(kpage_plan(graph))
    np.testing.assert_array_equal(base.device_arrays()["work_info"], base.work_info)


@pytest.mark.parametrize("seed", range(4))
def test_pair_union_order_and_tags(seed):
    """A pair item's stream: the union of A's and B's selected K blocks, pair by pair as [A only |
    shared | B only] in block order, tagged 1 / 3 / 2 — against a plain Python construction."""
    from sparseattn.planning.pair_forward import _ordered_union

    rng = np.random.default_rng(seed)
    n_pairs, nkb = 7, 23
    sides = [
        [np.flatnonzero(rng.random(nkb) < rng.uniform(0, 0.6)) for _ in range(n_pairs)] for _ in range(2)
    ]
    key_a, key_b = (np.concatenate([p * nkb + blocks for p, blocks in enumerate(side)]) for side in sides)
    union, tags = _ordered_union(key_a, key_b, n_pairs, nkb)
    want, want_tags = [], []
    for p in range(n_pairs):
        a, b = set(sides[0][p].tolist()), set(sides[1][p].tolist())
        for part, tag in ((a - b, 1), (a & b, 3), (b - a, 2)):
            want += [p * nkb + blk for blk in sorted(part)]
            want_tags += [tag] * len(part)
    assert union.tolist() == want and tags.tolist() == want_tags


def test_forward_auto_route_pairs_where_pages_shrink_enough():
    """KPage's forward ``route="auto"`` takes the pair list where it streams at most
    ``PAIR_FORWARD_MAX_PAGES`` of the per-block routes' pages (neighbouring cubes selecting nearly the
    same windows), and keeps the per-block routes on random selections (a pair shares few pages) and on
    128-row blocks; ``executed_pairs`` follow the resolved route."""
    from sparseattn.kernels.forward import PAIR_FORWARD_MAX_PAGES, _work_of, forward_route, work_of

    layout = video_layout((6, 9, 10), (4, 4, 4), block_size=64)
    mask = np.zeros((2, layout.num_blocks, layout.num_blocks), dtype=bool)
    for i in range(layout.num_blocks):
        mask[:, i, max(0, i - 6) : i + 7] = True
    window = SparseGraph.from_block_mask(layout, layout, mask)
    full_cubes = video_layout((8, 8, 8), (4, 4, 4), block_size=64)  # no partial blocks to pack
    scattered = builders.random_graph(full_cubes, full_cubes, heads=2, density=0.3, seed=4)
    big_layout = video_layout((8, 8, 8), (4, 4, 8), block_size=128)
    big = builders.random_graph(big_layout, big_layout, heads=2, density=0.4, seed=2)
    for graph, expected in ((window, "pair"), (scattered, "auto"), (big, "auto")):
        assert forward_route(graph) == expected
        ratio = (
            _work_of(graph, "kpage", "pair").stream_pages.size
            / _work_of(graph, "kpage", "auto").stream_pages.size
        )
        assert (ratio <= PAIR_FORWARD_MAX_PAGES) == (expected == "pair")
        assert work_of(graph) is _work_of(graph, "kpage", expected)
        assert executed_pairs(graph) == executed_pairs(graph, "kpage", expected)
        assert forward_route(graph, "kpage", 1) == 1 and forward_route(graph, "bsa") == "auto"
    assert forward_route(HeadStack.of([window.select_heads([0]), window.select_heads([1])])) == "pair"


@pytest.mark.parametrize("case", [c for c in SMALL_CASES if "B32" not in c and "B16" not in c])
def test_per_block_stream_pages_count_the_auto_list(case, seed):
    """``per_block_stream_pages`` (counted from the graph, for the forward's route choice) equals the
    per-block work list's streamed pages, all and on 64-row items, for a graph and a HeadStack."""
    from sparseattn.kernels.forward import _work_of, per_block_stream_pages

    q_lay, k_lay = small_layouts(case)
    graph = make_graph(q_lay, k_lay, heads=3, density=0.4, seed=seed)
    for obj in (graph, HeadStack.of([graph.select_heads([0]), graph.select_heads([2])])):
        work = _work_of(obj, "kpage", "auto")
        pages = work.work_info[:, 2].astype(np.int64)
        assert per_block_stream_pages(obj) == (int(pages.sum()), int(pages[work.work_info[:, 3] == 64].sum()))


@pytest.mark.parametrize("route", ["auto", 0, 1, "pair", "packed"], ids=lambda r: f"route={r}")
def test_writes_every_valid_row_sees_an_unowned_page(route):
    import dataclasses

    from sparseattn.kernels.forward import work_of
    from sparseattn.planning.work_list import writes_every_valid_row

    lay = video_layout((5, 6, 7), (2, 4, 4), 64)
    mask = np.random.default_rng(4).random((2, lay.num_blocks, lay.num_blocks)) < 0.3
    mask[1, 3] = False  # a Q block that selects nothing is still owned (its rows get o = 0)
    wl = work_of(SparseGraph.from_block_mask(lay, lay, mask), "kpage", route)
    assert writes_every_valid_row(wl, lay)
    own = wl.own_pages.copy()
    item, slot = np.argwhere(own >= 0)[-1]
    own[item, slot] = -1  # one page no item owns
    assert not writes_every_valid_row(dataclasses.replace(wl, own_pages=own), lay)
    own_mask = wl.own_mask.copy()
    own_mask[item, slot] &= 0xFFFE if own_mask[item, slot] & 1 else 0xFFFF
    if own_mask[item, slot] != wl.own_mask[item, slot]:  # one valid row of a page left out
        assert not writes_every_valid_row(dataclasses.replace(wl, own_mask=own_mask), lay)
