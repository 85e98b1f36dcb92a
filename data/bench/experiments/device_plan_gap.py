"""Where the forward on device plans loses to host plans (lab script, GPU).

One workload, one process, five work lists of the same selection alternated in rotated rounds (CUDA
events, median of ``--reps`` per round, paired ratio to the host list's time in the same round):

- ``host_shared``: the host's pair list (each head pairs its blocks by shared K pages): what ``kpage`` runs;
- ``host_layout``: the host's pair list with the device planner's partners (``partners="layout"``);
- ``device``: the device planner's plans, launched as ``kpage_device`` launches them;
- ``device_copied``: the device list copied to the host and launched as a WorkList (its counter from 0, so
  it runs as ``device_from_zero``);
- ``device_no_empty``: that copy without its empty items (no stream entry, no owned page);
- ``device_from_zero``: the device plans with the item counter started at 0 (before v14 of the device
  planner's notes: the void items the order lists first are fetched and passed by).

Every list's output is compared with ``host_shared``'s (same inputs, NaN-poisoned buffers). If
``host_layout`` runs like ``device``, the partners cost the time; if like ``host_shared``, the device
list's structure (empty items, order) does.

    PYTHONPATH=src python data/bench/experiments/device_plan_gap.py --workload vsa_wan14b_480p --out gap.json
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def device_list_on_host(plans):
    """The device forward list as a host :class:`WorkList` (same items, same order, the streams' used
    entries only)."""
    from sparseattn.planning.device_emulation import as_work_list

    f = plans.forward
    arrays = {name: plans.view("forward", name).get() for name in ("work_info", "work_order", "own_entries")}
    info = arrays["work_info"].reshape(-1, 4)
    used = int((info[:, 1].astype(np.int64) + info[:, 2]).max()) if len(info) else 0
    arrays["stream_entries"] = plans.view("forward", "stream_entries").get().reshape(-1, 2)[:used]
    return as_work_list(f, arrays, f.heads)  # the forward list stands in for its template (its chunk)


def empty_items(wl) -> np.ndarray:
    """bool [items]: the items with no stream entry and no owned page."""
    return (wl.work_info[:, 2] == 0) & ~(wl.own_pages >= 0).any(axis=1)


def without_empty(wl, WorkList, work_order):
    keep = ~empty_items(wl)
    info = wl.work_info[keep]
    return WorkList(
        work_info=info,
        work_order=work_order(info, wl.chunk, "head"),
        own_pages=wl.own_pages[keep],
        own_mask=wl.own_mask[keep],
        stream_pages=wl.stream_pages,
        stream_mask=wl.stream_mask,
        heads=wl.heads,
        chunk=wl.chunk,
    )


def counts(wl) -> dict:
    return dict(
        items=int(wl.num_work),
        empty_items=int(empty_items(wl).sum()),
        pages=int(wl.work_info[:, 2].sum()),
        chunks=int(wl.chunks_per_item().sum()),
        pair_items=int((wl.work_info[:, 3] == 128).sum()),
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="vsa_wan14b_480p")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    import cupy

    from sparseattn import bench
    from sparseattn.kernels import forward
    from sparseattn.planning.device import DevicePlanner
    from sparseattn.planning.pair_forward import pair_work_list
    from sparseattn.planning.work_list import WorkList, work_order

    graph, head_dim = bench.workload_graph(args.workload, None, seed=0)
    case = bench.Case(graph, head_dim, 1, seed=1)
    idx, num = bench.topk_selection(graph, 1)
    plans = DevicePlanner(graph.q, graph.k, backward=False).plan(idx, num)
    plans.check()
    lists = {
        "host_shared": pair_work_list(graph),
        "host_layout": pair_work_list(graph, partners="layout"),
    }
    copied = device_list_on_host(plans)
    lists["device_copied"] = copied
    lists["device_no_empty"] = without_empty(copied, WorkList, work_order)
    runs = {name: (lambda wl=wl: wl) for name, wl in lists.items()}
    runs["device"] = lambda: plans
    runs["device_from_zero"] = lambda: plans

    o, lse = forward.paged_forward(case.q, case.k, case.v, lists["host_shared"], scale=case.scale)
    cupy.cuda.Device().synchronize()
    ref = cupy.asnumpy(o).view(np.uint16).copy()
    buffers = (o, lse)
    record = dict(workload=args.workload, heads=graph.heads, lists={}, rounds=args.rounds, reps=args.reps)

    def launch(name, wl):
        forward.START_PAST_VOIDS = name != "device_from_zero"
        forward.paged_forward(case.q, case.k, case.v, wl, scale=case.scale, out=buffers)

    try:
        for name, get in runs.items():
            o.fill(0x7FC0)
            launch(name, get())
            cupy.cuda.Device().synchronize()
            got = bench.bf16_bits_to_float(cupy.asnumpy(o)).astype(np.float64)
            want = bench.bf16_bits_to_float(ref).astype(np.float64)
            entry = dict(
                max_abs_diff_to_host_shared=float(np.nanmax(np.abs(got - want))), nan=int(np.isnan(got).sum())
            )
            if name in lists:
                entry.update(counts(lists[name]))
            record["lists"][name] = entry
            print(name, entry, flush=True)
        return _timed(args, runs, launch, record)
    finally:
        forward.START_PAST_VOIDS = True


def _timed(args, runs, launch, record) -> int:
    from sparseattn import bench
    from sparseattn.variant_ab import rotation, summarize

    timer = bench.Timer(3, args.reps)
    names = list(runs)
    times = {n: [] for n in names}
    for r in range(args.rounds):
        for n in rotation(names, r):
            get = runs[n]
            wl = get()
            ms, _ = timer(lambda n=n, wl=wl: launch(n, wl))
            times[n].append(ms)
    summary = summarize(times, "host_shared")
    for n in names:
        record["lists"][n].update(summary[n])
    print(f"{'list':18s} {'median ms':>10s} {'paired':>8s}  items  empty   pages")
    for n in names:
        e = record["lists"][n]
        print(
            f"{n:18s} {e['time_ms']:10.3f} {e['paired_ratio']:8.4f} "
            f"{e.get('items', '-')!s:>6s} {e.get('empty_items', '-')!s:>6s} {e.get('pages', '-')!s:>7s}"
        )
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(record, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
