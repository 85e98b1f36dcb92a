"""`sparseattn bench model wan` on the CPU: its options, its records (bench format, summary, checkpointing
rule), the attention clock, a smoke run on a tiny random Wan (dense and masked-SDPA STA; an SVG2 slot that
is skipped; a failing and an out-of-memory implementation), and the figure drawn from a recorded run.
The runs need torch and diffusers (skipped without them)."""

from __future__ import annotations

import json
import re

import pytest
from matplotlib.text import Text

from sparseattn import benchdata, cli, figstyle, figures, model_bench, modelplots

TINY = ["wan", "--models", "tiny", "--res", "tiny", "--device", "cpu", "--reps", "1", "--warmup", "0"]
TINY += ["--sta-tile", "2x2x4", "--sta-window", "1x1x1"]


# ---- options -------------------------------------------------------------------------------------------
def test_defaults_are_the_issue_grid():
    args = model_bench.build_parser().parse_args(["wan"])
    assert args.models == ["1.3b", "14b"] and args.res == ["480p", "720p"]
    assert args.impl == ["dense", "kpage_sta", "flex_sta", "kpage_vsa", "vsa_kernel", "kpage_svg2"]
    assert args.modes == ["fwd", "train"] and args.layers == {}
    assert args.sta_tile == (4, 4, 8) and args.sta_window == (3, 3, 3)
    assert model_bench.MODELS["14b"].default_layers == 4 and model_bench.MODELS["14b"].layers_full == 40
    assert model_bench.MODELS["14b"].dim == 5120 and model_bench.MODELS["1.3b"].layers_full == 30
    assert [model_bench.token_grid(model_bench.RESOLUTIONS[r]) for r in ("480p", "720p")] == [
        (21, 30, 52),
        (21, 45, 80),
    ]


def test_options_parse():
    args = model_bench.build_parser().parse_args(
        ["wan", "--models", "14b", "--res", "720p,480p", "--impl", "kpage_sta,flex_sta,masked_sta"]
        + [
            "--layers",
            "14b=8,1.3b=2",
            "--modes",
            "train",
            "--reps",
            "3",
            "--sta-tile",
            "4×4×4",
            "--budget-s",
            "500",
        ]
    )
    assert args.models == ["14b"] and args.res == ["720p", "480p"]
    assert args.impl == ["kpage_sta", "flex_sta", "masked_sta"] and args.modes == ["train"]
    assert args.layers == {"14b": 8, "1.3b": 2} and args.reps == 3 and args.budget_s == 500
    assert args.sta_tile == (4, 4, 4)


@pytest.mark.parametrize(
    "argv",
    [
        ["wan", "--models", "7b"],
        ["wan", "--res", "1080p"],
        ["wan", "--impl", "kpage"],
        ["wan", "--layers", "14b=0"],
        ["wan", "--layers", "4"],
        ["wan", "--sta-tile", "4x4"],
        ["wan", "--reps", "0"],
        ["hunyuan"],
    ],
)
def test_bad_options_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "model", *argv])
    assert exit_.value.code == 2
    assert "sparseattn bench model" in capsys.readouterr().err


