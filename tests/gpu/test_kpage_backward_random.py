"""KPage backward on random cases with FlashAttention's error rule (the forward's rule): for dQ, dK and
dV, the error against the float64 reference is at most 2× that of a bf16-rounding emulation of the same
computation, in norm and in the worst row. Every case has fresh random inputs, NaN padding and NaN-poisoned
outputs (every valid element must be written, padding rows must be zero).

200 cases: 5 layout families (video tiles with prefix and in-place padding, independent Q/K partitions,
single-page and empty blocks, mixed block sizes) × head dim 64 / 128 × 20 seeds. Each case draws its
block size, route (auto, 64×256, 128×128), heads (1–3), batch (1–2) and density; per head a Q block
selects nothing and a K block is never selected."""

from __future__ import annotations

import numpy as np
import pytest
import test_bsa_backward as bwd_tests  # sibling module: layouts, graphs and inputs of the backward tests

from sparseattn.kernels.validate import bf16_bits_to_float
from sparseattn.reference import attention_backward

pytestmark = pytest.mark.gpu

ERR_FACTOR = 2.0
ERR_FLOOR = 1e-5
LAYOUT_KINDS = [
    "video_prefix",
    "video_inplace",
    "independent_partitions",
    "single_page_blocks",
    "mixed_block_sizes",
]


def check_gradient(name, bits, exact, emul, valid):
    got = bf16_bits_to_float(bits).astype(np.float64)
    assert np.isfinite(got).all(), f"{name}: unwritten (NaN) or non-finite elements"
    assert not got[:, :, ~valid].any(), f"{name}: padding rows must be zero"
    g, r, e = got[:, :, valid], exact[:, :, valid], emul[:, :, valid]
    norm = max(np.linalg.norm(r), 1e-30)
    rel, rel_emul = np.linalg.norm(g - r) / norm, np.linalg.norm(e - r) / norm
    assert rel <= ERR_FACTOR * rel_emul + ERR_FLOOR, (
        f"{name}: ‖err‖/‖ref‖ {rel:.2e} > 2 × emulation {rel_emul:.2e}"
    )
    row, row_emul = np.abs(g - r).max(axis=-1), np.abs(e - r).max(axis=-1)
    assert row.max() <= ERR_FACTOR * row_emul.max() + ERR_FLOOR, (
        f"{name}: worst row {row.max():.2e} > 2 × emulation's worst row {row_emul.max():.2e}"
    )
    return rel, rel_emul


@pytest.mark.parametrize("seed", range(20), ids=lambda s: f"case{s}")
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("layout", LAYOUT_KINDS)
def test_kpage_backward_random(layout, head_dim, seed, rng, poisoned):
    cupy = pytest.importorskip("cupy")
    from sparseattn.kernels.backward import kpage_backward

    block = int(rng.choice([64, 128]))
    route = ["auto", 0, 1][int(rng.integers(3))]
    heads, batch = int(rng.integers(1, 4)), int(rng.integers(1, 3))
    q_lay, k_lay = bwd_tests.LAYOUTS[layout](rng, block)
    graph = bwd_tests._graph(rng, q_lay, k_lay, heads, density=float(rng.uniform(0.15, 0.7)))
    host, exact = bwd_tests._problem(rng, graph, batch=batch, head_dim=head_dim)
    qf, kf, vf, dof = (bf16_bits_to_float(x) for x in (host[0], host[1], host[2], host[5]))
    o, lse = bf16_bits_to_float(host[3]), host[4].astype(np.float64)
    emul = attention_backward(qf, kf, vf, o, lse, dof, graph, emulate_bf16=True)
    q, k, v, o_d, lse_d, do = (cupy.asarray(x) for x in host)
    out = (poisoned(q.shape, "bf16"), poisoned(k.shape, "bf16"), poisoned(k.shape, "bf16"))
    dq, dk, dv = kpage_backward(q, k, v, o_d, lse_d, do, graph, route=route, out=out)
    cupy.cuda.runtime.deviceSynchronize()
    for name, got, ex, em, valid in (
        ("dq", dq, exact[0], emul[0], graph.q.valid),
        ("dk", dk, exact[1], emul[1], graph.k.valid),
        ("dv", dv, exact[2], emul[2], graph.k.valid),
    ):
        check_gradient(name, got.get(), ex, em, valid)
