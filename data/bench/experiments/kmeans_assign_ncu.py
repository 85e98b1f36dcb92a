"""One call of each wgmma k-means kernel at ``svg2_wan14b_720p``'s shapes, for Nsight Compute (lab script, GPU).

The assignment with labels only and the Lloyd step with sums (the host's default build and sum method, or
``SPARSEATTN_KMEANS_BUILD`` / ``SPARSEATTN_KMEANS_SUMS``) on K's 1,000 and Q's 300 clusters, from centroids
after 3 warm Lloyd steps (``kmeans_builds_ab.warm_sides``), each launch inside an NVTX range named by side
and call, after one warm-up call of each:

    PYTHONPATH=src ncu --clock-control none --set full -k regex:kmeans_assign --launch-skip 10 --launch-count 4 \\
        -o kmeans_assign python data/bench/experiments/kmeans_assign_ncu.py
"""

from __future__ import annotations

import sys


def main() -> int:
    import torch
    from kmeans_builds_ab import warm_sides

    from sparseattn.kernels import kmeans_assign as ka
    from sparseattn.workloads import get_workload

    sides = warm_sides(get_workload("svg2_wan14b_720p"))
    calls = [
        (f"{side}_{name}", fn, x, c)
        for side, x, _, c in sides
        for name, fn in (("assign", ka.nearest_centroid_wgmma), ("lloyd_step", ka.lloyd_step_wgmma))
    ]
    for _, fn, x, c in calls:  # warm-up: compiled and loaded before the profiled launches
        fn(x, c)
    torch.cuda.synchronize()
    for name, fn, x, c in calls:
        torch.cuda.nvtx.range_push(name)
        fn(x, c)
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    print("profiled:", ", ".join(name for name, *_ in calls), f"(build {ka.BUILD}, sums {ka.SUMS})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
