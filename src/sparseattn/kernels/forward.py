"""KPage and BSA forward on one Hopper kernel skeleton: ``kernels_cu/paged_fwd.cu``.

:func:`kpage_forward` runs the KPage plan of a graph (live pages only, packed across logical blocks,
each Q block routed to a 64×256 or a 128×128 tile), :func:`bsa_forward` the logical-block BSA plan
(one Bq×Bk tile per selected pair) — the same kernel, so their difference is the plan alone.
:func:`paged_forward` runs any owner-``"q"`` :class:`~sparseattn.planning.TilePlan` (or a prepared
:class:`~sparseattn.planning.WorkList`).

The kernel is persistent (one CTA per SM takes work items longest-first from a counter) and
warp-specialized: a producer warpgroup gathers 16-row Q/K/V pages with ``cp.async`` into swizzled
shared memory behind mbarriers, two consumer warpgroups run S = Q·Kᵀ and O += P·V on wgmma with the
online softmax in registers. A 128-row tile gives each consumer warpgroup 64 rows; a 64-row tile
(KPage's 64×256 route, BSA's 64×64) gives both warpgroups the same rows and alternate key chunks,
merged at the end. Keys stream in chunks of 128 (64 when every tile of the plan is 64 keys wide).

Inputs are CuPy arrays (bf16 as ``uint16`` bits or a bfloat16 dtype) or torch CUDA bf16 tensors
(no copies; launched on torch's current stream; torch tensors come back), ``[batch, heads, slots, d]``,
``d`` 64 or 128, in the graph's slot layout. Heads with their own layouts (SVG2) run in one launch
from a :class:`~sparseattn.graph.HeadStack` (or a list of per-head graphs).
"""

from __future__ import annotations

import math
import weakref

import numpy as np

from ..constants import KPAGE_ROUTES, PAGE_ROWS
from ..graph import HeadStack, SparseGraph
from ..planning.cache import cached, check_graph_matches, packed_work_of, pair_work_of, plan_of
from ..planning.device import LIST_ARRAYS, DevicePlans, DeviceWorkList
from ..planning.tile_plan import TilePlan, kpage_route_of_block, row_work
from ..planning.work_list import CHUNKS, OWN_PAGES, WorkList, work_list, writes_every_valid_row
from . import launch
from .tensor_map import TensorMap
from .validate import (
    BF16_DTYPE_NAMES,
    CUPY_TYPES,
    KernelTypeError,
    KernelValueError,
    check_head_dim,
    check_plan,
    check_scale,
    check_tensor,
    device_of,
    dtype_name,
    pages_of,
)

SOURCE = "paged_fwd.cu"

# Mirrors of the kernel's compile-time geometry (PAGED_FWD_* and FwdConfig in the source).
HEAD_DIMS = (64, 128)
THREADS = 384
Q_ROWS = 128
SMEM_LIMIT = 227 * 1024
SMALL_BYTES = 1280
ALIGN_SLACK = 1024
MAX_NBUF = 8
MAX_BATCH = 1 << 15
#: Compile-time variants of ``paged_fwd.cu`` (A/B runs): ``PAGED_FWD_SKIP_VOID`` passes items with no stream
#: entry and no owned page by without the Q buffer's hand-off (device plans hold one per block that joined
#: its neighbour's pair item); ``PAGED_FWD_TMA`` loads K pages and full V pages with the tensor-memory
#: accelerator (tensor maps :data:`TMA_PARAMS` after the kernel's other parameters); ``PAGED_FWD_PINGPONG``
#: makes the two consumer warpgroups issue their GEMMs in turns; ``PAGED_FWD_REGS_232`` gives the consumers
#: 232 registers and the producer 40 (with ``PAGED_FWD_TMA``: :data:`VARIANT_NEEDS`).
#: ``SPARSEATTN_FWD_VARIANT`` (comma-separated) selects them for a process.
VARIANTS = (
    "PAGED_FWD_SKIP_VOID",
    "PAGED_FWD_TMA",
    "PAGED_FWD_PINGPONG",
    "PAGED_FWD_REGS_232",
)
#: Variants that compile only together with others.
VARIANT_NEEDS = {"PAGED_FWD_REGS_232": ("PAGED_FWD_TMA",)}
#: The TMA variant's extra parameters: tensor maps of K and V (:class:`.tensor_map.TensorMap`).
TMA_PARAMS = ("tmK", "tmV")
#: The token-order build (:func:`torch_token_forward`): q, k, v and o stay ``[batch, tokens, heads, d]`` and
#: the kernel gathers (stores) each slot's row by the layouts' slot -> token maps. Compiled beside the
#: slot-order build, without the TMA variants (their tensor maps are over slot-ordered rows).
TOKEN_DEFINE = "PAGED_FWD_TOKENS"
#: The Q/O token build (:func:`torch_token_forward` with ``kv_in_slots``): q and o in token order, k and v
#: in slot order (the tensors streamed per chunk keep their contiguous pages).
TOKEN_QO_DEFINE = "PAGED_FWD_TOKENS_QO"
#: The tile-major token build (:func:`torch_token_forward` with ``kv_tma``): q and o by token as in the Q/O
#: build, k and v token-major and read by the tensor-memory accelerator, one box per page and 64 columns, for
#: layouts whose every live K page holds consecutive tokens (a model that keeps its tokens tile-major).
TOKEN_TMA_DEFINE = "PAGED_FWD_TOKENS_TMA"
#: The token builds by how they read K and V: 0 gathered by token, 1 in slot order, 2 token-major by TMA.
TOKEN_KV_BUILDS = (TOKEN_DEFINE, TOKEN_QO_DEFINE, TOKEN_TMA_DEFINE)
#: The token-order build's extra parameters, after :data:`KERNEL_PARAMS` (and the tile-major build's two
#: tensor maps :data:`TMA_PARAMS`).
TOKEN_PARAMS = ("q_map", "k_map", "q_tokens", "k_tokens", "tok_heads", "maps_per_row")


def check_variants(defines: tuple[str, ...], source: str = "SPARSEATTN_FWD_VARIANT") -> tuple[str, ...]:
    """``defines`` if every variant's companions (:data:`VARIANT_NEEDS`) are there; else a KernelValueError
    naming ``source``."""
    return launch.check_variant_needs(defines, VARIANT_NEEDS, source)


