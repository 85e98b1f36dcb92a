"""The Wan processor's SVG2 call replayed from a CUDA graph against the same call made eagerly (lab script,
GPU).

One KPage SVG2 call of the Wan processor at a built-in ``svg2_*`` workload's shape (its synthetic Q/K, V
random, ``[1, tokens, heads, d]`` bf16 as a model's projections give them): made eagerly with the host
waiting for each call (wall time: the host's launches are on the critical path), made eagerly with the host
queued ahead (CUDA events after a GPU sleep: the GPU's time alone), and captured once with
``torch.cuda.graph`` and replayed (wall time). The replays warm-start each other as eager calls do
(``WanSparseAttnProcessor._keep_centroids``); the script checks the last replay's output against an eager
call on the same inputs and the same warm start. Medians of ``--reps``.

    PYTHONPATH=src python data/bench/experiments/svg2_graph_replay.py --out svg2_graph_replay.json
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path


def main() -> int:
    import torch

    from sparseattn import workloads as wl
    from sparseattn.bench import write_run
    from sparseattn.diffusers_wan import WanSelection, WanSparseAttnProcessor
    from sparseattn.svg2_step_bench import features
    from sparseattn.torch import capture_cuda_graph

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="svg2_wan14b_720p")
    p.add_argument("--heads", type=int, default=None, help="heads (default: the workload's)")
    p.add_argument("--grid", default=None, help="TxHxW latent grid (default: the workload's)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    w = wl.get_workload(args.workload)
    if args.heads or args.grid:  # another model's shape, the same features and clusters
        grid = tuple(int(x) for x in args.grid.split("x")) if args.grid else w.grid
        w = dataclasses.replace(w, heads=args.heads or w.heads, grid=grid)
    sel = w.selection
    dev = torch.device("cuda")
    q, k, v = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in features(w, w.heads, dev))
    selection = WanSelection.svg2(
        q_clusters=sel.q_clusters,
        k_clusters=sel.k_clusters,
        top_p=sel.top_p,
        min_fraction=sel.min_fraction,
        block_size=w.block_size,
    )
    proc = WanSparseAttnProcessor(w.grid, selection, backend="kpage")
    twin = WanSparseAttnProcessor(w.grid, selection, backend="kpage")
    med = lambda xs: statistics.median(xs)
    records = []

    def record(mode, times, note):
        records.append(
            dict(workload=args.workload, mode=mode, time_ms=med(times), reps=len(times), note=note)
        )
        print(f"{mode:14s} {med(times):9.3f} ms  ({note})", flush=True)

    with torch.no_grad():
        proc.attend(q, k, v)  # the seeded first fit
        proc.attend(q, k, v)
        wall, issue = [], []
        for _ in range(args.reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            proc.attend(q, k, v)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            issue.append((t1 - t0) * 1e3)
            wall.append((time.perf_counter() - t0) * 1e3)
        record("eager_wall", wall, "host waits for every call: the launches on the critical path")
        record("eager_issue", issue, "host time to issue one call")
        queued = []
        for _ in range(args.reps):
            torch.cuda.synchronize()
            torch.cuda._sleep(400_000_000)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            proc.attend(q, k, v)
            b.record()
            torch.cuda.synchronize()
            queued.append(a.elapsed_time(b))
        record("eager_queued", queued, "host queued ahead: the GPU's time alone (CUDA events)")

        static = [x.clone() for x in (q, k, v)]
        graph, out = capture_cuda_graph(lambda: proc.attend(*static), warmup=1)
        replay, replay_gpu = [], []
        for _ in range(args.reps):
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            a.record()
            graph.replay()
            b.record()
            torch.cuda.synchronize()
            replay.append((time.perf_counter() - t0) * 1e3)
            replay_gpu.append(a.elapsed_time(b))
        record("graph_replay", replay, "one replay, host waiting for it")
        record("graph_gpu", replay_gpu, "one replay's CUDA events")

        # the last replay against an eager call from the same warm start: the twin takes the processor's
        # centroids as they were before that replay
        for dst, src in zip(static, (k, q, v)):  # new inputs for the check (q and k swapped)
            dst.copy_(src)
        key = next(iter(proc._centroids))
        twin._layer = proc._layer
        twin._centroids[key] = tuple(c.clone() for c in proc._centroids[key])
        want = twin.attend(k, q, v)
        graph.replay()
        torch.cuda.synchronize()
        rel = ((out.float() - want.float()).norm() / want.float().norm()).item()
        print(f"replay against eager on the same warm start: relative difference {rel:.2e}", flush=True)
    write_run(
        Path(args.out),
        "python data/bench/experiments/svg2_graph_replay.py",
        None,
        records,
        heads=w.heads,
        tokens=w.grid[0] * w.grid[1] * w.grid[2],
        replay_rel_diff=rel,
    )
    return 0 if rel < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
