"""The pair backward kernel's step order (``paged_bwd_ws_kernel<128, true>``), mirrored on the CPU."""

import numpy as np
import pytest

from sparseattn.planning.pair_backward import pair_step_halves, pair_step_order


def warp_count_leading(steps: int, pred) -> int:
    """``paged_bwd::warp_count_leading`` line by line: 32 probes a round, one per lane."""
    lo, hi = 0, steps
    while lo < hi:
        span = hi - lo
        c = sum(bool(pred(lo + (span * lane >> 5))) for lane in range(32))
        if c == 0:
            hi = lo
        else:
            if c < 32:
                hi = lo + (span * c >> 5)
            lo += (span * (c - 1) >> 5) + 1
    return lo


@pytest.mark.parametrize("steps", [0, 1, 2, 31, 32, 33, 97, 1025, 40_000])
def test_the_warp_search_counts_a_monotone_predicates_leading_run(steps):
    rng = np.random.default_rng(steps)
    for run in sorted({0, steps, *rng.integers(0, steps + 1, size=20).tolist()}):
        assert warp_count_leading(steps, lambda j, run=run: j < run) == run


def test_the_warp_search_ends_within_range_on_any_predicate():
    rng = np.random.default_rng(1)
    for steps in (1, 7, 100, 3000):
        bits = rng.random(steps) < 0.5
        assert 0 <= warp_count_leading(steps, bits.__getitem__) <= steps


def pair_stream(rng, a: int, s: int, b: int) -> np.ndarray:
    return np.array([1] * a + [3] * s + [2] * b, dtype=np.uint32)


@pytest.mark.parametrize("seed", range(30))
def test_the_order_is_a_permutation_that_alternates_one_half_steps(seed):
    rng = np.random.default_rng(seed)
    vis = pair_stream(rng, *rng.integers(0, 60, size=3))
    order = pair_step_order(vis)
    halves = pair_step_halves(vis)
    assert sorted(order.tolist()) == list(range(halves.size))
    ran = halves[order]
    a, b = int(np.sum(halves == 1)), int(np.sum(halves == 2))
    # the first 2 · min(A-only, B-only) steps run A, B, A, B, ...; the rest in stream order
    m = min(a, b)
    assert (ran[: 2 * m : 2] == 1).all() and (ran[1 : 2 * m : 2] == 2).all()
    assert (np.diff(order[2 * m :]) > 0).all()


def test_any_stream_gives_a_permutation():
    rng = np.random.default_rng(2)
    for _ in range(50):
        vis = rng.integers(1, 4, size=int(rng.integers(1, 200))).astype(np.uint32)
        assert sorted(pair_step_order(vis).tolist()) == list(range(pair_step_halves(vis).size))
