"""The forward's token-order build against the slot-order build on the same plans (lab script, GPU, torch).

Per built-in workload (one batch entry, its heads, bf16 q, k, v in the workload's token order), in one
process, alternated in rotated rounds (CUDA events, the bench's L2 flush, median of ``--reps`` per round,
paired ratio to ``slot`` in the same round):

- ``slot``: the slot-order build on tensors already in slot order (what ``sparseattn bench`` times);
- ``tokens``: the token-order build on the token-ordered tensors (``torch_token_forward``);
- ``slot_moved``: tokens to slots, the slot-order build, the output back to tokens (what a model's call did);
- ``qo``: the Q/O token build on token-ordered q and slot-ordered k, v (the kernel alone);
- ``qo_moved``: k and v to slots (one launch), then the Q/O token build (what a model's call does with it);
- with ``--device`` also ``slot_device`` / ``tokens_device``: the same on the device planner's plans of the
  graph's selection (planning not timed);
- with ``--order tiles`` also ``tma`` (and ``tma_device``): the tile-major token build, k and v read
  token-major page by page by the tensor-memory accelerator, nothing moved.

``--order tiles`` relabels the tokens: token ``i`` is the layout's ``i``-th valid slot (tile-major, no
padding: the order a model that keeps its tokens tile-major would hand in), so each 16-row page of a
token-ordered tensor is 16 consecutive tokens, ``heads · d`` elements apart. ``wan13b_sta_480p`` is the
Wan2.1-1.3B model's STA call at 480p (12 heads, grid 21 × 30 × 52, 4 × 4 × 8 tiles, 3 × 3 × 3 window).

Before timing, every token-order output is compared with the slot-order output moved to tokens (bit for
bit) and the LSEs with each other.

    PYTHONPATH=src python data/bench/experiments/token_order_ab.py --workload vsa_wan14b_480p --device --out ab.json
"""

from __future__ import annotations

import argparse
import json
import sys

WORKLOADS = ("vsa_wan14b_480p", "vsa_wan14b_720p", "ssta_hy15_720p", "sta_wan14b_69f", "wan13b_sta_480p")


def workload_graph(name: str, order: str):
    """(graph, head_dim) of ``name``, its tokens in ``order`` (``raster``: as built; ``tiles``: see above)."""
    from sparseattn import bench
    from sparseattn.diffusers_wan import WanSelection

    if name == "wan13b_sta_480p":
        graph = WanSelection.sta(tile=(4, 4, 8), window=(3, 3, 3)).graph((21, 30, 52), 12)
        head_dim = 128
    else:
        graph, head_dim = bench.workload_graph(name, None, seed=0)
    return (graph.tile_major_tokens() if order == "tiles" else graph), head_dim


def token_tensors(graph, head_dim: int):
    """``((q, k, v), (q_map, k_map), (qs, ks, vs))``: seeded bf16 CUDA tensors of one batch entry in token
    order, the layouts' slot -> token maps, and the tensors moved to slot order."""
    import torch

    import sparseattn.torch as st
    from sparseattn.torch_ops import _slot_indices

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    shape = lambda lay: (1, lay.num_tokens, graph.heads, head_dim)
    q = torch.randn(shape(graph.q), device=dev, generator=g).bfloat16()
    k, v = (torch.randn(shape(graph.k), device=dev, generator=g).bfloat16() for _ in range(2))
    maps = _slot_indices(graph.q, dev)[0], _slot_indices(graph.k, dev)[0]
    slots = (st.tokens_to_slots(graph.q, q)[0], *st.tokens_to_slots(graph.k, k, v))
    return (q, k, v), maps, slots


