"""Sparse-graph builders: STA / SSTA / VSA / SVG2 selections, random / mask / list graphs, synthetic Q/K."""

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseattn.builders import (
    BuilderError,
    block_list_graph,
    graph_from_group_masks,
    group_means,
    random_graph,
    ssta_graph,
    sta_graph,
    sta_tile_pairs,
    svg2_graph,
    svg2_select,
    token_mask_graph,
    vsa_graph,
)
from sparseattn.layouts import contiguous_layout, partition_layout, video_layout
from sparseattn.synthetic import (
    SyntheticError,
    grid_positions,
    synthetic_factors,
    synthetic_head_factors,
    synthetic_qk,
    synthetic_qk_tokens,
)


def pair_set(graph, head=0):
    h, i, j = graph.pairs
    return set(zip(i[h == head].tolist(), j[h == head].tolist()))


def useful_pairs(graph):
    _, i, j = graph.pairs
    return int((graph.q.valid_rows[i] * graph.k.valid_rows[j]).sum())


# --- STA ------------------------------------------------------------------------------------------
def test_sta_anchor_layout_matches_measured_counts():
    """Wan 720p latent, 4x4x8 tiles, B=128, prefix, 3x3x3 window: anchors/peers_probe.log measured
    15232 selected blocks and 196,376,320 useful pairs per head (window cut at the borders, |Δ| <= 1)."""
    g = sta_graph((21, 45, 80), (4, 4, 8), (3, 3, 3), heads=2, block_size=128, padding="prefix", clamp=False)
    assert g.head_nnz().tolist() == [15232, 15232]
    assert useful_pairs(g.select_heads([0])) == 196_376_320
    # Independent count: the cut window is separable per axis; Σ_{|a-b|<=1} e_a e_b per axis (e = tile extents).
    expected_pairs, expected_useful = 1, 1
    for size, t in zip((21, 45, 80), (4, 4, 8)):
        ext = np.minimum(t, size - t * np.arange(-(-size // t)))
        near = np.abs(np.subtract.outer(np.arange(ext.size), np.arange(ext.size))) <= 1
        expected_pairs *= int(near.sum())
        expected_useful *= int((near * np.outer(ext, ext)).sum())
    assert (expected_pairs, expected_useful) == (15232, 196_376_320)


def test_sta_clamped_window_keeps_full_size():
    g = sta_graph((21, 45, 80), (4, 4, 8), (3, 3, 3), heads=1)
    assert g.nnz == 720 * 27  # every one of the 6x12x10 tiles sees a full 3x3x3 window
    assert np.all(np.diff(g.indptr) == 27)


@pytest.mark.parametrize(
    "clamp, expected",
    [
        (True, {0: [0, 1, 2], 1: [0, 1, 2], 2: [1, 2, 3], 3: [2, 3, 4], 4: [2, 3, 4]}),
        (False, {0: [0, 1], 1: [0, 1, 2], 2: [1, 2, 3], 3: [2, 3, 4], 4: [3, 4]}),
    ],
    ids=["clamped", "cut"],
)
def test_sta_window_borders_1d(clamp, expected):
    qt, kt = sta_tile_pairs((1, 1, 5), (1, 1, 3), clamp=clamp)
    got = {c: sorted(kt[qt == c].tolist()) for c in range(5)}
    assert got == expected


def test_sta_even_window_clamped():
    qt, kt = sta_tile_pairs((1, 1, 4), (1, 1, 2), clamp=True)
    got = {c: sorted(kt[qt == c].tolist()) for c in range(4)}
    assert got == {0: [0, 1], 1: [0, 1], 2: [1, 2], 3: [2, 3]}


def test_sta_corner_tile_3d():
    qt, kt = sta_tile_pairs((3, 4, 5), (3, 3, 3), clamp=True)
    corner = sorted(kt[qt == 0].tolist())
    assert corner == sorted((a * 4 + b) * 5 + c for a in range(3) for b in range(3) for c in range(3))
    last = 3 * 4 * 5 - 1  # tile (2, 3, 4): window shifted to t 0..2, h 1..3, w 2..4
    assert sorted(kt[qt == last].tolist()) == sorted(
        (a * 4 + b) * 5 + c for a in range(3) for b in range(1, 4) for c in range(2, 5)
    )


@settings(deadline=None, max_examples=40)
@given(n=st.tuples(*[st.integers(1, 6)] * 3), data=st.data(), clamp=st.booleans())
def test_sta_tile_pairs_match_brute_force(n, data, clamp):
    w = tuple(data.draw(st.integers(1, n_a)) for n_a in n)
    qt, kt = sta_tile_pairs(n, w, clamp=clamp)
    coords = list(itertools.product(*(range(v) for v in n)))
    expected = set()
    for qi, qc in enumerate(coords):
        for ki, kc in enumerate(coords):
            ok = True
            for a in range(3):
                lo = qc[a] - w[a] // 2
                if clamp:
                    lo = min(max(lo, 0), n[a] - w[a])
                ok &= lo <= kc[a] < lo + w[a]
            if ok:
                expected.add((qi, ki))
    assert set(zip(qt.tolist(), kt.tolist())) == expected


def test_sta_tile_expands_to_block_pairs_and_drops_empty_blocks():
    # 6x8x8 = 384 slots = three 128-blocks; the second tile holds 6x8x4 = 192 tokens -> blocks 128, 64, 0.
    g = sta_graph((6, 8, 12), (6, 8, 8), (1, 1, 2), heads=3)
    assert g.q.valid_rows.tolist() == [128, 128, 128, 128, 64, 0]
    assert g.head_nnz().tolist() == [25, 25, 25]  # 5 non-empty blocks, every pair selected
    g1 = sta_graph((6, 8, 16), (6, 8, 8), (1, 1, 1), heads=1)
    assert pair_set(g1) == {
        (i, j) for t in range(2) for i in range(3 * t, 3 * t + 3) for j in range(3 * t, 3 * t + 3)
    }


def test_sta_per_head_windows():
    g = sta_graph((8, 8, 8), (2, 2, 2), [(1, 1, 1), (3, 3, 3)], heads=2, block_size=16)
    assert g.head_nnz().tolist() == [64, 64 * 27]


@pytest.mark.parametrize(
    "window, needle",
    [
        ((3, 3, 11), "window[2]=11 is wider than the tile grid (10 tiles along axis 2)"),
        ((0, 3, 3), "window entries must be positive"),
        ((3, 3), "window must be three integers"),
        ("3x3x3", "window must be three integers"),
    ],
    ids=["too-wide", "zero", "two-entries", "string"],
)
def test_sta_bad_window(window, needle):
    with pytest.raises(BuilderError, match="window") as err:
        sta_graph((21, 45, 80), (4, 4, 8), window)
    assert needle in str(err.value)


# --- group means / VSA ----------------------------------------------------------------------------
def test_group_means_use_present_rows_only():
    x = np.arange(10, dtype=np.float32)[:, None]
    means, counts = group_means(np.array([0, 0, 2, 2, 2, 0, 2, 2, 2, 2]), x, 3)
    assert counts.tolist() == [3, 0, 7]
    np.testing.assert_allclose(means[:, 0], [(0 + 1 + 5) / 3, 0, (2 + 3 + 4 + 6 + 7 + 8 + 9) / 7], rtol=1e-6)


def test_vsa_partial_cube_mean_over_valid_tokens_only():
    # cube 0: 4x4x4 = 64 tokens with k = 1; cube 1: only 4x4x2 = 32 valid tokens with k = 1.5.
    # Valid-token mean ranks cube 1 first (1.5 > 1); a mean over all 64 slots (zeros) would give 0.75 < 1.
    grid = (4, 4, 6)
    pos = grid_positions(grid)
    q = np.ones((1, 96, 1), dtype=np.float32)
    k = np.where(pos[:, 2] < 4, 1.0, 1.5).astype(np.float32)[None, :, None]
    g = vsa_graph(grid, (4, 4, 4), topk=1, q=q, k=k)
    assert g.q.valid_rows.tolist() == [64, 32]
    assert pair_set(g) == {(0, 1), (1, 1)}


@pytest.mark.parametrize(
    "topk, per_row", [(2, 2), (4, 4), (5, 5), (10, 5)], ids=["k2", "k4", "k5", "k10>alive"]
)
def test_vsa_topk_count_is_min_of_k_and_nonempty_blocks(topk, per_row):
    # 6x8x12 in 6x8x8 tiles with B=128: blocks valid rows 128,128,128,128,64,0 -> 5 non-empty K blocks.
    g = vsa_graph((6, 8, 12), (6, 8, 8), topk=topk, heads=2, block_size=128, seed=3)
    counts = np.diff(g.indptr).reshape(2, 6)
    assert counts[:, :5].ravel().tolist() == [per_row] * 10
    assert counts[:, 5].tolist() == [0, 0]  # the empty Q block selects nothing
    assert 5 not in g.indices.tolist()  # the empty K block is never selected


def test_vsa_matches_brute_force_scores():
    rng = np.random.default_rng(7)
    grid, tile = (5, 6, 7), (2, 4, 4)
    layout = video_layout(grid, tile, 32)
    q = rng.standard_normal((2, 210, 8)).astype(np.float32)
    k = rng.standard_normal((2, 210, 8)).astype(np.float32)
    g = vsa_graph(grid, tile, topk=3, block_size=32, q=q, k=k)
    block = layout.token_slot // 32
    for h in range(2):
        qm = np.stack([q[h][block == b].mean(0) for b in range(layout.num_blocks)])
        km = np.stack([k[h][block == b].mean(0) for b in range(layout.num_blocks)])
        scores = qm @ km.T
        for i in range(layout.num_blocks):
            assert set(g.row(h, i).tolist()) == set(np.argsort(-scores[i])[:3].tolist())


# --- SSTA -----------------------------------------------------------------------------------------
def test_ssta_is_window_union_topk_tiles():
    rng = np.random.default_rng(11)
    grid, tile, window, topk = (6, 8, 12), (3, 4, 4), (1, 1, 1), 2
    n = math.prod(grid)
    q = rng.standard_normal((2, n, 4)).astype(np.float32)
    k = rng.standard_normal((2, n, 4)).astype(np.float32)
    g = ssta_graph(grid, tile, window, topk, block_size=32, q=q, k=k)
    layout = g.q
    tiles = layout.block_group[layout.token_slot // 32]
    nt = int(tiles.max()) + 1
    blocks_of = {t: np.flatnonzero((layout.block_group == t) & (layout.valid_rows > 0)) for t in range(nt)}
    for h in range(2):
        qm = np.stack([q[h][tiles == t].mean(0) for t in range(nt)])
        km = np.stack([k[h][tiles == t].mean(0) for t in range(nt)])
        expected = set()
        for i in range(nt):
            chosen = set(np.argsort(-(qm[i] @ km.T))[:topk].tolist()) | {
                i
            }  # window (1,1,1) = the tile itself
            expected |= {(a, b) for j in chosen for a in blocks_of[i] for b in blocks_of[j]}
        assert pair_set(g, h) == expected


def test_ssta_contains_sta_window_and_is_deterministic():
    args = {"grid": (12, 16, 24), "tile": (6, 8, 8), "window": (1, 2, 3), "block_size": 128}
    g = ssta_graph(topk=4, heads=3, seed=5, **args)
    sta = sta_graph(heads=3, **args)
    for h in range(3):
        assert pair_set(sta, h) <= pair_set(g, h)
    again = ssta_graph(topk=4, heads=3, seed=5, **args)
    other = ssta_graph(topk=4, heads=3, seed=6, **args)
    assert np.array_equal(g.indptr, again.indptr) and np.array_equal(g.indices, again.indices)
    assert not (np.array_equal(g.indptr, other.indptr) and np.array_equal(g.indices, other.indices))


# --- SVG2 -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "top_p, min_fraction, expected",
    [
        (0.4, 0.0, {2}),
        (0.7, 0.0, {2, 1}),
        (0.75, 0.0, {2, 1, 3}),
        (0.9, 0.0, {2, 1, 3}),
        (1.0, 0.0, {2, 1, 3, 0}),
        (0.4, 0.5, {2, 1}),
        (0.4, 0.6, {2, 1, 3}),
    ],
    ids=["p.4", "p.7", "p.75", "p.9", "p1", "p.4-min50%", "p.4-min60%"],
)
def test_svg2_select_hand_computed(top_p, min_fraction, expected):
    # Equal scores: p ∝ cluster size = [10, 30, 40, 20, 0] -> 0.1, 0.3, 0.4, 0.2; cluster 4 is empty.
    sizes = np.array([10, 30, 40, 20, 0])
    qc = np.zeros((1, 3), dtype=np.float32)
    kc = np.zeros((5, 3), dtype=np.float32)
    i, j = svg2_select(qc, kc, sizes, head_dim=3, top_p=top_p, min_fraction=min_fraction)
    assert set(j.tolist()) == expected and set(i.tolist()) == {0}


@settings(deadline=None, max_examples=50)
@given(
    seed=st.integers(0, 2**31 - 1),
    top_p=st.floats(0.01, 1.0),
    min_fraction=st.floats(0.0, 1.0),
    n_k=st.integers(1, 12),
)
def test_svg2_select_keeps_smallest_top_p_prefix(seed, top_p, min_fraction, n_k):
    rng = np.random.default_rng(seed)
    qc = rng.standard_normal((3, 4)).astype(np.float32)
    kc = rng.standard_normal((n_k, 4)).astype(np.float32)
    sizes = rng.integers(0, 5, n_k)
    sizes[0] = max(sizes[0], 1)
    i, j = svg2_select(qc, kc, sizes, head_dim=4, top_p=top_p, min_fraction=min_fraction)
    alive = np.flatnonzero(sizes > 0)
    for row in range(3):
        logits = (qc[row].astype(np.float64) @ kc[alive].T.astype(np.float64)) / 2.0
        p = sizes[alive] * np.exp(logits - logits.max())
        p /= p.sum()
        order = alive[np.argsort(-p, kind="stable")]
        cum = np.cumsum(np.sort(p)[::-1])
        need = int(np.searchsorted(cum, top_p * (1 - 1e-9))) + 1
        need = max(min(need, alive.size), math.ceil(min_fraction * alive.size - 1e-9))
        kept = j[i == row]
        assert kept.size == need
        assert set(kept.tolist()) == set(order[:need].tolist()) or np.isclose(
            np.sort(p)[::-1][need - 1], np.sort(p)[::-1][min(need, alive.size - 1)]
        )


def test_svg2_select_scores_weight_by_exp_logit():
    # logits q·k/sqrt(d) = [2, 0] with d = 4, sizes 1 and 5: p ∝ [e^2, 5] = [7.39, 5] -> cluster 0 first.
    qc = np.array([[2.0, 0, 0, 0]], dtype=np.float32)
    kc = np.array([[2.0, 0, 0, 0], [0, 0, 0, 0]], dtype=np.float32)
    _, j = svg2_select(qc, kc, np.array([1, 5]), head_dim=4, top_p=0.5, min_fraction=0.0)
    assert j.tolist() == [0]
    _, j = svg2_select(qc, kc, np.array([1, 8]), head_dim=4, top_p=0.5, min_fraction=0.0)
    assert j.tolist() == [1]


def test_svg2_graph_independent_partitions_per_head():
    graphs = svg2_graph(
        (4, 8, 8),
        heads=3,
        q_clusters=6,
        k_clusters=12,
        block_size=16,
        seed=1,
        top_p=0.5,
        min_fraction=0.25,
        workers=2,
    )
    assert len(graphs) == 3 and all(g.heads == 1 for g in graphs)
    for g in graphs:
        assert g.q.num_tokens == g.k.num_tokens == 256
        # every Q block of a cluster selects whole K clusters: at least ceil(0.25 * live clusters) of them
        live_k = np.unique(g.k.block_group[g.k.valid_rows > 0]).size
        for i in np.flatnonzero(g.q.valid_rows > 0):
            clusters = np.unique(g.k.block_group[g.row(0, i)])
            assert clusters.size >= math.ceil(0.25 * live_k)
            members = np.flatnonzero(np.isin(g.k.block_group, clusters) & (g.k.valid_rows > 0))
            assert np.array_equal(np.sort(g.row(0, i)), members)
    assert not np.array_equal(graphs[0].q.token_slot, graphs[1].q.token_slot)


def test_svg2_deterministic_and_worker_independent():
    args = {"grid": (4, 8, 8), "heads": 2, "q_clusters": 5, "k_clusters": 10, "block_size": 16}
    a = svg2_graph(seed=2, workers=1, **args)
    b = svg2_graph(seed=2, workers=2, **args)
    c = svg2_graph(seed=3, **args)
    for x, y in zip(a, b):
        assert np.array_equal(x.q.token_slot, y.q.token_slot) and np.array_equal(x.indices, y.indices)
    assert any(not np.array_equal(x.k.token_slot, z.k.token_slot) for x, z in zip(a, c))


def test_svg2_with_user_qk():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 300, 8)).astype(np.float32)
    k = rng.standard_normal((2, 300, 8)).astype(np.float32)
    graphs = svg2_graph(q=q, k=k, q_clusters=4, k_clusters=8, block_size=16)
    assert len(graphs) == 2 and all(g.q.num_tokens == 300 for g in graphs)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": "x"}, "top_p"),
        ({"min_fraction": -0.1}, "min_fraction"),
        ({"q_clusters": 0}, "q_clusters"),
        ({"k_clusters": 10_000}, "k_clusters"),
    ],
    ids=["p0", "p1.5", "p-str", "minfrac", "qc0", "kc-too-many"],
)
def test_svg2_bad_arguments(kwargs, field):
    with pytest.raises(BuilderError, match=field):
        svg2_graph((4, 8, 8), **{"q_clusters": 4, "k_clusters": 8, "block_size": 16, **kwargs})


