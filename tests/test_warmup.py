"""The kernel warm-up (sparseattn.kernels.warmup) compiles what the launches compile: every declared
instantiation, in the very (source, name expressions, options) modules that ``launch.function`` asks
CuPy for, so that CuPy's on-disk cache entries it writes are the ones the test workers look up."""

import pytest

from sparseattn.kernels import bsa_backward, bsa_mma_forward, compile_check, launch, planner, runtime, warmup
from sparseattn.kernels import pageweaver as pw
from sparseattn.pageweaver import grouping_gpu

#: The defines of the token-order builds (forward and backward), which add kernels of their own.
TOKEN_DEFINES = {"PAGED_FWD_TOKENS", "PAGED_BWD_TOKENS"}


def _keys(builds):
    return {(b.source, tuple(sorted(b.name_expressions)), b.options) for b in builds}


def test_builds_cover_every_declared_instantiation_and_every_source():
    builds = warmup.builds()
    declared = compile_check.declared_instantiations()
    assert not [k for k in declared if k.startswith("!")], declared  # every wrapper imports
    extra = {}  # the other builds' instantiations (the token-order builds: kernels only they compile)
    for b in builds:
        if TOKEN_DEFINES & set(b.defines):
            extra.setdefault(b.source, set()).update(b.name_expressions)
    for source, exprs in declared.items():
        built = {e for b in builds if b.source == source for e in b.name_expressions}
        assert built == set(exprs) | extra.get(source, set()), source
    assert {b.source for b in builds} == {p.name for p in runtime.kernel_sources()}
    assert builds[0].source == "paged_bwd.cu"  # the longest compile starts first
    assert len(_keys(builds)) == len(builds)


def test_builds_are_the_modules_the_launches_compile(monkeypatch):
    asked = []

    def record(source, name, names=None, options=runtime.NVRTC_OPTIONS):
        asked.append((source, tuple(sorted(names)), tuple(options)))
        return object()

    monkeypatch.setattr(runtime, "get_function", record)
    monkeypatch.setattr(launch, "_FUNCTIONS", {})
    grouping_gpu._kernels.cache_clear()
    bsa_mma_forward.launch_target(128, 128, 128)
    planner._fn("plan_scan")
    grouping_gpu._kernels(0)
    launch.function(
        bsa_backward.WGMMA_SOURCE, bsa_backward.ws_kernel_name(128), bsa_backward.WGMMA_NAME_EXPRESSIONS
    )
    launch.function(bsa_backward.SOURCE, bsa_backward.preprocess_name(128), bsa_backward.NAME_EXPRESSIONS)
    launch.function(pw.PER_QUERY_SOURCE, pw.PER_QUERY_KERNEL, (pw.PER_QUERY_KERNEL,), pw._defines("PQ_"))
    grouping_gpu._kernels.cache_clear()
    assert set(asked) <= _keys(warmup.builds()), set(asked) - _keys(warmup.builds())


def test_a_variant_in_force_is_what_the_warm_up_compiles():
    before = pw.variant()
    try:
        pw.set_variant("PW_BF16_OPERANDS")
        by_source = {b.source: b for b in warmup.builds()}
        assert by_source["pw_union_fwd.cu"].defines == ("PW_BF16_OPERANDS",)
        assert "-DPW_BF16_OPERANDS" in by_source["pw_union_fwd.cu"].options
        assert by_source["pw_per_query_fwd.cu"].defines == ()
    finally:
        pw.set_variant(*before)


def test_compile_build_compiles_the_module_through_the_runtime(monkeypatch):
    calls = []

    class FakeModule:
        def compile(self):
            calls.append("compile")

    def get_module(source, names, options):
        calls.append((source, names, options))
        return FakeModule()

    monkeypatch.setattr(runtime, "get_module", get_module)
    build = next(b for b in warmup.builds() if b.source == "paged_fwd.cu")
    assert warmup.compile_build(build) >= 0
    assert calls == [("paged_fwd.cu", build.name_expressions, runtime.NVRTC_OPTIONS), "compile"]


def test_warm_up_reports_each_module_and_goes_on_after_a_failure(monkeypatch):
    def fake(build):
        if build.source == "bsa_fwd.cu":
            raise RuntimeError("nvrtc: error: something\nmore")
        return 0.5

    monkeypatch.setattr(warmup, "compile_build", fake)
    lines = []
    results = warmup.warm_up(jobs=1, log=lines.append)
    assert [r.build for r in results] == warmup.builds() and len(lines) == len(results)
    bad = [r for r in results if not r.ok]
    assert [r.build.source for r in bad] == ["bsa_fwd.cu"] and bad[
        0
    ].error == "RuntimeError: nvrtc: error: something"
    assert sum("FAILED" in line for line in lines) == 1


@pytest.mark.parametrize("value, on", [("0", False), ("off", False), ("1", True), (None, True)])
def test_the_environment_switch(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv(warmup.ENV_SWITCH, raising=False)
    else:
        monkeypatch.setenv(warmup.ENV_SWITCH, value)
    assert warmup.enabled() is on


def test_list_needs_no_gpu(capsys):
    assert warmup.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "paged_bwd.cu" in out and "pw_grouping.cu" in out


def test_warm_up_compiles_in_separate_processes():
    """Two builds on two spawned processes; without CuPy (CI) each reports the import error."""
    todo = warmup.builds()[-2:]
    results = warmup.warm_up(todo, jobs=2)
    assert [r.build for r in results] == todo
    for r in results:
        assert r.ok or "cupy" in r.error.lower(), r.error
