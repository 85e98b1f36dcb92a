"""Candidate lists without all-pairs weights: MinHash neighbours (plus the 26 spatial neighbours).

    PYTHONPATH=src:data/bench/experiments/device_planner_matching .venv/bin/python data/bench/experiments/device_planner_matching/matching_study3.py vsa_wan14b_480p vsa_wan14b_720p

Per head, m MinHash signatures of each full block's selected K blocks (signature i = the smallest value of a
fixed random permutation of the K block ids over the selected ones); for each i, the blocks sorted by
(signature, block) and each block's candidates = the w blocks before and after it in that order (GPU: m
segmented sorts of n keys per head, no sort of pairs). Candidate lists are unioned with the 26 spatial
neighbours and symmetrised; the exact weights (shared K pages) only for those. Then mutual best / Suitor
rounds as in matching_study2.py. Also the hybrid: 26 (or 124) neighbours for 2 rounds, then the still-free
blocks over all pairs among themselves (their all-pairs weights only).
Ratios: full-block part with the host's partial packing (as matching_study2.py prints them).
"""

from __future__ import annotations

import sys
import time

import matching_study as ms
import numpy as np
from matching_study2 import suitor

from sparseattn.planning.pair_forward import packed_groups


def minhash_cands(x_bool, m, w, rng_perms):
    n = x_bool.shape[0]
    cand = np.zeros((n, n), bool)
    for i in range(m):
        perm = rng_perms[i]
        sig = np.where(x_bool, perm[None, :], perm.size).min(axis=1)
        order = np.lexsort((np.arange(n), sig))
        pos = np.empty(n, np.int64)
        pos[order] = np.arange(n)
        for d in range(1, w + 1):
            a = order[:-d]
            b = order[d:]
            cand[a, b] = cand[b, a] = True
    return cand


def study(name):
    t0 = time.time()
    arrays = ms.setup(name)
    graph, heads, nk, sel, kp, fid, n, pid = (
        arrays.graph,
        arrays.heads,
        arrays.nk,
        arrays.sel,
        arrays.kp,
        arrays.fid,
        arrays.n,
        arrays.pid,
    )
    coords = arrays.all_coords[fid]
    r1, r2 = ms.box(coords, (1, 1, 1)), ms.box(coords, (2, 2, 2))
    rng = np.random.default_rng(12345)
    perms = [rng.permutation(nk) for _ in range(8)]
    F, rounds, deg = {}, {}, {}
    base_full = part_host = 0.0
    for h in range(heads):
        xb = sel[h][fid]
        _, wp, alone = ms.head_weights(arrays, h)
        base_full += alone
        key = ms.key_matrix(wp)
        gh = graph.select_heads([h])
        p = ms.host_partners(arrays, h)
        F["host"] = F.get("host", 0) + ms.shared_of(ms.rest_in_order(p), wp)
        groups = packed_groups(gh, pid)
        part_host += ms.items_pages(
            sel[h],
            kp,
            [
                np.concatenate([ga, gb])
                for ga, gb in zip(groups[0::2], groups[1::2] + [np.zeros(0, np.int64)] * (len(groups) % 2))
            ],
        )
        variants = []
        for m, w in ((4, 1), (4, 2), (8, 1), (8, 2), (8, 4)):
            c = minhash_cands(xb, m, w, perms) | r1
            variants.append((f"minhash m={m} w={w} + r1", c))
        for lbl, c in variants:
            deg.setdefault(lbl, []).append(c.sum(axis=1).mean())
            kc = np.where(c, key, np.uint64(0))
            for R in (6, 8, 10, 12, ms.CONV):
                pr, r, _, _ = ms.mutual_best(kc, None, R)
                rl = "conv" if R == ms.CONV else R
                F[f"{lbl}, mutual best R={rl}"] = F.get(f"{lbl}, mutual best R={rl}", 0) + ms.shared_of(
                    ms.rest_in_order(pr), wp
                )
                if R == ms.CONV:
                    rounds.setdefault(f"{lbl}, mutual best", []).append(r)
            for R in (6, 8):
                ps, _, _ = suitor(kc, R)
                F[f"{lbl}, Suitor R={R}"] = F.get(f"{lbl}, Suitor R={R}", 0) + ms.shared_of(
                    ms.rest_in_order(ps), wp
                )
            ps, r, _ = suitor(kc, ms.CONV)
            rounds.setdefault(f"{lbl}, Suitor", []).append(r)
        # hybrid: 2 local rounds, then all pairs among the free ones (Suitor rounds there)
        for cl, cm in (("r1", r1), ("r2", r2)):
            pr, _, _, _ = ms.mutual_best(ms.key_matrix(np.where(cm, wp, 0)), None, 2)
            free = pr < 0
            deg.setdefault(f"free after {cl} x2", []).append(free.sum())
            sub = np.flatnonzero(free)
            ksub = ms.key_matrix(wp[np.ix_(sub, sub)])
            for R in (4, 6, 8, ms.CONV):
                ps, r, _ = suitor(ksub, R)
                p2 = pr.copy()
                m_ = ps >= 0
                p2[sub[m_]] = sub[ps[m_]]
                rl = "conv" if R == ms.CONV else R
                F[f"hybrid {cl} x2 + free all-pairs Suitor x{rl}"] = F.get(
                    f"hybrid {cl} x2 + free all-pairs Suitor x{rl}", 0
                ) + ms.shared_of(ms.rest_in_order(p2), wp)
                if R == ms.CONV:
                    rounds.setdefault(f"hybrid {cl} x2 + free all-pairs Suitor", []).append(r)
        if h % 10 == 9:
            print(f"  head {h + 1}/{heads} ({time.time() - t0:.0f} s)", flush=True)
    host_total = base_full - F["host"] + part_host
    print(f"# {name}: {n} full blocks; host total {host_total:.0f}")
    for lbl, v in deg.items():
        print(f"  mean per head/block: {lbl}: {np.mean(v):.1f}")
    for lbl, s in F.items():
        print(f"  {lbl:52s} {(base_full - s + part_host) / host_total:.4f}")
    for lbl, v in rounds.items():
        print(f"  rounds to converge, {lbl}: mean {np.mean(v):.1f}, max {np.max(v)}")
    print(f"  ({time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    for nm in sys.argv[1:] or ["vsa_wan14b_480p"]:
        study(nm)
