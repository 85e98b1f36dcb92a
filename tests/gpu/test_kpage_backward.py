"""KPage backward (K/V-owned KPage plan on the backward kernel) and the torch autograd op, against
the float64 reference: fresh random bf16 inputs with NaN padding, NaN-poisoned gradient buffers,
‖grad − ref‖/‖ref‖ < 1e-2 on valid rows, zero gradients on padding rows."""

from __future__ import annotations

import numpy as np
import pytest
import test_bsa_backward as bwd_tests  # sibling module: layouts, problems and checks of the BSA backward

from sparseattn.kernels.validate import bf16_bits_to_float, float_to_bf16_bits
from sparseattn.reference import attention_backward, attention_forward

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("route", ["auto", 0, 1], ids=["auto", "64x256", "128x128"])
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("layout", ["video_prefix", "independent_partitions", "single_page_blocks"])
def test_kpage_backward_matches_reference(layout, head_dim, route, rng, poisoned):
    cupy = pytest.importorskip("cupy")
    from sparseattn.kernels.backward import kpage_backward

    q_lay, k_lay = bwd_tests.LAYOUTS[layout](rng, 128)
    graph = bwd_tests._graph(rng, q_lay, k_lay, heads=2)
    host, ref = bwd_tests._problem(rng, graph, batch=2, head_dim=head_dim)
    q, k, v, o, lse, do = (cupy.asarray(x) for x in host)
    out = (poisoned(q.shape, "bf16"), poisoned(k.shape, "bf16"), poisoned(k.shape, "bf16"))
    dq, dk, dv = kpage_backward(q, k, v, o, lse, do, graph, route=route, out=out)
    cupy.cuda.runtime.deviceSynchronize()
    for name, got, want, valid in (
        ("dq", dq, ref[0], graph.q.valid),
        ("dk", dk, ref[1], graph.k.valid),
        ("dv", dv, ref[2], graph.k.valid),
    ):
        vals = bf16_bits_to_float(got.get())
        assert np.isfinite(vals).all(), f"{name}: unwritten (NaN) elements"
        assert not vals[:, :, ~valid].any(), f"{name}: padding rows must be zero"
        err = bwd_tests._rel_err(got.get(), want, valid)
        assert err < bwd_tests.REL_TOL, f"{name}: relative error {err:.3e}"


@pytest.mark.parametrize("route", ["auto", "pair"])
def test_torch_op_forward_and_gradients(route, rng):
    """The autograd op on 128-slot blocks (route 'auto') and on 64-slot blocks with the pair route in
    both passes."""
    torch = pytest.importorskip("torch")
    import sparseattn.torch as st

    q_lay, k_lay = bwd_tests.LAYOUTS["video_prefix"](rng, 128 if route == "auto" else 64)
    graph = bwd_tests._graph(rng, q_lay, k_lay, heads=2)
    shape_q, shape_k = (1, 2, graph.q.num_slots, 128), (1, 2, graph.k.num_slots, 128)
    bits = [
        float_to_bf16_bits(rng.standard_normal(s).astype(np.float32)) for s in (shape_q, shape_k, shape_k)
    ]
    do_bits = float_to_bf16_bits(rng.standard_normal(shape_q).astype(np.float32))
    q, k, v = (torch.from_numpy(b.view(np.int16)).cuda().view(torch.bfloat16).requires_grad_() for b in bits)
    do = torch.from_numpy(do_bits.view(np.int16)).cuda().view(torch.bfloat16)
    o = st.kpage_attention(q, k, v, graph, route=route)
    o.backward(do)
    qf, kf, vf, dof = (bf16_bits_to_float(b).astype(np.float64) for b in (*bits, do_bits))
    o_ref, lse_ref = attention_forward(qf, kf, vf, graph)
    dq_ref, dk_ref, dv_ref = attention_backward(qf, kf, vf, o_ref, lse_ref, dof, graph)
    for name, got, want, valid in (
        ("o", o, o_ref, graph.q.valid),
        ("dq", q.grad, dq_ref, graph.q.valid),
        ("dk", k.grad, dk_ref, graph.k.valid),
        ("dv", v.grad, dv_ref, graph.k.valid),
    ):
        g = got.detach().float().cpu().numpy().astype(np.float64)
        assert np.isfinite(g).all(), name
        assert not g[:, :, ~valid].any(), f"{name}: padding rows must be zero"
        err = np.linalg.norm(g[:, :, valid] - want[:, :, valid]) / np.linalg.norm(want[:, :, valid])
        assert err < 1e-2, f"{name}: relative error {err:.3e}"
