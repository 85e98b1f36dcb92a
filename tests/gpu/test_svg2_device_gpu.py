"""SVG2's k-means on the GPU against the host's (scipy's Lloyd steps from the same seeds), on random blobs
and on a built-in workload's synthetic features: float32 rows (torch distances) and bf16 rows (the fused
Triton assignment, centroids rounded to bf16 for the dot products)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_svg2_device import LAYOUT_TENSORS, assert_layouts_equal, blobs, clear_labels, host_lloyd, sq_dist

from sparseattn import svg2_device as sd
from sparseattn.builders import _kmeans_pp_init

pytestmark = pytest.mark.gpu


def _inertia(x: np.ndarray, labels: np.ndarray, centroids: np.ndarray) -> float:
    """float64 sum of squared distances of each token to its labelled centroid."""
    diff = x.astype(np.float64) - centroids.astype(np.float64)[labels]
    return float((diff * diff).sum())


def _synthetic(heads: int, tokens: int) -> np.ndarray:
    """float32 ``[heads, tokens, d]``: the K features of ``svg2_wan14b_720p`` (first ``tokens``)."""
    from sparseattn.svg2_step_bench import synthetic_qk
    from sparseattn.workloads import get_workload

    return synthetic_qk(get_workload("svg2_wan14b_720p"), heads)[1][:, :tokens]


def _round_bf16(c: np.ndarray) -> np.ndarray:
    """float64 values of ``c`` rounded to float32, then to bf16 (as the fused kernel rounds centroids)."""
    return torch.from_numpy(c.astype(np.float32)).bfloat16().double().numpy()


def host_lloyd_bf16(x: np.ndarray, init: np.ndarray, iters: int):
    """The fused path's Lloyd steps in float64: each assignment to the bf16-rounded centroids, each
    update the mean of the tokens (an empty cluster keeps its centre), then a last assignment.
    ``(centroids [k, d], distances to the rounded final centroids [tokens, k])``."""
    code = init.astype(np.float64)
    for _ in range(iters):
        labels = sq_dist(x, _round_bf16(code)).argmin(1)
        for c in range(code.shape[0]):
            members = x[labels == c]
            if len(members):
                code[c] = members.astype(np.float64).mean(0)
    return code, sq_dist(x, _round_bf16(code))


@pytest.mark.parametrize("data", ["blobs", "synthetic"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_kmeans_agrees_with_the_host(data, dtype):
    """Same seeds (k-means++ on the host), same data: labels equal wherever the nearest centroid is clear,
    and the inertia of the GPU clustering within 1e-4 (float32) / 1e-3 (bf16 rows) of the host's. The
    host runs scipy's Lloyd steps for float32 rows and, for bf16 rows, the same steps assigning to
    bf16-rounded centroids as the fused kernel does (scipy's unrounded steps part ways from it at the
    first token whose nearest centroid changes under that rounding)."""
    k, iters = 40, 3
    x = blobs(3, 4, 3000, 64) if data == "blobs" else _synthetic(4, 6000)
    if dtype == "bfloat16":  # the host clusters the same (rounded) values
        x = torch.from_numpy(x).bfloat16().float().numpy()
    rng = np.random.default_rng(0)
    init = np.stack([_kmeans_pp_init(x[r].astype(np.float64), k, rng) for r in range(x.shape[0])])
    xt = torch.from_numpy(x).cuda()
    if dtype == "bfloat16":
        xt = xt.bfloat16()
    labels, cent = sd.kmeans(xt, k, iters, init=torch.from_numpy(init).cuda())
    labels, cent = labels.cpu().numpy(), cent.cpu().numpy()
    tol = 1e-4 if dtype == "float32" else 1e-3
    for r in range(x.shape[0]):
        if dtype == "float32":
            code, dist = host_lloyd(x[r], init[r], iters)
        else:
            code, dist = host_lloyd_bf16(x[r], init[r], iters)
        host_labels = dist.argmin(1)
        got, want = _inertia(x[r], labels[r], cent[r]), _inertia(x[r], host_labels, code)
        assert abs(got - want) <= tol * want, (r, got, want)
        mine = cent[r] if dtype == "float32" else _round_bf16(cent[r])
        clear = clear_labels(sq_dist(x[r], mine), 1e-4 * np.abs(dist).mean())
        assert clear.mean() > 0.95
        same = (labels[r][clear] == host_labels[clear]).mean()
        assert same > 0.999, (r, same)


def test_fused_assignment_is_the_nearest_of_the_rounded_centroids():
    """bf16 rows: the fused kernel's labels are the float64 nearest centroids of the bf16-rounded
    centroids, wherever the nearest beats the second by more than float32 rounding."""
    from sparseattn.nearest_centroid import nearest_centroid_fused

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(3, 5000, 128, device="cuda", generator=g).bfloat16()
    c = torch.randn(3, 333, 128, device="cuda", generator=g)
    got = nearest_centroid_fused(x, c).cpu().numpy()
    xs, cs = x.float().cpu().numpy(), c.bfloat16().float().cpu().numpy()
    for r in range(3):
        dist = sq_dist(xs[r], cs[r])
        # float32 accumulation of 128 products is good to ~1e-5 here; the margin is 2.6e-3 (1e-5 x ~256)
        clear = clear_labels(dist, 1e-5 * np.abs(dist).mean())
        assert clear.mean() > 0.99
        np.testing.assert_array_equal(got[r][clear], dist.argmin(1)[clear])


def test_fused_lloyd_step_sums_and_sizes():
    """The fused Lloyd step's float32 cluster sums and sizes equal those of its own labels."""
    from sparseattn.nearest_centroid import lloyd_step_fused

    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(2, 20000, 128, device="cuda", generator=g).bfloat16()
    c = torch.randn(2, 500, 128, device="cuda", generator=g)
    labels, sums, sizes = lloyd_step_fused(x, c)
    want_sums = torch.zeros_like(sums).scatter_add_(1, labels.unsqueeze(-1).expand(-1, -1, 128), x.float())
    want_sizes = torch.zeros_like(sizes).scatter_add_(1, labels, torch.ones_like(labels, dtype=torch.float32))
    assert torch.equal(sizes, want_sizes)
    torch.testing.assert_close(sums, want_sums, rtol=1e-5, atol=1e-3)


