"""``launch.side_by_side`` (CPU, on a stand-in for CuPy's stream API): every launch but the last runs on
a side stream that first waits for the current stream, the last on the current stream, which then waits
for the side stream; one launch runs as it is."""

from __future__ import annotations

import sys
import types

import pytest

from sparseattn.kernels import launch


class _Stream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def record(self):
        self.log.append(("record", self.name))
        return f"event@{self.name}"

    def wait_event(self, event):
        self.log.append(("wait", self.name, event))

    def __enter__(self):
        self.log.append(("enter", self.name))
        _FakeCupy.current = self

    def __exit__(self, *exc):
        self.log.append(("exit", self.name))
        _FakeCupy.current = _FakeCupy.main


class _FakeCupy:
    current = main = None


@pytest.fixture
def fake_cupy(monkeypatch):
    log = []
    _FakeCupy.main = _FakeCupy.current = _Stream("main", log)
    cupy = types.ModuleType("cupy")
    cuda = types.SimpleNamespace(
        get_current_stream=lambda: _FakeCupy.current,
        Stream=lambda non_blocking: _Stream("side", log),
        runtime=types.SimpleNamespace(getDevice=lambda: 0),
    )
    cupy.cuda = cuda
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(launch, "_SIDE_STREAMS", {})
    return log


def _launch(name, log):
    return lambda: log.append(("launch", name, _FakeCupy.current.name))


def test_launches_run_side_by_side(fake_cupy):
    log = fake_cupy
    launch.side_by_side([_launch("pairs", log), _launch("64-rows", log), _launch("plain", log)])
    assert log == [
        ("record", "main"),
        ("wait", "side", "event@main"),  # the side stream starts after what is queued so far
        ("enter", "side"),
        ("launch", "pairs", "side"),
        ("launch", "64-rows", "side"),
        ("exit", "side"),
        ("launch", "plain", "main"),  # the largest launch, queued after the others
        ("record", "side"),
        ("wait", "main", "event@side"),  # and the current stream waits for the side stream
    ]


def test_one_launch_runs_on_the_current_stream(fake_cupy):
    log = fake_cupy
    launch.side_by_side([_launch("plain", log)])
    launch.side_by_side([])
    assert log == [("launch", "plain", "main")]


def test_plan_launches_go_largest_last(monkeypatch):
    """A backward recipe runs one launch per (route, plain / pair) range of the plan side by side, the one
    streaming the most pages last; each launch covers its range's items."""
    import types

    import numpy as np

    from sparseattn import builders
    from sparseattn.kernels import bsa_backward
    from sparseattn.layouts import video_layout
    from sparseattn.planning.pair_backward import pair_backward_plan
    from sparseattn.planning.tile_plan import first_pair_items

    layout = video_layout((7, 9, 11), (4, 4, 8), block_size=128)  # 128-row blocks, partial ones at edges
    graph = builders.random_graph(layout, layout, heads=2, density=0.4, seed=6)
    plan = pair_backward_plan(graph)
    arrays = dict(plan.device_arrays(), first_pair_item=first_pair_items(plan))
    launched = []
    monkeypatch.setattr(bsa_backward.launch, "prepare", lambda fn, smem: None)

    class Packed:  # records (first item (after the plan arrays), items, pair) in the order launches are made
        def __init__(self, fn, grid, block, args, smem=0, bound=None):
            launched.append((int(args[7]), int(grid[0]), fn.pair))

    monkeypatch.setattr(bsa_backward.launch, "PackedLaunch", Packed)

    def kernel_of(rows, pair):
        return types.SimpleNamespace(pair=pair), 0, 128

    recipe = bsa_backward.BackwardRecipe()
    kind, steps = bsa_backward._route_steps(recipe, plan, arrays, kernel_of, (), (1, 1, 16, 16), 1.0)
    ranges = list(bsa_backward._launch_ranges(plan, arrays))
    assert kind == "side" and len(steps) == len(ranges) >= 2
    pages = [int(plan.stream_indptr[b]) - int(plan.stream_indptr[a]) for _, a, b, _ in ranges]
    assert sorted((a, b - a, pair) for _, a, b, pair in ranges) == sorted(launched)
    by_start = {a: p for (_, a, _, _), p in zip(ranges, pages)}
    assert [by_start[first] for first, _, _ in launched] == sorted(pages)
    assert np.any([pair for _, _, pair in launched]) and not all(pair for _, _, pair in launched)


def test_packed_arguments_keep_their_c_types():
    """Kernel arguments packed for ``cuLaunchKernel``: numpy scalars keep their width and kind, arrays pass
    a pointer, anything else (a Python int: which width?) is refused."""
    import ctypes
    import types

    import numpy as np
    import pytest

    from sparseattn.kernels.validate import KernelTypeError

    array = types.SimpleNamespace(data=types.SimpleNamespace(ptr=0xABC0))
    args = (np.int32(-3), np.uint32(7), np.int64(1 << 40), np.uint64(0xDEAD), np.float32(0.5), array)
    slots, params, held = launch.pack_arguments(args)
    assert [type(s) for s in slots] == [
        ctypes.c_int32,
        ctypes.c_uint32,
        ctypes.c_int64,
        ctypes.c_uint64,
        ctypes.c_float,
        ctypes.c_uint64,
    ]
    assert [s.value for s in slots] == [-3, 7, 1 << 40, 0xDEAD, 0.5, 0xABC0]
    assert [params[i] for i in range(len(slots))] == [ctypes.addressof(s) for s in slots]
    assert held == [array]
    with pytest.raises(KernelTypeError, match="argument 1"):
        launch.pack_arguments((np.int32(1), 5))
