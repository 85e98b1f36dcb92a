"""The wgmma k-means assignment's cluster sums, timed apart (lab script, GPU).

At ``svg2_wan14b_720p``'s shapes (40 heads × 75,600 tokens, Q 300 / K 1,000 clusters) on the workload's
synthetic features, from centroids after 3 warm Lloyd steps: the assignment with labels only against the
same with the cluster sums (CUDA events, median of 10), the k-means of one call (2 Lloyd steps), and how
many distinct clusters a 128-token CTA holds (what the sums' atomics can be cut to). The kernel source
is this checkout's ``kernels_cu/`` or ``$SPARSEATTN_KERNEL_DIR``.

.. code-block:: text

    PYTHONPATH=src python data/bench/experiments/kmeans_sums_cost.py
"""

import os

import torch

from sparseattn import svg2_device as sd
from sparseattn.kernels.kmeans_assign import lloyd_step_wgmma, nearest_centroid_wgmma
from sparseattn.nearest_centroid import centroid_operands
from sparseattn.pageweaver.gpu_bench import time_device
from sparseattn.svg2_step_bench import features
from sparseattn.workloads import get_workload


def side(name, x, kk, g):
    idx = torch.randperm(x.shape[1], generator=g, device="cuda")[:kk]
    c0 = x[:, idx].float()
    c = sd.lloyd(x, kk, 3, init=c0, assign="wgmma", final_assign=False)[1]  # warm centroids
    n = x.shape[0]
    tn = time_device(lambda: nearest_centroid_wgmma(x, c), reps=10, warmup=2)
    ts = time_device(lambda: lloyd_step_wgmma(x, c), reps=10, warmup=2)
    to = time_device(lambda: centroid_operands(x, c), reps=10, warmup=2)
    tz = time_device(
        lambda: (torch.zeros(n, kk, 128, device="cuda"), torch.zeros(n, kk, device="cuda")), reps=10, warmup=2
    )
    tl = time_device(
        lambda: sd.lloyd(x, kk, 2, init=c, assign="wgmma", final_assign=False), reps=10, warmup=2
    )
    lab = nearest_centroid_wgmma(x, c)
    whole = (lab.shape[1] // 128) * 128
    srt = lab[:, :whole].reshape(n, -1, 128).sort(-1).values
    distinct = (1 + (srt[..., 1:] != srt[..., :-1]).sum(-1)).float().mean().item()
    w16 = lab[:, : (lab.shape[1] // 16) * 16].reshape(n, -1, 16)
    runs16 = (1 + (w16[..., 1:] != w16[..., :-1]).sum(-1)).float().mean().item()
    gf = 2 * n * x.shape[1] * kk * 128 / 1e9
    print(
        f"{name} (k={kk}): labels only {tn:.3f} ms ({gf / tn:.0f} TFLOP/s), with sums {ts:.3f} ms, operands "
        f"{to:.3f}, zeros {tz:.3f}, lloyd 2 steps {tl:.3f} ms; distinct clusters per 128 tokens {distinct:.1f}, "
        f"runs per 16 {runs16:.2f}",
        flush=True,
    )


def main():
    print(f"kernels: {os.environ.get('SPARSEATTN_KERNEL_DIR') or 'kernels_cu/ of this checkout'}", flush=True)
    q, k, _ = features(get_workload("svg2_wan14b_720p"), 40, torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(0)
    side("q", q, 300, g)
    side("k", k, 1000, g)


if __name__ == "__main__":
    main()
