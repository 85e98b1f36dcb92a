"""Where the backward's wall time goes (NOTES_kpage_bwd.md, "Where the backward's time goes, launch by
launch", 04372ba), on an H200:

    PYTHONPATH=src OUT=DIR python data/bench/experiments/backward_launches.py svg2_wan14b_720p vsa_wan14b_480p \\
        ssta_hy15_720p svg2_wan14b_720p:bsa

For each workload (``NAME`` or ``NAME:KIND``, kind ``kpage`` by default; full heads, batch 1): the
backward's CUDA-event time with its main launches side by side (the default, in both orders) and one
after the other (both orders), the event time of each main launch in the sequential order, and the host
time to enqueue one call while the GPU is busy. Variants interleave, median of REPS each, an L2 flush
before every timed call (the bench's Timer). Prints a line per workload, writes DIR/launches.json.
"""

import json
import os
import sys
import time

import cupy
import numpy as np

from sparseattn import bench
from sparseattn.kernels import launch
from sparseattn.kernels.backward import paged_backward
from sparseattn.kernels.forward import paged_forward

REPS = 10
MODES = ("side", "siderev", "seq", "rev")
SIDE_BY_SIDE = launch.side_by_side  # the wrapper calls launch.side_by_side: patching the module is enough


def sequential(order: str, events: list):
    """A side_by_side replacement: the launches one after the other on the current stream (``"rev"``:
    reversed), an event pair around each, appended to ``events``."""

    def run(launches):
        launches = list(launches)[::-1] if order == "rev" else list(launches)
        for go in launches:
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            go()
            end.record()
            events.append((start, end))

    return run


def measure(name: str, kind: str) -> dict:
    graph, head_dim = bench.workload_graph(name)
    case = bench.Case(graph, head_dim, 1, seed=1)
    timer = bench.Timer(warmup=2, reps=1)
    o, lse = paged_forward(case.q, case.k, case.v, graph, scale=case.scale, kind=kind)

    def backward():
        return paged_backward(case.q, case.k, case.v, o, lse, case.do, graph, scale=case.scale, kind=kind)

    backward()
    cupy.cuda.Device().synchronize()
    res = {mode: [] for mode in MODES} | {"host_ms": [], "launch_ms": []}
    events: list = []
    for _ in range(REPS):
        for mode in MODES:
            if mode == "side":
                launch.side_by_side = SIDE_BY_SIDE
            elif mode == "siderev":
                launch.side_by_side = lambda launches: SIDE_BY_SIDE(list(launches)[::-1])
            else:
                launch.side_by_side = sequential(mode, events)
            events.clear()
            ms, _ = timer(backward)
            res[mode].append(ms)
            if mode == "seq":
                n = len(events) // (timer.warmup + timer.reps)  # the launches of one call
                res["launch_ms"].append([cupy.cuda.get_elapsed_time(a, b) for a, b in events[-n:]])
    launch.side_by_side = SIDE_BY_SIDE
    busy = cupy.empty(1 << 30, dtype=cupy.int32)  # keeps the GPU busy while the host enqueues one call
    for _ in range(REPS):
        for _ in range(20):
            busy.fill(1)
        t0 = time.perf_counter()
        backward()
        res["host_ms"].append((time.perf_counter() - t0) * 1e3)
        cupy.cuda.Device().synchronize()
    median = {k: float(np.median(v)) for k, v in res.items() if k != "launch_ms"}
    per_launch = np.median(np.array(res["launch_ms"]), axis=0).tolist() if res["launch_ms"][0] else []
    print(
        f"{name:18s} {kind:5s} "
        + "  ".join(f"{mode} {median[mode]:8.2f}" for mode in MODES)
        + f"  host {median['host_ms']:6.2f} ms  launches(seq) {[round(x, 2) for x in per_launch]}",
        flush=True,
    )
    return dict(median=median, launch_ms_seq=per_launch, raw=res)


def main(argv: list[str]) -> None:
    out = dict(
        gpu=cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
        date=time.strftime("%Y-%m-%d", time.gmtime()),
        commit=os.environ.get("SPARSEATTN_COMMIT", ""),
        command="python data/bench/experiments/backward_launches.py " + " ".join(argv),
        workloads={},
    )
    for arg in argv:
        name, _, kind = arg.partition(":")
        out["workloads"][f"{name}:{kind or 'kpage'}"] = measure(name, kind or "kpage")
    with open(os.path.join(os.environ.get("OUT", "."), "launches.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
