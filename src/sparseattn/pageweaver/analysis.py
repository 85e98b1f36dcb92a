"""PageWeaver occupancy analysis: page loads and tile occupancy of the per-query path vs query unions.

Counting rules (docs/counting.md), per capture (one head group, one attention call), page size ``P``:

* ``useful   = Σ_q |S_q|·P``  (query–key pairs the selection asks for);
* per-query path: every query loads its own pages; ``physical = Σ_q R·|S_q|·P`` with
  ``R = PER_QUERY_TILE_ROWS = 16``: an mma.sync m16n8k16 tile has 16 A rows, so one query alone
  pays 16 rows; ``page_loads = Σ_q |S_q|``;
* union paths (adjacent or affinity groups ``g``): one load of ``∪_{q∈g} S_q`` per group;
  ``physical = Σ_g M_g·|∪S_q|·P`` with ``M_g = 16·⌈n_g/16⌉`` (group rows padded to the union
  kernel's 16-row tile, so ``M_g = 16`` for ``G ≤ 16``); ``page_loads = Σ_g |∪S_q|``.
* occupancy = useful / physical; gains are ratios per-query / path (> 1 = fewer loads / pairs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from .captures import (
    Capture,
    CaptureError,
    CaptureFileError,
    builtin_capture_paths,
    capture_path,
    capture_stats,
    load_capture,
)
from .grouping import (
    DEFAULT_GROUP_SIZE,
    DEFAULT_WINDOW,
    Grouping,
    adjacent_groups,
    affinity_groups,
    union_sizes,
)

#: Rows the per-query path pays per query (mma.sync minimum M = 16).
PER_QUERY_TILE_ROWS = 16
#: The union kernel's row tile: a group of n queries pays 16·⌈n/16⌉ rows.
UNION_TILE_ROWS = 16
GROUPINGS = ("per_query", "adjacent", "affinity")


def union_tile_rows(group_sizes: np.ndarray) -> np.ndarray:
    """``M_g`` per group: members padded to the union kernel's 16-row tile."""
    return UNION_TILE_ROWS * -(-np.asarray(group_sizes, dtype=np.int64) // UNION_TILE_ROWS)


def _dist(x: np.ndarray) -> dict:
    x = np.asarray(x, dtype=np.float64)
    return {
        "mean_union": float(x.mean()) if x.size else 0.0,
        "p50_union": float(np.percentile(x, 50)) if x.size else 0.0,
        "p90_union": float(np.percentile(x, 90)) if x.size else 0.0,
        "max_union_pages": int(x.max()) if x.size else 0,
    }


def grouping_counts(capture: Capture, grouping: Grouping | None) -> dict:
    """Page loads, physical/useful pairs and the union-size distribution of one path.

    ``grouping=None`` is the per-query path.
    """
    P = capture.page_size
    counts = capture.counts
    useful = int(counts.sum()) * P
    if grouping is None:
        loads = int(counts.sum())
        physical = PER_QUERY_TILE_ROWS * useful
        dist, groups = _dist(counts), capture.num_queries
    else:
        u = union_sizes(capture, grouping)
        loads = int(u.sum())
        physical = int((union_tile_rows(grouping.sizes) * u).sum()) * P
        dist, groups = _dist(u), grouping.num_groups
    return {
        "groups": int(groups),
        "page_loads": loads,
        "useful_pairs": useful,
        "physical_pairs": int(physical),
        "occupancy": useful / physical if physical else 0.0,
        **dist,
    }


def analyze_capture(
    capture,
    group_size: int = DEFAULT_GROUP_SIZE,
    window: int = DEFAULT_WINDOW,
    max_union: int | None = None,
) -> list[dict]:
    """Three flat rows (per_query, adjacent, affinity) for one capture (object, path or built-in name).

    A capture in which no query selected any page (every id is ``-1`` padding) has nothing to count:
    it raises :class:`CaptureFileError` naming the file (:class:`CaptureError` for a capture object)
    instead of rows of zero loads.
    """
    cap = load_capture(capture)
    if not (cap.pages >= 0).any():
        what = (
            f"every one of its {cap.num_queries} queries selected nothing (all page ids are -1 padding): "
            "no page loads to count"
        )
        if isinstance(capture, Capture):
            raise CaptureError(f"capture {cap.name!r}: pages: {what}", "pages")
        raise CaptureFileError(capture_path(capture), what, "pages")
    t0 = time.perf_counter()
    adj = adjacent_groups(cap.num_queries, group_size)
    t1 = time.perf_counter()
    aff = affinity_groups(cap, group_size, window, max_union)
    t2 = time.perf_counter()
    stats = capture_stats(cap)
    base = {
        "capture": cap.name,
        "style": cap.meta.get("style", ""),
        "context": cap.context,
        "page_size": cap.page_size,
        "k": cap.k,
        "queries": cap.num_queries,
        "adjacent_jaccard": stats["adjacent_jaccard"],
        "union4_mean": stats["union4_mean"],
    }
    rows = []
    for name, grouping, ms in (
        ("per_query", None, 0.0),
        ("adjacent", adj, 1e3 * (t1 - t0)),
        ("affinity", aff, 1e3 * (t2 - t1)),
    ):
        row = dict(base, grouping=name)
        row["group_size"] = 1 if grouping is None else int(group_size)
        row["window"] = int(window) if name == "affinity" else None
        row["max_union"] = max_union if name == "affinity" else None
        row["tile_rows"] = (
            f"R={PER_QUERY_TILE_ROWS}"
            if grouping is None
            else f"M_g={UNION_TILE_ROWS}*ceil(n_g/{UNION_TILE_ROWS})"
        )
        row.update(grouping_counts(cap, grouping))
        row["grouping_ms_cpu"] = ms
        rows.append(row)
    pq, ad = rows[0], rows[1]
    for row in rows:
        row["load_ratio_vs_per_query"] = _ratio(pq["page_loads"], row["page_loads"])
        row["physical_ratio_vs_per_query"] = _ratio(pq["physical_pairs"], row["physical_pairs"])
        row["load_ratio_vs_adjacent"] = _ratio(ad["page_loads"], row["page_loads"])
    return rows


def _ratio(num: int, den: int) -> float:
    return num / den if den else float("nan")


def analyze_captures(
    paths=None,
    group_size: int = DEFAULT_GROUP_SIZE,
    window: int = DEFAULT_WINDOW,
    max_union: int | None = None,
) -> list[dict]:
    """Flat rows for each capture × grouping; ``paths`` None (or empty) = the six built-in captures.

    ``paths`` items may be ``.npz`` paths, built-in names or :class:`Capture` objects.
    """
    if isinstance(paths, (str, Path, Capture)):
        items = [paths]
    else:
        items = list(paths or []) or builtin_capture_paths()
    rows = []
    for item in items:
        rows.extend(analyze_capture(item, group_size, window, max_union))
    return rows


TABLE_COLUMNS = (
    ("capture", "{}"),
    ("grouping", "{}"),
    ("queries", "{}"),
    ("k", "{}"),
    ("page_loads", "{:,}"),
    ("physical_pairs", "{:,}"),
    ("occupancy", "{:.1%}"),
    ("mean_union", "{:.1f}"),
    ("p90_union", "{:.0f}"),
    ("load_ratio_vs_per_query", "{:.2f}×"),
    ("load_ratio_vs_adjacent", "{:.2f}×"),
    ("grouping_ms_cpu", "{:.1f}"),
)


def format_table(rows: list[dict]) -> str:
    """Plain-text table of the main columns."""
    head = [c for c, _ in TABLE_COLUMNS]
    body = [[fmt.format(r[c]) if r.get(c) is not None else "-" for c, fmt in TABLE_COLUMNS] for r in rows]
    width = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, width))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(b, width)) for b in body]
    return "\n".join(lines)


