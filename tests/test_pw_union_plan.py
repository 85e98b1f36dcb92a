"""PageWeaver union plan: construction (vs a Python-set spec), validation, the numpy kernel emulator
(vs the float64 per-query reference), work counts, and a table of bad inputs."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
from small_cases import page_table

from sparseattn.pageweaver.captures import Capture, GeneratorConfig, generate_capture
from sparseattn.pageweaver.grouping import Grouping, adjacent_groups, affinity_groups, union_sizes
from sparseattn.pageweaver.reference import paged_attention_reference
from sparseattn.pageweaver.union_plan import (
    MEMBER_SLOTS,
    UnionPlan,
    UnionPlanError,
    build_union_plan,
    emulate_union,
    union_counts,
    validate_union_plan,
)

PAGE_SIZES = (16, 64, 128)
GROUP_SIZES = (1, 3, 8)
CONTEXT = 2011  # not a multiple of any page size: the last page is partial
QUERIES = 120
EMPTY_ROWS = (3, 50, 119)  # rows that select nothing (no valid key: o = 0, lse = -inf)
KV_HEADS, HEAD_DIM = 2, 32


def _capture(rows, positions, context, page_size=16, causal=True):
    """Capture from python lists of page ids (rows padded with -1)."""
    pages = page_table(rows)
    return Capture(pages, np.asarray(positions), context, page_size, causal=causal)


@functools.cache
def random_capture(page_size: int, causal: bool) -> Capture:
    cfg = GeneratorConfig(
        context=CONTEXT,
        page_size=page_size,
        num_queries=QUERIES,
        budget_tokens=8 * page_size if page_size > 16 else 256,
        sink_tokens=page_size,
        local_tokens=2 * page_size,
        segment_mean=6.0,
        topic_span=64,
        seed=page_size,
    )
    cap = generate_capture(cfg)
    pages = cap.pages.copy()
    pages[list(EMPTY_ROWS)] = -1
    return Capture(pages, cap.positions, cap.context, page_size, causal=causal)


def grouping_for(cap: Capture, method: str, G: int) -> Grouping:
    return adjacent_groups(cap.num_queries, G) if method == "adjacent" else affinity_groups(cap, G, 32)


@functools.cache
def attention_case(page_size: int, causal: bool, gqa: int):
    """(q, k, v, reference o, reference lse) for the random capture (shared by the groupings)."""
    cap = random_capture(page_size, causal)
    rng = np.random.default_rng(1000 * page_size + 10 * gqa + causal)
    q = rng.standard_normal((KV_HEADS * gqa, cap.num_queries, HEAD_DIM))
    k = rng.standard_normal((KV_HEADS, cap.context, HEAD_DIM))
    v = rng.standard_normal((KV_HEADS, cap.context, HEAD_DIM))
    o, lse = paged_attention_reference(q, k, v, cap)
    return q, k, v, o, lse


def spec_plan(cap: Capture, grouping: Grouping):
    """The plan as specified, with Python sets: [(members, [(page, mask), ...]), ...]."""
    out = []
    for a, b in zip(grouping.offsets[:-1], grouping.offsets[1:]):
        members = grouping.ids[a:b].tolist()
        union = {}
        for slot, q in enumerate(members):
            for p in cap.pages[q][cap.pages[q] >= 0].tolist():
                union[p] = union.get(p, 0) | (1 << slot)
        out.append((members, sorted(union.items())))
    return out


def plan_as_lists(plan: UnionPlan):
    out = []
    for g in range(plan.num_groups):
        a, b = plan.union_offsets[g], plan.union_offsets[g + 1]
        members = [int(m) for m in plan.members[g] if m >= 0]
        out.append((members, list(zip(plan.union_pages[a:b].tolist(), plan.member_masks[a:b].tolist()))))
    return out


def assert_matches_reference(o, lse, ro, rlse):
    assert o.shape == ro.shape and lse.shape == rlse.shape
    assert np.array_equal(np.isneginf(lse), np.isneginf(rlse))
    np.testing.assert_allclose(o, ro, rtol=0, atol=1e-10)
    np.testing.assert_allclose(lse, rlse, rtol=0, atol=1e-10)


RANDOM_CASES = [
    pytest.param(P, causal, method, G, id=f"P{P}-{'causal' if causal else 'noncausal'}-{method}-G{G}")
    for P in PAGE_SIZES
    for causal in (True, False)
    for method in ("adjacent", "affinity")
    for G in GROUP_SIZES
]


# ---- construction ------------------------------------------------------------------------------
@pytest.mark.parametrize("P,causal,method,G", RANDOM_CASES)
def test_plan_equals_the_spec_and_validates(P, causal, method, G):
    cap = random_capture(P, causal)
    grouping = grouping_for(cap, method, G)
    plan = build_union_plan(cap, grouping)
    validate_union_plan(plan, cap)
    assert plan_as_lists(plan) == spec_plan(cap, grouping)
    assert np.array_equal(plan.union_lengths, union_sizes(cap, grouping))
    assert plan.union_lengths.dtype == np.int64
    assert plan.members.dtype == np.int32 and plan.members.shape == (grouping.num_groups, MEMBER_SLOTS)
    assert plan.union_offsets.dtype == np.int32 and plan.union_pages.dtype == np.int32
    assert plan.member_masks.dtype == np.uint8
    assert (plan.num_groups, plan.num_queries, plan.page_size, plan.num_pages) == (
        grouping.num_groups,
        cap.num_queries,
        P,
        cap.num_pages,
    )


def hand_capture(causal=True):
    """5 queries over 6 pages of 16 (context 91: page 5 is partial); query 4 selects nothing."""
    rows = [[0, 1, 2], [1, 2, 3], [5], [2, 4], []]
    return _capture(rows, [40, 60, 85, 70, 10], context=91, causal=causal)


def hand_plan():
    return build_union_plan(hand_capture(), adjacent_groups(5, 3))


def test_hand_computed_plan():
    plan = hand_plan()
    assert plan.members.tolist() == [[0, 1, 2] + [-1] * 5, [3, 4] + [-1] * 6]
    assert plan.union_offsets.tolist() == [0, 5, 7]
    assert plan.union_pages.tolist() == [0, 1, 2, 3, 5, 2, 4]
    assert plan.member_masks.tolist() == [0b001, 0b011, 0b011, 0b010, 0b100, 0b01, 0b01]
    assert plan.union_lengths.tolist() == [5, 2]
    validate_union_plan(plan, hand_capture())


def test_members_keep_the_grouping_order():
    cap = hand_capture()
    grouping = Grouping(np.array([4, 2, 0, 3, 1], np.int32), np.array([0, 2, 5], np.int32), 3)
    plan = build_union_plan(cap, grouping)
    assert plan.members[:, :3].tolist() == [[4, 2, -1], [0, 3, 1]]
    assert plan_as_lists(plan) == spec_plan(cap, grouping)
    assert plan.union_pages.tolist() == [5, 0, 1, 2, 3, 4]
    assert plan.member_masks.tolist() == [0b10, 0b001, 0b101, 0b111, 0b100, 0b010]


def test_capture_selecting_nothing_gives_an_empty_plan():
    cap = _capture([[], [], []], [0, 5, 40], context=48)
    plan = build_union_plan(cap, adjacent_groups(3, 2))
    validate_union_plan(plan, cap)
    assert plan.union_offsets.tolist() == [0, 0, 0] and plan.union_pages.size == 0
    q = np.ones((2, 3, 4))
    o, lse = emulate_union(plan, cap, q, np.ones((1, 48, 4)), np.ones((1, 48, 4)))
    assert not o.any() and np.isneginf(lse).all()


# ---- emulator ----------------------------------------------------------------------------------
@pytest.mark.parametrize("gqa", [1, 4], ids=["gqa1", "gqa4"])
@pytest.mark.parametrize("P,causal,method,G", RANDOM_CASES)
def test_emulator_equals_reference(P, causal, method, G, gqa):
    cap = random_capture(P, causal)
    q, k, v, ro, rlse = attention_case(P, causal, gqa)
    plan = build_union_plan(cap, grouping_for(cap, method, G))
    o, lse = emulate_union(plan, cap, q, k, v)
    assert_matches_reference(o, lse, ro, rlse)
    assert np.isneginf(lse[:, list(EMPTY_ROWS)]).all() and not o[:, list(EMPTY_ROWS)].any()


@pytest.mark.parametrize("chunk_keys", [1, 7, 16, 64, 1000], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("gqa", [1, 2], ids=["gqa1", "gqa2"])
def test_emulator_on_the_hand_capture(chunk_keys, causal, gqa):
    """Partial own pages (causal), a partial last page (context 91), an empty row, any chunk size."""
    cap = hand_capture(causal)
    rng = np.random.default_rng(7)
    q = rng.standard_normal((3 * gqa, 5, 8))
    k = rng.standard_normal((3, 96, 8))  # more rows than context: rows 91..95 must stay unused
    v = rng.standard_normal((3, 96, 8))
    k[:, 91:] = v[:, 91:] = 1e6
    for grouping in (adjacent_groups(5, 3), adjacent_groups(5, 8), affinity_groups(cap, 2, 4)):
        plan = build_union_plan(cap, grouping)
        o, lse = emulate_union(plan, cap, q, k, v, scale=0.3, chunk_keys=chunk_keys)
        assert_matches_reference(o, lse, *paged_attention_reference(q, k, v, cap, scale=0.3))
        assert np.isneginf(lse[:, 4]).all() and not o[:, 4].any()
        assert np.isfinite(lse[:, :4]).all()


def test_emulator_masks_keys_by_member():
    """Two queries in one group, disjoint pages: each must see only its own page's keys."""
    cap = _capture([[0], [1]], [31, 31], context=32, causal=False)
    plan = build_union_plan(cap, adjacent_groups(2, 2))
    q = np.zeros((1, 2, 2))  # uniform attention: o = mean of the visible values
    k = np.zeros((1, 32, 2))
    v = np.zeros((1, 32, 2))
    v[0, :16, 0] = 1.0
    v[0, 16:, 1] = 1.0
    o, lse = emulate_union(plan, cap, q, k, v)
    assert o[0].tolist() == [[1.0, 0.0], [0.0, 1.0]]
    np.testing.assert_allclose(lse, np.log(16.0))


