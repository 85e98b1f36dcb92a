"""Occupancy analysis: hand-derived counts on small layouts, and properties against the tile plans."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseattn import analysis, planning
from sparseattn.graph import SparseGraph
from sparseattn.layouts import slot_layout, video_layout


def full_graph(q, k, heads=1, drop_empty=True):
    return SparseGraph.from_block_mask(
        q, k, np.ones((heads, q.num_blocks, k.num_blocks), bool), drop_empty=drop_empty
    )


def totals(graph, route="auto"):
    return analysis.graph_counts(graph, route).totals()


# --- hand-derived cases ---------------------------------------------------------------------------
def test_partial_tile_prefix_padding():
    # latent 2x8x12, tiles 2x8x8, B=128: tile 0 = 2*8*8 = 128 tokens (8 live pages),
    # tile 1 = 2*8*4 = 64 tokens as a prefix of its 128 slots (4 live pages).
    lay = video_layout((2, 8, 12), (2, 8, 8), 128)
    g = full_graph(lay, lay)
    t = totals(g)
    assert t["selected_pairs"] == 4
    # useful = (128 + 64) * (128 + 64) = 192^2
    assert t["useful"] == 36864
    # bsa = 4 pairs * 128 * 128
    assert t["bsa_physical"] == 65536
    # every row streams 8 + 4 = 12 K pages = 192 rows.
    # Q block 0: 128 rows -> (128,128): 128*ceil(128/128) * 128*ceil(192/128) = 128 * 256 = 32768
    # Q block 1:  64 rows -> (64,256):   64*ceil(64/64)   * 256*ceil(192/256) =  64 * 256 = 16384
    assert t["kpage_routed"] == t["kpage_physical"] == 32768 + 16384
    # no routing: Q block 1 pays 128 * 256 = 32768 as well
    assert t["kpage_no_routing"] == 65536
    # fixed 64x256: Q block 0 = 64*ceil(128/64) * 256*ceil(192/256) = 128 * 256 = 32768; block 1 = 16384
    assert t["kpage_small_tile"] == 49152


def test_partial_tile_inplace_padding_keeps_every_page_live():
    # same latent, in-place padding: tile 1 has 4 valid tokens in each 8-wide w row, so every
    # 16-slot page (two w rows) holds 8 valid rows -> 8 live pages in both blocks.
    lay = video_layout((2, 8, 12), (2, 8, 8), 128, padding="inplace")
    assert lay.live_pages.tolist() == [8, 8]
    t = totals(full_graph(lay, lay))
    assert t["useful"] == 36864  # same valid tokens: 192^2
    # both Q blocks 128 rows -> (128,128); rows stream 16 pages = 256 rows -> 2 tiles:
    # 2 blocks * 128 * 256 = 65536 (no saving over BSA)
    assert t["kpage_physical"] == 65536
    assert t["bsa_physical"] == 65536


def test_empty_rows_and_unselected_q_blocks_cost_nothing():
    # 1-D layout: blocks of 64 with valid rows [64, 0, 20]; Q block 0 selects K blocks {0, 2},
    # Q block 2 selects nothing; the empty Q block 1 selects K block 0 (dropped: no output rows).
    valid = np.zeros(192, bool)
    valid[:64] = True
    valid[128:148] = True
    lay = slot_layout(valid, 64)
    assert lay.valid_rows.tolist() == [64, 0, 20]
    assert lay.live_pages.tolist() == [4, 0, 2]  # 20 rows -> pages of 16 + 4 rows
    g = SparseGraph.from_pairs(lay, lay, 1, [0, 0, 0], [0, 0, 1], [0, 2, 0])
    t = totals(g)
    assert t["selected_pairs"] == 2
    assert t["useful"] == 64 * 64 + 64 * 20  # 4096 + 1280 = 5376
    assert t["bsa_physical"] == 2 * 64 * 64  # 8192
    # Q block 0: 64 rows -> (64,256); streams 4 + 2 = 6 pages = 96 rows -> 64 * 256 = 16384
    assert t["kpage_physical"] == 16384
    # no routing: 128*ceil(64/128) * 128*ceil(96/128) = 128 * 128 = 16384
    assert t["kpage_no_routing"] == 16384


def test_empty_q_block_kept_by_drop_empty_false_is_skipped_like_the_plan():
    valid = np.zeros(128, bool)
    valid[:64] = True
    lay = slot_layout(valid, 64)  # blocks: [64 valid, 0 valid]
    g = full_graph(lay, lay, drop_empty=False)  # 4 pairs, 2 of them in the empty Q block's row
    t = totals(g)
    # Q block 0 pays two 64x64 tiles (its empty K block too): 2 * 4096; Q block 1 has no output rows.
    assert t["bsa_physical"] == 8192 == planning.bsa_plan(g).physical_pairs()
    assert t["useful"] == 64 * 64


def test_vsa_cube_with_one_live_page():
    # latent 4x4x5, 4x4x4 cubes, B=64: cube 0 = 64 tokens (4 pages), cube 1 = 4*4*1 = 16 tokens
    # as a prefix -> exactly 1 live page.
    lay = video_layout((4, 4, 5), (4, 4, 4), 64)
    assert lay.valid_rows.tolist() == [64, 16]
    assert lay.live_pages.tolist() == [4, 1]
    t = totals(full_graph(lay, lay))
    assert t["useful"] == 80 * 80  # (64 + 16)^2 = 6400
    assert t["bsa_physical"] == 4 * 64 * 64  # 16384
    # rows stream 4 + 1 = 5 pages = 80 rows; both Q blocks have <= 64 rows -> (64,256):
    # cube 0: 64*1 * 256*1 = 16384; cube 1 (16 rows): 64*ceil(16/64) * 256 = 16384
    assert t["kpage_physical"] == 32768
    # one pair alone (cube 1 x cube 1): useful 16*16 = 256, BSA 64*64 = 4096, KPage 64*256 = 16384
    single = SparseGraph.from_pairs(lay, lay, 1, [0], [1], [1])
    t1 = totals(single)
    assert (t1["useful"], t1["bsa_physical"], t1["kpage_physical"]) == (256, 4096, 16384)


def test_384_slot_tile_split_into_three_blocks():
    # latent 6x8x12, tiles 6x8x8 = 384 slots = three 128-blocks per tile.
    # tile 0: 384 tokens -> blocks [128,128,128]; tile 1: 6*8*4 = 192 tokens -> [128, 64, 0].
    lay = video_layout((6, 8, 12), (6, 8, 8), 128)
    assert lay.valid_rows.tolist() == [128, 128, 128, 128, 64, 0]
    assert lay.live_pages.tolist() == [8, 8, 8, 8, 4, 0]
    assert lay.block_group.tolist() == [0, 0, 0, 1, 1, 1]
    t = totals(full_graph(lay, lay))  # the empty block is dropped: 5 x 5 pairs
    assert t["selected_pairs"] == 25
    assert t["useful"] == 576 * 576  # (4*128 + 64)^2 = 331776
    assert t["bsa_physical"] == 25 * 128 * 128  # 409600
    # each row streams 4*8 + 4 = 36 pages = 576 rows: 5 tiles of 128 (640) or 3 tiles of 256 (768).
    # Q blocks 0-3 (128 rows, 128x128): 4 * 128 * 640 = 327680; Q block 4 (64 rows, 64x256): 64 * 768 = 49152
    assert t["kpage_physical"] == 327680 + 49152
    # no routing: 5 * 128 * 640 = 409600
    assert t["kpage_no_routing"] == 409600


def test_per_head_counts_and_aggregation():
    lay = video_layout((2, 8, 12), (2, 8, 8), 128)
    # head 0 selects everything (4 pairs), head 1 only (block 1, block 1)
    g = SparseGraph.from_pairs(lay, lay, 2, [0, 0, 0, 0, 1], [0, 0, 1, 1, 1], [0, 1, 0, 1, 1])
    c = analysis.graph_counts(g)
    assert c.useful.tolist() == [36864, 64 * 64]
    assert c.bsa_physical.tolist() == [65536, 16384]
    # head 1: 64 rows -> (64,256), streams 4 pages = 64 rows -> 64 * 256
    assert c.kpage_physical.tolist() == [49152, 16384]
    rep = analysis.analyze_graphs([g, g.select_heads([1])], "two", layers=3)
    rec = rep.record()
    assert rep.heads == 3
    assert rec["useful_pairs"] == 36864 + 2 * 4096
    assert rec["kpage_physical"] == 49152 + 2 * 16384
    assert rec["bsa_occupancy"] == pytest.approx(rec["useful_pairs"] / rec["bsa_physical"])
    assert rep.record(multiply_layers=True)["bsa_physical"] == 3 * rec["bsa_physical"]
    per_head = rep.per_head_records()
    assert [r["useful_pairs"] for r in per_head] == [36864, 4096, 4096]
    total = analysis.total_record([rep, rep])
    assert total["useful_pairs"] == 2 * rec["useful_pairs"]


def test_block_fill_histograms():
    lay = video_layout((6, 8, 12), (6, 8, 8), 128)
    fill = analysis.graph_fill(full_graph(lay, lay, heads=2))
    # layout histograms count each block once per head
    assert fill.q_valid_rows[128] == 2 * 4 and fill.q_valid_rows[64] == 2 and fill.q_valid_rows[0] == 2
    assert fill.k_live_pages.tolist() == [2, 0, 0, 0, 2, 0, 0, 0, 8]
    # selected pairs: 2 heads * 5 rows * (4 full K blocks + 1 half K block)
    assert fill.selected_k_valid_rows[128] == 40 and fill.selected_k_valid_rows[64] == 10
    # pair fill: full x full = 1.0 (32 pairs), full x half = 0.5 (16), half x half = 0.25 (2)
    bins = fill.pair_fill_bins
    assert fill.pair_fill[np.searchsorted(bins, 0.25, side="right") - 1] == 2
    assert fill.pair_fill[np.searchsorted(bins, 0.5, side="right") - 1] == 16
    assert fill.pair_fill[-1] == 32
    assert fill.pair_fill.sum() == 50


@pytest.mark.parametrize(
    "route,expected",
    [("auto", "auto"), ("64x256", 0), ("128x128", 1), (0, 0), (1, 1)],
    ids=["auto", "64x256", "128x128", "int0", "int1"],
)
def test_parse_route(route, expected):
    assert analysis.parse_route(route) == expected


@pytest.mark.parametrize("bad", ["fast", 2, True, None], ids=["name", "int", "bool", "none"])
def test_bad_route_names_the_argument(bad):
    with pytest.raises(ValueError, match="route"):
        analysis.parse_route(bad)


def test_bad_inputs_raise_value_errors():
    with pytest.raises(ValueError, match="graph"):
        analysis.graph_counts("not a graph")
    with pytest.raises(ValueError, match="graphs"):
        analysis.analyze_graphs([])
    lay = video_layout((2, 8, 12), (2, 8, 8), 128)
    with pytest.raises(ValueError, match="layers"):
        analysis.analyze_graphs([full_graph(lay, lay)], layers=0)


# --- properties against the planners --------------------------------------------------------------
@st.composite
def random_layout(draw, max_blocks=5):
    block = draw(st.sampled_from([16, 32, 64, 128]))
    nblocks = draw(st.integers(1, max_blocks))
    kind = draw(st.sampled_from(["mask", "video"]))
    if kind == "video":
        tile = (draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 8)))
        grid = tuple(t + draw(st.integers(0, 2 * t - 1)) for t in tile)  # partial edge tiles likely
        padding = draw(st.sampled_from(["prefix", "inplace"]))
        return video_layout(grid, tile, block, padding=padding)
    bits = draw(st.lists(st.booleans(), min_size=nblocks * block, max_size=nblocks * block))
    valid = np.asarray(bits, bool)
    if not valid.any():
        valid[draw(st.integers(0, valid.size - 1))] = True
    return slot_layout(valid, block)


@st.composite
def random_graph(draw):
    q = draw(random_layout())
    k = draw(random_layout())
    heads = draw(st.integers(1, 3))
    n = draw(st.integers(0, 30))
    head = draw(st.lists(st.integers(0, heads - 1), min_size=n, max_size=n))
    qb = draw(st.lists(st.integers(0, q.num_blocks - 1), min_size=n, max_size=n))
    kb = draw(st.lists(st.integers(0, k.num_blocks - 1), min_size=n, max_size=n))
    drop_empty = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    return (
        q,
        k,
        heads,
        np.asarray(head, np.int64),
        np.asarray(qb, np.int64),
        np.asarray(kb, np.int64),
        drop_empty,
        seed,
    )


@settings(deadline=None, max_examples=60)
@given(random_graph())
def test_counts_equal_plan_physical_pairs_and_bound_useful(case):
    q, k, heads, h, i, j, drop_empty, _ = case
    g = SparseGraph.from_pairs(q, k, heads, h, i, j, drop_empty=drop_empty)
    c = analysis.graph_counts(g)
    t = c.totals()
    if q.block_size <= 128:
        assert t["bsa_physical"] == planning.bsa_plan(g).physical_pairs()
    for route, key in (("auto", "kpage_routed"), (0, "kpage_small_tile"), (1, "kpage_no_routing")):
        assert t[key] == planning.kpage_plan(g, route).physical_pairs(), route
    assert t["useful"] <= t["kpage_routed"]
    assert t["useful"] <= t["kpage_no_routing"]
    assert t["useful"] <= t["kpage_small_tile"]
    assert t["useful"] <= t["bsa_physical"]
    # useful equals the token mask's count, head by head
    for head in range(heads):
        assert c.useful[head] == int(g.token_mask(head).sum())


@settings(deadline=None, max_examples=40)
@given(random_graph())
def test_counts_do_not_depend_on_pair_order(case):
    q, k, heads, h, i, j, drop_empty, seed = case
    g = SparseGraph.from_pairs(q, k, heads, h, i, j, drop_empty=drop_empty)
    perm = np.random.default_rng(seed).permutation(h.size)
    # duplicates of listed pairs must not change anything either
    dup = np.concatenate([perm, perm[: h.size // 2]])
    shuffled = SparseGraph.from_pairs(q, k, heads, h[dup], i[dup], j[dup], drop_empty=drop_empty)
    a, b = analysis.graph_counts(g), analysis.graph_counts(shuffled)
    for name in ("selected_pairs", "useful", "bsa_physical", "kpage_physical", "kpage_no_routing"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


@settings(deadline=None, max_examples=30)
@given(random_graph())
def test_per_head_counts_equal_single_head_graphs(case):
    q, k, heads, h, i, j, drop_empty, _ = case
    g = SparseGraph.from_pairs(q, k, heads, h, i, j, drop_empty=drop_empty)
    whole = analysis.graph_counts(g)
    split = analysis.PairCounts.concat([analysis.graph_counts(g.select_heads([x])) for x in range(heads)])
    for name in ("useful", "bsa_physical", "kpage_physical", "kpage_no_routing", "kpage_small_tile"):
        np.testing.assert_array_equal(getattr(whole, name), getattr(split, name), err_msg=name)
