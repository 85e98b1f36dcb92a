"""Speed figures from recorded benchmark runs (:mod:`sparseattn.benchdata`): KPage speedups per workload
and PageWeaver complete-call speedups per capture.

Each figure draws the numbers of ONE run and says in the figure what that run lacks: while no KPage
records exist it shows the baselines' useful TFLOP/s, and while no PageWeaver complete-call records
exist it says so in place of the bars.
"""

from __future__ import annotations

import math

from matplotlib.figure import Figure

from . import figstyle
from .benchdata import BenchRun, is_usable, pick_run, useful_tflops

#: KPage speedups are taken over these baselines (when the run has them).
KPAGE_BASELINES = ("bsa", "flex", "vsa_kernel")
#: Implementations drawn as useful TFLOP/s while a run has no KPage records.
RATE_IMPLS = ("bsa", "bsa_mma", "bsa_wgmma", "flex", "vsa_kernel")
KPAGE_PASSES = ("fwd", "bwd", "fwdbwd")
#: KPage's bars: its default routes, then (hatched, where the run has them) its forced pair route.
PAIR_SERIES = ("kpage", "kpage_pair")
#: PageWeaver complete-call speedups: the union kernels over the per-query paths.
PW_UNIONS = ("pageweaver_union", "kv_page_union")
PW_BASELINES = ("flashinfer", "per_query")
#: The records whose fastest per capture and GQA is the ``flashinfer`` baseline: FlashInfer with the e4m3
#: cache and with a bf16 cache, on every backend a run tried (``backend``).
FLASHINFER_PATHS = ("flashinfer", "flashinfer_bf16")
GROUPING_LABELS = {"adjacent8": "adjacent 8", "affinity": "affinity"}
PW_PASS = "complete_call"
#: The legend's geometric means take these GQA group sizes when the run records them (the measure the
#: speed target is stated in); G = 16 bars are drawn but not averaged.
PW_GEOMEAN_GQA = (1, 4, 8)
#: The PageWeaver paper's Union8 complete-call speedup over FlashInfer, geometric mean of six H200 captures.
PAPER_PW_SPEEDUP = 1.70


def pick_kpage_run(runs) -> BenchRun | None:
    """The newest run with KPage forward and forward+backward records and a baseline; else the newest run
    with KPage and a baseline; else the newest run with any baseline (no KPage yet). Among runs of the
    chosen run's commit that qualify alike, the one with KPage records on the most workloads (a shorter
    repeat of a few workloads does not replace the full run)."""
    both = [r for r in runs if all(r.has("kpage", (p,)) for p in ("fwd", "fwdbwd"))]
    for pool, kwargs in (
        (both, dict(all_of=("kpage",), any_of=KPAGE_BASELINES)),
        (runs, dict(all_of=("kpage",), any_of=KPAGE_BASELINES)),
        (runs, dict(any_of=RATE_IMPLS)),
    ):
        run = pick_run(pool, passes=KPAGE_PASSES, **kwargs)
        if run is not None:
            alike = [
                r for r in pool if r.commit == run.commit and pick_run([r], passes=KPAGE_PASSES, **kwargs)
            ]
            return max(alike, key=lambda r: (len(_kpage_workloads(r)), r is run))
    return None


def _kpage_workloads(run: BenchRun) -> set[str]:
    """Workloads with a usable record of KPage (or, without KPage, of any rate baseline) in any pass."""
    impls = ("kpage",) if run.has("kpage") else RATE_IMPLS
    return {w for i in impls for p in KPAGE_PASSES for w in run.usable(i, p)}


def pick_pageweaver_run(runs) -> BenchRun | None:
    """The newest run with complete-call records of the PageWeaver union and FlashInfer, else None."""
    return pick_run(runs, all_of=("pageweaver_union", "flashinfer"), passes=(PW_PASS,))


