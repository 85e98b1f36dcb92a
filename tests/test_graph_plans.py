import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseattn.graph import GraphError, SparseGraph
from sparseattn.layouts import partition_layout, slot_layout, video_layout
from sparseattn.planning.tile_plan import PlanError, bsa_plan, full_pages_first, gather_segments, kpage_plan


def _layout(valid_rows_per_block, block_size):
    valid = np.zeros(len(valid_rows_per_block) * block_size, bool)
    for b, n in enumerate(valid_rows_per_block):
        valid[b * block_size : b * block_size + n] = True
    return slot_layout(valid, block_size)


def test_from_pairs_sorts_dedups_and_drops_empty():
    q = _layout([128, 40, 0], 128)
    k = _layout([128, 0, 7], 128)
    g = SparseGraph.from_pairs(q, k, 1, [0, 0, 0, 0, 0], [1, 0, 0, 2, 1], [2, 2, 0, 0, 2])
    # (2,0) dropped: Q block 2 empty; (q=1,k=2) listed twice.
    assert g.nnz == 3
    np.testing.assert_array_equal(g.row(0, 0), [0, 2])
    np.testing.assert_array_equal(g.row(0, 1), [2])
    np.testing.assert_array_equal(g.row(0, 2), [])


@pytest.mark.parametrize(
    "bad",
    [dict(k_block=[5]), dict(q_block=[-1]), dict(head=[2])],
    ids=["k-out-of-range", "q-negative", "head-out-of-range"],
)
def test_from_pairs_rejects_out_of_range(bad):
    q = _layout([16, 16], 16)
    args = dict(head=[0], q_block=[0], k_block=[0])
    args.update(bad)
    with pytest.raises(GraphError, match=next(iter(bad))):
        SparseGraph.from_pairs(q, q, 2, **args)


def test_csr_validation():
    q = _layout([16], 16)
    with pytest.raises(GraphError, match="indices"):
        SparseGraph(q, q, 1, np.array([0, 1]), np.array([3]))
    with pytest.raises(GraphError, match="sorted"):
        SparseGraph(q, _layout([16, 16], 16), 1, np.array([0, 2]), np.array([1, 0]))


def test_transpose_roundtrip():
    rng = np.random.default_rng(1)
    lay = video_layout((5, 7, 9), (2, 4, 4), 32)
    g = SparseGraph.from_block_mask(lay, lay, rng.random((2, lay.num_blocks, lay.num_blocks)) < 0.3)
    np.testing.assert_array_equal(g.transpose().transpose().block_mask(), g.block_mask())
    np.testing.assert_array_equal(g.transpose().block_mask(), g.block_mask().transpose(0, 2, 1))


def test_gather_segments():
    out, lens = gather_segments(np.array([0, 2, 2, 5]), np.arange(10, 15), np.array([2, 0, 1, 2]))
    np.testing.assert_array_equal(out, [12, 13, 14, 10, 11, 12, 13, 14])
    np.testing.assert_array_equal(lens, [3, 2, 0, 3])


def test_kpage_plan_by_hand():
    # Q block 0: 40 valid rows -> 3 live pages -> qrows 48 -> 64x256 route.
    # K blocks: 128 valid (8 pages) and 7 valid (1 page) -> 9 pages = 144 rows -> ceil(144/256) = 1 tile.
    q = _layout([40], 128)
    k = _layout([128, 7], 128)
    g = SparseGraph.from_pairs(q, k, 1, [0, 0], [0, 0], [0, 1])
    p = kpage_plan(g)
    assert p.num_work == 1 and p.routes[p.work_route[0]] == (64, 256)
    np.testing.assert_array_equal(p.own_pages[0], [0, 1, 2, -1, -1, -1, -1, -1])
    np.testing.assert_array_equal(p.stream_pages, list(range(8)) + [8])
    assert p.physical_pairs() == 64 * 256
    assert kpage_plan(g, route=1).physical_pairs() == 128 * 128 * 2
    assert bsa_plan(g).physical_pairs() == 2 * 128 * 128


def test_bsa_plan_keeps_rows_without_selection():
    q = _layout([128, 3], 128)
    g = SparseGraph.from_pairs(q, q, 1, [0], [0], [0])
    p = bsa_plan(g)
    assert p.num_work == 2  # Q block 1 has valid rows and no selection: still written (O=0)
    np.testing.assert_array_equal(p.stream_lengths(), [8, 0])


def test_plan_owner_kv_is_transpose():
    q = _layout([128, 64], 128)
    k = _layout([16, 128, 128], 128)
    g = SparseGraph.from_pairs(q, k, 1, [0, 0, 0], [0, 1, 1], [0, 0, 2])
    p = bsa_plan(g, owner="kv")
    assert p.owner == "kv" and p.num_work == 3
    assert p.q_page_mask is p.stream_page_mask and p.k_page_mask is p.own_page_mask
    with pytest.raises(PlanError, match="owner"):
        bsa_plan(g, owner="k")


