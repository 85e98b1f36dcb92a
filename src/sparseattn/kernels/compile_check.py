"""CPU-only compile check: build every ``kernels_cu/*.cu`` to an sm_90a cubin with NVRTC.

Uses NVRTC's C API through ctypes (``libnvrtc`` from the ``nvidia-cuda-nvrtc`` wheel, CUDA headers
from the ``nvidia-cuda-runtime`` wheel: ``pip install -e ".[compile]"``), so no GPU, driver or CuPy is
needed. Each source is preprocessed exactly as :mod:`.runtime` does and compiled with the same
options plus ``--ptxas-options=-v``; every template instantiation a wrapper module declares is
added as a name expression. Wrapper modules in ``sparseattn.kernels`` declare their kernels with
either ``SOURCE = "x.cu"`` + ``NAME_EXPRESSIONS = (...)`` or ``KERNEL_SOURCES = {"x.cu": (...)}``.

``python -m sparseattn.kernels.compile_check`` prints a table (registers, spills, shared memory
per kernel) and exits non-zero on any error, on ptxas serializing a kernel's wgmma instructions
(warnings C7512, C7514: the tensor cores lose their overlap), or on a spill that :data:`ACCEPTED_SPILLS` does not
accept; the output says why each accepted spill is accepted. The test suite uses the same list.
"""

from __future__ import annotations

import ctypes
import importlib
import pkgutil
import re
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from . import runtime


class CompileToolchainMissing(RuntimeError):
    """The NVRTC library or the CUDA headers were not found (install the ``compile`` extra)."""


@dataclass(frozen=True)
class AcceptedSpill:
    """Register spills measured and accepted for one kernel: at most these bytes, for ``reason``."""

    stores: int
    loads: int
    reason: str


#: The one list of accepted spills (kernel name -> limits and why). Any other spill, or a larger one,
#: fails both ``python -m sparseattn.kernels.compile_check`` and ``tests/test_compile.py``.
ACCEPTED_SPILLS = {
    "bsa_bwd_kernel<128, 128, 64, 64, 1>": AcceptedSpill(
        32,
        44,
        "d=128 / 128-block backward at 255 registers; every spill-free tiling measured on the H200 "
        "ran about 14% slower (data/bench/experiments/NOTES_bsa_bwd.md)",
    ),
    # the pair backward (what route="auto" runs on 64-row K/V blocks): its consumers need 240 registers
    # (at 232 they spill or ptxas serializes their wgmmas), which leaves the producer 24
    "paged_bwd_ws_kernel<128, true>": AcceptedSpill(
        88,
        140,
        "pair backward: the producer warpgroup at 24 registers spills a few words of its page-gather loop, "
        "and the consumers at 240 some words (a few local loads per 64-row step) since steps run in four "
        "forms (data/bench/experiments/NOTES_kpage_bwd.md, v20)",
    ),
    "paged_bwd_ws_kernel<64, true>": AcceptedSpill(
        20,
        20,
        "pair backward at d = 64: the producer warpgroup at 24 registers, as for d = 128",
    ),
    "plan_items": AcceptedSpill(
        8,
        16,
        "device planner's item passes at 4 blocks of 256 threads per SM (64 registers): faster on the H200 "
        "than 2 blocks at 96 registers without spills, planning 1.17 against 1.40 ms at VSA 720p; since v17 "
        "the members' rows are shuffled where used, which left two words "
        "(data/bench/experiments/NOTES_device_planner.md, v7-v9, v17)",
    ),
}


def kernel_key(kernel: str) -> str:
    """A kernel name as :data:`ACCEPTED_SPILLS` spells it (``f<1, 2>``, whatever the spacing)."""
    return kernel.replace(" ", "").replace(",", ", ")


# ---- locating the wheels ---------------------------------------------------------------------


