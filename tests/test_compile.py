"""CPU compile check: every kernel builds to an sm_90a cubin with NVRTC, without spills.

Needs the ``compile`` extra (nvidia-cuda-nvrtc + nvidia-cuda-runtime wheels); skipped with the reason
when they are missing. Also checks that the tile constants agree between Python and CUDA.
"""

from __future__ import annotations

import ast
import re

import pytest

from sparseattn import constants
from sparseattn.kernels import bsa_backward, bsa_mma_forward, compile_check, forward, runtime


def _cuh_defines() -> dict[str, int]:
    text = (runtime.kernel_dir() / "tile_config.cuh").read_text()
    return {
        m.group(1): int(m.group(2))
        for m in re.finditer(r"^#define\s+(\w+)\s+(-?\d+)\s*$", text, re.MULTILINE)
    }


def _python_int_constants() -> dict[str, int]:
    with open(constants.__file__) as fh:
        tree = ast.parse(fh.read())
    out = {}
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, int)
        ):
            out[node.targets[0].id] = node.value.value
    return out


def test_tile_constants_agree_between_python_and_cuda():
    cuh = _cuh_defines()
    py = _python_int_constants()
    assert py, "no integer constants parsed from constants.py"
    for name, value in py.items():
        assert name in cuh, f"{name} is defined in constants.py but not in tile_config.cuh"
        assert cuh[name] == value, f"{name}: constants.py {value} != tile_config.cuh {cuh[name]}"
    assert (cuh["BSA_BLOCK_SIZE_SMALL"], cuh["BSA_BLOCK_SIZE_LARGE"]) == tuple(constants.BSA_BLOCK_SIZES)
    assert (
        (cuh["KPAGE_TILE_SMALL_M"], cuh["KPAGE_TILE_SMALL_N"]),
        (cuh["KPAGE_TILE_LARGE_M"], cuh["KPAGE_TILE_LARGE_N"]),
    ) == tuple(constants.KPAGE_ROUTES)


def test_forward_wrapper_mirrors_kernel_constants():
    cuh = _cuh_defines()
    cu = (runtime.kernel_dir() / bsa_mma_forward.SOURCE).read_text()
    fwd = {
        m.group(1): int(m.group(2))
        for m in re.finditer(r"^#define\s+(BSA_FWD_\w+)\s+(\d+)\s*$", cu, re.MULTILINE)
    }
    assert bsa_mma_forward.PAGE_ROWS == cuh["PAGE_ROWS"] and bsa_mma_forward.WARP_ROWS == cuh["WARP_ROWS"]
    assert bsa_mma_forward.STAGE_KEYS == fwd["BSA_FWD_STAGE_KEYS"]
    assert bsa_mma_forward.WARP_M_LARGE == fwd["BSA_FWD_WARP_M_LARGE"]
    assert {m for m, n in bsa_mma_forward.TILE_SHAPES} == {
        cuh["BSA_BLOCK_SIZE_SMALL"],
        cuh["BSA_BLOCK_SIZE_LARGE"],
    }


@pytest.fixture(scope="module")
def reports():
    try:
        compile_check.find_nvrtc()
        compile_check.find_cuda_include()
    except compile_check.CompileToolchainMissing as exc:
        pytest.skip(f"NVRTC compile toolchain missing ({exc})")
    return compile_check.check_all()


def test_every_kernel_source_compiles(reports):
    sources = {p.name for p in runtime.kernel_sources()}
    assert sources <= {r.source for r in reports}
    errors = {r.source: r.error for r in reports if not r.ok or r.error}
    assert not errors, errors


def test_no_register_spills_but_the_accepted_ones(reports):
    # compile_check.ACCEPTED_SPILLS is the one list, shared with `python -m ...compile_check`
    kernels = [k for r in reports for k in r.kernels]
    assert kernels
    for k in kernels:
        assert k.registers is not None and 0 < k.registers <= 255, (k.source, k.kernel, k.registers)
        assert k.status() != "SPILLS", f"{k.kernel} spills {k.spill_stores}/{k.spill_loads} bytes"


def test_spill_verdicts():
    accepted = next(iter(compile_check.ACCEPTED_SPILLS))
    limit = compile_check.ACCEPTED_SPILLS[accepted]
    report = compile_check.KernelReport
    assert report("x.cu", "other<1>").status() == "ok"
    assert report("x.cu", "other<1>", spill_stores=4).status() == "SPILLS"
    assert report("x.cu", accepted.replace(", ", ","), spill_loads=limit.loads).status() == "accepted spill"
    assert report("x.cu", accepted, spill_stores=limit.stores + 1).status() == "SPILLS"
    assert all(entry.reason for entry in compile_check.ACCEPTED_SPILLS.values())


