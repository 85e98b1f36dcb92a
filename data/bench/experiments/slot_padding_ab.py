"""SVG2's move of q, k and v to slots with the padding slots zeroed or left unwritten, alternated in one
process (lab script, GPU).

At a built-in ``svg2_*`` workload's 720p shape (the Wan processor's order: k-means whose last step assigns
labels only, then the move with the last step's cluster sums), the three copies of
:func:`sparseattn.svg2_device.move_to_slots` with ``used`` the slots of each row's blocks
(``DeviceLayout.used_slots``: padding inside a block written as zeros) against ``used`` the slots that hold
tokens (``DeviceLayout.filled_slots``: padding left unwritten). The token rows and the sums are compared
first; then rounds alternated, each form timed with the host queued ahead (CUDA events after a GPU sleep)
and with the host waiting (wall), medians.

    PYTHONPATH=src python data/bench/experiments/slot_padding_ab.py --out slot_padding_ab.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path


def main() -> int:
    import torch
    from svg2_plan_profile import queued_and_wall, warm_call_inputs

    from sparseattn import svg2_device as sd
    from sparseattn import workloads as wl
    from sparseattn.bench import write_run

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="svg2_wan14b_720p")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    w = wl.get_workload(args.workload)
    sel = w.selection
    q, k, v, init = warm_call_inputs(w)
    fitted = sd.fit_for_slots(q, k, sel.q_clusters, sel.k_clusters, w.block_size, 2, *init, None, "wgmma")
    ql, kl = fitted.q_layout, fitted.k_layout
    masks = {
        "zeroed": (ql.used_slots(), kl.used_slots()),
        "unwritten": (ql.filled_slots(), kl.filled_slots()),
    }

    def move(form):
        qs, ks, vs, q_sums, k_sums = sd.move_to_slots(fitted, q, k, v, masks[form])
        return (qs, ks, vs), (q_sums, k_sums)

    a, b = move("zeroed"), move("unwritten")
    for x, y, lay in zip(a[0], b[0], (ql, kl, kl)):
        tokens = lay.valid
        assert torch.equal(x[tokens], y[tokens])
    for x, y in zip(a[1], b[1]):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-3)  # atomics: the order of the additions
    del a, b
    print("token rows equal, sums within float32 order", flush=True)

    times = {(form, how): [] for form in masks for how in ("queued", "wall")}
    for rnd in range(args.rounds):
        for form in ("zeroed", "unwritten") if rnd % 2 == 0 else ("unwritten", "zeroed"):
            for _ in range(args.reps):
                t_queued, t_wall = queued_and_wall(lambda _, f=form: move(f))
                times[(form, "queued")].append(t_queued)
                times[(form, "wall")].append(t_wall)
    records = [
        dict(part="to_slots", form=form, timing=how, time_ms=statistics.median(xs), samples=len(xs))
        for (form, how), xs in times.items()
    ]
    for how in ("queued", "wall"):
        z, u = (statistics.median(times[(f, how)]) for f in ("zeroed", "unwritten"))
        print(f"to_slots {how:6s} zeroed {z:7.3f} ms  unwritten {u:7.3f} ms  ({u / z:.3f})", flush=True)
    write_run(
        Path(args.out),
        "python data/bench/experiments/slot_padding_ab.py",
        None,
        records,
        workload=args.workload,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
