"""A partition layout's per-group and per-block arrays from its groups' sizes, in two Triton kernels.

:func:`sparseattn.svg2_device.partition_slots` lays each row's groups out one after another, each padded to
whole blocks. From the groups' sizes it needs each group's first slot (a scan over the groups), then for
every block its group (a search of the groups' block ends), its rows and live pages, and the valid slots:
some 18 torch kernels on ``[N, groups]`` and ``[N, max_blocks]`` tensors (at SVG2's 720p K side, 40 rows,
1,000 groups, 1,582 blocks: ~0.12 ms of launches and passes). :func:`group_starts` is one program per row
(the scan); :func:`block_arrays` one program per row and :data:`BLOCKS` blocks, each block's group found by
a bisection over the row's block ends. Integer arithmetic throughout: the torch form's arrays exactly.

Runs on CUDA tensors (or on the CPU under ``TRITON_INTERPRET=1``, for tests); :func:`available` says
whether it can run on a tensor.
"""

from __future__ import annotations

import torch

from .constants import PAGE_ROWS
from .triton_support import runs_on, tl, triton

#: Blocks per program of :func:`block_arrays`.
BLOCKS = 16
#: The most groups a row may have (one program holds a row's sizes).
MAX_GROUPS = 8192


def available(x: torch.Tensor) -> bool:
    """Whether the kernels run on ``x``'s device and size: Triton importable, a CUDA device (or the CPU
    under ``TRITON_INTERPRET=1``) and at most :data:`MAX_GROUPS` groups (``x`` ``[N, groups]``)."""
    return runs_on(x) and x.shape[-1] <= MAX_GROUPS


if triton is not None:

    @triton.jit
    def _group_starts_kernel(
        sizes_ptr,  # int64 [N, G]
        start_ptr,  # int64 [N, G]: each group's first slot
        end_ptr,  # int32 [N, G]: each group's block end (its first block plus its blocks)
        slots_ptr,  # int64 [N]: the row's slots
        groups,
        B: tl.constexpr,
        BLOCK_G: tl.constexpr,
    ):
        n = tl.program_id(0).to(tl.int64)
        g = tl.arange(0, BLOCK_G)
        inside = g < groups
        size = tl.load(sizes_ptr + n * groups + g, mask=inside, other=0)
        blocks = (size + (B - 1)) // B
        end = tl.cumsum(blocks, 0)
        tl.store(start_ptr + n * groups + g, (end - blocks) * B, mask=inside)
        tl.store(end_ptr + n * groups + g, end.to(tl.int32), mask=inside)
        tl.store(slots_ptr + n, tl.sum(blocks, 0) * B)

    @triton.jit
    def _block_arrays_kernel(
        sizes_ptr,  # int64 [N, G]
        end_ptr,  # int32 [N, G]
        group_ptr,  # int64 [N, MB]: each block's group, -1 past the row's blocks
        rows_ptr,  # int64 [N, MB]: valid slots per block
        pages_ptr,  # int64 [N, MB]: live 16-row pages per block
        valid_ptr,  # uint8 [N, MB · B]
        groups,
        max_blocks,
        B: tl.constexpr,
        BR: tl.constexpr,
        PAGE: tl.constexpr,
        BB: tl.constexpr,
        STEPS: tl.constexpr,
    ):
        n = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1) * BB + tl.arange(0, BB)
        in_range = j < max_blocks
        ends = end_ptr + n * groups
        # the group of block j: the number of groups whose block end is <= j (searchsorted, right=True)
        lo = tl.zeros([BB], dtype=tl.int32)
        hi = tl.zeros([BB], dtype=tl.int32) + groups
        for _ in range(STEPS):
            active = lo < hi
            mid = (lo + hi) // 2
            probe = tl.load(ends + mid, mask=active, other=0)
            right = active & (probe <= j)
            lo = tl.where(right, mid + 1, lo)
            hi = tl.where(active & ~right, mid, hi)
        group = lo
        inside = group < groups
        g = tl.minimum(group, groups - 1)
        size = tl.load(sizes_ptr + n * groups + g, mask=in_range, other=0)
        end = tl.load(ends + g, mask=in_range, other=0)
        first = end - (size + (B - 1)) // B
        rows = tl.minimum(tl.maximum(size - (j - first).to(tl.int64) * B, 0), B)
        rows = tl.where(inside, rows, 0)
        out = n * max_blocks + j
        tl.store(group_ptr + out, tl.where(inside, group.to(tl.int64), -1), mask=in_range)
        tl.store(rows_ptr + out, rows, mask=in_range)
        tl.store(pages_ptr + out, (rows + (PAGE - 1)) // PAGE, mask=in_range)
        r = tl.arange(0, BR)  # a block's slots (BR: B up to a power of two)
        slot = out[:, None] * B + r[None, :]
        keep = in_range[:, None] & (r[None, :] < B)
        tl.store(valid_ptr + slot, (r[None, :] < rows[:, None]).to(tl.uint8), mask=keep)


def group_starts(sizes: torch.Tensor, block_size: int):
    """``(start int64 [N, G], end int32 [N, G], num_slots int64 [N])`` of groups of ``sizes`` int64 ``[N, G]``
    laid out in id order, each padded to whole blocks of ``block_size``: each group's first slot, its block
    end (first block plus its blocks) and each row's slots. Needs :func:`available`."""
    n, groups = sizes.shape
    sizes = sizes.contiguous()
    start = torch.empty(n, groups, dtype=torch.int64, device=sizes.device)
    end = torch.empty(n, groups, dtype=torch.int32, device=sizes.device)
    slots = torch.empty(n, dtype=torch.int64, device=sizes.device)
    if n and groups:
        block_g = max(16, triton.next_power_of_2(groups))
        _group_starts_kernel[(n,)](
            sizes,
            start,
            end,
            slots,
            groups,
            B=block_size,
            BLOCK_G=block_g,
            num_warps=4 if block_g <= 2048 else 8,
        )
    return start, end, slots


def block_arrays(sizes: torch.Tensor, end: torch.Tensor, block_size: int, max_blocks: int):
    """``(block_group, block_rows, block_pages, valid)`` of :class:`~sparseattn.svg2_device.DeviceLayout` from
    the groups' ``sizes`` int64 ``[N, G]`` and block ends ``end`` int32 ``[N, G]`` (:func:`group_starts`):
    int64 ``[N, max_blocks]`` each (group -1 and 0 rows past the row's blocks) and ``valid`` bool ``[N,
    max_blocks · block_size]``. Needs :func:`available`."""
    n, groups = sizes.shape
    dev = sizes.device
    block_group = torch.empty(n, max_blocks, dtype=torch.int64, device=dev)
    block_rows = torch.empty_like(block_group)
    block_pages = torch.empty_like(block_group)
    valid = torch.empty(n, max_blocks * block_size, dtype=torch.bool, device=dev)
    if n and max_blocks:
        _block_arrays_kernel[(n, triton.cdiv(max_blocks, BLOCKS))](
            sizes.contiguous(),
            end.contiguous(),
            block_group,
            block_rows,
            block_pages,
            valid.view(torch.uint8),
            groups,
            max_blocks,
            B=block_size,
            BR=triton.next_power_of_2(block_size),
            PAGE=PAGE_ROWS,
            BB=BLOCKS,
            STEPS=max(1, groups.bit_length()),
        )
    return block_group, block_rows, block_pages, valid