# --- random / token mask / block list ------------------------------------------------------------------
def test_random_graph_row_counts_and_seed():
    layout = video_layout((6, 8, 12), (6, 8, 8), 128)  # 5 non-empty blocks of 6
    g = random_graph(layout, layout, heads=4, density=0.4, seed=1)
    counts = np.diff(g.indptr).reshape(4, 6)
    assert counts[:, :5].ravel().tolist() == [2] * 20 and counts[:, 5].tolist() == [0] * 4
    assert np.array_equal(g.indices, random_graph(layout, layout, 4, 0.4, seed=1).indices)
    assert not np.array_equal(g.indices, random_graph(layout, layout, 4, 0.4, seed=2).indices)


@pytest.mark.parametrize("density", [0, -0.5, 1.2, "dense"], ids=["zero", "negative", "above1", "string"])
def test_random_graph_bad_density(density):
    layout = contiguous_layout(64, 16)
    with pytest.raises(BuilderError, match="density"):
        random_graph(layout, layout, 1, density)


def test_token_mask_graph_selects_blocks_with_any_pair():
    q = contiguous_layout(64, 16)
    k = partition_layout(np.array([1, 0] * 24), 16)  # group 0 = odd tokens, group 1 = even tokens
    mask = np.zeros((64, 48), dtype=bool)
    mask[17, 40] = True  # q block 1; token 40 is even -> group 1, rank 20 -> slot 32 + 20 -> k block 3
    mask[0, 1] = True  # q block 0; token 1 odd -> group 0, rank 0 -> k block 0
    g = token_mask_graph(q, k, mask, heads=2)
    assert pair_set(g, 0) == pair_set(g, 1) == {(1, 3), (0, 0)}
    per_head = np.stack([mask, np.zeros_like(mask)])
    assert token_mask_graph(q, k, per_head).head_nnz().tolist() == [2, 0]
    with pytest.raises(BuilderError, match="token_mask"):
        token_mask_graph(q, k, mask[:10])


