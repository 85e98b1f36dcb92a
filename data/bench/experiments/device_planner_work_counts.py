"""Where the forward on device plans loses to the forward on host plans (NOTES_device_planner, "Where the
forward's gap goes"): CPU counts, no GPU.

    PYTHONPATH=src python data/bench/experiments/device_planner_work_counts.py vsa_wan14b_480p [vsa_wan14b_720p ...]

For a built-in workload's graph as a top-k selection, the device planner's forward work list (its numpy twin,
:mod:`sparseattn.planning.device_emulation`) against the host's pair work lists: pair items matched by the
K pages the two blocks share (``partners="shared"``, the host's default) and neighbours paired by the
layout (``partners="layout"``). Prints items, empty items (a matched-away slot stays in the list with no
stream), streamed pages, 16-row-page chunks of the kernel and the longest item.
"""

import sys

import numpy as np

from sparseattn.planning import device_emulation as emu
from sparseattn.planning.device import DevicePlanner
from sparseattn.planning.pair_forward import pair_work_list
from sparseattn.workloads import get_workload


def topk_arrays(graph):
    """The graph's selection as ``(q2k_idx [1, heads, q_blocks, k], q2k_num [1, heads, q_blocks])`` (numpy)."""
    counts = np.diff(graph.indptr).astype(np.int64)
    k = int(counts.max(initial=1))
    idx = np.zeros((graph.num_rows, k), dtype=np.int32)
    idx[graph.row_of_nnz, np.arange(graph.nnz) - np.repeat(graph.indptr[:-1], counts)] = graph.indices
    shape = (1, graph.heads, graph.q.num_blocks)
    return idx.reshape(*shape, k), counts.reshape(shape).astype(np.int32)


def counts(work) -> dict:
    info = work.work_info  # (head, stream begin, stream length, rows)
    chunks = -(-info[:, 2] // (work.chunk // 16))
    return dict(
        items=len(info),
        empty=int((info[:, 2] == 0).sum()),
        pages=int(info[:, 2].sum()),
        chunks=int(chunks.sum()),
        longest=int(chunks.max()),
    )


def main() -> None:
    for name in sys.argv[1:] or ["vsa_wan14b_480p"]:
        graph = get_workload(name).build()
        planner = DevicePlanner(graph.q, graph.k)
        out = emu.emulate_plans(planner, *topk_arrays(graph))
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
                f"({c['pages'] / base['pages']:.3f}x)  chunks {c['chunks']:8d}  longest {c['longest']} chunks"
            )


if __name__ == "__main__":
    main()
