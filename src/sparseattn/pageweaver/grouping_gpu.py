"""PageWeaver's affinity grouping on the GPU (``kernels_cu/pw_grouping.cu``), equal to
:func:`sparseattn.pageweaver.grouping.affinity_groups` group for group.

:func:`affinity_groups_device` is the on-device step of a complete call: it takes the capture's page
ids already on the GPU and returns CSR ids/offsets on the GPU without a host synchronisation (two
launches: the per-window search, then a one-CTA scan that writes the offsets).
:func:`affinity_groups_gpu` wraps it for a host :class:`Capture` and returns a host :class:`Grouping`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..kernels.launch import function as get_function
from .captures import Capture
from .grouping import DEFAULT_GROUP_SIZE, DEFAULT_WINDOW, Grouping, GroupingError, _check_params

KERNEL_SOURCE = "pw_grouping.cu"
KERNELS = ("pw_affinity_group", "pw_group_offsets")
#: The module as :mod:`sparseattn.kernels.warmup` compiles it (the tuple :func:`_kernels` launches with).
SOURCE, NAME_EXPRESSIONS = KERNEL_SOURCE, KERNELS
#: Shared memory a CTA may use on the H200 (227 KB opt-in).
MAX_SHARED_BYTES = 227 * 1024
SCAN_THREADS = 1024


@dataclass
class DeviceGrouping:
    """CSR groups on the GPU: ``ids`` int32 ``[Q]``; ``offsets`` int32 ``[Q + 1]`` of which the first
    ``num_groups + 1`` are valid; ``num_groups`` int32 ``[1]`` (device); ``max_groups`` a host bound
    (exact when no union cap is set)."""

    ids: object
    offsets: object
    num_groups: object
    group_size: int
    max_groups: int

    def to_host(self) -> Grouping:
        n = int(self.num_groups.get()[0])
        return Grouping(self.ids.get(), self.offsets[: n + 1].get(), self.group_size, "affinity_gpu")


def shared_bytes(window: int, num_pages: int) -> int:
    """Dynamic shared memory of one search CTA: bitsets ``[window][words|1]`` + union + sizes."""
    words = max(1, -(-num_pages // 32))
    return 4 * (window * (words | 1) + words + window)


@functools.cache
def _kernels(device_id: int):
    """The two kernels, looked up once per device and process (the runtime hashes the source per lookup)."""
    return tuple(get_function(KERNEL_SOURCE, name, KERNELS) for name in KERNELS)


def affinity_groups_device(
    pages,
    num_pages: int,
    group_size: int = DEFAULT_GROUP_SIZE,
    window: int = DEFAULT_WINDOW,
    max_union: int | None = None,
) -> DeviceGrouping:
    """Group the queries of ``pages`` (cupy int32 ``[Q, k]``, C-contiguous, ``-1`` padded).

    Ids outside ``[0, num_pages)`` are ignored by the kernel (validate with :class:`Capture`).
    """
    import cupy as cp

    if not isinstance(pages, cp.ndarray):
        raise TypeError(f"pages must be a cupy.ndarray, got {type(pages).__name__}")
    if pages.dtype != cp.int32:
        raise TypeError(f"pages must be int32, got {pages.dtype}")
    if pages.ndim != 2 or pages.shape[1] < 1:
        raise GroupingError(f"pages must be 2-D [num_queries, k>=1], got shape {pages.shape}")
    if not pages.flags.c_contiguous:
        raise GroupingError("pages must be C-contiguous")
    device_id = cp.cuda.runtime.getDevice()
    if pages.device.id != device_id:
        raise GroupingError(f"pages is on device {pages.device.id}, the current device is {device_id}")
    if isinstance(num_pages, bool) or not isinstance(num_pages, (int, np.integer)) or num_pages < 1:
        raise GroupingError(f"num_pages must be a positive int, got {num_pages!r}")
    Q, k = (int(s) for s in pages.shape)
    _check_params(group_size, window, max_union, k)
    if Q >= 2**31 - 1 or Q * k >= 2**31:
        raise GroupingError(f"pages too large for int32 indexing: shape {pages.shape}")
    smem = shared_bytes(window, num_pages)
    if smem > MAX_SHARED_BYTES:
        raise GroupingError(
            f"window={window} × num_pages={num_pages} needs {smem} B of shared memory (> {MAX_SHARED_BYTES}); "
            "use a smaller window or a larger page size"
        )
    W, G = int(window), int(group_size)
    nW = -(-Q // W)
    ids = cp.empty(Q, dtype=cp.int32)
    offsets = cp.empty(Q + 1, dtype=cp.int32)
    num_groups = cp.empty(1, dtype=cp.int32)  # written by the scan kernel
    last = Q - (nW - 1) * W
    max_groups = ((nW - 1) * -(-W // G) + -(-last // G) if Q else 0) if max_union is None else Q
    if Q == 0:
        offsets[0] = 0
        num_groups[0] = 0
        return DeviceGrouping(ids, offsets, num_groups, G, 0)
    group_start = cp.empty(Q, dtype=cp.int32)
    window_groups = cp.empty(nW, dtype=cp.int32)
    search, scan = _kernels(device_id)
    if smem > 48 * 1024:
        search.max_dynamic_shared_size_bytes = smem
    threads = 32 * (-(-W // 32))
    cap = np.int64(2**62 if max_union is None else max_union)
    words = max(1, -(-int(num_pages) // 32))
    search(
        (nW,),
        (threads,),
        (
            pages,
            np.int32(Q),
            np.int32(k),
            np.int32(num_pages),
            np.int32(words),
            np.int32(W),
            np.int32(G),
            cap,
            ids,
            group_start,
            window_groups,
        ),
        shared_mem=smem,
    )
    scan(
        (1,),
        (SCAN_THREADS,),
        (window_groups, group_start, np.int32(nW), np.int32(W), np.int32(Q), offsets, num_groups),
    )
    return DeviceGrouping(ids, offsets, num_groups, G, max_groups)


def affinity_groups_gpu(
    capture: Capture,
    group_size: int = DEFAULT_GROUP_SIZE,
    window: int = DEFAULT_WINDOW,
    max_union: int | None = None,
) -> Grouping:
    """Host convenience: upload ``capture.pages``, run the GPU search, return a host :class:`Grouping`."""
    import cupy as cp

    if not isinstance(capture, Capture):
        raise TypeError(f"capture must be a Capture, got {type(capture).__name__}")
    dev = cp.ascontiguousarray(cp.asarray(capture.pages, dtype=cp.int32))
    return affinity_groups_device(dev, capture.num_pages, group_size, window, max_union).to_host()
