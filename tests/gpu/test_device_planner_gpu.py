"""The device planner on the H200: its arrays equal the numpy twin's bit for bit on random selections, and
the kernels on its plans (CuPy and torch, forward and backward, CUDA-graph replay) equal the float64
reference."""

from __future__ import annotations

import numpy as np
import pytest
from device_plan_cases import graph_of, random_case
from small_cases import rel_err

from sparseattn.planning import device_emulation as emu
from sparseattn.planning.device import DevicePlanner
from sparseattn.reference import attention_backward, attention_forward

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

BF16_NAN = 0x7FC0


def _device_selection(case):
    if case.mask is not None:
        return {"mask": cupy.asarray(case.mask)}
    return {"q2k_idx": cupy.asarray(case.q2k_idx), "q2k_num": cupy.asarray(case.q2k_num)}


def _planner(case):
    return DevicePlanner(case.q, case.k, kind=case.kind, route=case.route)


def _written(work_info) -> np.ndarray:
    """int64: the stream positions a forward work list's items hold (each item's begin .. begin + length)."""
    spans = [np.arange(b, b + n) for _, b, n, _ in np.asarray(work_info, np.int64)]
    return np.concatenate(spans) if spans else np.zeros(0, np.int64)


def _assert_same(plans, part: str, twin: dict, names, label: str):
    """The device arrays equal the twin's (their first entries: device buffers are sized to a bound; the
    forward's streams where its items write, which with slices leaves gaps the device does not touch)."""
    for name in names:
        want = twin[name]
        got = cupy.asnumpy(plans.view(part, name))[: want.shape[0]]
        if part == "forward" and name == "stream_entries":
            at = _written(twin["work_info"])
            got, want = got[at], want[at]
        assert got.shape == want.shape and np.array_equal(got, want), f"{label}: {name}"


def _assert_plans_equal_the_twin(case, planner=None):
    planner = _planner(case) if planner is None else planner
    plans = planner.plan(**_device_selection(case))
    twin = emu.emulate_plans(planner, **case.selection())
    assert cupy.asnumpy(plans.arena.view("status")).tolist() == [0, 0], case.name
    forward = ["work_info", "work_order", "first_live", "own_entries", "stream_entries"]
    if twin["forward"]["partner"] is not None:  # the matched pairs of the full 64-row blocks
        forward.append("partner")
    _assert_same(plans, "forward", twin["forward"], forward, f"{case.name} forward")
    for part in ("backward", "dq"):
        if twin[part] is None:
            assert getattr(plans, part) is None
            continue
        names = ["work_head", "own_pages", "stream_indptr", "stream_pages", "order"]
        if twin[part]["pair_pages"] is not None:
            names.append("pair_pages")
        _assert_same(plans, part, twin[part], names, f"{case.name} {part}")


@pytest.mark.parametrize("chunk", range(10), ids=lambda c: f"cases{c * 21}-{c * 21 + 20}")
def test_device_arrays_equal_the_numpy_twin(chunk):
    """210 random selections (ragged and video layouts, 64/128-row and single-page blocks, batch entries
    with their own selections, top-k and masks, every route, KPage and BSA): every array the kernels read
    equals :mod:`sparseattn.planning.device_emulation`'s, which the CPU tests hold to the host planners."""
    rng = np.random.default_rng(5000 + chunk)
    for index in range(chunk * 21, (chunk + 1) * 21):
        _assert_plans_equal_the_twin(random_case(rng, index))


def _another_selection(case, rng):
    """``case`` with a new random selection of the same shape and form."""
    from dataclasses import replace

    if case.mask is not None:
        return replace(case, mask=rng.random(case.mask.shape) < rng.uniform(0.05, 0.9))
    idx = rng.integers(0, case.k.num_blocks, size=case.q2k_idx.shape).astype(np.int32)
    num = rng.integers(0, idx.shape[-1] + 1, size=case.q2k_num.shape).astype(np.int32)
    return replace(case, q2k_idx=idx, q2k_num=num)


