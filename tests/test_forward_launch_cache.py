"""The forward's cached launches (``kernels.forward._prepared``, CPU, on a stand-in for CuPy): each launch key
of one work list (tensor sizes, scale, build) gets an item counter of its own, alive as long as the work
list's arrays, so preparing a second key (e.g. the token-order build beside the slot-order one) never frees
the counter the first key's packed launch points at."""

from __future__ import annotations

import types

import cupy_stand_in
import numpy as np
import pytest
from small_cases import random_ragged_graph

from sparseattn.kernels import forward, launch

_FREED: list[int] = []  # pointers of collected _DeviceArrays


class _DeviceArray:
    """A CuPy array stand-in: a fresh fake device pointer, logged in _FREED when collected."""

    next_ptr = 0x1000

    def __init__(self, *_, **__):
        _DeviceArray.next_ptr += 512
        self.data = types.SimpleNamespace(ptr=_DeviceArray.next_ptr)

    def __del__(self):
        _FREED.append(self.data.ptr)


class _PackedLaunch:
    def __init__(self, fn, grid, block, args, smem, bound=None):
        self.args, self.bound = args, bound


@pytest.fixture
def fake_cupy(monkeypatch):
    cupy_stand_in.install(monkeypatch, zeros=_DeviceArray, asarray=_DeviceArray)
    monkeypatch.setattr(launch, "prepare", lambda fn, smem: fn)
    monkeypatch.setattr(launch, "PackedLaunch", _PackedLaunch)
    monkeypatch.setattr(launch, "_DEVICE_ARRAYS", {})
    _FREED.clear()


def test_each_launch_key_keeps_its_own_counter(fake_cupy):
    graph = random_ragged_graph(np.random.default_rng(0))
    h, sq, sk = graph.heads, graph.q.num_slots, graph.k.num_slots
    wl = forward.resolve_work(graph, "kpage", "auto", h, sq, sk)
    sizes = (2, h, sq, sk, 128)
    slot_order = forward._prepared(wl, sizes, 0.088, 0)
    tokens = (graph.q.num_tokens, graph.k.num_tokens, h, 0, False)
    token_order = forward._prepared(wl, sizes, 0.088, 0, tokens=tokens)
    qo_build = forward._prepared(wl, sizes, 0.088, 0, tokens=(*tokens[:4], True))  # the Q/O token build
    other_batch = forward._prepared(wl, (1, *sizes[1:]), 0.088, 0)
    counters = [ready[1] for ready in (slot_order, token_order, qo_build, other_batch)]
    assert len(set(counters)) == 4, "two launch keys share an item counter"
    assert not set(counters) & set(_FREED), "a cached launch points at a freed counter"
    assert forward._prepared(wl, sizes, 0.088, 0) is slot_order  # still cached, its counter alive


def _recording_runtime(cupy, calls: list):
    cupy.cuda.runtime = types.SimpleNamespace(
        memcpyDeviceToDevice=3,
        memsetAsync=lambda *args: calls.append(("memset", *args)),
        memcpyAsync=lambda *args: calls.append(("memcpy", *args)),
    )
    cupy.cuda.get_current_stream = lambda: types.SimpleNamespace(ptr=77)


def test_a_device_work_list_starts_its_counter_past_the_void_items(fake_cupy, monkeypatch):
    """A device planner's list lists its void items first: each launch copies ``first_live`` into the item
    counter (on the launch's stream) instead of zeroing it; a host list's counter is zeroed."""
    import sys

    from sparseattn.planning.device import DeviceWorkList

    calls: list = []
    _recording_runtime(sys.modules["cupy"], calls)
    monkeypatch.setattr(_PackedLaunch, "__call__", lambda self, stream, *pointers: calls.append(("launch",)))
    names = ("work_info", "work_order", "own_entries", "stream_entries", "counter", "first_live")
    arrays = {name: np.uint64(0x9000 + 256 * i) for i, name in enumerate(names)}
    wl = DeviceWorkList(arrays, num_work=40, heads=4, chunk=128, pair=False, stream_total=100, arena=None)
    sizes = (1, 4, 256, 256, 128)
    forward._launch(1, 2, 3, wl, 0.088, 4, 5, 0, sizes=sizes)
    assert calls == [("memcpy", 0x9000 + 256 * 4, 0x9000 + 256 * 5, 4, 3, 77), ("launch",)]

    calls.clear()
    graph = random_ragged_graph(np.random.default_rng(1))
    h, sq, sk = graph.heads, graph.q.num_slots, graph.k.num_slots
    host = forward.resolve_work(graph, "kpage", "auto", h, sq, sk)
    forward._launch(1, 2, 3, host, 0.088, 4, 5, 0, sizes=(1, h, sq, sk, 128))
    counter = forward._prepared(host, (1, h, sq, sk, 128), 0.088, 0)[1]
    assert calls == [("memset", counter, 0, 4, 77), ("launch",)]


