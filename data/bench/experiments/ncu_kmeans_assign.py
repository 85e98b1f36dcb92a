"""One launch of the wgmma k-means assignment at SVG2's 720p shapes, for ncu (lab script, GPU).

At ``svg2_wan14b_720p``'s shapes (40 heads × 75,600 tokens; K 1,000 or Q 300 clusters) on the workload's
synthetic features, from centroids after 3 warm Lloyd steps: three warm-up calls, then one call between
``cudaProfilerStart`` / ``Stop``, so that ``ncu --profile-from-start off`` profiles exactly that launch.
``assign`` is the labels-only assignment (the Lloyd step the call runs last), ``lloyd_step`` the
assignment with the cluster sums (its first step). The question it answers: what bounds the kernel, L2
reads of the centroid chunks (every CTA of 128 tokens reads all of them), the tensor pipe, or the
argmin's issue slots and the CTA barriers between them.

.. code-block:: text

    ncu --clock-control none --profile-from-start off --set full -o kmeans_k \\
        python data/bench/experiments/ncu_kmeans_assign.py k assign
    ncu --import kmeans_k.ncu-rep --page details --csv > kmeans_k_details.csv
"""

import sys

import torch


def main(side: str, call: str, workload: str = "svg2_wan14b_720p") -> None:
    from sparseattn import svg2_device as sd
    from sparseattn.kernels import kmeans_assign as ka
    from sparseattn.svg2_step_bench import features
    from sparseattn.workloads import get_workload

    w = get_workload(workload)
    q, k, _ = features(w, w.heads, torch.device("cuda"))
    x, clusters = (k, w.selection.k_clusters) if side == "k" else (q, w.selection.q_clusters)
    g = torch.Generator(device="cuda").manual_seed(0)
    idx = torch.randperm(x.shape[1], generator=g, device="cuda")[:clusters]
    c = sd.lloyd(x, clusters, 3, init=x[:, idx].float(), assign="wgmma", final_assign=False)[1]
    fn = {"assign": ka.nearest_centroid_wgmma, "lloyd_step": ka.lloyd_step_wgmma}[call]
    for _ in range(3):
        fn(x, c)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn(x, c)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main(*sys.argv[1:])