@pytest.mark.parametrize("chunk", range(2), ids=lambda c: f"cases{c * 21}-{c * 21 + 20}")
def test_later_calls_replay_the_first_and_equal_the_numpy_twin(chunk):
    """A planner records its first call of a shape and replays its launches for the next ones
    (planning.plan_recipe): three more selections per case through one planner equal the twin's."""
    rng = np.random.default_rng(7300 + chunk)
    for index in range(chunk * 21, (chunk + 1) * 21):
        case = random_case(rng, index)
        planner = _planner(case)
        _assert_plans_equal_the_twin(case, planner)
        for _ in range(3):
            _assert_plans_equal_the_twin(_another_selection(case, rng), planner)
        assert len(planner._recipes) == 1


@pytest.mark.parametrize(
    "form, stage",
    [("staged", 8), ("staged", 3), ("staged", 1), ("coalesced", 256), ("per_block", 256)],
    ids=["staged-groups-of-2", "staged-windows-of-3", "staged-windows-of-1", "coalesced", "per_block"],
)
def test_every_write_form_equals_the_numpy_twin(form, stage, monkeypatch):
    """The write pass's other store forms (planner.ITEMS_WRITE), and the staged form with stages too small
    for 32 blocks (groups of fewer blocks) or for one block (a block's pages in several windows), give the
    twin's arrays on 42 random selections."""
    from sparseattn.kernels import planner as launchers

    monkeypatch.setattr(launchers, "ITEMS_WRITE", form)
    monkeypatch.setattr(launchers, "STAGE_CAP", stage)
    rng = np.random.default_rng(7100)
    for index in range(42):
        _assert_plans_equal_the_twin(random_case(rng, index))


@pytest.mark.parametrize(
    "fused, bitmap",
    [(False, "rows"), (True, "atomic"), (False, "atomic")],
    ids=["three-pass-forward", "atomic-topk-bitmap", "both-replaced-forms"],
)
def test_replaced_planner_forms_equal_the_numpy_twin(fused, bitmap, monkeypatch):
    """The forward's count pass, scan and write pass (planner.FUSED_FORWARD off) and the top-k bitmap by
    global atomics (planner.BITMAP_TOPK="atomic"), which the fused pass and the per-row bitmap replaced, give
    the twin's arrays too, on 42 random selections."""
    from sparseattn.kernels import planner as launchers

    monkeypatch.setattr(launchers, "FUSED_FORWARD", fused)
    monkeypatch.setattr(launchers, "BITMAP_TOPK", bitmap)
    rng = np.random.default_rng(7200)
    for index in range(42):
        _assert_plans_equal_the_twin(random_case(rng, index))


def _mask_cases(seed: int, count: int = 60):
    """The block-mask cases among ``count`` random cases of one seed."""
    rng = np.random.default_rng(seed)
    cases = (random_case(rng, index) for index in range(count))
    return [case for case in cases if case.mask is not None]


def test_fused_forward_counts_cut_streams_as_the_scan_does(monkeypatch):
    """A block mask selecting more than ``max_selected`` blocks per row outgrows the buffers: the fused pass
    cuts the same streams at the same capacity as the count pass + scan + write pass (every forward array
    and the status words equal), on random masks and layouts with each form planned by its own planner."""
    from sparseattn.kernels import planner as launchers

    monkeypatch.setattr(launchers, "FORWARD_SLICES", False)  # the streams back to back in both forms
    cut = 0
    for case in _mask_cases(7400):
        got = {}
        for fused in (True, False):
            monkeypatch.setattr(launchers, "FUSED_FORWARD", fused)
            planner = DevicePlanner(case.q, case.k, kind=case.kind, route=case.route, max_selected=2)
            plans = planner.plan(mask=cupy.asarray(case.mask), backward=False)
            names = ["work_info", "stream_entries", "begin", "cnt"]
            got[fused] = [cupy.asnumpy(plans.arena.view("status"))] + [
                cupy.asnumpy(plans.view("forward", n)) for n in names
            ]
            written = got[fused][3][-1]  # begin[n]: the entries written (past it the buffer is as allocated)
            got[fused][2] = got[fused][2][:written]
        for name, a, b in zip(["status", *names], got[True], got[False]):
            assert np.array_equal(a, b), f"{case.name}: {name}"
        cut += int(got[True][0][1] > 0)
    assert cut >= 5, f"only {cut} cases outgrew their buffers"


