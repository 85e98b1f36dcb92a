"""One launch of the forward's slot-order, token-order or Q/O token build on the same plan, for ncu (lab
script, GPU, torch).

The workload and token order as in ``token_order_ab.py``; three warm-up calls, then one call between
``cudaProfilerStart`` / ``Stop``, so that ``ncu --profile-from-start off`` profiles that launch alone
(tensors already in the order each build reads: no move is profiled).

.. code-block:: text

    ncu --clock-control none --profile-from-start off --set full -o tokens \\
        python data/bench/experiments/ncu_token_order.py tokens wan13b_sta_480p tiles
    ncu -i tokens.ncu-rep --page source --csv --print-source sass > tokens.csv

``summarize NAME=SOURCE.csv[.gz] ...`` (no GPU) reads such source pages and prints JSON per build: the
instructions executed by opcode, the cp.async copies (``LDGSTS``), the instructions between the first and
the last copy of the SASS (the producer's code) per copy, and the share of the stall samples at each
mbarrier wait (the try-wait and the two instructions after it) above 0.4%.
"""

import collections
import csv
import gzip
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import token_order_ab

from sparseattn.kernels.forward import torch_graph_forward, torch_token_forward


def main(build: str, workload: str, order: str) -> None:
    graph, head_dim = token_order_ab.workload_graph(workload, order)
    (q, k, v), (q_map, k_map), (qs, ks, vs) = token_order_ab.token_tensors(graph, head_dim)
    calls = {
        "slot": lambda: torch_graph_forward(qs, ks, vs, graph),
        "tokens": lambda: torch_token_forward(q, k, v, graph, q_map, k_map),
        "qo": lambda: torch_token_forward(q, ks, vs, graph, q_map, None, kv_in_slots=True),
        "tma": lambda: torch_token_forward(q, k, v, graph, q_map, k_map, kv_tma=True),
    }
    call = calls[build]
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled", build, workload, order)


def summarize_source(path: str) -> dict:
    """The summary above of one ncu source page (CSV, optionally gzipped)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as fh:
        rows = list(csv.reader(fh))
    header, lines = rows[1], rows[2:]
    src, samples, executed = (
        header.index(n) for n in ("Source", "Warp Stall Sampling (All Samples)", "Instructions Executed")
    )
    total = sum(int(r[samples]) for r in lines)
    by_op = collections.Counter()
    for r in lines:
        op = re.sub(r"^@!?U?P\w+\s+", "", r[src].strip()).split(" ")[0].split(".")[0]
        by_op[op] += int(r[executed])
    copies = [i for i, r in enumerate(lines) if "LDGSTS" in r[src]]
    producer = sum(int(r[executed]) for r in lines[copies[0] : copies[-1] + 1])
    waits = []
    for i, r in enumerate(lines):
        if "SYNCS.PHASECHK" in r[src]:
            share = sum(int(x[samples]) for x in lines[i : i + 3]) / total
            if share > 0.004:
                waits.append(dict(line=i, sass=r[src].strip(), executed=int(r[executed]), stall_share=share))
    return dict(
        instructions=sum(by_op.values()),
        samples=total,
        ldgsts=by_op["LDGSTS"],
        producer_instructions_per_copy=producer / by_op["LDGSTS"],
        by_opcode=dict(by_op.most_common(30)),
        barrier_waits=waits,
    )


if __name__ == "__main__":
    if sys.argv[1] == "summarize":
        print(
            json.dumps({a.split("=")[0]: summarize_source(a.split("=")[1]) for a in sys.argv[2:]}, indent=1)
        )
    else:
        main(*sys.argv[1:4])
