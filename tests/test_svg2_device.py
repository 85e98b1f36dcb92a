"""SVG2 on the device (torch, here on the CPU): k-means, partition slots, selection and block mask
against the host path of :mod:`sparseattn.builders` / :mod:`sparseattn.layouts`."""

import dataclasses
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from scipy.cluster.vq import kmeans2

from sparseattn import svg2_device as sd
from sparseattn.builders import (
    _kmeans_pp_init,
    graph_from_group_masks,
    group_means,
    svg2_select,
)
from sparseattn.layouts import partition_layout


def blobs(seed, n, tokens, d, centres=12, spread=0.6):
    """float32 ``[n, tokens, d]``: Gaussian blobs around random centres (each row its own)."""
    rng = np.random.default_rng(seed)
    c = rng.normal(size=(n, centres, d)) * 2.0
    which = rng.integers(centres, size=(n, tokens))
    x = np.take_along_axis(c, which[..., None], axis=1) + spread * rng.normal(size=(n, tokens, d))
    return x.astype(np.float32)


def sq_dist(x, c):
    """float64 ``[tokens, k]`` squared distances."""
    x, c = x.astype(np.float64), c.astype(np.float64)
    return (x * x).sum(1)[:, None] - 2 * x @ c.T + (c * c).sum(1)[None, :]


