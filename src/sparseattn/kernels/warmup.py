"""Compile every kernel module the wrappers launch, once, into CuPy's on-disk kernel cache.

A process that launches a kernel compiles its module with NVRTC (one run per source and set of
template instantiations: about 15 s for ``paged_bwd.cu``, 25 s for all of them on one core) unless
CuPy's kernel cache already holds it. That cache is on disk (``~/.cupy/kernel_cache``, or
``$CUPY_CACHE_DIR``) and keyed by the code, the options, the target and the instantiations (CuPy
≥ 14.1 also caches modules built with name expressions). Cold, every one of the GPU suite's
pytest-xdist workers would compile every module itself; after :func:`warm_up` they all load the cubins.

:func:`warm_up` compiles the :func:`builds` — each wrapper module's ``SOURCE`` + ``NAME_EXPRESSIONS``
and ``KERNEL_SOURCES``, exactly the tuples its launches pass to :func:`.launch.function`, with the
compile-time variants in force (``kernel_defines``), and the other builds it launches (``extra_builds()``:
``(source, name expressions, defines)``, e.g. the forward's token-order build) — each in its own process, all at once (the
longest first). ``tests/conftest.py`` calls it once in the pytest controller before the xdist workers
start (``pytest -m gpu``; ``SPARSEATTN_KERNEL_WARMUP=0`` skips it) and ``python -m
sparseattn.gpucheck`` runs it as its first step. From the shell::

    python -m sparseattn.kernels.warmup            # compile what is not cached yet; a table of times
    python -m sparseattn.kernels.warmup --list     # the builds, without compiling (no GPU needed)
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing
import os
import pkgutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

from . import runtime

#: Modules outside ``sparseattn.kernels`` that launch kernels of their own (``SOURCE`` + ``NAME_EXPRESSIONS``).
EXTRA_MODULES = ("sparseattn.pageweaver.grouping_gpu",)
#: Modules of ``sparseattn.kernels`` that declare no kernel.
_NOT_WRAPPERS = ("compile_check", "launch", "runtime", "tensor_map", "validate", "warmup")
#: Environment variable that switches the pytest warm-up off (``0``).
ENV_SWITCH = "SPARSEATTN_KERNEL_WARMUP"


@dataclass(frozen=True)
class Build:
    """One compiled module: what :func:`.launch.function` compiles for ``source``."""

    source: str
    name_expressions: tuple[str, ...]
    defines: tuple[str, ...] = ()
    module: str = ""

    @property
    def options(self) -> tuple[str, ...]:
        return runtime.NVRTC_OPTIONS + tuple(f"-D{d}" for d in self.defines)


@dataclass
class BuildResult:
    build: Build
    seconds: float
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


def _wrapper_modules() -> list[str]:
    import sparseattn.kernels as pkg

    names = [
        f"{pkg.__name__}.{m.name}" for m in pkgutil.iter_modules(pkg.__path__) if m.name not in _NOT_WRAPPERS
    ]
    return sorted(names) + list(EXTRA_MODULES)


def builds() -> list[Build]:
    """Every module build the wrappers launch, longest compile first (``paged_bwd.cu`` first)."""
    found: dict[tuple, Build] = {}
    for name in _wrapper_modules():
        mod = importlib.import_module(name)
        sources = dict(getattr(mod, "KERNEL_SOURCES", {}) or {})
        if hasattr(mod, "SOURCE") and hasattr(mod, "NAME_EXPRESSIONS"):
            sources.setdefault(mod.SOURCE, tuple(mod.NAME_EXPRESSIONS))
        defines_of = getattr(mod, "kernel_defines", None)
        for source, exprs in sources.items():
            defines = tuple(defines_of(source)) if defines_of is not None else ()
            build = Build(source, tuple(exprs), defines, name)
            found.setdefault((source, tuple(sorted(exprs)), defines), build)
        for source, exprs, defines in getattr(mod, "extra_builds", tuple)():  # other builds of a source
            found.setdefault(
                (source, tuple(sorted(exprs)), tuple(defines)),
                Build(source, tuple(exprs), tuple(defines), name),
            )
    return sorted(found.values(), key=lambda b: (-len(b.name_expressions), b.source))


def compile_build(build: Build) -> float:
    """Compile (or load from CuPy's cache) one build in this process; returns the seconds taken."""
    t0 = time.perf_counter()
    module = runtime.get_module(build.source, build.name_expressions, build.options)
    module.compile()
    return time.perf_counter() - t0


def _run_one(build: Build) -> BuildResult:
    t0 = time.perf_counter()
    try:
        return BuildResult(build, compile_build(build))
    except Exception as exc:  # noqa: BLE001 - reported per build; the tests show the compile error again
        first = (str(exc).strip().splitlines() or [""])[0]
        return BuildResult(build, time.perf_counter() - t0, f"{type(exc).__name__}: {first}"[:300])


def warm_up(selected: list[Build] | None = None, jobs: int | None = None, log=None) -> list[BuildResult]:
    """Compile ``selected`` (default: :func:`builds`) on up to ``jobs`` processes (default: one per
    build, at most the CPU count); ``log(line)`` after each. Results in the order of ``selected``."""
    todo = builds() if selected is None else list(selected)
    jobs = max(1, min(len(todo), jobs or os.cpu_count() or 1))
    results: dict[int, BuildResult] = {}

    def done(i: int, result: BuildResult) -> None:
        results[i] = result
        if log is not None:
            b = result.build
            what = "ok" if result.ok else f"FAILED {result.error}"
            log(f"{b.source:22s} {len(b.name_expressions):3d} kernels {result.seconds:7.1f} s  {what}")

    if jobs == 1:
        for i, build in enumerate(todo):
            done(i, _run_one(build))
    else:  # spawned: no fork of a process that may hold a CUDA context
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(_run_one, build): i for i, build in enumerate(todo)}
            for future in as_completed(futures):
                done(futures[future], future.result())
    return [results[i] for i in range(len(todo))]


def enabled() -> bool:
    """False when ``SPARSEATTN_KERNEL_WARMUP`` is ``0`` (or ``no`` / ``false`` / ``off``)."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "no", "false", "off")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sparseattn.kernels.warmup", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--list", action="store_true", help="list the builds, compile nothing")
    parser.add_argument("--jobs", type=int, default=None, help="processes (default: one per build)")
    args = parser.parse_args(argv)
    todo = builds()
    if args.list:
        for b in todo:
            extra = f"  -D {' '.join(b.defines)}" if b.defines else ""
            print(f"{b.source:22s} {len(b.name_expressions):3d} kernels  ({b.module}){extra}")
        return 0
    cache = os.environ.get("CUPY_CACHE_DIR", "~/.cupy/kernel_cache")
    print(f"compiling {len(todo)} kernel modules into CuPy's cache ({cache})", flush=True)
    t0 = time.perf_counter()
    results = warm_up(todo, args.jobs, log=lambda line: print(line, flush=True))
    failed = [r for r in results if not r.ok]
    print(f"warm-up: {len(results) - len(failed)}/{len(results)} modules in {time.perf_counter() - t0:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
