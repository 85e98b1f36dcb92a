"""Where the forward on device plans loses to the forward on host plans (NOTES_device_planner, "Where the
forward's gap goes"): CPU counts, no GPU.

    PYTHONPATH=src python data/bench/experiments/device_planner_work_counts.py vsa_wan14b_480p [vsa_wan14b_720p ...]

For a built-in workload's graph as a top-k selection, the device planner's forward work list (its numpy twin,
:mod:`sparseattn.planning.device_emulation`) against the host's pair work lists: pair items matched by the
K pages the two blocks share (``partners="shared"``, the host's default) and neighbours paired by the
layout (``partners="layout"``). Prints items, empty items (a matched-away slot stays in the list with no
stream), streamed pages, 16-row-page chunks of the kernel and the longest item. Then the backward's
K/V-owned plans: the host's (pairs by shared Q pages, and by layout neighbours) against the device's twin,
items and streamed Q pages. "in plain items": the chunks of items without visibility bits, which a host list
marks ``PLAIN_ITEM`` (the pair kernel then skips its per-chunk decode) and the device planner leaves unmarked.
"""

import sys

from sparseattn.bench import topk_arrays
from sparseattn.planning import device_emulation as emu
from sparseattn.planning.device import DevicePlanner
from sparseattn.planning.pair_backward import pair_backward_plan
from sparseattn.planning.pair_forward import pair_work_list
from sparseattn.workloads import get_workload


def counts(work) -> dict:
    info = work.work_info  # (head, stream begin, stream length, rows)
    chunks = -(-info[:, 2] // (work.chunk // 16))
    return dict(
        items=len(info),
        empty=int((info[:, 2] == 0).sum()),
        pages=int(info[:, 2].sum()),
        chunks=int(chunks.sum()),
        longest=int(chunks.max()),
        plain_chunks=int(chunks[work.plain_items()].sum()),  # empty items add 0 chunks
    )


def main() -> None:
    for name in sys.argv[1:] or ["vsa_wan14b_480p"]:
        graph = get_workload(name).build()
        planner = DevicePlanner(graph.q, graph.k)
        out = emu.emulate_plans(planner, *topk_arrays(graph, 1))
        lists = {
            "host, shared pages": pair_work_list(graph),
            "host, layout neighbours": pair_work_list(graph, partners="layout"),
            "device (twin)": emu.as_work_list(planner.forward, out["forward"], out["heads"]),
        }
        base = counts(lists["host, shared pages"])
        for label, work in lists.items():
            c = counts(work)
            print(
                f"{name} {label:24s} items {c['items']:6d} (empty {c['empty']:6d})  pages {c['pages']:9d} "
                f"({c['pages'] / base['pages']:.3f}x)  chunks {c['chunks']:8d}  longest {c['longest']} chunks  "
                f"in plain items {c['plain_chunks']}"
            )
        backward = {
            "host, shared pages": pair_backward_plan(graph),
            "host, layout neighbours": pair_backward_plan(graph, partners="layout"),
        }
        pages = {label: int(plan.stream_lengths().sum()) for label, plan in backward.items()}
        items = {label: int(plan.num_work) for label, plan in backward.items()}
        twin = out["backward"]
        pages["device (twin)"] = int(twin["stream_indptr"][-1])
        items["device (twin)"] = int(twin["order"].size)
        for label, n_pages in pages.items():
            print(
                f"{name} backward {label:24s} items {items[label]:6d}  Q pages {n_pages:9d} "
                f"({n_pages / pages['host, shared pages']:.3f}x)"
            )


if __name__ == "__main__":
    main()
