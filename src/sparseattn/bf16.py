"""bf16 values as raw 16-bit patterns, the storage the kernels read and write (via ``ml_dtypes``).

``float_to_bf16_bits`` rounds to the nearest bf16 (ties to even) after a conversion to float32, as
a cast on the GPU does; every NaN becomes the canonical quiet NaN ``0x7FC0``.
``bf16_bits_to_float`` is exact. Both work on host (numpy) arrays.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

#: numpy dtype of bfloat16 values.
BF16 = np.dtype(ml_dtypes.bfloat16)
#: bits of the quiet NaN every NaN is stored as.
BF16_NAN_BITS = 0x7FC0


class Bf16TypeError(TypeError):
    """A bf16 helper got something that is not an array of numbers; the message names the argument."""


class Bf16ValueError(ValueError):
    """A bf16 helper got values out of range; the message names the argument."""


def _host_array(name: str, value) -> np.ndarray:
    if hasattr(value, "__cuda_array_interface__") and not isinstance(value, np.ndarray):
        raise Bf16TypeError(f"{name} must be a host (numpy) array; copy device arrays first (.get())")
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as err:
        raise Bf16TypeError(
            f"{name} must be an array of numbers, got {type(value).__name__} ({err})"
        ) from None
    return arr


def float_to_bf16_bits(x) -> np.ndarray:
    """uint16 bf16 bits of ``x`` (real numbers of any float, integer or bf16 dtype), same shape."""
    arr = _host_array("x", x)
    if arr.dtype != BF16 and arr.dtype.kind not in "fiu":
        raise Bf16TypeError(f"x must hold real numbers, got dtype {arr.dtype}")
    with np.errstate(over="ignore"):  # beyond float32: inf, as the cast on the GPU gives
        f32 = np.asarray(arr, dtype=np.float32)
    bits = np.ascontiguousarray(f32.astype(BF16)).view(np.uint16)
    bits[np.isnan(f32)] = BF16_NAN_BITS
    return bits


def bf16_bits_to_float(bits) -> np.ndarray:
    """float32 values of bf16 bits: a uint16 array, or integers in [0, 65535]."""
    arr = _host_array("bits", bits)
    if arr.dtype != np.uint16:
        if arr.dtype.kind not in "iu":
            raise Bf16TypeError(f"bits must be uint16 bf16 bit patterns, got dtype {arr.dtype}")
        if arr.size and (arr.min() < 0 or arr.max() > 0xFFFF):
            raise Bf16ValueError(f"bits must lie in [0, 65535], got values from {arr.min()} to {arr.max()}")
        arr = arr.astype(np.uint16)
    return np.ascontiguousarray(arr).view(BF16).astype(np.float32)
