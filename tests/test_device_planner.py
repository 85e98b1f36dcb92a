"""The device planner's algorithm on the CPU (:mod:`sparseattn.planning.device_emulation`, the numpy twin of
``kernels_cu/planner.cu``) against the host planners, and its plans executed by the numpy emulators
against the float64 reference. The GPU tests (``tests/gpu/test_device_planner_gpu.py``) compare the
device's arrays with this twin bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from device_plan_cases import (
    canonical_plan,
    canonical_work_list,
    graph_of,
    host_forward,
    host_owned,
    random_case,
)
from small_cases import rel_err

from sparseattn.emulator import emulate_backward, emulate_work_list
from sparseattn.layouts import video_layout
from sparseattn.planning import device_emulation as emu
from sparseattn.planning.device import DevicePlanner
from sparseattn.planning.layout_pairs import forward_pairs_pay
from sparseattn.planning.tile_plan import PlanError
from sparseattn.reference import attention_backward, attention_forward
from sparseattn.workloads import get_workload

CASES = 220


def _planner(case):
    return DevicePlanner(case.q, case.k, kind=case.kind, route=case.route)


def _device_route(planner, case, owned):
    return "pair" if owned.has_pairs else ("auto" if case.route == "pair" else case.route)


@pytest.mark.parametrize("chunk", range(11), ids=lambda c: f"cases{c * 20}-{c * 20 + 19}")
def test_device_plans_equal_host_plans(chunk):
    """≥ 200 random selections: the forward work list has the host's items (owned pages, masks, streams in
    order), the K/V-owned backward plan and the dQ pass's plan the host's items, in the host's order where
    there are no pair items (the device runs every pair launch on the pair kernel, so it keeps the launch's
    order where the host moves the first item hiding an entry to the front)."""
    rng = np.random.default_rng(1000 + chunk)
    for index in range(chunk * CASES // 11, (chunk + 1) * CASES // 11):
        case = random_case(rng, index)
        planner = _planner(case)
        out = emu.emulate_plans(planner, **case.selection())
        graph = graph_of(out["rows"], case.q, case.k)
        assert out["forward"]["overflow"] == 0 and out["invalid"] == 0, case.name
        forward = emu.as_work_list(planner.forward, out["forward"], out["heads"])
        host = host_forward(graph, case.kind, _device_route(planner, case, planner.forward))
        assert canonical_work_list(forward) == canonical_work_list(host), case.name
        backward = emu.as_tile_plan(planner.backward, out["backward"], out["heads"])
        host_b = host_owned(graph, case.kind, _device_route(planner, case, planner.backward), "kv")
        assert canonical_plan(backward) == canonical_plan(host_b), case.name
        if not planner.backward.has_pairs:  # the host moves a pair item to its launch's front: not needed
            assert np.array_equal(backward.stream_pages, host_b.stream_pages), f"{case.name}: backward order"
            assert np.array_equal(backward.work_head, host_b.work_head), f"{case.name}: backward order"
        if planner.dq is not None:
            dq = emu.as_tile_plan(planner.dq, out["dq"], out["heads"])
            assert canonical_plan(dq) == canonical_plan(host_owned(graph, case.kind, case.route, "q")), (
                case.name
            )


@pytest.mark.parametrize("chunk", range(3), ids=lambda c: f"cases{c * 20}-{c * 20 + 19}")
def test_forward_slices_keep_the_host_items(chunk, monkeypatch):
    """The forward items written at layout-fixed slices (planner.FORWARD_SLICES): each item starts its slice
    (head h's item i at h · slices[-1] + slices[i]) and stays inside it, no item is cut, the items equal the
    host's, and the emulated kernel on the gapped list gives the float64 reference."""
    from sparseattn.kernels import planner as launchers

    monkeypatch.setattr(launchers, "FORWARD_SLICES", True)
    rng = np.random.default_rng(1500 + chunk)
    for index in range(chunk * 20, (chunk + 1) * 20):
        case = random_case(rng, index)
        planner = _planner(case)
        out = emu.emulate_plans(planner, **case.selection())
        fwd, heads = out["forward"], out["heads"]
        k = case.q2k_idx.shape[-1] if case.mask is None else planner.mask_width()
        slices = planner.forward.stream_slices(k)
        assert fwd["overflow"] == 0 and fwd["stream_entries"].shape[0] == heads * slices[-1], case.name
        _, begin, length, _ = fwd["work_info"].astype(np.int64).T
        start = (np.arange(heads)[:, None] * slices[-1] + slices[:-1]).ravel()
        assert np.array_equal(begin, start), case.name
        assert (length <= np.tile(np.diff(slices), heads)).all(), case.name
        work = emu.as_work_list(planner.forward, fwd, heads)
        graph = graph_of(out["rows"], case.q, case.k)
        host = host_forward(graph, case.kind, _device_route(planner, case, planner.forward))
        assert canonical_work_list(work) == canonical_work_list(host), case.name
        q = rng.standard_normal((1, heads, case.q.num_slots, 16))
        kk, v = (rng.standard_normal((1, heads, case.k.num_slots, 16)) for _ in range(2))
        o_ref, _ = attention_forward(q, kk, v, graph)
        o, _ = emulate_work_list(work, q, kk, v)
        valid = case.q.valid
        assert rel_err(o[:, :, valid], o_ref[:, :, valid]) < 1e-12, case.name


@pytest.mark.parametrize("seed", range(12))
def test_device_plans_compute_the_graph(seed):
    """The twin's plans, executed by the numpy emulators, give the float64 reference's O, LSE, dQ, dK, dV
    (batch entries with their own selections run as one batch of batch · heads heads)."""
    rng = np.random.default_rng(seed)
    case = random_case(rng, seed)
    planner = _planner(case)
    out = emu.emulate_plans(planner, **case.selection())
    heads = out["heads"]
    graph = graph_of(out["rows"], case.q, case.k)
    q = rng.standard_normal((1, heads, case.q.num_slots, 16))
    k, v = (rng.standard_normal((1, heads, case.k.num_slots, 16)) for _ in range(2))
    do = rng.standard_normal(q.shape)
    o_ref, lse_ref = attention_forward(q, k, v, graph)
    o, lse = emulate_work_list(emu.as_work_list(planner.forward, out["forward"], heads), q, k, v)
    valid = case.q.valid
    assert rel_err(o[:, :, valid], o_ref[:, :, valid]) < 1e-12, case.name
    assert np.array_equal(np.isinf(lse[:, :, valid]), np.isinf(lse_ref[:, :, valid])), case.name
    grads_ref = attention_backward(q, k, v, o_ref, lse_ref, do, graph)
    grads = emulate_backward(
        emu.as_tile_plan(planner.backward, out["backward"], heads), q, k, v, o_ref, lse_ref, do
    )
    for name, g, r, lay in zip(("dq", "dk", "dv"), grads, grads_ref, (case.q, case.k, case.k)):
        assert rel_err(g[:, :, lay.valid], r[:, :, lay.valid]) < 1e-10, f"{case.name}: {name}"


@pytest.mark.parametrize("chunk", range(4), ids=lambda c: f"cases{c * 15}-{c * 15 + 14}")
def test_forward_order_lists_void_items_first_and_the_rest_computes_the_graph(chunk):
    """The forward's order: every void item (no stream entry, no owned page) first, ``first_live`` of them,
    then the live items head by head, largest M · chunks first; the items from ``first_live`` on (where a
    launch starts the item counter) give the float64 reference's O and LSE on every valid row."""
    import dataclasses

    rng = np.random.default_rng(3000 + chunk)
    voids = 0
    for index in range(chunk * 15, (chunk + 1) * 15):
        case = random_case(rng, index)
        planner = _planner(case)
        out = emu.emulate_plans(planner, **case.selection())
        fwd, heads = out["forward"], out["heads"]
        assert fwd["overflow"] == 0, case.name  # work_info's lengths are then the uncut ones
        order, info, own = fwd["work_order"], fwd["work_info"], fwd["own_entries"][..., 0]
        first = int(fwd["first_live"][0])
        assert np.array_equal(np.sort(order), np.arange(info.shape[0])), case.name
        void = (info[:, 2] == 0) & np.all(own < 0, axis=1)
        assert void[order[:first]].all() and not void[order[first:]].any(), case.name
        live = order[first:]
        assert np.all(np.diff(info[live, 0]) >= 0), f"{case.name}: live items head by head"
        cost = info[:, 3].astype(np.int64) * -(-info[:, 2] // (planner.forward.chunk // 16))
        for h in range(heads):
            assert np.all(np.diff(cost[live[info[live, 0] == h]]) <= 0), f"{case.name}: head {h} order"
        voids += first
        work = dataclasses.replace(emu.as_work_list(planner.forward, fwd, heads), work_order=live)
        graph = graph_of(out["rows"], case.q, case.k)
        q, k, v = (rng.standard_normal((1, heads, lay.num_slots, 16)) for lay in (case.q, case.k, case.k))
        o_ref, lse_ref = attention_forward(q, k, v, graph)
        o, lse = emulate_work_list(work, q, k, v)
        valid = case.q.valid
        assert rel_err(o[:, :, valid], o_ref[:, :, valid]) < 1e-12, case.name
        assert np.array_equal(np.isinf(lse[:, :, valid]), np.isinf(lse_ref[:, :, valid])), case.name
    assert voids > 0, "no case had a void item: the test would not see the order's split"


def test_mask_and_topk_selections_plan_alike():
    """A top-k selection and the block mask of the same pairs give the same plans (the forward's items
    alike; their slices differ, sized by the selection's width)."""
    rng = np.random.default_rng(3)
    lay = video_layout((5, 9, 10), (2, 4, 4), 64)
    nb = lay.num_blocks
    idx = rng.integers(0, nb, size=(2, 3, nb, 4)).astype(np.int32)
    num = rng.integers(0, 5, size=(2, 3, nb)).astype(np.int32)
    mask = np.zeros((2, 3, nb, nb), dtype=bool)
    b, h, i, e = np.nonzero(np.arange(4)[None, None, None, :] < num[..., None])
    mask[b, h, i, idx[b, h, i, e]] = True
    planner = DevicePlanner(lay)
    a, m = emu.emulate_plans(planner, idx, num), emu.emulate_plans(planner, mask=mask)
    lists = [emu.as_work_list(planner.forward, x["forward"], x["heads"]) for x in (a, m)]
    assert canonical_work_list(lists[0]) == canonical_work_list(lists[1])
    assert np.array_equal(a["forward"]["work_order"], m["forward"]["work_order"])
    for part in ("backward",):
        for name in ("work_info", "stream_entries", "stream_indptr", "stream_pages", "own_pages"):
            if name in a[part]:
                assert np.array_equal(a[part][name], m[part][name]), (part, name)


def test_invalid_entries_are_ignored_and_counted():
    lay = video_layout((4, 8, 8), (2, 4, 4), 64)
    nb = lay.num_blocks
    idx = np.zeros((1, 1, nb, 2), dtype=np.int32)
    idx[0, 0, 0] = (nb, -1)  # out of range: ignored
    num = np.full((1, 1, nb), 2, dtype=np.int32)
    num[0, 0, 1] = 7  # more than k: invalid, read as k
    rows, invalid = emu.selection_matrix(lay.valid_rows > 0, lay.valid_rows > 0, idx[0], num[0])
    assert invalid == 3
    assert not rows[0, 0].any() and rows[0, 1, 0]


@pytest.mark.parametrize("slices", [False, True], ids=["back-to-back", "slices"])
def test_stream_capacity_holds_any_topk_selection(slices, monkeypatch):
    """Every Q block selecting the k blocks with the most pages, all heads alike: the forward and backward
    streams fit their buffers (or the forward items their slices) exactly or with room (the bound holds at
    its worst case)."""
    from sparseattn.kernels import planner as launchers

    monkeypatch.setattr(launchers, "FORWARD_SLICES", slices)
    lay = video_layout((5, 8, 12), (3, 4, 8), 128)
    nb, k = lay.num_blocks, 5
    top = np.argsort(-lay.live_pages, kind="stable")[:k].astype(np.int32)
    idx = np.broadcast_to(top, (1, 2, nb, k)).copy()
    num = np.full((1, 2, nb), k, dtype=np.int32)
    for route in ("auto", "pair", 0, 1):
        planner = DevicePlanner(lay, route=route)
        out = emu.emulate_plans(planner, idx, num)
        assert out["forward"]["overflow"] == 0 and out["backward"]["overflow"] == 0


def test_max_selected_below_the_selection_is_reported():
    lay = video_layout((4, 8, 8), (2, 4, 4), 64)
    nb = lay.num_blocks
    planner = DevicePlanner(lay, max_selected=1)
    out = emu.emulate_plans(planner, mask=np.ones((1, 1, nb, nb), dtype=bool))
    assert out["forward"]["overflow"] > 0


def test_auto_routes_follow_a_rule_of_the_layout():
    """``"auto"`` pairs the forward's 64-row blocks where most Q blocks are 64-row blocks (VSA's cubes), not
    on SSTA's 128-row tiles; the backward pairs wherever the K/V layout has 64-row blocks."""
    vsa, ssta = get_workload("vsa_wan14b_480p").layout(), get_workload("ssta_hy15_720p").layout()
    assert forward_pairs_pay(vsa) and not forward_pairs_pay(ssta)
    assert DevicePlanner(vsa).forward.has_pairs and DevicePlanner(vsa).backward.has_pairs
    assert not DevicePlanner(ssta).forward.has_pairs and DevicePlanner(ssta).backward.has_pairs
    assert not DevicePlanner(vsa, deterministic=True).backward.has_pairs


def test_bad_planner_arguments_name_them():
    lay = video_layout((4, 8, 8), (2, 4, 4), 64)
    with pytest.raises(PlanError, match="q_layout"):
        DevicePlanner("not a layout")
    with pytest.raises(PlanError, match="route"):
        DevicePlanner(lay, route="diagonal")
    with pytest.raises(PlanError, match="kind"):
        DevicePlanner(lay, kind="dense")
    with pytest.raises(PlanError, match="pair"):
        DevicePlanner(lay, kind="bsa", route="pair")
    with pytest.raises(PlanError, match="max_selected"):
        DevicePlanner(lay, max_selected=0)


def test_a_layout_past_the_write_pass_page_ids_is_refused(monkeypatch):
    """The write pass packs a page id with its lane in 32 bits (page ids below planner.STAGE_PAGES, 2^26):
    a planner over a layout with more pages is refused when it is made, naming the layout."""
    from sparseattn.kernels import planner as launchers

    lay = video_layout((4, 8, 8), (2, 4, 4), 64)
    monkeypatch.setattr(launchers, "STAGE_PAGES", lay.num_pages - 1)
    with pytest.raises(PlanError, match="q_layout has"):
        DevicePlanner(lay)
    monkeypatch.setattr(launchers, "STAGE_PAGES", lay.num_pages)
    DevicePlanner(lay)


def test_the_pair_matching_takes_shared_memory_where_it_fits(monkeypatch):
    """planner.pair_match_form: shared memory for layouts whose keys, edges and partners fit (VSA 720p:
    1,100 slots, ~14,300 edges), the L2 form past that or when asked; 'smem' that cannot fit is refused."""
    from sparseattn.kernels import planner

    monkeypatch.setattr(planner, "PAIR_MATCH", "auto")
    assert planner.pair_match_form(1100, 14300) == "smem"
    assert planner.pair_match_form(20000, 260000) == "global"
    monkeypatch.setattr(planner, "PAIR_MATCH", "global")
    assert planner.pair_match_form(1100, 14300) == "global"
    monkeypatch.setattr(planner, "PAIR_MATCH", "smem")
    with pytest.raises(ValueError, match="PAIR_MATCH='smem'"):
        planner.pair_match_form(20000, 260000)
    monkeypatch.setattr(planner, "PAIR_MATCH", "fast")
    with pytest.raises(ValueError, match="must be one of"):
        planner.pair_match_form(10, 10)


def test_partial_blocks_group_by_proximity_in_video_layouts():
    """forward_layout_groups on a video layout: every partial 64-row block in exactly one half, halves of at
    most 4 pages, at most 8 member blocks an item, as many items as block order would make or fewer, the
    same halves on every call; a layout without a tile grid keeps block order."""
    from sparseattn.layouts import contiguous_layout
    from sparseattn.planning import layout_pairs as lp

    layout = video_layout((9, 13, 11), (4, 4, 4), block_size=64)  # ragged borders: 1-3-page blocks
    live = layout.live_pages.astype(np.int64)
    partial = np.flatnonzero(lp.small_blocks(layout) & (live < lp.HALF_PAGES))
    assert partial.size > 20
    halves_a, halves_b = lp.forward_layout_groups(layout)
    members = np.concatenate([*halves_a, *halves_b])
    assert np.array_equal(np.sort(members), partial)
    assert all(live[h].sum() <= lp.HALF_PAGES for h in (*halves_a, *halves_b))
    assert all(a.size + b.size <= 8 and a.size > 0 for a, b in zip(halves_a, halves_b))
    in_order = lp.packed_in_order(partial, live)
    assert len(halves_a) <= -(-len(in_order) // 2)
    again = lp.forward_layout_groups(layout)
    assert all(np.array_equal(x, y) for x, y in zip(halves_a + halves_b, again[0] + again[1]))
    flat = contiguous_layout(64 * 7 - 30, 64)
    groups = lp.packed_in_order(
        np.flatnonzero(lp.small_blocks(flat) & (flat.live_pages < lp.HALF_PAGES)),
        flat.live_pages.astype(np.int64),
    )
    assert [g.tolist() for g in lp.forward_layout_groups(flat)[0]] == [g.tolist() for g in groups[0::2]]


def test_proximity_groups_stream_fewer_pages_than_block_order_on_vsa():
    """On VSA 480p's layout and selection (8 heads), the partial blocks' items stream fewer K pages than
    block order's (counted as the twin streams them: the union of the members' selected pages)."""
    from sparseattn.planning import layout_pairs as lp

    graph = get_workload("vsa_wan14b_480p").build()
    live = graph.q.live_pages.astype(np.int64)
    kp = graph.k.live_pages.astype(np.int64)
    partial = np.flatnonzero(lp.small_blocks(graph.q) & (live < lp.HALF_PAGES))
    sel = graph.block_mask()[:8]

    def pages(items):
        return sum(int(kp[s[np.asarray(m)].any(axis=0)].sum()) for s in sel for m in items)

    near = [np.concatenate([a, b]) for a, b in zip(*lp.forward_layout_groups(graph.q))]
    groups = lp.packed_in_order(partial, live)
    ordered = [np.concatenate([a, *b]) for a, b in zip(groups[0::2], [[g] for g in groups[1::2]] + [[]])]
    assert len(near) == len(ordered)
    assert pages(near) < 0.95 * pages(ordered)
