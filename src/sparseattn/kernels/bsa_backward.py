"""The K/V-owned backward kernels behind one validating wrapper, :func:`plan_backward`, and the
``mma.sync`` BSA baseline :func:`bsa_mma_backward` (benchmarked as ``bsa_mma``).

K/V-owned FlashAttention-2-style backward with exact masking. :func:`plan_backward` executes any
owner-``"kv"`` :class:`~sparseattn.planning.TilePlan` whose owned tile height is 64 or 128 rows; given a
:class:`~sparseattn.graph.SparseGraph` it builds (and caches) ``bsa_plan(graph, owner="kv")``. The public
entry points sit on it: ``sparseattn.kpage_backward`` / ``sparseattn.bsa_backward``
(:mod:`.backward`: graphs, HeadStacks, routes) and :func:`bsa_mma_backward`.

Three launches per call (plus one main launch per route of the plan):

1. ``bsa_bwd_preprocess``: ``Δ = rowsum(dO ∘ O)`` fp32 ``[batch, heads, q_slots]``;
2. ``bsa_bwd_kernel<D, BLOCK_K, BLOCK_Q, SUB_Q, MIN_BLOCKS>``: grid ``(work items of the route,
   batch)``; each CTA keeps the dK/dV of its owned K/V pages in registers and writes them once, and
   adds its dQ share into an fp32 buffer with vector atomics;
3. ``bsa_bwd_postprocess``: ``dQ = bf16(scale · dq_accum)``.

Step 2 has several implementations with the same plan, arguments and results:

* ``impl="wgmma"`` (the default), what measured fastest on the H200: 128-row tiles on the warp-specialized
  ``paged_bwd_ws_kernel<D>`` (a producer warpgroup gathering Q and dO pages into an mbarrier ring, a warp
  adding staged dQ pages by bulk reductions, two consumer warpgroups); on plans whose routes are all
  64-row tiles, dK/dV without dQ and then dQ in a Q-owned pass (``paged_bwd_dq_kernel``, no atomics) when
  the Q-owned plan can be had (a graph, or ``dq_plan``), else ``paged_bwd_kernel<D, 64, 1, DQ_BULK>``;
* ``"wgmma_sync"`` (version 2's default: ``paged_bwd_kernel<D, BLOCK_K, 1, DQ_MODE>``, one consumer
  warpgroup per 64 owned rows, bulk dQ reductions on 64-row tiles, fp32 vector atomics on 128-row tiles),
  ``"wgmma_atomic"`` (atomics on every route: version 1), ``"wgmma_bulk"`` (bulk reductions on every
  route), ``"wgmma_qsplit"`` and ``"wgmma_qsplit_bulk"`` (64-row owned tiles on two warpgroups that split
  each step's 128 streamed rows), ``"wgmma_dq_pass"`` (the dQ pass on every plan) and ``"wgmma_ws"`` (the
  warp-specialized kernel on 128-row tiles, bulk reductions on 64-row tiles);
* ``impl="mma"``: the ``mma.sync`` kernel ``bsa_bwd_kernel``.

A plan with pair items (``TilePlan.stream_vis``, :mod:`sparseattn.planning.pair_backward`: two 64-row K/V
blocks in a 128-row item, each half seeing its own block's Q pages) runs its 128-row items on
``paged_bwd_ws_kernel<D, true>`` (its GPU tests: ``tests/gpu/test_kpage_backward.py``'s pair route); it
needs ``impl="wgmma"`` or ``"wgmma_ws"`` without ``deterministic``.

``deterministic=True`` (wgmma implementations) makes dQ bit-identical from run to run: the Q-owned dQ
pass already is (a fixed summation order); otherwise dQ is added in 64-bit fixed point with integer
atomics, then ``bwd_fixed_postprocess`` converts it, and the result does not depend on the order of the
work items either. The environment variable
``SPARSEATTN_BWD_IMPL`` sets the default implementation for a process (the GPU tests use it to run every
backward case on either kernel).
"""

from __future__ import annotations

import math
import os
import weakref

import numpy as np

from ..constants import PAGE_ROWS
from ..planning.cache import PlanCache
from ..planning.device import DeviceOwnedPlan
from ..planning.tile_plan import TilePlan, first_pair_items, pages_hold_rows
from . import launch
from .validate import (
    BF16_DTYPE_NAMES,
    KernelTypeError,
    KernelValueError,
    check_head_dim,
    check_scale,
    check_tensor,
    pages_of,
)

SOURCE = "bsa_bwd.cu"
WGMMA_SOURCE = "paged_bwd.cu"
#: Compile-time variants of ``paged_bwd.cu`` (A/B runs): ``PAGED_BWD_WG_DQ`` makes each consumer warpgroup
#: of paged_bwd_ws_kernel compute the dQ of its own 64 owned rows over every head-dim column and reduce it
#: through its own staging buffer, so the two warpgroups share no barrier inside the loop (twice the dQ
#: reduction traffic); with it (:data:`VARIANT_NEEDS`), ``PAGED_BWD_WG_OFFSET`` starts the second warpgroup
#: half a step after the first, and ``PAGED_BWD_WG_SUM`` has the second add its dQ partial to the first's in
#: one staging buffer (one reduction per step, as the default build). ``SPARSEATTN_BWD_VARIANT``
#: (comma-separated) selects them for a process.
VARIANTS = ("PAGED_BWD_WG_DQ", "PAGED_BWD_WG_OFFSET", "PAGED_BWD_WG_SUM")
#: Variants that compile only together with others.
VARIANT_NEEDS = {"PAGED_BWD_WG_OFFSET": ("PAGED_BWD_WG_DQ",), "PAGED_BWD_WG_SUM": ("PAGED_BWD_WG_DQ",)}
DEFINES = launch.check_variant_needs(
    launch.variants_from_env("SPARSEATTN_BWD_VARIANT", VARIANTS), VARIANT_NEEDS, "SPARSEATTN_BWD_VARIANT"
)
#: How a wgmma CTA adds its dQ partials (paged_bwd.cu's DQ_MODE): fp32 vector atomics, bulk
#: asynchronous reductions of staged pages, or 64-bit fixed-point integer atomics (deterministic).
DQ_ATOMIC, DQ_BULK, DQ_FIXED, DQ_NONE = 0, 1, 2, 3
#: The "Q split" that selects paged_bwd_ws_kernel (128-row tiles only).
WS_SPLIT = 0
#: The wgmma variants: owned tile height (64 or 128 rows) -> (Q split, dQ mode), paged_bwd_kernel's last
#: two template parameters (Q split 0: the warp-specialized paged_bwd_ws_kernel). ``wgmma`` (the default)
#: is what measured fastest on the H200: 128-row tiles on paged_bwd_ws_kernel, and on plans whose routes
#: are all 64-row tiles the Q-owned dQ pass (:func:`resolve_impl`), else bulk dQ reductions on them.
WGMMA_VARIANTS = {
    "wgmma": {64: (1, DQ_BULK), 128: (WS_SPLIT, DQ_BULK)},
    # version 2's default: the synchronous kernel on every route, bulk reductions on 64-row tiles
    "wgmma_sync": {64: (1, DQ_BULK), 128: (1, DQ_ATOMIC)},
    "wgmma_atomic": {64: (1, DQ_ATOMIC), 128: (1, DQ_ATOMIC)},
    "wgmma_bulk": {64: (1, DQ_BULK), 128: (1, DQ_BULK)},
    "wgmma_qsplit": {64: (2, DQ_ATOMIC), 128: (1, DQ_ATOMIC)},
    "wgmma_qsplit_bulk": {64: (2, DQ_BULK), 128: (1, DQ_BULK)},
    # dK/dV without dQ, then dQ in a Q-owned pass (paged_bwd_dq_kernel) that recomputes S and dP: no
    # atomics (deterministic by construction), for DRAM-bound 64-row tiles
    "wgmma_dq_pass": {64: (1, DQ_NONE), 128: (1, DQ_NONE)},
    # the warp-specialized kernel on 128-row tiles whatever the plan
    "wgmma_ws": {64: (1, DQ_BULK), 128: (WS_SPLIT, DQ_BULK)},
}
IMPLS = ("mma", *WGMMA_VARIANTS)
#: Streamed Q rows per step of the wgmma kernel (PB_Q_ROWS in paged_bwd.cu).
WGMMA_Q_ROWS = 64

