"""SVG2's top-p cluster selection (``cluster_select``'s Triton kernel, float64 bisection): warps per program
(lab script, GPU).

At SVG2's 720p shape (40 heads, 300 Q × 1,000 K clusters, d = 128) the kernel runs one program per Q cluster,
12,000 programs of 1,024 float64 lanes, 64 bisection steps each a masked sum over the row. With 4 warps every
sum crosses warps through shared memory and a barrier; with fewer warps per program more programs fit on an
SM and the sums stay in shuffles. Each setting's masks must equal the torch sort's (the reference form).
Two score regimes (:func:`regime_inputs`).

    PYTHONPATH=src python data/bench/experiments/select_warps_ab.py --out select_warps.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

#: The score regimes (the centroids' scale): on peaked scores top-p keeps few clusters and the minimum
#: fraction (10%) decides, so both bisections run; on flat ones top-p decides (about 68% kept).
SCORE_REGIMES = (("peaked", 3.0), ("flat", 0.3))


def regime_inputs(heads: int, q_clusters: int, k_clusters: int, scale: float, generator, d: int = 128):
    """``(qc, kc, sizes, dots, bias, least, want)`` of one regime on the GPU: random float64 centroids times
    ``scale``, K cluster sizes in [0, 200), the selection's inputs (minimum fraction 0.1) and the torch
    sort's mask at top-p 0.9 (the reference)."""
    import torch

    from sparseattn.svg2_device import _select_by_sort, selection_inputs

    dev = generator.device
    qc = torch.randn(heads, q_clusters, d, generator=generator, device=dev, dtype=torch.float64) * scale
    kc = torch.randn(heads, k_clusters, d, generator=generator, device=dev, dtype=torch.float64) * scale
    sizes = torch.randint(0, 200, (heads, k_clusters), generator=generator, device=dev)
    dots, bias, least = selection_inputs(qc, kc, sizes, 0.1)
    return qc, kc, sizes, dots, bias, least, _select_by_sort(dots, bias, d, 0.9, least)


def regimes_record(args) -> dict:
    """The JSON record's head: the GPU and the shape (``--heads``, ``--q-clusters``, ``--k-clusters``)."""
    import torch

    return dict(
        gpu=torch.cuda.get_device_name(),
        heads=args.heads,
        q_clusters=args.q_clusters,
        k_clusters=args.k_clusters,
        regimes={},
    )


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
    from sparseattn.svg2_device import selection_inputs
    from sparseattn.variant_ab import rotation

    g = torch.Generator(device="cuda").manual_seed(0)
    d = 128
    record = regimes_record(args)
    warps = [int(w) for w in args.warps.split(",")]
    for regime, scale in SCORE_REGIMES:
        qc, kc, sizes, dots, bias, least, want = regime_inputs(
            args.heads, args.q_clusters, args.k_clusters, scale, g, d
        )
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