def test_block_list_graph_forms_and_errors():
    layout = contiguous_layout(64, 16)  # 4 blocks
    g = block_list_graph(layout, layout, [[0, 0, 1], [1, 3, 2], [0, 0, 1]])
    assert g.heads == 2 and pair_set(g, 0) == {(0, 1)} and pair_set(g, 1) == {(3, 2)}
    lists = [[[0], [1, 2], [], [3]]]
    assert pair_set(block_list_graph(layout, layout, lists)) == {(0, 0), (1, 1), (1, 2), (3, 3)}
    with pytest.raises(BuilderError, match=r"blocks\[1\] = \(0, 4, 0\): q_block 4 is outside \[0, 4\)"):
        block_list_graph(layout, layout, [[0, 0, 0], [0, 4, 0]])
    with pytest.raises(BuilderError, match="blocks.*k_block"):
        block_list_graph(layout, layout, [[[0], [9], [], []]])
    with pytest.raises(BuilderError, match=r"blocks\[0\] has 2 Q blocks"):
        block_list_graph(layout, layout, [[[0], [1]]])


def test_graph_from_group_masks_matches_pairs():
    layout = video_layout((6, 8, 12), (6, 8, 8), 128)
    m = np.array([[False, True], [True, True]])
    g = graph_from_group_masks(layout, layout, [m, ~m], q_groups=2, k_groups=2)
    assert pair_set(g, 0) == {(i, j) for i in range(3) for j in range(3, 5)} | {
        (i, j) for i in range(3, 5) for j in range(5)
    }
    assert pair_set(g, 1) == {(i, j) for i in range(3) for j in range(3)}


