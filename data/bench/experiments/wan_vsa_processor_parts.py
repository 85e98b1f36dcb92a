"""Where one Wan VSA processor call spends its GPU time (lab script; needs a GPU, torch, fastvideo-kernel).

One self-attention call of a Wan2.1-1.3B-shaped layer (12 heads of 128, bf16, batch 1) at 480p and 720p
(81 frames), VSA top 10% of the 4x4x4 cubes selected on the GPU, split into the processor's steps, each
timed alone with CUDA events (median of ``--reps`` after a warm-up; inputs of 100-230 MB each, above L2):

* ``to_slots``: q, k, v to the layout's slot order (one fused launch);
* ``cube_sums``: the per-cube sums of q and k (``vsa_topk``'s first half), ``scores_topk`` the rest;
* ``vsa_topk``: the whole selection;
* ``kpage_plan_attn``: ``block_sparse_attention`` (the device planner and the KPage forward);
* ``vsa_attn``: the VSA system's kernel (``block_sparse_attn_from_indices``) on the same selection;
* ``to_tokens``: the output back to token order;
* ``kpage_call`` / ``vsa_call``: the whole processor call (what the model bench's attention part sums);
* the token-order forward (no moves into or out of slot order): ``vsa_topk_tokens`` (the selection from
  token-ordered q, k), ``kpage_token_plan_attn`` (planning and the token-order build) and
  ``kpage_tokens_call`` (the whole call of a processor with ``token_order=True``).

Also a torch.profiler table of one whole KPage call per resolution (the kernels behind each step), and
with ``--train`` one per path of five forward + backward calls.
With ``--train``, the backward of each differentiable step too, timed alone after its forward (events
around ``backward`` only): ``to_slots_bwd`` (the gradients back to token order), ``kpage_attn_bwd`` /
``vsa_attn_bwd`` (the attention's backward on the same selection), ``to_tokens_bwd``, and the whole
call's forward + backward (``kpage_train_call`` / ``vsa_train_call``).

    python data/bench/experiments/wan_vsa_processor_parts.py --out parts.json [--train] [--plot parts.png]
    python data/bench/experiments/wan_vsa_processor_parts.py --from-json parts.json --plot parts.png  # no GPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys


def timed(fn, reps: int, warmup: int = 3) -> float:
    """Median ms of ``fn()`` between CUDA events (the project's :func:`~sparseattn.pageweaver.gpu_bench.time_device`)."""
    from sparseattn.pageweaver.gpu_bench import time_device

    return time_device(fn, reps=reps, warmup=warmup)


def timed_backward(forward, reps: int, warmup: int = 2) -> float:
    """Median ms of ``torch.autograd.backward(out, grad)`` alone, for ``(out, grad) = forward()`` run before
    each timing (``out``, ``grad``: tensors or sequences of them)."""
    import torch

    times = []
    for rep in range(warmup + reps):
        out, grad = forward()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.autograd.backward(out, grad)
        end.record()
        end.synchronize()
        if rep >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def train_parts(proc, vsa_proc, q, k, v, idx, num, reps: int) -> dict:
    """The backward of each differentiable step of a processor call (see the module docstring)."""
    import torch

    from sparseattn.torch import block_sparse_attention, slots_to_tokens, tokens_to_slots

    layout, planner = proc._handles("dynamic")
    leaves = lambda *xs: [x.detach().clone().requires_grad_() for x in xs]
    g = torch.Generator(device="cuda").manual_seed(1)
    grad_tokens = torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=g)
    qs, ks, vs = (x.detach() for x in tokens_to_slots(layout, q, k, v))
    grad_slots = torch.randn(qs.shape, device="cuda", dtype=qs.dtype, generator=g)

    def to_slots():
        return list(tokens_to_slots(layout, *leaves(q, k, v))), [grad_slots] * 3

    def kpage_attn():
        o, _ = block_sparse_attention(*leaves(qs, ks, vs), planner, idx, num)
        return o, grad_slots

    def to_tokens():
        return slots_to_tokens(layout, *leaves(qs)), grad_tokens

    def call(p):
        return lambda: (p.attend(*leaves(q, k, v)), grad_tokens)

    steps = {"to_slots_bwd": to_slots, "kpage_attn_bwd": kpage_attn, "to_tokens_bwd": to_tokens}
    if vsa_proc is not None:
        from fastvideo_kernel.block_sparse_attn import block_sparse_attn_from_indices

        sizes = torch.tensor(proc.layout.valid_rows.astype("int32"), device="cuda")

        def vsa_attn():
            o, _ = block_sparse_attn_from_indices(*leaves(qs, ks, vs), idx, num, sizes)
            return o, grad_slots

        steps["vsa_attn_bwd"] = vsa_attn
    out = {name: round(timed_backward(fn, reps), 4) for name, fn in steps.items()}
    for name, p in (("kpage", proc), ("vsa", vsa_proc)):
        if p is not None:
            out[f"{name}_train_call"] = round(timed(lambda p=p: call(p)()[0].backward(grad_tokens), reps), 4)
    return out


