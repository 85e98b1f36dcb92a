"""The KPage forward's token-order build (``PAGED_FWD_TOKENS``: q, k, v and o stay ``[batch, tokens, heads,
d]``, each slot's row gathered from its token and each output row stored to its token) against the
slot-order build on the same plans: the output moved to tokens and the LSE equal bit for bit. Static graphs
on ragged layouts whose tokens are randomly permuted (every route, d = 64 and 128, batch 2; a map per row
too), device plans of random selections (batch entries with their own), outputs and gradients allocated as
NaN; the float64 reference on some; the per-block sums of token rows; the Wan processor with
``token_order`` on. The backward's token-order build (``PAGED_BWD_TOKENS``) against the slot-order backward
on the same plans (gradients equal to rounding; every main-kernel variant with a token form), and autograd
through ``token_order_attention`` with ``SPARSEATTN_TOKEN_BACKWARD=1``. The Q/O token build
(``PAGED_FWD_TOKENS_QO``: q and o by token, k and v in slot order) beside the token-order build in the
forward's cases, bit for bit against the slot-order build too. The tile-major token build
(``PAGED_FWD_TOKENS_TMA``: k and v token-major, each page 16 consecutive tokens read by TMA) on tile-major
video layouts, static graphs and device plans, bit for bit against the slot-order build, and a Wan model
with its tokens kept tile-major against the Q/O path."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from device_plan_cases import random_case
from small_cases import random_ragged_graph, rel_err

from sparseattn import emulator, reference
from sparseattn.graph import SparseGraph

pytestmark = pytest.mark.gpu


def _permuted(layout, rng):
    """``layout`` with its tokens placed in a random order (the same slots hold tokens)."""
    return dataclasses.replace(layout, token_slot=rng.permutation(layout.token_slot))


def _tokens(q_layout, k_layout, batch, heads, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda n: torch.randn(batch, n, heads, d, device="cuda", generator=g).bfloat16()
    return make(q_layout.num_tokens), make(k_layout.num_tokens), make(k_layout.num_tokens)


def _maps(q_layout, k_layout):
    from sparseattn.torch_ops import _slot_indices

    return _slot_indices(q_layout, torch.device("cuda"))[0], _slot_indices(k_layout, torch.device("cuda"))[0]


def _static_case(seed: int, d: int):
    """A ragged random graph on layouts whose tokens are randomly permuted, batch-2 token-ordered q, k, v
    and the layouts' maps: ``(q_layout, k_layout, graph, (q, k, v), (q_map, k_map))``."""
    rng = np.random.default_rng(seed)
    base = random_ragged_graph(rng)
    q_lay, k_lay = _permuted(base.q, rng), _permuted(base.k, rng)
    graph = SparseGraph.from_block_mask(q_lay, k_lay, base.block_mask())
    return q_lay, k_lay, graph, _tokens(q_lay, k_lay, 2, graph.heads, d, seed), _maps(q_lay, k_lay)


