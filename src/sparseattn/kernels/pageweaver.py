"""PageWeaver's ID-aware union attention on Hopper: ``kernels_cu/pw_union_fwd.cu``.

:func:`union_forward` runs one CTA work item per (KV head, pack of consecutive query groups): the
groups' member ids come straight from a :class:`~sparseattn.pageweaver.grouping.Grouping` (CSR ``ids`` /
``offsets``, host or device), the kernel builds the union of the members' selected pages itself, loads
each union page of the FP8 cache once, computes every member against the union with per-member exact
masking, and writes each query's O/LSE row by id. A group fills ``8·G`` rows of the 64-row wgmma tile;
``pack`` groups share one tile (default ``8 // G``: the tile full at ``G ≤ 4``) and stream the union of
their unions. With singleton groups (:func:`per_query_groups`) and ``pack=1`` the same kernel is the
per-query paged design: every query loads its own pages (rows = its ``G`` query heads, padded to the
64-row wgmma tile).

Tensors (CuPy arrays or torch CUDA tensors, C-contiguous, one device):

* ``q`` bf16 ``[q_heads, num_queries, 128]`` (``uint16`` bits or bfloat16);
* ``k_cache``, ``v_cache`` e4m3 ``[kv_heads, num_pages · page_size, 128]`` (``uint8`` bits or float8_e4m3fn)
  and ``k_scale``, ``v_scale`` float32 ``[kv_heads, num_pages]`` (see :mod:`sparseattn.pageweaver.fp8`);
* returns ``o`` like ``q`` and ``lse`` float32 ``[q_heads, num_queries]``.

``q_heads = G · kv_heads`` with ``G ≤ 16`` (query head ``hq`` reads KV head ``hq // G``); every KV head
shares the capture's selection.
"""

from __future__ import annotations

import math
import os
import weakref

import numpy as np

from ..pageweaver.captures import Capture, CaptureShape
from ..pageweaver.grouping import Grouping, GroupingError, validate_grouping
from ..pageweaver.kv_page_plan import build_kv_page_plan
from . import launch
from .validate import (
    BF16_DTYPE_NAMES,
    KernelTypeError,
    KernelValueError,
    check_scale,
    check_tensor,
    device_of,
)

SOURCE = "pw_union_fwd.cu"
KERNEL = "pw_union_fwd_kernel"
KVPAGE_KERNEL = "pw_kvpage_fwd_kernel"
MERGE_KERNEL = "pw_lse_merge_kernel"
NAME_EXPRESSIONS = (KERNEL, KVPAGE_KERNEL, MERGE_KERNEL)
PER_QUERY_SOURCE = "pw_per_query_fwd.cu"
PER_QUERY_KERNEL = "pw_per_query_fwd_kernel"
KERNEL_SOURCES = {PER_QUERY_SOURCE: (PER_QUERY_KERNEL,)}
# Parameter names shared by the kernels: the tensors, then the call's shape and capture scalars.
_TENSOR_PARAMS = ("Q", "K", "V", "k_scale", "v_scale", "O", "LSE")
_SCALAR_PARAMS = (
    "kv_heads",
    "gqa",
    "num_queries",
    "selected",
    "num_pages",
    "log2_page",
    "context",
    "causal",
    "scale_log2",
)
#: The kernels' parameters, in order (tests/test_compile.py checks them against the sources).
KERNEL_PARAMS = (
    *_TENSOR_PARAMS,
    "ids",
    "offsets",
    "group_count",
    "pages",
    "positions",
    "item_counter",
    "num_groups",
    *_SCALAR_PARAMS,
    "num_entries",
    "pack",
)
PER_QUERY_PARAMS = (*_TENSOR_PARAMS, "pages", "positions", *_SCALAR_PARAMS)

