"""The forward work list's per-item arrays in Triton: what :func:`.dynamic_layouts._forward_items` computes in
torch (some 40 small operations on ``[R, q_blocks]`` tensors), written by one kernel.

:func:`items` writes, for every item (row ``r``, Q block ``i``), its own pages ``own_entries``, its
``work_info`` (row, stream start, stream length, M) and its sort key (``-cost``); by groups it also takes
each block's stream from its Q group's (:func:`.dynamic_layouts.cluster_forward_work_list`: zero where the
block has no rows or its group is outside ``[0, groups)``). :func:`live_groups` writes the selection by
groups of the groups that hold a live block (the cluster mask where the Q group has a block with rows,
else false). The order (a stable sort of each row's keys) stays in torch. The kernels run where
:func:`.page_streams.available` says Triton runs (CUDA, or the CPU under ``TRITON_INTERPRET=1``); the
same bytes as the torch form (``SPARSEATTN_PLAN_ITEMS``, :data:`.dynamic_layouts.ITEMS`).
"""

from __future__ import annotations

import torch

from ..constants import PAGE_ROWS
from ..triton_support import tl, triton
from .work_list import OWN_PAGES

#: Q blocks per program of the items kernel, and per step of the live-groups kernel.
BLOCK_Q = 128
#: Q groups per program of the live-groups kernel, and K groups per step of its copy of the mask.
BLOCK_G = 32
BLOCK_K = 128

