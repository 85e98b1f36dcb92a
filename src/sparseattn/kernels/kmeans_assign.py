"""k-means assignment on the tensor cores: ``kernels_cu/kmeans_assign.cu``.

The nearest centroid of every token is a product of rows, ``|c|² − 2·x·c``, and its row-wise argmin:
attention's S = Q·Kᵀ with a running argmin instead of the softmax. The kernel runs it on wgmma (128 tokens
a CTA, centroids streamed 128 at a time), where :mod:`sparseattn.nearest_centroid` runs it on Triton's
``tl.dot``; the metric is the same (bf16 tokens, centroids rounded to bf16, ``|c|²`` of the rounded
centroids in float32), so the labels differ only where two centroids are within float32 rounding of a tie.

Torch CUDA tensors in and out, on torch's current stream. ``x`` bf16 ``[N, tokens, d]`` (``d`` 64 or 128),
``centroids`` float ``[N, k, d]``.

Two builds of the running argmin (:data:`BUILD`, ``SPARSEATTN_KMEANS_BUILD``): ``"argmin"`` compares each
distance with the row's best and selects value and index, ties to the lower index as torch's argmin;
``"packed_argmax"`` (in its ``_tail64_ring`` form the default) maximizes ``−|x − c|²/2`` (the MMA's accumulators
start at ``−|c|²/2 − |x|²/2``) with each score's column in its 5 low mantissa bits, so the running best is a
chain of max instructions alone. Measured on an H100 at SVG2's 720p shapes, its first form (scores
``x·c − |c|²/2``, without the |x|² shift) was 14–16% faster on K's assignment and Lloyd step, 8–14% on Q's
(``data/bench/experiments/kmeans_builds_ab_h100_20261206_ae3521a.json``), but its resolution was 2⁻¹⁸ of
|x|²/2: on data far from the origin (the GPU test's blobs) 0.1% of the tokens whose nearest centroid is
clear by distance got another label. With the shift the resolution is relative to the distance, and the
whole GPU suite passes with it (H100, 49ea0f4): K's assignment 1.825 → 1.610 ms, Q's 0.786 → 0.727. Each
build has a ``_tail64`` form (``"argmin_tail64"``, ``"packed_argmax_tail64"``): a last chunk of at most 64
centroids is multiplied and scanned at wgmma N = 64, not 128 (the same scores for the same columns, so the
same labels): Q's assignment at SVG2's 300 clusters 0.727 → 0.662 ms, its Lloyd step 1.240 → 1.188
(``data/bench/experiments/kmeans_builds_ab_h100_20261207_49ea0f4.json``). The ``_ring`` form (the default)
runs the two chunk buffers on mbarriers: each warp releases a chunk once its MMA has read it, and the chunk
after next loads during the scan, with no CTA barrier per chunk: K's assignment 1.790 → 1.698 ms, its Lloyd
step 2.308 → 2.068 (``data/bench/experiments/kmeans_builds_ab_h100_20261207_ec06916.json``).

The Lloyd step's cluster sums (:data:`SUMS`, ``SPARSEATTN_KMEANS_SUMS``) are by default one more product on
the tensor cores per CTA (``"mma"``: a one-hot matrix of equal labels times the CTA's tokens, each cluster's
partial sum sent by its first token): Q's step at 300 clusters 1.237 → 1.114 ms against the per-cluster
presum, K's at 1,000 2.150 → 2.080 against one atomic per token
(``data/bench/experiments/kmeans_sums_ab_h100_20261207_ec06916.json``).
"""

from __future__ import annotations

import os

import numpy as np

from . import launch

