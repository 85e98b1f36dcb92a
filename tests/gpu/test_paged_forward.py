"""GPU tests of the paged forward skeleton (``kernels_cu/paged_fwd.cu``): KPage plans (both routes,
routed and fixed) and BSA plans on the same kernel, against the float64 reference.

Every case: fresh random bf16 inputs (seed printed), NaN in every padding slot of the inputs,
NaN-poisoned outputs, FlashAttention's error rule (≤ 2× a bf16-rounding emulation, in norm and per
row), LSE within 1e-3, -inf and o = 0 exactly for rows without keys, padding rows untouched.
"""

from __future__ import annotations

import numpy as np
import pytest
from forward_checks import check_forward, random_inputs, slots_of
from small_cases import ragged_valid, random_ragged_graph

from sparseattn import builders
from sparseattn.graph import HeadStack, SparseGraph
from sparseattn.layouts import contiguous_layout, partition_layout, slot_layout, video_layout

pytestmark = pytest.mark.gpu

#: (plan kind, route) pairs: every tile route the skeleton runs
ROUTES = [
    ("kpage", "auto"),
    ("kpage", 0),
    ("kpage", 1),
    ("kpage", "pair"),
    ("kpage", "packed"),
    ("bsa", "auto"),
]
ROUTE_IDS = ["kpage-auto", "kpage-64x256", "kpage-128x128", "kpage-pair", "kpage-packed", "bsa"]
routes = pytest.mark.parametrize("kind, route", ROUTES, ids=ROUTE_IDS)
head_dims = pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"d{d}")


def run_case(rng, poisoned, graph, kind, route, batch=1, head_dim=128, scale=None):
    import cupy

    from sparseattn.kernels.forward import paged_forward

    _h, _sq, _sk = slots_of(graph)
    qb, kb, vb = random_inputs(rng, graph, batch, head_dim)
    q, k, v = (cupy.asarray(x) for x in (qb, kb, vb))
    o, lse = poisoned(q.shape, "bf16"), poisoned(q.shape[:3], "float32")
    scale = float(rng.uniform(0.5, 1.5)) / np.sqrt(head_dim) if scale is None else scale
    paged_forward(q, k, v, graph, scale=scale, out=(o, lse), kind=kind, route=route)
    cupy.cuda.Device().synchronize()
    return check_forward(cupy.asnumpy(o), cupy.asnumpy(lse), qb, kb, vb, graph, scale)


@pytest.mark.parametrize("part", range(4), ids=lambda p: f"part{p}")
@routes
def test_random_ragged_cases(seed, poisoned, kind, route, part):
    """100 random ragged graphs per route in four parts of 25 (so pytest-xdist spreads them), each at head
    dims 64 and 128 (batch 1-2): 200 cases."""
    rng = np.random.default_rng([seed, part])
    worst = 0.0
    for case in range(25):
        graph = random_ragged_graph(rng)
        for d in (64, 128):
            res = run_case(rng, poisoned, graph, kind, route, batch=int(rng.integers(1, 3)), head_dim=d)
            worst = max(worst, res["rel"] / max(res["rel_emul"], 1e-12))
    print(f"worst rel err / emulation's: {worst:.2f}")


@routes
@head_dims
def test_video_layout_partial_tiles(rng, poisoned, kind, route, head_dim):
    for padding, tile, bs in (
        ("prefix", (4, 4, 8), 128),
        ("inplace", (4, 4, 8), 128),
        ("prefix", (4, 4, 4), 64),
    ):
        layout = video_layout((5, 7, 9), tile, block_size=bs, padding=padding)
        graph = builders.random_graph(layout, layout, heads=2, density=0.3, seed=int(rng.integers(1 << 30)))
        run_case(rng, poisoned, graph, kind, route, batch=2, head_dim=head_dim)


@routes
@head_dims
def test_per_head_layouts_in_one_launch(rng, poisoned, kind, route, head_dim):
    """A HeadStack: every head has its own Q and K partitions (SVG2-like clusters) and slot count."""
    run_case(rng, poisoned, cluster_stack(rng), kind, route, batch=2, head_dim=head_dim)


