"""The numpy plan emulator: BSA/KPage plans executed tile by tile equal the float64 reference."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from small_cases import SMALL_CASES, make_graph, rel_err, small_layouts

from sparseattn.emulator import (
    EmulationError,
    coverage_report,
    covered_pairs,
    emulate_backward,
    emulate_forward,
    graph_slot_pairs,
)
from sparseattn.graph import SparseGraph
from sparseattn.layouts import slot_layout
from sparseattn.planning.tile_plan import bsa_plan, kpage_plan
from sparseattn.reference import attention_backward, attention_forward

RTOL = 1e-12


LAYOUTS = SMALL_CASES

PLANS = {
    "bsa": lambda g, owner: bsa_plan(g, owner=owner),
    "kpage-auto": lambda g, owner: kpage_plan(g, "auto", owner=owner),
    "kpage-64x256": lambda g, owner: kpage_plan(g, 0, owner=owner),
    "kpage-128x128": lambda g, owner: kpage_plan(g, 1, owner=owner),
}


def _problem(layout_name, density=0.45, heads=2, batch=2, d=8, seed=0):
    ql, kl = small_layouts(layout_name)
    graph = make_graph(ql, kl, heads, density, seed)
    rng = np.random.default_rng(seed + 100)
    q = rng.standard_normal((batch, heads, ql.num_slots, d))
    k = rng.standard_normal((batch, heads, kl.num_slots, d))
    v = rng.standard_normal((batch, heads, kl.num_slots, d))
    for x, lay in ((q, ql), (k, kl), (v, kl)):
        x[:, :, ~lay.valid] = np.nan  # padding contents must never reach a valid output
    return graph, q, k, v


@pytest.mark.parametrize("plan_name", list(PLANS))
@pytest.mark.parametrize("layout_name", LAYOUTS)
def test_forward_equals_reference(layout_name, plan_name):
    graph, q, k, v = _problem(layout_name)
    plan = PLANS[plan_name](graph, "q")
    o, lse = emulate_forward(plan, q, k, v)
    o_ref, lse_ref = attention_forward(q, k, v, graph)
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    assert np.array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    assert rel_err(o, o_ref) < RTOL and rel_err(lse, lse_ref) < RTOL


@pytest.mark.parametrize("plan_name", list(PLANS))
@pytest.mark.parametrize("layout_name", LAYOUTS)
def test_backward_equals_reference(layout_name, plan_name):
    graph, q, k, v = _problem(layout_name, seed=1)
    o, lse = attention_forward(q, k, v, graph, scale=0.4)
    do = np.random.default_rng(2).standard_normal(o.shape)
    plan = PLANS[plan_name](graph, "kv")
    got = emulate_backward(plan, q, k, v, o, lse, do, scale=0.4)
    want = attention_backward(q, k, v, o, lse, do, graph, scale=0.4)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert not np.isnan(g).any(), name
        assert rel_err(g, w) < RTOL, name


def test_dense_selection_streams_several_partial_tiles():
    graph, q, k, v = _problem("video-5x7x9-tile2x4x4-B32-prefix", density=0.95, heads=1, batch=1)
    for route in (0, 1):
        plan = kpage_plan(graph, route)
        n_pages = plan.routes[route][1] // 16
        lengths = plan.stream_lengths()
        assert plan.tiles_per_work().max() > 1 and np.any(lengths % n_pages)
        o, lse = emulate_forward(plan, q, k, v)
        o_ref, lse_ref = attention_forward(q, k, v, graph)
        assert rel_err(o, o_ref) < RTOL and rel_err(lse, lse_ref) < RTOL


@pytest.mark.parametrize("plan_name", list(PLANS))
@pytest.mark.parametrize("owner", ["q", "kv"])
@pytest.mark.parametrize(
    "layout_name", ["video-3x10x10-tile2x8x8-B64-empty-blocks", "partition-Q32-K64-independent"]
)
def test_plans_cover_every_useful_pair_once(layout_name, owner, plan_name):
    graph, *_ = _problem(layout_name, heads=2)
    report = coverage_report(PLANS[plan_name](graph, owner), graph)
    assert report["computed"] == report["useful"] > 0
    assert report["duplicated"] == report["missing"] == report["outside"] == 0


@st.composite
def small_graphs(draw):
    """Random Q/K slot layouts (block sizes 16..128, empty and partial blocks) and a random graph."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    layouts = []
    for side in ("q", "k"):
        block = draw(st.sampled_from([16, 32, 64, 128]), label=f"{side}_block")
        blocks = draw(st.integers(1, 5), label=f"{side}_blocks")
        density = draw(st.sampled_from([0.0, 0.2, 0.7, 1.0]), label=f"{side}_valid")
        valid = rng.random(block * blocks) < density
        valid[rng.integers(valid.size)] = True  # at least one token
        layouts.append(slot_layout(valid, block))
    heads = draw(st.integers(1, 3), label="heads")
    density = draw(st.sampled_from([0.0, 0.3, 0.8]), label="graph_density")
    drop_empty = draw(st.booleans(), label="drop_empty")
    mask = rng.random((heads, layouts[0].num_blocks, layouts[1].num_blocks)) < density
    return SparseGraph.from_block_mask(layouts[0], layouts[1], mask, drop_empty=drop_empty)


