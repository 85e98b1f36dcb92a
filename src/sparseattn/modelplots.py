"""The whole-model figure: Wan step time and its attention part per implementation, from ONE recorded
``sparseattn bench model wan`` run (:mod:`sparseattn.model_bench`).

A run qualifies when it holds model-step records (``pass`` ``step_fwd`` or ``step_train`` with
``layers_full``, which only ``bench model`` writes). Bars: each implementation's step time divided by the
dense step's of the same model, resolution and pass (dense = 1); the hatched part of a bar is the step's
attention part (``attn_fwd`` / ``attn_train``); the number after a bar is the speedup of the whole step
over dense (dense's own bar carries its time).
"""

from __future__ import annotations

import math

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from . import figstyle
from .benchdata import BenchRun, is_usable

STEP_PASSES = ("step_fwd", "step_train")
ATTN_OF = {"step_fwd": "attn_fwd", "step_train": "attn_train"}
PANEL_TITLES = {
    "step_fwd": "Forward step (one denoising step)",
    "step_train": "Training step (forward + backward)",
}
#: Implementation order and legend names of the model bench.
IMPL_ORDER = (
    "dense",
    "dense_diffusers",
    "kpage_sta",
    "kpage_sta_tokens",
    "kpage_sta_slots",
    "kpage_sta_tiles",
    "flex_sta",
    "masked_sta",
    "kpage_vsa",
    "kpage_vsa_tokens",
    "kpage_vsa_slots",
    "kpage_vsa_tiles",
    "vsa_kernel",
    "kpage_svg2",
)
IMPL_LABELS = {
    "dense": "dense (cuDNN)",
    "dense_diffusers": "dense (diffusers)",
    "kpage_sta": "KPage STA",
    "kpage_sta_tokens": "KPage STA, token order",
    "kpage_sta_slots": "KPage STA, slot order",
    "kpage_sta_tiles": "KPage STA, tile-major tokens",
    "flex_sta": "FlexAttention STA",
    "masked_sta": "masked SDPA STA",
    "kpage_vsa": "KPage VSA",
    "kpage_vsa_tokens": "KPage VSA, token order",
    "kpage_vsa_slots": "KPage VSA, slot order",
    "kpage_vsa_tiles": "KPage VSA, tile-major tokens",
    "vsa_kernel": "VSA kernel",
    "kpage_svg2": "KPage SVG2",
}
IMPL_COLORS = {
    "dense": figstyle.OKABE_ITO["black"],
    "dense_diffusers": figstyle.OKABE_ITO["grey"],
    "kpage_sta": figstyle.OKABE_ITO["blue"],
    "kpage_sta_tokens": figstyle.OKABE_ITO["vermillion"],
    "kpage_sta_slots": figstyle.OKABE_ITO["vermillion"],
    "kpage_sta_tiles": figstyle.OKABE_ITO["vermillion"],
    "flex_sta": figstyle.OKABE_ITO["sky_blue"],
    "masked_sta": figstyle.OKABE_ITO["grey"],
    "kpage_vsa": figstyle.OKABE_ITO["reddish_purple"],
    "kpage_vsa_tokens": figstyle.OKABE_ITO["yellow"],
    "kpage_vsa_slots": figstyle.OKABE_ITO["yellow"],
    "kpage_vsa_tiles": figstyle.OKABE_ITO["yellow"],
    "vsa_kernel": figstyle.OKABE_ITO["bluish_green"],
    "kpage_svg2": figstyle.OKABE_ITO["orange"],
}
#: Height of one bar's slot (inches): room for an 8 pt number after each bar.
SLOT_INCH = 0.15  # a bar per implementation: room for its 8-pt speed-up label


def is_model_record(record: dict) -> bool:
    return record.get("pass") in STEP_PASSES + tuple(ATTN_OF.values()) and "layers_full" in record


