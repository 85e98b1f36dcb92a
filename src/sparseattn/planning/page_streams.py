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

Two launch forms (:data:`FORM`, ``SPARSEATTN_PAGE_STREAMS``): ``"item"`` (the default) runs one program per
item, which walks the other side's blocks ``BLOCK_J`` at a time; ``"chunks"`` runs one program per item
and ``BLOCK_J``-block chunk, each placing its chunk's entries at offsets from a prefix sum over the chunks'
counts (:func:`chunk_streams`): no serial walk, ``ceil(blocks / BLOCK_J)`` times the programs. Both write
the same entries.

Entries past ``capacity`` go nowhere (the callers count them in their status). The kernels need CUDA
tensors, or CPU tensors under ``TRITON_INTERPRET=1`` (tests); :func:`available` says which.
"""

from __future__ import annotations

import os

import torch

from ..constants import PAGE_ROWS
from ..triton_support import runs_on, tl, triton

#: Blocks of the other side read per step of a program (per program in the "chunks" form).
BLOCK_J = 256
FULL_MASK = (1 << PAGE_ROWS) - 1
FORMS = ("item", "chunks")
#: The launch form :func:`streams` takes (one of FORMS).
FORM = os.environ.get("SPARSEATTN_PAGE_STREAMS") or "item"


def available(x: torch.Tensor) -> bool:
    """Whether the Triton stream writers can run on ``x``'s device."""
    return runs_on(x)


