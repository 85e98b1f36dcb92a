"""A/B of the backward's work-item order and launch concurrency (H200, 2026-12-01, commit d02a471).

For each workload the pair plan of the K/V-owned backward runs in four item orders:

* A_hidden_tail: launch key "item has an entry hidden from one half" + each launch's last items longest
  first (d02a471);
* B_pair_notail: launch key "is a pair item", block order (ad52a35's order);
* C_pair_tail: launch key "is a pair item" + the tail longest first (adopted in 4bd31b7);
* D_hidden_notail: launch key "has hidden entries", block order;

with the plan's launches side by side (``launch.side_by_side``) and, on ssta, one after the other.
CUDA events, median of 10 after 3 warm-ups, batch 1, the workloads' real head counts.

Usage (H200): ``PYTHONPATH=src python data/bench/experiments/h200_kpage_bwd_v9_20261201_ab_order.py vsa_wan14b_480p
vsa_wan14b_720p ssta_hy15_720p``; JSON to ``$OUT/ab_order.json``.
"""

import dataclasses
import json
import os
import sys

import cupy
import numpy as np

from sparseattn.bench import Case, workload_graph
from sparseattn.kernels import launch
from sparseattn.kernels.backward import kpage_backward
from sparseattn.kernels.forward import kpage_forward
from sparseattn.planning.pair_backward import PAIR_ROUTE, pair_backward_plan
from sparseattn.planning.pair_forward import pair_partners
from sparseattn.planning.tile_plan import gather_segments, launch_order


def permuted(plan, order):
    """The plan with its work items in ``order`` (streams and visibility moved with them)."""
    entries, lengths = gather_segments(
        plan.stream_indptr.astype(np.int64), np.arange(plan.stream_pages.size), order
    )
    return dataclasses.replace(
        plan,
        work_route=plan.work_route[order],
        work_head=plan.work_head[order],
        work_block=plan.work_block[order],
        own_pages=plan.own_pages[order],
        stream_indptr=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
        stream_pages=plan.stream_pages[entries].astype(np.int32),
        stream_vis=plan.stream_vis[entries].astype(np.uint32),
    )


def time_ms(fn, reps=10, warm=3):
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


def sequential(launches):
    for go in launches:
        go()


SIDE_BY_SIDE = launch.side_by_side


def main(names):
    out = []
    for name in names:
        graph, d = workload_graph(name, None, 0)
        case = Case(graph, d, 1, seed=1)
        o, lse = kpage_forward(case.q, case.k, case.v, graph, scale=case.scale)
        grads = tuple(cupy.empty_like(x) for x in (case.q, case.k, case.v))
        plan = pair_backward_plan(graph)
        firsts, _ = pair_partners(graph.transpose())
        is_pair = np.isin(plan.work_block, firsts) & (plan.work_route == PAIR_ROUTE)
        route = plan.work_route.astype(np.int64)
        hidden = np.concatenate([[0], np.cumsum(plan.stream_vis != 3)])
        has_hidden = hidden[plan.stream_indptr[1:]] > hidden[plan.stream_indptr[:-1]]
        lengths = np.diff(plan.stream_indptr)
        by_pair = np.lexsort((plan.work_block, plan.work_head, is_pair, route))
        by_hidden = np.lexsort((plan.work_block, plan.work_head, has_hidden, route))
        tail = launch_order((2 * route + is_pair)[by_pair], lengths[by_pair])
        variants = {
            "A_hidden_tail": plan,
            "B_pair_notail": permuted(plan, by_pair),
            "C_pair_tail": permuted(plan, by_pair[tail]),
            "D_hidden_notail": permuted(plan, by_hidden),
        }
        print(
            f"[{name}] items {lengths.size} pair items {int(is_pair.sum())} "
            f"pair items without hidden entries {int((is_pair & ~has_hidden).sum())}",
            flush=True,
        )
        modes = ("side", "seq") if name.startswith(("ssta", "svg2")) else ("side",)
        for variant, p in variants.items():
            for mode in modes:
                launch.side_by_side = SIDE_BY_SIDE if mode == "side" else sequential
                ms = time_ms(
                    lambda p=p, c=case, o=o, lse=lse, g=grads: kpage_backward(
                        c.q, c.k, c.v, o, lse, c.do, p, scale=c.scale, out=g
                    )
                )
                rec = dict(workload=name, variant=variant, launches=mode, time_ms=round(ms, 3))
                out.append(rec)
                print(json.dumps(rec), flush=True)
        launch.side_by_side = SIDE_BY_SIDE
        case = o = lse = grads = None  # frees the inputs before the next workload
        cupy.get_default_memory_pool().free_all_blocks()
    with open(os.environ.get("OUT", "/tmp") + "/ab_order.json", "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
