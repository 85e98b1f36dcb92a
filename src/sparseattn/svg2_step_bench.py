"""One SVG2 attention call on the GPU, timed by part, on a built-in ``svg2_*`` workload's shape.

A call as the Wan processor makes it (warm-started from the previous call's centroids): k-means of Q and
of K (:func:`sparseattn.svg2_device.kmeans`), the partition layouts and the selection (slots, cluster
means, top-p, block mask), tokens to slots, the KPage forward's work list
(:func:`sparseattn.planning.dynamic_layouts.forward_work_list`) and kernel, slots back to tokens, and the
backward's plan. Each part between CUDA events, median of ``--reps`` calls; the call runs once per k-means
variant of :data:`METHODS` (float32 torch distances, the fused Triton kernel, and the fused kernel with
SVG2's own pairing of labels and centroids, which the Wan processor runs) in the same run, and the k-means
parts by flash-kmeans (SVG2's own Triton k-means) when it is installed. The processor's method runs once
more with the host queueing each call while the GPU sleeps (:data:`QUEUED`): its parts are then the GPU's
time alone, as in a model whose host runs ahead of the GPU; the other methods' parts include whatever
time the GPU waits for the host's launches. :data:`IN_SLOTS` runs it queued once more with the last
Lloyd step's cluster sums taken while q and k move to slots
(:func:`sparseattn.svg2_device.svg2_step_in_slots`; the summary adds the tokens' move to each method's
overhead, since this one moves work into it), and :data:`IN_SLOTS_CLUSTERS` the same with the forward
planned by clusters (:meth:`sparseattn.svg2_device.SVG2Step.forward_work_list`). ``--methods`` times a
subset. Tokens move to slots as the CPU
path does (zeros, then ``index_copy``) in the ``torch`` method, and in one Triton pass that leaves unused
slots unwritten (:mod:`sparseattn.slot_copy`) in the fused ones.

Q and K are the workload's synthetic features (:func:`sparseattn.synthetic.synthetic_head_factors`,
zero-padded to the head dim) in bf16; V is random. The output of head 0 is checked on sampled query
tokens against float64 attention over the selected cluster pairs.

    python -m sparseattn.svg2_step_bench --workload svg2_wan14b_720p --out data/bench/svg2_step.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

PARTS_SELECT = ("kmeans_q", "kmeans_k", "layouts_select")
PARTS_KPAGE = ("to_slots", "plan_fwd", "kernel_fwd", "from_slots")
#: (label, assignment, final_assign) of the k-means variants timed: float32 torch distances and the fused
#: Triton kernel with the labels re-assigned after the last step (as the host's k-means), and the fused
#: kernel with the last step's labels (SVG2's own pairing), and the same on the wgmma assignment kernel
#: (:mod:`sparseattn.kernels.kmeans_assign`; what the Wan processor runs on an sm_90 GPU).
METHODS = (
    ("torch", "torch", True),
    ("fused", "fused", True),
    ("fused_last_step", "fused", False),
    ("wgmma_last_step", "wgmma", False),
)
#: The processor's method timed once more with the GPU kept busy (``torch.cuda._sleep``) while the host
#: queues the whole call, as in a model, where the previous layer's attention runs while the host queues
#: the next layer's: the parts' CUDA events then time the GPU's work alone, not the host's launch gaps.
QUEUED = "wgmma_last_step_queued"
QUEUE_CYCLES = 200_000_000  # ~0.1 s of GPU sleep: longer than the host takes to queue a call
#: The queued call with the last Lloyd step's cluster sums taken while q and k move to slots
#: (:func:`sparseattn.svg2_device.svg2_step_in_slots`; v22 of NOTES_svg2_device, the Wan processor's order).
IN_SLOTS = "wgmma_in_slots_queued"
#: The in-slots call with the forward planned by clusters (v26 and v29 of NOTES_svg2_device; the processor's).
IN_SLOTS_CLUSTERS = "wgmma_in_slots_queued_clusters"
#: :data:`IN_SLOTS_CLUSTERS` with the selection and the work list on a side stream while v moves to slots
#: (:func:`sparseattn.svg2_device.slots_and_step`, ``beside=True``; v42 of NOTES_svg2_device). Its
#: ``to_slots`` part holds what of them the move does not hide: :func:`summary` counts its overhead as the
#: parts plus its ``to_slots`` less :data:`IN_SLOTS_CLUSTERS`' of the same run.
IN_SLOTS_BESIDE = "wgmma_in_slots_queued_clusters_beside"
#: Each method that runs the selection and plan beside v's move, with the in-order method of the same run
#: whose move to slots its own is measured against (:func:`unhidden_ms`).
IN_ORDER_OF = {IN_SLOTS_BESIDE: IN_SLOTS_CLUSTERS}
ASSIGNS = tuple(m[0] for m in METHODS) + (QUEUED, IN_SLOTS, IN_SLOTS_CLUSTERS, IN_SLOTS_BESIDE)


def _call_options(assign: str) -> dict:
    """:func:`one_call`'s ``in_slots`` and ``plan`` of a method of :data:`ASSIGNS`."""
    return dict(
        in_slots=assign in (IN_SLOTS, IN_SLOTS_CLUSTERS, IN_SLOTS_BESIDE),
        plan="clusters" if assign in (IN_SLOTS_CLUSTERS, IN_SLOTS_BESIDE) else "blocks",
        beside=assign == IN_SLOTS_BESIDE,
    )