def _variant_from_env() -> tuple[str, ...]:
    return check_variants(launch.variants_from_env("SPARSEATTN_FWD_VARIANT", VARIANTS))


DEFINES = _variant_from_env()


def token_defines(kv_build: int = 0) -> tuple[str, ...]:
    """A token build's macros: :data:`DEFINES` without the TMA variants, plus :data:`TOKEN_KV_BUILDS`
    ``[kv_build]`` (0 / False: :data:`TOKEN_DEFINE`; 1 / True, ``kv_in_slots``: :data:`TOKEN_QO_DEFINE`;
    2: :data:`TOKEN_TMA_DEFINE`)."""
    tma = ("PAGED_FWD_TMA", "PAGED_FWD_REGS_232")
    return tuple(d for d in DEFINES if d not in tma) + (TOKEN_KV_BUILDS[int(kv_build)],)


def extra_builds() -> tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...]:
    """The token-order builds, for :mod:`.warmup`: ``((source, name expressions, defines), ...)``."""
    return tuple((SOURCE, NAME_EXPRESSIONS, token_defines(kv)) for kv in range(len(TOKEN_KV_BUILDS)))


def kernel_defines(source: str) -> tuple[str, ...]:
    """The macros ``source`` is compiled with now (:data:`DEFINES`): what :mod:`.warmup` compiles."""
    return DEFINES if source == SOURCE else ()


def kernel_name(head_dim: int, chunk: int, pair: bool = False) -> str:
    """The instantiation for a work list; ``pair``: one with row-half visibility bits (pair items)."""
    return (
        f"paged_fwd_kernel<{head_dim}, {chunk}, true>" if pair else f"paged_fwd_kernel<{head_dim}, {chunk}>"
    )


#: Pair work lists stream 128-key chunks (KPage's plans), so only those get a pair instantiation.
NAME_EXPRESSIONS = tuple(kernel_name(d, c) for d in HEAD_DIMS for c in CHUNKS) + tuple(
    kernel_name(d, 128, pair=True) for d in HEAD_DIMS
)
#: The kernel's parameters, in order (tests/test_compile.py checks them against the source).
KERNEL_PARAMS = (
    "Q",
    "K",
    "V",
    "O",
    "LSE",
    "work_info",
    "work_order",
    "own_pages",
    "stream_pages",
    "item_counter",
    "num_work",
    "batch",
    "heads",
    "q_slots",
    "k_slots",
    "stream_total",
    "scale_log2",
)


def stage_buffers(head_dim: int, chunk: int) -> int:
    """K (and V) chunk buffers in shared memory: as many as fit, at most MAX_NBUF."""
    kv = chunk * head_dim * 2
    fit = (SMEM_LIMIT - ALIGN_SLACK - SMALL_BYTES - Q_ROWS * head_dim * 2) // (2 * kv)
    return min(fit, MAX_NBUF)


def smem_bytes(head_dim: int, chunk: int) -> int:
    """Dynamic shared memory: alignment slack, Q tile, K and V rings, barriers and metadata."""
    return (
        ALIGN_SLACK
        + Q_ROWS * head_dim * 2
        + 2 * stage_buffers(head_dim, chunk) * chunk * head_dim * 2
        + SMALL_BYTES
    )


# ---- work lists, cached per graph / plan -------------------------------------------------------------

_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_RESOLVED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


#: KPage's ``route="auto"`` runs the pair route (64-row Q blocks joined two by two) where its work list
#: streams at most this fraction of the K/V pages of the per-block routes. Measured at ad52a35 (H200,
#: forward): VSA 480p streams 0.63x the pages paired and ran 5.64 against 6.11 ms; SVG2 (0.92x) ran
#: 78.6 against 75.7 ms and ssta (0.98x) 31.5 against 29.8 ms: a paired step computes both halves, so a
#: small page saving does not pay for it.
PAIR_FORWARD_MAX_PAGES = 0.75


def _as_stack(obj):
    """A list or tuple of per-head graphs as a :class:`HeadStack`; anything else as it is."""
    if isinstance(obj, (list, tuple)) and obj and all(isinstance(g, SparseGraph) for g in obj):
        return HeadStack.of(obj)
    return obj


def forward_route(graph_or_plan, kind: str = "kpage", route="auto"):
    """The route a forward of ``graph_or_plan`` runs: ``route``, except that KPage's ``"auto"`` on a
    graph or HeadStack becomes ``"pair"`` where the pair work list streams at most
    :data:`PAIR_FORWARD_MAX_PAGES` of the pages of the per-block routes (both lists are built once and
    cached)."""
    obj = _as_stack(graph_or_plan)
    if route != "auto" or kind != "kpage" or not isinstance(obj, (SparseGraph, HeadStack)):
        return route
    return cached(obj, ("forward route", kind), lambda: _pair_if_fewer_pages(obj, kind))


def per_block_stream_pages(graph_or_stack) -> tuple[int, int]:
    """``(all, 64-row)``: K/V pages the per-block KPage routes stream (``route="auto"``'s work list:
    every owned tile of a Q block streams the live pages of the blocks it selects), over all items and
    over the 64-row items; counted from the graph without building the list."""
    graphs = graph_or_stack.graphs if isinstance(graph_or_stack, HeadStack) else (graph_or_stack,)
    total = small = 0
    for g in graphs:
        route = np.tile(kpage_route_of_block(g.q.live_pages), g.heads)
        _, tiles, streamed = row_work(
            g, g.q, g.q.live_pages, g.k.live_pages, np.asarray(KPAGE_ROUTES)[route, 0]
        )
        per_row = tiles * streamed
        total += int(per_row.sum())
        small += int(per_row[route == 0].sum())
    return total, small


def _pair_if_fewer_pages(obj, kind: str):
    total, small = per_block_stream_pages(obj)
    # a pair item streams the union of the pages its blocks select: two full blocks at least half their
    # sum, two halves packed from up to four partial blocks each at least an eighth; skip building the pair
    # list where even that is not enough
    if total == 0 or total - small * 7 / 8 > PAIR_FORWARD_MAX_PAGES * total:
        return "auto"
    paired = int(_work_of(obj, kind, "pair").work_info[:, 2].astype(np.int64).sum())
    return "pair" if paired <= PAIR_FORWARD_MAX_PAGES * total else "auto"


