"""End-to-end check of one combination with the package's own item builders (pair_items, group_items):
the device's 26-neighbour matching of full blocks (layout_pairs.forward_matched_pairs) + the partial blocks
packed by 3 levels of mutual best (r2 candidates, 4 rounds per level; matching_study2.level_merge), each item
split into two halves of <= 4 pages. Prints streamed pages and items against the host's work list.

    PYTHONPATH=src:data/bench/experiments/device_planner_matching .venv/bin/python data/bench/experiments/device_planner_matching/validate_combo.py vsa_wan14b_480p
"""

import sys

import numpy as np
from matching_study import box
from matching_study2 import level_merge

from sparseattn.planning.layout_pairs import forward_matched_pairs, full_blocks
from sparseattn.planning.pair_forward import group_items, pair_items, pair_work_list
from sparseattn.workloads import get_workload


def halves(unit, live):
    a, b, la, lb = [], [], 0, 0
    for blk in sorted(unit, key=lambda x: -live[x]):
        if la <= lb:
            a.append(blk)
            la += live[blk]
        else:
            b.append(blk)
            lb += live[blk]
    assert la <= 4 and lb <= 4
    return np.asarray(sorted(a), np.int64), np.asarray(sorted(b), np.int64)


for name in sys.argv[1:] or ["vsa_wan14b_480p"]:
    g = get_workload(name).build()
    sel = g.block_mask()
    kp = g.k.live_pages.astype(np.float64)
    live = g.q.live_pages.astype(np.int64)
    pid = np.flatnonzero((live > 0) & (live < 4))
    nt, nh, nw, _ = g.q.tile_grid
    co = np.stack(np.unravel_index(np.arange(g.q.num_blocks), (nt, nh, nw)), axis=1)
    cand = box(co, (2, 2, 2)) | np.eye(g.q.num_blocks, dtype=bool)
    full = full_blocks(g.q)
    pages = items = 0
    for h in range(g.heads):
        gh = g.select_heads([h])
        f, s = forward_matched_pairs(g.q, sel[h])
        pr = pair_items(gh, f, s)
        single = np.setdiff1d(np.flatnonzero(full), np.concatenate([f, s]))
        units, _ = level_merge(sel[h], kp.astype(np.float32), pid, live, 4, cand)
        hv = [halves(u, live) for u in units]
        gi = group_items(gh, [x[0] for x in hv], [x[1] for x in hv])
        pages += int(pr[0][:, 2].sum() + gi[0][:, 2].sum()) + int(sum(kp[sel[h][b]].sum() for b in single))
        items += pr[0].shape[0] + gi[0].shape[0] + single.size
    host = pair_work_list(g).work_info
    hp = int(host[:, 2].astype(np.int64).sum())
    print(
        f"{name}: 26-nbr pairs + 3-level r2 R=4 packing: pages {pages} ({pages / hp:.4f}x host {hp}), "
        f"items {items} (host {host.shape[0]})"
    )
