"""Checks of the Triton kernels under Triton's interpreter (CPU tensors), against their torch references.

Triton's interpreter must be chosen before Triton is imported, so ``test_triton_interpreted.py`` runs
this file in a fresh process with ``TRITON_INTERPRET=1``: ``python tests/triton_interpreted_checks.py
page_streams`` (or ``forward_items``, ``nearest_centroid``, ``slot_copy``, ``cluster_blocks``, ``cluster_select``,
``cluster_select_words``, ``vsa_select``, ``token_block_sums``, ``centroid_update``, ``layout_blocks``). Exit status 0 when every case agrees.
"""

from __future__ import annotations

import os
import sys

import torch


def _case(seed, r=3, nq=9, nk=13, block=128, density=0.4):
    g = torch.Generator().manual_seed(seed)
    q_rows = torch.randint(0, block + 1, (r, nq), generator=g)
    k_rows = torch.randint(0, block + 1, (r, nk), generator=g)
    q_rows[:, -2:] = 0  # padding blocks, as a per-row layout has
    mask = torch.rand(r, nq, nk, generator=g) < density
    return q_rows, k_rows, mask


def check_page_streams() -> int:
    """The page streams equal the torch streams, with one and with several steps per item, and with
    ``WRITER = "cuda"`` on CPU tensors (the Triton writers then run)."""
    from sparseattn.planning import page_streams

    cases = _check_page_streams_form(range(3)) + _check_cluster_streams(range(3))
    page_streams.BLOCK_J = 8  # several steps per item
    cases += _check_page_streams_form(range(1)) + _check_cluster_streams(range(1))
    page_streams.BLOCK_J = 256
    page_streams.WRITER = "cuda"  # CPU tensors: the Triton writers run
    try:
        cases += _check_page_streams_form(range(1))
        page_streams.WRITER = "cuda_one_walk"  # likewise, through streams() too
        cases += _check_page_streams_form(range(1)) + _check_cluster_streams(range(1))
    finally:
        page_streams.WRITER = "triton"
    return cases


