"""What the forward's pair instantiation costs on the same work, and what plain items and packing save.

    PYTHONPATH=src python data/bench/experiments/pair_instantiation_cost.py OUT.json [WORKLOAD ...]

Per workload (default ``svg2_wan14b_720p``; batch 1, d = 128, random non-zero bf16 inputs), lists timed in
one process, twice in a row, median of 10 calls each (CUDA events, no L2 flush):
* ``auto``: KPage's per-block work list (the default kernel instantiation);
* ``auto_vis``: the same list with every entry marked as seen by every slot (``VIS_SLOTS``): the same
  items, pages and output, every item decoded per chunk by the pair instantiation;
* ``packed``: the packed route's list (:mod:`sparseattn.planning.packed_forward`), its items without
  visibility bits marked plain (``PLAIN_ITEM``: not decoded); ``packed_decoded``: the same list with no
  item marked (as before plain items);
* ``pair`` / ``pair_decoded``: the pair route's list (:mod:`sparseattn.planning.pair_forward`), likewise.
"""

import dataclasses
import json
import os
import subprocess
import sys
from datetime import datetime, timezone

import cupy
import numpy as np

from sparseattn.graph import HeadStack, SparseGraph
from sparseattn.kernels.forward import paged_forward, work_of
from sparseattn.planning.work_list import VIS_SLOTS, WorkList
from sparseattn.workloads import get_workload


class _Decoded(WorkList):
    """A work list handed to the kernel without plain-item marks: every item decoded per chunk."""

    def device_arrays(self):
        arrays = super().device_arrays()
        arrays["work_info"] = np.ascontiguousarray(self.work_info, dtype=np.int32)
        return arrays


def _decoded(wl: WorkList) -> WorkList:
    return _Decoded(**{f.name: getattr(wl, f.name) for f in dataclasses.fields(wl)})


def lists_of(graph) -> dict[str, WorkList]:
    auto = work_of(graph, "kpage", "auto")
    marked = (auto.stream_mask | np.uint32(VIS_SLOTS)).astype(np.uint32)
    lists = {"auto": auto, "auto_vis": dataclasses.replace(auto, stream_mask=marked)}
    for route in ("packed", "pair"):
        wl = work_of(graph, "kpage", route)
        if wl.has_visibility():
            if wl is not auto:  # (VSA's "auto" is the pair route)
                lists[route] = wl
            lists[f"{route}_decoded"] = _decoded(wl)
    return lists


def time_lists(graph, lists: dict[str, WorkList], rng) -> dict[str, list[float]]:
    h, d = graph.heads, 128

    def bf16_bits(n):  # magnitudes 2^-7 .. 1, random signs
        bits = rng.integers(0x3C00, 0x3F80, (1, h, n, d)) | (rng.integers(0, 2, (1, h, n, d)) << 15)
        return cupy.asarray(bits.astype(np.uint16))

    q_slots = graph.q_slots if isinstance(graph, HeadStack) else graph.q.num_slots
    k_slots = graph.k_slots if isinstance(graph, HeadStack) else graph.k.num_slots
    q, k, v = bf16_bits(q_slots), bf16_bits(k_slots), bf16_bits(k_slots)
    times: dict[str, list[float]] = {}
    outputs = {}
    for name, wl in list(lists.items()) * 2:
        o, lse = paged_forward(q, k, v, wl)
        cupy.cuda.Device().synchronize()
        base = name.split("_")[0]  # the same items: the output bit for bit that list's
        if base != name and base in outputs and not bool(cupy.array_equal(o, outputs[base])):
            print(f"  {name}: output differs from {base}'s", flush=True)
        outputs.setdefault(name, o.copy())
        ts = []
        for _ in range(10):
            e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
            e0.record()
            paged_forward(q, k, v, wl, out=(o, lse))
            e1.record()
            e1.synchronize()
            ts.append(cupy.cuda.get_elapsed_time(e0, e1))
        times.setdefault(name, []).append(float(np.median(ts)))
        print(f"  {name}: {times[name][-1]:.3f} ms", flush=True)
    return times


def main(out: str, workloads: list[str]) -> None:
    rng = np.random.default_rng(0)
    results = {}
    for name in workloads:
        built = get_workload(name).build()
        graph = HeadStack.of(built) if isinstance(built, list) else built
        assert isinstance(graph, (SparseGraph, HeadStack))
        print(name, flush=True)
        results[name] = time_lists(graph, lists_of(graph), rng)
    commit = os.environ.get("SPARSEATTN_COMMIT") or (
        subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], check=False, capture_output=True, text=True
        ).stdout.strip()
    )
    record = {
        "gpu": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
        "commit": commit,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "times_ms": results,
    }
    with open(out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or ["svg2_wan14b_720p"])
