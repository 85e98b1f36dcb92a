"""Which pair matching could the device planner run per call, and how many K pages does the forward pair
list then stream against the host's? CPU study (numpy), no GPU.

    PYTHONPATH=src .venv/bin/python data/bench/experiments/device_planner_matching/matching_study.py vsa_wan14b_480p vsa_wan14b_720p

Counting (as data/bench/experiments/device_planner_work_counts.py counts ``work_info[:, 2]``), per head:
  * full blocks (4 live pages): each block's selected K pages, minus the K pages the two blocks of each pair
    item share. Pairs = the matching, then the blocks left paired two by two in slot order (host and
    device both do that); a single left over streams its own.
  * partial blocks (1-3 live pages): per item, the union of the K pages its member blocks select
    (host: ``packed_groups`` by similarity, halves two by two; device: ``forward_layout_groups``, block order).
The totals are checked against the work lists (host ``pair_work_list`` = host matching + host packing;
``partners="layout"``, which streams exactly what the device twin streams = device rule + in-order packing).

Matching = rounds of *mutual best*: every free block proposes its best free candidate (largest key: weight,
then the device's 12-bit hash of the two slots, then slots; weight > 0); mutual proposals match. Run to
convergence it is the greedy (heaviest edge first) matching over the candidates: the device's current
``greedy_matching`` rounds and the host's ``_sharing_pairs`` are this, over 26 neighbours / all pairs.
"""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import numpy as np

from sparseattn.planning.layout_pairs import forward_layout_groups, full_blocks
from sparseattn.planning.pair_forward import _sharing_pairs, packed_groups, pair_work_list
from sparseattn.workloads import get_workload

CONV = 10_000  # "rounds until nothing is left to match"
ROUNDS = (1, 2, 3, 4, 6, 8, 12, CONV)