def test_cli_help_names_the_model_target(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "model", "wan", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--models" in out and "--budget-s" in out and "kpage_svg2" in out


# ---- records -------------------------------------------------------------------------------------------
def test_checkpointing_rule_fits_the_measured_runs():
    """480p 1.3B training (30 layers) ran without checkpointing on the H200 (139 GiB); 720p needs it."""
    h200 = 139 * 2**30
    m13, m14 = model_bench.MODELS["1.3b"], model_bench.MODELS["14b"]
    assert model_bench.activation_bytes(m13, 32760, 30) < h200
    assert model_bench.activation_bytes(m13, 75600, 30) > h200
    assert model_bench.activation_bytes(m14, 75600, 4) < h200 < model_bench.activation_bytes(m14, 75600, 10)


def _records():
    base = dict(workload="wan1.3b_480p", model="Wan2.1-1.3B", res="480p", layers=30, layers_full=30, heads=12)
    recs = []
    for impl, times in (("dense", (600, 300, 2000, 1200)), ("kpage_sta", (300, 30, 900, 120))):
        for pass_, t in zip(model_bench.PASSES, times):
            recs.append(
                dict(
                    base,
                    impl=impl,
                    **{"pass": pass_},
                    time_ms=float(t),
                    checked=True,
                    rel_err=1e-3,
                    correct=True,
                )
            )
    recs.append(dict(base, impl="flex_sta", **{"pass": "step_train"}, error="InductorError: no"))
    recs.append(dict(base, impl="kpage_svg2", **{"pass": "step_fwd"}, skipped=model_bench.SVG2_MISSING))
    return recs


def test_summary_rows():
    rows = {r["impl"]: r for r in model_bench.summary_rows(_records())}
    assert rows["kpage_sta"]["x_step_fwd"] == pytest.approx(2.0)
    assert rows["kpage_sta"]["x_step_train"] == pytest.approx(2000 / 900)
    assert rows["kpage_sta"]["attn_train"] == 120 and rows["dense"]["x_step_fwd"] == 1.0
    assert rows["flex_sta"]["note"].startswith("error: InductorError")
    assert rows["kpage_svg2"]["note"].startswith("skipped: SVG2 on KPage is not available")


def test_markdown_table(tmp_path, capsys):
    table = model_bench.markdown_table(_records())
    lines = table.splitlines()
    assert lines[:2] == ["| step | dense (cuDNN) | KPage STA |", "|---|---|---|"]  # columns with a time only
    assert lines[2] == "| 1.3B 480p forward | 600 ms (300) | 300 ms (30), 2.00× |"
    assert lines[3] == "| 1.3B 480p training | 2,000 ms (1,200) | 900 ms (120), 2.22× |"
    with_flex = [*_records(), dict(_records()[4], impl="flex_sta", time_ms=600.0)]  # its step_fwd only
    row = model_bench.markdown_table(with_flex).splitlines()[2]
    assert row == "| 1.3B 480p forward | 600 ms (300) | 300 ms (30), 2.00× | 600 ms, 1.00× | – |"
    path = tmp_path / "run.json"
    path.write_text(json.dumps(dict(records=_records())))
    assert model_bench.main(["wan", "--markdown", str(path)]) == 0
    assert capsys.readouterr().out.strip() == table


def test_pick_model_run_wants_dense_and_a_peer(tmp_path):
    def write(name, date, records):
        doc = dict(
            gpu="NVIDIA H200",
            commit="abc1234",
            date=date,
            command="sparseattn bench model wan",
            records=records,
        )
        (tmp_path / name).write_text(json.dumps(doc))

    write("old.json", "2026-12-01T00:00:00+00:00", _records())
    write("dense_only.json", "2026-12-03T00:00:00+00:00", [r for r in _records() if r["impl"] == "dense"])
    kernel = dict(
        workload="vsa_wan14b_720p", impl="kpage", heads=40, time_ms=1.0
    )  # a kernel run: no model steps
    write("kernels.json", "2026-12-04T00:00:00+00:00", [dict(kernel, **{"pass": "fwd"})])
    run = modelplots.pick_model_run(benchdata.find_runs(tmp_path))
    assert run is not None and run.path.name == "old.json"
    narrow = [r for r in _records() if r["impl"] in ("dense", "kpage_sta") and r["pass"] == "step_fwd"]
    write("narrow.json", "2026-12-05T00:00:00+00:00", narrow)  # newer, but fewer rows: not the figure's
    assert modelplots.pick_model_run(benchdata.find_runs(tmp_path)).path.name == "old.json"
    write("again.json", "2026-12-06T00:00:00+00:00", _records())  # as wide and newer: it
    assert modelplots.pick_model_run(benchdata.find_runs(tmp_path)).path.name == "again.json"
    for name in ("old.json", "narrow.json", "again.json"):
        (tmp_path / name).unlink()
    assert modelplots.pick_model_run(benchdata.find_runs(tmp_path)) is None


# ---- the attention clock -------------------------------------------------------------------------------
def test_attention_clock_times_forward_and_backward_on_the_cpu():
    torch = pytest.importorskip("torch")
    clock = model_bench.AttentionClock("cpu")

    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    timed = clock.wrap(attend)
    q, k, v = (torch.randn(1, 2, 256, 32, requires_grad=True) for _ in range(3))
    with torch.no_grad():
        timed(q, k, v)
    forward_only = [dict(e) for e in clock.calls]
    assert len(forward_only) == 1 and "bwd_start" not in forward_only[0]
    clock.reset()
    out = timed(q, k, v)
    torch.testing.assert_close(out, attend(q, k, v))
    out.square().sum().backward()
    entry = clock.calls[0]
    assert len(entry["bwd_start"]) == 1 and len(entry["bwd_end"]) == 3
    assert clock.total_ms() > 0 and clock.calls == []
    assert q.grad is not None and q.grad.abs().sum() > 0


# ---- a smoke run on a tiny random Wan ------------------------------------------------------------------
@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    out = tmp_path_factory.mktemp("model_bench") / "run.json"
    argv = [*TINY, "--impl", "dense,masked_sta,kpage_svg2,dense_diffusers", "--out", str(out)]
    code = model_bench.main(argv, prog="sparseattn bench model")
    return code, out


def test_smoke_run_writes_a_bench_run(smoke):
    code, out = smoke
    assert code == 0
    run = benchdata.load_run(out)  # the bench format: gpu, commit, date, command, records
    assert run.command.startswith("sparseattn bench model wan --models tiny")
    doc = json.loads(out.read_text())
    assert doc["models"]["wantiny"].startswith("tiny Wan-shaped") and doc["sta"]["tile"] == [2, 2, 4]
    by = {(r["impl"], r["pass"]): r for r in run.records}
    for impl in ("dense", "masked_sta"):
        for pass_ in model_bench.PASSES:
            rec = by[(impl, pass_)]
            assert benchdata.is_usable(rec), rec
            assert rec["workload"] == "wantiny_tiny" and rec["tokens"] == 4 * 4 * 8
            assert rec["layers"] == rec["layers_full"] == 2 and rec["heads"] == 2 and rec["head_dim"] == 32
            assert rec["checked"] is True and rec["correct"] is True and rec["rel_err"] < 1e-5
    assert by[("masked_sta", "step_fwd")]["tile"] == [2, 2, 4] and by[("masked_sta", "step_fwd")][
        "window"
    ] == [1, 1, 1]
    assert by[("dense", "step_train")]["grad_checkpointing"] is False
    assert by[("dense", "attn_fwd")]["time_ms"] < by[("dense", "step_fwd")]["time_ms"]
    assert (
        by[("dense_diffusers", "step_fwd")]["checked"] is False and ("dense_diffusers", "attn_fwd") not in by
    )
    for pass_ in model_bench.PASSES:  # on the CPU KPage's SVG2 graph is computed by masking
        rec = by[("kpage_svg2", pass_)]
        assert benchdata.is_usable(rec) and rec["q_clusters"] == 32 and rec["k_clusters"] == 64, rec
        assert rec["checked"] is True and rec["rel_err"] < 1e-5, rec  # the same step's cluster pairs
        assert 0 < rec["svg2_selected_pairs"] <= 1, rec
    assert "svg2_selected_pairs" not in by[("dense", "step_fwd")]


def test_smoke_run_goes_on_after_a_failing_impl(monkeypatch, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    real = model_bench.build_impl

    def build(impl, *args):
        if impl == "kpage_sta":
            raise ModuleNotFoundError("No module named 'cupy'")
        return real(impl, *args)

    monkeypatch.setattr(model_bench, "build_impl", build)
    out = tmp_path / "run.json"
    code = model_bench.main([*TINY, "--impl", "kpage_sta,dense", "--modes", "fwd", "--out", str(out)])
    records = json.loads(out.read_text())["records"]
    assert code == 0
    assert [(r["impl"], r["pass"], "error" in r) for r in records] == [
        ("kpage_sta", "step_fwd", True),
        ("kpage_sta", "attn_fwd", True),
        ("dense", "step_fwd", False),
        ("dense", "attn_fwd", False),
    ]


def test_out_of_memory_in_training_retries_with_checkpointing(monkeypatch, tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    real, calls = model_bench.time_mode, []

    def time_mode(model, inputs, clock, train, *args):
        calls.append((train, model.gradient_checkpointing))
        if train and not model.gradient_checkpointing:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9 GiB")
        return real(model, inputs, clock, train, *args)

    monkeypatch.setattr(model_bench, "time_mode", time_mode)
    out = tmp_path / "run.json"
    assert model_bench.main([*TINY, "--impl", "dense", "--out", str(out)]) == 0
    by = {r["pass"]: r for r in json.loads(out.read_text())["records"]}
    assert calls == [(False, False), (True, False), (True, True)]
    assert by["step_train"]["grad_checkpointing"] is True
    assert by["step_train"]["checkpointing_reason"] == "out of memory without"
    assert "grad_checkpointing" not in by["step_fwd"] and benchdata.is_usable(by["attn_train"])


def test_a_spent_budget_skips_the_rest(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    out = tmp_path / "run.json"
    assert model_bench.main([*TINY, "--impl", "dense", "--budget-s", "1e-9", "--out", str(out)]) == 0
    records = json.loads(out.read_text())["records"]
    assert len(records) == 4 and all(r["skipped"].startswith("time budget spent") for r in records)


# ---- the figure ----------------------------------------------------------------------------------------
def _figure_records():
    recs = []
    for model, layers, full in (("Wan2.1-1.3B", 30, 30), ("Wan2.1-14B", 4, 40)):
        for res, scale in (("480p", 1.0), ("720p", 3.5)):
            key = "1.3b" if layers == full else "14b"
            base = dict(workload=f"wan{key}_{res}", model=model, res=res, layers=layers, layers_full=full)
            for impl, t in (
                ("dense", (600, 300, 2000, 1200)),
                ("kpage_sta", (300, 30, 900, 120)),
                ("flex_sta", (350, 70, 1000, 220)),
            ):
                for pass_, ms in zip(model_bench.PASSES, t):
                    extra = (
                        dict(selection="sta", tile=[4, 4, 8], window=[3, 3, 3], block_size=128)
                        if "sta" in impl
                        else {}
                    )
                    recs.append(
                        dict(base, impl=impl, **{"pass": pass_}, time_ms=ms * scale, correct=True, **extra)
                    )
            recs.append(
                dict(
                    base,
                    impl="vsa_kernel",
                    **{"pass": "step_fwd"},
                    error="ModuleNotFoundError: fastvideo_kernel",
                )
            )
            recs.append(
                dict(base, impl="kpage_svg2", **{"pass": "step_fwd"}, skipped=model_bench.SVG2_MISSING)
            )
    return recs


def test_model_panel_values():
    labels, series, notes, attention, texts = modelplots.model_panel(_figure_records(), "step_fwd")
    assert labels == [
        "Wan2.1-1.3B 480p",
        "Wan2.1-1.3B 720p",
        "Wan2.1-14B 480p, 4 of 40 layers",
        "Wan2.1-14B 720p, 4 of 40 layers",
    ]
    names = [s[0] for s in series]
    assert names[:3] == ["dense (cuDNN)", "KPage STA", "FlexAttention STA"]
    kp = names.index("KPage STA")
    assert series[kp][2][0] == pytest.approx(0.5) and attention[kp][0] == pytest.approx(0.05)
    assert texts[kp][0] == "2.00×" and texts[0][1] == "2.10 s" and texts[0][0] == "600 ms"
    vsa = names.index("VSA kernel")
    assert notes[(0, vsa)] == "VSA kernel: failed"
    assert not any("SVG2" in text for text in notes.values())  # the SVG2 slot waits quietly


def test_model_figure_from_a_run(tmp_path):
    doc = dict(
        gpu="NVIDIA H200",
        commit="abc1234",
        date="2026-12-03T00:00:00+00:00",
        command="x",
        records=_figure_records(),
    )
    (tmp_path / "model_wan.json").write_text(json.dumps(doc))
    run = modelplots.pick_model_run(benchdata.find_runs(tmp_path))
    fig = modelplots.model_steps_figure(run)
    fig.canvas.draw()
    assert fig.get_size_inches()[0] == pytest.approx(figstyle.ONE_COLUMN)
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
    assert all(t.get_fontsize() >= figstyle.MIN_FONT_PT for t in texts)
    joined = " ".join(" ".join(t.get_text().split()) for t in texts)
    assert "Forward step" in joined and "Training step" in joined and "window 3×3×3" in joined
    assert "2.00×" in joined and "attention part" in joined
    assert not re.search(r"\b(vsa|ssta|sta|svg2)_\w+|wan1\.3b_", joined)
    written = figures.regenerate(
        tmp_path / "figs", only=["model_wan_steps"], bench_dir=tmp_path, formats=("png",)
    )
    assert [p.name for p in written] == ["model_wan_steps.png"]


def test_model_figure_is_skipped_without_a_model_run(tmp_path, capsys):
    bench = tmp_path / "bench"
    bench.mkdir()
    code = cli.main(
        ["figures", "--out", str(tmp_path), "--only", "model_wan_steps", "--bench-dir", str(bench)]
    )
    assert code == 0
    assert "skipped model_wan_steps: no recorded `sparseattn bench model wan` run" in capsys.readouterr().err
    assert not (tmp_path / "model_wan_steps.png").exists()


# ---- the example ---------------------------------------------------------------------------------------
def test_the_wan_example_runs_on_the_cpu(capsys):
    pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "wan_sparse_attention.py"
    spec = importlib.util.spec_from_file_location("wan_sparse_attention_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    diff = example.main(["--tiny", "--device", "cpu", "--backend", "masked_sdpa"])
    out = capsys.readouterr().out
    assert "128 tokens, 2 layers on cpu" in out and "sparse (sta, masked_sdpa)" in out
    assert 0 < diff < 1


def test_ranks_run_records_one_and_n_ranks(tmp_path):
    """``--ranks 2``: the masked-SDPA STA step at 1 and 2 gloo ranks (Ulysses), with the all-to-alls'
    share; implementations that do not run under sequence parallelism are recorded as skipped."""
    pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    out = tmp_path / "ranks.json"
    argv = [*TINY, "--impl", "masked_sta,dense", "--modes", "fwd", "--ranks", "2", "--out", str(out)]
    assert model_bench.main(argv, prog="sparseattn bench model") == 0
    records = json.loads(out.read_text())["records"]
    timed = {r["ranks"]: r for r in records if r["impl"] == "masked_sta"}
    assert set(timed) == {1, 2} and all(r["pass"] == "step_fwd" and r["time_ms"] > 0 for r in timed.values())
    assert 0 < timed[2]["all_to_all_share"] <= 1 and len(timed[2]["per_rank_ms"]) == 2
    assert timed[1]["all_to_all_ms"] == 0
    assert all(r["token_order"] in ("qo", True, False) for r in timed.values())  # the processors' default
    (dense,) = [r for r in records if r["impl"] == "dense"]
    assert "sequence parallelism" in dense["skipped"]
