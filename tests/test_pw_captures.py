"""PageWeaver captures: validation, .npz round trip, the seeded generator, built-ins, the Quest selector."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseattn.pageweaver.captures import (
    BUILTIN_CAPTURES,
    Capture,
    CaptureError,
    GeneratorConfig,
    adjacent_jaccard,
    builtin_capture_dir,
    builtin_capture_paths,
    builtin_config,
    capture_stats,
    generate_capture,
    window_union_sizes,
)
from sparseattn.pageweaver.quest import page_key_stats, quest_select


def _cap(pages, positions=None, context=256, page_size=64, causal=True):
    pages = np.asarray(pages)
    if positions is None:
        positions = np.full(pages.shape[0], context - 1)
    return Capture(pages, np.asarray(positions), context, page_size, causal=causal)


# ---- validation -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        pytest.param({"pages": [[0, 4]]}, CaptureError, "out of range", id="id-beyond-pages"),
        pytest.param({"pages": [[0, -2]]}, CaptureError, "out of range", id="negative-id"),
        pytest.param({"pages": np.array([[0.0, 1.0]])}, TypeError, "integer", id="float-dtype"),
        pytest.param({"pages": np.array([[True, False]])}, TypeError, "integer", id="bool-dtype"),
        pytest.param({"pages": [[0, 3]], "positions": [70]}, CaptureError, "non-causal", id="non-causal"),
        pytest.param({"pages": [[1, 1]]}, CaptureError, "duplicate page 1", id="duplicate"),
        pytest.param({"pages": [[-1, 1]]}, CaptureError, "after -1 padding", id="pad-before-id"),
        pytest.param({"pages": [0, 1]}, CaptureError, "2-D", id="1d-pages"),
        pytest.param(
            {"pages": [[0, 1]], "positions": [1, 2]}, CaptureError, "positions", id="positions-shape"
        ),
        pytest.param(
            {"pages": [[0, 1]], "positions": [256]}, CaptureError, "positions", id="position-beyond"
        ),
        pytest.param({"pages": [[0]], "page_size": 24}, CaptureError, "page_size", id="page-size"),
        pytest.param({"pages": [[0]], "context": 0}, CaptureError, "context", id="context"),
    ],
)
def test_bad_captures_name_the_problem(kwargs, error, match):
    with pytest.raises(error, match=match):
        _cap(**kwargs)


def test_non_causal_selection_is_fine_when_not_causal():
    cap = _cap([[0, 3]], positions=[70], causal=False)
    assert cap.pages.dtype == np.int32 and cap.counts.tolist() == [2]


# ---- I/O --------------------------------------------------------------------------------------
@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous-positions", "sparse-positions"])
def test_save_load_round_trip(tmp_path, contiguous):
    positions = np.array([200, 201, 202]) if contiguous else np.array([3, 130, 255])
    pages = np.array([[0, -1, -1], [0, 2, -1], [0, 1, 3]], np.int64)
    cap = Capture(pages, positions, 256, 64, name="t", meta={"note": "x"})
    path = cap.save(tmp_path / "t.npz")
    with np.load(path) as z:
        assert z["pages"].dtype == np.int16
        assert ("positions" in z) != contiguous
    back = Capture.load(path)
    assert back.pages.dtype == np.int32
    np.testing.assert_array_equal(back.pages, cap.pages)
    np.testing.assert_array_equal(back.positions, cap.positions)
    assert (back.context, back.page_size, back.causal, back.name, back.meta) == (
        256,
        64,
        True,
        "t",
        {"note": "x"},
    )


def test_large_page_ids_are_stored_as_int32(tmp_path):
    context = 40000 * 16  # 40,000 pages of 16 do not fit int16
    cap = Capture(np.array([[0, 39999]], np.int32), np.array([context - 1]), context, 16)
    path = cap.save(tmp_path / "big.npz")
    with np.load(path) as z:
        assert z["pages"].dtype == np.int32
    assert Capture.load(path).pages[0, 1] == 39999


def test_load_rejects_a_foreign_npz(tmp_path):
    np.savez(tmp_path / "x.npz", a=np.zeros(3))
    with pytest.raises(CaptureError, match="header"):
        Capture.load(tmp_path / "x.npz")


# ---- statistics -------------------------------------------------------------------------------
def test_statistics_hand_computed():
    cap = _cap([[0, 1, 2, -1], [0, 1, 3, -1], [0, 1, 3, -1], [2, -1, -1, -1]])
    # {0,1,2} vs {0,1,3}: 2/4; {0,1,3} vs {0,1,3}: 1; {0,1,3} vs {2}: 0
    np.testing.assert_allclose(adjacent_jaccard(cap), [0.5, 1.0, 0.0])
    assert window_union_sizes(cap, 2).tolist() == [4, 4]  # {0,1,2,3} twice
    assert window_union_sizes(cap, 4).tolist() == [4]


# ---- generator --------------------------------------------------------------------------------
@settings(deadline=None, max_examples=25)
@given(
    context=st.integers(16, 3000),
    page_size=st.sampled_from([16, 64, 128]),
    budget=st.sampled_from([256, 1024, 2048]),
    nq=st.integers(1, 400),
    seed=st.integers(0, 10_000),
)
def test_generator_is_causal_and_keeps_sink_and_local_pages(context, page_size, budget, nq, seed):
    cfg = GeneratorConfig(
        context=context,
        page_size=page_size,
        budget_tokens=budget,
        num_queries=min(nq, context),
        seed=seed,
        topic_span=64,
    )
    cap = generate_capture(cfg)  # the constructor validates range, duplicates and causality
    cur = cap.positions // page_size
    assert np.all(cap.pages <= cur[:, None])
    assert cap.counts.tolist() == np.minimum(cfg.k, cur + 1).tolist()
    sel = [set(r[r >= 0].tolist()) for r in cap.pages]
    for s, c in zip(sel, cur):
        assert set(range(min(cfg.sink_pages, c + 1))) <= s
        assert set(range(max(0, c - cfg.local_pages + 1), c + 1)) <= s or len(s) == cfg.k


def test_generator_is_deterministic_by_seed():
    cfg = GeneratorConfig(context=4096, num_queries=512, seed=7)
    a, b = generate_capture(cfg), generate_capture(cfg)
    np.testing.assert_array_equal(a.pages, b.pages)
    assert not np.array_equal(
        a.pages, generate_capture(GeneratorConfig(context=4096, num_queries=512, seed=8)).pages
    )


def test_drop_rate_controls_adjacent_similarity():
    lo = capture_stats(generate_capture(GeneratorConfig(context=8192, num_queries=2048, drop=0.0)))
    hi = capture_stats(generate_capture(GeneratorConfig(context=8192, num_queries=2048, drop=0.3)))
    assert lo["adjacent_jaccard"] > hi["adjacent_jaccard"]
    assert lo["union4_mean"] < hi["union4_mean"]


# ---- built-ins --------------------------------------------------------------------------------
def test_builtin_captures_exist_and_stay_small():
    paths = builtin_capture_paths()
    assert len(paths) == 6 and all(p.exists() for p in paths)
    assert sum(p.stat().st_size for p in builtin_capture_dir().glob("*.npz")) < 12e6


@pytest.mark.parametrize("name", list(BUILTIN_CAPTURES))
def test_builtin_capture_meets_its_calibration_target(name):
    cap = Capture.load(builtin_capture_dir() / f"{name}.npz")
    style, context, _ = BUILTIN_CAPTURES[name]
    assert cap.context == context and cap.num_queries == context and cap.causal
    assert cap.k == {"nsa": 16, "dsa": 32}[style]
    stats = capture_stats(cap)
    if context == 8192:
        assert abs(stats["adjacent_jaccard"] - 0.9) < 0.015  # Jaccard ≈ 0.9 at 8K
    else:
        assert abs(stats["union4_mean"] / (4 * cap.k) - 22 / 64) < 0.01  # ≈ 22 distinct of 64 loaded


def test_builtin_file_matches_the_generator():
    cap = Capture.load(builtin_capture_dir() / "nsa_8k.npz")
    np.testing.assert_array_equal(cap.pages, generate_capture(builtin_config("nsa_8k")).pages)


# ---- Quest selector ---------------------------------------------------------------------------
def test_page_key_stats_match_brute_force(rng):
    keys = rng.standard_normal((150, 4))
    kmax, kmin = page_key_stats(keys, 64, "maxmin")
    mean, _ = page_key_stats(keys, 64, "mean")
    for p, (a, b) in enumerate([(0, 64), (64, 128), (128, 150)]):
        np.testing.assert_allclose(kmax[p], keys[a:b].max(0))
        np.testing.assert_allclose(kmin[p], keys[a:b].min(0))
        np.testing.assert_allclose(mean[p], keys[a:b].mean(0))


@pytest.mark.parametrize("stat", ["maxmin", "mean"])
@pytest.mark.parametrize("heads", [1, 3], ids=["1-head", "3-heads"])
def test_quest_select_equals_brute_force_top_k(rng, stat, heads):
    L, d, Q, k, P = 300, 8, 40, 3, 16
    keys = rng.standard_normal((L, d))
    q = rng.standard_normal((Q, heads, d))
    cap = quest_select(q, keys, k, page_size=P, stat=stat)
    for i, pos in enumerate(cap.positions):
        scores = []
        for p in range(pos // P + 1):
            kp = keys[p * P : min((p + 1) * P, L)]
            if stat == "maxmin":
                s = sum(np.maximum(q[i, h] * kp.max(0), q[i, h] * kp.min(0)).sum() for h in range(heads))
                # the Quest score bounds every q·k of the page
                assert s >= max((kp @ q[i, h]).max() for h in range(heads)) - 1e-9 or heads > 1
            else:
                s = sum(q[i, h] @ kp.mean(0) for h in range(heads))
            scores.append(s)
        want = sorted(np.argsort(scores)[::-1][:k].tolist())
        assert cap.pages[i][cap.pages[i] >= 0].tolist() == want


def test_quest_select_is_causal_and_forces_sink_and_local(rng):
    keys = rng.standard_normal((512, 8))
    q = rng.standard_normal((512, 8))
    cap = quest_select(q, keys, 4, page_size=64, sink_pages=1, local_pages=1, positions=np.arange(512))
    cur = cap.positions // 64
    assert np.all(cap.pages <= cur[:, None])
    assert np.all((cap.pages == 0).any(axis=1))
    assert np.all((cap.pages == cur[:, None]).any(axis=1))
    assert cap.counts.tolist() == np.minimum(4, cur + 1).tolist()


@pytest.mark.parametrize(
    "q,keys,kwargs,error,match",
    [
        pytest.param(np.zeros((2, 4), np.int32), np.zeros((8, 4)), {}, TypeError, "float", id="int-q"),
        pytest.param(np.zeros((2, 4)), np.zeros((8, 5)), {}, CaptureError, "keys", id="dim-mismatch"),
        pytest.param(np.zeros((2, 4)), np.zeros((8, 4)), {"stat": "median"}, CaptureError, "stat", id="stat"),
        pytest.param(
            np.zeros((9, 4)), np.zeros((8, 4)), {}, CaptureError, "positions", id="too-many-queries"
        ),
        pytest.param(
            np.zeros((2, 4)), np.zeros((8, 4)), {"page_size": 10}, CaptureError, "page_size", id="page"
        ),
    ],
)
def test_quest_select_rejects_bad_input(q, keys, kwargs, error, match):
    with pytest.raises(error, match=match):
        quest_select(q, keys, 2, **kwargs)