def synthetic_qk(workload, heads: int):
    """float32 ``(q, k)`` ``[heads, tokens, d]``: a built-in workload's synthetic Q/K features
    (:func:`sparseattn.synthetic.synthetic_head_factors`), zero-padded to its head dim."""
    from .synthetic import synthetic_head_factors

    d = workload.head_dim
    pad = lambda z: np.pad(z, ((0, 0), (0, d - z.shape[1])))
    pairs = [synthetic_head_factors(h, grid=workload.grid, dim=d) for h in range(heads)]
    return tuple(np.stack([pad(z[i]) for z in pairs]).astype(np.float32) for i in (0, 1))


def features(workload, heads: int, device):
    """bf16 ``(q, k, v)`` ``[heads, tokens, d]`` of a built-in workload: its synthetic Q/K features, V random."""
    import torch

    q, k = (torch.from_numpy(x).to(device, torch.bfloat16) for x in synthetic_qk(workload, heads))
    g = torch.Generator(device=device).manual_seed(2)
    v = torch.randn(q.shape, generator=g, device=device, dtype=torch.bfloat16)
    return q, k, v


def one_call(
    q,
    k,
    v,
    sel,
    block_size,
    init,
    assign,
    iters,
    marks=None,
    final_assign=False,
    in_slots=False,
    plan="blocks",
    beside=False,
):
    """One SVG2 call: ``(out [N, tokens, d], step)``; ``marks(name)`` is called after each part.
    ``in_slots``: :func:`~sparseattn.svg2_device.svg2_step_in_slots` (the last step's sums taken while the
    tokens move; its parts ``layouts`` and ``select`` instead of ``layouts_select``). ``plan``: the forward's
    work list from the block mask (``"blocks"``, :func:`~sparseattn.planning.dynamic_layouts.forward_work_list`)
    or from the cluster mask and the blocks' groups (``"clusters"``, streams shared by a cluster's blocks,
    no block mask: :meth:`~sparseattn.svg2_device.SVG2Step.forward_work_list`)."""
    from .svg2_device import gather_from_slots, scatter_to_slots, svg2_partition_step, svg2_step_in_slots
    from .torch import per_row_forward

    mark = marks or (lambda name: None)
    args = (sel.q_clusters, sel.k_clusters, block_size, sel.top_p, sel.min_fraction, iters, *init)
    if in_slots:
        step, qs, ks, vs, work = svg2_step_in_slots(
            q, k, v, *args, assign=assign, mark=mark, plan=plan, beside=beside
        )
    else:
        step = svg2_partition_step(q, k, *args, assign=assign, final_assign=final_assign, mark=mark)
        ql, kl = step.q_layout, step.k_layout
        # the torch method moves tokens as the CPU path does (zeros, then index_copy); the fused ones write
        # only the slots that hold a token (one Triton pass, as the Wan processor on the GPU)
        used = (lambda lay: None) if assign == "torch" else (lambda lay: lay.filled_slots())
        qs = scatter_to_slots(q, ql.token_slot, ql.max_slots, used(ql))
        k_used = used(kl)
        ks = scatter_to_slots(k, kl.token_slot, kl.max_slots, k_used)
        vs = scatter_to_slots(v, kl.token_slot, kl.max_slots, k_used)
        mark("to_slots")
        work = step.forward_work_list(plan)
        mark("plan_fwd")
    ql, kl = step.q_layout, step.k_layout
    o, _ = per_row_forward(qs, ks, vs, work, 1.0 / q.shape[-1] ** 0.5)  # the emulator on the CPU
    mark("kernel_fwd")
    out = gather_from_slots(o, ql.token_slot)
    mark("from_slots")
    return out, dict(
        q_labels=step.q_labels,
        k_labels=step.k_labels,
        mask=step.cluster_mask,
        step=step,  # its block mask made only where asked for
        cent=(step.q_centroids, step.k_centroids),
        ql=ql,
        kl=kl,
    )


