"""KPage backward on random cases with FlashAttention's error rule (the forward's rule): for dQ, dK and
dV, the error against the float64 reference is at most 2× that of a bf16-rounding emulation of the same
computation, in norm and in the worst row. Every case has fresh random inputs, NaN padding and NaN-poisoned
outputs (every valid element must be written, padding rows must be zero).

200 cases: 5 layout families (video tiles with prefix and in-place padding, independent Q/K partitions,
single-page and empty blocks, mixed block sizes) × head dim 64 / 128 × 20 seeds. Each case draws its
block size, route (auto, 64×256, 128×128), heads (1–3), batch (1–2) and density; per head a Q block
selects nothing and a K block is never selected. Every main-kernel implementation (``impl``: the
``mma.sync`` kernel and the wgmma variants) also runs 12 cases of two families, and the deterministic
mode 12 cases whose dQ must come out bit-identical from a plan with its work items and streams reversed."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import test_bsa_backward as bwd_tests  # sibling module: layouts, graphs and inputs of the backward tests

from sparseattn.kernels.bsa_backward import IMPLS
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
    run_random_case(layout, head_dim, rng, poisoned, impl=None)


# Every main-kernel implementation (the default one runs the 200 cases above): 2 layout families x
# both head dims x 3 seeds each, same rule.
@pytest.mark.parametrize("seed", range(3), ids=lambda s: f"case{s}")
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("layout", ["video_prefix", "mixed_block_sizes"])
@pytest.mark.parametrize("impl", IMPLS)
def test_kpage_backward_implementations(impl, layout, head_dim, seed, rng, poisoned):
    run_random_case(layout, head_dim, rng, poisoned, impl=impl)


# route="pair" (opt-in): 64-row K/V blocks two by two as 128-row items over the ordered union of their Q
# pages, each owned half seeing only its own block's Q pages (paged_bwd_ws_kernel<D, true>). 64-slot
# blocks pair with their neighbours; 128-slot blocks have 64-row blocks only where they are partial, which
# pair with each other wherever they are. 2 block sizes x 2 layout families x both head dims x 4 seeds.
@pytest.mark.parametrize("seed", range(4), ids=lambda s: f"case{s}")
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("layout", ["video_prefix", "independent_partitions"])
@pytest.mark.parametrize("block", [64, 128], ids=lambda b: f"B{b}")
def test_kpage_backward_pair_route(block, layout, head_dim, seed, rng, poisoned):
    run_random_case(layout, head_dim, rng, poisoned, impl=None, block=block, route="pair")


@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
def test_kpage_backward_pair_route_shared_pages(head_dim, rng, poisoned):
    """A neighbour-window graph: the pairs share most of their Q pages, so most entries are seen by both
    halves and the [A only | shared | B only] boundaries fall inside steps."""
    cupy = pytest.importorskip("cupy")
    from sparseattn.graph import SparseGraph
    from sparseattn.kernels.backward import kpage_backward
    from sparseattn.layouts import video_layout
    from sparseattn.planning.cache import plan_of

    layout = video_layout((5, 7, 9), (4, 4, 4), block_size=64)
    window = np.zeros((2, layout.num_blocks, layout.num_blocks), dtype=bool)
    for i in range(layout.num_blocks):
        window[:, i, max(0, i - int(rng.integers(2, 8))) : i + int(rng.integers(2, 8))] = True
    graph = SparseGraph.from_block_mask(layout, layout, window)
    plan = plan_of(graph, "kpage", "pair", owner="kv")
    assert np.any(plan.stream_vis == 3) and np.any(plan.stream_vis != 3)
    host, exact = bwd_tests._problem(rng, graph, batch=2, head_dim=head_dim)
    qf, kf, vf, dof = (bf16_bits_to_float(x) for x in (host[0], host[1], host[2], host[5]))
    o, lse = bf16_bits_to_float(host[3]), host[4].astype(np.float64)
    emul = attention_backward(qf, kf, vf, o, lse, dof, graph, emulate_bf16=True)
    q, k, v, o_d, lse_d, do = (cupy.asarray(x) for x in host)
    out = (poisoned(q.shape, "bf16"), poisoned(k.shape, "bf16"), poisoned(k.shape, "bf16"))
    dq, dk, dv = kpage_backward(q, k, v, o_d, lse_d, do, graph, route="pair", out=out)
    cupy.cuda.runtime.deviceSynchronize()
    for name, got, ex, em, valid in (
        ("dq", dq, exact[0], emul[0], graph.q.valid),
        ("dk", dk, exact[1], emul[1], graph.k.valid),
        ("dv", dv, exact[2], emul[2], graph.k.valid),
    ):
        check_gradient(name, got.get(), ex, em, valid)


def test_pair_plans_refuse_other_kernels(rng):
    """A plan with pair items runs only on the warp-specialized kernel: other implementations and the
    deterministic mode are refused before any launch."""
    cupy = pytest.importorskip("cupy")
    from sparseattn.kernels.bsa_backward import plan_backward
    from sparseattn.kernels.validate import KernelValueError
    from sparseattn.planning.cache import plan_of

    q_lay, k_lay = bwd_tests.LAYOUTS["video_prefix"](rng, 64)
    graph = bwd_tests._graph(rng, q_lay, k_lay, 2, density=0.5)
    plan = plan_of(graph, "kpage", "pair", owner="kv")
    assert np.any(plan.stream_vis != 3)
    host, _ = bwd_tests._problem(rng, graph, batch=1, head_dim=64)
    args = [cupy.asarray(x) for x in host]
    for kwargs in ({"impl": "wgmma_sync"}, {"impl": "mma"}, {"deterministic": True}):
        with pytest.raises(KernelValueError, match="pair items"):
            plan_backward(*args, plan, **kwargs)


def reversed_plan(plan):
    """The same work in the opposite order: work items reversed within each route, every item's streamed
    pages reversed (every dQ partial sum is added in another order)."""
    order = np.concatenate([np.arange(start, stop)[::-1] for start, stop in plan.route_ranges()])
    segments = [plan.stream_pages[plan.stream_indptr[w] : plan.stream_indptr[w + 1]][::-1] for w in order]
    lengths = np.array([len(x) for x in segments], dtype=np.int64)
    return dataclasses.replace(
        plan,
        work_route=plan.work_route[order],
        work_head=plan.work_head[order],
        work_block=plan.work_block[order],
        own_pages=plan.own_pages[order],
        stream_indptr=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
        stream_pages=np.concatenate([*segments, np.zeros(0, np.int32)]).astype(np.int32),
    )


@pytest.mark.parametrize("seed", range(2), ids=lambda s: f"case{s}")
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("layout", ["video_prefix", "independent_partitions", "mixed_block_sizes"])
def test_kpage_backward_deterministic(layout, head_dim, seed, rng, poisoned):
    """deterministic=True: within the error rule and bit-identical on a second run; on a plan (the
    fixed-point dQ), dQ bit-identical when the plan runs with its work items and streamed pages in
    reverse order (fp32 atomics would round differently)."""
    run_random_case(layout, head_dim, rng, poisoned, impl=None, deterministic=True)


def run_random_case(layout, head_dim, rng, poisoned, impl, deterministic=False, block=None, route=None):
    cupy = pytest.importorskip("cupy")
    from sparseattn.kernels.backward import kpage_backward

    block = int(rng.choice([64, 128])) if block is None else block
    route = ["auto", 0, 1][int(rng.integers(3))] if route is None else route
    heads, batch = int(rng.integers(1, 4)), int(rng.integers(1, 3))
    q_lay, k_lay = bwd_tests.LAYOUTS[layout](rng, block)
    graph = bwd_tests._graph(rng, q_lay, k_lay, heads, density=float(rng.uniform(0.15, 0.7)))
    host, exact = bwd_tests._problem(rng, graph, batch=batch, head_dim=head_dim)
    qf, kf, vf, dof = (bf16_bits_to_float(x) for x in (host[0], host[1], host[2], host[5]))
    o, lse = bf16_bits_to_float(host[3]), host[4].astype(np.float64)
    emul = attention_backward(qf, kf, vf, o, lse, dof, graph, emulate_bf16=True)
    q, k, v, o_d, lse_d, do = (cupy.asarray(x) for x in host)
    out = (poisoned(q.shape, "bf16"), poisoned(k.shape, "bf16"), poisoned(k.shape, "bf16"))
    dq, dk, dv = kpage_backward(
        q, k, v, o_d, lse_d, do, graph, route=route, out=out, impl=impl, deterministic=deterministic
    )
    cupy.cuda.runtime.deviceSynchronize()
    if deterministic:
        from sparseattn.planning.cache import plan_of

        def same_bits(a, b):
            return (a.view(cupy.uint16) == b.view(cupy.uint16)).all().item()

        # on a graph the default may run the Q-owned dQ pass (a fixed order): identical from run to run
        again = kpage_backward(q, k, v, o_d, lse_d, do, graph, route=route, impl=impl, deterministic=True)
        for name, a, b in zip(("dq", "dk", "dv"), again, (dq, dk, dv)):
            assert same_bits(a, b), f"{name} differs between two runs"
        # on a plan (no Q-owned plan at hand) dQ is added in fixed point: independent of the work order
        plan = plan_of(graph, "kpage", route, owner="kv")
        dq_fixed = kpage_backward(q, k, v, o_d, lse_d, do, plan, impl=impl, deterministic=True)[0]
        rev = reversed_plan(plan)
        dq_rev = kpage_backward(q, k, v, o_d, lse_d, do, rev, impl=impl, deterministic=True)[0]
        assert rev.num_work > 1
        assert same_bits(dq_rev, dq_fixed), "dQ depends on the work order"
        check_gradient("dq (fixed point)", dq_fixed.get(), exact[0], emul[0], graph.q.valid)
    for name, got, ex, em, valid in (
        ("dq", dq, exact[0], emul[0], graph.q.valid),
        ("dk", dk, exact[1], emul[1], graph.k.valid),
        ("dv", dv, exact[2], emul[2], graph.k.valid),
    ):
        check_gradient(name, got.get(), ex, em, valid)


@pytest.mark.parametrize("seed", range(8), ids=lambda s: f"case{s}")
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
def test_kpage_backward_head_stack(head_dim, seed, rng, poisoned):
    """SVG2's per-head layouts (a HeadStack: every head its own Q and K partition and slot count); odd
    seeds run the deterministic mode."""
    run_head_stack_case(head_dim, rng, poisoned, deterministic=seed % 2 == 1)


@pytest.mark.parametrize("seed", range(4), ids=lambda s: f"case{s}")
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")
def test_kpage_backward_head_stack_pair_route(head_dim, seed, rng, poisoned):
    """route='pair' on per-head layouts: each head's partial (64-row) K/V blocks paired within the head,
    the heads' pair plans stacked with their visibility."""
    run_head_stack_case(head_dim, rng, poisoned, route="pair")