# ---- counts ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "heads_q,row_tile,rows",
    [(1, 64, 64), (8, 64, 64), (9, 64, 128), (4, 16, 32), (3, 16, 32)],
    ids=["G1", "G8", "G9-two-tiles", "G4-tile16", "G3-tile16"],
)
def test_union_counts_hand_computed(heads_q, row_tile, rows):
    plan = hand_plan()  # unions of 5 and 2 pages of 16; Σ|S_q| = 3 + 3 + 1 + 2 + 0 = 9
    c = union_counts(plan, heads_q=heads_q, row_tile=row_tile)
    assert c["rows_per_group"] == rows
    assert c["page_loads"] == 7
    assert c["per_query_page_loads"] == 9
    assert c["useful_pairs"] == heads_q * 9 * 16
    assert c["physical_pairs"] == rows * 7 * 16
    assert c["occupancy"] == pytest.approx(heads_q * 9 / (rows * 7))
    assert c["groups"] == 2


def test_union_counts_agree_with_the_capture():
    cap = random_capture(64, True)
    plan = build_union_plan(cap, affinity_groups(cap, 8, 32))
    c = union_counts(plan)
    assert c["per_query_page_loads"] == int(cap.counts.sum())
    assert c["useful_pairs"] == int(cap.counts.sum()) * 64
    assert c["page_loads"] == int(union_sizes(cap, affinity_groups(cap, 8, 32)).sum())