@pytest.mark.parametrize("chunk", range(3), ids=lambda c: f"cases{c * 21}-{c * 21 + 20}")
def test_forward_slices_equal_the_numpy_twin(chunk, monkeypatch):
    """The fused pass writing each forward item at its layout-fixed slice (planner.FORWARD_SLICES) gives the
    twin's arrays (the streams where the items write) on 63 random selections."""
    from sparseattn.kernels import planner as launchers

    monkeypatch.setattr(launchers, "FORWARD_SLICES", True)
    rng = np.random.default_rng(7500 + chunk)
    for index in range(chunk * 21, (chunk + 1) * 21):
        _assert_plans_equal_the_twin(random_case(rng, index))


def test_forward_slices_cut_streams_as_the_twin_does(monkeypatch):
    """Block masks selecting more than ``max_selected`` blocks per row outgrow their slices: the device cuts
    the twin's streams at each slice's end and counts the items cut in the status word."""
    from sparseattn.kernels import planner as launchers

    monkeypatch.setattr(launchers, "FORWARD_SLICES", True)
    cut = 0
    for case in _mask_cases(7600):
        planner = DevicePlanner(case.q, case.k, kind=case.kind, route=case.route, max_selected=2)
        plans = planner.plan(mask=cupy.asarray(case.mask), backward=False)
        twin = emu.emulate_plans(planner, mask=case.mask)["forward"]
        _assert_same(plans, "forward", twin, ["work_info", "work_order", "stream_entries"], case.name)
        status = cupy.asnumpy(plans.arena.view("status"))
        assert status[1] == twin["overflow"], case.name
        cut += int(twin["overflow"] > 0)
    assert cut >= 5, f"only {cut} cases outgrew their slices"


@pytest.mark.parametrize("form", ["smem", "global"])
def test_both_pair_matching_forms_equal_the_numpy_twin(form, monkeypatch):
    """The full blocks' pair matching with a head's keys, edges and partners in shared memory and with them
    in L2 (planner.PAIR_MATCH) both give the twin's partners and work list, on the random selections of
    42 cases that have matched slots (9 of them)."""
    from sparseattn.kernels import planner as launchers

    monkeypatch.setattr(launchers, "PAIR_MATCH", form)
    rng = np.random.default_rng(7000)
    matched = 0
    for index in range(42):
        case = random_case(rng, index)
        planner = _planner(case)
        twin = emu.emulate_plans(planner, **case.selection())
        if twin["forward"]["partner"] is None:
            continue
        matched += 1
        plans = planner.plan(**_device_selection(case))
        names = ["work_info", "work_order", "first_live", "own_entries", "stream_entries", "partner"]
        _assert_same(plans, "forward", twin["forward"], names, f"{case.name} forward ({form})")
    assert matched == 9


def _bf16(rng, shape):
    from sparseattn.kernels.validate import bf16_bits_to_float, float_to_bf16_bits

    bits = float_to_bf16_bits(rng.standard_normal(shape).astype(np.float32))
    return bits, bf16_bits_to_float(bits).astype(np.float64)


