"""Recorded benchmark runs: loading, picking one run per figure, and the speed figures drawn from them."""

import json
import math

import pytest
from matplotlib.text import Text

from sparseattn import benchdata, speedplots
from sparseattn.benchdata import BenchFileError, find_runs, load_run, pick_run


def _rec(workload, impl, pass_, time_ms, **extra):
    rec = {
        "workload": workload,
        "impl": impl,
        "pass": pass_,
        "heads": 40,
        "head_dim": 128,
        "time_ms": time_ms,
        "useful_pairs": 10**10,
        "physical_pairs": 2 * 10**10,
        "correct": True,
    }
    rec.update(extra)
    return rec


def _write_run(folder, name, date, records, commit="0123456789abcdef0123+x"):
    doc = {
        "gpu": "NVIDIA H200",
        "commit": commit,
        "date": date,
        "command": "python -m sparseattn.bench",
        "records": records,
    }
    path = folder / name
    path.write_text(json.dumps(doc))
    return path


BASELINES = [
    _rec("vsa_wan14b_720p", "bsa", "fwd", 80.0),
    _rec("vsa_wan14b_720p", "flex", "fwd", 60.0),
    _rec("vsa_wan14b_720p", "flex", "fwdbwd", None, error="InductorError: no choices"),
    _rec("vsa_wan14b_720p", "bsa", "fwdbwd", 300.0),
    _rec("sta_wan14b_69f", "bsa", "fwd", 40.0),
    _rec("sta_wan14b_69f", "flex", "fwd", 35.0),
]
KPAGE = [
    _rec("vsa_wan14b_720p", "kpage", "fwd", 40.0),
    _rec("vsa_wan14b_720p", "kpage", "fwdbwd", 200.0),
    _rec("sta_wan14b_69f", "kpage", "fwd", 38.0),
]


@pytest.fixture
def bench_dir(tmp_path):
    """Three runs: an old one with KPage, a newer one without, and files that are not runs."""
    _write_run(
        tmp_path,
        "a_old_with_kpage.json",
        "2026-11-01T10:00:00+00:00",
        BASELINES + KPAGE,
        commit="aaaaaaaaaaaaaaaa",
    )
    _write_run(
        tmp_path, "z_new_baselines.json", "2026-11-29T18:00:00+00:00", BASELINES, commit="bbbbbbbbbbbb"
    )
    (tmp_path / "summary.json").write_text(json.dumps([{"step": "pytest"}]))
    (tmp_path / "analysis.json").write_text(json.dumps({"command": "x", "rows": []}))
    (tmp_path / "broken.json").write_text("{not json")
    return tmp_path


def test_find_runs_skips_other_files_and_sorts_newest_first(bench_dir):
    runs = find_runs(bench_dir)
    assert [r.path.name for r in runs] == ["z_new_baselines.json", "a_old_with_kpage.json"]


def test_load_run_rejects_files_that_are_not_runs(bench_dir):
    with pytest.raises(BenchFileError, match="no field 'gpu'"):
        load_run(bench_dir / "analysis.json")
    with pytest.raises(BenchFileError, match="JSON object"):
        load_run(bench_dir / "summary.json")
    with pytest.raises(BenchFileError, match="cannot read"):
        load_run(bench_dir / "broken.json")


def test_pick_run_takes_the_newest_run_with_what_is_needed(bench_dir):
    runs = find_runs(bench_dir)
    assert pick_run(runs, all_of=("kpage",)).path.name == "a_old_with_kpage.json"
    assert pick_run(runs, any_of=("bsa", "flex")).path.name == "z_new_baselines.json"
    assert pick_run(runs, all_of=("vsa_kernel",)) is None
    assert pick_run(runs, all_of=("kpage",), passes=("complete_call",)) is None


def test_dates_are_compared_as_times_not_strings(tmp_path):
    _write_run(tmp_path, "a.json", "2026-11-29T20:00:00+02:00", BASELINES)  # 18:00 UTC
    _write_run(tmp_path, "b.json", "2026-11-29T19:00:00+00:00", BASELINES)
    assert find_runs(tmp_path)[0].path.name == "b.json"


def test_usable_and_failed_records():
    assert benchdata.is_usable(_rec("w", "bsa", "fwd", 1.0))
    assert not benchdata.is_usable(_rec("w", "bsa", "fwd", 1.0, correct=False))
    assert not benchdata.is_usable(_rec("w", "bsa", "fwd", None, error="x"))
    assert not benchdata.is_usable(_rec("w", "bsa", "fwd", float("nan")))
    assert benchdata.is_usable(_rec("w", "bsa", "fwdbwd", 1.0, correct=None))  # not checked is not wrong


