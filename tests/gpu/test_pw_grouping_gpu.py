"""GPU affinity grouping (kernels_cu/pw_grouping.cu) equals the numpy reference group for group."""

from __future__ import annotations

import numpy as np
import pytest

from sparseattn.pageweaver.captures import Capture, builtin_config, generate_capture, load_capture
from sparseattn.pageweaver.grouping import GroupingError, affinity_groups, validate_grouping

pytestmark = pytest.mark.gpu


def _random_capture(rng, queries, num_pages, k, page_size=16):
    """Causal capture with random selections (fresh seed per test)."""
    context = num_pages * page_size
    positions = np.sort(rng.choice(context, queries, replace=queries > context))
    cur = positions // page_size
    score = rng.random((queries, num_pages))
    score[np.arange(num_pages)[None, :] > cur[:, None]] = -1
    top = np.argsort(-score, axis=1)[:, :k]
    ok = np.take_along_axis(score, top, axis=1) >= 0
    pages = np.sort(np.where(ok, top, num_pages), axis=1)
    return Capture(np.where(pages < num_pages, pages, -1).astype(np.int32), positions, context, page_size)


def _assert_equal(cap, group_size, window, max_union):
    from sparseattn.pageweaver.grouping_gpu import affinity_groups_gpu

    ref = affinity_groups(cap, group_size, window, max_union)
    got = affinity_groups_gpu(cap, group_size, window, max_union)
    validate_grouping(got, cap.num_queries, group_size)
    np.testing.assert_array_equal(got.ids, ref.ids)
    np.testing.assert_array_equal(got.offsets, ref.offsets)


@pytest.mark.parametrize(
    "queries,num_pages,k,group_size,window,max_union",
    [
        pytest.param(1, 1, 1, 8, 64, None, id="one-query"),
        pytest.param(100, 40, 5, 8, 64, None, id="partial-window"),
        pytest.param(257, 70, 6, 4, 33, None, id="odd-window"),
        pytest.param(300, 90, 8, 1, 16, None, id="group-of-1"),
        pytest.param(500, 300, 12, 16, 128, 30, id="capped"),
        pytest.param(700, 64, 16, 8, 1024, None, id="window-1024"),
        pytest.param(400, 4096, 16, 8, 128, 40, id="smem-over-48k"),
        pytest.param(333, 33, 33, 5, 7, 40, id="k-equals-pages"),
    ],
)
def test_gpu_grouping_equals_reference(rng, queries, num_pages, k, group_size, window, max_union):
    cap = _random_capture(rng, queries, num_pages, k)
    _assert_equal(cap, group_size, window, max_union)


@pytest.mark.parametrize("name", ["nsa_8k", "dsa_8k"])
def test_gpu_grouping_equals_reference_on_builtin(name):
    try:
        cap = load_capture(name)
    except FileNotFoundError:
        cap = generate_capture(builtin_config(name), name)
    _assert_equal(cap, 8, 64, None)
    _assert_equal(cap, 8, 64, 2 * cap.k)


def test_device_grouping_reports_group_count_on_device():
    import cupy as cp

    from sparseattn.pageweaver.grouping_gpu import affinity_groups_device

    cap = generate_capture(builtin_config("nsa_8k"), "nsa_8k")
    dev = affinity_groups_device(cp.asarray(cap.pages), cap.num_pages, 8, 64)
    assert int(dev.num_groups.get()[0]) == dev.max_groups == cap.num_queries // 8


@pytest.mark.parametrize(
    "make,kwargs,error,match",
    [
        pytest.param(lambda cp: np.zeros((4, 2), np.int32), {}, TypeError, "cupy.ndarray", id="host-array"),
        pytest.param(lambda cp: cp.zeros((4, 2), cp.float32), {}, TypeError, "int32", id="float-pages"),
        pytest.param(lambda cp: cp.zeros(8, cp.int32), {}, GroupingError, "2-D", id="1d-pages"),
        pytest.param(
            lambda cp: cp.zeros((4, 4), cp.int32)[:, ::2], {}, GroupingError, "contiguous", id="strided"
        ),
        pytest.param(
            lambda cp: cp.zeros((4, 2), cp.int32), {"window": 2048}, GroupingError, "window", id="window"
        ),
        pytest.param(
            lambda cp: cp.zeros((4, 2), cp.int32), {"max_union": 1}, GroupingError, "max_union", id="cap"
        ),
        pytest.param(
            lambda cp: cp.zeros((4, 2), cp.int32), {"num_pages": 0}, GroupingError, "num_pages", id="pages0"
        ),
        pytest.param(
            lambda cp: cp.zeros((4, 2), cp.int32),
            {"num_pages": 10**6, "window": 1024},
            GroupingError,
            "shared memory",
            id="smem",
        ),
    ],
)
def test_device_grouping_rejects_bad_input(make, kwargs, error, match):
    import cupy as cp

    from sparseattn.pageweaver.grouping_gpu import affinity_groups_device

    args = {"num_pages": 8, **kwargs}
    with pytest.raises(error, match=match):
        affinity_groups_device(make(cp), **args)


def test_out_of_range_ids_do_not_fault():
    """Ids the capture would reject are ignored by the kernel (no illegal memory access)."""
    import cupy as cp

    from sparseattn.pageweaver.grouping_gpu import affinity_groups_device

    pages = cp.asarray(np.array([[0, 1, 10**6], [-5, 2, 3], [1, 2, 3]], np.int32))
    got = affinity_groups_device(pages, 4, 2, 4).to_host()
    validate_grouping(got, 3, 2)
