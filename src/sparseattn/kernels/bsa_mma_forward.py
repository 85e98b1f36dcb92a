"""The ``mma.sync`` BSA baseline forward, :func:`bsa_mma_forward` (benchmarked as ``bsa_mma``):
``kernels_cu/bsa_fwd.cu`` behind a validating wrapper. (``sparseattn.bsa_forward`` is the paged wgmma
skeleton on the same BSA plan, :mod:`.forward`.)

The kernel executes any owner-``"q"`` :class:`~sparseattn.planning.TilePlan` whose tile shapes it was
instantiated for; given a :class:`~sparseattn.graph.SparseGraph` the wrapper builds (and caches) the
logical-block plan :func:`~sparseattn.planning.bsa_plan`. One launch per route, grid
``(work items of the route, batch)``.
"""

from __future__ import annotations

import math
import weakref

import numpy as np

from ..planning.cache import PlanCache
from ..planning.tile_plan import TilePlan
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

SOURCE = "bsa_fwd.cu"

# Mirrors of the kernel's compile-time configuration (kept here on purpose; the compile check builds
# every instantiation listed in NAME_EXPRESSIONS).
HEAD_DIMS = (64, 128)
#: (TILE_M, TILE_N) instantiations: the BSA tiles for B = 128 and B = 64 (also KPage's 128×128 route).
TILE_SHAPES = ((128, 128), (64, 64))
PAGE_ROWS = 16
#: Keys per pipeline stage (BSA_FWD_STAGE_KEYS) and query rows per warp (BSA_FWD_WARP_M_LARGE / WARP_ROWS).
STAGE_KEYS = 64
WARP_M_LARGE = 32
WARP_ROWS = 16
MAX_GRID_Y = 65535


def kernel_name(head_dim: int, tile_m: int, tile_n: int) -> str:
    return f"bsa_fwd_kernel<{head_dim}, {tile_m}, {tile_n}>"


NAME_EXPRESSIONS = tuple(kernel_name(d, m, n) for d in HEAD_DIMS for m, n in TILE_SHAPES)


def warp_rows(tile_m: int) -> int:
    """Query rows per warp: 32 for 128-row tiles (two m16 tiles share each K/V fragment), else 16."""
    return WARP_M_LARGE if tile_m >= 128 else WARP_ROWS


def threads_per_cta(tile_m: int) -> int:
    return tile_m // warp_rows(tile_m) * 32


def stage_buffers(tile_m: int) -> int:
    """K/V stage buffers in shared memory (prefetch depth + 1)."""
    return 2 if tile_m >= 128 else 3