# Mirrors of the kernel's compile-time configuration (kernels_cu/bsa_bwd.cu).
HEAD_DIMS = (64, 128)
#: Owned K/V rows per CTA (the plan's tile M): one warp per 16 rows (one owned page per warp).
OWNED_ROWS = (64, 128)
#: (Q rows streamed per step, Q rows computed at once, CTAs per SM targeted) per (head_dim, owned
#: rows): the kernel's BSA_BWD_TILES_HD<d>_BK<rows> macros.
TILES = {(64, 64): (64, 64, 2), (64, 128): (64, 64, 1), (128, 64): (32, 32, 2), (128, 128): (64, 64, 1)}
#: Streamed tile widths a plan may carry (the kernel streams TILES rows whatever N is).
STREAM_TILE_N = (64, 128, 256)
TILE_SHAPES = tuple((m, n) for m in OWNED_ROWS for n in STREAM_TILE_N)
WARP_ROWS = 16
MAX_GRID_Y = 65535
ELEMENTWISE_THREADS = 256


def kernel_name(head_dim: int, owned_rows: int) -> str:
    q_rows, sub_rows, min_blocks = TILES[head_dim, owned_rows]
    return f"bsa_bwd_kernel<{head_dim}, {owned_rows}, {q_rows}, {sub_rows}, {min_blocks}>"


def preprocess_name(head_dim: int) -> str:
    return f"bsa_bwd_preprocess<{head_dim}>"


POSTPROCESS_NAME = "bsa_bwd_postprocess"

NAME_EXPRESSIONS = (
    tuple(kernel_name(d, m) for d in HEAD_DIMS for m in OWNED_ROWS)
    + tuple(preprocess_name(d) for d in HEAD_DIMS)
    + (POSTPROCESS_NAME,)
)


def wgmma_variant(impl: str, owned_rows: int, deterministic: bool = False) -> tuple[int, int]:
    """(Q split, dQ mode) of implementation ``impl`` on ``owned_rows``-row tiles; ``deterministic``
    replaces the dQ mode by the fixed-point one."""
    split, mode = WGMMA_VARIANTS[impl][owned_rows]
    if deterministic and split == WS_SPLIT:  # the fixed-point dQ runs on the synchronous kernel
        return 1, DQ_FIXED
    return split, DQ_FIXED if deterministic and mode != DQ_NONE else mode


def resolve_impl(impl: str | None, plan: TilePlan | None = None, dq_plan_available: bool = True) -> str:
    """The implementation that runs: ``impl`` (``None``: :func:`default_impl`), where ``"wgmma"`` on a
    K/V-owned ``plan`` whose non-empty routes are all 64-row tiles becomes ``"wgmma_dq_pass"`` when the
    Q-owned plan can be had (a graph, or ``dq_plan`` given): those tiles are DRAM-bound and the dQ pass
    measured 25% faster on them (VSA 720p backward 168 -> 127 ms)."""
    impl = default_impl() if impl is None else impl
    if impl == "wgmma" and plan is not None and dq_plan_available:
        rows = {int(plan.routes[r][0]) for r, (a, b) in enumerate(plan.route_ranges()) if b > a}
        if rows == {64}:
            return "wgmma_dq_pass"
    return impl


def uses_dq_pass(impl: str | None, plan: TilePlan | None = None, dq_plan_available: bool = True) -> bool:
    """True when ``impl`` (resolved by :func:`resolve_impl` on ``plan``) computes dQ in the separate
    Q-owned pass (it then needs the owner-"q" plan)."""
    impl = resolve_impl(impl, plan, dq_plan_available)
    return impl in WGMMA_VARIANTS and all(mode == DQ_NONE for _, mode in WGMMA_VARIANTS[impl].values())


WS_THREADS = 384


def ws_kernel_name(head_dim: int, pair: bool = False) -> str:
    """paged_bwd_ws_kernel's instantiation; ``pair``: the one that reads the plan's ``stream_vis``."""
    return f"paged_bwd_ws_kernel<{head_dim}, {'true' if pair else 'false'}>"


def ws_smem_bytes(head_dim: int, pair: bool = False, defines: tuple[str, ...] | None = None) -> int:
    """paged_bwd_ws_kernel (its Config): alignment slack, K and V (128 owned rows), 2-stage Q and dO (64 rows),
    two dSᵀ buffers (bf16), the fp32 dQ staging of one step (contiguous pages), LSE₂ and Δ per stage
    (``pair``: two copies each, and the seen-row ballot words [2 stages][4 warps]), six mbarriers (+2 spare).
    ``PAGED_BWD_WG_DQ`` in ``defines`` (default :data:`DEFINES`): one dSᵀ buffer, a dQ staging per consumer
    warpgroup (one with ``PAGED_BWD_WG_SUM``), two copies of LSE₂ and Δ."""
    defines = DEFINES if defines is None else defines
    wg_dq = "PAGED_BWD_WG_DQ" in defines
    stagings = 2 if wg_dq and "PAGED_BWD_WG_SUM" not in defines else 1
    return (
        1024
        + 2 * (2 * 128 * head_dim + 4 * 64 * head_dim + (1 if wg_dq else 2) * 128 * 64)
        + stagings * 64 * head_dim * 4
        + 2 * 2 * (2 if pair or wg_dq else 1) * 64 * 4
        + (2 * 4 * 4 if pair else 0)
        + 64
    )


def dq_kernel_name(head_dim: int, owned_rows: int) -> str:
    return f"paged_bwd_dq_kernel<{head_dim}, {owned_rows}>"


def dq_threads_per_cta(owned_rows: int) -> int:
    """One consumer warpgroup per 64 owned Q rows."""
    return owned_rows // 64 * 128