def host_lloyd(x, init, iters):
    """scipy's Lloyd iterations (empty clusters keep their centre), then the nearest centroids."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code, _ = kmeans2(x.astype(np.float64), init, iter=iters, minit="matrix", missing="warn")
    return code, sq_dist(x, code)


def clear_labels(dist, eps):
    """bool ``[tokens]``: the nearest centroid beats the second by more than ``eps``."""
    part = np.partition(dist, 1, axis=1)
    return part[:, 1] - part[:, 0] > eps


# --- k-means -------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed, tokens, d, k, iters", [(0, 1500, 32, 24, 3), (1, 700, 16, 40, 5)])
def test_kmeans_matches_scipy_lloyd_from_same_init(seed, tokens, d, k, iters):
    """``iters`` steps at once against scipy's. Exact only while no step meets a near tie: float32
    and float64 distances can then send a token to different clusters, and the centroids part ways
    from that step on (the fixed data here has none; the step-by-step test below covers ties)."""
    x = blobs(seed, 4, tokens, d)
    rng = np.random.default_rng(seed)
    init = np.stack([_kmeans_pp_init(x[r].astype(np.float64), k, rng) for r in range(x.shape[0])])
    init[:, -1] = 1e3  # a centre no token is near: its cluster stays empty and keeps the centre
    labels, cent = sd.kmeans(torch.from_numpy(x), k, iters, init=torch.from_numpy(init))
    assert labels.shape == (4, tokens) and labels.dtype == torch.int64
    assert cent.shape == (4, k, d) and cent.dtype == torch.float32
    for r in range(x.shape[0]):
        code, dist = host_lloyd(x[r], init[r], iters)
        np.testing.assert_allclose(cent[r].numpy(), code, rtol=0, atol=2e-4)
        clear = clear_labels(dist, 1e-3)
        assert clear.mean() > 0.99
        np.testing.assert_array_equal(labels[r].numpy()[clear], dist.argmin(1)[clear])
        np.testing.assert_array_equal(cent[r, -1].numpy(), np.float32(1e3))


@pytest.mark.parametrize("seed", [0, 11, 20])
def test_each_lloyd_step_matches_host_from_the_same_centroids(seed):
    """One step at a time from the device's own centroids, so a float32/float64 near tie in one step
    cannot carry over into the next (seeds 11 and 20 hold such ties)."""
    x = blobs(seed, 4, 1000, 32)
    xt, k = torch.from_numpy(x), 24
    rng = np.random.default_rng(seed)
    init = np.stack([_kmeans_pp_init(x[r].astype(np.float64), k, rng) for r in range(x.shape[0])])
    init[:, -1] = 1e3
    c = torch.from_numpy(init).float()
    disagree = 0
    for _ in range(4):
        assign = sd.nearest_centroid(xt, c)
        _, c_next = sd.kmeans(xt, k, 1, init=c)
        for r in range(x.shape[0]):
            dist = sq_dist(x[r], c[r].numpy())
            host = dist.argmin(1)
            clear = clear_labels(dist, 1e-3)
            np.testing.assert_array_equal(assign[r].numpy()[clear], host[clear])
            disagree += int((assign[r].numpy() != host).sum())
            sums = np.zeros((k, x.shape[2]))
            np.add.at(sums, host, x[r].astype(np.float64))
            sizes = np.bincount(host, minlength=k)
            means = np.where(sizes[:, None] > 0, sums / np.maximum(sizes, 1)[:, None], c[r].numpy())
            settled = np.ones(k, bool)  # clusters no unclear token joins or leaves
            settled[host[~clear]] = settled[assign[r].numpy()[~clear]] = False
            np.testing.assert_allclose(c_next[r].numpy()[settled], means[settled], rtol=0, atol=1e-4)
        c = c_next
    assert disagree <= 3  # near ties only (here: 0, 1 and 1 for seeds 0, 11, 20)


def test_kmeans_rows_are_independent_and_chunking_changes_nothing():
    x = torch.from_numpy(blobs(2, 3, 400, 16))
    init = sd.kmeans_pp_init(x, 10, torch.Generator().manual_seed(5))
    labels, cent = sd.kmeans(x, 10, 3, init=init)
    for r in range(3):
        lr, cr = sd.kmeans(x[r : r + 1], 10, 3, init=init[r : r + 1])
        assert torch.equal(lr[0], labels[r])
        torch.testing.assert_close(cr[0], cent[r], rtol=0, atol=1e-5)
    lc, cc = sd.kmeans(x, 10, 3, init=init, chunk_tokens=37)
    assert torch.equal(lc, labels) and torch.equal(cc, cent)


def test_kmeans_wcss_does_not_increase():
    x = torch.from_numpy(blobs(3, 4, 900, 24, centres=20, spread=1.5))
    init = sd.kmeans_pp_init(x, 16, torch.Generator().manual_seed(0))
    wcss = []
    for iters in range(7):
        labels, cent = sd.kmeans(x, 16, iters, init=init)
        diff = x.double() - cent.double().gather(1, labels.unsqueeze(-1).expand(-1, -1, x.shape[2]))
        wcss.append((diff * diff).sum((1, 2)))
    wcss = torch.stack(wcss)  # [iters, N]
    assert torch.all(wcss[1:] <= wcss[:-1] * (1 + 1e-6))
    assert torch.all(wcss[-1] < wcss[0])


def test_kmeans_pp_seeding_is_reproducible_and_picks_distinct_points():
    x = torch.from_numpy(blobs(4, 3, 500, 16))
    a = sd.kmeans_pp_init(x, 12, torch.Generator().manual_seed(7))
    b = sd.kmeans_pp_init(x, 12, torch.Generator().manual_seed(7))
    c = sd.kmeans_pp_init(x, 12, torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)
    for r in range(3):
        # every seed is a token of its row, and no token is picked twice (D² never picks distance 0)
        match = (a[r][:, None, :] == x[r][None]).all(-1)  # [k, tokens]
        assert torch.all(match.any(1))
        assert torch.unique(match.float().argmax(1)).numel() == 12
    la, ca = sd.kmeans(x, 12, 2, generator=torch.Generator().manual_seed(7))
    lb, cb = sd.kmeans(x, 12, 2, generator=torch.Generator().manual_seed(7))
    assert torch.equal(la, lb) and torch.equal(ca, cb)


def test_kmeans_degenerate_and_low_precision_inputs():
    # 3 distinct points, 5 clusters: seeding repeats points, labels stay in range
    x = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]]).repeat(1, 40, 1).reshape(1, 120, 2).repeat(2, 1, 1)
    labels, cent = sd.kmeans(x, 5, 3, generator=torch.Generator().manual_seed(0))
    assert labels.min() >= 0 and labels.max() < 5 and torch.isfinite(cent).all()
    assert torch.equal(cent.gather(1, labels.unsqueeze(-1).expand(-1, -1, 2)), x)
    xb = torch.from_numpy(blobs(5, 2, 300, 16)).bfloat16()
    lb, cb = sd.kmeans(xb, 8, 2, generator=torch.Generator().manual_seed(0))
    assert lb.shape == (2, 300) and cb.dtype == torch.float32
    with pytest.raises(ValueError, match="k=301"):
        sd.kmeans(xb, 301, 1)
    with pytest.raises(ValueError, match="init"):
        sd.kmeans(xb, 8, 1, init=torch.zeros(2, 7, 16))


# --- partition slots -----------------------------------------------------------------------------
def label_cases(seed):
    """(name, labels [N, tokens] int64, num_groups) covering empty groups, one group, singletons."""
    rng = np.random.default_rng(seed)
    t = 200
    rows_random = rng.integers(0, 12, size=(3, t))
    rows_random[1] = rng.choice([0, 3, 7, 29], size=t)  # most of the 30 groups empty
    skewed = np.where(rng.random((2, t)) < 0.9, 5, rng.integers(0, 30, size=(2, t)))
    return [
        ("random", np.concatenate([rows_random, skewed]), 30),
        ("one group", np.stack([np.zeros(t, np.int64), np.full(t, 3)]), 4),
        ("only group", np.zeros((2, t), np.int64), 1),
        ("singletons", np.stack([rng.permutation(t), np.arange(t)]), t),
        # the widest int16 keys' bound and past it (int32 keys)
        (
            "many groups",
            np.stack([rng.integers(2**15 - 40, 2**15 - 1, t), rng.integers(0, 40_000, t)]),
            40_000,
        ),
        ("int16 bound", np.stack([rng.integers(2**15 - 40, 2**15 - 2, t), np.full(t, 2**15 - 3)]), 2**15 - 2),
    ]


@pytest.mark.parametrize("block_size", [16, 64, 128])
@pytest.mark.parametrize("case", range(6))
def test_partition_slots_matches_partition_layout(case, block_size):
    name, labels, groups = label_cases(case + 10 * block_size)[case]
    lay = sd.partition_slots(torch.from_numpy(labels), groups, block_size)
    n, t = labels.shape
    bound = sd.max_slots_bound(t, groups, block_size)
    assert lay.max_slots == bound and lay.max_blocks == bound // block_size
    assert lay.valid.dtype == torch.bool and lay.token_slot.dtype == torch.int64
    for r in range(n):
        host = partition_layout(labels[r], block_size, groups)
        ns, nb = host.num_slots, host.num_blocks
        assert int(lay.num_slots[r]) == ns <= bound, name
        np.testing.assert_array_equal(lay.token_slot[r].numpy(), host.token_slot)
        np.testing.assert_array_equal(lay.valid[r, :ns].numpy(), host.valid)
        assert not lay.valid[r, ns:].any()
        np.testing.assert_array_equal(lay.block_group[r, :nb].numpy(), host.block_group)
        assert torch.all(lay.block_group[r, nb:] == -1)
        np.testing.assert_array_equal(lay.group_sizes[r].numpy(), np.bincount(labels[r], minlength=groups))
        np.testing.assert_array_equal(lay.block_rows[r, :nb].numpy(), host.valid_rows)
        np.testing.assert_array_equal(lay.block_pages[r, :nb].numpy(), host.live_pages)
        assert not lay.block_rows[r, nb:].any() and not lay.block_pages[r, nb:].any()


def test_max_slots_bound_is_reached_and_checked():
    # every token its own group: each takes a whole block, exactly the bound
    assert sd.max_slots_bound(200, 200, 128) == 200 * 128
    assert sd.max_slots_bound(200, 1000, 16) == 200 * 16
    assert sd.max_slots_bound(100, 1, 64) == 128
    labels = torch.arange(200).unsqueeze(0)
    assert int(sd.partition_slots(labels, 200, 128).num_slots[0]) == 200 * 128
    wide = sd.partition_slots(labels, 200, 128, max_slots=201 * 128)
    assert wide.max_slots == 201 * 128 and int(wide.block_group[0, -1]) == -1
    for bad in (200 * 128 - 128, 200 * 128 + 16):
        with pytest.raises(ValueError, match="max_slots"):
            sd.partition_slots(labels, 200, 128, max_slots=bad)
    with pytest.raises(ValueError, match="block_size"):
        sd.partition_slots(labels, 200, 24)


def test_scatter_and_gather_slots_round_trip():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 9, size=(3, 250))
    lay = sd.partition_slots(torch.from_numpy(labels), 9, 32)
    x = torch.randn(3, 250, 8, dtype=torch.float64, requires_grad=True)
    y = sd.scatter_to_slots(x, lay.token_slot, lay.max_slots)
    assert y.shape == (3, lay.max_slots, 8)
    for r in range(3):
        host = partition_layout(labels[r], 32, 9)
        np.testing.assert_array_equal(y[r, : host.num_slots].detach().numpy(), host.to_slots(x[r].detach()))
        assert not y[r, host.num_slots :].any()
    back = sd.gather_from_slots(y, lay.token_slot)
    assert torch.equal(back, x)
    (back * 2).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


# --- selection -----------------------------------------------------------------------------------
def host_mask(qc, kc, sizes, head_dim, top_p, min_fraction):
    out = np.zeros((qc.shape[0], kc.shape[0]), bool)
    with np.errstate(invalid="ignore"):
        i, j = svg2_select(qc, kc, sizes, head_dim, top_p, min_fraction)
    out[i, j] = True
    return out


def select_cases(seed):
    rng = np.random.default_rng(seed)
    n, cq, ck, d = 5, 12, 40, 8
    qc, kc = rng.normal(size=(n, cq, d)), rng.normal(size=(n, ck, d))
    sizes = rng.integers(0, 20, size=(n, ck))
    sizes[:, ::7] = 0
    sizes[0, 5:] = 0  # few live clusters
    # ties: small integer centroids and sizes, so equal scores are bit-equal on both sides
    qt = rng.integers(-1, 2, size=(n, cq, 4)).astype(np.float64)
    kt = rng.integers(-1, 2, size=(n, ck, 4)).astype(np.float64)
    st = rng.integers(0, 3, size=(n, ck))
    st[1] = 0  # a row with no live K cluster selects nothing
    return [(qc, kc, sizes, d), (qt, kt, st, 4), (qc * 4, kc * 4, sizes, d)]


@pytest.mark.parametrize("top_p, min_fraction", [(0.3, 0.0), (0.9, 0.1), (0.5, 0.5), (1.0, 0.0), (0.2, 1.0)])
@pytest.mark.parametrize("case", range(3))
def test_svg2_select_matches_host(case, top_p, min_fraction):
    qc, kc, sizes, d = select_cases(case)[case]
    mask = sd.svg2_select(
        torch.from_numpy(qc), torch.from_numpy(kc), torch.from_numpy(sizes), d, top_p, min_fraction
    )
    assert mask.dtype == torch.bool and mask.shape == (qc.shape[0], qc.shape[1], kc.shape[1])
    for r in range(qc.shape[0]):
        np.testing.assert_array_equal(
            mask[r].numpy(), host_mask(qc[r], kc[r], sizes[r], d, top_p, min_fraction)
        )
    assert not (mask & (torch.from_numpy(sizes) == 0).unsqueeze(1)).any()


def test_svg2_select_ties_are_present_and_float32_agrees():
    qc, kc, sizes, d = select_cases(1)[1]
    logits = np.einsum("nqd,nkd->nqk", qc, kc) / 2 + np.log(np.maximum(sizes, 1))[:, None, :]
    assert any(
        np.unique(row[sizes[r] > 0]).size < (sizes[r] > 0).sum() for r in range(5) for row in logits[r]
    )
    qc, kc, sizes, d = select_cases(0)[0]
    args = (torch.from_numpy(sizes), d, 0.9, 0.1)
    m64 = sd.svg2_select(torch.from_numpy(qc), torch.from_numpy(kc), *args)
    m32 = sd.svg2_select(torch.from_numpy(qc).float(), torch.from_numpy(kc).float(), *args)
    assert torch.equal(m32, m64)


def test_svg2_select_never_picks_empty_clusters_on_underflow():
    # every live cluster's p underflows to 0 but the winner's; min_fraction=1 keeps every live one.
    # (The host rule ties the underflowed live clusters with the empty ones at p == 0 and takes the
    # lowest indices, empty or not; here empty clusters never count.)
    qc = np.array([[[1.0, 0.0]]])
    kc = np.array([[[0.0, 0.0], [2000.0, 0.0], [0.0, 0.0], [-2000.0, 0.0], [0.0, 0.0]]])
    sizes = np.array([[0, 1, 3, 2, 4]])
    mask = sd.svg2_select(torch.from_numpy(qc), torch.from_numpy(kc), torch.from_numpy(sizes), 1, 0.5, 1.0)
    assert mask[0, 0].tolist() == [False, True, True, True, True]


# --- block mask and the whole step ---------------------------------------------------------------
def host_block_mask(q_lab, k_lab, mask, block_size, cq, ck):
    q_lay = partition_layout(q_lab, block_size, cq)
    k_lay = partition_layout(k_lab, block_size, ck)
    return graph_from_group_masks(q_lay, k_lay, [mask], q_groups=cq, k_groups=ck).block_mask()[0]


def check_block_mask(device_mask, host):
    nbq, nbk = host.shape
    np.testing.assert_array_equal(device_mask[:nbq, :nbk].numpy(), host)
    assert not device_mask[nbq:].any() and not device_mask[:, nbk:].any()


@pytest.mark.parametrize("block_size", [16, 64])
def test_cluster_block_mask_matches_graph_from_group_masks(block_size):
    rng = np.random.default_rng(block_size)
    n, cq, ck = 4, 7, 11
    q_lab = rng.integers(0, cq, size=(n, 300))
    k_lab = rng.integers(0, ck - 3, size=(n, 260))  # the last 3 K clusters are empty
    q_lab[0] = 2  # one Q cluster
    cmask = rng.random((n, cq, ck)) < 0.3
    q_lay = sd.partition_slots(torch.from_numpy(q_lab), cq, block_size)
    k_lay = sd.partition_slots(torch.from_numpy(k_lab), ck, block_size)
    bm = sd.cluster_block_mask(torch.from_numpy(cmask), q_lay.block_group, k_lay.block_group)
    assert bm.shape == (n, q_lay.max_blocks, k_lay.max_blocks)
    for r in range(n):
        check_block_mask(bm[r], host_block_mask(q_lab[r], k_lab[r], cmask[r], block_size, cq, ck))


def test_svg2_partition_step_matches_host_path():
    n, d, cq, ck, block_size = 3, 32, 10, 20, 32
    q = torch.from_numpy(blobs(20, n, 600, d))
    k = torch.from_numpy(blobs(21, n, 500, d))
    step = sd.svg2_partition_step(
        q, k, cq, ck, block_size, 0.9, 0.1, 3, generator=torch.Generator().manual_seed(0)
    )
    assert step.q_centroids.shape == (n, cq, d) and step.k_centroids.shape == (n, ck, d)
    for r in range(n):
        q_lab, k_lab = step.q_labels[r].numpy(), step.k_labels[r].numpy()
        qh, kh = q[r].numpy(), k[r].numpy()
        for lab, groups, lay in ((q_lab, cq, step.q_layout), (k_lab, ck, step.k_layout)):
            host = partition_layout(lab, block_size, groups)
            np.testing.assert_array_equal(lay.token_slot[r].numpy(), host.token_slot)
            np.testing.assert_array_equal(lay.block_group[r, : host.num_blocks].numpy(), host.block_group)
        qm, _ = group_means(q_lab, qh, cq)
        km, k_sizes = group_means(k_lab, kh, ck)
        np.testing.assert_array_equal(step.k_sizes[r].numpy(), k_sizes)
        cmask = host_mask(qm, km, k_sizes, d, 0.9, 0.1)
        np.testing.assert_array_equal(step.cluster_mask[r].numpy(), cmask)
        check_block_mask(step.block_mask[r], host_block_mask(q_lab, k_lab, cmask, block_size, cq, ck))
    assert 0 < step.block_mask.float().mean() < 1
    # warm start: zero Lloyd steps from the returned centroids give back the same labels
    again = sd.svg2_partition_step(
        q, k, cq, ck, block_size, 0.9, 0.1, 0, q_init=step.q_centroids, k_init=step.k_centroids
    )
    assert torch.equal(again.q_labels, step.q_labels) and torch.equal(again.k_labels, step.k_labels)


def test_selected_pair_fraction_is_the_token_mask_density():
    q = torch.from_numpy(blobs(22, 2, 300, 16))
    k = torch.from_numpy(blobs(23, 2, 250, 16))
    step = sd.svg2_partition_step(q, k, 6, 9, 16, 0.7, 0.1, 2, generator=torch.Generator().manual_seed(1))
    tokens = sd.cluster_pair_mask(step.cluster_mask, step.q_labels, step.k_labels)  # [2, 300, 250]
    got = sd.selected_pair_fraction(step)
    assert got.dtype == torch.float64 and got.shape == (2,)
    torch.testing.assert_close(got, tokens.double().mean((1, 2)), rtol=0, atol=1e-12)
    assert 0 < got.min() and got.max() < 1


def test_static_shapes_on_meta_tensors():
    """Every step runs on meta tensors (no data): no output shape depends on values, nothing reads
    a value back to the host."""
    n, d, cq, ck = 2, 16, 6, 9
    meta = torch.device("meta")
    q, k = torch.empty(n, 300, d, device=meta), torch.empty(n, 200, d, device=meta)
    qi, ki = torch.empty(n, cq, d, device=meta), torch.empty(n, ck, d, device=meta)
    step = sd.svg2_partition_step(q, k, cq, ck, 32, 0.9, 0.1, 2, q_init=qi, k_init=ki)
    assert step.block_mask.shape == (
        n,
        sd.max_slots_bound(300, cq, 32) // 32,
        sd.max_slots_bound(200, ck, 32) // 32,
    )
    assert step.q_layout.valid.shape == (n, sd.max_slots_bound(300, cq, 32))
    assert sd.kmeans_pp_init(q, cq).shape == (n, cq, d)


def test_last_step_labels_pair_with_their_cluster_means():
    """``final_assign=False`` (SVG2's own pairing): the labels are the last Lloyd step's assignment, the
    centroids its cluster means (empty clusters keep theirs), and lloyd's sums and sizes are those clusters'."""
    x = torch.from_numpy(blobs(5, 3, 600, 16))
    init = x[:, :20].clone()
    labels, cent, sums, sizes = sd.lloyd(x, 20, 2, init, final_assign=False)
    _, before = sd.kmeans(x, 20, 1, init)  # the centroids the last step assigned to
    assert torch.equal(labels, sd.nearest_centroid(x, before))
    means, counts = sd.cluster_means(x, labels, 20)
    assert torch.equal(counts, sizes.long())
    occupied = (counts > 0).unsqueeze(-1)
    torch.testing.assert_close(torch.where(occupied, cent, means), means)
    torch.testing.assert_close(sums / sizes.clamp_min(1).unsqueeze(-1), means)
    with pytest.raises(ValueError, match="iters >= 1"):
        sd.lloyd(x, 20, 0, init, final_assign=False)


def test_last_step_without_its_sums():
    """``last_sums=False``: the same labels as ``final_assign=False``, the centroids they were assigned to,
    no sums; it needs the last step's labels."""
    x = torch.from_numpy(blobs(5, 3, 600, 16))
    init = x[:, :20].clone()
    labels, cent, sums, sizes = sd.lloyd(x, 20, 2, init, final_assign=False, last_sums=False)
    _, before = sd.kmeans(x, 20, 1, init)
    assert torch.equal(labels, sd.lloyd(x, 20, 2, init, final_assign=False)[0])
    assert torch.equal(cent, before) and sums is None and sizes is None
    with pytest.raises(ValueError, match="last_sums=False needs final_assign=False"):
        sd.lloyd(x, 20, 2, init, last_sums=False)


def test_slot_sum_index_names_each_slots_group():
    labels = torch.tensor([[2, 0, 2, 2, 1], [1, 1, 1, 1, 1]])
    lay = sd.partition_slots(labels, 3, 16)
    index = sd.slot_sum_index(lay).view(2, lay.max_slots)
    for r in range(2):
        for s in range(lay.max_slots):
            block = s // 16
            group = int(lay.block_group[r, block])
            assert int(index[r, s]) == (-1 if group < 0 else 3 * r + group)


@pytest.mark.parametrize("side_stream", [False, True], ids=["one_stream", "side_stream_asked"])
@pytest.mark.parametrize("block_size", [16, 64])
def test_step_in_slots_matches_the_partition_step(block_size, side_stream, monkeypatch):
    """svg2_step_in_slots: the last step's sums taken while q and k move to slots give the partition
    step's labels, layouts, centroids, selection and the same slot tensors (with ``SIDE_STREAM`` asked
    for, CPU tensors keep the one-stream order)."""
    monkeypatch.setattr(sd, "SIDE_STREAM", side_stream)
    g = torch.Generator().manual_seed(block_size)
    q = torch.from_numpy(blobs(6, 2, 500, 16))
    k = torch.from_numpy(blobs(7, 2, 500, 16))
    v = torch.randn(2, 500, 16, generator=g)
    args = (12, 30, block_size, 0.7, 0.1, 2, q[:, :12].clone(), k[:, :30].clone())
    want = sd.svg2_partition_step(q, k, *args, final_assign=False)
    marks = []
    got, qs, ks, vs, _ = sd.svg2_step_in_slots(q, k, v, *args, mark=marks.append)
    assert marks == ["kmeans_q", "kmeans_k", "layouts", "to_slots", "select"]
    for name in ("q_labels", "k_labels", "k_sizes", "cluster_mask", "block_mask"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    for name in ("q_centroids", "k_centroids"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name))
    assert torch.equal(got.q_layout.token_slot, want.q_layout.token_slot)
    ql, kl = want.q_layout, want.k_layout
    assert torch.equal(qs, sd.scatter_to_slots(q, ql.token_slot, ql.max_slots))
    assert torch.equal(ks, sd.scatter_to_slots(k, kl.token_slot, kl.max_slots))
    assert torch.equal(vs, sd.scatter_to_slots(v, kl.token_slot, kl.max_slots))
    with pytest.raises(ValueError, match="v must have k's shape"):
        sd.svg2_step_in_slots(q, k, v[:, :-1], *args)
    marks = []  # with a plan, beside asked for: CPU tensors keep the one-stream order
    again = sd.svg2_step_in_slots(q, k, v, *args, mark=marks.append, plan="clusters", beside=True)
    assert marks == ["kmeans_q", "kmeans_k", "layouts", "to_slots", "select", "plan_fwd"]
    assert torch.equal(again[4].item_streams(), again[0].forward_work_list("clusters").item_streams())


def test_partition_step_with_last_step_labels_matches_its_own_means():
    """svg2_partition_step(final_assign=False) selects on the means of the labels it returns."""
    q = torch.from_numpy(blobs(6, 2, 500, 16))
    k = torch.from_numpy(blobs(7, 2, 500, 16))
    step = sd.svg2_partition_step(q, k, 12, 30, 64, 0.7, 0.1, 2, q[:, :12], k[:, :30], final_assign=False)
    q_means, _ = sd.cluster_means(q, step.q_labels, 12)
    k_means, k_sizes = sd.cluster_means(k, step.k_labels, 30)
    want = sd.svg2_select(q_means.double(), k_means.double(), k_sizes, 16, 0.7, 0.1)
    assert torch.equal(step.cluster_mask, want)
    assert torch.equal(step.k_sizes, k_sizes)


@pytest.mark.parametrize("final_assign", [True, False])
def test_svg2_step_bench_pipeline_on_the_cpu(final_assign):
    """The timed call of ``svg2_step_bench`` (k-means, layouts, selection, slots, work list, the kernel's
    emulator, back to tokens) against float64 attention over the selected cluster pairs."""
    from types import SimpleNamespace

    from sparseattn.svg2_step_bench import check_head0, one_call

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 300, 64, generator=g) for _ in range(3))
    sel = SimpleNamespace(q_clusters=6, k_clusters=15, top_p=0.8, min_fraction=0.1)
    init = (q[:, :6].clone(), k[:, :15].clone())
    out, state = one_call(q, k, v, sel, 64, init, "torch", 2, None, final_assign)
    assert out.shape == q.shape
    assert check_head0(q, k, v, out, state, samples=64) < 1e-5
    if not final_assign:  # the last step's sums taken while the tokens move: the same call
        again, state_in_slots = one_call(q, k, v, sel, 64, init, "torch", 2, None, False, in_slots=True)
        assert torch.equal(state_in_slots["mask"], state["mask"])
        torch.testing.assert_close(again, out)
        # planned by clusters (the forward's streams shared by a cluster's blocks): the same call
        by_clusters, _ = one_call(
            q, k, v, sel, 64, init, "torch", 2, None, False, in_slots=True, plan="clusters"
        )
        torch.testing.assert_close(by_clusters, again)


