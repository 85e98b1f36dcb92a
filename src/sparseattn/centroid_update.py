"""The k-means assignment's centroid operands in one pass: bf16 centroids and their ``|c|²``.

The wgmma assignment (:mod:`sparseattn.kernels.kmeans_assign`) takes the centroids rounded to the tokens'
dtype, bf16, and ``|c|²`` of the rounded values (:func:`sparseattn.nearest_centroid.centroid_operands`: four torch
passes over ``[N, k, d]``), and between two Lloyd steps the means of the step's sums replace the centroids
of non-empty clusters (:func:`sparseattn.svg2_device.lloyd`: two more passes and a division). At SVG2's
720p K side (40 heads, 1,000 clusters, d = 128) those are ~10 small kernels per step over 20 MB tensors.
Here one program per :data:`ROWS` centroids reads them once and writes all three: :func:`operands` from
centroids, :func:`update` from a step's sums and sizes (``sums / max(size, 1)`` rounded as torch divides,
the previous centroid where the size is 0), and :func:`selection_means` the same centroids with the float64
means SVG2's selection starts from. ``|c|²`` is summed in another order than torch's (last bits).

Runs on CUDA tensors (or on the CPU under ``TRITON_INTERPRET=1``, for tests); :func:`available` says
whether it can run on a tensor.
"""

from __future__ import annotations

import torch

from .triton_support import runs_on, tl, triton

#: Centroids per program.
ROWS = 8


def available(x: torch.Tensor) -> bool:
    """Whether :func:`operands` and :func:`update` run their kernel on ``x``'s device: Triton importable, a
    CUDA device (or the CPU under ``TRITON_INTERPRET=1``) and a power-of-two last dimension ≥ 16."""
    d = x.shape[-1]
    return runs_on(x) and d >= 16 and d & (d - 1) == 0


if triton is not None:

    @triton.jit
    def _program_rows(rows, D: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr):
        """This program's centroids: ``(r, inside, offs, mask)``, their flat indices, which exist, the offsets
        of their ``[ROWS_PER_PROGRAM, D]`` tile and its mask."""
        r = tl.program_id(0).to(tl.int64) * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)
        inside = r < rows
        return r, inside, r[:, None] * D + tl.arange(0, D)[None, :], inside[:, None]

    @triton.jit
    def _step_means(sums_ptr, size, prev, offs, m):
        """``(means, centroids)`` of a tile: ``sums / max(size, 1)`` rounded as torch divides, and the means where
        ``size`` (float32 ``[rows, 1]``) is > 0, else ``prev``."""
        mean = tl.math.div_rn(tl.load(sums_ptr + offs, mask=m, other=0.0), tl.maximum(size, 1.0))
        return mean, tl.where(size > 0, mean, prev)

    @triton.jit
    def _operands_kernel(
        prev_ptr,  # float32 [rows, D]: the centroids (the previous ones with UPDATE)
        sums_ptr,  # float32 [rows, D] (UPDATE)
        sizes_ptr,  # float32 [rows] (UPDATE)
        cent_ptr,  # float32 [rows, D]: the new centroids (UPDATE)
        low_ptr,  # uint16 [rows, D]: the centroids rounded to bf16 (their bits)
        csq_ptr,  # float32 [rows]: |c|² of the rounded centroids
        rows,
        D: tl.constexpr,
        ROWS_PER_PROGRAM: tl.constexpr,
        UPDATE: tl.constexpr,
    ):
        r, inside, offs, m = _program_rows(rows, D, ROWS_PER_PROGRAM)
        c = tl.load(prev_ptr + offs, mask=m, other=0.0)
        if UPDATE:
            size = tl.load(sizes_ptr + r, mask=inside, other=0.0)[:, None]
            c = _step_means(sums_ptr, size, c, offs, m)[1]
            tl.store(cent_ptr + offs, c, mask=m)
        # rounded to bf16 to nearest even by the bits (as torch's .to(bfloat16), and the same under Triton's
        # interpreter, whose conversion truncates)
        bits = c.to(tl.uint32, bitcast=True)
        high = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(low_ptr + offs, high.to(tl.uint16), mask=m)
        f = (high << 16).to(tl.float32, bitcast=True)
        tl.store(csq_ptr + r, tl.sum(f * f, 1), mask=inside)

    @triton.jit
    def _means_kernel(
        sums_ptr,  # float32 [rows, D]
        sizes_ptr,  # int64 [rows]
        prev_ptr,  # float32 [rows, D]
        cent_ptr,  # float32 [rows, D]: the means where the size is > 0, else the previous centroid
        means_ptr,  # float64 [rows, D]: the float32 means (zero where the size is 0), widened
        rows,
        D: tl.constexpr,
        ROWS_PER_PROGRAM: tl.constexpr,
    ):
        r, inside, offs, m = _program_rows(rows, D, ROWS_PER_PROGRAM)
        size = tl.load(sizes_ptr + r, mask=inside, other=0).to(tl.float32)[:, None]
        mean, cent = _step_means(sums_ptr, size, tl.load(prev_ptr + offs, mask=m, other=0.0), offs, m)
        tl.store(cent_ptr + offs, cent, mask=m)
        tl.store(means_ptr + offs, mean.to(tl.float64), mask=m)


