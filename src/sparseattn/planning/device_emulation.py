"""The device planner's steps in numpy: what ``kernels_cu/planner.cu`` computes, array for array.

:mod:`.device` runs these steps on the GPU; this module runs them on the CPU, item by item, so that
the algorithm can be read and checked without a GPU (the tests compare it with the host planners, and
the GPU tests compare the device's arrays with it bit for bit):

1. :func:`selection_matrix`: the selection as bool ``[heads, q_blocks, k_blocks]`` (the device's bitmap),
   with entries of blocks without valid rows dropped;
2. :func:`item_streams`: per (head, template item), the entries it streams, in its stream mode's order,
   and the counts the write pass places them by;
3. :func:`forward_arrays` / :func:`owned_plan_arrays`: the order (the persistent forward's ``work_order``;
   the backward's item order) and the offsets, as the device's sort and scan give them (the forward's: each
   item's layout-fixed slice, or back to back where the planner's ``FORWARD_SLICES`` is off).

:func:`as_work_list` and :func:`as_tile_plan` turn the arrays into the host's objects, so the numpy
emulators (:mod:`sparseattn.emulator`) can execute them against the float64 reference.
"""

from __future__ import annotations

import numpy as np

from .layout_pairs import edge_keys, greedy_matching_by_key
from .templates import (
    ALL_SLOTS,
    HALF_A,
    HALF_B,
    MODE_FULL_FIRST,
    MODE_HALVES,
    MODE_INTERLEAVED,
    MODE_PLAIN,
    ItemTemplate,
)
from .tile_plan import TAIL_ITEMS, TilePlan
from .work_list import OWN_PAGES, VIS_SHIFT, WorkList

INT32_MAX = np.iinfo(np.int32).max
FULL_PAGE = 0xFFFF


def selection_matrix(
    q_alive: np.ndarray, k_alive: np.ndarray, q2k_idx=None, q2k_num=None, mask=None
) -> tuple[np.ndarray, int]:
    """bool ``[heads, q_blocks, k_blocks]`` of a selection, and how many of its entries were invalid.

    ``q2k_idx`` int ``[heads, q_blocks, k]`` with ``q2k_num`` ``[heads, q_blocks]`` (entries at or past a
    row's count are not read; an index outside ``[0, k_blocks)`` or a count outside ``[0, k]`` is invalid
    and ignored), or ``mask`` bool ``[heads, q_blocks, k_blocks]``. Rows of Q blocks and columns of K blocks
    without valid rows (``q_alive``, ``k_alive``) are cleared, as the host's graphs drop those pairs."""
    nq, nk = q_alive.size, k_alive.size
    invalid = 0
    if mask is not None:
        sel = np.asarray(mask).astype(bool).copy()
    else:
        idx = np.asarray(q2k_idx, dtype=np.int64)
        num = np.asarray(q2k_num, dtype=np.int64)
        heads, _, k = idx.shape
        invalid += int(np.count_nonzero((num < 0) | (num > k)))
        used = np.arange(k)[None, None, :] < np.clip(num, 0, k)[..., None]
        ok = used & (idx >= 0) & (idx < nk)
        invalid += int(np.count_nonzero(used & ~ok))
        sel = np.zeros((heads, nq, nk), dtype=bool)
        h, i, e = np.nonzero(ok)
        sel[h, i, idx[h, i, e]] = True
    sel &= q_alive[None, :, None] & k_alive[None, None, :]
    return sel, invalid


