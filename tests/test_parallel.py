"""Tasks over processes (sparseattn.parallel) and the sliced analysis built on it."""

import pytest

from sparseattn import analysis
from sparseattn.parallel import run_tasks
from sparseattn.workloads import Selection, Workload


def _square(x):
    if x < 0:
        raise ValueError(f"negative task {x}")
    return x * x


def test_run_tasks_keeps_task_order_on_two_processes():
    done = []
    assert run_tasks(_square, range(12), workers=2, on_done=done.append) == [x * x for x in range(12)]
    assert sorted(done) == list(range(12))


def test_run_tasks_raises_the_task_error():
    with pytest.raises(ValueError, match="negative task -3"):
        run_tasks(_square, [1, 2, -3, 4], workers=1)


def test_sliced_parallel_analysis_equals_one_piece(monkeypatch):
    w = Workload(
        "small", "", 9, 2, 64, (4, 8, 8), None, Selection("svg2", q_clusters=5, k_clusters=7), block_size=32
    )
    monkeypatch.setattr(analysis, "PARALLEL_MIN_WORK", 0)
    seen = []
    (sliced,) = analysis.analyze_workloads([w], seed=3, workers=2, on_progress=lambda w, n: seen.append(n))
    whole = analysis.analyze_workload(w, seed=3)
    assert sliced.record() == whole.record()
    assert sliced.per_head_records() == whole.per_head_records()
    assert len(seen) == 3 and max(seen) == 9  # three slices: heads 0-3, 4-7, 8
    for name in ("q_valid_rows", "selected_k_live_pages", "pair_fill"):
        assert (getattr(sliced.fill, name) == getattr(whole.fill, name)).all()


def test_a_failing_progress_callback_stops_the_run_without_hanging():
    def on_done(i):
        raise KeyError(f"progress {i}")

    with pytest.raises(KeyError, match="progress"):
        run_tasks(_square, range(8), workers=2, on_done=on_done)