def work_of(graph_or_plan, kind: str = "kpage", route="auto") -> WorkList:
    """The work list of a graph, HeadStack (or list of per-head graphs), plan, list of single-head
    plans or work list; built once per graph / plan. ``route="auto"`` resolves by
    :func:`forward_route`. Index ranges against tensors: :func:`resolve_work`."""
    return _work_of(graph_or_plan, kind, forward_route(graph_or_plan, kind, route))


#: The routes a KPage forward of a graph takes (:func:`paged_forward`).
FORWARD_ROUTES = ("auto", 0, 1, "pair", "packed")


def _work_of(graph_or_plan, kind: str, route) -> WorkList:
    if kind == "kpage" and route not in FORWARD_ROUTES:
        raise KernelValueError(f"route must be one of {FORWARD_ROUTES} for KPage's forward, got {route!r}")
    obj = _as_stack(graph_or_plan)
    # "pair": 64-row Q blocks joined two by two into 128-row items; "packed": the partial 64-row Q blocks
    # packed into shared 64-row items
    if route in ("pair", "packed"):
        if kind != "kpage" or not isinstance(obj, (SparseGraph, HeadStack)):
            raise KernelValueError(f"route={route!r} runs KPage on a SparseGraph or a HeadStack")
        return (pair_work_of if route == "pair" else packed_work_of)(obj)
    if isinstance(obj, SparseGraph):
        plan = plan_of(obj, kind, route)
        return cached(
            plan, "work", lambda: work_list(check_plan(plan, obj.q.num_pages, obj.k.num_pages, obj.heads))
        )
    if isinstance(obj, HeadStack):

        def build():
            plans = [plan_of(g, kind, route) for g in obj.graphs]
            for g, p in zip(obj.graphs, plans):
                check_plan(p, g.q.num_pages, g.k.num_pages, 1)
            return work_list(plans)

        return cached(obj, ("work", kind, route), build)
    if isinstance(obj, TilePlan):
        return cached(obj, "work", lambda: work_list(obj))
    if isinstance(obj, (list, tuple)) and obj and all(isinstance(p, TilePlan) for p in obj):
        for p in obj:
            check_plan(p, p.own_page_mask.size, p.stream_page_mask.size, 1)
        return work_list(list(obj))
    if isinstance(obj, WorkList):
        return obj
    raise KernelTypeError(
        "graph_or_plan must be a SparseGraph, a HeadStack (or list of per-head SparseGraphs), a "
        f"TilePlan, a list of single-head TilePlans or a WorkList; got {type(graph_or_plan).__name__}"
    )


def resolve_work(graph_or_plan, kind: str, route, heads: int, q_slots: int, k_slots: int) -> WorkList:
    """The validated work list for tensors of these sizes (built and checked once per object and size).

    ``graph_or_plan``: a :class:`SparseGraph`, a :class:`HeadStack` or list of per-head graphs, a
    :class:`TilePlan` (owner ``"q"``), a list of single-head plans, or a :class:`WorkList`.
    """
    key = (kind, route, heads, q_slots, k_slots)
    try:  # repeated calls: one weak-dictionary hit
        return _RESOLVED[graph_or_plan][key]
    except (KeyError, TypeError):  # TypeError: a list is not weak-referenceable (not cached)
        pass
    wl = _resolve_work(graph_or_plan, kind, route, heads, q_slots, k_slots)
    try:
        _RESOLVED.setdefault(graph_or_plan, {})[key] = wl
    except TypeError:
        pass
    return wl


def _resolve_work(graph_or_plan, kind: str, route, heads: int, q_slots: int, k_slots: int) -> WorkList:
    q_pages, k_pages = pages_of("q", q_slots), pages_of("k", k_slots)
    obj = _as_stack(graph_or_plan)
    if isinstance(obj, SparseGraph):
        check_graph_matches(obj, heads, q_slots, k_slots)
    elif isinstance(obj, HeadStack):
        if obj.heads != heads:
            raise KernelValueError(f"the HeadStack has {obj.heads} heads but q has {heads}")
        if obj.q_slots != q_slots or obj.k_slots != k_slots:
            raise KernelValueError(
                f"the HeadStack's largest layouts have {obj.q_slots} Q / {obj.k_slots} K slots, "
                f"the tensors {q_slots} / {k_slots}"
            )
    elif isinstance(obj, TilePlan):
        check_plan(obj, q_pages, k_pages, heads)
    return check_work_list(work_of(obj, kind, route), q_pages, k_pages, heads)


def check_work_list(wl: WorkList, q_pages: int, k_pages: int, heads: int) -> WorkList:
    """Every index the kernel will follow is in range for tensors of these sizes (once per size)."""
    done = _CHECKED.setdefault(wl, set())
    if (q_pages, k_pages, heads) in done:
        return wl
    info = wl.work_info.astype(np.int64)
    w, s = info.shape[0], wl.stream_pages.size
    if wl.work_order.shape != (w,) or not np.array_equal(np.sort(wl.work_order), np.arange(w)):
        raise KernelValueError("work_list.work_order must be a permutation of the work items")
    if wl.own_pages.shape != (w, OWN_PAGES) or wl.own_mask.shape != (w, OWN_PAGES):
        raise KernelValueError(f"work_list.own_pages / own_mask must be [{w}, {OWN_PAGES}]")
    if wl.stream_mask.shape != (s,):
        raise KernelValueError("work_list.stream_mask must have one entry per stream page")
    if wl.chunk not in CHUNKS:
        raise KernelValueError(f"work_list.chunk must be one of {CHUNKS}, got {wl.chunk}")
    checks = (
        ("head", info[:, 0], 0, heads),
        ("own_pages", wl.own_pages, -1, q_pages),
        ("stream_pages", wl.stream_pages, 0, k_pages),
    )
    for name, arr, low, high in checks:
        if arr.size and (int(arr.min()) < low or int(arr.max()) >= high):
            raise KernelValueError(f"work_list.{name} holds values outside [{low}, {high})")
    if w and (info[:, 1].min() < 0 or info[:, 2].min() < 0 or (info[:, 1] + info[:, 2]).max() > s):
        raise KernelValueError("work_list streams run outside stream_pages")
    if w and not np.isin(info[:, 3], (64, 128)).all():
        raise KernelValueError("work_list rows (M) must be 64 or 128")
    if wl.has_visibility() and wl.chunk != 128:
        raise KernelValueError("a pair work list (row-half visibility bits) must stream 128-key chunks")
    if k_pages * 16 * 128 >= 2**31 or q_pages * 16 * 128 >= 2**31:
        raise KernelValueError("a head's slot count is too large for 32-bit element offsets")
    done.add((q_pages, k_pages, heads))
    return wl


