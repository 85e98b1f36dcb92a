"""Figures of the PageWeaver analysis in the toolkit's style: page loads and union sizes per capture.

Inputs are the rows of :func:`sparseattn.pageweaver.analysis.analyze_captures` and the union sizes of
:func:`union_size_samples`; every function returns a :class:`matplotlib.figure.Figure` and writes it
when given ``path``.
"""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from .. import figstyle
from .captures import load_capture
from .grouping import DEFAULT_GROUP_SIZE, DEFAULT_WINDOW, adjacent_groups, affinity_groups, union_sizes

#: (grouping, legend label) of the page-load bars, top to bottom within a capture.
LOAD_BARS = (
    ("per_query", "per-query (each query alone)"),
    ("adjacent", "adjacent groups"),
    ("affinity", "affinity groups"),
)


def _write(fig: Figure, path) -> Figure:
    if path is not None:
        figstyle.save(fig, path)
    return fig


def _by_capture(rows: list[dict]) -> dict[str, dict[str, dict]]:
    table: dict[str, dict[str, dict]] = {}
    for r in rows:
        table.setdefault(r["capture"], {})[r["grouping"]] = r
    missing = [(c, g) for c, paths in table.items() for g, _ in LOAD_BARS if g not in paths]
    if missing:
        raise ValueError(f"rows lack grouping {missing[0][1]!r} of capture {missing[0][0]!r}")
    return table


def page_loads_figure(rows: list[dict], path=None, source: str | None = None) -> Figure:
    """(a) KV page loads per query of the per-query path, adjacent and affinity groups, per capture;
    (b) the share of adjacent grouping's page loads that affinity grouping saves, labelled directly.

    ``rows``: :func:`analyze_captures` rows (``capture``, ``grouping``, ``page_loads``, ``queries``,
    ``page_size``, ``group_size``, ``window``).
    """
    table = _by_capture(rows)
    names = list(table)
    first = table[names[0]]
    group, window = first["affinity"]["group_size"], first["affinity"]["window"]
    page_sizes = sorted({r["page_size"] for r in rows})
    page_text = "/".join(str(p) for p in page_sizes)
    labels = {
        "per_query": LOAD_BARS[0][1],
        "adjacent": f"adjacent groups of {group}",
        "affinity": f"affinity groups of {group} (window {window})",
    }
    n = len(names)
    y = np.arange(n, dtype=float)
    bar_h = 0.26
    with figstyle.style():
        height = 1.25 + 0.3 * n
        fig = figstyle.sourced_figure(source, height=height) if source else figstyle.figure(height=height)
        ax_loads, ax_saved = fig.subplots(1, 2, sharey=True, width_ratios=(1.35, 1.0))
        for k, (grouping, _) in enumerate(LOAD_BARS):
            per_query = [table[c][grouping]["page_loads"] / table[c][grouping]["queries"] for c in names]
            ax_loads.barh(
                y + (k - 1) * bar_h,
                per_query,
                bar_h * 0.92,
                color=figstyle.COLORS[grouping],
                label=labels[grouping],
            )
        ax_loads.set_yticks(y, [figstyle.capture_label(c) for c in names])
        ax_loads.invert_yaxis()
        ax_loads.tick_params(axis="y", length=0)
        ax_loads.set_xlabel(f"KV page loads per query\n(pages of {page_text} tokens)")
        ax_loads.grid(axis="x")
        figstyle.panel_title(ax_loads, "a", "Page loads")

        saved = np.array(
            [
                100 * (1 - table[c]["affinity"]["page_loads"] / table[c]["adjacent"]["page_loads"])
                for c in names
            ]
        )
        ax_saved.barh(y, saved, 0.6, color=figstyle.COLORS["affinity"])
        for yi, s in zip(y, saved):
            ax_saved.annotate(
                f"{s:.1f}%",
                (max(s, 0.0), yi),
                xytext=(2, 0),
                textcoords="offset points",
                ha="left",
                va="center",
            )
        ax_saved.set_xlim(min(0.0, saved.min() * 1.3), max(1.0, saved.max()) * 1.45)
        ax_saved.axvline(0, color="black", lw=0.6)
        ax_saved.tick_params(axis="y", length=0)
        ax_saved.set_xlabel("loads saved vs\nadjacent groups (%)")
        ax_saved.grid(axis="x")
        figstyle.panel_title(ax_saved, "b", "Affinity saves")
        for ax in (ax_loads, ax_saved):
            ax.set_axisbelow(True)
        fig.legend(*ax_loads.get_legend_handles_labels(), loc="outside upper left", ncols=1)
    return _write(fig, path)


def union_size_samples(
    captures=None, group_size: int = DEFAULT_GROUP_SIZE, window: int = DEFAULT_WINDOW
) -> list[dict]:
    """Per capture: ``capture``, ``k``, ``page_size`` and the union size of every adjacent and affinity
    group (``adjacent``, ``affinity``: int arrays). ``captures``: names, paths or Capture objects
    (default: the six built-ins)."""
    from .captures import BUILTIN_CAPTURES

    out = []
    for item in captures if captures is not None else list(BUILTIN_CAPTURES):
        cap = load_capture(item)
        out.append(
            {
                "capture": cap.name,
                "k": int(cap.k),
                "page_size": int(cap.page_size),
                "group_size": int(group_size),
                "window": int(window),
                "adjacent": union_sizes(cap, adjacent_groups(cap.num_queries, group_size)),
                "affinity": union_sizes(cap, affinity_groups(cap, group_size, window)),
            }
        )
    return out


def union_size_figure(samples: list[dict], path=None, source: str | None = None) -> Figure:
    """Distribution of union sizes (pages one group loads) per capture, adjacent vs affinity groups,
    in units of one query's selection ``k``: 1 = the group's queries share every page, ``G`` = none.

    Boxes span the quartiles, whiskers the 5th–95th percentiles, the line is the median and the
    dot the mean.
    """
    if not samples:
        raise ValueError("samples must hold at least one capture")
    group = samples[0]["group_size"]
    n = len(samples)
    y = np.arange(n, dtype=float)
    with figstyle.style():
        height = 1.0 + 0.32 * n
        fig = figstyle.sourced_figure(source, height=height) if source else figstyle.figure(height=height)
        ax = fig.add_subplot()
        for k, (grouping, label) in enumerate(
            (("adjacent", f"adjacent groups of {group}"), ("affinity", f"affinity groups of {group}"))
        ):
            data = [np.asarray(s[grouping], dtype=float) / s["k"] for s in samples]
            pos = y + (k - 0.5) * 0.36
            colour = figstyle.COLORS[grouping]
            ax.boxplot(
                data,
                positions=pos,
                orientation="horizontal",
                widths=0.3,
                whis=(5, 95),
                showfliers=False,
                patch_artist=True,
                boxprops={"facecolor": colour, "edgecolor": colour, "alpha": 0.35},
                medianprops={"color": colour, "lw": 1.5},
                whiskerprops={"color": colour},
                capprops={"color": colour},
            )
            ax.plot([d.mean() for d in data], pos, "o", ms=3, color=colour, label=label)
        ax.set_yticks(y, [f"{figstyle.capture_label(s['capture'])}\n(k = {s['k']})" for s in samples])
        ax.set_ylim(n - 0.5, -0.5)
        ax.tick_params(axis="y", length=0)
        ax.set_xlim(1, None)
        ax.set_xlabel(f"pages loaded per group, in units of k\n(1 = the {group} queries share all pages)")
        ax.grid(axis="x")
        ax.set_axisbelow(True)
        fig.legend(loc="outside upper left", ncols=2)
    return _write(fig, path)
