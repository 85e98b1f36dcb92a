"""svg2's forward+backward against `bsa`: what the floor asks of the kernels (NOTES_kpage_bwd.md, 8f56664).

    PYTHONPATH=src python data/bench/experiments/svg2_backward_floor.py \\
        data/bench/experiments/h200_complete_bench_20261201_31cacf6_bench.json data/bench/experiments/h200_backward_launches_20261201_04372ba.json

From a complete bench (kpage and bsa records of svg2_wan14b_720p) and the launch timings of
``backward_launches.py``: the floor (0.9 × bsa's forward pairs over kpage's), the time budget it leaves
kpage, each pass's time per physical pair against bsa's, kpage's passes at bsa's per-pair time, and the
backward's time per 128 × 64 step in each launch, counted on the stacked 40-head plan (the pair launch's
one-half steps count half their pairs, as the bench's physical pairs do).
"""

import json
import sys

from occupancy_counts import graphs_of  # beside this script
from svg2_backward_counts import launch_steps

from sparseattn.benchdata import load_run

WORKLOAD = "svg2_wan14b_720p"
STEP_PAIRS = 128 * 64


def records(path: str) -> dict:
    """svg2's timed records of a bench run, by (impl, pass)."""
    run = load_run(path)
    return {(r["impl"], r["pass"]): r for r in run.records if r["workload"] == WORKLOAD and "time_ms" in r}


def main(bench_path: str, launches_path: str) -> None:
    r = records(bench_path)
    with open(launches_path) as f:
        launches = json.load(f)["workloads"]
    ms = {key: rec["time_ms"] for key, rec in r.items()}
    pairs = {key: rec["physical_pairs"] / 1e9 for key, rec in r.items()}  # G pairs
    floor = 0.9 * pairs["bsa", "fwd"] / pairs["kpage", "fwd"]
    budget = ms["bsa", "fwdbwd"] / floor
    print(
        f"floor {floor:.3f}: kpage forward+backward <= {ms['bsa', 'fwdbwd']:.1f} / {floor:.3f} = {budget:.1f} ms"
    )
    overhead = ms["kpage", "fwdbwd"] - ms["kpage", "fwd"] - ms["kpage", "bwd"]
    at_bsa = 0.0
    for p in ("fwd", "bwd"):
        bsa_rate = ms["bsa", p] / pairs["bsa", p]
        k_rate = ms["kpage", p] / pairs["kpage", p]
        at_bsa += pairs["kpage", p] * bsa_rate
        print(
            f"{p}: kpage {ms['kpage', p]:.1f} ms / {pairs['kpage', p]:.1f} G pairs = {k_rate:.3f} ms/G, "
            f"bsa {ms['bsa', p]:.1f} / {pairs['bsa', p]:.1f} = {bsa_rate:.3f} ms/G ({k_rate / bsa_rate - 1:+.1%}); "
            f"kpage's pairs at bsa's rate {pairs['kpage', p] * bsa_rate:.1f} ms"
        )
    print(
        f"kpage's plans at bsa's per-pair time, forward+backward: {at_bsa + overhead:.1f} ms "
        f"(with today's {overhead:.1f} ms between the passes) against the budget {budget:.1f}"
    )
    bwd_budget = budget - ms["kpage", "fwd"] - overhead
    bsa_bwd_rate = ms["bsa", "bwd"] / pairs["bsa", "bwd"]
    print(
        f"with today's forward the backward must take <= {bwd_budget:.1f} ms: at bsa's per-pair time, "
        f"<= {bwd_budget / bsa_bwd_rate:.1f} G pairs (today {pairs['kpage', 'bwd']:.1f})"
    )

    steps = launch_steps(graphs_of(WORKLOAD, 40))
    timed = launches[f"{WORKLOAD}:kpage"]["launch_ms_seq"]  # the sequential order: smallest launch first
    bsa_ms = launches[f"{WORKLOAD}:bsa"]["launch_ms_seq"][-1]
    bsa_steps = r["bsa", "bwd"]["physical_pairs"] / STEP_PAIRS
    bsa_step_ns = bsa_ms / bsa_steps * 1e6
    print(f"bsa: {bsa_ms:.1f} ms for {bsa_steps / 1e6:.2f} M steps, {bsa_step_ns:.2f} ns per step")
    for s, t in zip(sorted(steps, key=lambda s: s["steps"]), sorted(timed)):
        full = s["steps"] - s["one_half_steps"] / 2  # steps in full-step pairs
        ideal = full * bsa_step_ns / 1e6
        print(
            f"kpage {s['launch']}: {t:.1f} ms for {s['steps'] / 1e6:.3f} M steps ({s['one_half_steps'] / 1e6:.3f} M "
            f"one-half), {full / 1e6:.3f} M full-step equivalents; at bsa's step time {ideal:.1f} ms "
            f"(excess {t - ideal:+.1f} ms)"
        )
    total = launches[f"{WORKLOAD}:kpage"]["median"]["seq"]
    print(
        f"kpage backward, launches one after the other: {total:.1f} ms, {total - sum(timed):.1f} ms outside them"
    )


if __name__ == "__main__":
    main(*sys.argv[1:3])