# ---- launch ----------------------------------------------------------------------------------------


def _fast_tensors(q, k, v, out):
    """The common case in a few attribute reads: CuPy bf16 tensors of matching shapes, contiguous, on
    one device. Returns the sizes, or None to run the full checks (which name what is wrong)."""
    try:
        t = type(q)
        if t not in CUPY_TYPES or type(k) is not t or type(v) is not t:
            return None
        b, h, sq, d = q.shape
        dt = q.dtype
        if d not in HEAD_DIMS or dtype_name(q) not in BF16_DTYPE_NAMES or b > MAX_BATCH:
            return None
        ks = k.shape
        if len(ks) != 4 or ks[0] != b or ks[1] != h or ks[3] != d or v.shape != ks:
            return None
        if k.dtype != dt or v.dtype != dt or not (q._c_contiguous and k._c_contiguous and v._c_contiguous):
            return None
        dev = q.data.device_id
        if k.data.device_id != dev or v.data.device_id != dev:
            return None
        if out is not None:
            o, lse = out
            if type(o) is not t or type(lse) is not t or o.shape != q.shape or o.dtype != dt:
                return None
            if lse.shape != (b, h, sq) or dtype_name(lse) != "float32":
                return None
            if (
                not (o._c_contiguous and lse._c_contiguous)
                or o.data.device_id != dev
                or lse.data.device_id != dev
            ):
                return None
        return b, h, sq, ks[2], d, dev
    except Exception:  # noqa: BLE001 - anything unexpected: the full checks say what it is
        return None


def _check_tensors(q, k, v, out):
    fast = _fast_tensors(q, k, v, out)
    if fast is not None:
        return fast
    check_tensor("q", q, dtype=BF16_DTYPE_NAMES, ndim=4)
    b, h, sq, d = q.shape
    check_head_dim("q", d, HEAD_DIMS)
    device = device_of(q)
    like_q = (dtype_name(q),)
    check_tensor("k", k, dtype=like_q, shape=(b, h, None, d), device=device)
    check_tensor("v", v, dtype=like_q, shape=(b, h, k.shape[2], d), device=device)
    if b > MAX_BATCH:
        raise KernelValueError(f"q has batch {b}; at most {MAX_BATCH}")
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise KernelTypeError("out must be a tuple (o, lse) of preallocated arrays")
        check_tensor("out[0] (o)", out[0], dtype=like_q, shape=(b, h, sq, d), device=device)
        check_tensor("out[1] (lse)", out[1], dtype="float32", shape=(b, h, sq), device=device)
    return b, h, sq, k.shape[2], d, device


#: Whether a device planner's list starts the item counter past its void items (False: from 0, the void
#: items fetched and passed by; an A/B knob, ``data/bench/experiments/device_plan_gap.py``).
START_PAST_VOIDS = True


#: The kernel parameter of each of a work list's :data:`LIST_ARRAYS` (a device list binds them at every
#: call, after the five tensors: each call's device plans live in a new arena, the packed launch is shared
#: by every arena of one shape).
_LIST_PARAMS = dict(
    zip(LIST_ARRAYS, ("work_info", "work_order", "own_pages", "stream_pages", "item_counter"))
)


def _prepared(wl: WorkList | DeviceWorkList, sizes: tuple, scale: float, device: int, tokens=None):
    """``(packed launch, counter pointer, tensor maps)`` of one launch (the five tensors its first
    arguments; tensor maps of K and V in the ``PAGED_FWD_TMA`` build, else none), prepared once per
    (work list, device, tensor sizes, scale) and reused; None when there is no work. A device planner's
    work list is new per call, its arrays in a new arena of the same shape: its launch is kept in the
    arena's shared ``launches`` and binds :data:`LIST_ARRAYS` per call (counter pointer None: the list's
    own). ``sizes``: (batch, heads, q_slots, k_slots, d). ``tokens``: the token-order build's
    ``(q_tokens, k_tokens, tok_heads, maps_per_row, kv_build)`` (its two map pointers are then set per
    call after the five tensors and a device list's arrays; ``kv_build`` as :func:`token_defines`; 2 adds
    token-major tensor maps of K and V)."""
    import cupy

    b, h, sq, sk, d = sizes
    on_device = isinstance(wl, DeviceWorkList)
    if on_device:
        cache = getattr(wl.arena, "launches", None)
        if cache is None:  # a list with memory of its own (SVG2's per-call lists): packed per call
            cache = {}
    else:
        cache = launch.device_arrays(wl, device, wl.device_arrays)
    defines = DEFINES if tokens is None else token_defines(tokens[4])
    key = (sizes, scale, defines, tokens, device, wl.num_work, wl.chunk, wl.has_visibility())
    ready = cache.get(key)
    if ready is None:
        if wl.num_work * b == 0:
            return None
        smem = smem_bytes(d, wl.chunk)
        name = kernel_name(d, wl.chunk, pair=wl.has_visibility())
        fn = launch.prepare(launch.function(SOURCE, name, NAME_EXPRESSIONS, defines), smem)
        if on_device:
            list_arrays = {name: np.uint64(0) for name in LIST_ARRAYS}
            counter = None
        else:  # one counter per launch key, kept as long as its packed launch (which holds its pointer only)
            with cupy.cuda.Device(device):
                counter_array = cache[("counter", key)] = cupy.zeros(1, dtype=cupy.int32)
            list_arrays = {name: cache[name] for name in LIST_ARRAYS[:-1]}
            list_arrays["counter"] = counter = np.uint64(counter_array.data.ptr)
        values = dict(
            **{param: list_arrays[name] for name, param in _LIST_PARAMS.items()},
            num_work=np.int32(wl.num_work),
            batch=np.int32(b),
            heads=np.int32(h),
            q_slots=np.int32(sq),
            k_slots=np.int32(sk),
            stream_total=np.int32(wl.stream_total if on_device else wl.stream_pages.size),
            scale_log2=np.float32(scale * math.log2(math.e)),
        )
        rest = tuple(values[name] for name in KERNEL_PARAMS[5:])
        maps, bound, token_args = (), list(range(5)), ()
        if on_device:
            bound += [KERNEL_PARAMS.index(param) for param in _LIST_PARAMS.values()]
        if tokens is not None and tokens[4] == 2:  # token-major K and V: [batch · k_tokens, tok_heads, d]
            rows = b * h // tokens[2] * tokens[1]  # (a device list's sizes fold the batch into the heads)
            maps = tuple(TensorMap(rows, d, name, heads=tokens[2]) for name in ("k", "v"))
        elif tokens is None and "PAGED_FWD_TMA" in DEFINES:  # pointed at each call's K and V by _launch
            maps = (TensorMap(b * h * sk, d, "k"), TensorMap(b * h * sk, d, "v"))
        if tokens is not None:  # (after the tensor maps, as in the kernel's parameters)
            token_args = (np.uint64(0), np.uint64(0)) + tuple(np.int32(x) for x in tokens[:4])
            bound += [len(KERNEL_PARAMS) + len(maps), len(KERNEL_PARAMS) + len(maps) + 1]
        grid = (min(launch.sm_count(device), wl.num_work * b),)
        args = (np.uint64(0),) * 5 + rest + maps + token_args
        packed = launch.PackedLaunch(fn, grid, (THREADS,), args, smem, bound)
        ready = cache[key] = (packed, None if counter is None else int(counter), maps)
    return ready


