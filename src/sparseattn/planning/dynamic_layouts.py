"""Forward work lists of per-head layouts made per call (SVG2), built in torch on the tensors' device.

The device planner (:mod:`.device`) plans a selection over layouts fixed at the call site. SVG2 makes new
layouts every call: per row (batch entry × head) its k-means clusters, each padded to whole blocks
(:func:`sparseattn.svg2_device.partition_slots`, a :class:`~sparseattn.svg2_device.DeviceLayout` of
static shape). What the forward kernel needs of a layout is per-block: how many rows a block holds, as a
prefix (so its live 16-row pages and their row masks). :func:`forward_work_list` takes those counts and a
block mask and writes the paged forward kernel's work list (:class:`~.work_list.WorkList`'s arrays) with
torch operations: one item per (row, Q block); its own pages the block's live pages; its stream the live
K pages of every block it selects, full pages first and each block's partial page last (KPage's packing
across blocks); items taken head by head, largest first.

Every shape is static (``rows × q_blocks`` items; ``capacity`` stream entries), nothing synchronises with
the host, and a stream that would pass ``capacity`` is cut and counted in ``status`` (check it with
:func:`check_status`). Rows are processed ``rows_per_chunk`` at a time, bounding the temporary
``[rows, q_blocks, k_blocks, pages]`` index tensors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..constants import PAGE_ROWS
from . import forward_items, page_streams
from .work_list import OWN_PAGES

#: Keys per chunk of the work lists made here (the forward kernel's 128-key chunks).
CHUNK = 128
FULL_MASK = (1 << PAGE_ROWS) - 1
ITEMS_FORMS = ("torch", "triton")
#: Who computes the forward work lists' per-item arrays (own pages, ``work_info``, the sort keys, and by
#: clusters each block's stream from its group's), one of :data:`ITEMS_FORMS`, read at each call of
#: :func:`forward_work_list` and :func:`cluster_forward_work_list`: ``"triton"`` (the default) two Triton
#: kernels (:mod:`.forward_items`, where :func:`.page_streams.available` says Triton runs; elsewhere torch);
#: ``"torch"`` some 60 small torch operations. The same bytes; at SVG2's 720p call (H100) the forward plan by
#: clusters 0.57 → 0.41 ms (NOTES_svg2_device.md v41).
ITEMS = os.environ.get("SPARSEATTN_PLAN_ITEMS") or "triton"


def _triton_items(x: torch.Tensor) -> bool:
    """Whether the per-item arrays are written by :mod:`.forward_items`: :data:`ITEMS` is ``"triton"``
    (checked first: another value than :data:`ITEMS_FORMS` raises) and Triton runs on ``x``."""
    items = ITEMS
    if items not in ITEMS_FORMS:
        raise ValueError(
            f"dynamic_layouts.ITEMS (SPARSEATTN_PLAN_ITEMS) must be one of {ITEMS_FORMS}, got {items!r}"
        )
    return items == "triton" and page_streams.available(x)


@dataclass(frozen=True, eq=False)
class DynamicWorkList:
    """A forward work list as torch tensors on the device (the arrays of
    :meth:`~.work_list.WorkList.device_arrays`).

    Attributes:
        work_info: int32 ``[W, 4]``: row (head of the flattened ``[1, rows, slots, d]`` tensors), first
            stream entry, stream length (pages), query rows M (64 when the block has at most 4 live pages).
        work_order: int32 ``[W]``: the order the persistent CTAs take the items.
        own_entries: int32 ``[W, 8, 2]``: (Q page id, row mask), ``(-1, 0)`` padded.
        stream_entries: int32 ``[capacity, 2]``: (K page id, row mask); the first ``total`` used.
        status: int64 ``[2]``: stream entries needed in all, and how many of them did not fit.
        rows, chunk, capacity: rows (heads) of the list, keys per chunk, stream entries allocated.
    """

    work_info: torch.Tensor
    work_order: torch.Tensor
    own_entries: torch.Tensor
    stream_entries: torch.Tensor
    status: torch.Tensor
    rows: int
    chunk: int
    capacity: int
    counter: torch.Tensor

    @property
    def num_work(self) -> int:
        return int(self.work_info.shape[0])

    def device_work_list(self):
        """The list as the forward kernel's launcher takes it (raw pointers; this object keeps the memory)."""
        import numpy as np

        from .device import DeviceWorkList

        ptr = lambda t: np.uint64(t.data_ptr())
        arrays = dict(
            work_info=ptr(self.work_info),
            work_order=ptr(self.work_order),
            own_entries=ptr(self.own_entries),
            stream_entries=ptr(self.stream_entries),
            counter=ptr(self.counter),
        )
        return DeviceWorkList(arrays, self.num_work, self.rows, self.chunk, False, self.capacity, self)

    def item_streams(self) -> torch.Tensor:
        """int32 ``[Σ lengths, 2]``: every item's stream entries (page, mask), item after item in item order
        (synchronises; for checks: two lists with the same items stream the same pages, whether or not
        their items share stored streams). An entry cut at the capacity reads ``(-1, 0)``."""
        start, length = self.work_info[:, 1].long(), self.work_info[:, 2].long()
        first = length.cumsum(0) - length
        idx = torch.arange(int(length.sum()), device=start.device)
        item = torch.repeat_interleave(torch.arange(len(length), device=start.device), length)
        idx = idx - first[item] + start[item]
        cut = torch.tensor([-1, 0], dtype=torch.int32, device=idx.device)
        inside = (idx < self.capacity).unsqueeze(1)
        return torch.where(inside, self.stream_entries[idx.clamp(max=max(self.capacity - 1, 0))], cut)

    def to_work_list(self):
        """The host :class:`~.work_list.WorkList` (synchronises; for checks and the emulator)."""
        import numpy as np

        from .work_list import WorkList

        info = self.work_info.cpu().numpy()
        total = int(info[:, 2].astype(np.int64).sum())
        stream = self.stream_entries[: min(total, self.capacity)].cpu().numpy()
        own = self.own_entries.cpu().numpy()
        return WorkList(
            work_info=info,
            work_order=self.work_order.cpu().numpy(),
            own_pages=own[:, :, 0],
            own_mask=own[:, :, 1].astype(np.uint32),
            stream_pages=stream[:, 0],
            stream_mask=stream[:, 1].astype(np.uint32),
            heads=self.rows,
            chunk=self.chunk,
        )


