"""Forward work lists of per-row layouts made per call (SVG2's clusters), built in torch: run by the numpy
emulator of the kernel (:func:`sparseattn.emulator.emulate_work_list`), they give the float64 attention of
each row's slot mask; items, streams and counts as the module says."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from sparseattn.emulator import emulate_work_list
from sparseattn.planning.dynamic_layouts import (
    backward_plan,
    check_status,
    cluster_backward_plan,
    cluster_forward_work_list,
    forward_work_list,
)
from sparseattn.svg2_device import cluster_block_mask, partition_slots


def _problem(seed, rows=3, tokens=150, q_groups=5, k_groups=7, block=32, density=0.4, device="cpu"):
    """Random per-row partitions (clusters padded to blocks) and a random cluster-pair selection, laid out
    by :func:`partition_slots` on ``device``: ``(q layout, k layout, block mask)``."""
    q_lay, k_lay, _, mask = _cluster_problem(seed, rows, tokens, q_groups, k_groups, block, density, device)
    return q_lay, k_lay, mask


def _cluster_problem(seed, rows=3, tokens=150, q_groups=5, k_groups=7, block=32, density=0.4, device="cpu"):
    """:func:`_problem` with the cluster pairs: ``(q layout, k layout, cluster mask, block mask)``."""
    g = torch.Generator().manual_seed(seed)
    ql = torch.randint(0, q_groups, (rows, tokens), generator=g)
    kl = torch.randint(0, k_groups, (rows, tokens), generator=g)
    kl[:, : tokens // 3] = 0  # one large cluster: blocks full of rows beside partial ones
    pairs = torch.rand(rows, q_groups, k_groups, generator=g) < density
    pairs[0, 0] = False  # a Q cluster selecting nothing
    ql, kl, pairs = ql.to(device), kl.to(device), pairs.to(device)
    q_lay, k_lay = partition_slots(ql, q_groups, block), partition_slots(kl, k_groups, block)
    mask = cluster_block_mask(pairs, q_lay.block_group, k_lay.block_group)
    return q_lay, k_lay, pairs, mask


def _reference(q, k, v, q_lay, k_lay, mask, block):
    """float64 attention of each row over its valid slots and selected block pairs; o NaN on padding."""
    rows, sq, d = q.shape
    qb = np.arange(sq) // block
    kb = np.arange(k.shape[1]) // block
    o = np.full((rows, sq, d), np.nan)
    for r in range(rows):
        allowed = mask[r][qb][:, kb] & k_lay.valid[r].cpu().numpy()[None, :]
        s = q[r] @ k[r].T / np.sqrt(d)
        s = np.where(allowed, s, -np.inf)
        top = s.max(1, keepdims=True)
        p = np.exp(s - np.where(np.isfinite(top), top, 0))
        den = p.sum(1, keepdims=True)
        out = np.where(den > 0, (p @ v[r]) / np.where(den > 0, den, 1), 0.0)
        valid = q_lay.valid[r].cpu().numpy()
        o[r, valid] = out[valid]
    return o


@pytest.mark.parametrize("seed", range(6), ids=lambda s: f"case{s}")
@pytest.mark.parametrize("block", [32, 64, 128], ids=lambda b: f"B{b}")
def test_emulated_work_list_equals_the_reference(seed, block):
    q_lay, k_lay, mask = _problem(seed, block=block)
    work = forward_work_list(q_lay.block_rows, k_lay.block_rows, mask, block)
    check_status(work)
    wl = work.to_work_list()
    rng = np.random.default_rng(seed)
    rows, sq, sk, d = mask.shape[0], q_lay.max_slots, k_lay.max_slots, 16
    q, k, v = (rng.standard_normal((rows, n, d)) for n in (sq, sk, sk))
    o, _ = emulate_work_list(wl, q[None], k[None], v[None])
    want = _reference(q, k, v, q_lay, k_lay, mask.numpy(), block)
    valid = q_lay.valid.numpy()
    np.testing.assert_allclose(o[0][valid], want[valid], atol=1e-12)
    assert np.isnan(o[0][~valid]).all(), "padding Q slots must belong to no item"


def test_items_streams_and_order():
    """One item per (row, Q block); a stream holds each selected K block's live pages, full pages before
    the partial ones; M 64 for blocks of at most 4 live pages; items head by head, largest first."""
    block = 128
    q_lay, k_lay, mask = _problem(3, block=block)
    work = forward_work_list(q_lay.block_rows, k_lay.block_rows, mask, block)
    info = work.work_info.numpy().astype(np.int64)
    rows, nq = q_lay.block_rows.shape
    assert info.shape == (rows * nq, 4)
    k_rows = k_lay.block_rows.numpy()
    for w in range(info.shape[0]):
        r, i = divmod(w, nq)
        selected = np.flatnonzero(mask[r, i].numpy() & (k_rows[r] > 0))
        want_len = int(np.sum(-(-k_rows[r, selected] // 16))) if q_lay.block_rows[r, i] > 0 else 0
        assert info[w, 2] == want_len
        q_pages = -(-int(q_lay.block_rows[r, i]) // 16)
        assert info[w, 3] == (64 if q_pages <= 4 else 128)
        entries = work.stream_entries[info[w, 1] : info[w, 1] + info[w, 2]].numpy()
        partial = entries[:, 1] != 0xFFFF
        if partial.any():
            assert partial[np.argmax(partial) :].all(), "partial pages must come last"
    order = work.work_order.numpy()
    heads = info[order, 0]
    assert np.all(np.diff(heads) >= 0)
    cost = info[:, 3] * -(-info[:, 2] // 8)
    for r in range(rows):
        c = cost[order[heads == r]]
        assert np.all(np.diff(c) <= 0)
    # exactly: head by head, largest first, ties in item order
    np.testing.assert_array_equal(order, np.lexsort((np.arange(len(cost)), -cost, info[:, 0])))


def test_cluster_work_list_streams_what_the_block_work_list_does():
    """Planned from the cluster mask and the blocks' groups (off Triton: the expanded block mask), the items
    and every item's stream equal the block mask's, and the emulator gives the reference."""
    block = 64
    q_lay, k_lay, pairs, mask = _cluster_problem(2, block=block)
    groups = (q_lay.block_rows, k_lay.block_rows, q_lay.block_group, k_lay.block_group)
    got = cluster_forward_work_list(*groups, pairs, block)
    want = forward_work_list(q_lay.block_rows, k_lay.block_rows, mask, block)
    assert torch.equal(got.work_info[:, [0, 2, 3]], want.work_info[:, [0, 2, 3]])
    assert torch.equal(got.work_order, want.work_order) and torch.equal(got.own_entries, want.own_entries)
    assert torch.equal(got.item_streams(), want.item_streams())
    bwd = cluster_backward_plan(*groups, pairs, block)
    bwd_ref = backward_plan(q_lay.block_rows, k_lay.block_rows, mask, block)
    for name in ("stream_indptr", "stream_pages", "own_pages", "own_page_mask", "stream_page_mask", "status"):
        assert torch.equal(getattr(bwd, name), getattr(bwd_ref, name)), name
    with pytest.raises(ValueError, match="q_block_group"):
        cluster_forward_work_list(
            q_lay.block_rows, k_lay.block_rows, q_lay.block_group[:, 1:], k_lay.block_group, pairs, block
        )


def test_item_streams_follow_each_items_start_and_length():
    q_lay, k_lay, mask = _problem(4, block=32)
    work = forward_work_list(q_lay.block_rows, k_lay.block_rows, mask, 32)
    got = work.item_streams()
    info = work.work_info.long()
    want = torch.cat([work.stream_entries[s : s + n] for s, n in info[:, 1:3].tolist()])
    assert got.shape[0] == int(info[:, 2].sum()) > 0
    assert torch.equal(got, want)


def test_capacity_cut_is_reported():
    q_lay, k_lay, mask = _problem(1, block=64, density=1.0)
    work = forward_work_list(q_lay.block_rows, k_lay.block_rows, mask, 64, capacity=10)
    assert int(work.status[1]) > 0
    with pytest.raises(ValueError, match="did not fit"):
        check_status(work)


def _reference_grads(q, k, v, do, q_lay, k_lay, mask, block):
    """float64 gradients of each row's masked attention (torch autograd), zero on padding slots."""
    _, sq, d = q.shape
    qb = torch.arange(sq) // block
    kb = torch.arange(k.shape[1]) // block
    leaves = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v)]
    qt, kt, vt = leaves
    allowed = mask[:, qb][:, :, kb] & k_lay.valid.cpu()[:, None, :] & q_lay.valid.cpu()[:, :, None]
    s = (qt @ kt.transpose(1, 2) / np.sqrt(d)).masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num()
    o = p @ vt
    o.backward(torch.tensor(do) * q_lay.valid.cpu()[:, :, None])
    return o.detach().numpy(), [x.grad.numpy() for x in leaves]


