"""The six built-in workloads and the Workload API (build / graphs / validation)."""

import math

import numpy as np
import pytest

from sparseattn.builders import sta_graph
from sparseattn.synthetic import synthetic_qk
from sparseattn.workloads import (
    WORKLOADS,
    Selection,
    UnknownWorkloadError,
    Workload,
    WorkloadError,
    get_workload,
)

BUILTIN_NAMES = [
    "vsa_wan14b_720p",
    "vsa_wan14b_480p",
    "ssta_hy15_720p",
    "sta_hunyuan_117f",
    "sta_wan14b_69f",
    "svg2_wan14b_720p",
]


def test_registry_has_the_six_builtins():
    assert list(WORKLOADS) == BUILTIN_NAMES
    for name in BUILTIN_NAMES:
        w = get_workload(name)
        assert w.name == name and w.description and w.source


def test_unknown_workload_lists_valid_names():
    with pytest.raises(UnknownWorkloadError) as err:
        get_workload("vsa_wan_720")
    assert "vsa_wan_720" in str(err.value) and all(n in str(err.value) for n in BUILTIN_NAMES)
    assert isinstance(err.value, KeyError) and isinstance(err.value, ValueError)


@pytest.mark.parametrize(
    "name, heads, layers, head_dim, grid",
    [
        ("vsa_wan14b_720p", 40, 40, 128, (21, 45, 80)),
        ("vsa_wan14b_480p", 40, 40, 128, (21, 30, 52)),
        ("ssta_hy15_720p", 16, 54, 128, (31, 45, 80)),
        ("sta_hunyuan_117f", 24, 60, 128, (30, 48, 80)),
        ("sta_wan14b_69f", 40, 40, 128, (18, 48, 80)),
        ("svg2_wan14b_720p", 40, 40, 128, (21, 45, 80)),
    ],
    ids=BUILTIN_NAMES,
)
def test_public_config_numbers(name, heads, layers, head_dim, grid):
    w = get_workload(name)
    assert (w.heads, w.layers, w.head_dim, w.grid) == (heads, layers, head_dim, grid)


@pytest.mark.parametrize("name, cubes", [("vsa_wan14b_720p", 6 * 12 * 20), ("vsa_wan14b_480p", 6 * 8 * 13)])
def test_vsa_topk_is_ten_percent_of_cubes(name, cubes):
    w = get_workload(name)
    assert w.selection.topk == math.ceil(0.1 * cubes)  # 144 and 63
    g = w.build(heads=2)
    assert g.q.num_blocks == cubes
    assert np.all(np.diff(g.indptr) == w.selection.topk)