def _launch(prev, sums, sizes):
    n, k, d = prev.shape
    prev = prev.contiguous()
    cent = torch.empty_like(prev) if sums is not None else prev
    low = torch.empty(n, k, d, dtype=torch.bfloat16, device=prev.device)
    csq = torch.empty(n, k, dtype=torch.float32, device=prev.device)
    rows = n * k
    if rows:
        update = sums is not None
        _operands_kernel[(triton.cdiv(rows, ROWS),)](
            prev,
            sums.contiguous() if update else prev,
            sizes.contiguous() if update else csq,
            cent,
            low.view(torch.uint16),
            csq,
            rows,
            D=d,
            ROWS_PER_PROGRAM=ROWS,
            UPDATE=update,
        )
    return cent, (low, csq)


def _check(name: str, x: torch.Tensor, shape) -> None:
    if x.dtype != torch.float32 or tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must be float32 {list(shape)}, got {x.dtype} {list(x.shape)}")


def _check_centroids(name: str, x: torch.Tensor) -> None:
    """float32 ``[N, k, d]`` centroids, or a ValueError naming ``name``."""
    if x.ndim != 3:
        raise ValueError(f"{name} must be [N, k, d], got {list(x.shape)}")
    _check(name, x, x.shape)


def operands(centroids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(low, csq)``: float32 ``centroids`` ``[N, k, d]`` rounded to bf16 and ``|c|²`` (float32 ``[N, k]``)
    of the rounded values, as :func:`sparseattn.nearest_centroid.centroid_operands` for bf16 tokens. Needs
    :func:`available`."""
    _check_centroids("centroids", centroids)
    return _launch(centroids, None, None)[1]


def update(sums: torch.Tensor, sizes: torch.Tensor, previous: torch.Tensor):
    """``(centroids, (low, csq))`` after a Lloyd step: ``sums / max(sizes, 1)`` where ``sizes > 0``, else the
    ``previous`` centroid (float32 ``[N, k, d]``; ``sums`` float32 ``[N, k, d]``, ``sizes`` float32 ``[N,
    k]``), and :func:`operands` of them. Needs :func:`available`."""
    _check_centroids("previous", previous)
    _check("sums", sums, previous.shape)
    _check("sizes", sizes, previous.shape[:2])
    return _launch(previous, sums, sizes)


def selection_means(sums: torch.Tensor, sizes: torch.Tensor, previous: torch.Tensor):
    """``(centroids float32, means float64)``, both ``[N, k, d]``, of clusters' float32 ``sums`` ``[N, k, d]`` and
    int64 ``sizes`` ``[N, k]``: the means ``sums / max(size, 1)`` rounded to float32 as torch divides (zero for
    an empty cluster) and widened to float64, SVG2's selection's input; the centroids the means where the size
    is > 0, else the ``previous`` centroid (float32 ``[N, k, d]``). One pass where torch takes six. Needs
    :func:`available`."""
    _check_centroids("previous", previous)
    _check("sums", sums, previous.shape)
    if sizes.dtype != torch.int64 or tuple(sizes.shape) != tuple(previous.shape[:2]):
        raise ValueError(
            f"sizes must be int64 {list(previous.shape[:2])}, got {sizes.dtype} {list(sizes.shape)}"
        )
    n, k, d = previous.shape
    cent = torch.empty_like(previous)
    means = torch.empty(n, k, d, dtype=torch.float64, device=previous.device)
    if n * k:
        _means_kernel[(triton.cdiv(n * k, ROWS),)](
            sums.contiguous(),
            sizes.contiguous(),
            previous.contiguous(),
            cent,
            means,
            n * k,
            D=d,
            ROWS_PER_PROGRAM=ROWS,
        )
    return cent, means
