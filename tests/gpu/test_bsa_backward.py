"""BSA backward kernel (kernels_cu/bsa_bwd.cu) against the float64 reference.

GPU tests (``gpu`` marker): fresh random bf16 inputs, padding slots of every input filled with NaN
(masking must keep them out), NaN-poisoned output buffers (every element must be written), and
``‖out − ref‖ / ‖ref‖ < 1e-2`` for dQ, dK and dV over valid rows. O and LSE come from the float64
reference forward (O rounded to bf16), so this file checks the backward alone.
The CPU tests at the end check the wrapper's configuration and its refusal of host arrays.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sparseattn.constants import PAGE_ROWS
from sparseattn.graph import SparseGraph
from sparseattn.kernels import bsa_backward as bwd
from sparseattn.kernels.validate import (
    KernelTypeError,
    KernelValueError,
    bf16_bits_to_float,
    float_to_bf16_bits,
)
from sparseattn.layouts import contiguous_layout, partition_layout, slot_layout, video_layout
from sparseattn.planning.tile_plan import bsa_plan, kpage_plan
from sparseattn.reference import attention_backward, attention_forward

REL_TOL = 1e-2
H200_SMEM_PER_SM = 228 * 1024  # 1 KB of it reserved per resident CTA


# ---- layouts and graphs ------------------------------------------------------------------------


def _video_layouts(rng, block, padding):
    tile = (4, 4, 4) if block == 64 else (4, 4, 8)
    lay = video_layout((6, 7, 10), tile, block, padding)  # partial tiles along every axis
    return lay, lay


def _partitions(rng, block):
    """Independent Q/K partitions (SVG2-like clusters), different token counts and group counts."""
    q = partition_layout(rng.integers(0, 7, size=600), block)
    k = partition_layout(rng.integers(0, 11, size=700), block)
    return q, k


def _mixed_blocks(rng, block):
    """Q and K with different block sizes (64 vs 128)."""
    other = 128 if block == 64 else 64
    return contiguous_layout(700, block), partition_layout(rng.integers(0, 5, size=650), other)


def _single_page_blocks(rng, block):
    """Blocks holding one valid row, one live page, a scattered page, none at all, and random rows."""
    nb = 6
    q_valid = np.zeros(nb * block, dtype=bool)
    q_valid[0:block] = True  # full block
    q_valid[block + 3] = True  # one valid row
    q_valid[2 * block + 16 : 2 * block + 32] = True  # exactly one live page
    q_valid[3 * block :: PAGE_ROWS][: block // PAGE_ROWS] = True  # first row of every page
    # block 4 stays empty (no work item, no stream)
    q_valid[5 * block : 6 * block] = rng.random(block) < 0.3
    k_valid = rng.random(nb * block) < 0.4
    k_valid[2 * block : 3 * block] = False
    k_valid[2 * block + 40] = True  # single valid K row in one page
    k_valid[4 * block : 5 * block] = False  # empty K block: its pages are zeroed
    return slot_layout(q_valid, block), slot_layout(k_valid, block)


def _full(rng, block):
    lay = contiguous_layout(8 * block, block)
    return lay, lay


LAYOUTS = {
    "full_blocks": _full,
    "video_prefix": lambda rng, b: _video_layouts(rng, b, "prefix"),
    "video_inplace": lambda rng, b: _video_layouts(rng, b, "inplace"),
    "independent_partitions": _partitions,
    "mixed_block_sizes": _mixed_blocks,
    "single_page_blocks": _single_page_blocks,
}


def _graph(rng, q_lay, k_lay, heads, density=0.45, full=False):
    """Random selection with, per head, a Q block that selects nothing and a K block nobody selects."""
    shape = (heads, q_lay.num_blocks, k_lay.num_blocks)
    mask = np.ones(shape, dtype=bool) if full else rng.random(shape) < density
    if not full:
        for h in range(heads):
            mask[h, rng.integers(q_lay.num_blocks), :] = False
            mask[h, :, rng.integers(k_lay.num_blocks)] = False
    return SparseGraph.from_block_mask(q_lay, k_lay, mask)


# ---- data ------------------------------------------------------------------------------------


def _bf16_tensor(rng, shape, valid, pad_value=np.nan):
    """bf16 bits of N(0, 1) data with padding slots (axis 2) set to ``pad_value``."""
    x = rng.standard_normal(shape).astype(np.float32)
    x[:, :, ~valid] = pad_value
    return float_to_bf16_bits(x)


def _problem(rng, graph, batch, head_dim):
    """Host inputs (bf16 bits, NaN padding) plus the float64 reference gradients."""
    h = graph.heads
    q = _bf16_tensor(rng, (batch, h, graph.q.num_slots, head_dim), graph.q.valid)
    k = _bf16_tensor(rng, (batch, h, graph.k.num_slots, head_dim), graph.k.valid)
    v = _bf16_tensor(rng, (batch, h, graph.k.num_slots, head_dim), graph.k.valid)
    do = _bf16_tensor(rng, (batch, h, graph.q.num_slots, head_dim), graph.q.valid)
    qf, kf, vf, dof = (bf16_bits_to_float(x) for x in (q, k, v, do))
    o_ref, lse_ref = attention_forward(qf, kf, vf, graph)
    o = float_to_bf16_bits(o_ref)
    o[:, :, ~graph.q.valid] = 0x7FC0  # the forward leaves padding rows undefined
    lse = lse_ref.astype(np.float32)
    lse[:, :, ~graph.q.valid] = np.nan
    ref = attention_backward(qf, kf, vf, bf16_bits_to_float(o), lse.astype(np.float64), dof, graph)
    return (q, k, v, o, lse, do), ref


def _rel_err(out_bits, ref, valid):
    out = bf16_bits_to_float(out_bits)[:, :, valid].astype(np.float64)
    ref = ref[:, :, valid]
    assert not np.isnan(out).any(), "NaN in valid rows"
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / denom) if denom > 0 else float(np.abs(out).max())


def _run_and_check(cupy, poisoned, graph_or_plan, graph, host, ref, head_dim):
    q, k, v, o, lse, do = (cupy.asarray(x) for x in host)
    out = (poisoned(q.shape, "bf16"), poisoned(k.shape, "bf16"), poisoned(k.shape, "bf16"))
    dq, dk, dv = bwd.plan_backward(q, k, v, o, lse, do, graph_or_plan, out=out)
    assert dq is out[0] and dk is out[1] and dv is out[2]
    cupy.cuda.runtime.deviceSynchronize()
    errs = {}
    for name, got, want, valid in (
        ("dq", dq, ref[0], graph.q.valid),
        ("dk", dk, ref[1], graph.k.valid),
        ("dv", dv, ref[2], graph.k.valid),
    ):
        bits = got.get()
        vals = bf16_bits_to_float(bits)
        assert np.isfinite(vals).all(), f"{name}: unwritten (NaN) or non-finite elements"
        assert not vals[:, :, ~valid].any(), f"{name}: padding rows must be zero"
        errs[name] = _rel_err(bits, want, valid)
    print({name: f"{e:.2e}" for name, e in errs.items()})
    for name, e in errs.items():
        assert e < REL_TOL, f"{name}: relative error {e:.3e} >= {REL_TOL}"
    return errs


# ---- GPU: correctness -------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("block", [64, 128], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_matches_reference(layout, block, head_dim, rng, poisoned):
    cupy = pytest.importorskip("cupy")
    q_lay, k_lay = LAYOUTS[layout](rng, block)
    graph = _graph(rng, q_lay, k_lay, heads=2, full=(layout == "full_blocks"))
    host, ref = _problem(rng, graph, batch=2, head_dim=head_dim)
    _run_and_check(cupy, poisoned, graph, graph, host, ref, head_dim)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
def test_kpage_kv_plan_runs_exactly(head_dim, rng, poisoned):
    """The kernel also executes a K/V-owned KPage plan (live pages only, packed, two routes)."""
    cupy = pytest.importorskip("cupy")
    q_lay, k_lay = _video_layouts(rng, 128, "prefix")
    graph = _graph(rng, q_lay, k_lay, heads=2)
    host, ref = _problem(rng, graph, batch=1, head_dim=head_dim)
    _run_and_check(cupy, poisoned, kpage_plan(graph, owner="kv"), graph, host, ref, head_dim)


@pytest.mark.gpu
def test_default_outputs_and_scale(rng):
    """Freshly allocated outputs, a non-default scale, the graph's cached plan reused on a second call."""
    cupy = pytest.importorskip("cupy")
    q_lay, k_lay = _single_page_blocks(rng, 64)
    graph = _graph(rng, q_lay, k_lay, heads=1)
    scale = 0.3
    h = graph.heads
    host = [
        _bf16_tensor(rng, (1, h, n, 64), valid)
        for n, valid in (
            (graph.q.num_slots, graph.q.valid),
            (graph.k.num_slots, graph.k.valid),
            (graph.k.num_slots, graph.k.valid),
            (graph.q.num_slots, graph.q.valid),
        )
    ]
    qf, kf, vf, dof = (bf16_bits_to_float(x) for x in host)
    o_ref, lse_ref = attention_forward(qf, kf, vf, graph, scale=scale)
    o = float_to_bf16_bits(o_ref)
    lse = lse_ref.astype(np.float32)
    ref = attention_backward(
        qf, kf, vf, bf16_bits_to_float(o), lse.astype(np.float64), dof, graph, scale=scale
    )
    q, k, v, do = (cupy.asarray(x) for x in host)
    args = (q, k, v, cupy.asarray(o), cupy.asarray(lse), do, graph)
    for _ in range(2):
        dq, dk, dv = bwd.plan_backward(*args, scale=scale)
        for name, got, want, valid in (
            ("dq", dq, ref[0], graph.q.valid),
            ("dk", dk, ref[1], graph.k.valid),
            ("dv", dv, ref[2], graph.k.valid),
        ):
            vals = bf16_bits_to_float(got.get())
            assert np.isfinite(vals).all(), name
            assert _rel_err(got.get(), want, valid) < REL_TOL, name
    assert bwd.plan_for(graph) is bwd.plan_for(graph)