def _nvidia_roots() -> list[Path]:
    roots = []
    for key in ("purelib", "platlib"):
        p = Path(sysconfig.get_paths()[key]) / "nvidia"
        if p.is_dir() and p not in roots:
            roots.append(p)
    for entry in sys.path:
        p = Path(entry) / "nvidia"
        if p.is_dir() and p not in roots:
            roots.append(p)
    return roots


def find_nvrtc() -> Path:
    """Path of ``libnvrtc.so`` from the nvidia-cuda-nvrtc wheel."""
    for root in _nvidia_roots():
        hits = sorted(root.glob("*/lib/libnvrtc.so*")) + sorted(root.glob("*/*/lib/libnvrtc.so*"))
        hits = [h for h in hits if ".alt." not in h.name and "builtins" not in h.name]
        if hits:
            return hits[0]
    raise CompileToolchainMissing(
        "libnvrtc not found: pip install 'nvidia-cuda-nvrtc==13.0.88' (the compile extra)"
    )


def find_cuda_include() -> Path:
    """The include folder holding ``cuda_bf16.h`` (nvidia-cuda-runtime wheel)."""
    for root in _nvidia_roots():
        hits = sorted(root.glob("*/include/cuda_bf16.h")) + sorted(root.glob("*/*/include/cuda_bf16.h"))
        if hits:
            return hits[0].parent
    raise CompileToolchainMissing(
        "cuda_bf16.h not found: pip install 'nvidia-cuda-runtime==13.0.96' (the compile extra)"
    )


# ---- NVRTC through ctypes --------------------------------------------------------------------


