"""GPU tests of PageWeaver's attention kernels against the float64 reference over the FP8 cache's exact
values: the union kernel (``kernels_cu/pw_union_fwd.cu``, also with singleton groups), the direct
KV-page union (same source, plus its LSE merge) and the per-query kernel (``pw_per_query_fwd.cu``).

Every case: fresh random bf16 Q and e4m3 K/V (seed printed), NaN bytes in every cache row past the
context, NaN-poisoned outputs (every query row must be written), FlashAttention's error rule (≤ 2× the
error of a bf16-rounding emulation — bf16 K/V operands as the kernel dequantises them, P and O rounded
to bf16 — in norm and per row), LSE within 1e-3, o = 0 and LSE = -inf exactly for queries without keys.
"""

from __future__ import annotations

import numpy as np
import pytest

from sparseattn.bf16 import bf16_bits_to_float, float_to_bf16_bits
from sparseattn.pageweaver.captures import Capture, GeneratorConfig, generate_capture
from sparseattn.pageweaver.fp8 import Fp8KVCache, random_cache
from sparseattn.pageweaver.grouping import Grouping, adjacent_groups, affinity_groups
from sparseattn.pageweaver.reference import paged_attention_reference

pytestmark = pytest.mark.gpu

E4M3_NAN = 0x7F
ERR_FACTOR = 2.0
ERR_FLOOR = 1e-5
LSE_ABS_TOL = 1e-3


def random_capture(rng, page_size: int, causal: bool) -> Capture:
    context = int(rng.integers(2, 40)) * page_size - int(rng.integers(0, page_size))  # ragged last page
    nq = int(rng.integers(1, min(context, 180) + 1))
    if causal:
        budget = int(rng.choice([2, 4, 8, 16, 32])) * page_size
        cfg = GeneratorConfig(
            context=context,
            page_size=page_size,
            budget_tokens=budget,
            sink_tokens=page_size,
            local_tokens=page_size * int(rng.integers(1, 3)),
            num_queries=nq,
            segment_mean=float(rng.uniform(2, 30)),
            seed=int(rng.integers(2**31)),
        )
        return generate_capture(cfg)
    num_pages = -(-context // page_size)
    k = int(rng.integers(1, min(num_pages, 40) + 1))
    pages = np.full((nq, k), -1, dtype=np.int32)
    for i in range(nq):
        n = int(rng.integers(0, k + 1))  # some queries select nothing
        pages[i, :n] = rng.choice(num_pages, n, replace=False)
    positions = rng.integers(0, context, nq)
    return Capture(pages=pages, positions=positions, context=context, page_size=page_size, causal=False)


def random_grouping(rng, nq: int, kind: str, capture: Capture) -> Grouping:
    if kind == "adjacent":
        return adjacent_groups(nq, 8)
    if kind == "affinity":
        return affinity_groups(capture, 8, int(rng.choice([16, 64])))
    if kind in ("kv_page", "per_query_mma"):
        return kind
    if kind == "per_query":
        from sparseattn.kernels.pageweaver import per_query_groups

        return per_query_groups(nq)
    ids = rng.permutation(nq).astype(np.int32)  # scattered members, ragged group sizes
    sizes = []
    while sum(sizes) < nq:
        sizes.append(int(min(rng.integers(1, 9), nq - sum(sizes))))
    return Grouping(ids, np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32), 8, "random")


