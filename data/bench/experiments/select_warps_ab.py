"""SVG2's top-p cluster selection (``cluster_select``'s Triton kernel, float64 bisection): warps per program
(lab script, GPU).

At SVG2's 720p shape (40 heads, 300 Q × 1,000 K clusters, d = 128) the kernel runs one program per Q cluster,
12,000 programs of 1,024 float64 lanes, 64 bisection steps each a masked sum over the row. With 4 warps every
sum crosses warps through shared memory and a barrier; with fewer warps per program more programs fit on an
SM and the sums stay in shuffles. Each setting's masks must equal the torch sort's (the reference form).
Two score regimes: peaked (the top-p set is small) and flat (the minimum fraction decides, a second bisection).

    PYTHONPATH=src python data/bench/experiments/select_warps_ab.py --out select_warps.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--q-clusters", type=int, default=300)
    ap.add_argument("--k-clusters", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warps", default="1,2,4,8")
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    import torch

    from sparseattn import cluster_select
    from sparseattn.svg2_device import _select_by_sort, selection_inputs
    from sparseattn.variant_ab import rotation

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    d = 128
    record = dict(
        gpu=torch.cuda.get_device_name(),
        heads=args.heads,
        q_clusters=args.q_clusters,
        k_clusters=args.k_clusters,
        regimes={},
    )
    warps = [int(w) for w in args.warps.split(",")]
    for regime, scale in (("peaked", 3.0), ("flat", 0.3)):
        qc = torch.randn(args.heads, args.q_clusters, d, generator=g, device=dev, dtype=torch.float64) * scale
        kc = torch.randn(args.heads, args.k_clusters, d, generator=g, device=dev, dtype=torch.float64) * scale
        sizes = torch.randint(0, 200, (args.heads, args.k_clusters), generator=g, device=dev)
        dots, bias, least = selection_inputs(qc, kc, sizes, 0.1)
        want = _select_by_sort(dots, bias, d, 0.9, least)
        entry = dict(selected_fraction=float(want.float().mean()), warps={})
        times = {w: [] for w in warps}
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for w in warps:
            cluster_select.NUM_WARPS = w
            got = cluster_select.select_mask(dots, bias, d, 0.9, least, method="bisect")
            entry["warps"][w] = dict(equal_to_sort=bool(torch.equal(got, want)))
        for r in range(args.rounds):
            for w in rotation(warps, r):
                cluster_select.NUM_WARPS = w
                for _ in range(3):
                    cluster_select.select_mask(dots, bias, d, 0.9, least, method="bisect")
                per = []
                for _ in range(args.reps):
                    start.record()
                    cluster_select.select_mask(dots, bias, d, 0.9, least, method="bisect")
                    stop.record()
                    stop.synchronize()
                    per.append(start.elapsed_time(stop))
                times[w].append(statistics.median(per))
        start.record()
        for _ in range(args.reps):
            selection_inputs(qc, kc, sizes, 0.1)
        stop.record()
        stop.synchronize()
        entry["inputs_ms"] = start.elapsed_time(stop) / args.reps
        for w in warps:
            entry["warps"][w]["time_ms"] = statistics.median(times[w])
            entry["warps"][w]["rounds_ms"] = times[w]
        record["regimes"][regime] = entry
    cluster_select.NUM_WARPS = None
    print(f"{'regime':8s} {'warps':>5s} {'ms':>8s}  equal  (selection_inputs ms)")
    for regime, entry in record["regimes"].items():
        for w, e in entry["warps"].items():
            print(
                f"{regime:8s} {w:5d} {e['time_ms']:8.3f}  {e['equal_to_sort']!s:5s}  ({entry['inputs_ms']:.3f})"
            )
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(record, fh, indent=1)
    return (
        0 if all(e["equal_to_sort"] for x in record["regimes"].values() for e in x["warps"].values()) else 1
    )


if __name__ == "__main__":
    sys.exit(main())