def test_useful_tflops_matches_the_recorded_rate():
    run = load_run(benchdata.DEFAULT_BENCH_DIR / "forward_speed_seven_workloads_h200_20261201_c9804b7.json")
    checked = [r for r in run.records if benchdata.is_usable(r) and "useful_tflops" in r]
    assert len(checked) >= 20
    for rec in checked:
        assert benchdata.useful_tflops(rec) == pytest.approx(rec["useful_tflops"], abs=0.06)


def test_source_names_gpu_commit_date_and_file(bench_dir):
    run = load_run(bench_dir / "a_old_with_kpage.json")
    assert run.short_commit == "aaaaaaa"
    assert load_run(bench_dir / "z_new_baselines.json").short_commit == "bbbbbbb"
    text = run.source()
    assert "NVIDIA H200" in text and "2026-11-01" in text and "a_old_with_kpage.json" in text


def test_kpage_speedups_come_from_one_run(bench_dir):
    run = speedplots.pick_kpage_run(find_runs(bench_dir))
    assert run.path.name == "a_old_with_kpage.json"
    rows = {(r["workload"], r["pass"], r["baseline"]): r["speedup"] for r in speedplots.kpage_speedups(run)}
    assert rows == {
        ("vsa_wan14b_720p", "fwd", "bsa"): 2.0,
        ("vsa_wan14b_720p", "fwd", "flex"): 1.5,
        ("vsa_wan14b_720p", "fwdbwd", "bsa"): 1.5,
        ("sta_wan14b_69f", "fwd", "bsa"): 40.0 / 38.0,
        ("sta_wan14b_69f", "fwd", "flex"): 35.0 / 38.0,
    }


def _texts(fig):
    fig.canvas.draw()
    return " ".join(" ".join(t.get_text().split()) for t in fig.findobj(Text) if t.get_visible())


def test_kpage_speed_figure_with_kpage_records(bench_dir):
    run = speedplots.pick_kpage_run(find_runs(bench_dir))
    text = _texts(speedplots.kpage_speed_figure(run))
    assert "KPage speedup" in text and "vs BSA" in text and "vs FlexAttention" in text
    assert "FlexAttention: failed" in text  # the fwd+bwd FlexAttention record carries an error
    assert "Not in this run: VSA kernel" in text
    assert "No KPage records" not in text


def test_kpage_speed_figure_hatches_the_pair_route_where_it_ran(tmp_path):
    """kpage_pair records add hatched "pair route vs ..." bars whose lengths are the baseline's time over
    the pair route's; a pass without pair records gets none."""
    pair = [_rec("vsa_wan14b_720p", "kpage_pair", "fwd", 30.0)]
    _write_run(tmp_path, "with_pair.json", "2026-11-29T18:00:00+00:00", BASELINES + KPAGE + pair)
    run = speedplots.pick_kpage_run(find_runs(tmp_path))
    fig = speedplots.kpage_speed_figure(run)
    assert "pair route vs BSA" in _texts(fig)
    fwd, fwdbwd = fig.axes[0], fig.axes[1]
    hatched = [b for b in fwd.patches if b.get_hatch()]
    assert sorted(round(b.get_width(), 6) for b in hatched) == [2.0, round(80.0 / 30.0, 6)]
    assert not [b for b in fwdbwd.patches if b.get_hatch()]


def test_kpage_run_is_the_newest_commits_most_complete(tmp_path):
    """A later, shorter repeat (same commit, fewer workloads) does not replace the commit's full run; a
    newer commit's run does."""
    full = BASELINES + KPAGE
    short = [r for r in full if r["workload"] == "vsa_wan14b_720p"]
    _write_run(tmp_path, "full.json", "2026-11-29T18:00:00+00:00", full)
    _write_run(tmp_path, "repeat.json", "2026-11-29T19:00:00+00:00", short)
    assert speedplots.pick_kpage_run(find_runs(tmp_path)).path.name == "full.json"
    _write_run(tmp_path, "newer.json", "2026-11-29T20:00:00+00:00", short, commit="c" * 40)
    assert speedplots.pick_kpage_run(find_runs(tmp_path)).path.name == "newer.json"


def test_kpage_speed_figure_without_kpage_says_so(tmp_path):
    _write_run(tmp_path, "only_baselines.json", "2026-11-29T18:00:00+00:00", BASELINES)
    run = speedplots.pick_kpage_run(find_runs(tmp_path))
    assert run is not None and not run.has("kpage")
    text = _texts(speedplots.kpage_speed_figure(run))
    assert "No KPage records yet" in text and "useful TFLOP/s" in text
    assert "Not in this run: KPage" in text
    assert "FlexAttention" in text and "VSA · Wan2.1-14B 720p" in text


