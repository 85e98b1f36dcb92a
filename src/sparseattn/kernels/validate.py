"""Checks every kernel wrapper runs before a launch, so bad input never reaches the GPU.

Tensors must be CuPy arrays on the GPU. Detection does not import CuPy (a numpy array is refused
with a clear message on a machine without CuPy). bf16 tensors are accepted either as CuPy's
``bfloat16`` dtype (where CuPy/ml_dtypes provide it) or as ``uint16`` arrays holding bf16 bits.

Errors name the argument: :class:`KernelTypeError` (a ``TypeError``) for wrong kinds/dtypes,
:class:`KernelValueError` (a ``ValueError``) for shapes, layouts and index ranges.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from ..constants import PAGE_ROWS
from ..planning.tile_plan import TilePlan


class KernelTypeError(TypeError):
    """A kernel argument has the wrong type or dtype; the message names the argument."""


class KernelValueError(ValueError):
    """A kernel argument has a wrong shape, layout or index; the message names the argument."""


#: dtype names accepted as bf16 storage (``uint16`` = raw bf16 bits).
BF16_DTYPE_NAMES = ("bfloat16", "uint16")


# ---- bf16 bits on the host ------------------------------------------------------------------


def float_to_bf16_bits(x) -> np.ndarray:
    """uint16 bf16 bits of ``x``: :func:`sparseattn.bf16.float_to_bf16_bits`."""
    from ..bf16 import float_to_bf16_bits as to_bits

    return to_bits(x)


def bf16_bits_to_float(bits) -> np.ndarray:
    """float32 values of bf16 bits: :func:`sparseattn.bf16.bf16_bits_to_float`."""
    from ..bf16 import bf16_bits_to_float as to_float

    return to_float(bits)


# ---- tensors --------------------------------------------------------------------------------


CUPY_TYPES: set = set()  # array types already recognised (the check runs on every launch)
_DTYPE_NAMES: dict = {}


def is_cupy_array(x) -> bool:
    """True for a CuPy ndarray (checked without importing CuPy)."""
    t = type(x)
    if t in CUPY_TYPES:
        return True
    if t.__module__.split(".")[0] == "cupy" and hasattr(x, "__cuda_array_interface__"):
        CUPY_TYPES.add(t)
        return True
    return False


def _dtype_name(x) -> str:
    dt = getattr(x, "dtype", None)
    if dt is None:
        return type(x).__name__
    name = _DTYPE_NAMES.get(dt)
    if name is None:
        name = _DTYPE_NAMES[dt] = str(dt)
    return name


dtype_name = _dtype_name  # the dtype's name (cached per dtype object)


def check_tensor(
    name: str,
    x,
    *,
    dtype: str | Iterable[str] | None = None,
    shape=None,
    ndim: int | None = None,
    device: int | None = None,
):
    """Check a kernel tensor argument and return it.

    Args:
        name: the argument's name, used in messages.
        x: the argument; must be a C-contiguous CuPy array.
        dtype: accepted dtype name(s), e.g. ``BF16_DTYPE_NAMES`` or ``"float32"``.
        shape: expected shape; ``None`` entries match any size.
        ndim: expected number of dimensions (implied by ``shape``).
        device: expected CUDA device id.
    Raises:
        KernelTypeError: not a CuPy array, or wrong dtype.
        KernelValueError: wrong ndim/shape, not contiguous, wrong device.
    """
    if not is_cupy_array(x):
        raise KernelTypeError(
            f"{name} must be a cupy array on the GPU, got {type(x).__module__}.{type(x).__name__}"
        )
    if dtype is not None:
        names = (dtype,) if isinstance(dtype, str) else tuple(dtype)
        if _dtype_name(x) not in names:
            raise KernelTypeError(f"{name} must have dtype {' or '.join(names)}, got {_dtype_name(x)}")
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and x.ndim != ndim:
        raise KernelValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")
    if shape is not None:
        for axis, (want, got) in enumerate(zip(shape, x.shape)):
            if want is not None and int(want) != int(got):
                raise KernelValueError(
                    f"{name} must have shape {tuple(shape)} (None = any), got {tuple(x.shape)} (axis {axis})"
                )
    if not x.flags.c_contiguous:
        raise KernelValueError(f"{name} must be C-contiguous (use cupy.ascontiguousarray)")
    if device is not None:
        dev = device_of(x)
        if dev is not None and dev != int(device):
            raise KernelValueError(f"{name} is on device {dev}, expected device {device}")
    return x


def device_of(x) -> int | None:
    """CUDA device id of a CuPy array (its memory's device), without creating a Device object."""
    data = getattr(x, "data", None)
    dev = getattr(data, "device_id", None)
    if dev is None:
        dev = getattr(getattr(x, "device", None), "id", None)
    return None if dev is None else int(dev)


def check_same_device(**tensors) -> int:
    """The common device id of the named CuPy arrays; raises naming the first one that differs."""
    first_name, first_dev = None, None
    for name, x in tensors.items():
        if not is_cupy_array(x):
            raise KernelTypeError(
                f"{name} must be a cupy array on the GPU, got {type(x).__module__}.{type(x).__name__}"
            )
        dev = int(x.device.id)
        if first_dev is None:
            first_name, first_dev = name, dev
        elif dev != first_dev:
            raise KernelValueError(f"{name} is on device {dev} but {first_name} is on device {first_dev}")
    return int(first_dev) if first_dev is not None else 0


def check_scale(scale, head_dim: int) -> float:
    """The softmax scale: ``1/sqrt(head_dim)`` when ``None``; must be a finite positive number."""
    if scale is None:
        return 1.0 / float(np.sqrt(head_dim))
    try:
        s = float(scale)
    except (TypeError, ValueError):
        raise KernelTypeError(f"scale must be a number, got {type(scale).__name__}") from None
    if not math.isfinite(s) or s <= 0:
        raise KernelValueError(f"scale must be finite and positive, got {scale!r}")
    return s


def check_head_dim(name: str, head_dim: int, supported: Iterable[int]) -> int:
    supported = tuple(supported)
    if int(head_dim) not in supported:
        raise KernelValueError(f"{name} has head_dim {head_dim}; supported: {supported}")
    return int(head_dim)


# ---- plans ----------------------------------------------------------------------------------


def _check_range(field: str, arr: np.ndarray, low: int, high: int):
    if arr.size and (int(arr.min()) < low or int(arr.max()) >= high):
        bad = arr[(arr < low) | (arr >= high)].ravel()[0]
        raise KernelValueError(f"plan.{field} holds {int(bad)} outside [{low}, {high})")


def check_plan(
    plan,
    q_pages: int,
    k_pages: int,
    heads: int,
    owner: str = "q",
    tile_shapes: Iterable[tuple[int, int]] | None = None,
) -> TilePlan:
    """Check that a :class:`TilePlan` can be executed safely against tensors of the given sizes.

    Args:
        plan: the plan.
        q_pages, k_pages: 16-row pages of the Q and K/V slot spaces (``slots // 16``).
        heads: heads of the tensors.
        owner: the owner side the kernel expects (``"q"`` forward, ``"kv"`` backward).
        tile_shapes: (M, N) shapes the kernel supports; every route a work item uses must be one of them.
    Raises:
        KernelTypeError: not a TilePlan.
        KernelValueError: owner/heads mismatch, page ids or heads out of range, bad ``stream_indptr``,
            wrong mask sizes, unsupported tile shape.
    """
    if not isinstance(plan, TilePlan):
        raise KernelTypeError(f"plan must be a TilePlan, got {type(plan).__name__}")
    if plan.owner != owner:
        raise KernelValueError(f"plan.owner is {plan.owner!r}, this kernel needs owner={owner!r}")
    if int(plan.heads) != int(heads):
        raise KernelValueError(f"plan.heads is {plan.heads} but the tensors have {heads} heads")
    own_side, stream_side = (q_pages, k_pages) if owner == "q" else (k_pages, q_pages)
    arrays = plan.device_arrays()
    w = arrays["work_head"].size
    if arrays["work_route"].shape != (w,):
        raise KernelValueError(
            f"plan.work_route must have {w} entries, got shape {arrays['work_route'].shape}"
        )
    _check_range("work_route", arrays["work_route"], 0, len(plan.routes))
    _check_range("work_head", arrays["work_head"], 0, heads)
    own = arrays["own_pages"]
    if own.ndim != 2 or own.shape[0] != w:
        raise KernelValueError(f"plan.own_pages must be [{w}, max_own_pages], got shape {own.shape}")
    for m, n in plan.routes:
        if m % PAGE_ROWS or n % PAGE_ROWS or m // PAGE_ROWS > own.shape[1]:
            raise KernelValueError(
                f"plan.routes has tile {(m, n)} that does not fit own_pages width {own.shape[1]}"
            )
    if tile_shapes is not None:
        allowed = {tuple(int(v) for v in s) for s in tile_shapes}
        used = np.unique(arrays["work_route"]) if w else np.zeros(0, np.int32)
        for route in (plan.routes[int(r)] for r in used):
            if tuple(route) not in allowed:
                raise KernelValueError(
                    f"plan.routes has tile {tuple(route)}; this kernel supports {sorted(allowed)}"
                )
    _check_range("own_pages", own, -1, own_side)
    indptr = arrays["stream_indptr"]
    if indptr.shape != (w + 1,):
        raise KernelValueError(f"plan.stream_indptr must have {w + 1} entries, got shape {indptr.shape}")
    stream = arrays["stream_pages"]
    if w + 1 and (
        int(indptr[0]) != 0 or np.any(np.diff(indptr.astype(np.int64)) < 0) or int(indptr[-1]) != stream.size
    ):
        raise KernelValueError(
            "plan.stream_indptr must start at 0, be non-decreasing and end at len(stream_pages)"
        )
    _check_range("stream_pages", stream, 0, stream_side)
    if "stream_vis" in arrays:  # pair items: only 128-row items may hide entries from one half
        vis = arrays["stream_vis"]
        if vis.shape != stream.shape:
            raise KernelValueError(f"plan.stream_vis must have {stream.size} entries, got shape {vis.shape}")
        _check_range("stream_vis", vis, 1, 4)
        rows = np.repeat(np.asarray(plan.routes, dtype=np.int64)[arrays["work_route"], 0], np.diff(indptr))
        if np.any((rows != 128) & (vis != 3)):
            raise KernelValueError("plan.stream_vis may restrict entries of 128-row work items only")
    if arrays["own_page_mask"].shape != (own_side,):
        raise KernelValueError(
            f"plan.own_page_mask has {arrays['own_page_mask'].size} pages, the owner side has {own_side}"
        )
    if arrays["stream_page_mask"].shape != (stream_side,):
        raise KernelValueError(
            f"plan.stream_page_mask has {arrays['stream_page_mask'].size} pages, "
            f"the streamed side has {stream_side}"
        )
    return plan


def pages_of(name: str, slots: int) -> int:
    """Pages of a slot count; raises naming ``name`` if it is not a multiple of 16."""
    if int(slots) % PAGE_ROWS:
        raise KernelValueError(f"{name} has {slots} slots, not a multiple of {PAGE_ROWS}")
    return int(slots) // PAGE_ROWS
