"""CPU counts behind the notes of 8adfd1b → 31cacf6 on svg2's backward (NOTES_kpage_bwd.md, "Where svg2's backward
time goes" and "svg2 against `bsa`: what is left, counted").

    PYTHONPATH=src python data/bench/experiments/svg2_backward_counts.py steps svg2_wan14b_720p 40
    PYTHONPATH=src python data/bench/experiments/svg2_backward_counts.py tiles svg2_wan14b_720p 4
    PYTHONPATH=src python data/bench/experiments/svg2_backward_counts.py alternated vsa_wan14b_480p 8

* ``steps``: the stacked K/V-owned backward plan's launches (plain items, pair items) in kernel steps of
  four Q pages, and how many pair steps one half sees nothing of (that half skips its GEMMs).
* ``alternated``: the pair launch's steps by the halves that see them, and how many one-half steps the
  v20 candidate of the pair backward can run side by side (2 · min(A-only, B-only steps) per item; its
  stream is [A only | both | B only]), with the step-unit model of NOTES_kpage_bwd.md ("v20 candidate").
* ``tiles``: K/V-owned work at page level over the useful page pairs: every K/V block as one 128-row
  tile, as 64-row halves (no union), and with blocks selected by identical Q-block sets packed together.
"""

import sys
from collections import defaultdict

import numpy as np
from occupancy_counts import graphs_of  # beside this script

from sparseattn.kernels.backward import backward_route
from sparseattn.planning.cache import plan_of
from sparseattn.planning.tile_plan import first_pair_items, stack_head_plans

STEP_PAGES = 4


def stacked_kv_plan(gs: list):
    """The stacked K/V-owned backward plan of the heads' graphs (the route the backward takes)."""
    route = backward_route(gs[0])
    sq = -(-max(g.q.num_slots for g in gs) // 16) * 16
    sk = -(-max(g.k.num_slots for g in gs) // 16) * 16
    return stack_head_plans([plan_of(g, "kpage", route, owner="kv") for g in gs], sk // 16, sq // 16)


def step_halves(vis: np.ndarray) -> np.ndarray:
    """Per kernel step of STEP_PAGES entries of one item, the halves that see it (bit 0 rows 0-63, bit 1
    rows 64-127; a last partial step holds fewer entries)."""
    n = -(-vis.size // STEP_PAGES)
    padded = np.zeros(n * STEP_PAGES, np.uint32)
    padded[: vis.size] = vis & 3
    return np.bitwise_or.reduce(padded.reshape(n, STEP_PAGES), axis=1)


def launch_steps(gs: list) -> list[dict]:
    """Per launch of the stacked K/V-owned backward plan (plain items, pair items of each route): items,
    streamed entries, kernel steps of STEP_PAGES Q pages, the steps one half sees nothing of, and the
    share of entries one half sees."""
    plan = stacked_kv_plan(gs)
    indptr = plan.stream_indptr.astype(np.int64)
    vis = plan.stream_vis if plan.stream_vis is not None else np.full(int(indptr[-1]), 3, np.uint32)
    out = []
    for (start, stop), first_pair in zip(plan.route_ranges(), first_pair_items(plan)):
        for name, a, b in (("plain", start, first_pair), ("pair", first_pair, stop)):
            if b <= a:
                continue
            total = one_half = 0
            for w in range(a, b):
                halves = step_halves(vis[indptr[w] : indptr[w + 1]])
                total += halves.size
                one_half += int(((halves == 1) | (halves == 2)).sum())
            entries = vis[indptr[a] : indptr[b]]
            out.append(
                dict(
                    launch=name,
                    items=b - a,
                    entries=int(indptr[b] - indptr[a]),
                    steps=total,
                    one_half_steps=one_half,
                    seen_by_one=float(((entries == 1) | (entries == 2)).mean()) if entries.size else 0.0,
                )
            )
    return out


def alternated(gs: list) -> None:
    plan = stacked_kv_plan(gs)
    if plan.stream_vis is None:
        print("no pair items")
        return
    indptr = plan.stream_indptr.astype(np.int64)
    both = one = paired = 0
    for (_, stop), first_pair in zip(plan.route_ranges(), first_pair_items(plan)):
        for w in range(first_pair, stop):
            halves = step_halves(plan.stream_vis[indptr[w] : indptr[w + 1]])
            a, b = int((halves == 1).sum()), int((halves == 2).sum())
            both += int((halves == 3).sum())
            one += a + b
            paired += 2 * min(a, b)
    print(
        f"pair steps {both + one}: both halves {both}, one half {one} ({paired} alternated, {one - paired} not)"
    )
    # step units: a one-half step in lock-step 0.81 of a full step (measured, v18), two alternated 1.05;
    # v20a runs the others alone at 0.85-1.0, v20b in lock-step
    before = both + 0.81 * one
    alone = one - paired
    v20a_lo, v20a_hi = (both + 0.525 * paired + c * alone for c in (0.85, 1.0))
    v20b = both + 0.525 * paired + 0.81 * alone
    print(
        f"step units {before:.0f}; v20a {v20a_lo:.0f} to {v20a_hi:.0f} "
        f"({v20a_lo / before - 1:+.1%} to {v20a_hi / before - 1:+.1%}); v20b {v20b:.0f} ({v20b / before - 1:+.1%})"
    )


def steps(gs: list) -> None:
    for r in launch_steps(gs):
        print(
            f"{r['launch']}: items {r['items']}, entries {r['entries']}, steps {r['steps']} "
            f"({r['one_half_steps']} with one half seeing none of its rows); entries seen by one half "
            f"{r['seen_by_one']:.3f}"
        )


def tiles(gs: list) -> None:
    useful = per_block = halves = same_set = 0
    for g in gs:
        t = g.transpose()  # rows: K/V blocks, columns: the Q blocks selecting them
        k_pages, q_pages = t.q.live_pages.astype(np.int64), t.k.live_pages.astype(np.int64)
        pages_of_set, stream_of_set = defaultdict(int), {}
        for b in range(t.q.num_blocks):
            sel = t.indices[t.indptr[b] : t.indptr[b + 1]]
            if k_pages[b] == 0 or sel.size == 0:
                continue
            stream = int(q_pages[sel].sum())
            useful += int(k_pages[b]) * stream
            per_block += 8 * stream
            halves += 4 * -(-int(k_pages[b]) // 4) * stream
            key = tuple(sel.tolist())
            pages_of_set[key] += int(k_pages[b])
            stream_of_set[key] = stream
        same_set += sum(-(-p // 8) * 8 * stream_of_set[k] for k, p in pages_of_set.items())
        print(f"K/V blocks {t.q.num_blocks}, distinct Q-block sets {len(pages_of_set)}")
    print(
        f"page pairs over useful: 128-row tile per block {per_block / useful:.3f}; 64-row halves "
        f"{halves / useful:.3f}; identical sets packed into 128-row tiles {same_set / useful:.3f}"
    )


if __name__ == "__main__":
    mode, name, heads = sys.argv[1], sys.argv[2], int(sys.argv[3])
    {"steps": steps, "tiles": tiles, "alternated": alternated}[mode](graphs_of(name, heads))