def _pointer(x) -> int:
    """A device pointer: raw (an integer) or a CuPy array's."""
    return int(x) if isinstance(x, (int, np.integer)) else x.data.ptr


def _launch(
    q,
    k,
    v,
    wl: WorkList | DeviceWorkList,
    scale: float,
    o,
    lse,
    device: int,
    sizes=None,
    stream=None,
    tokens=None,
    token_maps=(),
):
    """One launch of the persistent kernel on ``stream`` (default: CuPy's current stream); the tensors are
    CuPy arrays, or raw pointers with their ``sizes`` (batch, heads, q_slots, k_slots, d). The token-order
    build: ``tokens`` as :func:`_prepared` takes them and ``token_maps`` the two maps' pointers."""
    import cupy

    if sizes is None:
        b, h, sq, d = q.shape
        sizes = (b, h, sq, k.shape[2], d)
    ready = _prepared(wl, sizes, scale, device, tokens)
    if ready is None:
        return
    packed, counter, maps = ready
    pointers = [_pointer(x) for x in (q, k, v, o, lse)]
    first = None
    if counter is None:  # a device list: its arrays bound per call, its counter started past its void items
        arrays = wl.arrays
        pointers += [int(arrays[name]) for name in LIST_ARRAYS]
        counter = pointers[-1]
        live = arrays.get("first_live") if sizes[0] == 1 else None  # SVG2's lists have none
        first = None if live is None else int(live)
    pointers += [int(p) for p in token_maps]
    for tensor_map, pointer in zip(maps, pointers[1:3]):  # K and V (TMA build)
        tensor_map.point_at(pointer)
    stream = cupy.cuda.get_current_stream().ptr if stream is None else stream
    if first is None or not START_PAST_VOIDS:
        cupy.cuda.runtime.memsetAsync(counter, 0, 4, stream)
    else:  # past the void items a device planner's work order lists first
        cupy.cuda.runtime.memcpyAsync(counter, first, 4, cupy.cuda.runtime.memcpyDeviceToDevice, stream)
    packed(stream, *pointers)


def _fresh_outputs(q, lse_shape: tuple, device: int):
    """``o`` zeros like ``q`` and ``lse`` float32 ``-inf`` of ``lse_shape`` on the current stream (``-inf``
    by one copy from a constant buffer, where ``cupy.full`` would launch a kernel)."""
    import cupy

    o = cupy.zeros(q.shape, dtype=q.dtype)
    lse = cupy.empty(lse_shape, dtype=cupy.float32)
    launch.fill_neg_inf(lse.data.ptr, lse.size, cupy.cuda.get_current_stream().ptr, device)
    return o, lse


def _device_plans_forward(q, k, v, plans: DevicePlans, scale, out):
    """The forward of a device planner's plans: the tensors ``[batch, heads, slots, d]`` run as one batch
    of ``batch · heads`` heads (every batch entry has its own selection)."""
    if launch.is_torch_tensor(q):
        return _torch_forward(q, k, v, plans, scale, out, "kpage", "auto")
    b, h, sq, sk, d, device = _check_tensors(q, k, v, out)
    if (b, h) != (plans.batch, plans.heads):
        raise KernelValueError(
            f"the plans were made for batch {plans.batch} x {plans.heads} heads, q has {b} x {h}"
        )
    if (sq, sk) != (plans.q_slots, plans.k_slots):
        raise KernelValueError(
            f"the plans' layouts have {plans.q_slots} Q / {plans.k_slots} K slots, q has {sq} and k {sk}"
        )
    scale = check_scale(scale, d)
    import cupy

    with cupy.cuda.Device(device):
        o, lse = _fresh_outputs(q, (b, h, sq), device) if out is None else out
        one = lambda x: x.reshape(1, b * h, *x.shape[2:])
        _launch(one(q), one(k), one(v), plans.forward, scale, one(o), one(lse), device)
    return o, lse