# Mirrors of the kernel's compile-time geometry (PW_* in the source).
THREADS = 384
HEAD_DIM = 128
Q_ROWS = 128
CHUNK = 64
NBUF = 4
NSTAGE = 3
MEMBERS = 8
MAX_PACK = 8  # groups per 64-row tile at G = 1
MAX_SELECTED = 64
MAX_PAGES = 8192
MAX_GQA = Q_ROWS // MEMBERS
_SUB_PAGES = CHUNK // 16
SMALL_BYTES = (
    8 * (4 * NBUF + 6) + 16 * NBUF * _SUB_PAGES + 16 + 2 * 64 * 4 + 32 + 8 * NBUF * _SUB_PAGES + 4 * Q_ROWS
)
MAX_UNION = MEMBERS * MAX_SELECTED  # union pages a tile holds (a pack's union above it is split)
# union list: member masks (u64), row map (int4 per row), page bitset and its word ranks, pages
LIST_BYTES = 8 * MAX_UNION + 16 * Q_ROWS + 2 * 4 * (MAX_PAGES // 32) + 4 * MAX_UNION
SMEM_BYTES = (
    1024
    + Q_ROWS * HEAD_DIM * 2
    + 2 * NBUF * CHUNK * HEAD_DIM * 2
    + 2 * NSTAGE * CHUNK * HEAD_DIM
    + NSTAGE * 128 * 8
    + LIST_BYTES
    + SMALL_BYTES
)
E4M3_DTYPE_NAMES = ("uint8", "float8_e4m3fn")
#: Compile-time variants that :func:`set_variant` (or the environment variable ``SPARSEATTN_PW_VARIANT``,
#: comma-separated) may switch on: ``PW_*`` for ``pw_union_fwd.cu``, ``PQ_*`` for ``pw_per_query_fwd.cu``.
VARIANTS = ("PW_BF16_OPERANDS", "PQ_BF16_OPERANDS")
_variant: tuple[str, ...] = ()


def set_variant(*names: str) -> tuple[str, ...]:
    """Compile the PageWeaver kernels with these :data:`VARIANTS` (none: the default builds).

    The default builds use f16 operands (e4m3 → f16 exactly, the scales applied to S and P / O).
    ``PW_BF16_OPERANDS``: the union / KV-page kernels dequantise K and V to bf16 with their scales (the
    earlier path, kept for comparison). ``PQ_BF16_OPERANDS``: the same for the per-query kernel.
    Returns the variant in force.
    """
    global _variant
    bad = [n for n in names if n not in VARIANTS]
    if bad:
        raise KernelValueError(f"unknown variant {bad[0]!r}; choose from {VARIANTS}")
    _variant = tuple(sorted(set(names)))
    return _variant


def _defines(prefix: str) -> tuple[str, ...]:
    """The variant's macros for one source (``PW_`` or ``PQ_``)."""
    return tuple(n for n in _variant if n.startswith(prefix))


def kernel_defines(source: str) -> tuple[str, ...]:
    """The macros ``source`` is compiled with now (the variant in force): what :mod:`.warmup` compiles."""
    return _defines("PQ_" if source == PER_QUERY_SOURCE else "PW_")


def variant() -> tuple[str, ...]:
    """The compile-time variant in force for ``pw_union_fwd.cu`` (empty: the default build)."""
    return _variant


set_variant(*launch.variants_from_env("SPARSEATTN_PW_VARIANT", VARIANTS))
# Mirrors of the per-query kernel's geometry (PQ_* in pw_per_query_fwd.cu).
PQ_WARPS = 12
PQ_STEP_KEYS = 16
PQ_NSTAGE = 4
PQ_SMEM_BYTES = PQ_WARPS * PQ_NSTAGE * (2 * PQ_STEP_KEYS * HEAD_DIM + 8)


def pack_limit(gqa: int) -> int:
    """The most groups a 64-row tile holds at ``G = gqa``: ``8 // G`` (1 at ``G > 8``, the 128-row tile)."""
    return max(1, MAX_PACK // gqa) if gqa <= MAX_PACK else 1


#: ``SPARSEATTN_PW_PACK`` (an integer, read once): the groups per tile a process forces (A/B runs).
_FORCED_PACK = int(os.environ["SPARSEATTN_PW_PACK"]) if os.environ.get("SPARSEATTN_PW_PACK") else None


def default_pack(gqa: int, requested: int | None = None) -> int:
    """Groups per tile that fill the 64-row tile: :func:`pack_limit`; ``requested`` (else the environment
    variable ``SPARSEATTN_PW_PACK``) overrides it, clamped to what fits (A/B runs)."""
    limit = pack_limit(gqa)
    forced = _FORCED_PACK if requested is None else requested
    return limit if forced is None else min(limit, max(1, int(forced)))


def check_pack(pack, gqa: int) -> int:
    """``pack`` (``None``: :func:`default_pack`) after its checks: an integer with ``8·G·pack ≤ 64``."""
    if pack is None:
        return default_pack(gqa)
    limit = pack_limit(gqa)
    if isinstance(pack, bool) or not isinstance(pack, (int, np.integer)) or not 1 <= pack <= limit:
        raise KernelValueError(
            f"pack must be an integer in [1, {limit}] at G = {gqa} (8·G·pack rows fill at most 64), got {pack!r}"
        )
    return int(pack)


def per_query_groups(num_queries: int) -> Grouping:
    """Every query its own group: the per-query paged design on the union kernel."""
    ids = np.arange(num_queries, dtype=np.int32)
    return Grouping(ids, np.arange(num_queries + 1, dtype=np.int32), 1, "per_query")


class DeviceCapture(CaptureShape):
    """A selection that lives on the device (made per call by a model: :mod:`sparseattn.pageweaver.page_select`),
    for the kernels in place of a host :class:`Capture`: ``pages`` int32 ``[Q, k]`` (valid ids first, ``-1``
    padding, ids in ``[0, num_pages)`` by construction: not checked, as a host capture is),
    ``positions`` int32 ``[Q]`` (CuPy arrays or torch CUDA tensors), the ``context`` length, the
    ``page_size`` and causality."""

    def __init__(self, pages, positions, context: int, page_size: int, causal: bool = True):
        import cupy

        as_cupy = lambda x: x if isinstance(x, cupy.ndarray) else cupy.from_dlpack(x.contiguous())
        self.pages, self.positions = as_cupy(pages), as_cupy(positions)
        if self.pages.dtype != cupy.int32 or self.positions.dtype != cupy.int32:
            raise KernelTypeError("DeviceCapture pages and positions must be int32")
        if self.pages.ndim != 2 or self.positions.shape != (self.pages.shape[0],):
            raise KernelValueError(
                f"DeviceCapture pages must be [Q, k] and positions [Q], got {self.pages.shape} and "
                f"{self.positions.shape}"
            )
        self.context, self.page_size, self.causal = int(context), int(page_size), bool(causal)


def check_capture(capture) -> Capture:
    if isinstance(capture, DeviceCapture):
        return _check_capture_sizes(capture)
    if not isinstance(capture, Capture):
        raise KernelTypeError(
            f"capture must be a sparseattn.pageweaver.Capture, got {type(capture).__name__}"
        )
    return _check_capture_sizes(capture)


def _check_capture_sizes(capture):
    P = capture.page_size
    if P < 16 or P & (P - 1):
        raise KernelValueError(f"capture.page_size must be a power of two >= 16 for the kernel, got {P}")
    if capture.k > MAX_SELECTED:
        raise KernelValueError(
            f"capture selects up to {capture.k} pages per query; the kernel reads at most {MAX_SELECTED}"
        )
    if capture.num_pages > MAX_PAGES:
        raise KernelValueError(
            f"capture has {capture.num_pages} pages per head; the kernel covers at most {MAX_PAGES}"
        )
    return capture


def _device_capture(capture: Capture, device: int) -> dict:
    if isinstance(capture, DeviceCapture):
        return {"pages": capture.pages, "positions": capture.positions}
    return launch.device_arrays(
        capture,
        device,
        lambda: {
            "pages": np.ascontiguousarray(capture.pages, dtype=np.int32),
            "positions": np.ascontiguousarray(capture.positions, dtype=np.int32),
        },
    )


def _device_grouping(grouping, capture: Capture, device: int):
    """(ids, offsets, num_groups, group_count) on the device; a host Grouping is validated in full."""
    if isinstance(grouping, Grouping):
        try:
            validate_grouping(grouping, capture.num_queries, MEMBERS)
        except GroupingError as err:
            raise KernelValueError(f"grouping: {err}") from None
        arrays = launch.device_arrays(
            grouping,
            device,
            lambda: {
                "ids": np.ascontiguousarray(grouping.ids, dtype=np.int32),
                "offsets": np.ascontiguousarray(grouping.offsets, dtype=np.int32),
            },
        )
        return arrays["ids"], arrays["offsets"], grouping.num_groups, None
    if hasattr(grouping, "num_groups") and hasattr(grouping, "max_groups"):  # a grouping_gpu.DeviceGrouping
        if grouping.group_size > MEMBERS:
            raise KernelValueError(
                f"grouping: groups of up to {grouping.group_size} queries; the kernel takes {MEMBERS}"
            )
        check_tensor("grouping ids", grouping.ids, dtype="int32", shape=(capture.num_queries,), device=device)
        n = int(grouping.max_groups)
        return grouping.ids, grouping.offsets[: n + 1], n, grouping.num_groups
    if not isinstance(grouping, (tuple, list)) or len(grouping) != 2:
        raise KernelTypeError("grouping must be a Grouping or a tuple (ids, offsets) of device int32 arrays")
    ids, offsets = grouping
    check_tensor("grouping ids", ids, dtype="int32", shape=(capture.num_queries,), device=device)
    check_tensor("grouping offsets", offsets, dtype="int32", ndim=1, device=device)
    if offsets.shape[0] < 2:
        raise KernelValueError("grouping offsets must hold at least one group")
    return ids, offsets, int(offsets.shape[0] - 1), None


def check_device_grouping(ids, offsets, num_queries: int) -> None:
    """Validate a device grouping (every query once, groups of 1..8) — a few small kernels and one sync."""
    import cupy

    sizes = cupy.diff(offsets)
    bad = int(offsets[0]) != 0 or int(offsets[-1]) != num_queries
    bad = bad or bool(((sizes < 1) | (sizes > MEMBERS)).any())
    if bad:
        raise KernelValueError(f"grouping offsets must run from 0 to {num_queries} in steps of 1..{MEMBERS}")
    if bool(((ids < 0) | (ids >= num_queries)).any()):
        raise KernelValueError(f"grouping ids must lie in [0, {num_queries})")
    if int(cupy.bincount(ids, minlength=num_queries).max()) != 1:
        raise KernelValueError("grouping ids must hold every query exactly once")


def _torch_call(fn, q, k_cache, v_cache, k_scale, v_scale, out, *args, **kwargs):
    """``fn`` on CuPy views of torch tensors (no copies), on torch's current stream; returns torch (o, lse)."""
    import torch

    if out is None:
        out = (
            torch.zeros_like(q),
            torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device),
        )
    import cupy

    def view(name, x):
        if not launch.is_torch_tensor(x):
            raise KernelTypeError(f"{name} must be a torch tensor like q, got {type(x).__name__}")
        if x.dtype == torch.float8_e4m3fn:
            return cupy.from_dlpack(x.detach().view(torch.uint8))
        if x.dtype in (torch.uint8, torch.float32):
            return cupy.from_dlpack(x.detach())
        return launch.torch_to_cupy(name, x)

    views = [
        view(n, x)
        for n, x in (
            ("q", q),
            ("k_cache", k_cache),
            ("v_cache", v_cache),
            ("k_scale", k_scale),
            ("v_scale", v_scale),
        )
    ]
    outs = tuple(view(n, x) for n, x in (("out[0] (o)", out[0]), ("out[1] (lse)", out[1])))
    with launch.torch_stream():
        fn(*views, *args, out=outs, **kwargs)
    return tuple(out)


def _check_inputs(q, k_cache, v_cache, k_scale, v_scale, capture: Capture, scale):
    """(q_heads, num_queries, kv_heads, device, scale) after every tensor check both designs share."""
    check_tensor("q", q, dtype=BF16_DTYPE_NAMES, ndim=3)
    hq, nq, d = q.shape
    if d != HEAD_DIM:
        raise KernelValueError(f"q has head_dim {d}; the union kernel is built for {HEAD_DIM}")
    if nq != capture.num_queries:
        raise KernelValueError(f"q holds {nq} queries but the capture {capture.num_queries}")
    device = device_of(q)
    rows = capture.num_pages * capture.page_size
    check_tensor("k_cache", k_cache, dtype=E4M3_DTYPE_NAMES, ndim=3, device=device)
    hkv = k_cache.shape[0]
    check_tensor("k_cache", k_cache, dtype=E4M3_DTYPE_NAMES, shape=(hkv, rows, HEAD_DIM), device=device)
    check_tensor("v_cache", v_cache, dtype=E4M3_DTYPE_NAMES, shape=(hkv, rows, HEAD_DIM), device=device)
    check_tensor("k_scale", k_scale, dtype="float32", shape=(hkv, capture.num_pages), device=device)
    check_tensor("v_scale", v_scale, dtype="float32", shape=(hkv, capture.num_pages), device=device)
    if hkv < 1 or hq % hkv or not 1 <= hq // hkv <= MAX_GQA:
        raise KernelValueError(
            f"q has {hq} heads and the cache {hkv}: q_heads must be G · kv_heads with 1 <= G <= {MAX_GQA}"
        )
    if hkv * rows * HEAD_DIM >= 2**31 or hq * nq * HEAD_DIM >= 2**62:
        raise KernelValueError("the cache is too large for the kernel's 32-bit row offsets")
    scale = check_scale(scale, HEAD_DIM)
    return hq, nq, hkv, device, scale


def union_forward(
    q, k_cache, v_cache, k_scale, v_scale, capture: Capture, grouping, scale=None, out=None, pack=None
):
    """PageWeaver's union attention (see the module docstring for shapes).

    Args:
        grouping: a :class:`Grouping` (groups of at most 8 queries; validated), a
            :class:`~sparseattn.pageweaver.grouping_gpu.DeviceGrouping` (the GPU search's output, used
            without a host synchronisation), or ``(ids, offsets)`` int32 device arrays (shapes checked;
            :func:`check_device_grouping` validates the contents on request).
        scale: softmax scale (default ``1/sqrt(128)``).
        out: optional ``(o, lse)`` to write into.
        pack: consecutive groups per 64-row tile (default :func:`default_pack`: ``8 // G``); 1 runs one
            group per tile (the per-query design with :func:`per_query_groups`).
    """
    if launch.is_torch_tensor(q):
        return _torch_call(
            union_forward, q, k_cache, v_cache, k_scale, v_scale, out, capture, grouping, scale, pack=pack
        )
    capture = check_capture(capture)
    hq, _, hkv, device, scale = _check_inputs(q, k_cache, v_cache, k_scale, v_scale, capture, scale)
    pack = check_pack(pack, hq // hkv)
    ids, offsets, num_groups, group_count = _device_grouping(grouping, capture, device)
    o, lse = _outputs(q, out, device)
    cap = _device_capture(capture, device)
    cache = (k_cache, v_cache, k_scale, v_scale)
    _launch(
        KERNEL,
        q,
        cache,
        (o, lse),
        (ids, offsets, group_count),
        cap["pages"],
        cap["positions"],
        num_groups,
        capture,
        scale,
        0,
        pack,
    )
    return o, lse


def _outputs(q, out, device):
    """(o, lse): fresh (o = 0, lse = -inf) or ``out`` after its checks."""
    import cupy

    hq, nq = q.shape[:2]
    if out is None:
        with cupy.cuda.Device(device):
            return cupy.zeros(q.shape, dtype=q.dtype), cupy.full((hq, nq), -np.inf, dtype=cupy.float32)
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise KernelTypeError("out must be a tuple (o, lse) of preallocated arrays")
    o, lse = out
    check_tensor(
        "out[0] (o)",
        o,
        dtype=(q.dtype.name if q.dtype.name in BF16_DTYPE_NAMES else BF16_DTYPE_NAMES),
        shape=q.shape,
        device=device,
    )
    check_tensor("out[1] (lse)", lse, dtype="float32", shape=(hq, nq), device=device)
    return o, lse


def _scalar_args(hkv: int, gqa: int, nq: int, capture: Capture, scale: float) -> tuple:
    """The kernels' trailing scalars, in the order of ``_SCALAR_PARAMS``."""
    return (
        np.int32(hkv),
        np.int32(gqa),
        np.int32(nq),
        np.int32(capture.k),
        np.int32(capture.num_pages),
        np.int32(int(math.log2(capture.page_size))),
        np.int32(capture.context),
        np.int32(1 if capture.causal else 0),
        np.float32(scale * math.log2(math.e)),
    )


def _launch(
    kernel, q, cache, outputs, groups, pages, positions, num_groups, capture, scale, num_entries, pack=1
) -> None:
    """One persistent launch of ``kernel`` (the union or the KV-page kernel) over ``⌈num_groups / pack⌉ ·
    kv_heads`` items. ``cache``: (k_cache, v_cache, k_scale, v_scale); ``outputs``: (o, lse) or the
    partials; ``groups``: (ids, offsets, group_count or None)."""
    import cupy

    ids, offsets, group_count = groups
    hkv = cache[0].shape[0]
    hq, nq = q.shape[:2]
    device = device_of(q)
    with cupy.cuda.Device(device):
        fn = launch.prepare(launch.function(SOURCE, kernel, NAME_EXPRESSIONS, _defines("PW_")), SMEM_BYTES)
        counter = _counter(device)
        stream = cupy.cuda.get_current_stream()
        cupy.cuda.runtime.memsetAsync(counter.data.ptr, 0, 4, stream.ptr)
        items = -(-num_groups // pack) * hkv
        grid = (max(1, min(launch.sm_count(device), items)),)
        args = (
            q,
            *cache,
            *outputs,
            ids,
            offsets,
            np.uint64(0) if group_count is None else group_count,
            pages,
            positions,
            counter,
            np.int32(num_groups),
            *_scalar_args(hkv, hq // hkv, nq, capture, scale),
            np.int32(num_entries),
            np.int32(pack),
        )
        if items:
            fn(grid, (THREADS,), args, shared_mem=SMEM_BYTES)


MERGE_THREADS = 256


def per_query_forward(q, k_cache, v_cache, k_scale, v_scale, capture: Capture, scale=None, out=None):
    """The per-query paged baseline (FlashInfer's design): every query loads its own selected pages.

    Same tensors as :func:`union_forward`, no grouping. One warp per (query, KV head) work item on
    ``mma.sync`` 16-row tiles holding the query's ``G`` heads (``kernels_cu/pw_per_query_fwd.cu``).
    """
    if launch.is_torch_tensor(q):
        return _torch_call(
            per_query_forward, q, k_cache, v_cache, k_scale, v_scale, out, capture, scale=scale
        )
    capture = check_capture(capture)
    hq, nq, hkv, device, scale = _check_inputs(q, k_cache, v_cache, k_scale, v_scale, capture, scale)
    o, lse = _outputs(q, out, device)
    cap = _device_capture(capture, device)
    import cupy

    with cupy.cuda.Device(device):
        fn = launch.prepare(
            launch.function(PER_QUERY_SOURCE, PER_QUERY_KERNEL, (PER_QUERY_KERNEL,), _defines("PQ_")),
            PQ_SMEM_BYTES,
        )
        items = nq * hkv
        grid = (max(1, min(launch.sm_count(device), -(-items // PQ_WARPS))),)
        args = (
            q,
            k_cache,
            v_cache,
            k_scale,
            v_scale,
            o,
            lse,
            cap["pages"],
            cap["positions"],
            *_scalar_args(hkv, hq // hkv, nq, capture, scale),
        )
        fn(grid, (PQ_WARPS * 32,), args, shared_mem=PQ_SMEM_BYTES)
    return o, lse


def kv_page_plan(capture: Capture):
    """The capture's :class:`~sparseattn.pageweaver.kv_page_plan.KvPagePlan`, built once per capture."""
    plan = _KV_PLANS.get(capture)
    if plan is None:
        plan = _KV_PLANS[capture] = build_kv_page_plan(capture, MEMBERS)
    return plan


def kv_page_forward(
    q,
    k_cache,
    v_cache,
    k_scale,
    v_scale,
    capture: Capture,
    scale=None,
    out=None,
    partial_budget=None,
    phases=None,
):
    """The direct KV-page union (the comparison design): partials per (query, page), merged by LSE.

    Same tensors as :func:`union_forward`. Work is split by KV page (:func:`kv_page_plan`: items of up to
    8 queries that selected one page); each item writes every member's normalised partial O (fp32) and
    LSE, and ``pw_lse_merge_kernel`` combines each query's partials. KV heads run in chunks whose fp32
    partials fit ``partial_budget`` bytes (default: half the device's free memory).

    Args:
        phases: optional dict; when given, CUDA events time the two phases and it receives
            ``partials_ms`` and ``merge_ms`` (the reduction's own cost; this synchronises).
    """
    if launch.is_torch_tensor(q):
        return _torch_call(
            kv_page_forward,
            q,
            k_cache,
            v_cache,
            k_scale,
            v_scale,
            out,
            capture,
            scale=scale,
            partial_budget=partial_budget,
            phases=phases,
        )
    capture = check_capture(capture)
    hq, nq, hkv, device, scale = _check_inputs(q, k_cache, v_cache, k_scale, v_scale, capture, scale)
    o, lse = _outputs(q, out, device)
    plan = kv_page_plan(capture)
    arrays = launch.device_arrays(
        plan,
        device,
        lambda: {
            "ids": plan.ids,
            "offsets": plan.offsets,
            "item_pages": plan.item_pages,
            "slot_entry": plan.slot_entry,
        },
    )
    cap = _device_capture(capture, device)
    G = hq // hkv
    E = plan.num_entries
    import cupy

    if partial_budget is None:
        with cupy.cuda.Device(device):
            budget = cupy.cuda.runtime.memGetInfo()[0] // 2 + cupy.get_default_memory_pool().free_bytes() // 2
    else:
        budget = int(partial_budget)
    per_head = G * max(E, 1) * (HEAD_DIM + 1) * 4
    if per_head > budget:
        raise KernelValueError(
            f"partial_budget ({budget} bytes) is below one KV head's partials ({per_head} bytes)"
        )
    chunk = max(1, min(hkv, budget // per_head))

    with cupy.cuda.Device(device):
        o_part = cupy.empty((chunk * G, E, HEAD_DIM), dtype=cupy.float32)
        lse_part = cupy.empty((chunk * G, E), dtype=cupy.float32)
        merge = launch.function(SOURCE, MERGE_KERNEL, NAME_EXPRESSIONS, _defines("PW_"))
        events = [cupy.cuda.Event() for _ in range(3)] if phases is not None else None
        spent = [0.0, 0.0]
        for h0 in range(0, hkv, chunk):
            h1 = min(hkv, h0 + chunk)
            qs, os_, ls = q[h0 * G : h1 * G], o[h0 * G : h1 * G], lse[h0 * G : h1 * G]
            if events:
                events[0].record()
            _launch(
                KVPAGE_KERNEL,
                qs,
                tuple(x[h0:h1] for x in (k_cache, v_cache, k_scale, v_scale)),
                (o_part, lse_part),
                (arrays["ids"], arrays["offsets"], None),
                arrays["item_pages"],
                cap["positions"],
                plan.num_items,
                capture,
                scale,
                E,
            )
            if events:
                events[1].record()
            rows = (h1 - h0) * G * nq
            warps = MERGE_THREADS // 32
            merge(
                ((rows + warps - 1) // warps,),
                (MERGE_THREADS,),
                (
                    o_part,
                    lse_part,
                    arrays["slot_entry"],
                    os_,
                    ls,
                    np.int32((h1 - h0) * G),
                    np.int32(nq),
                    np.int32(capture.k),
                    np.int32(E),
                ),
            )
            if events:
                events[2].record()
                events[2].synchronize()
                spent[0] += cupy.cuda.get_elapsed_time(events[0], events[1])
                spent[1] += cupy.cuda.get_elapsed_time(events[1], events[2])
        if phases is not None:
            phases["partials_ms"], phases["merge_ms"] = spent
            phases["head_chunks"] = -(-hkv // chunk)
    return o, lse


_KV_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


_COUNTERS: dict = {}


def _counter(device: int):
    import cupy

    c = _COUNTERS.get(device)
    if c is None:
        c = _COUNTERS[device] = cupy.zeros(1, dtype=cupy.int32)
    return c
