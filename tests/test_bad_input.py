"""Bad input, one table: every mistake a user can make is refused cleanly.

From the command line: exactly one line ``sparseattn: error: FILE: field '...': ...`` (or without the
field where the whole file is wrong) and exit status 2 — never a traceback, a hang or a silent wrong
result. From Python: a named exception of the package (a ``ValueError`` or ``TypeError`` subclass)
whose message names the argument. Sizes that cannot fit are refused before any allocation, so
``MemoryError`` never escapes.
"""

import json
import warnings

import numpy as np
import pytest

from sparseattn import analysis, cli
from sparseattn.analysis import AnalysisError, DroppedPairsWarning, analyze_graphs
from sparseattn.bf16 import Bf16TypeError, Bf16ValueError, bf16_bits_to_float, float_to_bf16_bits
from sparseattn.builders import BuilderError, random_graph, vsa_graph
from sparseattn.emulator import EmulationError, emulate_forward
from sparseattn.graph import GraphError, GraphTypeError, SparseGraph
from sparseattn.kernels.backward import paged_backward
from sparseattn.kernels.bsa_backward import plan_backward
from sparseattn.kernels.forward import work_of
from sparseattn.kernels.validate import KernelTypeError, KernelValueError, check_same_device
from sparseattn.layouts import (
    BlockLayout,
    LayoutError,
    LayoutTypeError,
    contiguous_layout,
    partition_layout,
    slot_layout,
    video_layout,
)
from sparseattn.pageweaver.analysis import analyze_captures
from sparseattn.pageweaver.captures import Capture, CaptureError, CaptureTypeError
from sparseattn.planning.tile_plan import PlanTypeError, bsa_plan, kpage_plan
from sparseattn.reference import ReferenceError, ReferenceTypeError, attention_forward
from sparseattn.workloads import Selection, Workload, WorkloadError

HUGE = 2**70

# --- files written for the command-line cases -------------------------------------------------------
CAPTURE_HEADER = {
    "format": 1,
    "name": "c",
    "context": 256,
    "page_size": 64,
    "causal": True,
    "num_queries": 3,
    "k": 2,
    "query_start": 100,
    "meta": {},
}
PAGES = np.array([[0, 1], [0, -1], [1, 0]], np.int16)


def _npz(header=CAPTURE_HEADER, pages=PAGES, **arrays):
    if not isinstance(header, np.ndarray):
        header = np.array(header if isinstance(header, str) else json.dumps(header))

    def write(path):
        with open(path, "wb") as f:
            np.savez(f, header=header, pages=pages, **arrays)

    return write


def _bytes(data: bytes):
    return lambda path: path.write_bytes(data)


