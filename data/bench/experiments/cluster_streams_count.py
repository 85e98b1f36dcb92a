"""How many forward stream entries the block form and the cluster form write at an SVG2 workload's shape
(CPU count, no GPU).

One SVG2 call on ``--heads`` heads of a built-in ``svg2_*`` workload's synthetic Q/K features (torch on the
CPU: k-means++ seeds and ``--iters`` Lloyd steps, the partition layouts, SVG2's selection), then the
forward's work list from the block mask (:func:`sparseattn.planning.dynamic_layouts.forward_work_list`).
The block form stores one stream per (head, Q block); the cluster form
(:func:`~sparseattn.planning.dynamic_layouts.cluster_forward_work_list`) one per (head, Q cluster) with
blocks, each the stream of any of the cluster's blocks (they are equal: checked here on every block). Also
counted: the items, the block pairs each form's selection reads, and the programs each pass launches.

    PYTHONPATH=src python data/bench/experiments/cluster_streams_count.py --heads 2 --out counts.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="svg2_wan14b_720p")
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    import torch

    from sparseattn.planning.dynamic_layouts import forward_work_list
    from sparseattn.svg2_device import svg2_partition_step
    from sparseattn.svg2_step_bench import synthetic_qk
    from sparseattn.workloads import get_workload

    w = get_workload(args.workload)
    sel = w.selection
    t0 = time.perf_counter()
    q, k = (torch.from_numpy(x) for x in synthetic_qk(w, args.heads))
    g = torch.Generator().manual_seed(0)
    step = svg2_partition_step(
        q,
        k,
        sel.q_clusters,
        sel.k_clusters,
        w.block_size,
        sel.top_p,
        sel.min_fraction,
        args.iters,
        generator=g,
    )
    ql, kl = step.q_layout, step.k_layout
    work = forward_work_list(ql.block_rows, kl.block_rows, step.block_mask, w.block_size, rows_per_chunk=1)
    length = work.work_info[:, 2].long().view(args.heads, -1)
    entries = work.item_streams()
    start = torch.cat([torch.zeros(1, dtype=torch.long), length.reshape(-1).cumsum(0)])
    group = ql.block_group
    cluster_entries = 0
    per_head = []
    for r in range(args.heads):
        first = {}
        for i in range(group.shape[1]):
            c = int(group[r, i])
            if c < 0 or int(ql.block_rows[r, i]) == 0:
                continue
            w_id = r * group.shape[1] + i
            stream = entries[start[w_id] : start[w_id + 1]]
            if c in first:
                assert torch.equal(stream, first[c]), (r, i, c)  # a cluster's blocks stream the same
            else:
                first[c] = stream
        head_entries = sum(len(s) for s in first.values())
        cluster_entries += head_entries
        per_head.append(
            dict(
                q_blocks=int((ql.block_rows[r] > 0).sum()),
                q_clusters_with_blocks=len(first),
                block_form_entries=int(length[r].sum()),
                cluster_form_entries=head_entries,
            )
        )
    block_entries = int(length.sum())
    nq, nk = ql.max_blocks, kl.max_blocks
    record = dict(
        workload=args.workload,
        heads=args.heads,
        iters=args.iters,
        q_clusters=sel.q_clusters,
        k_clusters=sel.k_clusters,
        block_size=w.block_size,
        q_max_blocks=nq,
        k_max_blocks=nk,
        block_form=dict(
            streams=args.heads * nq,
            entries=block_entries,
            pairs_read_per_pass=args.heads * nq * nk,
            block_mask_bytes=args.heads * nq * nk,
        ),
        cluster_form=dict(
            streams=args.heads * sel.q_clusters,
            entries=cluster_entries,
            pairs_read_per_pass=args.heads * sel.q_clusters * nk,
            block_mask_bytes=0,
        ),
        entries_ratio=block_entries / max(cluster_entries, 1),
        per_head=per_head,
        seconds=time.perf_counter() - t0,
        command="python data/bench/experiments/cluster_streams_count.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
    )
    print(json.dumps({k: v for k, v in record.items() if k != "per_head"}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