@pytest.mark.parametrize("seed", range(52))
def test_kernels_on_device_plans_match_the_reference(seed):
    """52 random selections through the dynamic path with CuPy arrays: forward into NaN-poisoned outputs,
    backward into NaN-poisoned gradients; every valid row against the float64 reference (bf16 inputs)."""
    from sparseattn.kernels.backward import kpage_backward
    from sparseattn.kernels.forward import kpage_forward
    from sparseattn.kernels.validate import bf16_bits_to_float

    rng = np.random.default_rng(9000 + seed)
    case = random_case(rng, seed)
    d = 128 if seed % 2 else 64
    planner = _planner(case)
    plans = planner.plan(**_device_selection(case))
    rows, _ = emu.selection_matrix(planner.forward.owner_alive, planner.forward.stream.alive, **_flat(case))
    graph = graph_of(rows, case.q, case.k)
    b, h, sq, sk = case.batch, case.heads, case.q.num_slots, case.k.num_slots
    (qb, q), (kb, k), (vb, v), (dob, do) = (_bf16(rng, (b, h, n, d)) for n in (sq, sk, sk, sq))
    o = cupy.full((b, h, sq, d), BF16_NAN, dtype=cupy.uint16)
    lse = cupy.full((b, h, sq), np.nan, dtype=cupy.float32)
    kpage_forward(*(cupy.asarray(x) for x in (qb, kb, vb)), plans, out=(o, lse))
    flat = lambda x: x.reshape(1, b * h, *x.shape[2:])
    o_ref, lse_ref = attention_forward(flat(q), flat(k), flat(v), graph)
    got_o = bf16_bits_to_float(cupy.asnumpy(o)).astype(np.float64).reshape(o_ref.shape)
    valid_q, valid_k = case.q.valid, case.k.valid
    assert np.isfinite(got_o[:, :, valid_q]).all(), case.name
    assert rel_err(got_o[:, :, valid_q], o_ref[:, :, valid_q]) < 1e-2, case.name
    got_lse = cupy.asnumpy(lse).reshape(lse_ref.shape)
    assert np.array_equal(np.isinf(got_lse[:, :, valid_q]), np.isinf(lse_ref[:, :, valid_q])), case.name
    fin = np.isfinite(lse_ref[:, :, valid_q])
    assert np.abs(got_lse[:, :, valid_q][fin] - lse_ref[:, :, valid_q][fin]).max(initial=0) < 2e-2, case.name

    # the backward from fresh forward outputs (padding rows: o = 0, lse = -inf), into poisoned gradients
    inputs = tuple(cupy.asarray(x) for x in (qb, kb, vb))
    o, lse = kpage_forward(*inputs, plans)
    grads = tuple(
        cupy.full(s, BF16_NAN, dtype=cupy.uint16) for s in ((b, h, sq, d), (b, h, sk, d), (b, h, sk, d))
    )
    kpage_backward(*inputs, o, lse, cupy.asarray(dob), plans, out=grads)
    o_used = bf16_bits_to_float(cupy.asnumpy(o)).astype(np.float64).reshape(o_ref.shape)
    lse_used = cupy.asnumpy(lse).astype(np.float64).reshape(lse_ref.shape)
    refs = attention_backward(flat(q), flat(k), flat(v), o_used, lse_used, flat(do), graph)
    for name, g, r, valid in zip(("dq", "dk", "dv"), grads, refs, (valid_q, valid_k, valid_k)):
        got = bf16_bits_to_float(cupy.asnumpy(g)).astype(np.float64).reshape(r.shape)
        assert np.isfinite(got[:, :, valid]).all(), f"{case.name}: {name} not written"
        assert rel_err(got[:, :, valid], r[:, :, valid]) < 1e-2, f"{case.name}: {name}"


def _flat(case):
    if case.mask is not None:
        return {"mask": case.mask.reshape(-1, *case.mask.shape[2:])}
    return {
        "q2k_idx": case.q2k_idx.reshape(-1, *case.q2k_idx.shape[2:]),
        "q2k_num": case.q2k_num.reshape(-1, case.q2k_num.shape[-1]),
    }


