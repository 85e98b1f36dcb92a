"""SVG2's partition layouts and forward plan by clusters: this checkout against earlier modules, alternated in
one process (lab script, GPU).

At a built-in ``svg2_*`` workload's 720p shape (the Wan processor's call: k-means labels of the synthetic
features after a warm start), ``partition_slots`` of both sides and ``cluster_forward_work_list`` of one
step, each from this checkout's ``sparseattn.svg2_device`` / ``sparseattn.planning.dynamic_layouts`` and
from the files given by ``--old-svg2-device`` / ``--old-dynamic-layouts`` (loaded into the package under
other names, so their relative imports resolve): outputs compared field by field, then rounds alternated,
each form timed with the host queued ahead (CUDA events after a GPU sleep) and with the host waiting
(wall), medians.

    git show REV:src/sparseattn/svg2_device.py > /tmp/old_svg2_device.py
    git show REV:src/sparseattn/planning/dynamic_layouts.py > /tmp/old_dynamic_layouts.py
    PYTHONPATH=src python data/bench/experiments/layouts_plan_ab.py --old-svg2-device /tmp/old_svg2_device.py \\
        --old-dynamic-layouts /tmp/old_dynamic_layouts.py --out layouts_plan_ab.json
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import statistics
import sys
from pathlib import Path


def load(path: str, name: str):
    """The module at ``path`` as ``name`` inside the package (its relative imports resolve there)."""
    import sparseattn.planning  # noqa: F401

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def main() -> int:
    import torch
    from svg2_plan_profile import queued_and_wall, warm_call_inputs

    from sparseattn import svg2_device as sd
    from sparseattn import workloads as wl
    from sparseattn.bench import write_run
    from sparseattn.planning import dynamic_layouts as dl
    from sparseattn.svg2_device import svg2_step_in_slots

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old-svg2-device", required=True)
    p.add_argument("--old-dynamic-layouts", required=True)
    p.add_argument("--workload", default="svg2_wan14b_720p")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    old_sd = load(args.old_svg2_device, "sparseattn._svg2_device_old")
    old_dl = load(args.old_dynamic_layouts, "sparseattn.planning._dynamic_layouts_old")

    w = wl.get_workload(args.workload)
    sel = w.selection
    q, k, v, init = warm_call_inputs(w)
    qc, kc, block = sel.q_clusters, sel.k_clusters, w.block_size
    fitted = sd.fit_for_slots(q, k, qc, kc, block, 2, *init, None, "wgmma")
    q_labels, k_labels = fitted.q_fit[0], fitted.k_fit[0]
    step = svg2_step_in_slots(q, k, v, qc, kc, block, sel.top_p, sel.min_fraction, 2, *init, assign="wgmma")[
        0
    ]
    groups = step._group_args()

    parts = {
        "layouts": {
            form: (
                lambda m=m: (m.partition_slots(q_labels, qc, block), m.partition_slots(k_labels, kc, block))
            )
            for form, m in (("old", old_sd), ("new", sd))
        },
        "fwd_plan_clusters": {
            form: (lambda m=m: m.cluster_forward_work_list(*groups))
            for form, m in (("old", old_dl), ("new", dl))
        },
    }
    # the same outputs, field by field
    for (a, b), name in zip(zip(parts["layouts"]["old"](), parts["layouts"]["new"]()), ("q", "k")):
        for field in dataclasses.fields(b):
            x, y = getattr(a, field.name), getattr(b, field.name)
            assert torch.equal(x, y) if isinstance(y, torch.Tensor) else x == y, (name, field.name)
    a, b = parts["fwd_plan_clusters"]["old"](), parts["fwd_plan_clusters"]["new"]()
    for field in ("work_info", "work_order", "own_entries", "status"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert torch.equal(a.item_streams(), b.item_streams())
    print("outputs equal field by field", flush=True)

    times = {(part, form, how): [] for part in parts for form in ("old", "new") for how in ("queued", "wall")}
    for rnd in range(args.rounds):
        for part, forms in parts.items():
            for form in ("old", "new") if rnd % 2 == 0 else ("new", "old"):
                fn = forms[form]
                for _ in range(args.reps):
                    t_queued, t_wall = queued_and_wall(lambda _, f=fn: f())
                    times[(part, form, "queued")].append(t_queued)
                    times[(part, form, "wall")].append(t_wall)
    records = []
    for (part, form, how), xs in times.items():
        records.append(dict(part=part, form=form, timing=how, time_ms=statistics.median(xs), samples=len(xs)))
    for part in parts:
        for how in ("queued", "wall"):
            o, n = (statistics.median(times[(part, f, how)]) for f in ("old", "new"))
            print(f"{part:18s} {how:6s} old {o:7.3f} ms  new {n:7.3f} ms  ({n / o:.3f})", flush=True)
    write_run(
        Path(args.out),
        "python data/bench/experiments/layouts_plan_ab.py",
        None,
        records,
        workload=args.workload,
        outputs_equal=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