@pytest.fixture(autouse=True)
def nan_empty_like(monkeypatch):
    """Every float tensor made by ``torch.empty_like`` (the wrappers' o, dq, dk and dv) starts as NaN, so rows
    a kernel leaves unwritten show up."""
    real = torch.empty_like

    def poisoned(x, *args, **kwargs):
        out = real(x, *args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty_like", poisoned)


def _assert_equal(o_tok, lse_tok, o_slot_tokens, lse_slot, label):
    assert not torch.isnan(o_tok).any(), f"{label}: an output row was not written"
    assert torch.equal(o_tok, o_slot_tokens), f"{label}: outputs differ from the slot-order build"
    assert torch.equal(lse_tok, lse_slot), f"{label}: LSE differs from the slot-order build"


@pytest.mark.parametrize("seed", range(12), ids=lambda s: f"ragged{s}")
def test_static_graphs_equal_the_slot_order_build(seed):
    import sparseattn.torch as st
    from sparseattn.kernels.forward import torch_graph_forward, torch_token_forward

    q_lay, k_lay, graph, (q, k, v), (q_map, k_map) = _static_case(500 + seed, 128 if seed % 2 else 64)
    routes = ["auto", 0, 1] + (["pair"] if q_lay.block_size == 64 else [])
    for route in routes:
        o, lse = torch_token_forward(q, k, v, graph, q_map, k_map, route=route)
        qs = st.tokens_to_slots(q_lay, q)[0]
        ks, vs = st.tokens_to_slots(k_lay, k, v)
        o_s, lse_s = torch_graph_forward(qs, ks, vs, graph, route=route)
        _assert_equal(o, lse, st.slots_to_tokens(q_lay, o_s), lse_s, f"seed {seed} route {route}")
        # the Q/O token build: k and v from slot order
        o_qo, lse_qo = torch_token_forward(q, ks, vs, graph, q_map, None, route=route, kv_in_slots=True)
        _assert_equal(o_qo, lse_qo, st.slots_to_tokens(q_lay, o_s), lse_s, f"seed {seed} route {route} (Q/O)")
    # and the float64 reference (slot order) for the last route
    args = [
        st.tokens_to_slots(lay, x)[0].double().cpu().numpy()
        for lay, x in ((q_lay, q), (k_lay, k), (k_lay, v))
    ]
    o_ref, _ = reference.attention_forward(*args, graph)
    want = o_ref[:, :, q_lay.token_slot].transpose(0, 2, 1, 3)  # [batch, tokens, heads, d]
    assert rel_err(o.double().cpu().numpy(), want) < 1e-2


@pytest.mark.parametrize("seed", range(30))
def test_device_plans_equal_the_slot_order_build(seed):
    """Random selections planned on the device (top-k and mask forms, batch entries with their own
    selections, 64- and 128-row and single-page blocks), tokens in a random order."""
    import sparseattn.torch as st
    from sparseattn.kernels.forward import torch_graph_forward, torch_token_forward
    from sparseattn.planning.device import DevicePlanner

    rng = np.random.default_rng(7000 + seed)
    case = random_case(rng, seed)
    q_lay, k_lay = _permuted(case.q, rng), _permuted(case.k, rng)
    route = case.route if case.kind == "kpage" else "auto"
    planner = DevicePlanner(q_lay, k_lay, kind=case.kind, route=route)
    selection = {name: torch.as_tensor(x, device="cuda") for name, x in case.selection().items()}
    plans = planner.plan(**selection)
    d = 64 if seed % 2 else 128
    q, k, v = _tokens(q_lay, k_lay, case.batch, case.heads, d, seed)
    q_map, k_map = _maps(q_lay, k_lay)
    o, lse = torch_token_forward(q, k, v, plans, q_map, k_map)
    qs = st.tokens_to_slots(q_lay, q)[0]
    ks, vs = st.tokens_to_slots(k_lay, k, v)
    o_s, lse_s = torch_graph_forward(qs, ks, vs, plans)
    _assert_equal(o, lse, st.slots_to_tokens(q_lay, o_s), lse_s, case.name)
    o_qo, lse_qo = torch_token_forward(q, ks, vs, plans, q_map, None, kv_in_slots=True)  # the Q/O build
    _assert_equal(o_qo, lse_qo, st.slots_to_tokens(q_lay, o_s), lse_s, f"{case.name} (Q/O)")


def test_token_order_attention_with_a_planner_equals_block_sparse_attention():
    import sparseattn.torch as st
    from sparseattn.layouts import video_layout

    lay = video_layout((6, 10, 12), (2, 4, 4), 64)
    q, k, v = _tokens(lay, lay, 2, 3, 128, 3)
    with torch.no_grad():
        idx, num = st.vsa_topk_tokens(q, k, lay, 5)
        o = st.token_order_attention(q, k, v, st.planner_for(lay), idx, num)
        want, _ = st.block_sparse_attention(*st.tokens_to_slots(lay, q, k, v), lay, idx, num)
    assert torch.equal(o, st.slots_to_tokens(lay, want))


def test_token_block_sums_and_selection_match_the_slot_order_path():
    import sparseattn.torch as st
    from sparseattn import vsa_select
    from sparseattn.layouts import video_layout

    lay = video_layout((21, 30, 52), (4, 4, 4), 64)  # Wan 480p's cubes, ragged borders
    q, k, _ = _tokens(lay, lay, 1, 12, 128, 4)
    q_map, _ = _maps(lay, lay)
    qs, ks = st.tokens_to_slots(lay, q, k)
    sums = vsa_select.token_block_sums(q, q_map, 64)
    want = qs.reshape(1, 12, lay.num_blocks, 64, 128).sum(3, dtype=torch.float32)
    torch.testing.assert_close(sums, want, rtol=1e-5, atol=1e-4)
    idx_t, _ = st.vsa_topk_tokens(q, k, lay, 63)
    idx_s, _ = st.vsa_topk(qs, ks, lay, 63)
    same = (idx_t == idx_s).float().mean().item()
    assert same > 0.99, f"only {same:.4f} of the chosen blocks agree"


@pytest.mark.parametrize("order", [True, "qo"], ids=["tokens", "qo"])
@pytest.mark.parametrize("kind", ["sta", "vsa"])
def test_wan_processor_token_order_equals_the_slot_order_path(kind, order):
    from sparseattn.diffusers_wan import WanSelection, WanSparseAttnProcessor

    grid = (6, 12, 16)
    selection = (
        WanSelection.sta((2, 4, 4), (3, 3, 3)) if kind == "sta" else WanSelection.vsa((2, 4, 4), topk=6)
    )
    g = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = (torch.randn(1, 6 * 12 * 16, 4, 128, device="cuda", generator=g).bfloat16() for _ in range(3))
    with torch.no_grad():
        got = WanSparseAttnProcessor(grid, selection, token_order=order).attend(q, k, v)
        want = WanSparseAttnProcessor(grid, selection, token_order=False).attend(q, k, v)
    if kind == "sta":
        assert torch.equal(got, want)
    else:  # the cube sums in another order: near-tied scores may pick other cubes
        assert rel_err(got.double().cpu().numpy(), want.double().cpu().numpy()) < 1e-2


@pytest.mark.parametrize("plan", ["blocks", "clusters"])
def test_svg2_per_row_maps_equal_the_slot_order_path(plan, monkeypatch):
    """SVG2's per-call per-row layouts: the token-order build with a map per (batch, head) row against the
    processor's slot-order path on the same step and plan, bit for bit."""
    from sparseattn.diffusers_wan import WanSelection, WanSparseAttnProcessor

    monkeypatch.setenv("SPARSEATTN_SVG2_PLAN", plan)

    grid = (4, 8, 12)
    g = torch.Generator(device="cuda").manual_seed(13)
    q, k, v = (torch.randn(2, 4 * 8 * 12, 3, 128, device="cuda", generator=g).bfloat16() for _ in range(3))
    proc = WanSparseAttnProcessor(grid, WanSelection.svg2(q_clusters=12, k_clusters=24), token_order=True)
    with torch.no_grad():
        want = proc._svg2_kpage(q, k, v)  # the slot-order path makes the step
        got = proc._svg2_kpage_tokens(q, k, v, proc.last_svg2_step)
    assert not torch.isnan(got).any()
    assert torch.equal(got, want)


def _slot_backward_in_tokens(q_lay, k_lay, q, k, v, o, lse, do, target, route="auto"):
    """The slot-order backward on ``target``'s plans (``route`` for a graph), its gradients moved to tokens."""
    import sparseattn.torch as st
    from sparseattn.kernels.backward import kpage_backward

    qs, os_, dos = st.tokens_to_slots(q_lay, q, o, do)
    ks, vs = st.tokens_to_slots(k_lay, k, v)
    dq, dk, dv = kpage_backward(qs, ks, vs, os_, lse, dos, target, route=route)
    return st.slots_to_tokens(q_lay, dq), st.slots_to_tokens(k_lay, dk), st.slots_to_tokens(k_lay, dv)


def _assert_grads(got, want, label):
    """Equal to rounding: dQ is added by reductions in any order, and the slot-order path may take the
    Q-owned dQ pass (another main kernel) where the token-order build runs bulk reductions; a row gathered
    or stored at the wrong token is off by far more."""
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert not torch.isnan(g).any(), f"{label}: {name} has rows never written"
        assert rel_err(g.double().cpu().numpy(), w.double().cpu().numpy()) < 2e-3, f"{label}: {name}"


@pytest.mark.parametrize("seed", range(10), ids=lambda s: f"ragged{s}")
def test_static_backward_equals_the_slot_order_build(seed):
    from sparseattn.kernels.backward import torch_token_backward
    from sparseattn.kernels.forward import torch_token_forward

    q_lay, k_lay, graph, (q, k, v), (q_map, k_map) = _static_case(800 + seed, 128 if seed % 2 else 64)
    do = torch.randn_like(q)
    for route in ["auto", 0, 1] + (["pair"] if k_lay.block_size == 64 and q_lay.block_size == 64 else []):
        o, lse = torch_token_forward(q, k, v, graph, q_map, k_map, route=route)
        grads = torch_token_backward(q, k, v, o, lse, do, graph, q_map, k_map, route=route)
        assert grads is not None, f"the token-order backward refused route {route}"
        want = _slot_backward_in_tokens(q_lay, k_lay, q, k, v, o, lse, do, graph, route)
        _assert_grads(grads, want, f"seed {seed} route {route}")


@pytest.mark.parametrize("seed", range(20))
def test_device_plan_backward_equals_the_slot_order_build(seed):
    from sparseattn.kernels.backward import torch_token_backward
    from sparseattn.kernels.forward import torch_token_forward
    from sparseattn.planning.device import DevicePlanner

    rng = np.random.default_rng(9100 + seed)
    case = random_case(rng, seed)
    if case.kind != "kpage":
        pytest.skip("the token-order backward runs KPage's plans")
    q_lay, k_lay = _permuted(case.q, rng), _permuted(case.k, rng)
    planner = DevicePlanner(q_lay, k_lay, kind="kpage", route=case.route)
    plans = planner.plan(**{name: torch.as_tensor(x, device="cuda") for name, x in case.selection().items()})
    d = 64 if seed % 2 else 128
    q, k, v = _tokens(q_lay, k_lay, case.batch, case.heads, d, seed)
    do = torch.randn_like(q)
    q_map, k_map = _maps(q_lay, k_lay)
    o, lse = torch_token_forward(q, k, v, plans, q_map, k_map)
    grads = torch_token_backward(q, k, v, o, lse, do, plans, q_map, k_map)
    assert grads is not None, case.name
    _assert_grads(grads, _slot_backward_in_tokens(q_lay, k_lay, q, k, v, o, lse, do, plans), case.name)


@pytest.mark.parametrize("kind", ["graph", "planner"])
def test_autograd_in_token_order_matches_the_moves(kind, monkeypatch):
    import sparseattn.torch as st
    from sparseattn.layouts import video_layout

    lay = _permuted(video_layout((6, 10, 12), (2, 4, 4), 64), np.random.default_rng(2))
    q, k, v = _tokens(lay, lay, 2, 3, 128, 21)
    do = torch.randn_like(q)
    if kind == "graph":
        mask = np.random.default_rng(3).random((3, lay.num_blocks, lay.num_blocks)) < 0.3
        target, sel = SparseGraph.from_block_mask(lay, lay, mask), {}
    else:
        target = st.planner_for(lay)
        idx, num = st.vsa_topk_tokens(q, k, lay, 5)
        sel = dict(q2k_idx=idx, q2k_num=num)
    import sparseattn.kernels.backward as backward_module

    real, ran = backward_module.torch_token_backward, []

    def recorded(*args, **kwargs):
        grads = real(*args, **kwargs)
        ran.append(grads is not None)
        return grads

    monkeypatch.setattr(backward_module, "torch_token_backward", recorded)
    results = {}
    for flag in ("1", "0"):  # token order in both passes, then the moves
        monkeypatch.setenv("SPARSEATTN_TOKEN_BACKWARD", flag)
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        o = st.token_order_attention(*leaves, target, **sel)
        o.backward(do)
        results[flag] = (o.detach(), *(x.grad for x in leaves))
    assert ran == [True], f"the token-order backward ran {ran} (expected once, with flag 1)"
    assert torch.equal(results["1"][0], results["0"][0])
    _assert_grads(results["1"][1:], results["0"][1:], kind)


@pytest.mark.parametrize("impl", ["wgmma_sync", "wgmma_atomic", "wgmma_bulk", "wgmma_qsplit", "wgmma_ws"])
def test_every_token_form_of_the_main_kernels(impl, monkeypatch):
    """The token-order backward under each main-kernel variant with a token form (both paths take
    ``SPARSEATTN_BWD_IMPL``), routes 64 x 256 and 128 x 128, d = 64 and 128."""
    from sparseattn.kernels.backward import torch_token_backward
    from sparseattn.kernels.forward import torch_token_forward

    monkeypatch.setenv("SPARSEATTN_BWD_IMPL", impl)
    for seed, d in ((41, 64), (42, 128), (43, 128)):
        q_lay, k_lay, graph, (q, k, v), (q_map, k_map) = _static_case(seed, d)
        do = torch.randn_like(q)
        for route in (0, 1):
            o, lse = torch_token_forward(q, k, v, graph, q_map, k_map, route=route)
            grads = torch_token_backward(q, k, v, o, lse, do, graph, q_map, k_map, route=route)
            assert grads is not None, f"{impl} route {route}"
            want = _slot_backward_in_tokens(q_lay, k_lay, q, k, v, o, lse, do, graph, route)
            _assert_grads(grads, want, f"{impl} seed {seed} route {route}")


def _row_maps(layout, rows: int, rng):
    """int32 CUDA ``[rows, slots]``: the layout's slot -> token map with each row's tokens renamed by a
    permutation of its own (the same slots hold tokens)."""
    base = np.asarray(layout.slot_token)
    maps = np.full((rows, base.size), -1, dtype=np.int32)
    for r in range(rows):
        perm = rng.permutation(layout.num_tokens)
        maps[r, base >= 0] = perm[base[base >= 0]]
    return torch.as_tensor(maps, device="cuda")


def _rows_in_slots(x, maps):
    """``[batch, heads, slots, d]`` from token-ordered ``x`` through per-row ``maps`` (zeros for -1), by the
    emulator's numpy twin of the kernels' gather (``emulator.token_rows``; bf16 values pass through float64
    exactly)."""
    b, _, h, d = x.shape
    rows = emulator.token_rows(x.double().cpu().numpy(), maps.cpu().numpy())
    return torch.from_numpy(rows.reshape(b, h, -1, d)).to(x.dtype).cuda()


def _slots_in_tokens(xs, maps, tokens: int):
    """:func:`_rows_in_slots`' inverse (``emulator.rows_to_tokens``): ``[batch, tokens, heads, d]``."""
    b, h, slots, d = xs.shape
    rows = xs.double().cpu().numpy().reshape(b * h, slots, d)
    out = emulator.rows_to_tokens(rows, maps.cpu().numpy(), (b, tokens, h, d))
    return torch.from_numpy(out).to(xs.dtype).cuda()


@pytest.mark.parametrize("seed", range(4), ids=lambda s: f"ragged{s}")
def test_a_map_per_row_on_a_static_graph(seed):
    """Maps ``[batch · heads, slots]`` (``maps_per_row``) on a static graph, both passes, against the
    slot-order builds on each row's own move to slots."""
    from sparseattn.kernels.backward import kpage_backward, torch_token_backward
    from sparseattn.kernels.forward import torch_graph_forward, torch_token_forward

    rng = np.random.default_rng(1700 + seed)
    q_lay, k_lay, graph, (q, k, v), _ = _static_case(1700 + seed, 128 if seed % 2 else 64)
    rows = q.shape[0] * q.shape[2]
    q_map, k_map = _row_maps(q_lay, rows, rng), _row_maps(k_lay, rows, rng)
    do = torch.randn_like(q)
    o, lse = torch_token_forward(q, k, v, graph, q_map, k_map)
    qs, dos = _rows_in_slots(q, q_map), _rows_in_slots(do, q_map)
    ks, vs = _rows_in_slots(k, k_map), _rows_in_slots(v, k_map)
    o_s, lse_s = torch_graph_forward(qs, ks, vs, graph)
    _assert_equal(o, lse, _slots_in_tokens(o_s, q_map, q.shape[1]), lse_s, f"seed {seed} forward")
    grads = torch_token_backward(q, k, v, o, lse, do, graph, q_map, k_map)
    assert grads is not None
    dq, dk, dv = kpage_backward(qs, ks, vs, o_s, lse_s, dos, graph)
    want = (
        _slots_in_tokens(dq, q_map, q.shape[1]),
        _slots_in_tokens(dk, k_map, k.shape[1]),
        _slots_in_tokens(dv, k_map, k.shape[1]),
    )
    _assert_grads(grads, want, f"seed {seed} backward")


def test_bad_maps_are_refused_before_any_launch():
    from sparseattn.kernels.forward import torch_token_forward
    from sparseattn.kernels.validate import KernelTypeError, KernelValueError

    base = random_ragged_graph(np.random.default_rng(3))
    q, k, v = _tokens(base.q, base.k, 1, base.heads, 64, 0)
    q_map, k_map = _maps(base.q, base.k)
    with pytest.raises(KernelTypeError, match="q_map must be an int32"):
        torch_token_forward(q, k, v, base, q_map.long(), k_map)
    with pytest.raises(KernelValueError, match="k and v must be"):
        torch_token_forward(q, k[:, :-1], v, base, q_map, k_map)  # k and v with different token counts
    # the Q/O token build: k and v in slot order
    with pytest.raises(KernelValueError, match="slot order"):
        torch_token_forward(q, k, v, base, q_map, None, kv_in_slots=True)  # k, v given in token order
    with pytest.raises(KernelTypeError, match="q_map must be an int32"):
        ks = torch.zeros(1, base.heads, base.k.num_slots, 64, dtype=torch.bfloat16, device="cuda")
        torch_token_forward(q, ks, ks, base, q_map.long(), None, kv_in_slots=True)


# ---- the tile-major token build (PAGED_FWD_TOKENS_TMA): k and v token-major, read page by page by TMA ----

#: Video layouts with partial tiles along every axis: (grid, tile, block size).
TILE_LAYOUTS = [
    ((5, 7, 9), (2, 4, 4), 32),
    ((5, 7, 9), (2, 4, 4), 64),
    ((6, 10, 13), (4, 4, 8), 128),
    ((3, 5, 11), (1, 4, 8), 64),
]


def _tile_major_case(index: int, seed: int, d: int, batch: int = 2, heads: int = 3):
    """A random block mask over a tile-major video layout, token-ordered q, k, v and the maps."""
    from sparseattn.layouts import tile_major_tokens, video_layout

    grid, tile, block = TILE_LAYOUTS[index % len(TILE_LAYOUTS)]
    lay = tile_major_tokens(video_layout(grid, tile, block))
    rng = np.random.default_rng(seed)
    mask = rng.random((heads, lay.num_blocks, lay.num_blocks)) < 0.4
    mask[:, rng.integers(lay.num_blocks)] = False  # a Q block that selects nothing
    graph = SparseGraph.from_block_mask(lay, lay, mask)
    return lay, graph, _tokens(lay, lay, batch, heads, d, seed), _maps(lay, lay)


@pytest.mark.parametrize("seed", range(8), ids=lambda s: f"tiles{s}")
def test_tile_major_build_equals_the_slot_order_build(seed):
    """Static graphs over tile-major video layouts (partial tiles, 32-, 64- and 128-row blocks, every
    route), d = 64 and 128, batch 2: output and LSE bit for bit the slot-order build's; the float64
    reference on the last route."""
    import sparseattn.torch as st
    from sparseattn.kernels.forward import torch_graph_forward, torch_token_forward

    lay, graph, (q, k, v), (q_map, k_map) = _tile_major_case(seed, 900 + seed, 128 if seed % 2 else 64)
    qs = st.tokens_to_slots(lay, q)[0]
    ks, vs = st.tokens_to_slots(lay, k, v)
    routes = ["auto", 0, 1] + (["pair"] if lay.block_size == 64 else [])
    for route in routes:
        o, lse = torch_token_forward(q, k, v, graph, q_map, k_map, route=route, kv_tma=True)
        o_s, lse_s = torch_graph_forward(qs, ks, vs, graph, route=route)
        _assert_equal(o, lse, st.slots_to_tokens(lay, o_s), lse_s, f"seed {seed} route {route} (tiles)")
    args = [st.tokens_to_slots(lay, x)[0].double().cpu().numpy() for x in (q, k, v)]
    o_ref, _ = reference.attention_forward(*args, graph)
    want = o_ref[:, :, lay.token_slot].transpose(0, 2, 1, 3)
    assert rel_err(o.double().cpu().numpy(), want) < 1e-2


@pytest.mark.parametrize("seed", range(8), ids=lambda s: f"plans{s}")
def test_tile_major_build_on_device_plans(seed):
    """Random block masks planned on the device, batch entries with their own selections."""
    import sparseattn.torch as st
    from sparseattn.kernels.forward import torch_graph_forward, torch_token_forward
    from sparseattn.planning.device import DevicePlanner

    lay, graph, (q, k, v), (q_map, k_map) = _tile_major_case(seed, 1900 + seed, 64 if seed % 2 else 128)
    rng = np.random.default_rng(seed)
    mask = torch.as_tensor(rng.random((2, graph.heads, lay.num_blocks, lay.num_blocks)) < 0.3, device="cuda")
    plans = DevicePlanner(lay, lay).plan(mask=mask, backward=False)
    o, lse = torch_token_forward(q, k, v, plans, q_map, k_map, kv_tma=True)
    qs = st.tokens_to_slots(lay, q)[0]
    ks, vs = st.tokens_to_slots(lay, k, v)
    o_s, lse_s = torch_graph_forward(qs, ks, vs, plans)
    _assert_equal(o, lse, st.slots_to_tokens(lay, o_s), lse_s, f"seed {seed} (tiles, device plans)")


def test_tile_major_build_refuses_maps_without_consecutive_pages():
    from sparseattn.kernels.forward import torch_token_forward
    from sparseattn.kernels.validate import KernelValueError

    lay, graph, (q, k, v), (q_map, _) = _tile_major_case(0, 5, 64)
    raster = _permuted(lay, np.random.default_rng(0))  # the same slots, tokens in another order
    with pytest.raises(KernelValueError, match="k_map: the tile-major token build"):
        torch_token_forward(q, k, v, graph, *_maps(raster, raster), kv_tma=True)
    with pytest.raises(KernelValueError, match="choose one"):
        torch_token_forward(q, k, v, graph, q_map, None, kv_in_slots=True, kv_tma=True)


@pytest.mark.parametrize("kind", ["sta", "vsa"])
def test_wan_model_with_tile_major_tokens_equals_the_qo_path(kind):
    """A small bf16 Wan transformer on the GPU: KPage with the model's tokens tile-major (hooks, the
    tile-major build) against the processors' default (the Q/O build behind k, v moves), same weights."""
    from sparseattn.diffusers_wan import WanSelection, install_sparse_attention
    from sparseattn.wan_training import tiny_wan

    latent, grid = (6, 16, 24), (6, 8, 12)
    selection = (
        WanSelection.sta((2, 4, 4), (1, 1, 1)) if kind == "sta" else WanSelection.vsa((2, 4, 4), topk=4)
    )
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(1, 4, *latent, device="cuda", generator=g).bfloat16()
    t = torch.tensor([400], device="cuda")
    enc = torch.randn(1, 7, 16, device="cuda", generator=g).bfloat16()
    outs = []
    for order in ("qo", "tiles"):
        model = tiny_wan(0, head_dim=128, text_dim=16, ffn_dim=64).cuda().bfloat16().eval()
        install_sparse_attention(model, grid, selection, token_order=order)
        with torch.no_grad():
            outs.append(model(x, t, enc, return_dict=False)[0].float())
    assert not torch.isnan(outs[1]).any()
    if kind == "sta":
        torch.testing.assert_close(outs[1], outs[0], rtol=2e-2, atol=2e-2)
    else:  # the cube sums in another order: near-tied scores may pick other cubes
        assert rel_err(outs[1].double().cpu().numpy(), outs[0].double().cpu().numpy()) < 2e-2
