"""VSA's per-block top-k, one Triton program per Q block: the ``k`` largest scores of a row by bisection on
their bit patterns, the chosen K blocks written in ascending block order.

:func:`sparseattn.torch.vsa_topk` scores every Q cube against every K cube ``[batch, heads, blocks,
blocks]`` (float32) and keeps each row's ``k`` largest. ``torch.topk`` does that by a multi-pass radix
select that clears counters each call and gathers sorted values: at the Wan2.1-1.3B shape (12 heads,
H100) 0.2 ms of kernels per call at 480p (624 cubes, top 63) and 0.8 ms at 720p (1,440, top 144), as much
as the cube means, the scores and the planner together. Here a program holds one row in registers and
builds the ``k``-th largest value's order-preserving integer key bit by bit from the top (each step a
count over the row), stopping as soon as exactly ``k`` keys lie at or above the prefix found so far (on
distinct scores after about log2(blocks) + a few steps instead of 32). It writes the row's indices once:
every value above the threshold, and of the values equal to it the lowest-index ones until ``k``
(``torch.topk`` breaks such ties in no stated order). The scores are the same tensor either way, so the
two pick the same values; only their order differs (``torch.topk`` sorts by value).

Runs on CUDA tensors (or on the CPU under ``TRITON_INTERPRET=1``, for tests); :func:`available` says
whether it can run on a tensor.
"""

from __future__ import annotations

import torch

from .triton_support import runs_on, tl, triton

#: The most blocks one program holds (a row of scores in registers).
MAX_BLOCKS = 8192


def available(scores: torch.Tensor) -> bool:
    """Whether :func:`row_topk` runs its kernel on ``scores``: Triton importable, a CUDA device (or the CPU
    under ``TRITON_INTERPRET=1``) and at most :data:`MAX_BLOCKS` columns."""
    return runs_on(scores) and scores.shape[-1] <= MAX_BLOCKS


if triton is not None:

    @triton.jit
    def _row_topk_kernel(
        scores_ptr,  # float32 [rows, cols]
        live_ptr,  # uint8 [cols]: whether column j may be chosen
        out_ptr,  # int32 [rows, kept]
        cols,
        kept,
        BLOCK: tl.constexpr,
    ):
        # (one warp per 1,024 columns: each step's count is then mostly a warp's shuffles)
        row = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, BLOCK)
        in_row = j < cols
        live = (tl.load(live_ptr + j, mask=in_row, other=0) != 0) & in_row
        bits = tl.load(scores_ptr + row * cols + j, mask=in_row, other=0.0).to(tl.int32, bitcast=True)
        # int32 keys in the floats' order (flip the magnitude bits of negative values); a column that may
        # not be chosen gets the lowest key, below every threshold tried
        key = tl.where(live, tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF), -2147483648)
        # the threshold t in unsigned form (key + 2^31), one bit at a time from the top: the largest t with
        # count(key >= t) >= kept, or any t with exactly kept keys at or above it
        t = tl.zeros((), tl.int64)
        count = tl.sum(live.to(tl.int32), 0)
        b = 31
        while (b >= 0) & (count != kept):
            cand = t | (tl.full((), 1, tl.int64) << b)
            c = tl.sum((key >= (cand - 2147483648).to(tl.int32)).to(tl.int32), 0)
            t = tl.where(c >= kept, cand, t)
            count = tl.where(c >= kept, c, count)
            b -= 1
        t32 = (t - 2147483648).to(tl.int32)
        tied = key == t32
        need = kept - tl.sum((key > t32).to(tl.int32), 0)
        chosen = (key > t32) | (tied & (tl.cumsum(tied.to(tl.int32), 0) <= need))
        chosen = tl.where(count == kept, key >= t32, chosen) & live
        pos = tl.cumsum(chosen.to(tl.int32), 0) - 1
        tl.store(out_ptr + row * kept + pos, j, mask=chosen)


