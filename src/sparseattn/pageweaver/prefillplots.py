"""The whole-model prefill figure: tokens/s of a Llama-like prefill per backend and context, and the
attention part split into its parts, from the newest recorded ``sparseattn bench model prefill`` run
(:mod:`.prefill_bench`; the first runs, one file per context of the same commit, are read together)."""

from __future__ import annotations

import math

import numpy as np
from matplotlib.figure import Figure

from .. import figstyle
from ..benchdata import is_usable
from .prefill_bench import record_impl

IMPL_ORDER = ("sdpa_dense", "pageweaver_union", "flashinfer_e4m3", "flashinfer_bf16")
IMPL_LABELS = {
    "sdpa_dense": "dense SDPA",
    "pageweaver_union": "union, FP8",
    "flashinfer_e4m3": "FlashInfer, FP8",
    "flashinfer_bf16": "FlashInfer, bf16",
}
IMPL_COLORS = {
    "sdpa_dense": figstyle.OKABE_ITO["black"],
    "pageweaver_union": figstyle.OKABE_ITO["blue"],
    "flashinfer_e4m3": figstyle.OKABE_ITO["orange"],
    "flashinfer_bf16": figstyle.OKABE_ITO["yellow"],
}
SHORT_LABELS = {
    "pageweaver_union": "union",
    "flashinfer_e4m3": "FlashInfer FP8",
    "flashinfer_bf16": "FlashInfer bf16",
}
PART_LABELS = {
    "select": "selection",
    "cache": "cache",
    "group": "grouping",
    "plan": "FlashInfer plan",
    "kernel": "attention kernel",
    "attention": "not split",
}
PART_COLORS = {
    "select": figstyle.OKABE_ITO["sky_blue"],
    "cache": figstyle.OKABE_ITO["grey"],
    "group": figstyle.OKABE_ITO["reddish_purple"],
    "plan": figstyle.OKABE_ITO["vermillion"],
    "kernel": figstyle.OKABE_ITO["bluish_green"],
    "attention": figstyle.OKABE_ITO["grey"],
}


def prefill_records(runs) -> tuple[list[dict], list]:
    """``(records, runs used)``: the newest run (``runs`` newest first) with usable ``pageweaver_union``
    prefill records, merged with the other runs of its commit and command (one file per context)."""

    def has_union(run):
        return any(
            r.get("pass") == "prefill" and r.get("impl") == "pageweaver_union" and is_usable(r)
            for r in run.records
        )

    newest = next((run for run in runs if has_union(run)), None)
    if newest is None:
        return [], []
    stem = newest.command.split(" --")[0]
    used = [run for run in runs if run.commit == newest.commit and run.command.split(" --")[0] == stem]
    records = [r for run in used for r in run.records if r.get("pass") == "prefill"]
    return records, used


def _contexts(records) -> list[int]:
    return sorted({int(r["tokens"]) for r in records})


def prefill_figure(records: list[dict], source: str) -> Figure:
    """Panel a: tokens/s per context and backend (the union's gain over FlashInfer's FP8 path after its
    bar). Panel b: each sparse backend's attention part per prefill, stacked by part."""
    index = {(int(r["tokens"]), record_impl(r)): r for r in records if is_usable(r)}
    contexts = _contexts(records)
    impls = [i for i in IMPL_ORDER if any(k[1] == i for k in index)]
    sparse = [i for i in impls if i != "sdpa_dense"]
    groups = [f"{c // 1024}K tokens" for c in contexts]
    with figstyle.style():
        h_a = figstyle.grouped_barh_height(len(contexts), len(impls)) + 0.5
        h_b = 0.3 * len(contexts) * len(sparse) + 0.5
        fig = figstyle.sourced_figure(source, height=h_a + h_b + 0.9)
        ax_a, ax_b = fig.subplots(2, 1, height_ratios=[h_a, h_b])
        series = []
        for impl in impls:
            values = [
                index[(c, impl)]["tokens_per_s"] / 1e3 if (c, impl) in index else math.nan for c in contexts
            ]
            series.append(
                (IMPL_LABELS.get(impl, impl), IMPL_COLORS.get(impl, figstyle.OKABE_ITO["grey"]), values)
            )
        centres = figstyle.grouped_barh(ax_a, groups, series)
        largest = max((v for _, _, vals in series for v in vals if math.isfinite(v)), default=1.0)
        if "pageweaver_union" in impls and "flashinfer_e4m3" in impls:
            s = impls.index("pageweaver_union")
            for g, c in enumerate(contexts):
                u, f = index.get((c, "pageweaver_union")), index.get((c, "flashinfer_e4m3"))
                if u and f:
                    ax_a.text(
                        u["tokens_per_s"] / 1e3 + 0.01 * largest,
                        centres[g, s],
                        f"{u['tokens_per_s'] / f['tokens_per_s']:.2f}×",
                        va="center",
                        fontsize=figstyle.MIN_FONT_PT,
                    )
        ax_a.set_xlim(0, largest * 3.0)  # the legend (lower right) clear of the bars and their labels
        ax_a.set_xlabel("prefill throughput (thousand tokens/s)")
        ax_a.legend(loc="lower right", fontsize=figstyle.MIN_FONT_PT, frameon=False)
        figstyle.panel_title(ax_a, "a", "Whole prefill")

        bar_groups = [(c, impl) for c in contexts for impl in sparse]
        # each bar's parts (runs before the split: the whole attention part as one)
        bar_parts = []
        for key in bar_groups:
            rec = index.get(key, {})
            bar_parts.append(
                rec.get("parts_ms") or ({"attention": rec["attn_ms"]} if "attn_ms" in rec else {})
            )
        order = [p for p in PART_LABELS if any(p in parts for parts in bar_parts)]
        y = np.arange(len(bar_groups))[::-1].astype(float)
        left = np.zeros(len(bar_groups))
        for p in order:
            widths = np.array([parts.get(p, 0.0) for parts in bar_parts])
            ax_b.barh(y, widths, 0.7, left=left, color=PART_COLORS[p], label=PART_LABELS[p], linewidth=0)
            left += widths
        ax_b.set_yticks(
            y,
            [f"{c // 1024}K, {SHORT_LABELS.get(i, i)}" for c, i in bar_groups],
            fontsize=figstyle.MIN_FONT_PT,
        )
        ax_b.set_xlabel("attention part of a prefill (ms, all layers)")
        ax_b.set_xlim(0, max(float(left.max()), 1e-9) * 2.0)
        ax_b.legend(loc="lower right", fontsize=figstyle.MIN_FONT_PT, frameon=False)
        figstyle.panel_title(ax_b, "b", "Attention part, by part")
    return fig


def figure_from_runs(runs) -> Figure | None:
    """The figure of the newest recorded prefill run (:func:`prefill_records`); None without one."""
    records, used = prefill_records(runs)
    if not records:
        return None
    r = records[0]
    files = ", ".join(sorted(run.path.name for run in used))
    source = (
        f"Measured on {used[0].gpu}, {used[0].day}, commit {used[0].short_commit}; data: data/bench/{files}. "
        f"Llama-like model, random init, bf16, {r['layers']} layers, width {r['hidden']}, {r['heads']} query "
        f"heads on {r['kv_heads']} KV heads of {r['head_dim']}; batch 1; {r['sink']} sink + {r['local']} local "
        f"+ {r['top']} top pages of {r['page_size']} tokens per query, selected on the GPU every layer. "
        "× after a union bar: its throughput over FlashInfer's on the same FP8 cache."
    )
    return prefill_figure(records, source)
