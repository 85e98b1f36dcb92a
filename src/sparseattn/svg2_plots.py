"""The SVG2 call figure: what clustering, selection and planning cost per call beside the KPage forward kernel,
from ONE recorded ``python -m sparseattn.svg2_step_bench`` run (:mod:`sparseattn.svg2_step_bench`).

Such a run is an object with ``gpu``, ``commit``, ``date``, ``command`` and ``records``, each record a
``part`` (``kmeans_q``, ``kmeans_k``, ``layouts_select``, ``plan_fwd``, ``kernel_fwd``, ...) of one
k-means method (``assign``) with its ``time_ms``. One bar per method, its parts stacked; the tick on each
bar is 10% of the same method's kernel time (the target), the text after it the total and its share of
the kernel.
"""

from __future__ import annotations

import math

from matplotlib.figure import Figure

from . import figstyle
from .benchdata import BenchRun, find_runs, newest_first
from .svg2_step_bench import IN_ORDER_OF, unhidden_ms

#: The parts that make a call's overhead, in the order they run, with their legend names and colours.
OVERHEAD_PARTS = (
    ("kmeans_q", "k-means of Q", figstyle.OKABE_ITO["sky_blue"]),
    ("kmeans_k", "k-means of K", figstyle.OKABE_ITO["blue"]),
    ("layouts_select", "layouts, selection", figstyle.OKABE_ITO["orange"]),
    ("plan_fwd", "forward plan", figstyle.OKABE_ITO["reddish_purple"]),
    ("beside_unhidden", "left exposed", figstyle.OKABE_ITO["vermillion"]),
)
#: Parts a method may lack (counted 0): only the beside methods have the part v's move did not hide.
OPTIONAL_PARTS = ("beside_unhidden",)
CAPTION = (
    "Each part between CUDA events, median of the run's calls; after a bar: its total and its share of the "
    "same method's KPage forward kernel; black tick: 10% of that kernel's time (the target); ▶: bar cut at the "
    "axis' end; left exposed: what of the parts run beside the moves to slots (the selection and plan "
    "beside v's; K's layout beside q's, from v47 on) the moves did not hide (that method's moves less the "
    "in-order method's of the same run)."
)
#: The share of the KPage forward kernel's time the overhead should stay within.
TARGET_SHARE = 0.10
METHOD_LABELS = {
    "torch": "torch distances",
    "fused": "Triton assignment",
    "fused_last_step": "Triton, last step labels only",
    "wgmma_last_step": "wgmma, last step labels only",
    "wgmma_last_step_queued": "wgmma, host ahead of the GPU",
    "wgmma_in_slots_queued": "wgmma, host ahead, sums in the move",
    "wgmma_in_slots_queued_clusters": "the same work, in order",
    "wgmma_in_slots_queued_clusters_beside": "processor's order (beside v's move)",
}
#: Methods whose overhead passes this share of their kernel's time (torch's is ~3×) do not set the axis' end.
CUT_SHARE = 0.5


#: What every record of a ``svg2_step_bench`` run holds (in place of :data:`~sparseattn.benchdata.RECORD_FIELDS`).
STEP_RECORD_FIELDS = ("part", "assign")


def find_step_runs(bench_dir=None) -> list[BenchRun]:
    """Every ``svg2_step_bench`` run in ``bench_dir`` (default ``data/bench``), newest first."""
    return [run for run in find_runs(bench_dir, STEP_RECORD_FIELDS) if run.records]


