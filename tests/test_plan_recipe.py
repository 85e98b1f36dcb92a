"""The device planner's recorded calls (``planning.plan_recipe``, CPU, on a stand-in for CuPy): a later call
of one shape replays the first one's launches with its own buffers and selection, and issues exactly what
a call through the launchers would (every kernel, grid, block, shared memory and argument; the pointers
into the call's buffers at the same offsets, the selection's pointers the new selection's)."""

from __future__ import annotations

import itertools
import types
from typing import ClassVar

import cupy_stand_in
import numpy as np
import pytest
from device_plan_cases import random_case

from sparseattn.kernels import launch
from sparseattn.kernels import planner as launchers
from sparseattn.planning import device as device_planning
from sparseattn.planning.device import DevicePlanner

_POINTERS = itertools.count(0x10_0000_0000, 0x100_0000)


class _DeviceArray:
    """A CuPy array stand-in with a fresh fake device pointer (its module passes ``is_cupy_array``)."""

    __module__ = "cupy.fake"

    def __init__(self, x=None, dtype=None, shape=None):
        x = np.zeros(x, dtype=dtype) if isinstance(x, int) else np.asarray(x)
        self.dtype, self.shape = (x.dtype, x.shape) if dtype is None or shape is None else (dtype, shape)
        self.data = types.SimpleNamespace(ptr=next(_POINTERS), device_id=0)
        self.flags = types.SimpleNamespace(c_contiguous=True)
        self.__cuda_array_interface__ = {}


def _empty(n, dtype=None):
    return _DeviceArray(int(n), dtype=np.uint8)


class _Kernel:
    """``launch.function``'s stand-in: a call logs (name, grid, block, shared memory, argument values)."""

    def __init__(self, name, log):
        self.name, self.log = name, log
        self.kernel = types.SimpleNamespace(ptr=1)
        self.max_dynamic_shared_size_bytes = 0

    def __call__(self, grid, block, args, shared_mem=0):
        self.log.append((self.name, tuple(grid), tuple(block), int(shared_mem), [_value(a) for a in args]))


def _value(a):
    if isinstance(a, np.uint64):
        return ("ptr", int(a))
    if hasattr(getattr(a, "data", None), "ptr"):
        return ("ptr", int(a.data.ptr))
    return ("scalar", a.item() if isinstance(a, np.generic) else a)


class _Packed:
    """``launch.PackedLaunch``'s stand-in: a call logs the kernel's arguments with the bound ones set."""

    log: ClassVar[list] = []
    calls = 0

    def __init__(self, fn, grid, block, args, smem=0, bound=None):
        launch.pack_arguments(args)  # the real packing's type checks
        self.fn, self.grid, self.block, self.smem = fn, tuple(grid), tuple(block), int(smem)
        self.args, self.bound = [_value(a) for a in args], tuple(bound or ())

    def __call__(self, stream, *values):
        args = list(self.args)
        for i, v in zip(self.bound, values):
            args[i] = ("ptr", int(v))
        _Packed.calls += 1
        _Packed.log.append((self.fn.name, self.grid, self.block, self.smem, args))


@pytest.fixture
def fake_cupy(monkeypatch):
    log: list = []
    cupy = cupy_stand_in.install(monkeypatch, asarray=_DeviceArray, empty=_empty, uint8=np.uint8)
    runtime = types.SimpleNamespace(
        memcpyDeviceToDevice=3,
        getDevice=lambda: 0,
        memsetAsync=lambda p, v, n, s: log.append(("memset", int(p), int(n))),
        memcpyAsync=lambda d, s, n, kind, st: log.append(("copy", int(d), int(s), int(n))),
    )
    cupy.cuda = types.SimpleNamespace(
        Device=cupy_stand_in.NoDevice,
        runtime=runtime,
        get_current_stream=lambda: types.SimpleNamespace(ptr=7),
    )
    monkeypatch.setattr(launch, "function", lambda source, name, *a, **k: _Kernel(name, log))
    monkeypatch.setattr(launch, "prepare", lambda fn, smem: fn)
    monkeypatch.setattr(launch, "PackedLaunch", _Packed)
    monkeypatch.setattr(launch, "side_by_side", lambda calls: [go() for go in calls])
    _Packed.log = log
    return log


