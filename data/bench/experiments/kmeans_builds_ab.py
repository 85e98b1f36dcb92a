"""The wgmma k-means assignment's builds (``kmeans_assign.BUILDS``) side by side (lab script, GPU).

At ``svg2_wan14b_720p``'s shapes (40 heads × 75,600 tokens, Q 300 / K 1,000 clusters) on the workload's
synthetic features, from centroids after 3 warm Lloyd steps: the assignment with labels only and the Lloyd
step with the cluster sums (each cluster's tokens presummed up to ``PRESUM_MAX_CLUSTERS``), per build
(``argmin``: compare and select value and index per score; ``packed_argmax``: a chain of max instructions
over scores carrying their column in the low mantissa bits; each with its ``_tail64`` form, whose last chunk of
at most 64 centroids runs at wgmma N = 64: Q's 300 clusters take it, K's 1,000 not); CUDA events, median of ``--reps`` calls,
builds alternated over ``--rounds``. The labels must agree but where the two picks' scores are within the
packing's resolution (2⁻¹⁶ relative, checked in float64 here), and the labels' inertia is reported per
build. Earlier builds (256 tokens per CTA, a chunk ring; TMA multicast) ran with this script at 7c3490d
and dec9eb1.

    PYTHONPATH=src python data/bench/experiments/kmeans_builds_ab.py --out kmeans_builds_ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics


def warm_sides(w):
    """``[(side, x, clusters, centroids)]`` for q and k of workload ``w``'s synthetic features on the GPU,
    the centroids after 3 Lloyd steps from random tokens (seed 0)."""
    import torch

    from sparseattn import svg2_device as sd
    from sparseattn.svg2_step_bench import features

    q, k, _ = features(w, w.heads, torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(0)
    sides = []
    for side, x, kk in (("q", q, w.selection.q_clusters), ("k", k, w.selection.k_clusters)):
        idx = torch.randperm(x.shape[1], generator=g, device="cuda")[:kk]
        c = sd.lloyd(x, kk, 3, init=x[:, idx].float(), assign="wgmma", final_assign=False)[1]
        sides.append((side, x, kk, c))
    return sides


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="svg2_wan14b_720p")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    import torch

    from sparseattn.kernels import kmeans_assign as ka
    from sparseattn.variant_ab import rotation
    from sparseattn.workloads import get_workload

    w = get_workload(args.workload)
    record = dict(gpu=torch.cuda.get_device_name(), workload=args.workload, heads=w.heads, sides={})
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ok = True
    for side, x, kk, c in warm_sides(w):
        calls = {
            "assign": lambda x=x, c=c: ka.nearest_centroid_wgmma(x, c),
            "lloyd_step": lambda x=x, c=c: ka.lloyd_step_wgmma(x, c),
        }
        labels = {}
        builds = list(ka.BUILDS)
        for build in builds:
            ka.BUILD = build
            labels[build] = calls["assign"]()
        cb = c.bfloat16().double()
        score = torch.empty(x.shape[:2] + (len(builds),), dtype=torch.float64, device=x.device)
        for h in range(x.shape[0]):  # per head: the float64 [tokens, k] scores one at a time
            s = x[h].double() @ cb[h].T - 0.5 * (cb[h] * cb[h]).sum(-1)
            for i, b in enumerate(builds):
                score[h, :, i] = s.gather(1, labels[b][h][:, None])[:, 0]
        near = ((score - score[..., :1]).abs() <= 2.0**-16 * score[..., :1].abs() + 1e-6).all(-1)
        same = torch.stack([labels[b] == labels[builds[0]] for b in builds]).all(0)
        equal = bool((same | near).all())
        ok &= equal
        inertia = {  # Σ |x − c|² of each build's labels: |x|² − 2·score, summed
            b: float(((x.double() ** 2).sum(-1) - 2 * score[..., i]).sum()) for i, b in enumerate(builds)
        }
        times = {(build, call): [] for build in builds for call in calls}
        for r in range(args.rounds):
            for build in rotation(builds, r):
                ka.BUILD = build
                for call, fn in calls.items():
                    fn()
                    for _ in range(args.reps):
                        start.record()
                        fn()
                        stop.record()
                        stop.synchronize()
                        times[build, call].append(start.elapsed_time(stop))
        entry = dict(
            clusters=kk,
            labels_agree_but_near_ties=equal,
            labels_equal_fraction=float(same.float().mean()),
            inertia=inertia,
        )
        for (build, call), ts in times.items():
            entry[f"{call}_ms_{build}"] = statistics.median(ts)
        record["sides"][side] = entry
        print(
            f"{side} ({kk} clusters), labels agree {equal} (equal {entry['labels_equal_fraction']:.6f}): "
            + ", ".join(
                f"{call} {build} {statistics.median(ts):.3f} ms" for (build, call), ts in times.items()
            )
        )
    ka.BUILD = "argmin"
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
