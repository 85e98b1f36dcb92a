"""SVG2's block mask from its cluster mask in one pass: a Triton kernel that looks each block pair up.

A partition layout lays every cluster out as whole blocks, so block pair ``(i, j)`` is selected exactly
when the pair of their clusters is: ``out[n, i, j] = cluster_mask[n, q_group[n, i], k_group[n, j]]``,
false where a block lies past its row's layout (group ``-1``). :func:`sparseattn.svg2_device.cluster_block_mask`
does this in torch with two ``gather`` calls over index tensors expanded to ``[N, q_blocks,
k_clusters]`` and ``[N, q_blocks, k_blocks]`` and two ``&`` over the result: at SVG2's 720p shape (40 heads,
888 × 1,582 blocks, 300 × 1,000 clusters) about 2.5 ms of the 4.5 ms its layouts and selection take.
:func:`block_mask` writes each output byte once, reading the cluster mask (300 KB per row, cached) by
the two groups.

Runs on CUDA tensors (or on the CPU under ``TRITON_INTERPRET=1``, for tests); :func:`available` says
whether it can run on a tensor.
"""

from __future__ import annotations

import torch

from .triton_support import runs_on, tl, triton

#: Output tile of one program: query blocks × key blocks.
TILE_Q, TILE_K = 16, 256


def available(x: torch.Tensor) -> bool:
    """Whether :func:`block_mask` runs its kernel on ``x``'s device: Triton importable and a CUDA device
    (or the CPU under ``TRITON_INTERPRET=1``)."""
    return runs_on(x)


if triton is not None:

    @triton.jit
    def _block_mask_kernel(
        mask_ptr,
        qg_ptr,
        kg_ptr,
        out_ptr,
        q_blocks,
        k_blocks,
        q_clusters,
        k_clusters,
        BQ: tl.constexpr,
        BK: tl.constexpr,
    ):
        n = tl.program_id(0).to(tl.int64)
        offs_i = tl.program_id(1) * BQ + tl.arange(0, BQ)
        offs_j = tl.program_id(2) * BK + tl.arange(0, BK)
        i_ok = offs_i < q_blocks
        j_ok = offs_j < k_blocks
        qg = tl.load(qg_ptr + n * q_blocks + offs_i, mask=i_ok, other=-1).to(tl.int64)
        kg = tl.load(kg_ptr + n * k_blocks + offs_j, mask=j_ok, other=-1).to(tl.int64)
        # a group outside [0, clusters) selects nothing (-1 past the layout; anything else is not read)
        q_in = (qg >= 0) & (qg < q_clusters)
        k_in = (kg >= 0) & (kg < k_clusters)
        look = q_in[:, None] & k_in[None, :]
        at = n * q_clusters * k_clusters + qg[:, None] * k_clusters + kg[None, :]
        val = tl.load(mask_ptr + at, mask=look, other=0)
        write = i_ok[:, None] & j_ok[None, :]
        tl.store(out_ptr + (n * q_blocks + offs_i[:, None]) * k_blocks + offs_j[None, :], val, mask=write)


def block_mask(cluster_mask: torch.Tensor, q_block_group: torch.Tensor, k_block_group: torch.Tensor):
    """bool ``[N, q_blocks, k_blocks]``: ``cluster_mask`` bool ``[N, q_clusters, k_clusters]`` at each block
    pair's clusters (``q_block_group`` / ``k_block_group`` int ``[N, q_blocks]`` / ``[N, k_blocks]``), false
    where either group is outside its cluster range (``-1``: past the row's layout). Needs
    :func:`available`."""
    if not available(cluster_mask):
        raise ValueError(
            f"block_mask needs Triton and a CUDA tensor, got {cluster_mask.dtype} on {cluster_mask.device}"
        )
    if cluster_mask.dtype != torch.bool or cluster_mask.ndim != 3:
        raise ValueError(
            f"cluster_mask must be bool [N, q_clusters, k_clusters], got {cluster_mask.dtype} "
            f"{list(cluster_mask.shape)}"
        )
    n, cq, ck = cluster_mask.shape
    for name, g in (("q_block_group", q_block_group), ("k_block_group", k_block_group)):
        if g.ndim != 2 or g.shape[0] != n or g.is_floating_point() or g.dtype == torch.bool:
            raise ValueError(f"{name} must be int [{n}, blocks], got {g.dtype} {list(g.shape)}")
        if g.device != cluster_mask.device:
            raise ValueError(f"{name} is on {g.device}, cluster_mask on {cluster_mask.device}")
    a, b = q_block_group.shape[1], k_block_group.shape[1]
    out = torch.empty(n, a, b, dtype=torch.bool, device=cluster_mask.device)
    if out.numel():
        grid = (n, triton.cdiv(a, TILE_Q), triton.cdiv(b, TILE_K))
        _block_mask_kernel[grid](
            cluster_mask.contiguous().view(torch.uint8),
            q_block_group.contiguous(),
            k_block_group.contiguous(),
            out.view(torch.uint8),
            a,
            b,
            cq,
            ck,
            BQ=TILE_Q,
            BK=TILE_K,
        )
    return out
