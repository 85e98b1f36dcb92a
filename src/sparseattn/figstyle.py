"""One figure style for the toolkit: paper sizes, fonts, colours, readable names, deterministic files.

Every figure of the toolkit (``sparseattn analyze --plot``, ``sparseattn figures``, the notebooks) is
drawn inside :func:`style` and written by :func:`save`/:func:`save_all`:

* widths of one and two paper columns (:data:`ONE_COLUMN`, :data:`TWO_COLUMN`, inches), text of at
  least 8 pt at that printed size;
* the Okabe–Ito colour-blind-safe palette, one colour per meaning (:data:`COLORS`);
* readable names for workload ids, capture ids and kernel implementations (:func:`workload_label`,
  :func:`capture_label`, :func:`impl_label`);
* a source line under the figure (:func:`add_source_line`) and bold panel letters (:func:`panel_title`);
* PNG (200 dpi), PDF and SVG written byte-for-byte reproducibly: no dates, fixed SVG ids, the bundled
  DejaVu Sans font, so regenerating a figure leaves a git checkout clean.
"""

from __future__ import annotations

import contextlib
import os
import textwrap
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.layout_engine import ConstrainedLayoutEngine

#: Printed widths in inches: one column of a two-column paper, and the full text width.
ONE_COLUMN = 3.4
TWO_COLUMN = 7.0
#: Smallest text size at printed size, in points; tick labels and the source line use it.
MIN_FONT_PT = 8
PNG_DPI = 200
FORMATS = ("png", "pdf", "svg")

#: Okabe & Ito (2008) colour-blind-safe palette.
OKABE_ITO = {
    "black": "#000000",
    "orange": "#E69F00",
    "sky_blue": "#56B4E9",
    "bluish_green": "#009E73",
    "yellow": "#F0E442",
    "blue": "#0072B2",
    "vermillion": "#D55E00",
    "reddish_purple": "#CC79A7",
    "grey": "#999999",
}

#: One colour per meaning, used by every figure so that a colour means the same thing everywhere.
COLORS = {
    "useful": OKABE_ITO["grey"],
    "bsa": OKABE_ITO["vermillion"],
    "bsa_mma": OKABE_ITO["vermillion"],
    "bsa_wgmma": OKABE_ITO["reddish_purple"],
    "kpage_no_routing": OKABE_ITO["orange"],
    "kpage": OKABE_ITO["blue"],
    "flex": OKABE_ITO["sky_blue"],
    "vsa_kernel": OKABE_ITO["bluish_green"],
    "cudnn_dense": OKABE_ITO["black"],
    "per_query": OKABE_ITO["vermillion"],
    "adjacent": OKABE_ITO["orange"],
    "affinity": OKABE_ITO["blue"],
    "flashinfer": OKABE_ITO["sky_blue"],
    "pageweaver_union": OKABE_ITO["blue"],
    "kv_page_union": OKABE_ITO["bluish_green"],
    "q": OKABE_ITO["blue"],
    "k": OKABE_ITO["vermillion"],
}

#: Built-in workload ids -> names a reader of a paper understands (method · model, resolution).
WORKLOAD_LABELS = {
    "vsa_wan14b_720p": "VSA · Wan2.1-14B 720p",
    "vsa_wan14b_480p": "VSA · Wan2.1-14B 480p",
    "ssta_hy15_720p": "SSTA · HunyuanVideo-1.5 720p",
    "sta_hunyuan_117f": "STA · HunyuanVideo 117f",
    "sta_wan14b_69f": "STA · Wan2.1-14B 69f",
    "svg2_wan14b_720p": "SVG2 · Wan2.1-14B 720p",
    "dense_16384": "Dense · 16,384 tokens × 32 heads",
    "dense_32768": "Dense · 32,768 tokens × 16 heads",
    "dense_75600": "Dense · 75,600 tokens, all pairs",
    "dense_131072": "Dense · 131,072 tokens × 4 heads",
}

