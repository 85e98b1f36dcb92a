"""Where the device planner's GPU time goes, launch by launch (NOTES_device_planner.md), on an H200:

    PYTHONPATH=src OUT=DIR python data/bench/experiments/device_planner_launches.py vsa_wan14b_720p vsa_wan14b_480p \
        [--items-blocks 2:per_block,4:per_block,4:coalesced,4]

For each workload (full heads, batch 1, the graph's selection as top-k indices on the GPU, as
``sparseattn bench --pass plan`` gives it): ten planning calls (forward + backward plans) under
torch.profiler after warm-up; the last call's launches in order, each with its start and end after the
call's first launch (which launches overlap, and which one ends the call), and each kernel's mean GPU time
per call, largest first. ``--items-blocks`` runs each workload once per variant ``BLOCKS[:WRITE]`` of ``plan_items``: blocks per SM
(the kernel compiled for it, ``sparseattn.kernels.planner.ITEMS_BLOCKS_PER_SM``) and the write pass's
stores (``auto``, ``coalesced`` or ``per_block``, ``planner.ITEMS_WRITE``). Writes DIR/launches.json.
"""

import json
import os
import sys
from collections import defaultdict

import cupy
import torch

from sparseattn import bench
from sparseattn.kernels import launch
from sparseattn.kernels import planner as planner_kernels
from sparseattn.planning.device import DevicePlanner

CALLS = 10


def profile(name: str) -> dict:
    graph, _ = bench.workload_graph(name)
    idx, num = bench.topk_selection(graph, 1)
    planner = DevicePlanner(graph.q, graph.k)
    with launch.torch_context():
        for _ in range(3):
            planner.plan(idx, num)
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        with launch.torch_context():
            for _ in range(CALLS):
                planner.plan(idx, num)
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name][0] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            per[e.name][1] += 1
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    last = sorted(kernels, key=lambda e: e.time_range.start)[-len(kernels) // CALLS :]
    t0 = last[0].time_range.start if last else 0
    sequence = [
        (e.name, e.time_range.elapsed_us(), e.time_range.start - t0, e.time_range.end - t0) for e in last
    ]
    print(f"{name}: the last call's launches in order (start and end, µs after the first launch's start)")
    for n, us, start, end in sequence:
        print(f"  {us:8.1f} us  [{start:7.1f}, {end:7.1f}]  {n[:80]}")
    rows = sorted(((n, t / CALLS, c / CALLS) for n, (t, c) in per.items()), key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    print(f"{name}: {total:.1f} us of GPU time per call in {sum(r[2] for r in rows):.0f} launches")
    for n, us, c in rows:
        print(f"  {us:8.1f} us  x{c:4.1f}  {n[:90]}")
    return {
        "workload": name,
        "gpu_us_per_call": total,
        "last_call": [dict(name=n, us=us, start_us=start, end_us=end) for n, us, start, end in sequence],
        "launches": [dict(name=n, us=us, per_call=c) for n, us, c in rows],
    }


def main() -> None:
    args = sys.argv[1:]
    variants = [f"{planner_kernels.ITEMS_BLOCKS_PER_SM}:{planner_kernels.ITEMS_WRITE}"]
    if "--items-blocks" in args:
        at = args.index("--items-blocks")
        variants = args[at + 1].split(",")
        del args[at : at + 2]
    names = args or ["vsa_wan14b_720p", "vsa_wan14b_480p"]
    out = []
    for variant in variants:
        blocks, _, write = variant.partition(":")
        planner_kernels.ITEMS_BLOCKS_PER_SM = int(blocks)
        planner_kernels.ITEMS_WRITE = write or "auto"
        print(f"== plan_items at {blocks} blocks per SM, {planner_kernels.ITEMS_WRITE} writes")
        out += [
            dict(profile(n), items_blocks_per_sm=int(blocks), items_write=planner_kernels.ITEMS_WRITE)
            for n in names
        ]
    path = os.path.join(os.environ.get("OUT", "."), "launches.json")
    with open(path, "w") as f:
        json.dump(
            {"gpu": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), "runs": out}, f, indent=1
        )


if __name__ == "__main__":
    main()