def _normalized(log, base: int, nbytes: int, selection: dict):
    """The log with pointers into the call's buffers as offsets and the selection's as names."""
    names = {p: n for n, p in selection.items()}

    def norm(v):
        if v[0] != "ptr":
            return v
        p = v[1]
        if base <= p < base + nbytes:
            return ("arena", p - base)
        return ("selection", names[p]) if p in names else v

    out = []
    for entry in log:
        if entry[0] == "memset":
            out.append(("memset", norm(("ptr", entry[1])), entry[2]))
        elif entry[0] == "copy":
            out.append(("copy", norm(("ptr", entry[1])), norm(("ptr", entry[2])), entry[3]))
        else:
            name, grid, block, smem, args = entry
            out.append((name, grid, block, smem, [norm(a) for a in args]))
    return out


def _selection(case, rng):
    if case.mask is not None:
        return {"mask": _DeviceArray(rng.random(case.mask.shape) < 0.4)}
    idx = rng.integers(0, case.k.num_blocks, size=case.q2k_idx.shape).astype(np.int32)
    num = rng.integers(0, idx.shape[-1] + 1, size=case.q2k_num.shape).astype(np.int32)
    return {"q2k_idx": _DeviceArray(idx), "q2k_num": _DeviceArray(num)}


def _pointers(sel: dict) -> dict:
    key = {"mask": "mask", "q2k_idx": "idx", "q2k_num": "num"}
    return {key[n]: int(a.data.ptr) for n, a in sel.items()}


@pytest.mark.parametrize("index", range(12))
@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "in-order"])
def test_a_replayed_call_issues_what_the_launchers_would(fake_cupy, monkeypatch, index, overlap):
    rng = np.random.default_rng(900 + index)
    case = random_case(rng, index)
    log = fake_cupy

    def call(planner, sel):
        log.clear()
        plans = planner.plan(**sel)
        return plans, _normalized(log, plans.arena.base, plans.arena.nbytes, _pointers(sel))

    planner = DevicePlanner(case.q, case.k, kind=case.kind, route=case.route, overlap_backward=overlap)
    first, recorded = call(planner, _selection(case, rng))
    assert recorded and any(e[0] == "plan_items" for e in recorded)
    second_sel = _selection(case, rng)
    _Packed.calls = 0
    second, replayed = call(planner, second_sel)
    assert _Packed.calls == sum(e[0] not in ("memset", "copy") for e in replayed), "not replayed"
    assert second.arena.base != first.arena.base
    # the same call through the launchers: a planner that does not replay
    monkeypatch.setattr(device_planning, "REPLAY", False)
    fresh_planner = DevicePlanner(case.q, case.k, kind=case.kind, route=case.route, overlap_backward=overlap)
    _, through_launchers = call(fresh_planner, second_sel)
    # one planner: the replay issues the recording, buffers at the same offsets, the selection by name
    assert replayed == recorded
    # another planner through the launchers issues the same (its tables are its own uploads: any other
    # non-null pointer compared by position)
    tables = lambda seq: [
        e
        if e[0] in ("memset", "copy")
        else (*e[:4], [("table",) if a[0] == "ptr" and a[1] else a for a in e[4]])
        for e in seq
    ]
    assert tables(replayed) == tables(through_launchers)
    # the plans returned point into the second call's buffers at the first call's offsets
    for part in ("forward", "backward", "dq"):
        a, b = getattr(first, part), getattr(second, part)
        assert (a is None) == (b is None)
        if a is None:
            continue
        for name, value in a.arrays.items():
            if (
                isinstance(value, np.uint64)
                and first.arena.base <= int(value) < first.arena.base + first.arena.nbytes
            ):
                assert int(b.arrays[name]) - second.arena.base == int(value) - first.arena.base, name