def pick_model_run(runs) -> BenchRun | None:
    """Of the runs with usable model-step records of dense and of another implementation in the same
    pass, the widest (most usable (workload, impl, step pass) records: a focused later run of a few rows does not replace
    the whole comparison), the newest of equally wide ones (``runs`` newest first, as
    :func:`benchdata.find_runs` gives them); None if there is none."""
    best, best_width = None, 0
    for run in runs:
        usable = {
            (r["workload"], r["impl"], r["pass"]) for r in run.records if is_model_record(r) and is_usable(r)
        }
        pairs = {(i, p) for _, i, p in usable}
        if not any(
            ("dense", pass_) in pairs and any(p == pass_ and i != "dense" for i, p in pairs)
            for pass_ in STEP_PASSES
        ):
            continue
        width = sum(p in STEP_PASSES for _, _, p in usable)
        if width > best_width:
            best, best_width = run, width
    return best


def _workloads(records) -> list[str]:
    return list(dict.fromkeys(r["workload"] for r in records if is_model_record(r)))


def _impls(records) -> list[str]:
    found = {r["impl"] for r in records if is_model_record(r)}
    return [i for i in IMPL_ORDER if i in found] + sorted(found - set(IMPL_ORDER))


def _index(records) -> dict:
    return {(r["workload"], r["impl"], r["pass"]): r for r in records if is_model_record(r)}


def _group_label(records: list[dict], workload: str, pass_: str) -> str:
    rec = next(r for r in records if r["workload"] == workload)
    name = f"{rec.get('model', workload)} {rec.get('res', '')}".strip()
    layers, full = rec.get("layers"), rec.get("layers_full")
    if layers and full and layers != full:
        name += f", {layers} of {full} layers"
    ran = [r for r in records if r["workload"] == workload and r["pass"] == pass_ and "time_ms" in r]
    ckpt = [r["impl"] for r in ran if r.get("grad_checkpointing")]
    if pass_ == "step_train" and ckpt:
        name += ", checkpointed" if len(ckpt) == len(ran) else f", {', '.join(ckpt)} checkpointed"
    return name


def _time_text(ms: float) -> str:
    return f"{ms / 1e3:.2f} s" if ms >= 1e3 else f"{ms:.0f} ms"


def model_panel(records: list[dict], pass_: str):
    """(group labels, series, notes, attention values, bar texts) of one panel: per workload with a dense
    step, per implementation, its step ÷ dense step, its attention part ÷ dense step, the text after its bar;
    notes name failed, skipped or wrong records."""
    index = _index(records)
    impls = _impls(records)
    workloads = [w for w in _workloads(records) if is_usable(index.get((w, "dense", pass_), {}))]
    series, attention, texts, notes = [], [], [], {}
    for s, impl in enumerate(impls):
        values, parts, labels = [], [], []
        for g, w in enumerate(workloads):
            dense = index[(w, "dense", pass_)]["time_ms"]
            rec = index.get((w, impl, pass_))
            attn = index.get((w, impl, ATTN_OF[pass_]))
            if rec is not None and is_usable(rec):
                values.append(rec["time_ms"] / dense)
                parts.append(
                    attn["time_ms"] / dense if attn is not None and is_usable(attn) else float("nan")
                )
                labels.append(_time_text(dense) if impl == "dense" else f"{dense / rec['time_ms']:.2f}×")
                continue
            values.append(float("nan"))
            parts.append(float("nan"))
            labels.append("")
            if rec is not None:
                why = "skipped" if rec.get("skipped") else "failed" if rec.get("error") else "wrong result"
                if impl != "kpage_svg2" or not rec.get("skipped"):  # the SVG2 slot waits for its selection
                    notes[(g, s)] = f"{IMPL_LABELS.get(impl, impl)}: {why}"
        series.append(
            (IMPL_LABELS.get(impl, impl), IMPL_COLORS.get(impl, figstyle.OKABE_ITO["grey"]), values)
        )
        attention.append(parts)
        texts.append(labels)
    labels = [_group_label(records, w, pass_) for w in workloads]
    return labels, series, notes, attention, texts