def dq_smem_bytes(head_dim: int, owned_rows: int) -> int:
    """Alignment slack, Q and dO (owned), double-buffered 64-row K and V (bf16), K page masks (x2)."""
    return 1024 + 2 * (2 * owned_rows * head_dim + 4 * 64 * head_dim) + 2 * 4 * 4


def wgmma_kernel_name(head_dim: int, owned_rows: int, split: int = 1, dq_mode: int = DQ_ATOMIC) -> str:
    return f"paged_bwd_kernel<{head_dim}, {owned_rows}, {split}, {dq_mode}>"


ABSMAX_NAME = "bwd_absmax_bf16"
FIXED_POSTPROCESS_NAME = "bwd_fixed_postprocess"
#: Every instantiation of paged_bwd.cu: (head dim, owned rows, Q split, dQ mode), and its helpers.
WGMMA_SHAPES = tuple(
    (d, m, q, mode)
    for mode in (DQ_ATOMIC, DQ_BULK, DQ_FIXED, DQ_NONE)
    for d in HEAD_DIMS
    for m in OWNED_ROWS
    for q in (1, 2)
    if q == 1 or (m == 64 and mode != DQ_NONE)
)
DQ_SHAPES = tuple((d, m) for d in HEAD_DIMS for m in OWNED_ROWS)
WGMMA_NAME_EXPRESSIONS = (
    tuple(wgmma_kernel_name(*shape) for shape in WGMMA_SHAPES)
    + tuple(dq_kernel_name(*shape) for shape in DQ_SHAPES)
    + tuple(ws_kernel_name(d, pair) for pair in (False, True) for d in HEAD_DIMS)
    + (ABSMAX_NAME, FIXED_POSTPROCESS_NAME)
)
#: Other sources this module launches (for the CPU compile check).
KERNEL_SOURCES = {WGMMA_SOURCE: WGMMA_NAME_EXPRESSIONS}
#: The token-order build of paged_bwd.cu (:func:`torch_token_plan_backward`): q, k, v, dO, dK, dV in token
#: order, the main kernels' pages gathered and stored by the layouts' slot -> token maps (their extra
#: parameters :data:`TOKEN_PARAMS`), and its own preprocess / postprocess.
TOKEN_DEFINE = "PAGED_BWD_TOKENS"
TOKEN_PARAMS = ("q_map", "k_map", "q_tokens", "k_tokens", "tok_heads", "maps_per_row")
TOKEN_NAME_EXPRESSIONS = WGMMA_NAME_EXPRESSIONS + tuple(
    f"tokens_bwd_{kind}<{d}>" for kind in ("preprocess", "postprocess") for d in HEAD_DIMS
)


def extra_builds() -> tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...]:
    """The token-order build, for :mod:`.warmup`: ``((source, name expressions, defines),)``."""
    return ((WGMMA_SOURCE, TOKEN_NAME_EXPRESSIONS, (*DEFINES, TOKEN_DEFINE)),)


def kernel_defines(source: str) -> tuple[str, ...]:
    """The macros ``source`` is compiled with now (:data:`DEFINES`): what :mod:`.warmup` compiles."""
    return DEFINES if source == WGMMA_SOURCE else ()


def wgmma_threads_per_cta(owned_rows: int, split: int = 1) -> int:
    """One consumer warpgroup per 64 owned K/V rows and Q slice."""
    return owned_rows // 64 * split * 128


def wgmma_smem_bytes(head_dim: int, owned_rows: int, split: int = 1) -> int:
    """Alignment slack, K and V (owned), double-buffered Q and dO, one dSᵀ per Q slice (bf16); LSE, Δ,
    slot (x2)."""
    q = WGMMA_Q_ROWS * split
    return (
        1024
        + 2 * (2 * owned_rows * head_dim + 4 * q * head_dim + split * owned_rows * WGMMA_Q_ROWS)
        + 3 * 2 * q * 4
    )


def default_impl() -> str:
    """The main kernel used when ``impl`` is not given: ``SPARSEATTN_BWD_IMPL`` or ``"wgmma"``."""
    impl = os.environ.get("SPARSEATTN_BWD_IMPL", "wgmma") or "wgmma"
    if impl not in IMPLS:
        raise KernelValueError(f"SPARSEATTN_BWD_IMPL must be one of {IMPLS}, got {impl!r}")
    return impl


def threads_per_cta(owned_rows: int) -> int:
    """One warp per 16 owned K/V rows."""
    return owned_rows // WARP_ROWS * 32


def smem_bytes(head_dim: int, owned_rows: int) -> int:
    """Dynamic shared memory: K and V (owned), double-buffered Q, dO and dSᵀ (bf16); LSE, Δ, slot."""
    q_rows = TILES[head_dim, owned_rows][0]
    bf16_elems = 2 * owned_rows * head_dim + 4 * q_rows * head_dim + 2 * owned_rows * q_rows
    return bf16_elems * 2 + 2 * q_rows * 3 * 4


# ---- plan and device-array caches ------------------------------------------------------------

_PLANS = PlanCache(owner="kv", tile_shapes=TILE_SHAPES)
_DEVICE_PLANS: weakref.WeakKeyDictionary[TilePlan, dict] = weakref.WeakKeyDictionary()
plan_for = _PLANS.plan_for
check_backward_plan = _PLANS.checked
#: Owner-"q" plans of the Q-owned dQ pass (``impl="wgmma_dq_pass"``).
_DQ_PLANS = PlanCache(owner="q", tile_shapes=TILE_SHAPES)


def uncovered_k_pages(plan: TilePlan, k_pages: int) -> tuple[np.ndarray, np.ndarray]:
    """(head, page) int64 arrays of the owner-side pages no work item owns (blocks without valid rows;
    K pages of a K/V-owned plan, Q pages of a Q-owned one): the kernel never writes them, so the wrapper
    zeroes their gradient rows."""
    own = plan.own_pages.astype(np.int64)
    heads = np.repeat(plan.work_head.astype(np.int64), own.shape[1])
    pages = own.ravel()
    keep = pages >= 0
    covered = np.zeros((plan.heads, k_pages), dtype=bool)
    covered[heads[keep], pages[keep]] = True
    return np.nonzero(~covered)


def uncovered_rows_valid(plan: TilePlan, pages: np.ndarray) -> bool:
    """Whether any of the owner-side ``pages`` (:func:`uncovered_k_pages`' second array) holds a valid row."""
    return pages_hold_rows(plan.own_page_mask, pages)


#: The name a recipe binds a device planner's arena to: a device plan's arrays inside it are given as
#: ``"arena+OFFSET"`` (:func:`_bound_name`), so that one recipe serves every call whose plans lie in an arena
#: of the same shape (the planner makes a new one per call).
ARENA = "arena"
#: Whether device plans share their recipes that way (the default; ``SPARSEATTN_SHARED_DEVICE_RECIPES=0``
#: turns it off for an A/B run, and each call of a device plan then packs its own recipe).
SHARED_DEVICE_RECIPES = os.environ.get("SPARSEATTN_SHARED_DEVICE_RECIPES", "1") == "1"