def test_no_kernel_serializes_its_wgmmas(reports):
    """ptxas warnings C7514 (a non-wgmma instruction touching an accumulator inside a pipeline stage) and
    C7512 (too few registers) make every wgmma wait for the one before: correct results, half the
    tensor-core rate."""
    serialized = {k.kernel: k.wgmma_serialized for r in reports for k in r.kernels if k.wgmma_serialized}
    assert not serialized, serialized


@pytest.mark.parametrize(
    "warning, reason",
    [
        (
            (
                "(C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
                "non wgmma instructions reading accumulator registers of  a wgmma between start and end of "
                "the pipeline stage in the function"
            ),
            "non wgmma instructions reading accumulator registers",
        ),
        (
            (
                "(C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
                "insufficient register resources for the function"
            ),
            "insufficient register resources",
        ),
    ],
    ids=["C7514-in", "C7512-for"],
)
def test_serialized_wgmma_warning_fails_the_kernel(warning, reason):
    """A serialization line (ptxas says "in the function" or "for the function") names the mangled
    function, before or after its entry line; it maps to that kernel only, whose status then fails the
    check."""
    log = (
        f"ptxas info    : {warning} '_Z1fILi1EEvv'\n"
        "ptxas info    : Compiling entry function '_Z1fILi1EEvv' for 'sm_90a'\n"
        "ptxas info    : Used 168 registers, used 3 barriers\n"
        "ptxas info    : Compiling entry function '_Z1fILi2EEvv' for 'sm_90a'\n"
        "ptxas info    : Used 128 registers\n"
    )
    lowered = {"f<1>": "_Z1fILi1EEvv", "f<2>": "_Z1fILi2EEvv"}
    first, second = compile_check.parse_ptxas_log("x.cu", log, lowered)
    assert (first.kernel, first.status()) == ("f<1>", "WGMMA SERIALIZED")
    assert first.wgmma_serialized.startswith(reason)
    assert (second.kernel, second.status()) == ("f<2>", "ok")
    assert "WGMMA SERIALIZED" in compile_check.FAILING


def test_command_exits_0_and_says_why_a_spill_is_accepted(reports, monkeypatch, capsys):
    monkeypatch.setattr(compile_check, "check_all", lambda sources=None: reports)
    code = compile_check.main([])
    out = capsys.readouterr().out
    assert code == 0, out
    spilled = [k for r in reports for k in r.kernels if k.spills]
    for k in spilled:
        assert f"accepted spill: {k.kernel}" in out and k.accepted_spill().reason[:40] in " ".join(
            out.split()
        )


def test_every_forward_instantiation_is_built(reports):
    built = {k.kernel for r in reports if r.source == bsa_mma_forward.SOURCE for k in r.kernels}
    assert set(bsa_mma_forward.NAME_EXPRESSIONS) <= built


def test_forward_shared_memory_fits_two_ctas_per_sm_on_the_h200():
    # 228 KB of shared memory per SM, 1 KB reserved per CTA; the kernel is tuned for two CTAs per SM
    smem_per_sm = 228 * 1024
    for d in bsa_mma_forward.HEAD_DIMS:
        for m, n in bsa_mma_forward.TILE_SHAPES:
            assert 2 * (bsa_mma_forward.smem_bytes(d, m, n) + 1024) <= smem_per_sm, (d, m, n)


def test_forward_wrapper_shared_memory_formula_matches_the_kernel(reports):
    """The launch passes smem_bytes(); NVRTC checks it equals the kernel's FwdTile::SMEM_BYTES."""
    checks = "\n".join(
        f"static_assert(FwdTile<{d}, {m}, {n}>::SMEM_BYTES == {bsa_mma_forward.smem_bytes(d, m, n)}, "
        f'"smem_bytes({d}, {m}, {n}) differs from the kernel");'
        f"static_assert(FwdTile<{d}, {m}, {n}>::THREADS == {bsa_mma_forward.threads_per_cta(m)}, "
        f'"threads_per_cta({m}) differs from the kernel");'
        for d in bsa_mma_forward.HEAD_DIMS
        for m, n in bsa_mma_forward.TILE_SHAPES
    )
    code = runtime.preprocess(bsa_mma_forward.SOURCE) + "\n" + checks + "\n"
    nvrtc = compile_check._Nvrtc(compile_check.find_nvrtc())
    ok, log, _, _ = nvrtc.compile(
        code, "smem_check.cu", compile_check.compile_options(compile_check.find_cuda_include()), ()
    )
    assert ok, log


