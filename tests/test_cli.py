"""The `sparseattn` command line: formats, options, error handling, lazy optional parts.

Most tests run the CLI on small hand-made workloads (patched in as the built-ins) so their numbers can
be derived by hand; a few run the real built-in workloads, layout files and modules.
"""

import csv
import io
import json
import subprocess
import sys
import types
from dataclasses import dataclass, field

import numpy as np
import pytest

from sparseattn import analysis, cli
from sparseattn.graph import SparseGraph
from sparseattn.layouts import video_layout

REQUIRED_INT_FIELDS = (
    "heads",
    "layers",
    "useful_pairs",
    "bsa_physical",
    "kpage_physical",
    "kpage_physical_no_routing",
)


@dataclass
class FakeWorkload:
    name: str
    description: str
    heads: int
    layers: int
    head_dim: int
    make: object = field(repr=False)

    def graphs(self, seed=0):
        return self.make(seed)


def _tiles384(seed):
    # latent 6x8x12 in 6x8x8 tiles, B=128: blocks with valid rows [128,128,128,128,64,0];
    # every head selects every pair (5 x 5 after the empty block is dropped).
    lay = video_layout((6, 8, 12), (6, 8, 8), 128)
    return [SparseGraph.from_block_mask(lay, lay, np.ones((2, 6, 6), bool))]


def _random_per_head(seed):
    lay = video_layout((4, 8, 20), (4, 4, 4), 64)
    rng = np.random.default_rng(seed)
    return [
        SparseGraph.from_block_mask(lay, lay, rng.random((1, lay.num_blocks, lay.num_blocks)) < 0.3)
        for _ in range(3)
    ]


def _empty(seed):
    lay = video_layout((2, 8, 8), (2, 8, 8), 128)
    return [SparseGraph.from_block_mask(lay, lay, np.zeros((1, 1, 1), bool))]


FAKE = {
    "tiles384": FakeWorkload("tiles384", "hand-derived 384-slot tiles", 2, 5, 128, _tiles384),
    "cubes": FakeWorkload("cubes", "random cubes, one graph per head", 3, 2, 64, _random_per_head),
}


@pytest.fixture
def fake_workloads(monkeypatch):
    module = types.SimpleNamespace(WORKLOADS=dict(FAKE), get_workload=lambda name: FAKE[name])
    monkeypatch.setattr(cli, "_workloads_module", lambda: module)
    return module


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, err, expected_code=2, *fragments):
    assert code == expected_code
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("sparseattn: error: ")
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0]


# --- analyze: formats and options --------------------------------------------------------------------
def test_analyze_json_has_design_fields_and_hand_derived_counts(capsys, fake_workloads):
    code, out, _ = run_cli(capsys, "analyze", "--format", "json")
    assert code == 0
    records = json.loads(out)
    assert [r["workload"] for r in records] == ["tiles384", "cubes"]
    for rec in records:
        for key in REQUIRED_INT_FIELDS:
            assert isinstance(rec[key], int), key
    t = records[0]
    # per head (see test_analysis.test_384_slot_tile_split_into_three_blocks): useful 576^2 = 331776,
    # BSA 25 * 128^2 = 409600, KPage 376832, no routing 409600; two heads
    assert (t["heads"], t["layers"]) == (2, 5)
    assert t["useful_pairs"] == 2 * 331776
    assert t["bsa_physical"] == 2 * 409600
    assert t["kpage_physical"] == 2 * 376832
    assert t["kpage_physical_no_routing"] == 2 * 409600
    assert t["kpage_occupancy"] == pytest.approx(331776 / 376832)


def test_analyze_sums_graphs_of_a_workload(capsys, fake_workloads):
    code, out, _ = run_cli(capsys, "analyze", "--workload", "cubes", "--format", "json", "--seed", "3")
    assert code == 0
    (rec,) = json.loads(out)
    expected = analysis.analyze_graphs(_random_per_head(3), "cubes").record()
    assert rec["heads"] == 3
    for key in ("useful_pairs", "bsa_physical", "kpage_physical", "kpage_physical_no_routing"):
        assert rec[key] == expected[key], key
    other = json.loads(
        run_cli(capsys, "analyze", "--workload", "cubes", "--format", "json", "--seed", "4")[1]
    )
    assert other[0]["useful_pairs"] != rec["useful_pairs"]  # the seed reaches the selection


