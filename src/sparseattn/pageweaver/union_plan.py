"""PageWeaver's union plan: each query group's union of selected pages with per-member masks.

The union kernel runs one CTA per (group, KV head). A group holds at most :data:`MEMBER_SLOTS` = 8
queries; member slot ``m`` of query head ``h`` (of the ``G`` query heads sharing the KV head) is tile
row ``h·8 + m`` (so slot ``m`` owns rows ``m, m+8, …``). The CTA walks the group's union
``U_g = ∪_{q∈g} S_q`` (ascending page ids) once, ``P`` keys per page, with an online softmax; key
``j`` of page ``p`` counts for member ``m`` iff

* bit ``m`` of the page's member mask is set (member ``m`` selected ``p``),
* its position ``p·P + j < context``, and
* for a causal capture, ``p·P + j ≤ positions[member]``.

The GPU kernel builds each union itself from the member ids; :class:`UnionPlan` is the CPU model of
that information (analysis, validation and the numpy emulator :func:`emulate_union`):

* ``members``       int32 ``[num_groups, 8]``: query ids, ``-1`` padding at the end of a row;
* ``union_offsets`` int32 ``[num_groups + 1]``: CSR offsets into the two arrays below;
* ``union_pages``   int32 ``[total]``: group ``g``'s union, strictly ascending page ids;
* ``member_masks``  uint8 ``[total]``: bit ``m`` set iff member slot ``m`` selected that page.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .captures import Capture
from .grouping import Grouping, GroupingError, validate_grouping
from .reference import check_paged_qkv

#: Queries per group the kernel holds (one bit each in a ``uint8`` member mask).
MEMBER_SLOTS = 8
#: Default row tile of the union kernel (rows of a CTA are padded to a multiple of it).
UNION_ROW_TILE = 64


class UnionPlanError(ValueError):
    """A union plan (or an argument of this module) is invalid; the message names the field."""


@dataclass(frozen=True, eq=False)
class UnionPlan:
    """Per-group page unions with member masks (see the module docstring for the fields)."""

    members: np.ndarray
    union_offsets: np.ndarray
    union_pages: np.ndarray
    member_masks: np.ndarray
    page_size: int
    num_pages: int
    num_queries: int

    @property
    def num_groups(self) -> int:
        return int(np.shape(self.members)[0])

    @property
    def union_lengths(self) -> np.ndarray:
        """int64 ``[num_groups]``: ``|U_g|``, pages in each group's union."""
        return np.diff(np.asarray(self.union_offsets, dtype=np.int64))

    @property
    def member_counts(self) -> np.ndarray:
        """int64 ``[num_groups]``: members per group."""
        return (np.asarray(self.members) >= 0).sum(axis=1)

    def __repr__(self) -> str:
        return (
            f"UnionPlan(groups={self.num_groups}, queries={self.num_queries}, "
            f"union_pages={int(np.shape(self.union_pages)[0])}, page_size={self.page_size})"
        )


def _group_of_entries(offsets: np.ndarray, total: int) -> np.ndarray:
    """int64 ``[total]``: the group of each union entry (offsets already checked to be CSR)."""
    return np.repeat(np.arange(offsets.shape[0] - 1), np.diff(offsets))[:total]