# --- determinism of data-dependent builders -------------------------------------------------------------
@pytest.mark.parametrize(
    "build",
    [
        lambda s: vsa_graph((8, 8, 8), (4, 4, 4), 3, heads=2, seed=s),
        lambda s: ssta_graph((12, 16, 16), (6, 8, 8), (1, 1, 1), 2, heads=2, seed=s),
    ],
    ids=["vsa", "ssta"],
)
def test_same_seed_same_graph_other_seed_differs(build):
    a, b, c = build(0), build(0), build(1)
    assert np.array_equal(a.indptr, b.indptr) and np.array_equal(a.indices, b.indices)
    assert not (np.array_equal(a.indptr, c.indptr) and np.array_equal(a.indices, c.indices))


def test_builders_reject_mismatched_user_qk():
    q = np.zeros((2, 100, 8), dtype=np.float32)
    with pytest.raises(BuilderError, match="q has 100 tokens"):
        vsa_graph((4, 4, 8), (4, 4, 4), 1, q=q, k=q)
    with pytest.raises(BuilderError, match="both q and k"):
        vsa_graph((4, 4, 8), (4, 4, 4), 1, q=np.zeros((1, 128, 4), np.float32))
    with pytest.raises(BuilderError, match="q must hold floats"):
        vsa_graph((4, 4, 8), (4, 4, 4), 1, q=np.zeros((1, 128, 4), int), k=np.zeros((1, 128, 4), int))


