"""SVG2's partition layouts (``svg2_device.partition_slots``): the chunked counting sort in Triton against
one torch stable sort per row (lab script, GPU).

At SVG2's 720p shape (40 heads × 75,600 tokens; 300 Q and 1,000 K clusters; 128-slot blocks) on the
workload's synthetic features: labels from the k-means the Wan processor runs (50 Lloyd steps from
k-means++ seeds, then the 2 warm-started steps of a call). Both forms build the whole ``DeviceLayout``
(token slots, valid slots, block groups, rows and pages); each form's layout must equal the other's.
CUDA events, median of ``--reps`` calls, forms alternated over ``--rounds`` rounds.

    PYTHONPATH=src python data/bench/experiments/partition_sort_ab.py --out partition_sort_ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from unittest import mock

FIELDS = ("token_slot", "valid", "block_group", "num_slots", "group_sizes", "block_rows", "block_pages")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="svg2_wan14b_720p")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    import torch

    from sparseattn import partition_sort, svg2_device
    from sparseattn.svg2_step_bench import features
    from sparseattn.variant_ab import rotation
    from sparseattn.workloads import get_workload

    w = get_workload(args.workload)
    sel = w.selection
    dev = torch.device("cuda")
    q, k, _ = features(w, w.heads, dev)
    g = torch.Generator(device=dev).manual_seed(0)
    record = dict(gpu=torch.cuda.get_device_name(), workload=args.workload, heads=w.heads, tokens=q.shape[1])
    record["sides"] = {}
    for side, x, groups in (("q", q, sel.q_clusters), ("k", k, sel.k_clusters)):
        _, cent, _, _ = svg2_device.lloyd(x, groups, 50, None, g, final_assign=False)
        labels, *_ = svg2_device.lloyd(x, groups, 2, cent, g, final_assign=False)

        def counting(labels=labels, groups=groups):
            return svg2_device.partition_slots(labels, groups, w.block_size)

        def by_sort(labels=labels, groups=groups):
            with mock.patch.object(partition_sort, "available", lambda *a, **kw: False):
                return svg2_device.partition_slots(labels, groups, w.block_size)

        forms = {"counting_sort": counting, "torch_sort": by_sort}
        a, b = counting(), by_sort()
        equal = all(torch.equal(getattr(a, f), getattr(b, f)) for f in FIELDS)
        times = {name: [] for name in forms}
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for r in range(args.rounds):
            for name in rotation(list(forms), r):
                for _ in range(3):
                    forms[name]()
                for _ in range(args.reps):
                    start.record()
                    forms[name]()
                    stop.record()
                    stop.synchronize()
                    times[name].append(start.elapsed_time(stop))
        entry = dict(groups=groups, layouts_equal=equal)
        entry.update({f"{name}_ms": statistics.median(ts) for name, ts in times.items()})
        record["sides"][side] = entry
        print(
            f"{side}: {groups} groups, layouts equal {equal}: counting sort {entry['counting_sort_ms']:.3f} ms, "
            f"torch sort {entry['torch_sort_ms']:.3f} ms (median of {len(times['torch_sort'])})"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0 if all(e["layouts_equal"] for e in record["sides"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