def test_wgmma_assignment_refuses_what_it_cannot_run():
    """The tensor-core assignment names the argument before any launch (its results: the GPU tests)."""
    from sparseattn.kernels.kmeans_assign import nearest_centroid_wgmma

    x = torch.randn(2, 40, 64)
    with pytest.raises(ValueError, match="x must be a bf16 CUDA tensor"):
        nearest_centroid_wgmma(x, torch.randn(2, 4, 64))
    with pytest.raises(ValueError, match="x must be a bf16 CUDA tensor"):
        sd.lloyd(x, 4, 1, x[:, :4], assign="wgmma")
    with pytest.raises(ValueError, match="assign must be"):
        sd.lloyd(x, 4, 1, x[:, :4], assign="tensor cores")


def test_wgmma_lloyd_step_names_an_unknown_sum_method(monkeypatch):
    """An unknown way to form the cluster sums raises before any launch, naming the argument or the
    environment variable it came from; ``"auto"`` presums up to PRESUM_MAX_CLUSTERS clusters."""
    from sparseattn.kernels import kmeans_assign as ka

    x = torch.randn(2, 40, 64)
    with pytest.raises(ValueError, match="sums must be 'auto' or one of"):
        ka.lloyd_step_wgmma(x, torch.randn(2, 4, 64), sums="shared")
    monkeypatch.setattr(ka, "SUMS", "tensor cores")
    with pytest.raises(ValueError, match="SPARSEATTN_KMEANS_SUMS"):
        ka.lloyd_step_wgmma(x, torch.randn(2, 4, 64))
    assert ka._sum_method_code("auto", ka.PRESUM_MAX_CLUSTERS) == ka.SUM_METHODS["presum"]
    assert ka._sum_method_code("auto", ka.PRESUM_MAX_CLUSTERS + 1) == ka.SUM_METHODS["atomics"]
    assert ka._sum_method_code(ka._sum_method("mma"), 3) == ka.SUM_METHODS["mma"]


