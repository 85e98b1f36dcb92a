"""sparseattn bench variants on the GPU: two builds checked against the reference and timed in rounds."""

import json

import pytest

pytestmark = pytest.mark.gpu


def test_interleaved_ab_checks_and_times_every_build(tmp_path):
    from sparseattn import variant_ab
    from sparseattn.kernels import forward

    before = forward.DEFINES
    out = tmp_path / "ab.json"
    argv = ["--workload", "dense_16384", "--heads", "1", "--variant", "default", "--variant", "PAGED_FWD_TMA"]
    assert variant_ab.main([*argv, "--rounds", "2", "--reps", "1", "--out", str(out)]) == 0
    assert forward.DEFINES == before  # the builds were switched only inside the run
    records = json.loads(out.read_text())["records"]
    assert [r["fwd_variant"] for r in records] == ["default", "PAGED_FWD_TMA"]
    assert all(r["correct"] is True and len(r["round_ms"]) == 2 for r in records)
    assert records[0]["paired_ratio"] == pytest.approx(1.0)


def test_interleaved_backward_ab_checks_and_times_every_build(tmp_path):
    """--pass bwd: each backward build's gradients checked against the reference, then the builds alternated
    in rounds; the process's build is restored afterwards."""
    from sparseattn import variant_ab
    from sparseattn.kernels import bsa_backward

    before = bsa_backward.DEFINES
    out = tmp_path / "ab_bwd.json"
    argv = ["--pass", "bwd", "--workload", "vsa_wan14b_480p", "--heads", "1"]
    argv += ["--variant", "default", "--variant", bsa_backward.VARIANTS[0]]
    assert variant_ab.main([*argv, "--rounds", "2", "--reps", "1", "--out", str(out)]) == 0
    assert bsa_backward.DEFINES == before
    records = json.loads(out.read_text())["records"]
    assert [r["bwd_variant"] for r in records] == ["default", bsa_backward.VARIANTS[0]]
    assert all(r["pass"] == "bwd" and r["correct"] is True and len(r["round_ms"]) == 2 for r in records)