if triton is not None:

    @triton.jit
    def _selected_pages(sel_ptr, pages_ptr, r, i, j, ok, n_other, s_r, s_i, s_j):
        """int64 ``[BJ]``: ``pages[r, j]`` of each block ``j`` that item ``(r, i)`` selects, else 0."""
        s = tl.load(sel_ptr + r * s_r + i * s_i + j * s_j, mask=ok, other=0) != 0
        return tl.where(s, tl.load(pages_ptr + r * n_other + j, mask=ok, other=0), 0).to(tl.int64)

    @triton.jit
    def _write_partial_pages(
        out_ptr, full_ptr, rows_ptr, m, pos, base, r, j, ok, n_other, capacity, P: tl.constexpr
    ):
        """The partial page of each block with ``m`` > 0 at ``pos``: its id (after the block's full pages)
        and its row mask, as an int32 pair."""
        keep = (m > 0) & (pos < capacity)
        nf = tl.load(full_ptr + r * n_other + j, mask=ok, other=0)
        rows = tl.load(rows_ptr + r * n_other + j, mask=ok, other=0) % 16
        tl.store(out_ptr + 2 * pos, (base + j * P + nf).to(tl.int32), mask=keep)
        tl.store(out_ptr + 2 * pos + 1, ((1 << rows) - 1).to(tl.int32), mask=keep)

    @triton.jit
    def _lengths_kernel(
        sel_ptr, full_ptr, part_ptr, out_ptr, n_owner, n_other, s_r, s_i, s_j, BJ: tl.constexpr
    ):
        item = tl.program_id(0)
        r = (item // n_owner).to(tl.int64)
        i = (item % n_owner).to(tl.int64)
        total = tl.zeros([], tl.int64)
        for j0 in range(0, n_other, BJ):
            j = j0 + tl.arange(0, BJ)
            ok = j < n_other
            s = tl.load(sel_ptr + r * s_r + i * s_i + j * s_j, mask=ok, other=0) != 0
            nf = tl.load(full_ptr + r * n_other + j, mask=ok, other=0)
            npart = tl.load(part_ptr + r * n_other + j, mask=ok, other=0)
            total += tl.sum(tl.where(s, nf + npart, 0).to(tl.int64), axis=0)
        tl.store(out_ptr + item, total)

    @triton.jit
    def _write_kernel(
        sel_ptr,
        full_ptr,
        part_ptr,
        rows_ptr,
        start_ptr,
        out_ptr,
        n_owner,
        n_other,
        s_r,
        s_i,
        s_j,
        capacity,
        row_page_stride,
        P: tl.constexpr,
        SPLIT: tl.constexpr,
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
            n = _selected_pages(sel_ptr, full_ptr, r, i, j, ok, n_other, s_r, s_i, s_j)
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
                n = _selected_pages(sel_ptr, part_ptr, r, i, j, ok, n_other, s_r, s_i, s_j)
                pos = off + tl.cumsum(n, axis=0) - n
                _write_partial_pages(
                    out_ptr, full_ptr, rows_ptr, n, pos, base, r, j, ok, n_other, capacity, P
                )
                off += tl.sum(n, axis=0)


if triton is not None:

    @triton.jit
    def _chunk_counts_kernel(
        sel_ptr, full_ptr, part_ptr, nf_ptr, np_ptr, n_owner, n_other, chunks, s_r, s_i, s_j, BJ: tl.constexpr
    ):
        item = tl.program_id(0)
        c = tl.program_id(1)
        r = (item // n_owner).to(tl.int64)
        i = (item % n_owner).to(tl.int64)
        j = c * BJ + tl.arange(0, BJ)
        ok = j < n_other
        at = item.to(tl.int64) * chunks + c
        nf = _selected_pages(sel_ptr, full_ptr, r, i, j, ok, n_other, s_r, s_i, s_j)
        tl.store(nf_ptr + at, tl.sum(nf, axis=0))
        tl.store(
            np_ptr + at,
            tl.sum(_selected_pages(sel_ptr, part_ptr, r, i, j, ok, n_other, s_r, s_i, s_j), axis=0),
        )

    @triton.jit
    def _chunk_write_kernel(
        sel_ptr,
        full_ptr,
        part_ptr,
        rows_ptr,
        off_full_ptr,
        off_part_ptr,
        out_ptr,
        n_owner,
        n_other,
        chunks,
        s_r,
        s_i,
        s_j,
        capacity,
        row_page_stride,
        P: tl.constexpr,
        PP: tl.constexpr,
        SPLIT: tl.constexpr,
        BJ: tl.constexpr,
    ):
        item = tl.program_id(0)
        c = tl.program_id(1)
        r = (item // n_owner).to(tl.int64)
        i = (item % n_owner).to(tl.int64)
        at = item.to(tl.int64) * chunks + c
        base = r * row_page_stride
        j = c * BJ + tl.arange(0, BJ)
        ok = j < n_other
        # the chunk's full pages (SPLIT) or every live page, a block's pages on neighbouring lanes
        n = _selected_pages(sel_ptr, full_ptr, r, i, j, ok, n_other, s_r, s_i, s_j)
        pp = tl.arange(0, PP)
        pos = tl.load(off_full_ptr + at) + (tl.cumsum(n, axis=0) - n)[:, None] + pp[None, :]
        keep = (pp[None, :] < n[:, None]) & (pos < capacity)
        page = (base + j[:, None] * P + pp[None, :]).to(tl.int32)
        if SPLIT:
            tl.store(out_ptr + 2 * pos, page, mask=keep)
            tl.store(out_ptr + 2 * pos + 1, tl.full([BJ, PP], 0xFFFF, tl.int32), mask=keep)
            # the chunk's partial pages, after every full page of the item
            m = _selected_pages(sel_ptr, part_ptr, r, i, j, ok, n_other, s_r, s_i, s_j)
            pos = tl.load(off_part_ptr + at) + tl.cumsum(m, axis=0) - m
            _write_partial_pages(out_ptr, full_ptr, rows_ptr, m, pos, base, r, j, ok, n_other, capacity, P)
        else:
            tl.store(out_ptr + pos, page, mask=keep)


def _check(sel: torch.Tensor, full: torch.Tensor, part: torch.Tensor):
    if sel.ndim != 3 or full.shape != (sel.shape[0], sel.shape[2]) or part.shape != full.shape:
        raise ValueError(
            f"sel must be [R, owner, other] with full/part [R, other]; got {list(sel.shape)}, "
            f"{list(full.shape)}, {list(part.shape)}"
        )
    if not available(sel):
        raise ValueError(
            f"the Triton stream writers cannot run on {sel.device} (Triton: {triton is not None})"
        )


def stream_lengths(sel: torch.Tensor, full: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """int64 ``[R · owner]``: entries of each item's stream, ``Σ_j sel[r, i, j] · (full + part)[r, j]``.

    Args:
        sel: bool ``[R, owner_blocks, other_blocks]`` (any strides: a transposed view is fine).
        full, part: int32 ``[R, other_blocks]``: pages of the first kind (full, or all live) and of the
            second (0 or 1 partial page) of each block of the other side.
    """
    _check(sel, full, part)
    r, n_owner, n_other = sel.shape
    out = torch.empty(r * n_owner, dtype=torch.int64, device=sel.device)
    if out.numel():
        sel_u8 = sel.view(torch.uint8)
        _lengths_kernel[(r * n_owner,)](
            sel_u8, full, part, out, n_owner, n_other, *sel_u8.stride(), BJ=BLOCK_J
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
) -> None:
    """Write every item's stream at ``start[item]`` into ``out``.

    Args:
        sel, full, part: as :func:`stream_lengths`.
        rows: int32 ``[R, other_blocks]``, valid rows of each block (for the partial pages' masks;
            ``split_partial`` only).
        start: int64 ``[R · owner]``, each item's first entry.
        out: int32 ``[capacity + 1, 2]`` (``split_partial``: (page, mask) pairs) or ``[capacity + 1]``.
        pages_per_block: 16-row pages per block; a page id is
            ``r · row_page_stride + j · pages_per_block + p``.
    """
    _check(sel, full, part)
    r, n_owner, n_other = sel.shape
    if r * n_owner == 0:
        return
    sel_u8 = sel.view(torch.uint8)
    _write_kernel[(r * n_owner,)](
        sel_u8,
        full,
        part,
        full if rows is None else rows,
        start,
        out,
        n_owner,
        n_other,
        *sel_u8.stride(),
        int(capacity),
        int(row_page_stride),
        P=int(pages_per_block),
        SPLIT=bool(split_partial),
        BJ=BLOCK_J,
    )


def _stream_out(capacity: int, split_partial: bool, device) -> torch.Tensor:
    """The streams' uninitialised int32 output: ``[capacity + 1, 2]`` (page, mask) pairs or ``[capacity + 1]``."""
    shape = (capacity + 1, 2) if split_partial else (capacity + 1,)
    return torch.empty(shape, dtype=torch.int32, device=device)


def streams(
    sel, full, part, rows, capacity: int, pages_per_block: int, row_page_stride: int, split_partial: bool
):
    """Every item's stream, counted, placed and written: ``(lengths int64 [R · owner], starts int64
    [R · owner], total int64 [], out)`` with ``out`` int32 ``[capacity + 1, 2]`` (``split_partial``) or
    ``[capacity + 1]``, uninitialised past the written entries. Arguments as :func:`write_streams`."""
    if FORM not in FORMS:
        raise ValueError(f"page_streams.FORM (SPARSEATTN_PAGE_STREAMS) must be one of {FORMS}, got {FORM!r}")
    if FORM == "chunks":
        return chunk_streams(sel, full, part, rows, capacity, pages_per_block, row_page_stride, split_partial)
    lengths = stream_lengths(sel, full, part)
    starts = lengths.cumsum(0) - lengths
    out = _stream_out(capacity, split_partial, sel.device)
    write_streams(
        sel, full, part, rows, starts, out, capacity, pages_per_block, row_page_stride, split_partial
    )
    return lengths, starts, lengths.sum(), out


def chunk_streams(
    sel, full, part, rows, capacity: int, pages_per_block: int, row_page_stride: int, split_partial: bool
):
    """:func:`streams` in the "chunks" form: one program per (item, ``BLOCK_J``-block chunk) counts its
    chunk's full and partial pages, prefix sums over the chunks place them (an item's full pages first,
    then its partial ones), and one program per (item, chunk) writes them. Same results as :func:`streams`."""
    _check(sel, full, part)
    r, n_owner, n_other = sel.shape
    items, chunks = r * n_owner, max(1, triton.cdiv(n_other, BLOCK_J))
    dev = sel.device
    out = _stream_out(capacity, split_partial, dev)
    if items == 0:
        lengths = torch.zeros(0, dtype=torch.int64, device=dev)
        return lengths, lengths, lengths.sum(), out
    sel_u8 = sel.view(torch.uint8)
    counts = torch.empty(2, items, chunks, dtype=torch.int64, device=dev)  # full, partial
    grid = (items, chunks)
    _chunk_counts_kernel[grid](
        sel_u8, full, part, counts[0], counts[1], n_owner, n_other, chunks, *sel_u8.stride(), BJ=BLOCK_J
    )
    n_full = counts[0].sum(1)  # [items]
    lengths = n_full + counts[1].sum(1)
    starts = lengths.cumsum(0) - lengths
    earlier = counts.cumsum(2) - counts  # [2, items, chunks]: the item's entries of earlier chunks
    off_full = starts[:, None] + earlier[0]
    off_part = (starts + n_full)[:, None] + earlier[1]
    _chunk_write_kernel[grid](
        sel_u8,
        full,
        part,
        full if rows is None else rows,
        off_full,
        off_part,
        out,
        n_owner,
        n_other,
        chunks,
        *sel_u8.stride(),
        int(capacity),
        int(row_page_stride),
        P=int(pages_per_block),
        PP=triton.next_power_of_2(int(pages_per_block)),
        SPLIT=bool(split_partial),
        BJ=BLOCK_J,
    )
    return lengths, starts, lengths.sum(), out