def run_workload(name: str, rounds: int, reps: int, device: bool, order: str = "raster") -> dict:
    import torch

    import sparseattn.torch as st
    from sparseattn import bench
    from sparseattn.kernels.forward import torch_graph_forward, torch_token_forward
    from sparseattn.planning.device import DevicePlanner
    from sparseattn.variant_ab import rotation, summarize

    graph, head_dim = workload_graph(name, order)
    dev = torch.device("cuda")
    (q, k, v), (q_map, k_map), (qs, ks, vs) = token_tensors(graph, head_dim)

    runs = {
        "slot": lambda: torch_graph_forward(qs, ks, vs, graph),
        "tokens": lambda: torch_token_forward(q, k, v, graph, q_map, k_map),
        "slot_moved": lambda: st.slots_to_tokens(
            graph.q,
            torch_graph_forward(*st.tokens_to_slots(graph.q, q), *st.tokens_to_slots(graph.k, k, v), graph)[
                0
            ],
        ),
    }
    runs["qo"] = lambda: torch_token_forward(q, ks, vs, graph, q_map, None, kv_in_slots=True)
    runs["qo_moved"] = lambda: torch_token_forward(
        q, *st.tokens_to_slots(graph.k, k, v), graph, q_map, None, kv_in_slots=True
    )
    pairs = [("slot", "tokens"), ("slot", "qo")]
    if order == "tiles":  # the tile-major token build: k and v token-major, read page by page by TMA
        runs["tma"] = lambda: torch_token_forward(q, k, v, graph, q_map, k_map, kv_tma=True)
        pairs.append(("slot", "tma"))
    if device:
        idx, num = (torch.as_tensor(x, device=dev) for x in bench.topk_arrays(graph, 1))
        plans = DevicePlanner(graph.q, graph.k, backward=False).plan(idx, num)
        runs["slot_device"] = lambda: torch_graph_forward(qs, ks, vs, plans)
        runs["tokens_device"] = lambda: torch_token_forward(q, k, v, plans, q_map, k_map)
        runs["qo_device"] = lambda: torch_token_forward(q, ks, vs, plans, q_map, None, kv_in_slots=True)
        pairs += [("slot_device", "tokens_device"), ("slot_device", "qo_device")]
        if order == "tiles":
            runs["tma_device"] = lambda: torch_token_forward(q, k, v, plans, q_map, k_map, kv_tma=True)
            pairs.append(("slot_device", "tma_device"))

    record = dict(
        workload=name,
        token_order=order,
        heads=graph.heads,
        head_dim=head_dim,
        tokens=graph.q.num_tokens,
        checks={},
    )
    for slot_name, token_name in pairs:
        o_s, lse_s = runs[slot_name]()[:2]
        o_t, lse_t = runs[token_name]()
        record["checks"][token_name] = dict(
            output_equal=bool(torch.equal(o_t, st.slots_to_tokens(graph.q, o_s))),
            lse_equal=bool(torch.equal(lse_t, lse_s)),
            nan=int(torch.isnan(o_t).sum()),
        )
        print(name, token_name, record["checks"][token_name], flush=True)

    timer = bench.Timer(3, reps)
    names = list(runs)
    times = {n: [] for n in names}
    for r in range(rounds):
        for n in rotation(names, r):
            ms, _ = timer(runs[n])
            times[n].append(ms)
    record["runs"] = summarize(times, "slot")
    for n in names:
        e = record["runs"][n]
        print(f"{name:18s} {n:14s} {e['time_ms']:9.3f} ms  paired {e['paired_ratio']:.4f}", flush=True)
    return record


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", action="append", choices=WORKLOADS, help="default: all four")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", action="store_true", help="also on the device planner's plans")
    ap.add_argument(
        "--order", choices=("raster", "tiles"), default="raster", help="the tokens' order (above)"
    )
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    records = [
        run_workload(w, args.rounds, args.reps, args.device, args.order) for w in args.workload or WORKLOADS
    ]
    print(f"{'workload':18s} {'run':14s} {'ms':>9s} {'paired':>8s}")
    for rec in records:
        for n, e in rec["runs"].items():
            print(f"{rec['workload']:18s} {n:14s} {e['time_ms']:9.3f} {e['paired_ratio']:8.4f}")
    if args.out:
        import datetime
        import os

        import torch

        meta = dict(
            gpu=torch.cuda.get_device_name(),
            commit=os.environ.get("SPARSEATTN_COMMIT", ""),
            date=datetime.date.today().isoformat(),
            SPARSEATTN_FWD_VARIANT=os.environ.get("SPARSEATTN_FWD_VARIANT", ""),
        )
        with open(args.out, "w") as fh:
            json.dump(dict(command=" ".join(sys.argv), **meta, records=records), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