def _arena_base(plan: DeviceOwnedPlan):
    """The device pointer of ``plan``'s arena, or None (an arena without memory of its own)."""
    return getattr(plan.arena, "base", None)


def _arena_relative(arrays: dict, plan: DeviceOwnedPlan) -> dict:
    """``arrays`` with every pointer into ``plan``'s arena as ``"arena+OFFSET"`` (the planner's layout tables
    and page lists, outside the arena, stay pointers)."""

    def relative(p):
        offset = plan.arena.offset_of(p) if isinstance(p, (int, np.integer)) else None
        return p if offset is None else f"{ARENA}+{offset}"

    return {name: relative(p) for name, p in arrays.items()}


def _recipe_cache(plan, arrays: dict, dq_plan):
    """Where :func:`backward_recipe` keeps a plan's recipes: a host plan's arrays (with a host dQ plan or
    none), a device plan's arena's shared ``launches`` (with ``SHARED_DEVICE_RECIPES``; its dQ plan, if any,
    in the same allocation), else nowhere (None: the recipe holds raw pointers of this call's memory)."""
    if not isinstance(plan, DeviceOwnedPlan):
        return None if isinstance(dq_plan, DeviceOwnedPlan) else arrays
    if not SHARED_DEVICE_RECIPES or _arena_base(plan) is None:
        return None
    if dq_plan is not None and (
        not isinstance(dq_plan, DeviceOwnedPlan) or _arena_base(dq_plan) != _arena_base(plan)
    ):  # a dQ plan of another allocation: its pointers are this call's alone
        return None
    return getattr(plan.arena, "launches", None)


def arena_pointers(plan) -> dict:
    """The pointer a recipe of ``plan`` binds besides the tensors: ``{ARENA: base}`` for a device plan."""
    shared = SHARED_DEVICE_RECIPES and isinstance(plan, DeviceOwnedPlan)
    base = _arena_base(plan) if shared else None
    return {} if base is None else {ARENA: int(base)}


def _device_plan(
    plan: TilePlan | DeviceOwnedPlan, q_pages: int, k_pages: int, heads: int, device: int
) -> dict:
    """Validated plan arrays on the device (validation and upload happen once per plan and sizes); the
    plan is K/V-owned (the main kernels) or Q-owned (the dQ pass). A device planner's plan is on the device
    already (built valid by construction: its heads are checked here)."""
    import cupy

    if isinstance(plan, DeviceOwnedPlan):
        if plan.heads != heads:
            raise KernelValueError(
                f"the device plan holds {plan.heads} heads, the tensors {heads} (batch · heads)"
            )
        return {**plan.arrays, "pair": plan.pair, "first_pair_item": None}

    per_plan = _DEVICE_PLANS.setdefault(plan, {})
    key = (q_pages, k_pages, heads, device)
    if key not in per_plan:
        (_DQ_PLANS if plan.owner == "q" else _PLANS).checked(plan, q_pages, k_pages, heads)
        with cupy.cuda.Device(device):
            arrays = {name: cupy.asarray(arr) for name, arr in plan.device_arrays().items()}
            uh, up = uncovered_k_pages(plan, q_pages if plan.owner == "q" else k_pages)
            arrays["uncovered"] = (cupy.asarray(uh), cupy.asarray(up)) if uh.size else None
            arrays["uncovered valid"] = uncovered_rows_valid(plan, up)
            # pair items: some entries hidden from one half (only the pair kernel may run them); the kernel
            # reads int32 [entries][3]: the page, then the page or -1 as each owned half sees it
            arrays["pair"] = plan.stream_vis is not None and bool(np.any(plan.stream_vis != 3))
            arrays["first_pair_item"] = None
            if arrays["pair"]:
                pages, vis = plan.stream_pages.astype(np.int32), plan.stream_vis.astype(np.int64)
                halves = [np.where(vis & bit, pages, -1) for bit in (1, 2)]
                arrays["pair_pages"] = cupy.asarray(np.stack([pages, *halves], axis=1).astype(np.int32))
                arrays["first_pair_item"] = first_pair_items(plan)
        per_plan[key] = arrays
    return per_plan[key]


def _launch_ranges(plan: TilePlan, arrays: dict):
    """(route, start, stop, pair) per launch: one per non-empty route; a route whose items include pair
    items (entries hidden from one half) is split where the first such item starts, so that the items
    before it run on the plain kernel and only the rest on the pair kernel."""
    first_pair = arrays.get("first_pair_item")
    for route, (start, stop) in enumerate(plan.route_ranges()):
        if stop <= start:
            continue
        cut = stop if first_pair is None else min(max(int(first_pair[route]), start), stop)
        if cut > start:
            yield route, start, cut, False
        if cut < stop:
            yield route, cut, stop, True


def _ordered_launches(plan: TilePlan | DeviceOwnedPlan, arrays: dict) -> list:
    """``(route, start, stop, pair)`` of every launch, the one streaming the most pages last (a device
    plan's streams are on the device: its launches are ordered by owned rows instead)."""
    if isinstance(plan, DeviceOwnedPlan):
        ranges = [r for r in plan.launches if r[2] > r[1]]
        return sorted(ranges, key=lambda r: (r[2] - r[1]) * plan.routes[r[0]][0])
    return sorted(
        _launch_ranges(plan, arrays),
        key=lambda r: int(plan.stream_indptr[r[2]]) - int(plan.stream_indptr[r[1]]),
    )


# ---- one backward call as a list of packed launches --------------------------------------------------

#: The tensors of a backward call, in the order :meth:`BackwardRecipe.run` takes their pointers.
TENSORS = ("q", "k", "v", "o", "lse", "do", "dq", "dk", "dv", "delta", "dq_accum", "absmax")


def _bound_name(name: str) -> tuple[str, int]:
    """``"absmax+4"`` -> ``("absmax", 4)``: a tensor and a byte offset into it."""
    tensor, _, offset = name.partition("+")
    return tensor, int(offset or 0)


