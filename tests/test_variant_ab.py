"""The interleaved A/B of the forward's builds (sparseattn.variant_ab): argument checks, round order and
the paired ratio, on the CPU."""

import numpy as np
import pytest

from sparseattn import cli, variant_ab
from sparseattn.kernels.forward import VARIANTS


def test_builds_are_named_by_their_macros():
    assert variant_ab.parse_variant("default") == ()
    assert variant_ab.parse_variant("PAGED_FWD_TMA, PAGED_FWD_PINGPONG") == (
        "PAGED_FWD_PINGPONG",
        "PAGED_FWD_TMA",
    )
    assert variant_ab.variant_name(()) == "default"
    with pytest.raises(ValueError, match="--variant 'PAGED_FWD_NOPE'"):
        variant_ab.parse_variant("PAGED_FWD_NOPE")


def test_backward_builds_are_named_by_the_backward_macros():
    from sparseattn.kernels.bsa_backward import VARIANTS as BWD_VARIANTS

    assert variant_ab.parse_variant("PAGED_BWD_WG_DQ", "bwd") == ("PAGED_BWD_WG_DQ",)
    assert variant_ab.parse_builds(None, "bwd") == [
        (),
        ("PAGED_BWD_WG_DQ",),
        ("PAGED_BWD_WG_DQ", "PAGED_BWD_WG_OFFSET"),
        ("PAGED_BWD_WG_DQ", "PAGED_BWD_WG_SUM"),
    ]
    assert len(BWD_VARIANTS) == 3
    with pytest.raises(ValueError, match="PAGED_BWD_WG_OFFSET needs PAGED_BWD_WG_DQ"):
        variant_ab.parse_variant("PAGED_BWD_WG_OFFSET", "bwd")
    with pytest.raises(ValueError, match="--variant 'PAGED_FWD_TMA'"):  # a forward macro is no backward build
        variant_ab.parse_variant("PAGED_FWD_TMA", "bwd")
    with pytest.raises(ValueError, match="--variant 'PAGED_BWD_WG_DQ'"):
        variant_ab.parse_variant("PAGED_BWD_WG_DQ")


def test_builds_default_to_each_macro_and_need_two():
    builds = variant_ab.parse_builds(None)
    assert builds[0] == () and len(builds) == len(VARIANTS) + 1
    assert ("PAGED_FWD_REGS_232", "PAGED_FWD_TMA") in builds  # with the variant it needs
    with pytest.raises(ValueError, match="PAGED_FWD_REGS_232 needs PAGED_FWD_TMA"):
        variant_ab.parse_variant("PAGED_FWD_REGS_232")
    assert variant_ab.parse_builds(["default", "PAGED_FWD_TMA", "default"]) == [(), ("PAGED_FWD_TMA",)]
    with pytest.raises(ValueError, match="at least two"):
        variant_ab.parse_builds(["PAGED_FWD_TMA", "PAGED_FWD_TMA"])


def test_every_build_leads_a_round_in_turn():
    names = ["a", "b", "c"]
    firsts = [variant_ab.rotation(names, r)[0] for r in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]
    assert all(sorted(variant_ab.rotation(names, r)) == names for r in range(6))


def test_the_paired_ratio_cancels_drift_between_rounds():
    """Both builds slow down by 20% over the run; B is 3% faster than A in every round. The medians alone
    mix the drift in; the paired ratio reads exactly 0.97."""
    drift = np.linspace(1.0, 1.2, 9)
    times = {"a": list(10.0 * drift), "b": list(9.7 * drift)}
    s = variant_ab.summarize(times, "a")
    assert s["a"]["paired_ratio"] == pytest.approx(1.0)
    assert s["b"]["paired_ratio"] == pytest.approx(0.97)
    assert s["b"]["paired_ratio_iqr"] == pytest.approx([0.97, 0.97])
    assert s["b"]["time_ms"] == pytest.approx(9.7 * np.median(drift))
    assert len(s["b"]["round_ms"]) == 9


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--workload", "nope", "--variant", "default", "--variant", "PAGED_FWD_TMA"], "--workload 'nope'"),
        (["--workload", "dense_32768", "--variant", "default", "--variant", "BAD"], "--variant 'BAD'"),
        (["--workload", "dense_32768", "--rounds", "1"], "--rounds"),
        (
            [
                "--workload",
                "dense_32768",
                "--pass",
                "bwd",
                "--variant",
                "default",
                "--variant",
                "PAGED_FWD_TMA",
            ],
            "--variant 'PAGED_FWD_TMA'",
        ),
        (["--workload", "dense_32768", "--pass", "bwd", "--cudnn"], "--cudnn"),
    ],
    ids=["workload", "variant", "rounds", "bwd-variant", "bwd-cudnn"],
)
def test_bad_arguments_are_named_before_any_gpu_work(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "variants", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def _recorded_run(tmp_path):
    """A run file as `bench variants` writes it: two workloads, three builds and cuDNN."""
    import json

    records = []
    for workload in ("dense_32768", "vsa_wan14b_480p"):
        times = {
            "default": [10.0, 10.4, 10.9],
            "PAGED_FWD_TMA": [9.7, 10.1, 10.5],
            "cudnn_dense": [9.0, 9.3, 9.9],
        }
        times["PAGED_FWD_PINGPONG"] = [9.9, 10.2, 10.6]
        for name, s in variant_ab.summarize(times, "default").items():
            impl = "cudnn_dense" if name == "cudnn_dense" else "kpage"
            records.append(
                dict(
                    workload=workload,
                    impl=impl,
                    fwd_variant=None if impl != "kpage" else name,
                    baseline="default",
                    **s,
                )
            )
    path = tmp_path / "ab.json"
    path.write_text(json.dumps({"records": records}))
    return path


def test_a_recorded_run_is_drawn_without_a_gpu(tmp_path):
    run = _recorded_run(tmp_path)
    out = tmp_path / "ab.png"
    assert cli.main(["bench", "variants", "--from-json", str(run), "--plot", str(out)]) == 0
    assert out.stat().st_size > 1000
    from sparseattn.speedplots import variant_ratio_figure

    fig = variant_ratio_figure([])  # nothing to draw: a figure that says so
    assert "no kpage records" in " ".join(t.get_text() for ax in fig.axes for t in ax.texts)


def test_a_recorded_backward_run_is_drawn_by_its_builds(tmp_path):
    import json

    times = {"default": [18.2, 18.4, 18.3], "PAGED_BWD_WG_DQ": [16.9, 17.1, 17.0]}
    records = [
        dict(
            workload="vsa_wan14b_480p",
            impl="kpage",
            bwd_variant=name,
            baseline="default",
            **{"pass": "bwd"},
            **s,
        )
        for name, s in variant_ab.summarize(times, "default").items()
    ]
    run = tmp_path / "ab_bwd.json"
    run.write_text(json.dumps({"records": records}))
    out = tmp_path / "ab_bwd.png"
    assert cli.main(["bench", "variants", "--from-json", str(run), "--plot", str(out)]) == 0
    from sparseattn.speedplots import variant_ratio_figure

    fig = variant_ratio_figure(records)
    ax = fig.axes[0]
    assert "backward" in ax.get_title(loc="left")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["default", "WG_DQ"]


def test_the_plot_path_is_checked_first(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "variants", "--from-json", "x.json", "--plot", str(tmp_path / "no" / "ab.png")])
    assert "--plot" in capsys.readouterr().err