def test_device_lists_of_one_arena_shape_share_one_launch(fake_cupy, monkeypatch):
    """Each call of a device planner writes its lists into a new arena of the same shape: the packed launch
    is made once for the shape and binds each call's list arrays (in ``LIST_ARRAYS`` order, after the five
    tensors) and starts each call's own counter."""
    import sys

    from sparseattn.planning.device import Arena, DeviceWorkList

    calls: list = []
    _recording_runtime(sys.modules["cupy"], calls)
    monkeypatch.setattr(_PackedLaunch, "__call__", lambda self, stream, *pointers: calls.append(pointers))
    proto = Arena({"forward.work_info": ((40, 4), np.int32)})
    proto.base = 0x10000
    names = (*forward.LIST_ARRAYS, "first_live")
    sizes = (1, 4, 256, 256, 128)
    prepared = []
    for call in range(2):
        arrays = {name: np.uint64(0x20000 * (call + 1) + 256 * i) for i, name in enumerate(names)}
        wl = DeviceWorkList(arrays, 40, 4, 128, False, 100, proto.rebased())
        prepared.append(forward._prepared(wl, sizes, 0.088, 0))
        forward._launch(1, 2, 3, wl, 0.088, 4, 5, 0, sizes=sizes)
        counter, first = int(arrays["counter"]), int(arrays["first_live"])
        assert calls[-2] == ("memcpy", counter, first, 4, 3, 77)
        assert calls[-1] == (1, 2, 3, 4, 5, *(int(arrays[name]) for name in forward.LIST_ARRAYS))
    assert prepared[0] is prepared[1], "each call packed its own launch"
    bound = [forward.KERNEL_PARAMS[i] for i in prepared[0][0].bound]
    tensors, lists = bound[:5], bound[5:]
    assert tensors == list("QKVO") + ["LSE"]
    assert lists == [
        "work_info",
        "work_order",
        "own_pages",
        "stream_pages",
        "item_counter",
    ]  # LIST_ARRAYS' order
    assert len(proto.launches) == 1


def test_a_cached_host_list_launches_without_a_pass_over_its_stream(fake_cupy, monkeypatch):
    """The launch key asks whether the list has visibility bits; on a host list that is a pass over every
    stream entry (45 instead of 25 ms per STA 69f forward when it ran at every call), so it runs once."""
    import sys

    _recording_runtime(sys.modules["cupy"], [])
    monkeypatch.setattr(_PackedLaunch, "__call__", lambda self, stream, *pointers: None)
    graph = random_ragged_graph(np.random.default_rng(2))
    h, sq, sk = graph.heads, graph.q.num_slots, graph.k.num_slots
    wl = forward.resolve_work(graph, "kpage", "auto", h, sq, sk)
    scans = []
    mask = wl.stream_mask

    class CountingMask(np.ndarray):
        def astype(self, *args, **kwargs):
            scans.append(1)
            return np.asarray(self).astype(*args, **kwargs)

    object.__setattr__(wl, "stream_mask", mask.view(CountingMask))
    wl.__dict__.pop("_has_visibility", None)
    launch_once = lambda: forward._launch(1, 2, 3, wl, 0.088, 4, 5, 0, sizes=(1, h, sq, sk, 128))
    launch_once()  # uploads the list and packs its launch
    first = len(scans)
    for _ in range(4):
        launch_once()
    assert len(scans) == first, "a cached launch converted the stream masks again"
