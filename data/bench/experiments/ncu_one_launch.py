"""One launch of KPage's forward (or cuDNN's dense SDPA) on a workload, for ncu (lab script, GPU).

Three warm-up calls, then one call between ``cudaProfilerStart`` / ``Stop``, so that
``ncu --profile-from-start off`` profiles exactly that launch.

.. code-block:: text

    ncu --clock-control none --profile-from-start off --set full -o kpage \\
        python data/bench/experiments/ncu_one_launch.py kpage dense_32768
    ncu ... python data/bench/experiments/ncu_one_launch.py cudnn dense_32768
"""

import sys

import cupy
import torch

from sparseattn import bench
from sparseattn.kernels import forward
from sparseattn.variant_ab import _cudnn_call


def main(which: str, workload: str) -> None:
    graph, d = bench.workload_graph(workload, None, seed=0)
    case = bench.Case(graph, d, 1, seed=1)
    if which == "kpage":

        def call():
            forward.paged_forward(case.q, case.k, case.v, graph, scale=case.scale)
    else:
        call = _cudnn_call(case)
    for _ in range(3):
        call()
    cupy.cuda.Device().synchronize()
    torch.cuda.synchronize()
    cupy.cuda.runtime.profilerStart()
    call()
    cupy.cuda.Device().synchronize()
    torch.cuda.synchronize()
    cupy.cuda.runtime.profilerStop()
    print("profiled", which, workload)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
