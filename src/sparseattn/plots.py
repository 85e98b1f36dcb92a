"""Figures of the occupancy analysis in the toolkit's style (:mod:`sparseattn.figstyle`).

Functions return a :class:`matplotlib.figure.Figure` (no pyplot: they work headless and show inline in
notebooks); pass ``path`` to also write it (PNG/PDF/SVG by extension, reproducibly).
"""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from . import figstyle
from .analysis import BlockFill

#: (record key, legend label, colour key) of the capacity bars, top to bottom within a workload.
CAPACITY_BARS = (
    ("useful_pairs", "useful", "useful"),
    ("bsa_physical", "BSA physical", "bsa"),
    ("kpage_physical_no_routing", "KPage, 128×128 tiles only", "kpage_no_routing"),
    ("kpage_physical", "KPage physical (routed)", "kpage"),
)


def _write(fig: Figure, path) -> Figure:
    if path is not None:
        figstyle.save(fig, path)
    return fig


def _check_records(records: list[dict]) -> None:
    if not records:
        raise ValueError("records must hold at least one workload record")
    for key in ("workload", "useful_pairs", "bsa_physical", "kpage_physical"):
        missing = [i for i, r in enumerate(records) if key not in r]
        if missing:
            raise ValueError(f"records[{missing[0]}] has no field {key!r}")


def capacity_bar_chart(
    records: list[dict], path=None, title: str | None = None, source: str | None = None
) -> Figure:
    """Horizontal bars per workload: useful vs BSA vs KPage physical QK pairs, BSA/KPage ratio at the right.

    Each workload's name is written above its bars, so long names need no room beside the axis.

    Args:
        records: dicts as produced by ``OccupancyReport.record()`` (``workload``, ``useful_pairs``,
            ``bsa_physical``, ``kpage_physical``; ``kpage_physical_no_routing`` drawn when present).
        path: optional output file (.png, .pdf or .svg).
        title: optional title above the figure.
        source: optional caption line under the figure (where the numbers come from).
    """
    _check_records(records)
    bars = [b for b in CAPACITY_BARS if all(b[0] in r for r in records)]
    largest = max(max(r[b[0]] for b in bars) for r in records)
    scale, unit = figstyle.pair_unit(largest)
    all_layers = records[0].get("scope") == "all_layers"
    scope = "all layers of one step" if all_layers else "attention call"
    n = len(records)
    with figstyle.style():
        height = 0.95 + figstyle.grouped_barh_height(n, len(bars)) + (0.2 if title else 0.0)
        fig = figstyle.sourced_figure(source, height=height) if source else figstyle.figure(height=height)
        ax = fig.add_subplot()
        series = [
            (label, figstyle.COLORS[colour], [r[key] / scale for r in records]) for key, label, colour in bars
        ]
        centres = figstyle.grouped_barh(
            ax, [figstyle.workload_label(str(r["workload"])) for r in records], series
        )
        ratio_texts = []
        for g, r in enumerate(records):  # the ratio sits right of the group's longest bar
            ratio = r["bsa_physical"] / r["kpage_physical"] if r["kpage_physical"] else float("nan")
            end = max(r[b[0]] for b in bars) / scale
            text = f"{ratio:.2f}×" if np.isfinite(ratio) else "–"
            ratio_texts.append(text)
            ax.annotate(
                text,
                (end, centres[g].mean()),
                xytext=(3, 0),
                textcoords="offset points",
                ha="left",
                va="center",
                fontweight="bold",
            )
        ax.set_xlim(0, 1.2 * largest / scale if largest else 1.0)
        ax.set_xlabel(f"QK pairs per {scope}, all heads ({unit})")
        handles, labels = ax.get_legend_handles_labels()
        handles.append(Line2D([], [], linestyle="none"))
        example = next((t for t in ratio_texts if t != "–"), "1.00×")
        labels.append(rf"$\bf{{{example}}}$: BSA ÷ KPage")  # the legend explains the bold numbers
        fig.legend(handles, labels, loc="outside upper left", ncols=2)
        if title:
            fig.suptitle(title, x=0.01, ha="left")
    return _write(fig, path)


def block_fill_histogram(fill: BlockFill, title: str = "", path=None, source: str | None = None) -> Figure:
    """Three stacked panels of a workload's block fill: (a) cumulative share of blocks by valid rows
    (Q and K layouts), (b) selected pairs by the live 16-row pages of their K block, (c) selected pairs
    by the useful fraction of their Bq×Bk tile."""
    if not isinstance(fill, BlockFill):
        raise TypeError(f"fill must be a BlockFill, got {type(fill).__name__}")
    with figstyle.style():
        height = 4.6
        fig = figstyle.sourced_figure(source, height=height) if source else figstyle.figure(height=height)
        ax_rows, ax_pages, ax_pairs = fig.subplots(3, 1)
        if title:
            fig.suptitle(title, x=0.01, ha="left", fontweight="bold")

        same = np.array_equal(fill.q_valid_rows, fill.k_valid_rows)
        sides = [(fill.q_valid_rows, "Q and K blocks" if same else "Q blocks", "q", "-")]
        if not same:
            sides.append((fill.k_valid_rows, "K blocks", "k", "--"))
        block = fill.q_valid_rows.size - 1
        for hist, label, colour, style in sides:
            cdf = np.cumsum(hist) / max(hist.sum(), 1)
            ax_rows.step(
                np.arange(hist.size),
                100 * cdf,
                where="post",
                label=label,
                color=figstyle.COLORS[colour],
                linestyle=style,
            )
        ax_rows.set_xlim(0, block)
        ax_rows.set_ylim(0, 102)
        ax_rows.legend(loc="upper left")
        ax_rows.set_xlabel(f"valid rows per block (of {block})")
        ax_rows.set_ylabel("blocks with ≤ x\nvalid rows (%)")
        for hist, label, colour, _ in sides:
            partial = hist[1:-1].sum() / max(hist[1:].sum(), 1)
            if len(sides) == 1 or label == "Q blocks":
                ax_rows.text(
                    0.98,
                    0.06,
                    f"{100 * partial:.0f}% of blocks partial",
                    transform=ax_rows.transAxes,
                    ha="right",
                    va="bottom",
                )
        figstyle.panel_title(ax_rows, "a", "Valid rows per logical block")

        sel = fill.selected_k_live_pages
        pages = np.arange(sel.size)
        ax_pages.bar(pages, 100 * sel / max(sel.sum(), 1), width=0.7, color=figstyle.COLORS["kpage"])
        ax_pages.set_xticks(pages)
        ax_pages.set_xlabel("live 16-row pages of the selected K block")
        ax_pages.set_ylabel("selected pairs (%)")
        figstyle.panel_title(ax_pages, "b", "Live pages of each selected K block")

        edges = fill.pair_fill_bins
        ax_pairs.bar(
            100 * edges[:-1],
            100 * fill.pair_fill / max(fill.pair_fill.sum(), 1),
            width=100 * np.diff(edges),
            align="edge",
            color=figstyle.COLORS["bsa"],
            edgecolor="white",
        )
        ax_pairs.set_xlim(0, 100)
        ax_pairs.set_xlabel("useful share of the pair's Bq×Bk tile (%)")
        ax_pairs.set_ylabel("selected pairs (%)")
        figstyle.panel_title(ax_pairs, "c", "Useful share of each selected BSA tile")
        for ax in (ax_pages, ax_pairs):
            ax.grid(axis="y")
            ax.set_axisbelow(True)
    return _write(fig, path)