def parts(resolution: str, reps: int, profile: bool, train: bool = False) -> dict:
    import torch

    from sparseattn.diffusers_wan import WanSelection, WanSparseAttnProcessor
    from sparseattn.torch import (
        block_sparse_attention,
        slots_to_tokens,
        token_order_attention,
        tokens_to_slots,
        vsa_topk,
        vsa_topk_tokens,
    )
    from sparseattn.wan_bench import LATENTS, TOPK_FRACTION

    frames, height, width = LATENTS[resolution]
    grid = (frames, height // 2, width // 2)
    blocks = math.prod(-(-g // 4) for g in grid)
    selection = WanSelection.vsa((4, 4, 4), topk=math.ceil(TOPK_FRACTION * blocks))
    proc = WanSparseAttnProcessor(grid, selection, backend="kpage", token_order=False)
    proc_tokens = WanSparseAttnProcessor(grid, selection, backend="kpage", token_order=True)
    layout, planner = proc._handles("dynamic")
    lay = proc.layout
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (1, math.prod(grid), 12, 128)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    out: dict = dict(resolution=resolution, tokens=shape[1], heads=12, blocks=blocks, topk=selection.topk)
    with torch.no_grad():
        qs, ks, vs = tokens_to_slots(layout, q, k, v)
        idx, num = vsa_topk(qs, ks, layout, selection.topk)
        attn, _ = block_sparse_attention(qs, ks, vs, planner, idx, num)
        b, h, _, d = qs.shape
        nb, bs = lay.num_blocks, lay.block_size

        def cube_sums():
            qs.reshape(b, h, nb, bs, d).sum(3, dtype=torch.float32)
            ks.reshape(b, h, nb, bs, d).sum(3, dtype=torch.float32)

        qm = qs.reshape(b, h, nb, bs, d).sum(3, dtype=torch.float32)
        km = ks.reshape(b, h, nb, bs, d).sum(3, dtype=torch.float32)

        def scores_topk():
            s = qm @ km.transpose(-1, -2)
            s.topk(selection.topk, dim=-1)

        steps = {
            "to_slots": lambda: tokens_to_slots(layout, q, k, v),
            "cube_sums": cube_sums,
            "scores_topk": scores_topk,
            "vsa_topk": lambda: vsa_topk(qs, ks, layout, selection.topk),
            "kpage_plan_attn": lambda: block_sparse_attention(qs, ks, vs, planner, idx, num),
            "to_tokens": lambda: slots_to_tokens(layout, attn),
            "kpage_call": lambda: proc.attend(q, k, v),
            # the token-order forward: no moves into or out of slot order
            "vsa_topk_tokens": lambda: vsa_topk_tokens(q, k, layout, selection.topk),
            "kpage_token_plan_attn": lambda: token_order_attention(q, k, v, proc.planner(), idx, num),
            "kpage_tokens_call": lambda: proc_tokens.attend(q, k, v),
        }
        vsa_proc = None
        try:
            os.environ.setdefault("FASTVIDEO_VSA_TRITON", "1")
            from fastvideo_kernel.block_sparse_attn import block_sparse_attn_from_indices

            from sparseattn.wan_bench import processors

            sizes = torch.tensor(lay.valid_rows.astype("int32"), device="cuda")
            vsa_proc = processors(grid, "vsa_kernel")
            steps["vsa_attn"] = lambda: block_sparse_attn_from_indices(qs, ks, vs, idx, num, sizes)
            steps["vsa_call"] = lambda: vsa_proc.attend(q, k, v)
        except ImportError as exc:
            out["vsa_error"] = str(exc)
        out["ms"] = {name: round(timed(fn, reps), 4) for name, fn in steps.items()}
    if train:
        out["train_ms"] = train_parts(proc, vsa_proc, q, k, v, idx, num, reps)
    with torch.no_grad():
        if profile:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    proc.attend(q, k, v)
                torch.cuda.synchronize()
            out["profile"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    if train and profile:
        out["train_profile"] = train_profiles(proc, vsa_proc, q, k, v)
    return out


def train_profiles(proc, vsa_proc, q, k, v) -> dict:
    """A torch.profiler table (CUDA kernels) of five forward + backward calls per path."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    tables = {}
    grad = torch.randn_like(q)
    for name, p in (("kpage", proc), ("vsa", vsa_proc)):
        if p is None:
            continue
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        p.attend(*leaves).backward(grad)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                p.attend(*leaves).backward(grad)
            torch.cuda.synchronize()
        tables[name] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
    return tables


#: The parts of each path's call as stacked bars: (label, the KPage path's step, the VSA kernel path's).
#: (None: the path has no such step.)
BAR_PARTS = (
    ("tokens to slots", "to_slots", "to_slots", None),
    ("selection", "vsa_topk", "vsa_topk", "vsa_topk_tokens"),
    ("attention (KPage: with planning)", "kpage_plan_attn", "vsa_attn", "kpage_token_plan_attn"),
    ("back to tokens", "to_tokens", "to_tokens", None),
)
PATHS = (
    ("KPage", "kpage_call", 1),
    ("VSA kernel", "vsa_call", 2),
    ("KPage, token order", "kpage_tokens_call", 3),
)


def plot(results: list[dict], path: str, source: str) -> None:
    """Per resolution, a processor call's parts stacked for the KPage path and the VSA kernel's path, each
    step timed alone; a bar marks the whole call timed as one (host and GPU work overlap across its steps,
    so it can be shorter than the sum)."""
    from sparseattn import figstyle

    with figstyle.style():
        fig = figstyle.sourced_figure(source, width=figstyle.TWO_COLUMN, height=2.8)
        axes = fig.subplots(1, len(results), squeeze=False)[0]
        colors = ("#9ecae1", "#fdae6b", "#3182bd", "#c6dbef")
        for ax, res in zip(axes, results):
            ms = res["ms"]
            paths = [p for p in PATHS if p[1] in ms]  # (runs before the token-order path have two)
            for x, (_, call, column) in enumerate(paths):
                bottom = 0.0
                for part, color in zip(BAR_PARTS, colors):
                    value = 0.0 if part[column] is None else ms.get(part[column], float("nan"))
                    ax.bar(x, value, bottom=bottom, color=color, width=0.6, label=part[0] if x == 0 else None)
                    bottom += value
                whole = ms.get(call, float("nan"))
                ax.plot(
                    x, whole, marker="_", markersize=18, color="black", label="whole call" if x == 0 else None
                )
            ax.set_xticks(range(len(paths)), [name for name, _, _ in paths])
            ax.set_title(
                f"{res['resolution']}: {res['heads']} heads, top {res['topk']} of {res['blocks']} cubes"
            )
        axes[0].set_ylabel("ms per call")
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside right center", fontsize="small")
        fig.savefig(path, metadata=figstyle.METADATA.get(path.rsplit(".", 1)[-1]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--resolution", action="append", choices=("480p", "720p"))
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--train", action="store_true", help="also the backward of each step")
    parser.add_argument("--out")
    parser.add_argument("--from-json", help="draw a recorded run (no GPU)")
    parser.add_argument("--plot", help="PNG of the parts per call (see plot())")
    args = parser.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            recorded = json.load(f)
        plot(recorded["results"], args.plot, f"{args.from_json}: {recorded['command']}")
        return 0
    results = [
        parts(r, args.reps, not args.no_profile, args.train) for r in args.resolution or ("480p", "720p")
    ]
    for res in results:
        print(f"== {res['resolution']}: {res['tokens']} tokens, {res['blocks']} cubes, top {res['topk']}")
        print(res.get("profile", ""))
        for name, table in res.get("train_profile", {}).items():
            print(f"-- {name}: five forward + backward calls")
            print(table)
    for res in results:
        print(res["resolution"], "  ".join(f"{k} {v:.3f}" for k, v in res["ms"].items()))
        if "train_ms" in res:
            print(res["resolution"], "  ".join(f"{k} {v:.3f}" for k, v in res["train_ms"].items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(command=" ".join(sys.argv), results=results), f, indent=1)
    if args.plot:
        plot(results, args.plot, " ".join(sys.argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
