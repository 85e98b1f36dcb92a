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
    ],
    ids=["workload", "variant", "rounds"],
)
def test_bad_arguments_are_named_before_any_gpu_work(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "variants", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