def run_head_stack_case(head_dim, rng, poisoned, deterministic=False, route="auto"):
    cupy = pytest.importorskip("cupy")
    from sparseattn.graph import HeadStack
    from sparseattn.kernels.backward import kpage_backward
    from sparseattn.kernels.validate import float_to_bf16_bits
    from sparseattn.layouts import partition_layout
    from sparseattn.reference import attention_forward

    heads, batch, block = int(rng.integers(2, 4)), int(rng.integers(1, 3)), int(rng.choice([64, 128]))
    graphs = []
    for _ in range(heads):
        q_lay = partition_layout(
            rng.integers(0, int(rng.integers(3, 9)), size=int(rng.integers(300, 700))), block
        )
        k_lay = partition_layout(
            rng.integers(0, int(rng.integers(3, 12)), size=int(rng.integers(300, 700))), block
        )
        graphs.append(bwd_tests._graph(rng, q_lay, k_lay, 1, density=float(rng.uniform(0.2, 0.7))))
    stack = HeadStack.of(graphs)
    if route == "pair":  # some head has 64-row K/V blocks to pair
        from sparseattn.planning.pair_forward import pair_partners

        assert any(pair_partners(g.transpose())[0].size for g in graphs)
    sq, sk = stack.q_slots, stack.k_slots
    shapes = {
        "q": (batch, heads, sq),
        "k": (batch, heads, sk),
        "v": (batch, heads, sk),
        "do": (batch, heads, sq),
    }
    data = {n: np.full((*s, head_dim), np.nan, dtype=np.float32) for n, s in shapes.items()}
    o = np.full((batch, heads, sq, head_dim), np.nan, dtype=np.float32)
    lse = np.full((batch, heads, sq), np.nan, dtype=np.float32)
    per_head = []
    for h, g in enumerate(graphs):
        for n, lay in (("q", g.q), ("k", g.k), ("v", g.k), ("do", g.q)):
            x = rng.standard_normal((batch, lay.num_slots, head_dim)).astype(np.float32)
            x[:, ~lay.valid] = np.nan
            data[n][:, h, : lay.num_slots] = x
        qf, kf, vf, dof = (
            bf16_bits_to_float(float_to_bf16_bits(data[n][:, h : h + 1, : lay.num_slots]))
            for n, lay in (("q", g.q), ("k", g.k), ("v", g.k), ("do", g.q))
        )
        o_ref, lse_ref = attention_forward(qf, kf, vf, g)
        o_bf = bf16_bits_to_float(float_to_bf16_bits(o_ref))
        o[:, h : h + 1, : g.q.num_slots] = np.where(g.q.valid[:, None], o_bf, np.nan)
        lse[:, h : h + 1, : g.q.num_slots] = np.where(g.q.valid, lse_ref, np.nan)
        lse_h = lse[:, h : h + 1, : g.q.num_slots].astype(np.float64)
        exact = attention_backward(qf, kf, vf, o_bf, lse_h, dof, g)
        emul = attention_backward(qf, kf, vf, o_bf, lse_h, dof, g, emulate_bf16=True)
        per_head.append((exact, emul))
    q, k, v, do = (cupy.asarray(float_to_bf16_bits(data[n])) for n in ("q", "k", "v", "do"))
    o_d, lse_d = cupy.asarray(float_to_bf16_bits(o)), cupy.asarray(lse)
    out = (poisoned(q.shape, "bf16"), poisoned(k.shape, "bf16"), poisoned(k.shape, "bf16"))
    dq, dk, dv = kpage_backward(
        q, k, v, o_d, lse_d, do, stack, route=route, out=out, deterministic=deterministic
    )
    cupy.cuda.runtime.deviceSynchronize()
    grads = [x.get() for x in (dq, dk, dv)]
    for h, g in enumerate(graphs):
        exact, emul = per_head[h]
        for i, (name, n, valid) in enumerate(
            (
                ("dq", g.q.num_slots, g.q.valid),
                ("dk", g.k.num_slots, g.k.valid),
                ("dv", g.k.num_slots, g.k.valid),
            )
        ):
            bits = grads[i][:, h : h + 1]
            assert not bf16_bits_to_float(bits[:, :, n:]).any(), f"head {h} {name}: slots past its layout"
            check_gradient(f"head {h} {name}", bits[:, :, :n], exact[i], emul[i], valid)
