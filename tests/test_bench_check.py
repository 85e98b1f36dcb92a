"""The benchmark's gradient check (CPU): ``sampled_grad_error`` against the float64 reference, and
``bench_paged`` putting it on its backward records, with the kernels replaced by the reference (a wrong
backward must show up as ``correct: False`` before anything is timed)."""

import types

import numpy as np
import pytest

from sparseattn import bench, builders
from sparseattn.bf16 import bf16_bits_to_float, float_to_bf16_bits
from sparseattn.layouts import video_layout
from sparseattn.reference import attention_backward, attention_forward

D = 16


def _problem(seed=0, batch=1, heads=2):
    layout = video_layout((6, 8, 9), (4, 4, 4), block_size=64)  # partial tiles at two edges
    graph = builders.random_graph(layout, layout, heads=heads, density=0.4, seed=seed)
    rng = np.random.default_rng(seed)
    shape = (batch, heads, layout.num_slots, D)
    return graph, *(rng.standard_normal(shape) for _ in range(4))


@pytest.mark.parametrize("wrong", [None, "dq", "dk", "dv"])
def test_sampled_grad_error_flags_each_wrong_gradient(wrong):
    graph, q, k, v, do = _problem()
    g = graph.select_heads([0])
    q, k, v, do = (x[:, :1] for x in (q, k, v, do))
    o, lse = attention_forward(q, k, v, g)
    grads = list(attention_backward(q, k, v, o, lse, do, g))
    if wrong is not None:
        grads["qkv".index(wrong[1])] = grads["qkv".index(wrong[1])] * 1.1
    err = bench.sampled_grad_error(g, q, k, v, o, lse, do, grads, 1 / np.sqrt(D), sample_blocks=5)
    if wrong is None:
        assert err < 1e-12
    else:
        assert err > 0.05


@pytest.fixture
def reference_kernels(monkeypatch):
    """``bench_paged`` on the CPU: a host stand-in for cupy, the forward and backward kernels replaced by
    the float64 reference on bf16 inputs (outputs rounded to bf16); ``factor`` scales the dK returned."""
    import sparseattn.kernels.backward as backward_module
    import sparseattn.kernels.forward as forward_module

    graph, q, k, v, do = _problem()
    device = types.SimpleNamespace(synchronize=lambda: None)
    monkeypatch.setattr(
        bench,
        "cupy",
        types.SimpleNamespace(asnumpy=np.asarray, cuda=types.SimpleNamespace(Device=lambda: device)),
    )
    case = object.__new__(bench.Case)  # its inputs set by hand instead of on a GPU
    case.graph, case.d, case.b, case.scale = graph, D, 1, 1 / np.sqrt(D)
    case.q, case.k, case.v, case.do = (float_to_bf16_bits(x) for x in (q, k, v, do))
    qf, kf, vf, dof = (bf16_bits_to_float(x).astype(np.float64) for x in (case.q, case.k, case.v, case.do))
    o, lse = attention_forward(qf, kf, vf, graph)
    o_bits = float_to_bf16_bits(o)
    grads = attention_backward(qf, kf, vf, bf16_bits_to_float(o_bits).astype(np.float64), lse, dof, graph)
    state = types.SimpleNamespace(factor=1.0, case=case)
    monkeypatch.setattr(forward_module, "paged_forward", lambda *a, **kw: (o_bits, lse.astype(np.float32)))
    monkeypatch.setattr(
        backward_module,
        "paged_backward",
        lambda *a, **kw: tuple(
            float_to_bf16_bits(x * (state.factor if n == 1 else 1.0)) for n, x in enumerate(grads)
        ),
    )
    return state


def _timer(fn, reps=None):
    fn()
    return 1.0, [1.0]


@pytest.mark.parametrize("factor, correct", [(1.0, True), (1.2, False)], ids=["right", "dk_wrong"])
def test_bench_paged_checks_the_backward_before_timing(reference_kernels, factor, correct):
    reference_kernels.factor = factor
    records = bench.bench_paged(reference_kernels.case, _timer, ("bwd", "fwdbwd"), check=True, kind="kpage")
    assert [r["pass"] for r in records] == ["bwd", "fwdbwd"]
    for r in records:
        assert r["correct"] is correct and r["time_ms"] == 1.0
        assert (r["rel_err_grads"] < bench.GRAD_REL_TOL) is correct


def test_a_failing_check_is_recorded_and_the_timing_still_runs(reference_kernels, monkeypatch):
    def broken(*args):
        raise RuntimeError("no reference today")

    monkeypatch.setattr(reference_kernels.case, "grad_err_head0", broken)
    records = bench.bench_paged(reference_kernels.case, _timer, ("bwd",), check=True, kind="kpage")
    assert records[0]["correct"] is None and records[0]["time_ms"] == 1.0
    assert records[0]["check_error"] == "RuntimeError: no reference today"
    unchecked = bench.bench_paged(reference_kernels.case, _timer, ("bwd",), check=False, kind="kpage")
    assert unchecked[0]["correct"] is None and "rel_err_grads" not in unchecked[0]


@pytest.mark.parametrize("name", ["dense_16384", "dense_32768", "dense_75600", "dense_131072"])
def test_dense_workloads_select_every_block_pair(name):
    """The dense rows: every block pair of 128-token blocks at the workload's head count."""
    from sparseattn.bench import DENSE_WORKLOADS, workload_graph

    tokens, heads, head_dim = DENSE_WORKLOADS[name]
    graph, d = workload_graph(name)
    blocks = -(-tokens // 128)
    assert (graph.heads, graph.q.num_blocks, d) == (heads, blocks, head_dim)
    assert graph.nnz == heads * blocks * blocks and graph.useful_pairs() == heads * tokens**2
    assert int(graph.q.valid.sum()) == tokens


def test_varblock_inputs_are_the_same_graph():
    """FlashInfer's variable-block form of an SVG2 HeadStack: per head, the clusters' token counts as
    blocks, the tokens in slot order, and a block mask that keeps exactly the graph's (query, key) pairs."""
    from sparseattn.builders import svg2_graph
    from sparseattn.graph import HeadStack

    graphs = svg2_graph((4, 6, 8), heads=3, q_clusters=5, k_clusters=9, block_size=64, seed=2)
    mask, row_sz, col_sz, q_slots, k_slots = bench.varblock_inputs(HeadStack.of(graphs))
    tokens = 4 * 6 * 8
    assert q_slots.shape == k_slots.shape == (3, tokens)
    for h, g in enumerate(graphs):
        assert row_sz[h].sum() == col_sz[h].sum() == tokens
        assert np.array_equal(q_slots[h], np.flatnonzero(g.q.valid))
        q_block = np.repeat(np.arange(row_sz.shape[1]), row_sz[h])  # cluster block of each token, slot order
        k_block = np.repeat(np.arange(col_sz.shape[1]), col_sz[h])
        got = mask[h][q_block][:, k_block]
        want = g.token_mask(0)[q_slots[h]][:, k_slots[h]]
        assert np.array_equal(got, want)