def cluster_stack(rng, heads: int = 3) -> HeadStack:
    """SVG2-like per-head layouts: random Q and K cluster partitions of 600-1100 tokens in 128-slot blocks
    (cluster remainders are partial blocks), half of the block pairs selected."""
    graphs = []
    for _ in range(heads):
        n = int(rng.integers(600, 1100))
        q = partition_layout(rng.integers(0, int(rng.integers(3, 9)), n), 128)
        k = partition_layout(rng.integers(0, int(rng.integers(4, 12)), n), 128)
        graphs.append(SparseGraph.from_block_mask(q, k, rng.random((1, q.num_blocks, k.num_blocks)) < 0.5))
    return HeadStack.of(graphs)


@routes
@head_dims
def test_long_streams_through_the_rings(rng, poisoned, kind, route, head_dim):
    """Dense selection over 40 K blocks: many passes through the K/V buffer rings per item."""
    q = contiguous_layout(128 * 3 - 50, 128)
    k = contiguous_layout(128 * 40 - 37, 128)
    graph = SparseGraph.from_block_mask(q, k, np.ones((1, q.num_blocks, k.num_blocks), dtype=bool))
    run_case(rng, poisoned, graph, kind, route, batch=1, head_dim=head_dim)


@routes
def test_many_items_per_cta(rng, poisoned, kind, route):
    """More work items than CTAs, of very different lengths (the persistent scheduler's queue)."""
    q = contiguous_layout(64 * 300, 64)
    k = contiguous_layout(64 * 30, 64)
    mask = rng.random((2, q.num_blocks, k.num_blocks)) < rng.uniform(0.0, 0.6, (2, q.num_blocks, 1))
    run_case(rng, poisoned, SparseGraph.from_block_mask(q, k, mask), kind, route, batch=1, head_dim=64)


def test_torch_tensors_in_and_out(rng):
    torch = pytest.importorskip("torch")
    import cupy

    from sparseattn.kernels.forward import kpage_forward

    layout = video_layout((4, 6, 8), (4, 4, 8), block_size=128)
    graph = builders.random_graph(layout, layout, heads=2, density=0.5, seed=int(rng.integers(1 << 30)))
    qb, kb, vb = random_inputs(rng, graph, 1, 128)
    q, k, v = (torch.from_numpy(x.view(np.int16)).cuda().view(torch.bfloat16) for x in (qb, kb, vb))
    o, lse = kpage_forward(q, k, v, graph)
    assert isinstance(o, torch.Tensor) and o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    o2, _lse2 = kpage_forward(*(cupy.asarray(x) for x in (qb, kb, vb)), graph)
    valid = graph.q.valid
    assert np.array_equal(
        o.view(torch.int16).cpu().numpy()[:, :, valid], cupy.asnumpy(o2).view(np.int16)[:, :, valid]
    )