#: Kernel implementation ids of the benchmark JSON -> legend names.
IMPL_LABELS = {
    "kpage": "KPage",
    "bsa": "BSA",
    "bsa_mma": "BSA (mma.sync)",
    "bsa_wgmma": "BSA (wgmma)",
    "flex": "FlexAttention",
    "cudnn_dense": "cuDNN dense",
    "vsa_kernel": "VSA kernel",
    "flashinfer": "FlashInfer",
    "flashinfer_bf16": "FlashInfer (bf16 cache)",
    "pageweaver_union": "PageWeaver union",
    "kv_page_union": "KV-page union",
    "per_query": "per-query",
}

#: Benchmark passes -> axis/panel names.
PASS_LABELS = {
    "fwd": "forward",
    "bwd": "backward",
    "fwdbwd": "forward + backward",
    "complete_call": "complete call",
}

#: Capture styles of :mod:`sparseattn.pageweaver.captures` -> names.
CAPTURE_STYLE_LABELS = {"nsa": "NSA-like", "dsa": "DSA-like"}

#: rcParams of the style: sizes are in points at printed size.
RC = {
    "font.family": "sans-serif",
    "font.sans-serif": ["DejaVu Sans"],  # bundled with matplotlib: the same glyphs on every machine
    "mathtext.fontset": "dejavusans",
    "font.size": MIN_FONT_PT,
    "axes.titlesize": MIN_FONT_PT + 1,
    "axes.labelsize": MIN_FONT_PT,
    "xtick.labelsize": MIN_FONT_PT,
    "ytick.labelsize": MIN_FONT_PT,
    "legend.fontsize": MIN_FONT_PT,
    "legend.title_fontsize": MIN_FONT_PT,
    "figure.titlesize": MIN_FONT_PT + 1,
    "axes.linewidth": 0.6,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": False,
    "grid.linewidth": 0.4,
    "grid.alpha": 0.5,
    "axes.titlelocation": "left",
    "axes.titlepad": 4.0,
    "axes.labelpad": 2.0,
    "xtick.major.width": 0.6,
    "ytick.major.width": 0.6,
    "xtick.major.size": 2.5,
    "ytick.major.size": 2.5,
    "lines.linewidth": 1.2,
    "patch.linewidth": 0.5,
    "legend.frameon": False,
    "legend.handlelength": 1.2,
    "legend.handletextpad": 0.4,
    "legend.columnspacing": 1.0,
    "legend.borderaxespad": 0.2,
    "axes.prop_cycle": matplotlib.cycler(
        color=[
            OKABE_ITO[c]
            for c in (
                "blue",
                "vermillion",
                "orange",
                "bluish_green",
                "sky_blue",
                "reddish_purple",
                "black",
                "yellow",
            )
        ]
    ),
    "image.cmap": "viridis",
    "figure.dpi": 150,  # on screen (notebooks); files use PNG_DPI
    "savefig.dpi": PNG_DPI,
    "pdf.fonttype": 42,  # TrueType in PDF: editable text, accepted by paper systems (no Type 3)
    "svg.fonttype": "none",  # SVG text stays text (small files, editable)
    "svg.hashsalt": "sparseattn",  # fixed ids inside SVG files
}

#: Metadata per format: nothing that changes from run to run (dates) or with the installed version
#: of matplotlib's writer (PDF Producer); the SVG keeps matplotlib's Creator line, which says
#: which version drew the figure (tests compare committed figures only when it matches).
METADATA = {
    "png": {"Software": None},
    "pdf": {"Creator": "sparseattn", "Producer": None, "CreationDate": None, "ModDate": None},
    "svg": {"Date": None},
}


@contextlib.contextmanager
def style():
    """Context in which figures are drawn (and saved) in the toolkit's style."""
    with matplotlib.rc_context(RC):
        yield


def use() -> None:
    """Apply the style for the rest of the session (notebooks: call once at the top)."""
    matplotlib.rcParams.update(RC)


def figure(width: float = ONE_COLUMN, height: float = 2.4, source_lines: int = 0) -> Figure:
    """A new Figure (no pyplot) of ``width`` × ``height`` inches with constrained layout.

    ``source_lines`` reserves room at the bottom for :func:`add_source_line`.
    """
    fig = Figure(figsize=(width, height), layout="constrained")
    if source_lines:
        bottom = _source_height(source_lines) / height
        fig.get_layout_engine().set(rect=(0.0, bottom, 1.0, 1.0 - bottom))
    FigureCanvasAgg(fig)
    return fig


