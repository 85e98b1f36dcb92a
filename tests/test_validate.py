"""CPU tests of the kernel argument checks (no GPU, no CuPy needed).

A small stand-in class whose module is ``cupy.*`` plays the role of a device array so every check
(dtype, shape, contiguity, device) runs here exactly as it runs on the GPU machine.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sparseattn.graph import SparseGraph
from sparseattn.kernels import validate
from sparseattn.kernels.bsa_mma_forward import bsa_mma_forward, check_inputs
from sparseattn.kernels.validate import (
    KernelTypeError,
    KernelValueError,
    bf16_bits_to_float,
    check_plan,
    check_scale,
    check_tensor,
    float_to_bf16_bits,
)
from sparseattn.layouts import contiguous_layout
from sparseattn.planning.tile_plan import bsa_plan, kpage_plan


class FakeDevice:
    def __init__(self, id):
        self.id = id


class FakeCupyArray:
    """Just enough of ``cupy.ndarray`` for the checks: dtype, shape, flags, device."""

    def __init__(self, arr, device=0):
        self._a = arr
        self.device = FakeDevice(device)

    dtype = property(lambda self: self._a.dtype)
    shape = property(lambda self: self._a.shape)
    ndim = property(lambda self: self._a.ndim)
    flags = property(lambda self: self._a.flags)

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (0, False), "version": 3}


FakeCupyArray.__module__ = "cupy._fake"


def fake(shape, dtype=np.uint16, device=0, order="C"):
    return FakeCupyArray(np.zeros(shape, dtype=dtype, order=order), device)


@pytest.fixture
def small_graph():
    q = contiguous_layout(200, 64)  # 4 blocks, last one partial
    k = contiguous_layout(150, 64)  # 3 blocks
    return SparseGraph.from_block_lists(q, k, [[[0], [0, 1], [2], []], [[1, 2], [], [0], [0, 2]]])


# ---- bf16 bits ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, bits",
    [
        (1.0, 0x3F80),
        (-2.0, 0xC000),
        (0.0, 0x0000),
        (1.0 + 2.0**-8, 0x3F80),  # tie between 0x3F80 and 0x3F81 -> even
        (1.0 + 3 * 2.0**-8, 0x3F82),  # tie between 0x3F81 and 0x3F82 -> even
        (1.0 + 2.0**-7, 0x3F81),  # exactly representable
        (float("nan"), 0x7FC0),
    ],
    ids=["one", "minus-two", "zero", "tie-down", "tie-up", "exact", "nan"],
)
def test_float_to_bf16_bits_rounds_to_nearest_even(value, bits):
    assert int(float_to_bf16_bits(np.array([value], np.float32))[0]) == bits


def test_bf16_round_trip_error_is_below_half_ulp(rng):
    x = rng.standard_normal(10_000).astype(np.float32)
    y = bf16_bits_to_float(float_to_bf16_bits(x))
    assert np.all(np.abs(x - y) <= np.abs(x) * 2.0**-8)


# ---- tensors --------------------------------------------------------------------------------------


def test_numpy_array_is_refused_naming_the_argument():
    with pytest.raises(KernelTypeError, match="q must be a cupy array on the GPU"):
        check_tensor("q", np.zeros((1, 1, 16, 64), np.uint16))


def test_wrapper_refuses_numpy_before_any_gpu_import(small_graph):
    q = np.zeros((1, 2, small_graph.q.num_slots, 64), np.uint16)
    k = np.zeros((1, 2, small_graph.k.num_slots, 64), np.uint16)
    with pytest.raises(KernelTypeError, match="q must be a cupy array"):
        bsa_mma_forward(q, k, k, small_graph)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(dtype="float32"), KernelTypeError, "x must have dtype float32, got uint16"),
        (dict(ndim=3), KernelValueError, "x must be 3-D"),
        (dict(shape=(2, None, 16, 64)), KernelValueError, r"x must have shape \(2, None, 16, 64\)"),
        (dict(device=1), KernelValueError, "x is on device 0, expected device 1"),
    ],
    ids=["dtype", "ndim", "shape", "device"],
)
def test_check_tensor_errors_name_the_argument(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        check_tensor("x", fake((1, 2, 16, 64)), **kwargs)


def test_check_tensor_refuses_non_contiguous():
    arr = FakeCupyArray(np.zeros((1, 2, 16, 64), np.uint16).transpose(0, 2, 1, 3))
    with pytest.raises(KernelValueError, match="x must be C-contiguous"):
        check_tensor("x", arr)


def test_check_tensor_accepts_matching_array():
    x = fake((1, 2, 16, 64))
    assert check_tensor("x", x, dtype=validate.BF16_DTYPE_NAMES, shape=(1, None, 16, 64), device=0) is x


@pytest.mark.parametrize(
    "scale, exc",
    [(-1.0, KernelValueError), (float("inf"), KernelValueError), ("big", KernelTypeError)],
    ids=["negative", "inf", "string"],
)
def test_check_scale_rejects(scale, exc):
    with pytest.raises(exc, match="scale"):
        check_scale(scale, 64)


def test_check_scale_default_is_inverse_sqrt_head_dim():
    assert check_scale(None, 64) == pytest.approx(0.125)


# ---- the forward wrapper's argument checks (fake device arrays) ----------------------------------


def _qkv(graph, b=1, h=2, d=64, dtype=np.uint16):
    return (
        fake((b, h, graph.q.num_slots, d), dtype),
        fake((b, h, graph.k.num_slots, d), dtype),
        fake((b, h, graph.k.num_slots, d), dtype),
    )


def test_check_inputs_accepts_valid_arguments(small_graph):
    q, k, v = _qkv(small_graph)
    plan, scale, o, _, _ = check_inputs(q, k, v, small_graph)
    assert plan.kind == "bsa" and plan.owner == "q" and scale == pytest.approx(0.125) and o is None


@pytest.mark.parametrize(
    "mutate, exc, match",
    [
        (lambda q, k, v, g: (fake(q.shape, np.float32), k, v, g), KernelTypeError, "q must have dtype"),
        (
            lambda q, k, v, g: (q, fake(k.shape, np.float32), v, g),
            KernelTypeError,
            "k must have dtype uint16",
        ),
        (lambda q, k, v, g: (q, k, fake((1, 2, 128, 64)), g), KernelValueError, "v must have shape"),
        (lambda q, k, v, g: (q, fake((1, 3) + k.shape[2:]), v, g), KernelValueError, "k must have shape"),
        (lambda q, k, v, g: (fake(q.shape[:3] + (96,)), k, v, g), KernelValueError, "q has head_dim 96"),
        (
            lambda q, k, v, g: (fake((1, 2, 16, 64)), k, v, g),
            KernelValueError,
            "graph.q has 256 slots but q has 16",
        ),
        (
            lambda q, k, v, g: (fake((1, 2, 8, 64)), k, v, g),
            KernelValueError,
            "q has 8 slots, not a multiple of 16",
        ),
        (lambda q, k, v, g: (q, k, v, "graph"), KernelTypeError, "graph_or_plan must be"),
        (
            lambda q, k, v, g: (q, fake(k.shape, device=1), fake(v.shape, device=1), g),
            KernelValueError,
            "k is on device 1 but q is on device 0",
        ),
    ],
    ids=[
        "q-dtype",
        "k-dtype",
        "v-shape",
        "k-heads",
        "head-dim",
        "q-slots",
        "q-pages",
        "graph-type",
        "device",
    ],
)
def test_check_inputs_rejects(small_graph, mutate, exc, match):
    q, k, v, g = mutate(*_qkv(small_graph), small_graph)
    with pytest.raises(exc, match=match):
        check_inputs(q, k, v, g)


def test_check_inputs_rejects_graph_with_other_heads(small_graph):
    q, k, v = _qkv(small_graph, h=3)
    with pytest.raises(KernelValueError, match="graph has 2 heads but q has 3"):
        check_inputs(q, k, v, small_graph)


def test_check_inputs_rejects_bad_out_buffers(small_graph):
    q, k, v = _qkv(small_graph)
    o = fake(q.shape)
    with pytest.raises(KernelValueError, match=r"out\[1\] \(lse\) must have shape"):
        check_inputs(q, k, v, small_graph, out=(o, fake((1, 2, 16), np.float32)))
    with pytest.raises(KernelTypeError, match="out must be a tuple"):
        check_inputs(q, k, v, small_graph, out=o)


# ---- plans ----------------------------------------------------------------------------------------


def _pages(graph):
    return graph.q.num_pages, graph.k.num_pages


def test_check_plan_accepts_bsa_and_kpage_plans(small_graph):
    for plan in (bsa_plan(small_graph), kpage_plan(small_graph)):
        assert check_plan(plan, *_pages(small_graph), heads=2) is plan


@pytest.mark.parametrize(
    "field, value, match",
    [
        (
            "stream_pages",
            lambda p: np.where(np.arange(p.stream_pages.size) == 0, 10_000, p.stream_pages),
            r"plan.stream_pages holds 10000 outside \[0, ",
        ),
        (
            "stream_pages",
            lambda p: np.where(np.arange(p.stream_pages.size) == 0, -1, p.stream_pages),
            "plan.stream_pages holds -1",
        ),
        ("own_pages", lambda p: np.where(p.own_pages >= 0, p.own_pages + 1000, -1), "plan.own_pages holds"),
        ("work_head", lambda p: p.work_head + 5, "plan.work_head holds"),
        ("stream_indptr", lambda p: p.stream_indptr[::-1].copy(), "plan.stream_indptr must start at 0"),
        ("stream_indptr", lambda p: p.stream_indptr[:-1].copy(), "plan.stream_indptr must have"),
        ("stream_page_mask", lambda p: p.stream_page_mask[:-1].copy(), "plan.stream_page_mask has"),
        ("own_pages", lambda p: p.own_pages[:, :1].copy(), "does not fit own_pages width"),
    ],
    ids=[
        "stream-page-high",
        "stream-page-negative",
        "own-page-high",
        "head",
        "indptr-order",
        "indptr-length",
        "mask-size",
        "own-width",
    ],
)
def test_check_plan_rejects_corrupt_plans(small_graph, field, value, match):
    plan = bsa_plan(small_graph)
    bad = dataclasses.replace(plan, **{field: value(plan)})
    with pytest.raises(KernelValueError, match=match):
        check_plan(bad, *_pages(small_graph), heads=2)


def test_check_plan_rejects_owner_heads_and_tile_mismatch(small_graph):
    with pytest.raises(KernelValueError, match="plan.owner is 'kv'"):
        check_plan(bsa_plan(small_graph, owner="kv"), *_pages(small_graph), heads=2)
    with pytest.raises(KernelValueError, match="plan.heads is 2 but the tensors have 4"):
        check_plan(bsa_plan(small_graph), *_pages(small_graph), heads=4)
    with pytest.raises(KernelValueError, match=r"plan.routes has tile \(64, 256\)"):
        check_plan(kpage_plan(small_graph, route=0), *_pages(small_graph), heads=2, tile_shapes=((128, 128),))
    # routes no work item uses do not matter
    check_plan(kpage_plan(small_graph, route=1), *_pages(small_graph), heads=2, tile_shapes=((128, 128),))
    with pytest.raises(KernelTypeError, match="plan must be a TilePlan"):
        check_plan(small_graph, *_pages(small_graph), heads=2)


def test_forward_wrapper_rejects_plan_with_unsupported_tile(small_graph):
    q, k, v = _qkv(small_graph)
    plan = kpage_plan(small_graph, route=0)  # 64x256: not instantiated in the forward kernel
    with pytest.raises(KernelValueError, match=r"plan.routes has tile \(64, 256\)"):
        check_inputs(q, k, v, plan)