SOURCE = "kmeans_assign.cu"
HEAD_DIMS = (64, 128)
#: Builds of the assignment: ``(packed_argmax, narrow_tail, loop)``, whether each takes the packed maximum,
#: whether a last chunk of at most 64 centroids runs at wgmma N = 64 (``_tail64``: the same labels with less
#: MMA work where k mod 128 is 1..64, e.g. 300 clusters), and how the chunk loop runs (the kernel's LOOP): 0
#: with two CTA barriers per chunk, 1 with the buffers on mbarriers (``_ring``: each warp releases a buffer
#: once its MMA has read it).
BUILDS = {
    "argmin": (False, False, 0),
    "packed_argmax": (True, False, 0),
    "argmin_tail64": (False, True, 0),
    "packed_argmax_tail64": (True, True, 0),
    "packed_argmax_tail64_ring": (True, True, 1),
}
#: The build the launches take (a key of BUILDS; ``SPARSEATTN_KMEANS_BUILD`` sets it at import).
BUILD = os.environ.get("SPARSEATTN_KMEANS_BUILD") or "packed_argmax_tail64_ring"


def _kernel_name(d: int, accumulate: bool, packed: bool, narrow_tail: bool, loop: int) -> str:
    flags = ", ".join("true" if b else "false" for b in (accumulate, packed, narrow_tail))
    return f"kmeans_assign_kernel<{d}, {flags}, {loop}>"


NAME_EXPRESSIONS = tuple(
    _kernel_name(d, acc, *build) for build in BUILDS.values() for d in HEAD_DIMS for acc in (False, True)
)
# Geometry mirrored from the kernel.
THREADS = 256
ROWS = 128  # tokens per CTA
CHUNK = 128  # centroids per step
NBUF = 2
#: How a CTA forms the Lloyd step's cluster sums (the kernel's ``sum_method``): ``"atomics"``, one float
#: atomic per token and column; ``"presum"``, each cluster's tokens of the CTA summed first (ballots, then a
#: member loop), one atomic per cluster present; ``"mma"``, the same partial sums as one product on the
#: tensor cores (a one-hot matrix of equal labels times the CTA's tokens).
SUM_METHODS = {"atomics": 0, "presum": 1, "mma": 2}
#: The method the Lloyd steps take (``SPARSEATTN_KMEANS_SUMS``, default ``"mma"``): a key of SUM_METHODS, or
#: ``"auto"``: ``"presum"`` up to :data:`PRESUM_MAX_CLUSTERS` clusters, ``"atomics"`` above.
SUMS = os.environ.get("SPARSEATTN_KMEANS_SUMS") or "mma"
#: Up to this many clusters ``"auto"`` presums: measured at SVG2's 720p shapes (H100), 300 clusters save
#: 0.3 ms per Lloyd step, 1,000 lose ~0.05 ms (their atomics rarely collide); the bound sits between the two.
PRESUM_MAX_CLUSTERS = 512


def smem_bytes(head_dim: int) -> int:
    """Dynamic shared memory of one CTA: the X tile, NBUF centroid chunks, their |c|², the ring build's
    mbarriers (64 bytes), 1 KB of alignment."""
    return 1024 + ROWS * head_dim * 2 * (1 + NBUF) + 4 * NBUF * CHUNK + 64


def available(x) -> bool:
    """Whether the kernel can run on ``x``: a bf16 CUDA tensor with head dim 64 or 128 on an sm_90 GPU (the
    kernel is built for sm_90a), and CuPy importable."""
    return (
        launch.runs_sm90(x) and str(x.dtype) == "torch.bfloat16" and x.ndim == 3 and x.shape[-1] in HEAD_DIMS
    )


def _sum_method(sums: str | None) -> str:
    """The method asked for (``sums``, else :data:`SUMS`), checked: ``"auto"`` or a key of SUM_METHODS."""
    method = SUMS if sums is None else sums
    if method != "auto" and method not in SUM_METHODS:
        where = "kmeans_assign.SUMS (SPARSEATTN_KMEANS_SUMS)" if sums is None else "sums"
        raise ValueError(f"{where} must be 'auto' or one of {list(SUM_METHODS)}, got {method!r}")
    return method


