"""Paged FP8 (e4m3) K/V cache: quantisation helpers and the dequantised values the kernels use.

Layout (what the PageWeaver kernels read):

* ``k``, ``v``   uint8 ``[kv_heads, num_pages · page_size, head_dim]``: e4m3 (``float8_e4m3fn``) bits,
  page ``p`` of head ``h`` = rows ``[p·P, (p+1)·P)``; rows past ``context`` are zero;
* ``k_scale``, ``v_scale`` float32 ``[kv_heads, num_pages]``: one scale per (KV head, page) — the
  value of an element is ``e4m3(bits) · scale``.

:func:`quantize_kv` picks ``scale = 2^⌈log2(amax / 448)⌉`` per (head, page) (448 is e4m3's largest
finite value; an all-zero page gets scale 1; no scale is below float32's smallest normal) and rounds to
nearest even. A power-of-two scale costs no precision (e4m3 is a floating format: the page's values
still span its binades, amax lands in (224, 448]) and makes ``e4m3 · scale`` exact in bf16. The kernels
accept any positive float32 scales and turn an element into bf16 as ``bf16(float32(e4m3) · scale)``
(one float32 product, one rounding to bf16 — none for power-of-two scales): :func:`dequantize` with
``round_bf16=True`` gives exactly those values, ``round_bf16=False`` the exact float64 values the
reference attends over.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ..bf16 import bf16_bits_to_float, float_to_bf16_bits

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E4M3_MAX = 448.0


class Fp8CacheError(ValueError):
    """An FP8 cache argument is invalid; the message names the argument."""


@dataclass(frozen=True, eq=False)
class Fp8KVCache:
    """An e4m3 K/V cache with per-(KV head, page) scales (see the module docstring)."""

    k: np.ndarray
    v: np.ndarray
    k_scale: np.ndarray
    v_scale: np.ndarray
    page_size: int
    context: int

    def __post_init__(self):
        check_cache(self.k, self.v, self.k_scale, self.v_scale, self.page_size, self.context)

    @property
    def kv_heads(self) -> int:
        return int(self.k.shape[0])

    @property
    def head_dim(self) -> int:
        return int(self.k.shape[2])

    @property
    def num_pages(self) -> int:
        return int(self.k_scale.shape[1])

    def dequantized(self, round_bf16: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(K, V) float64 ``[kv_heads, num_pages · page_size, head_dim]`` (see :func:`dequantize`)."""
        return (
            dequantize(self.k, self.k_scale, self.page_size, round_bf16),
            dequantize(self.v, self.v_scale, self.page_size, round_bf16),
        )


def check_cache(k, v, k_scale, v_scale, page_size: int, context: int) -> None:
    """Raise :class:`Fp8CacheError` (naming the argument) unless the arrays form an FP8 cache."""
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size <= 0:
        raise Fp8CacheError(f"page_size must be a positive integer, got {page_size!r}")
    if isinstance(context, bool) or not isinstance(context, (int, np.integer)) or context <= 0:
        raise Fp8CacheError(f"context must be a positive integer, got {context!r}")
    num_pages = -(-int(context) // int(page_size))
    for name, x in (("k", k), ("v", v)):
        if getattr(x, "dtype", None) not in (np.dtype(np.uint8), E4M3):
            raise Fp8CacheError(
                f"{name} must hold e4m3 values (uint8 bits or float8_e4m3fn), got {getattr(x, 'dtype', type(x).__name__)}"
            )
        if x.ndim != 3 or x.shape[1] != num_pages * page_size:
            raise Fp8CacheError(
                f"{name} must have shape [kv_heads, num_pages·page_size = {num_pages * page_size}, head_dim], got {x.shape}"
            )
    if k.shape != v.shape:
        raise Fp8CacheError(f"v must have k's shape {k.shape}, got {v.shape}")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if getattr(s, "dtype", None) != np.float32:
            raise Fp8CacheError(f"{name} must be float32, got {getattr(s, 'dtype', type(s).__name__)}")
        if s.shape != (k.shape[0], num_pages):
            raise Fp8CacheError(
                f"{name} must have shape [kv_heads, num_pages] = {(k.shape[0], num_pages)}, got {s.shape}"
            )
        if isinstance(s, np.ndarray) and not (np.isfinite(s).all() and (s > 0).all()):
            raise Fp8CacheError(f"{name} must be finite and positive")


def quantize_kv(x, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """e4m3 bits (uint8 ``[H, ⌈L/P⌉·P, d]``) and float32 scales ``[H, ⌈L/P⌉]`` of ``x`` ``[H, L, d]``."""
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size <= 0:
        raise Fp8CacheError(f"page_size must be a positive integer, got {page_size!r}")
    page_size = int(page_size)
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 3:
        raise Fp8CacheError(f"x must have shape [kv_heads, tokens, head_dim], got {x.shape}")
    if not np.isfinite(x).all():
        raise Fp8CacheError("x must be finite (e4m3fn has no infinity)")
    h, length, d = x.shape
    pages = -(-length // page_size)
    padded = np.zeros((h, pages * page_size, d), dtype=np.float32)
    padded[:, :length] = x
    blocks = padded.reshape(h, pages, page_size * d)
    amax = np.abs(blocks).max(axis=2)
    # the smallest power of two >= amax / 448 (exact, in float64), at least float32's smallest normal
    # (a page of float32 subnormals would otherwise get a subnormal or zero scale)
    mant, expo = np.frexp(amax.astype(np.float64) / E4M3_MAX)
    pow2 = np.ldexp(1.0, np.where(mant == 0.5, expo - 1, expo))
    tiny = float(np.finfo(np.float32).tiny)
    scale = np.where(amax > 0, np.maximum(pow2, tiny), 1.0).astype(np.float32)
    scaled = np.clip(blocks / scale[:, :, None], -E4M3_MAX, E4M3_MAX)
    bits = scaled.astype(E4M3).view(np.uint8).reshape(h, pages * page_size, d)
    return bits, scale


def dequantize(bits, scale, page_size: int, round_bf16: bool = False) -> np.ndarray:
    """float64 ``[H, rows, d]`` values of e4m3 ``bits`` times their page's ``scale``.

    ``round_bf16``: the kernels' bf16 operand, ``bf16(float32(e4m3) · scale)``; else exact values.
    """
    bits = np.asarray(bits)
    rows = bits.shape[1]
    values = bits.view(E4M3).astype(np.float32)
    per_row = np.repeat(np.asarray(scale, dtype=np.float32), page_size, axis=1)[:, :rows, None]
    if round_bf16:
        return bf16_bits_to_float(float_to_bf16_bits(values * per_row)).astype(np.float64)
    return values.astype(np.float64) * per_row.astype(np.float64)


def random_cache(rng, kv_heads: int, context: int, head_dim: int, page_size: int) -> Fp8KVCache:
    """A cache of quantised standard-normal K and V (tests and benchmarks)."""
    k, ks = quantize_kv(rng.standard_normal((kv_heads, context, head_dim), dtype=np.float32), page_size)
    v, vs = quantize_kv(rng.standard_normal((kv_heads, context, head_dim), dtype=np.float32), page_size)
    return Fp8KVCache(k, v, ks, vs, page_size, context)
