"""User layout files (JSON / YAML): the shipped examples and every kind of malformed file."""

import json
from pathlib import Path

import numpy as np
import pytest

from sparseattn.builders import sta_graph
from sparseattn.layout_file import LayoutFileError, load_layout_file, parse_layout
from sparseattn.workloads import Workload

EXAMPLES = Path(__file__).resolve().parents[1] / "data" / "workloads"

BASE = {
    "name": "mine",
    "grid": [8, 8, 16],
    "tile": [4, 4, 8],
    "heads": 2,
    "selection": {"kind": "sta", "window": [1, 1, 2]},
}


def test_example_sta_yaml_matches_python_definition():
    w = load_layout_file(EXAMPLES / "example_sta.yaml")
    assert isinstance(w, Workload)
    assert (w.name, w.grid, w.tile, w.block_size, w.padding) == (
        "example_sta",
        (13, 30, 52),
        (4, 4, 8),
        128,
        "prefix",
    )
    assert (w.heads, w.layers, w.head_dim) == (8, 30, 128)
    [g] = w.graphs()
    expected = sta_graph((13, 30, 52), (4, 4, 8), (3, 3, 3), heads=8)
    assert np.array_equal(g.indptr, expected.indptr) and np.array_equal(g.indices, expected.indices)
    assert 0 < g.q.summary()["partial_blocks"] < g.q.num_blocks


def test_example_custom_json_block_list():
    w = load_layout_file(EXAMPLES / "example_custom.json")
    assert (w.name, w.padding, w.block_size, w.heads, w.head_dim) == ("example_custom", "inplace", 64, 2, 64)
    [g] = w.graphs()
    data = json.loads((EXAMPLES / "example_custom.json").read_text())
    expected = {tuple(b) for b in data["selection"]["blocks"]}
    h, i, j = g.pairs
    assert set(zip(h.tolist(), i.tolist(), j.tolist())) == expected


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
def test_roundtrip_all_suffixes_and_defaults(tmp_path, suffix):
    path = tmp_path / f"layout{suffix}"
    data = {k: v for k, v in BASE.items() if k != "name"}
    path.write_text(json.dumps(data))  # JSON is valid YAML too
    w = load_layout_file(path)
    assert (w.name, w.layers, w.head_dim, w.block_size, w.padding) == ("layout", 1, 128, 128, "prefix")
    assert w.graphs()[0].heads == 2


@pytest.mark.parametrize(
    "kind, selection",
    [
        ("ssta", {"kind": "ssta", "window": [1, 1, 1], "topk": 2, "seed": 3}),
        ("vsa", {"kind": "vsa", "topk": 3}),
        ("svg2", {"kind": "svg2", "q_clusters": 4, "k_clusters": 8, "top_p": 0.8, "min_fraction": 0.2}),
        ("random", {"kind": "random", "density": 0.5, "seed": 1}),
        (
            "per-head-lists",
            {
                "kind": "blocks",
                "blocks": [[[0], [1], [], [3], [], [], [], [7]], [[], [], [2, 3], [], [], [], [], []]],
            },
        ),
        ("per-head-windows", {"kind": "sta", "window": [[1, 1, 1], [2, 2, 2]]}),
    ],
)
def test_every_selection_kind_loads_and_builds(tmp_path, kind, selection):
    path = tmp_path / "sel.yaml"
    path.write_text(json.dumps({**BASE, "selection": selection}))
    graphs = load_layout_file(path).graphs()
    assert sum(g.heads for g in graphs) == 2 and all(g.nnz > 0 for g in graphs)