class BackwardRecipe:
    """Every launch of one backward call, packed once per (plan, sizes, scale, implementation): ``steps``
    in order, each ``("launch", packed, names)`` (the tensors bound to the launch's pointer arguments),
    ``("memset", name, bytes)`` or ``("side", [launch steps])`` (launches side by side, the last on the
    caller's stream). ``temporaries``: ``name -> (shape, dtype)`` the caller allocates."""

    def __init__(self):
        self.steps: list = []
        self.temporaries: dict = {}
        self.zeroed: tuple = ()  # outputs the caller allocates as zeros (the token-order recipe)
        self.dq_plan = None  # a cached recipe's host dQ plan, kept alive: the cache key holds its id()
        self._events = None

    def add(self, fn, grid, block, args: tuple, smem: int = 0):
        """A launch step; tensor arguments are given by name (strings) and bound per call."""
        bound = tuple(i for i, a in enumerate(args) if isinstance(a, str))
        names = tuple(_bound_name(args[i]) for i in bound)
        values = tuple(np.uint64(0) if isinstance(a, str) else a for a in args)
        launch.prepare(fn, smem)
        return ("launch", launch.PackedLaunch(fn, grid, block, values, smem, bound), names)

    def run(self, stream: int, device: int, pointers: dict) -> None:
        """Enqueue the call on ``stream``; ``pointers``: name -> device pointer (int)."""
        import cupy

        rt = cupy.cuda.runtime
        for step in self.steps:
            kind = step[0]
            if kind == "launch":
                step[1](stream, *(pointers[n] + off for n, off in step[2]))
            elif kind == "memset":
                rt.memsetAsync(pointers[step[1]] + step[3], 0, step[2], stream)
            elif not step[1]:
                continue
            elif len(step[1]) == 1:
                _, packed, names = step[1][0]
                packed(stream, *(pointers[n] + off for n, off in names))
            else:
                side = launch.side_stream(device).ptr
                if self._events is None:
                    flags = rt.eventDisableTiming
                    self._events = (rt.eventCreateWithFlags(flags), rt.eventCreateWithFlags(flags))
                forked, joined = self._events
                rt.eventRecord(forked, stream)
                rt.streamWaitEvent(side, forked, 0)
                for _, packed, names in step[1][:-1]:
                    packed(side, *(pointers[n] + off for n, off in names))
                _, packed, names = step[1][-1]
                packed(stream, *(pointers[n] + off for n, off in names))
                rt.eventRecord(joined, side)
                rt.streamWaitEvent(stream, joined, 0)


def _route_steps(
    recipe, plan, arrays: dict, kernel_of, tensors: tuple, sizes, scale, extra=(), tail=()
) -> tuple:
    """One launch per non-empty route of ``plan`` (two where pair items start inside a route), to run side
    by side, the one streaming the most pages last: ``kernel_of(owned_rows, pair)`` gives ``(fn, smem,
    threads)`` (and optionally its own ``extra``); arguments: ``tensors`` (names), the plan's device arrays,
    the launch's first item, heads, slots, scales, ``extra``, then ``tail`` (the token-order build's
    parameters). ``sizes``: (batch, heads, q_slots, k_slots)."""
    b, h, sq, sk = sizes
    own_stride = np.int32(plan.own_stride if isinstance(plan, DeviceOwnedPlan) else plan.own_pages.shape[1])
    scale_log2 = np.float32(scale * math.log2(math.e))
    steps = []
    for route, start, stop, pair in _ordered_launches(plan, arrays):
        fn, smem, threads, *own_extra = kernel_of(plan.routes[route][0], pair)
        args = (
            *tensors,
            arrays["work_head"],
            arrays["own_pages"],
            own_stride,
            arrays["stream_indptr"],
            arrays["stream_pages"],
            arrays["own_page_mask"],
            arrays["stream_page_mask"],
            np.int32(start),
            np.int32(h),
            np.int32(sq),
            np.int32(sk),
            np.float32(scale),
            scale_log2,
            *(own_extra[0] if own_extra else extra),
            *tail,
        )
        steps.append(recipe.add(fn, (stop - start, b), (threads,), args, smem))
    return ("side", steps)