# ---- bad inputs --------------------------------------------------------------------------------
def twelve_queries():
    return _capture([[q % 3, 3 + q % 2] for q in range(12)], [70] * 12, context=80)


@pytest.mark.parametrize(
    "make,match",
    [
        pytest.param(lambda: adjacent_groups(12, 9), r"grouping: group 0 has 9 queries", id="group-of-9"),
        pytest.param(
            lambda: Grouping(np.arange(11, dtype=np.int32), np.array([0, 6, 11], np.int32), 8),
            r"grouping: ids must have shape",
            id="missing-query",
        ),
        pytest.param(
            lambda: Grouping(np.array([0, 1, 1, *range(3, 12)], np.int32), np.array([0, 6, 12], np.int32), 8),
            r"grouping: ids: a query appears in more than one group",
            id="repeated-query",
        ),
        pytest.param(
            lambda: Grouping(np.array([*range(11), 12], np.int32), np.array([0, 6, 12], np.int32), 8),
            r"grouping: ids: query id out of range",
            id="id-out-of-range",
        ),
        pytest.param(
            lambda: Grouping(np.arange(12, dtype=np.int32), np.array([0, 6, 6, 12], np.int32), 8),
            r"grouping: offsets: group 1 is empty",
            id="empty-group",
        ),
        pytest.param(lambda: np.arange(12), r"grouping must be a Grouping", id="not-a-grouping"),
    ],
)
def test_union_plan_rejects_bad_groupings(make, match):
    with pytest.raises(UnionPlanError, match=match):
        build_union_plan(twelve_queries(), make())


