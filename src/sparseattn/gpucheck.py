"""One-shot verification run on the GPU machine: ``python -m sparseattn.gpucheck --out DIR [--quick]``.

Steps (each with its own time limit, total < 10 minutes on the H200):

0. ``python -m sparseattn.kernels.warmup`` — every kernel module compiled once, the modules in
   parallel, into CuPy's on-disk cache, so that the pytest workers and the sanitizer runs load cubins
   instead of each compiling every kernel (``warmup.log``; seconds when nothing was cached yet, about one
   when everything was);
1. ``pytest -m gpu --require-gpu tests/`` — every GPU test (forward and backward), mandatory; on
   pytest-xdist workers when the plugin is installed;
2. ``compute-sanitizer --tool memcheck`` over a small ragged forward (+ backward) case;
3. the benchmark subset (``sparseattn.bench``) with the peers, forward and forward+backward.

``--suite pageweaver`` does the same for PageWeaver's kernels: their GPU tests, the sanitizers over a
small capture (union kernel with adjacent and singleton groups, KV-page union, per-query kernel), and
``sparseattn bench pageweaver`` (``--bench-impl`` picks its implementations).

Writes into DIR (at most 9 files): ``warmup.log``, ``pytest.log``, ``sanitizer.log``, ``bench.log``, ``bench.json``
(PageWeaver: ``pageweaver_kernels.log`` / ``.json``), ``summary.json``; prints a short table last. Exit
status 0 only when every step passed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .kernels.bsa_backward import IMPLS as BWD_IMPLS

REPO = Path(__file__).resolve().parents[2]


# Step time limits (seconds); together under 8 minutes with a warm cache.
WARMUP_LIMIT_S = 240
PYTEST_LIMIT_S = 330
SANITIZER_LIMIT_S = 60
BENCH_LIMIT_S = 300
BENCH_QUICK_LIMIT_S = 110
FULL_BENCH_WORKLOADS = (
    "vsa_wan14b_720p",
    "ssta_hy15_720p",
    "sta_hunyuan_117f",
    "vsa_wan14b_480p",
    "sta_wan14b_69f",
)


def _run(cmd: list[str], log: Path, timeout: float, env=None) -> tuple[int, float, str]:
    """Run ``cmd`` with output teed to ``log``; returns (exit code, seconds, last lines)."""
    t0 = time.time()
    with open(log, "w") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        try:
            proc = subprocess.run(  # noqa: PLW1510 (the exit status is read)
                cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout, cwd=REPO, env=env
            )
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = 124
            fh.write(f"\n!!! timed out after {timeout:.0f} s\n")
    tail = log.read_text(errors="replace").splitlines()[-40:]
    return code, time.time() - t0, "\n".join(tail)


PAGEWEAVER_TESTS = ("tests/gpu/test_pw_union.py", "tests/gpu/test_pw_grouping_gpu.py")


def xdist_args() -> list[str]:
    """pytest-xdist workers when the plugin is installed (the GPU tests' float64 references are CPU-bound:
    on the H200 machine the whole GPU suite takes ~2 min on 15 workers instead of over 5 serially), with
    pytest-benchmark switched off (it refuses to time under xdist and warns per worker)."""
    if importlib.util.find_spec("xdist") is None:
        return []
    extra = ["-p", "no:benchmark"] if importlib.util.find_spec("pytest_benchmark") else []
    return ["-n", str(max(1, min(15, (os.cpu_count() or 2) - 1))), *extra]


def pageweaver_sanitize_case() -> int:
    """A small ragged capture (P = 16 and 64, 2 KV heads, G = 4) through every PageWeaver kernel."""
    import cupy
    import numpy as np

    from .kernels.pageweaver import kv_page_forward, per_query_forward, per_query_groups, union_forward
    from .kernels.validate import float_to_bf16_bits
    from .pageweaver.captures import GeneratorConfig, generate_capture
    from .pageweaver.fp8 import random_cache
    from .pageweaver.grouping import adjacent_groups

    rng = np.random.default_rng(0)
    for P in (16, 64):
        cap = generate_capture(
            GeneratorConfig(context=40 * P - 5, page_size=P, num_queries=37, budget_tokens=8 * P, seed=P)
        )
        cache = random_cache(rng, 2, cap.context, 128, P)
        q = float_to_bf16_bits(rng.standard_normal((8, cap.num_queries, 128)))
        args = [cupy.asarray(x) for x in (q, cache.k, cache.v, cache.k_scale, cache.v_scale)]
        union_forward(*args, cap, adjacent_groups(cap.num_queries, 8))
        union_forward(*args, cap, per_query_groups(cap.num_queries), pack=1)
        kv_page_forward(*args, cap)
        per_query_forward(*args, cap)
        cupy.cuda.Device().synchronize()
    print("pageweaver sanitize case done")
    return 0


def pair_sanitize_case() -> int:
    """The pair routes for compute-sanitizer: a neighbour-window graph on 64-slot video blocks (partial
    border cubes packed into halves), a random graph on 128-slot blocks (scattered partial blocks paired)
    and a HeadStack of both, forward (auto and pair routes) and backward (pair route), d = 128 and 64."""
    import cupy
    import numpy as np

    from .builders import random_graph
    from .graph import HeadStack, SparseGraph
    from .kernels.backward import kpage_backward
    from .kernels.forward import kpage_forward
    from .kernels.validate import float_to_bf16_bits
    from .layouts import video_layout

    layout = video_layout((5, 7, 9), (4, 4, 4), block_size=64)
    window = np.zeros((2, layout.num_blocks, layout.num_blocks), dtype=bool)
    for i in range(layout.num_blocks):
        window[:, i, max(0, i - 5) : i + 6] = True
    lay128 = video_layout((5, 7, 9), (4, 4, 8), block_size=128)
    stack = HeadStack.of(
        [
            random_graph(layout, layout, heads=1, density=0.4, seed=2),
            random_graph(lay128, lay128, 1, 0.4, seed=3),
        ]
    )
    cases = (
        (SparseGraph.from_block_mask(layout, layout, window), layout.num_slots),
        (random_graph(lay128, lay128, heads=2, density=0.5, seed=1), lay128.num_slots),
        (stack, stack.q_slots),
    )
    rng = np.random.default_rng(0)
    for graph, slots in cases:
        for d in (128, 64):
            shape = (1, 2, slots, d)
            q, k, v, do = (cupy.asarray(float_to_bf16_bits(rng.standard_normal(shape))) for _ in range(4))
            o, lse = kpage_forward(q, k, v, graph)
            kpage_forward(q, k, v, graph, route="pair")
            kpage_backward(q, k, v, o, lse, do, graph, route="pair")
            cupy.cuda.Device().synchronize()
    print("pair sanitize case done")
    return 0


def sanitize_case(paged_only: bool = False, backward_only: bool = False) -> int:
    """A small ragged case for compute-sanitizer: the paged forward (every route), the mma.sync BSA
    forward and the backward, synchronized, then the pair routes (:func:`pair_sanitize_case`);
    ``paged_only`` runs the paged forward alone and ``backward_only`` the backward (after one forward
    for its inputs): racecheck is slow."""
    import cupy
    import numpy as np

    from .builders import random_graph
    from .graph import SparseGraph
    from .kernels.bsa_mma_forward import bsa_mma_forward
    from .kernels.forward import paged_forward
    from .kernels.validate import float_to_bf16_bits
    from .layouts import contiguous_layout, slot_layout, video_layout

    rng = np.random.default_rng(0)
    cases = [
        video_layout((5, 7, 9), (4, 4, 8), block_size=128),
        video_layout((5, 7, 9), (4, 4, 4), block_size=64),
    ]
    valid = rng.random(6 * 64) < 0.5
    valid[64:128] = False
    cases.append(slot_layout(valid, 64))
    if paged_only:
        cases = cases[:2]
    graphs = [random_graph(layout, layout, heads=2, density=0.5, seed=1) for layout in cases]
    # a long stream through the K/V rings (each buffer reused many times per item): the consumers' reads
    # of a chunk's page masks against the producer's next store to the same slot
    ring_q, ring_k = contiguous_layout(128 * 3 - 50, 128), contiguous_layout(128 * 40 - 37, 128)
    graphs.append(
        SparseGraph.from_block_mask(
            ring_q, ring_k, np.ones((2, ring_q.num_blocks, ring_k.num_blocks), dtype=bool)
        )
    )
    for graph in graphs:
        for d in (64, 128):
            q, k, v, do = (
                cupy.asarray(float_to_bf16_bits(rng.standard_normal((1, 2, n, d))))
                for n in (graph.q.num_slots, graph.k.num_slots, graph.k.num_slots, graph.q.num_slots)
            )
            forwards = (("kpage", "auto"), ("kpage", 0), ("kpage", 1), ("bsa", "auto"))
            for kind, route in () if backward_only else forwards:
                paged_forward(q, k, v, graph, kind=kind, route=route)
            if paged_only:
                continue
            from .kernels.bsa_backward import default_impl, plan_backward

            o, lse = bsa_mma_forward(q, k, v, graph)
            plan_backward(q, k, v, o, lse, do, graph)
            if default_impl() != "mma":  # and the deterministic (fixed-point dQ) kernels
                plan_backward(q, k, v, o, lse, do, graph, deterministic=True)
            cupy.cuda.Device().synchronize()
    print("sanitize case done")
    return 0 if paged_only or backward_only else pair_sanitize_case()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sparseattn.gpucheck", description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="folder for logs and JSON (required but with --sanitize-case)")
    parser.add_argument(
        "--quick", action="store_true", help="fewer benchmark workloads, heads and repetitions"
    )
    parser.add_argument(
        "--skip", action="append", default=[], choices=("warmup", "pytest", "sanitizer", "bench")
    )
    parser.add_argument("--tests", nargs="+", default=["tests/"], help="pytest paths (default: tests/)")
    parser.add_argument("--fwd-only", action="store_true", help="benchmark the forward pass only")
    parser.add_argument(
        "--suite",
        choices=("kpage", "pageweaver"),
        default="kpage",
        help="which kernels to check (default kpage)",
    )
    parser.add_argument("--sanitize-case", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--paged-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backward-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pair-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--bwd-impl",
        choices=BWD_IMPLS,
        default=None,
        help="backward kernel for every step (sets SPARSEATTN_BWD_IMPL; default: the package's default)",
    )
    parser.add_argument("--racecheck", action="store_true", help="also run compute-sanitizer racecheck")
    parser.add_argument(
        "--bench-workload",
        action="append",
        default=None,
        metavar="NAME",
        help="benchmark these workloads (default: the built-ins whose heads share a layout)",
    )
    parser.add_argument(
        "--bench-impl",
        action="append",
        default=None,
        metavar="IMPL",
        help="benchmark these implementations (default: all)",
    )
    parser.add_argument("--bench-limit", type=float, default=None, help="bench step time limit (s)")
    args = parser.parse_args(argv)
    pageweaver = args.suite == "pageweaver"
    if args.sanitize_case:
        if pageweaver:
            return pageweaver_sanitize_case()
        return pair_sanitize_case() if args.pair_only else sanitize_case(args.paged_only, args.backward_only)
    if args.out is None:
        parser.error("the following arguments are required: --out")
    if pageweaver and args.tests == ["tests/"]:
        args.tests = list(PAGEWEAVER_TESTS)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
        PYTHONUNBUFFERED="1",
    )
    if args.bwd_impl:
        env["SPARSEATTN_BWD_IMPL"] = args.bwd_impl
    py = sys.executable
    steps = []

    if "warmup" not in args.skip:
        code, sec, tail = _run(
            [py, "-m", "sparseattn.kernels.warmup"], out / "warmup.log", WARMUP_LIMIT_S, env
        )
        note = next((line for line in reversed(tail.splitlines()) if line.startswith("warm-up:")), "")
        steps.append(
            dict(
                step="kernel warm-up (CuPy cache)", code=code, seconds=round(sec, 1), note=note or tail[-110:]
            )
        )
        env["SPARSEATTN_KERNEL_WARMUP"] = "0"  # done: pytest's own warm-up (tests/conftest.py) is not needed

    if "pytest" not in args.skip:
        code, sec, tail = _run(
            [
                py,
                "-m",
                "pytest",
                "-m",
                "gpu",
                "--require-gpu",
                "-q",
                "-p",
                "no:cacheprovider",
                "-rfEs",
                *([f"--timeout={PYTEST_LIMIT_S - 30}"] if importlib.util.find_spec("pytest_timeout") else []),
                *xdist_args(),
                *args.tests,
            ],
            out / "pytest.log",
            PYTEST_LIMIT_S,
            dict(env, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1"),
        )
        summary = next(
            (line for line in reversed(tail.splitlines()) if " in " in line and "=" in line),
            tail.splitlines()[-1] if tail else "",
        )
        steps.append(
            dict(
                step="pytest -m gpu --require-gpu", code=code, seconds=round(sec, 1), note=summary.strip("= ")
            )
        )

    if "sanitizer" not in args.skip:
        tool = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"

        def sanitize(which: str, log: str, limit: float, *case_args: str) -> None:
            """compute-sanitizer ``which`` over the sanitize case; one summary step."""
            if Path(tool).exists():
                cmd = [tool, "--tool", which, "--error-exitcode", "3", py, "-m", "sparseattn.gpucheck"]
                cmd += ["--suite", args.suite, "--out", str(out), "--sanitize-case", *case_args]
                code, sec, tail = _run(cmd, out / log, limit, env)
                note = next((line for line in reversed(tail.splitlines()) if "SUMMARY" in line), "no summary")
            else:
                code, sec, note = 127, 0.0, "compute-sanitizer not found"
                (out / log).write_text(note + "\n")
            steps.append(
                dict(
                    step=f"compute-sanitizer {which}"
                    + (" (backward)" if "--backward-only" in case_args else "")
                    + (" (pair routes)" if "--pair-only" in case_args else ""),
                    code=code,
                    seconds=round(sec, 1),
                    note=note.strip(),
                )
            )

        sanitize("memcheck", "sanitizer.log", SANITIZER_LIMIT_S * 2)
        if args.racecheck and Path(tool).exists():
            if pageweaver:
                sanitize("racecheck", "racecheck.log", SANITIZER_LIMIT_S * 2)
            else:  # the forward and the backward apart: either alone fills racecheck's time limit
                sanitize("racecheck", "racecheck.log", SANITIZER_LIMIT_S * 2, "--paged-only")
                sanitize("racecheck", "racecheck_backward.log", SANITIZER_LIMIT_S * 2, "--backward-only")
                sanitize("racecheck", "racecheck_pair.log", SANITIZER_LIMIT_S * 2, "--pair-only")

    if "bench" not in args.skip and pageweaver:
        cmd = [py, "-m", "sparseattn.pageweaver.kernel_bench", "--out", str(out)]
        if args.quick:
            cmd += ["--captures", "nsa_8k", "dsa_64k", "--gqa", "1", "8", "--reps", "5"]
        if args.bench_impl:
            cmd += ["--impl", *args.bench_impl]
        limit = args.bench_limit or (BENCH_QUICK_LIMIT_S if args.quick else BENCH_LIMIT_S)
        code, sec, tail = _run(cmd, out / "bench_stdout.log", limit, env)
        steps.append(
            dict(
                step="bench pageweaver", code=code, seconds=round(sec, 1), note="see pageweaver_kernels.json"
            )
        )
    elif "bench" not in args.skip:
        cmd = [
            py,
            "-m",
            "sparseattn.bench",
            "--out",
            str(out / "bench.json"),
            "--pass",
            "fwd",
            "--launch-overhead",
        ]
        if not args.fwd_only:
            cmd += ["--pass", "bwd", "--pass", "fwdbwd"]
        if args.quick:
            cmd += [
                "--workload",
                "vsa_wan14b_720p",
                "--workload",
                "ssta_hy15_720p",
                "--heads",
                "4",
                "--reps",
                "5",
            ]
        else:  # the built-in workloads at their real head counts
            for name in args.bench_workload or FULL_BENCH_WORKLOADS:
                cmd += ["--workload", name]
            cmd += ["--reps", "10", "--warmup", "2"]
        for impl in args.bench_impl or ():
            cmd += ["--impl", impl]
        limit = args.bench_limit or (BENCH_QUICK_LIMIT_S if args.quick else BENCH_LIMIT_S)
        code, sec, tail = _run(cmd, out / "bench.log", limit, env)
        steps.append(dict(step="bench", code=code, seconds=round(sec, 1), note="see bench.json"))

    (out / "summary.json").write_text(json.dumps(steps, indent=1))
    if (out / "bench.json").exists():
        try:
            from .bench import print_table

            print_table(json.loads((out / "bench.json").read_text())["records"])
        except Exception as exc:  # noqa: BLE001 - the summary below still prints
            print(f"(bench table unavailable: {exc})")
    print(f"{'step':32s} {'exit':>4s} {'sec':>7s}  note")
    for s in steps:
        print(f"{s['step']:32s} {s['code']:4d} {s['seconds']:7.1f}  {s['note'][:110]}")
    ok = bool(steps) and all(s["code"] == 0 for s in steps)  # no step run proves nothing
    print("GPUCHECK", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
