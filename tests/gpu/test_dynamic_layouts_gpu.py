"""The KPage forward on work lists of per-row layouts made per call (SVG2's clusters: partitions, selection
and work list planned in torch on the GPU): against the float64 attention of each row's slot mask, NaN in
every padding slot of q, k, v (the kernel must not read them), block sizes 64 and 128, head dims 64 and
128."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from small_cases import rel_err
from test_dynamic_layouts import _cluster_problem, _reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("seed", range(4), ids=lambda s: f"case{s}")
@pytest.mark.parametrize("block", [64, 128], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("plan", ["blocks", "clusters"])
def test_dynamic_forward_matches_the_reference(seed, block, head_dim, plan):
    """Planned from the block mask, or by clusters (streams shared by a cluster's blocks)."""
    from sparseattn.kernels.forward import torch_dynamic_forward
    from sparseattn.planning.dynamic_layouts import check_status, cluster_forward_work_list, forward_work_list

    q_lay, k_lay, pairs, mask = _cluster_problem(
        seed, rows=6, tokens=700, q_groups=9, k_groups=13, block=block, device="cuda"
    )
    if plan == "clusters":
        groups = (q_lay.block_rows, k_lay.block_rows, q_lay.block_group, k_lay.block_group)
        work = cluster_forward_work_list(*groups, pairs, block)
    else:
        work = forward_work_list(q_lay.block_rows, k_lay.block_rows, mask, block)
    check_status(work)
    rng = np.random.default_rng(seed)
    rows, sq, sk = mask.shape[0], q_lay.max_slots, k_lay.max_slots
    q, k, v = (rng.standard_normal((rows, n, head_dim)).astype(np.float32) for n in (sq, sk, sk))
    for x, lay in ((q, q_lay), (k, k_lay), (v, k_lay)):
        x[~lay.valid.cpu().numpy()] = np.nan
    qt, kt, vt = (torch.from_numpy(x).cuda().bfloat16()[None] for x in (q, k, v))
    o, _ = torch_dynamic_forward(qt, kt, vt, work)
    torch.cuda.synchronize()
    qf, kf, vf = (np.nan_to_num(x[0].double().cpu().numpy()) for x in (qt, kt, vt))
    want = _reference(qf, kf, vf, q_lay, k_lay, mask.cpu().numpy(), block)
    got = o[0].double().cpu().numpy()
    valid = q_lay.valid.cpu().numpy()
    assert np.isfinite(got[valid]).all(), "unwritten or non-finite valid rows"
    assert rel_err(got[valid], want[valid]) < 1e-2
    assert not got[~valid].any(), "padding rows must stay zero"


@pytest.mark.parametrize("seed", range(3), ids=lambda s: f"case{s}")
@pytest.mark.parametrize("block", [64, 128], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("plan", ["blocks", "clusters"])
def test_per_row_layout_attention_gradients_match_the_reference(seed, block, plan):
    """Forward and backward planned on the device per call (``per_row_layout_attention``, or
    ``per_row_cluster_attention`` from the cluster mask): gradients of every row's masked attention against
    float64, NaN in the padding slots of q, k, v and dO."""
    from test_dynamic_layouts import _reference_grads

    from sparseattn.torch import per_row_cluster_attention, per_row_layout_attention

    q_lay, k_lay, pairs, mask = _cluster_problem(
        seed, rows=5, tokens=600, q_groups=8, k_groups=11, block=block, device="cuda"
    )
    rng = np.random.default_rng(seed)
    rows, sq, sk, d = mask.shape[0], q_lay.max_slots, k_lay.max_slots, 128
    q, k, v, do = (rng.standard_normal((rows, n, d)).astype(np.float32) for n in (sq, sk, sk, sq))
    for x, lay in ((q, q_lay), (k, k_lay), (v, k_lay), (do, q_lay)):
        x[~lay.valid.cpu().numpy()] = np.nan
    qt, kt, vt, dot = (torch.from_numpy(x).cuda().bfloat16() for x in (q, k, v, do))
    leaves = [x.clone().requires_grad_() for x in (qt, kt, vt)]
    if plan == "clusters":
        groups = (q_lay.block_group, k_lay.block_group, pairs)
        o, _ = per_row_cluster_attention(*leaves, q_lay.block_rows, k_lay.block_rows, *groups, block)
    else:
        o, _ = per_row_layout_attention(*leaves, q_lay.block_rows, k_lay.block_rows, mask, block)
    o.backward(dot)
    torch.cuda.synchronize()
    f64 = lambda x: np.nan_to_num(x.double().cpu().numpy())
    _, want = _reference_grads(f64(qt), f64(kt), f64(vt), f64(dot), q_lay, k_lay, mask.cpu(), block)
    valid = (q_lay.valid.cpu().numpy(), k_lay.valid.cpu().numpy(), k_lay.valid.cpu().numpy())
    for name, x, w, ok in zip(("dq", "dk", "dv"), leaves, want, valid):
        g = x.grad.double().cpu().numpy()
        assert np.isfinite(g).all(), f"{name}: non-finite"
        assert rel_err(g[ok], w[ok]) < 1e-2, name
        assert not g[~ok].any(), f"{name}: padding slots must be zero"


def _random_partitions(case: int, g):
    """``(rows, block, q layout, k layout)`` of case ``case``: ragged token counts, k-means-like labels of
    up to 13 Q and 21 K groups padded to 64- or 128-slot blocks."""
    from sparseattn.svg2_device import partition_slots

    rows, tokens, block = 1 + case % 3, 97 + 37 * case, (64, 128)[case % 2]
    labels = lambda groups: torch.randint(0, groups, (rows, tokens), device="cuda", generator=g)
    return (
        rows,
        block,
        partition_slots(labels(3 + case % 11), 13, block),
        partition_slots(labels(5 + case % 17), 21, block),
    )


@pytest.mark.parametrize("block_j", [256, 32])
def test_triton_page_streams_equal_the_torch_planner_on_100_partitions(block_j, monkeypatch):
    """The compiled Triton stream writers (32-block steps give an item several) against the torch planner
    (both on the GPU) on 100 random per-row partitions (k-means-like labels, padded to blocks) and
    selections, ragged and capacity-cut."""
    from sparseattn.planning import dynamic_layouts as dl
    from sparseattn.planning import page_streams

    monkeypatch.setattr(page_streams, "BLOCK_J", block_j)

    g = torch.Generator(device="cuda").manual_seed(0)
    for case in range(100):
        rows, block, ql, kl = _random_partitions(case, g)
        mask = torch.rand(rows, ql.max_blocks, kl.max_blocks, device="cuda", generator=g) < 0.05 + case / 120
        capacity = 50 if case % 10 == 9 else None
        args = (ql.block_rows, kl.block_rows, mask, block)
        assert page_streams.available(mask)
        fwd, bwd = dl.forward_work_list(*args, capacity=capacity), dl.backward_plan(*args, capacity=capacity)
        with monkeypatch.context() as m:
            m.setattr(page_streams, "available", lambda x: False)
            fwd_ref, bwd_ref = (
                dl.forward_work_list(*args, capacity=capacity),
                dl.backward_plan(*args, capacity=capacity),
            )
        for name in ("work_info", "work_order", "own_entries", "status"):
            assert torch.equal(getattr(fwd, name), getattr(fwd_ref, name)), (case, name)
        used = min(int(fwd.status[0]), fwd.capacity)
        assert torch.equal(fwd.stream_entries[:used], fwd_ref.stream_entries[:used]), case
        for name in ("stream_indptr", "own_pages", "status"):
            assert torch.equal(getattr(bwd, name), getattr(bwd_ref, name)), (case, name)
        used = min(int(bwd.status[0]), bwd.capacity)
        assert torch.equal(bwd.stream_pages[:used], bwd_ref.stream_pages[:used]), case


@pytest.mark.parametrize("block_j", [256, 32])
def test_cluster_work_lists_stream_what_block_work_lists_do_on_100_partitions(block_j, monkeypatch):
    """Planned by clusters (the compiled Triton writers, one stream per Q cluster) against the block mask's
    work list on 100 random per-row partitions and cluster selections: the same items, and every item's
    stream the same entries in the same order, in fewer stored entries; the backward's plan by groups
    equal to the block form's entry for entry."""
    from sparseattn.planning import dynamic_layouts as dl
    from sparseattn.planning import page_streams
    from sparseattn.svg2_device import cluster_block_mask

    monkeypatch.setattr(page_streams, "BLOCK_J", block_j)
    g = torch.Generator(device="cuda").manual_seed(1)
    fewer = 0
    for case in range(100):
        rows, block, ql, kl = _random_partitions(case, g)
        pairs = torch.rand(rows, 13, 21, device="cuda", generator=g) < 0.05 + case / 120
        got = dl.cluster_forward_work_list(
            ql.block_rows, kl.block_rows, ql.block_group, kl.block_group, pairs, block
        )
        blocks = cluster_block_mask(pairs, ql.block_group, kl.block_group)
        want = dl.forward_work_list(ql.block_rows, kl.block_rows, blocks, block)
        assert torch.equal(got.work_info[:, [0, 2, 3]], want.work_info[:, [0, 2, 3]]), case
        for name in ("work_order", "own_entries"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (case, name)
        assert int(got.status[1]) == 0 and int(got.status[0]) <= int(want.status[0]), case
        fewer += int(got.status[0]) < int(want.status[0])
        assert torch.equal(got.item_streams(), want.item_streams()), case
        bwd = dl.cluster_backward_plan(
            ql.block_rows, kl.block_rows, ql.block_group, kl.block_group, pairs, block
        )
        bwd_ref = dl.backward_plan(ql.block_rows, kl.block_rows, blocks, block)
        for name in ("stream_indptr", "own_pages", "status"):
            assert torch.equal(getattr(bwd, name), getattr(bwd_ref, name)), (case, name)
        used = int(bwd.status[0])
        assert torch.equal(bwd.stream_pages[:used], bwd_ref.stream_pages[:used]), case
    assert fewer > 50, "clusters of several blocks share their streams"
