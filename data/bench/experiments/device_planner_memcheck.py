"""The device planner under compute-sanitizer (lab script; needs a GPU and CuPy):

    compute-sanitizer --tool memcheck --error-exitcode 9 python data/bench/experiments/device_planner_memcheck.py
    compute-sanitizer --tool racecheck --error-exitcode 9 python data/bench/experiments/device_planner_memcheck.py

Plans 24 random selections of ``tests/device_plan_cases.py`` (ragged and video layouts, every route, top-k
and masks, masks that outgrow a ``max_selected`` of 2 and are cut) with the forward's one pass and with its
three passes, and the top-k bitmap per row and by atomics, synchronising after each call.
"""

import os
import sys

import cupy
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests"))

from device_plan_cases import random_case

from sparseattn.kernels import planner as launchers
from sparseattn.planning.device import DevicePlanner


def main() -> int:
    rng = np.random.default_rng(9100)
    calls = 0
    for index in range(24):
        case = random_case(rng, index)
        if case.mask is not None:
            selection = {"mask": cupy.asarray(case.mask)}
        else:
            selection = {"q2k_idx": cupy.asarray(case.q2k_idx), "q2k_num": cupy.asarray(case.q2k_num)}
        cut = case.mask is not None and index % 2 == 1
        for fused, bitmap in ((True, "rows"), (False, "atomic")):
            launchers.FUSED_FORWARD, launchers.BITMAP_TOPK = fused, bitmap
            planner = DevicePlanner(
                case.q, case.k, kind=case.kind, route=case.route, max_selected=2 if cut else None
            )
            planner.plan(**selection)
            cupy.cuda.runtime.deviceSynchronize()
            calls += 1
    print(f"{calls} planning calls")
    return 0


if __name__ == "__main__":
    sys.exit(main())
