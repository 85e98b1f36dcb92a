"""Figures of the occupancy analysis (matplotlib, no pyplot: works headless and inside notebooks).

Functions return a :class:`matplotlib.figure.Figure`; pass ``path`` to also write it (PNG/PDF/SVG by
extension, rendered with the Agg canvas).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .analysis import BlockFill

#: (record key, legend label, colour) of the capacity bars, in drawing order.
CAPACITY_BARS = (
    ("useful_pairs", "useful", "#4c956c"),
    ("bsa_physical", "BSA physical", "#d1495b"),
    ("kpage_physical_no_routing", "KPage physical, no routing (128×128)", "#edae49"),
    ("kpage_physical", "KPage physical", "#00798c"),
)


def _save(fig: Figure, path) -> Figure:
    if path is not None:
        path = Path(path)
        if path.parent and not path.parent.exists():
            raise FileNotFoundError(f"plot directory {str(path.parent)!r} does not exist")
        FigureCanvasAgg(fig)
        fig.savefig(path, dpi=150)
    return fig


def capacity_bar_chart(records: list[dict], path=None, title: str | None = None) -> Figure:
    """Grouped bars per workload: useful vs BSA vs KPage physical QK pairs (G pairs).

    Args:
        records: dicts as produced by ``OccupancyReport.record()`` (``workload``, ``useful_pairs``,
            ``bsa_physical``, ``kpage_physical``; ``kpage_physical_no_routing`` drawn when present).
        path: optional output file.
    """
    if not records:
        raise ValueError("records must hold at least one workload record")
    for key in ("workload", "useful_pairs", "bsa_physical", "kpage_physical"):
        missing = [i for i, r in enumerate(records) if key not in r]
        if missing:
            raise ValueError(f"records[{missing[0]}] has no field {key!r}")
    bars = [b for b in CAPACITY_BARS if all(b[0] in r for r in records)]
    names = [str(r["workload"]) for r in records]
    x = np.arange(len(records), dtype=float)
    width = 0.8 / len(bars)
    fig = Figure(figsize=(max(6.0, 1.6 * len(records) + 2), 4.5), layout="constrained")
    ax = fig.add_subplot()
    for n, (key, label, colour) in enumerate(bars):
        values = np.array([r[key] for r in records], dtype=float) / 1e9
        ax.bar(x + (n - (len(bars) - 1) / 2) * width, values, width, label=label, color=colour)
    for xi, r in zip(x, records):
        if r["kpage_physical"]:
            top = max(r[b[0]] for b in bars) / 1e9
            ax.annotate(f"{r['bsa_physical'] / r['kpage_physical']:.2f}×", (xi, top), ha="center",
                        va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(x, names, rotation=20, ha="right", fontsize=8)
    all_layers = records[0].get("scope") == "all_layers"
    ax.set_ylabel("QK pairs, all layers (G)" if all_layers else "QK pairs per attention call (G)")
    ax.set_title(title or "Useful vs physical QK pairs (label: BSA / KPage physical)", fontsize=10)
    ax.set_ylim(top=1.3 * max(max(r[b[0]] for b in bars) for r in records) / 1e9)
    ax.legend(fontsize=7, ncols=2, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def block_fill_histogram(fill: BlockFill, title: str = "", path=None) -> Figure:
    """Three panels of a workload's block fill: cumulative distribution of valid rows per block (Q and K
    layouts), selected K blocks by live 16-row pages, and selected pairs by useful fraction of their
    Bq×Bk tile."""
    if not isinstance(fill, BlockFill):
        raise TypeError(f"fill must be a BlockFill, got {type(fill).__name__}")
    fig = Figure(figsize=(12, 3.4), layout="constrained")
    ax_rows, ax_pages, ax_pairs = fig.subplots(1, 3)

    same = np.array_equal(fill.q_valid_rows, fill.k_valid_rows)
    sides = [(fill.q_valid_rows, "Q and K blocks" if same else "Q blocks", "#00798c", "-")]
    if not same:
        sides.append((fill.k_valid_rows, "K blocks", "#d1495b", "--"))
    for hist, label, colour, style in sides:
        cdf = np.cumsum(hist) / max(hist.sum(), 1)
        ax_rows.step(np.arange(hist.size), cdf, where="post", label=label, color=colour, linestyle=style)
    ax_rows.set_ylim(0, 1.02)
    ax_rows.legend(fontsize=8, loc="upper left")
    ax_rows.set_xlabel("valid rows per block")
    ax_rows.set_ylabel("fraction of blocks with ≤ x valid rows")

    pages = np.arange(fill.selected_k_live_pages.size)
    sel_pages = fill.selected_k_live_pages
    ax_pages.bar(pages, sel_pages / max(sel_pages.sum(), 1), color="#00798c")
    ax_pages.set_xlabel("live 16-row pages of the selected K block")
    ax_pages.set_ylabel("fraction of selected pairs")

    edges = fill.pair_fill_bins
    ax_pairs.bar(edges[:-1], fill.pair_fill / max(fill.pair_fill.sum(), 1), width=np.diff(edges),
                 align="edge", color="#d1495b", edgecolor="white")
    ax_pairs.set_xlabel("useful fraction of the pair's Bq×Bk tile")
    ax_pairs.set_ylabel("fraction of selected pairs")
    if title:
        fig.suptitle(title)
    return _save(fig, path)