def build_union_plan(capture: Capture, grouping: Grouping) -> UnionPlan:
    """The union plan of ``grouping`` over ``capture`` (vectorized: one sort, one OR-reduce).

    Raises :class:`UnionPlanError` naming ``grouping`` when it is not a valid grouping of the
    capture's queries or a group has more than :data:`MEMBER_SLOTS` queries.
    """
    if not isinstance(capture, Capture):
        raise UnionPlanError(f"capture must be a Capture, got {type(capture).__name__}")
    if not isinstance(grouping, Grouping):
        raise UnionPlanError(f"grouping must be a Grouping, got {type(grouping).__name__}")
    try:
        validate_grouping(grouping, capture.num_queries, group_size=np.iinfo(np.int64).max)
    except GroupingError as err:
        raise UnionPlanError(f"grouping: {err}") from None
    sizes = grouping.sizes
    if (sizes > MEMBER_SLOTS).any():
        g = int(np.flatnonzero(sizes > MEMBER_SLOTS)[0])
        raise UnionPlanError(
            f"grouping: group {g} has {int(sizes[g])} queries, more than MEMBER_SLOTS={MEMBER_SLOTS}"
        )
    members = grouping.padded(MEMBER_SLOTS)  # [ng, 8]
    ng, npages = members.shape[0], capture.num_pages
    sel = capture.pages[np.maximum(members, 0)]  # [ng, 8, k]
    g, m, c = np.nonzero((members[:, :, None] >= 0) & (sel >= 0))
    key = g.astype(np.int64) * npages + sel[g, m, c]
    order = np.argsort(key, kind="stable")
    key = key[order]
    bits = np.left_shift(np.uint8(1), m[order].astype(np.uint8))
    if key.size:
        starts = np.flatnonzero(np.concatenate([[True], key[1:] != key[:-1]]))
        masks = np.bitwise_or.reduceat(bits, starts).astype(np.uint8)
        ukey = key[starts]
    else:
        masks, ukey = np.zeros(0, np.uint8), np.zeros(0, np.int64)
    offsets = np.zeros(ng + 1, dtype=np.int64)
    np.cumsum(np.bincount(ukey // npages, minlength=ng), out=offsets[1:])
    return UnionPlan(
        members=members.astype(np.int32),
        union_offsets=offsets.astype(np.int32),
        union_pages=(ukey % npages).astype(np.int32),
        member_masks=masks,
        page_size=capture.page_size,
        num_pages=npages,
        num_queries=capture.num_queries,
    )


def _plan_array(name: str, value, dtype, ndim: int) -> np.ndarray:
    """The plan field as int64 after checking its dtype (what the kernel reads) and rank."""
    arr = np.asarray(value)
    if arr.dtype != dtype:
        raise UnionPlanError(f"{name} must be {np.dtype(dtype).name}, got dtype {arr.dtype}")
    if arr.ndim != ndim:
        raise UnionPlanError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    return arr.astype(np.int64)


def validate_union_plan(plan: UnionPlan, capture: Capture) -> None:
    """Raise :class:`UnionPlanError` (naming the field and the first offending group) unless ``plan`` is
    the union plan of some grouping of ``capture``.

    Checks: every query in exactly one group, member ids in range and padded only at a row's end; CSR
    offsets monotone from 0 to ``len(union_pages)``; pages in ``[0, num_pages)``, strictly ascending in
    a group; masks nonzero with bits of existing members only; and the plan's (member, page) pairs are
    exactly the capture's selections. Dtypes are exact (int32 ids, offsets and pages; uint8 masks).
    """
    if not isinstance(plan, UnionPlan):
        raise UnionPlanError(f"plan must be a UnionPlan, got {type(plan).__name__}")
    if not isinstance(capture, Capture):
        raise UnionPlanError(f"capture must be a Capture, got {type(capture).__name__}")
    for name, want in (
        ("page_size", capture.page_size),
        ("num_pages", capture.num_pages),
        ("num_queries", capture.num_queries),
    ):
        if getattr(plan, name) != want:
            raise UnionPlanError(f"{name}: the plan has {getattr(plan, name)!r}, the capture {want}")
    Q, npages = capture.num_queries, capture.num_pages
    members = _plan_array("members", plan.members, np.int32, 2)
    offsets = _plan_array("union_offsets", plan.union_offsets, np.int32, 1)
    pages = _plan_array("union_pages", plan.union_pages, np.int32, 1)
    masks = _plan_array("member_masks", plan.member_masks, np.uint8, 1)

    # ---- members -------------------------------------------------------------------------------
    if members.shape[1] != MEMBER_SLOTS:
        raise UnionPlanError(f"members must have {MEMBER_SLOTS} columns, got shape {members.shape}")
    ng = members.shape[0]
    bad = (members < -1) | (members >= Q)
    if bad.any():
        g, s = np.argwhere(bad)[0]
        raise UnionPlanError(
            f"members: group {g} slot {s} holds query id {members[g, s]} outside [0, {Q}) (-1 pads)"
        )
    valid = members >= 0
    if ng and not valid[:, 0].all():
        raise UnionPlanError(f"members: group {int(np.flatnonzero(~valid[:, 0])[0])} is empty")
    late = valid[:, 1:] & ~valid[:, :-1]
    if late.any():
        g = int(np.argwhere(late)[0, 0])
        raise UnionPlanError(f"members: group {g} has a query id after -1 padding (pad only at the end)")
    count = np.bincount(members[valid], minlength=Q)
    if (count > 1).any():
        q = int(np.flatnonzero(count > 1)[0])
        where = np.flatnonzero((members == q).any(axis=1)).tolist()
        raise UnionPlanError(f"members: query {q} is in more than one group (groups {where})")
    if (count == 0).any():
        raise UnionPlanError(f"members: query {int(np.flatnonzero(count == 0)[0])} is in no group")

    # ---- CSR -----------------------------------------------------------------------------------
    total = pages.shape[0]
    if offsets.shape != (ng + 1,):
        raise UnionPlanError(
            f"union_offsets must have shape (num_groups + 1,) = ({ng + 1},), got {offsets.shape}"
        )
    if offsets[0] != 0 or offsets[-1] != total:
        raise UnionPlanError(
            f"union_offsets must run from 0 to len(union_pages) = {total}, got {offsets[0]} … {offsets[-1]}"
        )
    if (np.diff(offsets) < 0).any():
        g = int(np.flatnonzero(np.diff(offsets) < 0)[0])
        raise UnionPlanError(f"union_offsets: decreasing at group {g} ({offsets[g]} > {offsets[g + 1]})")
    if masks.shape != (total,):
        raise UnionPlanError(f"member_masks must have union_pages' shape ({total},), got {masks.shape}")
    grp = _group_of_entries(offsets, total)

    # ---- pages and masks -----------------------------------------------------------------------
    bad = (pages < 0) | (pages >= npages)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise UnionPlanError(
            f"union_pages: group {grp[i]} has page {pages[i]} outside [0, num_pages={npages})"
        )
    down = (grp[1:] == grp[:-1]) & (pages[1:] <= pages[:-1])
    if down.any():
        i = int(np.flatnonzero(down)[0])
        raise UnionPlanError(
            f"union_pages: group {grp[i]} is not strictly ascending (page {pages[i]} then {pages[i + 1]})"
        )
    if (masks == 0).any():
        i = int(np.flatnonzero(masks == 0)[0])
        raise UnionPlanError(f"member_masks: group {grp[i]} page {pages[i]} has an empty mask")
    allowed = (1 << valid.sum(axis=1)) - 1  # members sit in slots 0 … n-1
    stray = masks & ~allowed[grp] if total else masks
    if (stray != 0).any():
        i = int(np.flatnonzero(stray)[0])
        slot = int(np.flatnonzero([(int(stray[i]) >> b) & 1 for b in range(MEMBER_SLOTS)])[0])
        raise UnionPlanError(
            f"member_masks: group {grp[i]} page {pages[i]} sets bit {slot}, but the group has only "
            f"{int(valid[grp[i]].sum())} members"
        )

    # ---- the (member, page) pairs equal the capture's selections --------------------------------
    bitset = (masks[:, None] >> np.arange(MEMBER_SLOTS)) & 1  # [total, 8]
    e, s = np.nonzero(bitset)
    plan_keys = np.sort(members[grp[e], s] * npages + pages[e])
    cp = capture.pages.astype(np.int64)
    r, c = np.nonzero(cp >= 0)
    cap_keys = np.sort(r * npages + cp[r, c])
    if plan_keys.shape == cap_keys.shape and np.array_equal(plan_keys, cap_keys):
        return
    group_of = np.empty(Q, dtype=np.int64)
    slot_of = np.empty(Q, dtype=np.int64)
    group_of[members[valid]] = np.nonzero(valid)[0]
    slot_of[members[valid]] = np.nonzero(valid)[1]
    extra = np.setdiff1d(plan_keys, cap_keys)
    missing = np.setdiff1d(cap_keys, plan_keys)
    first_extra = extra[np.argmin(group_of[extra // npages])] if extra.size else None
    first_missing = missing[np.argmin(group_of[missing // npages])] if missing.size else None
    if first_missing is None or (
        first_extra is not None and group_of[first_extra // npages] <= group_of[first_missing // npages]
    ):
        q, p = divmod(int(first_extra), npages)
        raise UnionPlanError(
            f"member_masks: group {group_of[q]} slot {slot_of[q]} (query {q}) is marked for page {p}, "
            "which the capture does not select"
        )
    q, p = divmod(int(first_missing), npages)
    g = group_of[q]
    if np.any(pages[offsets[g] : offsets[g + 1]] == p):
        raise UnionPlanError(
            f"member_masks: group {g} page {p} lacks bit {slot_of[q]} (query {q}), which selects it"
        )
    raise UnionPlanError(f"union_pages: group {g} lacks page {p}, selected by slot {slot_of[q]} (query {q})")


def emulate_union(plan: UnionPlan, capture: Capture, q, k, v, scale=None, chunk_keys: int = 64):
    """(o float64 ``[q_heads, Q, d]``, lse float64 ``[q_heads, Q]``): the plan run as the kernel runs it.

    Per (group, KV head) the tile rows are (query head ``h`` of the KV head, member slot ``m``); the
    union's keys (pages in plan order, ``P`` keys each) stream through in chunks of ``chunk_keys`` with
    an online softmax (running max, running sum, rescaled accumulator); masking as in the module
    docstring. Groups are vectorized (batches bound the memory). Shapes and results as
    :func:`.reference.paged_attention_reference` (float64, so they agree to rounding): a query without
    a valid key gets ``o = 0``, ``lse = −inf``.
    """
    validate_union_plan(plan, capture)
    if isinstance(chunk_keys, bool) or not isinstance(chunk_keys, (int, np.integer)) or chunk_keys < 1:
        raise UnionPlanError(f"chunk_keys must be a positive integer, got {chunk_keys!r}")
    q, k, v = check_paged_qkv(q, k, v, capture, UnionPlanError)
    hq, nq, d = q.shape
    hkv = k.shape[0]
    scale = 1.0 / np.sqrt(d) if scale is None else float(scale)
    G, P, S = hq // hkv, plan.page_size, MEMBER_SLOTS
    members = np.asarray(plan.members, dtype=np.int64)
    offsets = np.asarray(plan.union_offsets, dtype=np.int64)
    upages = np.asarray(plan.union_pages, dtype=np.int64)
    umasks = np.asarray(plan.member_masks, dtype=np.int64)
    lengths = np.diff(offsets) * P  # keys per group
    # last key position each member may see (context bound, causal bound); -1 for an empty slot
    last = capture.positions[np.maximum(members, 0)] if capture.causal else capture.context - 1
    limit = np.where(members >= 0, np.minimum(last, capture.context - 1), -1)  # [ng, 8]
    o = np.zeros((hq, nq, d))
    lse = np.full((hq, nq), -np.inf)
    ck = int(chunk_keys)
    batch = max(1, (1 << 21) // max(1, G * S * ck))  # groups per batch: bounds the score tensor
    for b0 in range(0, plan.num_groups, batch):
        gs = np.arange(b0, min(plan.num_groups, b0 + batch))
        # Slots past the batch's largest group hold no query: skipped (their rows stay empty).
        width = max(1, int((members[gs] >= 0).sum(axis=1).max(initial=1)))
        mem, lim, nkeys, first = members[gs, :width], limit[gs, :width], lengths[gs], offsets[gs]
        n, slot = gs.size, np.arange(width)
        gi, mi = np.nonzero(mem >= 0)
        qid = mem[gi, mi]
        for hk in range(hkv):
            # rows (h, m) of the tile, flattened h·width + m (the kernel's h·8 + m, empty slots dropped)
            qq = q[hk * G : (hk + 1) * G][:, np.maximum(mem, 0)].astype(np.float64)  # [G, n, w, d]
            qq = qq.transpose(1, 0, 2, 3).reshape(n, G * width, d)
            run_max = np.full((n, G * width), -np.inf)
            run_sum = np.zeros((n, G * width))
            acc = np.zeros((n, G * width, d))
            for j0 in range(0, int(nkeys.max(initial=0)), ck):
                j = j0 + np.arange(ck)  # key index inside the union
                inside = j[None, :] < nkeys[:, None]  # [n, ck]
                entry = np.where(inside, first[:, None] + j[None, :] // P, 0)
                page, mask = upages[entry], umasks[entry]
                pos = np.where(inside, page * P + j[None, :] % P, 0)  # [n, ck]
                ok = inside[:, None, :] & (((mask[:, None, :] >> slot[None, :, None]) & 1) == 1)
                ok &= pos[:, None, :] <= lim[:, :, None]  # context and causal limit: [n, w, ck]
                row = np.minimum(pos, k.shape[1] - 1)  # keys past the cache rows are masked anyway
                kk = k[hk][row].astype(np.float64)  # [n, ck, d]
                vv = v[hk][row].astype(np.float64)
                s = scale * np.matmul(qq, kk.transpose(0, 2, 1))  # [n, G·w, ck]
                s = np.where(np.tile(ok, (1, G, 1)), s, -np.inf)
                new_max = np.maximum(run_max, s.max(axis=-1))
                shift = np.where(np.isfinite(new_max), new_max, 0.0)
                alpha = np.exp(run_max - shift)
                p = np.exp(s - shift[..., None])
                run_sum = run_sum * alpha + p.sum(axis=-1)
                acc = acc * alpha[..., None] + np.matmul(p, vv)
                run_max = new_max
            has = run_sum > 0
            out = (acc / np.where(has, run_sum, 1.0)[..., None]).reshape(n, G, width, d)
            l = np.where(has, run_max + np.log(np.where(has, run_sum, 1.0)), -np.inf).reshape(n, G, width)
            for h in range(G):
                o[hk * G + h, qid] = out[gi, h, mi]
                lse[hk * G + h, qid] = l[gi, h, mi]
    return o, lse


def union_counts(plan: UnionPlan, heads_q: int = 1, row_tile: int = UNION_ROW_TILE) -> dict:
    """Work of the union kernel per KV head (``G = heads_q`` query heads share it; ``P`` = page size).

    * ``useful_pairs   = G · Σ_q |S_q| · P`` — (query row, key) pairs the selections ask for (page
      granularity: context and causal masking inside a page are not subtracted);
    * ``rows_per_group = row_tile · ⌈MEMBER_SLOTS · G / row_tile⌉`` — the CTA's rows (every group pays
      all 8 member slots per query head, whatever its size);
    * ``physical_pairs = Σ_g rows_per_group · |U_g| · P`` — pairs the tensor cores compute;
    * ``page_loads     = Σ_g |U_g|`` — pages each KV head loads (K and V once per union page);
    * ``per_query_page_loads = Σ_q |S_q|`` — the loads without grouping, for comparison;
    * ``occupancy = useful_pairs / physical_pairs`` (0 when nothing is selected).
    """
    for name, x in (("heads_q", heads_q), ("row_tile", row_tile)):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 1:
            raise UnionPlanError(f"{name} must be a positive integer, got {x!r}")
    P = int(plan.page_size)
    lengths = plan.union_lengths
    useful_pages = int(np.count_nonzero(np.unpackbits(np.asarray(plan.member_masks, np.uint8))))
    rows = int(row_tile) * -(-MEMBER_SLOTS * int(heads_q) // int(row_tile))
    useful = int(heads_q) * useful_pages * P
    physical = rows * int(lengths.sum()) * P
    return {
        "groups": plan.num_groups,
        "rows_per_group": rows,
        "useful_pairs": useful,
        "physical_pairs": physical,
        "page_loads": int(lengths.sum()),
        "per_query_page_loads": useful_pages,
        "occupancy": useful / physical if physical else 0.0,
        "mean_union": float(lengths.mean()) if lengths.size else 0.0,
    }