@pytest.mark.parametrize(
    "name, window_blocks", [("sta_hunyuan_117f", 3 * 3 * 5 * 9), ("sta_wan14b_69f", 3 * 3 * 3 * 9)]
)
def test_sta_builtins_have_full_tiles_and_full_windows(name, window_blocks):
    w = get_workload(name)
    g = w.build(heads=2)
    assert g.q.valid.all()  # no partial tiles: the parity case
    assert np.all(np.diff(g.indptr) == window_blocks // 3)  # each of a tile's 3 blocks sees window x 3 blocks


def test_ssta_builtin_layout_pads_to_36x48x80():
    w = get_workload("ssta_hy15_720p")
    layout = w.layout()
    assert layout.num_slots == 36 * 48 * 80 and layout.num_tokens == 31 * 45 * 80
    g = w.build(heads=2)
    window = sta_graph(w.grid, w.tile, w.selection.window, heads=2)
    h, i, j = g.pairs
    hw, iw, jw = window.pairs
    assert set(zip(hw.tolist(), iw.tolist(), jw.tolist())) <= set(zip(h.tolist(), i.tolist(), j.tolist()))
    assert g.nnz > window.nnz


@pytest.mark.parametrize("name", BUILTIN_NAMES)
def test_graphs_cover_requested_heads(name):
    w = get_workload(name)
    graphs = w.graphs(seed=0, heads=2)
    assert isinstance(graphs, list) and sum(g.heads for g in graphs) == 2
    assert len(graphs) == (2 if w.per_head_layouts else 1)
    assert all(g.nnz > 0 for g in graphs)


def test_svg2_builtin_partitions():
    w = get_workload("svg2_wan14b_720p")
    graphs = w.graphs(heads=1)
    g = graphs[0]
    assert g.q.num_tokens == g.k.num_tokens == 75_600
    assert np.unique(g.q.block_group).size <= 300 and np.unique(g.k.block_group).size <= 1000
    live_k = np.unique(g.k.block_group[g.k.valid_rows > 0]).size
    per_row = [
        np.unique(g.k.block_group[g.row(0, i)]).size for i in range(g.q.num_blocks) if g.q.valid_rows[i]
    ]
    assert min(per_row) >= math.ceil(0.1 * live_k)
    with pytest.raises(WorkloadError, match="tile"):
        w.layout()


def test_build_with_user_qk_uses_their_head_count():
    w = Workload(
        "tiny_vsa",
        "VSA on a tiny latent",
        heads=4,
        layers=1,
        head_dim=32,
        grid=(8, 8, 8),
        tile=(4, 4, 4),
        block_size=64,
        selection=Selection("vsa", topk=2),
    )
    q, k = synthetic_qk(w.grid, heads=3, dim=32, seed=1)
    g = w.build(q=q, k=k)
    assert g.heads == 3
    assert np.array_equal(g.indices, w.build(seed=1, heads=3).indices)


def test_selection_seed_pins_the_seed():
    sel = Selection("vsa", topk=2, seed=7)
    w = Workload(
        "pinned",
        "",
        heads=2,
        layers=1,
        head_dim=32,
        grid=(8, 8, 8),
        tile=(4, 4, 4),
        block_size=64,
        selection=sel,
    )
    assert np.array_equal(w.build(seed=0).indices, w.build(seed=1).indices)


@pytest.mark.parametrize(
    "kwargs, field, needle",
    [
        ({"heads": 0}, "heads", "positive integer"),
        ({"head_dim": -1}, "head_dim", "positive integer"),
        ({"grid": (8, 0, 8)}, "grid", "grid[1]=0 must be positive"),
        ({"tile": (4, 9, 4)}, "tile", "tile[1]=9 is larger than grid[1]=8"),
        ({"tile": None}, "tile", "required"),
        ({"block_size": 100}, "block_size", "multiple of 16"),
        ({"padding": "center"}, "padding", "prefix, inplace"),
        ({"selection": Selection("sta")}, "selection.window", "required"),
        (
            {"selection": Selection("sta", window=(3, 3, 3))},
            "selection.window",
            "window[0]=3 is wider",
        ),  # 2x2x2 tiles
        ({"selection": Selection("vsa", topk=0)}, "selection.topk", "positive integer"),
        ({"selection": Selection("vsa", topk=3, top_p=0.5)}, "selection.top_p", "does not apply"),
        (
            {"selection": Selection("svg2", q_clusters=4, k_clusters=8, top_p=1.5)},
            "selection.top_p",
            "(0, 1]",
        ),
        ({"selection": Selection("svg2")}, "selection.k_clusters", "1000 clusters exceed the 512 tokens"),
        ({"selection": Selection("random", density=0)}, "selection.density", "(0, 1]"),
        (
            {"selection": Selection("blocks", blocks=[[0, 0, 99]])},
            "selection.blocks",
            "k_block 99 is outside [0, 8)",
        ),
        (
            {"selection": Selection("blocks", blocks=[[5, 0, 0]])},
            "selection.blocks",
            "head 5 is outside [0, 2)",
        ),
        ({"selection": Selection("cubes")}, "selection.kind", "must be one of"),
    ],
    ids=[
        "heads",
        "head_dim",
        "grid",
        "tile",
        "tile-missing",
        "block_size",
        "padding",
        "window-missing",
        "window-wide",
        "topk",
        "top_p-vsa",
        "top_p",
        "k_clusters",
        "density",
        "blocks",
        "blocks-head",
        "kind",
    ],
)
def test_workload_validation_names_field(kwargs, field, needle):
    base = {
        "name": "w",
        "description": "",
        "heads": 2,
        "layers": 1,
        "head_dim": 32,
        "grid": (8, 8, 8),
        "tile": (4, 4, 4),
        "block_size": 64,
        "selection": Selection("vsa", topk=2),
    }
    base.update(kwargs)
    with pytest.raises(WorkloadError) as err:
        Workload(**base)
    assert err.value.field == field and f"field '{field}'" in str(err.value) and needle in str(err.value)


def test_selection_strings():
    assert str(get_workload("sta_hunyuan_117f").selection) == "STA window 3×3×5 tiles"
    assert str(get_workload("ssta_hy15_720p").selection) == "SSTA window 3×3×3 ∪ top-32 tiles"
    assert "top-p 0.9" in str(get_workload("svg2_wan14b_720p").selection)


@pytest.mark.parametrize("name", ["vsa_wan14b_480p", "ssta_hy15_720p", "svg2_wan14b_720p"])
def test_builtin_seed_determinism(name):
    w = get_workload(name)
    a, b, c = (w.graphs(seed=s, heads=1)[0] for s in (0, 0, 1))
    assert np.array_equal(a.indptr, b.indptr) and np.array_equal(a.indices, b.indices)
    assert np.array_equal(a.k.valid, b.k.valid)
    assert not (np.array_equal(a.indices, c.indices) and np.array_equal(a.k.valid, c.k.valid))


SMALL = {
    "sta": Selection("sta", window=((1, 1, 1), (2, 2, 2), (1, 2, 2))),
    "ssta": Selection("ssta", window=(1, 1, 1), topk=2),
    "vsa": Selection("vsa", topk=3),
    "svg2": Selection("svg2", q_clusters=5, k_clusters=7),
    "random": Selection("random", density=0.3),
    "blocks": Selection("blocks", blocks=[[0, 0, 1], [1, 2, 0], [2, 1, 1]]),
}


@pytest.mark.parametrize("kind", list(SMALL))
def test_head_slices_equal_the_whole_build(kind):
    tile = None if kind == "svg2" else (2, 4, 4)
    w = Workload("small", "", 3, 1, 64, (4, 8, 8), tile, SMALL[kind], block_size=32)
    whole = w.graphs(seed=5)
    masks = np.concatenate([g.block_mask() for g in whole]) if kind != "svg2" else None
    for heads in ([2], [0, 2], [2, 1]):
        part = w.graphs(seed=5, heads=heads)
        if kind == "svg2":
            for g, h in zip(part, heads):
                assert np.array_equal(g.indices, whole[h].indices)
                assert np.array_equal(g.q.token_slot, whole[h].q.token_slot)
        else:
            (g,) = part
            assert np.array_equal(g.block_mask(), masks[heads])


def test_heads_beyond_a_fixed_head_count_are_refused():
    w = Workload("small", "", 3, 1, 64, (4, 8, 8), (2, 4, 4), SMALL["sta"], block_size=32)
    with pytest.raises(WorkloadError, match="heads"):
        w.graphs(heads=[3])
    with pytest.raises(WorkloadError, match="heads"):
        w.graphs(heads=[1, 1])