@pytest.fixture(params=["argmin", "packed_argmax", "argmin_tail64", "packed_argmax_tail64"])
def kmeans_build(request, monkeypatch):
    """The wgmma assignment's builds (``kmeans_assign.BUILDS``), each in turn."""
    from sparseattn.kernels import kmeans_assign

    monkeypatch.setattr(kmeans_assign, "BUILD", request.param)
    return request.param


#: The tensors of a DeviceLayout, compared field by field.

ASSIGNMENT_CASES = [(3, 5000, 333, 128), (2, 97, 1000, 128), (2, 300, 1, 64), (1, 1025, 130, 64)]


@pytest.mark.parametrize("n, tokens, k, d", ASSIGNMENT_CASES)
def test_wgmma_assignment_is_the_nearest_of_the_rounded_centroids(n, tokens, k, d, kmeans_build):
    """The tensor-core assignment (ragged tokens and centroid counts, every build): the float64 nearest of
    the bf16-rounded centroids wherever the nearest beats the second by more than float32 accumulation
    error, and the Triton kernel's labels there too."""
    from sparseattn.kernels.kmeans_assign import nearest_centroid_wgmma
    from sparseattn.nearest_centroid import nearest_centroid_fused

    g = torch.Generator(device="cuda").manual_seed(tokens + k)
    x = torch.randn(n, tokens, d, device="cuda", generator=g).bfloat16()
    c = torch.randn(n, k, d, device="cuda", generator=g)
    got = nearest_centroid_wgmma(x, c)
    assert got.dtype == torch.int64 and got.shape == (n, tokens)
    triton_labels = nearest_centroid_fused(x, c).cpu().numpy()
    got = got.cpu().numpy()
    xs, cs = x.float().cpu().numpy(), c.bfloat16().float().cpu().numpy()
    for r in range(n):
        dist = sq_dist(xs[r], cs[r])
        clear = clear_labels(dist, 1e-5 * np.abs(dist).mean()) if k > 1 else np.ones(tokens, bool)
        assert clear.mean() > 0.99
        np.testing.assert_array_equal(got[r][clear], dist.argmin(1)[clear])
        np.testing.assert_array_equal(got[r][clear], triton_labels[r][clear])


@pytest.mark.parametrize("n, tokens, k, d", ASSIGNMENT_CASES)
def test_packed_argmax_labels_equal_the_argmins_but_for_near_ties(n, tokens, k, d, monkeypatch):
    """The packed build's labels equal the exact build's wherever the two scores differ by more than the
    packing's 2⁻¹⁸ (relative; the float32 scores of both picks recomputed here)."""
    from sparseattn.kernels import kmeans_assign

    g = torch.Generator(device="cuda").manual_seed(tokens * k)
    x = torch.randn(n, tokens, d, device="cuda", generator=g).bfloat16()
    c = torch.randn(n, k, d, device="cuda", generator=g)
    labels = {}
    for build in kmeans_assign.BUILDS:
        monkeypatch.setattr(kmeans_assign, "BUILD", build)
        labels[build] = kmeans_assign.nearest_centroid_wgmma(x, c)
    a, b = labels["argmin"], labels["packed_argmax"]
    cb = c.bfloat16().double()
    score = x.double() @ cb.transpose(1, 2) - 0.5 * (cb * cb).sum(-1)[:, None, :]
    sa, sb = score.gather(2, a[..., None])[..., 0], score.gather(2, b[..., None])[..., 0]
    near = (sa - sb).abs() <= 2.0**-16 * sa.abs() + 1e-6  # packing plus float32 accumulation
    assert bool(((a == b) | near).all())
    assert (a == b).float().mean() > 0.999