def check_head0(q, k, v, out, state, samples: int = 256, seed: int = 0) -> float:
    """Relative error of head 0's output on ``samples`` query tokens against float64 attention over the
    selected cluster pairs."""
    import torch

    from .svg2_device import cluster_pair_mask

    rng = np.random.default_rng(seed)
    t = q.shape[1]
    rows = torch.from_numpy(rng.choice(t, size=min(samples, t), replace=False)).to(q.device)
    labels_q, labels_k = state["q_labels"][:1, rows], state["k_labels"][:1]
    allowed = cluster_pair_mask(state["mask"][:1], labels_q, labels_k)[0]  # [samples, tokens]
    qq, kk, vv = q[0, rows].double(), k[0].double(), v[0].double()
    s = (qq @ kk.T) / q.shape[2] ** 0.5
    s = s.masked_fill(~allowed, float("-inf"))
    ref = torch.softmax(s, -1) @ vv
    got = out[0, rows].double()
    return float((got - ref).norm() / ref.norm())


class _Marks:
    """CUDA events in call order; ``elapsed()`` gives each mark's time since the previous one (ms)."""

    def __init__(self):
        import torch

        self._event = lambda: torch.cuda.Event(enable_timing=True)
        self._sync = torch.cuda.synchronize
        self.events = [("start", self._event())]
        self.events[0][1].record()

    def __call__(self, name: str) -> None:
        e = self._event()
        e.record()
        self.events.append((name, e))

    def elapsed(self) -> dict[str, float]:
        self._sync()
        pairs = zip(self.events, self.events[1:])
        out = {b[0]: a[1].elapsed_time(b[1]) for a, b in pairs}
        out.pop("plan_bwd_start", None)
        if "select" in out:  # svg2_step_in_slots' parts around the move to slots
            out["layouts_select"] = out.pop("layouts") + out.pop("select")
        return out