@pytest.mark.parametrize("seed", range(5), ids=lambda s: f"case{s}")
@pytest.mark.parametrize("block", [64, 128], ids=lambda b: f"B{b}")
def test_emulated_backward_plan_equals_the_reference(seed, block):
    """The K/V-owned plan run by the backward kernel's numpy emulator over the rows viewed as one head
    gives the float64 gradients of every row's masked attention."""
    from sparseattn.emulator import emulate_backward
    from sparseattn.planning.dynamic_layouts import backward_plan

    q_lay, k_lay, mask = _problem(seed, block=block, tokens=260)
    plan = backward_plan(q_lay.block_rows, k_lay.block_rows, mask, block)
    assert int(plan.status[1]) == 0
    rng = np.random.default_rng(seed)
    rows, sq, sk, d = mask.shape[0], q_lay.max_slots, k_lay.max_slots, 16
    q, k, v, do = (rng.standard_normal((rows, n, d)) for n in (sq, sk, sk, sq))
    o, grads = _reference_grads(q, k, v, do, q_lay, k_lay, mask, block)
    flat = lambda x: x.reshape(1, 1, -1, d)
    scores = np.einsum("rqd,rkd->rqk", q, k) / np.sqrt(d)
    qb, kb = np.arange(sq) // block, np.arange(sk) // block
    allowed = mask.numpy()[:, qb][:, :, kb] & k_lay.valid.numpy()[:, None, :]
    top = np.where(allowed, scores, -np.inf).max(-1)
    with np.errstate(divide="ignore"):  # rows without keys: lse -inf
        lse = top + np.log(
            np.where(allowed, np.exp(scores - np.where(np.isfinite(top), top, 0)[..., None]), 0).sum(-1)
        )
    got = emulate_backward(
        plan.tile_plan(), flat(q), flat(k), flat(v), flat(o), lse.reshape(1, 1, -1), flat(do)
    )
    valid = (q_lay.valid.numpy(), k_lay.valid.numpy(), k_lay.valid.numpy())
    for name, g, want, ok in zip(("dq", "dk", "dv"), got, grads, valid):
        g = g.reshape(want.shape)
        np.testing.assert_allclose(g[ok], want[ok], atol=1e-10, err_msg=name)
        assert not g[~ok].any(), f"{name}: padding slots must be zero"


