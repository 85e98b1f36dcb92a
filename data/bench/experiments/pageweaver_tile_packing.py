"""How much a union tile filled at small G could save (NOTES_pageweaver, "Filling the tile at small G"):
CPU counts on the built-in captures, no GPU.

    PYTHONPATH=src python data/bench/experiments/pageweaver_tile_packing.py [--out FILE.json]

The union kernel runs one 64-row tile per (KV head, group of 8 queries): 8·G live rows, so at G = 1 / 2 /
4 only 8 / 16 / 32 of its 64 rows hold queries, and it streams the group's union U_g in 64-key chunks
(``kernel_bench.union_chunks``: Σ_g ⌈|U_g|·P / 64⌉ per KV head). Two designs fill the tile:

* **packing**: ``p = 64 / (8·G)`` consecutive groups (in the affinity search's order) share one tile and
  stream the union of their unions: chunks Σ_t ⌈|∪_{g∈t} U_g|·P / 64⌉, each chunk with a per-row mask;
* **two-CTA cluster**: consecutive groups in pairs, each CTA its own tile, each page of U_a ∪ U_b loaded
  once into both CTAs (multicast): chunks as now, page loads Σ_pairs |U_a ∪ U_b| against Σ |U_a| + |U_b|.

Prints one line per capture and G: chunks now and packed (their ratio is the predicted speedup where the
per-chunk cost dominates, as it does at G ≤ 4), and the loads the two-CTA design saves.
"""

import json
import sys

from sparseattn.pageweaver.captures import BUILTIN_CAPTURES, load_capture
from sparseattn.pageweaver.grouping import Grouping, affinity_groups, union_sizes


def chunks(cap, grouping: Grouping) -> int:
    return int((-(-(union_sizes(cap, grouping) * cap.page_size) // 64)).sum())


def main() -> None:
    out = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None
    rows = []
    for name in BUILTIN_CAPTURES:
        cap = load_capture(name)
        groups = affinity_groups(cap, 8, 64)
        now = chunks(cap, groups)
        u = union_sizes(cap, groups)
        pairs = union_sizes(cap, groups.packed(2))
        loads_now, loads_pairs = int(u.sum()), int(pairs.sum())
        for gqa in (1, 2, 4):
            p = 64 // (8 * gqa)
            packed = chunks(cap, groups.packed(p))
            row = dict(
                capture=name,
                gqa=gqa,
                groups_per_tile=p,
                chunks_now=now,
                chunks_packed=packed,
                chunk_ratio=now / packed,
                page_loads_now=loads_now,
                page_loads_two_cta=loads_pairs,
                load_ratio_two_cta=loads_now / loads_pairs,
            )
            rows.append(row)
            print(
                f"{name:8s} G={gqa} {p} groups/tile: chunks {now:,} -> {packed:,} ({row['chunk_ratio']:.2f}x); "
                f"two-CTA loads {loads_now:,} -> {loads_pairs:,} ({row['load_ratio_two_cta']:.2f}x)"
            )
    if out:
        with open(out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