@pytest.mark.parametrize("k", [1, 130, 333, 1000])
@pytest.mark.parametrize("d", [64, 128])
def test_ring_build_gives_the_barrier_builds_labels(d, k, monkeypatch):
    """The chunk loop on mbarriers (``_ring``) gives ``packed_argmax_tail64``'s labels bit for bit (the same
    instructions on the same data)."""
    from sparseattn.kernels import kmeans_assign

    g = torch.Generator(device="cuda").manual_seed(3 * k + d)
    x = torch.randn(2, 5001, d, device="cuda", generator=g).bfloat16()
    c = torch.randn(2, k, d, device="cuda", generator=g)
    got = {}
    for build in ("packed_argmax_tail64", "packed_argmax_tail64_ring"):
        monkeypatch.setattr(kmeans_assign, "BUILD", build)
        got[build] = kmeans_assign.nearest_centroid_wgmma(x, c)
    assert torch.equal(*got.values())


@pytest.mark.parametrize("k", [1, 3, 64, 130, 192, 300, 333])
@pytest.mark.parametrize("d", [64, 128])
def test_narrow_tail_builds_give_their_base_builds_labels(d, k, monkeypatch):
    """A last chunk of at most 64 centroids at wgmma N = 64 (``_tail64``; k = 1, 3, 64, 130, 192 and 300 take
    it, 333's tail of 77 does not): the same labels as the build it narrows, bit for bit, and the same
    cluster sizes from its Lloyd step (the same labels; the sums' atomics may add in another order)."""
    from sparseattn.kernels import kmeans_assign

    g = torch.Generator(device="cuda").manual_seed(k + d)
    x = torch.randn(2, 1025, d, device="cuda", generator=g).bfloat16()
    c = torch.randn(2, k, d, device="cuda", generator=g)
    for base in ("argmin", "packed_argmax"):
        got = {}
        for build in (base, f"{base}_tail64"):
            monkeypatch.setattr(kmeans_assign, "BUILD", build)
            got[build] = (kmeans_assign.nearest_centroid_wgmma(x, c), *kmeans_assign.lloyd_step_wgmma(x, c))
        (a, la, sa, na), (b, lb, sb, nb) = got.values()
        assert torch.equal(a, b) and torch.equal(la, lb) and torch.equal(a, la), base
        assert torch.equal(na, nb), base
        torch.testing.assert_close(sb, sa, rtol=1e-5, atol=1e-3)


def test_packed_argmax_keeps_columns_of_scores_near_zero(monkeypatch):
    """The packed value is −|x − c|²/2: a token equal to its centroid scores exactly 0, which packs into a
    subnormal whose bits still carry the column, so the nearest is found, not column 0 of the lane's set."""
    from sparseattn.kernels import kmeans_assign

    monkeypatch.setattr(kmeans_assign, "BUILD", "packed_argmax")
    d, k = 128, 130
    x = torch.zeros(1, 256, d, device="cuda")
    x[0, :, 0] = 1.0  # every token on axis 0
    c = torch.zeros(1, k, d, device="cuda")
    c[0, :, 1] = 1.0  # centroids off the axis: −|x − c|²/2 = −1 ...
    c[0, 77] = x[0, 0]  # ... but centroid 77 is the tokens: exactly 0, the nearest
    got = kmeans_assign.nearest_centroid_wgmma(x.bfloat16(), c)
    assert bool((got == 77).all())


@pytest.mark.parametrize("method", ["atomics", "presum", "mma"])
@pytest.mark.parametrize("k", [500, 3], ids=["k500", "k3"])
@pytest.mark.parametrize("d", [64, 128])
def test_wgmma_lloyd_step_sums_and_sizes(d, k, method, kmeans_build):
    """The tensor-core Lloyd step's float32 cluster sums and sizes equal those of its own labels (every
    build), with each token's atomics, with each cluster's tokens of a CTA summed first, and with those
    partial sums as a one-hot product on the tensor cores (3 clusters put dozens of tokens in each; 20,001
    tokens leave the last CTA partial)."""
    from sparseattn.kernels.kmeans_assign import lloyd_step_wgmma

    g = torch.Generator(device="cuda").manual_seed(d + k)
    x = torch.randn(2, 20001, d, device="cuda", generator=g).bfloat16()
    c = torch.randn(2, k, d, device="cuda", generator=g)
    labels, sums, sizes = lloyd_step_wgmma(x, c, sums=method)
    index = labels.unsqueeze(-1).expand(-1, -1, d)
    want_sums = torch.zeros_like(sums, dtype=torch.float64).scatter_add_(1, index, x.double())
    want_sizes = torch.zeros_like(sizes).scatter_add_(1, labels, torch.ones_like(labels, dtype=torch.float32))
    assert torch.equal(sizes, want_sizes)
    torch.testing.assert_close(sums.double(), want_sums, rtol=1e-5, atol=1e-3)


