"""Follow-up to matching_study.py: GPU-shaped variants with bounded rounds and short candidate lists.

    PYTHONPATH=src .venv/bin/python data/bench/experiments/device_planner_matching/matching_study2.py vsa_wan14b_480p vsa_wan14b_720p

Full blocks (per head, weights = shared K pages, device tie-break):
  * mutual best over all pairs, R rounds (R to convergence = the host's greedy);
  * synchronous Suitor over all pairs (proposals need not be mutual: a block proposes to its best candidate
    whose held offer is lower; each block keeps its best offer; displaced blocks propose again). It ends
    in the same greedy matching; counted here for its rounds;
  * top-C candidate lists (each block's C heaviest partners, symmetrised), mutual best R rounds, then the
    blocks still free: mutual best over all pairs among themselves (R2 rounds), then in slot order.
Partial blocks (1-2 live pages): levels of matching, unit pages ≤ 2, ≤ 4, ≤ 8 (an item): per level the
units' shared K pages (once per level), mutual best R rounds over candidates, the rest paired in order when
they fit. Pages as matching_study.py counts them; totals against the host's work list.
"""

from __future__ import annotations

import sys
import time

import numpy as np
from matching_study import (
    CONV,
    box,
    head_weights,
    host_partners,
    items_pages,
    key_matrix,
    mutual_best,
    rest_in_order,
    setup,
    shared_of,
    top_c,
)

from sparseattn.planning.layout_pairs import forward_layout_groups
from sparseattn.planning.pair_forward import packed_groups


def suitor(key, rounds):
    """Synchronous Suitor rounds on dense keys. Returns (partner, rounds used, converged)."""
    n = key.shape[0]
    s = np.full(n, -1, np.int64)
    sk = np.zeros(n, np.uint64)
    prop = np.ones(n, bool)
    r = 0
    while prop.any() and r < rounds:
        r += 1
        ids = np.flatnonzero(prop)
        m = np.where(key[ids] > sk[None, :], key[ids], np.uint64(0))
        j = m.argmax(axis=1)
        kv = m[np.arange(ids.size), j]
        ok = kv > 0
        prop[ids[~ok]] = False
        ids, j, kv = ids[ok], j[ok], kv[ok]
        if ids.size == 0:
            break
        order = np.lexsort((kv, j))  # by j, then key ascending: the last of each j wins
        last = np.r_[j[order][1:] != j[order][:-1], True]
        win_i, win_j, win_k = ids[order][last], j[order][last], kv[order][last]
        better = win_k > sk[win_j]
        win_i, win_j, win_k = win_i[better], win_j[better], win_k[better]
        displaced = s[win_j]
        s[win_j], sk[win_j] = win_i, win_k
        prop[win_i] = False
        d = displaced[displaced >= 0]
        prop[d] = True
    partner = np.full(n, -1, np.int64)
    i = np.arange(n)
    mutual = (s >= 0) & (s[np.maximum(s, 0)] == i)
    partner[mutual] = s[mutual]
    return partner, r, not prop.any()


def level_merge(sel_h, kp, blocks, live, rounds, cand=None, caps=(2, 4, 8)):
    units = [[int(b)] for b in blocks]
    pages = np.asarray([int(live[b]) for b in blocks])
    bits = sel_h[blocks].copy()
    used = []
    for cap in caps:
        x = bits.astype(np.float32)
        w = (x * kp) @ x.T
        np.fill_diagonal(w, 0)
        fits = (pages[:, None] + pages[None, :]) <= cap
        if cand is not None:
            first = np.asarray([u[0] for u in units])
            fits &= cand[np.ix_(first, first)]
        partner, r, _, _ = mutual_best(key_matrix(np.where(fits, w, 0)), None, rounds)
        used.append(r)
        # the rest in order, when they fit
        free = [i for i in np.argsort([u[0] for u in units], kind="stable").tolist() if partner[i] < 0]
        k = 0
        while k + 1 < len(free):
            a, b = free[k], free[k + 1]
            if pages[a] + pages[b] <= cap:
                partner[a], partner[b] = b, a
                k += 2
            else:
                k += 1
        new_units, new_pages, new_bits = [], [], []
        for i in range(len(units)):
            p = partner[i]
            if p >= 0 and p < i:
                continue
            if p >= 0:
                new_units.append(units[i] + units[p])
                new_pages.append(pages[i] + pages[p])
                new_bits.append(bits[i] | bits[p])
            else:
                new_units.append(units[i])
                new_pages.append(pages[i])
                new_bits.append(bits[i])
        units, pages, bits = new_units, np.asarray(new_pages), np.stack(new_bits)
    return units, used