def test_changed_launcher_settings_record_anew(fake_cupy, monkeypatch):
    """A planner's recording is keyed by the launchers' settings: after ``ITEMS_WRITE`` changes, a call of
    the same shape goes through the launchers again (and launches the other write form)."""
    rng = np.random.default_rng(77)
    case = random_case(rng, 3)
    planner = DevicePlanner(case.q, case.k, kind=case.kind, route=case.route)
    planner.plan(**_selection(case, rng))
    planner.plan(**_selection(case, rng))
    assert len(planner._recipes) == 1
    monkeypatch.setattr(launchers, "ITEMS_WRITE", "coalesced")
    planner.plan(**_selection(case, rng))
    assert len(planner._recipes) == 2


def _topk_case():
    rng = np.random.default_rng(31)
    for index in itertools.count():
        case = random_case(rng, index)
        if case.q2k_idx is not None and case.q2k_idx.shape[-1] > 0:
            return case, rng


@pytest.mark.parametrize("fused", [True, False], ids=["fused-forward", "three-pass-forward"])
@pytest.mark.parametrize("bitmap", ["rows", "atomic"])
def test_each_planner_form_issues_its_launches_and_zeroes_what_it_reads(
    fake_cupy, monkeypatch, fused, bitmap
):
    """The forward's one pass (or its count pass, scan and write pass) and the top-k bitmap per row (or by
    atomics): which launches a call issues, and that the one memset zeroes the fused pass's claim counter and
    look-back words always and the bitmap only where the atomic kernel needs it."""
    monkeypatch.setattr(launchers, "FUSED_FORWARD", fused)
    monkeypatch.setattr(launchers, "FORWARD_SLICES", False)  # the look-back's offsets (slices: below)
    monkeypatch.setattr(launchers, "BITMAP_TOPK", bitmap)
    monkeypatch.setattr(device_planning, "REPLAY", False)
    case, rng = _topk_case()
    planner = DevicePlanner(case.q, case.k, kind=case.kind, route=case.route, backward=False)
    log = fake_cupy
    log.clear()
    plans = planner.plan(**_selection(case, rng), backward=False)
    names = [e[0] for e in log]
    assert names.count("plan_items_fused") == (1 if fused else 0)
    assert names.count("plan_items") == (0 if fused else 2)
    assert names.count("plan_scan") == (0 if fused else 1)
    assert ("plan_bitmap_from_topk_rows" in names) == (bitmap == "rows")
    assert ("plan_bitmap_from_topk" in names) == (bitmap == "atomic")
    memsets = [e for e in log if e[0] == "memset"]
    assert len(memsets) == 1
    start, nbytes = memsets[0][1], memsets[0][2]
    arena = plans.arena
    for name in ("status", "forward.voids", "forward.claim", "forward.lookback"):
        offset, shape, dtype = arena.specs[name]
        assert start <= arena.base + offset and arena.base + offset + int(
            np.prod(shape)
        ) * dtype.itemsize <= (start + nbytes), name
    bitmap_offset, bitmap_shape, _ = arena.specs["bitmap"]
    covers_bitmap = start + nbytes >= arena.base + bitmap_offset + int(np.prod(bitmap_shape)) * 4
    assert covers_bitmap == (bitmap == "atomic")
    if fused:
        launch_args = next(e for e in log if e[0] == "plan_items_fused")[4]
        begin = ("ptr", int(arena.buffer("forward.begin")))
        assert launch_args[-2] == begin and launch_args[-4:-2] == [
            ("ptr", int(arena.buffer("forward.lookback"))),
            ("ptr", int(arena.buffer("forward.claim"))),
        ]
        assert launch_args[-1] == ("ptr", 0)  # no slices: the offsets by look-back


def test_forward_slices_pass_the_layout_bounds_and_size_the_buffer(fake_cupy, monkeypatch):
    """With ``planner.FORWARD_SLICES`` the fused pass gets the template's slices (one upload per width, kept
    by the planner, the same pointer in a replayed call) and the stream buffer holds every head's slices."""
    monkeypatch.setattr(launchers, "FORWARD_SLICES", True)
    case, rng = _topk_case()
    planner = DevicePlanner(case.q, case.k, kind=case.kind, route=case.route)
    log = fake_cupy
    pointers = []
    for _ in range(2):  # recorded, then replayed
        log.clear()
        plans = planner.plan(**_selection(case, rng))
        pointers.append(next(e for e in log if e[0] == "plan_items_fused")[4][-1])
    k = case.q2k_idx.shape[-1]
    (uploaded,) = planner._slices.values()
    want = planner.forward.stream_slices(k)
    assert uploaded.shape == want.shape and uploaded.dtype == np.int64
    assert pointers[0] == pointers[1] == ("ptr", int(uploaded.data.ptr))
    heads = case.batch * case.heads
    _, shape, _ = plans.arena.specs["forward.stream_entries"]
    assert shape == (heads * int(want[-1]), 2)
    assert want[-1] >= planner.forward.stream_capacity(1, k)  # never smaller than the back-to-back bound