def row_topk(scores: torch.Tensor, live: torch.Tensor, kept: int) -> torch.Tensor:
    """int32 ``[..., kept]``: per row of float32 ``scores [..., cols]``, the indices of its ``kept``
    largest values among the columns where bool ``live [cols]`` holds, in ascending index order (of equal
    values at the boundary, the lowest indices). ``kept`` must not exceed the live columns (not checked:
    counting them would synchronise; a row's entries past its live columns are left unwritten).
    Needs :func:`available`."""
    if not available(scores):
        raise ValueError(
            f"row_topk needs Triton, a CUDA tensor and at most {MAX_BLOCKS} columns, got "
            f"{list(scores.shape)} on {scores.device}"
        )
    if scores.dtype != torch.float32:
        raise ValueError(f"scores must be float32, got {scores.dtype}")
    cols = scores.shape[-1]
    if live.shape != (cols,) or live.dtype != torch.bool:
        raise ValueError(f"live must be bool [{cols}], got {live.dtype} {list(live.shape)}")
    if not 0 <= kept <= cols:
        raise ValueError(f"kept must be in [0, {cols}], got {kept}")
    scores = scores.contiguous()
    out = torch.empty(*scores.shape[:-1], kept, dtype=torch.int32, device=scores.device)
    rows = scores.numel() // max(cols, 1)
    if kept and rows:
        block = max(16, triton.next_power_of_2(cols))
        _row_topk_kernel[(rows,)](
            scores, live.view(torch.uint8), out, cols, kept, BLOCK=block, num_warps=max(1, block // 1024)
        )
    return out


# ---- per-block sums of token-ordered rows (the selection without moving q and k into slot order) ----------

if triton is not None:

    @triton.jit
    def _token_block_sums_kernel(
        x_ptr,  # [batch, tokens, heads, D] (any float dtype)
        map_ptr,  # int32 [blocks * BS]: the token of each slot, -1 for padding
        out_ptr,  # float32 [batch, heads, blocks, D]
        tokens,
        heads,
        blocks,
        D: tl.constexpr,
        BS: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)  # (batch, head, block), block fastest
        blk = pid % blocks
        bh = pid // blocks
        h = bh % heads
        b = bh // heads
        tok = tl.load(map_ptr + blk * BS + tl.arange(0, BS)).to(tl.int64)
        cols = tl.arange(0, D)
        rows = (b * tokens + tok) * heads + h
        x = tl.load(x_ptr + rows[:, None] * D + cols[None, :], mask=(tok >= 0)[:, None], other=0.0)
        tl.store(out_ptr + pid * D + cols, tl.sum(x.to(tl.float32), 0))


def token_block_sums(x: torch.Tensor, slot_token: torch.Tensor, block_size: int) -> torch.Tensor:
    """float32 ``[batch, heads, blocks, d]``: per block of a layout, the sum of its valid tokens' rows of
    token-ordered ``x [batch, tokens, heads, d]``; ``slot_token``: int32 ``[blocks · block_size]``, the token
    of each slot (-1 for padding: ``BlockLayout.slot_token``). ``block_size`` and ``d`` powers of two. What
    ``x`` moved into slot order and summed per block gives, without the move (sums in another order: equal
    to float32 rounding). Needs :func:`sparseattn.triton_support.runs_on` ``(x)``."""
    if not runs_on(x):
        raise ValueError(f"token_block_sums needs Triton and a CUDA tensor, got one on {x.device}")
    if x.dim() != 4:
        raise ValueError(f"x must be [batch, tokens, heads, d], got {list(x.shape)}")
    b, n, h, d = x.shape
    slots = slot_token.numel()
    if slot_token.dtype != torch.int32 or slot_token.dim() != 1 or slots % block_size:
        raise ValueError(
            f"slot_token must be int32 [blocks * {block_size}], got {slot_token.dtype} {list(slot_token.shape)}"
        )
    for name, value in (("block_size", block_size), ("d", d)):
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two, got {value}")
    blocks = slots // block_size
    x, slot_token = x.contiguous(), slot_token.contiguous()
    out = torch.empty(b, h, blocks, d, dtype=torch.float32, device=x.device)
    if out.numel():
        _token_block_sums_kernel[(b * h * blocks,)](x, slot_token, out, n, h, blocks, D=d, BS=block_size)
    return out
