"""Time the GPU affinity grouping (CUDA events, median) and check it equals the numpy reference.

``python -m sparseattn.pageweaver.gpu_bench --out DIR`` runs every built-in capture (the 64K ones have
65,536 queries) plus a union-capped variant, and writes ``DIR/pageweaver_grouping_gpu.json``
(the docs/results.md format: gpu, commit, date, command, records) and ``DIR/pageweaver_grouping_gpu.log``.
``time_ms`` is the median of one call between CUDA events: the complete grouping of a call (host
validation and launch, search kernel, offsets scan) with the capture's page ids already on the GPU.
``pipelined_ms`` queues ``reps`` calls back to back (the device time when launches overlap), and
``host_enqueue_ms`` is the host time per call.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from .analysis import _commit, grouping_counts
from .captures import BUILTIN_CAPTURES, load_capture
from .grouping import DEFAULT_GROUP_SIZE, DEFAULT_WINDOW, affinity_groups
from .grouping_gpu import affinity_groups_device


def time_device(fn, reps: int = 50, warmup: int = 5, flush=None) -> float:
    """Median milliseconds of ``fn()`` between CUDA events; ``flush`` (a device buffer larger than L2)
    is zeroed before every timed call so each call starts with a cold cache."""
    import cupy as cp

    for _ in range(warmup):
        fn()
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(reps):
        if flush is not None:
            flush.fill(0)
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


def time_pipelined(fn, reps: int = 50) -> tuple[float, float]:
    """(device ms per call with ``reps`` calls queued back to back, host ms per call to enqueue)."""
    import cupy as cp

    fn()
    cp.cuda.Device().synchronize()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    host = 1e3 * (time.perf_counter() - t0) / reps
    stop.record()
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) / reps, host


class RunLog:
    """Lines printed as they come and kept for the run's ``.log``; :meth:`write` saves the run's JSON
    (gpu, commit, date, command, records) and the log as ``DIR/<stem>.json`` / ``.log``."""

    def __init__(self):
        import cupy as cp

        name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"]
        self.gpu = name.decode() if isinstance(name, bytes) else str(name)
        self.lines: list[str] = []

    def __call__(self, msg: str) -> None:
        print(msg, flush=True)
        self.lines.append(msg)

    def write(self, out: Path, stem: str, command: str, records: list) -> None:
        doc = {
            "gpu": self.gpu,
            "commit": _commit(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": command,
            "records": records,
        }
        (out / f"{stem}.json").write_text(json.dumps(doc, indent=1))
        (out / f"{stem}.log").write_text("\n".join(self.lines) + "\n")


def bench_capture(name, group_size, window, max_union, reps, log) -> dict:
    import cupy as cp

    cap = load_capture(name)
    t0 = time.perf_counter()
    ref = affinity_groups(cap, group_size, window, max_union)
    cpu_ms = 1e3 * (time.perf_counter() - t0)
    pages = cp.asarray(cap.pages)
    got = affinity_groups_device(pages, cap.num_pages, group_size, window, max_union).to_host()
    equal = bool(np.array_equal(got.ids, ref.ids) and np.array_equal(got.offsets, ref.offsets))

    def call():
        return affinity_groups_device(pages, cap.num_pages, group_size, window, max_union)

    ms = time_device(call, reps)
    pipelined_ms, host_ms = time_pipelined(call, reps)
    counts = grouping_counts(cap, got)
    rec = {
        "workload": cap.name,
        "impl": "pw_grouping_gpu",
        "pass": "grouping",
        "heads": 1,
        "head_dim": None,
        "time_ms": ms,
        "useful_pairs": counts["useful_pairs"],
        "physical_pairs": counts["physical_pairs"],
        "correct": equal,
        "queries": cap.num_queries,
        "k": cap.k,
        "context": cap.context,
        "group_size": group_size,
        "window": window,
        "max_union": max_union,
        "groups": got.num_groups,
        "page_loads": counts["page_loads"],
        "cpu_reference_ms": cpu_ms,
        "pipelined_ms": pipelined_ms,
        "host_enqueue_ms": host_ms,
    }
    log(
        f"{cap.name:8s} Q={cap.num_queries:6d} k={cap.k:2d} cap={max_union!s:>4s}  gpu {ms:7.4f} ms (pipelined {pipelined_ms:7.4f}, host enqueue {host_ms:6.4f})  "
        f"cpu ref {cpu_ms:8.1f} ms  groups {got.num_groups:6d}  loads {counts['page_loads']:8d}  equal={equal}"
    )
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output folder for the JSON and the log")
    ap.add_argument("--captures", nargs="*", default=list(BUILTIN_CAPTURES))
    ap.add_argument("--group-size", type=int, default=DEFAULT_GROUP_SIZE)
    ap.add_argument("--window", type=int, default=DEFAULT_WINDOW)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = RunLog()
    log(
        f"gpu {log.gpu}; group_size {args.group_size}, window {args.window}, reps {args.reps} (median of CUDA events)"
    )
    records = []
    for name in args.captures:
        records.append(bench_capture(name, args.group_size, args.window, None, args.reps, log))
    for name in [n for n in args.captures if n.endswith("64k")]:
        k = load_capture(name).k
        records.append(bench_capture(name, args.group_size, args.window, 2 * k, args.reps, log))
    ok = all(r["correct"] for r in records)
    log(f"all equal to the numpy reference: {ok}")
    command = "python -m sparseattn.pageweaver.gpu_bench " + " ".join(sys.argv[1:] if argv is None else argv)
    log.write(out, "pageweaver_grouping_gpu", command, records)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