@pytest.mark.parametrize("plan", ["blocks", "clusters"])
def test_per_row_layout_attention_on_the_cpu_gives_the_reference_gradients(plan):
    """``per_row_layout_attention`` (and ``per_row_cluster_attention``, from the cluster mask) end to end on
    CPU tensors (its plans run by the kernels' emulators): output and gradients of every row's masked
    attention, padding slots zero — the autograd glue of the GPU path (flattened rows, masked dK/dV) on the
    same plans."""
    from sparseattn.torch import per_row_cluster_attention, per_row_layout_attention

    block = 64
    q_lay, k_lay, pairs, mask = _cluster_problem(4, block=block, tokens=200)
    rng = np.random.default_rng(4)
    rows, sq, sk, d = mask.shape[0], q_lay.max_slots, k_lay.max_slots, 16
    q, k, v, do = (rng.standard_normal((rows, n, d)) for n in (sq, sk, sk, sq))
    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    if plan == "clusters":
        groups = (q_lay.block_group, k_lay.block_group, pairs)
        o, _ = per_row_cluster_attention(*leaves, q_lay.block_rows, k_lay.block_rows, *groups, block)
    else:
        o, _ = per_row_layout_attention(*leaves, q_lay.block_rows, k_lay.block_rows, mask, block)
    o.backward(torch.tensor(do))
    o_ref, grads = _reference_grads(q, k, v, do, q_lay, k_lay, mask, block)
    valid = (q_lay.valid.numpy(), k_lay.valid.numpy(), k_lay.valid.numpy())
    np.testing.assert_allclose(o.detach().numpy()[valid[0]], o_ref[valid[0]], atol=1e-10)
    for name, x, want, ok in zip(("dq", "dk", "dv"), leaves, grads, valid):
        g = x.grad.numpy()
        np.testing.assert_allclose(g[ok], want[ok], atol=1e-10, err_msg=name)
        assert not g[~ok].any(), f"{name}: padding slots must be zero"