def measure(
    workload_name: str,
    heads: int | None,
    reps: int,
    warmup: int,
    iters: int,
    log=print,
    init_iters: int = 50,
    methods=None,
):
    """The parts' times of one call per method of :data:`ASSIGNS` (``methods``: a subset, default all),
    as records."""
    import torch

    from . import svg2_device
    from . import workloads as wl
    from .kernels import kmeans_assign
    from .planning import dynamic_layouts, page_streams

    w = wl.get_workload(workload_name)
    sel = w.selection
    heads = heads or w.heads
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    q, k, v = features(w, heads, dev)
    log(
        f"{workload_name}: {heads} heads x {q.shape[1]:,} tokens, d={q.shape[2]}, features in "
        f"{time.perf_counter() - t0:.1f} s"
    )
    B = w.block_size
    g = torch.Generator(device=dev).manual_seed(0)
    from .svg2_device import lloyd

    torch.cuda.synchronize()
    seed_t = {}
    for side, x, c in (("q", q, sel.q_clusters), ("k", k, sel.k_clusters)):
        a = time.perf_counter()
        _, cent, _, _ = lloyd(x, c, init_iters, None, g, final_assign=False)
        torch.cuda.synchronize()
        seed_t[side] = (time.perf_counter() - a) * 1e3, cent
    init = (seed_t["q"][1], seed_t["k"][1])
    note = (
        f"a layer's first call: k-means++ seeds and {init_iters} Lloyd steps (once; Triton compiles included)"
    )
    records = [dict(part=f"seed_{s}", assign="-", time_ms=seed_t[s][0], note=note) for s in ("q", "k")]
    queued = (QUEUED, IN_SLOTS, IN_SLOTS_CLUSTERS, IN_SLOTS_BESIDE)
    every = (*METHODS, *((name, "wgmma", False) for name in queued))
    for assign, how, final_assign in (m for m in every if methods is None or m[0] in methods):
        times: dict[str, list[float]] = {}
        options = _call_options(assign)
        try:
            for rep in range(warmup + reps):
                if assign in queued:
                    torch.cuda._sleep(QUEUE_CYCLES)
                marks = _Marks()
                out, state = one_call(q, k, v, sel, B, init, how, iters, marks, final_assign, **options)
                init = state["cent"]
                if assign in ("fused_last_step", IN_SLOTS, IN_SLOTS_CLUSTERS, IN_SLOTS_BESIDE):
                    # the backward's plan of the same call (by clusters where the forward was), warmed up like the rest
                    marks("plan_bwd_start")  # a block mask the forward's plan made is reused
                    state["step"].backward_plan(options["plan"])
                    marks("plan_bwd")
                if rep >= warmup:
                    for name, ms in marks.elapsed().items():
                        times.setdefault(name, []).append(ms)
        except Exception as exc:  # noqa: BLE001 (a method that fails is recorded; the run goes on)
            log(f"assign={assign}: {type(exc).__name__}: {exc}")
            records.append(dict(part="kmeans_q", assign=assign, error=f"{type(exc).__name__}: {exc}"))
            continue
        err = check_head0(q, k, v, out, state)
        ql, kl = state["ql"], state["kl"]
        qsz = torch.bincount(state["q_labels"][0], minlength=sel.q_clusters).double()
        ksz = torch.bincount(state["k_labels"][0], minlength=sel.k_clusters).double()
        useful = float(qsz @ state["mask"][0].double() @ ksz) / float(q.shape[1]) ** 2
        live_blocks = float(
            state["step"].block_mask.float().sum()
            / ((ql.block_rows > 0).sum(1) * (kl.block_rows > 0).sum(1)).sum()
        )
        for name, ts in times.items():
            records.append(
                dict(
                    part=name,
                    assign=assign,
                    final_assign=final_assign,
                    time_ms=statistics.median(ts),
                    reps=len(ts),
                    rel_err_head0=err,
                    useful_fraction_head0=useful,
                    block_fraction=live_blocks,
                )
            )
        log(
            f"assign={assign}: "
            + ", ".join(f"{n} {statistics.median(ts):.2f}" for n, ts in times.items())
            + f" ms; head-0 rel_err {err:.2e}; useful pairs {useful:.1%}"
        )
    if methods is None:
        records += flash_kmeans_records(q, k, sel, init, iters, reps, warmup, log)
    meta = dict(
        workload=workload_name,
        heads=heads,
        tokens=int(q.shape[1]),
        head_dim=int(q.shape[2]),
        q_clusters=sel.q_clusters,
        k_clusters=sel.k_clusters,
        iters=iters,
        init_iters=init_iters,
        block_size=B,
        top_p=sel.top_p,
        min_fraction=sel.min_fraction,
        select_method=_select_method(),
        kmeans_build=kmeans_assign.BUILD,  # the wgmma methods' assignment and Lloyd sums
        kmeans_sums=kmeans_assign.SUMS,
        side_stream=svg2_device.SIDE_STREAM,  # the in-slots methods' Q layout beside K's k-means
        layout_slots=svg2_device.LAYOUT_SLOTS,
        stream_writer=page_streams.WRITER,
        plan_items=dynamic_layouts.ITEMS,
        select_beside=svg2_device.SELECT_BESIDE,  # the processor's order; the beside method sets it itself
        side_priority=svg2_device.SIDE_PRIORITY,
        kmeans_update=svg2_device.KMEANS_UPDATE,
        layout_blocks=svg2_device.LAYOUT_BLOCKS,
        select_means=svg2_device.SELECT_MEANS,
        k_layout_beside=svg2_device.K_LAYOUT_BESIDE,  # with the beside method only (svg2_step_in_slots)
    )
    return [dict(meta, **r) for r in records]