def test_svg2_step_bench_summary_reports_the_queued_timing_beside_the_in_order_one():
    """The bench's summary gives the overhead of each timed method, the queued one (GPU time alone) too."""
    from sparseattn.svg2_step_bench import QUEUED, summary

    parts = dict(kmeans_q=3.0, kmeans_k=5.0, layouts_select=2.0, plan_fwd=1.0, kernel_fwd=55.0)
    records = [
        dict(part=p, assign=a, time_ms=t) for a in ("wgmma_last_step", QUEUED) for p, t in parts.items()
    ]
    records[-3]["time_ms"] = 1.5  # the queued layouts and selection
    lines = summary(records)
    assert len(lines) == 2 and lines[1].startswith(f"assign={QUEUED}:")
    assert "= 11.00 ms = 20.0% of the kernel" in lines[0] and "= 10.50 ms = 19.1% of the kernel" in lines[1]


def test_svg2_step_bench_summary_counts_what_v_move_did_not_hide():
    """The beside method's overhead is its parts plus its move to slots less the in-order method's of the
    same run (what of the selection and plan v's move did not hide); without that method it says so."""
    from sparseattn.svg2_step_bench import IN_SLOTS_BESIDE, IN_SLOTS_CLUSTERS, summary

    parts = dict(
        kmeans_q=1.5, kmeans_k=3.5, layouts=0.4, select=0.5, plan_fwd=0.5, to_slots=3.0, kernel_fwd=57.0
    )
    beside = dict(parts, select=0.0, plan_fwd=0.0, to_slots=3.2)
    records = [dict(part=p, assign=IN_SLOTS_CLUSTERS, time_ms=t) for p, t in parts.items()]
    records += [dict(part=p, assign=IN_SLOTS_BESIDE, time_ms=t) for p, t in beside.items()]
    for r in records:  # as _Marks.elapsed merges them
        if r["part"] in ("layouts", "select"):
            r["part"] = "layouts_select"
            r["time_ms"] = (parts if r["assign"] == IN_SLOTS_CLUSTERS else beside)["layouts"] + (
                parts if r["assign"] == IN_SLOTS_CLUSTERS else beside
            )["select"]
    lines = summary(records)
    assert "= 6.40 ms = 11.2% of the kernel" in lines[0]
    assert lines[1].startswith(f"assign={IN_SLOTS_BESIDE}:") and "not hidden by v's move 0.20" in lines[1]
    assert "= 5.60 ms = 9.8% of the kernel" in lines[1]
    alone = summary([r for r in records if r["assign"] == IN_SLOTS_BESIDE])
    assert alone == [f"assign={IN_SLOTS_BESIDE}: its overhead needs {IN_SLOTS_CLUSTERS} in the same run"]