class _Nvrtc:
    def __init__(self, path: Path):
        # NVRTC dlopens its builtins library by soname at compile time; load it first from the wheel.
        for builtins in sorted(path.parent.glob("libnvrtc-builtins.so*")):
            if ".alt." not in builtins.name:
                ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
                break
        self.lib = ctypes.CDLL(str(path))
        lib = self.lib
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        lib.nvrtcGetLoweredName.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p)]

    def check(self, status: int, what: str):
        if status != 0:
            raise RuntimeError(f"{what}: {self.lib.nvrtcGetErrorString(status).decode()}")

    def version(self) -> str:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        return f"{major.value}.{minor.value}"

    def compile(self, code: str, name: str, options, name_expressions):
        """Returns (ok, log, cubin bytes or None, {name expression: lowered name})."""
        lib = self.lib
        prog = ctypes.c_void_p()
        self.check(
            lib.nvrtcCreateProgram(ctypes.byref(prog), code.encode(), name.encode(), 0, None, None),
            "nvrtcCreateProgram",
        )
        try:
            for expr in name_expressions:
                self.check(lib.nvrtcAddNameExpression(prog, expr.encode()), f"nvrtcAddNameExpression({expr})")
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            status = lib.nvrtcCompileProgram(prog, len(options), opts)
            size = ctypes.c_size_t()
            self.check(lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "nvrtcGetProgramLogSize")
            buf = ctypes.create_string_buffer(size.value)
            self.check(lib.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
            log = buf.value.decode(errors="replace")
            if status != 0:
                return False, log, None, {}
            self.check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
            cubin = ctypes.create_string_buffer(size.value)
            self.check(lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
            lowered = {}
            for expr in name_expressions:
                out = ctypes.c_char_p()
                self.check(
                    lib.nvrtcGetLoweredName(prog, expr.encode(), ctypes.byref(out)), "nvrtcGetLoweredName"
                )
                lowered[expr] = out.value.decode()
            return True, log, cubin.raw, lowered
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


# ---- what to build ---------------------------------------------------------------------------


def declared_instantiations() -> dict[str, tuple[str, ...]]:
    """``{source file: name expressions}`` declared by the wrapper modules of ``sparseattn.kernels``.

    A module that fails to import is reported under the key ``"!<module>"`` with the error text.
    """
    import sparseattn.kernels as pkg

    found: dict[str, list[str]] = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name in ("compile_check", "runtime", "validate"):
            continue
        modname = f"{pkg.__name__}.{info.name}"
        try:
            mod = importlib.import_module(modname)
        except Exception as exc:  # noqa: BLE001 - a broken wrapper must show up in the report, not hide it
            found[f"!{modname}"] = [f"{type(exc).__name__}: {exc}"]
            continue
        sources = dict(getattr(mod, "KERNEL_SOURCES", {}) or {})
        if hasattr(mod, "SOURCE") and hasattr(mod, "NAME_EXPRESSIONS"):
            sources.setdefault(mod.SOURCE, tuple(mod.NAME_EXPRESSIONS))
        for src, exprs in sources.items():
            found.setdefault(src, [])
            found[src].extend(e for e in exprs if e not in found[src])
    return {k: tuple(v) for k, v in found.items()}


@dataclass
class KernelReport:
    source: str
    kernel: str
    registers: int | None = None
    spill_stores: int = 0
    spill_loads: int = 0
    stack_bytes: int = 0
    smem_static: int = 0
    cmem: str = ""
    #: ptxas's reason when it serialized the kernel's wgmma instructions (C7512, C7514, ...), else "".
    wgmma_serialized: str = ""

    @property
    def spills(self) -> bool:
        return bool(self.spill_stores or self.spill_loads)

    def accepted_spill(self) -> AcceptedSpill | None:
        """The :data:`ACCEPTED_SPILLS` entry covering this kernel's spills, if any."""
        accepted = ACCEPTED_SPILLS.get(kernel_key(self.kernel))
        if accepted and self.spill_stores <= accepted.stores and self.spill_loads <= accepted.loads:
            return accepted
        return None

    def status(self) -> str:
        """``ok``, ``accepted spill``, ``SPILLS`` (a spill nothing accepts) or ``WGMMA SERIALIZED``
        (ptxas waits for every wgmma before the next: the kernel's tensor-core overlap is gone)."""
        if self.wgmma_serialized:
            return "WGMMA SERIALIZED"
        if not self.spills:
            return "ok"
        return "accepted spill" if self.accepted_spill() else "SPILLS"


@dataclass
class SourceReport:
    source: str
    ok: bool
    log: str
    cubin_bytes: int = 0
    kernels: list[KernelReport] = field(default_factory=list)
    error: str = ""


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(.*)")
_SMEM = re.compile(r"(\d+) bytes smem")
_SERIALIZED = re.compile(
    r"wgmma\.mma_async instructions are serialized due to (.*?) (?:in|for) the function '([^']+)'"
)
#: Statuses that fail the check.
FAILING = ("SPILLS", "WGMMA SERIALIZED")


def parse_ptxas_log(source: str, log: str, lowered: dict[str, str]) -> list[KernelReport]:
    """Per-kernel resource lines of a ``--ptxas-options=-v`` log (mangled names mapped back)."""
    demangle = {v: k for k, v in lowered.items()}
    reports: list[KernelReport] = []
    by_mangled: dict[str, KernelReport] = {}
    current = None
    for line in log.splitlines():
        m = _ENTRY.search(line)
        if m:
            current = by_mangled.setdefault(
                m.group(1), KernelReport(source, demangle.get(m.group(1), m.group(1)))
            )
            reports.append(current)
            continue
        if current is None:
            continue
        m = _FRAME.search(line)
        if m:
            current.stack_bytes, current.spill_stores, current.spill_loads = (int(x) for x in m.groups())
        m = _USED.search(line)
        if m:
            current.registers = int(m.group(1))
            s = _SMEM.search(m.group(2))
            current.smem_static = int(s.group(1)) if s else 0
    for m in _SERIALIZED.finditer(log):  # ptxas names the function; the line may precede its entry line
        report = by_mangled.get(m.group(2))
        if report is not None:
            report.wgmma_serialized = " ".join(m.group(1).split())
    return reports


def compile_options(include_dir: Path) -> tuple[str, ...]:
    return tuple(runtime.NVRTC_OPTIONS) + ("--ptxas-options=-v", f"-I{include_dir}")


def check_all(sources=None) -> list[SourceReport]:
    """Compile every kernel source (or the given file names); one report per source."""
    nvrtc = _Nvrtc(find_nvrtc())
    include = find_cuda_include()
    declared = declared_instantiations()
    reports = [SourceReport(k, False, "", error=v[0]) for k, v in declared.items() if k.startswith("!")]
    paths = runtime.kernel_sources() if sources is None else [runtime.kernel_dir() / s for s in sources]
    for path in paths:
        exprs = declared.get(path.name, ())
        try:
            code = runtime.preprocess(path)
            ok, log, cubin, lowered = nvrtc.compile(code, path.name, compile_options(include), exprs)
        except Exception as exc:  # noqa: BLE001 (report any failure per source)
            reports.append(SourceReport(path.name, False, "", error=f"{type(exc).__name__}: {exc}"))
            continue
        rep = SourceReport(path.name, ok, log, len(cubin) if cubin else 0)
        if ok:
            rep.kernels = parse_ptxas_log(path.name, log, lowered)
            if not rep.kernels:
                rep.error = "no kernel compiled (no wrapper declares its instantiations?)"
        else:
            rep.error = "\n".join(line for line in log.splitlines() if "error" in line)[:2000] or log[:2000]
        reports.append(rep)
    return reports


def print_table(reports: list[SourceReport], file=None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="NVRTC sm_90a compile check (ptxas -v)")
    for col in ("source", "kernel", "regs", "spill st/ld", "stack", "static smem", "status"):
        table.add_column(col)
    for rep in reports:
        if not rep.ok:
            table.add_row(
                rep.source, "-", "-", "-", "-", "-", f"ERROR {rep.error.splitlines()[0] if rep.error else ''}"
            )
            continue
        for k in rep.kernels:
            status = k.status()
            table.add_row(
                rep.source,
                k.kernel,
                str(k.registers),
                f"{k.spill_stores}/{k.spill_loads}",
                str(k.stack_bytes),
                str(k.smem_static),
                status,
            )
        if rep.error:
            table.add_row(rep.source, "-", "-", "-", "-", "-", f"WARN {rep.error}")
    console = Console(file=file, width=160)
    console.print(table)
    for k in (k for rep in reports for k in rep.kernels if k.status() == "accepted spill"):
        accepted = k.accepted_spill()
        console.print(
            f"accepted spill: {k.kernel} {k.spill_stores}/{k.spill_loads} bytes (limit "
            f"{accepted.stores}/{accepted.loads}): {accepted.reason}",
            highlight=False,
            soft_wrap=True,
        )


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m sparseattn.kernels.compile_check", description=__doc__.split("\n")[0]
    )
    parser.add_argument("sources", nargs="*", help="kernel files (default: every kernels_cu/*.cu)")
    parser.add_argument("--log", action="store_true", help="print the full NVRTC logs")
    args = parser.parse_args(argv)
    try:
        nvrtc = _Nvrtc(find_nvrtc())
        print(f"NVRTC {nvrtc.version()} ({find_nvrtc()}), headers {find_cuda_include()}")
        reports = check_all(args.sources or None)
    except CompileToolchainMissing as exc:
        print(f"compile check unavailable: {exc}", file=sys.stderr)
        return 2
    if args.log:
        for rep in reports:
            print(f"==== {rep.source}\n{rep.log}\n{rep.error}")
    print_table(reports)
    bad = [r for r in reports if not r.ok or r.error] + [
        k for r in reports for k in r.kernels if k.status() in FAILING
    ]
    for k in (k for rep in reports for k in rep.kernels if k.wgmma_serialized):
        print(f"wgmma serialized: {k.kernel}: {k.wgmma_serialized}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