def tie_hash(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The device's 12-bit tie-break of slots a < b (``layout_pairs.edge_keys``)."""
    a, b = a.astype(np.uint64), b.astype(np.uint64)
    m = np.uint64(0xFFFFFFFF)
    mix = ((a * np.uint64(0x9E3779B1)) & m) ^ ((b * np.uint64(0x85EBCA77)) & m)
    return (mix >> np.uint64(20)) & np.uint64(0xFFF)


def key_matrix(weight: np.ndarray) -> np.ndarray:
    """uint64 [n, n], symmetric: (weight, hash, -min slot, -max slot) packed, 0 where weight is 0. Same order
    as ``edge_keys`` for weights < 4096, without its 4095 cap (for weights summed over heads)."""
    n = weight.shape[0]
    assert n < 2048
    i, j = np.triu_indices(n, 1)
    w = np.rint(weight[i, j]).astype(np.uint64)
    k = (
        (w << np.uint64(34))
        | (tie_hash(i, j) << np.uint64(22))
        | (np.uint64(2047 - i) << np.uint64(11))
        | np.uint64(2047 - j)
    )
    out = np.zeros((n, n), dtype=np.uint64)
    out[i, j] = np.where(w > 0, k, np.uint64(0))
    out[j, i] = out[i, j]
    return out


def mutual_best(key, cand, rounds, partner=None):
    """Mutual-best rounds (see the module doc). ``cand``: bool [n, n] or None (all). Continues from
    ``partner`` (-1: free). Returns (partner, rounds with a match, converged?, matches per round)."""
    n = key.shape[0]
    k = key if cand is None else np.where(cand, key, np.uint64(0))
    partner = np.full(n, -1, np.int64) if partner is None else partner.copy()
    free = partner < 0
    idx = np.arange(n)
    per_round = []
    k = np.where(free[:, None] & free[None, :], k, np.uint64(0))
    for _ in range(rounds):
        best = k.argmax(axis=1)
        has = k[idx, best] > 0
        if not has.any():
            return partner, len(per_round), True, per_round
        a = idx[has & (best[best] == idx) & (idx < best)]
        partner[a], partner[best[a]] = best[a], a
        free[a] = free[best[a]] = False
        per_round.append(int(a.size))
        k = np.where(free[:, None] & free[None, :], k, np.uint64(0))
    return partner, len(per_round), not (k > 0).any(), per_round


def rest_in_order(partner):
    p = partner.copy()
    rest = np.flatnonzero(p < 0)
    rest = rest[: rest.size - rest.size % 2]
    p[rest[0::2]], p[rest[1::2]] = rest[1::2], rest[0::2]
    return p


def shared_of(partner, wp):
    i = np.flatnonzero(partner > np.arange(partner.size))
    return float(wp[i, partner[i]].sum())


def box(coords, r):
    d = np.abs(coords[:, None, :] - coords[None, :, :])
    m = (d <= np.asarray(r)).all(axis=2)
    np.fill_diagonal(m, False)
    return m


def top_c(w, c):
    """Each block's c heaviest partners (symmetrised)."""
    order = np.argsort(-w, axis=1, kind="stable")[:, :c]
    m = np.zeros(w.shape, dtype=bool)
    np.put_along_axis(m, order, True, axis=1)
    m &= w > 0
    return m | m.T


# --- partial blocks -----------------------------------------------------------------------------------


def items_pages(sel_h, kp, items):
    return sum(float(kp[sel_h[np.asarray(m, np.int64)].any(axis=0)].sum()) for m in items)


def agglomerate(sel_h, kp, blocks, live, cap, rounds, cand=None):
    """Partial blocks merged by mutual-best rounds: units (start: one block each) propose the free unit
    whose union shares most K pages with theirs, among units that fit (pages together ≤ ``cap``);
    mutual proposals merge. After ``rounds``, the units are packed next-fit in order up to ``cap``.
    With cap 8 a unit is an item (blocks of 1-2 pages always split into two halves of ≤ 4)."""
    units = [[int(b)] for b in blocks]
    pages = [int(live[b]) for b in blocks]
    bits = [sel_h[b].copy() for b in blocks]
    used_rounds = 0
    for _ in range(rounds):
        n = len(units)
        x = np.stack(bits).astype(np.float32)
        w = (x * kp) @ x.T
        np.fill_diagonal(w, 0)
        p = np.asarray(pages)
        fits = (p[:, None] + p[None, :]) <= cap
        if cand is not None:
            first = np.asarray([u[0] for u in units])
            fits &= cand[np.ix_(first, first)]
        w = np.where(fits, w, 0)
        key = key_matrix(w)
        best = key.argmax(axis=1)
        idx = np.arange(n)
        has = key[idx, best] > 0
        a = idx[has & (best[best] == idx) & (idx < best)]
        if a.size == 0:
            break
        used_rounds += 1
        gone = set()
        for i in a.tolist():
            j = int(best[i])
            units[i] = units[i] + units[j]
            pages[i] += pages[j]
            bits[i] = bits[i] | bits[j]
            gone.add(j)
        keep = [i for i in range(n) if i not in gone]
        units, pages, bits = [units[i] for i in keep], [pages[i] for i in keep], [bits[i] for i in keep]
    # next-fit in order of first block
    order = np.argsort([min(u) for u in units], kind="stable")
    items, cur, room = [], [], 0
    for i in order.tolist():
        if cur and room + pages[i] > cap:
            items.append(cur)
            cur, room = [], 0
        cur = cur + units[i]
        room += pages[i]
    if cur:
        items.append(cur)
    return items, used_rounds


def setup(name: str) -> SimpleNamespace:
    """A built-in workload's arrays: the graph, its selection [heads, q_blocks, k_blocks], the K blocks'
    live pages, the full (4-page) and partial (1-3-page) Q blocks, the Q blocks' tile coordinates."""
    graph = get_workload(name).build()
    nt, nh, nw, per_tile = graph.q.tile_grid
    live = graph.q.live_pages.astype(np.int64)
    kp = graph.k.live_pages.astype(np.float64)
    fid = np.flatnonzero(full_blocks(graph.q))
    nq = graph.q.num_blocks
    return SimpleNamespace(
        graph=graph,
        heads=graph.heads,
        nq=nq,
        nk=graph.k.num_blocks,
        sel=graph.block_mask(),
        kp=kp,
        kp32=kp.astype(np.float32),
        fid=fid,
        n=fid.size,
        grid=(nt, nh, nw),
        per_tile=per_tile,
        all_coords=np.stack(np.unravel_index(np.arange(nq), (nt, nh, nw)), axis=1),
        live=live,
        pid=np.flatnonzero((live > 0) & (live < 4)),
    )


def head_weights(w: SimpleNamespace, h: int):
    """Head h's full blocks: their selection rows (float32), the K pages each pair shares (zero diagonal)
    and the pages the blocks stream alone."""
    x = w.sel[h][w.fid].astype(np.float32)
    wp = ((x * w.kp32) @ x.T).astype(np.float64)
    np.fill_diagonal(wp, 0)
    return x, wp, float((x.astype(np.float64) @ w.kp).sum())


def host_partners(w: SimpleNamespace, h: int) -> np.ndarray:
    """The host's matching of head h's full blocks (``_sharing_pairs``): each block's partner index, or -1."""
    a, b, _ = _sharing_pairs(w.graph.select_heads([h]), w.fid)
    sa, sb = np.searchsorted(w.fid, a), np.searchsorted(w.fid, b)
    p = np.full(w.n, -1, np.int64)
    p[sa], p[sb] = sb, sa
    return p


def study(name: str, verify: bool = True) -> None:
    t0 = time.time()
    w = setup(name)
    graph, heads, nq, sel, kp, fid, n, pid = w.graph, w.heads, w.nq, w.sel, w.kp, w.fid, w.n, w.pid
    (nt, nh, nw), all_coords, live = w.grid, w.all_coords, w.live
    assert w.per_tile == 1
    coords = all_coords[fid]
    assert live[pid].max() <= 2
    print(
        f"# {name}: {heads} heads, {nq} Q blocks ({n} full, {pid.size} partial), tile grid {nt}x{nh}x{nw}",
        flush=True,
    )

    boxes = {"r1": box(coords, (1, 1, 1)), "r2": box(coords, (2, 2, 2)), "r3": box(coords, (3, 3, 3))}
    for lbl, m in boxes.items():
        print(f"  candidates {lbl}: per block mean {m.sum(1).mean():.1f}, max {m.sum(1).max()}")
    part_box = box(all_coords, (1, 1, 1)) | np.eye(nq, dtype=bool)
    part_box2 = box(all_coords, (2, 2, 2)) | np.eye(nq, dtype=bool)

    acc = {}  # label -> [full shared pages summed over heads, partial pages, partial items]
    conv = {}
    per_round_all = {}
    lsa_bound = 0.0
    wps, wp_sum, base_full = [], np.zeros((n, n)), 0.0
    ha_lo, hb_lo = forward_layout_groups(graph.q)
    order_items = [
        np.concatenate([np.asarray(a, np.int64), np.asarray(b, np.int64)]) for a, b in zip(ha_lo, hb_lo)
    ]

    def add(label, shared=0.0, ppages=0.0, pitems=0):
        v = acc.setdefault(label, [0.0, 0.0, 0])
        v[0] += shared
        v[1] += ppages
        v[2] += pitems

    from scipy.optimize import linear_sum_assignment

    for h in range(heads):
        x, wp, alone = head_weights(w, h)
        wb = (x @ x.T).astype(np.float64)
        np.fill_diagonal(wb, 0)
        wps.append(wp)
        wp_sum += wp
        base_full += alone
        r_, c_ = linear_sum_assignment(np.where(np.eye(n, dtype=bool), -1e9, wp), maximize=True)
        lsa_bound += float(wp[r_, c_].sum()) / 2
        gh = graph.select_heads([h])
        p = host_partners(w, h)  # host matching, exactly
        add("F host", shared_of(rest_in_order(p), wp))
        # partial packings
        groups = packed_groups(gh, pid)
        hitems = [
            np.concatenate([ga, gb])
            for ga, gb in zip(groups[0::2], groups[1::2] + [np.zeros(0, np.int64)] * (len(groups) % 2))
        ]
        add("P host (similarity, window 32)", 0, items_pages(sel[h], kp, hitems), len(hitems))
        add("P device (block order)", 0, items_pages(sel[h], kp, order_items), len(order_items))
        for R in (1, 2, 4, CONV):
            for cl, cm in (("all", None), ("r1", part_box), ("r2", part_box2)):
                its, used = agglomerate(sel[h], w.kp32, pid, live, 8, R, cm)
                rl = "conv" if R == CONV else R
                add(f"P mutual-best merge, {cl}, R={rl}", 0, items_pages(sel[h], kp, its), len(its))
                if R == CONV:
                    conv.setdefault(f"P merge {cl}", []).append(used)
        # full blocks: mutual best over candidate sets
        kpg, kbl = key_matrix(wp), key_matrix(wb)
        cands = [
            ("r1", "blocks", kbl, boxes["r1"]),
            ("r1", "pages", kpg, boxes["r1"]),
            ("r2", "pages", kpg, boxes["r2"]),
            ("r3", "pages", kpg, boxes["r3"]),
            ("all", "blocks", kbl, None),
            ("all", "pages", kpg, None),
        ]
        for c in (4, 8, 16):
            cands.append((f"top{c}", "pages", kpg, top_c(wp, c)))
        for cl, wk, key, cm in cands:
            for R in ROUNDS:
                partner, used, _done, pr = mutual_best(key, cm, R)
                rl = "conv" if R == CONV else R
                add(f"F {cl}, {wk}, R={rl}", shared_of(rest_in_order(partner), wp))
                if R == CONV:
                    conv.setdefault(f"F {cl} {wk}", []).append(used)
                    acc_pr = per_round_all.setdefault(f"F {cl} {wk}", [])
                    for i, v in enumerate(pr):
                        acc_pr.append(0) if i >= len(acc_pr) else None
                        acc_pr[i] += v
        # hybrid: local rounds, then all pairs among the blocks still free
        for cl in ("r1", "r2"):
            for r_loc in (2, 4, 6):
                partner, _, _, _ = mutual_best(kpg, boxes[cl], r_loc)
                nfree = int((partner < 0).sum())
                for r_glob in (2, 4, 6, CONV):
                    p2, used, _, _ = mutual_best(kpg, None, r_glob, partner)
                    rl = "conv" if r_glob == CONV else r_glob
                    add(f"F hybrid {cl} x{r_loc} + all-free x{rl}", shared_of(rest_in_order(p2), wp))
                    if r_glob == CONV:
                        conv.setdefault(f"F hybrid {cl} x{r_loc} + all-free", []).append(used)
                add(f"free after {cl} x{r_loc}", nfree)
        if h % 10 == 9:
            print(f"  head {h + 1}/{heads} ({time.time() - t0:.0f} s)", flush=True)

    # one matching for all heads (weights summed over heads)
    ks = key_matrix(wp_sum)
    for cl, cm in (("r1", boxes["r1"]), ("all", None)):
        for R in (4, 8, CONV):
            partner, _, _, _ = mutual_best(ks, cm, R)
            pr = rest_in_order(partner)
            rl = "conv" if R == CONV else R
            add(f"F SUMMED over heads {cl}, pages, R={rl}", sum(shared_of(pr, w) for w in wps))

    ph, pho = acc["P host (similarity, window 32)"][1:], acc["P device (block order)"][1:]
    full_items = heads * ((n + 1) // 2)
    host_total = base_full - acc["F host"][0] + ph[0]
    dev_total = base_full - acc["F r1, blocks, R=conv"][0] + pho[0]
    print(
        f"  host total {host_total:.0f} (items {full_items + ph[1]}), device rule total {dev_total:.0f} "
        f"(items {full_items + pho[1]}, {dev_total / host_total:.4f}x)"
    )
    if verify:
        ref_host = int(pair_work_list(graph).work_info[:, 2].astype(np.int64).sum())
        ref_lay = int(pair_work_list(graph, partners="layout").work_info[:, 2].astype(np.int64).sum())
        print(f"  check against the work lists: host {ref_host}, layout = device twin {ref_lay}")
    print(
        f"  full blocks: own pages {base_full:.0f}, host shares {acc['F host'][0]:.0f}; "
        f"bound on any matching (assignment/2) {lsa_bound:.0f} -> total >= {(base_full - lsa_bound + ph[0]) / host_total:.4f}x host"
    )
    print("  full-block matchings (partial packing: host's | device's block order); pages = full + partial")
    for lbl, (s, _, _) in acc.items():
        if lbl.startswith("F"):
            t_h = base_full - s + ph[0]
            t_d = base_full - s + pho[0]
            print(f"    {lbl:44s} shared {s:10.0f}  total {t_h / host_total:.4f}x | {t_d / host_total:.4f}x")
    print("  partial packings (full blocks: host matching | device rule)")
    for lbl, (_, pp, it) in acc.items():
        if lbl.startswith("P"):
            t_h = base_full - acc["F host"][0] + pp
            t_d = base_full - acc["F r1, blocks, R=conv"][0] + pp
            print(
                f"    {lbl:44s} pages {pp:9.0f} items {it:6d}  total {t_h / host_total:.4f}x | {t_d / host_total:.4f}x"
            )
    for lbl, v in acc.items():
        if lbl.startswith("free"):
            print(f"    {lbl}: {v[0] / heads:.1f} of {n} blocks free per head")
    for lbl, v in conv.items():
        v = np.asarray(v)
        extra = ""
        if lbl in per_round_all:
            fr = np.cumsum(per_round_all[lbl]) / np.sum(per_round_all[lbl])
            extra = "; matched share after 1..8 rounds " + " ".join(f"{c:.3f}" for c in fr[:8])
        print(f"  rounds to converge, {lbl}: mean {v.mean():.1f}, max {v.max()}{extra}")
    print(f"  ({time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    for nm in sys.argv[1:] or ["vsa_wan14b_480p"]:
        study(nm)