if triton is not None:

    @triton.jit
    def _items_kernel(
        q_rows_ptr,
        len_ptr,
        start_ptr,
        grp_ptr,
        own_ptr,
        info_ptr,
        key_ptr,
        nq,
        n_groups,
        P: tl.constexpr,
        PAGE: tl.constexpr,
        OWN: tl.constexpr,
        CHUNK_PAGES: tl.constexpr,
        GROUPED: tl.constexpr,
        BQ: tl.constexpr,
    ):
        r = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1).to(tl.int64) * BQ + tl.arange(0, BQ)
        ok = i < nq
        item = r * nq + i
        q = tl.load(q_rows_ptr + item, mask=ok, other=0).to(tl.int64)
        if GROUPED:
            g = tl.load(grp_ptr + item, mask=ok, other=-1).to(tl.int64)
            has = ok & (q > 0) & (g >= 0) & (g < n_groups)
            flat = r * n_groups + g
            length = tl.load(len_ptr + flat, mask=has, other=0).to(tl.int64)
            start = tl.load(start_ptr + flat, mask=has, other=0).to(tl.int64)
        else:
            length = tl.load(len_ptr + item, mask=ok, other=0).to(tl.int64)
            start = tl.load(start_ptr + item, mask=ok, other=0).to(tl.int64)
        # own pages: the block's live pages with their row masks, (-1, 0) past them
        q_live = (q + (PAGE - 1)) // PAGE
        slot = tl.arange(0, OWN).to(tl.int64)
        live = slot[None, :] < q_live[:, None]
        page = tl.where(live, i[:, None] * P + slot[None, :], -1)
        rows = tl.minimum(tl.maximum(q[:, None] - slot[None, :] * PAGE, 0), PAGE)
        bits = tl.where(live, (tl.full(rows.shape, 1, tl.int64) << rows) - 1, 0)
        own = own_ptr + item[:, None] * (2 * OWN) + slot[None, :] * 2
        tl.store(own, page.to(tl.int32), mask=ok[:, None])
        tl.store(own + 1, bits.to(tl.int32), mask=ok[:, None])
        m = tl.where(q_live <= OWN // 2, 64, 128).to(tl.int64)
        info = info_ptr + item * 4
        tl.store(info, (tl.zeros_like(i) + r).to(tl.int32), mask=ok)
        tl.store(info + 1, start.to(tl.int32), mask=ok)
        tl.store(info + 2, length.to(tl.int32), mask=ok)
        tl.store(info + 3, m.to(tl.int32), mask=ok)
        cost = m * ((length + (CHUNK_PAGES - 1)) // CHUNK_PAGES)
        tl.store(key_ptr + item, (-cost).to(key_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _live_groups_kernel(
        mask_ptr,
        q_rows_ptr,
        grp_ptr,
        out_ptr,
        nq,
        n_groups,
        n_k,
        s_r,
        s_g,
        s_k,
        BQ: tl.constexpr,
        BG: tl.constexpr,
        BK: tl.constexpr,
    ):
        r = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1).to(tl.int64) * BG + tl.arange(0, BG)
        g_ok = g < n_groups
        live = tl.zeros([BG], tl.int32)
        for i0 in range(0, nq, BQ):  # each group of the program: whether a block with rows has it
            i = i0 + tl.arange(0, BQ)
            ok = i < nq
            q = tl.load(q_rows_ptr + r * nq + i, mask=ok, other=0)
            grp = tl.load(grp_ptr + r * nq + i, mask=ok, other=-1).to(tl.int64)
            grp = tl.where(q > 0, grp, -1)
            live += tl.sum((grp[:, None] == g[None, :]).to(tl.int32), axis=0)
        keep = g_ok & (live > 0)
        for k0 in range(0, n_k, BK):
            k = k0 + tl.arange(0, BK)
            ok = g_ok[:, None] & (k < n_k)[None, :]
            sel = tl.load(mask_ptr + r * s_r + g[:, None] * s_g + k[None, :] * s_k, mask=ok, other=0)
            out = ((sel != 0) & keep[:, None]).to(tl.uint8)
            tl.store(out_ptr + (r * n_groups + g[:, None]) * n_k + k[None, :], out, mask=ok)


def live_groups(
    cluster_mask: torch.Tensor, q_rows: torch.Tensor, q_block_group: torch.Tensor
) -> torch.Tensor:
    """bool ``[R, q_groups, k_groups]`` (contiguous): ``cluster_mask`` where the Q group holds a block with
    rows (``q_rows[r, i] > 0`` and ``q_block_group[r, i]`` the group), else false."""
    r, nqg, nkg = cluster_mask.shape
    out = torch.empty((r, nqg, nkg), dtype=torch.bool, device=cluster_mask.device)
    if out.numel():
        sel = cluster_mask.view(torch.uint8)
        _live_groups_kernel[(r, triton.cdiv(nqg, BLOCK_G))](
            sel,
            q_rows.contiguous(),
            q_block_group.contiguous(),
            out.view(torch.uint8),
            q_rows.shape[1],
            nqg,
            nkg,
            *sel.stride(),
            BQ=BLOCK_Q,
            BG=BLOCK_G,
            BK=BLOCK_K,
        )
    return out


def items(
    q_rows: torch.Tensor,
    lengths: torch.Tensor,
    starts: torch.Tensor,
    pages_per_block: int,
    chunk: int,
    key_dtype: torch.dtype,
    q_block_group: torch.Tensor | None = None,
    n_groups: int = 0,
):
    """``(own_entries int32 [W, 8, 2], work_info int32 [W, 4], key [W])`` of the items ``W = R · q_blocks``,
    ``key`` (``key_dtype``) the negated cost ``M · ceil(length / (chunk / 16))``.

    Args:
        q_rows: int ``[R, q_blocks]``, each Q block's rows (clamped to the block).
        lengths, starts: int64, each item's stream length and first entry (``[R · q_blocks]``); with
            ``q_block_group``, each Q group's (``[R · q_groups]``), taken by the blocks of the group that
            have rows (the others stream nothing).
        q_block_group: int ``[R, q_blocks]`` or None; ``n_groups`` its groups (Q groups).
    """
    r, nq = q_rows.shape
    dev = q_rows.device
    own = torch.empty((r * nq, OWN_PAGES, 2), dtype=torch.int32, device=dev)
    info = torch.empty((r * nq, 4), dtype=torch.int32, device=dev)
    key = torch.empty(r * nq, dtype=key_dtype, device=dev)
    if r * nq:
        grouped = q_block_group is not None
        _items_kernel[(r, triton.cdiv(nq, BLOCK_Q))](
            q_rows.contiguous(),
            lengths.contiguous(),
            starts.contiguous(),
            (q_block_group if grouped else q_rows).contiguous(),
            own,
            info,
            key,
            nq,
            int(n_groups) if grouped else nq,
            P=int(pages_per_block),
            PAGE=PAGE_ROWS,
            OWN=OWN_PAGES,
            CHUNK_PAGES=chunk // PAGE_ROWS,
            GROUPED=grouped,
            BQ=BLOCK_Q,
        )
    return own, info, key