# ---- GPU: bad input raises before any launch ----------------------------------------------------


@pytest.fixture
def small_problem(rng):
    cupy = pytest.importorskip("cupy")
    lay = contiguous_layout(200, 64)
    graph = _graph(rng, lay, lay, heads=2)
    shape = (1, 2, lay.num_slots, 64)
    args = [cupy.asarray(_bf16_tensor(rng, shape, lay.valid, 0.0)) for _ in range(4)]
    q, k, v, do = args
    o = cupy.asarray(_bf16_tensor(rng, shape, lay.valid, 0.0))
    lse = cupy.zeros(shape[:3], dtype=cupy.float32)
    return cupy, graph, {"q": q, "k": k, "v": v, "o": o, "lse": lse, "do": do}


def _bad_plan(plan, **changes):
    return dataclasses.replace(plan, **changes)


BAD_INPUTS = {
    "q_float32": (lambda cp, g, t: dict(t, q=t["q"].astype(cp.float32)), KernelTypeError, "q"),
    "k_host_numpy": (lambda cp, g, t: dict(t, k=t["k"].get()), KernelTypeError, "k must be a cupy array"),
    "v_wrong_slots": (lambda cp, g, t: dict(t, v=t["v"][:, :, :-16].copy()), KernelValueError, "v"),
    "do_not_contiguous": (lambda cp, g, t: dict(t, do=cp.asfortranarray(t["do"])), KernelValueError, "do"),
    "o_wrong_heads": (lambda cp, g, t: dict(t, o=t["o"][:, :1].copy()), KernelValueError, "o"),
    "lse_bf16": (lambda cp, g, t: dict(t, lse=t["q"][..., 0].copy()), KernelTypeError, "lse"),
    "lse_wrong_shape": (lambda cp, g, t: dict(t, lse=t["lse"][..., :-16].copy()), KernelValueError, "lse"),
    "head_dim_96": (
        lambda cp, g, t: {
            n: (cp.concatenate([x, x], axis=-1)[..., :96].copy() if x.ndim == 4 else x) for n, x in t.items()
        },
        KernelValueError,
        "head_dim",
    ),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_tensor_raises_before_launch(case, small_problem):
    cupy, graph, tensors = small_problem
    make, exc, words = BAD_INPUTS[case]
    bad = make(cupy, graph, tensors)
    with pytest.raises(exc, match=words):
        bwd.plan_backward(bad["q"], bad["k"], bad["v"], bad["o"], bad["lse"], bad["do"], graph)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case",
    [
        "forward_plan",
        "stream_page_out_of_range",
        "own_page_out_of_range",
        "wrong_heads",
        "graph_of_other_size",
    ],
)
def test_bad_plan_raises_before_launch(case, small_problem, poisoned):
    cupy, graph, t = small_problem
    plan = bsa_plan(graph, owner="kv")
    pages = t["q"].shape[2] // PAGE_ROWS
    if case == "forward_plan":
        bad, words = bsa_plan(graph, owner="q"), "owner"
    elif case == "stream_page_out_of_range":
        sp = plan.stream_pages.copy()
        sp[-1] = pages
        bad, words = _bad_plan(plan, stream_pages=sp), "stream_pages"
    elif case == "own_page_out_of_range":
        own = plan.own_pages.copy()
        own[0, 0] = pages + 3
        bad, words = _bad_plan(plan, own_pages=own), "own_pages"
    elif case == "wrong_heads":
        bad, words = bsa_plan(graph.select_heads([0]), owner="kv"), "heads"
    else:
        other = contiguous_layout(300, 64)
        bad, words = _graph(np.random.default_rng(0), other, other, heads=2), "slots"
    out = (poisoned(t["q"].shape, "bf16"), poisoned(t["k"].shape, "bf16"), poisoned(t["k"].shape, "bf16"))
    with pytest.raises(KernelValueError, match=words):
        bwd.plan_backward(t["q"], t["k"], t["v"], t["o"], t["lse"], t["do"], bad, out=out)
    cupy.cuda.runtime.deviceSynchronize()
    for buf in out:  # nothing was launched: the poisoned buffers are untouched
        assert bool((buf == 0x7FC0).all())