def paged_forward(q, k, v, graph_or_plan, scale=None, out=None, *, kind: str = "kpage", route="auto"):
    """Sparse attention forward on the paged kernel skeleton.

    Args:
        q: bf16 ``[batch, heads, q_slots, d]`` (CuPy ``uint16`` bits / bfloat16, or a torch CUDA
            bf16 tensor), C-contiguous; ``d`` 64 or 128; ``q_slots`` a multiple of 16.
        k, v: like ``q`` with ``k_slots``.
        graph_or_plan: a :class:`SparseGraph` or :class:`HeadStack` (its ``kind`` plan: ``"kpage"`` with
            ``route``, or ``"bsa"``), a :class:`TilePlan` (owner ``"q"``), a list of single-head plans,
            or a :class:`WorkList`.
        scale: softmax scale (default ``1/sqrt(d)``).
        out: optional ``(o, lse)`` to write into.
        kind, route: which plan a graph runs (``route``: ``"auto"``, 0 = 64×256, 1 = 128×128; or
            ``"pair"``: KPage with 64-row Q blocks joined two by two into 128-row items, per head on a
            HeadStack, :mod:`sparseattn.planning.pair_forward`; ``"auto"`` takes it where
            :func:`forward_route` says so; or ``"packed"``: KPage with the partial 64-row Q blocks (1–3
            live pages) packed into shared 64-row items, :mod:`sparseattn.planning.packed_forward`).

    Returns:
        ``(o, lse)``: ``o`` like ``q``, ``lse`` float32 ``[batch, heads, q_slots]`` (natural log). Valid
        rows without any valid key get ``o = 0``, ``lse = -inf``; padding rows are not written (fresh
        outputs hold zeros and ``-inf`` there).
    """
    if kind not in ("kpage", "bsa"):
        raise KernelValueError(f"kind must be 'kpage' or 'bsa', got {kind!r}")
    if isinstance(graph_or_plan, DevicePlans):
        return _device_plans_forward(q, k, v, graph_or_plan, scale, out)
    if launch.is_torch_tensor(q):
        return _torch_forward(q, k, v, graph_or_plan, scale, out, kind, route)
    b, h, sq, sk, d, device = _check_tensors(q, k, v, out)
    wl = resolve_work(graph_or_plan, kind, route, h, sq, sk)
    scale = check_scale(scale, d)
    import cupy

    if out is None:
        with cupy.cuda.Device(device):
            o, lse = _fresh_outputs(q, (b, h, sq), device)
    else:
        o, lse = out
    if cupy.cuda.runtime.getDevice() == device:
        _launch(q, k, v, wl, scale, o, lse, device)
    else:
        with cupy.cuda.Device(device):
            _launch(q, k, v, wl, scale, o, lse, device)
    return o, lse


def _torch_fast_forward(q, k, v, graph_or_plans, route, scale, out, zero_rows=None):
    """The forward of device plans or a cached graph on torch tensors in a few attribute reads and one
    launch (raw pointers, no DLPack views); None when anything is unusual (the general path then names
    what is wrong). ``zero_rows``: see :func:`_torch_launch` (device plans only)."""
    import torch

    try:
        b, h, sq, d = q.shape
        sk = k.shape[2]
        dev = q.device
        ok = (
            q.dtype == k.dtype == v.dtype == torch.bfloat16
            and dev.type == "cuda"
            and k.device == dev
            and v.device == dev
            and k.shape == v.shape == (b, h, sk, d)
            and d in HEAD_DIMS
            and q.is_contiguous()
            and k.is_contiguous()
            and v.is_contiguous()
            and out is None
        )
    except (AttributeError, TypeError, ValueError):
        return None
    if not ok:
        return None
    if isinstance(graph_or_plans, DevicePlans):
        plans = graph_or_plans
        if (b, h, sq, sk) != (plans.batch, plans.heads, plans.q_slots, plans.k_slots):
            return None
        wl, sizes = plans.forward, (1, b * h, sq, sk, d)
    elif isinstance(graph_or_plans, SparseGraph) and b <= MAX_BATCH:
        wl, sizes = resolve_work(graph_or_plans, "kpage", route, h, sq, sk), (b, h, sq, sk, d)
        zero_rows = None  # a host plan may leave valid rows unowned: o is zeroed whole
    else:
        return None
    return _torch_launch(q, k, v, wl, check_scale(scale, d), sizes, zero_rows)


def _torch_launch(
    q, k, v, wl, scale: float, sizes, zero_rows=None, *, lse_shape=None, tokens=None, token_maps=()
):
    """``(o, lse)`` of one launch on torch tensors (raw pointers, torch's current stream): fresh outputs,
    ``o`` zeroed and ``lse`` ``-inf`` where no item writes. ``sizes`` as :func:`_launch` takes them.
    ``zero_rows`` (int64 CUDA tensor of slot indices): the only rows of ``o`` no item writes (a device
    plan writes every valid row of its Q layout; these are its padding slots), zeroed instead of all of
    ``o``; False: no row needs zeros. ``lse_shape``: default ``q.shape[:3]``; ``tokens`` / ``token_maps``:
    the token-order build's, as :func:`_launch` takes them."""
    import cupy
    import torch

    dev = q.device
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:3] if lse_shape is None else lse_shape, dtype=torch.float32, device=dev)
    stream = launch.torch_stream_ptr(dev.index)
    from .. import slot_copy

    if zero_rows is False:
        pass
    elif zero_rows is None or not slot_copy.available(o):
        cupy.cuda.runtime.memsetAsync(o.data_ptr(), 0, o.numel() * 2, stream)
    else:
        slot_copy.zero_rows(o, zero_rows)
    launch.fill_neg_inf(lse.data_ptr(), lse.numel(), stream, dev.index)
    ptr = lambda x: x.data_ptr()
    maps = tuple(ptr(m) for m in token_maps)
    _launch(ptr(q), ptr(k), ptr(v), wl, scale, ptr(o), ptr(lse), dev.index, sizes, stream, tokens, maps)
    return o, lse


