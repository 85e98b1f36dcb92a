"""The SVG2 call figure (:mod:`sparseattn.svg2_plots`): which run it draws, which methods, cut bars."""

import json

import pytest
from matplotlib.text import Text

from sparseattn import svg2_plots

PARTS = {"kmeans_q": 2.0, "kmeans_k": 4.0, "layouts_select": 2.5, "plan_fwd": 1.5, "kernel_fwd": 60.0}


def _write_run(folder, name, date, methods, extra=()):
    records = [
        dict(
            workload="svg2_wan14b_720p",
            heads=40,
            tokens=75600,
            part=part,
            assign=m,
            time_ms=t if part == "kernel_fwd" else t * scale,
        )
        for m, scale in methods.items()
        for part, t in PARTS.items()
    ]
    doc = dict(
        gpu="GPU",
        commit="abc1234",
        date=date,
        command="python -m sparseattn.svg2_step_bench",
        records=records + list(extra),
    )
    (folder / name).write_text(json.dumps(doc))


def test_the_newest_run_with_a_complete_method_is_drawn(tmp_path):
    _write_run(tmp_path, "a.json", "2026-12-01T00:00:00+00:00", {"torch": 10.0, "wgmma_last_step": 1.0})
    incomplete = [dict(part="kmeans_q", assign="fused", time_ms=1.0)]
    _write_run(tmp_path, "b.json", "2026-12-03T00:00:00+00:00", {}, incomplete)
    (tmp_path / "other.json").write_text(json.dumps({"rows": []}))
    runs = svg2_plots.find_step_runs(tmp_path)
    assert [r.path.name for r in runs] == ["b.json", "a.json"]
    run = svg2_plots.pick_step_run(runs)
    assert run.path.name == "a.json"
    assert list(svg2_plots.method_parts(run)) == ["torch", "wgmma_last_step"]
    assert svg2_plots.pick_step_run(runs[:1]) is None


def test_bars_state_totals_and_cut_the_longest(tmp_path):
    _write_run(tmp_path, "a.json", "2026-12-01T00:00:00+00:00", {"torch": 30.0, "wgmma_last_step": 1.0})
    fig = svg2_plots.svg2_call_parts_figure(svg2_plots.pick_step_run(svg2_plots.find_step_runs(tmp_path)))
    fig.canvas.draw()
    texts = " | ".join(t.get_text() for t in fig.findobj(Text))
    assert "10.00 ms, 16.7%" in texts  # 2 + 4 + 2.5 + 1.5 of the kernel's 60
    assert "▶ 300.00 ms, 500.0%" in texts  # torch's bar ends past the axis
    assert fig.axes[0].get_xlim()[1] < 300.0


def test_a_run_without_complete_methods_is_refused(tmp_path):
    _write_run(
        tmp_path, "b.json", "2026-12-03T00:00:00+00:00", {}, [dict(part="kmeans_q", assign="x", time_ms=1.0)]
    )
    run = svg2_plots.find_step_runs(tmp_path)[0]
    with pytest.raises(ValueError, match="no method"):
        svg2_plots.svg2_call_parts_figure(run)


def test_the_beside_method_adds_what_vs_move_did_not_hide(tmp_path):
    """The selection and plan beside v's move: their part is the method's move to slots less the in-order
    method's of the same run; without the in-order method the beside method is not drawn."""
    in_order, beside = "wgmma_in_slots_queued_clusters", "wgmma_in_slots_queued_clusters_beside"
    moves = [
        dict(part="to_slots", assign=in_order, time_ms=3.0),
        dict(part="to_slots", assign=beside, time_ms=3.4),
    ]
    _write_run(tmp_path, "a.json", "2026-12-01T00:00:00+00:00", {in_order: 1.0, beside: 1.0}, moves)
    run = svg2_plots.pick_step_run(svg2_plots.find_step_runs(tmp_path))
    parts = svg2_plots.method_parts(run)
    assert parts[beside]["beside_unhidden"] == pytest.approx(0.4) and "beside_unhidden" not in parts[in_order]
    fig = svg2_plots.svg2_call_parts_figure(run)
    fig.canvas.draw()
    texts = " | ".join(t.get_text() for t in fig.findobj(Text))
    assert "10.40 ms, 17.3%" in texts and "10.00 ms, 16.7%" in texts
    _write_run(tmp_path, "b.json", "2026-12-02T00:00:00+00:00", {beside: 1.0}, moves[1:])
    newest = svg2_plots.find_step_runs(tmp_path)[0]
    assert newest.path.name == "b.json" and svg2_plots.method_parts(newest) == {}