@settings(deadline=None, max_examples=40)
@given(graph=small_graphs(), plan_name=st.sampled_from(list(PLANS)), owner=st.sampled_from(["q", "kv"]))
def test_coverage_exactly_once_property(graph, plan_name, owner):
    report = coverage_report(PLANS[plan_name](graph, owner), graph)
    assert report["computed"] == report["useful"]
    assert report["duplicated"] == report["missing"] == report["outside"] == 0


def test_covered_pairs_are_oriented_q_then_k():
    graph, *_ = _problem("partition-Q32-K64-independent", heads=1)
    h, qs, ks = covered_pairs(kpage_plan(graph, owner="kv"))
    assert graph.q.valid[qs].all() and graph.k.valid[ks].all() and (h == 0).all()
    want = graph_slot_pairs(graph)

    def key(hh, a, b):
        return np.sort((hh * graph.q.num_slots + a) * graph.k.num_slots + b)

    assert np.array_equal(key(h, qs, ks), key(*want))


# --- broken plans are caught ------------------------------------------------------------------


def _broken(plan, **changes):
    return dataclasses.replace(plan, **changes)


def test_dropped_stream_page_is_reported_missing():
    graph, q, k, v = _problem("video-5x7x9-tile2x4x4-B32-prefix", heads=1)
    plan = kpage_plan(graph)
    w = int(np.flatnonzero(plan.stream_lengths() > 0)[0])
    cut = int(plan.stream_indptr[w])
    pages = np.delete(plan.stream_pages, cut)
    indptr = plan.stream_indptr.copy()
    indptr[w + 1 :] -= 1
    broken = _broken(plan, stream_pages=pages, stream_indptr=indptr)
    assert coverage_report(broken, graph)["missing"] > 0
    o, _ = emulate_forward(broken, q, k, v)
    assert rel_err(o, attention_forward(q, k, v, graph)[0]) > 1e-6


def test_duplicated_work_item_is_a_race():
    graph, q, k, v = _problem("video-5x7x9-tile2x4x4-B32-prefix", heads=1)
    plan = kpage_plan(graph)
    dup = np.concatenate([np.arange(plan.num_work), [0]])
    lengths = plan.stream_lengths()[dup]
    starts = plan.stream_indptr[dup].astype(np.int64)
    pages = np.concatenate([plan.stream_pages[s : s + n] for s, n in zip(starts, lengths)])
    broken = _broken(
        plan,
        work_route=plan.work_route[dup],
        work_head=plan.work_head[dup],
        work_block=plan.work_block[dup],
        own_pages=plan.own_pages[dup],
        stream_indptr=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
        stream_pages=pages,
    )
    assert coverage_report(broken, graph)["duplicated"] > 0
    with pytest.raises(EmulationError, match="twice"):
        emulate_forward(broken, q, k, v)


def test_missing_work_item_leaves_rows_unwritten():
    graph, q, k, v = _problem("video-5x7x9-tile2x4x4-B32-prefix", heads=1)
    plan = kpage_plan(graph)
    keep = np.arange(1, plan.num_work)
    ptr = plan.stream_indptr
    broken = _broken(
        plan,
        work_route=plan.work_route[keep],
        work_head=plan.work_head[keep],
        work_block=plan.work_block[keep],
        own_pages=plan.own_pages[keep],
        stream_indptr=(ptr[1:] - ptr[1]).astype(np.int32),
        stream_pages=plan.stream_pages[ptr[1] :],
    )
    with pytest.raises(EmulationError, match="never writes O"):
        emulate_forward(broken, q, k, v)