def test_an_unknown_bitmap_form_is_refused(monkeypatch):
    monkeypatch.setattr(launchers, "BITMAP_TOPK", "both")
    with pytest.raises(ValueError, match="BITMAP_TOPK"):
        launchers.topk_by_rows(8, 4)


def test_the_look_back_sleep_compiles_into_the_fused_pass_only(fake_cupy, monkeypatch):
    """``planner.LB_SLEEP_NS`` away from its default compiles the fused pass with ``PLAN_LB_SLEEP_NS`` (the
    other kernels as before), and ``LB_SLEEP_MAX_NS`` above it ``PLAN_LB_SLEEP_MAX_NS``; a value out of range is refused before any launch, naming the setting."""
    requested = []
    real = launch.function
    monkeypatch.setattr(
        launch,
        "function",
        lambda source, name, *a, **k: requested.append((name, a[1:] or ())) or real(source, name),
    )
    monkeypatch.setattr(device_planning, "REPLAY", False)
    monkeypatch.setattr(launchers, "LB_SLEEP_NS", 256)
    case, rng = _topk_case()
    DevicePlanner(case.q, case.k, kind=case.kind, route=case.route).plan(**_selection(case, rng))
    with_define = {
        name for name, extra in requested if any("PLAN_LB_SLEEP_NS=256" in d for d in sum(extra, ()))
    }
    assert with_define == {"plan_items_fused"}
    requested.clear()
    monkeypatch.setattr(launchers, "LB_SLEEP_MAX_NS", 1024)
    DevicePlanner(case.q, case.k, kind=case.kind, route=case.route).plan(**_selection(case, rng))
    with_max = {
        name for name, extra in requested if any("PLAN_LB_SLEEP_MAX_NS=1024" in d for d in sum(extra, ()))
    }
    assert with_max == {"plan_items_fused"}
    monkeypatch.setattr(launchers, "LB_SLEEP_MAX_NS", 2_000_000)
    fake_cupy.clear()
    with pytest.raises(ValueError, match="LB_SLEEP_MAX_NS"):
        DevicePlanner(case.q, case.k, kind=case.kind, route=case.route).plan(**_selection(case, rng))
    assert not fake_cupy
    monkeypatch.setattr(launchers, "LB_SLEEP_MAX_NS", 0)
    monkeypatch.setattr(launchers, "LB_SLEEP_NS", -1)
    fake_cupy.clear()
    with pytest.raises(ValueError, match="LB_SLEEP_NS"):
        DevicePlanner(case.q, case.k, kind=case.kind, route=case.route).plan(**_selection(case, rng))
    assert not fake_cupy


@pytest.mark.parametrize("forward_first", [False, True], ids=["backward-first", "forward-first"])
def test_the_chains_are_issued_in_the_order_asked(fake_cupy, monkeypatch, forward_first):
    """``device.FORWARD_FIRST``: the forward's chain (pair matching, fused pass, sort) is issued before the
    backward's (transpose, count, ...), recorded and replayed alike; off, the backward's first."""
    monkeypatch.setattr(device_planning, "FORWARD_FIRST", forward_first)
    case, rng = _topk_case()
    planner = DevicePlanner(case.q, case.k, kind=case.kind, route=case.route)
    log = fake_cupy
    for _ in range(2):  # recorded, then replayed
        log.clear()
        planner.plan(**_selection(case, rng))
        names = [e[0] for e in log]
        fused, transpose = names.index("plan_items_fused"), names.index("plan_bitmap_transpose")
        assert (fused < transpose) == forward_first