def _select_method() -> str:
    """The top-p selection's form on the float64 scores the call selects from."""
    import torch

    from . import cluster_select

    return cluster_select.method_for(torch.float64)


def flash_kmeans_records(q, k, sel, init, iters: int, reps: int, warmup: int, log=print) -> list[dict]:
    """The k-means parts by flash-kmeans (``flash_kmeans.batch_kmeans_Euclid``, SVG2's own Triton k-means,
    when installed) from the same warm-start centroids and Lloyd steps: ``kmeans_q`` / ``kmeans_k``
    records (assign ``flash_kmeans``) with the share of labels equal to ours (``fused_last_step``, the
    same pairing of labels and centroids; rounding can move near ties). An error record when it is not
    installed or fails."""
    import torch

    from .svg2_device import lloyd

    try:
        from flash_kmeans import batch_kmeans_Euclid
    except ImportError as exc:
        return [dict(part="kmeans_q", assign="flash_kmeans", error=f"not installed: {exc}")]
    out = []
    for part, x, clusters, c0 in (
        ("kmeans_q", q, sel.q_clusters, init[0]),
        ("kmeans_k", k, sel.k_clusters, init[1]),
    ):
        try:
            times = []
            for rep in range(warmup + reps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                # tol < 0: every one of the iters steps runs (its convergence test never stops it)
                labels, _, _ = batch_kmeans_Euclid(
                    x, clusters, max_iters=iters, tol=-1.0, init_centroids=c0.to(x.dtype).contiguous()
                )
                end.record()
                torch.cuda.synchronize()
                if rep >= warmup:
                    times.append(start.elapsed_time(end))
            ours = lloyd(x, clusters, iters, c0, assign="auto", final_assign=False)[0]
            agree = float((labels.long() == ours).float().mean())
            out.append(
                dict(
                    part=part,
                    assign="flash_kmeans",
                    time_ms=statistics.median(times),
                    reps=len(times),
                    label_agreement=agree,
                )
            )
            log(f"flash_kmeans {part}: {statistics.median(times):.2f} ms; labels equal to ours {agree:.2%}")
        except Exception as exc:  # noqa: BLE001 (a failing peer is recorded; the run goes on)
            out.append(dict(part=part, assign="flash_kmeans", error=f"{type(exc).__name__}: {exc}"[:300]))
            log(f"flash_kmeans {part}: {type(exc).__name__}: {exc}")
    return out


def unhidden_ms(parts: dict, method: str) -> float | None:
    """What of the parts a method of :data:`IN_ORDER_OF` runs beside the moves (the selection and plan beside
    v's, K's layout beside q's since v47) left exposed: its move to slots less its in-order method's
    (``parts``: ``{method: {part: ms}}`` of one run); 0.0 for another method; None where either move is
    missing."""
    in_order = IN_ORDER_OF.get(method)
    if in_order is None:
        return 0.0
    beside, alone = parts.get(method, {}).get("to_slots"), parts.get(in_order, {}).get("to_slots")
    return None if beside is None or alone is None else beside - alone


def summary(records) -> list[str]:
    """The per-call overhead (clustering + selection + planning) against the KPage kernel, per method."""
    lines = []
    parts: dict = {}
    for r in records:
        if "time_ms" in r and "assign" in r:
            parts.setdefault(r["assign"], {})[r["part"]] = r["time_ms"]
    for assign in ASSIGNS:
        t = parts.get(assign, {})
        if "kernel_fwd" not in t:
            continue
        unhidden = unhidden_ms(parts, assign)
        if unhidden is None:
            lines.append(f"assign={assign}: its overhead needs {IN_ORDER_OF[assign]} in the same run")
            continue
        over = sum(t.get(p, 0.0) for p in (*PARTS_SELECT, "plan_fwd")) + unhidden
        lines.append(
            f"assign={assign}: kmeans q {t['kmeans_q']:.2f} + k {t['kmeans_k']:.2f} + layouts/select "
            f"{t['layouts_select']:.2f} + fwd plan {t['plan_fwd']:.2f}"
            + (f" + not hidden by v's move {unhidden:.2f}" if assign in IN_ORDER_OF else "")
            + f" = {over:.2f} ms = {over / t['kernel_fwd']:.1%} of the kernel's {t['kernel_fwd']:.2f} ms"
            + (
                f"; with tokens to slots {t['to_slots']:.2f}: {over + t['to_slots']:.2f} ms"
                if "to_slots" in t
                else ""
            )
            + (f"; bwd plan {t['plan_bwd']:.2f} ms" if "plan_bwd" in t else "")
        )
    return lines


def main(argv=None) -> int:
    from .bench import run_path, write_run

    ap = argparse.ArgumentParser(
        prog="python -m sparseattn.svg2_step_bench", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--workload", default="svg2_wan14b_720p")
    ap.add_argument("--heads", type=int, default=None, help="heads (default: the workload's)")
    ap.add_argument(
        "--iters",
        type=int,
        default=2,
        help="Lloyd steps per warm-started call (default 2: SVG2's, the processor's)",
    )
    ap.add_argument(
        "--init-iters", type=int, default=50, help="Lloyd steps of the first call (default 50: SVG2's)"
    )
    ap.add_argument(
        "--methods", default=None, help=f"comma-separated methods to time (default all: {', '.join(ASSIGNS)})"
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--profile", default=None, help="also write a torch.profiler table of one call per method here"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    methods = None
    if args.methods:
        methods = tuple(m.strip() for m in args.methods.split(","))
        unknown = sorted(set(methods) - set(ASSIGNS))
        if unknown:
            ap.error(f"--methods: unknown {unknown}; choose from {', '.join(ASSIGNS)}")
    records = measure(
        args.workload,
        args.heads,
        args.reps,
        args.warmup,
        args.iters,
        init_iters=args.init_iters,
        methods=methods,
    )
    if args.profile:
        profile_table(args.workload, args.heads, args.iters, args.profile)
    path = write_run(run_path(args.out, "svg2_step"), "python -m sparseattn.svg2_step_bench", argv, records)
    for line in summary(records):
        print(line)
    print(f"wrote {path}")
    return 0


def profile_table(workload_name, heads, iters, path) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from . import workloads as wl
    from .svg2_device import kmeans

    w = wl.get_workload(workload_name)
    q, k, v = features(w, heads or w.heads, torch.device("cuda"))
    init = tuple(kmeans(x, c, 0)[1] for x, c in ((q, w.selection.q_clusters), (k, w.selection.k_clusters)))
    with open(path, "w") as f:
        in_slots = ((IN_SLOTS, "wgmma", False), (IN_SLOTS_CLUSTERS, "wgmma", False))
        for assign, how, final_assign in (*METHODS, *in_slots):
            call = (q, k, v, w.selection, w.block_size, init, how, iters, None, final_assign)
            options = _call_options(assign)
            one_call(*call, **options)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                one_call(*call, **options)
                torch.cuda.synchronize()
            f.write(f"== assign={assign}\n")
            f.write(
                prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70)
            )
            f.write("\n")


if __name__ == "__main__":
    sys.exit(main())
