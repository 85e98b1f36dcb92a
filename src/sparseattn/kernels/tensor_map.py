"""Tensor maps for the tensor-memory accelerator (TMA): ``CUtensorMap`` values a kernel takes by value.

A :class:`TensorMap` describes a row-major bf16 matrix ``[rows, cols]`` in device memory for
``cp.async.bulk.tensor`` loads of ``[16, 64]`` boxes (16 rows of 128 bytes) with the 128-byte swizzle —
the layout ``hopper::warp_tma_pages`` writes (``kernels_cu/hopper_wgmma.cuh``) — or, given ``heads``, a
token-major ``[rows, heads, cols]`` tensor (a model's ``[batch · tokens, heads, d]``) for ``[16, 1, 64]``
boxes: 16 consecutive tokens of one head, written as the 2-D box writes them
(``hopper::warp_tma_token_pages``). The driver encodes it
(``cuTensorMapEncodeTiled``, called through ctypes on ``libcuda``: CuPy has no binding for it); the 128
bytes then go to the kernel as a ``const __grid_constant__`` parameter through
:class:`~sparseattn.kernels.launch.PackedLaunch`, which copies them at every launch, so pointing a map at
another tensor (:meth:`TensorMap.point_at`) between launches is safe.
"""

from __future__ import annotations

import ctypes
import functools

from .validate import KernelValueError

#: CUtensorMapDataType / CUtensorMapInterleave / CUtensorMapSwizzle / CUtensorMapL2promotion /
#: CUtensorMapFloatOOBfill values of ``cuda.h`` (CUDA 12 and 13).
DTYPE_BFLOAT16 = 9
INTERLEAVE_NONE = 0
SWIZZLE_128B = 3
L2_PROMOTION_128B = 2
OOB_FILL_ZERO = 0
#: The box: 16 rows (a page) of 64 bf16 columns (128 bytes, the swizzle's row).
BOX_ROWS = 16
BOX_COLS = 64
MAP_BYTES = 128
MAP_ALIGN = 64
#: Box coordinates are 32-bit signed integers.
MAX_ROWS = 1 << 31


class TensorMapError(RuntimeError):
    """The driver refused to encode or retarget a tensor map."""


@functools.cache
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    encode = lib.cuTensorMapEncodeTiled
    encode.restype = ctypes.c_int
    encode.argtypes = [
        ctypes.c_void_p,  # CUtensorMap*
        ctypes.c_int,  # data type
        ctypes.c_uint32,  # rank
        ctypes.c_void_p,  # global address
        ctypes.POINTER(ctypes.c_uint64),  # global dims (innermost first)
        ctypes.POINTER(ctypes.c_uint64),  # global strides in bytes (rank - 1)
        ctypes.POINTER(ctypes.c_uint32),  # box dims
        ctypes.POINTER(ctypes.c_uint32),  # element strides
        ctypes.c_int,  # interleave
        ctypes.c_int,  # swizzle
        ctypes.c_int,  # L2 promotion
        ctypes.c_int,  # out-of-bounds fill
    ]
    replace = lib.cuTensorMapReplaceAddress
    replace.restype = ctypes.c_int
    replace.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    return encode, replace


class TensorMap:
    """A ``CUtensorMap`` of a row-major bf16 ``[rows, cols]`` matrix (``cols`` 64 or 128) for ``[16, 64]``
    box loads with the 128-byte swizzle, or with ``heads`` of a ``[rows, heads, cols]`` tensor for
    ``[16, 1, 64]`` boxes; encoded at the first :meth:`point_at`. ``name`` names the tensor in errors."""

    __slots__ = ("_raw", "cols", "heads", "name", "pointer", "rows", "value")

    def __init__(self, rows: int, cols: int, name: str = "tensor", heads: int | None = None):
        if cols not in (64, 128):
            raise KernelValueError(f"{name}: a tensor map needs 64 or 128 columns (head dim), got {cols}")
        if not 0 < rows < MAX_ROWS:
            raise KernelValueError(
                f"{name}: a tensor map addresses rows with 32-bit coordinates: {rows} rows "
                f"(batch · heads · slots, or batch · tokens) must be in [1, 2^31)"
            )
        if heads is not None and not 0 < heads < MAX_ROWS:
            raise KernelValueError(f"{name}: a token-major tensor map needs 1 or more heads, got {heads}")
        self.rows, self.cols, self.name = int(rows), int(cols), name
        self.heads = None if heads is None else int(heads)
        self._raw = (ctypes.c_uint8 * (MAP_BYTES + MAP_ALIGN))()
        start = -ctypes.addressof(self._raw) % MAP_ALIGN
        self.value = (ctypes.c_uint8 * MAP_BYTES).from_buffer(self._raw, start)
        self.pointer = None

    def kernel_argument(self):
        """The ctypes value whose 128 bytes a launch passes (aligned to 64 bytes)."""
        return self.value

    def point_at(self, pointer: int) -> None:
        """Describe the matrix at device address ``pointer`` (16-byte aligned): encoded the first time,
        the address replaced after that (a host-only call), nothing when it is the same."""
        pointer = int(pointer)
        if pointer == self.pointer:
            return
        if pointer % 16:
            raise KernelValueError(
                f"{self.name}: the tensor-memory accelerator needs a 16-byte aligned base address, got {pointer:#x}"
            )
        encode, replace = _driver()
        if self.pointer is None:
            if self.heads is None:
                rank, dims, strides, box = 2, (self.cols, self.rows), (self.cols * 2,), (BOX_COLS, BOX_ROWS)
            else:  # [rows, heads, cols]: one head's 16 consecutive rows per box
                rank = 3
                dims = (self.cols, self.heads, self.rows)
                strides = (self.cols * 2, self.heads * self.cols * 2)
                box = (BOX_COLS, 1, BOX_ROWS)
            status = encode(
                ctypes.addressof(self.value),
                DTYPE_BFLOAT16,
                rank,
                pointer,
                (ctypes.c_uint64 * rank)(*dims),
                (ctypes.c_uint64 * (rank - 1))(*strides),
                (ctypes.c_uint32 * rank)(*box),
                (ctypes.c_uint32 * rank)(*(1,) * rank),
                INTERLEAVE_NONE,
                SWIZZLE_128B,
                L2_PROMOTION_128B,
                OOB_FILL_ZERO,
            )
            what = "cuTensorMapEncodeTiled"
        else:
            status = replace(ctypes.addressof(self.value), pointer)
            what = "cuTensorMapReplaceAddress"
        if status != 0:
            raise TensorMapError(
                f"{self.name}: {what} failed with CUresult {status} ({self.rows} x "
                f"{'' if self.heads is None else f'{self.heads} x '}{self.cols} bf16)"
            )
        self.pointer = pointer
