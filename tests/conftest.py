"""Shared pytest setup.

* ``--require-gpu``: tests marked ``gpu`` FAIL (instead of skipping) when CuPy or a usable CUDA
  device is missing, so a broken driver on the GPU machine cannot pass silently.
* kernel warm-up: when GPU tests run (``-m gpu``, ``--require-gpu`` or paths under ``tests/gpu``) and
  CuPy is installed, the pytest process (the xdist controller, before any worker starts) compiles every
  kernel module once into CuPy's on-disk cache (:mod:`sparseattn.kernels.warmup`, the modules in
  parallel), so the workers load cubins instead of each compiling every kernel;
  ``SPARSEATTN_KERNEL_WARMUP=0`` skips it. The report header says what it took.
* ``rng``: a numpy Generator with a fresh seed per test (printed; set ``SPARSEATTN_SEED`` to replay).
* ``poisoned``: allocates NaN-filled CuPy output buffers (bf16 as uint16 bits, or float dtypes).
* ``SPARSEATTN_TEST_TIMES=<file>``: the controller appends a line to ``<file>`` when each test starts and
  when it ends (wall time, outcome, duration), flushed at once: a run cut off by a timeout still says which
  tests took the time and which were still running.
* ``SPARSEATTN_TEST_STACKS=<dir>``: each process (controller and xdist workers) dumps every thread's
  Python stack into ``<dir>/<worker>.txt`` on ``SIGUSR1`` (``pkill -USR1 -P <controller pid>`` reaches the
  workers, whose command lines do not name pytest): where a slow or stuck run spends its time, without a
  debugger.
* pytest-xdist workers run numpy and torch on one CPU thread each (``OMP_NUM_THREADS`` and the BLAS
  variables default to 1 there, and ``threadpoolctl`` caps the pools a plugin's earlier import of numpy
  or torch already started): fifteen workers with a thread per core each oversubscribe the CPU many
  times over, and the float64 references then crawl (the GPU machine at bc31104: load average 120 on
  16 cores, 20 threads per worker, the workers inside numpy's reference; tests 5-10x slower).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import secrets
import sys
import time

if os.environ.get("PYTEST_XDIST_WORKER"):  # before numpy (and torch) size their thread pools
    for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

import numpy as np
import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    try:
        from threadpoolctl import threadpool_limits
    except (
        ImportError
    ):  # optional (the GPU machine runs from the source tree): the variables above still apply
        threadpool_limits = None
    _THREAD_LIMITS = threadpool_limits(1) if threadpool_limits is not None else None  # kept for the process
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)

if os.environ.get("SPARSEATTN_TEST_STACKS"):
    import faulthandler
    import signal

    os.makedirs(os.environ["SPARSEATTN_TEST_STACKS"], exist_ok=True)
    _STACK_FILE = open(  # noqa: SIM115 -- kept open for the process's life, as faulthandler requires
        os.path.join(
            os.environ["SPARSEATTN_TEST_STACKS"], f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.txt"
        ),
        "a",
    )
    faulthandler.register(signal.SIGUSR1, file=_STACK_FILE, all_threads=True, chain=False)

BF16_NAN_BITS = 0x7FC0


def pytest_addoption(parser):
    parser.addoption(
        "--require-gpu",
        action="store_true",
        default=False,
        help="fail (not skip) GPU tests when no usable CUDA GPU/CuPy is found",
    )


@functools.lru_cache(maxsize=1)
def gpu_status() -> tuple[bool, str]:
    """(usable, reason): CuPy imports, a device exists and a tiny kernel runs."""
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001 -- ImportError, or a CUDA library failing to load
        return False, f"cupy not importable ({type(exc).__name__}: {exc})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
        if n < 1:
            return False, "no CUDA device"
        x = cupy.arange(16, dtype=cupy.float32)
        if float((x * 2).sum()) != 240.0:
            return False, "CUDA device computed a wrong result"
        name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
        name = name.decode() if isinstance(name, bytes) else name
        return True, f"{n} device(s), {name}"
    except Exception as exc:  # noqa: BLE001 -- any CUDA failure means "no usable GPU"
        return False, f"CUDA device not usable ({type(exc).__name__}: {exc})"


def _gpu_tests_selected(config) -> bool:
    markexpr = config.getoption("markexpr", "") or ""
    if "gpu" in markexpr:
        return "not gpu" not in markexpr
    return bool(config.getoption("--require-gpu")) or any(
        "tests/gpu" in str(arg).replace(os.sep, "/") for arg in config.args
    )


def pytest_configure(config):
    """Kernel warm-up, once per run in the controller (xdist workers have ``workerinput``)."""
    if hasattr(config, "workerinput") or not _gpu_tests_selected(config):
        return
    from sparseattn.kernels import warmup

    if not warmup.enabled():
        config._sparseattn_warmup = f"skipped ({warmup.ENV_SWITCH}=0)"
        return
    if importlib.util.find_spec("cupy") is None:
        config._sparseattn_warmup = "skipped (no CuPy)"
        return
    t0 = time.perf_counter()
    results = warmup.warm_up()
    failed = [r for r in results if not r.ok]
    note = f"{len(results) - len(failed)}/{len(results)} modules in {time.perf_counter() - t0:.1f} s"
    if failed:  # the tests that launch them report the compile error themselves
        note += f"; failed: {failed[0].build.source}: {failed[0].error}"
    config._sparseattn_warmup = note


def pytest_report_header(config):
    ok, reason = gpu_status()
    required = config.getoption("--require-gpu")
    lines = [f"sparseattn GPU: {'yes' if ok else 'no'} ({reason}); --require-gpu={required}"]
    if hasattr(config, "_sparseattn_warmup"):
        lines.append(f"sparseattn kernel warm-up (CuPy cache): {config._sparseattn_warmup}")
    return lines


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is None:
        return
    ok, reason = gpu_status()
    if ok:
        return
    if item.config.getoption("--require-gpu"):
        pytest.fail(f"--require-gpu given but no usable GPU: {reason}", pytrace=False)
    pytest.skip(f"GPU test skipped: {reason}")


@pytest.fixture
def seed() -> int:
    """A fresh seed for this test (``SPARSEATTN_SEED`` overrides); printed so failures can be replayed."""
    value = int(os.environ.get("SPARSEATTN_SEED", secrets.randbits(32)))
    print(f"seed = {value} (replay with SPARSEATTN_SEED={value})")
    return value


@pytest.fixture
def rng(seed) -> np.random.Generator:
    return np.random.default_rng(seed)


@pytest.fixture
def poisoned():
    """Factory ``poisoned(shape, dtype)``: a CuPy array filled with NaN.

    ``dtype`` ``"bf16"``/``"uint16"`` gives uint16 bf16 bits of NaN (0x7FC0); float dtypes give NaN.
    """
    import cupy

    def make(shape, dtype="float32"):
        if str(dtype) in ("bf16", "uint16", "bfloat16"):
            return cupy.full(shape, BF16_NAN_BITS, dtype=cupy.uint16)
        return cupy.full(shape, np.nan, dtype=dtype)

    return make


def _test_times_file():
    """The file of SPARSEATTN_TEST_TIMES, in the controller (or a run without xdist) only."""
    path = os.environ.get("SPARSEATTN_TEST_TIMES")
    return None if not path or os.environ.get("PYTEST_XDIST_WORKER") else path


def _times_line(text: str) -> None:
    path = _test_times_file()
    if path:
        with open(path, "a") as f:
            f.write(f"{time.time():.1f} {text}\n")


def pytest_runtest_logstart(nodeid, location):
    _times_line(f"start {nodeid}")


def pytest_runtest_logreport(report):
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _times_line(f"end {report.outcome} {report.duration:.1f}s {report.nodeid}")