def _sum_method_code(method: str, k: int) -> int:
    """The kernel's ``sum_method`` for a checked method at ``k`` clusters (``"auto"`` resolved)."""
    if method == "auto":
        method = "presum" if k <= PRESUM_MAX_CLUSTERS else "atomics"
    return SUM_METHODS[method]


def _run(x, centroids, accumulate: bool, sums: str | None = None, operands=None):
    import torch

    if BUILD not in BUILDS:
        raise ValueError(
            f"kmeans_assign.BUILD (SPARSEATTN_KMEANS_BUILD) must be one of {list(BUILDS)}, got {BUILD!r}"
        )
    method = _sum_method(sums) if accumulate else None
    if not available(x):
        raise ValueError(
            "x must be a bf16 CUDA tensor [N, tokens, d] with d 64 or 128 on an sm_90 GPU for the wgmma k-means "
            f"assignment (CuPy installed); got {x.dtype} on {x.device}, shape {list(x.shape)}"
        )
    from ..nearest_centroid import centroid_operands

    n, t, d = x.shape
    if operands is None:
        c, csq = centroid_operands(x, centroids)  # rounded to bf16, and |c|² of the rounded centroids
    else:  # made by the caller (sparseattn.centroid_update)
        c, csq = operands
        if c.dtype != x.dtype or tuple(c.shape) != tuple(centroids.shape) or tuple(csq.shape) != c.shape[:2]:
            raise ValueError(
                f"operands must be ({x.dtype} {list(centroids.shape)}, float32 {list(centroids.shape[:2])}), "
                f"got ({c.dtype} {list(c.shape)}, {csq.dtype} {list(csq.shape)})"
            )
    if centroids.device != x.device:
        raise ValueError(f"centroids must be on {x.device}, got {centroids.device}")
    k = c.shape[1]
    if k < 1:
        raise ValueError("centroids must hold at least one centroid")
    x = x.contiguous()
    labels = torch.empty(n, t, dtype=torch.int64, device=x.device)
    sums_out = torch.zeros(n, k, d, dtype=torch.float32, device=x.device) if accumulate else csq
    counts = torch.zeros(n, k, dtype=torch.float32, device=x.device) if accumulate else csq
    if n and t:
        name = _kernel_name(d, accumulate, *BUILDS[BUILD])
        smem = smem_bytes(d)
        fn = launch.prepare(launch.function(SOURCE, name, NAME_EXPRESSIONS), smem)
        ptr = lambda a: np.uint64(a.data_ptr())
        with launch.torch_stream():
            fn(
                (-(-t // ROWS), n),
                (THREADS,),
                (
                    ptr(x),
                    ptr(c),
                    ptr(csq),
                    ptr(labels),
                    ptr(sums_out),
                    ptr(counts),
                    np.int32(t),
                    np.int32(k),
                    np.int32(_sum_method_code(method, k) if accumulate else 0),
                ),
                shared_mem=smem,
            )
    return (labels, sums_out, counts) if accumulate else (labels,)


def nearest_centroid_wgmma(x, centroids, operands=None):
    """int64 ``[N, tokens]``: the nearest centroid of each row of ``x`` (ties to the lower index).
    ``operands``: the centroids rounded to ``x``'s dtype and their float32 ``|c|²``, when the caller made
    them (default :func:`sparseattn.nearest_centroid.centroid_operands`)."""
    return _run(x, centroids, accumulate=False, operands=operands)[0]


def lloyd_step_wgmma(x, centroids, sums: str | None = None, operands=None):
    """One Lloyd assignment with its cluster statistics: ``(labels int64 [N, tokens], sums float32 [N, k,
    d], sizes float32 [N, k])``, as :func:`sparseattn.nearest_centroid.lloyd_step_fused` returns them.
    ``sums``: how a CTA forms its clusters' sums, ``"auto"`` or a key of :data:`SUM_METHODS` (default
    :data:`SUMS`); ``operands`` as :func:`nearest_centroid_wgmma`."""
    return _run(x, centroids, accumulate=True, sums=sums, operands=operands)