def run_case(rng, poisoned, capture: Capture, grouping, kv_heads: int, gqa: int, **options):
    """One case of the union kernel with ``grouping``, or of another design when ``grouping`` names it:
    ``"kv_page"`` (direct KV-page union) or ``"per_query_mma"`` (the per-query mma.sync kernel)."""
    import cupy

    from sparseattn.kernels.pageweaver import kv_page_forward, per_query_forward, union_forward

    d = 128
    cache = random_cache(rng, kv_heads, capture.context, d, capture.page_size)
    if rng.random() < 0.25:  # scales that are not powers of two: the dequantisation rounds to bf16
        factor = rng.uniform(1.0, 2.0, cache.k_scale.shape).astype(np.float32)
        cache = Fp8KVCache(
            cache.k, cache.v, cache.k_scale * factor, cache.v_scale / factor, cache.page_size, cache.context
        )
    kb, vb = cache.k.copy(), cache.v.copy()
    kb[:, capture.context :] = E4M3_NAN  # rows past the context: never read
    vb[:, capture.context :] = E4M3_NAN
    hq, nq = kv_heads * gqa, capture.num_queries
    qb = float_to_bf16_bits(rng.standard_normal((hq, nq, d), dtype=np.float32))
    scale = float(rng.uniform(0.5, 1.5)) / np.sqrt(d)
    o, lse = poisoned((hq, nq, d), "bf16"), poisoned((hq, nq), "float32")
    tensors = [cupy.asarray(x) for x in (qb, kb, vb, cache.k_scale, cache.v_scale)]
    if isinstance(grouping, str) and grouping == "kv_page":
        kv_page_forward(*tensors, capture, scale=scale, out=(o, lse), **options)
    elif isinstance(grouping, str) and grouping == "per_query_mma":
        per_query_forward(*tensors, capture, scale=scale, out=(o, lse))
    else:
        union_forward(*tensors, capture, grouping, scale=scale, out=(o, lse), **options)
    cupy.cuda.Device().synchronize()
    qf = bf16_bits_to_float(qb).astype(np.float64)
    k_exact, v_exact = cache.dequantized()
    k_bf16, v_bf16 = cache.dequantized(round_bf16=True)
    o_ref, lse_ref = paged_attention_reference(qf, k_exact, v_exact, capture, scale)
    o_emul, lse_emul = paged_attention_reference(qf, k_bf16, v_bf16, capture, scale, emulate_bf16=True)
    got = bf16_bits_to_float(cupy.asnumpy(o)).astype(np.float64)
    lse = cupy.asnumpy(lse).astype(np.float64)
    assert not np.isnan(got).any(), "NaN in o: a query row unwritten (or a NaN cache row read)"
    assert not np.isnan(lse).any(), "NaN in lse: a query row unwritten"
    norm = max(np.linalg.norm(o_ref), 1e-30)
    rel, rel_emul = np.linalg.norm(got - o_ref) / norm, np.linalg.norm(o_emul - o_ref) / norm
    row, row_emul = np.abs(got - o_ref).max(axis=-1), np.abs(o_emul - o_ref).max(axis=-1)
    assert rel <= ERR_FACTOR * rel_emul + ERR_FLOOR, (
        f"‖o − ref‖/‖ref‖ = {rel:.2e} > 2 × emulation {rel_emul:.2e}"
    )
    worst = np.unravel_index(np.argmax(row), row.shape)
    assert row.max() <= ERR_FACTOR * row_emul.max() + ERR_FLOOR, (
        f"(head, query) {worst}: max |o − ref| = {row.max():.2e} > 2 × emulation's worst row {row_emul.max():.2e}"
    )
    empty = np.isneginf(lse_ref)
    assert np.array_equal(np.isneginf(lse), empty), "LSE is -inf exactly where a query has no key"
    assert np.all(got[empty] == 0.0), "queries without keys must have o = 0"
    if (~empty).any():
        err = float(np.abs(lse[~empty] - lse_ref[~empty]).max())
        err_emul = float(np.abs(lse_emul[~empty] - lse_ref[~empty]).max())  # bf16 K operands (non-2^k scales)
        assert err < ERR_FACTOR * err_emul + LSE_ABS_TOL, (
            f"max |lse − ref| = {err:.3e} (emulation {err_emul:.3e})"
        )
    return {"rel": rel, "rel_emul": rel_emul, "empty": int(empty.sum())}


GROUPINGS = ["adjacent", "affinity", "random", "per_query", "kv_page", "per_query_mma"]
UNION_GROUPINGS = ("adjacent", "affinity", "random", "per_query")
PAGE_SIZES = [16, 64, 128]


@pytest.mark.parametrize("seed", range(20), ids=lambda s: f"case{s}")
@pytest.mark.parametrize("grouping", GROUPINGS)
@pytest.mark.parametrize("page_size", PAGE_SIZES, ids=lambda p: f"P{p}")
def test_union_random(rng, poisoned, page_size, grouping, seed):
    """360 random cases, 60 per design: the union kernel with three groupings and singleton groups, the
    KV-page union, the per-query mma.sync kernel; causal generated and non-causal hand-made captures,
    ragged contexts, GQA 1-16."""
    causal = bool(rng.random() < 0.7)
    capture = random_capture(rng, page_size, causal)
    kv_heads = int(rng.integers(1, 3))
    gqa = int(rng.choice([1, 2, 4, 8, 16]))
    run_case(
        rng, poisoned, capture, random_grouping(rng, capture.num_queries, grouping, capture), kv_heads, gqa
    )