def method_parts(run: BenchRun) -> dict[str, dict[str, float]]:
    """``{method: {part: ms}}`` of the methods with every overhead part and the kernel timed, in run order."""
    found: dict[str, dict[str, float]] = {}
    for r in run.records:
        t = r.get("time_ms")
        if isinstance(t, (int, float)) and math.isfinite(t) and t > 0 and not r.get("error"):
            found.setdefault(r["assign"], {})[r["part"]] = float(t)
    for method in IN_ORDER_OF:
        unhidden = unhidden_ms(found, method)
        if method in found and unhidden is not None:
            found[method]["beside_unhidden"] = max(0.0, unhidden)
    need = [p for p, *_ in OVERHEAD_PARTS if p not in OPTIONAL_PARTS] + ["kernel_fwd"]
    complete = {m: parts for m, parts in found.items() if all(p in parts for p in need)}
    return {m: parts for m, parts in complete.items() if m not in IN_ORDER_OF or "beside_unhidden" in parts}


def pick_step_run(runs) -> BenchRun | None:
    """The newest run with a complete method (:func:`method_parts`); None if none has one."""
    return next((run for run in newest_first(runs) if method_parts(run)), None)


def _workload_text(run: BenchRun) -> str:
    rec = next((r for r in run.records if "heads" in r and "tokens" in r), None)
    if rec is None:
        return ""
    return (
        f"{figstyle.workload_label(rec.get('workload', ''))}: {rec['heads']} heads × {rec['tokens']:,} tokens, "
        f"Q {rec.get('q_clusters', '?')} / K {rec.get('k_clusters', '?')} clusters, "
        f"{rec.get('iters', '?')} Lloyd steps per call."
    )


def svg2_call_parts_figure(run: BenchRun) -> Figure:
    """One bar per k-means method of ``run``: its call's overhead parts stacked (ms), a tick at 10% of its
    KPage forward kernel's time, its total and share of the kernel after it."""
    methods = method_parts(run)
    if not methods:
        raise ValueError(f"{run.path}: no method with every overhead part and the kernel timed")
    totals = {m: sum(parts.get(p, 0.0) for p, *_ in OVERHEAD_PARTS) for m, parts in methods.items()}
    targets = {m: TARGET_SHARE * parts["kernel_fwd"] for m, parts in methods.items()}
    # the axis ends past the bars within half their kernel's time; longer ones (torch's) are cut
    short = [t for m, t in totals.items() if t <= CUT_SHARE * methods[m]["kernel_fwd"]] or list(
        totals.values()
    )
    limit = max(max(short), max(targets.values())) * 1.6
    source = " ".join(
        [
            run.source(),
            _workload_text(run),
            CAPTION,
        ]
    )
    names = list(methods)
    fig = figstyle.sourced_figure(source, height=1.3 + 0.36 * len(names))  # the legend and axis above one bar
    ax = fig.add_subplot()
    y = [i + 0.12 for i in range(len(names))]  # each bar under its name
    left = [0.0] * len(names)
    for part, label, colour in OVERHEAD_PARTS:
        widths = [methods[m].get(part, 0.0) for m in names]
        ax.barh(y, widths, 0.5, left=left, label=label, color=colour, linewidth=0)
        left = [a + b for a, b in zip(left, widths)]
    for i, m in enumerate(names):
        ax.plot([targets[m]] * 2, [y[i] - 0.3, y[i] + 0.3], color="black", linewidth=1.2)
        share = totals[m] / methods[m]["kernel_fwd"]
        cut = totals[m] > limit
        text = f"{'▶ ' if cut else ''}{totals[m]:.2f} ms, {share:.1%}"
        ax.text(
            min(totals[m], limit) + limit * 0.01 * (not cut),
            y[i],
            text,
            va="center",
            ha="right" if cut else "left",
            color="white" if cut else "black",
        )
        ax.text(0, i - 0.3, METHOD_LABELS.get(m, m), va="center", ha="left")
    ax.set_yticks([])
    ax.spines["left"].set_visible(False)
    ax.set_ylim(len(names) - 0.45, -0.55)
    ax.set_xlim(0, limit)
    ax.set_xlabel("ms per call")
    ax.grid(axis="x")
    ax.set_axisbelow(True)
    fig.legend(loc="outside upper center", ncols=2, frameon=False)
    return fig