def _uncovered_steps(recipe, names, arrays: dict, plan, sizes) -> list:
    """Steps zeroing the gradient rows of the owner pages no work item owns (``names``: dK and dV of a
    K/V-owned plan, dQ of the Q-owned one); ``sizes``: (batch, heads, owner pages, d)."""
    from . import planner

    b, h, pages, d = sizes
    if not _may_leave_pages(plan, arrays):
        return []
    if isinstance(plan, DeviceOwnedPlan):
        heads, head_elems, list_, n = b * h, pages * PAGE_ROWS * d, plan.uncovered, plan.uncovered_count
    else:
        if "uncovered flat" not in arrays:  # (head, page) pairs as pages of one head of h * pages pages
            import cupy

            heads_idx, pages_idx = arrays["uncovered"]
            arrays["uncovered flat"] = (heads_idx * pages + pages_idx).astype(cupy.int32)
        list_ = arrays["uncovered flat"]
        heads, head_elems, n = b, h * pages * PAGE_ROWS * d, int(list_.size)
    total = heads * n * (PAGE_ROWS * d // 8)
    if total == 0:
        return []
    fn = planner._fn("plan_zero_pages")
    grid = (planner._blocks(total),)
    return [
        recipe.add(
            fn,
            grid,
            (planner.THREADS,),
            (name, np.int32(heads), np.int64(head_elems), np.int32(PAGE_ROWS * d), list_, np.int32(n)),
        )
        for name in names
    ]


def _may_leave_pages(plan, arrays: dict) -> bool:
    """Whether some owner page of a plan (K/V- or Q-owned) may have no item (:func:`_uncovered_steps`
    zeroes their gradient rows)."""
    if isinstance(plan, DeviceOwnedPlan):
        return plan.uncovered is not None and int(plan.uncovered_count) > 0
    return arrays["uncovered"] is not None


def _may_leave_valid_rows(plan, arrays: dict) -> bool:
    """Whether an owner page no item owns holds a valid row (a page :func:`_may_leave_pages` counts that is
    not all padding): the token-order build has no padding rows to clear, only tokens."""
    valid = plan.uncovered_valid if isinstance(plan, DeviceOwnedPlan) else arrays["uncovered valid"]
    return valid and _may_leave_pages(plan, arrays)


def backward_recipe(
    plan, arrays, impl: str, deterministic: bool, dq_plan, sizes, scale, device: int, tokens=None
):
    """The :class:`BackwardRecipe` of a checked plan (``arrays``: its device arrays) for tensors of ``sizes``
    (batch, heads, q_slots, k_slots, d); cached with a host plan's arrays, or for every device plan of one
    arena shape in the arena's ``launches`` (:func:`_recipe_cache`). ``tokens``: the token-order
    build's ``(q_tokens, k_tokens, tok_heads, maps_per_row)`` (the maps are the tensors ``q_map`` and
    ``k_map``; no dQ pass, no fixed point, no ``mma``): its recipe leaves the gradient rows of pages no item
    owns unwritten and names them in ``zeroed``, which the caller allocates as zeros."""
    b, h, sq, sk, d = sizes
    dq_key = "device" if isinstance(dq_plan, DeviceOwnedPlan) else id(dq_plan)
    key = ("recipe", impl, bool(deterministic), dq_key, sizes, scale, tokens, device, DEFINES)
    cache = _recipe_cache(plan, arrays, dq_plan)
    cached_recipe = None if cache is None else cache.get(key)
    if cached_recipe is not None:
        return cached_recipe
    # a recipe shared by the arena's shape names the arena's buffers by offset (bound per run)
    shared = cache is not None and isinstance(plan, DeviceOwnedPlan)
    if shared:
        arrays = _arena_relative(arrays, plan)
    q_pages, k_pages = sq // PAGE_ROWS, sk // PAGE_ROWS
    dq_pass = uses_dq_pass(impl)
    fixed = deterministic and not dq_pass
    if tokens is not None and (dq_pass or fixed or impl == "mma"):
        raise KernelValueError(
            f"the token-order backward runs no dQ pass, fixed-point dQ or mma kernel (impl={impl!r}, "
            f"deterministic={deterministic})"
        )
    token_tail = token_scalars = ()
    if tokens is not None:
        token_tail = ("q_map", "k_map", *(np.int32(x) for x in tokens))
        # the preprocess / postprocess: q_slots, q_map, q_tokens, tok_heads, maps_per_row
        token_scalars = (np.int32(sq), "q_map", *(np.int32(x) for x in (tokens[0], tokens[2], tokens[3])))
    r = BackwardRecipe()
    r.temporaries["delta"] = ((b, h, sq), np.float32)
    if not dq_pass:
        r.temporaries["dq_accum"] = ((b, h, sq, d), np.int64 if fixed else np.float32)
        r.steps.append(("memset", "dq_accum", b * h * sq * d * (8 if fixed else 4), 0))
    if fixed:
        r.temporaries["absmax"] = ((3,), np.uint32)
        r.steps.append(("memset", "absmax", 12, 0))
        fn = launch.function(WGMMA_SOURCE, ABSMAX_NAME, WGMMA_NAME_EXPRESSIONS, DEFINES)
        blocks = 4 * launch.sm_count(device)
        for i, (name, slots, mask) in enumerate(
            (("do", sq, "stream_page_mask"), ("v", sk, "own_page_mask"), ("k", sk, "own_page_mask"))
        ):
            n8 = b * h * slots * d // 8
            step = r.add(
                fn,
                (max(1, min(blocks, -(-n8 // ELEMENTWISE_THREADS))),),
                (ELEMENTWISE_THREADS,),
                (name, np.int64(n8), np.int32(d), np.int32(slots), arrays[mask], f"absmax+{4 * i}"),
            )
            r.steps.append(step)

    function = (
        (lambda name: launch.function(WGMMA_SOURCE, name, WGMMA_NAME_EXPRESSIONS, DEFINES))
        if tokens is None
        else (
            lambda name: launch.function(WGMMA_SOURCE, name, TOKEN_NAME_EXPRESSIONS, (*DEFINES, TOKEN_DEFINE))
        )
    )
    rows = b * h * sq
    lanes = rows * (d // 8)
    if tokens is None:
        pre = launch.function(SOURCE, preprocess_name(d), NAME_EXPRESSIONS)
    else:
        pre = function(f"tokens_bwd_preprocess<{d}>")
    pre_args = ("o", "do", "delta", np.int64(rows), *token_scalars)
    r.steps.append(r.add(pre, (-(-lanes // ELEMENTWISE_THREADS),), (ELEMENTWISE_THREADS,), pre_args))

    def main_kernel(owned_rows, pair=False):
        if impl == "mma":
            fn = launch.function(SOURCE, kernel_name(d, owned_rows), NAME_EXPRESSIONS)
            return fn, smem_bytes(d, owned_rows), threads_per_cta(owned_rows)
        split, dq_mode = wgmma_variant(impl, owned_rows, deterministic)
        if split == WS_SPLIT:
            return (
                function(ws_kernel_name(d, pair)),
                ws_smem_bytes(d, pair),
                WS_THREADS,
                (arrays["pair_pages"],) if pair else extra,
            )
        fn = function(wgmma_kernel_name(d, owned_rows, split, dq_mode))
        return fn, wgmma_smem_bytes(d, owned_rows, split), wgmma_threads_per_cta(owned_rows, split)

    extra = () if impl == "mma" else ("absmax",) if fixed else (np.uint64(0),)
    dq_accum = "dq_accum" if not dq_pass else np.uint64(0)
    tensors = ("q", "k", "v", "do", "lse", "delta", dq_accum, "dk", "dv")
    r.steps.append(
        _route_steps(r, plan, arrays, main_kernel, tensors, (b, h, sq, sk), scale, extra, token_tail)
    )

    if dq_pass:
        dq_arrays = _device_plan(dq_plan, q_pages, k_pages, h, device)
        if shared:  # the same allocation as plan's (_recipe_cache)
            dq_arrays = _arena_relative(dq_arrays, dq_plan)

        def dq_kernel(owned_rows, pair=False):
            fn = launch.function(WGMMA_SOURCE, dq_kernel_name(d, owned_rows), WGMMA_NAME_EXPRESSIONS, DEFINES)
            return fn, dq_smem_bytes(d, owned_rows), dq_threads_per_cta(owned_rows)

        dq_tensors = ("q", "k", "v", "do", "lse", "delta", "dq")
        r.steps.append(_route_steps(r, dq_plan, dq_arrays, dq_kernel, dq_tensors, (b, h, sq, sk), scale))
        r.steps.extend(_uncovered_steps(r, ("dq",), dq_arrays, dq_plan, (b, h, q_pages, d)))
    elif fixed:
        post = launch.function(WGMMA_SOURCE, FIXED_POSTPROCESS_NAME, WGMMA_NAME_EXPRESSIONS, DEFINES)
        n2 = b * h * sq * d // 2
        args = ("dq_accum", "dq", np.float32(scale), "absmax", np.int32(d), np.int64(n2))
        r.steps.append(r.add(post, (-(-n2 // ELEMENTWISE_THREADS),), (ELEMENTWISE_THREADS,), args))
    else:
        if tokens is None:
            post = launch.function(SOURCE, POSTPROCESS_NAME, NAME_EXPRESSIONS)
        else:
            post = function(f"tokens_bwd_postprocess<{d}>")
        n4 = b * h * sq * d // 4
        args = ("dq_accum", "dq", np.float32(scale), np.int64(n4), *token_scalars)
        r.steps.append(r.add(post, (-(-n4 // ELEMENTWISE_THREADS),), (ELEMENTWISE_THREADS,), args))
    if tokens is None:
        r.steps.extend(_uncovered_steps(r, ("dk", "dv"), arrays, plan, (b, h, k_pages, d)))
    elif _may_leave_valid_rows(plan, arrays):
        r.zeroed = ("dk", "dv")  # valid rows of pages no item owns: their tokens' rows start as zeros
    if cache is not None:  # never a recipe with raw pointers of one call's memory (their ids get reused)
        r.dq_plan = None if isinstance(dq_plan, DeviceOwnedPlan) else dq_plan
        cache[key] = r
    return r


def check_inputs(q, k, v, o, lse, do, graph_or_plan, scale=None, out=None):
    """Validate every argument of :func:`plan_backward` (no launch).

    Returns ``(plan, scale, out_or_None, (q_pages, k_pages, device))``; the plan is checked against the
    tensor sizes too (page ids, heads, owner ``"kv"``, tile shapes).
    """
    check_tensor("q", q, dtype=BF16_DTYPE_NAMES, ndim=4)
    b, h, sq, d = (int(x) for x in q.shape)
    check_head_dim("q", d, HEAD_DIMS)
    device = int(q.device.id)
    dtype = (str(q.dtype),)
    check_tensor("k", k, dtype=dtype, shape=(b, h, None, d), device=device)
    sk = int(k.shape[2])
    check_tensor("v", v, dtype=dtype, shape=(b, h, sk, d), device=device)
    check_tensor("o", o, dtype=dtype, shape=(b, h, sq, d), device=device)
    check_tensor("do", do, dtype=dtype, shape=(b, h, sq, d), device=device)
    check_tensor("lse", lse, dtype="float32", shape=(b, h, sq), device=device)
    if b > MAX_GRID_Y:
        raise KernelValueError(f"q has batch {b}; the kernel grid allows at most {MAX_GRID_Y}")
    q_pages = pages_of("q", sq)
    k_pages = pages_of("k", sk)
    if isinstance(graph_or_plan, DeviceOwnedPlan):  # a device planner's: valid by construction
        plan = graph_or_plan
        if plan.owner != "kv" or plan.heads != h:
            raise KernelValueError(
                f"graph_or_plan is a device plan of owner {plan.owner!r} for {plan.heads} heads; the backward "
                f"needs owner 'kv' for the tensors' {h} (batch · heads)"
            )
    else:
        plan = _PLANS.resolve(graph_or_plan, h, sq, sk, q_pages, k_pages)
    scale = check_scale(scale, d)
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 3:
            raise KernelTypeError("out must be a tuple (dq, dk, dv) of preallocated cupy arrays")
        check_tensor("out[0] (dq)", out[0], dtype=dtype, shape=(b, h, sq, d), device=device)
        check_tensor("out[1] (dk)", out[1], dtype=dtype, shape=(b, h, sk, d), device=device)
        check_tensor("out[2] (dv)", out[2], dtype=dtype, shape=(b, h, sk, d), device=device)
        out = tuple(out)
    return plan, scale, out, (q_pages, k_pages, device)


def bsa_mma_backward(q, k, v, o, lse, do, graph_or_plan, scale=None, out=None):
    """The ``mma.sync`` BSA baseline backward: :func:`plan_backward` with ``impl="mma"`` (a graph runs
    its K/V-owned BSA plan). Returns ``(dq, dk, dv)``."""
    return plan_backward(q, k, v, o, lse, do, graph_or_plan, scale=scale, out=out, impl="mma")


def plan_backward(
    q, k, v, o, lse, do, graph_or_plan, scale=None, out=None, impl=None, deterministic=False, dq_plan=None
):
    """Gradients of block-sparse attention on the GPU for the loss ``Σ do · o``, on one K/V-owned plan.

    Args:
        q: bf16 ``[batch, heads, q_slots, d]`` CuPy array (``uint16`` bf16 bits or a bfloat16 dtype),
            C-contiguous; ``d`` in ``HEAD_DIMS``; ``q_slots`` a multiple of 16.
        k, v: same dtype, ``[batch, heads, k_slots, d]``.
        o: the forward output, like ``q``; ``lse``: float32 ``[batch, heads, q_slots]`` (natural log,
            ``-inf`` rows contribute nothing).
        do: the output gradient, like ``q``.
        graph_or_plan: a :class:`SparseGraph` (runs ``bsa_plan(graph, owner="kv")``) or an owner-``"kv"``
            :class:`TilePlan` whose owned tile height is 64 or 128.
        scale: softmax scale, default ``1/sqrt(d)``.
        out: optional ``(dq, dk, dv)`` buffers to write into.
        impl: main kernel, one of :data:`IMPLS` (default: :func:`default_impl`).
        deterministic: dQ bit-identical from run to run whatever order the CTAs run in; wgmma
            implementations only. The Q-owned dQ pass is by construction; the other implementations then
            add dQ in 64-bit fixed point (integer atomics), whose unit comes from the largest valid
            elements of dO, V and K, so ``lse`` must be the forward's.
        dq_plan: the owner-``"q"`` :class:`TilePlan` of the same graph for the Q-owned dQ pass
            (``impl="wgmma"`` or ``"wgmma_dq_pass"``); built from ``graph_or_plan`` when that is a graph.

    Returns:
        ``(dq, dk, dv)`` like ``q``/``k``/``v`` (bf16). Every row of dQ is written (0 where no pair
        contributes); every row of every owned K page is written (0 for padding rows and for K blocks
        no Q block selected); rows of K blocks without any valid row are zeroed by the wrapper.
    """
    impl = default_impl() if impl is None else impl
    if impl not in IMPLS:
        raise KernelValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if not isinstance(deterministic, (bool, np.bool_)):
        raise KernelTypeError(f"deterministic must be True or False, got {deterministic!r}")
    if deterministic and impl == "mma":
        raise KernelValueError("deterministic=True needs a wgmma implementation (impl='mma' adds dQ in fp32)")
    if dq_plan is not None and not uses_dq_pass(impl) and impl != "wgmma":
        raise KernelValueError(
            f"dq_plan is only used by the Q-owned dQ pass (impl='wgmma_dq_pass' or 'wgmma'), not {impl!r}"
        )
    plans = (TilePlan, DeviceOwnedPlan)
    if uses_dq_pass(impl) and dq_plan is None and isinstance(graph_or_plan, plans):
        raise KernelValueError(
            f"impl={impl!r} computes dQ over the graph's Q-owned plan: pass the graph, or dq_plan"
        )
    if dq_plan is not None and not isinstance(dq_plan, plans):
        raise KernelTypeError(f"dq_plan must be a TilePlan, got {type(dq_plan).__name__}")
    plan, scale, out, (_, _, device) = check_inputs(q, k, v, o, lse, do, graph_or_plan, scale, out)
    if impl != "mma" and max(int(q.shape[2]), int(k.shape[2])) * int(q.shape[3]) >= 2**31:
        raise KernelValueError(
            f"q/k have {max(int(q.shape[2]), int(k.shape[2]))} slots of head_dim {int(q.shape[3])}: past the "
            "wgmma kernel's 32-bit page offsets (slots · d < 2^31); use impl='mma'"
        )
    import cupy

    b, h, sq, d = (int(x) for x in q.shape)
    sk = int(k.shape[2])
    graph = None if isinstance(graph_or_plan, plans) else graph_or_plan
    recipe = _recipe_of(plan, dq_plan, graph, impl, deterministic, (b, h, sq, sk, d), scale, device)
    with cupy.cuda.Device(device):
        if out is None:
            dq = cupy.empty(q.shape, q.dtype)
            dk, dv = cupy.empty(k.shape, k.dtype), cupy.empty(k.shape, k.dtype)
        else:
            dq, dk, dv = out
        temps = {name: cupy.empty(shape, dtype) for name, (shape, dtype) in recipe.temporaries.items()}
        tensors = dict(q=q, k=k, v=v, o=o, lse=lse, do=do, dq=dq, dk=dk, dv=dv, **temps)
        pointers = {name: x.data.ptr for name, x in tensors.items()} | arena_pointers(plan)
        recipe.run(cupy.cuda.get_current_stream().ptr, device, pointers)
    return dq, dk, dv


def _recipe_of(plan, dq_plan, graph, impl: str, deterministic, sizes, scale: float, device: int):
    """The :class:`BackwardRecipe` of a checked K/V-owned ``plan`` for tensors of ``sizes`` (batch, heads,
    q_slots, k_slots, d): ``"wgmma"`` runs the Q-owned dQ pass when a ``dq_plan`` is given, or on
    all-64-row plans when the ``graph`` can give one; pair items run on the warp-specialized kernel only."""
    _, h, sq, sk, _ = sizes
    q_pages, k_pages = sq // PAGE_ROWS, sk // PAGE_ROWS
    impl = "wgmma_dq_pass" if impl == "wgmma" and dq_plan is not None else impl
    impl = resolve_impl(impl, plan, graph is not None)
    dq_pass = uses_dq_pass(impl)
    if dq_pass:
        dq_plan = _DQ_PLANS.plan_for(graph) if dq_plan is None else dq_plan
        if not isinstance(dq_plan, DeviceOwnedPlan):
            _DQ_PLANS.checked(dq_plan, q_pages, k_pages, h)
    arrays = _device_plan(plan, q_pages, k_pages, h, device)
    if arrays["pair"] and (impl not in ("wgmma", "wgmma_ws") or deterministic):
        raise KernelValueError(
            "graph_or_plan has pair items (stream_vis): they run on the warp-specialized kernel only, "
            f"impl='wgmma' or 'wgmma_ws' with deterministic=False (got impl={impl!r}, "
            f"deterministic={deterministic})"
        )
    return backward_recipe(
        plan, arrays, impl, deterministic, dq_plan if dq_pass else None, sizes, scale, device
    )


_TORCH_DTYPES = {np.float32: "float32", np.int64: "int64", np.uint32: "int32"}


def torch_plan_backward(q, k, v, o, lse, do, plan, scale=None, impl=None, deterministic=False, dq_plan=None):
    """:func:`plan_backward` on torch CUDA tensors in a few attribute reads and the recipe's launches
    (raw pointers, torch's current stream, no DLPack views): ``(dq, dk, dv)``, or None when anything is
    unusual (the caller then takes the general path, which names what is wrong). ``plan``: a checked-once
    K/V-owned :class:`TilePlan` or a device plan."""
    import torch

    try:
        b, h, sq, d = q.shape
        sk = k.shape[2]
        dev = q.device
        ok = (
            dev.type == "cuda"
            and q.dtype == torch.bfloat16
            and all(x.dtype == torch.bfloat16 and x.device == dev for x in (k, v, o, do))
            and lse.dtype == torch.float32
            and lse.device == dev
            and k.shape == v.shape == (b, h, sk, d)
            and o.shape == do.shape == q.shape
            and lse.shape == (b, h, sq)
            and all(x.is_contiguous() for x in (q, k, v, o, lse, do))
            and d in HEAD_DIMS
            and b <= MAX_GRID_Y
            and sq % PAGE_ROWS == 0
            and sk % PAGE_ROWS == 0
            and max(sq, sk) * d < 2**31
            and isinstance(plan, (TilePlan, DeviceOwnedPlan))
            and plan.owner == "kv"
        )
    except (AttributeError, TypeError, ValueError):
        return None
    impl = default_impl() if impl is None else impl
    if not ok or impl not in IMPLS or impl == "mma" or not isinstance(deterministic, (bool, np.bool_)):
        return None
    if isinstance(plan, TilePlan):
        _PLANS.checked(plan, sq // PAGE_ROWS, sk // PAGE_ROWS, h)
    elif plan.heads != h:
        return None
    if uses_dq_pass(impl) and dq_plan is None:  # the general path says a graph or dq_plan is needed
        return None
    scale = check_scale(scale, d)
    recipe = _recipe_of(plan, dq_plan, None, impl, deterministic, (b, h, sq, sk, d), scale, dev.index)
    return _run_torch(recipe, dict(q=q, k=k, v=v, o=o, lse=lse, do=do), plan)


def _run_torch(recipe: BackwardRecipe, tensors: dict, plan):
    """``(dq, dk, dv)`` of ``recipe`` on torch tensors (``tensors``: its inputs by name): fresh gradients like
    q, k and v (zeros where ``recipe.zeroed`` says), its temporaries, torch's current stream; ``plan``'s
    arena bound where it is a device plan."""
    import torch

    dev = tensors["q"].device
    for name, like in (("dq", "q"), ("dk", "k"), ("dv", "v")):
        make = torch.zeros_like if name in recipe.zeroed else torch.empty_like
        tensors[name] = make(tensors[like])
    for name, (shape, dtype) in recipe.temporaries.items():
        tensors[name] = torch.empty(shape, dtype=getattr(torch, _TORCH_DTYPES[dtype]), device=dev)
    pointers = {name: x.data_ptr() for name, x in tensors.items()} | arena_pointers(plan)
    recipe.run(launch.torch_stream_ptr(dev.index), dev.index, pointers)
    return tensors["dq"], tensors["dk"], tensors["dv"]


def torch_token_plan_backward(q, k, v, o, lse, do, plan, q_map, k_map, sizes, tokens, scale, impl=None):
    """The token-order backward (``PAGED_BWD_TOKENS``) of a checked K/V-owned ``plan`` (or device plan) on
    torch CUDA tensors: ``(dq, dk, dv)`` like ``q``, ``k``, ``v``, or None where the token-order build does
    not run the plan's recipe (the Q-owned dQ pass, pair items off the warp-specialized kernel).

    ``q``, ``o``, ``do``: bf16 ``[batch, q_tokens, tok_heads, d]``; ``k``, ``v``: ``[batch, k_tokens,
    tok_heads, d]``; ``lse``: float32 in slot order; ``q_map`` / ``k_map``: int32 slot -> token maps (see
    :func:`sparseattn.kernels.forward.torch_token_forward`); ``sizes``: the recipe's (batch, heads, q_slots,
    k_slots, d), heads being batch · heads for device plans; ``tokens``: ``(q_tokens, k_tokens, tok_heads,
    maps_per_row)``."""

    impl = default_impl() if impl is None else impl
    if impl == "mma" or uses_dq_pass(impl):
        return None
    _, h, sq, sk, _ = sizes
    q_pages, k_pages = sq // PAGE_ROWS, sk // PAGE_ROWS
    dev = q.device
    if isinstance(plan, TilePlan):
        _PLANS.checked(plan, q_pages, k_pages, h)
    elif plan.heads != h:
        return None
    arrays = _device_plan(plan, q_pages, k_pages, h, dev.index)
    if arrays["pair"] and impl not in ("wgmma", "wgmma_ws"):
        return None
    recipe = backward_recipe(
        plan, arrays, impl, False, None, sizes, scale, dev.index, tuple(int(x) for x in tokens)
    )
    return _run_torch(recipe, dict(q=q, k=k, v=v, o=o, lse=lse, do=do, q_map=q_map, k_map=k_map), plan)