def test_wgmma_kmeans_matches_the_fused_kmeans(kmeans_build):
    """Whole k-means (2 Lloyd steps, last-step labels) on the wgmma and the Triton assignment from the same
    centroids: the same labels but for near ties, the same inertia."""
    x = torch.from_numpy(_synthetic(4, 6000)).cuda().bfloat16()
    init = x[:, :64].float()
    got = sd.lloyd(x, 64, 2, init, assign="wgmma", final_assign=False)
    ref = sd.lloyd(x, 64, 2, init, assign="fused", final_assign=False)
    assert (got[0] == ref[0]).float().mean() > 0.999
    xs = x.float().cpu().numpy()
    for r in range(4):
        a = _inertia(xs[r], got[0][r].cpu().numpy(), got[1][r].cpu().numpy())
        b = _inertia(xs[r], ref[0][r].cpu().numpy(), ref[1][r].cpu().numpy())
        assert abs(a - b) <= 1e-4 * b


@pytest.mark.parametrize("group_dtype", [torch.int64, torch.int32])
def test_block_mask_kernel_matches_the_torch_gathers(group_dtype):
    """SVG2's block mask by the Triton lookup at the 720p shape's clusters and blocks (4 rows) equals the
    torch path's two gathers, -1 groups past each row's layout included."""
    from sparseattn import cluster_blocks

    g = torch.Generator(device="cuda").manual_seed(7)
    n, cq, ck, a, b = 4, 300, 1000, 888, 1582
    cmask = torch.rand(n, cq, ck, generator=g, device="cuda") < 0.14
    qg = torch.randint(0, cq, (n, a), generator=g, device="cuda").sort(-1).values.to(group_dtype)
    kg = torch.randint(0, ck, (n, b), generator=g, device="cuda").sort(-1).values.to(group_dtype)
    qg[:, 700:] = -1
    kg[1:, 1400:] = -1
    out = cluster_blocks.block_mask(cmask, qg, kg)
    want = sd._block_mask_by_gathers(cmask, qg, kg)
    assert torch.equal(out, want)