@pytest.mark.parametrize("seed", range(6), ids=lambda s: f"case{s}")
@pytest.mark.parametrize("grouping", UNION_GROUPINGS)
@pytest.mark.parametrize("gqa", [1, 2, 3, 4], ids=lambda g: f"G{g}")
@pytest.mark.parametrize("pack", ["one", "max", "between"])
def test_union_packing(rng, poisoned, pack, gqa, grouping, seed):
    """96 random cases of the union kernel at each number of groups per tile the G allows: one group per
    tile (the unpacked kernel), the most that fill the 64-row tile (8 // G), and one in between."""
    capture = random_capture(rng, int(rng.choice(PAGE_SIZES)), bool(rng.random() < 0.7))
    most = 8 // gqa
    n = {"one": 1, "max": most, "between": max(1, most // 2 + int(rng.integers(0, 2)))}[pack]
    groups = random_grouping(rng, capture.num_queries, grouping, capture)
    run_case(rng, poisoned, capture, groups, int(rng.integers(1, 3)), gqa, pack=min(n, most))


@pytest.mark.parametrize("selected", [20, 40, 64])
@pytest.mark.parametrize("gqa", [1, 2], ids=lambda g: f"G{g}")
def test_union_packs_whose_union_overflows_split(rng, poisoned, gqa, selected):
    """Queries that each select many scattered pages of a long context: a pack's union exceeds the tile's
    list of 512 pages, so the kernel halves its groups until each part fits (one group always fits)."""
    page_size, num_pages = 16, 4096
    nq = int(rng.integers(150, 260))
    pages = np.stack([rng.choice(num_pages, selected, replace=False) for _ in range(nq)]).astype(np.int32)
    pages[rng.random(nq) < 0.1, selected // 2 :] = -1  # some shorter rows
    capture = Capture(
        pages=pages,
        positions=rng.integers(0, num_pages * page_size, nq),
        context=num_pages * page_size,
        page_size=page_size,
        causal=False,
    )
    grouping = random_grouping(rng, nq, "random", capture)
    run_case(rng, poisoned, capture, grouping, 1, gqa)


@pytest.mark.parametrize("design", ["adjacent", "kv_page", "per_query_mma"])
@pytest.mark.parametrize("gqa", [1, 4, 8, 16], ids=lambda g: f"G{g}")
def test_union_builtin_sampled(rng, poisoned, gqa, design):
    """A slice of a built-in 8K capture (its last 256 queries), 2 KV heads: the union with adjacent groups
    of 8, the KV-page union and the per-query kernel."""
    from sparseattn.pageweaver.captures import load_capture

    full = load_capture("nsa_8k")
    rows = slice(full.num_queries - 256, full.num_queries)
    capture = Capture(
        pages=full.pages[rows], positions=full.positions[rows], context=full.context, page_size=full.page_size
    )
    grouping = adjacent_groups(capture.num_queries, 8) if design == "adjacent" else design
    run_case(rng, poisoned, capture, grouping, 2, gqa)


@pytest.mark.parametrize("gqa", [1, 4], ids=lambda g: f"G{g}")
def test_union_reads_only_the_device_group_count(rng, poisoned, gqa):
    """A grouping made on the GPU holds more group slots than groups (its count on the device): the slots
    past the count hold garbage offsets, which no tile may read, packed or not."""
    import types

    import cupy

    capture = random_capture(rng, 64, True)
    groups = random_grouping(rng, capture.num_queries, "random", capture)
    spare = 5
    offsets = np.concatenate([groups.offsets, np.full(spare, 10**6, dtype=np.int32)]).astype(np.int32)
    device_grouping = types.SimpleNamespace(
        ids=cupy.asarray(groups.ids),
        offsets=cupy.asarray(offsets),
        num_groups=cupy.asarray([groups.num_groups], dtype=cupy.int32),
        max_groups=groups.num_groups + spare,
        group_size=8,
    )
    run_case(rng, poisoned, capture, device_grouping, 2, gqa)


def test_kv_page_head_chunks_and_phase_times(rng, poisoned):
    """A partial budget of one KV head's partials: 3 KV heads run as 3 launches (+ merges), still exact."""
    from sparseattn.kernels.pageweaver import kv_page_plan

    capture = random_capture(rng, 64, True)
    gqa = 4
    per_head = gqa * kv_page_plan(capture).num_entries * 129 * 4
    phases = {}
    run_case(rng, poisoned, capture, "kv_page", 3, gqa, partial_budget=per_head, phases=phases)
    assert phases["head_chunks"] == 3
    assert phases["partials_ms"] > 0 and phases["merge_ms"] > 0


def test_union_rejects_bad_input(rng):
    import cupy

    from sparseattn.kernels.pageweaver import union_forward
    from sparseattn.kernels.validate import KernelTypeError, KernelValueError

    capture = generate_capture(GeneratorConfig(context=2048, page_size=64, num_queries=64, seed=1))
    cache = random_cache(rng, 2, capture.context, 128, 64)
    nq = capture.num_queries
    q = cupy.zeros((4, nq, 128), dtype=cupy.uint16)
    k, v, ks, vs = (cupy.asarray(x) for x in (cache.k, cache.v, cache.k_scale, cache.v_scale))
    good = adjacent_groups(nq, 8)
    bad_groupings = {
        "group of 9": adjacent_groups(nq, 9),
        "query missing": Grouping(good.ids[:-1].copy(), np.minimum(good.offsets, nq - 1), 8),
        "query repeated": Grouping(np.concatenate([good.ids[:-1], [0]]).astype(np.int32), good.offsets, 8),
        "id out of range": Grouping(np.concatenate([good.ids[:-1], [nq]]).astype(np.int32), good.offsets, 8),
    }
    for grouping in bad_groupings.values():
        with pytest.raises(KernelValueError, match="grouping"):
            union_forward(q, k, v, ks, vs, capture, grouping)
    with pytest.raises(KernelTypeError, match="k_cache"):
        union_forward(q, k.astype(cupy.float32), v, ks, vs, capture, good)
    with pytest.raises(KernelValueError, match="k_scale"):
        union_forward(q, k, v, ks[:, :-1].copy(), vs, capture, good)
    with pytest.raises(KernelValueError, match="heads"):
        union_forward(cupy.zeros((3, nq, 128), dtype=cupy.uint16), k, v, ks, vs, capture, good)
    with pytest.raises(KernelValueError, match="queries"):
        union_forward(q[:, :-1].copy(), k, v, ks, vs, capture, good)
    with pytest.raises(KernelValueError, match="head_dim"):
        union_forward(cupy.zeros((4, nq, 64), dtype=cupy.uint16), k, v, ks, vs, capture, good)
    for pack in (0, 5, 2.0, True):  # G = 2 allows 1..4 groups per tile
        with pytest.raises(KernelValueError, match="pack"):
            union_forward(q, k, v, ks, vs, capture, good, pack=pack)
    from sparseattn.kernels.pageweaver import kv_page_forward, per_query_forward

    with pytest.raises(KernelValueError, match="k_scale"):
        kv_page_forward(q, k, v, ks[:, :-1].copy(), vs, capture)
    with pytest.raises(KernelValueError, match="v_cache"):
        per_query_forward(q, k, v[:, :-1].copy(), ks, vs, capture)
    with pytest.raises(KernelValueError, match="partial_budget"):
        kv_page_forward(q, k, v, ks, vs, capture, partial_budget=1024)


@pytest.mark.parametrize("design", ["adjacent", "kv_page", "per_query_mma"])
def test_torch_tensors_in_and_out(rng, design):
    """torch bf16 / float8_e4m3fn CUDA tensors in, torch (o, lse) out, equal to the CuPy call's result."""
    torch = pytest.importorskip("torch")
    import cupy

    from sparseattn.kernels.pageweaver import kv_page_forward, per_query_forward, union_forward

    capture = generate_capture(GeneratorConfig(context=1500, page_size=64, num_queries=40, seed=3))
    cache = random_cache(rng, 2, capture.context, 128, 64)
    qb = float_to_bf16_bits(rng.standard_normal((4, capture.num_queries, 128), dtype=np.float32))
    grouping = adjacent_groups(capture.num_queries, 8)

    def call(*tensors):
        if design == "kv_page":
            return kv_page_forward(*tensors, capture)
        if design == "per_query_mma":
            return per_query_forward(*tensors, capture)
        return union_forward(*tensors, capture, grouping)

    o_c, lse_c = call(*(cupy.asarray(x) for x in (qb, cache.k, cache.v, cache.k_scale, cache.v_scale)))
    dev = torch.device("cuda")
    q_t = torch.from_numpy(qb.view(np.int16)).to(dev).view(torch.bfloat16)
    k_t, v_t = (torch.from_numpy(x).to(dev).view(torch.float8_e4m3fn) for x in (cache.k, cache.v))
    ks_t, vs_t = (torch.from_numpy(x).to(dev) for x in (cache.k_scale, cache.v_scale))
    o_t, lse_t = call(q_t, k_t, v_t, ks_t, vs_t)
    torch.cuda.synchronize()
    assert o_t.dtype == torch.bfloat16 and lse_t.dtype == torch.float32
    assert np.array_equal(o_t.view(torch.int16).cpu().numpy().view(np.uint16), cupy.asnumpy(o_c))
    assert np.array_equal(lse_t.cpu().numpy(), cupy.asnumpy(lse_c))