def _source(run: BenchRun) -> str:
    recs = [r for r in run.records if is_model_record(r)]
    sta = next((r for r in recs if r.get("selection") == "sta" and r.get("tile")), None)
    vsa = next((r for r in recs if r.get("selection") == "vsa" and r.get("tile")), None)
    parts = [run.source(), "Random-init diffusers Wan transformers, bf16, batch 1, 81 frames."]
    if sta is not None:
        tile = "×".join(map(str, sta["tile"]))
        window = "×".join(map(str, sta.get("window") or ()))
        parts.append(
            f"STA: {tile} tiles ({sta.get('block_size', '')}-token blocks), window {window}, for every STA bar."
        )
    if vsa is not None:
        frac = vsa.get("topk_fraction")
        top = f"top {100 * frac:.0f}%" if frac else f"top {vsa.get('topk')}"
        parts.append(
            f"VSA: {top} of {'×'.join(map(str, vsa['tile']))} cubes, selected on the GPU every call."
        )
    parts.append("Attention part: CUDA events around every attention call, summed over the step.")
    return " ".join(parts)


def model_steps_figure(run: BenchRun, path=None) -> Figure:
    """Forward and training panels (those the run has): per model and resolution, each implementation's
    step time relative to dense, its attention part hatched, its speedup written after it."""
    panels = []
    for pass_ in STEP_PASSES:
        labels, series, notes, attention, texts = model_panel(list(run.records), pass_)
        keep = [i for i, (_, _, v) in enumerate(series) if any(math.isfinite(x) for x in v)]
        if not labels or not keep:
            continue
        # series without any bar in this panel are dropped, their notes renumbered
        renumber = {old: new for new, old in enumerate(keep)}
        notes = {(g, renumber[s]): t for (g, s), t in notes.items() if s in renumber}
        panels.append(
            (
                pass_,
                labels,
                [series[i] for i in keep],
                notes,
                [attention[i] for i in keep],
                [texts[i] for i in keep],
            )
        )
    with figstyle.style():
        heights = [len(p[1]) * (len(p[2]) * SLOT_INCH + figstyle.GROUP_NAME_INCH) + 0.45 for p in panels]
        impls_shown = list(dict.fromkeys(s[0] for p in panels for s in p[2]))
        legend_rows = -(-(len(impls_shown) + 1) // 2)
        fig = figstyle.sourced_figure(_source(run), height=sum(heights) + 0.16 * (legend_rows + 2) + 0.1)
        axes = fig.subplots(len(panels), 1, height_ratios=heights, squeeze=False)[:, 0]
        handles = {}
        for letter, ax, (pass_, labels, series, notes, attention, texts) in zip("ab", axes, panels):
            centres = figstyle.grouped_barh(ax, labels, series, notes)
            slot = centres[0, 1] - centres[0, 0] if centres.shape[1] > 1 else 0.5
            largest = max(v for _, _, vals in series for v in vals if math.isfinite(v))
            for s, (label, colour, values) in enumerate(series):
                for g, value in enumerate(values):
                    if not math.isfinite(value):
                        continue
                    part = attention[s][g]
                    if math.isfinite(part):
                        ax.barh(
                            centres[g, s],
                            part,
                            slot * 0.9,
                            color=colour,
                            hatch="////",
                            edgecolor="white",
                            linewidth=0,
                        )
                    ax.text(value + 0.02 * largest, centres[g, s], texts[s][g], va="center", ha="left")
            ax.axvline(1.0, color="black", lw=0.6, ls=":")
            ax.set_xlim(0, largest * 1.32)
            ax.set_xlabel("step time ÷ dense step time")
            figstyle.panel_title(ax, letter, PANEL_TITLES[pass_])
            for handle, label in zip(*ax.get_legend_handles_labels()):
                handles.setdefault(label, handle)
        handles["attention part (hatched)"] = Patch(
            facecolor=figstyle.OKABE_ITO["grey"], hatch="////", edgecolor="white", linewidth=0
        )
        fig.legend(
            list(handles.values()),
            list(handles),
            loc="outside upper left",
            ncols=2,
            title="Whole Wan step against dense (× = dense ÷ step)",
            alignment="left",
        )
    if path is not None:
        figstyle.save(fig, path)
    return fig