def stream_capacity(q_blocks: int, k_rows_bound: int, k_blocks: int, rows: int) -> int:
    """Stream entries that hold any selection: every Q block of every row selecting every K block
    (``k_rows_bound / 16`` full pages plus one partial page per block)."""
    return rows * q_blocks * (k_rows_bound // PAGE_ROWS + k_blocks)


def _row_masks(rows_in_page: torch.Tensor) -> torch.Tensor:
    """16-bit row masks of pages holding ``rows_in_page`` rows (a prefix), int32."""
    return ((1 << rows_in_page.clamp(0, PAGE_ROWS)) - 1).to(torch.int32)


def forward_work_list(
    q_block_rows: torch.Tensor,
    k_block_rows: torch.Tensor,
    block_mask: torch.Tensor,
    block_size: int,
    capacity: int | None = None,
    rows_per_chunk: int = 8,
) -> DynamicWorkList:
    """The paged forward's work list of per-row layouts and a block selection.

    Args:
        q_block_rows: int ``[R, q_blocks]``: valid rows of each Q block (a prefix of the block), per row.
        k_block_rows: int ``[R, k_blocks]``: the same of K.
        block_mask: bool ``[R, q_blocks, k_blocks]``: the selected block pairs (blocks without rows are
            skipped whatever it says).
        block_size: slots per block (16 to 128, a multiple of 16).
        capacity: stream entries to allocate (default :func:`stream_capacity`: any selection fits).
        rows_per_chunk: rows planned per step (bounds the temporaries).
    """
    triton_items = _triton_items(block_mask)
    r, nq, nk, q_rows, k_rows, sel = _selection(q_block_rows, k_block_rows, block_mask, block_size)
    pages_per_block = _forward_pages_per_block(block_size)
    if capacity is None:
        capacity = stream_capacity(nq, nk * block_size, nk, r)
    if page_streams.available(sel):
        flat_len, start, total, entries = page_streams.streams(
            sel, *_k_pages32(k_rows), capacity, pages_per_block, 0, split_partial=True
        )
        stream_entries = entries[:capacity]
    else:
        k_full = k_rows // PAGE_ROWS  # [R, nk]
        k_part = (k_rows % PAGE_ROWS > 0).long()
        flat_len, start, total, stream_entries = _forward_streams_torch(
            sel, k_rows, k_full, k_part, capacity, pages_per_block, rows_per_chunk
        )
    if triton_items:
        return _forward_items_triton(q_rows, flat_len, start, total, stream_entries, block_size, capacity)
    return _forward_items(q_rows, flat_len, start, total, stream_entries, block_size, capacity)


def cluster_forward_work_list(
    q_block_rows: torch.Tensor,
    k_block_rows: torch.Tensor,
    q_block_group: torch.Tensor,
    k_block_group: torch.Tensor,
    cluster_mask: torch.Tensor,
    block_size: int,
    capacity: int | None = None,
    rows_per_chunk: int = 8,
) -> DynamicWorkList:
    """:func:`forward_work_list` of partition layouts, from their groups' selection: block pair ``(i, j)``
    of row ``r`` is selected when ``cluster_mask[r, q_block_group[r, i], k_block_group[r, j]]`` is.

    Every Q block of a group selects the same K blocks, so its stream is the same: the streams are
    written once per (row, Q group) and each item points at its group's (``work_info``'s first entry and
    length). An item's stream holds the same entries, in the same order, as :func:`forward_work_list`'s of
    the expanded block mask, in about a third of the entries at SVG2's shapes, and the ``[R, q_blocks,
    k_blocks]`` block mask is never made. Off Triton's devices it expands the mask and calls
    :func:`forward_work_list`.

    Args:
        q_block_rows, k_block_rows: as :func:`forward_work_list`.
        q_block_group, k_block_group: int ``[R, q_blocks]`` / ``[R, k_blocks]``: the group of each block
            in ``[0, groups)``, ``-1`` past a row's layout.
        cluster_mask: bool ``[R, q_groups, k_groups]``.
        capacity: stream entries to allocate (default: any selection fits).
        rows_per_chunk: as :func:`forward_work_list` (its torch path, off Triton's devices).
    """
    triton_items = _triton_items(cluster_mask)
    blocks, q_rows, k_rows = _groups_selection(
        q_block_rows, k_block_rows, q_block_group, k_block_group, cluster_mask, block_size
    )
    if blocks is not None:
        return forward_work_list(q_block_rows, k_block_rows, blocks, block_size, capacity, rows_per_chunk)
    (r, nk), nqg = k_rows.shape, cluster_mask.shape[1]
    pages_per_block = _forward_pages_per_block(block_size)
    if capacity is None:
        capacity = stream_capacity(nqg, nk * block_size, nk, r)
    k_group = torch.where(k_rows > 0, k_block_group, -1).to(torch.int32).contiguous()
    if triton_items:  # the live groups' selection, and each block's stream from its group's: two kernels
        group_len, group_start, total, entries = page_streams.streams(
            forward_items.live_groups(cluster_mask, q_rows, q_block_group),
            *_k_pages32(k_rows),
            capacity,
            pages_per_block,
            0,
            split_partial=True,
            other_group=k_group,
        )
        return _forward_items_triton(
            q_rows,
            group_len,
            group_start,
            total,
            entries[:capacity],
            block_size,
            capacity,
            q_block_group,
            nqg,
        )
    qg = q_block_group.long()
    has = (q_rows > 0) & (qg >= 0) & (qg < nqg)
    # a Q group without a live block (an empty cluster) streams nothing, as its blocks do in the block form
    group_live = torch.zeros(r, nqg, dtype=torch.int32, device=qg.device)
    group_live.scatter_add_(1, qg.clamp(0, nqg - 1), has.int())
    group_len, group_start, total, entries = page_streams.streams(
        (cluster_mask & (group_live > 0).unsqueeze(-1)).contiguous(),
        *_k_pages32(k_rows),
        capacity,
        pages_per_block,
        0,
        split_partial=True,
        other_group=k_group,
    )
    # each Q block takes its group's stream; blocks without rows or group stream nothing
    flat = (torch.arange(r, device=qg.device).unsqueeze(1) * nqg + qg.clamp(0, nqg - 1)).reshape(-1)
    flat_len = torch.where(has.reshape(-1), group_len[flat], 0)
    start = torch.where(has.reshape(-1), group_start[flat], 0)
    return _forward_items(q_rows, flat_len, start, total, entries[:capacity], block_size, capacity)


def _groups_selection(
    q_block_rows, k_block_rows, q_block_group, k_block_group, cluster_mask, block_size: int
):
    """``(blocks, q_rows, k_rows)`` of the planners by groups, the arguments checked: the expanded block mask
    where the Triton writers cannot run (the caller then plans the block form), else None; the row counts
    clamped to the block (int64)."""
    r, nq = q_block_rows.shape
    nk = k_block_rows.shape[1]
    if cluster_mask.ndim != 3 or cluster_mask.shape[0] != r:
        raise ValueError(f"cluster_mask must be [{r}, q_groups, k_groups], got {list(cluster_mask.shape)}")
    if q_block_group.shape != (r, nq) or k_block_group.shape != (r, nk):
        raise ValueError(
            f"q_block_group / k_block_group must be [{r}, {nq}] / [{r}, {nk}] (the block rows' shapes), got "
            f"{list(q_block_group.shape)} / {list(k_block_group.shape)}"
        )
    if not page_streams.available(cluster_mask):
        from ..svg2_device import cluster_block_mask

        return cluster_block_mask(cluster_mask, q_block_group, k_block_group), None, None
    return None, q_block_rows.long().clamp(0, block_size), k_block_rows.long().clamp(0, block_size)


def _k_pages32(k_rows: torch.Tensor):
    """The forward writers' per-K-block arguments, int32 ``[R, nk]``: full pages, partial pages (0 or 1),
    valid rows (the partial page's mask)."""
    return tuple(x.int().contiguous() for x in (k_rows // PAGE_ROWS, k_rows % PAGE_ROWS > 0, k_rows))


def _forward_pages_per_block(block_size: int) -> int:
    if block_size % PAGE_ROWS or not PAGE_ROWS <= block_size <= OWN_PAGES * PAGE_ROWS:
        raise ValueError(f"block_size must be a multiple of {PAGE_ROWS} up to {OWN_PAGES * PAGE_ROWS}")
    return block_size // PAGE_ROWS


def _forward_items(q_rows, flat_len, start, total, stream_entries, block_size: int, capacity: int):
    """The work list around written streams: one item per (row, Q block) with its stream's ``start`` and
    ``flat_len`` (``[R · q_blocks]``), its own pages, its query rows M, the order the CTAs take the items."""
    r, nq = q_rows.shape
    pages_per_block = block_size // PAGE_ROWS
    dev = q_rows.device
    # own pages: the Q block's live pages with their row masks
    own_slot = torch.arange(OWN_PAGES, device=dev)
    q_live = -(-q_rows // PAGE_ROWS)  # [R, nq]
    live = own_slot < q_live.unsqueeze(-1)  # [R, nq, 8]
    own_page = torch.arange(nq, device=dev)[:, None] * pages_per_block + own_slot
    own_page = torch.where(live, own_page.expand_as(live), -1)
    own_rows = (q_rows.unsqueeze(-1) - own_slot * PAGE_ROWS).clamp(0, PAGE_ROWS)
    own_mask = torch.where(live, _row_masks(own_rows), 0)
    own_entries = torch.stack([own_page.to(torch.int32), own_mask], -1).view(r * nq, OWN_PAGES, 2)

    m = torch.where(q_live <= OWN_PAGES // 2, 64, 128).reshape(-1)
    head = torch.arange(r, device=dev).repeat_interleave(nq)
    work_info = torch.stack([head, start, flat_len, m], 1).to(torch.int32)
    cost = m * -(-flat_len // (CHUNK // PAGE_ROWS))  # at most 128 · ceil(capacity / 8)
    key = -cost.to(_key_dtype(capacity))
    return _work_list(r, nq, work_info, own_entries, key, total, stream_entries, capacity)


def _key_dtype(capacity: int) -> torch.dtype:
    return torch.int32 if 16 * int(capacity) + 128 < 2**31 else torch.int64


def _forward_items_triton(
    q_rows,
    lengths,
    starts,
    total,
    stream_entries,
    block_size: int,
    capacity: int,
    q_block_group=None,
    groups=0,
):
    """:func:`_forward_items` by :func:`.forward_items.items` (one kernel; by groups, ``lengths`` and
    ``starts`` are each Q group's, ``[R · groups]``, taken by the group's blocks with rows)."""
    r, nq = q_rows.shape
    pages_per_block = block_size // PAGE_ROWS
    own_entries, work_info, key = forward_items.items(
        q_rows, lengths, starts, pages_per_block, CHUNK, _key_dtype(capacity), q_block_group, groups
    )
    return _work_list(r, nq, work_info, own_entries, key, total, stream_entries, capacity)


def _work_list(r: int, nq: int, work_info, own_entries, key, total, stream_entries, capacity: int):
    """The list around its items: ``key`` (``[R · q_blocks]``, the negated costs) ordered head by head,
    largest first, ties in item order (one stable sort of each row's items)."""
    dev = work_info.device
    ranked = torch.sort(key.view(r, nq), dim=1, stable=True).indices
    order = (ranked + torch.arange(r, device=dev).unsqueeze(1) * nq).reshape(-1)
    status = torch.stack([total, (total - capacity).clamp(min=0)])
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    return DynamicWorkList(
        work_info.contiguous(),
        order.to(torch.int32).contiguous(),
        own_entries.contiguous(),
        stream_entries.contiguous(),
        status,
        r,
        CHUNK,
        int(capacity),
        counter,
    )


def _forward_streams_torch(
    sel, k_rows, k_full, k_part, capacity: int, pages_per_block: int, rows_per_chunk: int
):
    """The forward's streams in torch (the reference of :mod:`.page_streams`, and its path off CUDA):
    ``(lengths, starts, total, stream_entries [capacity, 2])``."""
    r, nq, nk = sel.shape
    dev = sel.device
    sel_l = sel.long()
    len_full = (sel_l * k_full.unsqueeze(1)).sum(-1)  # [R, nq]
    len_part = (sel_l * k_part.unsqueeze(1)).sum(-1)
    flat_len, start, total = _offsets(len_full + len_part)
    # one scratch entry past the end takes every write that is not kept (static shapes, no sync)
    stream_pages = torch.zeros(capacity + 1, dtype=torch.int32, device=dev)
    stream_mask = torch.zeros(capacity + 1, dtype=torch.int32, device=dev)
    page_of = torch.arange(pages_per_block, device=dev)
    for a in range(0, r, rows_per_chunk):
        b = min(r, a + rows_per_chunk)
        s = sel[a:b]  # [c, nq, nk]
        c = b - a
        item_start = start.view(r, nq)[a:b]
        # full pages: (block j, page p < full_j), ranked in (j, p) order within the item
        full = s.unsqueeze(-1) & (page_of < k_full[a:b, None, :, None])  # [c, nq, nk, P]
        rank = full.reshape(c, nq, -1).long().cumsum(-1).view_as(full) - 1
        pos = item_start[:, :, None, None] + rank
        page = (torch.arange(nk, device=dev)[:, None] * pages_per_block + page_of).expand_as(full)
        _scatter(stream_pages, stream_mask, pos, full, page, torch.full_like(pos, FULL_MASK), capacity)
        # partial pages after them: one per selected block with a partial page
        part = s & (k_part[a:b, None, :] > 0)  # [c, nq, nk]
        rank = part.long().cumsum(-1) - 1
        pos = (item_start + len_full[a:b]).unsqueeze(-1) + rank
        page = (torch.arange(nk, device=dev) * pages_per_block + k_full[a:b]).unsqueeze(1).expand_as(part)
        masks = _row_masks(k_rows[a:b] % PAGE_ROWS).unsqueeze(1).expand_as(part)
        _scatter(stream_pages, stream_mask, pos, part, page, masks, capacity)
    return flat_len, start, total, torch.stack([stream_pages[:capacity], stream_mask[:capacity]], 1)


def _selection(q_block_rows, k_block_rows, block_mask, block_size: int):
    """``(R, q_blocks, k_blocks, q rows, k rows, selected pairs)``: the arguments checked, the row counts
    clamped to the block, pairs of blocks without rows dropped."""
    r, nq = q_block_rows.shape
    nk = k_block_rows.shape[1]
    if block_mask.shape != (r, nq, nk):
        raise ValueError(f"block_mask must be [{r}, {nq}, {nk}], got {list(block_mask.shape)}")
    q_rows = q_block_rows.long().clamp(0, block_size)
    k_rows = k_block_rows.long().clamp(0, block_size)
    sel = block_mask & (q_rows > 0).unsqueeze(-1) & (k_rows > 0).unsqueeze(1)
    return r, nq, nk, q_rows, k_rows, sel


def _offsets(lengths: torch.Tensor):
    """``(lengths flat, exclusive prefix sums, total)`` of per-item stream lengths."""
    flat = lengths.reshape(-1)
    return flat, flat.cumsum(0) - flat, flat.sum()


def _scatter(pages, masks, pos, keep, page, mask, capacity: int) -> None:
    """Write ``page`` (and ``mask``, unless None) at ``pos`` where ``keep`` and ``pos < capacity``,
    elsewhere into the scratch entry ``capacity`` (no data-dependent shapes)."""
    where = torch.where(keep & (pos < capacity), pos, capacity).reshape(-1)
    pages.index_put_((where,), page.reshape(-1).to(torch.int32))
    if masks is not None:
        masks.index_put_((where,), mask.reshape(-1).to(torch.int32))


def check_status(work: DynamicWorkList) -> None:
    """Raise when streams were cut at the capacity (synchronises)."""
    needed, cut = (int(x) for x in work.status.cpu())
    if cut:
        raise ValueError(
            f"the work list needs {needed} stream entries; {cut} did not fit its capacity {work.capacity}"
        )


# ---- the backward's K/V-owned plan ------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class DynamicOwnedPlan:
    """A K/V-owned backward plan of per-row layouts as torch tensors, in the format of
    :meth:`~.tile_plan.TilePlan.device_arrays`, over the tensors viewed as one head of ``rows · slots``
    slots (page ids global: row ``r``'s page ``p`` is ``r · pages_per_row + p``; the page masks are tables
    over all rows' pages).

    Attributes:
        work_head: int32 ``[W]`` (zeros: one head); work_block: int32 ``[W]``, the K block of each item.
        own_pages: int32 ``[W, 8]``: the K block's live pages, ``-1`` padded.
        stream_indptr: int32 ``[W + 1]``; stream_pages: int32 ``[capacity]``: the live Q pages of every Q
            block that selects the item's K block, in Q-block order.
        own_page_mask, stream_page_mask: int16 ``[rows · pages]`` (uint16 bits): row masks of the K / Q pages.
        status: int64 ``[2]``: entries needed, and how many did not fit.
        block_size: rows owned per item (the route ``(block_size, 64)``).
    """

    work_head: torch.Tensor
    work_block: torch.Tensor
    own_pages: torch.Tensor
    stream_indptr: torch.Tensor
    stream_pages: torch.Tensor
    own_page_mask: torch.Tensor
    stream_page_mask: torch.Tensor
    status: torch.Tensor
    block_size: int
    capacity: int

    @property
    def num_work(self) -> int:
        return int(self.work_head.shape[0])

    @property
    def routes(self) -> tuple:
        return ((self.block_size, 64),)

    def tile_plan(self):
        """The host :class:`~.tile_plan.TilePlan` (synchronises; for checks and the emulator)."""
        import numpy as np

        from .tile_plan import TilePlan

        indptr = self.stream_indptr.cpu().numpy()
        return TilePlan(
            kind="kpage",
            owner="kv",
            routes=self.routes,
            work_route=np.zeros(self.num_work, dtype=np.int8),
            work_head=self.work_head.cpu().numpy(),
            work_block=self.work_block.cpu().numpy(),
            own_pages=self.own_pages.cpu().numpy(),
            stream_indptr=indptr,
            stream_pages=self.stream_pages[: int(indptr[-1])].cpu().numpy(),
            own_page_mask=self.own_page_mask.cpu().numpy().view(np.uint16),
            stream_page_mask=self.stream_page_mask.cpu().numpy().view(np.uint16),
            heads=1,
        )

    def device_plan(self):
        """The plan as the backward's launcher takes it (raw pointers; this object keeps the memory)."""
        import numpy as np

        from .device import DeviceOwnedPlan

        ptr = lambda t: np.uint64(t.data_ptr())
        arrays = {
            name: ptr(getattr(self, name))
            for name in (
                "work_head",
                "own_pages",
                "stream_indptr",
                "stream_pages",
                "own_page_mask",
                "stream_page_mask",
            )
        }
        arrays["pair_pages"] = None
        w = self.num_work
        return DeviceOwnedPlan(arrays, "kv", self.routes, ((0, 0, w, False),), 1, w, OWN_PAGES, None, 0, self)


def _backward_streams_torch(owned_sel, q_live, capacity: int, per_block: int, rows_per_chunk: int):
    """The backward's streams in torch (the reference of :mod:`.page_streams`, and its path off CUDA):
    ``(starts, total, stream [capacity + 1])``."""
    r, nk, nq = owned_sel.shape
    dev = owned_sel.device
    q_per_row = nq * per_block
    _, start, total = _offsets((owned_sel.long() * q_live.unsqueeze(1)).sum(-1))  # per (row, K block)
    stream = torch.zeros(capacity + 1, dtype=torch.int32, device=dev)
    page_of = torch.arange(per_block, device=dev)
    for a in range(0, r, rows_per_chunk):
        b = min(r, a + rows_per_chunk)
        s = owned_sel[a:b]  # [c, nk, nq]
        live = s.unsqueeze(-1) & (page_of < q_live[a:b, None, :, None])  # [c, nk, nq, P]
        c = b - a
        rank = live.reshape(c, nk, -1).long().cumsum(-1).view_as(live) - 1
        pos = start.view(r, nk)[a:b, :, None, None] + rank
        row = torch.arange(a, b, device=dev)[:, None, None, None]
        page = row * q_per_row + torch.arange(nq, device=dev)[:, None] * per_block + page_of
        _scatter(stream, None, pos, live, page.expand_as(live), None, capacity)
    return start, total, stream


def _page_masks(block_rows: torch.Tensor, pages_per_block: int) -> torch.Tensor:
    """int16 ``[R · blocks · pages]``: the row mask of every page of every row's blocks (prefix rows)."""
    page = torch.arange(pages_per_block, device=block_rows.device)
    rows = (block_rows.long().unsqueeze(-1) - page * PAGE_ROWS).clamp(0, PAGE_ROWS)
    return _row_masks(rows).reshape(-1).to(torch.int16)


def backward_plan(
    q_block_rows: torch.Tensor,
    k_block_rows: torch.Tensor,
    block_mask: torch.Tensor,
    block_size: int,
    capacity: int | None = None,
    rows_per_chunk: int = 8,
) -> DynamicOwnedPlan:
    """The K/V-owned backward plan of per-row layouts and a block selection (arguments as
    :func:`forward_work_list`): one item per (row, K block) owning its live pages, streaming the live Q
    pages of the Q blocks that select it."""
    r, nq, nk, q_rows, k_rows, sel = _selection(q_block_rows, k_block_rows, block_mask, block_size)
    per_block = _backward_pages_per_block(block_size)
    if capacity is None:
        capacity = r * nk * nq * per_block
    q_live = -(-q_rows // PAGE_ROWS)  # [R, nq]
    owned_sel = sel.transpose(1, 2)  # [R, nk, nq]: the Q blocks selecting each K block
    if page_streams.available(sel):
        owned_sel = owned_sel.contiguous()  # each program then reads its K block's row coalesced
        start, total, stream = _backward_streams(owned_sel, q_live, capacity, per_block, None)
    else:
        start, total, stream = _backward_streams_torch(owned_sel, q_live, capacity, per_block, rows_per_chunk)
    return _owned_plan(q_rows, k_rows, start, total, stream, block_size, capacity)


def cluster_backward_plan(
    q_block_rows: torch.Tensor,
    k_block_rows: torch.Tensor,
    q_block_group: torch.Tensor,
    k_block_group: torch.Tensor,
    cluster_mask: torch.Tensor,
    block_size: int,
    capacity: int | None = None,
    rows_per_chunk: int = 8,
) -> DynamicOwnedPlan:
    """:func:`backward_plan` of partition layouts from their groups' selection (arguments as
    :func:`cluster_forward_work_list`), the same plan entry for entry, without the block mask: each K
    block's row of the selection is its group's row of the transposed cluster mask (``[R, k_blocks,
    q_groups]``, a third of the block mask's bytes at SVG2's shapes), and the stream writers look each Q
    block up in it by the block's group. Off Triton's devices it expands the mask and calls
    :func:`backward_plan`."""
    blocks, q_rows, k_rows = _groups_selection(
        q_block_rows, k_block_rows, q_block_group, k_block_group, cluster_mask, block_size
    )
    if blocks is not None:
        return backward_plan(q_block_rows, k_block_rows, blocks, block_size, capacity, rows_per_chunk)
    (r, nk), nq = k_rows.shape, q_rows.shape[1]
    per_block = _backward_pages_per_block(block_size)
    if capacity is None:
        capacity = r * nk * nq * per_block
    nkg = cluster_mask.shape[2]
    kg = k_block_group.long()
    k_in = (k_rows > 0) & (kg >= 0) & (kg < nkg)
    by_group = cluster_mask.transpose(1, 2)  # [R, k_groups, q_groups]
    rows = by_group.gather(1, kg.clamp(0, nkg - 1).unsqueeze(-1).expand(r, nk, by_group.shape[2]))
    owned_sel = (rows & k_in.unsqueeze(-1)).contiguous()  # [R, nk, q_groups]
    q_group = torch.where(q_rows > 0, q_block_group, -1).to(torch.int32).contiguous()
    q_live = -(-q_rows // PAGE_ROWS)
    start, total, stream = _backward_streams(owned_sel, q_live, capacity, per_block, q_group)
    return _owned_plan(q_rows, k_rows, start, total, stream, block_size, capacity)


def _backward_pages_per_block(block_size: int) -> int:
    if block_size not in (64, 128):
        raise ValueError("block_size must be 64 or 128 (the backward kernels own 64- or 128-row tiles)")
    return block_size // PAGE_ROWS


def _backward_streams(owned_sel, q_live, capacity: int, per_block: int, q_group):
    """The backward's streams by the Triton writers: ``(starts, total, stream [capacity + 1])``."""
    q_live32 = q_live.int().contiguous()
    _, start, total, stream = page_streams.streams(
        owned_sel,
        q_live32,
        torch.zeros_like(q_live32),
        None,
        capacity,
        per_block,
        q_live.shape[1] * per_block,
        split_partial=False,
        other_group=q_group,
    )
    return start, total, stream


def _owned_plan(q_rows, k_rows, start, total, stream, block_size: int, capacity: int) -> DynamicOwnedPlan:
    """The K/V-owned plan around written streams (one item per (row, K block), CSR offsets ``start``)."""
    r, nk = k_rows.shape
    per_block = block_size // PAGE_ROWS
    k_per_row = nk * per_block
    dev = q_rows.device
    own_slot = torch.arange(OWN_PAGES, device=dev)
    k_live = -(-k_rows // PAGE_ROWS)  # [R, nk]
    owned = own_slot < k_live.unsqueeze(-1)
    own = (
        torch.arange(r, device=dev)[:, None, None] * k_per_row
        + torch.arange(nk, device=dev)[:, None] * per_block
        + own_slot
    )
    own = torch.where(owned, own, -1).reshape(r * nk, OWN_PAGES).to(torch.int32)
    # offsets past the capacity are cut to it (those streams end early; status says so): never out of bounds
    indptr = torch.cat([start, total.reshape(1)]).clamp(max=capacity).to(torch.int32)
    return DynamicOwnedPlan(
        work_head=torch.zeros(r * nk, dtype=torch.int32, device=dev),
        work_block=torch.arange(nk, device=dev).repeat(r).to(torch.int32),
        own_pages=own.contiguous(),
        stream_indptr=indptr.contiguous(),
        stream_pages=stream[:capacity].contiguous(),
        own_page_mask=_page_masks(k_rows, per_block).contiguous(),
        stream_page_mask=_page_masks(q_rows, per_block).contiguous(),
        status=torch.stack([total, (total - capacity).clamp(min=0)]),
        block_size=block_size,
        capacity=int(capacity),
    )