def test_pageweaver_speed_figure_without_records_says_so(bench_dir):
    assert speedplots.pick_pageweaver_run(find_runs(bench_dir)) is None
    text = _texts(speedplots.pageweaver_speed_figure(None))
    assert "No recorded complete-call benchmark yet" in text and "1.70×" in text


def test_pageweaver_speed_figure_with_records(tmp_path):
    records = []
    for cap, union_ms in (("nsa_8k", 0.5), ("dsa_64k", 0.25)):
        records += [
            _rec(cap, "flashinfer", "complete_call", 1.0, heads=8),
            _rec(cap, "pageweaver_union", "complete_call", union_ms, heads=8),
        ]
    _write_run(tmp_path, "pw.json", "2026-12-01T00:00:00+00:00", records)
    _write_run(tmp_path, "newer_without_pw.json", "2026-12-02T00:00:00+00:00", BASELINES)
    run = speedplots.pick_pageweaver_run(find_runs(tmp_path))
    assert run.path.name == "pw.json"
    rows = speedplots.pageweaver_speedups(run)
    assert sorted(r["speedup"] for r in rows) == [2.0, 4.0]
    text = _texts(speedplots.pageweaver_speed_figure(run))
    assert f"{math.sqrt(8):.2f}× geomean" in text and "paper: 1.70×" in text
    assert "NSA-like 8K" in text and "DSA-like 64K" in text


def test_pageweaver_speedups_keep_each_grouping(tmp_path):
    """A union recorded with both groupings (fixed adjacent groups, affinity search) gives one row each."""
    records = [_rec("nsa_8k", "flashinfer", "complete_call", 1.0, heads=32)]
    for grouping, ms in (("adjacent8", 0.5), ("affinity", 0.4)):
        rec = _rec("nsa_8k", "pageweaver_union", "complete_call", ms, heads=32)
        rec.update(grouping=grouping, gqa=4)
        records.append(rec)
    _write_run(tmp_path, "pw.json", "2026-12-01T00:00:00+00:00", records)
    run = speedplots.pick_pageweaver_run(find_runs(tmp_path))
    rows = speedplots.pageweaver_speedups(run)
    assert sorted((r["grouping"], r["speedup"]) for r in rows) == [("adjacent8", 2.0), ("affinity", 2.5)]
    text = _texts(speedplots.pageweaver_speed_figure(run))
    assert "(adjacent 8): 2.00× geomean" in text and "(affinity): 2.50× geomean" in text


def test_pageweaver_geomean_leaves_out_gqa16(tmp_path):
    """G = 16 bars are drawn, but the legend's geometric mean is over GQA 1/4/8 (the target's measure)."""
    records = []
    for gqa, ms in ((1, 0.5), (8, 0.25), (16, 1.0)):
        for impl, t in (("flashinfer", 1.0), ("pageweaver_union", ms)):
            rec = _rec("nsa_8k", impl, "complete_call", t, heads=8 * gqa)
            rec.update(gqa=gqa)
            records.append(rec)
    _write_run(tmp_path, "pw.json", "2026-12-01T00:00:00+00:00", records)
    run = speedplots.pick_pageweaver_run(find_runs(tmp_path))
    assert len(speedplots.pageweaver_speedups(run)) == 3
    text = _texts(speedplots.pageweaver_speed_figure(run))
    assert f"{math.sqrt(8):.2f}× geomean, GQA 1/8" in text
    assert "GQA 16 (128 heads)" in text


def test_pageweaver_flashinfer_baseline_is_its_fastest_path(tmp_path):
    """The FlashInfer baseline of a capture and GQA is the fastest of its recorded paths (e4m3 or bf16
    cache, any backend); failed backends (error records) are left out."""
    fastest = _rec("nsa_8k", "flashinfer_bf16", "complete_call", 0.8, heads=8)
    fastest.update(backend="fa3")
    failed = _rec("nsa_8k", "flashinfer", "complete_call", 0.1, heads=8)
    failed.update(backend="auto", error="RuntimeError: no fa3 for e4m3")
    records = [
        _rec("nsa_8k", "flashinfer", "complete_call", 1.0, heads=8),
        fastest,
        failed,
        _rec("nsa_8k", "pageweaver_union", "complete_call", 0.4, heads=8),
    ]
    _write_run(tmp_path, "pw.json", "2026-12-01T00:00:00+00:00", records)
    run = speedplots.pick_pageweaver_run(find_runs(tmp_path))
    (row,) = speedplots.pageweaver_speedups(run)
    assert row["speedup"] == pytest.approx(2.0) and row["baseline_path"] == "flashinfer_bf16 (fa3)"
