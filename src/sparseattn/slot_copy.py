"""Token rows into slot rows in one pass: a Triton gather that writes each used slot row once.

:func:`sparseattn.svg2_device.scatter_rows` (torch) fills a ``[total, d]`` buffer with zeros, then copies
the token rows in (``index_copy``). The buffers are sized to a static bound: at SVG2's 720p K side (40
heads, 75,600 tokens, 1,000 clusters of 128-row blocks) that is 202,496 slots per head, 2 GB of zeros
per tensor, and most of them lie past each head's last block, where no plan ever reads.

:func:`rows_to_slots` gathers instead. Each program takes ``BLOCK_ROWS`` output rows and reads each one's
source from ``sources``: a token row (``>= 0``), zeros (``-1``: padding inside a used block; the KPage
kernels read no padding row, their GPU tests put NaN there, so a caller may leave it out of ``used``) or
nothing (``-2``: the row is left as ``torch.empty`` gave it). :func:`slot_sources` builds ``sources``
from the rows' targets and a mask of the used slots (a per-row layout's first ``num_slots`` slots). The
backward is the gather of the gradient at the same rows (``index_select``), so unwritten rows are never
read on either way.

Given ``sums`` and ``sum_index`` (the sums row of every output row, ``-1`` for none), the same pass also
adds each copied row, in float32, into its sums row: a program's rows that all go to one sums row (a
block of one cluster, when a program's rows lie in one block) send one atomic per column, others one per
row. SVG2's k-means takes its last step's cluster sums this way instead of a pass of its own.

:func:`zero_rows` writes zeros into listed rows only (the padding slots of a dynamic forward's output,
which no work item writes).

Runs on CUDA tensors (or on the CPU under ``TRITON_INTERPRET=1``, for tests); :func:`available` says
whether it can run on a tensor. :func:`scatter_rows` of ``svg2_device`` falls back to zeros and
``index_copy`` elsewhere.
"""

from __future__ import annotations

import torch

from .triton_support import runs_on, tl, triton

#: Output rows per program.
BLOCK_ROWS = 64
#: ``sources`` value of a zero row and of a row left unwritten.
ZERO, UNWRITTEN = -1, -2


def available(x: torch.Tensor) -> bool:
    """Whether :func:`rows_to_slots` runs its kernel on ``x``: Triton importable and ``x`` on a CUDA device
    (or on the CPU under ``TRITON_INTERPRET=1``)."""
    return runs_on(x)


if triton is not None:

    @triton.jit
    def _rows_to_slots_kernel(
        x_ptr,
        src_ptr,
        out_ptr,
        sum_idx_ptr,
        sums_ptr,
        total,
        stride_x,
        stride_out,
        D: tl.constexpr,
        BD: tl.constexpr,
        BR: tl.constexpr,
        SUMS: tl.constexpr,
    ):
        offs_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
        r_ok = offs_r < total
        src = tl.load(src_ptr + offs_r, mask=r_ok, other=-2).to(tl.int64)
        offs_d = tl.arange(0, BD)
        d_ok = offs_d < D
        take = (src >= 0)[:, None] & d_ok[None, :]
        rows = tl.load(x_ptr + src[:, None] * stride_x + offs_d[None, :], mask=take, other=0.0)
        write = (src >= -1)[:, None] & d_ok[None, :]
        tl.store(out_ptr + offs_r[:, None] * stride_out + offs_d[None, :], rows, mask=write)
        if SUMS:  # each copied row into its sums row (float32)
            idx = tl.load(sum_idx_ptr + offs_r, mask=r_ok, other=-1).to(tl.int64)
            has = (src >= 0) & (idx >= 0)
            hi = tl.max(tl.where(has, idx, -1), 0)
            lo = tl.min(tl.where(has, idx, hi), 0)
            vals = tl.where(has[:, None], rows.to(tl.float32), 0.0)
            if lo == hi:  # one sums row (or none): one atomic per column
                if hi >= 0:
                    tl.atomic_add(sums_ptr + hi * D + offs_d, tl.sum(vals, 0), mask=d_ok)
            else:
                tl.atomic_add(
                    sums_ptr + idx[:, None] * D + offs_d[None, :], vals, mask=has[:, None] & d_ok[None, :]
                )


def slot_sources(rows: torch.Tensor, total: int, used: torch.Tensor) -> torch.Tensor:
    """int32 ``[total]``: the source of every output row: the index of the input row whose target in
    ``rows`` (int ``[R]``, distinct) it is, else :data:`ZERO` where ``used`` (bool ``[total]``), else
    :data:`UNWRITTEN`. Every target must be a used row."""
    if used.shape != (total,):
        raise ValueError(f"used must be bool [{total}], got {list(used.shape)}")
    src = torch.where(used, ZERO, UNWRITTEN).to(torch.int32)
    return src.index_copy_(0, rows.long(), torch.arange(rows.shape[0], dtype=torch.int32, device=rows.device))