def test_union_plan_rejects_a_non_capture():
    with pytest.raises(UnionPlanError, match="capture must be a Capture"):
        build_union_plan(np.zeros((2, 2), np.int32), adjacent_groups(2, 2))


def _tampered(**fields):
    plan = hand_plan()  # pages [0 1 2 3 5 | 2 4], masks [1 3 3 2 4 | 1 1], members [0 1 2 | 3 4]
    arrays = {f: getattr(plan, f).copy() for f in ("members", "union_offsets", "union_pages", "member_masks")}
    for name, edit in fields.items():
        if callable(edit):
            edit(arrays[name])
        else:
            arrays[name] = edit
    return dataclasses.replace(plan, **arrays)


def _set(index, value):
    def edit(a):
        a[index] = value

    return edit


TAMPERED = [
    pytest.param(
        dict(union_pages=_set(4, 6)),
        r"union_pages: group 0 has page 6 outside \[0, num_pages=6\)",
        id="page-too-big",
    ),
    pytest.param(dict(union_pages=_set(5, -1)), r"union_pages: group 1 has page -1", id="page-negative"),
    pytest.param(
        dict(union_pages=_set(slice(0, 2), [1, 0]), member_masks=_set(slice(0, 2), [3, 1])),
        r"union_pages: group 0 is not strictly ascending \(page 1 then 0\)",
        id="pages-descending",
    ),
    pytest.param(
        dict(union_pages=_set(6, 2), member_masks=_set(6, 2)),
        r"union_pages: group 1 is not strictly ascending \(page 2 then 2\)",
        id="page-repeated",
    ),
    pytest.param(
        dict(member_masks=_set(5, 0b101)),
        r"member_masks: group 1 page 2 sets bit 2, but the group has only 2 members",
        id="bit-of-a-missing-member",
    ),
    pytest.param(
        dict(member_masks=_set(3, 0b10000010)),
        r"member_masks: group 0 page 3 sets bit 7",
        id="bit-7-of-3-members",
    ),
    pytest.param(
        dict(member_masks=_set(0, 0)), r"member_masks: group 0 page 0 has an empty mask", id="empty-mask"
    ),
    pytest.param(
        dict(member_masks=_set(1, 0b01)),
        r"member_masks: group 0 page 1 lacks bit 1 \(query 1\)",
        id="dropped-pair",
    ),
    pytest.param(
        dict(
            union_pages=np.array([0, 1, 2, 5, 2, 4], np.int32),
            member_masks=np.array([1, 3, 3, 4, 1, 1], np.uint8),
            union_offsets=np.array([0, 4, 6], np.int32),
        ),
        r"union_pages: group 0 lacks page 3, selected by slot 1 \(query 1\)",
        id="dropped-page",
    ),
    pytest.param(
        dict(member_masks=_set(0, 0b11)),
        r"member_masks: group 0 slot 1 \(query 1\) is marked for page 0, which the capture does not select",
        id="extra-pair",
    ),
    pytest.param(
        dict(members=_set((1, 1), 0)),
        r"members: query 0 is in more than one group \(groups \[0, 1\]\)",
        id="dup-member",
    ),
    pytest.param(dict(members=_set((1, 1), -1)), r"members: query 4 is in no group", id="missing-member"),
    pytest.param(
        dict(members=_set((0, slice(0, 4)), [0, -1, 2, 1])),
        r"members: group 0 has a query id after -1 padding",
        id="padding-in-the-middle",
    ),
    pytest.param(
        dict(members=_set((0, 0), 5)),
        r"members: group 0 slot 0 holds query id 5 outside \[0, 5\)",
        id="member-id-5",
    ),
    pytest.param(dict(members=_set((1, slice(0, 2)), -1)), r"members: group 1 is empty", id="empty-group"),
    pytest.param(
        dict(members=np.zeros((2, 4), np.int32)), r"members must have 8 columns", id="members-4-columns"
    ),
    pytest.param(
        dict(members=np.zeros((2, 8), np.float32)),
        r"members must be int32, got dtype float32",
        id="members-float",
    ),
    pytest.param(
        dict(union_pages=np.array([0, 1, 2, 3, 5, 2, 4], np.int64)),
        r"union_pages must be int32, got dtype int64",
        id="pages-int64",
    ),
    pytest.param(
        dict(member_masks=np.array([1, 3, 3, 2, 4, 1, 1], np.int32)),
        r"member_masks must be uint8, got dtype int32",
        id="masks-int32",
    ),
    pytest.param(
        dict(union_offsets=np.array([[0, 5, 7]], np.int32)), r"union_offsets must be 1-D", id="offsets-2d"
    ),
    pytest.param(
        dict(union_offsets=np.array([0, 8, 7], np.int32)),
        r"union_offsets: decreasing at group 1",
        id="offsets-decreasing",
    ),
    pytest.param(
        dict(union_offsets=np.array([0, 5, 6], np.int32)),
        r"union_offsets must run from 0 to len\(union_pages\) = 7",
        id="offsets-short",
    ),
    pytest.param(
        dict(union_offsets=np.array([0, 7], np.int32)), r"union_offsets must have shape", id="offsets-shape"
    ),
    pytest.param(
        dict(member_masks=np.ones(6, np.uint8)),
        r"member_masks must have union_pages' shape",
        id="masks-length",
    ),
]


