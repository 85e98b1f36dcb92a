"""GPU tests of the wgmma BSA forward kernel (``kernels_cu/bsa_fwd_wgmma.cu``).

The mma.sync kernel's suite (tests/gpu/test_bsa_forward.py: float64 reference on ragged layouts,
NaN-poisoned outputs, NaN padding in the inputs, rel err < 1e-2, LSE, rows without keys, untouched
invalid rows, a full-size built-in workload with sampled Q blocks, bad input refused before launch)
is re-run here with :func:`bsa_forward_wgmma` in place of ``bsa_forward`` (the default overlap
schedule; the sequential schedule on a subset). On top: the 128×128 routes really run on the wgmma
kernel, its output agrees with the mma.sync kernel's, and long streams (many passes through the
stage ring) stay exact.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import test_bsa_forward as base  # sibling module: the suite re-run here (tests/gpu is on sys.path)
from test_bsa_forward import small_case  # noqa: F401 (fixture of the reused bad-input test)

from sparseattn import builders
from sparseattn.graph import SparseGraph
from sparseattn.kernels import bsa_forward as mma_sync_module
from sparseattn.kernels.bsa_forward_wgmma import bsa_forward_wgmma, runs_on_wgmma
from sparseattn.kernels.validate import bf16_bits_to_float
from sparseattn.layouts import contiguous_layout, video_layout

pytestmark = pytest.mark.gpu

head_dims = pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
block_sizes = pytest.mark.parametrize("block_size", [64, 128], ids=lambda b: f"B{b}")


# tests not repeated for the sequential schedule (it shares all code but the stage loop with the
# overlap schedule; keeps the GPU suite's run time in check)
OVERLAP_ONLY = {
    "test_random_graph_partial_last_block",
    "test_video_layout_partial_tiles",
    "test_builtin_workload_full_size",
    "test_bad_input_raises_before_launch",
    "test_square_routes_run_on_wgmma",
}

# the mma.sync wrapper itself, taken before any test patches the module attribute
_MMA_SYNC_FORWARD = mma_sync_module.bsa_forward


@pytest.fixture(autouse=True, params=[True, False], ids=["overlap", "sequential"])
def wgmma_forward(request, monkeypatch):
    """The wgmma wrapper with one of its two schedules. The reused suite calls
    ``sparseattn.kernels.bsa_forward.bsa_forward``: that name runs the wgmma wrapper here."""
    if not request.param and request.node.originalname in OVERLAP_ONLY:
        pytest.skip("run with the default (overlap) schedule only")
    fn = functools.partial(bsa_forward_wgmma, overlap=request.param)
    monkeypatch.setattr(mma_sync_module, "bsa_forward", fn)
    return fn


# ---- the mma.sync suite through the wgmma wrapper ---------------------------------------------------


@head_dims
@block_sizes
def test_random_graph_partial_last_block(rng, poisoned, head_dim, block_size):
    base.test_random_graph_partial_last_block(rng, poisoned, head_dim, block_size)


@head_dims
@block_sizes
def test_ragged_blocks_and_empty_selections(rng, poisoned, head_dim, block_size):
    base.test_ragged_blocks_and_empty_selections(rng, poisoned, head_dim, block_size)


@pytest.mark.parametrize("padding", ["prefix", "inplace"])
@head_dims
def test_video_layout_partial_tiles(rng, poisoned, padding, head_dim):
    base.test_video_layout_partial_tiles(rng, poisoned, padding, head_dim)


@head_dims
def test_independent_q_k_partitions(rng, poisoned, head_dim):
    base.test_independent_q_k_partitions(rng, poisoned, head_dim)


@head_dims
def test_kpage_square_route_plan(rng, poisoned, head_dim):
    """KPage's 128×128 route (live pages of several blocks packed per tile, partial last tiles)."""
    base.test_kpage_square_route_plan_runs_on_the_same_skeleton(rng, poisoned, head_dim)


@pytest.mark.parametrize("name", ["vsa_wan14b_720p", "ssta_hy15_720p"])
def test_builtin_workload_full_size(rng, poisoned, name):
    base.test_builtin_workload_full_size(rng, poisoned, name)


_BAD_INPUT_CASES = next(
    m for m in base.test_bad_input_raises_before_launch.pytestmark if m.name == "parametrize"
).args[1]


@pytest.mark.parametrize("case, exc", _BAD_INPUT_CASES)
def test_bad_input_raises_before_launch(small_case, poisoned, case, exc):  # noqa: F811 (the fixture)
    base.test_bad_input_raises_before_launch(small_case, poisoned, case, exc)


# ---- wgmma-specific checks -------------------------------------------------------------------------


def test_square_routes_run_on_wgmma():
    assert runs_on_wgmma(128, 128, 128) and runs_on_wgmma(64, 128, 128)
    assert not runs_on_wgmma(128, 64, 64) and not runs_on_wgmma(96, 128, 128)


@head_dims
def test_agrees_with_mma_sync_kernel(rng, wgmma_forward, head_dim):
    """Same inputs through both kernels: outputs within bf16 rounding, identical -inf pattern."""
    import cupy

    layout = video_layout((6, 8, 16), (4, 4, 8), block_size=128)
    graph = builders.random_graph(layout, layout, heads=2, density=0.4, seed=int(rng.integers(1 << 30)))
    qb, kb, vb = base.random_qkv(rng, graph, batch=2, head_dim=head_dim)
    q, k, v = (cupy.asarray(x) for x in (qb, kb, vb))
    o_ref, lse_ref = _MMA_SYNC_FORWARD(q, k, v, graph)
    o, lse = wgmma_forward(q, k, v, graph)
    valid = graph.q.valid
    a = bf16_bits_to_float(cupy.asnumpy(o))[:, :, valid].astype(np.float64)
    b = bf16_bits_to_float(cupy.asnumpy(o_ref))[:, :, valid].astype(np.float64)
    rel = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
    assert rel < 5e-3, f"‖o_wgmma − o_mma.sync‖/‖o_mma.sync‖ = {rel:.2e}"
    la, lb = cupy.asnumpy(lse)[:, :, valid], cupy.asnumpy(lse_ref)[:, :, valid]
    assert np.array_equal(np.isneginf(la), np.isneginf(lb))
    fin = np.isfinite(lb)
    assert np.abs(la[fin] - lb[fin]).max() < 1e-3


@head_dims
def test_long_streams_through_the_ring(rng, poisoned, head_dim):
    """Dense selection over 40 K blocks: 40 stages per work item, many passes through the buffer ring."""
    q = contiguous_layout(128 * 3, 128)
    k = contiguous_layout(128 * 40 - 37, 128)
    mask = np.ones((1, q.num_blocks, k.num_blocks), dtype=bool)
    graph = SparseGraph.from_block_mask(q, k, mask, drop_empty=False)
    base.run_and_check(rng, poisoned, graph, batch=1, head_dim=head_dim)
