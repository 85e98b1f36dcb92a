"""Every built-in workload, scaled to fit the float64 reference, through the BSA kernels.

Each workload keeps its tile, block size, padding and selection rule, on a latent cut down to a few
tiles per axis (the partial-tile remainder of each axis is kept, so ragged tiles stay ragged);
top-k and cluster counts shrink with it. Forward (O, LSE) and backward (dQ, dK, dV) are compared
with the float64 reference on fresh random bf16 inputs whose padding slots hold NaN, with
NaN-poisoned outputs. Full-size forward checks of the large workloads live in
``test_bsa_forward.py`` and in every ``sparseattn bench`` record.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sparseattn.kernels.validate import bf16_bits_to_float, float_to_bf16_bits
from sparseattn.reference import attention_backward, attention_forward
from sparseattn.workloads import WORKLOADS

REL_TOL = 1e-2
LSE_TOL = 1e-3
HEADS = 2


def scaled_workload(name: str):
    """The workload on a latent of a few tiles per axis (enough for its window), same rules."""
    wl = WORKLOADS[name]
    sel = wl.selection
    if wl.tile is None:  # svg2: k-means clusters instead of tiles
        grid = (5, 9, 16)
        sel = dataclasses.replace(
            sel, q_clusters=max(4, sel.q_clusters // 25), k_clusters=max(8, sel.k_clusters // 25)
        )
    else:
        window = np.asarray(sel.window if sel.window is not None else (3, 3, 3)).reshape(-1, 3).max(0)
        grid = tuple(int(min(g, max(w, 2) * t + g % t)) for g, t, w in zip(wl.grid, wl.tile, window))
        if sel.topk is not None:
            tiles = np.prod([-(-g // t) for g, t in zip(grid, wl.tile)])
            sel = dataclasses.replace(sel, topk=int(max(1, min(sel.topk, tiles // 4))))
    return dataclasses.replace(wl, grid=grid, heads=HEADS, selection=sel)


def _bf16(rng, shape, valid):
    x = rng.standard_normal(shape).astype(np.float32)
    x[:, :, ~valid] = np.nan
    return float_to_bf16_bits(x)


def _rel_err(got_bits, ref, valid, name):
    got = bf16_bits_to_float(got_bits)[:, :, valid].astype(np.float64)
    assert np.isfinite(got).all(), f"{name}: NaN / unwritten element in a valid row"
    ref = ref[:, :, valid]
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_builtin_workload_scaled(name, rng, poisoned):
    cupy = pytest.importorskip("cupy")
    from sparseattn.kernels.bsa_backward import plan_backward
    from sparseattn.kernels.bsa_mma_forward import bsa_mma_forward

    wl = scaled_workload(name)
    d = wl.head_dim
    for graph in wl.graphs(seed=int(rng.integers(1 << 30))):
        h, sq, sk = graph.heads, graph.q.num_slots, graph.k.num_slots
        q, do = (_bf16(rng, (1, h, sq, d), graph.q.valid) for _ in range(2))
        k, v = (_bf16(rng, (1, h, sk, d), graph.k.valid) for _ in range(2))
        qf, kf, vf, dof = (bf16_bits_to_float(x) for x in (q, k, v, do))
        o_ref, lse_ref = attention_forward(qf, kf, vf, graph)

        o_gpu, lse_gpu = poisoned((1, h, sq, d), "bf16"), poisoned((1, h, sq), "float32")
        bsa_mma_forward(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), graph, out=(o_gpu, lse_gpu))
        valid = graph.q.valid
        err_o = _rel_err(o_gpu.get(), o_ref, valid, "o")
        lse = lse_gpu.get()[:, :, valid]
        finite = np.isfinite(lse_ref[:, :, valid])
        assert (np.isfinite(lse) == finite).all(), "LSE: -inf rows differ from the reference"
        err_lse = float(np.abs(lse[finite] - lse_ref[:, :, valid][finite]).max(initial=0.0))

        # backward from the reference forward (O rounded to bf16), so it is checked on its own
        o_bits = float_to_bf16_bits(o_ref)
        lse32 = lse_ref.astype(np.float32)
        dq_ref, dk_ref, dv_ref = attention_backward(
            qf, kf, vf, bf16_bits_to_float(o_bits), lse32.astype(np.float64), dof, graph
        )
        outs = (poisoned(q.shape, "bf16"), poisoned(k.shape, "bf16"), poisoned(k.shape, "bf16"))
        plan_backward(*(cupy.asarray(x) for x in (q, k, v, o_bits, lse32, do)), graph, out=outs)
        errs = {
            "o": err_o,
            "dq": _rel_err(outs[0].get(), dq_ref, graph.q.valid, "dq"),
            "dk": _rel_err(outs[1].get(), dk_ref, graph.k.valid, "dk"),
            "dv": _rel_err(outs[2].get(), dv_ref, graph.k.valid, "dv"),
        }
        print(
            name,
            wl.grid,
            f"pairs={graph.nnz}",
            {k_: f"{e:.2e}" for k_, e in errs.items()},
            f"lse_abs={err_lse:.1e}",
        )
        assert err_lse < LSE_TOL, f"LSE abs error {err_lse:.2e}"
        for key, err in errs.items():
            assert err < REL_TOL, f"{key}: relative error {err:.3e} >= {REL_TOL}"


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_scaled_workload_keeps_partial_tiles_and_selection_kind(name):
    """CPU check of the scaling itself: same selection kind, ragged where the original is."""
    wl, small = WORKLOADS[name], scaled_workload(name)
    assert small.selection.kind == wl.selection.kind and small.heads == HEADS
    if wl.tile is not None:
        assert [g % t for g, t in zip(small.grid, wl.tile)] == [g % t for g, t in zip(wl.grid, wl.tile)]
    graphs = small.graphs(seed=0)
    assert sum(g.heads for g in graphs) == HEADS and all(g.nnz > 0 for g in graphs)