@pytest.mark.parametrize("fields,match", TAMPERED)
def test_validate_union_plan_names_the_field(fields, match):
    with pytest.raises(UnionPlanError, match=match):
        validate_union_plan(_tampered(**fields), hand_capture())


@pytest.mark.parametrize(
    "field,value",
    [("page_size", 32), ("num_pages", 7), ("num_queries", 6)],
    ids=["page-size", "num-pages", "num-queries"],
)
def test_validate_union_plan_checks_the_scalars(field, value):
    with pytest.raises(UnionPlanError, match=f"{field}: the plan has {value}"):
        validate_union_plan(dataclasses.replace(hand_plan(), **{field: value}), hand_capture())


def test_validate_union_plan_rejects_the_plan_of_another_capture():
    other = _capture([[0, 1, 2], [1, 2, 3], [5], [2, 3], []], [40, 60, 85, 70, 10], context=91)
    with pytest.raises(UnionPlanError, match=r"group 1"):
        validate_union_plan(hand_plan(), other)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        pytest.param(dict(chunk_keys=0), "chunk_keys", id="chunk-0"),
        pytest.param(dict(chunk_keys=2.5), "chunk_keys", id="chunk-float"),
        pytest.param(dict(q=np.zeros((3, 5, 8))), r"q heads \(3\) must be a multiple", id="q-heads"),
        pytest.param(dict(q=np.zeros((2, 4, 8))), "q must hold the capture's 5 queries", id="q-queries"),
        pytest.param(dict(k=np.zeros((2, 90, 8)), v=np.zeros((2, 90, 8))), "at least 91 rows", id="k-short"),
        pytest.param(dict(v=np.zeros((2, 91, 4))), "k, v", id="v-shape"),
        pytest.param(dict(plan=_tampered(member_masks=_set(1, 1))), "member_masks", id="invalid-plan"),
    ],
)
def test_emulate_union_rejects_bad_arguments(kwargs, match):
    args = dict(plan=hand_plan(), capture=hand_capture(), q=np.zeros((2, 5, 8)))
    args.update(k=np.zeros((2, 91, 8)), v=np.zeros((2, 91, 8)))
    args.update(kwargs)
    with pytest.raises(UnionPlanError, match=match):
        emulate_union(**args)


@pytest.mark.parametrize(
    "kwargs", [dict(heads_q=0), dict(row_tile=0), dict(heads_q=True)], ids=["heads-0", "tile-0", "heads-bool"]
)
def test_union_counts_rejects_bad_parameters(kwargs):
    with pytest.raises(UnionPlanError, match=next(iter(kwargs))):
        union_counts(hand_plan(), **kwargs)


def test_package_exports():
    import sparseattn.pageweaver as pw

    for name in ("UnionPlan", "UnionPlanError", "emulate_union", "union_counts", "validate_union_plan"):
        assert getattr(pw, name) is globals()[name]
    assert pw.MEMBER_SLOTS == MEMBER_SLOTS == 8
    for name in ("Fp8KVCache", "Fp8CacheError", "quantize_kv", "dequantize", "random_cache"):
        assert callable(getattr(pw, name))
    assert pw.paged_attention_reference is paged_attention_reference