def test_layout_slots_form_is_checked_and_the_cpu_keeps_the_sort(monkeypatch):
    """``LAYOUT_SLOTS``: an unknown form raises, naming the variable, before any work; ``"counts"`` on CPU
    tensors (no counting kernels there) gives the sort's layout."""
    labels = torch.randint(0, 9, (3, 301), generator=torch.Generator().manual_seed(4))
    want = sd.partition_slots(labels, 9, 32)
    monkeypatch.setattr(sd, "LAYOUT_SLOTS", "radix")
    with pytest.raises(ValueError, match="SPARSEATTN_SVG2_LAYOUT_SLOTS"):
        sd.partition_slots(labels, 9, 32)
    monkeypatch.setattr(sd, "LAYOUT_SLOTS", "counts")
    assert_layouts_equal(sd.partition_slots(labels, 9, 32), want)


def test_a_kmeans_update_form_not_known_is_refused_before_any_work(monkeypatch):
    """``KMEANS_UPDATE`` is checked when :func:`lloyd` starts, on any device; ``"fused"`` on CPU tensors
    (no Triton there) keeps torch's updates."""
    x = torch.from_numpy(blobs(6, 2, 200, 16))
    monkeypatch.setattr(sd, "KMEANS_UPDATE", "numpy")
    with pytest.raises(ValueError, match=r"KMEANS_UPDATE \(SPARSEATTN_KMEANS_UPDATE\) must be one of"):
        sd.lloyd(x, 5, 1, x[:, :5].clone())
    monkeypatch.setattr(sd, "KMEANS_UPDATE", "fused")
    got = sd.lloyd(x, 5, 2, x[:, :5].clone())
    monkeypatch.setattr(sd, "KMEANS_UPDATE", "torch")
    want = sd.lloyd(x, 5, 2, x[:, :5].clone())
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_a_layout_blocks_form_not_known_is_refused_before_any_work(monkeypatch):
    """``LAYOUT_BLOCKS`` is checked at each layout; ``"triton"`` on CPU tensors (no Triton there) gives the
    torch form's layout."""
    labels = torch.randint(0, 9, (3, 301), generator=torch.Generator().manual_seed(5))
    want = sd.partition_slots(labels, 9, 32)
    monkeypatch.setattr(sd, "LAYOUT_BLOCKS", "numpy")
    with pytest.raises(ValueError, match=r"LAYOUT_BLOCKS \(SPARSEATTN_SVG2_LAYOUT_BLOCKS\) must be one of"):
        sd.partition_slots(labels, 9, 32)
    monkeypatch.setattr(sd, "LAYOUT_BLOCKS", "triton")
    assert_layouts_equal(sd.partition_slots(labels, 9, 32), want)


