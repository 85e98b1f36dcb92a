"""What the forward's pair instantiation costs on the same work, and what the packed route saves on it.

    PYTHONPATH=src python data/bench/experiments/pair_instantiation_cost.py OUT.json

On ``svg2_wan14b_720p`` (40 heads, batch 1, d = 128, random non-zero bf16 inputs), times in one process,
twice in a row, median of 10 calls each (CUDA events, no L2 flush):
* ``auto``: KPage's per-block work list (the default kernel instantiation);
* ``auto_vis``: the same list with every entry marked as seen by every slot (``VIS_SLOTS``): the same
  items, pages and output, run by the pair instantiation (``paged_fwd_kernel<128, 128, true>``);
* ``packed``: the packed route's list (:mod:`sparseattn.planning.packed_forward`), pair instantiation.
"""

import dataclasses
import json
import os
import subprocess
import sys
from datetime import datetime, timezone

import cupy
import numpy as np

from sparseattn.graph import HeadStack
from sparseattn.kernels.forward import paged_forward, work_of
from sparseattn.planning.work_list import VIS_SLOTS
from sparseattn.workloads import get_workload


def main(out: str) -> None:
    g = HeadStack.of(get_workload("svg2_wan14b_720p").build())
    auto, packed = work_of(g, "kpage", "auto"), work_of(g, "kpage", "packed")
    auto_vis = dataclasses.replace(
        auto, stream_mask=(auto.stream_mask | np.uint32(VIS_SLOTS)).astype(np.uint32)
    )
    h, d = g.heads, 128
    rng = np.random.default_rng(0)

    def bf16_bits(n):  # magnitudes 2^-7 .. 1, random signs
        bits = rng.integers(0x3C00, 0x3F80, (1, h, n, d)) | (rng.integers(0, 2, (1, h, n, d)) << 15)
        return cupy.asarray(bits.astype(np.uint16))

    q, k, v = bf16_bits(g.q_slots), bf16_bits(g.k_slots), bf16_bits(g.k_slots)
    times = {}
    for name, wl in (("auto", auto), ("auto_vis", auto_vis), ("packed", packed)) * 2:
        o, lse = paged_forward(q, k, v, wl)
        cupy.cuda.Device().synchronize()
        ts = []
        for _ in range(10):
            e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
            e0.record()
            paged_forward(q, k, v, wl, out=(o, lse))
            e1.record()
            e1.synchronize()
            ts.append(cupy.cuda.get_elapsed_time(e0, e1))
        times.setdefault(name, []).append(float(np.median(ts)))
        print(name, f"{times[name][-1]:.3f} ms", flush=True)
    commit = (
        os.environ.get("SPARSEATTN_COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], check=False, capture_output=True, text=True
        ).stdout.strip()
    )
    record = {
        "gpu": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
        "commit": commit,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "workload": "svg2_wan14b_720p",
        "times_ms": times,
    }
    with open(out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
