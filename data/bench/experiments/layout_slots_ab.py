"""SVG2's partition layouts with each form of the slots (``svg2_device.LAYOUT_SLOTS``: ``sort`` against
``counts``, v40) alternated in one process (lab script, GPU).

At a built-in ``svg2_*`` workload's shape (default ``svg2_wan14b_720p``: 40 heads × 75,600 tokens), the
labels of its synthetic Q and K features under centroids after 3 warm Lloyd steps
(``kmeans_builds_ab.warm_sides``), :func:`sparseattn.svg2_device.partition_slots` of each side with each form:
the layouts compared field by field, then rounds with the forms in rotated order, each call timed with the
host queued ahead (CUDA events after a GPU sleep, the GPU's time) and with the host waiting (wall), medians.
Exit status 1 when the layouts differ.

    PYTHONPATH=src python data/bench/experiments/layout_slots_ab.py --out layout_slots_ab.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

FORMS = ("sort", "counts")
FIELDS = ("token_slot", "valid", "block_group", "num_slots", "group_sizes", "block_rows", "block_pages")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="svg2_wan14b_720p")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    import torch
    from kmeans_builds_ab import warm_sides

    from sparseattn import svg2_device as sd
    from sparseattn.bench import write_run
    from sparseattn.kernels import kmeans_assign as ka
    from sparseattn.variant_ab import rotation
    from sparseattn.workloads import get_workload

    w = get_workload(args.workload)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    records, equal = [], True

    def layout(form, labels, kk):
        sd.LAYOUT_SLOTS = form
        return sd.partition_slots(labels, kk, args.block_size)

    for side, x, kk, c in warm_sides(w):
        labels = ka.nearest_centroid_wgmma(x, c)
        got = {form: layout(form, labels, kk) for form in FORMS}
        same = all(torch.equal(getattr(got["sort"], f), getattr(got["counts"], f)) for f in FIELDS)
        equal &= same
        times = {(form, timing): [] for form in FORMS for timing in ("queued", "wall")}
        for r in range(args.rounds):
            for form in rotation(list(FORMS), r):
                layout(form, labels, kk)
                for _ in range(args.reps):
                    torch.cuda.synchronize()
                    torch.cuda._sleep(50_000_000)  # the host queues the call while the GPU sleeps
                    start.record()
                    layout(form, labels, kk)
                    stop.record()
                    stop.synchronize()
                    times[form, "queued"].append(start.elapsed_time(stop))
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    layout(form, labels, kk)
                    torch.cuda.synchronize()
                    times[form, "wall"].append(1e3 * (time.perf_counter() - t0))
        for (form, timing), ts in times.items():
            records.append(
                dict(
                    side=side,
                    clusters=kk,
                    form=form,
                    timing=timing,
                    time_ms=statistics.median(ts),
                    samples=len(ts),
                )
            )
        print(
            f"{side} ({kk} clusters): layouts equal {same}; "
            + ", ".join(
                f"{form} {timing} {statistics.median(ts):.3f} ms" for (form, timing), ts in times.items()
            ),
            flush=True,
        )
    write_run(
        Path(args.out),
        "python data/bench/experiments/layout_slots_ab.py",
        None,
        records,
        workload=args.workload,
        block_size=args.block_size,
        layouts_equal=equal,
    )
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