def smem_bytes(head_dim: int, tile_m: int, tile_n: int) -> int:
    """Dynamic shared memory: Q tile, the K and V stage buffers (bf16), and 2·NBUF metadata slots of
    (page id, row mask) per stage page."""
    stage_n = min(tile_n, STAGE_KEYS)
    nbuf = stage_buffers(tile_m)
    return (tile_m + 2 * nbuf * stage_n) * head_dim * 2 + 2 * nbuf * (stage_n // PAGE_ROWS) * 8


# ---- plan and device-array caches ------------------------------------------------------------

_PLANS = PlanCache(owner="q", tile_shapes=TILE_SHAPES)
_DEVICE_PLANS: weakref.WeakKeyDictionary[TilePlan, dict] = weakref.WeakKeyDictionary()
plan_for = _PLANS.plan_for


def _device_plan(plan: TilePlan, device: int) -> dict:
    """The plan's arrays on the device (uploaded once per plan and device)."""
    import cupy

    per_plan = _DEVICE_PLANS.setdefault(plan, {})
    key = device
    if key not in per_plan:
        host = plan.device_arrays()
        # row mask of every stream entry (uint32: the kernel copies it with 4-byte cp.async); the plan
        # was validated first, so every stream page id is in range
        host["stream_entry_mask"] = host["stream_page_mask"][host["stream_pages"]].astype(np.uint32)
        with cupy.cuda.Device(device):
            per_plan[key] = {name: cupy.asarray(arr) for name, arr in host.items()}
    return per_plan[key]


def check_inputs(q, k, v, graph_or_plan, scale=None, out=None):
    """Validate every argument of :func:`bsa_mma_forward` (no launch); returns ``(plan, scale, o, lse)``
    with ``o``/``lse`` the caller's buffers or ``None``."""
    check_tensor("q", q, dtype=BF16_DTYPE_NAMES, ndim=4)
    b, h, sq, d = (int(x) for x in q.shape)
    check_head_dim("q", d, HEAD_DIMS)
    check_tensor("k", k, dtype=(str(q.dtype),), shape=(b, h, None, d))
    sk = int(k.shape[2])
    check_tensor("v", v, dtype=(str(q.dtype),), shape=(b, h, sk, d))
    device = int(q.device.id)
    for name, x in (("k", k), ("v", v)):
        if int(x.device.id) != device:
            raise KernelValueError(f"{name} is on device {x.device.id} but q is on device {device}")
    if b > MAX_GRID_Y:
        raise KernelValueError(f"q has batch {b}; the kernel grid allows at most {MAX_GRID_Y}")
    q_pages = pages_of("q", sq)
    k_pages = pages_of("k", sk)
    plan = _PLANS.resolve(graph_or_plan, h, sq, sk, q_pages, k_pages)
    scale = check_scale(scale, d)
    o = lse = None
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise KernelTypeError("out must be a tuple (o, lse) of preallocated cupy arrays")
        o, lse = out
        check_tensor("out[0] (o)", o, dtype=(str(q.dtype),), shape=(b, h, sq, d), device=device)
        check_tensor("out[1] (lse)", lse, dtype="float32", shape=(b, h, sq), device=device)
    return plan, scale, o, lse, (q_pages, k_pages, device)


def bsa_mma_forward(q, k, v, graph_or_plan, scale=None, out=None):
    """Block-sparse attention forward on the GPU, on the ``mma.sync`` kernel.

    Args:
        q: bf16 ``[batch, heads, q_slots, d]`` CuPy array (``uint16`` bf16 bits or a bfloat16 dtype),
            C-contiguous; ``d`` in ``HEAD_DIMS``; ``q_slots`` a multiple of 16.
        k, v: same dtype, ``[batch, heads, k_slots, d]``.
        graph_or_plan: a :class:`SparseGraph` (runs its BSA plan) or an owner-``"q"`` :class:`TilePlan`
            with tile shapes in ``TILE_SHAPES``.
        scale: softmax scale, default ``1/sqrt(d)``.
        out: optional ``(o, lse)`` buffers to write into.

    Returns:
        ``(o, lse)``: ``o`` like ``q`` (bf16), ``lse`` float32 ``[batch, heads, q_slots]`` (natural log).
        Valid rows with no valid key get ``o = 0``, ``lse = -inf``; invalid (padding) rows are not
        written (zeros / -inf in freshly allocated outputs).
    """
    return run_forward(q, k, v, graph_or_plan, scale, out, launch_target)


def launch_target(head_dim: int, tile_m: int, tile_n: int):
    """(kernel function, threads per CTA, dynamic shared memory) of the mma.sync kernel for one route."""
    fn = launch.function(SOURCE, kernel_name(head_dim, tile_m, tile_n), NAME_EXPRESSIONS)
    return fn, threads_per_cta(tile_m), smem_bytes(head_dim, tile_m, tile_n)


def run_forward(q, k, v, graph_or_plan, scale, out, target):
    """Validate, allocate the outputs and launch one kernel per route of the plan.

    ``target(head_dim, tile_m, tile_n) -> (fn, threads, smem_bytes)`` picks the kernel of a route; every
    forward kernel takes the same arguments (the plan's device arrays), so builds can share routes.
    """
    plan, scale, o, lse, (_, _, device) = check_inputs(q, k, v, graph_or_plan, scale, out)
    import cupy

    b, h, sq, d = (int(x) for x in q.shape)
    arrays = _device_plan(plan, device)
    with cupy.cuda.Device(device):
        if o is None:
            o = cupy.zeros(q.shape, dtype=q.dtype)
            lse = cupy.full((b, h, sq), -np.inf, dtype=cupy.float32)
        scale_log2 = np.float32(scale * math.log2(math.e))
        own_stride = np.int32(plan.own_pages.shape[1])
        for route, (start, stop) in enumerate(plan.route_ranges()):
            if stop <= start:
                continue
            tile_m, tile_n = plan.routes[route]
            fn, threads, smem = target(d, tile_m, tile_n)
            launch.prepare(fn, smem)
            fn(
                (stop - start, b),
                (threads,),
                (
                    q,
                    k,
                    v,
                    o,
                    lse,
                    arrays["work_head"],
                    arrays["own_pages"],
                    own_stride,
                    arrays["stream_indptr"],
                    arrays["stream_pages"],
                    arrays["own_page_mask"],
                    arrays["stream_entry_mask"],
                    np.int32(start),
                    np.int32(h),
                    np.int32(sq),
                    np.int32(int(k.shape[2])),
                    scale_log2,
                ),
                shared_mem=smem,
            )
    return o, lse