@pytest.mark.parametrize("head", range(4), ids=lambda h: f"head{h}")
@pytest.mark.parametrize("name", ["vsa_wan14b_720p", "ssta_hy15_720p", "svg2_wan14b_720p"])
def test_builtin_workload_full_size_sampled(rng, name, head):
    """One head of the full-size built-in (heads 0-3, one test each so pytest-xdist spreads them) on the
    KPage plan, checked on 16 random Q blocks against the block-wise float64 reference (‖o − ref‖/‖ref‖
    < 1e-2, per-row max error < 2e-2, LSE within 1e-3; the dense bf16 emulation does not fit at 75k
    tokens)."""
    import cupy

    from sparseattn.kernels.forward import kpage_forward
    from sparseattn.kernels.validate import bf16_bits_to_float
    from sparseattn.reference import attention_forward
    from sparseattn.workloads import get_workload

    wl = get_workload(name)
    graphs = wl.graphs(seed=int(rng.integers(1 << 20)), heads=[head])
    graph = HeadStack.of(graphs) if wl.per_head_layouts else graphs[0]
    qb, kb, vb = random_inputs(rng, graph, 1, wl.head_dim)
    o, lse = kpage_forward(*(cupy.asarray(x) for x in (qb, kb, vb)), graph)
    ob, lb = cupy.asnumpy(o), cupy.asnumpy(lse)
    qf, kf, vf = (bf16_bits_to_float(x) for x in (qb, kb, vb))
    heads = graph.graphs if isinstance(graph, HeadStack) else [graph]
    errs, errs_ref, rows_err = [], [], 0.0
    for t, g in enumerate(heads):  # the workload's head `head` is the tensors' head 0
        h, i, j = g.pairs
        chosen = rng.choice(g.q.num_blocks, size=16, replace=False)
        keep = np.isin(i, chosen)
        sub = SparseGraph.from_pairs(g.q, g.k, 1, h[keep], i[keep], j[keep], drop_empty=False)
        nq, nk = g.q.num_slots, g.k.num_slots
        o_ref, lse_ref = attention_forward(
            qf[:, t : t + 1, :nq], kf[:, t : t + 1, :nk], vf[:, t : t + 1, :nk], sub
        )
        rows = np.repeat(np.isin(np.arange(g.q.num_blocks), chosen), g.q.block_size) & g.q.valid
        got = bf16_bits_to_float(ob[:, t : t + 1, :nq]).astype(np.float64)[:, :, rows]
        ref = o_ref[:, :, rows]
        assert not np.isnan(got).any()
        errs.append(np.linalg.norm(got - ref) ** 2)
        errs_ref.append(np.linalg.norm(ref) ** 2)
        rows_err = max(rows_err, float(np.abs(got - ref).max()))
        fin = np.isfinite(lse_ref[:, :, rows])
        assert np.abs(lb[:, t : t + 1, :nq][:, :, rows][fin] - lse_ref[:, :, rows][fin]).max() < 1e-3
    rel = float(np.sqrt(sum(errs) / sum(errs_ref)))
    print(f"{name} head {head}: rel err {rel:.2e}, worst row error {rows_err:.2e}")
    assert rel < 1e-2 and rows_err < 2e-2


@head_dims
@pytest.mark.parametrize("seed", range(10), ids=lambda s: f"case{s}")
def test_pair_route(rng, poisoned, head_dim, seed):
    """route='pair' (the route "auto" takes on VSA): 64-row Q blocks matched by the K pages they share as
    128-row items over the ordered union of their K pages, partial blocks packed four pages to a half,
    each warp seeing only its own block's pages. Ragged random graphs on 64-slot blocks (so the 64-row
    route, pairs and packed halves occur) and a video neighbour-window graph with partial border cubes."""
    graph = random_ragged_graph(rng)
    if graph.q.block_size != 64:
        q = slot_layout(ragged_valid(rng, int(rng.integers(6, 12)), 64), 64)
        mask = rng.random((2, q.num_blocks, graph.k.num_blocks)) < rng.uniform(0.2, 0.8)
        graph = SparseGraph.from_block_mask(q, graph.k, mask)
    run_case(rng, poisoned, graph, "kpage", "pair", batch=int(rng.integers(1, 3)), head_dim=head_dim)
    layout = video_layout((5, 7, 9), (4, 4, 4), block_size=64)
    window = np.zeros((2, layout.num_blocks, layout.num_blocks), dtype=bool)
    for i in range(layout.num_blocks):
        window[:, i, max(0, i - int(rng.integers(2, 8))) : i + int(rng.integers(2, 8))] = True
    run_case(rng, poisoned, SparseGraph.from_block_mask(layout, layout, window), "kpage", "pair", 2, head_dim)