def test_analyze_table_has_rows_and_total_line(capsys, fake_workloads):
    code, out, _ = run_cli(capsys, "analyze")
    assert code == 0
    assert "tiles384" in out and "cubes" in out
    total_line = [line for line in out.splitlines() if line.startswith("TOTAL:")]
    assert len(total_line) == 1
    assert "(BSA) →" in total_line[0] and "useful" in total_line[0]


def test_analyze_csv_and_per_head_rows(capsys, fake_workloads):
    code, out, _ = run_cli(capsys, "analyze", "--format", "csv")
    assert code == 0
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [r["workload"] for r in rows] == ["tiles384", "cubes"]
    assert int(rows[0]["bsa_physical"]) == 2 * 409600

    code, out, _ = run_cli(capsys, "analyze", "--format", "csv", "--per-head", "--workload", "tiles384")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [int(r["head"]) for r in rows] == [0, 1]
    assert all(int(r["kpage_physical"]) == 376832 for r in rows)

    code, out, _ = run_cli(capsys, "analyze", "--format", "json", "--per-head", "--workload", "cubes")
    (rec,) = json.loads(out)
    assert len(rec["per_head"]) == 3
    assert sum(h["useful_pairs"] for h in rec["per_head"]) == rec["useful_pairs"]


def test_layers_multiplies_counts(capsys, fake_workloads):
    one = json.loads(run_cli(capsys, "analyze", "--workload", "tiles384", "--format", "json")[1])[0]
    all_layers = json.loads(
        run_cli(capsys, "analyze", "--workload", "tiles384", "--format", "json", "--layers")[1]
    )[0]
    assert all_layers["scope"] == "all_layers" and one["scope"] == "one_call"
    for key in ("useful_pairs", "bsa_physical", "kpage_physical"):
        assert all_layers[key] == 5 * one[key]
    assert all_layers["kpage_occupancy"] == pytest.approx(one["kpage_occupancy"])


@pytest.mark.parametrize(
    "route,per_head",
    [("128x128", 409600), ("64x256", 442368), ("auto", 376832)],
    ids=["no-routing", "small-tile", "auto"],
)
def test_route_option(capsys, fake_workloads, route, per_head):
    # 64x256 fixed: 4 Q blocks * 64*ceil(128/64) * 768 + 64 * 768 = 393216 + 49152 = 442368
    rec = json.loads(
        run_cli(capsys, "analyze", "--workload", "tiles384", "--format", "json", "--route", route)[1]
    )[0]
    assert rec["route"] == route
    assert rec["kpage_physical"] == 2 * per_head


def test_plot_writes_png(capsys, fake_workloads, tmp_path):
    path = tmp_path / "capacity.png"
    code, _, err = run_cli(capsys, "analyze", "--plot", str(path), "--format", "json")
    assert code == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(path) in err


def test_empty_selection_gives_null_occupancy_in_json(capsys, monkeypatch):
    empty = FakeWorkload("empty", "no pairs", 1, 1, 128, _empty)
    module = types.SimpleNamespace(WORKLOADS={"empty": empty}, get_workload=lambda name: empty)
    monkeypatch.setattr(cli, "_workloads_module", lambda: module)
    rec = json.loads(run_cli(capsys, "analyze", "--format", "json")[1])[0]
    assert rec["bsa_physical"] == 0 and rec["bsa_occupancy"] is None


def test_delayed_progress_starts_only_after_the_delay():
    with cli.DelayedProgress(2, "x", delay=60) as p:
        p.update("a", advance=1)
    assert not p._started
    import time

    with cli.DelayedProgress(2, "x", delay=0.0) as p:
        time.sleep(0.2)
        p.update("b", advance=2)
    assert p._started


