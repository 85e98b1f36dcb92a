"""Interleaved A/B of the KPage forward's (or backward's) compile-time builds (``sparseattn bench variants``).

Separate bench processes drift: back-to-back runs of the same build on one GPU read 1–4% apart as the GPU
warms, which is the size of the differences the forward's variants make. This runs every build (and
optionally cuDNN's dense SDPA as a fixed reference) in one process and alternates them: each round times
every build for ``reps`` calls, in an order rotated from round to round, and each build's result is the
median over rounds together with its *paired* ratio to the first build — the median over rounds of the
two builds' times in that round, where drift cancels.

Builds are named by their macros (:data:`sparseattn.kernels.forward.VARIANTS`): ``default`` or
comma-joined names, e.g. ``PAGED_FWD_TMA,PAGED_FWD_PINGPONG``. Each build's output is checked against
the float64 reference (head 0, sampled Q blocks) on a NaN-poisoned output buffer before timing.
``--pass bwd`` alternates the backward's builds instead (:data:`sparseattn.kernels.bsa_backward.VARIANTS`,
e.g. ``PAGED_BWD_WG_DQ``) on the default forward's outputs; each build's gradients are checked against the
float64 reference (head 0) before timing; records carry ``bwd_variant``.

.. code-block:: text

    sparseattn bench variants --workload dense_32768 --workload vsa_wan14b_480p \\
        --variant default --variant PAGED_FWD_TMA --cudnn --rounds 12 --reps 5 --out ab.json
    sparseattn bench variants --pass bwd --workload vsa_wan14b_480p \\
        --variant default --variant PAGED_BWD_WG_DQ --rounds 8 --reps 3 --out ab_bwd.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

DEFAULT = "default"
CUDNN = "cudnn_dense"


def known_variants(pass_: str = "fwd") -> tuple[tuple[str, ...], dict]:
    """The macros ``--variant`` may name for ``--pass pass_``, and the companions each needs."""
    if pass_ == "bwd":
        from .kernels.bsa_backward import VARIANT_NEEDS, VARIANTS
    else:
        from .kernels.forward import VARIANT_NEEDS, VARIANTS
    return VARIANTS, VARIANT_NEEDS


def parse_variant(text: str, pass_: str = "fwd") -> tuple[str, ...]:
    """``"default"`` -> ``()``; ``"A,B"`` -> ``("A", "B")`` sorted; unknown macros (of ``pass_``'s kernel)
    raise ``ValueError`` naming ``--variant``."""
    from .kernels.launch import check_variant_needs

    variants, needs = known_variants(pass_)
    text = text.strip()
    if text == DEFAULT:
        return ()
    names = tuple(sorted({n.strip() for n in text.split(",") if n.strip()}))
    unknown = [n for n in names if n not in variants]
    if not names or unknown:
        raise ValueError(
            f"--variant {text!r}: expected {DEFAULT!r} or comma-joined names of {', '.join(variants)}"
        )
    return check_variant_needs(names, needs, f"--variant {text!r}")


def variant_name(defines: tuple[str, ...]) -> str:
    return ",".join(defines) or DEFAULT


def rotation(names: list[str], round_index: int) -> list[str]:
    """The order of one round: ``names`` rotated by ``round_index`` (each build leads in turn)."""
    k = round_index % len(names)
    return names[k:] + names[:k]


def summarize(times: dict[str, list[float]], baseline: str) -> dict[str, dict]:
    """Per build: the median over rounds of its per-round medians, and the median of its paired ratio to
    ``baseline`` (``times[name][r] / times[baseline][r]``) with that ratio's interquartile range."""
    out = {}
    base = np.asarray(times[baseline], dtype=np.float64)
    for name, ts in times.items():
        t = np.asarray(ts, dtype=np.float64)
        ratio = t / base
        out[name] = dict(
            time_ms=float(np.median(t)),
            round_ms=[round(float(x), 4) for x in t],
            paired_ratio=float(np.median(ratio)),
            paired_ratio_iqr=[float(np.percentile(ratio, 25)), float(np.percentile(ratio, 75))],
        )
    return out


def _poison(o) -> None:
    o.fill(0x7FC0)  # bf16 NaN: a tile the kernel skips keeps it


def run_workload(name: str, builds: list[tuple[str, ...]], args, timer) -> list[dict]:
    """Check every build on one workload, then time them (and cuDNN with ``--cudnn``) in rotated rounds."""
    if getattr(args, "pass_", "fwd") == "bwd":
        return run_backward_workload(name, builds, args, timer)
    import cupy

    from . import bench
    from .kernels import forward

    graph, head_dim = bench.workload_graph(name, args.heads, seed=args.seed)
    case = bench.Case(graph, head_dim, args.batch, seed=args.seed + 1)
    useful = graph.useful_pairs() * args.batch
    o, lse = forward.paged_forward(case.q, case.k, case.v, graph, scale=case.scale)  # default build's buffers
    buffers = (o, lse)
    saved = forward.DEFINES
    calls = _calls_per_build(
        forward,
        builds,
        lambda: forward.paged_forward(case.q, case.k, case.v, graph, scale=case.scale, out=buffers),
    )
    checks = {}
    try:
        for label, call in list(calls.items()):
            _poison(o)
            call()
            cupy.cuda.Device().synchronize()
            rel = None
            if not args.no_check:
                rel = case.rel_err_head0(bench.bf16_bits_to_float(cupy.asnumpy(o[:, 0])).astype(np.float64))
            checks[label] = rel
        if args.cudnn:
            calls[CUDNN] = _cudnn_call(case)
        times = _timed_rounds(calls, args, timer)
    finally:
        forward.DEFINES = saved
    summary = summarize(times, variant_name(builds[0]))
    kpage_pairs = forward.executed_pairs(graph, "kpage", "auto") * args.batch
    dense_pairs = bench.head_graph(graph, 0).q.num_tokens ** 2 * graph.heads * args.batch
    records = []
    for label, s in summary.items():
        rel = checks.get(label)
        records.append(
            _ab_record(
                (name, builds, args, graph, head_dim, useful),
                s,
                dense_pairs if label == CUDNN else kpage_pairs,
                impl="cudnn_dense" if label == CUDNN else "kpage",
                fwd_variant=None if label == CUDNN else label,
                **{"pass": "fwd"},
                rel_err_o=rel,
                correct=None if rel is None else bool(rel < bench.O_REL_TOL),
            )
        )
    return records


def _calls_per_build(module, builds: list[tuple[str, ...]], run) -> dict:
    """``{build name: call}``: each call sets ``module.DEFINES`` to its build, then returns ``run()``."""

    def call_with(defines):
        def call():
            module.DEFINES = defines
            return run()

        return call

    return {variant_name(defines): call_with(defines) for defines in builds}


def _timed_rounds(calls: dict, args, timer) -> dict[str, list[float]]:
    names = list(calls)
    times = {n: [] for n in names}
    for r in range(args.rounds):
        for n in rotation(names, r):
            ms, _ = timer(calls[n])
            times[n].append(ms)
    return times


def run_backward_workload(name: str, builds: list[tuple[str, ...]], args, timer) -> list[dict]:
    """``--pass bwd``: the backward's builds on one workload, each checked (gradients of head 0 against the
    float64 reference), then timed in rotated rounds; the forward's outputs (default build) are shared."""
    import cupy

    from . import bench
    from .kernels import bsa_backward
    from .kernels.backward import backward_executed_pairs, paged_backward
    from .kernels.forward import paged_forward

    graph, head_dim = bench.workload_graph(name, args.heads, seed=args.seed)
    case = bench.Case(graph, head_dim, args.batch, seed=args.seed + 1)
    useful = graph.useful_pairs() * args.batch
    o, lse = paged_forward(case.q, case.k, case.v, graph, scale=case.scale)
    saved = bsa_backward.DEFINES
    # (a backward recipe is cached per build: the defines are in its key)
    calls = _calls_per_build(
        bsa_backward,
        builds,
        lambda: paged_backward(case.q, case.k, case.v, o, lse, case.do, graph, scale=case.scale),
    )
    checks = {}
    try:
        for label, call in list(calls.items()):
            grads = call()
            cupy.cuda.Device().synchronize()
            checks[label] = None if args.no_check else case.grad_err_head0(o, lse, grads)
            del grads
        times = _timed_rounds(calls, args, timer)
    finally:
        bsa_backward.DEFINES = saved
    physical = backward_executed_pairs(graph, head_dim) * args.batch
    records = []
    for label, s in summarize(times, variant_name(builds[0])).items():
        rel = checks.get(label)
        records.append(
            _ab_record(
                (name, builds, args, graph, head_dim, useful),
                s,
                physical,
                impl="kpage",
                bwd_variant=label,
                **{"pass": "bwd"},
                rel_err_grads=rel,
                correct=None if rel is None else bool(rel < bench.GRAD_REL_TOL),
            )
        )
    return records


def _ab_record(run: tuple, summary: dict, physical: int, **fields) -> dict:
    """One build's record of an A/B run on one workload: ``run`` = (workload, builds, args, graph, head dim,
    useful pairs), ``fields`` (impl, pass, build, check) and its round summary."""
    from . import bench

    workload, builds, args, graph, head_dim, useful = run
    record = dict(
        workload=workload,
        **fields,
        **summary,
        baseline=variant_name(builds[0]),
        rounds=args.rounds,
        reps=args.reps,
        heads=graph.heads,
        head_dim=head_dim,
        batch=args.batch,
        useful_pairs=useful,
        physical_pairs=physical,
    )
    return bench._rates(record, useful, head_dim)


def _cudnn_call(case):
    """cuDNN's dense SDPA on random inputs of the workload's shape (its tokens, heads, head dim)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .bench import cudnn_dense_inputs

    q, k, v = cudnn_dense_inputs(case)

    def call():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            torch.nn.functional.scaled_dot_product_attention(q, k, v)

    return call


def build_parser(prog: str = "sparseattn bench variants") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--workload", action="append", metavar="NAME", help="built-in workload (repeatable)")
    parser.add_argument(
        "--pass",
        dest="pass_",
        choices=("fwd", "bwd"),
        default="fwd",
        help="the kernel whose builds alternate: the forward (default) or the backward",
    )
    parser.add_argument(
        "--variant",
        action="append",
        metavar="BUILD",
        help=f"'{DEFAULT}' or comma-joined macros of the --pass kernel (repeatable; the first is the baseline; "
        f"default: {DEFAULT} and each single macro)",
    )
    parser.add_argument(
        "--cudnn", action="store_true", help="also time cuDNN's dense SDPA in every round (--pass fwd)"
    )
    parser.add_argument("--rounds", type=int, default=12, help="rounds (each times every build)")
    parser.add_argument("--reps", type=int, default=5, help="timed calls per build per round (median)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-check", action="store_true", help="skip the float64 reference check (head 0)")
    parser.add_argument("--out", metavar="PATH", help="JSON result file (the bench format)")
    parser.add_argument(
        "--plot",
        metavar="PATH",
        help="also draw the paired ratios (.png, .pdf or .svg; speedplots.variant_ratio_figure)",
    )
    parser.add_argument(
        "--from-json",
        metavar="FILE",
        help="draw --plot from a recorded run instead of running (no GPU needed)",
    )
    return parser


def plot_records(records: list[dict], plot_path) -> None:
    """Draw ``bench variants`` records' paired ratios to ``plot_path``."""
    from .speedplots import variant_ratio_figure

    variant_ratio_figure(records, plot_path)
    print(f"wrote {plot_path}")


def plot_run(json_path, plot_path) -> int:
    """Draw a recorded ``bench variants`` run's paired ratios to ``plot_path``."""
    import json

    plot_records(json.loads(Path(json_path).read_text())["records"], plot_path)
    return 0


def workload_names() -> list[str]:
    """The names ``--workload`` accepts: the built-in workloads and the dense all-pairs rows."""
    from .bench import DENSE_WORKLOADS
    from .workloads import WORKLOADS

    return [*WORKLOADS, *DENSE_WORKLOADS]


def parse_builds(texts: list[str] | None, pass_: str = "fwd") -> list[tuple[str, ...]]:
    """The builds of ``--variant`` in order, without repeats (default: the default build and each macro)."""
    variants, needs = known_variants(pass_)
    builds = (
        [parse_variant(t, pass_) for t in texts]
        if texts
        else [(), *(tuple(sorted((v, *needs.get(v, ())))) for v in variants)]
    )
    unique = list(dict.fromkeys(builds))
    if len(unique) < 2:
        raise ValueError("--variant: an A/B needs at least two different builds")
    return unique


def main(argv=None, prog: str = "sparseattn bench variants") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.plot:
        plot = Path(args.plot)
        if plot.suffix.lower() not in (".png", ".pdf", ".svg") or not plot.parent.is_dir():
            parser.error(f"--plot {args.plot!r}: a .png, .pdf or .svg path in an existing folder")
    if args.from_json:
        if not args.plot:
            parser.error("--from-json draws a figure: give --plot PATH")
        return plot_run(args.from_json, args.plot)
    if not args.workload:
        parser.error("--workload is required (or --from-json FILE --plot PATH)")
    try:
        builds = parse_builds(args.variant, args.pass_)
    except ValueError as err:
        parser.error(str(err))
    if args.cudnn and args.pass_ != "fwd":
        parser.error("--cudnn: cuDNN's reference is timed with --pass fwd only")
    if args.rounds < 2 or args.reps < 1:
        parser.error("--rounds must be at least 2 and --reps at least 1")
    unknown = [w for w in args.workload if w not in workload_names()]
    if unknown:
        parser.error(f"--workload {unknown[0]!r}: valid names: {', '.join(workload_names())}")
    from . import bench

    if bench.cupy is None:
        raise ImportError("sparseattn bench variants needs cupy and a CUDA GPU: pip install -e '.[gpu]'")
    timer = bench.Timer(args.warmup, args.reps)
    records = []
    for name in args.workload:
        t0 = time.time()
        records += run_workload(name, builds, args, timer)
        print(f"[{name}] {len(builds)} builds, {args.rounds} rounds: {time.time() - t0:.1f}s", flush=True)
        if args.out:
            bench.write_run(Path(args.out), prog, argv, records, builds=[variant_name(b) for b in builds])
    print(f"{'workload':18s} {'build':40s} {'median ms':>10s} {'paired':>8s} {'correct':>8s}")
    for r in records:
        print(
            f"{r['workload']:18s} {(r.get('fwd_variant') or r.get('bwd_variant') or r['impl']):40s} {r['time_ms']:10.3f} "
            f"{r['paired_ratio']:8.4f} {r['correct']!s:>8s}"
        )
    if args.out:
        print(f"wrote {args.out}")
    if args.plot:
        plot_records(records, args.plot)
    return 1 if any(r.get("correct") is False for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
