"""Randomized check of the CPU toolkit: ``python -m sparseattn.fuzz --cases 1000``.

Each case draws, from its own seed, a Q and a K layout (video tiles with either padding, k-means-like
partitions, random slot masks; shared or independent), a multi-head graph (empty rows, pairs on empty
blocks, any density) and random Q/K/V, then checks:

* analysis: ``graph_counts`` equals the physical pairs of the BSA plan and of the KPage plan of
  every route, useful ≤ physical, and useful equals the graph's valid slot pairs;
* coverage: every plan (BSA and KPage, owner ``q`` and ``kv``) computes each useful pair once;
* arithmetic: the emulator runs the ``q``-owned plans forward and the ``kv``-owned plans backward,
  equal to the float64 reference to ``1e-12`` relative error (see :func:`_rel_err` for outputs
  that are zero up to rounding).

It prints the number of cases, the time and the seed of every failing case (rerun one with
``--seed SEED --cases 1``), and exits 1 when a case fails. The test suite runs a few cases; this
entry point is for long runs.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

import numpy as np

from .analysis import graph_counts
from .emulator import coverage_report, emulate_backward, emulate_forward, graph_slot_pairs
from .graph import SparseGraph
from .layouts import BlockLayout, partition_layout, slot_layout, video_layout
from .planning import bsa_plan, kpage_plan
from .reference import attention_backward, attention_forward

RTOL = 1e-12
ROUTES = {"auto": "kpage_routed", 0: "kpage_small_tile", 1: "kpage_no_routing"}


def _layout(rng: np.random.Generator) -> BlockLayout:
    block = int(rng.choice([16, 32, 64, 128]))
    kind = rng.integers(3)
    if kind == 0:
        tile = tuple(int(t) for t in rng.integers(1, 5, 3))
        grid = tuple(int(t * rng.integers(1, 4) + rng.integers(0, t)) for t in tile)
        grid = tuple(max(g, t) for g, t in zip(grid, tile))
        return video_layout(grid, tile, block, padding=str(rng.choice(["prefix", "inplace"])))
    if kind == 1:
        groups = rng.integers(0, rng.integers(1, 8), rng.integers(1, 300))
        return partition_layout(groups, block, num_groups=int(groups.max()) + 1 + int(rng.integers(0, 2)))
    blocks = int(rng.integers(1, 7))
    return slot_layout(rng.random(blocks * block) < rng.uniform(0.0, 1.0), block)


def random_case(seed: int):
    """(graph, q, k, v, scale) of case ``seed``; padding slots of q/k/v hold NaN."""
    rng = np.random.default_rng(seed)
    q_layout = _layout(rng)
    k_layout = q_layout if rng.random() < 0.4 else _layout(rng)
    heads = int(rng.integers(1, 4))
    mask = rng.random((heads, q_layout.num_blocks, k_layout.num_blocks)) < rng.uniform(0.05, 1.0)
    mask[:, rng.random(q_layout.num_blocks) < 0.2] = False  # some Q blocks select nothing
    graph = SparseGraph.from_block_mask(q_layout, k_layout, mask, drop_empty=bool(rng.random() < 0.5))
    batch, d = int(rng.integers(1, 3)), int(rng.choice([8, 16]))
    q = rng.standard_normal((batch, heads, q_layout.num_slots, d))
    k = rng.standard_normal((batch, heads, k_layout.num_slots, d))
    v = rng.standard_normal((batch, heads, k_layout.num_slots, int(rng.choice([8, d]))))
    for x, layout in ((q, q_layout), (k, k_layout), (v, k_layout)):
        x[:, :, ~layout.valid] = np.nan  # padding must never reach a valid output
    scale = float(rng.uniform(0.05, 1.0))
    return graph, q, k, v, scale


def _rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """``‖a − b‖ / ‖b‖`` over the finite entries of ``b``, with ``‖b‖`` at least ``sqrt(entries)``.

    The floor (an RMS of 1, the inputs' scale) keeps outputs that are zero up to rounding from
    counting as errors: with a single valid key per query, dQ and dK are exactly 0 in theory and
    ~1e-15 noise in both the emulator and the reference.
    """
    finite = np.isfinite(b)
    scale = max(float(np.linalg.norm(b[finite])), float(np.sqrt(finite.sum())), 1e-300)
    return float(np.linalg.norm(a[finite] - b[finite])) / scale


def check_case(seed: int) -> list[str]:
    """The problems found in case ``seed`` (empty when every check passes)."""
    graph, q, k, v, scale = random_case(seed)
    problems = []
    counts = graph_counts(graph).totals()
    plans = {"kpage " + str(r): (lambda g, o, r=r: kpage_plan(g, r, owner=o)) for r in ROUTES}
    if graph.q.block_size <= 128 and graph.k.block_size <= 128:
        plans["bsa"] = lambda g, o: bsa_plan(g, owner=o)
        if counts["bsa_physical"] != bsa_plan(graph).physical_pairs():
            problems.append(
                f"bsa_physical {counts['bsa_physical']} != plan {bsa_plan(graph).physical_pairs()}"
            )
    for route, key in ROUTES.items():
        physical = kpage_plan(graph, route).physical_pairs()
        if counts[key] != physical:
            problems.append(f"{key} {counts[key]} != kpage_plan(route={route!r}) {physical}")
        if counts["useful"] > counts[key]:
            problems.append(f"useful {counts['useful']} > {key} {counts[key]}")
    if counts["useful"] != graph_slot_pairs(graph)[0].size:
        problems.append(f"useful {counts['useful']} != {graph_slot_pairs(graph)[0].size} valid slot pairs")

    o_ref, lse_ref = attention_forward(q, k, v, graph, scale=scale)
    do = np.random.default_rng(seed + 1).standard_normal(o_ref.shape)
    grads_ref = attention_backward(q, k, v, o_ref, lse_ref, do, graph, scale=scale)
    for name, make in plans.items():
        for owner in ("q", "kv"):
            plan = make(graph, owner)
            cover = coverage_report(plan, graph)
            if (
                cover["computed"] != cover["useful"]
                or cover["duplicated"]
                or cover["missing"]
                or cover["outside"]
            ):
                problems.append(f"{name} owner {owner}: coverage {cover}")
        o, lse = emulate_forward(make(graph, "q"), q, k, v, scale=scale)
        if not np.array_equal(np.isneginf(lse), np.isneginf(lse_ref)):
            problems.append(f"{name} forward: rows without keys differ from the reference")
        err = max(_rel_err(o, o_ref), _rel_err(lse, lse_ref))
        if not err < RTOL:
            problems.append(f"{name} forward: relative error {err:.2e}")
        grads = emulate_backward(make(graph, "kv"), q, k, v, o_ref, lse_ref, do, scale=scale)
        for label, got, want in zip(("dq", "dk", "dv"), grads, grads_ref):
            err = _rel_err(got, want)
            if not err < RTOL or np.isnan(got).any():
                problems.append(f"{name} backward {label}: relative error {err:.2e}")
    return problems


def run(cases: int, seed: int = 0, stream=None) -> tuple[int, float, dict[int, list[str]]]:
    """Check ``cases`` cases from ``seed`` on; returns (cases, seconds, {failing seed: problems})."""
    stream = sys.stdout if stream is None else stream
    failures: dict[int, list[str]] = {}
    start = time.perf_counter()
    for case_seed in range(seed, seed + cases):
        try:
            problems = check_case(case_seed)
        except Exception as err:  # noqa: BLE001 -- a crash is a finding: report it with its seed
            problems = [f"{type(err).__name__}: {err}", traceback.format_exc(limit=3)]
        if problems:
            failures[case_seed] = problems
            print(f"FAIL seed {case_seed}: {problems[0]}", file=stream, flush=True)
    return cases, time.perf_counter() - start, failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sparseattn.fuzz", description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=1000, help="number of random cases (default 1000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first case (default 0)")
    args = parser.parse_args(argv)
    if args.cases <= 0 or args.seed < 0:
        parser.error("--cases must be positive and --seed non-negative")
    cases, seconds, failures = run(args.cases, args.seed)
    print(
        f"fuzz: {cases} cases (seeds {args.seed}..{args.seed + cases - 1}) in {seconds:.1f} s: "
        f"{len(failures)} failed" + (f" (seeds {', '.join(map(str, failures))})" if failures else "")
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