def test_plans_never_read_slots_past_each_rows_blocks():
    """The GPU path leaves the slots past a row's ``num_slots`` unwritten (``slot_copy``). The reason it may:
    the blocks there hold no live page and no selected pair, and the plans stream live pages of selected
    pairs only. Then the end-to-end check (emulators on the same plans): NaN there changes nothing on the
    valid slots."""
    from sparseattn.torch import per_row_layout_attention

    block = 64
    q_lay, k_lay, mask = _problem(6, block=block, tokens=180)
    q_unused = ~q_lay.used_slots().view(q_lay.valid.shape)
    k_unused = ~k_lay.used_slots().view(k_lay.valid.shape)
    assert q_unused.any() and k_unused.any()  # the static bound leaves room past the blocks
    for lay, side in ((q_lay, 1), (k_lay, 2)):
        past = torch.arange(lay.block_pages.shape[1]) >= (lay.num_slots // block).unsqueeze(
            1
        )  # [rows, blocks]
        assert past.any() and not lay.block_pages[past].any() and not lay.block_rows[past].any()
        assert not (mask.any(3 - side) & past).any()  # no selected pair touches them
    rng = np.random.default_rng(6)
    rows, d = mask.shape[0], 16
    q, k, v, do = (
        torch.tensor(rng.standard_normal((rows, n, d)))
        for n in (q_lay.max_slots, k_lay.max_slots, k_lay.max_slots, q_lay.max_slots)
    )
    q, k, v = (
        x.masked_fill(~lay.valid.unsqueeze(-1), 0.0) for x, lay in ((q, q_lay), (k, k_lay), (v, k_lay))
    )
    runs = []
    for poison in (False, True):
        leaves = [x.clone() for x in (q, k, v)]
        if poison:
            for x, unused in zip(leaves, (q_unused, k_unused, k_unused)):
                x[unused] = float("nan")
        leaves = [x.requires_grad_() for x in leaves]
        o, _ = per_row_layout_attention(*leaves, q_lay.block_rows, k_lay.block_rows, mask, block)
        o.backward(do)
        runs.append((o.detach(), [x.grad for x in leaves]))
    (o0, g0), (o1, g1) = runs
    qv, kv = q_lay.valid, k_lay.valid
    assert torch.isfinite(o1[qv]).all()
    torch.testing.assert_close(o1[qv], o0[qv], rtol=0, atol=0)
    for a, b, ok in zip(g0, g1, (qv, kv, kv)):
        torch.testing.assert_close(b[ok], a[ok], rtol=0, atol=0)


def test_used_slots_are_each_rows_first_num_slots():
    q_lay, _, _ = _problem(7, block=32)
    used = q_lay.used_slots().view(q_lay.valid.shape)
    assert torch.equal(used.sum(1), q_lay.num_slots)
    assert not (q_lay.valid & ~used).any()  # every token's slot is used
    assert (used[:, :-1] | ~used[:, 1:]).all()  # a prefix