def test_paged_forward_launch_matches_the_kernel_signature():
    """The wrapper passes KERNEL_PARAMS in order (TMA_PARAMS after them in the PAGED_FWD_TMA build,
    TOKEN_PARAMS in the token-order builds, both in the tile-major one): the names equal the kernel's
    parameters."""
    from sparseattn.kernels import forward

    text = (runtime.kernel_dir() / forward.SOURCE).read_text()
    sig = re.search(r"paged_fwd_kernel\((.*?)\)\s*\{", text, re.DOTALL).group(1)
    tma = re.search(r"#define PAGED_FWD_TMA_PARAMS \\\n(.*?)\n", text).group(1)
    tokens = re.search(r"#define PAGED_FWD_TOKEN_PARAMS\s*\\\n(.*?)\n#else", text, re.DOTALL).group(1)
    tokens = tokens.replace("\\", " ")
    builds = (
        ("", "", forward.KERNEL_PARAMS),
        (tma, "", forward.KERNEL_PARAMS + forward.TMA_PARAMS),
        ("", tokens, forward.KERNEL_PARAMS + forward.TOKEN_PARAMS),
        (tma, tokens, forward.KERNEL_PARAMS + forward.TMA_PARAMS + forward.TOKEN_PARAMS),  # tile-major tokens
    )
    for extra, token_extra, params in builds:
        expanded = sig.replace("PAGED_FWD_TMA_PARAMS", extra).replace("PAGED_FWD_TOKEN_PARAMS", token_extra)
        assert tuple(re.findall(r"(\w+)\s*(?:,|$)", " ".join(expanded.split()))) == params


def test_paged_forward_shared_memory_formula_matches_the_kernel(reports):
    from sparseattn.kernels import forward

    checks = "\n".join(
        f'static_assert(FwdConfig<{d}, {c}>::SMEM_BYTES == {forward.smem_bytes(d, c)}, "smem {d} {c}");'
        f'static_assert(FwdConfig<{d}, {c}>::NBUF == {forward.stage_buffers(d, c)}, "nbuf {d} {c}");'
        for d in forward.HEAD_DIMS
        for c in (64, 128)
    )
    code = runtime.preprocess(forward.SOURCE) + "\n" + checks + "\n"
    nvrtc = compile_check._Nvrtc(compile_check.find_nvrtc())
    ok, log, _, _ = nvrtc.compile(
        code, "paged_smem_check.cu", compile_check.compile_options(compile_check.find_cuda_include()), ()
    )
    assert ok, log


@pytest.mark.parametrize(
    "source_attr, kernel, params_attr",
    [
        ("SOURCE", "pw_union_fwd_kernel", "KERNEL_PARAMS"),
        ("SOURCE", "pw_kvpage_fwd_kernel", "KERNEL_PARAMS"),
        ("PER_QUERY_SOURCE", "pw_per_query_fwd_kernel", "PER_QUERY_PARAMS"),
    ],
)
def test_pageweaver_launches_match_the_kernel_signatures(source_attr, kernel, params_attr):
    """The wrappers pass their parameter tuples in order: the names equal the kernels' parameters."""
    from sparseattn.kernels import pageweaver

    text = (runtime.kernel_dir() / getattr(pageweaver, source_attr)).read_text()
    sig = re.search(rf"\n{kernel}\((.*?)\)\s*\{{", text, re.DOTALL).group(1)
    names = tuple(re.findall(r"(\w+)\s*(?:,|$)", " ".join(sig.split())))
    assert names == getattr(pageweaver, params_attr)


def test_pageweaver_shared_memory_formulas_match_the_kernels(reports):
    """The wrappers' SMEM_BYTES / PQ_SMEM_BYTES equal the kernels' own constants (NVRTC static_asserts)."""
    from sparseattn.kernels import pageweaver

    nvrtc = compile_check._Nvrtc(compile_check.find_nvrtc())
    options = compile_check.compile_options(compile_check.find_cuda_include())
    for source, check in (
        (pageweaver.SOURCE, f'static_assert(kSmemBytes == {pageweaver.SMEM_BYTES}, "union smem");'),
        (pageweaver.PER_QUERY_SOURCE, f'static_assert(kSmemBytes == {pageweaver.PQ_SMEM_BYTES}, "pq smem");'),
    ):
        code = runtime.preprocess(source) + "\nnamespace {\n" + check + "\n}\n"
        ok, log, _, _ = nvrtc.compile(code, "pw_smem_check.cu", options, ())
        assert ok, log