#: The tensors of a :class:`~sparseattn.svg2_device.DeviceLayout`.
LAYOUT_TENSORS = tuple(f.name for f in dataclasses.fields(sd.DeviceLayout) if f.name != "block_size")


def assert_layouts_equal(got, want, context=()) -> None:
    """Two device layouts hold the same tensors, dtypes included."""
    for name in LAYOUT_TENSORS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), (*context, name)


def test_k_layout_beside_is_a_no_op_off_the_gpu_and_rows_may_come_late():
    """``fit_for_slots(k_beside=True)`` on CPU tensors (no side stream) joins nothing and gives the same
    layouts; ``slots_and_step`` takes K's slot rows as a function as well as a tensor, the same tensors."""
    q = torch.from_numpy(blobs(6, 2, 500, 16))
    k = torch.from_numpy(blobs(7, 2, 500, 16))
    v = torch.randn(2, 500, 16, generator=torch.Generator().manual_seed(3))
    init = (q[:, :12].clone(), k[:, :30].clone())
    want = sd.fit_for_slots(q, k, 12, 30, 64, 2, *init)
    got = sd.fit_for_slots(q, k, 12, 30, 64, 2, *init, k_beside=True)
    assert not got.k_join
    for a, b in ((got.q_layout, want.q_layout), (got.k_layout, want.k_layout)):
        for name in LAYOUT_TENSORS:
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    rows = lambda lay: sd.slot_rows(lay.token_slot, lay.max_slots).reshape(-1)
    flat = [x.reshape(-1, 16) for x in (q, k, v)]
    q_rows, k_rows = rows(got.q_layout), rows(got.k_layout)
    late = sd.slots_and_step(got, *flat, q_rows, lambda: k_rows, 0.7, 0.1)
    now = sd.slots_and_step(got, *flat, q_rows, k_rows, 0.7, 0.1)
    for a, b in zip(late[:3], now[:3]):
        assert torch.equal(a, b)
    assert torch.equal(late[3].cluster_mask, now[3].cluster_mask)


