"""How many tokens could skip the second Lloyd step's assignment by an exact bound? (CPU count, numpy)

SVG2 runs two Lloyd steps per call from the previous call's centroids. In the second step a token's label
cannot change when the triangle inequality proves it (Hamerly's bound): with d1 / d2 its distances to the
nearest and second-nearest centroid in step 1 and δ_j how far centroid j moved in the update,

    d1 + δ_a  ≤  d2 − max_{j ≠ a} δ_j   ⇒   step 2's argmin is still a.

A kernel could then assign only the tokens that fail the test (compacted), where today every token meets
every centroid again. This counts the fraction that passes, on a built-in workload's synthetic features
(``sparseattn.synthetic``), per side (Q: ``q_clusters``, K: ``k_clusters``) and head.

What the previous call saw is modelled, not recorded: its features are the same generator's at another
seed mixed in, ``x_prev = sqrt(1 − ε²)·x + ε·x_other`` (cosine ≈ sqrt(1 − ε²) between the two calls'
features), and its centroids are ``init_iters`` Lloyd steps on ``x_prev`` from the host builder's k-means++
seeds. Distances in float64 from float32 features, exact (a kernel's bf16 dot products would need a margin
on the test).

    PYTHONPATH=src python data/bench/experiments/kmeans_bound_counts.py --heads 2 --out counts.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def sq_dists(x: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float64 ``[n, k]`` squared distances (clamped at 0)."""
    d = (x * x).sum(1)[:, None] - 2.0 * (x @ c.T) + (c * c).sum(1)[None, :]
    return np.maximum(d, 0.0)


def lloyd_update(x: np.ndarray, labels: np.ndarray, c: np.ndarray) -> np.ndarray:
    k = c.shape[0]
    sums = np.zeros_like(c)
    np.add.at(sums, labels, x)
    counts = np.bincount(labels, minlength=k)[:, None]
    return np.where(counts > 0, sums / np.maximum(counts, 1), c)  # an empty cluster keeps its centroid


def fit(x: np.ndarray, k: int, iters: int, rng) -> np.ndarray:
    """The host builder's k-means++ seeds, then ``iters`` Lloyd steps (labels by its nearest_centroid)."""
    from sparseattn.builders import _kmeans_pp_init, nearest_centroid

    c = _kmeans_pp_init(x, k, rng)
    for _ in range(iters):
        c = lloyd_update(x, nearest_centroid(x, c), c)
    return c


def bound_counts(x: np.ndarray, c0: np.ndarray) -> dict:
    """One call's two Lloyd steps from ``c0``: the fraction of tokens the bound lets skip step 2's
    assignment, and the fraction whose label step 2 actually changes."""
    d = sq_dists(x, c0)
    two = np.partition(d, 1, axis=1)[:, :2]
    labels = d.argmin(1)
    d1, d2 = np.sqrt(two[:, 0]), np.sqrt(two[:, 1])
    c1 = lloyd_update(x, labels, c0)
    drift = np.sqrt(((c1 - c0) ** 2).sum(1))
    order = np.argsort(drift)
    top, second = order[-1], order[-2]
    other_max = np.where(labels == top, drift[second], drift[top])  # max over j != a
    skip = d1 + drift[labels] <= d2 - other_max
    changed = sq_dists(x, c1).argmin(1) != labels
    return dict(
        skip=float(skip.mean()),
        changed=float(changed.mean()),
        skipped_but_changed=int((skip & changed).sum()),
        drift_median=float(np.median(drift)),
        drift_max=float(drift.max()),
        gap_median=float(np.median(d2 - d1)),
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="svg2_wan14b_720p")
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--eps", default="0.05,0.1,0.2,0.4")
    ap.add_argument("--init-iters", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    from sparseattn.synthetic import synthetic_head_factors
    from sparseattn.workloads import get_workload

    w = get_workload(args.workload)
    d = w.head_dim
    sel = w.selection
    sides = (("q", sel.q_clusters), ("k", sel.k_clusters))
    pad = lambda z: np.pad(z, ((0, 0), (0, d - z.shape[1]))).astype(np.float64)
    record = dict(workload=args.workload, init_iters=args.init_iters, rows=[])
    print(
        f"{'head':>4s} {'side':>4s} {'k':>5s} {'eps':>5s} {'skip':>7s} {'changed':>8s} {'drift med/max':>15s} {'gap med':>8s}"
    )
    for h in range(args.heads):
        now = synthetic_head_factors(h, grid=w.grid, dim=d, seed=0)
        other = synthetic_head_factors(h, grid=w.grid, dim=d, seed=1)
        for i, (side, k) in enumerate(sides):
            x, y = pad(now[i]), pad(other[i])
            for eps in (float(e) for e in args.eps.split(",")):
                t0 = time.perf_counter()
                prev = np.sqrt(1 - eps * eps) * x + eps * y
                c0 = fit(prev, k, args.init_iters, np.random.default_rng(h))
                row = dict(head=h, side=side, clusters=k, eps=eps, **bound_counts(x, c0))
                row["seconds"] = time.perf_counter() - t0
                record["rows"].append(row)
                print(
                    f"{h:4d} {side:>4s} {k:5d} {eps:5.2f} {row['skip']:7.3f} {row['changed']:8.4f} "
                    f"{row['drift_median']:7.3f}/{row['drift_max']:7.3f} {row['gap_median']:8.3f}",
                    flush=True,
                )
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(record, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
