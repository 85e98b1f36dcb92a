"""SVG2's top-p cluster selection (``cluster_select``'s Triton kernel, float64): the bisection's forms
alternated in one process (lab script, GPU): ``bisect`` (whole 64-bit patterns), ``bisect_words`` (v27,
the default since its run: the patterns' high words first, then the few that share the winning one), and with
``--old`` the ``bisect`` of an earlier module loaded from a file (how v24 was measured against the 64-step
bisection it replaced).

At SVG2's 720p shape (40 heads, 300 Q × 1,000 K clusters, d = 128; 12,000 programs of 1,024 float64 lanes)
in ``select_warps_ab``'s two score regimes (on the peaked one the minimum fraction decides, so the second
bisection, by count, runs too):

    PYTHONPATH=src python data/bench/experiments/select_bisect_ab.py --out select_bisect_ab.json
    git show cdaa0c6:src/sparseattn/cluster_select.py > /tmp/cluster_select_64.py
    PYTHONPATH=src python data/bench/experiments/select_bisect_ab.py --old /tmp/cluster_select_64.py \\
        --out select_bisect_ab.json

Every form's masks must equal the torch sort's (the reference form). CUDA events, median of ``--reps``
calls per round, the forms alternated over ``--rounds``.
"""

from __future__ import annotations

import argparse
import json
import statistics


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", default=None, help="an earlier cluster_select.py, timed by its 'bisect'")
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--q-clusters", type=int, default=300)
    ap.add_argument("--k-clusters", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    import torch
    from select_warps_ab import SCORE_REGIMES, regime_inputs, regimes_record

    from sparseattn import cluster_select
    from sparseattn.variant_ab import rotation

    forms = {"bisect": (cluster_select, "bisect"), "bisect_words": (cluster_select, "bisect_words")}
    if args.old:
        from layouts_plan_ab import load

        forms["old_bisect"] = (load(args.old, "sparseattn._cluster_select_old"), "bisect")
    g = torch.Generator(device="cuda").manual_seed(0)
    d = 128
    record = regimes_record(args)
    ok = True
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for regime, scale in SCORE_REGIMES:
        *_, dots, bias, least, want = regime_inputs(args.heads, args.q_clusters, args.k_clusters, scale, g, d)
        call = lambda form, a=(dots, bias, d, 0.9, least): form[0].select_mask(*a, method=form[1])
        entry = dict(selected_fraction=float(want.float().mean()))
        for name, form in forms.items():
            entry[f"equal_to_sort_{name}"] = equal = bool(torch.equal(call(form), want))
            ok &= equal
        times = {name: [] for name in forms}
        for r in range(args.rounds):
            for name in rotation(list(forms), r):
                for _ in range(3):
                    call(forms[name])
                per = []
                for _ in range(args.reps):
                    start.record()
                    call(forms[name])
                    stop.record()
                    stop.synchronize()
                    per.append(start.elapsed_time(stop))
                times[name].append(statistics.median(per))
        for name, ts in times.items():
            entry[f"ms_{name}"] = statistics.median(ts)
        record["regimes"][regime] = entry
        print(
            f"{regime}: selected {entry['selected_fraction']:.3f}, "
            + ", ".join(f"{n} {entry[f'ms_{n}']:.3f} ms (equal {entry[f'equal_to_sort_{n}']})" for n in forms)
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
