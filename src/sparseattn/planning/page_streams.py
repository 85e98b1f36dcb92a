"""The page streams of per-row layouts, written by one Triton program per work item.

A work item (row ``r``, block ``i`` of its owning side) streams the live pages of every block ``j`` of
the other side that it selects, in block order. :func:`stream_lengths` counts each item's entries and
:func:`write_streams` writes them at the item's offset; between the two, an exclusive prefix sum in
torch. Each program walks its item's selection ``BLOCK_J`` blocks at a time (a prefix sum of page
counts within the chunk gives every page its position), so the work is one read of the selection and
one write per stream entry: no ``[rows, blocks, blocks, pages]`` temporaries as in the torch form
(:mod:`.dynamic_layouts`), which stays the reference and the path off CUDA.

Two stream forms:

* forward (``split_partial=True``): every selected block's full 16-row pages first (mask ``0xFFFF``),
  then one partial page per selected block that has one (its row mask), written as interleaved
  ``(page, mask)`` int32 pairs;
* backward (``split_partial=False``): all live pages of each selected block, page ids only.

The selection is read per (item, block) from a bool ``[R, owner, other]`` tensor, or by groups
(``other_group``): item ``i`` is then a group of owner blocks (:func:`.dynamic_layouts.cluster_forward_work_list`
writes one stream per Q cluster), and it selects block ``j`` when ``sel[r, i, other_group[r, j]]`` does.

Entries past ``capacity`` go nowhere (the callers count them in their status). The kernels need CUDA
tensors, or CPU tensors under ``TRITON_INTERPRET=1`` (tests); :func:`available` says which.

Writers of the same bytes (:data:`WRITER`, ``SPARSEATTN_STREAM_WRITER``): ``"cuda_one_walk"`` (the default)
and ``"cuda"``, :mod:`sparseattn.kernels.page_streams`, one warp per item walking the other side 32 blocks at a
time, the chunk's entries written by consecutive lanes, on CUDA tensors of an sm_90 GPU with CuPy installed
(``"cuda_one_walk"`` writes the forward's full and partial pages in one walk); and ``"triton"``, the kernels
here, which also run wherever the CUDA kernels cannot.
"""

from __future__ import annotations

import functools
import os

import torch

from ..constants import PAGE_ROWS
from ..triton_support import runs_on, tl, triton

#: Blocks of the other side read per step of a program.
BLOCK_J = 256
FULL_MASK = (1 << PAGE_ROWS) - 1
WRITERS = ("triton", "cuda", "cuda_one_walk")
#: The stream writer, one of :data:`WRITERS`, read at each call of :func:`stream_lengths`,
#: :func:`write_streams` and :func:`streams`: ``"cuda_one_walk"`` by default, the CUDA kernels with
#: :func:`streams`' split streams (the forward's) written in one walk of the other side's blocks instead of
#: two (``page_stream_write_one_walk``; NOTES_svg2_device.md v46: the 720p forward plan by clusters 0.41 →
#: 0.36 ms); ``"cuda"`` the CUDA kernels with two walks (v39: the 720p plans by clusters 18–29% shorter on the
#: GPU than Triton's); ``"triton"`` the Triton kernels everywhere.
WRITER = os.environ.get("SPARSEATTN_STREAM_WRITER") or "cuda_one_walk"


def available(x: torch.Tensor) -> bool:
    """Whether the Triton stream writers can run on ``x``'s device."""
    return runs_on(x)


def _cuda_writer(x: torch.Tensor) -> bool:
    """Whether the CUDA kernels write ``x``'s streams: :data:`WRITER` is not ``"triton"`` (checked first: a
    value not in :data:`WRITERS` raises) and they can run on ``x``."""
    writer = WRITER
    if writer not in WRITERS:
        raise ValueError(
            f"page_streams.WRITER (SPARSEATTN_STREAM_WRITER) must be one of {WRITERS}, got {writer!r}"
        )
    if writer == "triton" or not x.is_cuda:
        return False
    from ..kernels import page_streams as cuda_streams

    return cuda_streams.available(x)