def _interleaved_position(cat: int, r: int, na: int, ns: int, runs: int, pages: int) -> int:
    """Position of the r-th page of category ``cat`` (0 A only, 1 both, 2 B only) in an interleaved
    stream (``plan_interleaved`` in planner.cu)."""
    moved = runs * pages
    if cat == 1:
        return 2 * moved + (na - moved) + r
    if r < moved:
        return 2 * pages * (r // pages) + (pages if cat == 2 else 0) + r % pages
    return 2 * moved + (0 if cat == 0 else (na - moved) + ns) + (r - moved)


def matched_slots(template: ItemTemplate, rows: np.ndarray) -> dict:
    """The matched slots of every head (``plan_pair_weights`` and ``plan_pair_match``): each head's greedy
    matching of its full 64-row blocks over the template's edges by :func:`~.layout_pairs.edge_keys`
    (edges sharing no K block left out), the slots left two by two in order; then
    per slot its item: the pair (the lower slot), nothing (the higher) or the block alone. Returns
    ``{"partner": int64 [heads, matched]`` (-1: alone), ``"info"``, ``"members"``, ``"bits"``, ``"own"``
    (``[heads, matched, 4 | 8]``, the template's rows for those items)."""
    heads, n = rows.shape[0], template.matched
    blocks = template.block[:n].astype(np.int64)
    a, b = (template.edges[:, 0].astype(np.int64), template.edges[:, 1].astype(np.int64))
    partner = np.full((heads, n), -1, dtype=np.int64)
    for bh in range(heads):
        sel = rows[bh, blocks]
        shared = (sel[a] & sel[b]).sum(axis=1) if a.size else np.zeros(0, np.int64)
        keep = shared > 0
        chosen = greedy_matching_by_key(a[keep], b[keep], edge_keys(a[keep], b[keep], shared[keep]), n)
        partner[bh, a[keep][chosen]] = b[keep][chosen]
        partner[bh, b[keep][chosen]] = a[keep][chosen]
        rest = np.flatnonzero(partner[bh] < 0)
        rest = rest[: rest.size - rest.size % 2]
        partner[bh, rest[0::2]], partner[bh, rest[1::2]] = rest[1::2], rest[0::2]
    info = np.zeros((heads, n, 4), dtype=np.int64)
    members = np.full((heads, n, 8), -1, dtype=np.int64)
    bits = np.zeros((heads, n, 8), dtype=np.int64)
    own = np.full((heads, n, 8), -1, dtype=np.int64)
    slot = np.arange(n)
    for bh in range(heads):
        p = partner[bh]
        pair, alone = p > slot, p < 0
        info[bh, pair] = (MODE_INTERLEAVED, 128, 2, 0)
        info[bh, alone] = (MODE_FULL_FIRST, 64, 1, 0)
        info[bh, ~pair & ~alone] = (MODE_PLAIN, 64, 0, 0)
        members[bh, pair, 0], members[bh, pair, 1] = blocks[pair], blocks[p[pair]]
        bits[bh, pair, 0], bits[bh, pair, 1] = HALF_A, HALF_B
        own[bh, pair, :4], own[bh, pair, 4:] = template.own[slot[pair], :4], template.own[p[pair], :4]
        members[bh, alone, 0], bits[bh, alone, 0] = blocks[alone], ALL_SLOTS
        own[bh, alone] = template.own[slot[alone]]
    return {"partner": partner, "info": info, "members": members, "bits": bits, "own": own}


def _item_fields(template: ItemTemplate, matched, bh: int, it: int):
    """``(info, members, bits, own)`` of item ``it`` of head ``bh``: a matched slot's, else the template's."""
    if matched is not None and it < template.matched:
        return (matched[name][bh, it] for name in ("info", "members", "bits", "own"))
    return template.info[it], template.members[it], template.bits[it], template.own[it]


def item_streams(template: ItemTemplate, rows: np.ndarray, matched: dict | None = None):
    """Every item's stream, heads × items in head-major order.

    Args:
        rows: bool ``[heads, owner blocks, stream blocks]``: what each owner block selects (the forward's
            selection matrix, its transpose for K/V-owned templates).
        matched: the matched slots' items (:func:`matched_slots`), when the template has them.

    Returns:
        ``(entries, counts)``: ``entries[n]`` int64 ``[len, 2]`` of item n (page id, row mask with the
        visibility bits of interleaved items) in stream order; ``counts`` int64 ``[heads · items, 3]``:
        entries, then full pages (FULL_FIRST) or A-only pages (HALVES, INTERLEAVED), then pages seen by
        both halves (the device's ``cnt``).
    """
    st = template.stream
    first, pages, mask = st.first.astype(np.int64), st.pages.astype(np.int64), st.mask.astype(np.int64)
    chunk_pages = template.chunk // 16
    heads = rows.shape[0]
    entries, counts = [], []
    for bh in range(heads):
        for it in range(template.num_items):
            info, members, member_bits, _ = _item_fields(template, matched, bh, it)
            mode, _, n_members, _ = (int(x) for x in info)
            halves = mode in (MODE_HALVES, MODE_INTERLEAVED)
            blocks = np.asarray(members[:n_members], dtype=np.int64)
            bits = np.asarray(member_bits[:n_members], dtype=np.int64)
            sel = rows[bh, blocks]  # [members, stream blocks]
            a = sel[(bits & HALF_A) != 0].any(axis=0) if halves else sel.any(axis=0)
            b = sel[(bits & HALF_B) != 0].any(axis=0) if halves else a
            cols = np.flatnonzero(a | b)
            cat = np.where(a[cols] & b[cols], 1, np.where(a[cols], 0, 2))
            vis = (sel[:, cols] * bits[:, None]).sum(axis=0) if mode == MODE_INTERLEAVED else 0 * cols
            lens = first[cols + 1] - first[cols]
            page = pages[
                np.repeat(first[cols], lens) + np.arange(lens.sum()) - np.repeat(np.cumsum(lens) - lens, lens)
            ]
            page_cat = np.repeat(cat, lens)
            page_mask = mask[page] | (np.repeat(vis, lens).astype(np.int64) << VIS_SHIFT)
            full = mask[page] == FULL_PAGE
            na, ns = int((page_cat == 0).sum()), int((page_cat == 1).sum())
            if mode == MODE_PLAIN:
                order = np.arange(page.size)
            elif mode == MODE_FULL_FIRST:
                order = np.concatenate([np.flatnonzero(full), np.flatnonzero(~full)])
            elif mode == MODE_HALVES:
                order = np.concatenate([np.flatnonzero(page_cat == c) for c in (0, 1, 2)])
            else:
                runs = min(na, page.size - na - ns) // chunk_pages
                at = np.empty(page.size, dtype=np.int64)
                for c in (0, 1, 2):
                    where = np.flatnonzero(page_cat == c)
                    at[where] = [
                        _interleaved_position(c, r, na, ns, runs, chunk_pages) for r in range(where.size)
                    ]
                order = np.empty(page.size, dtype=np.int64)
                order[at] = np.arange(page.size)
            entries.append(np.stack([page[order], page_mask[order]], axis=1))
            c1 = int(full.sum()) if mode == MODE_FULL_FIRST else (na if halves else 0)
            counts.append((page.size, c1, ns if halves else 0))
    return entries, np.asarray(counts, dtype=np.int64).reshape(-1, 3)


def _sorted_segment(items: np.ndarray, metric: np.ndarray) -> np.ndarray:
    """``items`` sorted by ``metric`` (largest first, clamped to int32), ties in their order (the
    device's per-segment bitonic sort of ``(INT32_MAX - metric) << 32 | position``)."""
    key = INT32_MAX - np.minimum(metric, INT32_MAX)
    return items[np.lexsort((np.arange(items.size), key))]


def _clamped_offsets(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """int64 ``[n + 1]``: exclusive prefix sums of ``lengths``, each clamped to ``capacity``."""
    return np.minimum(np.concatenate([[0], np.cumsum(lengths)]), capacity)


def forward_arrays(template: ItemTemplate, rows: np.ndarray, capacity: int, slices=None) -> dict:
    """The forward work list's arrays as the device writes them (items in template order, head-major):
    ``work_info`` int32 ``[W, 4]`` (head, first entry, entries, M), ``work_order`` int32 ``[W]`` (every void
    item first — no stream entry, no owned page — head by head in item order; then the live items, head by
    head, largest M · chunks first), ``first_live`` (how many void items lead the order: where a launch
    starts the kernel's item counter), ``own_entries`` int32 ``[W, 8, 2]``, ``stream_entries`` int32
    ``[S, 2]`` (``S`` = the entries written, at most ``capacity``) and ``overflow`` (items cut at the
    capacity). With ``slices`` (int64 ``[items + 1]``, :meth:`ItemTemplate.stream_slices`) each item's
    entries start at its slice (head ``h``'s item ``i``: ``h · slices[-1] + slices[i]``) and are cut at its
    slice's end; ``stream_entries`` is then the whole buffer, ``[capacity, 2]``, with ``(-1, 0)`` where no
    item writes (the device leaves those entries as they were)."""
    matched = matched_slots(template, rows) if template.matched else None
    entries, counts = item_streams(template, rows, matched)
    heads, n_items = rows.shape[0], template.num_items
    lengths = counts[:, 0]
    if slices is None:
        begin = _clamped_offsets(lengths, capacity)
        kept = np.minimum(lengths, capacity - begin[:-1])
    else:
        slices = np.asarray(slices, dtype=np.int64)
        start = (np.arange(heads)[:, None] * slices[-1] + slices[None, :-1]).ravel()
        begin = np.minimum(np.append(start, heads * slices[-1]), capacity)
        kept = np.minimum(lengths, np.minimum(np.tile(np.diff(slices), heads), capacity - begin[:-1]))
    info = np.tile(template.info.astype(np.int64), (heads, 1, 1))
    own = np.tile(template.own.astype(np.int64), (heads, 1, 1))
    if matched is not None:
        info[:, : template.matched], own[:, : template.matched] = matched["info"], matched["own"]
    rows_m = info[:, :, 1].ravel()
    own = own.reshape(-1, own.shape[-1])
    work_info = np.stack([np.repeat(np.arange(heads), n_items), begin[:-1], kept, rows_m], axis=1)
    cost = rows_m * -(-lengths // (template.chunk // 16))
    void = (lengths == 0) & np.all(own < 0, axis=1)
    live = []
    for h in range(heads):
        items = np.arange(h * n_items, (h + 1) * n_items)
        items = items[~void[items]]
        live.append(_sorted_segment(items, cost[items]))
    order = np.concatenate([np.flatnonzero(void), *live]).astype(np.int64)
    own_mask = np.where(own >= 0, template.owner_mask.astype(np.int64)[np.maximum(own, 0)], 0)
    if slices is None:
        stream = (
            np.concatenate([e[:n] for e, n in zip(entries, kept)]) if entries else np.zeros((0, 2), np.int64)
        )
    else:
        stream = np.tile(np.array([-1, 0], np.int64), (int(capacity), 1))
        for e, b, n in zip(entries, begin[:-1], kept):
            stream[b : b + n] = e[:n]
    return dict(
        work_info=work_info.astype(np.int32),
        work_order=order.astype(np.int32),
        first_live=np.array([np.count_nonzero(void)], np.int32),
        own_entries=np.stack([own, own_mask], axis=-1).astype(np.int32),
        stream_entries=stream.astype(np.int32).reshape(-1, 2),
        overflow=int(np.count_nonzero(kept < lengths)),
        partner=None if matched is None else matched["partner"].astype(np.int32),
    )


def launch_order(template: ItemTemplate, heads: int, lengths: np.ndarray) -> np.ndarray:
    """int64 ``[heads · items]``: the device's item order of an owned plan (template items head-major):
    launch by launch (key order), head by head, longest stream first within a head (ties in template
    order), then each launch's last :data:`~.tile_plan.TAIL_ITEMS` items longest first over all heads."""
    n_items = template.num_items
    out = []
    for _, start, count, _ in template.launches:
        part = np.concatenate(
            [
                _sorted_segment(
                    h * n_items + start + np.arange(count),
                    lengths[h * n_items + start : h * n_items + start + count],
                )
                for h in range(heads)
            ]
        )
        tail = min(TAIL_ITEMS, part.size)
        if tail:
            part[part.size - tail :] = _sorted_segment(
                part[part.size - tail :], lengths[part[part.size - tail :]]
            )
        out.append(part)
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def owned_plan_arrays(template: ItemTemplate, rows: np.ndarray, capacity: int) -> dict:
    """An owned plan's arrays (the backward's K/V-owned plan, or the dQ pass's Q-owned one) as the device
    writes them, items in :func:`launch_order`: ``order`` (template item of each position), ``work_head``,
    ``own_pages`` ``[W, 8]``, ``stream_indptr`` ``[W + 1]``, ``stream_pages`` ``[S]``, ``pair_pages``
    ``[S, 3]`` (the page, then the page or -1 as each half sees it; None without pair items), and
    ``overflow``."""
    entries, counts = item_streams(template, rows)
    heads, n_items = rows.shape[0], template.num_items
    lengths = counts[:, 0]
    order = launch_order(template, heads, lengths)
    indptr = _clamped_offsets(lengths[order], capacity)
    kept = np.diff(indptr)
    streams = [entries[i][:n] for i, n in zip(order, kept)]
    stream = np.concatenate(streams) if streams else np.zeros((0, 2), np.int64)
    pair_pages = None
    if template.has_pairs:
        cats = [_categories(n, counts[i], template.mode[i % n_items]) for i, n in zip(order, kept)]
        cat = np.concatenate(cats) if cats else np.zeros(0, np.int64)
        pages = stream[:, 0]
        pair_pages = np.stack([pages, np.where(cat != 2, pages, -1), np.where(cat != 0, pages, -1)], axis=1)
    return dict(
        order=order,
        work_head=(order // n_items).astype(np.int32),
        own_pages=template.own[order % n_items].astype(np.int32)
        if order.size
        else np.zeros((0, OWN_PAGES), np.int32),
        stream_indptr=indptr.astype(np.int32),
        stream_pages=stream[:, 0].astype(np.int32),
        pair_pages=None if pair_pages is None else pair_pages.astype(np.int32),
        overflow=int(np.count_nonzero(kept < lengths[order])),
    )


def _categories(n: int, count: np.ndarray, mode: int) -> np.ndarray:
    """The category (0 A only, 1 both, 2 B only) of an item's first ``n`` entries, from their positions:
    HALVES streams are [A only | both | B only]; the other modes' entries are seen by both halves."""
    if mode != MODE_HALVES:
        return np.ones(n, dtype=np.int64)
    na, ns = int(count[1]), int(count[2])
    pos = np.arange(n)
    return np.where(pos < na, 0, np.where(pos < na + ns, 1, 2))


def as_work_list(template: ItemTemplate, arrays: dict, heads: int) -> WorkList:
    """The forward arrays as a host :class:`WorkList` (for the emulator and canonical comparisons)."""
    own = arrays["own_entries"]
    stream = arrays["stream_entries"]
    return WorkList(
        work_info=arrays["work_info"],
        work_order=arrays["work_order"],
        own_pages=own[..., 0],
        own_mask=own[..., 1].astype(np.uint32),
        stream_pages=stream[:, 0],
        stream_mask=stream[:, 1].astype(np.uint32),
        heads=heads,
        chunk=template.chunk,
    )


def as_tile_plan(template: ItemTemplate, arrays: dict, heads: int) -> TilePlan:
    """An owned plan's arrays as a host :class:`TilePlan` (items in the device's order)."""
    items = arrays["order"] % template.num_items
    vis = None
    if arrays["pair_pages"] is not None:
        pp = arrays["pair_pages"]
        vis = ((pp[:, 1] >= 0).astype(np.uint32) | ((pp[:, 2] >= 0).astype(np.uint32) << 1)).astype(np.uint32)
    return TilePlan(
        kind=template.kind,
        owner=template.owner,
        routes=template.routes,
        work_route=template.route[items].astype(np.int8),
        work_head=arrays["work_head"],
        work_block=template.block[items].astype(np.int32),
        own_pages=arrays["own_pages"],
        stream_indptr=arrays["stream_indptr"],
        stream_pages=arrays["stream_pages"],
        own_page_mask=template.owner_mask,
        stream_page_mask=template.stream.mask,
        heads=heads,
        stream_vis=vis,
    )


def emulate_plans(planner, q2k_idx=None, q2k_num=None, mask=None) -> dict:
    """What :meth:`DevicePlanner.plan <.device.DevicePlanner.plan>` writes for a selection (numpy arrays,
    ``[batch, heads, ...]`` like the device's), as ``{"forward", "backward", "dq"}`` arrays (None where the
    planner has no such plan), the selection matrix ``"rows"`` (``[batch · heads, q_blocks, k_blocks]``),
    ``"heads"`` (batch · heads) and ``"invalid"``."""
    fwd = planner.forward
    if mask is not None:
        mask = np.asarray(mask)
        heads = mask.shape[0] * mask.shape[1]
        sel, invalid = selection_matrix(
            fwd.owner_alive, fwd.stream.alive, mask=mask.reshape(heads, *mask.shape[2:])
        )
        k = sel.shape[2] if planner.max_selected is None else min(sel.shape[2], planner.max_selected)
    else:
        idx = np.asarray(q2k_idx)
        heads, k = idx.shape[0] * idx.shape[1], idx.shape[3]
        sel, invalid = selection_matrix(
            fwd.owner_alive,
            fwd.stream.alive,
            idx.reshape(heads, *idx.shape[2:]),
            np.asarray(q2k_num).reshape(heads, -1),
        )
    out = {"rows": sel, "heads": heads, "invalid": invalid}
    slices = fwd.stream_slices(k) if planner.forward_slices else None
    out["forward"] = forward_arrays(fwd, sel, planner.capacity(fwd, heads, k), slices)
    bwd, dq = planner.backward, planner.dq
    rows_t = np.ascontiguousarray(sel.transpose(0, 2, 1))
    out["backward"] = None if bwd is None else owned_plan_arrays(bwd, rows_t, planner.capacity(bwd, heads, k))
    out["dq"] = None if dq is None else owned_plan_arrays(dq, sel, planner.capacity(dq, heads, k))
    return out