class _RowsToSlots(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rows, sources, sum_index, sums):
        ctx.save_for_backward(rows)
        total, d = sources.shape[0], x.shape[1]
        x = x if x.stride(1) == 1 else x.contiguous()
        out = torch.empty(total, d, dtype=x.dtype, device=x.device)
        if total:
            grid = (triton.cdiv(total, BLOCK_ROWS),)
            _rows_to_slots_kernel[grid](
                x,
                sources,
                out,
                sources if sum_index is None else sum_index,
                out if sums is None else sums,
                total,
                x.stride(0),
                out.stride(0),
                D=d,
                BD=triton.next_power_of_2(d),
                BR=BLOCK_ROWS,
                SUMS=sums is not None,
            )
        return out

    @staticmethod
    def backward(ctx, grad):
        (rows,) = ctx.saved_tensors
        return grad.index_select(0, rows.long()), None, None, None, None


if triton is not None:

    @triton.jit
    def _zero_rows_kernel(y_ptr, rows_ptr, n_rows, slots, D: tl.constexpr, BR: tl.constexpr):
        offs_r = tl.program_id(1).to(tl.int64) * BR + tl.arange(0, BR)
        r_ok = offs_r < n_rows
        rows = tl.load(rows_ptr + offs_r, mask=r_ok, other=0).to(tl.int64)
        base = tl.program_id(0).to(tl.int64) * slots
        offs_d = tl.arange(0, D)
        zeros = tl.zeros((BR, D), dtype=y_ptr.dtype.element_ty)
        tl.store(y_ptr + (base + rows)[:, None] * D + offs_d[None, :], zeros, mask=r_ok[:, None])


def zero_rows(y: torch.Tensor, rows: torch.Tensor) -> None:
    """Zeros into rows ``rows`` (int64 ``[n]``) of every ``[slots, d]`` matrix of contiguous ``y``
    ``[..., slots, d]``, in place, in one launch that writes only those rows (a memset of all of ``y``
    writes every row). ``d`` a power of two. Needs :func:`available` ``(y)``."""
    if not available(y) or not y.is_contiguous():
        raise ValueError(f"zero_rows needs Triton and a contiguous CUDA tensor, got {y.dtype} on {y.device}")
    slots, d = y.shape[-2], y.shape[-1]
    if d & (d - 1) or rows.ndim != 1:
        raise ValueError(f"zero_rows needs d a power of two and rows [n], got d={d}, rows {list(rows.shape)}")
    matrices = y.numel() // max(slots * d, 1)
    if triton.cdiv(rows.numel(), BLOCK_ROWS) > 65535:
        raise ValueError(f"zero_rows takes at most {65535 * BLOCK_ROWS} rows, got {rows.numel()}")
    if rows.numel() and matrices:
        grid = (matrices, triton.cdiv(rows.numel(), BLOCK_ROWS))
        _zero_rows_kernel[grid](y, rows, rows.numel(), slots, D=d, BR=BLOCK_ROWS)


def rows_to_slots(
    x: torch.Tensor,
    rows: torch.Tensor,
    used: torch.Tensor,
    sums: torch.Tensor | None = None,
    sum_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[total, d]``: row ``i`` of ``x`` ``[R, d]`` at row ``rows[i]`` (``rows`` int ``[R]``, distinct, each a
    used row), zeros at the other rows where ``used`` (bool ``[total]``), the rest unwritten.
    Differentiable in ``x``. With ``sums`` (float32 ``[S, d]``, contiguous) and ``sum_index`` (int32
    ``[total]``: each output row's sums row, or -1), each copied row is also added into ``sums`` (in place,
    not differentiated). Needs :func:`available` ``(x)``."""
    if not available(x):
        raise ValueError(f"rows_to_slots needs Triton and a CUDA tensor, got {x.dtype} on {x.device}")
    if x.ndim != 2 or rows.shape != (x.shape[0],):
        raise ValueError(f"x must be [R, d] and rows [R], got {list(x.shape)} and {list(rows.shape)}")
    total = used.shape[0]
    if (sums is None) != (sum_index is None):
        raise ValueError("sums and sum_index go together")
    if sums is not None:
        if (
            sums.dtype != torch.float32
            or sums.ndim != 2
            or sums.shape[1] != x.shape[1]
            or not sums.is_contiguous()
        ):
            raise ValueError(
                f"sums must be contiguous float32 [S, {x.shape[1]}], got {sums.dtype} {list(sums.shape)}"
            )
        if sum_index.dtype != torch.int32 or sum_index.shape != (total,):
            raise ValueError(
                f"sum_index must be int32 [{total}], got {sum_index.dtype} {list(sum_index.shape)}"
            )
    return _RowsToSlots.apply(x, rows, slot_sources(rows, total, used), sum_index, sums)