def check_token_tensors(q, k, v, q_map, k_map, others=(), kv_in_slots=False):
    """The sizes ``(batch, q_tokens, heads, d, k_tokens, q_slots, k_slots, maps_per_row)`` of a token-order
    call (:func:`torch_token_forward`'s arguments; ``others``: more ``(name, tensor)`` shaped like ``q``,
    e.g. the backward's o and do), or a KernelTypeError / KernelValueError naming the argument.
    ``kv_in_slots`` (the Q/O token build): ``k`` and ``v`` are ``[batch, heads, k_slots, d]`` in slot order,
    ``k_map`` is not read, and ``k_tokens`` is ``k_slots``."""
    import torch

    token_ordered = (("q", q), *(() if kv_in_slots else (("k", k), ("v", v))), *others)
    for name, x in token_ordered:
        if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or not x.is_cuda or x.dim() != 4:
            raise KernelTypeError(f"{name} must be a bf16 CUDA tensor [batch, tokens, heads, d]")
    for name, x in (("k", k), ("v", v)) if kv_in_slots else ():
        if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or not x.is_cuda or x.dim() != 4:
            raise KernelTypeError(
                f"{name} must be a bf16 CUDA tensor [batch, heads, k_slots, d] in slot order"
            )
    b, nq, h, d = q.shape
    dev = q.device
    check_head_dim("q", d, HEAD_DIMS)
    if kv_in_slots:
        nk = k.shape[2]
        if k.shape != (b, h, nk, d) or v.shape != k.shape:
            raise KernelValueError(
                f"k and v must be [{b}, {h}, k_slots, {d}] in slot order; got {tuple(k.shape)}, {tuple(v.shape)}"
            )
    else:
        nk = k.shape[1]
        if k.shape != (b, nk, h, d) or v.shape != k.shape:
            raise KernelValueError(
                f"k and v must be [{b}, k_tokens, {h}, {d}] like q; got {tuple(k.shape)}, {tuple(v.shape)}"
            )
    if k.device != dev or v.device != dev:
        raise KernelValueError("q, k and v must be on one device")
    maps = (("q_map", q_map),) if kv_in_slots else (("q_map", q_map), ("k_map", k_map))
    for name, m in maps:
        if not isinstance(m, torch.Tensor) or m.dtype != torch.int32 or m.device != dev:
            raise KernelTypeError(f"{name} must be an int32 tensor on q's device")
    per_row = q_map.dim() == 2
    if kv_in_slots:
        if q_map.dim() not in (1, 2) or (per_row and q_map.shape[0] != b * h):
            raise KernelValueError(
                f"q_map must be [slots] or [batch x heads = {b * h}, slots]; got {tuple(q_map.shape)}"
            )
    elif (
        q_map.dim() not in (1, 2)
        or k_map.dim() != q_map.dim()
        or (per_row and (q_map.shape[0], k_map.shape[0]) != (b * h,) * 2)
    ):
        raise KernelValueError(
            f"q_map and k_map must both be [slots], or both [batch x heads = {b * h}, slots]; got "
            f"{tuple(q_map.shape)} and {tuple(k_map.shape)}"
        )
    sq, sk = q_map.shape[-1], (nk if kv_in_slots else k_map.shape[-1])
    if (nq if kv_in_slots else max(nq, nk)) * h * d >= 2**31:
        raise KernelValueError("a batch entry's tokens x heads x d is too large for 32-bit offsets")
    for name, x in others:
        if x.shape != q.shape or x.device != dev:
            raise KernelValueError(f"{name} must be like q: {tuple(q.shape)} on {dev}, got {tuple(x.shape)}")
    return b, nq, h, d, nk, sq, sk, per_row


def pages_consecutive(slot_token: np.ndarray) -> bool:
    """Whether every 16-slot page of a slot -> token map (``[..., slots]``, -1 for slots without a token) that
    holds a token holds consecutive tokens from its first slot's: what the tile-major token build (``kv_tma``)
    reads each page by."""
    pages = np.asarray(slot_token).reshape(-1, PAGE_ROWS).astype(np.int64)
    first = pages[:, :1]
    blank = pages < 0
    runs = ((pages == first + np.arange(PAGE_ROWS)) | blank).all(1)
    return bool((runs & ((first[:, 0] >= 0) | blank.all(1))).all())


def remember_consecutive_pages(k_map, ok: bool) -> None:
    """Keeps ``ok`` (:func:`pages_consecutive` of its contents) on the map tensor ``k_map`` for its current
    version: a map uploaded from a host layout is then never read back by :func:`check_consecutive_pages`
    (which would synchronise, and fail inside a CUDA-graph capture)."""
    k_map._sparseattn_consecutive_pages = (k_map._version, bool(ok))


def check_consecutive_pages(k_map) -> None:
    """A KernelValueError naming ``k_map`` unless :func:`pages_consecutive` holds for it: what the tile-major
    token build (``kv_tma``) reads each page by. Checked once per map tensor and version, on the host (the
    answer kept on the tensor itself, :func:`remember_consecutive_pages`: a cache keyed by its address would
    answer for a later tensor at a freed one's)."""
    seen = getattr(k_map, "_sparseattn_consecutive_pages", None)
    if seen is None or seen[0] != k_map._version:
        remember_consecutive_pages(k_map, pages_consecutive(k_map.detach().cpu().numpy()))
    if not k_map._sparseattn_consecutive_pages[1]:
        raise KernelValueError(
            "k_map: the tile-major token build (kv_tma) needs every page's tokens consecutive from its first "
            "slot's (a layout relabelled tile-major, sparseattn.layouts.tile_major_tokens)"
        )