@pytest.mark.parametrize(
    "field, make, match",
    [
        (
            "own_pages",
            lambda p: np.where(p.own_pages == p.own_pages.max(), 10**6, p.own_pages),
            "own_pages must be",
        ),
        ("stream_pages", lambda p: p.stream_pages - 1, "stream_pages must be page ids"),
        ("work_head", lambda p: p.work_head + 1, "work_head must lie"),
        ("work_route", lambda p: p.work_route + 2, "work_route must index"),
        ("stream_indptr", lambda p: p.stream_indptr[:-1], "stream_indptr must be"),
    ],
)
def test_corrupt_plan_fields_are_named(field, make, match):
    graph, q, k, v = _problem("video-5x7x9-tile2x4x4-B32-prefix", heads=1)
    plan = kpage_plan(graph, route=0)
    with pytest.raises(EmulationError, match=match):
        emulate_forward(_broken(plan, **{field: make(plan)}), q, k, v)


def test_own_page_beyond_route_rows_is_rejected():
    graph, q, k, v = _problem("video-3x10x10-tile2x8x8-B128", heads=1)
    plan = kpage_plan(graph, route=0)  # M = 64: only the first four own_pages columns may be used
    own = plan.own_pages.copy()
    own[0, 5] = 0
    with pytest.raises(EmulationError, match="beyond the M rows"):
        emulate_forward(_broken(plan, own_pages=own), q, k, v)


def test_owner_and_shape_mismatches_are_named():
    graph, q, k, v = _problem("video-5x7x9-tile2x4x4-B32-prefix", heads=1)
    o, lse = attention_forward(q, k, v, graph)
    with pytest.raises(EmulationError, match="owner='q'"):
        emulate_forward(kpage_plan(graph, owner="kv"), q, k, v)
    with pytest.raises(EmulationError, match="owner='kv'"):
        emulate_backward(kpage_plan(graph), q, k, v, o, lse, o)
    with pytest.raises(EmulationError, match="q must be"):
        emulate_forward(kpage_plan(graph), q[:, :, :-8], k, v)
    with pytest.raises(EmulationError, match="own_page_mask has"):
        emulate_forward(kpage_plan(graph), q[:, :, :-16], k, v)
    with pytest.raises(EmulationError, match="stream_page_mask has"):
        emulate_forward(kpage_plan(graph), q, k[:, :, :-16], v[:, :, :-16])


# --- heads with their own layouts as one stacked single-head plan ---------------------------------


