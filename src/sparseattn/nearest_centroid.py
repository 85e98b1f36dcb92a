"""Nearest centroid of every token, fused: distances and their argmin in one Triton kernel.

The torch form (:func:`sparseattn.svg2_device.nearest_centroid`) writes the whole distance matrix
``[N, tokens, k]`` in float32 and reads it back for the argmin: for SVG2's K side at 720p (40 heads,
75,600 tokens, 1,000 clusters) that is 12 GB of memory traffic per assignment, several times the
matmul's own time. Here each program holds a tile of ``BLOCK_T`` tokens in registers, streams the
centroids ``BLOCK_K`` at a time through ``tl.dot`` (tensor cores) and keeps a running minimum, so only
the labels leave the chip.

The dot products take the tokens' own half-precision values and the centroids rounded to the same
dtype; ``|c|²`` is computed from those rounded centroids in float32. The labels are therefore the exact
nearest centroids of the rounded centroids (a consistent metric), which can differ from the float32
path's only where two centroids are within rounding of a tie. Ties go to the lower index.

:func:`nearest_centroid_fused` needs CUDA tensors (or ``TRITON_INTERPRET=1`` on the CPU, for tests) and
Triton; :func:`fused_available` says whether it can run on a tensor.
"""

from __future__ import annotations

import torch

from .triton_support import runs_on, tl, triton

#: Tokens per program and centroids per step of the fused kernel.
BLOCK_T = 128
BLOCK_K = 64
HALF_DTYPES = (torch.bfloat16, torch.float16)


def fused_available(x: torch.Tensor) -> bool:
    """Whether :func:`nearest_centroid_fused` can run on ``x``: Triton importable, ``x`` half precision
    on a CUDA device (or on the CPU under ``TRITON_INTERPRET=1``), head dim a power of two ≥ 16."""
    if x.dtype not in HALF_DTYPES:
        return False
    d = x.shape[-1]
    if d < 16 or d & (d - 1):
        return False
    return runs_on(x)


if triton is not None:

    @triton.jit
    def _nearest_kernel(
        x_ptr,
        c_ptr,
        csq_ptr,
        out_ptr,
        sums_ptr,
        counts_ptr,
        tokens,
        k,
        stride_xn,
        stride_xt,
        stride_cn,
        stride_ck,
        D: tl.constexpr,
        BT: tl.constexpr,
        BK: tl.constexpr,
        ACCUMULATE: tl.constexpr,
    ):
        tb = tl.program_id(0)
        n = tl.program_id(1).to(tl.int64)
        offs_t = tb * BT + tl.arange(0, BT)
        offs_d = tl.arange(0, D)
        t_ok = offs_t < tokens
        x = tl.load(
            x_ptr + n * stride_xn + offs_t[:, None].to(tl.int64) * stride_xt + offs_d[None, :],
            mask=t_ok[:, None],
            other=0.0,
        )
        best = tl.full([BT], float("inf"), tl.float32)
        best_i = tl.zeros([BT], tl.int32)
        for k0 in range(0, k, BK):
            offs_k = k0 + tl.arange(0, BK)
            k_ok = offs_k < k
            c = tl.load(
                c_ptr + n * stride_cn + offs_k[:, None] * stride_ck + offs_d[None, :],
                mask=k_ok[:, None],
                other=0.0,
            )
            csq = tl.load(csq_ptr + n * k + offs_k, mask=k_ok, other=float("inf"))
            dist = csq[None, :] - 2.0 * tl.dot(x, tl.trans(c))
            m = tl.min(dist, axis=1)
            i = tl.argmin(dist, axis=1).to(tl.int32) + k0
            better = m < best
            best = tl.where(better, m, best)
            best_i = tl.where(better, i, best_i)
        tl.store(out_ptr + n * tokens + offs_t, best_i.to(tl.int64), mask=t_ok)
        if ACCUMULATE:  # the Lloyd step's sums and sizes of the clusters just assigned (float32 atomics)
            row = (n * k + best_i.to(tl.int64))[:, None] * D + offs_d[None, :]
            tl.atomic_add(sums_ptr + row, x.to(tl.float32), mask=t_ok[:, None])
            tl.atomic_add(counts_ptr + n * k + best_i, tl.full([BT], 1.0, tl.float32), mask=t_ok)


def nearest_centroid_fused(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """int64 ``[N, tokens]``: the nearest centroid (squared Euclidean) of each row of ``x``.

    Args:
        x: bf16 or fp16 ``[N, tokens, d]`` (``d`` a power of two ≥ 16), contiguous in ``d``.
        centroids: float ``[N, k, d]`` on the same device (rounded to ``x``'s dtype for the dot products).
    """
    return _launch(x, centroids, accumulate=False)[0]


def lloyd_step_fused(x: torch.Tensor, centroids: torch.Tensor):
    """One Lloyd assignment with its cluster statistics, fused: ``(labels int64 [N, tokens], sums float32
    [N, k, d], sizes float32 [N, k])``, the labels as :func:`nearest_centroid_fused` and each token added
    into its cluster's float32 sum and size as it is assigned (atomics: the order of the additions, so
    the last bits of the sums, may change from run to run, as with ``scatter_add_``). Arguments as
    :func:`nearest_centroid_fused`."""
    return _launch(x, centroids, accumulate=True)


def centroid_operands(x: torch.Tensor, centroids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(c, csq)``: ``centroids`` float ``[N, k, d]`` (checked against ``x`` ``[N, tokens, d]``) rounded to
    ``x``'s dtype, contiguous, and ``|c|²`` of those rounded centroids, float32 ``[N, k]``: the operands of
    an assignment kernel's ``|c|² − 2·x·c``."""
    n, _, d = x.shape
    if centroids.ndim != 3 or centroids.shape[0] != n or centroids.shape[2] != d:
        raise ValueError(f"centroids must be [N, k, d] = [{n}, k, {d}], got {list(centroids.shape)}")
    c = centroids.to(x.dtype).contiguous()
    return c, c.float().square().sum(-1).contiguous()


def _launch(x: torch.Tensor, centroids: torch.Tensor, accumulate: bool):
    if not fused_available(x):
        raise ValueError(
            "nearest_centroid_fused needs Triton and a half-precision CUDA tensor with a power-of-two head "
            f"dim >= 16; got {x.dtype} on {x.device}, shape {list(x.shape)}"
        )
    n, t, d = x.shape
    c, csq = centroid_operands(x, centroids)
    k = c.shape[1]
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(n, t, dtype=torch.int64, device=x.device)
    sums = torch.zeros(n, k, d, dtype=torch.float32, device=x.device) if accumulate else csq
    counts = torch.zeros(n, k, dtype=torch.float32, device=x.device) if accumulate else csq
    if n and t:
        grid = (triton.cdiv(t, BLOCK_T), n)
        _nearest_kernel[grid](
            x,
            c,
            csq,
            out,
            sums,
            counts,
            t,
            k,
            x.stride(0),
            x.stride(1),
            c.stride(0),
            c.stride(1),
            D=d,
            BT=BLOCK_T,
            BK=BLOCK_K,
            ACCUMULATE=accumulate,
        )
    return (out, sums, counts) if accumulate else (out,)