def test_synthetic_path_equals_full_features():
    """Builders on the rank-r factors select what they select on the materialised 128-d features."""
    grid, tile = (8, 12, 12), (4, 4, 4)
    q, k = synthetic_qk(grid, heads=3, dim=128, seed=4)
    a = vsa_graph(grid, tile, 5, heads=3, seed=4, head_dim=128)
    b = vsa_graph(grid, tile, 5, q=q, k=k)
    assert np.array_equal(a.indices, b.indices)


# --- synthetic generator ----------------------------------------------------------------------------
def test_synthetic_shapes_determinism_and_head_independence():
    q, k = synthetic_qk((3, 4, 5), heads=3, dim=32, seed=9)
    assert q.shape == k.shape == (3, 60, 32) and q.dtype == np.float32
    q2, k2 = synthetic_qk((3, 4, 5), heads=2, dim=32, seed=9)
    assert np.array_equal(q[:2], q2) and np.array_equal(k[:2], k2)  # head h does not depend on the head count
    q3, _ = synthetic_qk((3, 4, 5), heads=3, dim=32, seed=10)
    assert not np.allclose(q, q3)
    zq, zk = synthetic_factors(3, grid=(3, 4, 5), dim=32, seed=9)
    for h in range(3):
        np.testing.assert_allclose(q[h] @ k[h].T, zq[h] @ zk[h].T, atol=1e-3)