@pytest.mark.parametrize("kind, route", [("kpage", "auto"), ("kpage", 0), ("kpage", 1), ("bsa", "auto")])
@pytest.mark.parametrize("block", [64, 128])
def test_stacked_head_plans_give_every_heads_gradients(kind, route, block):
    """stack_head_plans: per-head K/V-owned plans laid end to end over the heads' slot spaces, run on the
    tensors viewed as one head, give each head's exact gradients; rows past a head's layout stay 0."""
    from small_cases import assert_head_stack_gradients, head_stack_backward_problem, head_stack_graphs

    from sparseattn.planning.tile_plan import bsa_plan, kpage_plan, stack_head_plans

    rng = np.random.default_rng(7 + block)
    graphs = head_stack_graphs(rng, 3, block)
    sq = max(g.q.num_slots for g in graphs) + 32  # extra padding past every layout
    sk = max(g.k.num_slots for g in graphs) + 16
    plans = [
        bsa_plan(g, owner="kv") if kind == "bsa" else kpage_plan(g, route=route, owner="kv") for g in graphs
    ]
    stacked = stack_head_plans(plans, sk // 16, sq // 16)
    assert stacked.heads == 1 and np.all(np.diff(stacked.work_route) >= 0)
    (q, k, v, o, lse, do), refs = head_stack_backward_problem(rng, graphs, 2, 16, sq, sk)
    b, h = q.shape[:2]

    def one(x):  # [b, h, s, ...] viewed as one head
        return x.reshape(b, 1, -1, *x.shape[3:])

    grads = emulate_backward(stacked, one(q), one(k), one(v), one(o), lse.reshape(b, 1, -1), one(do))
    grads = tuple(x.reshape(b, h, -1, 16) for x in grads)
    assert_head_stack_gradients(grads, graphs, refs)
    for i, g in enumerate(graphs):
        assert not grads[1][:, i, g.k.num_slots :].any() and not grads[2][:, i, g.k.num_slots :].any()


def test_stack_head_plans_refuses_mixed_plans():
    from small_cases import make_graph

    from sparseattn.layouts import contiguous_layout
    from sparseattn.planning.tile_plan import PlanError, bsa_plan, kpage_plan, stack_head_plans

    lay = contiguous_layout(256, 64)
    g = make_graph(lay, lay, heads=1, density=0.5, seed=0)
    with pytest.raises(PlanError, match="differs"):
        stack_head_plans([kpage_plan(g, owner="kv"), bsa_plan(g, owner="kv")], 16, 16)
    with pytest.raises(PlanError, match="more than"):
        stack_head_plans([kpage_plan(g, owner="kv")], 8, 16)
    two = make_graph(lay, lay, heads=2, density=0.5, seed=0)
    with pytest.raises(PlanError, match="single-head"):
        stack_head_plans([kpage_plan(two, owner="kv")], 16, 16)


def test_head_stack_backward_runs_the_stacked_plan_on_views(monkeypatch):
    """The HeadStack backward's host path: one call on the tensors viewed as one head, whose outputs
    land in the caller's buffers (the kernel call replaced by the float64 emulator)."""
    from small_cases import assert_head_stack_gradients, head_stack_backward_problem, head_stack_graphs

    from sparseattn.graph import HeadStack
    from sparseattn.kernels import backward as bw

    calls = []

    def fake_kernel(
        q, k, v, o, lse, do, plan, scale=None, out=None, impl=None, deterministic=False, dq_plan=None
    ):
        calls.append(q.shape)
        for buf, grad in zip(out, emulate_backward(plan, q, k, v, o, lse, do, scale)):
            buf[...] = grad
        return out

    monkeypatch.setattr(bw, "plan_backward", fake_kernel)
    rng = np.random.default_rng(3)
    graphs = head_stack_graphs(rng, 3, 64, sizes=(100, 200))
    stack = HeadStack.of(graphs)
    inputs, refs = head_stack_backward_problem(rng, graphs, 1, 8, stack.q_slots, stack.k_slots)
    out = tuple(np.full_like(x, np.nan) for x in inputs[:3])
    grads = bw.paged_backward(*inputs, stack, out=out)
    assert calls == [(1, 1, 3 * stack.q_slots, 8)] and grads[0] is out[0]
    assert_head_stack_gradients(grads, graphs, refs)


def test_bsa_backward_takes_a_head_stack_like_kpage_backward(monkeypatch):
    """``sparseattn.bsa_backward`` runs a HeadStack (per-head layouts) on the stacked BSA plans, as
    ``kpage_backward`` does on the KPage plans (the kernel call replaced by the float64 emulator)."""
    from small_cases import assert_head_stack_gradients, head_stack_backward_problem, head_stack_graphs

    import sparseattn
    from sparseattn.graph import HeadStack
    from sparseattn.kernels import backward as bw

    plans = []

    def fake_kernel(
        q, k, v, o, lse, do, plan, scale=None, out=None, impl=None, deterministic=False, dq_plan=None
    ):
        plans.append(plan)
        for buf, grad in zip(out, emulate_backward(plan, q, k, v, o, lse, do, scale)):
            buf[...] = grad
        return out

    monkeypatch.setattr(bw, "plan_backward", fake_kernel)
    assert sparseattn.bsa_backward is bw.bsa_backward
    rng = np.random.default_rng(4)
    graphs = head_stack_graphs(rng, 3, 64, sizes=(100, 200))
    stack = HeadStack.of(graphs)
    inputs, refs = head_stack_backward_problem(rng, graphs, 1, 8, stack.q_slots, stack.k_slots)
    out = tuple(np.full_like(x, np.nan) for x in inputs[:3])
    grads = sparseattn.bsa_backward(*inputs, stack, out=out)
    assert len(plans) == 1 and plans[0].kind == "bsa" and plans[0].owner == "kv"
    assert_head_stack_gradients(grads, graphs, refs)


# ---- the token-order builds' addressing (the numpy twin of PAGED_FWD_TOKENS) -------------------------------


def _permuted(layout, rng):
    return dataclasses.replace(layout, token_slot=rng.permutation(layout.token_slot))


def _slot_order(layout, x):
    """Token-ordered ``[batch, tokens, heads, d]`` -> ``[batch, heads, slots, d]`` (padding zeros)."""
    return layout.to_slots(np.asarray(x, dtype=np.float64).transpose(0, 2, 1, 3))


@pytest.mark.parametrize("route", ["auto", 0, 1, "pair", "packed"], ids=lambda r: f"route={r}")
@pytest.mark.parametrize("seed", range(3), ids=lambda s: f"ragged{s}")
def test_token_order_twin_equals_moving_to_slots(seed, route):
    """Rows gathered through the slot -> token maps and stored back by token give the slot path's output:
    tokens in a random order, batch 2, every route."""
    from small_cases import random_ragged_graph

    from sparseattn.emulator import emulate_token_work_list, emulate_work_list
    from sparseattn.kernels.forward import work_of

    rng = np.random.default_rng(40 + seed)
    base = random_ragged_graph(rng)
    if route == "pair" and base.q.block_size != 64:
        pytest.skip("pair items join 64-row Q blocks")
    q_lay, k_lay = _permuted(base.q, rng), _permuted(base.k, rng)
    graph = SparseGraph.from_block_mask(q_lay, k_lay, base.block_mask())
    wl = work_of(graph, "kpage", route)
    h = graph.heads
    q = rng.standard_normal((2, q_lay.num_tokens, h, 16))
    k, v = (rng.standard_normal((2, k_lay.num_tokens, h, 16)) for _ in range(2))
    o_tok, lse = emulate_token_work_list(wl, q, k, v, q_lay.slot_token, k_lay.slot_token)
    o_s, lse_s = emulate_work_list(wl, _slot_order(q_lay, q), _slot_order(k_lay, k), _slot_order(k_lay, v))
    want = q_lay.from_slots(o_s).transpose(0, 2, 1, 3)
    np.testing.assert_array_equal(o_tok, want)
    np.testing.assert_array_equal(lse, lse_s)


def test_token_order_twin_with_a_map_per_row():
    """SVG2's form: one slot layout, each (batch, head) row with its own token order (maps from
    ``diffusers_wan.slot_tokens`` of the rows' token -> slot tables, batch-major rows), on a work list whose
    heads are the rows: the same output as each row moved to slots by its own layout."""
    torch = pytest.importorskip("torch")
    from sparseattn.diffusers_wan import slot_tokens
    from sparseattn.emulator import emulate_token_work_list, emulate_work_list
    from sparseattn.kernels.forward import work_of
    from sparseattn.layouts import video_layout

    rng = np.random.default_rng(7)
    base = video_layout((3, 6, 7), (2, 4, 4), 64)
    b, h = 2, 3
    layouts = [_permuted(base, rng) for _ in range(b * h)]
    mask = rng.random((b * h, base.num_blocks, base.num_blocks)) < 0.4
    wl = work_of(SparseGraph.from_block_mask(base, base, mask), "kpage", "auto")
    table = torch.tensor(np.stack([lay.token_slot for lay in layouts]))
    maps = slot_tokens(table, base.num_slots).numpy()
    q, k, v = (rng.standard_normal((b, base.num_tokens, h, 16)) for _ in range(3))
    o_tok, _ = emulate_token_work_list(wl, q, k, v, maps, maps, folded=True)
    rows = lambda x: np.stack([lay.to_slots(x[r // h, :, r % h], axis=0) for r, lay in enumerate(layouts)])
    o_s, _ = emulate_work_list(wl, rows(q)[None], rows(k)[None], rows(v)[None])
    want = np.stack([lay.from_slots(o_s[0, r], axis=0) for r, lay in enumerate(layouts)])  # [R, tokens, d]
    np.testing.assert_array_equal(o_tok, want.reshape(b, h, base.num_tokens, 16).transpose(0, 2, 1, 3))