def _source_height(lines: int) -> float:
    """Inches taken by ``lines`` lines of the source text (and a small gap)."""
    return (lines * 1.25 * MIN_FONT_PT + 3) / 72


class _PathWrapper(textwrap.TextWrapper):
    """Breaks lines at spaces; a word longer than a line (a file path) after one of its ``/`` rather than
    inside a file name."""

    def _handle_long_word(self, reversed_chunks, cur_line, cur_len, width):
        chunk = reversed_chunks[-1]
        cut = chunk.rfind("/", 0, max(width - cur_len, 1)) + 1
        if cut:
            cur_line.append(chunk[:cut])
            reversed_chunks[-1] = chunk[cut:]
        else:
            super()._handle_long_word(reversed_chunks, cur_line, cur_len, width)


def wrap_source(text: str, width: float = ONE_COLUMN) -> list[str]:
    """The source text broken into lines that fit a figure ``width`` inches wide at MIN_FONT_PT."""
    chars = max(20, int(width * 72 / (0.56 * MIN_FONT_PT)))  # DejaVu Sans: ~0.56 em per character
    return _PathWrapper(chars, break_on_hyphens=False).wrap(text) or [""]


def add_source_line(fig: Figure, lines: list[str]) -> None:
    """Write the source lines (from :func:`wrap_source`) at the bottom-left of ``fig``."""
    fig.text(
        0.01,
        0.01,
        "\n".join(lines),
        ha="left",
        va="bottom",
        fontsize=MIN_FONT_PT,
        color="#444444",
        linespacing=1.25,
    )


def sourced_figure(source: str, width: float = ONE_COLUMN, height: float = 2.4) -> Figure:
    """A :func:`figure` with ``source`` written under it (wrapped to the figure's width)."""
    lines = wrap_source(source, width)
    fig = figure(width, height + _source_height(len(lines)), source_lines=len(lines))
    add_source_line(fig, lines)
    return fig


def panel_title(ax, letter: str, title: str = "") -> None:
    """Bold panel letter (a, b, ...) and a short title at the top-left of ``ax``."""
    ax.set_title(rf"$\bf{{{letter}}}$  {title}" if title else rf"$\bf{{{letter}}}$", loc="left")


def note(ax, text: str, **kwargs) -> None:
    """A plain message in the middle of an empty panel (for data that is not there yet)."""
    ax.text(
        0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", wrap=True, color="#444444", **kwargs
    )
    ax.set_xticks([])
    ax.set_yticks([])
    for side in ("left", "bottom"):
        ax.spines[side].set_visible(False)


def workload_label(name: str) -> str:
    """Readable name of a workload id; unknown ids (user layouts) are returned unchanged."""
    return WORKLOAD_LABELS.get(name, name)


def canonical_order(workloads) -> list[str]:
    """Workload ids with the built-ins first, in the order of :data:`WORKLOAD_LABELS`."""
    known = list(WORKLOAD_LABELS)
    return sorted(workloads, key=lambda w: (known.index(w) if w in known else len(known),))


def capture_label(name: str) -> str:
    """``nsa_32k`` -> ``NSA-like 32K``; other names are returned unchanged."""
    style_name, _, context = name.partition("_")
    if style_name in CAPTURE_STYLE_LABELS and context[:-1].isdigit() and context[-1:] in "kK":
        return f"{CAPTURE_STYLE_LABELS[style_name]} {context[:-1]}K"
    return name


def impl_label(impl: str) -> str:
    return IMPL_LABELS.get(impl, impl)


def pair_unit(largest: float) -> tuple[float, str]:
    """(scale, axis unit) for QK pair counts: 10⁹ pairs like the paper, 10⁶ or plain for small layouts."""
    if largest >= 1e8:
        return 1e9, "10⁹ pairs"
    if largest >= 1e5:
        return 1e6, "10⁶ pairs"
    return 1.0, "pairs"