def _commit() -> str:
    """The git commit of the tree (``SPARSEATTN_COMMIT`` overrides, for copies without ``.git``)."""
    if os.environ.get("SPARSEATTN_COMMIT"):
        return os.environ["SPARSEATTN_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(
        description="PageWeaver capture analysis (per-query vs adjacent vs affinity)"
    )
    ap.add_argument(
        "captures", nargs="*", help="capture .npz paths or built-in names (default: the six built-ins)"
    )
    ap.add_argument("--group-size", type=int, default=DEFAULT_GROUP_SIZE)
    ap.add_argument("--window", type=int, default=DEFAULT_WINDOW)
    ap.add_argument("--max-union", type=int, default=None)
    ap.add_argument("--json", metavar="OUT", help="write {command, date, commit, rows} to OUT")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = analyze_captures(args.captures or None, args.group_size, args.window, args.max_union)
    elapsed = time.perf_counter() - t0
    if args.json:
        doc = {
            "command": "python -m sparseattn.pageweaver.analysis "
            + " ".join(sys.argv[1:] if argv is None else argv),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "commit": _commit(),
            "counting": {
                "per_query_tile_rows": PER_QUERY_TILE_ROWS,
                "union_tile_rows": UNION_TILE_ROWS,
                "rule": __doc__.split("Counting rules")[1].strip(),
            },
            "analysis_seconds": elapsed,
            "rows": rows,
        }
        Path(args.json).write_text(json.dumps(doc, indent=1))
    print(format_table(rows))
    print(f"({len(rows)} rows in {elapsed:.2f} s)")


if __name__ == "__main__":
    main()
