"""Where an SVG2 call's forward and backward plans spend their GPU time (lab script, GPU): one 720p call's
step (``svg2_step_in_slots``, the Wan processor's order), then each plan (``blocks``: from the block mask,
made inside the call as the processor does; ``clusters``: by groups) timed with the host queued ahead
(CUDA events after a GPU sleep, median of ``--reps``), its wall time with the host not ahead, and a
profile of every kernel one plan launches (torch.profiler, all rows).

    PYTHONPATH=src python data/bench/experiments/svg2_plan_profile.py --out svg2_plan_profile.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> int:
    import torch

    from sparseattn import workloads as wl
    from sparseattn.svg2_device import lloyd, svg2_step_in_slots
    from sparseattn.svg2_step_bench import features

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="svg2_wan14b_720p")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", required=True)
    p.add_argument("--profile", default=None, help="the profiles' tables (default: OUT with .txt)")
    args = p.parse_args()
    w = wl.get_workload(args.workload)
    sel, dev = w.selection, torch.device("cuda")
    q, k, v = features(w, w.heads, dev)
    g = torch.Generator(device=dev).manual_seed(0)
    init = [
        lloyd(x, c, 50, None, g, final_assign=False)[1] for x, c in ((q, sel.q_clusters), (k, sel.k_clusters))
    ]
    call = (sel.q_clusters, sel.k_clusters, w.block_size, sel.top_p, sel.min_fraction, 2, *init)

    def fresh_step():  # the block mask is made on first use: a fresh step per blocks-plan call
        return svg2_step_in_slots(q, k, v, *call, assign="wgmma")[0]

    parts = {
        "fwd_blocks": lambda s: s.forward_work_list("blocks"),
        "fwd_clusters": lambda s: s.forward_work_list("clusters"),
        "bwd_blocks": lambda s: s.backward_plan("blocks"),
        "bwd_clusters": lambda s: s.backward_plan("clusters"),
    }
    records, tables = [], []
    for name, plan in parts.items():
        queued, wall = [], []
        for rep in range(args.reps + 1):
            step = fresh_step()
            torch.cuda.synchronize()
            torch.cuda._sleep(100_000_000)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            plan(step)
            b.record()
            torch.cuda.synchronize()
            step = fresh_step()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            plan(step)
            torch.cuda.synchronize()
            if rep:
                queued.append(a.elapsed_time(b))
                wall.append((time.perf_counter() - t0) * 1e3)
        step = fresh_step()
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
    meta = dict(
        gpu=torch.cuda.get_device_name(), workload=args.workload, heads=w.heads, torch=torch.__version__
    )
    with open(args.out, "w") as f:
        json.dump(dict(meta, records=records), f, indent=1)
    with open(args.profile or args.out.rsplit(".", 1)[0] + ".txt", "w") as f:
        f.write("\n\n".join(tables))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