def save(fig: Figure, path) -> Path:
    """Write ``fig`` to ``path`` (format from the extension: .png, .pdf or .svg), reproducibly."""
    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise ValueError(f"figure file {str(path)!r}: use a .png, .pdf or .svg extension")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"figure directory {str(path.parent)!r} does not exist")
    if fig.canvas is None or not isinstance(fig.canvas, FigureCanvasAgg):
        FigureCanvasAgg(fig)
    freeze_layout(fig)
    with style():
        extra = {"pil_kwargs": {"optimize": True}} if fmt == "png" else {}
        fig.savefig(path, format=fmt, dpi=PNG_DPI, metadata=METADATA[fmt], **extra)
    return path


def freeze_layout(fig: Figure, decimals: int = 4) -> None:
    """Run the figure's layout engine once, then fix every axes at its position rounded to ``decimals``
    of the figure size and turn the engine off.

    The constrained-layout solver can land 1e-6 apart from run to run (the order of its constraints
    follows object ids), which would change the coordinates written into SVG files; rounded frozen
    positions make every format byte-for-byte reproducible.
    """
    if not isinstance(fig.get_layout_engine(), ConstrainedLayoutEngine):
        return
    with style():
        fig.canvas.draw()
    fig.set_layout_engine("none")
    for ax in fig.axes:
        ax.set_position(np.round(ax.get_position(original=False).bounds, decimals), which="both")


def save_all(fig: Figure, out_dir, stem: str, formats=FORMATS) -> list[Path]:
    """Write ``fig`` as ``out_dir/stem.png``, ``.pdf`` and ``.svg``; returns the paths."""
    return [save(fig, Path(out_dir) / f"{stem}.{fmt}") for fmt in formats]


def output_dir(default="_output") -> Path:
    """Folder notebooks write figures to: ``$SPARSEATTN_FIGURES_DIR``, else ``default`` (created)."""
    out = Path(os.environ.get("SPARSEATTN_FIGURES_DIR") or default)
    out.mkdir(parents=True, exist_ok=True)
    return out


#: Inches of one bar and of the name above a group in :func:`grouped_barh` (size figures with
#: :func:`grouped_barh_height`).
BAR_INCH = 0.08
GROUP_NAME_INCH = 0.17


def grouped_barh_height(groups: int, bars: int) -> float:
    """Height in inches of the axes area that :func:`grouped_barh` needs for readable bars."""
    return groups * (bars * BAR_INCH + GROUP_NAME_INCH)


def grouped_barh(ax, groups: list[str], series: list[tuple[str, str, list]], notes=None):
    """Horizontal bars, one group per entry of ``groups`` (top to bottom) with its name written above
    its bars, so long names need no room beside the axis.

    ``series``: ``(legend label, colour, values)`` with one value per group (NaN = no bar), optionally
    followed by a hatch pattern (e.g. ``"///"``) for a variant of a series' colour.
    ``notes``: optional ``{(group index, series index): text}`` for a missing bar (e.g. "failed"),
    written after its group's name (a bar's slot is shorter than a line of text). Returns the bar
    centres, float ``[groups, series]``.
    """
    n, m = len(groups), max(len(series), 1)
    name_room = GROUP_NAME_INCH / (m * BAR_INCH + GROUP_NAME_INCH)
    bar_h = (1.0 - name_room - 0.04) / m
    top = -0.5 + name_room
    centres = np.arange(n, dtype=float)[:, None] + top + bar_h * (np.arange(m)[None, :] + 0.5)
    for s, (label, colour, values, *hatch) in enumerate(series):
        values = np.asarray(values, dtype=float)
        shown = np.isfinite(values)
        ax.barh(
            centres[shown, s],
            values[shown],
            bar_h * 0.9,
            label=label,
            color=colour,
            hatch=hatch[0] if hatch else None,
            edgecolor="white" if hatch else "none",
            linewidth=0,
        )
    names = ax.get_yaxis_transform()  # x in axes fraction, y in data
    for g, name in enumerate(groups):
        missing = [text for (gg, _), text in sorted((notes or {}).items()) if gg == g]
        ax.text(
            0.0,
            g - 0.5 + name_room / 2 + 0.02,
            name + (f" ({'; '.join(missing)})" if missing else ""),
            transform=names,
            ha="left",
            va="center",
            bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5},
        )
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_yticks([])
    ax.spines["left"].set_visible(False)
    ax.grid(axis="x")
    ax.set_axisbelow(True)
    return centres