def test_progress_lines_when_stderr_is_not_a_terminal(fake_workloads):
    stream = io.StringIO()
    workloads = list(fake_workloads.WORKLOADS.values())
    with cli.AnalysisProgress(workloads, delay=0.0, stream=stream) as progress:
        progress(workloads[0], 1)  # a slice: no line yet
        progress(workloads[0], workloads[0].heads)
        progress(workloads[1], workloads[1].heads)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    assert "tiles384" in lines[0] and "[1/2 workloads" in lines[0] and "[2/2 workloads" in lines[1]


@pytest.mark.parametrize(
    "name, needle",
    [
        ("missing/capacity.png", "does not exist"),
        ("capacity.txt", "unsupported file type"),
        ("dir.png", "is a folder"),
    ],
    ids=["no-folder", "bad-suffix", "a-folder"],
)
def test_plot_path_is_checked_before_the_analysis(
    capsys, fake_workloads, monkeypatch, tmp_path, name, needle
):
    monkeypatch.setattr(cli, "analyze_with_progress", lambda *a, **k: pytest.fail("analysis ran"))
    (tmp_path / "dir.png").mkdir()
    code, _, err = run_cli(capsys, "analyze", "--plot", str(tmp_path / name))
    assert_one_line_error(code, err, 2, "--plot", needle)


# --- errors --------------------------------------------------------------------------------------------
def test_unknown_workload_is_a_one_line_error(capsys, fake_workloads):
    code, out, err = run_cli(capsys, "analyze", "--workload", "nope")
    assert_one_line_error(code, err, 2, "'nope'", "tiles384")
    assert out == ""


def test_missing_layout_file_is_a_one_line_error(capsys, tmp_path):
    pytest.importorskip("sparseattn.layout_file", reason="sparseattn.layout_file not built yet")
    missing = tmp_path / "none.yaml"
    code, _, err = run_cli(capsys, "analyze", "--layout", str(missing))
    assert_one_line_error(code, err, 2, "none.yaml")


def test_bad_layout_file_field_is_a_one_line_error(capsys, tmp_path):
    pytest.importorskip("sparseattn.layout_file", reason="sparseattn.layout_file not built yet")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "bad", "grid": [4, 4, "x"], "tile": [4, 4, 4]}))
    code, _, err = run_cli(capsys, "analyze", "--layout", str(bad))
    assert_one_line_error(code, err, 2, "bad.json")


def test_bad_option_values_exit_2(capsys):
    for argv in (
        ["analyze", "--route", "99x1"],
        ["analyze", "--format", "xml"],
        ["analyze", "--seed", "-1"],
        ["frobnicate"],
    ):
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 2, argv
        assert "Traceback" not in capsys.readouterr().err


def test_captures_cannot_mix_with_workloads(capsys, fake_workloads):
    code, _, err = run_cli(capsys, "analyze", "--captures", "--workload", "tiles384")
    assert_one_line_error(code, err, 2, "--captures")


# --- optional parts: captures and bench ----------------------------------------------------------------
def test_captures_rows_are_rendered_generically(capsys, monkeypatch):
    calls = []

    def analyze_captures(paths=None, group_size=8, window=64):
        calls.append((paths, group_size, window))
        return [
            {"capture": "c1", "queries": 8192, "union_pages": 12.5},
            {"capture": "c2", "queries": 4096, "union_pages": 30.25},
        ]

    fake = types.ModuleType("sparseattn.pageweaver.analysis")
    fake.analyze_captures = analyze_captures
    monkeypatch.setitem(sys.modules, "sparseattn.pageweaver.analysis", fake)
    code, out, _ = run_cli(capsys, "analyze", "--captures", "--format", "json")
    assert code == 0 and json.loads(out)[1]["union_pages"] == 30.25
    assert calls[-1] == (None, 8, 64)
    code, out, _ = run_cli(
        capsys,
        "analyze",
        "--captures",
        "a.npz",
        "b.npz",
        "--group-size",
        "4",
        "--window",
        "32",
        "--format",
        "csv",
    )
    assert calls[-1] == (["a.npz", "b.npz"], 4, 32)
    assert out.splitlines()[0] == "capture,queries,union_pages"
    code, out, _ = run_cli(capsys, "analyze", "--captures")
    assert "c1" in out and "8,192" in out


