"""Complete-call benchmark of PageWeaver's attention: union kernel, KV-page union, per-query design, FlashInfer.

``sparseattn bench pageweaver --out DIR`` (or ``python -m sparseattn.pageweaver.kernel_bench``) runs, on every built-in capture and GQA group
size (8 KV heads by default, head dim 128, e4m3 K/V with per-page scales, bf16 Q):

* ``pageweaver_union`` / grouping ``adjacent8`` — fixed adjacent groups of 8 (the paper's Union8: no
  search, the call is the union kernel alone);
* ``pageweaver_union`` / grouping ``affinity`` — the GPU affinity search (window 64) then the union
  kernel, without a host synchronisation in between; the search's own time is recorded too;
* ``kv_page_union`` — the direct KV-page union (work split by page, items of up to 8 queries that
  selected it, fp32 partials merged by LSE); ``partials_ms`` and ``merge_ms`` time its two phases
  apart (the reduction's own cost); its plan (a host sort by page) is built once and not timed;
* ``per_query`` — the per-query kernel (``pw_per_query_fwd.cu``): one warp per (query, KV head),
  mma.sync 16-row tiles holding the query's G heads, 16-key steps, each query loading its own pages;
* ``union_singleton`` (opt-in) — every query its own group on the union kernel (rows = its G query
  heads, padded to the 64-row wgmma tile): the union kernel's machinery without the union;
* ``flashinfer`` — FlashInfer's ``BlockSparseAttentionWrapper`` (R = 1, C = page size, e4m3 K/V, bf16 Q),
  when the package imports; its ``plan`` (host work) is not timed. Queries are cut into chunks of at
  most 32,768 rows (the wrapper fails on 65,536 rows at GQA ≥ 4);
* ``flashinfer_bf16`` — the same selection with K/V dequantised to bf16 (each page times its scale),
  FlashInfer's faster path for a model that can afford a bf16 cache.

Both FlashInfer paths run on every backend of ``--flashinfer-backends`` (default ``fa2``, ``fa3``,
``auto``; the record's ``backend``); a backend that fails to build or run gives an ``error`` record and
the run goes on. The figures compare the union with the fastest FlashInfer path of each capture and GQA.

Times are medians of CUDA events with the L2 cache flushed before every call (a 256 MB memset).
``useful_pairs`` counts the valid (query head, key) pairs (causal keys of the selected pages);
``physical_pairs`` what the union kernel computes (tile rows × 64-key chunks). The same run checks the
union kernel's output on sampled queries of KV head 0 against the float64 reference (``correct``).
Writes ``DIR/pageweaver_kernels.json`` and ``DIR/pageweaver_kernels.log``.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import numpy as np

from .captures import BUILTIN_CAPTURES, Capture, load_capture
from .flashinfer_peer import block_sparse_wrapper
from .grouping import adjacent_groups
from .reference import key_index, paged_attention_reference

#: Implementations ``--impl`` accepts.
IMPLS = ("pageweaver_union", "kv_page_union", "per_query", "union_singleton", "flashinfer", "flashinfer_bf16")
#: FlashInfer backends each FlashInfer path is tried on.
FLASHINFER_BACKENDS = ("fa2", "fa3", "auto")

FLUSH_BYTES = 256 << 20
CHECK_QUERIES = 48
FLASHINFER_MAX_ROWS = 32768


def useful_pairs(capture: Capture) -> int:
    """Valid (query, key) pairs of one query head: selected keys before the context end (and causal)."""
    total = 0
    for a in range(0, capture.num_queries, 4096):
        _, valid = key_index(capture, np.arange(a, min(a + 4096, capture.num_queries)))
        total += int(valid.sum())
    return total


def union_chunks(capture: Capture, grouping, pack: int = 1) -> int:
    """64-key chunks the union kernel runs per KV head: Σ_t ⌈|U_t|·P / 64⌉ over its tiles (``pack``
    consecutive groups each, where their union fits the tile's list)."""
    from .grouping import union_sizes

    sizes = union_sizes(capture, grouping.packed(pack))
    return int((-(-(sizes * capture.page_size) // 64)).sum())


def per_query_steps(capture: Capture) -> int:
    """16-key steps the per-query kernel computes per KV head: page parts whose first key the query may see."""
    P = capture.page_size
    first = capture.pages.astype(np.int64)[:, :, None] * P + np.arange(0, P, 16)  # [Q, k, P/16]
    limit = np.full(capture.num_queries, capture.context - 1)
    if capture.causal:
        limit = np.minimum(limit, capture.positions)
    return int(((capture.pages[:, :, None] >= 0) & (first <= limit[:, None, None])).sum())


class Timer:
    def __init__(self, reps: int):
        import cupy as cp

        self.reps = reps
        self.flush = cp.empty(FLUSH_BYTES, dtype=cp.uint8)

    def __call__(self, fn) -> float:
        from .gpu_bench import time_device

        return time_device(fn, self.reps, warmup=1, flush=self.flush)


def _flashinfer_calls(capture: Capture, q_t, k_t, v_t, kv_heads: int, gqa: int, backend: str = "fa2"):
    """FlashInfer wrappers (planned, on ``backend``, K/V of ``k_t``'s dtype) and a callable running them;
    None when FlashInfer is missing."""
    try:
        import flashinfer  # noqa: F401 - imported here only to learn whether the peer can run
        import torch
    except Exception:  # noqa: BLE001 - FlashInfer is an optional peer: any import failure means "not run"
        return None
    P, L = capture.page_size, capture.context
    cnt = (capture.pages >= 0).sum(1)
    indptr = torch.tensor(np.concatenate([[0], np.cumsum(cnt)]), dtype=torch.int32, device="cuda")
    indices = torch.tensor(capture.pages[capture.pages >= 0], dtype=torch.int32, device="cuda")
    nq = capture.num_queries
    step = FLASHINFER_MAX_ROWS if gqa > 1 else nq
    calls = []
    for a in range(0, nq, step):
        b = min(nq, a + step)
        ip = (indptr[a : b + 1] - indptr[a]).contiguous()
        ix = indices[int(indptr[a]) : int(indptr[b])].contiguous()
        w = block_sparse_wrapper(torch.empty(512 << 20, dtype=torch.uint8, device="cuda"), b - a, backend)
        w.plan(
            ip,
            ix,
            b - a,
            -(-L // P) * P,
            1,
            P,
            kv_heads * gqa,
            kv_heads,
            128,
            q_data_type=torch.bfloat16,
            kv_data_type=k_t.dtype,
            o_data_type=torch.bfloat16,
        )
        calls.append((w, q_t[a:b]))
    return lambda: [w.run(qq, k_t, v_t) for w, qq in calls]


def flashinfer_cache(k8, v8, k_scale, v_scale, page_size: int, bf16: bool):
    """``(K, V)`` torch tensors ``[rows, kv_heads, d]`` for FlashInfer: the e4m3 cache as it is (its page
    scales are not FlashInfer's to apply: a timing peer), or dequantised to bf16 (each page times its
    scale: the same values the union kernel computes with)."""
    import cupy as cp
    import torch

    out = []
    for bits, scale in ((k8, k_scale), (v8, v_scale)):
        t = torch.from_dlpack(bits).view(torch.float8_e4m3fn)
        if bf16:
            per_row = torch.from_dlpack(cp.repeat(scale, page_size, axis=1)[:, : t.shape[1], None])
            t = (t.float() * per_row).to(torch.bfloat16)
        out.append(t.permute(1, 0, 2).contiguous())
    return tuple(out)


def check_sample(capture, q, k, v, ks, vs, o, gqa, rng) -> dict:
    """Union-kernel rows of KV head 0 on sampled queries against the float64 reference (2× emulation rule)."""
    import cupy as cp

    from ..bf16 import bf16_bits_to_float
    from .fp8 import dequantize

    queries = np.sort(rng.choice(capture.num_queries, min(CHECK_QUERIES, capture.num_queries), replace=False))
    sub = Capture(
        pages=capture.pages[queries],
        positions=capture.positions[queries],
        context=capture.context,
        page_size=capture.page_size,
        causal=capture.causal,
    )
    qh = bf16_bits_to_float(cp.asnumpy(q[:gqa, queries])).astype(np.float64)
    kb, vb = cp.asnumpy(k[:1]), cp.asnumpy(v[:1])
    ksc, vsc = cp.asnumpy(ks[:1]), cp.asnumpy(vs[:1])
    P = capture.page_size
    ke, ve = dequantize(kb, ksc, P), dequantize(vb, vsc, P)
    kr, vr = dequantize(kb, ksc, P, True), dequantize(vb, vsc, P, True)
    o_ref, _ = paged_attention_reference(qh, ke, ve, sub)
    o_emul, _ = paged_attention_reference(qh, kr, vr, sub, emulate_bf16=True)
    got = bf16_bits_to_float(cp.asnumpy(o[:gqa, queries])).astype(np.float64)
    norm = max(np.linalg.norm(o_ref), 1e-30)
    rel, rel_emul = np.linalg.norm(got - o_ref) / norm, np.linalg.norm(o_emul - o_ref) / norm
    row, row_emul = np.abs(got - o_ref).max(-1).max(), np.abs(o_emul - o_ref).max(-1).max()
    ok = bool(np.isfinite(got).all() and rel <= 2 * rel_emul + 1e-5 and row <= 2 * row_emul + 1e-5)
    return {"correct": ok, "rel_err": float(rel), "rel_err_emulation": float(rel_emul)}


def bench_capture(
    name: str,
    gqas,
    kv_heads: int,
    timer: Timer,
    impls,
    rng,
    log,
    flashinfer_backends=FLASHINFER_BACKENDS,
    failed_builds: dict | None = None,
    pack: int | None = None,
) -> list[dict]:
    """Records of every implementation on capture ``name`` at each GQA size. ``failed_builds`` maps
    (FlashInfer path, backend) to the error of a JIT build that failed earlier in the run: that pair is
    recorded as failed again without another build attempt (each costs minutes of nvcc). ``pack``: groups
    per tile of the union kernel, capped at what each G allows (default ``8 // G``)."""
    import cupy as cp

    from ..kernels.pageweaver import (
        default_pack,
        kv_page_forward,
        kv_page_plan,
        per_query_forward,
        per_query_groups,
        union_forward,
        variant,
    )
    from .grouping_gpu import affinity_groups_device

    cap = load_capture(name)
    P, nq = cap.page_size, cap.num_queries
    rows = cap.num_pages * P
    useful = useful_pairs(cap)
    k = cp.random.standard_normal((kv_heads, rows, 128), dtype=cp.float32)
    v = cp.random.standard_normal((kv_heads, rows, 128), dtype=cp.float32)
    # per-(head, page) power-of-two scales, as quantize_kv picks them
    ks = cp.exp2(cp.ceil(cp.log2(cp.abs(k).reshape(kv_heads, cap.num_pages, -1).max(-1) / 448))).astype(
        cp.float32
    )
    vs = cp.exp2(cp.ceil(cp.log2(cp.abs(v).reshape(kv_heads, cap.num_pages, -1).max(-1) / 448))).astype(
        cp.float32
    )
    import torch

    def e4m3(x, s):
        scaled = x / cp.repeat(s, P, axis=1)[:, :, None]
        return cp.from_dlpack(torch.from_dlpack(scaled).to(torch.float8_e4m3fn).view(torch.uint8))

    k8, v8 = e4m3(k, ks), e4m3(v, vs)
    del k, v
    pages_dev = cp.asarray(cap.pages)
    adjacent = adjacent_groups(nq, 8)
    per_query = per_query_groups(nq)
    chunks = {}  # (grouping, pack) -> union_chunks, host work shared by the GQA sizes

    def chunks_of(label, grouping, tile_pack):
        if (label, tile_pack) not in chunks:
            chunks[label, tile_pack] = union_chunks(cap, grouping, tile_pack)
        return chunks[label, tile_pack]

    steps = per_query_steps(cap) if "per_query" in impls else 0
    records = []

    def run_gqa(gqa: int) -> None:
        hq = kv_heads * gqa
        q = cp.asarray(torch.randn(hq, nq, 128, dtype=torch.bfloat16, device="cuda").view(torch.int16)).view(
            cp.uint16
        )
        o = cp.empty((hq, nq, 128), dtype=cp.uint16)
        lse = cp.empty((hq, nq), dtype=cp.float32)
        tile_rows = 64 if 8 * gqa <= 64 else 128
        tile_pack = default_pack(gqa, pack)
        base = {
            "workload": name,
            "variant": ",".join(variant()) or "default",
            "pass": "complete_call",
            "heads": hq,
            "kv_heads": kv_heads,
            "gqa": gqa,
            "head_dim": 128,
            "queries": nq,
            "context": cap.context,
            "page_size": P,
            "k": cap.k,
            "useful_pairs": useful * hq,
        }

        def record(impl, ms, physical=None, **extra):
            rec = dict(base, impl=impl, time_ms=ms, physical_pairs=physical, **extra)
            rec["useful_tflops"] = 4 * rec["useful_pairs"] * 128 / (ms * 1e9)
            records.append(rec)
            log(
                f"{name:8s} G={gqa:2d} {impl:17s} {extra.get('grouping', ''):9s} {ms:9.3f} ms  "
                f"useful {rec['useful_tflops']:6.1f} TFLOP/s  correct={rec.get('correct')}"
            )

        def measure(impl, call, physical, **extra):
            """Time ``call`` (it writes o / lse), check its output on sampled queries, record it."""
            ms = timer(call)
            record(impl, ms, physical, **extra, **check_sample(cap, q, k8, v8, ks, vs, o, gqa, rng))

        if "pageweaver_union" in impls:
            measure(
                "pageweaver_union",
                lambda: union_forward(q, k8, v8, ks, vs, cap, adjacent, out=(o, lse), pack=tile_pack),
                tile_rows * 64 * chunks_of("adjacent8", adjacent, tile_pack) * kv_heads,
                grouping="adjacent8",
                pack=tile_pack,
            )

            def affinity_call():
                g = affinity_groups_device(pages_dev, cap.num_pages, 8, 64)
                union_forward(q, k8, v8, ks, vs, cap, g, out=(o, lse), pack=tile_pack)

            gms = timer(lambda: affinity_groups_device(pages_dev, cap.num_pages, 8, 64))
            host_groups = affinity_groups_device(pages_dev, cap.num_pages, 8, 64).to_host()
            measure(
                "pageweaver_union",
                affinity_call,
                tile_rows * 64 * chunks_of("affinity", host_groups, tile_pack) * kv_heads,
                grouping="affinity",
                pack=tile_pack,
                grouping_ms=gms,
            )
        if "union_singleton" in impls:
            measure(
                "union_singleton",
                lambda: union_forward(q, k8, v8, ks, vs, cap, per_query, out=(o, lse), pack=1),
                tile_rows * 64 * chunks_of("single", per_query, 1) * kv_heads,
                grouping="single",
            )
        if "per_query" in impls:
            measure(
                "per_query",
                lambda: per_query_forward(q, k8, v8, ks, vs, cap, out=(o, lse)),
                16 * 16 * steps * kv_heads,
                grouping="single",
            )
        if "kv_page_union" in impls:
            t0 = time.perf_counter()
            plan = kv_page_plan(cap)  # host work, built once per capture (not in the timed call)
            plan_s = time.perf_counter() - t0
            ms = timer(lambda: kv_page_forward(q, k8, v8, ks, vs, cap, out=(o, lse)))
            chk = check_sample(cap, q, k8, v8, ks, vs, o, gqa, rng)
            parts = []
            for _ in range(max(3, timer.reps // 2)):  # the two phases, each call after an L2 flush
                timer.flush.fill(1)
                parts.append({})
                kv_page_forward(q, k8, v8, ks, vs, cap, out=(o, lse), phases=parts[-1])
            record(
                "kv_page_union",
                ms,
                tile_rows * 64 * plan.num_items * -(-P // 64) * kv_heads,
                grouping="by_page",
                partials_ms=float(np.median([x["partials_ms"] for x in parts])),
                merge_ms=float(np.median([x["merge_ms"] for x in parts])),
                head_chunks=parts[0]["head_chunks"],
                entries=plan.num_entries,
                plan_first_s=round(plan_s, 2),
                **chk,
            )
        paths = [impl for impl in ("flashinfer", "flashinfer_bf16") if impl in impls]
        if paths and importlib.util.find_spec("flashinfer") is None:
            log("flashinfer not importable: skipped")
            for skipped in paths:
                impls.remove(skipped)
            paths = []
        if paths:
            qt = torch.randn(nq, hq, 128, dtype=torch.bfloat16, device="cuda")
        for impl in paths:
            kt, vt = flashinfer_cache(k8, v8, ks, vs, P, bf16=impl == "flashinfer_bf16")
            for backend in flashinfer_backends:
                if failed_builds is not None and (impl, backend) in failed_builds:
                    message = f"not retried: {failed_builds[impl, backend]}"
                    records.append(dict(base, impl=impl, backend=backend, error=message))
                    continue
                try:
                    t0 = time.perf_counter()
                    run = _flashinfer_calls(cap, qt, kt, vt, kv_heads, gqa, backend)
                    if run is None:
                        raise ImportError("flashinfer (or torch) did not import")
                    run()
                    cp.cuda.Device().synchronize()
                    plan_s = time.perf_counter() - t0
                    ms = timer(run)
                    record(
                        impl,
                        ms,
                        None,
                        grouping="none",
                        backend=backend,
                        plan_first_s=round(plan_s, 1),
                        correct=None,
                    )
                except Exception as err:  # noqa: BLE001 - a failing peer is recorded, the run goes on
                    message = f"{type(err).__name__}: {str(err)[:300]}"
                    records.append(dict(base, impl=impl, backend=backend, error=message))
                    log(f"{name} G={gqa} {impl} ({backend}) failed: {message}")
                    if failed_builds is not None and "build failed" in str(err).lower():
                        failed_builds[impl, backend] = (
                            f"its JIT build failed on {name} G={gqa} ({message[:120]})"
                        )
            del kt, vt
            torch.cuda.empty_cache()
        if paths:
            del qt

    for gqa in gqas:
        run_gqa(gqa)
    return records


def main(argv=None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--captures", nargs="*", default=list(BUILTIN_CAPTURES))
    ap.add_argument("--gqa", nargs="*", type=int, default=[1, 4, 8, 16])
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument(
        "--impl",
        nargs="*",
        default=["pageweaver_union", "kv_page_union", "per_query", "flashinfer", "flashinfer_bf16"],
        choices=IMPLS,
        help="implementations to run (also: union_singleton)",
    )
    ap.add_argument(
        "--flashinfer-backends",
        nargs="*",
        default=list(FLASHINFER_BACKENDS),
        help="FlashInfer backends each FlashInfer path runs on (a failing one is an error record)",
    )
    ap.add_argument(
        "--pack",
        type=int,
        default=None,
        help="groups per 64-row tile of the union kernel, capped at 8 // G (default: 8 // G; 1: one group a tile)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--variant",
        nargs="*",
        default=None,
        help="compile-time variant of the union / KV-page kernels (sparseattn.kernels.pageweaver.VARIANTS)",
    )
    args = ap.parse_args(argv)
    if args.pack is not None and args.pack < 1:
        ap.error(f"--pack must be at least 1, got {args.pack}")
    try:
        import cupy  # noqa: F401 - the suite needs it; say so plainly when it is missing
    except ImportError:
        print(
            "sparseattn bench pageweaver needs cupy and a CUDA GPU: pip install -e '.[gpu]'", file=sys.stderr
        )
        return 1
    from ..kernels import pageweaver
    from .gpu_bench import RunLog

    if args.variant is not None:
        pageweaver.set_variant(*args.variant)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = RunLog()
    log(
        f"gpu {log.gpu}; kv_heads {args.kv_heads}; reps {args.reps} (median, L2 flushed before each call); "
        f"union kernel variant {','.join(pageweaver.variant()) or 'default'}"
    )
    timer = Timer(args.reps)
    rng = np.random.default_rng(args.seed)
    records = []
    failed_builds: dict = {}
    command = "sparseattn bench pageweaver " + " ".join(sys.argv[1:] if argv is None else argv)
    for name in args.captures:
        records += bench_capture(
            name,
            args.gqa,
            args.kv_heads,
            timer,
            list(args.impl),
            rng,
            log,
            tuple(args.flashinfer_backends),
            failed_builds,
            args.pack,
        )
        log.write(
            out, "pageweaver_kernels", command, records
        )  # after every capture: a cut run keeps its records
    return 0 if all(r.get("correct") in (True, None) for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