def test_synthetic_grid_and_positions_paths_agree():
    a = synthetic_head_factors(1, grid=(5, 6, 7), dim=64, seed=2)
    b = synthetic_head_factors(1, positions=grid_positions((5, 6, 7)), dim=64, seed=2)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, atol=2e-5)


def test_synthetic_is_spatially_correlated():
    grid = (8, 16, 16)
    zq, zk = synthetic_factors(8, grid=grid, dim=128, seed=0)
    pos = grid_positions(grid)
    dist = np.abs(pos[:, None, :] - pos[None, :256, :]).max(-1)
    near, far = [], []
    for h in range(8):
        s = zq[h] @ zk[h, :256].T
        near.append(s[(dist >= 1) & (dist <= 1)].mean())
        far.append(s[dist >= 8].mean())
    assert np.mean(near) > np.mean(far) + 5 * np.sqrt(128) / 4  # neighbours score several logits higher


def test_synthetic_tokens_and_errors():
    q, _k = synthetic_qk_tokens(100, heads=2, dim=16, seed=0)
    assert q.shape == (2, 100, 16)
    with pytest.raises(SyntheticError, match="dim"):
        synthetic_qk((2, 2, 2), heads=1, dim=4)
    with pytest.raises(SyntheticError, match="heads"):
        synthetic_qk((2, 2, 2), heads=0)
    with pytest.raises(SyntheticError, match="grid"):
        synthetic_qk((2, 2), heads=1)


def test_reused_synthetic_factors_are_the_same_draw_and_read_only():
    from sparseattn.synthetic import reuse_factors

    fresh = synthetic_head_factors(3, grid=(4, 6, 8), dim=64, seed=5)
    with reuse_factors():
        a = synthetic_head_factors(3, grid=(4, 6, 8), dim=64, seed=5)
        b = synthetic_head_factors(3, grid=(4, 6, 8), dim=64, seed=5)
        other = synthetic_head_factors(3, grid=(4, 6, 8), dim=64, seed=6)
    assert a[0] is b[0] and not a[0].flags.writeable
    assert np.array_equal(a[0], fresh[0]) and np.array_equal(a[1], fresh[1])
    assert not np.array_equal(other[0], a[0])
    assert synthetic_head_factors(3, grid=(4, 6, 8), dim=64, seed=5)[0] is not a[0]  # block over: fresh draws