def test_a_stream_writer_not_known_is_refused_before_any_launch(monkeypatch):
    """``page_streams.WRITER`` is read at each call and checked first; its default, with
    ``SPARSEATTN_STREAM_WRITER`` unset, is ``"cuda_one_walk"``."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from sparseattn.planning import page_streams

    monkeypatch.setattr(page_streams, "WRITER", "cuda_warps")
    sel, ints = torch.ones(1, 2, 3, dtype=torch.bool), torch.ones(1, 3, dtype=torch.int32)
    out = torch.full((7, 2), -7, dtype=torch.int32)
    start = torch.zeros(2, dtype=torch.int64)
    message = (
        r"page_streams\.WRITER \(SPARSEATTN_STREAM_WRITER\) must be one of \('triton', 'cuda', 'cuda_one_walk'\), "
        r"got 'cuda_warps'"
    )
    with pytest.raises(ValueError, match=message):
        page_streams.write_streams(sel, ints, ints, ints, start, out, 6, 4, 0, True)
    with pytest.raises(ValueError, match=message):
        page_streams.stream_lengths(sel, ints, ints)
    assert (out == -7).all()
    env = {k: v for k, v in os.environ.items() if k != "SPARSEATTN_STREAM_WRITER"}
    env["PYTHONPATH"] = str(Path(page_streams.__file__).parents[2])  # this checkout's package
    code = "from sparseattn.planning import page_streams; print(page_streams.WRITER)"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "cuda_one_walk"


def test_the_cuda_stream_writers_refuse_tensors_off_an_sm90_gpu():
    """The launchers check their arguments before any launch: CPU tensors are refused, naming ``sel``."""
    from sparseattn.kernels import page_streams as cuda_streams

    sel, ints = torch.ones(1, 2, 3, dtype=torch.bool), torch.ones(1, 3, dtype=torch.int32)
    assert not cuda_streams.available(sel)
    with pytest.raises(ValueError, match="sel must be a CUDA tensor"):
        cuda_streams.stream_lengths(sel, ints, ints)
    with pytest.raises(ValueError, match="sel must be a bool tensor"):
        cuda_streams.stream_lengths(sel.int(), ints, ints)


def test_an_items_form_not_known_is_refused_before_any_work(monkeypatch):
    """``dynamic_layouts.ITEMS`` is read at each call and checked first, by clusters and by blocks; its
    default, with ``SPARSEATTN_PLAN_ITEMS`` unset, is ``"triton"``."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from sparseattn.planning import dynamic_layouts as dl

    rows = torch.full((1, 2), 64)
    group = torch.zeros(1, 2, dtype=torch.int64)
    message = (
        r"dynamic_layouts\.ITEMS \(SPARSEATTN_PLAN_ITEMS\) must be one of \('torch', 'triton'\), got 'cuda'"
    )
    monkeypatch.setattr(dl, "ITEMS", "cuda")
    with pytest.raises(ValueError, match=message):
        dl.forward_work_list(rows, rows, torch.ones(1, 2, 2, dtype=torch.bool), 64)
    with pytest.raises(ValueError, match=message):
        dl.cluster_forward_work_list(rows, rows, group, group, torch.ones(1, 1, 1, dtype=torch.bool), 64)
    monkeypatch.setattr(dl, "ITEMS", "triton")  # Triton does not run on these CPU tensors: the torch form
    want = dl.forward_work_list(rows, rows, torch.ones(1, 2, 2, dtype=torch.bool), 64)
    assert torch.equal(want.work_info[:, 2], torch.tensor([8, 8], dtype=torch.int32))
    env = {k: v for k, v in os.environ.items() if k != "SPARSEATTN_PLAN_ITEMS"}
    env["PYTHONPATH"] = str(Path(dl.__file__).parents[2])  # this checkout's package
    code = "from sparseattn.planning import dynamic_layouts; print(dynamic_layouts.ITEMS)"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "triton"
