"""PageWeaver's ID-aware union attention on Hopper: ``kernels_cu/pw_union_fwd.cu``.

:func:`union_forward` runs one CTA work item per (KV head, query group): the group's member ids come
straight from a :class:`~sparseattn.pageweaver.grouping.Grouping` (CSR ``ids`` / ``offsets``, host or
device), the kernel builds the union of the members' selected pages itself, loads each union page of
the FP8 cache once, computes every member against the union with per-member exact masking, and writes
each query's O/LSE row by id. With singleton groups (:func:`per_query_groups`) the same kernel is the
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

import numpy as np

from ..pageweaver.captures import Capture
from ..pageweaver.grouping import Grouping, GroupingError, validate_grouping
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
NAME_EXPRESSIONS = (KERNEL,)
#: The kernel's parameters, in order (tests/test_compile.py checks them against the source).
KERNEL_PARAMS = (
    "Q",
    "K",
    "V",
    "k_scale",
    "v_scale",
    "O",
    "LSE",
    "ids",
    "offsets",
    "group_count",
    "pages",
    "positions",
    "item_counter",
    "num_groups",
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

# Mirrors of the kernel's compile-time geometry (PW_* in the source).
THREADS = 384
HEAD_DIM = 128
Q_ROWS = 128
CHUNK = 64
NBUF = 4
NSTAGE = 3
MEMBERS = 8
MAX_SELECTED = 64
MAX_PAGES = 8192
MAX_GQA = Q_ROWS // MEMBERS
_SUB_PAGES = CHUNK // 16
SMALL_BYTES = 8 * (4 * NBUF + 6) + 8 * NBUF * _SUB_PAGES + 16 + 2 * 64 * 4 + 32
SMEM_BYTES = (
    1024
    + Q_ROWS * HEAD_DIM * 2
    + 2 * NBUF * CHUNK * HEAD_DIM * 2
    + 2 * NSTAGE * CHUNK * HEAD_DIM
    + NSTAGE * 128 * 8
    + 4 * MEMBERS * (MAX_PAGES // 32)
    + 8 * MEMBERS * MAX_SELECTED
    + SMALL_BYTES
)
E4M3_DTYPE_NAMES = ("uint8", "float8_e4m3fn")


def per_query_groups(num_queries: int) -> Grouping:
    """Every query its own group: the per-query paged design on the union kernel."""
    ids = np.arange(num_queries, dtype=np.int32)
    return Grouping(ids, np.arange(num_queries + 1, dtype=np.int32), 1, "per_query")


def check_capture(capture) -> Capture:
    if not isinstance(capture, Capture):
        raise KernelTypeError(
            f"capture must be a sparseattn.pageweaver.Capture, got {type(capture).__name__}"
        )
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


def _torch_union(q, k_cache, v_cache, k_scale, v_scale, capture, grouping, scale, out):
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

    args = [
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
        union_forward(*args, capture, grouping, scale, outs)
    return tuple(out)


def union_forward(q, k_cache, v_cache, k_scale, v_scale, capture: Capture, grouping, scale=None, out=None):
    """PageWeaver's union attention (see the module docstring for shapes).

    Args:
        grouping: a :class:`Grouping` (groups of at most 8 queries; validated), a
            :class:`~sparseattn.pageweaver.grouping_gpu.DeviceGrouping` (the GPU search's output, used
            without a host synchronisation), or ``(ids, offsets)`` int32 device arrays (shapes checked;
            :func:`check_device_grouping` validates the contents on request).
        scale: softmax scale (default ``1/sqrt(128)``).
        out: optional ``(o, lse)`` to write into.
    """
    if launch.is_torch_tensor(q):
        return _torch_union(q, k_cache, v_cache, k_scale, v_scale, capture, grouping, scale, out)
    capture = check_capture(capture)
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
    ids, offsets, num_groups, group_count = _device_grouping(grouping, capture, device)
    import cupy

    if out is None:
        with cupy.cuda.Device(device):
            o = cupy.zeros(q.shape, dtype=q.dtype)
            lse = cupy.full((hq, nq), -np.inf, dtype=cupy.float32)
    else:
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
    cap = _device_capture(capture, device)
    with cupy.cuda.Device(device):
        fn = launch.prepare(launch.function(SOURCE, KERNEL, NAME_EXPRESSIONS), SMEM_BYTES)
        counter = _counter(device)
        stream = cupy.cuda.get_current_stream()
        cupy.cuda.runtime.memsetAsync(counter.data.ptr, 0, 4, stream.ptr)
        items = num_groups * hkv
        grid = (max(1, min(launch.sm_count(device), items)),)
        args = (
            q,
            k_cache,
            v_cache,
            k_scale,
            v_scale,
            o,
            lse,
            ids,
            offsets,
            np.uint64(0) if group_count is None else group_count,
            cap["pages"],
            cap["positions"],
            counter,
            np.int32(num_groups),
            np.int32(hkv),
            np.int32(hq // hkv),
            np.int32(nq),
            np.int32(capture.k),
            np.int32(capture.num_pages),
            np.int32(int(math.log2(capture.page_size))),
            np.int32(capture.context),
            np.int32(1 if capture.causal else 0),
            np.float32(scale * math.log2(math.e)),
        )
        if items:
            fn(grid, (THREADS,), args, shared_mem=SMEM_BYTES)
    return o, lse


_COUNTERS: dict = {}


def _counter(device: int):
    import cupy

    c = _COUNTERS.get(device)
    if c is None:
        c = _COUNTERS[device] = cupy.zeros(1, dtype=cupy.int32)
    return c
