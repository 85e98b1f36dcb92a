"""The wgmma Lloyd step's ways of forming the cluster sums (``kmeans_assign.SUM_METHODS``) side by side
(lab script, GPU).

At ``svg2_wan14b_720p``'s shapes (40 heads × 75,600 tokens, Q 300 / K 1,000 clusters) on the workload's
synthetic features, from centroids after 3 warm Lloyd steps (``kmeans_builds_ab.warm_sides``), the host's
default build: the Lloyd step with ``"atomics"`` (one atomic per token), ``"presum"`` (each cluster's tokens
of a CTA summed by ballots and a member loop) and ``"mma"`` (those partial sums as a one-hot product on the
tensor cores), and the assignment with labels only beside them (what the sums cost). Each method's labels
must equal the assignment's, its sizes the counts of its labels, and its sums the float64 sums of its
labels' tokens (float32 atomics in any order: ``sums_max_excess_err``, the largest |error| −
1e-4·|reference| over the sums, at most 1e-3, and 0 where every sum is within 1e-4 relative). CUDA events,
median of ``--reps`` calls, the methods in an order rotated over ``--rounds``.

    PYTHONPATH=src python data/bench/experiments/kmeans_sums_ab.py --out kmeans_sums_ab.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="svg2_wan14b_720p")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    import torch
    from kmeans_builds_ab import warm_sides

    from sparseattn.bench import write_run
    from sparseattn.kernels import kmeans_assign as ka
    from sparseattn.variant_ab import rotation
    from sparseattn.workloads import get_workload

    w = get_workload(args.workload)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    methods = list(ka.SUM_METHODS)
    records, ok = [], True
    for side, x, kk, c in warm_sides(w):
        labels = ka.nearest_centroid_wgmma(x, c)
        checks = {}
        for method in methods:
            got, sums, sizes = ka.lloyd_step_wgmma(x, c, sums=method)
            index = got.unsqueeze(-1).expand(-1, -1, x.shape[-1])
            want = torch.zeros_like(sums, dtype=torch.float64).scatter_add_(1, index, x.double())
            counts = torch.zeros_like(sizes).scatter_add_(1, got, torch.ones_like(got, dtype=torch.float32))
            err = ((sums.double() - want).abs() - 1e-4 * want.abs()).max().item()
            checks[method] = dict(
                labels_equal=bool(torch.equal(got, labels)),
                sizes_equal=bool(torch.equal(sizes, counts)),
                sums_max_excess_err=err,
                sums_ok=err <= 1e-3,
            )
            ok &= (
                checks[method]["labels_equal"] and checks[method]["sizes_equal"] and checks[method]["sums_ok"]
            )
            del got, sums, sizes, index, want, counts
        calls = {m: (lambda m=m, x=x, c=c: ka.lloyd_step_wgmma(x, c, sums=m)) for m in methods}
        calls["labels_only"] = lambda x=x, c=c: ka.nearest_centroid_wgmma(x, c)
        times = {name: [] for name in calls}
        for r in range(args.rounds):
            for name in rotation(list(calls), r):
                calls[name]()
                for _ in range(args.reps):
                    start.record()
                    calls[name]()
                    stop.record()
                    stop.synchronize()
                    times[name].append(start.elapsed_time(stop))
        for name, ts in times.items():
            records.append(
                dict(side=side, clusters=kk, method=name, time_ms=statistics.median(ts), samples=len(ts))
                | checks.get(name, {})
            )
        print(
            f"{side} ({kk} clusters): "
            + ", ".join(f"{name} {statistics.median(ts):.3f} ms" for name, ts in times.items())
            + f"; checks {checks}",
            flush=True,
        )
    write_run(
        Path(args.out),
        "python data/bench/experiments/kmeans_sums_ab.py",
        None,
        records,
        workload=args.workload,
        build=ka.BUILD,
        all_checks_pass=ok,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
