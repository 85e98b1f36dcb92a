"""The backward's recipe cache (``kernels.bsa_backward.backward_recipe``; CPU, on a stand-in for CuPy): a
recipe whose dQ pass runs a device planner's dQ plan (raw pointers into that call's memory) is never
reused for another call's plan, even when CPython gives the new plan the freed one's ``id()``; a host dQ
plan's cached recipe keeps that plan alive."""

from __future__ import annotations

import types

import cupy_stand_in
import numpy as np
import pytest
from small_cases import make_graph, small_layouts

from sparseattn.kernels import bsa_backward
from sparseattn.planning.cache import plan_of
from sparseattn.planning.device import DeviceOwnedPlan


class _Uploaded(np.ndarray):
    @property
    def data(self):
        return types.SimpleNamespace(ptr=0x10000000 + (self.__array_interface__["data"][0] & 0xFFFFFF))


@pytest.fixture
def fake_cupy(monkeypatch):
    cupy_stand_in.install(monkeypatch, asarray=lambda a: np.asarray(a).view(_Uploaded))


def _device_dq_plan(base: int, heads: int) -> DeviceOwnedPlan:
    """A Q-owned plan as the device planner returns it: raw pointers into an arena at ``base``."""
    names = ("work_head", "own_pages", "stream_indptr", "stream_pages", "order")
    arrays = {n: np.uint64(base + 256 * i) for i, n in enumerate(names)}
    arrays.update(
        pair_pages=None, own_page_mask=np.uint64(base + 4096), stream_page_mask=np.uint64(base + 8192)
    )
    return DeviceOwnedPlan(arrays, "q", ((64, 64),), ((0, 0, 4, False),), heads, 4, 8, None, 0, object())


def _packed_values(recipe) -> set:
    out = set()
    for step in recipe.steps:
        launches = step[1] if step[0] == "side" else [step] if step[0] == "launch" else []
        for _, packed, _ in launches:
            out |= {getattr(slot, "value", None) for slot in packed.slots}
    return out


def test_a_device_dq_plan_is_never_served_a_cached_recipe(fake_cupy):
    q_layout, k_layout = small_layouts("video-5x7x9-tile2x4x4-B64-inplace")
    graph = make_graph(q_layout, k_layout, 2, 0.4, 0)
    kv_plan = plan_of(graph, "kpage", "auto", owner="kv")
    sizes = (1, graph.heads, q_layout.num_slots, k_layout.num_slots, 128)
    for step in range(12):  # a training loop: a new device dQ plan per step, the previous one dropped
        base = 0xA0000000 + step * 0x100000
        dq_plan = _device_dq_plan(base, graph.heads)
        recipe = bsa_backward._recipe_of(kv_plan, dq_plan, None, "wgmma_dq_pass", False, sizes, 0.088, 0)
        assert base in _packed_values(recipe), f"step {step} ran a recipe of an earlier, freed dQ plan"
        del dq_plan, recipe


def test_a_cached_recipe_keeps_its_host_dq_plan(fake_cupy):
    q_layout, k_layout = small_layouts("video-5x7x9-tile2x4x4-B64-inplace")
    graph = make_graph(q_layout, k_layout, 2, 0.4, 0)
    kv_plan = plan_of(graph, "kpage", "auto", owner="kv")
    dq_plan = plan_of(graph, "kpage", "auto", owner="q")
    sizes = (1, graph.heads, q_layout.num_slots, k_layout.num_slots, 128)
    first = bsa_backward._recipe_of(kv_plan, dq_plan, None, "wgmma_dq_pass", False, sizes, 0.088, 0)
    assert first.dq_plan is dq_plan
    assert bsa_backward._recipe_of(kv_plan, dq_plan, None, "wgmma_dq_pass", False, sizes, 0.088, 0) is first


#: The arena buffers of a device K/V-owned plan with pair items.
KV_ARRAYS = ("work_head", "own_pages", "stream_indptr", "stream_pages", "order", "pair_pages")