def kpage_speedups(run: BenchRun) -> list[dict]:
    """One row per (workload, pass, baseline) where both KPage and the baseline have usable records:
    ``speedup`` = baseline time ÷ KPage time."""
    rows = []
    for pass_ in KPAGE_PASSES:
        kpage = run.usable("kpage", pass_)
        for base in KPAGE_BASELINES:
            other = run.usable(base, pass_)
            for w in run.workloads():
                if w in kpage and w in other:
                    rows.append(
                        {
                            "workload": w,
                            "pass": pass_,
                            "baseline": base,
                            "kpage_ms": kpage[w]["time_ms"],
                            "baseline_ms": other[w]["time_ms"],
                            "speedup": other[w]["time_ms"] / kpage[w]["time_ms"],
                        }
                    )
    return rows


def _impls_in(run: BenchRun, impls, pass_: str) -> list[str]:
    return [i for i in impls if any(r["impl"] == i and r["pass"] == pass_ for r in run.records)]


def _missing_note(run: BenchRun, wanted) -> str:
    absent = [figstyle.impl_label(i) for i in wanted if not run.has(i)]
    return f"Not in this run: {', '.join(absent)}." if absent else ""


def _panel_values(run: BenchRun, workloads, impl: str, pass_: str, value):
    """(values per workload, notes) of one bar series; ``value(record)`` gives a bar's length.
    NaN where there is no usable record, and a note where the record failed."""
    ok, bad = run.usable(impl, pass_), run.failed(impl, pass_)
    values, notes = [], {}
    for g, w in enumerate(workloads):
        values.append(value(ok[w]) if w in ok else float("nan"))
        if w in bad:
            notes[g] = "failed" if bad[w].get("error") else "wrong result"
    return values, notes