def test_invalid_selection_entries_are_reported():
    from sparseattn.layouts import video_layout
    from sparseattn.planning.tile_plan import PlanError

    lay = video_layout((4, 8, 8), (2, 4, 4), 64)
    nb = lay.num_blocks
    idx = cupy.zeros((1, 2, nb, 3), dtype=cupy.int32)
    idx[0, 1, 2, 0] = nb + 5
    num = cupy.full((1, 2, nb), 3, dtype=cupy.int32)
    plans = DevicePlanner(lay).plan(idx, num)
    with pytest.raises(PlanError, match="1 invalid"):
        plans.check()


torch = pytest.importorskip("torch")


def _torch_problem(seed, grid=(8, 12, 16), tile=(4, 4, 4), heads=3, batch=2, d=128, topk=9):
    from sparseattn.layouts import video_layout

    lay = video_layout(grid, tile, 64)
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (batch, heads, lay.num_slots, d)
    valid = torch.as_tensor(lay.valid, device="cuda")[None, None, :, None]
    q, k, v, do = (torch.randn(shape, device="cuda", generator=g).mul(valid).bfloat16() for _ in range(4))
    return lay, q, k, v, do, topk


def _reference(lay, q, k, v, do, idx, num):
    """float64 reference on the selection's graph (batch · heads heads)."""
    b, h = q.shape[:2]
    rows, _ = emu.selection_matrix(
        lay.valid_rows > 0,
        lay.valid_rows > 0,
        idx.cpu().numpy().reshape(b * h, *idx.shape[2:]),
        num.cpu().numpy().reshape(b * h, -1),
    )
    graph = graph_of(rows, lay, lay)
    flat = [x.double().cpu().numpy().reshape(1, b * h, *x.shape[2:]) for x in (q, k, v, do)]
    o, lse = attention_forward(*flat[:3], graph)
    grads = attention_backward(*flat[:3], o, lse, flat[3], graph)
    return o, grads


def test_torch_block_sparse_attention_with_autograd():
    """``block_sparse_attention`` (VSA's argument convention) against the reference, forward and gradients,
    a selection per batch entry and head from ``vsa_topk``."""
    from sparseattn.torch import block_sparse_attention, vsa_topk

    lay, q, k, v, do, topk = _torch_problem(1)
    idx, num = vsa_topk(q, k, lay, topk)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    o, _ = block_sparse_attention(q, k, v, lay, idx, num)
    o.backward(do)
    o_ref, grads_ref = _reference(lay, q.detach(), k.detach(), v.detach(), do, idx, num)
    valid = lay.valid
    got = o.detach().double().cpu().numpy().reshape(o_ref.shape)
    assert rel_err(got[:, :, valid], o_ref[:, :, valid]) < 1e-2
    assert (got[:, :, ~valid] == 0).all(), "padding rows of o must be zero"
    for x, r in zip((q, k, v), grads_ref):
        g = x.grad.double().cpu().numpy().reshape(r.shape)
        assert rel_err(g[:, :, valid], r[:, :, valid]) < 1e-2


def test_block_mask_form_equals_topk_form():
    from sparseattn.torch import block_sparse_attention, block_sparse_attention_mask, vsa_topk

    lay, q, k, v, _, topk = _torch_problem(2, heads=2, batch=1)
    idx, num = vsa_topk(q, k, lay, topk)
    mask = torch.zeros(*idx.shape[:3], lay.num_blocks, dtype=torch.bool, device="cuda")
    mask.scatter_(3, idx.long(), True)
    a, _ = block_sparse_attention(q, k, v, lay, idx, num)
    m, _ = block_sparse_attention_mask(q, k, v, lay, mask)
    assert torch.equal(a, m)


