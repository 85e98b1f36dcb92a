"""SVG2's plans by clusters with each page-stream writer, alternated in one process (lab script, GPU; v39).

``page_streams.WRITER`` ``"triton"`` (the default: one Triton program per work item) against ``"cuda"``
(``SPARSEATTN_STREAM_WRITER=cuda``: ``kernels_cu/page_streams.cu``, one warp per item). At a built-in
``svg2_*`` workload's 720p shape (the Wan processor's call: k-means labels of the synthetic features after a
warm start, ``svg2_step_in_slots``' step), ``forward_work_list(plan="clusters")`` and
``backward_plan(plan="clusters")`` with each writer: outputs compared field by field (every tensor
``torch.equal``; the stream buffers over their written entries ``min(total, capacity)``, the rest of the
buffer is allocated uninitialised), then rounds with the writers in rotated order, each plan timed with the
host queued ahead (CUDA events after a GPU sleep) and with the host waiting (wall), medians. Exit status 1
when the outputs differ.

    PYTHONPATH=src python data/bench/experiments/stream_writer_ab.py --out stream_writer_ab.json
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

WRITERS = ("triton", "cuda")
#: The stream buffers, written up to ``min(status[0], capacity)`` entries (allocated uninitialised).
STREAMS = ("stream_entries", "stream_pages")


def plans_equal(a, b) -> bool:
    """Whether two plans (``DynamicWorkList`` or ``DynamicOwnedPlan``) are equal field by field."""
    import torch

    used = min(int(b.status[0]), b.capacity)
    for field in dataclasses.fields(b):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if field.name in STREAMS:
            x, y = x[:used], y[:used]
        if not (torch.equal(x, y) if isinstance(y, torch.Tensor) else x == y):
            print(f"  {type(b).__name__}.{field.name} differs", flush=True)
            return False
    return True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="svg2_wan14b_720p")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import torch
    from svg2_plan_profile import queued_and_wall, warm_call_inputs

    from sparseattn import workloads as wl
    from sparseattn.bench import write_run
    from sparseattn.kernels import page_streams as cuda_streams
    from sparseattn.planning import page_streams
    from sparseattn.svg2_device import svg2_step_in_slots

    w = wl.get_workload(args.workload)
    sel = w.selection
    q, k, v, init = warm_call_inputs(w)
    qc, kc, block = sel.q_clusters, sel.k_clusters, w.block_size
    step = svg2_step_in_slots(q, k, v, qc, kc, block, sel.top_p, sel.min_fraction, 2, *init, assign="wgmma")[
        0
    ]
    if not cuda_streams.available(q):
        print(f"the CUDA writer cannot run on {q.device} (an sm_90 GPU with CuPy)", file=sys.stderr)
        return 2
    parts = {
        "fwd_plan_clusters": lambda _: step.forward_work_list(plan="clusters"),
        "bwd_plan_clusters": lambda _: step.backward_plan(plan="clusters"),
    }
    default = page_streams.WRITER

    def use(writer: str):
        return lambda: setattr(page_streams, "WRITER", writer)

    # the same outputs, field by field (and each writer's kernel compiled before the timings)
    outputs_equal, entries = True, {}
    for part, plan in parts.items():
        got = {}
        for writer in WRITERS:
            use(writer)()
            got[writer] = plan(None)
        torch.cuda.synchronize()
        equal = plans_equal(got["triton"], got["cuda"])
        entries[part] = int(got["triton"].status[0])
        print(f"{part}: {entries[part]:,} stream entries, outputs equal: {equal}", flush=True)
        outputs_equal &= equal

    times = {(part, writer, how): [] for part in parts for writer in WRITERS for how in ("queued", "wall")}
    for rnd in range(args.rounds):
        order = WRITERS[rnd % len(WRITERS) :] + WRITERS[: rnd % len(WRITERS)]
        for part, plan in parts.items():
            for writer in order:
                for _ in range(args.reps):
                    t_queued, t_wall = queued_and_wall(plan, use(writer))
                    times[(part, writer, "queued")].append(t_queued)
                    times[(part, writer, "wall")].append(t_wall)
    page_streams.WRITER = default
    records = []
    for (part, writer, how), xs in times.items():
        records.append(
            dict(part=part, writer=writer, timing=how, time_ms=statistics.median(xs), samples=len(xs))
        )
    write_run(
        Path(args.out),
        "python data/bench/experiments/stream_writer_ab.py",
        None,
        records,
        workload=args.workload,
        stream_entries=entries,
        outputs_equal=outputs_equal,
    )
    print(f"outputs equal: {outputs_equal}", flush=True)
    print(f"{'part':18s} {'timing':6s} {'triton':>9s} {'cuda':>9s}  cuda/triton", flush=True)
    for part in parts:
        for how in ("queued", "wall"):
            a, b = (statistics.median(times[(part, writer, how)]) for writer in WRITERS)
            print(f"{part:18s} {how:6s} {a:6.3f} ms {b:6.3f} ms  {b / a:.3f}", flush=True)
    return 0 if outputs_equal else 1


if __name__ == "__main__":
    sys.exit(main())