def kpage_speed_figure(run: BenchRun | None, path=None) -> Figure:
    """KPage forward, backward and forward+backward speedups (one panel per pass the run has) over BSA,
    FlexAttention and the VSA kernel per workload, from one run, with KPage's forced pair route hatched
    where the run has it; a run without KPage records shows the baselines' useful TFLOP/s instead and
    says that KPage is missing."""
    if run is None:
        return _empty_figure("KPage speed", "No recorded benchmark run in data/bench.", path)
    has_kpage = run.has("kpage", KPAGE_PASSES)
    impls = KPAGE_BASELINES if has_kpage else RATE_IMPLS
    if has_kpage:
        workloads = [w for w in run.workloads() if any(w in run.usable("kpage", p) for p in KPAGE_PASSES)]
        headline = "KPage speedup over each baseline (time ÷ KPage time)"
        missing = _missing_note(run, KPAGE_BASELINES)
    else:
        workloads = [
            w
            for w in run.workloads()
            if any(w in run.usable(i, p) or w in run.failed(i, p) for i in impls for p in KPAGE_PASSES)
        ]
        headline = (
            "No KPage records yet: the bars show the baselines' useful TFLOP/s; KPage's speedups "
            "over BSA, FlexAttention and the VSA kernel replace them once KPage is benchmarked."
        )
        missing = _missing_note(run, ("kpage", "flex", "vsa_kernel"))
    workloads = figstyle.canonical_order(workloads)
    panels = [(p, _impls_in(run, impls, p)) for p in KPAGE_PASSES]
    panels = [(p, *_kpage_panel_series(run, workloads, p, found, has_kpage)) for p, found in panels if found]
    source = " ".join(s for s in (run.source(), missing) if s)
    with figstyle.style():
        head_lines = figstyle.wrap_source(headline)
        heights = [figstyle.grouped_barh_height(len(workloads), len(s)) + 0.5 for _, s, _ in panels]
        legend_rows = -(-len({x[0] for _, s, _ in panels for x in s}) // 2)
        fig = figstyle.sourced_figure(
            source, height=sum(heights) + 0.15 * (len(head_lines) + legend_rows) + 0.1
        )
        axes = fig.subplots(len(panels), 1, height_ratios=heights, squeeze=False)[:, 0]
        labels = [figstyle.workload_label(w) for w in workloads]
        legend = {}
        for letter, ax, (pass_, series, notes) in zip("abcd", axes, panels):
            figstyle.grouped_barh(ax, labels, series, notes)
            if has_kpage:
                ax.axvline(1.0, color="black", lw=0.8, ls="--")
                ax.set_xlabel("speedup of KPage (×); 1 = baseline speed")
                finite = [v for x in series for v in x[2] if math.isfinite(v)]
                ax.set_xlim(0, max([1.2, *finite]) * 1.15)
            else:
                ax.set_xlabel("useful TFLOP/s")
            figstyle.panel_title(ax, letter, figstyle.PASS_LABELS[pass_].capitalize())
            for handle, label in zip(*ax.get_legend_handles_labels()):
                legend.setdefault(label, handle)
        # the headline (what the bars are, what is missing) heads the legend, above the panels
        fig.legend(
            list(legend.values()),
            list(legend),
            loc="outside upper left",
            ncols=2,
            title="\n".join(head_lines),
            alignment="left",
        )
    return _write(fig, path)


def _kpage_panel_series(run: BenchRun, workloads, pass_: str, impls, has_kpage: bool):
    """(series, notes) of one pass's panel for :func:`figstyle.grouped_barh`: KPage's speedup over each
    baseline in ``impls`` (its pair route hatched, where the run has it), or the baselines' useful
    TFLOP/s when the run has no KPage."""
    series, notes = [], {}
    for kpage_impl in PAIR_SERIES if has_kpage else ("kpage",):
        kp = run.usable(kpage_impl, pass_)
        if kpage_impl != "kpage" and not kp:
            continue

        def speedup(r, kp=kp):
            k = kp.get(r["workload"])
            return r["time_ms"] / k["time_ms"] if k else float("nan")

        for impl in impls:
            values, impl_notes = _panel_values(
                run, workloads, impl, pass_, speedup if has_kpage else useful_tflops
            )
            label = f"vs {figstyle.impl_label(impl)}" if has_kpage else figstyle.impl_label(impl)
            colour = figstyle.COLORS.get(impl, figstyle.OKABE_ITO["grey"])
            if kpage_impl != "kpage":  # the forced pair route: hatched, where it ran
                if any(math.isfinite(v) for v in values):
                    series.append((f"pair route {label}", colour, values, "///"))
                continue
            series.append((label, colour, values))
            notes.update(
                {
                    (g, len(series) - 1): f"{figstyle.impl_label(impl)}: {text}"
                    for g, text in impl_notes.items()
                }
            )
    return series, notes


def _geomean(values) -> float:
    values = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def pageweaver_speedups(run: BenchRun) -> list[dict]:
    """One row per (capture, heads, union impl and grouping, baseline): complete-call ``speedup`` =
    baseline ÷ union time; the FlashInfer baseline is its fastest recorded path (``flashinfer`` e4m3 or
    ``flashinfer_bf16``, any backend; ``baseline_path`` says which). A union recorded with several groupings (``grouping``: fixed adjacent groups,
    online affinity search) gives one row per grouping."""

    def records(impl):
        return [r for r in run.records if r["impl"] == impl and r["pass"] == PW_PASS and is_usable(r)]

    def baselines(base):
        """(capture, heads) -> the baseline's record: for FlashInfer the fastest of its paths and backends."""
        out = {}
        for impl in FLASHINFER_PATHS if base == "flashinfer" else (base,):
            for r in records(impl):
                key = (r["workload"], r.get("heads"))
                if key not in out or r["time_ms"] < out[key]["time_ms"]:
                    out[key] = r
        return out

    rows = []
    for union in PW_UNIONS:
        for base in PW_BASELINES:
            b = baselines(base)
            for u in records(union):
                key = (u["workload"], u.get("heads"))
                if key in b:
                    rows.append(
                        {
                            "capture": key[0],
                            "heads": key[1],
                            "gqa": u.get("gqa"),
                            "impl": union,
                            "grouping": u.get("grouping"),
                            "baseline": base,
                            "baseline_path": f"{b[key]['impl']} ({b[key].get('backend', 'fa2')})",
                            "speedup": b[key]["time_ms"] / u["time_ms"],
                        }
                    )
    return rows


def pageweaver_speed_figure(run: BenchRun | None, path=None) -> Figure:
    """Complete-call speedups (grouping included) of the union kernels over FlashInfer and the per-query
    path, per capture, beside the paper's 1.70× geometric mean; says so plainly when no run has them."""
    rows = pageweaver_speedups(run) if run is not None else []
    if not rows:
        text = (
            "No recorded complete-call benchmark yet. This panel fills in from a data/bench/*.json run "
            "with records of impl 'pageweaver_union' and 'flashinfer', pass 'complete_call'. "
            f"Paper: {PAPER_PW_SPEEDUP:.2f}× geometric mean over FlashInfer on six H200 captures."
        )
        return _empty_figure("PageWeaver complete-call speedup", text, path)
    if any(r["baseline"] == "flashinfer" for r in rows):  # the paper's baseline; per-query ratios: the JSON
        rows = [r for r in rows if r["baseline"] == "flashinfer"]
    multi_heads = len({r["heads"] for r in rows}) > 1
    keys = list(dict.fromkeys((r["capture"], r["heads"]) for r in rows))
    gqa = {(r["capture"], r["heads"]): r.get("gqa") for r in rows}
    pairs = list(dict.fromkeys((r["impl"], r["grouping"], r["baseline"]) for r in rows))
    value = {(r["capture"], r["heads"], r["impl"], r["grouping"], r["baseline"]): r["speedup"] for r in rows}

    def key_label(c, h):
        if not multi_heads:
            return figstyle.capture_label(c)
        g = gqa[(c, h)]
        return figstyle.capture_label(c) + (f" · GQA {g} ({h} heads)" if g else f" · {h} heads")

    labels = [key_label(c, h) for c, h in keys]
    colours = {
        ("pageweaver_union", "flashinfer"): figstyle.OKABE_ITO["blue"],
        ("pageweaver_union", "per_query"): figstyle.OKABE_ITO["sky_blue"],
        ("kv_page_union", "flashinfer"): figstyle.OKABE_ITO["bluish_green"],
        ("kv_page_union", "per_query"): figstyle.OKABE_ITO["yellow"],
    }
    second = {
        "pageweaver_union": figstyle.OKABE_ITO["orange"],
        "kv_page_union": figstyle.OKABE_ITO["reddish_purple"],
    }
    series = []
    seen = set()
    bases = list(dict.fromkeys(base for _, _, base in pairs))
    averaged = [i for i, k in enumerate(keys) if gqa[k] in PW_GEOMEAN_GQA]
    if averaged and len(averaged) < len(keys):
        over = "GQA " + "/".join(str(g) for g in PW_GEOMEAN_GQA if any(gqa[k] == g for k in keys))
        geo_label = f"geomean, {over}"
    else:
        averaged, geo_label = list(range(len(keys))), "geomean"
    for impl, grouping, base in pairs:
        vals = [value.get((c, h, impl, grouping, base), float("nan")) for c, h in keys]
        geo = _geomean([vals[i] for i in averaged])
        colour = colours.get((impl, base), figstyle.OKABE_ITO["grey"])
        if (impl, base) in seen:
            colour = second.get(impl, figstyle.OKABE_ITO["grey"])
        seen.add((impl, base))
        name = figstyle.impl_label(impl) + (
            f" ({GROUPING_LABELS.get(grouping, grouping)})" if grouping else ""
        )
        if len(bases) > 1:
            name += f" vs {figstyle.impl_label(base)}"
        series.append((f"{name}:\n{geo:.2f}× {geo_label}", colour, vals))
    missing = _missing_note(run, PW_UNIONS + PW_BASELINES)
    source = " ".join(s for s in (run.source(), "Complete call = grouping + attention.", missing) if s)
    with figstyle.style():
        height = figstyle.grouped_barh_height(len(keys), len(series)) + 0.9 + 0.18 * len(series)
        fig = figstyle.sourced_figure(source, height=height)
        ax = fig.add_subplot()
        figstyle.grouped_barh(ax, labels, series)
        ax.axvline(1.0, color="black", lw=0.8)
        ax.axvline(
            PAPER_PW_SPEEDUP,
            color=figstyle.OKABE_ITO["vermillion"],
            lw=1.0,
            ls="--",
            label=f"paper: {PAPER_PW_SPEEDUP:.2f}× geomean vs FlashInfer",
        )
        finite = [v for _, _, vals in series for v in vals if math.isfinite(v)]
        ax.set_xlim(0, max([PAPER_PW_SPEEDUP, *finite]) * 1.15)
        over = figstyle.impl_label(bases[0]) if len(bases) == 1 else "the baseline"
        if bases == ["flashinfer"] and any(r["baseline_path"].startswith("flashinfer_bf16") for r in rows):
            over += "'s fastest path"  # the baseline per capture: the fastest recorded FlashInfer path
        ax.set_xlabel(f"complete-call speedup over {over} (×)")
        fig.legend(*ax.get_legend_handles_labels(), loc="outside upper left", ncols=1)
    return _write(fig, path)


def _empty_figure(title: str, text: str, path) -> Figure:
    with figstyle.style():
        fig = figstyle.figure(height=1.5)
        ax = fig.add_subplot()
        figstyle.note(ax, "\n".join(figstyle.wrap_source(text, figstyle.ONE_COLUMN * 0.95)))
        ax.set_title(title)
    return _write(fig, path)


def _write(fig: Figure, path) -> Figure:
    if path is not None:
        figstyle.save(fig, path)
    return fig


def variant_ratio_figure(records: list[dict], path=None) -> Figure:
    """The paired time ratios of ``sparseattn bench variants`` records: one row per workload, one marker per
    forward (or, for ``bwd`` records, backward) build (the median over rounds of its time over the baseline
    build's in the same round, the interquartile range as a bar); left of 1 is faster than the baseline.
    cuDNN's records are left out (on a sparse workload its ratio is off the scale)."""
    rows = [r for r in records if r.get("impl") == "kpage" and r.get("paired_ratio") is not None]
    if not rows:
        return _empty_figure(
            "Forward builds, paired time ratio", "no kpage records with a paired ratio", path
        )
    backward = rows[0].get("pass") == "bwd"
    key = "bwd_variant" if backward else "fwd_variant"
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    builds = list(dict.fromkeys(r[key] for r in rows))
    baseline = rows[0].get("baseline", builds[0])
    palette = [c for name, c in figstyle.OKABE_ITO.items() if name not in ("grey",)]
    with figstyle.style():
        fig = figstyle.figure(
            width=figstyle.TWO_COLUMN,
            height=1.6 + 0.3 * len(workloads) * max(1.0, len(builds) / 3) + 0.12 * len(builds),
        )
        ax = fig.add_subplot()
        step = 0.8 / max(1, len(builds))
        for b, build in enumerate(builds):
            ys, xs, lo, hi = [], [], [], []
            for w, workload in enumerate(workloads):
                rec = next((r for r in rows if r["workload"] == workload and r[key] == build), None)
                if rec is None:
                    continue
                q1, q3 = rec.get("paired_ratio_iqr") or (rec["paired_ratio"],) * 2
                ys.append(w - 0.4 + step * (b + 0.5))
                xs.append(rec["paired_ratio"])
                lo.append(rec["paired_ratio"] - q1)
                hi.append(q3 - rec["paired_ratio"])
            color = palette[b % len(palette)]
            label = " + ".join(
                part.removeprefix("PAGED_FWD_").removeprefix("PAGED_BWD_") for part in build.split(",")
            )
            ax.errorbar(xs, ys, xerr=[lo, hi], fmt="o", ms=3.5, color=color, elinewidth=1.0, label=label)
        ax.axvline(1.0, color=figstyle.OKABE_ITO["grey"], lw=0.8, zorder=0)
        ax.set_yticks(range(len(workloads)), [figstyle.workload_label(w) for w in workloads])
        ax.invert_yaxis()
        ax.set_xlabel(f"time ÷ {baseline}'s in the same round (median over rounds; bar: quartiles)")
        ax.set_title(f"KPage {'backward' if backward else 'forward'} builds alternated in one process")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, fontsize="small", frameon=False)
    return _write(fig, path)