@pytest.mark.parametrize("deterministic", [False, True])
def test_cuda_graph_replay_with_new_selections_equals_eager(deterministic):
    """Forward + backward with a selection made on the GPU, captured once with ``torch.cuda.graph``; replayed
    with new q, k, v (so new selections) copied into the same buffers, it gives the eager results: the same
    bits with ``deterministic`` (dQ summed in a fixed order), else the same output and gradients within the
    atomics' rounding."""
    from sparseattn.torch import block_sparse_attention, capture_cuda_graph, vsa_topk

    lay, q0, k0, v0, do0, topk = _torch_problem(3, heads=2, batch=2)
    static = [x.clone().requires_grad_(i < 3) for i, x in enumerate((q0, k0, v0, do0))]

    def step():
        q, k, v, do = static
        idx, num = vsa_topk(q.detach(), k.detach(), lay, topk)
        o, _ = block_sparse_attention(q, k, v, lay, idx, num, deterministic=deterministic)
        return (o, *torch.autograd.grad(o, (q, k, v), do))

    graph, outs = capture_cuda_graph(step)
    for seed in (11, 12):
        _, q, k, v, do, _ = _torch_problem(seed, heads=2, batch=2)
        for buf, x in zip(static, (q, k, v, do)):
            buf.data.copy_(x)
        graph.replay()
        replayed = [x.clone() for x in outs]
        eager = step()
        assert torch.equal(replayed[0], eager[0]), "forward: replay differs from eager"
        for name, r, e in zip(("dq", "dk", "dv"), replayed[1:], eager[1:]):
            if deterministic or name != "dq":
                assert torch.equal(r, e), f"{name}: replay differs from eager"
            else:
                assert ((r.float() - e.float()).norm() / e.float().norm()).item() < 1e-2, name


@pytest.mark.parametrize("chunk", range(3), ids=lambda c: f"cases{c * 21}-{c * 21 + 20}")
def test_overlapped_backward_plans_equal_the_numpy_twin(chunk):
    """With the backward planned on a side stream beside the forward, the arrays are still the twin's."""
    rng = np.random.default_rng(7000 + chunk)
    for index in range(chunk * 21, (chunk + 1) * 21):
        case = random_case(rng, index)
        planner = DevicePlanner(case.q, case.k, kind=case.kind, route=case.route, overlap_backward=True)
        plans = planner.plan(**_device_selection(case))
        twin = emu.emulate_plans(planner, **case.selection())
        assert cupy.asnumpy(plans.arena.view("status")).tolist() == [0, 0], case.name
        _assert_same(
            plans,
            "forward",
            twin["forward"],
            ["work_info", "work_order", "first_live", "stream_entries"],
            case.name,
        )
        for part in ("backward", "dq"):
            if twin[part] is not None:
                names = ["work_head", "own_pages", "stream_indptr", "stream_pages", "order"]
                _assert_same(plans, part, twin[part], names, f"{case.name} {part}")


def test_overlapped_planning_replays_in_a_cuda_graph():
    """The overlapped planner captured in a CUDA graph and replayed on a new selection in the same buffers
    writes what an eager planner writes for that selection."""
    import torch

    from sparseattn.kernels import launch

    rng = np.random.default_rng(71)
    case = random_case(rng, 3)
    while case.q2k_idx is None:  # a top-k selection
        case = random_case(rng, 3)
    planner = DevicePlanner(case.q, case.k, kind=case.kind, route=case.route, overlap_backward=True)
    idx = torch.as_tensor(case.q2k_idx, device="cuda")
    num = torch.as_tensor(case.q2k_num, device="cuda")
    with launch.torch_context():
        planner.plan(idx, num)  # uploads the tables, builds the buffers' layout
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), launch.torch_context():
        plans = planner.plan(idx, num)
    new_idx = rng.integers(0, case.k.num_blocks, size=case.q2k_idx.shape).astype(np.int32)
    idx.copy_(torch.as_tensor(new_idx, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    twin = emu.emulate_plans(planner, q2k_idx=new_idx, q2k_num=case.q2k_num)
    _assert_same(
        plans,
        "forward",
        twin["forward"],
        ["work_info", "work_order", "first_live", "stream_entries"],
        "replay",
    )
    if twin["backward"] is not None:
        names = ["work_head", "own_pages", "stream_indptr", "stream_pages", "order"]
        _assert_same(plans, "backward", twin["backward"], names, "replay backward")