def test_missing_capture_analysis_is_reported(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "sparseattn.pageweaver.analysis", None)
    code, _, err = run_cli(capsys, "analyze", "--captures")
    assert_one_line_error(code, err, 1, "sparseattn.pageweaver.analysis")


def test_bench_subcommand_is_wired_lazily(capsys, monkeypatch):
    seen = {}
    fake = types.ModuleType("sparseattn.bench")
    fake.add_arguments = lambda parser: parser.add_argument("--iters", type=int, default=1)

    def run(args):
        seen["iters"] = args.iters
        return 0

    fake.run = run
    monkeypatch.setitem(sys.modules, "sparseattn.bench", fake)
    code, _, _ = run_cli(capsys, "bench", "--iters", "7")
    assert code == 0 and seen == {"iters": 7}


def test_missing_bench_is_a_one_line_error(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "sparseattn.bench", None)
    code, _, err = run_cli(capsys, "bench", "--anything")
    assert_one_line_error(code, err, 1, "sparseattn.bench")


def test_bench_backward_kernel_is_checked(capsys):
    with pytest.raises(SystemExit) as exc:  # argparse: usage line, then one error line, exit 2
        cli.main(["bench", "--bwd-impl", "cutlass"])
    assert exc.value.code == 2
    assert "argument --bwd-impl: invalid choice: 'cutlass'" in capsys.readouterr().err


def test_bench_names_every_backward_kernel():
    """Every backward implementation has the name its bench records carry (and so a --bwd-impl choice)."""
    from sparseattn.bench import BACKWARD_KERNELS
    from sparseattn.kernels.bsa_backward import IMPLS

    assert set(BACKWARD_KERNELS) == set(IMPLS)


def test_gpucheck_backward_kernel_is_checked(capsys, tmp_path):
    from sparseattn.gpucheck import main as gpucheck_main

    with pytest.raises(SystemExit) as exc:
        gpucheck_main(["--out", str(tmp_path), "--bwd-impl", "cutlass"])
    assert exc.value.code == 2
    assert "--bwd-impl" in capsys.readouterr().err


def test_gpucheck_needs_out_except_for_a_sanitizer_case(capsys, monkeypatch):
    """A full check needs --out; the case compute-sanitizer runs (--sanitize-case) does not, so a reader can
    run it by hand under a sanitizer."""
    from sparseattn import gpucheck

    with pytest.raises(SystemExit) as exc:
        gpucheck.main([])
    assert exc.value.code == 2 and "--out" in capsys.readouterr().err
    monkeypatch.setattr(gpucheck, "pair_sanitize_case", lambda: 0)
    assert gpucheck.main(["--sanitize-case", "--pair-only"]) == 0


