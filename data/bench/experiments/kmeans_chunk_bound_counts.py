"""Could a CTA skip whole centroid chunks of the assignment by a bounding sphere? (CPU count, numpy)

The wgmma assignment multiplies every CTA's 128 tokens by every 128-centroid chunk. A chunk with centre
m (its centroids' mean) and radius r (the farthest of its centroids from m) cannot hold a token's nearest
centroid when ``|x − m| − r ≥ |x − c*|`` (triangle inequality; c* the token's nearest centroid), and a CTA
could skip the chunk when that holds for all its tokens. This counts it optimistically: each token's best
distance is its exact nearest centroid's (as if the best chunk always came first), and the centroids are
grouped either in id order (the kernel's chunks today) or compactly (a k-means of the centroids into as
many groups as chunks, sizes unbalanced). On a built-in workload's synthetic features, centroids
``--iters`` Lloyd steps from the host builder's k-means++ seeds; distances in float64.

    PYTHONPATH=src python data/bench/experiments/kmeans_chunk_bound_counts.py --heads 2 --out counts.json
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
from kmeans_bound_counts import fit, sq_dists

CTA_TOKENS = 128
CHUNK = 128


def chunk_skips(x: np.ndarray, c: np.ndarray, groups: np.ndarray) -> dict:
    """Fractions of (token, chunk) and (CTA, chunk) pairs the bound lets skip, chunks by ``groups`` [k]."""
    best = np.sqrt(sq_dists(x, c).min(1))
    ids = np.unique(groups)
    centre = np.stack([c[groups == j].mean(0) for j in ids])
    radius = np.array([np.sqrt(((c[groups == j] - centre[i]) ** 2).sum(1)).max() for i, j in enumerate(ids)])
    skip = np.sqrt(sq_dists(x, centre)) - radius[None, :] >= best[:, None]
    whole = x.shape[0] // CTA_TOKENS * CTA_TOKENS
    cta = skip[:whole].reshape(-1, CTA_TOKENS, len(ids)).all(1)
    return dict(
        chunks=len(ids),
        token_chunk_skip=float(skip.mean()),
        cta_chunk_skip=float(cta.mean()),
        radius_median=float(np.median(radius)),
        best_median=float(np.median(best)),
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="svg2_wan14b_720p")
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    from sparseattn.synthetic import synthetic_head_factors
    from sparseattn.workloads import get_workload

    w = get_workload(args.workload)
    d = w.head_dim
    sel = w.selection
    record = dict(workload=args.workload, iters=args.iters, cta_tokens=CTA_TOKENS, chunk=CHUNK, rows=[])
    print(f"{'head':>4s} {'side':>4s} {'k':>5s} {'chunks':>9s} {'token-chunk':>11s} {'CTA-chunk':>9s}")
    for h in range(args.heads):
        feats = synthetic_head_factors(h, grid=w.grid, dim=d, seed=0)
        for i, (side, k) in enumerate((("q", sel.q_clusters), ("k", sel.k_clusters))):
            x = np.pad(feats[i], ((0, 0), (0, d - feats[i].shape[1]))).astype(np.float64)
            c = fit(x, k, args.iters, np.random.default_rng(h))
            n_chunks = -(-k // CHUNK)
            compact = sq_dists(c, fit(c, n_chunks, 20, np.random.default_rng(0))).argmin(1)
            for name, groups in (("id order", np.arange(k) // CHUNK), ("compact", compact)):
                row = dict(head=h, side=side, clusters=k, grouping=name, **chunk_skips(x, c, groups))
                record["rows"].append(row)
                print(
                    f"{h:4d} {side:>4s} {k:5d} {name:>9s} {row['token_chunk_skip']:11.3f} {row['cta_chunk_skip']:9.3f}",
                    flush=True,
                )
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(record, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