def test_route_errors():
    q = _layout([16], 16)
    g = SparseGraph.from_pairs(q, q, 1, [0], [0], [0])
    with pytest.raises(PlanError, match="route"):
        kpage_plan(g, route="64x64")


@settings(deadline=None, max_examples=40)
@given(
    rows_q=st.lists(st.integers(0, 128), min_size=1, max_size=5),
    rows_k=st.lists(st.integers(0, 128), min_size=1, max_size=5),
    seed=st.integers(0, 2**16),
    route=st.sampled_from(["auto", 0, 1]),
)
def test_plans_stream_exactly_the_live_pages(rows_q, rows_k, seed, route):
    rng = np.random.default_rng(seed)
    q, k = _layout(rows_q, 128), _layout(rows_k, 128)
    g = SparseGraph.from_block_mask(q, k, rng.random((2, q.num_blocks, k.num_blocks)) < 0.5)
    p = kpage_plan(g, route=route)
    # every streamed page is live; every owned page is live; each (head, owned page) appears once
    assert k.page_live[p.stream_pages].all()
    owned = p.own_pages[p.own_pages >= 0]
    assert q.page_live[owned].all()
    heads_rep = np.repeat(p.work_head, (p.own_pages >= 0).sum(1))
    keys = heads_rep.astype(np.int64) * q.num_pages + p.own_pages[p.own_pages >= 0]
    assert np.unique(keys).size == keys.size == 2 * int(q.live_pages.sum())
    # streamed page count per work item = live pages of the selected blocks of its Q block
    expect = np.array([k.live_pages[g.row(h, b)].sum() for h, b in zip(p.work_head, p.work_block)])
    np.testing.assert_array_equal(p.stream_lengths(), expect)
    # each item streams its blocks' live pages in block order, full pages before partial ones
    live = np.flatnonzero(k.page_live)
    for i, (h, b) in enumerate(zip(p.work_head, p.work_block)):
        pages = live[np.isin(live // (k.block_size // 16), g.row(h, b))]
        full = k.page_mask[pages] == 0xFFFF
        stream = p.stream_pages[p.stream_indptr[i] : p.stream_indptr[i + 1]]
        np.testing.assert_array_equal(stream, np.concatenate([pages[full], pages[~full]]))


@settings(deadline=None, max_examples=60)
@given(
    lengths=st.lists(st.integers(0, 20), max_size=6),
    seed=st.integers(0, 2**16),
)
def test_full_pages_first_is_a_stable_partition_per_item(lengths, seed):
    rng = np.random.default_rng(seed)
    mask = np.where(rng.random(30) < 0.3, rng.integers(0, 0xFFFF, 30), 0xFFFF).astype(np.uint16)
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    pages = rng.integers(0, 30, int(indptr[-1]))
    out = full_pages_first(pages, indptr, mask)
    for a, b in itertools.pairwise(indptr):
        seg = pages[a:b]
        full = mask[seg] == 0xFFFF
        np.testing.assert_array_equal(out[a:b], np.concatenate([seg[full], seg[~full]]))


def test_partition_layout_graph_plan():
    groups = np.random.default_rng(3).integers(0, 5, size=300)
    q = partition_layout(groups, 64)
    k = partition_layout(groups[::-1].copy(), 64)
    g = SparseGraph.from_block_mask(q, k, np.ones((1, q.num_blocks, k.num_blocks), bool))
    useful = int((q.valid_rows[:, None] * k.valid_rows[None, :]).sum())
    # KPage can exceed BSA here (64x64 blocks vs 256-wide packed tiles); both cover the useful pairs
    assert useful <= kpage_plan(g).physical_pairs()
    assert useful <= bsa_plan(g).physical_pairs() == g.nnz * 64 * 64


def test_from_pairs_ignores_order_and_duplicates():
    """Shuffled, duplicated pairs give the graph of the block mask they select, dropped pairs counted
    once each, and the transpose holds the same pairs."""
    rng = np.random.default_rng(7)
    lay = video_layout((5, 6, 7), (4, 4, 4), block_size=64)
    mask = rng.random((3, lay.num_blocks, lay.num_blocks)) < 0.3
    h, i, j = np.nonzero(mask)
    take = rng.permutation(np.concatenate([np.arange(h.size), rng.integers(0, h.size, h.size // 2)]))
    got = SparseGraph.from_pairs(lay, lay, 3, h[take], i[take], j[take])
    want = SparseGraph.from_block_mask(lay, lay, mask)
    np.testing.assert_array_equal(got.indptr, want.indptr)
    np.testing.assert_array_equal(got.indices, want.indices)
    np.testing.assert_array_equal(got.dropped_pairs, want.dropped_pairs)
    np.testing.assert_array_equal(got.transpose().block_mask(), got.block_mask().transpose(0, 2, 1))