if triton is not None:

    @triton.jit
    def _selects(sel_ptr, grp_ptr, r, i, j, ok, n_other, n_groups, s_r, s_i, s_j, GROUPED: tl.constexpr):
        """bool ``[BJ]``: whether item ``(r, i)`` selects block ``j``: ``sel[r, i, j]``, or with ``GROUPED``
        ``sel[r, i, group[r, j]]`` (false where the group is outside ``[0, n_groups)``)."""
        if GROUPED:
            col = tl.load(grp_ptr + r * n_other + j, mask=ok, other=-1).to(tl.int64)
            inside = ok & (col >= 0) & (col < n_groups)
            return tl.load(sel_ptr + r * s_r + i * s_i + col * s_j, mask=inside, other=0) != 0
        return tl.load(sel_ptr + r * s_r + i * s_i + j * s_j, mask=ok, other=0) != 0

    @triton.jit
    def _selected_pages(
        sel_ptr, grp_ptr, pages_ptr, r, i, j, ok, n_other, n_groups, s_r, s_i, s_j, GROUPED: tl.constexpr
    ):
        """int64 ``[BJ]``: ``pages[r, j]`` of each block ``j`` that item ``(r, i)`` selects, else 0."""
        s = _selects(sel_ptr, grp_ptr, r, i, j, ok, n_other, n_groups, s_r, s_i, s_j, GROUPED)
        return tl.where(s, tl.load(pages_ptr + r * n_other + j, mask=ok, other=0), 0).to(tl.int64)

    @triton.jit
    def _lengths_kernel(
        sel_ptr,
        grp_ptr,
        full_ptr,
        part_ptr,
        out_ptr,
        n_owner,
        n_other,
        n_groups,
        s_r,
        s_i,
        s_j,
        GROUPED: tl.constexpr,
        BJ: tl.constexpr,
    ):
        item = tl.program_id(0)
        r = (item // n_owner).to(tl.int64)
        i = (item % n_owner).to(tl.int64)
        total = tl.zeros([], tl.int64)
        for j0 in range(0, n_other, BJ):
            j = j0 + tl.arange(0, BJ)
            ok = j < n_other
            s = _selects(sel_ptr, grp_ptr, r, i, j, ok, n_other, n_groups, s_r, s_i, s_j, GROUPED)
            nf = tl.load(full_ptr + r * n_other + j, mask=ok, other=0)
            npart = tl.load(part_ptr + r * n_other + j, mask=ok, other=0)
            total += tl.sum(tl.where(s, nf + npart, 0).to(tl.int64), axis=0)
        tl.store(out_ptr + item, total)

    @triton.jit
    def _write_kernel(
        sel_ptr,
        grp_ptr,
        full_ptr,
        part_ptr,
        rows_ptr,
        start_ptr,
        out_ptr,
        n_owner,
        n_other,
        n_groups,
        s_r,
        s_i,
        s_j,
        capacity,
        row_page_stride,
        P: tl.constexpr,
        SPLIT: tl.constexpr,
        GROUPED: tl.constexpr,
        BJ: tl.constexpr,
    ):
        item = tl.program_id(0)
        r = (item // n_owner).to(tl.int64)
        i = (item % n_owner).to(tl.int64)
        off = tl.load(start_ptr + item)
        base = r * row_page_stride
        # pass 1: full pages (SPLIT) or every live page, block by block
        for j0 in range(0, n_other, BJ):
            j = j0 + tl.arange(0, BJ)
            ok = j < n_other
            n = _selected_pages(
                sel_ptr, grp_ptr, full_ptr, r, i, j, ok, n_other, n_groups, s_r, s_i, s_j, GROUPED
            )
            excl = tl.cumsum(n, axis=0) - n
            for p in tl.static_range(P):
                pos = off + excl + p
                keep = (p < n) & (pos < capacity)
                page = (base + j * P + p).to(tl.int32)
                if SPLIT:
                    tl.store(out_ptr + 2 * pos, page, mask=keep)
                    tl.store(out_ptr + 2 * pos + 1, tl.full([BJ], 0xFFFF, tl.int32), mask=keep)
                else:
                    tl.store(out_ptr + pos, page, mask=keep)
            off += tl.sum(n, axis=0)
        if SPLIT:  # pass 2: the partial page of each selected block, after all full pages
            for j0 in range(0, n_other, BJ):
                j = j0 + tl.arange(0, BJ)
                ok = j < n_other
                n = _selected_pages(
                    sel_ptr, grp_ptr, part_ptr, r, i, j, ok, n_other, n_groups, s_r, s_i, s_j, GROUPED
                )
                pos = off + tl.cumsum(n, axis=0) - n
                keep = (n > 0) & (pos < capacity)
                nf = tl.load(full_ptr + r * n_other + j, mask=ok, other=0)
                rows = tl.load(rows_ptr + r * n_other + j, mask=ok, other=0) % 16
                tl.store(out_ptr + 2 * pos, (base + j * P + nf).to(tl.int32), mask=keep)
                tl.store(out_ptr + 2 * pos + 1, ((1 << rows) - 1).to(tl.int32), mask=keep)
                off += tl.sum(n, axis=0)


def _check(
    sel: torch.Tensor,
    full: torch.Tensor,
    part: torch.Tensor,
    other_group: torch.Tensor | None,
    cuda: bool = False,
):
    if sel.ndim != 3 or full.ndim != 2 or full.shape[0] != sel.shape[0] or part.shape != full.shape:
        raise ValueError(
            f"sel must be [R, owner, other] with full/part [R, other]; got {list(sel.shape)}, "
            f"{list(full.shape)}, {list(part.shape)}"
        )
    if other_group is None and full.shape[1] != sel.shape[2]:
        raise ValueError(
            f"full/part must be [R, {sel.shape[2]}] (sel's other blocks), got {list(full.shape)}"
        )
    if other_group is not None and (other_group.shape != full.shape or other_group.dtype != torch.int32):
        raise ValueError(
            f"other_group must be int32 {list(full.shape)} (full's shape), got {other_group.dtype} "
            f"{list(other_group.shape)}"
        )
    if not cuda and not available(sel):
        raise ValueError(
            f"the Triton stream writers cannot run on {sel.device} (Triton: {triton is not None})"
        )


def _selection_args(sel: torch.Tensor, full: torch.Tensor, other_group: torch.Tensor | None):
    """The kernels' selection arguments: ``(sel as bytes, group pointer, n_other, n_groups, strides...)``."""
    sel_u8 = sel.view(torch.uint8)
    grp = full if other_group is None else other_group  # not read without groups
    return (sel_u8, grp), (full.shape[1], sel.shape[2], *sel_u8.stride())


def stream_lengths(
    sel: torch.Tensor, full: torch.Tensor, part: torch.Tensor, other_group: torch.Tensor | None = None
) -> torch.Tensor:
    """int64 ``[R · owner]``: entries of each item's stream, ``Σ_j sel[r, i, j] · (full + part)[r, j]``.

    Args:
        sel: bool ``[R, owner_blocks, other_blocks]`` (any strides: a transposed view is fine); with
            ``other_group``, ``[R, owner_groups, other_groups]``: item ``(r, i)`` selects block ``j`` when
            ``sel[r, i, other_group[r, j]]`` (a group outside ``[0, other_groups)`` selects nothing).
        full, part: int32 ``[R, other_blocks]``: pages of the first kind (full, or all live) and of the
            second (0 or 1 partial page) of each block of the other side.
        other_group: int32 ``[R, other_blocks]`` or None.
    """
    cuda = _cuda_writer(sel)
    _check(sel, full, part, other_group, cuda)
    if cuda:
        from ..kernels import page_streams as cuda_streams

        return cuda_streams.stream_lengths(sel, full, part, other_group)
    r, n_owner = sel.shape[:2]
    out = torch.empty(r * n_owner, dtype=torch.int64, device=sel.device)
    if out.numel():
        (sel_u8, grp), sizes = _selection_args(sel, full, other_group)
        _lengths_kernel[(r * n_owner,)](
            sel_u8, grp, full, part, out, n_owner, *sizes, GROUPED=other_group is not None, BJ=BLOCK_J
        )
    return out


def write_streams(
    sel: torch.Tensor,
    full: torch.Tensor,
    part: torch.Tensor,
    rows: torch.Tensor | None,
    start: torch.Tensor,
    out: torch.Tensor,
    capacity: int,
    pages_per_block: int,
    row_page_stride: int,
    split_partial: bool,
    other_group: torch.Tensor | None = None,
) -> None:
    """Write every item's stream at ``start[item]`` into ``out``.

    Args:
        sel, full, part, other_group: as :func:`stream_lengths`.
        rows: int32 ``[R, other_blocks]``, valid rows of each block (for the partial pages' masks;
            ``split_partial`` only).
        start: int64 ``[R · owner]``, each item's first entry.
        out: int32 ``[capacity + 1, 2]`` (``split_partial``: (page, mask) pairs) or ``[capacity + 1]``.
        pages_per_block: 16-row pages per block; a page id is
            ``r · row_page_stride + j · pages_per_block + p``.

    The writer is :data:`WRITER`'s (the CUDA kernels, two walks, where they can run; :func:`streams` takes
    ``"cuda_one_walk"``'s one walk).
    """
    cuda = _cuda_writer(sel)
    _check(sel, full, part, other_group, cuda)
    if cuda:
        from ..kernels import page_streams as cuda_streams

        cuda_streams.write_streams(
            sel,
            full,
            part,
            rows,
            start,
            out,
            capacity,
            pages_per_block,
            row_page_stride,
            split_partial,
            other_group,
        )
        return
    r, n_owner = sel.shape[:2]
    if r * n_owner == 0:
        return
    (sel_u8, grp), sizes = _selection_args(sel, full, other_group)
    _write_kernel[(r * n_owner,)](
        sel_u8,
        grp,
        full,
        part,
        full if rows is None else rows,
        start,
        out,
        n_owner,
        *sizes,
        int(capacity),
        int(row_page_stride),
        P=int(pages_per_block),
        SPLIT=bool(split_partial),
        GROUPED=other_group is not None,
        BJ=BLOCK_J,
    )


def streams(
    sel,
    full,
    part,
    rows,
    capacity: int,
    pages_per_block: int,
    row_page_stride: int,
    split_partial: bool,
    other_group=None,
):
    """Every item's stream, counted, placed and written: ``(lengths int64 [R · owner], starts int64
    [R · owner], total int64 [], out)`` with ``out`` int32 ``[capacity + 1, 2]`` (``split_partial``) or
    ``[capacity + 1]``, uninitialised past the written entries. Arguments as :func:`write_streams`."""
    write = write_streams
    if WRITER == "cuda_one_walk" and split_partial and _cuda_writer(sel):  # the lengths with partial counts
        from ..kernels import page_streams as cuda_streams

        _check(sel, full, part, other_group, True)
        lengths, partials = cuda_streams.stream_lengths(sel, full, part, other_group, with_partials=True)
        write = functools.partial(cuda_streams.write_streams, one_walk=(lengths, partials))
    else:
        lengths = stream_lengths(sel, full, part, other_group)
    starts = lengths.cumsum(0) - lengths
    shape = (capacity + 1, 2) if split_partial else (capacity + 1,)
    out = torch.empty(shape, dtype=torch.int32, device=sel.device)
    write(
        sel,
        full,
        part,
        rows,
        starts,
        out,
        capacity,
        pages_per_block,
        row_page_stride,
        split_partial,
        other_group,
    )
    return lengths, starts, lengths.sum(), out