@pytest.mark.parametrize("slots_form", ["sort", "counts"])
@pytest.mark.parametrize("groups", [300, 1000, 3])
def test_partition_layouts_on_the_gpu_equal_the_cpu_path(groups, slots_form, monkeypatch):
    """SVG2's partition layouts at the 720p shape (2 rows of 75,600 labels, clustered as tokens of one cube
    share clusters) on the GPU equal the CPU path's, field by field, with either form of the slots."""
    monkeypatch.setattr(sd, "LAYOUT_SLOTS", slots_form)
    g = torch.Generator(device="cuda").manual_seed(groups)
    n, t = 2, 75_600
    near = torch.randint(0, groups, (n, t // 64 + 1), generator=g, device="cuda").repeat_interleave(64, 1)[
        :, :t
    ]
    noise = torch.randint(0, groups, (n, t), generator=g, device="cuda")
    labels = torch.where(torch.rand(n, t, generator=g, device="cuda") < 0.3, noise, near)
    lay = sd.partition_slots(labels, groups, 128)
    ref = sd.partition_slots(labels.cpu(), groups, 128)
    for name in LAYOUT_TENSORS:
        assert torch.equal(getattr(lay, name).cpu(), getattr(ref, name)), name


@pytest.mark.parametrize(
    "n, tokens, groups",
    [(1, 1, 1), (3, 97, 5), (2, 2048, 1), (5, 2049, 64), (4, 20_001, 4096), (2, 10_000, 2000)],
    ids=lambda v: str(v),
)
def test_counted_slots_equal_the_sorted_slots(n, tokens, groups):
    """``group_slots.token_slots`` (counts per chunk, no sort) gives the stable sort's slots on ragged rows:
    one token, a whole chunk of one group, chunks cut at the end, the most groups, empty groups, and labels
    outside ``[0, groups)`` (slot -1, not counted); the counts are the labels' per chunk."""
    from sparseattn.kernels import group_slots

    g = torch.Generator(device="cuda").manual_seed(tokens + groups)
    labels = torch.randint(0, groups, (n, tokens), generator=g, device="cuda")
    if groups > 1:  # runs of one label, as neighbouring tokens share clusters
        labels[:, : tokens // 2] = labels[:, : tokens // 2] // max(1, groups // 7)
    start = torch.randint(0, 50, (n, groups), generator=g, device="cuda").cumsum(1)
    got = group_slots.token_slots(labels, groups, start)
    sorted_labels, order = sd._sorted_rows(labels, groups)
    bounds = torch.arange(groups + 1, device="cuda").expand(n, -1).contiguous()
    first = torch.searchsorted(sorted_labels.long(), bounds)
    want = sd._token_slots(sorted_labels, order, first[:, :-1], start)
    assert torch.equal(got, want)
    counts = group_slots.chunk_counts(labels, groups)
    chunk = torch.arange(tokens, device="cuda") // group_slots.CHUNK_TOKENS
    ref = torch.zeros_like(counts, dtype=torch.int64)
    ref.index_put_(
        (torch.arange(n, device="cuda")[:, None].expand(n, tokens), chunk.expand(n, -1), labels),
        torch.ones_like(labels),
        accumulate=True,
    )
    assert torch.equal(counts.long(), ref)
    bad = labels.clone()
    bad[:, ::3] = -1
    bad[:, 1::5] = groups
    got = group_slots.token_slots(bad, groups, start)
    assert bool((got[bad < 0] == -1).all()) and bool((got[bad >= groups] == -1).all())
    keep = (bad >= 0) & (bad < groups)
    for r in range(n):  # the counted tokens keep their groups' stable order from each group's start
        lab, slot = bad[r][keep[r]], got[r][keep[r]]
        order = torch.sort(lab, stable=True).indices
        rank = torch.arange(lab.numel(), device="cuda") - torch.searchsorted(lab[order], lab[order])
        assert torch.equal(slot[order], start[r][lab[order]] + rank)


@pytest.mark.parametrize("method", ["sort", "bisect", "bisect_words"])
@pytest.mark.parametrize("top_p, min_fraction", [(0.9, 0.1), (0.5, 0.0), (0.95, 0.3)])
def test_select_kernel_matches_the_torch_sort(top_p, min_fraction, method, monkeypatch):
    """SVG2's top-p selection by the Triton kernel (one program per Q cluster, sorting or bisecting) at the
    720p shape's clusters (8 rows of 300 × 1,000, float64) equals the torch sort's, empty K clusters and a
    row without live ones included."""
    from sparseattn import cluster_select

    monkeypatch.setattr(cluster_select, "METHOD", method)
    g = torch.Generator(device="cuda").manual_seed(11)
    n, cq, ck, d = 8, 300, 1000, 128
    qc = torch.randn(n, cq, d, generator=g, device="cuda", dtype=torch.float64) * 0.4
    kc = torch.randn(n, ck, d, generator=g, device="cuda", dtype=torch.float64) * 0.4
    sizes = torch.randint(0, 160, (n, ck), generator=g, device="cuda")
    sizes[:, ::9] = 0
    sizes[3] = 0
    assert cluster_select.available(qc)
    got = sd.svg2_select(qc, kc, sizes, d, top_p, min_fraction)
    dots, bias, least = sd.selection_inputs(qc, kc, sizes, min_fraction)
    want = sd._select_by_sort(dots, bias, d, top_p, least)
    assert torch.equal(got, want)
    assert not got[3].any() and got[:, :, ::9].sum() == 0
    live_rows = torch.arange(n, device="cuda") != 3
    assert (got[live_rows].sum(-1) >= 1).all()  # every Q cluster of a live row keeps at least one


@pytest.mark.parametrize("noise", [1e-12, 0.0], ids=["near_flat", "flat"])
def test_select_by_words_equals_the_bisection_on_rows_that_share_their_high_words(noise):
    """``bisect_words`` against ``bisect`` on the GPU where the second phase does the work: probabilities of a
    row equal but for ~1e-12 (one high word for all) or exactly equal (ties at the cut), 1,000 K clusters,
    the floor on half the rows: the same masks bit for bit (the same sums compared)."""
    from sparseattn import cluster_select

    g = torch.Generator(device="cuda").manual_seed(3)
    n, cq, ck = 4, 64, 1000
    dots = 1.0 + noise * torch.randn(n, cq, ck, generator=g, device="cuda", dtype=torch.float64)
    bias = torch.zeros(n, ck, device="cuda", dtype=torch.float64)
    bias[0, ::7] = float("-inf")
    least = torch.tensor([0, 300, 0, 700], device="cuda")
    for top_p in (0.5, 0.9, 0.999):
        a = cluster_select.select_mask(dots, bias, 128, top_p, least, method="bisect")
        b = cluster_select.select_mask(dots, bias, 128, top_p, least, method="bisect_words")
        assert torch.equal(a, b), top_p
        assert (b.sum(-1)[[1, 3]] >= least[[1, 3]].unsqueeze(-1)).all()


def test_q_layout_on_a_side_stream_is_the_layout_of_its_labels(monkeypatch):
    """``SIDE_STREAM``: Q's layout, built on a side stream while K's k-means runs, is the layout of the
    labels the call returns (so the side stream waited for them, and the call for it), as is K's, with no
    host synchronisation in the call. (Two calls' labels may differ at near ties: the sums' atomics.)"""
    monkeypatch.setattr(sd, "SIDE_STREAM", True)
    x = torch.from_numpy(_synthetic(4, 20000)).cuda().bfloat16()
    q, k = x, x.flip(1).contiguous()
    init = (q[:, :100].float(), k[:, :300].float())
    sd.fit_for_slots(q, k, 100, 300, 128, 2, *init, assign="wgmma")  # the side stream made, kernels loaded
    torch.cuda.synchronize()
    with _no_host_sync():
        fit = sd.fit_for_slots(q, k, 100, 300, 128, 2, *init, assign="wgmma")
        del x, k  # freed on the main stream while the side stream may still be reading: must stay safe
    torch.cuda.synchronize()
    for lay, labels, groups in ((fit.q_layout, fit.q_fit[0], 100), (fit.k_layout, fit.k_fit[0], 300)):
        want = sd.partition_slots(labels, groups, 128)
        for name in LAYOUT_TENSORS:
            assert torch.equal(getattr(lay, name), getattr(want, name)), name


def test_k_layout_beside_q_move_is_the_layout_of_its_labels(monkeypatch):
    """``fit_for_slots(k_beside=True)`` (v47): K's layout, built on the side stream behind Q's, is joined by
    ``slots_and_step`` after q's move, with K's slot rows made then: the layouts are those of the labels the
    call returns, the slot tensors those of a move from them, and the call makes no host synchronisation."""
    monkeypatch.setattr(sd, "SIDE_STREAM", True)
    x = torch.from_numpy(_synthetic(4, 20000)).cuda().bfloat16()
    q, k = x, x.flip(1).contiguous()
    g = torch.Generator(device="cuda").manual_seed(9)
    v = torch.randn(x.shape, device="cuda", generator=g).bfloat16()
    init = (q[:, :100].float(), k[:, :300].float())
    flat = [y.reshape(-1, y.shape[-1]) for y in (q, k, v)]
    rows = lambda lay: sd.slot_rows(lay.token_slot, lay.max_slots).reshape(-1)

    def call():
        fit = sd.fit_for_slots(q, k, 100, 300, 128, 2, *init, assign="wgmma", k_beside=True)
        assert len(fit.k_join) == 1
        out = sd.slots_and_step(
            fit, *flat, rows(fit.q_layout), lambda: rows(fit.k_layout), 0.9, 0.05, "clusters"
        )
        assert not fit.k_join
        return fit, out

    call()  # the side stream made, kernels loaded
    torch.cuda.synchronize()
    with _no_host_sync():
        fit, (qs, ks, vs, step, work) = call()
    torch.cuda.synchronize()
    for lay, labels, groups in ((fit.q_layout, fit.q_fit[0], 100), (fit.k_layout, fit.k_fit[0], 300)):
        want = sd.partition_slots(labels, groups, 128)
        for name in LAYOUT_TENSORS:
            assert torch.equal(getattr(lay, name), getattr(want, name)), name
    for got, lay, y in (
        (qs, fit.q_layout, flat[0]),
        (ks, fit.k_layout, flat[1]),
        (vs, fit.k_layout, flat[2]),
    ):
        filled = lay.filled_slots()
        want = sd.scatter_rows(y, rows(lay), lay.valid.numel(), filled)
        assert torch.equal(got[filled], want[filled])
    again = step.forward_work_list("clusters")
    assert torch.equal(work.item_streams(), again.item_streams())


def test_step_in_slots_takes_the_last_steps_sums_while_tokens_move():
    """svg2_step_in_slots on the GPU (the wgmma assignment, the Triton slot copy with each
    block's sums): its centroids are the means of its labels' clusters (empty ones keep theirs), its
    selection is SVG2's rule on them (but for float32 summation order), and its slot tensors are the
    tokens moved to its layouts."""
    x = torch.from_numpy(_synthetic(4, 20000)).cuda().bfloat16()
    q, k = x, x.flip(1).contiguous()
    g = torch.Generator(device="cuda").manual_seed(5)
    v = torch.randn(x.shape, device="cuda", generator=g).bfloat16()
    init = (q[:, :100].float(), k[:, :300].float())
    step, qs, ks, vs, _ = sd.svg2_step_in_slots(q, k, v, 100, 300, 128, 0.9, 0.05, 2, *init, assign="wgmma")
    q_means, q_sizes = sd.cluster_means(q, step.q_labels, 100)
    k_means, k_sizes = sd.cluster_means(k, step.k_labels, 300)
    assert torch.equal(step.k_sizes, k_sizes)
    for cent, means, sizes in ((step.q_centroids, q_means, q_sizes), (step.k_centroids, k_means, k_sizes)):
        occupied = sizes > 0
        torch.testing.assert_close(cent[occupied], means[occupied], rtol=1e-5, atol=1e-5)
    want = sd.svg2_select(q_means.double(), k_means.double(), k_sizes, 128, 0.9, 0.05)
    assert (step.cluster_mask != want).float().mean() < 1e-3
    for got, lay, y in ((qs, step.q_layout, q), (ks, step.k_layout, k), (vs, step.k_layout, v)):
        tokens = lay.valid  # the padding slots are left unwritten
        assert torch.equal(got[tokens], sd.scatter_to_slots(y, lay.token_slot, lay.max_slots)[tokens])


@pytest.mark.parametrize("plan", ["blocks", "clusters"])
def test_selection_and_plan_beside_vs_move_are_the_sequential_ones(plan):
    """``slots_and_step(beside=True)``: the selection and the forward's work list, enqueued on a side stream
    while v moves, are those of the sums the q and k moves took (the side stream waited for them) and the
    caller's stream waits for them (the list equals one planned afterwards from the step it returned); the
    slot tensors are the sequential call's; no host synchronisation. (The sums' atomics may order the last
    bits differently from one call to the next, so the two calls' selections may differ at near ties.)"""
    x = torch.from_numpy(_synthetic(4, 20000)).cuda().bfloat16()
    q, k = x, x.flip(1).contiguous()
    g = torch.Generator(device="cuda").manual_seed(6)
    v = torch.randn(x.shape, device="cuda", generator=g).bfloat16()
    init = (q[:, :100].float(), k[:, :300].float())
    fit = sd.fit_for_slots(q, k, 100, 300, 128, 2, *init, assign="wgmma")
    rows = [sd.slot_rows(lay.token_slot, lay.max_slots).reshape(-1) for lay in (fit.q_layout, fit.k_layout)]
    flat = [y.reshape(-1, y.shape[-1]) for y in (q, k, v)]
    args = (fit, *flat, *rows, 0.9, 0.05, plan)
    want = sd.slots_and_step(*args, beside=False)
    sd.slots_and_step(*args, beside=True)  # the side stream made, kernels loaded
    torch.cuda.synchronize()
    with _no_host_sync():
        got = sd.slots_and_step(*args, beside=True)
        del flat, args  # freed on the main stream while the side stream may still be reading: must stay safe
    torch.cuda.synchronize()
    for a, b, lay in zip(got[:3], want[:3], (fit.q_layout, fit.k_layout, fit.k_layout)):
        filled = lay.filled_slots()
        assert torch.equal(a[filled], b[filled])
    step, work = got[3], got[4]
    assert (step.cluster_mask != want[3].cluster_mask).float().mean() < 1e-3
    again = step.forward_work_list(plan)
    assert torch.equal(work.item_streams(), again.item_streams())
    for name in ("work_info", "own_entries", "status"):
        assert torch.equal(getattr(work, name), getattr(again, name)), name


def test_centroid_operands_in_one_pass_are_torchs():
    """``centroid_update`` compiled: the bf16 centroids bit for bit and ``|c|²`` within float32 rounding of
    torch's; after a step the centroids bit for bit (means of non-empty clusters, else the previous)."""
    from sparseattn import centroid_update
    from sparseattn.nearest_centroid import centroid_operands

    g = torch.Generator(device="cuda").manual_seed(8)
    prev = torch.randn(40, 1000, 128, device="cuda", generator=g) * 3
    sums = torch.randn(40, 1000, 128, device="cuda", generator=g) * 40
    sizes = torch.randint(0, 5, (40, 1000), device="cuda", generator=g).float()
    x = torch.zeros(40, 1, 128, device="cuda", dtype=torch.bfloat16)
    cent, (low, csq) = centroid_update.update(sums, sizes, prev)
    want = torch.where(sizes.unsqueeze(-1) > 0, sums / sizes.clamp_min(1).unsqueeze(-1), prev)
    assert torch.equal(cent, want)
    want_low, want_csq = centroid_operands(x, want)
    assert torch.equal(low, want_low)
    torch.testing.assert_close(csq, want_csq, rtol=1e-6, atol=0)
    low, csq = centroid_update.operands(prev)
    want_low, want_csq = centroid_operands(x, prev)
    assert torch.equal(low, want_low)
    torch.testing.assert_close(csq, want_csq, rtol=1e-6, atol=0)


def test_selection_means_in_one_pass_give_torchs_step(monkeypatch):
    """``SELECT_MEANS="fused"`` compiled: from the same slots' sums, the step's centroids, sizes and selection
    equal the torch form's bit for bit (the same float32 means, widened)."""
    x = torch.from_numpy(_synthetic(4, 20000)).cuda().bfloat16()
    q, k = x, x.flip(1).contiguous()
    v = torch.randn(
        x.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(9)
    ).bfloat16()
    init = (q[:, :100].float(), k[:, :300].float())
    fit = sd.fit_for_slots(q, k, 100, 300, 128, 2, *init, assign="wgmma")
    _, _, _, q_sums, k_sums = sd.move_to_slots(fit, q, k, v)
    steps = {}
    for form in ("torch", "fused"):
        monkeypatch.setattr(sd, "SELECT_MEANS", form)
        steps[form] = sd.step_from_slot_sums(fit, q_sums, k_sums, 0.9, 0.05)
    for name in ("cluster_mask", "k_sizes", "q_centroids", "k_centroids"):
        assert torch.equal(getattr(steps["fused"], name), getattr(steps["torch"], name)), name


def test_lloyd_with_fused_centroid_updates_is_lloyd(monkeypatch):
    """``KMEANS_UPDATE="fused"``: the wgmma Lloyd steps with the one-pass operands and updates give the torch
    updates' labels (but at near ties: ``|c|²``'s summation order and the sums' atomics) and centroids."""
    x = torch.from_numpy(_synthetic(4, 20000)).cuda().bfloat16()
    init = x[:, :300].float()
    got, want = [], []
    for form, out in (("fused", got), ("torch", want)):
        monkeypatch.setattr(sd, "KMEANS_UPDATE", form)
        out.extend(sd.lloyd(x, 300, 3, init, assign="wgmma", final_assign=False))
    assert (got[0] != want[0]).float().mean() < 1e-3
    close = ((got[1] - want[1]).abs() <= 1e-4 * (1 + want[1].abs())).all(-1)
    assert close.float().mean() > 0.99


@pytest.mark.parametrize("block_size", [64, 128])
def test_layout_blocks_by_triton_are_torchs(block_size, monkeypatch):
    """``LAYOUT_BLOCKS="triton"`` compiled: SVG2's 720p-sized layouts (40 rows, 1,000 groups, one empty, a
    static bound above the minimum) equal the torch form's field by field."""
    g = torch.Generator(device="cuda").manual_seed(block_size)
    labels = torch.randint(0, 999, (40, 75600), device="cuda", generator=g)
    bound = sd.max_slots_bound(75600, 1000, block_size) + 4 * block_size
    layouts = {}
    for form in ("torch", "triton"):
        monkeypatch.setattr(sd, "LAYOUT_BLOCKS", form)
        layouts[form] = sd.partition_slots(labels, 1000, block_size, bound)
    assert_layouts_equal(layouts["triton"], layouts["torch"])


@contextlib.contextmanager
def _no_host_sync():
    """Whatever synchronises the host with the GPU inside raises (``torch.cuda.set_sync_debug_mode``)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("plan", ["blocks", "clusters"])
def test_an_svg2_call_and_its_plans_never_synchronize(plan):
    """A warm SVG2 call (k-means, layouts, selection, tokens to slots) and its forward and backward plans
    launch without a host synchronisation (``torch.cuda.set_sync_debug_mode("error")``), so a host queued
    ahead of the GPU stays ahead; a copy from a host list in the selection once drained it."""
    x = torch.from_numpy(_synthetic(2, 6000)).cuda().bfloat16()
    q, k = x, x.flip(1).contiguous()
    v = torch.randn(
        x.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3)
    ).bfloat16()
    init = (q[:, :40].float(), k[:, :120].float())

    def call():
        step = sd.svg2_step_in_slots(q, k, v, 40, 120, 64, 0.9, 0.05, 2, *init, assign="auto")[0]
        return step.forward_work_list(plan), step.backward_plan(plan)

    call()  # compiles and caches outside the check
    with _no_host_sync():
        call()
    torch.cuda.synchronize()


def test_the_wan_processors_svg2_forward_never_synchronizes():
    """The Wan processor's SVG2 call through KPage (no gradients): after a first call, the next one
    launches without a host synchronisation."""
    from sparseattn.diffusers_wan import WanSelection, WanSparseAttnProcessor

    grid = (6, 10, 12)
    sel = WanSelection.svg2(q_clusters=20, k_clusters=40, top_p=0.8, min_fraction=0.1, block_size=64)
    processor = WanSparseAttnProcessor(grid, sel, backend="kpage")
    g = torch.Generator(device="cuda").manual_seed(4)
    q, k, v = (torch.randn(1, 720, 3, 64, device="cuda", generator=g).bfloat16() for _ in range(3))
    with torch.no_grad():
        first = processor.attend(q, k, v)
        with _no_host_sync():
            out = processor.attend(q, k, v)
    assert torch.isfinite(out).all() and out.shape == first.shape