def _check_cluster_streams(seeds) -> int:
    """The streams written once per Q group (``cluster_forward_work_list``) against the torch streams of
    the expanded block mask: the same items, and every item's stream the same entries in the same order;
    the backward's plan by groups (``cluster_backward_plan``) equal to the block form's."""
    from sparseattn.planning import dynamic_layouts as dl
    from sparseattn.planning import page_streams
    from sparseattn.svg2_device import cluster_block_mask, partition_slots

    triton_available = page_streams.available
    cases = 0
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        for block in (48, 64, 128):
            rows, tokens, qg, kg = 2, 300 + 41 * seed, 5, 7
            q_labels = torch.randint(0, qg - 1, (rows, tokens), generator=g)  # Q group qg - 1 empty
            q_labels[:, : tokens // 2] = 2  # Q group 2 takes several blocks: they share its stream
            ql = partition_slots(q_labels, qg, block)
            labels = torch.randint(0, kg - 1, (rows, tokens), generator=g)  # K group kg - 1 empty
            labels[:, : tokens // 3] = 0  # a large cluster: full blocks beside partial ones
            kl = partition_slots(labels, kg, block)
            pairs = torch.rand(rows, qg, kg, generator=g) < 0.5
            pairs[:, 2, 0] = True
            pairs[0, 1] = False  # a Q group selecting nothing
            pairs[:, qg - 1] = True  # the empty Q group selects everything: it must store no stream
            args = (ql.block_rows, kl.block_rows, ql.block_group, kl.block_group, pairs, block)
            got = dl.cluster_forward_work_list(*args)
            page_streams.available = lambda x: False
            try:
                blocks = cluster_block_mask(pairs, ql.block_group, kl.block_group)
                want = dl.forward_work_list(ql.block_rows, kl.block_rows, blocks, block)
            finally:
                page_streams.available = triton_available
            info, info_ref = got.work_info, want.work_info
            assert torch.equal(info[:, [0, 2, 3]], info_ref[:, [0, 2, 3]]), "items"
            for name in ("work_order", "own_entries"):
                assert torch.equal(getattr(got, name), getattr(want, name)), name
            assert int(got.status[1]) == 0 and int(got.status[0]) < int(want.status[0]), "shared streams"
            assert torch.equal(got.item_streams(), want.item_streams()), "item streams"
            shared = {}  # each stored stream once, by its start: the items sharing it read the same entries
            for start, length in zip(info[:, 1].tolist(), info[:, 2].tolist()):
                if length:
                    shared.setdefault(start, length)
            stored = sum(shared.values())
            assert int(got.status[0]) == stored, "only the streams some item reads are stored"
            if block in (64, 128):  # the backward's plan by clusters: entry for entry the block form's
                bwd = dl.cluster_backward_plan(*args)
                page_streams.available = lambda x: False
                try:
                    bwd_ref = dl.backward_plan(ql.block_rows, kl.block_rows, blocks, block)
                finally:
                    page_streams.available = triton_available
                for name in ("stream_indptr", "own_pages", "work_block", "status"):
                    assert torch.equal(getattr(bwd, name), getattr(bwd_ref, name)), name
                used = int(bwd.status[0])
                assert used > 0 and torch.equal(bwd.stream_pages[:used], bwd_ref.stream_pages[:used]), "bwd"
            cases += 1
    return cases


def _check_page_streams_form(seeds) -> int:
    from sparseattn.planning import dynamic_layouts as dl
    from sparseattn.planning import page_streams

    triton_available = page_streams.available
    cases = 0
    for seed in seeds:
        for block in (48, 64, 128):  # 3 pages a block: not a power of two
            for capacity in (None, 41):
                q_rows, k_rows, mask = _case(seed, nk=11 + seed * 5, block=block)
                assert triton_available(mask), "the interpreter is not on"
                backward = block in (64, 128)  # the backward's tiles (the forward takes any multiple of 16)
                fwd = dl.forward_work_list(q_rows, k_rows, mask, block, capacity=capacity)
                bwd = dl.backward_plan(q_rows, k_rows, mask, block, capacity=capacity) if backward else None
                page_streams.available = lambda x: False
                try:
                    fwd_ref = dl.forward_work_list(q_rows, k_rows, mask, block, capacity=capacity)
                    if backward:
                        bwd_ref = dl.backward_plan(q_rows, k_rows, mask, block, capacity=capacity)
                finally:
                    page_streams.available = triton_available
                for name in ("work_info", "work_order", "own_entries", "status"):
                    assert torch.equal(getattr(fwd, name), getattr(fwd_ref, name)), name
                used = min(int(fwd.status[0]), fwd.capacity)
                assert used > 0
                assert torch.equal(fwd.stream_entries[:used], fwd_ref.stream_entries[:used]), "fwd streams"
                cases += 1
                if not backward:
                    assert capacity is None or int(fwd.status[1]) > 0, "the cut is counted"
                    continue
                for name in ("stream_indptr", "own_pages", "work_block", "status"):
                    assert torch.equal(getattr(bwd, name), getattr(bwd_ref, name)), name
                used = min(int(bwd.status[0]), bwd.capacity)
                assert torch.equal(bwd.stream_pages[:used], bwd_ref.stream_pages[:used]), "bwd streams"
                if capacity is not None:
                    assert int(fwd.status[1]) > 0 and int(bwd.status[1]) > 0, "the cut is counted"
    return cases


def _lists_equal(got, want, what: str) -> None:
    """Two ``DynamicWorkList`` equal field by field (the stream entries over those written and kept)."""
    for name in ("work_info", "work_order", "own_entries", "status", "counter"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), f"{what}: {name}"
    assert (got.rows, got.chunk, got.capacity) == (want.rows, want.chunk, want.capacity), what
    used = min(int(want.status[0]), want.capacity)
    assert torch.equal(got.stream_entries[:used], want.stream_entries[:used]), f"{what}: stream entries"


def _with_items(form: str, plan, *args, **kwargs):
    from sparseattn.planning import dynamic_layouts as dl

    items = dl.ITEMS
    dl.ITEMS = form
    try:
        return plan(*args, **kwargs)
    finally:
        dl.ITEMS = items


def check_forward_items() -> int:
    """``dynamic_layouts.ITEMS = "triton"`` (the per-item arrays by :mod:`~sparseattn.planning.forward_items`)
    gives the same work lists as ``"torch"``, by clusters and by blocks: random per-row partitions with
    empty groups, blocks without rows, groups outside the range, Q blocks of 1 to 8 live pages (M 64 and
    128), and a capacity cut."""
    from sparseattn.planning import dynamic_layouts as dl
    from sparseattn.planning import page_streams
    from sparseattn.svg2_device import cluster_block_mask, partition_slots

    assert page_streams.available(torch.zeros(1)), "the interpreter is not on"
    cases, ms, cut = 0, set(), False
    for seed in range(4):
        g = torch.Generator().manual_seed(100 + seed)
        for block in (64, 128):
            rows, tokens, qg, kg = 3, 500 + 37 * seed, 6, 7
            q_labels = torch.randint(0, qg - 1, (rows, tokens), generator=g)  # Q group qg - 1 empty
            q_labels[:, : tokens // 3] = 2
            ql = partition_slots(q_labels, qg, block)
            labels = torch.randint(0, kg - 1, (rows, tokens), generator=g)  # K group kg - 1 empty
            labels[:, : tokens // 4] = 0
            kl = partition_slots(labels, kg, block)
            pairs = torch.rand(rows, qg, kg, generator=g) < 0.5
            pairs[:, 2, 0] = True
            pairs[0, 1] = False
            pairs[:, qg - 1] = True  # the empty Q group selects everything
            q_rows, q_group = ql.block_rows, ql.block_group
            if seed % 2:  # any rows (1 to 8 live pages, or none) and groups outside [0, qg) with rows
                q_rows = torch.randint(0, block + 1, q_rows.shape, generator=g)
                q_group = q_group.clone()
                q_group[:, -1] = qg + 1
                q_group[0, 0] = -1
            blocks = cluster_block_mask(pairs, q_group.clamp(-1, qg - 1), kl.block_group)
            for capacity in (None, 57):
                args = (q_rows, kl.block_rows, q_group, kl.block_group, pairs, block)
                got = _with_items("triton", dl.cluster_forward_work_list, *args, capacity=capacity)
                want = _with_items("torch", dl.cluster_forward_work_list, *args, capacity=capacity)
                _lists_equal(got, want, f"clusters seed {seed} block {block} capacity {capacity}")
                args = (q_rows, kl.block_rows, blocks, block)
                got = _with_items("triton", dl.forward_work_list, *args, capacity=capacity)
                want = _with_items("torch", dl.forward_work_list, *args, capacity=capacity)
                _lists_equal(got, want, f"blocks seed {seed} block {block} capacity {capacity}")
                ms.update(want.work_info[:, 3].tolist())
                cut |= int(want.status[1]) > 0
                cases += 2
    assert ms == {64, 128} and cut, (ms, cut)
    return cases


def check_nearest_centroid() -> int:
    """fp16 (the interpreter has no bf16): labels equal the float32 path's on the rounded centroids."""
    from sparseattn.nearest_centroid import lloyd_step_fused, nearest_centroid_fused
    from sparseattn.svg2_device import kmeans, lloyd, nearest_centroid

    cases = 0
    for n, t, k, d in ((1, 128, 64, 64), (2, 97, 70, 64), (3, 300, 130, 32)):
        g = torch.Generator().manual_seed(t)
        x = torch.randn(n, t, d, generator=g).half()
        c = torch.randn(n, k, d, generator=g)
        got = nearest_centroid_fused(x, c)
        want = nearest_centroid(x.float(), c.half().float())
        assert got.dtype == torch.int64 and torch.equal(got, want), (n, t, k, d)
        init = c[:, :16]
        labels, cent = kmeans(x, 16, 2, init, assign="fused")
        assert torch.equal(labels, nearest_centroid(x.float(), cent.half().float()))
        # one fused Lloyd step: the labels, and each cluster's float32 sum and size
        labels, sums, sizes = lloyd_step_fused(x, c)
        assert torch.equal(labels, want)
        ref_sums = torch.zeros(n, k, d).index_put_(
            (torch.arange(n)[:, None].expand(n, t), labels), x.float(), accumulate=True
        )
        torch.testing.assert_close(sums, ref_sums, rtol=1e-6, atol=1e-5)
        assert torch.equal(sizes, torch.stack([torch.bincount(r, minlength=k) for r in labels]).float())
        # the whole k-means, fused (atomics for the sums) against torch on the same rounded values
        got = lloyd(x, 16, 2, init, assign="fused", final_assign=False)
        ref = lloyd(x.float(), 16, 2, init, assign="torch", final_assign=False)
        same = torch.equal(got[0], ref[0])  # fp16-rounded centroids may move a near tie
        assert same or (got[0] != ref[0]).float().mean() < 0.01
        if same:
            torch.testing.assert_close(got[3], ref[3])
        cases += 1
    return cases


def check_slot_copy() -> int:
    """Token rows into slots in one pass: the used rows equal zeros + ``index_copy``'s, rows outside
    ``used`` untouched; the gradient is the rows' gather; with sums, each copied row added into its sums
    row."""
    from sparseattn import slot_copy
    from sparseattn.svg2_device import scatter_rows

    cases = 0
    for total, r, d, dtype in (
        (300, 70, 64, torch.float16),
        (1000, 333, 96, torch.float32),
        (64, 0, 32, torch.float16),
    ):
        g = torch.Generator().manual_seed(total)
        used = torch.rand(total, generator=g) < 0.6
        used_rows = used.nonzero().squeeze(1)
        rows = used_rows[torch.randperm(used_rows.numel(), generator=g)[:r]]
        x = torch.randn(r, d, generator=g).to(dtype).requires_grad_()
        assert slot_copy.available(x), "the interpreter is not on"
        got = scatter_rows(x, rows, total, used)
        want = x.detach().new_zeros(total, d).index_copy(0, rows, x.detach())
        assert torch.equal(got[used], want[used]), (total, r, d)
        src = slot_copy.slot_sources(rows, total, used)
        assert torch.equal(src[~used], torch.full_like(src[~used], slot_copy.UNWRITTEN))
        # the unwritten rows keep what was there: the kernel itself into a NaN-filled buffer
        out = torch.full((total, d), float("nan"), dtype=dtype)
        slot_copy._rows_to_slots_kernel[(slot_copy.triton.cdiv(total, slot_copy.BLOCK_ROWS),)](
            x.detach(),
            src,
            out,
            src,
            out,
            total,
            x.stride(0),
            out.stride(0),
            D=d,
            BD=slot_copy.triton.next_power_of_2(d),
            BR=slot_copy.BLOCK_ROWS,
            SUMS=False,
        )
        assert torch.equal(out[used], want[used]) and out[~used].isnan().all()
        # each copied row into its sums row: runs of one sums row (a program's rows in one block) and
        # scattered ones, rows without one (-1)
        groups = 5
        sum_index = (torch.arange(total) // slot_copy.BLOCK_ROWS % (groups + 1) - 1).to(torch.int32)
        scattered = (torch.rand(total, generator=g) < 0.1) & (torch.arange(total) >= total // 2)
        sum_index[scattered] = torch.randint(
            -1, groups, (int(scattered.sum()),), generator=g, dtype=torch.int32
        )
        sums = torch.zeros(groups, d)
        scatter_rows(x.detach(), rows, total, used, sums, sum_index)
        want_sums = torch.zeros(groups, d, dtype=torch.float64)
        target = sum_index.long()[rows]
        want_sums.index_add_(0, target[target >= 0], x.detach()[target >= 0].double())
        torch.testing.assert_close(sums.double(), want_sums, rtol=1e-5, atol=1e-4)
        if r:
            dy = torch.randn(total, d, generator=g).to(dtype)
            (got * dy).sum().backward()
            torch.testing.assert_close(x.grad, dy[rows])
        cases += 1
    for shape, n in (((2, 3, 100, 64), 37), ((1, 70, 128), 70), ((4, 5, 16), 0)):
        y = torch.full(shape, float("nan")).to(torch.bfloat16)
        rows = torch.randperm(shape[-2], generator=g)[:n]
        slot_copy.zero_rows(y, rows)
        zeroed = torch.zeros(shape[-2], dtype=torch.bool)
        zeroed[rows] = True
        assert (y[..., zeroed, :] == 0).all() and y[..., ~zeroed, :].isnan().all(), (shape, n)
        cases += 1
    return cases


def check_cluster_blocks() -> int:
    """SVG2's block mask by one Triton lookup per block pair equals the torch gathers, with -1 groups
    past each row's layout (and out-of-range groups selecting nothing); ragged tile edges."""
    from sparseattn import cluster_blocks, svg2_device

    cases = 0
    for n, cq, ck, a, b in ((2, 5, 7, 19, 300), (3, 1, 1, 16, 256), (1, 30, 40, 45, 513)):
        g = torch.Generator().manual_seed(a * b)
        cmask = torch.rand(n, cq, ck, generator=g) < 0.35
        qg = torch.randint(0, cq, (n, a), generator=g).sort(-1).values
        kg = torch.randint(0, ck, (n, b), generator=g).sort(-1).values
        qg[:, a - a // 4 :] = -1  # past the layout
        kg[0, b // 2 :] = -1
        assert cluster_blocks.available(cmask), "the interpreter is not on"
        got = cluster_blocks.block_mask(cmask, qg, kg)
        want = svg2_device._block_mask_by_gathers(cmask, qg, kg)
        assert got.dtype == torch.bool and torch.equal(got, want), (n, cq, ck, a, b)
        wide = qg.clone()
        wide[:, 0] = cq  # outside the cluster range: nothing selected, nothing read
        assert not cluster_blocks.block_mask(cmask, wide, kg)[:, 0].any()
        cases += 1
    return cases


def _select_cases():
    """SVG2 selection cases: ``(qc, kc, sizes, d, scale, top_p, min_fraction)`` — random scores, bit-equal
    ties, a row without live K clusters, underflowing scores, K cluster counts that are not powers of two."""
    g = torch.Generator().manual_seed(5)
    shapes = ((3, 6, 40, 8, 1.0), (2, 4, 1000, 16, 1.0), (3, 5, 24, 4, 0.0), (1, 3, 17, 2, 300.0))
    for n, cq, ck, d, scale in shapes:
        if scale:  # random centroids (the last shape: scores that underflow)
            qc = torch.randn(n, cq, d, generator=g, dtype=torch.float64) * scale**0.5
            kc = torch.randn(n, ck, d, generator=g, dtype=torch.float64) * scale**0.5
        else:  # small integers: equal scores are bit-equal
            qc = torch.randint(-1, 2, (n, cq, d), generator=g).double()
            kc = torch.randint(-1, 2, (n, ck, d), generator=g).double()
        sizes = torch.randint(0, 4 if not scale else 30, (n, ck), generator=g)
        sizes[:, ::5] = 0
        if n > 1:
            sizes[1] = 0  # no live K cluster: nothing selected
        for top_p, min_fraction in ((0.9, 0.1), (0.3, 0.0), (1.0, 0.0), (0.2, 1.0)):
            yield qc, kc, sizes, d, scale, top_p, min_fraction


def check_cluster_select() -> int:
    """SVG2's top-p selection by one Triton program per Q cluster (``svg2_select``'s float64 default, the
    bisection) equals the torch sort and the host's numpy rule on :func:`_select_cases`."""
    import numpy as np

    from sparseattn import builders, cluster_select, svg2_device

    cases = 0
    for qc, kc, sizes, d, scale, top_p, min_fraction in _select_cases():
        assert cluster_select.available(qc), "the interpreter is not on"
        got = svg2_device.svg2_select(qc, kc, sizes, d, top_p, min_fraction)
        dots, bias, least = svg2_device.selection_inputs(qc, kc, sizes, min_fraction)
        want = svg2_device._select_by_sort(dots, bias, d, top_p, least)
        where = (*qc.shape, kc.shape[1], scale, top_p, min_fraction)
        assert got.dtype == torch.bool and torch.equal(got, want), where
        for r in range(qc.shape[0]):
            host = np.zeros((qc.shape[1], kc.shape[1]), bool)
            with np.errstate(invalid="ignore"):
                i, j = builders.svg2_select(
                    qc[r].numpy(), kc[r].numpy(), sizes[r].numpy(), d, top_p, min_fraction
                )
            host[i, j] = True
            host &= sizes[r].numpy()[None, :] > 0  # the host counts empty clusters among underflowed ties
            assert np.array_equal(got[r].numpy(), host) or scale > 100, (r, *where)
        cases += 1
    return cases


def check_cluster_select_words() -> int:
    """The selection's other bisection, by whole patterns (``method="bisect"``), equals the torch sort on
    :func:`_select_cases` (:func:`check_cluster_select` holds the default, by high words first, to it), and
    the two bisections are equal bit for bit on rows whose probabilities share their high words (scores equal but for ~1e-12, or exactly: the second phase then settles the low words
    among many lanes, and ties at the cut are frequent; there the sort's cumulative sums round differently
    and are not the reference)."""
    from sparseattn import cluster_select, svg2_device

    cases = 0
    for qc, kc, sizes, d, scale, top_p, min_fraction in _select_cases():
        dots, bias, least = svg2_device.selection_inputs(qc, kc, sizes, min_fraction)
        want = svg2_device._select_by_sort(dots, bias, d, top_p, least)
        got = cluster_select.select_mask(dots, bias, d, top_p, least, method="bisect")
        assert torch.equal(got, want), (*qc.shape, kc.shape[1], scale, top_p, min_fraction)
        cases += 1
    g = torch.Generator().manual_seed(6)
    for ck, noise in ((40, 1e-12), (160, 1e-12), (160, 0.0)):
        dots = 1.0 + noise * torch.randn(2, 4, ck, generator=g, dtype=torch.float64)
        bias = torch.zeros(2, ck, dtype=torch.float64)
        bias[0, ::7] = float("-inf")
        least = torch.tensor([0, ck // 3])
        for top_p in (0.5, 0.9):
            by_patterns = cluster_select.select_mask(dots, bias, 16, top_p, least, method="bisect")
            by_words = cluster_select.select_mask(dots, bias, 16, top_p, least, method="bisect_words")
            assert torch.equal(by_words, by_patterns), (ck, noise, top_p)
            kept = by_words.sum(-1)
            assert (kept[1] >= ck // 3).all() and (kept > 0).all(), (ck, noise, top_p)
            cases += 1
    return cases


def vsa_topk_agrees(scores, live, kept, got) -> None:
    """``got`` (int32 ``[..., kept]``, :func:`sparseattn.vsa_select.row_topk`) picks, per row, distinct live
    columns in ascending order whose values are the ``kept`` largest live values (``torch.topk``'s)."""
    want = scores.masked_fill(~live, float("-inf")).topk(kept, dim=-1).values
    assert got.shape == (*scores.shape[:-1], kept) and got.dtype == torch.int32
    idx = got.long()
    if kept > 1:
        assert bool((idx[..., 1:] > idx[..., :-1]).all()), "indices not ascending (or repeated)"
    assert bool(live[idx].all()), "a column that may not be chosen was chosen"
    picked = scores.gather(-1, idx).sort(-1, descending=True).values
    assert torch.equal(picked, want), "the chosen values are not the k largest"


def check_vsa_select() -> int:
    """VSA's per-row top-k by bisection equals ``torch.topk``'s values: random, negative and bit-equal
    scores (ties at the boundary), signed zeros, columns that may not be chosen, ``kept`` from 1 to every
    live column, column counts that are not powers of two; ``vsa_topk`` on a ragged layout."""
    from sparseattn import vsa_select

    cases = 0
    g = torch.Generator().manual_seed(11)
    for rows, cols in ((5, 17), (4, 100), (3, 624), (2, 1440)):
        live = torch.rand(cols, generator=g) > 0.2
        live[0] = True
        n_live = int(live.sum())
        for kind in ("normal", "ties", "zeros"):
            if kind == "normal":
                scores = torch.randn(rows, cols, generator=g) * 10
            elif kind == "ties":
                scores = torch.randint(-3, 4, (rows, cols), generator=g).float()
            else:
                signs = torch.randint(0, 2, (rows, cols), generator=g).bool()
                scores = torch.where(signs, torch.tensor(-0.0), torch.tensor(0.0))
                scores[:, ::3] = -1.0
            for kept in sorted({1, min(7, n_live), n_live // 2 or 1, n_live}):
                assert vsa_select.available(scores), "the interpreter is not on"
                got = vsa_select.row_topk(scores, live, kept)
                vsa_topk_agrees(scores, live, kept, got)
                cases += 1
    # vsa_topk end to end on a ragged video layout: its choice is the top-k of its scores
    from sparseattn.layouts import video_layout
    from sparseattn.torch import _block_weights, _layout_handle, tokens_to_slots, vsa_topk

    lay = video_layout((5, 6, 7), (2, 4, 4), 32)
    q, k = (torch.randn(2, lay.num_tokens, 3, 64, generator=g).bfloat16() for _ in range(2))
    qs, ks = tokens_to_slots(lay, q, k)
    idx, num = vsa_topk(qs, ks, lay, 4)
    weight, alive = _block_weights(_layout_handle(lay), qs.device)
    qm, km = (x.reshape(2, 3, lay.num_blocks, 32, 64).sum(3, dtype=torch.float32) * weight for x in (qs, ks))
    vsa_topk_agrees(qm @ km.transpose(-1, -2), alive, 4, idx)
    assert torch.equal(num, torch.full_like(num, 4))
    return cases + 1


def check_token_block_sums() -> int:
    """Per-block sums gathered from token order equal the slot-order sums (ragged layouts, padding slots,
    head dims 64 and 128, batch 2); ``vsa_topk_tokens`` picks the top-k of the scores of those sums."""
    from sparseattn import vsa_select
    from sparseattn.layouts import video_layout
    from sparseattn.torch import _block_weights, _layout_handle, tokens_to_slots, vsa_topk_tokens
    from sparseattn.torch_ops import _slot_indices

    cases = 0
    g = torch.Generator().manual_seed(5)
    for grid, tile, bs, d in (((5, 6, 7), (2, 4, 4), 32, 64), ((3, 5, 9), (2, 2, 4), 16, 128)):
        lay = video_layout(grid, tile, bs)
        x = torch.randn(2, lay.num_tokens, 3, d, generator=g).bfloat16()
        got = vsa_select.token_block_sums(x, _slot_indices(lay, x.device)[0], bs)
        want = tokens_to_slots(lay, x)[0].reshape(2, 3, lay.num_blocks, bs, d).sum(3, dtype=torch.float32)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        cases += 1
    lay = video_layout((5, 6, 7), (2, 4, 4), 32)
    q, k = (torch.randn(2, lay.num_tokens, 3, 64, generator=g).bfloat16() for _ in range(2))
    idx, num = vsa_topk_tokens(q, k, lay, 4)
    slot_token = _slot_indices(lay, q.device)[0]
    weight, alive = _block_weights(_layout_handle(lay), q.device)
    qm, km = (vsa_select.token_block_sums(x, slot_token, 32) * weight for x in (q, k))
    vsa_topk_agrees(qm @ km.transpose(-1, -2), alive, 4, idx)
    assert torch.equal(num, torch.full_like(num, 4))
    return cases + 1


def check_centroid_update() -> int:
    """The centroid operands in one pass equal torch's: the centroids rounded to bf16 bit for bit (ties to
    even included), ``|c|²`` within float32 rounding of a sum's order; after a Lloyd step the means of
    non-empty clusters (divided as torch divides) and the previous centroids of empty ones, bit for bit.
    Ragged counts of centroids (programs past the last), d 16 and 128."""
    from sparseattn import centroid_update
    from sparseattn.nearest_centroid import centroid_operands

    cases = 0
    for seed, (n, k, d) in enumerate(((2, 13, 128), (3, 8, 16), (1, 1, 128))):
        g = torch.Generator().manual_seed(seed)
        prev = torch.randn(n, k, d, generator=g) * 3
        prev[0, 0, :4] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-130])  # ties, a subnormal
        sums = torch.randn(n, k, d, generator=g) * 50
        sizes = torch.randint(0, 4, (n, k), generator=g).float()
        sizes[0, -1] = 0  # an empty cluster keeps its centroid
        x = torch.zeros(n, 1, d, dtype=torch.bfloat16)
        low, csq = centroid_update.operands(prev)
        want_low, want_csq = centroid_operands(x, prev)
        assert torch.equal(low, want_low), seed
        torch.testing.assert_close(csq, want_csq, rtol=1e-6, atol=0)
        cent, (low, csq) = centroid_update.update(sums, sizes, prev)
        want = torch.where(sizes.unsqueeze(-1) > 0, sums / sizes.clamp_min(1).unsqueeze(-1), prev)
        assert torch.equal(cent, want), seed
        want_low, want_csq = centroid_operands(x, want)
        assert torch.equal(low, want_low), seed
        torch.testing.assert_close(csq, want_csq, rtol=1e-6, atol=0)
        int_sizes = sizes.long()
        cent, means = centroid_update.selection_means(sums, int_sizes, prev)
        want_means = sums / int_sizes.float().clamp_min(1).unsqueeze(-1)
        assert torch.equal(cent, want) and means.dtype == torch.float64, seed
        assert torch.equal(means, want_means.double()), seed
        cases += 3
    return cases


def check_layout_blocks() -> int:
    """A partition layout's arrays by the two Triton kernels equal the torch form's field by field: block
    sizes 16, 48, 64 and 128, empty groups, a group that fills whole blocks, one group, more groups than
    tokens, static slot bounds above the minimum (blocks past every group)."""
    from test_svg2_device import assert_layouts_equal

    from sparseattn import svg2_device as sd

    cases = 0
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        for block, groups, tokens in (
            (16, 7, 100),
            (48, 13, 301),
            (64, 1, 200),
            (128, 40, 1000),
            (64, 300, 257),
        ):
            labels = torch.randint(0, groups, (3, tokens), generator=g)
            labels[0] = labels[0].clamp(max=max(groups - 2, 0))  # the last group empty in row 0
            labels[1, : 2 * block] = 0  # group 0 fills whole blocks in row 1 (or more)
            for extra in (0, 3 * block):
                bound = sd.max_slots_bound(tokens, groups, block) + extra
                sd.LAYOUT_BLOCKS = "torch"
                want = sd.partition_slots(labels, groups, block, bound)
                sd.LAYOUT_BLOCKS = "triton"
                got = sd.partition_slots(labels, groups, block, bound)
                assert_layouts_equal(got, want, (seed, block, groups, extra))
                cases += 1
    sd.LAYOUT_BLOCKS = "torch"
    return cases


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    name = sys.argv[1]
    print(f"{name}: {globals()[f'check_{name}']()} cases agree")
