"""``sparseattn figures``: regenerate every committed figure from code and ``data/`` on a CPU.

GPU numbers come only from the recorded benchmark runs in ``data/bench/``; everything else is
recomputed (capacity analysis of the built-in workloads, PageWeaver analysis of the built-in captures).
Files are written reproducibly (:mod:`sparseattn.figstyle`), so regenerating the committed figures
leaves a git checkout clean. A figure whose data does not exist yet is skipped with a message.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from matplotlib.figure import Figure

from . import figstyle

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "figures"
SEED = 0
#: The workload whose block fill is drawn (VSA's partial 3D cubes, the paper's main case).
BLOCK_FILL_WORKLOAD = "vsa_wan14b_720p"
NBSP = "\u00a0"


class Inputs:
    """The data behind the figures, each computed once and only when a figure asks for it."""

    def __init__(self, bench_dir=None):
        self.bench_dir = bench_dir

    @cached_property
    def reports(self) -> list:
        from .analysis import analyze_workloads
        from .workloads import WORKLOADS

        return analyze_workloads(list(WORKLOADS.values()), seed=SEED)

    @cached_property
    def capture_rows(self) -> list[dict]:
        from .pageweaver.analysis import analyze_captures

        return analyze_captures(None)

    @cached_property
    def union_samples(self) -> list[dict]:
        from .pageweaver.plots import union_size_samples

        return union_size_samples()

    @cached_property
    def runs(self) -> list:
        from .benchdata import find_runs

        return find_runs(self.bench_dir)


def _giga(pairs: int) -> str:
    return f"{pairs / 1e9:.1f}G"


def capacity_figure(inputs: Inputs) -> Figure:
    from .analysis import total_record
    from .plots import capacity_bar_chart

    total = total_record(inputs.reports)
    source = (
        f"Counted by sparseattn analyze; VSA, SSTA and SVG2 select from seeded synthetic Q/K "
        f"(seed{NBSP}{SEED}). Total:{NBSP}{_giga(total['bsa_physical'])}{NBSP}(BSA){NBSP}→"
        f"{NBSP}{_giga(total['kpage_physical'])}{NBSP}(KPage) physical for "
        f"{_giga(total['useful_pairs'])}{NBSP}useful."
    )
    return capacity_bar_chart([r.record() for r in inputs.reports], source=source)


def block_fill_figure(inputs: Inputs) -> Figure:
    from .plots import block_fill_histogram

    report = next(r for r in inputs.reports if r.workload == BLOCK_FILL_WORKLOAD)
    source = f"{report.description}; synthetic selection, seed{NBSP}{SEED}."
    return block_fill_histogram(report.fill, title=figstyle.workload_label(report.workload), source=source)


def kpage_speed_figure(inputs: Inputs) -> Figure | None:
    from .speedplots import kpage_speed_figure as draw
    from .speedplots import pick_kpage_run

    run = pick_kpage_run(inputs.runs)
    return None if run is None else draw(run)


def page_loads_figure(inputs: Inputs) -> Figure:
    from .pageweaver.plots import page_loads_figure as draw

    return draw(
        inputs.capture_rows,
        source="Built-in seeded selection captures (data/captures), one KV head group, one attention call.",
    )


def union_sizes_figure(inputs: Inputs) -> Figure:
    from .pageweaver.plots import union_size_figure

    return union_size_figure(
        inputs.union_samples,
        source="Box: quartiles; whiskers: 5th–95th percentile; "
        "line: median; dot: mean. Built-in seeded captures (data/captures).",
    )


def pageweaver_speed_figure(inputs: Inputs) -> Figure | None:
    from .speedplots import pageweaver_speed_figure as draw
    from .speedplots import pick_pageweaver_run

    run = pick_pageweaver_run(inputs.runs)
    return None if run is None else draw(run)


def model_steps_figure(inputs: Inputs) -> Figure | None:
    from .modelplots import model_steps_figure as draw
    from .modelplots import pick_model_run

    run = pick_model_run(inputs.runs)
    return None if run is None else draw(run)


def svg2_call_figure(inputs: Inputs) -> Figure | None:
    from .svg2_plots import find_step_runs, pick_step_run, svg2_call_parts_figure

    run = pick_step_run(find_step_runs(inputs.bench_dir))
    return None if run is None else svg2_call_parts_figure(run)


def prefill_figure(inputs: Inputs) -> Figure | None:
    from .pageweaver.prefillplots import figure_from_runs

    return figure_from_runs(inputs.runs)


@dataclass(frozen=True)
class FigureSpec:
    """One figure of ``figures/``: file stem, what it shows, how it is drawn (None = no data yet)."""

    stem: str
    what: str
    draw: Callable[[Inputs], Figure | None]
    missing: str = ""


FIGURES = (
    FigureSpec(
        "kpage_capacity",
        "useful vs BSA vs KPage physical QK pairs of the built-in workloads",
        capacity_figure,
    ),
    FigureSpec("kpage_block_fill", f"block fill of {BLOCK_FILL_WORKLOAD}", block_fill_figure),
    FigureSpec(
        "kpage_speed",
        "KPage speedups (or the baselines' rates) from the newest recorded H200 run",
        kpage_speed_figure,
        missing="no benchmark run in data/bench",
    ),
    FigureSpec(
        "pageweaver_page_loads",
        "page loads per query: per-query vs adjacent vs affinity groups",
        page_loads_figure,
    ),
    FigureSpec(
        "pageweaver_union_sizes",
        "union-size distributions of adjacent vs affinity groups",
        union_sizes_figure,
    ),
    FigureSpec(
        "pageweaver_speed",
        "PageWeaver complete-call speedups from a recorded run",
        pageweaver_speed_figure,
        missing="no recorded complete-call benchmark yet "
        "(impl pageweaver_union and flashinfer, pass complete_call)",
    ),
    FigureSpec(
        "model_wan_steps",
        "whole Wan steps (forward, training) and their attention part per implementation",
        model_steps_figure,
        missing="no recorded `sparseattn bench model wan` run in data/bench yet",
    ),
    FigureSpec(
        "svg2_call_parts",
        "an SVG2 call's clustering, selection and planning per k-means method, against its KPage kernel",
        svg2_call_figure,
        missing="no recorded `python -m sparseattn.svg2_step_bench` run in data/bench yet",
    ),
    FigureSpec(
        "llama_prefill",
        "a Llama-like prefill with PageWeaver's union, FlashInfer and dense attention; the attention's parts",
        prefill_figure,
        missing="no recorded `sparseattn bench model prefill` run in data/bench yet",
    ),
)
FIGURE_NAMES = tuple(spec.stem for spec in FIGURES)


def regenerate(
    out_dir=None, only=None, bench_dir=None, formats=figstyle.FORMATS, log=None, inputs: Inputs | None = None
) -> list[Path]:
    """Draw the figures (all, or the stems in ``only``) into ``out_dir`` (default ``figures/``, created if
    missing) as PNG, PDF and SVG; returns the written paths. ``log(message)`` reports each figure or skip."""
    out = Path(out_dir) if out_dir is not None else DEFAULT_OUT
    if not out.parent.is_dir():
        raise FileNotFoundError(f"the folder holding {str(out)!r} does not exist")
    unknown = [name for name in (only or ()) if name not in FIGURE_NAMES]
    if unknown:
        raise ValueError(f"unknown figure {unknown[0]!r}; figures: {', '.join(FIGURE_NAMES)}")
    out.mkdir(exist_ok=True)
    inputs = inputs if inputs is not None else Inputs(bench_dir)
    written = []
    for spec in FIGURES:
        if only and spec.stem not in only:
            continue
        fig = spec.draw(inputs)
        if fig is None:
            if log:
                log(f"skipped {spec.stem}: {spec.missing}")
            continue
        paths = figstyle.save_all(fig, out, spec.stem, formats)
        written.extend(paths)
        if log:
            log(f"wrote {', '.join(str(p) for p in paths)}")
    return written