def torch_token_forward(
    q, k, v, graph_or_plans, q_map, k_map, route="auto", scale=None, kv_in_slots=False, kv_tma=False
):
    """KPage forward on token-ordered torch tensors, with no tensor moved into or out of slot order (the
    ``PAGED_FWD_TOKENS`` build gathers each slot's row from its token and stores O rows to theirs).

    Args:
        q: bf16 CUDA ``[batch, q_tokens, heads, d]`` (a model's layout), contiguous; ``d`` 64 or 128.
        k, v: ``[batch, k_tokens, heads, d]`` like ``q``; with ``kv_in_slots``, ``[batch, heads, k_slots, d]``
            in the K layout's slot order (padding slots zero) and ``k_map`` None: the Q/O token build
            (``PAGED_FWD_TOKENS_QO``), which streams K and V pages as the slot-order build does.
        graph_or_plans: a :class:`SparseGraph` of ``heads`` heads (its plans cached; ``route`` as
            :func:`paged_forward`), a device planner's :class:`DevicePlans` of ``batch x heads``, or a
            :class:`~sparseattn.planning.dynamic_layouts.DynamicWorkList` of ``batch · heads`` rows (per-row
            layouts made per call: SVG2).
        q_map, k_map: int32 CUDA: the token each slot of the Q / K layout holds, -1 for padding slots
            (``BlockLayout.slot_token``), every token in exactly one slot: ``[q_slots]`` / ``[k_slots]``
            for one layout of every row, or ``[batch · heads, q_slots]`` / ``[batch · heads, k_slots]`` for a
            layout per (batch, head) row, batch-major.
        scale: softmax scale (default ``1/sqrt(d)``).
        kv_tma: the tile-major token build (``PAGED_FWD_TOKENS_TMA``): k, v token-major as above, each live
            page of ``k_map`` (one map for every row) 16 consecutive tokens from its first slot's
            (:func:`check_consecutive_pages`), read by the tensor-memory accelerator.

    Returns:
        ``o`` bf16 ``[batch, q_tokens, heads, d]`` (tokens whose Q block selects nothing: zeros; ``o`` is
        zeroed first only where a plan may leave such rows unowned,
        :func:`~sparseattn.planning.work_list.writes_every_valid_row`) and ``lse`` float32
        ``[batch, heads, q_slots]`` in slot order (padding slots ``-inf``).
    """
    from ..planning.dynamic_layouts import DynamicWorkList

    if kv_tma and kv_in_slots:
        raise KernelValueError("kv_tma reads token-major k and v; kv_in_slots slot-ordered ones: choose one")
    b, nq, h, d, nk, sq, sk, per_row = check_token_tensors(q, k, v, q_map, k_map, kv_in_slots=kv_in_slots)
    if kv_in_slots:
        k_map = q_map  # (not read by the Q/O build)
    if kv_tma:
        if per_row:
            raise KernelValueError("kv_tma takes one map for every row ([k_slots]), not a map per row")
        if k.data_ptr() % 16 or v.data_ptr() % 16:
            raise KernelValueError("kv_tma: k and v must start at 16-byte aligned addresses")
        check_consecutive_pages(k_map)
    q, k, v, q_map, k_map = (x.contiguous() for x in (q, k, v, q_map, k_map))
    if isinstance(graph_or_plans, DevicePlans):
        plans = graph_or_plans
        if (b, h, sq, sk) != (plans.batch, plans.heads, plans.q_slots, plans.k_slots):
            raise KernelValueError(
                f"the plans are for batch {plans.batch} x {plans.heads} heads over {plans.q_slots} Q / "
                f"{plans.k_slots} K slots; the tensors and maps give {b} x {h} over {sq} / {sk}"
            )
        wl, sizes, whole = plans.forward, (1, b * h, sq, sk, d), False  # every valid row is written
    elif isinstance(graph_or_plans, DynamicWorkList):
        if graph_or_plans.rows != b * h:
            raise KernelValueError(f"the work list has {graph_or_plans.rows} rows; q has {b} x {h}")
        wl, sizes, whole = graph_or_plans.device_work_list(), (1, b * h, sq, sk, d), True
    elif isinstance(graph_or_plans, SparseGraph):
        if b > MAX_BATCH:
            raise KernelValueError(f"q has batch {b}; at most {MAX_BATCH}")
        wl, sizes = resolve_work(graph_or_plans, "kpage", route, h, sq, sk), (b, h, sq, sk, d)
        whole = not writes_every_valid_row(wl, graph_or_plans.q)  # else a Q block selecting nothing
    else:
        raise KernelTypeError(
            "graph_or_plans must be a SparseGraph, DevicePlans or a DynamicWorkList, got "
            f"{type(graph_or_plans).__name__}"
        )
    return _torch_launch(
        q,
        k,
        v,
        wl,
        check_scale(scale, d),
        sizes,
        None if whole else False,
        lse_shape=(b, h, sq),
        tokens=(nq, nk, h, int(per_row), 2 if kv_tma else int(bool(kv_in_slots))),
        token_maps=(q_map, k_map),
    )


def torch_dynamic_forward(q, k, v, work, scale=None):
    """KPage forward of a :class:`~sparseattn.planning.dynamic_layouts.DynamicWorkList` (per-row layouts
    made per call): ``q`` bf16 ``[batch, heads, q_slots, d]`` with ``batch · heads`` the list's rows (each
    row in its own layout's slot order), ``k``, ``v`` ``[batch, heads, k_slots, d]``. Returns ``(o, lse)``
    (padding rows zero / ``-inf``)."""
    import torch

    q, k, v = (x.contiguous() for x in (q, k, v))
    b, h, sq, d = q.shape
    sk = k.shape[2]
    if b * h != work.rows:
        raise KernelValueError(f"the work list has {work.rows} rows; q has {b} x {h} (batch x heads)")
    if q.dtype != torch.bfloat16 or k.dtype != q.dtype or v.dtype != q.dtype or not q.is_cuda:
        raise KernelTypeError("q, k, v must be bf16 CUDA tensors")
    if k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != d or d not in HEAD_DIMS:
        raise KernelValueError(f"k and v must be [{b}, {h}, k_slots, d] like q (d in {HEAD_DIMS})")
    return _torch_launch(q, k, v, work.device_work_list(), check_scale(scale, d), (1, b * h, sq, sk, d))


def torch_graph_forward(q, k, v, graph_or_plans, route="auto", scale=None):
    """KPage forward of a :class:`SparseGraph` (or device plans) on torch CUDA tensors: ``(o, lse)``, as
    :func:`paged_forward`; the common case in one launch with microseconds of host work."""
    q, k, v = (x.contiguous() for x in (q, k, v))
    fast = _torch_fast_forward(q, k, v, graph_or_plans, route, scale, None)
    if fast is not None:
        return fast
    return paged_forward(q, k, v, graph_or_plans, scale, kind="kpage", route=route)


def _torch_forward(q, k, v, graph_or_plan, scale, out, kind, route):
    import torch

    if isinstance(graph_or_plan, DevicePlans) or (kind == "kpage" and isinstance(graph_or_plan, SparseGraph)):
        fast = _torch_fast_forward(q, k, v, graph_or_plan, route, scale, out)
        if fast is not None:
            return fast

    if out is None:
        out = (
            torch.zeros_like(q),
            torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device),
        )
    with launch.torch_context():  # the views too: DLPack then exchanges no event with another stream
        inputs, outputs = launch.torch_views(
            dict(q=q, k=k, v=v), out, ("out[0] (o)", "out[1] (lse)"), "(o, lse)"
        )
        paged_forward(*inputs, graph_or_plan, scale, tuple(outputs), kind=kind, route=route)
    return tuple(out)


def kpage_forward(q, k, v, graph_or_plan, route="auto", scale=None, out=None):
    """KPage forward: live 16-row K/V pages of all selected blocks of a Q block packed back to back,
    the Q block routed to a 64×256 (≤ 64 live rows) or 128×128 tile (``route="auto"``; 0 / 1 fix it).
    Arguments and results as :func:`paged_forward`."""
    return paged_forward(q, k, v, graph_or_plan, scale, out, kind="kpage", route=route)


def bsa_forward(q, k, v, graph_or_plan, scale=None, out=None):
    """BSA forward on the same skeleton: one full Bq×Bk tile per selected block pair (B = 64 or 128).
    Arguments and results as :func:`paged_forward`."""
    return paged_forward(q, k, v, graph_or_plan, scale, out, kind="bsa")


def executed_pairs(graph_or_plan, kind: str = "kpage", route="auto") -> int:
    """Query–key pairs the kernel computes for one batch entry (M · chunk · chunks over work items)."""
    return work_of(graph_or_plan, kind, route).executed_pairs()