def _compile_variant(source: str, names, variant: str):
    """NVRTC-compile ``names`` of ``source`` with ``-D<variant>`` for each comma-joined variant (asserting
    success); the ptxas reports."""
    nvrtc = compile_check._Nvrtc(compile_check.find_nvrtc())
    options = compile_check.compile_options(compile_check.find_cuda_include()) + tuple(
        f"-D{v}" for v in variant.split(",")
    )
    ok, log, _, lowered = nvrtc.compile(runtime.preprocess(source), source, options, names)
    assert ok, log
    return compile_check.parse_ptxas_log(source, log, lowered)


@pytest.mark.parametrize("variant", ["PW_BF16_OPERANDS", "PQ_BF16_OPERANDS"])
def test_pageweaver_variants_compile_without_spills(variant, reports):
    """The PageWeaver kernels' compile-time variants (sparseattn.kernels.pageweaver.set_variant) build too."""
    from sparseattn.kernels import pageweaver

    assert variant in pageweaver.VARIANTS
    source, names = (
        (pageweaver.PER_QUERY_SOURCE, (pageweaver.PER_QUERY_KERNEL,))
        if variant.startswith("PQ_")
        else (pageweaver.SOURCE, pageweaver.NAME_EXPRESSIONS)
    )
    kernels = _compile_variant(source, names, variant)
    assert {k.kernel for k in kernels} >= set(names)
    assert not any(k.spills for k in kernels), [(k.kernel, k.spill_stores, k.spill_loads) for k in kernels]


@pytest.mark.parametrize("variant", (*forward.VARIANTS, *forward.TOKEN_KV_BUILDS))
def test_forward_variants_compile_without_spills(variant, reports):
    """The KPage forward's compile-time variants (sparseattn.kernels.forward.VARIANTS) and its token-order
    build build too."""
    build = ",".join((variant, *forward.VARIANT_NEEDS.get(variant, ())))
    kernels = _compile_variant(forward.SOURCE, forward.NAME_EXPRESSIONS, build)
    assert len(kernels) >= len(forward.NAME_EXPRESSIONS)
    assert not any(k.spills for k in kernels), [(k.kernel, k.spill_stores, k.spill_loads) for k in kernels]


#: The token-order backward build's pair kernel: its producer warpgroup runs at 24 registers (as the slot-order
#: build's, which compile_check.ACCEPTED_SPILLS accepts at 20/24 bytes) and holds two more words per step
#: here (the page tokens loaded before its buffer wait).
TOKEN_BWD_ACCEPTED_SPILLS = {
    "paged_bwd_ws_kernel<128, true>": (48, 56),
    "paged_bwd_ws_kernel<64, true>": (44, 48),
}


def test_backward_token_build_compiles(reports):
    """paged_bwd.cu's token-order build (bsa_backward.TOKEN_DEFINE) compiles every kernel it declares, spill
    free but for the pair kernel's producer (TOKEN_BWD_ACCEPTED_SPILLS), and its main kernels take the
    slot-order build's parameters plus bsa_backward.TOKEN_PARAMS."""
    from sparseattn.kernels import bsa_backward as bb

    kernels = _compile_variant(bb.WGMMA_SOURCE, bb.TOKEN_NAME_EXPRESSIONS, bb.TOKEN_DEFINE)
    assert {k.kernel for k in kernels} >= set(bb.TOKEN_NAME_EXPRESSIONS)
    for k in kernels:
        stores, loads = TOKEN_BWD_ACCEPTED_SPILLS.get(k.kernel, (0, 0))
        assert k.spill_stores <= stores and k.spill_loads <= loads, (k.kernel, k.spill_stores, k.spill_loads)
    text = (runtime.kernel_dir() / bb.WGMMA_SOURCE).read_text()
    macro = re.search(r"#define PAGED_BWD_TOKEN_PARAMS\s*\\\n(.*?)\n#define", text, re.DOTALL).group(1)
    names = tuple(re.findall(r"(\w+)\s*(?:,|$)", " ".join(macro.replace("\\", " ").split())))
    assert names == bb.TOKEN_PARAMS
    for kernel in ("paged_bwd_kernel", "paged_bwd_ws_kernel"):
        sig = re.search(rf"\n{kernel}\((.*?)\)\s*\{{", text, re.DOTALL).group(1)
        assert sig.rstrip().endswith("PAGED_BWD_TOKEN_PARAMS"), kernel


