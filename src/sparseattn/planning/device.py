"""Device planner: the forward work list and the backward plans of a selection that lives on the GPU.

A model that chooses its sparse graph per call (VSA's top-k cubes from each layer's Q and K, a learned or
score-based selection) hands the selection to a :class:`DevicePlanner`; :meth:`DevicePlanner.plan` builds
every plan the kernels read on the caller's stream, with no host synchronisation and no copy between host
and device, so a call can be captured in a CUDA graph:

.. code-block:: text

    selection (top-k indices + counts, or a block mask)       [batch, heads, q_blocks, ...]
      -> bitmap: one row of bits per (batch · head, Q block)   plan_bitmap_from_topk / _from_mask
      -> per template item: pages streamed (count pass)        plan_items
      -> offsets (scan) and order (per-head sort)              plan_scan, plan_segment_sort
      -> streams written at their offsets (write pass)         plan_items
      -> the backward's K/V-owned plan from the transposed bitmap, the same way

What depends only on the layouts (live pages per block, routes, owned pages, which blocks pair up: an
:class:`~.templates.ItemTemplate`) is built once per planner on the host and uploaded once per device.
Every batch entry selects on its own: a call plans ``batch · heads`` heads, and the kernels run the tensors
viewed as ``[1, batch · heads, slots, d]``.

The plans equal the host planners' on the same graph (:mod:`.device_emulation` runs these steps in numpy;
the tests compare it with the host and the GPU with it): the same work items with the same streams, in
their stream order, and the same per-head ordering rules; the items are stored in the template's order
(the forward's ``work_order`` orders them) and the pair items join blocks by a rule of the layout
(:mod:`.layout_pairs`), where the host matches them by shared pages. ``route="auto"`` likewise decides by
a rule of the layout (:func:`~.templates.forward_route`, :func:`~.templates.backward_route`).

Buffers are sized before the call from the layouts and the selection's width (the top-k's ``k``, or every
K block for a mask: see :meth:`ItemTemplate.stream_capacity`), so they hold any selection of that form.
Invalid selection entries (an index outside ``[0, k_blocks)``, a count outside ``[0, k]``) are ignored and
counted; :meth:`DevicePlans.check` (which synchronises) raises if there were any.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..constants import PAGE_ROWS
from ..layouts import BlockLayout
from .templates import ItemTemplate, backward_template, dq_template, forward_template
from .tile_plan import TAIL_ITEMS, PlanError, PlanTypeError

SLOTS = 8


def _words(n: int) -> int:
    return -(-n // 32)


def _alive_words(alive: np.ndarray) -> np.ndarray:
    """uint32 bitmap of a bool array (bit i of word i // 32)."""
    words = np.zeros(max(1, _words(alive.size)), dtype=np.uint32)
    idx = np.flatnonzero(alive)
    np.bitwise_or.at(words, idx // 32, (np.uint32(1) << (idx % 32).astype(np.uint32)))
    return words


@dataclass(frozen=True, eq=False)
class DeviceTemplate:
    """An :class:`ItemTemplate`'s arrays on one device, and the layout bitmaps of its two sides."""

    template: ItemTemplate
    tables: dict
    owner_alive: object
    stream_alive: object
    uncovered: object
    uncovered_count: int
    segments: dict = field(default_factory=dict)

    @classmethod
    def upload(cls, template: ItemTemplate) -> DeviceTemplate:
        import cupy

        st = template.stream
        tables = {
            "items": template.num_items,
            "info": cupy.asarray(template.info),
            "members": cupy.asarray(template.members),
            "bits": cupy.asarray(template.bits),
            "own": cupy.asarray(template.own),
            "t_first": cupy.asarray(st.first),
            "t_pages": cupy.asarray(st.pages if st.pages.size else np.zeros(1, np.int32)),
            "t_full": cupy.asarray(st.full if st.full.size else np.zeros(1, np.int32)),
            "t_mask": cupy.asarray(st.mask),
            "o_mask": cupy.asarray(template.owner_mask),
        }
        uncovered = template.uncovered_pages(template.owner_mask.size).astype(np.int32)
        return cls(
            template=template,
            tables=tables,
            owner_alive=cupy.asarray(_alive_words(template.owner_alive)),
            stream_alive=cupy.asarray(_alive_words(st.alive)),
            uncovered=cupy.asarray(uncovered) if uncovered.size else None,
            uncovered_count=int(uncovered.size),
        )

    def head_segments(self, heads: int):
        """int32 ``[heads, 4]``: one sort segment per head over all its items (the forward's work order)."""
        key = ("heads", heads)
        if key not in self.segments:
            import cupy

            n = self.template.num_items
            segs = np.zeros((heads, 4), dtype=np.int32)
            segs[:, 0] = segs[:, 1] = np.arange(heads) * n
            segs[:, 2] = n
            self.segments[key] = cupy.asarray(segs)
        return self.segments[key]

    def launch_segments(self, heads: int):
        """The sort segments of an owned plan: ``(per (launch, head), tails)``, int32 ``[n, 4]`` each, and
        the launches ``(route, start, stop, pair)`` of ``heads`` heads (layout-fixed sizes)."""
        key = ("launches", heads)
        if key not in self.segments:
            import cupy

            n_items = self.template.num_items
            per, tails, launches = [], [], []
            base = 0
            for k, start, count, pair in self.template.launches:
                for h in range(heads):
                    per.append((h * n_items + start, base + h * count, count, 0))
                total = heads * count
                tail = min(TAIL_ITEMS, total)
                if tail:
                    tails.append((base + total - tail, base + total - tail, tail, 0))
                launches.append((k // 2, base, base + total, pair))
                base += total
            as_array = lambda rows: cupy.asarray(np.asarray(rows, dtype=np.int32).reshape(-1, 4))
            self.segments[key] = (as_array(per), as_array(tails), tuple(launches))
        return self.segments[key]


@dataclass(frozen=True, eq=False)
class DeviceWorkList:
    """A forward work list in device memory (what ``paged_fwd.cu`` reads), built by the device planner.

    ``arrays``: ``work_info`` int32 ``[W, 4]``, ``work_order`` int32 ``[W]``, ``own_entries`` int32
    ``[W, 8, 2]``, ``stream_entries`` int32 ``[capacity, 2]`` (the first entries used); ``num_work`` and
    ``heads`` (batch · heads) are fixed by the layouts, the streams' lengths live on the device."""

    arrays: dict
    num_work: int
    heads: int
    chunk: int
    pair: bool
    stream_total: int

    def has_visibility(self) -> bool:
        return self.pair


@dataclass(frozen=True, eq=False)
class DeviceOwnedPlan:
    """A K/V-owned backward plan (or the dQ pass's Q-owned plan) in device memory, in the format of
    :meth:`~.tile_plan.TilePlan.device_arrays`: ``work_head``, ``own_pages`` ``[W, 8]``, ``stream_indptr``
    ``[W + 1]``, ``stream_pages``, page masks, and ``pair_pages`` ``[capacity, 3]`` with pair items.
    ``launches``: ``(route, first item, stop, pair)`` per launch (layout-fixed)."""

    arrays: dict
    owner: str
    routes: tuple
    launches: tuple
    heads: int
    num_work: int
    own_stride: int
    uncovered: object
    uncovered_count: int

    def route_ranges(self) -> list[tuple[int, int]]:
        """``(start, stop)`` of each route's items (keys are route-major, so each route is contiguous)."""
        out = []
        for r in range(len(self.routes)):
            spans = [(s, e) for route, s, e, _ in self.launches if route == r]
            out.append((min(s for s, _ in spans), max(e for _, e in spans)) if spans else (0, 0))
        return out

    @property
    def pair(self) -> bool:
        return self.arrays.get("pair_pages") is not None


@dataclass(frozen=True, eq=False)
class DevicePlans:
    """Every plan of one call: the forward work list, the backward's K/V-owned plan and (when the
    backward computes dQ in a Q-owned pass) its plan; ``batch``/``heads`` of the selection, the slot
    counts of the layouts; ``status`` int32 ``[2]`` on the device: invalid selection entries, streams cut
    at the capacity."""

    forward: DeviceWorkList
    backward: DeviceOwnedPlan | None
    dq: DeviceOwnedPlan | None
    batch: int
    heads: int
    q_slots: int
    k_slots: int
    status: object

    def check(self) -> None:
        """Raise if the selection held invalid entries or a stream outgrew its buffer (synchronises)."""
        invalid, overflow = (int(x) for x in self.status.get())
        if invalid:
            raise PlanError(
                f"the selection holds {invalid} invalid entries (q2k_idx outside [0, k_blocks) or q2k_num "
                "outside [0, k]); they were ignored"
            )
        if overflow:
            raise PlanError(
                f"{overflow} streams outgrew the plan buffers (a block mask selecting more than max_selected "
                "blocks per row); they were cut"
            )


def _selection_arrays(name: str, x, dtype: str, shape: tuple):
    """``(argument, device)`` of a CuPy array or torch CUDA tensor of ``dtype`` and ``shape`` (None = any),
    C-contiguous; torch tensors pass as raw pointers."""
    from ..kernels import launch
    from ..kernels.validate import KernelTypeError, KernelValueError

    if launch.is_torch_tensor(x):
        import torch

        want = {"int32": torch.int32, "bool": torch.bool}[dtype]
        if not x.is_cuda:
            raise KernelTypeError(f"{name} must be a CUDA tensor, got one on {x.device}")
        if x.dtype != want:
            raise KernelTypeError(f"{name} must have dtype {want}, got {x.dtype}")
        dims, device, contiguous = tuple(x.shape), x.device.index, x.is_contiguous()
        arg = np.uint64(x.data_ptr())
    else:
        from ..kernels.validate import is_cupy_array

        if not is_cupy_array(x):
            raise KernelTypeError(
                f"{name} must be a CuPy array or a torch CUDA tensor, got {type(x).__name__}"
            )
        if str(x.dtype) != dtype:
            raise KernelTypeError(f"{name} must have dtype {dtype}, got {x.dtype}")
        dims, device, contiguous = tuple(x.shape), x.data.device_id, x.flags.c_contiguous
        arg = x
    if len(dims) != len(shape) or any(s is not None and s != d for s, d in zip(shape, dims)):
        want_shape = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise KernelValueError(f"{name} must have shape {want_shape}, got {list(dims)}")
    if not contiguous:
        raise KernelValueError(f"{name} must be C-contiguous")
    return arg, dims, device


class DevicePlanner:
    """Plans of one call site on the GPU: fixed Q/K layouts, plan kind and route; per call a selection.

    Args:
        q_layout, k_layout: the layouts of the call (``k_layout`` defaults to ``q_layout``).
        kind: ``"kpage"`` (live pages packed) or ``"bsa"`` (logical blocks).
        route: ``"auto"``, 0 (64×256), 1 (128×128) or ``"pair"``: as the host's, ``"auto"`` decided by a rule
            of the layout (pair items where most Q blocks are 64-row blocks; the backward's wherever the K/V
            layout has 64-row blocks and the kernel runs them).
        backward: also plan the backward (K/V-owned, and the dQ pass where that runs).
        impl, deterministic: the backward kernel (as :func:`sparseattn.kernels.bsa_backward.bsa_backward`),
            which decides whether pair items run and whether dQ takes the Q-owned pass.
        max_selected: for block masks, the most K blocks one Q block selects (default: all; a top-k selection
            is bounded by its ``k``): sizes the stream buffers.
    """

    def __init__(
        self,
        q_layout: BlockLayout,
        k_layout: BlockLayout | None = None,
        *,
        kind: str = "kpage",
        route="auto",
        backward: bool = True,
        impl=None,
        deterministic: bool = False,
        max_selected: int | None = None,
    ):
        k_layout = q_layout if k_layout is None else k_layout
        for name, layout in (("q_layout", q_layout), ("k_layout", k_layout)):
            if not isinstance(layout, BlockLayout):
                raise PlanTypeError(f"{name} must be a BlockLayout, got {type(layout).__name__}")
        if max_selected is not None and (not isinstance(max_selected, (int, np.integer)) or max_selected < 1):
            raise PlanError(f"max_selected must be a positive integer, got {max_selected!r}")
        self.q, self.k, self.kind, self.route = q_layout, k_layout, kind, route
        self.max_selected = None if max_selected is None else int(max_selected)
        self.forward = forward_template(q_layout, k_layout, kind, route)
        self.backward = self.dq = None
        self.impl, self.deterministic = impl, bool(deterministic)
        if backward:
            from ..kernels.bsa_backward import default_impl

            resolved = default_impl() if impl is None else impl
            pairs_allowed = resolved in ("wgmma", "wgmma_ws") and not deterministic
            self.backward = backward_template(q_layout, k_layout, kind, route, pairs_allowed)
            all_64 = bool((self.backward.rows == 64).all()) and self.backward.num_items > 0
            if resolved == "wgmma_dq_pass" or (resolved == "wgmma" and all_64):
                self.dq = dq_template(q_layout, k_layout, kind, route)
        self._devices: dict = {}

    @property
    def q_blocks(self) -> int:
        return self.q.num_blocks

    @property
    def k_blocks(self) -> int:
        return self.k.num_blocks

    def _uploaded(self, device: int) -> dict:
        tables = self._devices.get(device)
        if tables is None:
            import cupy

            with cupy.cuda.Device(device):
                tables = {
                    name: DeviceTemplate.upload(t)
                    for name, t in (("forward", self.forward), ("backward", self.backward), ("dq", self.dq))
                    if t is not None
                }
            self._devices[device] = tables
        return tables

    def capacity(self, template: ItemTemplate, heads: int, k: int) -> int:
        cap = template.stream_capacity(heads, k)
        if cap >= 2**31:
            raise PlanError(
                f"the plan's streams may need {cap} entries, more than int32 offsets allow; plan fewer heads per "
                "call" + (" or give max_selected" if self.max_selected is None else "")
            )
        return cap

    def plan(self, q2k_idx=None, q2k_num=None, *, mask=None) -> DevicePlans:
        """The plans of one selection, enqueued on the current stream (CuPy's; torch's inside
        :func:`sparseattn.kernels.launch.torch_context`).

        Args:
            q2k_idx: int32 ``[batch, heads, q_blocks, k]``: the K blocks each Q block selects (the VSA
                kernel's ``q2k_block_sparse_index``; order and repeats do not matter), with
            q2k_num: int32 ``[batch, heads, q_blocks]``: how many of them are used; or
            mask: bool ``[batch, heads, q_blocks, k_blocks]``.
            CuPy arrays or torch CUDA tensors, C-contiguous.
        """
        import cupy

        from ..kernels import planner as P
        from ..kernels.validate import KernelValueError

        nq, nk = self.q_blocks, self.k_blocks
        if (mask is None) == (q2k_idx is None):
            raise KernelValueError("give either q2k_idx with q2k_num, or mask")
        if mask is not None:
            mask_arg, dims, device = _selection_arrays("mask", mask, "bool", (None, None, nq, nk))
            batch, heads = dims[0], dims[1]
            k = nk if self.max_selected is None else min(nk, self.max_selected)
        else:
            if q2k_num is None:
                raise KernelValueError("q2k_idx needs q2k_num (how many of each row's indices are used)")
            idx_arg, dims, device = _selection_arrays("q2k_idx", q2k_idx, "int32", (None, None, nq, None))
            batch, heads, _, k = dims
            num_arg, _, num_device = _selection_arrays("q2k_num", q2k_num, "int32", (batch, heads, nq))
            if num_device != device:
                raise KernelValueError(f"q2k_num is on device {num_device}, q2k_idx on device {device}")
        bh = batch * heads
        if bh == 0:
            raise KernelValueError("the selection has no (batch, head) rows")
        tables = self._uploaded(device)
        fwd = tables["forward"]
        wq, wk = _words(nk), _words(nq)
        with cupy.cuda.Device(device):
            stream = cupy.cuda.get_current_stream()
            status = cupy.zeros(2, dtype=cupy.int32)
            invalid, overflow = status[0:1], status[1:2]
            bitmap = cupy.empty((bh, nq, wq), dtype=cupy.uint32)
            if mask is not None:
                P.bitmap_from_mask(mask_arg, bh * nq, nq, nk, wq, fwd.owner_alive, fwd.stream_alive, bitmap)
            else:
                cupy.cuda.runtime.memsetAsync(bitmap.data.ptr, 0, bitmap.nbytes, stream.ptr)
                P.bitmap_from_topk(
                    idx_arg,
                    num_arg,
                    bh * nq,
                    k,
                    nq,
                    nk,
                    wq,
                    fwd.owner_alive,
                    fwd.stream_alive,
                    bitmap,
                    invalid,
                )
            forward = self._forward(fwd, bitmap, bh, k, overflow)
            backward = dq = None
            if self.backward is not None:
                bitmap_t = cupy.empty((bh, nk, wk), dtype=cupy.uint32)
                P.bitmap_transpose(bitmap, bh, nq, nk, wq, wk, bitmap_t)
                backward = self._owned(tables["backward"], bitmap_t, nk, wk, bh, k, overflow)
            if self.dq is not None:
                dq = self._owned(tables["dq"], bitmap, nq, wq, bh, k, overflow)
        return DevicePlans(forward, backward, dq, batch, heads, self.q.num_slots, self.k.num_slots, status)

    def _forward(self, dev: DeviceTemplate, bitmap, bh: int, k: int, overflow) -> DeviceWorkList:
        import cupy

        from ..kernels import planner as P

        t = dev.template
        n = bh * t.num_items
        cap = self.capacity(t, bh, k)
        chunk_pages = t.chunk // PAGE_ROWS
        cnt = cupy.empty((max(n, 1), 4), dtype=cupy.int32)
        words = bitmap.shape[2]
        P.items(bitmap, t.owner_blocks, words, bh, dev.tables, chunk_pages, False, P.OUT_WORK_LIST, cnt)
        begin = cupy.empty(n + 1, dtype=cupy.int32)
        P.scan(cnt, n, cap, begin, overflow)
        arrays = {
            "work_info": cupy.empty((max(n, 1), 4), dtype=cupy.int32),
            "work_order": cupy.empty(max(n, 1), dtype=cupy.int32),
            "own_entries": cupy.empty((max(n, 1), SLOTS, 2), dtype=cupy.int32),
            "stream_entries": cupy.empty((max(cap, 1), 2), dtype=cupy.int32),
        }
        P.items(
            bitmap,
            t.owner_blocks,
            words,
            bh,
            dev.tables,
            chunk_pages,
            True,
            P.OUT_WORK_LIST,
            cnt,
            base=begin,
            cap=cap,
            work_info=arrays["work_info"],
            own_entries=arrays["own_entries"],
            stream_entries=arrays["stream_entries"],
            overflow=overflow,
        )
        P.segment_sort(
            dev.head_segments(bh),
            bh,
            t.num_items,
            cnt,
            arrays["work_order"],
            P.KEY_COST,
            info=dev.tables["info"],
            items_per_head=t.num_items,
            chunk_pages=chunk_pages,
        )
        return DeviceWorkList(arrays, n, bh, t.chunk, t.has_pairs, cap)

    def _owned(
        self, dev: DeviceTemplate, rows, row_blocks: int, words: int, bh: int, k: int, overflow
    ) -> DeviceOwnedPlan:
        import cupy

        from ..kernels import planner as P

        t = dev.template
        n = bh * t.num_items
        cap = self.capacity(t, bh, k)
        cnt = cupy.empty((max(n, 1), 4), dtype=cupy.int32)
        P.items(rows, row_blocks, words, bh, dev.tables, 0, False, P.OUT_TILE_PLAN, cnt)
        per, tails, launches = dev.launch_segments(bh)
        head_major = cupy.empty(max(n, 1), dtype=cupy.int32)
        largest = max((c for _, _, c, _ in t.launches), default=0)
        P.segment_sort(per, per.shape[0], largest, cnt, head_major, P.KEY_LEN)
        order = head_major.copy()  # the tails re-sorted over all heads
        P.segment_sort(tails, tails.shape[0], TAIL_ITEMS, cnt, order, P.KEY_LEN, indirect=head_major)
        indptr = cupy.empty(n + 1, dtype=cupy.int32)
        P.scan(cnt, n, cap, indptr, overflow, perm=order)
        arrays = {
            "work_head": cupy.empty(max(n, 1), dtype=cupy.int32),
            "own_pages": cupy.empty((max(n, 1), SLOTS), dtype=cupy.int32),
            "stream_indptr": indptr,
            "stream_pages": cupy.empty(max(cap, 1), dtype=cupy.int32),
            "own_page_mask": dev.tables["o_mask"],
            "stream_page_mask": dev.tables["t_mask"],
            "pair_pages": cupy.empty((max(cap, 1), 3), dtype=cupy.int32) if t.has_pairs else None,
            "order": order,
        }
        P.items(
            rows,
            row_blocks,
            words,
            bh,
            dev.tables,
            0,
            True,
            P.OUT_TILE_PLAN,
            cnt,
            base=indptr,
            perm=order,
            cap=cap,
            work_head=arrays["work_head"],
            own_pages=arrays["own_pages"],
            stream_pages=arrays["stream_pages"],
            pair_pages=P.NULL if arrays["pair_pages"] is None else arrays["pair_pages"],
            overflow=overflow,
        )
        return DeviceOwnedPlan(
            arrays=arrays,
            owner=t.owner,
            routes=t.routes,
            launches=launches,
            heads=bh,
            num_work=n,
            own_stride=SLOTS,
            uncovered=dev.uncovered,
            uncovered_count=dev.uncovered_count,
        )