# ---- CPU: configuration and host-side refusal ---------------------------------------------------


@pytest.mark.parametrize("head_dim", bwd.HEAD_DIMS)
@pytest.mark.parametrize("owned", bwd.OWNED_ROWS)
def test_shared_memory_fits_hopper(head_dim, owned):
    min_blocks = bwd.TILES[head_dim, owned][2]
    assert min_blocks * (bwd.smem_bytes(head_dim, owned) + 1024) <= H200_SMEM_PER_SM
    assert bwd.kernel_name(head_dim, owned) in bwd.NAME_EXPRESSIONS


def test_tiles_match_kernel_source():
    from sparseattn.kernels.runtime import kernel_dir

    src = (kernel_dir() / bwd.SOURCE).read_text()
    for (d, owned), tiles in bwd.TILES.items():
        assert f"#define BSA_BWD_TILES_HD{d}_BK{owned} {', '.join(map(str, tiles))}" in src


def test_uncovered_pages_are_the_empty_blocks():
    rng = np.random.default_rng(1)
    q_lay, k_lay = _single_page_blocks(rng, 64)
    graph = _graph(rng, q_lay, k_lay, heads=2)
    heads, pages = bwd.uncovered_k_pages(bsa_plan(graph, owner="kv"), k_lay.num_pages)
    empty_pages = np.flatnonzero(np.repeat(k_lay.valid_rows == 0, k_lay.pages_per_block))
    assert np.array_equal(pages, np.tile(empty_pages, 2))
    assert np.array_equal(heads, np.repeat([0, 1], empty_pages.size))


def test_host_arrays_are_refused():
    lay = contiguous_layout(64, 64)
    graph = _graph(np.random.default_rng(2), lay, lay, heads=1)
    x = np.zeros((1, 1, 64, 64), dtype=np.uint16)
    with pytest.raises(KernelTypeError, match="q must be a cupy array"):
        bwd.plan_backward(x, x, x, x, np.zeros((1, 1, 64), np.float32), x, graph)