# --- real modules --------------------------------------------------------------------------------------
def test_python_dash_m_entry_point():
    proc = subprocess.run(
        [sys.executable, "-m", "sparseattn", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0 and proc.stdout.startswith("sparseattn ")


def test_workloads_lists_the_six_builtins(capsys):
    pytest.importorskip("sparseattn.workloads", reason="sparseattn.workloads not built yet")
    code, out, _ = run_cli(capsys, "workloads", "--format", "json")
    assert code == 0
    names = {row["name"] for row in json.loads(out)}
    assert names == {
        "vsa_wan14b_720p",
        "vsa_wan14b_480p",
        "ssta_hy15_720p",
        "sta_hunyuan_117f",
        "sta_wan14b_69f",
        "svg2_wan14b_720p",
    }


def test_builtin_workload_analysis_is_consistent(capsys):
    wl = pytest.importorskip("sparseattn.workloads", reason="sparseattn.workloads not built yet")
    name = "sta_wan14b_69f"  # full tiles: the parity case
    code, out, _ = run_cli(capsys, "analyze", "--workload", name, "--format", "json")
    assert code == 0
    (rec,) = json.loads(out)
    assert rec["heads"] == wl.get_workload(name).heads
    # no partial tiles: every block is full, so BSA and KPage (128x128 tiles) pay exactly the useful pairs
    assert rec["useful_pairs"] == rec["bsa_physical"] == rec["kpage_physical_no_routing"] > 0


# --- tables: 100 columns, names never cut, one way to write each kind of number -----------------------
def _record(name, useful, bsa, kpage, no_routing):
    rec = {
        "workload": name,
        "heads": 40,
        "layers": 60,
        "scope": "one_call",
        "route": "auto",
        "useful_pairs": useful,
        "bsa_physical": bsa,
        "kpage_physical": kpage,
        "kpage_physical_no_routing": no_routing,
        "kpage_physical_routed": kpage,
    }
    rec.update(analysis.record_ratios(rec))
    return rec


@pytest.fixture
def narrow(monkeypatch):
    from rich.console import Console

    out = io.StringIO()
    monkeypatch.setattr(cli, "_stdout_console", lambda: Console(file=out, width=100, soft_wrap=False))
    return out


def _table_lines(text):
    return [line for line in text.splitlines() if line.strip()]


def _capacity(names):
    records = [_record(n, 65_400_000_000, 136_400_000_000, 80_100_000_000, 289_100_000_000) for n in names]
    summed = (*REQUIRED_INT_FIELDS[2:], "kpage_physical_routed")
    total = {**_record("TOTAL", 1, 2, 2, 2), **{k: sum(r[k] for r in records) for k in summed}}
    total.update(analysis.record_ratios(total))
    return records, total


def test_capacity_and_per_head_tables_fit_100_columns(narrow):
    names = ["vsa_wan14b_720p", "svg2_wan14b_720p", "sta_hunyuan_117f"]
    records, total = _capacity(names)
    row = {"head": 0, "selected_pairs": 1234, "useful_pairs": 7, "bsa_physical": 9, "kpage_physical": 8}
    row.update(kpage_physical_no_routing=9, bsa_occupancy=0.7, kpage_occupancy=0.875)
    cli.render_capacity_table(records, total, [[dict(row, workload=n)] for n in names])
    text = narrow.getvalue()
    table = [line for line in _table_lines(text) if not line.startswith("TOTAL:")]
    assert max(len(line) for line in table) <= 100
    assert all(name in text for name in names) and "…" not in text
    assert "47.9%" in text and "1.70×" in text and "70.0%" in text and "87.5%" in text


def test_a_table_too_wide_for_the_terminal_is_printed_whole(narrow):
    long_name = "my_layout_with_a_rather_long_descriptive_name"
    cli.render_capacity_table(*_capacity([long_name]))
    text = narrow.getvalue()
    assert long_name in text and "…" not in text and "289.1G" in text


def test_workloads_table_fits_and_keeps_names(narrow, capsys):
    assert cli.main(["workloads"]) == 0
    text = narrow.getvalue()
    assert max(len(line) for line in _table_lines(text)) <= 100 and "…" not in text
    for name in ("vsa_wan14b_720p", "sta_hunyuan_117f", "svg2_wan14b_720p", "ssta_hy15_720p"):
        assert name in text


def test_capture_table_uses_the_same_number_formats(narrow, monkeypatch):
    rows = [
        {
            "capture": "nsa_64k",
            "grouping": g,
            "queries": 65536,
            "k": 16,
            "page_loads": 1_040_384,
            "physical_pairs": 1_070_000_000,
            "occupancy": occ,
            "mean_union": 15.9,
            "p90_union": 16.0,
            "load_ratio_vs_per_query": ratio,
            "load_ratio_vs_adjacent": float("nan"),
            "grouping_ms_cpu": 107.3,
        }
        for g, occ, ratio in (("per_query", 0.0625, 1.0), ("affinity", 0.291, 4.69))
    ]
    fake = types.ModuleType("sparseattn.pageweaver.analysis")
    fake.analyze_captures = lambda paths=None, group_size=8, window=64: rows
    monkeypatch.setitem(sys.modules, "sparseattn.pageweaver.analysis", fake)
    assert cli.main(["analyze", "--captures"]) == 0
    text = narrow.getvalue()
    assert max(len(line) for line in _table_lines(text)) <= 100 and "…" not in text
    assert "6.2%" in text and "29.1%" in text and "4.69×" in text and "1.07G" in text and "–" in text