@head_dims
@pytest.mark.parametrize("seed", range(4), ids=lambda s: f"case{s}")
def test_pair_route_scattered_and_per_head(rng, poisoned, head_dim, seed):
    """route='pair' beyond neighbours: 128-slot video blocks, whose partial (64-row) Q blocks pair with
    each other wherever they are, and a HeadStack of SVG2-like cluster layouts paired head by head."""
    layout = video_layout((7, 9, 11), (4, 4, 8), block_size=128)
    graph = builders.random_graph(layout, layout, heads=2, density=0.4, seed=int(rng.integers(1 << 30)))
    run_case(rng, poisoned, graph, "kpage", "pair", batch=int(rng.integers(1, 3)), head_dim=head_dim)
    run_case(rng, poisoned, cluster_stack(rng), "kpage", "pair", batch=2, head_dim=head_dim)


@pytest.fixture
def tma_build(monkeypatch):
    """The forward compiled with PAGED_FWD_TMA for this test (K and full V pages by the tensor-memory
    accelerator); launches prepared with other macros are not reused (they are cached per macro set)."""
    from sparseattn.kernels import forward

    monkeypatch.setattr(forward, "DEFINES", tuple(sorted({*forward.DEFINES, "PAGED_FWD_TMA"})))


@pytest.mark.parametrize("part", range(2), ids=lambda p: f"part{p}")
@routes
def test_tma_variant_random_ragged_cases(seed, poisoned, tma_build, kind, route, part):
    """PAGED_FWD_TMA on 20 random ragged graphs per route and part, head dims 64 and 128, batch 1-2: NaN in
    every padding slot, so a V page the TMA loaded with an invalid row, or a K page's unmasked stale rows,
    would show up."""
    rng = np.random.default_rng([seed, part, 31])
    for case in range(10):
        graph = random_ragged_graph(rng)
        for d in (64, 128):
            run_case(rng, poisoned, graph, kind, route, batch=int(rng.integers(1, 3)), head_dim=d)


@routes
@head_dims
def test_tma_variant_video_tiles_rings_and_per_head_layouts(rng, poisoned, tma_build, kind, route, head_dim):
    """PAGED_FWD_TMA on partial video tiles, long streams through the K/V rings (full pages by TMA) and a
    HeadStack of cluster layouts (mostly partial pages through cp.async), pair route included."""
    layout = video_layout((5, 7, 9), (4, 4, 4), block_size=64)
    graph = builders.random_graph(layout, layout, heads=2, density=0.3, seed=int(rng.integers(1 << 30)))
    run_case(rng, poisoned, graph, kind, route, batch=2, head_dim=head_dim)
    q = contiguous_layout(128 * 3 - 50, 128)
    k = contiguous_layout(128 * 40 - 37, 128)
    dense = SparseGraph.from_block_mask(q, k, np.ones((1, q.num_blocks, k.num_blocks), dtype=bool))
    run_case(rng, poisoned, dense, kind, route, batch=1, head_dim=head_dim)
    run_case(rng, poisoned, cluster_stack(rng), kind, route, batch=2, head_dim=head_dim)


def test_tma_variant_rejects_an_unaligned_k_before_launch(rng, tma_build):
    """The tensor maps need 16-byte aligned K and V: a view that starts 2 bytes in is refused by name."""
    import cupy

    from sparseattn.kernels.forward import paged_forward
    from sparseattn.kernels.validate import KernelValueError

    q_layout, k_layout = contiguous_layout(200, 64), contiguous_layout(300, 64)
    mask = np.ones((2, q_layout.num_blocks, k_layout.num_blocks), dtype=bool)
    graph = SparseGraph.from_block_mask(q_layout, k_layout, mask)
    qb, kb, vb = random_inputs(rng, graph, 1, 64)
    q, v = cupy.asarray(qb), cupy.asarray(vb)
    flat = cupy.zeros(kb.size + 1, dtype=kb.dtype)
    k = flat[1:].reshape(kb.shape)
    k[...] = cupy.asarray(kb)
    with pytest.raises(KernelValueError, match="k: .*16-byte aligned"):
        paged_forward(q, k, v, graph, kind="kpage")