def _bad_cases():
    yield "missing-grid", {k: v for k, v in BASE.items() if k != "grid"}, "grid", "missing"
    yield "missing-kind", {**BASE, "selection": {"window": [1, 1, 1]}}, "selection.kind", "missing"
    yield "missing-tile", {k: v for k, v in BASE.items() if k != "tile"}, "tile", "missing"
    yield "heads-string", {**BASE, "heads": "four"}, "heads", "positive integer"
    yield "heads-float", {**BASE, "heads": 2.5}, "heads", "positive integer"
    yield "grid-string-entry", {**BASE, "grid": [8, "x", 16]}, "grid", "grid[1] must be an integer"
    yield "grid-two-entries", {**BASE, "grid": [8, 8]}, "grid", "three positive integers"
    yield (
        "tile-larger",
        {**BASE, "grid": [8, 8, 16], "tile": [4, 9, 8]},
        "tile",
        "tile[1]=9 is larger than grid[1]=8",
    )
    yield "grid-zero", {**BASE, "grid": [0, 8, 16]}, "grid", "grid[0]=0 must be positive"
    yield "tile-negative", {**BASE, "tile": [4, -4, 8]}, "tile", "tile[1]=-4 must be positive"
    yield "head_dim-zero", {**BASE, "head_dim": 0}, "head_dim", "positive integer"
    yield "block_size", {**BASE, "block_size": 100}, "block_size", "multiple of 16"
    yield "padding", {**BASE, "padding": "suffix"}, "padding", "prefix, inplace"
    yield (
        "window-wide",
        {**BASE, "selection": {"kind": "sta", "window": [1, 1, 3]}},
        "selection.window",
        "window[2]=3 is wider than the tile grid (2 tiles along axis 2)",
    )
    yield (
        "window-type",
        {**BASE, "selection": {"kind": "sta", "window": "3x3x3"}},
        "selection.window",
        "three integers",
    )
    yield (
        "block-out-of-range",
        {**BASE, "selection": {"kind": "blocks", "blocks": [[0, 0, 1], [1, 2, 8]]}},
        "selection.blocks",
        "blocks[1] = (1, 2, 8): k_block 8 is outside [0, 8)",
    )
    yield (
        "top_p-zero",
        {**BASE, "selection": {"kind": "svg2", "q_clusters": 4, "k_clusters": 8, "top_p": 0}},
        "selection.top_p",
        "(0, 1]",
    )
    yield (
        "top_p-above-one",
        {**BASE, "selection": {"kind": "svg2", "top_p": 1.01}},
        "selection.top_p",
        "(0, 1]",
    )
    yield (
        "min_fraction",
        {**BASE, "selection": {"kind": "svg2", "min_fraction": 2}},
        "selection.min_fraction",
        "[0, 1]",
    )
    yield "density", {**BASE, "selection": {"kind": "random", "density": 0}}, "selection.density", "(0, 1]"
    yield (
        "topk-negative",
        {**BASE, "selection": {"kind": "vsa", "topk": -1}},
        "selection.topk",
        "positive integer",
    )
    yield "kind-unknown", {**BASE, "selection": {"kind": "nsa"}}, "selection.kind", "must be one of"
    yield "field-unknown", {**BASE, "tiles": [4, 4, 8]}, "tiles", "unknown field"
    yield (
        "selection-field-unknown",
        {**BASE, "selection": {"kind": "sta", "windw": [1, 1, 1]}},
        "selection.windw",
        "unknown field",
    )
    yield (
        "field-not-for-kind",
        {**BASE, "selection": {"kind": "sta", "window": [1, 1, 1], "topk": 3}},
        "selection.topk",
        "does not apply",
    )
    yield "selection-not-mapping", {**BASE, "selection": "sta"}, "selection", "must be a mapping"
    yield (
        "clamp-type",
        {**BASE, "selection": {"kind": "sta", "window": [1, 1, 1], "clamp": "yes"}},
        "selection.clamp",
        "true or false",
    )
    yield (
        "seed-type",
        {**BASE, "selection": {"kind": "vsa", "topk": 1, "seed": "abc"}},
        "selection.seed",
        "integer",
    )
    yield "name-type", {**BASE, "name": 5}, "name", "string"


BAD = list(_bad_cases())


@pytest.mark.parametrize("data, field, needle", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
@pytest.mark.parametrize("fmt", ["yaml", "json"])
def test_malformed_file_names_file_and_field(tmp_path, fmt, data, field, needle):
    path = tmp_path / f"my.{fmt}"
    path.write_text(json.dumps(data))
    with pytest.raises(LayoutFileError) as err:
        load_layout_file(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: field '{field}': "), msg
    assert needle in msg, msg
    assert err.value.field == field and err.value.path == str(path)


def test_exact_message_for_tile_larger_than_grid(tmp_path):
    path = tmp_path / "my.yaml"
    path.write_text("grid: [8, 8, 8]\ntile: [4, 9, 4]\nselection: {kind: sta, window: [1, 1, 1]}\n")
    with pytest.raises(LayoutFileError) as err:
        load_layout_file(path)
    assert str(err.value) == f"{path}: field 'tile': tile[1]=9 is larger than grid[1]=8"


@pytest.mark.parametrize(
    "name, text, needle",
    [
        ("bad.yaml", "grid: [8, 8, 8\ntile: [4, 4, 4]\n", "invalid YAML at line"),
        ("bad.yaml", "grid: [8, 8, 8]\n  tile: : [4]\n", "invalid YAML"),
        ("bad.json", '{"grid": [8, 8, 8],}', "invalid JSON at line 1"),
        ("list.yaml", "- 1\n- 2\n", "top level must be a mapping"),
        ("empty.yaml", "", "top level must be a mapping"),
        ("layout.toml", "grid = [8, 8, 8]", "unsupported file type '.toml'"),
    ],
    ids=["yaml-bracket", "yaml-colon", "json-comma", "yaml-list", "yaml-empty", "toml"],
)
def test_unparsable_files_name_the_file(tmp_path, name, text, needle):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(LayoutFileError) as err:
        load_layout_file(path)
    assert str(err.value).startswith(f"{path}: ") and needle in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(LayoutFileError, match="cannot read"):
        load_layout_file(tmp_path / "nope.yaml")


def test_parse_layout_from_mapping():
    w = parse_layout(dict(BASE), source="inline")
    assert w.name == "mine" and w.source == "inline"