def study(name: str) -> None:
    t0 = time.time()
    w = setup(name)
    graph, heads, nq, sel, kp, fid, n, pid = w.graph, w.heads, w.nq, w.sel, w.kp, w.fid, w.n, w.pid
    all_coords, live = w.all_coords, w.live
    part_r2 = box(all_coords, (2, 2, 2)) | np.eye(nq, dtype=bool)
    part_r1 = box(all_coords, (1, 1, 1)) | np.eye(nq, dtype=bool)
    ha, hb = forward_layout_groups(graph.q)
    order_items = [np.concatenate([np.asarray(a, np.int64), np.asarray(b, np.int64)]) for a, b in zip(ha, hb)]
    print(f"# {name}: {heads} heads, {n} full, {pid.size} partial blocks", flush=True)

    F, P, rounds = {}, {}, {}
    base_full = 0.0

    def addf(lbl, v):
        F[lbl] = F.get(lbl, 0.0) + v

    def addp(lbl, items):
        v = P.setdefault(lbl, [0.0, 0])
        v[0] += items_pages(sel[h], kp, items)
        v[1] += len(items)

    def addr(lbl, r):
        rounds.setdefault(lbl, []).append(r)

    for h in range(heads):
        _, wp, alone = head_weights(w, h)
        base_full += alone
        key = key_matrix(wp)
        gh = graph.select_heads([h])
        p = host_partners(w, h)
        addf("host", shared_of(rest_in_order(p), wp))
        r1 = box(all_coords[fid], (1, 1, 1))
        pr, r, _, _ = mutual_best(key_matrix(np.where(r1, wp, 0)), None, CONV)  # pages weights, r1
        addf("device-like: 26 nbrs, conv", shared_of(rest_in_order(pr), wp))
        greedy, r, _, _ = mutual_best(key, None, CONV)
        addr("mutual best, all pairs", r)
        for R in (6, 8, 10, 12, 16):
            pr, _, _, _ = mutual_best(key, None, R)
            addf(f"all pairs, mutual best R={R}", shared_of(rest_in_order(pr), wp))
        ps, r, done = suitor(key, CONV)
        assert done and np.array_equal(ps, greedy), "Suitor should end in the greedy matching"
        addr("Suitor, all pairs", r)
        for R in (4, 6, 8, 10):
            ps, _, _ = suitor(key, R)
            addf(f"all pairs, Suitor R={R}", shared_of(rest_in_order(ps), wp))
        for C in (8, 16, 32, 64):
            cm = top_c(wp, C)
            kc = np.where(cm, key, np.uint64(0))
            pc, r, _, _ = mutual_best(kc, None, CONV)
            addr(f"top{C}, mutual best", r)
            addf(f"top{C}, conv (rest in order)", shared_of(rest_in_order(pc), wp))
            ps, r, _ = suitor(kc, CONV)
            addr(f"top{C}, Suitor", r)
            for R in (6, 8):
                pc, _, _, _ = mutual_best(kc, None, R)
                for R2 in (2, 4, CONV):
                    p2, r2, _, _ = mutual_best(key, None, R2, pc)
                    rl = "conv" if R2 == CONV else R2
                    addf(f"top{C} x{R} + free all-pairs x{rl}", shared_of(rest_in_order(p2), wp))
                    if R2 == CONV:
                        addr(f"top{C} x{R} + free all-pairs", r2)
                        addf(f"free after top{C} x{R}", float((pc < 0).sum()))
        # partial blocks
        groups = packed_groups(gh, pid)
        addp(
            "host (similarity, window 32)",
            [
                np.concatenate([ga, gb])
                for ga, gb in zip(groups[0::2], groups[1::2] + [np.zeros(0, np.int64)] * (len(groups) % 2))
            ],
        )
        addp("device (block order)", order_items)
        for cl, cm in (("all", None), ("r2", part_r2), ("r1", part_r1)):
            for R in (1, 2, 4, CONV):
                its, used = level_merge(sel[h], w.kp32, pid, live, R, cm)
                rl = "conv" if R == CONV else R
                addp(f"3 levels, {cl}, R={rl} per level", its)
                if R == CONV:
                    addr(f"partial levels {cl} (per level)", max(used))
        if h % 10 == 9:
            print(f"  head {h + 1}/{heads} ({time.time() - t0:.0f} s)", flush=True)

    ph = P["host (similarity, window 32)"][0]
    pd = P["device (block order)"][0]
    host_total = base_full - F["host"] + ph
    print(
        f"  host total {host_total:.0f}; full blocks own {base_full:.0f}, partial host {ph:.0f}, block order {pd:.0f}"
    )
    print("  full blocks (ratio with host's partial packing | with block order):")
    for lbl, s in F.items():
        if lbl.startswith("free"):
            print(f"    {lbl}: {s / heads:.1f} of {n} per head")
            continue
        print(
            f"    {lbl:40s} {(base_full - s + ph) / host_total:.4f} | {(base_full - s + pd) / host_total:.4f}"
        )
    print("  partial blocks (ratio with host's full matching | with the 26-neighbour rule, pages weights):")
    for lbl, (pp, it) in P.items():
        print(
            f"    {lbl:40s} pages {pp:9.0f} items {it:6d}  {(base_full - F['host'] + pp) / host_total:.4f} | "
            f"{(base_full - F['device-like: 26 nbrs, conv'] + pp) / host_total:.4f}"
        )
    for lbl, v in rounds.items():
        v = np.asarray(v)
        print(f"  rounds to converge, {lbl}: mean {v.mean():.1f}, max {v.max()}")
    print(f"  ({time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    for nm in sys.argv[1:] or ["vsa_wan14b_480p"]:
        study(nm)
