"""Where an SVG2 call's parts spend their GPU time (lab script, GPU): one 720p call's step
(``svg2_step_in_slots``, the Wan processor's order), then each part alone timed with the host queued ahead
(CUDA events after a GPU sleep, median of ``--reps``), its wall time with the host not ahead, and a
profile of every kernel it launches (torch.profiler, all rows). The parts (``--parts``, default all):
each plan (``fwd_blocks`` / ``bwd_blocks`` from the block mask, made inside the part as the processor would;
``fwd_clusters`` / ``bwd_clusters`` by groups), each side's k-means (``kmeans_q``, ``kmeans_k``: the
warm-started Lloyd steps, the last one labels only), the partition ``layouts`` of both sides, the move of
q, k, v to slots with the clusters' sums (``to_slots``) and the means and top-p selection from those sums
(``select``).

    PYTHONPATH=src python data/bench/experiments/svg2_plan_profile.py --out svg2_plan_profile.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def warm_call_inputs(w):
    """``(q, k, v, init)`` of a call at workload ``w``'s shape: its synthetic features (bf16 ``[heads,
    tokens, d]``, V random) and each side's centroids after 50 Lloyd steps, the previous call's warm start."""
    import torch

    from sparseattn.svg2_device import lloyd
    from sparseattn.svg2_step_bench import features

    sel, dev = w.selection, torch.device("cuda")
    q, k, v = features(w, w.heads, dev)
    g = torch.Generator(device=dev).manual_seed(0)
    init = [
        lloyd(x, c, 50, None, g, final_assign=False)[1] for x, c in ((q, sel.q_clusters), (k, sel.k_clusters))
    ]
    return q, k, v, init


def queued_and_wall(call, prepare=lambda: None) -> tuple[float, float]:
    """``(queued, wall)`` ms of ``call(prepare())``: once with the host queued ahead (CUDA events around it
    after a GPU sleep: the GPU's time alone), once with the host waiting for it (wall time)."""
    import torch

    arg = prepare()
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    call(arg)
    b.record()
    torch.cuda.synchronize()
    arg = prepare()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    call(arg)
    torch.cuda.synchronize()
    return a.elapsed_time(b), (time.perf_counter() - t0) * 1e3


def main() -> int:
    import torch

    from sparseattn import svg2_device as sd
    from sparseattn import workloads as wl
    from sparseattn.bench import write_run
    from sparseattn.svg2_device import lloyd, svg2_step_in_slots

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="svg2_wan14b_720p")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", required=True)
    p.add_argument("--profile", default=None, help="the profiles' tables (default: OUT with .txt)")
    p.add_argument("--parts", default=None, help="comma-separated parts (default: all)")
    args = p.parse_args()
    w = wl.get_workload(args.workload)
    sel = w.selection
    q, k, v, init = warm_call_inputs(w)
    call = (sel.q_clusters, sel.k_clusters, w.block_size, sel.top_p, sel.min_fraction, 2, *init)

    def fresh_step():  # the block mask is made on first use: a fresh step per blocks-plan call
        return svg2_step_in_slots(q, k, v, *call, assign="wgmma")[0]

    qc, kc, block = sel.q_clusters, sel.k_clusters, w.block_size
    fitted = sd.fit_for_slots(q, k, qc, kc, block, 2, *init, None, "wgmma")

    def moved():  # the move's cluster sums, as the call takes them
        return sd.move_to_slots(fitted, q, k, v)[3:]

    sums = moved()
    last_only = dict(assign="wgmma", final_assign=False, last_sums=False)
    parts = {
        "fwd_blocks": (fresh_step, lambda s: s.forward_work_list("blocks")),
        "fwd_clusters": (fresh_step, lambda s: s.forward_work_list("clusters")),
        "bwd_blocks": (fresh_step, lambda s: s.backward_plan("blocks")),
        "bwd_clusters": (fresh_step, lambda s: s.backward_plan("clusters")),
        "kmeans_q": (lambda: None, lambda _: lloyd(q, qc, 2, init[0], **last_only)),
        "kmeans_k": (lambda: None, lambda _: lloyd(k, kc, 2, init[1], **last_only)),
        "layouts": (
            lambda: None,
            lambda _: (
                sd.partition_slots(fitted.q_fit[0], qc, block),
                sd.partition_slots(fitted.k_fit[0], kc, block),
            ),
        ),
        "to_slots": (lambda: None, lambda _: moved()),
        "select": (
            lambda: None,
            lambda _: sd.step_from_slot_sums(fitted, *sums, sel.top_p, sel.min_fraction),
        ),
    }
    if args.parts:
        unknown = set(args.parts.split(",")) - set(parts)
        if unknown:
            raise SystemExit(f"--parts: unknown {sorted(unknown)}; known {list(parts)}")
        parts = {n: parts[n] for n in args.parts.split(",")}
    records, tables = [], []
    for name, (prepare, plan) in parts.items():
        queued, wall = [], []
        for rep in range(args.reps + 1):
            t_queued, t_wall = queued_and_wall(plan, prepare)
            if rep:  # the first is a warm-up
                queued.append(t_queued)
                wall.append(t_wall)
        step = prepare()
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            plan(step)
            torch.cuda.synchronize()
        kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        gpu_sum = sum(e.self_device_time_total for e in kernels) / 1e3
        launches = sum(e.count for e in kernels)
        table = prof.key_averages().table(
            sort_by="self_cuda_time_total", row_limit=-1, max_name_column_width=70
        )
        tables.append(
            f"== {name}: queued {statistics.median(queued):.3f} ms, wall {statistics.median(wall):.3f} ms, "
            f"kernels {gpu_sum:.3f} ms in {launches} launches\n{table}"
        )
        records.append(
            dict(
                part=name,
                queued_ms=statistics.median(queued),
                wall_ms=statistics.median(wall),
                kernels_ms=gpu_sum,
                launches=launches,
                reps=args.reps,
            )
        )
        print(
            f"{name:14s} queued {records[-1]['queued_ms']:.3f} ms  wall {records[-1]['wall_ms']:.3f} ms  "
            f"kernels {gpu_sum:.3f} ms in {launches} launches",
            flush=True,
        )
    write_run(
        Path(args.out),
        "python data/bench/experiments/svg2_plan_profile.py",
        None,
        records,
        workload=args.workload,
        heads=w.heads,
    )
    with open(args.profile or args.out.rsplit(".", 1)[0] + ".txt", "w") as f:
        f.write("\n\n".join(tables))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
