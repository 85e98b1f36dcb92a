"""The token slots of a partition layout by a counting sort: two Triton passes over the labels, no global sort.

:func:`sparseattn.svg2_device.partition_slots` lays every group out as whole blocks, group after group
in id order, the tokens of a group in token order. Each token's slot is therefore its group's first slot
plus its rank among the group's tokens — a stable counting sort by label. The torch form sorts every row
(a radix sort with its index array, then gathers and a scatter); at SVG2's 720p shapes (40 rows of
75,600 labels) that is about 0.6 ms for 300 groups and 0.9 ms for 1,000.

Here each row is cut into chunks of ``CHUNK`` tokens:

1. :func:`_chunk_counts_kernel` counts each chunk's tokens per group (``counts[n, c, g]``, integer
   atomics into a zeroed array);
2. torch turns the counts into one offset per (chunk, group): the group's first slot, plus its tokens
   in earlier chunks, minus its chunk's tokens of lower groups (two cumulative sums over small arrays);
3. :func:`_chunk_slots_kernel` sorts each chunk's ``label · CHUNK + position`` keys in registers
   (``tl.sort``); the token at sorted position ``p`` of label ``g`` then sits at slot ``offset[c, g] + p``.

Labels outside ``[0, num_groups)`` get slot ``-1`` and count nowhere (the torch form does not check them).

Runs on CUDA tensors (or on the CPU under ``TRITON_INTERPRET=1``, for tests); :func:`available` says
whether it can run on a tensor.
"""

from __future__ import annotations

import torch

from .triton_support import runs_on, tl, triton

#: Tokens per chunk (a power of two): one program's sort.
CHUNK = 2048


def available(labels: torch.Tensor, num_groups: int, chunk: int = CHUNK) -> bool:
    """Whether :func:`token_slots` runs on ``labels``: Triton on its device (CUDA, or the CPU under
    ``TRITON_INTERPRET=1``) and sort keys ``label · chunk + position`` that fit in int32."""
    return runs_on(labels) and (num_groups + 1) * chunk < 2**31


if triton is not None:

    @triton.jit
    def _chunk_counts_kernel(labels_ptr, counts_ptr, tokens, num_groups, chunks, C: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        offs = c * C + tl.arange(0, C)
        ok = offs < tokens
        lab = tl.load(labels_ptr + n * tokens + offs, mask=ok, other=-1)
        ok = ok & (lab >= 0) & (lab < num_groups)
        at = (n * chunks + c) * num_groups + lab.to(tl.int64)
        tl.atomic_add(counts_ptr + at, tl.full((C,), 1, tl.int32), mask=ok, sem="relaxed")

    @triton.jit
    def _chunk_slots_kernel(
        labels_ptr, offset_ptr, slot_ptr, tokens, num_groups, chunks, C: tl.constexpr, LOG_C: tl.constexpr
    ):
        n = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        pos = tl.arange(0, C)
        offs = c * C + pos
        ok = offs < tokens
        lab = tl.load(labels_ptr + n * tokens + offs, mask=ok, other=-1)
        inside = ok & (lab >= 0) & (lab < num_groups)
        # past the row or out of range: group num_groups, after every real group in the sort
        key = tl.where(inside, lab.to(tl.int32), num_groups) * C + pos
        key = tl.sort(key)
        grp = key >> LOG_C
        tok = key & (C - 1)
        real = grp < num_groups
        off = tl.load(offset_ptr + (n * chunks + c) * num_groups + grp.to(tl.int64), mask=real, other=0)
        slot = tl.where(real, off + pos, -1)
        dst = c * C + tok
        tl.store(slot_ptr + n * tokens + dst, slot.to(tl.int64), mask=dst < tokens)


def token_slots(labels: torch.Tensor, num_groups: int, block_size: int, chunk: int = CHUNK):
    """``(token_slot int64 [N, tokens], sizes int64 [N, num_groups])``: each token's slot in the partition
    layout of its row (groups in id order, each padded to whole blocks of ``block_size`` slots, tokens in
    order inside a group) and the tokens per group. ``labels`` int ``[N, tokens]``; a label outside
    ``[0, num_groups)`` gets slot ``-1``. ``chunk``: tokens per program, a power of two (small ones for
    tests). Needs :func:`available`."""
    if not available(labels, num_groups, chunk):
        raise ValueError(
            f"token_slots needs Triton on the labels' device and (num_groups + 1) * chunk < 2**31; got "
            f"{labels.device}, num_groups={num_groups}, chunk={chunk}"
        )
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= 16, got {chunk}")
    n, t = labels.shape
    dev = labels.device
    chunks = max(1, triton.cdiv(t, chunk))
    labels = labels.contiguous()
    counts = torch.zeros(n, chunks, num_groups, dtype=torch.int32, device=dev)
    slot = torch.empty(n, t, dtype=torch.int64, device=dev)
    if n == 0 or t == 0:
        return slot, counts.sum(1, dtype=torch.int64)
    grid = (n, chunks)
    _chunk_counts_kernel[grid](labels, counts, t, num_groups, chunks, C=chunk)
    sizes = counts.sum(1, dtype=torch.int64)  # [N, G]
    blocks = (sizes + (block_size - 1)) // block_size
    group_start = (blocks.cumsum(1) - blocks) * block_size  # [N, G]
    earlier_chunks = counts.cumsum(1, dtype=torch.int64) - counts  # [N, C, G]
    lower_groups = counts.cumsum(2, dtype=torch.int64) - counts  # [N, C, G]
    offset = (group_start.unsqueeze(1) + earlier_chunks - lower_groups).to(torch.int32)
    _chunk_slots_kernel[grid](
        labels, offset, slot, t, num_groups, chunks, C=chunk, LOG_C=chunk.bit_length() - 1
    )
    return slot, sizes