def _device_kv_plan(arena, heads: int, tables: dict, pair: bool = True) -> DeviceOwnedPlan:
    """A K/V-owned plan as the device planner returns it: its arrays in ``arena`` (at the offsets of its
    buffers), the layout's page masks in ``tables`` (outside every arena), with or without pair items."""
    arrays = {n: arena.buffer(f"backward.{n}") for n in KV_ARRAYS}
    if not pair:
        arrays["pair_pages"] = None
    arrays.update(own_page_mask=tables["o_mask"], stream_page_mask=tables["t_mask"])
    launches = ((0, 0, 4, pair), (1, 4, 6, False))
    return DeviceOwnedPlan(arrays, "kv", ((128, 128), (128, 128)), launches, heads, 6, 8, None, 0, arena)


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "per-call"])
def test_device_plans_of_one_arena_shape_share_one_recipe(fake_cupy, monkeypatch, shared):
    """With ``SHARED_DEVICE_RECIPES``: the device planner writes each call's plans into a new arena of one
    shape; the backward's recipe is packed once for the shape, names the plans' arrays by their offsets in
    the arena, and each run binds that call's arena; the layout tables, outside every arena, stay fixed
    arguments. Without it (the default until its GPU run): each call packs its own recipe over raw pointers."""
    from sparseattn.planning.device import Arena

    monkeypatch.setattr(bsa_backward, "SHARED_DEVICE_RECIPES", shared)

    proto = Arena({f"backward.{n}": ((64,), np.int32) for n in KV_ARRAYS})
    proto.base = 0
    offsets = {proto.specs[f"backward.{n}"][0] for n in KV_ARRAYS}
    tables = {"o_mask": np.uint64(0x7000000), "t_mask": np.uint64(0x7100000)}
    sizes = (1, 2, 512, 512, 128)
    recipes = []
    for call in range(2):
        arena = proto.rebased()
        arena.base = 0xB0000000 + call * 0x100000
        plan = _device_kv_plan(arena, 2, tables)
        recipe = bsa_backward._recipe_of(plan, None, None, "wgmma", False, sizes, 0.088, 0)
        recipes.append(recipe)
        pointers = bsa_backward.arena_pointers(plan)
        assert int(tables["o_mask"]) in _packed_values(recipe), "a layout table is not a fixed argument"
        if not shared:
            assert pointers == {} and arena.base + min(offsets) in _packed_values(recipe)
            continue
        assert pointers == {bsa_backward.ARENA: arena.base}
        main = next(step for step in recipe.steps if step[0] == "side")[1]
        in_arena = {pointers[n] + off for _, _, bound in main for n, off in bound if n == bsa_backward.ARENA}
        assert in_arena and {p - arena.base for p in in_arena} <= offsets
    assert (recipes[0] is recipes[1]) == shared


def _in_arena(plan: DeviceOwnedPlan, base: int) -> DeviceOwnedPlan:
    """``plan`` with an arena at ``base`` holding its arrays (as the planner's allocations do)."""
    from dataclasses import replace

    from sparseattn.planning.device import Arena

    arena = Arena({"all": ((1 << 18,), np.uint8)})
    arena.base = base
    return replace(plan, arena=arena)


def test_shared_recipes_never_bind_a_dq_plan_of_another_allocation(fake_cupy, monkeypatch):
    """With ``SHARED_DEVICE_RECIPES``: a device dQ plan beside a host K/V plan, or beside a device K/V plan
    in another allocation, keeps raw pointers (every bound name is a tensor the run supplies), and its
    recipe is not cached."""
    from sparseattn.planning.device import Arena

    monkeypatch.setattr(bsa_backward, "SHARED_DEVICE_RECIPES", True)
    q_layout, k_layout = small_layouts("video-5x7x9-tile2x4x4-B64-inplace")
    graph = make_graph(q_layout, k_layout, 2, 0.4, 0)
    host_kv = plan_of(graph, "kpage", "auto", owner="kv")
    tables = {"o_mask": np.uint64(0x7000000), "t_mask": np.uint64(0x7100000)}
    sizes = (1, graph.heads, q_layout.num_slots, k_layout.num_slots, 128)
    tensors = set(bsa_backward.TENSORS)
    for step in range(2):
        base = 0xC0000000 + step * 0x1000000
        dq_plan = _in_arena(_device_dq_plan(base, graph.heads), base)
        kv_arena = Arena({f"backward.{n}": ((64,), np.int32) for n in KV_ARRAYS})
        kv_arena.base = base + 0x800000  # another allocation than the dQ plan's
        device_kv = _device_kv_plan(kv_arena, graph.heads, tables, pair=False)
        for kv in (host_kv, device_kv):
            recipe = bsa_backward._recipe_of(kv, dq_plan, None, "wgmma_dq_pass", False, sizes, 0.088, 0)
            steps = [s for step_ in recipe.steps if step_[0] == "side" for s in step_[1]]
            bound = {n for _, _, names in steps for n, _ in names}
            assert bound <= tensors, f"names no run binds: {bound - tensors}"
            assert base in _packed_values(recipe), "the dQ plan's own pointers are not in its launches"
