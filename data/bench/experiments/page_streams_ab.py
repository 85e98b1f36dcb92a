"""The SVG2 call's plans with the page streams in each launch form (``page_streams.FORMS``) (lab script, GPU).

At ``svg2_wan14b_720p`` (40 heads × 75,600 tokens; 300 Q / 1,000 K clusters of 128-slot blocks), on the
layouts and block selection of one warm SVG2 call on the workload's synthetic features: the forward's work
list (``dynamic_layouts.forward_work_list``) and the backward's plan (``dynamic_layouts.backward_plan``) with
the streams written one program per item (``item``) or one program per item and 256-block chunk
(``chunks``). CUDA events, median of ``--reps`` calls per round, forms alternated over ``--rounds``; each
form's streams must equal the other's entry for entry.

    PYTHONPATH=src python data/bench/experiments/page_streams_ab.py --out page_streams_ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="svg2_wan14b_720p")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    import torch

    from sparseattn import svg2_device as sd
    from sparseattn.planning import dynamic_layouts as dl
    from sparseattn.planning import page_streams
    from sparseattn.svg2_step_bench import features
    from sparseattn.variant_ab import rotation
    from sparseattn.workloads import get_workload

    w = get_workload(args.workload)
    sel = w.selection
    q, k, _ = features(w, w.heads, torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(0)
    init = tuple(
        sd.lloyd(x, c, 20, None, g, final_assign=False)[1]
        for x, c in ((q, sel.q_clusters), (k, sel.k_clusters))
    )
    step = sd.svg2_partition_step(
        q,
        k,
        sel.q_clusters,
        sel.k_clusters,
        w.block_size,
        sel.top_p,
        sel.min_fraction,
        2,
        *init,
        final_assign=False,
    )
    args_ = (step.q_layout.block_rows, step.k_layout.block_rows, step.block_mask, w.block_size)
    plans = {
        "plan_fwd": lambda: dl.forward_work_list(*args_, rows_per_chunk=4),
        "plan_bwd": lambda: dl.backward_plan(*args_, rows_per_chunk=4),
    }
    outputs = {}
    for form in page_streams.FORMS:
        page_streams.FORM = form
        fwd, bwd = plans["plan_fwd"](), plans["plan_bwd"]()
        used_f, used_b = min(int(fwd.status[0]), fwd.capacity), min(int(bwd.status[0]), bwd.capacity)
        outputs[form] = (
            fwd.stream_entries[:used_f],
            fwd.work_info,
            bwd.stream_pages[:used_b],
            bwd.stream_indptr,
        )
    first = outputs[page_streams.FORMS[0]]
    equal = all(all(torch.equal(a, b) for a, b in zip(first, outputs[f])) for f in page_streams.FORMS)
    times = {(form, part): [] for form in page_streams.FORMS for part in plans}
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for r in range(args.rounds):
        for form in rotation(list(page_streams.FORMS), r):
            page_streams.FORM = form
            for part, fn in plans.items():
                fn()
                for _ in range(args.reps):
                    start.record()
                    fn()
                    stop.record()
                    stop.synchronize()
                    times[form, part].append(start.elapsed_time(stop))
    page_streams.FORM = "item"
    record = dict(
        gpu=torch.cuda.get_device_name(),
        workload=args.workload,
        heads=w.heads,
        stream_entries=int(first[0].shape[0]),
        streams_equal=equal,
        **{f"{part}_ms_{form}": statistics.median(ts) for (form, part), ts in times.items()},
    )
    print(
        f"{args.workload}: {record['stream_entries']:,} forward entries, streams equal {equal}: "
        + ", ".join(f"{part} {form} {statistics.median(ts):.3f} ms" for (form, part), ts in times.items())
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
