"""The TMA tensor maps' host side (sparseattn.kernels.tensor_map): argument checks before the driver, the
by-value kernel argument and how a packed launch passes it. Encoding needs the GPU driver: the GPU tests
run the forward's PAGED_FWD_TMA build (tests/gpu/test_paged_forward.py)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from sparseattn.kernels import launch
from sparseattn.kernels.tensor_map import MAP_ALIGN, MAP_BYTES, MAX_ROWS, TensorMap
from sparseattn.kernels.validate import KernelValueError


@pytest.mark.parametrize("cols", [32, 96, 256])
def test_head_dims_other_than_64_and_128_are_refused(cols):
    with pytest.raises(KernelValueError, match="k: .*64 or 128 columns"):
        TensorMap(1024, cols, "k")


@pytest.mark.parametrize("rows", [0, MAX_ROWS])
def test_rows_outside_32_bit_coordinates_are_refused(rows):
    with pytest.raises(KernelValueError, match=r"v: .*\[1, 2\^31\)"):
        TensorMap(rows, 128, "v")


@pytest.mark.parametrize("offset", [2, 8, 0x1002])
def test_an_unaligned_base_address_is_refused_before_the_driver(offset):
    tm = TensorMap(4096, 128, "k")
    with pytest.raises(KernelValueError, match="k: .*16-byte aligned"):
        tm.point_at(0x7F0000000000 + offset)
    assert tm.pointer is None


def test_the_kernel_argument_is_128_aligned_bytes_that_a_packed_launch_passes_by_address():
    maps = [TensorMap(4096, 64, f"m{i}") for i in range(5)]  # several: the alignment cannot be luck
    for tm in maps:
        value = tm.kernel_argument()
        assert ctypes.sizeof(value) == MAP_BYTES
        assert ctypes.addressof(value) % MAP_ALIGN == 0
    slots, params, held = launch.pack_arguments((np.uint64(7), np.int32(3), maps[0], maps[1]))
    assert slots[2] is maps[0].kernel_argument() and held == [maps[0], maps[1]]
    assert params[2] == ctypes.addressof(maps[0].kernel_argument())
    assert params[3] == ctypes.addressof(maps[1].kernel_argument())
    assert slots[0].value == 7 and slots[1].value == 3
