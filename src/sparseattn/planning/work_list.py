"""The flat work list the persistent paged kernels read, built from tile plans (CPU, numpy).

A :class:`~sparseattn.planning.tile_plan.TilePlan` describes one layout shared by all heads; a work list is
what one launch executes: every work item with its head, its stream of K/V pages and its owned Q pages,
the row mask of every entry (so heads with their own layouts — a :class:`~sparseattn.graph.HeadStack`
— run in one launch), and the order in which the persistent CTAs take the items (largest first).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ..constants import PAGE_ROWS
from .tile_plan import TilePlan

# KernelValueError (sparseattn.kernels.validate) is imported where raised: `import sparseattn` loads no
# kernel module.

#: Owned Q pages per work item the kernel reads (the largest route's M / 16).
OWN_PAGES = 8
#: Key-chunk widths the forward kernel is built for.
CHUNKS = (64, 128)
#: Query rows (M) of the routes the kernel runs: 64 (two warpgroups split the keys) or 128 (the rows).
ROUTE_ROWS = (64, 128)
#: Visibility bits of a stream entry's mask word (pair items, :mod:`.pair_forward`): bit 16 + s set =
#: the rows of owned page slot s (rows 16s .. 16s + 15) see the page. An entry without any is seen by
#: every row. ``VIS_HALF0`` / ``VIS_HALF1``: all slots of rows 0-63 / 64-127.
VIS_SHIFT = 16
VIS_SLOTS = 0xFF << VIS_SHIFT
VIS_HALF0, VIS_HALF1 = 0x0F << VIS_SHIFT, 0xF0 << VIS_SHIFT
#: Bit of an item's rows word (``work_info[w, 3]``) in the arrays a pair list hands the kernel
#: (:meth:`WorkList.device_arrays`): no entry of the item has visibility bits, so the kernel's pair
#: instantiation runs it without decoding them per chunk (``kPlainItem`` in ``kernels_cu/paged_fwd.cu``).
PLAIN_ITEM = 1 << 16
#: Orders in which the persistent CTAs take items: "head" = head by head, largest first within a
#: head (concurrent CTAs share one head's K/V in L2); "cost" = largest first over all heads.
ORDERS = ("head", "cost")


def default_order() -> str:
    """``$SPARSEATTN_WORK_ORDER`` (an experiment knob) or ``"head"``."""
    order = os.environ.get("SPARSEATTN_WORK_ORDER", "head")
    if order not in ORDERS:
        from ..kernels.validate import KernelValueError

        raise KernelValueError(f"SPARSEATTN_WORK_ORDER must be one of {ORDERS}, got {order!r}")
    return order


@dataclass(frozen=True, eq=False)
class WorkList:
    """Arrays of one launch of the paged forward kernel.

    Attributes:
        work_info: int32 ``[W, 4]``: head, first stream entry, stream length (pages), query rows M.
        work_order: int32 ``[W]``: the order the persistent CTAs take items (see ``ORDERS``).
        own_pages: int32 ``[W, 8]``: owned Q page ids, ``-1`` padded.
        own_mask: uint32 ``[W, 8]``: 16-bit row mask of each owned page (0 for padding).
        stream_pages: int32 ``[S]``; stream_mask: uint32 ``[S]``: streamed K/V page ids and row masks.
        heads: heads the list indexes.
        chunk: keys per chunk (64 or 128) the kernel streams.
    """

    work_info: np.ndarray
    work_order: np.ndarray
    own_pages: np.ndarray
    own_mask: np.ndarray
    stream_pages: np.ndarray
    stream_mask: np.ndarray
    heads: int
    chunk: int

    @property
    def num_work(self) -> int:
        return int(self.work_info.shape[0])

    def chunks_per_item(self) -> np.ndarray:
        """int64 ``[W]``: key chunks each item streams."""
        pages = self.chunk // PAGE_ROWS
        return -(-self.work_info[:, 2].astype(np.int64) // pages)

    def executed_pairs(self) -> int:
        """Σ over items of M · chunk · (chunks streamed): the query–key pairs the tensor cores compute. With
        row-half visibility bits (pair items) each 64-row half of a 128-row item counts only the chunks
        holding a page it sees."""
        info = self.work_info.astype(np.int64)
        chunks = self.chunks_per_item()
        if not self.has_visibility():
            return int((info[:, 3] * self.chunk * chunks).sum())
        halves = info[:, 3] > 64
        total = int((info[~halves, 3] * self.chunk * chunks[~halves]).sum())
        # entries of the 128-row items: (item, chunk) keys, kept where a half sees the entry
        items = np.flatnonzero(halves)
        lengths = info[items, 2]
        offsets = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        entries = np.repeat(info[items, 1], lengths) + offsets
        keys = np.repeat(np.arange(items.size), lengths) * (int(chunks.max()) + 1) + offsets // (
            self.chunk // PAGE_ROWS
        )
        seen = _visibility(self.stream_mask[entries]).reshape(2, 4, -1).any(axis=1)  # per row half
        return total + sum(64 * self.chunk * np.unique(keys[seen[h]]).size for h in (0, 1))

    def has_visibility(self) -> bool:
        """True when some stream entry carries visibility bits (a pair work list). A pass over every stream
        entry (tens of milliseconds on a 720p list), so computed once: the forward asks at every launch."""
        known = self.__dict__.get("_has_visibility")
        if known is None:
            known = bool((self.stream_mask.astype(np.uint32) & VIS_SLOTS).any())
            object.__setattr__(self, "_has_visibility", known)
        return known

    def stream_visibility(self, begin: int, length: int) -> np.ndarray:
        """bool ``[8, length]``: which owned page slot (rows 16s .. 16s + 15) sees each entry of a stream."""
        return _visibility(self.stream_mask[begin : begin + length])

    def plain_items(self) -> np.ndarray:
        """bool ``[W]``: the items none of whose stream entries carries visibility bits."""
        info = self.work_info.astype(np.int64)
        marked = np.concatenate([[0], np.cumsum((self.stream_mask.astype(np.uint32) & VIS_SLOTS) != 0)])
        return marked[info[:, 1] + info[:, 2]] == marked[info[:, 1]]  # no marked entry in [begin, end)

    def device_arrays(self) -> dict[str, np.ndarray]:
        """What the kernel reads: work_info int4 [W], work_order [W], own entries int2 [W, 8] and
        stream entries int2 [S] of (page id, row mask). In a list with visibility bits (the pair
        instantiation's), the rows word of each item without any carries :data:`PLAIN_ITEM`."""
        info = np.array(self.work_info, dtype=np.int32)
        if self.has_visibility():
            info[self.plain_items(), 3] |= PLAIN_ITEM
        return {
            "work_info": info,
            "work_order": np.ascontiguousarray(self.work_order, dtype=np.int32),
            "own_entries": np.ascontiguousarray(
                np.stack([self.own_pages, self.own_mask.astype(np.int32)], axis=-1), dtype=np.int32
            ),
            "stream_entries": np.ascontiguousarray(
                np.stack([self.stream_pages, self.stream_mask.astype(np.int32)], axis=-1), dtype=np.int32
            ),
        }


def _visibility(masks: np.ndarray) -> np.ndarray:
    """bool ``[8, n]``: which owned page slot sees each entry (an entry without visibility bits: all)."""
    m = masks.astype(np.uint32)
    none = (m & VIS_SLOTS) == 0
    return np.stack([none | ((m >> (VIS_SHIFT + s)) & 1).astype(bool) for s in range(OWN_PAGES)])


def chunk_for(plans) -> int:
    """Keys per chunk for the routes these plans use: 64 when every route is 64 keys wide, else 128.

    Raises :class:`KernelValueError` when a route's M is not 64 or 128 or its N is not a multiple of
    the chunk (the kernel would execute a different tile than the plan counts).
    """
    used = set()
    for plan in plans:
        if plan.num_work:
            used |= {tuple(plan.routes[int(r)]) for r in np.unique(plan.work_route)}
    chunk = 64 if used and all(n == 64 for _, n in used) else 128
    for m, n in sorted(used):
        if m not in ROUTE_ROWS or n % chunk:
            from ..kernels.validate import KernelValueError

            raise KernelValueError(
                f"plan.routes has tile {(m, n)}; the paged forward kernel runs M in {ROUTE_ROWS} with N a "
                f"multiple of {chunk} (plans mixing 64- and wider key tiles run with {chunk}-key chunks)"
            )
    return chunk


def work_list(plans, heads_of=None, order: str | None = None) -> WorkList:
    """One work list from owner-``"q"`` plans (validated before: page ids in range).

    Args:
        plans: one :class:`TilePlan` (all heads) or a sequence of single-head plans (a HeadStack).
        heads_of: with several plans, the head each plan's head 0 becomes (default ``0, 1, ...``).
        order: ``"head"`` or ``"cost"`` (default :func:`default_order`).
    """
    order = default_order() if order is None else order
    if order not in ORDERS:
        from ..kernels.validate import KernelValueError

        raise KernelValueError(f"order must be one of {ORDERS}, got {order!r}")
    plans = _checked_plans(plans, "q", "the forward kernel")
    return _flatten(plans, heads_of, chunk_for(plans), order)


#: Streamed Q rows per step of the backward kernels (a backward work list's ``chunk``).
BACKWARD_STEP_ROWS = 64


def backward_work_list(plans, heads_of=None) -> WorkList:
    """One work list from owner-``"kv"`` plans, for a K/V-owned backward: items own K/V pages (``M``
    = 64 or 128 rows) and stream the Q pages that select them, ``chunk`` = the streamed rows per step.
    With several single-head plans (a HeadStack), every head keeps its own layouts through the entries'
    row masks. Arguments as :func:`work_list`; items are ordered largest first."""
    plans = _checked_plans(plans, "kv", "the backward kernel")
    for i, plan in enumerate(plans):
        if plan.num_work:
            rows = {int(plan.routes[int(r)][0]) for r in np.unique(plan.work_route)}
            if not rows <= set(ROUTE_ROWS):
                from ..kernels.validate import KernelValueError

                raise KernelValueError(
                    f"plans[{i}] owns tiles of {sorted(rows)} rows; the backward kernel owns {ROUTE_ROWS}"
                )
    return _flatten(plans, heads_of, BACKWARD_STEP_ROWS, "cost")


def _checked_plans(plans, owner: str, what: str) -> list[TilePlan]:
    from ..kernels.validate import KernelValueError

    plans = [plans] if isinstance(plans, TilePlan) else list(plans)
    if not plans:
        raise KernelValueError("a work list needs at least one plan")
    for i, plan in enumerate(plans):
        if not isinstance(plan, TilePlan):
            raise KernelValueError(f"plans[{i}] must be a TilePlan, got {type(plan).__name__}")
        if plan.owner != owner:
            raise KernelValueError(f"plans[{i}].owner is {plan.owner!r}; {what} needs owner={owner!r}")
    if len(plans) > 1 and any(p.heads != 1 for p in plans):
        raise KernelValueError("several plans must each hold one head (a HeadStack)")
    return plans


def work_order(info: np.ndarray, chunk: int, order: str) -> np.ndarray:
    """int32 ``[W]``: the order the persistent CTAs take the items of ``info`` (``work_info``, ``[W, 4]``):
    largest first (M × chunks), head by head (``"head"``) or over all heads (``"cost"``), ties in item
    order."""
    info = info.astype(np.int64)
    cost = info[:, 3] * -(-info[:, 2] // (chunk // PAGE_ROWS))
    index = np.arange(info.shape[0])
    keys = (index, -cost, info[:, 0]) if order == "head" else (index, info[:, 0], -cost)
    return np.lexsort(keys).astype(np.int32)


def _flatten(plans: list[TilePlan], heads_of, chunk: int, order: str) -> WorkList:
    """The plans' items, entries and row masks as one list; ``order`` as :func:`work_list`."""
    head_base = np.arange(len(plans)) if heads_of is None else np.asarray(heads_of, dtype=np.int64)
    parts = {name: [] for name in ("info", "own", "own_mask", "stream", "stream_mask")}
    offset = 0
    for plan, h0 in zip(plans, head_base):
        w = plan.num_work
        rows = (
            np.asarray(plan.routes, dtype=np.int64)[plan.work_route.astype(np.int64), 0] if w else np.zeros(0)
        )
        lengths = plan.stream_lengths()
        info = (
            np.stack(
                [
                    plan.work_head.astype(np.int64) + int(h0),
                    plan.stream_indptr[:-1].astype(np.int64) + offset,
                    lengths,
                    rows,
                ],
                axis=1,
            )
            if w
            else np.zeros((0, 4), np.int64)
        )
        own = np.full((w, OWN_PAGES), -1, dtype=np.int64)
        cols = min(OWN_PAGES, plan.own_pages.shape[1])
        own[:, :cols] = plan.own_pages[:, :cols]
        own_mask = np.where(own >= 0, plan.own_page_mask[np.maximum(own, 0)], 0).astype(np.uint32)
        stream = plan.stream_pages.astype(np.int64)
        parts["info"].append(info)
        parts["own"].append(own)
        parts["own_mask"].append(own_mask)
        parts["stream"].append(stream)
        parts["stream_mask"].append(plan.stream_page_mask[stream].astype(np.uint32))
        offset += stream.size
    info = np.concatenate(parts["info"]).astype(np.int64)
    if offset > np.iinfo(np.int32).max:
        from ..kernels.validate import KernelValueError

        raise KernelValueError(f"the plans stream {offset} pages, more than int32 indexing allows")
    return WorkList(
        work_info=info.astype(np.int32),
        work_order=work_order(info, chunk, order),
        own_pages=np.concatenate(parts["own"]).astype(np.int32),
        own_mask=np.concatenate(parts["own_mask"]),
        stream_pages=np.concatenate(parts["stream"]).astype(np.int32),
        stream_mask=np.concatenate(parts["stream_mask"]),
        heads=int(head_base.max()) + 1 if len(plans) > 1 else int(plans[0].heads),
        chunk=chunk,
    )


def writes_every_valid_row(wl: WorkList, q_layout) -> bool:
    """Whether ``wl``'s items own every valid row of ``q_layout`` in every head (the owned pages' row masks
    together cover each page's valid rows): then a forward writes every valid row of ``o`` and only the
    padding slots need zeros. Counted once per list and layout."""
    from .cache import cached

    def count() -> bool:
        covered = np.zeros((wl.heads, q_layout.num_pages), dtype=np.uint32)
        pages = wl.own_pages.astype(np.int64)
        used = pages >= 0
        heads = np.broadcast_to(wl.work_info[:, :1].astype(np.int64), pages.shape)
        np.bitwise_or.at(covered, (heads[used], pages[used]), wl.own_mask[used].astype(np.uint32) & 0xFFFF)
        want = q_layout.page_mask.astype(np.uint32)[None, :]
        return bool(((covered & want) == want).all())

    return cached(wl, ("writes every valid row", id(q_layout)), count)


def stack_head_lists(lists: list[WorkList], order: str | None = None) -> WorkList:
    """Work lists of one head each (``lists[h]``: head h's) as one list: items' head set to h, streams
    laid back to back, items ordered by ``order`` (:func:`work_order`; default :func:`default_order`)."""
    order = default_order() if order is None else order
    infos = []
    base = 0
    for h, wl in enumerate(lists):
        info = wl.work_info.astype(np.int64).copy()
        info[:, 0] = h
        info[:, 1] += base
        base += wl.stream_pages.size
        infos.append(info)
    info = np.concatenate(infos)
    chunk = lists[0].chunk
    return WorkList(
        work_info=info.astype(np.int32),
        work_order=work_order(info, chunk, order),
        own_pages=np.concatenate([wl.own_pages for wl in lists]).astype(np.int32),
        own_mask=np.concatenate([wl.own_mask for wl in lists]).astype(np.uint32),
        stream_pages=np.concatenate([wl.stream_pages for wl in lists]).astype(np.int32),
        stream_mask=np.concatenate([wl.stream_mask for wl in lists]).astype(np.uint32),
        heads=len(lists),
        chunk=chunk,
    )