def _truncated(path):
    _npz()(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _without(key):
    return {k: v for k, v in CAPTURE_HEADER.items() if k != key}


LAYOUT = "grid: [8, 8, 16]\ntile: [4, 4, 8]\nheads: 2\nselection:\n  kind: sta\n  window: [1, 1, 2]\n"


def _yaml(text: str = LAYOUT, **replace):
    for key, value in replace.items():
        text = text.replace(key, value)
    return lambda path: path.write_text(text, encoding="utf-8")


def _layout_json(**fields):
    data = {"grid": [8, 8, 16], "tile": [4, 4, 8], "selection": {"kind": "sta", "window": [1, 1, 2]}}
    data.update(fields)
    return lambda path: path.write_text(json.dumps(data))


def _sel(**selection):
    data = {"grid": [8, 8, 16], "tile": [4, 4, 8], "heads": 2, "selection": selection}
    return lambda path: path.write_text(json.dumps(data))


def cli_case(file, write, args, fragments, id):
    """``sparseattn analyze`` on ``file`` (made by ``write``) fails with one line holding ``fragments``."""
    return pytest.param(file, write, args, fragments, id=id)


CLI_CASES = [
    # captures (.npz)
    cli_case("c.npz", _truncated, ["--captures"], ["c.npz:", "not a capture .npz"], "capture-truncated"),
    cli_case("c.npz", _bytes(b""), ["--captures"], ["c.npz:", "not a capture .npz"], "capture-empty-file"),
    cli_case(
        "c.npz", _bytes(bytes(range(256)) * 3), ["--captures"], ["c.npz:", "not a capture"], "capture-random"
    ),
    cli_case(
        "c.txt", _bytes(b"queries\n1 2 3\n"), ["--captures"], ["c.txt:", "not a capture .npz"], "capture-text"
    ),
    cli_case(
        "c.npz",
        _npz(_without("context")),
        ["--captures"],
        ["field 'context'", "missing"],
        "capture-no-context",
    ),
    cli_case(
        "c.npz", _npz(_without("page_size")), ["--captures"], ["field 'page_size'"], "capture-no-page-size"
    ),
    cli_case("c.npz", _npz([1, 2]), ["--captures"], ["field 'header'", "JSON object"], "capture-header-list"),
    cli_case(
        "c.npz",
        _npz("{oops"),
        ["--captures"],
        ["field 'header'", "not valid JSON"],
        "capture-header-not-json",
    ),
    cli_case(
        "c.npz", _npz(dict(CAPTURE_HEADER, format=2)), ["--captures"], ["field 'format'"], "capture-format"
    ),
    cli_case(
        "c.npz",
        _npz(dict(CAPTURE_HEADER, query_start=None)),
        ["--captures"],
        ["field 'query_start'"],
        "capture-null-start",
    ),
    cli_case(
        "c.npz",
        _npz(pages=np.zeros((0, 2), np.int16)),
        ["--captures"],
        ["field 'pages'", "no queries"],
        "capture-no-queries",
    ),
    cli_case(
        "c.npz",
        _npz(dict(CAPTURE_HEADER, query_start=None), positions=np.array([100.7, 101.2, 102.9])),
        ["--captures"],
        ["field 'positions'", "integer"],
        "capture-float-positions",
    ),
    cli_case(
        "c.npz",
        _npz(pages=PAGES.astype(np.float32)),
        ["--captures"],
        ["field 'pages'", "integer"],
        "capture-float-pages",
    ),
    cli_case(
        "c.npz",
        _npz(dict(CAPTURE_HEADER, context="256")),
        ["--captures"],
        ["field 'context'"],
        "capture-string-context",
    ),
    cli_case(
        "c.npz",
        _npz(dict(CAPTURE_HEADER, causal="yes")),
        ["--captures"],
        ["field 'causal'"],
        "capture-causal-string",
    ),
    cli_case(
        "c.npz",
        _npz(pages=np.array([[0, 3], [0, 1], [1, 0]])),
        ["--captures"],
        ["field 'pages'", "non-causal"],
        "capture-non-causal",
    ),
    cli_case(
        "c.npz",
        _npz(pages=np.array([[0, 9], [0, 1], [1, 0]])),
        ["--captures"],
        ["field 'pages'", "out of range"],
        "capture-page-id",
    ),
    # page ids are range-checked in the stored dtype, before any narrowing cast: 2^40 in an int64 array
    # used to come back as page 0, and 2^64 - 1 in a uint64 array as page -1 (padding)
    cli_case(
        "c.npz",
        _npz(pages=np.array([[0, 2**40], [0, 1], [1, 0]], np.int64)),
        ["--captures"],
        ["field 'pages'", "page id 1099511627776", "out of range"],
        "capture-page-id-int64-wraps",
    ),
    cli_case(
        "c.npz",
        _npz(pages=np.array([[0, 2**64 - 1], [0, 1], [1, 0]], np.uint64)),
        ["--captures"],
        ["field 'pages'", "page id 18446744073709551615", "out of range"],
        "capture-page-id-uint64-wraps",
    ),
    cli_case(
        "c.npz",
        _npz(pages=np.array([[0, 1], [0, -1], [1, 0]], np.int8), positions=np.array([100, 2**33, 102])),
        ["--captures"],
        ["field 'positions'", "8589934592", "outside"],
        "capture-position-int64",
    ),
    cli_case(
        "c.npz",
        _npz(dict(CAPTURE_HEADER, query_start=2**70)),
        ["--captures"],
        ["field 'query_start'", "1180591620717411303424"],
        "capture-query-start-overflows",
    ),
    cli_case(
        "c.npz",
        _npz(pages=np.full((3, 2), -1, np.int16)),
        ["--captures"],
        ["field 'pages'", "selected nothing", "-1 padding"],
        "capture-all-padding",
    ),
    cli_case("c.npz", _npz(header=np.zeros(3)), ["--captures"], ["field 'header'"], "capture-header-array"),
    cli_case("c.npz", None, ["--captures"], ["c.npz", "not found"], "capture-missing-file"),
    # layout files
    cli_case(
        "l.yaml",
        _yaml(LAYOUT + "grid: [4, 4, 4]\n"),
        ["--layout"],
        ["field 'grid'", "appears twice"],
        "layout-duplicate-yaml-key",
    ),
    cli_case(
        "l.yaml",
        _yaml(LAYOUT.replace("  kind", "  window: [1, 1, 1]\n  kind")),
        ["--layout"],
        ["field 'window'", "twice"],
        "layout-duplicate-nested-key",
    ),
    cli_case(
        "l.json",
        _bytes(b'{"grid": [8, 8, 16], "grid": [8, 8, 8]}'),
        ["--layout"],
        ["field 'grid'", "twice"],
        "layout-duplicate-json-key",
    ),
    cli_case(
        "l.yaml",
        _bytes(LAYOUT.encode() + b"name: caf\xe9\n"),
        ["--layout"],
        ["l.yaml:", "not UTF-8"],
        "layout-latin-1",
    ),
    cli_case("l.yaml", _bytes(b""), ["--layout"], ["l.yaml:", "mapping"], "layout-empty-file"),
    cli_case("l.yaml", _yaml("- 1\n- 2\n"), ["--layout"], ["l.yaml:", "mapping"], "layout-top-level-list"),
    cli_case("l.yaml", _yaml("grid: [8, 8\n"), ["--layout"], ["l.yaml:", "invalid YAML"], "layout-bad-yaml"),
    cli_case("l.json", _bytes(b"{"), ["--layout"], ["l.json:", "invalid JSON"], "layout-bad-json"),
    cli_case(
        "l.toml", _bytes(b"grid = 1"), ["--layout"], ["l.toml:", "unsupported file type"], "layout-suffix"
    ),
    cli_case("l.yaml", None, ["--layout"], ["l.yaml", "not"], "layout-missing-file"),
    cli_case(
        "l.yaml",
        _yaml(**{"grid: [8, 8, 16]": f"grid: [{HUGE}, 8, 16]"}),
        ["--layout"],
        ["field 'grid'", "memory"],
        "layout-grid-2**70",
    ),
    cli_case(
        "l.yaml",
        _yaml(**{"grid: [8, 8, 16]": "grid: [2000, 2000, 2000]"}),
        ["--layout"],
        ["field 'grid'", "memory"],
        "layout-grid-huge",
    ),
    cli_case(
        "l.yaml",
        _yaml(**{"heads: 2": f"heads: {HUGE}"}),
        ["--layout"],
        ["field 'heads'", "memory"],
        "layout-heads-2**70",
    ),
    cli_case(
        "l.yaml",
        _yaml(**{"heads: 2": "heads: 1000000000"}),
        ["--layout"],
        ["field 'heads'", "memory"],
        "layout-heads-billion",
    ),
    cli_case(
        "l.yaml", _yaml(**{"heads: 2": "heads: 2.5"}), ["--layout"], ["field 'heads'"], "layout-heads-float"
    ),
    cli_case(
        "l.yaml", _yaml(**{"heads: 2": "heads: 0"}), ["--layout"], ["field 'heads'"], "layout-heads-zero"
    ),
    cli_case(
        "l.yaml",
        _yaml(**{"tile: [4, 4, 8]": "tile: [4, 9, 8]"}),
        ["--layout"],
        ["field 'tile'", "larger"],
        "layout-tile-larger",
    ),
    cli_case(
        "l.yaml",
        _yaml(**{"grid: [8, 8, 16]": "grid: [8, 8]"}),
        ["--layout"],
        ["field 'grid'"],
        "layout-grid-two-entries",
    ),
    cli_case(
        "l.yaml",
        _yaml(**{"grid: [8, 8, 16]": "grid: [8, 8, -16]"}),
        ["--layout"],
        ["field 'grid'"],
        "layout-grid-negative",
    ),
    cli_case(
        "l.json",
        _layout_json(block_size="abc"),
        ["--layout"],
        ["field 'block_size'"],
        "layout-block-size-string",
    ),
    cli_case(
        "l.json",
        _layout_json(block_size=24),
        ["--layout"],
        ["field 'block_size'", "multiple of 16"],
        "layout-block-size-24",
    ),
    cli_case(
        "l.json",
        _layout_json(block_size=64.5),
        ["--layout"],
        ["field 'block_size'"],
        "layout-block-size-float",
    ),
    cli_case(
        "l.json", _layout_json(head_dim=64.5), ["--layout"], ["field 'head_dim'"], "layout-head-dim-float"
    ),
    cli_case("l.json", _layout_json(padding="middle"), ["--layout"], ["field 'padding'"], "layout-padding"),
    cli_case(
        "l.json",
        _layout_json(colour="red"),
        ["--layout"],
        ["field 'colour'", "unknown"],
        "layout-unknown-field",
    ),
    cli_case(
        "l.json", _layout_json(selection=[1]), ["--layout"], ["field 'selection'"], "layout-selection-list"
    ),
    cli_case("l.json", _sel(kind="magic"), ["--layout"], ["field 'selection.kind'"], "layout-kind-unknown"),
    cli_case(
        "l.json",
        _sel(kind="sta"),
        ["--layout"],
        ["field 'selection.window'", "required"],
        "layout-window-missing",
    ),
    cli_case(
        "l.json",
        _sel(kind="sta", window=[9, 1, 1]),
        ["--layout"],
        ["field 'selection.window'", "wider"],
        "layout-window-wide",
    ),
    cli_case(
        "l.json",
        _sel(kind="sta", window=[1, 1, 1], colour=1),
        ["--layout"],
        ["field 'selection.colour'"],
        "layout-sel-unknown",
    ),
    cli_case(
        "l.json",
        _sel(kind="vsa", topk=3, seed=-1),
        ["--layout"],
        ["field 'selection.seed'", "non-negative"],
        "layout-seed-negative",
    ),
    cli_case(
        "l.json",
        _sel(kind="vsa", topk=3, seed=1.5),
        ["--layout"],
        ["field 'selection.seed'"],
        "layout-seed-float",
    ),
    cli_case(
        "l.json", _sel(kind="vsa", topk=0), ["--layout"], ["field 'selection.topk'"], "layout-topk-zero"
    ),
    cli_case(
        "l.json",
        _sel(kind="vsa", topk=3, window=[1, 1, 1]),
        ["--layout"],
        ["field 'selection.window'", "does not apply"],
        "layout-param-wrong-kind",
    ),
    cli_case(
        "l.json",
        _sel(kind="random", density=2),
        ["--layout"],
        ["field 'selection.density'"],
        "layout-density-2",
    ),
    cli_case(
        "l.json",
        _sel(kind="random", density=HUGE),
        ["--layout"],
        ["field 'selection.density'"],
        "layout-density-2**70",
    ),
    cli_case(
        "l.json",
        _sel(kind="svg2", q_clusters=5000),
        ["--layout"],
        ["field 'selection.q_clusters'"],
        "layout-clusters-over-tokens",
    ),
    cli_case(
        "l.json", _sel(kind="svg2", top_p=0), ["--layout"], ["field 'selection.top_p'"], "layout-top-p-zero"
    ),
    cli_case(
        "l.json",
        _sel(kind="sta", window=[1, 1, 1], clamp="yes"),
        ["--layout"],
        ["field 'selection.clamp'"],
        "layout-clamp-string",
    ),
    cli_case(
        "l.json",
        _sel(kind="blocks", blocks=[[0, 0, 99]]),
        ["--layout"],
        ["field 'selection.blocks'", "99"],
        "layout-block-out-of-range",
    ),
    cli_case(
        "l.json",
        _sel(kind="blocks", blocks=[[0, 0, HUGE]]),
        ["--layout"],
        ["field 'selection.blocks'", "64-bit"],
        "layout-block-2**70",
    ),
    cli_case(
        "l.json",
        _sel(kind="blocks", blocks=[[0, 0.5, 1]]),
        ["--layout"],
        ["field 'selection.blocks'"],
        "layout-block-float",
    ),
    # options
    cli_case(None, None, ["--workload", "nope"], ["--workload", "'nope'"], "option-unknown-workload"),
    cli_case(
        "no/such/dir/x.png",
        None,
        ["--workload", "sta_wan14b_69f", "--plot"],
        ["--plot", "does not exist"],
        "option-plot-folder",
    ),
    cli_case(
        "x.gif",
        None,
        ["--workload", "sta_wan14b_69f", "--plot"],
        ["--plot", "unsupported"],
        "option-plot-suffix",
    ),
]


@pytest.mark.parametrize("file, write, args, fragments", CLI_CASES)
def test_command_line_refuses_with_one_line(tmp_path, capsys, monkeypatch, file, write, args, fragments):
    monkeypatch.chdir(tmp_path)
    if write is not None:
        write(tmp_path / file)
    argv = ["analyze", *args] + ([file] if file else [])
    code = cli.main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("sparseattn: error: "), err
    if file and args[0] in ("--captures", "--layout"):
        assert lines[0].startswith(f"sparseattn: error: {file}: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


# --- Python API ---------------------------------------------------------------------------------------
LAY = contiguous_layout(200, 64)  # blocks with 64, 64, 64, 8 valid rows
GRAPH = SparseGraph.from_block_mask(LAY, LAY, np.ones((1, 4, 4), bool))
ZEROS = np.zeros((1, 1, LAY.num_slots, 16))
STA = Selection("sta", window=(1, 1, 1))


def api_case(call, error, needle, id):
    """``call()`` raises ``error`` (a package exception) with ``needle`` in its message."""
    return pytest.param(call, error, needle, id=id)


API_CASES = [
    # layouts
    api_case(
        lambda: partition_layout(np.array([0, 2**64 - 1], np.uint64), 16),
        LayoutError,
        "too large",
        "partition-uint64-groups",
    ),
    api_case(
        lambda: BlockLayout(16, np.ones(16, bool), np.arange(16) + 0.5, [0]),
        LayoutTypeError,
        "token_slot",
        "layout-float-token-slot",
    ),
    api_case(
        lambda: BlockLayout(16, np.ones(16, bool), np.zeros(16, int), [0]),
        LayoutError,
        "every valid slot once",
        "layout-duplicate-token-slot",
    ),
    api_case(
        lambda: BlockLayout(16, np.ones(16, bool), np.arange(16, dtype=np.uint64) + np.uint64(2**63), [0]),
        LayoutError,
        "too large",
        "layout-uint64-token-slot",
    ),
    api_case(lambda: video_layout(None, (4, 4, 4)), LayoutTypeError, "grid", "video-layout-grid-none"),
    api_case(lambda: video_layout((8, 8, 8), None), LayoutTypeError, "tile", "video-layout-tile-none"),
    api_case(
        lambda: video_layout((8, 8, 8), (4, 4, 4), block_size="abc"),
        LayoutTypeError,
        "block_size",
        "block-size-string",
    ),
    api_case(
        lambda: video_layout((8, 8, 8), (4, 4, 4), block_size=64.5),
        LayoutTypeError,
        "block_size",
        "block-size-float",
    ),
    api_case(lambda: video_layout((8.5, 8, 8), (4, 4, 4)), LayoutTypeError, "grid[0]", "grid-float"),
    api_case(
        lambda: video_layout((8, 8, 8), (4, 4, 4), padding=None), LayoutError, "padding", "padding-none"
    ),
    api_case(lambda: video_layout((HUGE, 8, 8), (4, 4, 4)), LayoutError, "memory", "video-layout-2**70"),
    api_case(lambda: video_layout((4000, 4000, 4000), (4, 4, 4)), LayoutError, "memory", "video-layout-huge"),
    api_case(lambda: contiguous_layout(96.5), LayoutTypeError, "num_tokens", "contiguous-float"),
    api_case(lambda: contiguous_layout(HUGE), LayoutError, "memory", "contiguous-2**70"),
    api_case(
        lambda: partition_layout([0, 1, 1], 64, num_groups=96.5),
        LayoutTypeError,
        "num_groups",
        "partition-groups-float",
    ),
    api_case(
        lambda: partition_layout([0, 1], 64, num_groups=HUGE), LayoutError, "memory", "partition-groups-2**70"
    ),
    api_case(lambda: partition_layout([0.5, 1.0], 64), LayoutTypeError, "groups", "partition-float-ids"),
    # graphs
    api_case(
        lambda: SparseGraph.from_block_mask(None, LAY, np.ones((4, 4), bool)),
        GraphTypeError,
        "q must be",
        "mask-layout-none",
    ),
    api_case(lambda: SparseGraph.from_block_mask(LAY, LAY, None), GraphTypeError, "mask", "mask-none"),
    api_case(
        lambda: SparseGraph.from_block_mask(LAY, LAY, np.ones((4, 4))), GraphTypeError, "float", "mask-float"
    ),
    api_case(
        lambda: SparseGraph.from_block_mask(LAY, LAY, -np.ones((4, 4), int)),
        GraphTypeError,
        "-1",
        "mask-minus-one",
    ),
    api_case(
        lambda: SparseGraph.from_block_mask(LAY, LAY, np.full((4, 4), "x")),
        GraphTypeError,
        "mask",
        "mask-string",
    ),
    api_case(
        lambda: SparseGraph.from_pairs(LAY, LAY, 1, [0.5], [0], [0]), GraphTypeError, "head", "pairs-float"
    ),
    api_case(
        lambda: SparseGraph.from_pairs(LAY, LAY, "2", [0], [0], [0]),
        GraphTypeError,
        "heads",
        "pairs-heads-string",
    ),
    # ids that an int64 cannot hold are refused with their value (they used to wrap to negative ids)
    api_case(
        lambda: SparseGraph.from_pairs(LAY, LAY, 1, [0], [0], np.array([2**64 - 1], np.uint64)),
        GraphError,
        "18446744073709551615",
        "pairs-uint64-wraps",
    ),
    api_case(
        lambda: SparseGraph.from_block_lists(LAY, LAY, [[[2**63], [], [], []]]),
        GraphError,
        "9223372036854775808",
        "block-lists-uint64-wraps",
    ),
    api_case(
        lambda: SparseGraph(LAY, LAY, 1, np.array([0.0, 1.9, 2.0, 2.0, 2.0]), np.array([0, 1])),
        GraphTypeError,
        "indptr",
        "graph-float-indptr",
    ),
    api_case(lambda: GRAPH.row(0, 9), GraphError, "q_block", "row-out-of-range"),
    api_case(lambda: GRAPH.select_heads([3]), GraphError, "heads", "select-heads-out-of-range"),
    # builders and workloads
    api_case(
        lambda: vsa_graph((8, 8, 8), (4, 4, 4), 2, q=np.full((1, 512, 8), np.nan), k=np.ones((1, 512, 8))),
        BuilderError,
        "NaN",
        "vsa-nan-q",
    ),
    api_case(lambda: vsa_graph((8, 8, 8), (4, 4, 4), 2.5), BuilderError, "topk", "vsa-topk-float"),
    api_case(lambda: random_graph(LAY, LAY, [0, 0], 0.5), BuilderError, "distinct", "random-repeated-heads"),
    api_case(
        lambda: Workload("w", "", 2.5, 1, 64, (8, 8, 8), (4, 4, 4), STA),
        WorkloadError,
        "heads",
        "workload-heads-float",
    ),
    api_case(
        lambda: Workload("w", "", 2, 1, 64.5, (8, 8, 8), (4, 4, 4), STA),
        WorkloadError,
        "head_dim",
        "workload-head-dim-float",
    ),
    api_case(
        lambda: Workload("w", "", HUGE, 1, 64, (8, 8, 8), (4, 4, 4), STA),
        WorkloadError,
        "memory",
        "workload-heads-2**70",
    ),
    api_case(
        lambda: Workload("w", "", 1, 1, 64, (8, 8, 8), (4, 4, 4), Selection("vsa", topk=2, seed=-1)),
        WorkloadError,
        "seed",
        "workload-seed-negative",
    ),
    api_case(
        lambda: Workload("w", "", 2, 1, 64, (8, 8, 8), (4, 4, 4), STA).graphs(heads=[5, 5]),
        WorkloadError,
        "heads",
        "workload-head-ids",
    ),
    # analysis
    api_case(
        lambda: analyze_graphs(GRAPH, head_dim=64.5), AnalysisError, "head_dim", "analysis-head-dim-float"
    ),
    api_case(lambda: analyze_graphs(GRAPH, layers="2"), AnalysisError, "layers", "analysis-layers-string"),
    api_case(lambda: analyze_graphs(None), AnalysisError, "graphs", "analysis-none"),
    api_case(lambda: analyze_graphs(GRAPH, route="256x64"), AnalysisError, "route", "analysis-route"),
    # routes
    api_case(lambda: work_of(GRAPH, "kpage", "256x64"), KernelValueError, "route", "forward-route-unknown"),
    api_case(
        lambda: paged_backward(None, None, None, None, None, None, GRAPH, route="packed"),
        KernelValueError,
        "forward route",
        "backward-route-packed",
    ),
    # plans, reference, emulator
    api_case(lambda: bsa_plan(None), PlanTypeError, "graph", "plan-graph-none"),
    api_case(
        lambda: attention_forward(ZEROS, ZEROS, ZEROS, GRAPH, scale=-0.25),
        ReferenceError,
        "positive",
        "reference-negative-scale",
    ),
    api_case(
        lambda: attention_forward(ZEROS, ZEROS, ZEROS, GRAPH, scale="1"),
        ReferenceTypeError,
        "scale",
        "reference-scale-string",
    ),
    api_case(
        lambda: attention_forward(None, ZEROS, ZEROS, GRAPH), ReferenceTypeError, "q", "reference-q-none"
    ),
    api_case(
        lambda: emulate_forward(None, ZEROS, ZEROS, ZEROS), EmulationError, "plan", "emulator-plan-none"
    ),
    # captures, bf16, device checks
    api_case(
        lambda: Capture(PAGES, [1.5, 2.5, 3.5], 256), CaptureTypeError, "positions", "capture-float-positions"
    ),
    api_case(
        lambda: Capture(PAGES, [100, 101, 102], 256.0), CaptureTypeError, "context", "capture-float-context"
    ),
    api_case(
        lambda: Capture(np.zeros((0, 2), int), [], 256), CaptureError, "no queries", "capture-no-queries"
    ),
    api_case(
        lambda: Capture(np.array([[0, 2**40]], np.int64), [100], 256),
        CaptureError,
        "1099511627776",
        "capture-page-id-int64-wraps",
    ),
    api_case(
        lambda: analyze_captures([Capture(np.full((3, 2), -1), [100, 101, 102], 256, name="c")]),
        CaptureError,
        "selected nothing",
        "capture-all-padding",
    ),
    api_case(lambda: float_to_bf16_bits("abc"), Bf16TypeError, "x", "bf16-string"),
    api_case(lambda: float_to_bf16_bits([1 + 2j]), Bf16TypeError, "real", "bf16-complex"),
    api_case(lambda: bf16_bits_to_float([1.5]), Bf16TypeError, "bits", "bf16-bits-float"),
    api_case(lambda: bf16_bits_to_float([-1]), Bf16ValueError, "65535", "bf16-bits-negative"),
    api_case(
        lambda: check_same_device(q=np.zeros(3)),
        KernelTypeError,
        "q must be a cupy array",
        "same-device-numpy",
    ),
    api_case(
        lambda: plan_backward(None, None, None, None, None, None, GRAPH, impl="cutlass"),
        KernelValueError,
        "impl must be one of",
        "backward-impl",
    ),
    api_case(
        lambda: plan_backward(None, None, None, None, None, None, GRAPH, impl="mma", deterministic=True),
        KernelValueError,
        "deterministic=True needs a wgmma implementation",
        "backward-deterministic-mma",
    ),
    api_case(
        lambda: plan_backward(None, None, None, None, None, None, GRAPH, impl="wgmma_sync", dq_plan=object()),
        KernelValueError,
        "dq_plan is only used by the Q-owned dQ pass",
        "backward-dq-plan-unused",
    ),
    api_case(
        lambda: plan_backward(
            None, None, None, None, None, None, GRAPH, impl="wgmma_dq_pass", dq_plan="plan"
        ),
        KernelTypeError,
        "dq_plan must be a TilePlan",
        "backward-dq-plan-type",
    ),
    api_case(
        lambda: plan_backward(
            None, None, None, None, None, None, kpage_plan(GRAPH, owner="kv"), impl="wgmma_dq_pass"
        ),
        KernelValueError,
        "pass the graph, or dq_plan",
        "backward-dq-pass-needs-graph",
    ),
    api_case(
        lambda: plan_backward(None, None, None, None, None, None, GRAPH, deterministic="yes"),
        KernelTypeError,
        "deterministic must be True or False",
        "backward-deterministic-type",
    ),
]


@pytest.mark.parametrize("call, error, needle", API_CASES)
def test_python_api_raises_a_named_error(call, error, needle):
    with pytest.raises(error) as info:
        call()
    assert isinstance(info.value, (ValueError, TypeError))
    assert type(info.value).__module__.startswith("sparseattn"), type(info.value)
    assert needle in str(info.value)


# --- dropped pairs: counted and warned about, not silent ----------------------------------------------
def test_dropped_block_pairs_are_counted_and_warned_once(tmp_path, capsys):
    blocks = [[0, 0, 1], [0, 3, 1], [1, 2, 3], [0, 0, 0], [1, 3, 3], [1, 3, 3]]  # block 3 is empty
    text = "grid: [4, 8, 12]\ntile: [4, 8, 8]\nheads: 2\nselection:\n  kind: blocks\n  blocks: " + json.dumps(
        blocks
    )
    (tmp_path / "d.yaml").write_text(text)
    assert cli.main(["analyze", "--layout", str(tmp_path / "d.yaml"), "--format", "json"]) == 0
    out, err = capsys.readouterr()
    (rec,) = json.loads(out)
    assert rec["dropped_pairs"] == 3 and rec["selected_pairs"] == 2
    lines = err.strip().splitlines()
    assert (
        len(lines) == 1
        and lines[0].startswith("sparseattn: warning: ")
        and "field 'selection.blocks'" in lines[0]
    )


def test_dropped_pairs_per_head_and_python_warning():
    lay = slot_layout(np.r_[np.ones(128, bool), np.zeros(128, bool)], 64)  # blocks 2 and 3 empty
    mask = np.zeros((2, 4, 4), bool)
    mask[0, 0, 0] = mask[1, 1, 1] = mask[1, 3, 0] = mask[1, 0, 2] = True
    graph = SparseGraph.from_block_mask(lay, lay, mask)
    assert graph.dropped_pairs.tolist() == [0, 2]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = analyze_graphs(graph)
    assert [w.category for w in caught] == [DroppedPairsWarning]
    assert report.record()["dropped_pairs"] == 2
    assert [r["dropped_pairs"] for r in report.per_head_records()] == [0, 2]
    assert "dropped_pairs" not in analyze_graphs(graph.select_heads([0])).record()


def test_size_checks_run_before_any_allocation(monkeypatch):
    monkeypatch.setenv("SPARSEATTN_MEMORY_LIMIT", "64M")
    with pytest.raises(LayoutError, match="memory"):
        video_layout((64, 128, 128), (4, 4, 4))
    w = Workload("w", "", 64, 1, 64, (16, 32, 32), (4, 4, 4), Selection("random", density=1.0))
    with pytest.raises(WorkloadError, match="heads"):
        w.graphs()
    assert w.graphs(heads=[0])[0].heads == 1


def test_an_unreadable_memory_limit_is_refused(monkeypatch):
    from sparseattn.limits import memory_limit

    monkeypatch.setenv("SPARSEATTN_MEMORY_LIMIT", "64 gigs")
    with pytest.raises(ValueError, match="SPARSEATTN_MEMORY_LIMIT"):
        memory_limit()
    monkeypatch.setenv("SPARSEATTN_MEMORY_LIMIT", "1.5k")
    assert memory_limit() == 1536


def test_a_capture_with_some_empty_queries_is_analysed(tmp_path):
    """Only a capture in which every query selected nothing is refused; empty rows among others count."""
    _npz(pages=np.array([[0, 1], [-1, -1], [1, 0]], np.int16))(tmp_path / "c.npz")
    rows = analyze_captures([tmp_path / "c.npz"])
    assert len(rows) == 3 and rows[0]["page_loads"] == 4


def test_memory_error_never_escapes_the_command_line(capsys, monkeypatch):
    def explode(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(analysis, "analyze_workloads", explode)
    assert cli.main(["analyze", "--workload", "sta_wan14b_69f"]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("sparseattn: error: out of memory") and "\n" not in line


def test_backward_impl_from_the_environment(monkeypatch):
    from sparseattn.kernels.bsa_backward import default_impl

    monkeypatch.setenv("SPARSEATTN_BWD_IMPL", "mma")
    assert default_impl() == "mma"
    monkeypatch.delenv("SPARSEATTN_BWD_IMPL")
    assert default_impl() == "wgmma"
    monkeypatch.setenv("SPARSEATTN_BWD_IMPL", "tensor-cores")
    with pytest.raises(KernelValueError, match="SPARSEATTN_BWD_IMPL"):
        default_impl()