def test_a_select_means_form_not_known_is_refused_and_the_cpu_keeps_torchs(monkeypatch):
    """``SELECT_MEANS`` is checked at each step from the slots' sums; ``"fused"`` on CPU tensors (no Triton
    there) gives the torch form's step."""
    q = torch.from_numpy(blobs(6, 2, 500, 16))
    k = torch.from_numpy(blobs(7, 2, 500, 16))
    v = torch.randn(2, 500, 16, generator=torch.Generator().manual_seed(2))
    args = (12, 30, 64, 0.7, 0.1, 2, q[:, :12].clone(), k[:, :30].clone())
    monkeypatch.setattr(sd, "SELECT_MEANS", "torch")
    want = sd.svg2_step_in_slots(q, k, v, *args)[0]
    monkeypatch.setattr(sd, "SELECT_MEANS", "fused")
    got = sd.svg2_step_in_slots(q, k, v, *args)[0]
    for name in ("cluster_mask", "k_sizes", "q_centroids", "k_centroids"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    monkeypatch.setattr(sd, "SELECT_MEANS", "numpy")
    with pytest.raises(ValueError, match=r"SELECT_MEANS \(SPARSEATTN_SVG2_SELECT_MEANS\) must be one of"):
        sd.svg2_step_in_slots(q, k, v, *args)
