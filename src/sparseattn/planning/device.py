"""Device planner: the forward work list and the backward plans of a selection that lives on the GPU.

A model that chooses its sparse graph per call (VSA's top-k cubes from each layer's Q and K, a learned or
score-based selection) hands the selection to a :class:`DevicePlanner`; :meth:`DevicePlanner.plan` builds
every plan the kernels read on the caller's stream, with no host synchronisation and no copy between host
and device, so a call can be captured in a CUDA graph:

.. code-block:: text

    selection (top-k indices + counts, or a block mask)       [batch, heads, q_blocks, ...]
      -> bitmap: one row of bits per (batch · head, Q block)   plan_bitmap_from_topk / _from_mask
      -> per template item: pages streamed and stream written at the start of the item's slice of
         the buffer (a bound fixed by the layout), in one pass  plan_items_fused
      -> order (per-head sort)                                  plan_segment_sort
      -> the backward's K/V-owned plan from the transposed bitmap: per item its pages streamed (count
         pass), the order (per-launch sorts), offsets in that order (scan), streams written (write pass)
                                                                plan_items, plan_segment_sort, plan_scan

What depends only on the layouts (live pages per block, routes, owned pages, which blocks pair up: an
:class:`~.templates.ItemTemplate`) is built once per planner on the host and uploaded once per device.
Every batch entry selects on its own: a call plans ``batch · heads`` heads, and the kernels run the tensors
viewed as ``[1, batch · heads, slots, d]``.

The plans equal the host planners' on the same graph (:mod:`.device_emulation` runs these steps in numpy;
the tests compare it with the host and the GPU with it): the same work items with the same streams, in
their stream order, and the same per-head ordering rules; the forward's streams lie at layout-fixed slices
of their buffer, with gaps (:meth:`~.templates.ItemTemplate.stream_slices`; ``planner.FORWARD_SLICES``
off: back to back, byte for byte the host's), and the items are stored in the template's order
(the forward's ``work_order`` orders them) and the pair items join blocks by a rule of the layout
(:mod:`.layout_pairs`), where the host matches them by shared pages. ``route="auto"`` likewise decides by
a rule of the layout (:func:`~.templates.forward_route`, :func:`~.templates.backward_route`).

Buffers are sized before the call from the layouts and the selection's width (the top-k's ``k``, or every
K block for a mask: see :meth:`ItemTemplate.stream_capacity` and :meth:`ItemTemplate.stream_slices`), so
they hold any selection of that form.
Invalid selection entries (an index outside ``[0, k_blocks)``, a count outside ``[0, k]``) are ignored and
counted; :meth:`DevicePlans.check` (which synchronises) raises if there were any.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import numpy as np

from ..constants import PAGE_ROWS
from ..layouts import BlockLayout
from .plan_recipe import PHASES, PlanRecipe, pointer_of
from .templates import ItemTemplate, backward_template, dq_template, forward_template
from .tile_plan import TAIL_ITEMS, PlanError, PlanTypeError

SLOTS = 8
#: Whether a planner replays its first call of each shape with packed launches (:mod:`.plan_recipe`; the
#: default): ``SPARSEATTN_PLANNER_REPLAY=0`` runs every call through the launchers (an A/B of host time).
REPLAY = os.environ.get("SPARSEATTN_PLANNER_REPLAY", "1") == "1"
#: With the chains side by side: the forward's chain issued first, on the side stream, and the backward's
#: on the caller's stream (the forward's is the longer: its launches then start as soon as the bitmap is
#: done, where an eager call otherwise issues them after the backward's); ``SPARSEATTN_PLAN_FORWARD_FIRST``.
FORWARD_FIRST = os.environ.get("SPARSEATTN_PLAN_FORWARD_FIRST", "0") == "1"


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
    uncovered_valid: bool = True  # whether an owner page no item owns holds a valid row

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
            # sizes of the stream tables, which plan_items stages in shared memory when they fit
            "t_blocks": st.num_blocks,
            "t_listed": int(st.pages.size),
            "t_pages_total": int(st.mask.size),
            "t_max_pages": int(np.diff(st.first).max()) if st.num_blocks else 0,
            "smem_bytes": -(-(4 * (2 * st.num_blocks + 1 + st.pages.size) + 2 * st.mask.size) // 16) * 16,
        }
        if template.matched:  # the forward's matched slots: their blocks, owned pages and candidate edges
            tables["slot_block"] = cupy.asarray(template.block[: template.matched])
            tables["slot_own"] = cupy.asarray(template.own[: template.matched])
            tables["edges"] = cupy.asarray(
                template.edges if template.edges.size else np.zeros((1, 2), np.int32)
            )
        uncovered = template.uncovered_pages(template.owner_mask.size).astype(np.int32)
        return cls(
            template=template,
            tables=tables,
            owner_alive=cupy.asarray(_alive_words(template.owner_alive)),
            stream_alive=cupy.asarray(_alive_words(st.alive)),
            uncovered=cupy.asarray(uncovered) if uncovered.size else None,
            uncovered_count=int(uncovered.size),
            uncovered_valid=template.uncovered_rows_valid(),
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


def _cupy_bytes(memory, nbytes: int):
    """A CuPy ``uint8`` view of the first ``nbytes`` bytes of a torch CUDA tensor (which it keeps alive)."""
    import cupy

    held = memory.numel() * memory.element_size()
    if held < nbytes:
        raise PlanError(f"memory holds {held} bytes; the plans need {nbytes}")
    raw = cupy.cuda.UnownedMemory(memory.data_ptr(), nbytes, memory, memory.device.index)
    return cupy.ndarray((nbytes,), cupy.uint8, memptr=cupy.cuda.MemoryPointer(raw, 0))


def _rebased_arrays(arrays: dict, old: Arena, new: Arena) -> dict:
    """``arrays`` with the pointers into ``old`` moved to the same offsets in ``new`` (launch caches,
    keyed by tuples, dropped; pointers to the templates' tables kept)."""
    out = {}
    for name, value in arrays.items():
        if not isinstance(name, str):
            continue
        offset = old.offset_of(value) if isinstance(value, np.uint64) else None
        if offset is not None:
            value = np.uint64(new.base + offset)
        out[name] = value
    return out


class Arena:
    """The buffers of one call in one device allocation: ``buffer(name)`` is a raw device pointer
    (``numpy.uint64``, what kernels take), ``view(name)`` a CuPy array over it (for tests and checks).
    ``launches``: a dict that every allocation of one prototype shares (the kernel wrappers keep their
    packed launches there, bound to each call's buffers when it launches)."""

    ALIGN = 256

    def __init__(self, specs: dict):
        self.specs, offset = {}, 0
        for name, (shape, dtype) in specs.items():
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            self.specs[name] = (offset, tuple(int(x) for x in shape), np.dtype(dtype))
            offset += -(-max(nbytes, 1) // self.ALIGN) * self.ALIGN
        self.nbytes = offset
        self.memory = None
        self.launches = {}

    def allocate(self, memory=None) -> Arena:
        """A fresh allocation (CuPy's allocator: torch's inside :func:`~sparseattn.kernels.launch.torch_context`),
        or the caller's ``memory``: a torch CUDA tensor of at least :attr:`nbytes` bytes."""
        import cupy

        out = Arena.__new__(Arena)
        out.specs, out.nbytes, out.launches = self.specs, self.nbytes, self.launches
        if memory is None:
            out.memory = cupy.empty(self.nbytes, dtype=cupy.uint8)
        else:
            out.memory = _cupy_bytes(memory, self.nbytes)
        out.base = int(out.memory.data.ptr)
        return out

    def rebased(self, memory=None) -> Arena:
        """The same buffers in ``memory`` (a torch CUDA tensor), or without memory (a prototype)."""
        out = Arena.__new__(Arena)
        out.specs, out.nbytes, out.launches = self.specs, self.nbytes, self.launches
        out.memory = None if memory is None else _cupy_bytes(memory, self.nbytes)
        out.base = self.base if memory is None else int(out.memory.data.ptr)
        return out

    def offset_of(self, pointer) -> int | None:
        """The offset of device pointer ``pointer`` (an integer) in this allocation, or None outside it."""
        offset = int(pointer) - self.base
        return offset if 0 <= offset < self.nbytes else None

    def buffer(self, name: str) -> np.uint64:
        return np.uint64(self.base + self.specs[name][0])

    def view(self, name: str):
        import cupy

        offset, shape, dtype = self.specs[name]
        return cupy.ndarray(shape, dtype, memptr=self.memory.data + offset)


#: A device work list's arrays that a forward launch reads, in the order it binds them per call (the list
#: also holds ``first_live``, where the launch starts the item counter).
LIST_ARRAYS = ("work_info", "work_order", "own_entries", "stream_entries", "counter")


@dataclass(frozen=True, eq=False)
class DeviceWorkList:
    """A forward work list in device memory (what ``paged_fwd.cu`` reads), built by the device planner.

    ``arrays``: raw pointers to ``work_info`` int32 ``[W, 4]``, ``work_order`` int32 ``[W]``,
    ``own_entries`` int32 ``[W, 8, 2]``, ``stream_entries`` int32 ``[capacity, 2]`` (the first entries used),
    ``counter`` int32 (the persistent kernel's item counter), ``first_live`` int32: how many void items
    (no stream entry, no owned page) ``work_order`` lists first; a launch starts the counter there, so the
    kernel never takes them. ``num_work`` and ``heads`` (batch · heads) are fixed by the layouts, the
    streams' lengths live on the device. ``arena`` holds the memory."""

    arrays: dict
    num_work: int
    heads: int
    chunk: int
    pair: bool
    stream_total: int
    arena: Arena

    def has_visibility(self) -> bool:
        return self.pair


@dataclass(frozen=True, eq=False)
class DeviceOwnedPlan:
    """A K/V-owned backward plan (or the dQ pass's Q-owned plan) in device memory, in the format of
    :meth:`~.tile_plan.TilePlan.device_arrays`: raw pointers to ``work_head``, ``own_pages`` ``[W, 8]``,
    ``stream_indptr`` ``[W + 1]``, ``stream_pages``, the page masks, and ``pair_pages`` ``[capacity, 3]``
    with pair items (else None). ``launches``: ``(route, first item, stop, pair)`` per launch
    (layout-fixed); ``uncovered``: the owner pages no item owns (int32, on the device) or None."""

    arrays: dict
    owner: str
    routes: tuple
    launches: tuple
    heads: int
    num_work: int
    own_stride: int
    uncovered: object
    uncovered_count: int
    arena: Arena
    uncovered_valid: bool = True  # whether an owner page no item owns holds a valid row

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
    counts of the layouts; ``arena.view("status")`` int32 ``[2]``: invalid selection entries, streams cut
    at the capacity."""

    forward: DeviceWorkList
    backward: DeviceOwnedPlan | None
    dq: DeviceOwnedPlan | None
    batch: int
    heads: int
    q_slots: int
    k_slots: int
    arena: Arena

    def view(self, part: str, name: str):
        """A CuPy view of one of the plans' arrays (``part``: ``"forward"``, ``"backward"``, ``"dq"``)."""
        return self.arena.view(f"{part}.{name}")

    def rebased(self, memory=None) -> DevicePlans:
        """The same plans over the bytes of ``memory`` (a torch CUDA tensor holding a copy of this call's
        arena, e.g. the ``plans`` output of the ``dynamic_fwd`` operator), or without memory (a prototype)."""
        return self.in_arena(self.arena.rebased(memory))

    def in_arena(self, arena: Arena) -> DevicePlans:
        """The same plans at the same offsets of ``arena`` (an allocation of this arena's shape)."""
        move = lambda part: (
            None
            if part is None
            else replace(part, arrays=_rebased_arrays(part.arrays, self.arena, arena), arena=arena)
        )
        return replace(
            self, forward=move(self.forward), backward=move(self.backward), dq=move(self.dq), arena=arena
        )

    def check(self) -> None:
        """Raise if the selection held invalid entries or a stream outgrew its buffer (synchronises)."""
        invalid, overflow = (int(x) for x in self.arena.view("status").get())
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
        overlap_backward: plan the backward on a side stream beside the forward
            (:func:`sparseattn.kernels.launch.side_by_side`; both read only the selection's bitmap and write
            their own buffers), so that small launches of one chain (the forward's per-head pair matching
            fills 40 of 132 SMs at 40 heads) run beside the other's (the default; ``False``: one after
            the other). The same plans either way.
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
        overlap_backward: bool = True,
    ):
        k_layout = q_layout if k_layout is None else k_layout
        from ..kernels.planner import STAGE_PAGES

        for name, layout in (("q_layout", q_layout), ("k_layout", k_layout)):
            if not isinstance(layout, BlockLayout):
                raise PlanTypeError(f"{name} must be a BlockLayout, got {type(layout).__name__}")
            if layout.num_pages > STAGE_PAGES:
                raise PlanError(
                    f"{name} has {layout.num_pages} pages; the device planner's write pass holds page ids "
                    f"below {STAGE_PAGES}"
                )
        if max_selected is not None and (not isinstance(max_selected, (int, np.integer)) or max_selected < 1):
            raise PlanError(f"max_selected must be a positive integer, got {max_selected!r}")
        self.q, self.k, self.kind, self.route = q_layout, k_layout, kind, route
        self.max_selected = None if max_selected is None else int(max_selected)
        self.overlap_backward = bool(overlap_backward)
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
        self._tables: dict = {}  # device -> the templates' arrays on it
        self._arenas: dict = {}  # (heads, selection width, backward, slices) -> the buffers' layout
        self._prototypes: dict = {}  # (heads, width, backward, device, slices) -> plans without memory (plans_in)
        self._recipes: dict = {}  # the call's shape and the launchers' settings -> PlanRecipe
        self._slice_bounds: dict = {}  # selection width -> the forward items' slices (host)
        self._slices: dict = {}  # (device, selection width) -> the forward items' slices on it

    @property
    def q_blocks(self) -> int:
        return self.q.num_blocks

    @property
    def k_blocks(self) -> int:
        return self.k.num_blocks

    def _uploaded(self, device: int) -> dict:
        tables = self._tables.get(device)
        if tables is None:
            import cupy

            with cupy.cuda.Device(device):
                tables = {
                    name: DeviceTemplate.upload(t)
                    for name, t in (("forward", self.forward), ("backward", self.backward), ("dq", self.dq))
                    if t is not None
                }
            self._tables[device] = tables
        return tables

    @property
    def forward_slices(self) -> bool:
        """Whether the forward's items write at layout-fixed slices of their buffer
        (:meth:`ItemTemplate.stream_slices`; ``planner.FORWARD_SLICES`` with the fused pass), read per call."""
        from ..kernels import planner as P

        return bool(P.FUSED_FORWARD and P.FORWARD_SLICES)

    def capacity(self, template: ItemTemplate, heads: int, k: int) -> int:
        if template is self.forward and self.forward_slices:
            cap = heads * int(self._host_slices(k)[-1])
        else:
            cap = template.stream_capacity(heads, k)
        if cap >= 2**31:
            raise PlanError(
                f"the plan's streams may need {cap} entries, more than int32 offsets allow; plan fewer heads per "
                "call" + (" or give max_selected" if self.max_selected is None else "")
            )
        return cap

    def _arena(self, bh: int, k: int, backward: bool) -> Arena:
        """The buffers of a call with ``bh`` heads and selections of width ``k`` (built once per shape)."""
        key = (bh, k, backward, self.forward_slices)
        arena = self._arenas.get(key)
        if arena is None:
            i32, u32 = np.int32, np.uint32
            nq, nk = self.q_blocks, self.k_blocks
            t = self.forward
            n, cap = bh * t.num_items, self.capacity(t, bh, k)
            # status, the forward's void counts and its one pass's look-back and claim counter lie before
            # the bitmap: one memset zeroes them (and the bitmap, where the top-k kernel needs it zeroed)
            specs = {
                "status": ((2,), i32),
                "forward.voids": ((bh,), i32),
                "forward.claim": ((1,), i32),
                "forward.lookback": ((n,), np.uint64),
                "bitmap": ((bh, nq, _words(nk)), u32),
            }
            specs.update(
                {
                    "forward.cnt": ((n, 4), i32),
                    "forward.begin": ((n + 1,), i32),
                    "forward.work_info": ((n, 4), i32),
                    "forward.work_order": ((n,), i32),
                    "forward.own_entries": ((n, SLOTS, 2), i32),
                    "forward.stream_entries": ((cap, 2), i32),
                    "forward.counter": ((1,), i32),
                    "forward.first_live": ((1,), i32),
                }
            )
            if t.matched:
                m, e = t.matched, t.edges.shape[0]
                specs.update(
                    {
                        "forward.keys": ((bh, e), np.uint64),
                        "forward.partner": ((bh, m), i32),
                        "forward.best": ((bh, m), np.uint64),
                        "forward.m_info": ((bh, m, 4), i32),
                        "forward.m_members": ((bh, m, SLOTS), i32),
                        "forward.m_bits": ((bh, m, SLOTS), i32),
                        "forward.m_own": ((bh, m, SLOTS), i32),
                    }
                )
            if backward and self.backward is not None:
                specs["bitmap_t"] = ((bh, nk, _words(nq)), u32)
            for part, t in (("backward", self.backward), ("dq", self.dq)):
                if t is None or not backward:
                    continue
                n, cap = bh * t.num_items, self.capacity(t, bh, k)
                specs.update(
                    {
                        f"{part}.cnt": ((n, 4), i32),
                        f"{part}.head_major": ((n,), i32),
                        f"{part}.order": ((n,), i32),
                        f"{part}.stream_indptr": ((n + 1,), i32),
                        f"{part}.work_head": ((n,), i32),
                        f"{part}.own_pages": ((n, SLOTS), i32),
                        f"{part}.stream_pages": ((cap,), i32),
                    }
                )
                if t.has_pairs:
                    specs[f"{part}.pair_pages"] = ((cap, 3), i32)
            arena = self._arenas[key] = Arena(specs)
        return arena

    def mask_width(self) -> int:
        """How many K blocks one Q block of a block mask may select (sizes the plan buffers)."""
        return self.k_blocks if self.max_selected is None else min(self.k_blocks, self.max_selected)

    def arena_bytes(self, bh: int, width: int, backward: bool) -> int:
        """Bytes of one call's plans: ``bh`` (batch · heads) rows, selections of ``width``."""
        return self._arena(bh, width, bool(backward) and self.backward is not None).nbytes

    def plans_in(self, memory, batch: int, heads: int, width: int) -> DevicePlans:
        """The plans (with the backward's) that an earlier :meth:`plan` call of this shape wrote into
        ``memory`` (its torch tensor), without a launch: the layout of the buffers is the shape's."""
        key = (batch * heads, int(width), self.backward is not None, memory.device.index, self.forward_slices)
        proto = self._prototypes.get(key)
        if proto is None:
            raise PlanError(
                f"this planner made no plans for {batch} x {heads} heads of width {width} with the backward "
                "in this process"
            )
        return proto.rebased(memory)

    def plan(
        self, q2k_idx=None, q2k_num=None, *, mask=None, backward: bool = True, memory=None
    ) -> DevicePlans:
        """The plans of one selection, enqueued on the current stream (CuPy's; torch's inside
        :func:`sparseattn.kernels.launch.torch_context`), in one new device allocation.

        Args:
            q2k_idx: int32 ``[batch, heads, q_blocks, k]``: the K blocks each Q block selects (the VSA
                kernel's ``q2k_block_sparse_index``; order and repeats do not matter), with
            q2k_num: int32 ``[batch, heads, q_blocks]``: how many of them are used; or
            mask: bool ``[batch, heads, q_blocks, k_blocks]``.
            CuPy arrays or torch CUDA tensors, C-contiguous.
            backward: also the backward's plans (when the planner has them); False for inference.
            memory: a torch CUDA tensor of at least :meth:`arena_bytes` bytes to hold the plans (default:
                a new allocation).
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
            k = self.mask_width()
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
        backward = bool(backward) and self.backward is not None
        tables = self._uploaded(device)
        with cupy.cuda.Device(device):
            arena = self._arena(bh, k, backward).allocate(memory)
            if mask is not None:
                selection = {"mask": int(pointer_of(mask_arg))}
            else:
                selection = {"idx": int(pointer_of(idx_arg)), "num": int(pointer_of(num_arg))}
            key = (
                batch,
                heads,
                k,
                backward,
                mask is not None,
                self.overlap_backward,
                FORWARD_FIRST,
                device,
                P.settings(),
            )
            recipe = self._recipes.get(key) if REPLAY else None
            if recipe is not None:  # a later call of this shape: the first one's launches, rebound
                recipe.replay("top", arena.base, selection)
                self._run_chains(
                    backward,
                    lambda: recipe.replay("backward", arena.base, selection),
                    lambda: recipe.replay("forward", arena.base, selection),
                )
                return recipe.plans.in_arena(arena)
            records = {name: [] for name in PHASES} if REPLAY else None
            try:
                given = mask_arg if mask is not None else (idx_arg, num_arg)
                built = self._launch_all(arena, tables, backward, mask is not None, given, bh, k, records)
            finally:
                P.RECORD = None
        plans = DevicePlans(
            built["forward"],
            built["backward"],
            built["dq"],
            batch,
            heads,
            self.q.num_slots,
            self.k.num_slots,
            arena,
        )
        if backward:
            self._prototypes.setdefault((bh, k, True, device, self.forward_slices), plans.rebased())
        if records is not None:
            self._recipes[key] = PlanRecipe(records, arena, selection, plans.rebased())
        return plans

    def _launch_all(
        self, arena: Arena, tables: dict, backward: bool, is_mask: bool, given, bh: int, k: int, records
    ):
        """Enqueue one call's launches on the current stream (``given``: the mask, or the top-k indices and
        counts, as launch arguments); with ``records``, the launchers record each phase's into it."""
        from ..kernels import planner as P

        nq, nk = self.q_blocks, self.k_blocks
        wq, wk = _words(nk), _words(nq)
        fwd = tables["forward"]
        buf = arena.buffer
        status, bitmap = buf("status"), buf("bitmap")
        P.RECORD = None if records is None else records["top"]
        # status, the void counts, the look-back and (where the top-k kernel needs it) the bitmap are zeroed
        # in one memset: back to back
        zeroed = arena.specs["bitmap"][0]
        if not is_mask and not P.topk_by_rows(k, wq):
            zeroed += bh * nq * wq * 4
        P.memset_zero(status, zeroed)
        if is_mask:
            P.bitmap_from_mask(given, bh * nq, nq, nk, wq, fwd.owner_alive, fwd.stream_alive, bitmap)
        else:
            P.bitmap_from_topk(
                *given, bh * nq, k, nq, nk, wq, fwd.owner_alive, fwd.stream_alive, bitmap, status
            )
        overflow = np.uint64(int(status) + 4)
        built = {"forward": None, "backward": None, "dq": None}

        def plan_forward():
            P.RECORD = None if records is None else records["forward"]
            built["forward"] = self._forward(fwd, arena, bitmap, bh, k, overflow)

        def plan_backward():
            P.RECORD = None if records is None else records["backward"]
            bitmap_t = buf("bitmap_t")
            P.bitmap_transpose(bitmap, bh, nq, nk, wq, wk, bitmap_t)
            built["backward"] = self._owned(
                "backward", tables["backward"], arena, bitmap_t, nk, wk, bh, k, overflow
            )
            if self.dq is not None:
                built["dq"] = self._owned("dq", tables["dq"], arena, bitmap, nq, wq, bh, k, overflow)

        self._run_chains(backward, plan_backward, plan_forward)
        return built

    def _run_chains(self, backward: bool, plan_backward, plan_forward) -> None:
        """The forward's chain, and the backward's where planned: on a side stream beside it
        (``overlap_backward``), else after it."""
        if backward and self.overlap_backward:
            from ..kernels import launch

            # the first chain on the side stream
            launch.side_by_side(
                [plan_forward, plan_backward] if FORWARD_FIRST else [plan_backward, plan_forward]
            )
        else:
            plan_forward()
            if backward:
                plan_backward()

    def _forward(
        self, dev: DeviceTemplate, arena: Arena, bitmap, bh: int, k: int, overflow
    ) -> DeviceWorkList:
        from ..kernels import planner as P

        t = dev.template
        n = bh * t.num_items
        cap = self.capacity(t, bh, k)
        chunk_pages = t.chunk // PAGE_ROWS
        buf = lambda name: arena.buffer("forward." + name)
        cnt = buf("cnt")
        words = _words(self.k_blocks)
        matched = None
        if t.matched:  # every head matches its full 64-row blocks in pairs: the slots' items
            matched = {"slots": t.matched, **{n: buf("m_" + n) for n in ("info", "members", "bits", "own")}}
            n_edges = t.edges.shape[0]
            tb = dev.tables
            P.pair_weights(
                bitmap, t.owner_blocks, words, bh, tb["edges"], n_edges, tb["slot_block"], buf("keys")
            )
            P.pair_match(
                buf("keys"),
                tb["edges"],
                n_edges,
                t.matched,
                bh,
                tb["slot_block"],
                tb["slot_own"],
                buf("partner"),
                buf("best"),
                matched,
            )

        def items(write: bool, **outputs):  # a pass over the items: count, write, or both (fused)
            P.items(
                bitmap,
                t.owner_blocks,
                words,
                bh,
                dev.tables,
                chunk_pages,
                write,
                P.OUT_WORK_LIST,
                cnt,
                matched=matched,
                void_counts=buf("voids"),
                **outputs,
            )

        arrays = {name: buf(name) for name in (*LIST_ARRAYS, "first_live")}
        if P.FUSED_FORWARD:  # count, offsets and write in one pass
            fused = {"lookback": buf("lookback"), "claim": buf("claim"), "begin": buf("begin")}
            if self.forward_slices:
                fused["slices"] = self._device_slices(k)
            base = P.NULL
        else:
            items(False)
            P.scan(cnt, n, cap, buf("begin"), overflow)
            fused, base = None, buf("begin")
        items(
            True,
            fused=fused,
            base=base,
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
            chunk_pages=chunk_pages,
            void_counts=buf("voids"),
            first_live=arrays["first_live"],
        )
        return DeviceWorkList(arrays, n, bh, t.chunk, t.has_pairs, cap, arena)

    def _host_slices(self, k: int) -> np.ndarray:
        """The forward items' slices (:meth:`ItemTemplate.stream_slices`) for selections of width ``k`` (cached)."""
        if int(k) not in self._slice_bounds:
            self._slice_bounds[int(k)] = self.forward.stream_slices(k)
        return self._slice_bounds[int(k)]

    def _device_slices(self, k: int):
        """:meth:`_host_slices` on the current device (uploaded once per device and width)."""
        import cupy

        key = (cupy.cuda.runtime.getDevice(), int(k))
        if key not in self._slices:
            self._slices[key] = cupy.asarray(self._host_slices(k))
        return self._slices[key]

    def _owned(
        self,
        part: str,
        dev: DeviceTemplate,
        arena: Arena,
        rows,
        row_blocks: int,
        words: int,
        bh: int,
        k: int,
        overflow,
    ) -> DeviceOwnedPlan:
        from ..kernels import planner as P

        t = dev.template
        n = bh * t.num_items
        cap = self.capacity(t, bh, k)
        buf = lambda name: arena.buffer(f"{part}.{name}")
        cnt = buf("cnt")
        P.items(rows, row_blocks, words, bh, dev.tables, 0, False, P.OUT_TILE_PLAN, cnt)
        per, tails, launches = dev.launch_segments(bh)
        head_major, order = buf("head_major"), buf("order")
        largest = max((c for _, _, c, _ in t.launches), default=0)
        P.segment_sort(per, per.shape[0], largest, cnt, head_major, P.KEY_LEN)
        # the order: the head-major one with each launch's tail re-sorted over all heads
        P.copy(order, head_major, 4 * n)
        P.segment_sort(tails, tails.shape[0], TAIL_ITEMS, cnt, order, P.KEY_LEN, indirect=head_major)
        P.scan(cnt, n, cap, buf("stream_indptr"), overflow, perm=order)
        names = ("work_head", "own_pages", "stream_indptr", "stream_pages", "order")
        arrays = {name: buf(name) for name in names}
        arrays["pair_pages"] = buf("pair_pages") if t.has_pairs else None
        arrays["own_page_mask"], arrays["stream_page_mask"] = dev.tables["o_mask"], dev.tables["t_mask"]
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
            base=arrays["stream_indptr"],
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
            arena=arena,
            uncovered_valid=dev.uncovered_valid,
        )