def _ws_smem_asserts(defines: tuple[str, ...]) -> str:
    """static_asserts that paged_bwd_ws::Config's shared memory is bsa_backward.ws_smem_bytes's for a build."""
    return "".join(
        f"static_assert(paged_bwd_ws::Config<{d}, {str(pair).lower()}>::kSmemBytes == "
        f'{bsa_backward.ws_smem_bytes(d, pair, defines)}, "ws s");'
        for d in bsa_backward.HEAD_DIMS
        for pair in (False, True)
    )


#: The backward's opt-in builds: each variant with its companions (slot order), and all of them together in the
#: token-order build (one compile each: the source instantiates every kernel).
BWD_VARIANT_BUILDS = [(v, *bsa_backward.VARIANT_NEEDS.get(v, ())) for v in bsa_backward.VARIANTS] + [
    (*bsa_backward.VARIANTS, bsa_backward.TOKEN_DEFINE)
]


@pytest.mark.parametrize("build", BWD_VARIANT_BUILDS, ids=[",".join(b) for b in BWD_VARIANT_BUILDS])
def test_backward_variants_compile_without_new_spills(build, reports):
    """The KPage backward's compile-time variants (bsa_backward.VARIANTS) build every kernel with no wgmma
    serialized, no spill the default build does not accept, and paged_bwd_ws_kernel with the shared memory
    bsa_backward.ws_smem_bytes says (static_asserts compiled with the kernels)."""
    from sparseattn.kernels import bsa_backward as bb

    names = tuple(bb.ws_kernel_name(d, pair) for pair in (False, True) for d in bb.HEAD_DIMS)
    checks = _ws_smem_asserts(build)
    nvrtc = compile_check._Nvrtc(compile_check.find_nvrtc())
    options = compile_check.compile_options(compile_check.find_cuda_include()) + tuple(
        f"-D{v}" for v in build
    )
    code = runtime.preprocess(bb.WGMMA_SOURCE) + "\n" + checks + "\n"
    ok, log, _, lowered = nvrtc.compile(code, bb.WGMMA_SOURCE, options, names)
    assert ok, log
    kernels = compile_check.parse_ptxas_log(bb.WGMMA_SOURCE, log, lowered)
    assert {k.kernel for k in kernels} >= set(names)
    assert not any(k.wgmma_serialized for k in kernels), [k.kernel for k in kernels if k.wgmma_serialized]
    for k in kernels:
        limit = compile_check.ACCEPTED_SPILLS.get(k.kernel)
        if bb.TOKEN_DEFINE in build:
            stores, loads = TOKEN_BWD_ACCEPTED_SPILLS.get(k.kernel, (0, 0))
        else:
            stores, loads = (limit.stores, limit.loads) if limit else (0, 0)
        assert k.spill_stores <= stores and k.spill_loads <= loads, (
            build,
            k.kernel,
            k.spill_stores,
            k.spill_loads,
        )


def test_backward_variant_from_the_environment(monkeypatch):
    from sparseattn.kernels import bsa_backward as bb
    from sparseattn.kernels import launch
    from sparseattn.kernels.validate import KernelValueError

    monkeypatch.setenv("SPARSEATTN_BWD_VARIANT", "PAGED_BWD_WG_DQ")
    assert launch.variants_from_env("SPARSEATTN_BWD_VARIANT", bb.VARIANTS) == ("PAGED_BWD_WG_DQ",)
    monkeypatch.setenv("SPARSEATTN_BWD_VARIANT", "PAGED_BWD_NOPE")
    with pytest.raises(KernelValueError, match="SPARSEATTN_BWD_VARIANT"):
        launch.variants_from_env("SPARSEATTN_BWD_VARIANT", bb.VARIANTS)
    with pytest.raises(
        KernelValueError, match="SPARSEATTN_BWD_VARIANT: PAGED_BWD_WG_OFFSET needs PAGED_BWD_WG_DQ"
    ):
        launch.check_variant_needs(("PAGED_BWD_WG_OFFSET",), bb.VARIANT_NEEDS, "SPARSEATTN_BWD_VARIANT")


