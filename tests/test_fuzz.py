"""The fuzz entry point (`python -m sparseattn.fuzz --cases N`): a few cases here, long runs by hand."""

import io

import numpy as np

from sparseattn import fuzz
from sparseattn.analysis import PairCounts


def test_a_few_random_cases_pass():
    cases, _, failures = fuzz.run(6, seed=1000, stream=io.StringIO())
    assert cases == 6 and failures == {}


def test_outputs_zero_up_to_rounding_are_not_errors():
    # seed 824: one valid key per query, so dQ = dK = 0 exactly and both sides give ~1e-15 noise
    assert fuzz.check_case(824) == []
    assert fuzz._rel_err(np.array([1e-15]), np.array([-1e-15])) < 1e-12
    assert fuzz._rel_err(np.array([2.0, 1.0]), np.array([1.0, 1.0])) > 0.5


def test_cases_are_reproducible_from_their_seed():
    a, b = fuzz.random_case(7), fuzz.random_case(7)
    assert np.array_equal(a[0].indices, b[0].indices) and np.array_equal(a[1], b[1], equal_nan=True)


def test_a_wrong_count_is_reported_with_its_seed(monkeypatch):
    real = fuzz.graph_counts

    def off_by_one(graph, route="auto"):
        c = real(graph, route)
        return PairCounts(**{**c.__dict__, "kpage_routed": c.kpage_routed + 1})

    monkeypatch.setattr(fuzz, "graph_counts", off_by_one)
    out = io.StringIO()
    _, _, failures = fuzz.run(2, seed=5, stream=out)
    assert set(failures) == {5, 6}
    assert "FAIL seed 5: kpage_routed" in out.getvalue()
    assert fuzz.main(["--cases", "1", "--seed", "5"]) == 1
