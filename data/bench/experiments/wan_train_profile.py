"""Where a Wan training step's attention time goes: the GPU kernels of one step, by name, per impl.

A Wan2.1-1.3B-shaped transformer (random init, bf16) with ``--layers`` blocks at 480p (or 720p) runs
``--warmup`` training steps (forward and backward of a squared-error loss, no optimizer), then one step under
``torch.profiler``; the same step's attention part (:class:`sparseattn.model_bench.AttentionClock`: the
processors' calls and their backward) is printed beside the kernels' totals, so the kernels that make up
the attention part can be read off. ``--impl`` as in :mod:`sparseattn.wan_bench` (kpage_vsa, vsa_kernel).

    python data/bench/experiments/wan_train_profile.py --impl kpage_vsa --impl vsa_kernel --out prof.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys

#: Kernels whose launches mark an impl's attention backward (the timeline is printed around the first).
BACKWARD_KERNELS = ("paged_bwd", "_attn_bwd_dkdv")


def timeline(prof, around: int) -> list[dict]:
    """The GPU kernels (and copies) of the profiled step in start order, ``around`` of them before and after
    the first attention-backward kernel: name, start (µs after the first listed one's), duration and the GPU
    idle time before it."""
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    events.sort(key=lambda e: e.time_range.start)
    at = next((i for i, e in enumerate(events) if any(k in e.name for k in BACKWARD_KERNELS)), None)
    if at is None:
        return []
    window = events[max(at - around, 0) : at + around + 1]
    t0, out, end = window[0].time_range.start, [], None
    for e in window:
        start, stop = e.time_range.start, e.time_range.end
        gap = 0.0 if end is None else max(0.0, start - end)
        out.append(
            dict(
                name=e.name[:90],
                start_us=round(start - t0, 1),
                us=round(stop - start, 1),
                idle_before_us=round(gap, 1),
            )
        )
        end = stop if end is None else max(end, stop)
    return out


def profile_impl(impl: str, layers: int, resolution: str, warmup: int, top: int, around: int = 0) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from sparseattn.model_bench import MODELS, AttentionClock, build_model, make_inputs, token_grid
    from sparseattn.wan_bench import LATENTS, processors

    spec = MODELS["1.3b"]
    model = build_model(spec, layers, "cuda", torch.bfloat16)
    x, t, text = make_inputs(spec, LATENTS[resolution], "cuda", torch.bfloat16)
    grid = token_grid(LATENTS[resolution])
    processor = processors(grid, impl)
    clock = AttentionClock()
    processor.attend = clock.wrap(processor.attend)
    for block in model.blocks:
        block.attn1.set_processor(processor)
    model.train(True)

    def step():
        model.zero_grad(set_to_none=True)
        out = model(x, t, text, return_dict=False)[0]
        out.float().square().mean().backward()

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    clock.reset()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    attention_ms = clock.total_ms()
    kernels = []
    for ev in prof.key_averages():
        cuda_us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if cuda_us <= 0:
            continue
        kernels.append(dict(name=ev.key[:160], calls=int(ev.count), total_us=round(float(cuda_us), 1)))
    kernels.sort(key=lambda k: -k["total_us"])
    total_us = sum(k["total_us"] for k in kernels)
    torch.cuda.empty_cache()
    return dict(
        impl=impl,
        layers=layers,
        resolution=resolution,
        tokens=math.prod(grid),
        attn_train_ms=round(attention_ms, 3),
        attn_train_ms_per_layer=round(attention_ms / layers, 3),
        gpu_total_ms=round(total_us / 1e3, 3),
        kernels=kernels[: max(top, 1)],
        timeline=timeline(prof, around) if around else [],
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", action="append", help="kpage_vsa (default), vsa_kernel, kpage_vsa_tokens")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--resolution", default="480p", choices=("480p", "720p"))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--top", type=int, default=40, help="kernels kept per impl, by total time")
    parser.add_argument(
        "--around",
        type=int,
        default=0,
        help="print this many kernels before and after the first attention backward",
    )
    parser.add_argument("--out", help="JSON of the kernels' totals per impl")
    args = parser.parse_args(argv)
    results = []
    for impl in args.impl or ["kpage_vsa"]:
        r = profile_impl(impl, args.layers, args.resolution, args.warmup, args.top, args.around)
        results.append(r)
        print(
            f"== {impl}: {r['layers']} layers, {r['resolution']}; attention part {r['attn_train_ms']:.2f} ms "
            f"({r['attn_train_ms_per_layer']:.2f} per layer); all kernels {r['gpu_total_ms']:.2f} ms"
        )
        for k in r["kernels"]:
            print(f"{k['total_us'] / 1e3:9.3f} ms  {k['calls']:5d}  {k['name']}")
        if r["timeline"]:
            idle = sum(t["idle_before_us"] for t in r["timeline"][1:])
            print(f"-- {impl}: timeline around the first attention backward (idle in it {idle:.1f} us)")
            for t in r["timeline"]:
                print(f"{t['start_us']:10.1f} {t['us']:9.1f} idle {t['idle_before_us']:7.1f}  {t['name']}")
        sys.stdout.flush()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(command=" ".join(sys.argv), results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