def test_forward_variant_from_the_environment(monkeypatch):
    from sparseattn.kernels import forward
    from sparseattn.kernels.validate import KernelValueError

    monkeypatch.setenv("SPARSEATTN_FWD_VARIANT", "PAGED_FWD_SKIP_VOID")
    assert forward._variant_from_env() == ("PAGED_FWD_SKIP_VOID",)
    monkeypatch.setenv("SPARSEATTN_FWD_VARIANT", "PAGED_FWD_NOPE")
    with pytest.raises(KernelValueError, match="SPARSEATTN_FWD_VARIANT"):
        forward._variant_from_env()
    monkeypatch.setenv("SPARSEATTN_FWD_VARIANT", "PAGED_FWD_REGS_232")
    with pytest.raises(
        KernelValueError, match="SPARSEATTN_FWD_VARIANT: PAGED_FWD_REGS_232 needs PAGED_FWD_TMA"
    ):
        forward._variant_from_env()
    monkeypatch.setenv("SPARSEATTN_FWD_VARIANT", "PAGED_FWD_TMA,PAGED_FWD_REGS_232")
    assert forward._variant_from_env() == ("PAGED_FWD_REGS_232", "PAGED_FWD_TMA")


def test_wgmma_backward_mirrors_match_the_kernel(reports):
    """kernels.bsa_backward's wgmma shared-memory and thread formulas equal paged_bwd.cu's Config, and the wgmma
    kernel takes the mma.sync kernel's parameters plus the fixed-point bound (the wrapper passes one
    argument tuple and appends that one)."""
    from sparseattn.kernels import bsa_backward as bb

    nvrtc = compile_check._Nvrtc(compile_check.find_nvrtc())
    options = compile_check.compile_options(compile_check.find_cuda_include())
    helpers = {bb.ABSMAX_NAME, bb.FIXED_POSTPROCESS_NAME} | {bb.dq_kernel_name(*x) for x in bb.DQ_SHAPES}
    helpers |= {bb.ws_kernel_name(d, pair) for d in bb.HEAD_DIMS for pair in (False, True)}
    assert {bb.wgmma_kernel_name(*x) for x in bb.WGMMA_SHAPES} | helpers == set(bb.WGMMA_NAME_EXPRESSIONS)
    launched = {
        (m, *bb.wgmma_variant(i, m, det))
        for i in bb.IMPLS[1:]
        for m in bb.OWNED_ROWS
        for det in (False, True)
    }
    ws = {(128, bb.WS_SPLIT, bb.DQ_BULK)}  # paged_bwd_ws_kernel, named apart
    assert launched - ws == {(m, q, mode) for _, m, q, mode in bb.WGMMA_SHAPES} and ws <= launched
    checks = (
        "".join(
            f'static_assert(paged_bwd::Config<{d}, {m}, {q}, {b}>::kSmemBytes == {bb.wgmma_smem_bytes(d, m, q)}, "s");'
            f'static_assert(paged_bwd::Config<{d}, {m}, {q}, {b}>::kThreads == {bb.wgmma_threads_per_cta(m, q)}, "t");'
            for d, m, q, b in bb.WGMMA_SHAPES
        )
        + "".join(
            f'static_assert(paged_bwd_dq::Config<{d}, {m}>::kSmemBytes == {bb.dq_smem_bytes(d, m)}, "dq s");'
            f'static_assert(paged_bwd_dq::Config<{d}, {m}>::kThreads == {bb.dq_threads_per_cta(m)}, "dq t");'
            for d, m in bb.DQ_SHAPES
        )
        + _ws_smem_asserts(())
        + f'static_assert(paged_bwd_ws::kThreads == {bb.WS_THREADS}, "ws t");'
    )
    code = runtime.preprocess(bb.WGMMA_SOURCE) + "\n" + checks + "\n"
    ok, log, _, _ = nvrtc.compile(code, "paged_bwd_check.cu", options, ())
    assert ok, log

    def params(source, kernel):  # the slot-order build's (the token-order build's are checked apart)
        text = (runtime.kernel_dir() / source).read_text()
        sig = re.search(rf"\n{kernel}\((.*?)\)\s*\{{", text, re.DOTALL).group(1)
        sig = sig.replace("PAGED_BWD_TOKEN_PARAMS", "")
        return tuple(re.findall(r"(\w+)\s*(?:,|$)", " ".join(sig.split())))

    assert params(bb.WGMMA_SOURCE, "paged_bwd_kernel") == (*params(bb.SOURCE, "bsa_bwd_kernel"), "dq_absmax")
