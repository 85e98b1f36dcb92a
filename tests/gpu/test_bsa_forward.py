"""GPU tests of the BSA forward kernel against the float64 reference.

Every case draws fresh random bf16 inputs (seed printed), fills padding slots of Q/K/V with NaN
(they must never contribute), poisons the outputs with NaN, and checks over valid query rows:
‖o − ref‖/‖ref‖ < 1e-2, |lse − ref| < 1e-3 where finite, -inf and o = 0 exactly where the row has
no key, no NaN; and that invalid query rows were not written (still NaN).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sparseattn import builders
from sparseattn.graph import SparseGraph
from sparseattn.kernels.validate import (
    KernelTypeError,
    KernelValueError,
    bf16_bits_to_float,
    float_to_bf16_bits,
)
from sparseattn.layouts import contiguous_layout, partition_layout, slot_layout, video_layout
from sparseattn.planning.tile_plan import bsa_plan, kpage_plan
from sparseattn.reference import attention_forward

pytestmark = pytest.mark.gpu

O_REL_TOL = 1e-2
LSE_ABS_TOL = 1e-3
BF16_NAN = 0x7FC0


def random_qkv(rng, graph: SparseGraph, batch: int, head_dim: int):
    """bf16 bits (numpy uint16) of random Q/K/V, NaN in every padding slot."""
    h = graph.heads
    out = []
    for layout in (graph.q, graph.k, graph.k):
        x = rng.standard_normal((batch, h, layout.num_slots, head_dim), dtype=np.float32)
        bits = float_to_bf16_bits(x)
        bits[:, :, ~layout.valid] = BF16_NAN
        out.append(bits)
    return out


def sampled_rows(graph: SparseGraph, rng, num_blocks: int):
    """(graph keeping only the pairs of ``num_blocks`` random Q blocks, bool [q slots] of their rows):
    lets a full-size workload be checked against the float64 reference in seconds."""
    chosen = rng.choice(graph.q.num_blocks, size=min(num_blocks, graph.q.num_blocks), replace=False)
    h, i, j = graph.pairs
    keep = np.isin(i, chosen)
    sub = SparseGraph.from_pairs(graph.q, graph.k, graph.heads, h[keep], i[keep], j[keep], drop_empty=False)
    rows = np.zeros(graph.q.num_blocks, dtype=bool)
    rows[chosen] = True
    return sub, np.repeat(rows, graph.q.block_size)


def run_and_check(
    rng,
    poisoned,
    graph: SparseGraph,
    batch: int,
    head_dim: int,
    plan=None,
    heads_checked=None,
    sample_q_blocks: int | None = None,
):
    import cupy

    from sparseattn.kernels.bsa_mma_forward import bsa_mma_forward

    qb, kb, vb = random_qkv(rng, graph, batch, head_dim)
    q, k, v = (cupy.asarray(x) for x in (qb, kb, vb))
    o = poisoned(q.shape, "bf16")
    lse = poisoned(q.shape[:3], "float32")
    scale = float(rng.uniform(0.5, 1.5)) / np.sqrt(head_dim)
    bsa_mma_forward(q, k, v, plan if plan is not None else graph, scale=scale, out=(o, lse))
    cupy.cuda.Device().synchronize()

    heads = np.arange(graph.heads) if heads_checked is None else np.asarray(heads_checked)
    ref_graph, rows = graph, np.ones(graph.q.num_slots, dtype=bool)
    if sample_q_blocks is not None:
        ref_graph, rows = sampled_rows(graph, rng, sample_q_blocks)
    ref_o, ref_lse = attention_forward(
        *(bf16_bits_to_float(x[:, heads]) for x in (qb, kb, vb)), ref_graph.select_heads(heads), scale=scale
    )
    o_bits = cupy.asnumpy(o)[:, heads]
    got_o = bf16_bits_to_float(o_bits).astype(np.float64)
    got_lse = cupy.asnumpy(lse)[:, heads].astype(np.float64)
    valid = graph.q.valid & rows

    vo, vr = got_o[:, :, valid], ref_o[:, :, valid]
    assert not np.isnan(vo).any(), "NaN in a valid output row"
    assert not np.isnan(got_lse[:, :, valid]).any(), "NaN in a valid LSE entry"
    rel = np.linalg.norm(vo - vr) / max(np.linalg.norm(vr), 1e-30)
    assert rel < O_REL_TOL, f"‖o − ref‖/‖ref‖ = {rel:.3e}"
    lv, lr = got_lse[:, :, valid], ref_lse[:, :, valid]
    empty = np.isneginf(lr)
    assert np.array_equal(np.isneginf(lv), empty), "LSE is -inf exactly where a row has no key"
    assert np.all(vo[empty] == 0.0), "rows without keys must have o = 0"
    lse_err = float(np.abs(lv[~empty] - lr[~empty]).max()) if (~empty).any() else 0.0
    assert lse_err < LSE_ABS_TOL, f"max |lse − ref| = {lse_err:.3e}"
    # padding query rows are never written
    pad = ~graph.q.valid
    assert np.all(o_bits[:, :, pad] == BF16_NAN), "an invalid query row of o was written"
    assert np.isnan(got_lse[:, :, pad]).all(), "an invalid query row of lse was written"
    print(f"rel err o {rel:.2e}, max lse err {lse_err:.2e}, empty rows {int(empty.sum())}")
    return rel, lse_err


def ragged_valid(rng, blocks: int, block_size: int) -> np.ndarray:
    """A slot mask with full, partial, single-page, single-row and empty blocks."""
    valid = rng.random(blocks * block_size) < 0.7
    v = valid.reshape(blocks, block_size)
    v[0] = True  # full block
    v[1] = False  # empty block
    v[2] = False
    v[2, 5] = True  # a single valid row
    v[3] = False
    v[3, 16:32] = True  # exactly one live page (not the first)
    v[4, : block_size // 2] = True  # prefix-partial
    v[4, block_size // 2 :] = False
    return valid


# ---- ragged layouts -----------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("block_size", [64, 128], ids=lambda b: f"B{b}")
def test_random_graph_partial_last_block(rng, poisoned, head_dim, block_size):
    q = contiguous_layout(int(rng.integers(700, 1100)), block_size)
    k = contiguous_layout(int(rng.integers(500, 1300)), block_size)
    graph = builders.random_graph(q, k, heads=3, density=0.5, seed=int(rng.integers(1 << 30)))
    run_and_check(rng, poisoned, graph, batch=2, head_dim=head_dim)


@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("block_size", [64, 128], ids=lambda b: f"B{b}")
def test_ragged_blocks_and_empty_selections(rng, poisoned, head_dim, block_size):
    """Single-row, single-page and empty blocks; Q blocks with no selection; selections of empty K blocks."""
    nq, nk = 8, 7
    q = slot_layout(ragged_valid(rng, nq, block_size), block_size)
    k = slot_layout(ragged_valid(rng, nk, block_size), block_size)
    mask = rng.random((2, nq, nk)) < 0.5
    mask[:, 5] = False  # Q block 5 selects nothing
    mask[0, 6] = False
    mask[0, 6, 1] = True  # selects only an empty K block -> rows without keys
    mask[:, 2, 2] = True  # single-row Q block x single-row K block
    mask[:, 3, 3] = True
    graph = SparseGraph.from_block_mask(q, k, mask, drop_empty=False)
    run_and_check(rng, poisoned, graph, batch=1, head_dim=head_dim)


@pytest.mark.parametrize("padding", ["prefix", "inplace"])
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
def test_video_layout_partial_tiles(rng, poisoned, padding, head_dim):
    # 4x4x4 cubes (B=64) and 4x4x8 tiles (B=128) over a grid that leaves partial tiles on every axis
    for tile, block in (((4, 4, 4), 64), ((4, 4, 8), 128)):
        layout = video_layout((6, 7, 13), tile, block_size=block, padding=padding)
        graph = builders.random_graph(layout, layout, heads=2, density=0.3, seed=int(rng.integers(1 << 30)))
        run_and_check(rng, poisoned, graph, batch=1, head_dim=head_dim)


@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
def test_independent_q_k_partitions(rng, poisoned, head_dim):
    n = 1500
    q = partition_layout(rng.integers(0, 9, n), block_size=128)
    k = partition_layout(rng.integers(0, 23, n), block_size=128)
    graph = builders.random_graph(q, k, heads=2, density=0.4, seed=int(rng.integers(1 << 30)))
    run_and_check(rng, poisoned, graph, batch=2, head_dim=head_dim)


@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
def test_kpage_square_route_plan_runs_on_the_same_skeleton(rng, poisoned, head_dim):
    """A KPage plan (live pages of several blocks packed into 128x128 tiles) through the same kernel."""
    layout = video_layout((5, 9, 14), (4, 4, 8), block_size=128)
    graph = builders.random_graph(layout, layout, heads=2, density=0.3, seed=int(rng.integers(1 << 30)))
    run_and_check(rng, poisoned, graph, batch=1, head_dim=head_dim, plan=kpage_plan(graph, route=1))


# ---- built-in workloads at full size (a few heads) ------------------------------------------------


@pytest.mark.parametrize("name", ["vsa_wan14b_720p", "ssta_hy15_720p"])
def test_builtin_workload_full_size(rng, poisoned, name):
    from sparseattn.bench import workload_graph

    graph, _ = workload_graph(name, heads=2, seed=int(rng.integers(1 << 30)))
    run_and_check(rng, poisoned, graph, batch=1, head_dim=128, heads_checked=[1], sample_q_blocks=96)


# ---- bad input raises before launch -----------------------------------------------------------------


@pytest.fixture
def small_case():
    import cupy

    layout = contiguous_layout(300, 64)
    graph = builders.random_graph(layout, layout, heads=2, density=0.5, seed=1)
    shape = (1, 2, layout.num_slots, 64)
    q, k, v = (
        cupy.asarray(float_to_bf16_bits(np.random.default_rng(i).standard_normal(shape))) for i in range(3)
    )
    return graph, q, k, v


def _bad_plan(graph, field):
    plan = bsa_plan(graph)
    if field == "stream_pages":
        return dataclasses.replace(plan, stream_pages=plan.stream_pages + graph.k.num_pages)
    if field == "own_pages":
        return dataclasses.replace(plan, own_pages=np.where(plan.own_pages >= 0, plan.own_pages + 10_000, -1))
    if field == "work_head":
        return dataclasses.replace(plan, work_head=plan.work_head + 2)
    if field == "stream_indptr":
        return dataclasses.replace(plan, stream_indptr=plan.stream_indptr * 3)
    raise KeyError(field)


@pytest.mark.parametrize(
    "case, exc",
    [
        ("float32-q", KernelTypeError),
        ("numpy-k", KernelTypeError),
        ("non-contiguous-v", KernelValueError),
        ("short-k", KernelValueError),
        ("head-dim-96", KernelValueError),
        ("stream_pages", KernelValueError),
        ("own_pages", KernelValueError),
        ("work_head", KernelValueError),
        ("stream_indptr", KernelValueError),
    ],
)
def test_bad_input_raises_before_launch(small_case, poisoned, case, exc):
    import cupy

    from sparseattn.kernels.bsa_mma_forward import bsa_mma_forward

    graph, q, k, v = small_case
    target = graph
    if case == "float32-q":
        q = q.astype(cupy.float32)
    elif case == "numpy-k":
        k = cupy.asnumpy(k)
    elif case == "non-contiguous-v":
        v = cupy.ascontiguousarray(v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    elif case == "short-k":
        k = k[:, :, :-16].copy()
    elif case == "head-dim-96":
        q = cupy.zeros(q.shape[:3] + (96,), dtype=q.dtype)
    else:
        target = _bad_plan(graph, case)
    o = poisoned((1, 2, graph.q.num_slots, 64), "bf16")
    lse = poisoned((1, 2, graph.q.num_slots), "float32")
    with pytest.raises(exc):
        bsa_mma_forward(q, k, v, target, out=(o, lse))
    cupy.cuda.Device().synchronize()
    assert bool((o == BF16_NAN).all()), "output written although the input was refused"
