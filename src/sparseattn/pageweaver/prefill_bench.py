"""Whole-model sparse prefill: a random-init Llama-like ``transformers`` model whose attention layers
select each query's pages on the GPU, timed per backend (:mod:`.prefill`).

``sparseattn bench model prefill`` (or ``python -m sparseattn.pageweaver.prefill_bench``) runs, for every
context length, one prefill per backend on the same model and tokens:

* ``union``: PageWeaver's union kernel after the GPU grouping, on the FP8 cache;
* ``flashinfer``: FlashInfer's block-sparse wrapper on the same selection and FP8 (e4m3) cache, the native
  path of a model that keeps an FP8 cache;
* ``flashinfer_bf16``: the same wrapper and selection with K and V in bf16 (twice the cache's memory);
* ``sdpa``: the model's own dense causal attention (bf16, no cache quantisation).

Records (``pass`` ``prefill``): ``time_ms`` (median whole prefill), ``tokens_per_s``, ``attn_ms`` (CUDA
events around every attention call, summed over the layers) and ``parts_ms`` (its split: selection, FP8
or bf16 cache, grouping, FlashInfer's plan, the attention kernel). ``--captures-out DIR`` also writes each
layer's page selection of the union run as a PageWeaver capture (``sparseattn analyze --captures DIR/*.npz`` reads
them; the model's weights are random, and the captures say so).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

#: A Llama-like shape: 8 KV heads of 128 (GQA 4), width 4096, FFN 14336 (Llama-3-8B's), random init.
LLAMA_SHAPE = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
)
BENCH_BACKENDS = ("union", "flashinfer", "flashinfer_bf16", "sdpa")
IMPL_OF = {
    "union": "pageweaver_union",
    "flashinfer": "flashinfer_e4m3",
    "flashinfer_bf16": "flashinfer_bf16",
    "sdpa": "sdpa_dense",
    "reference": "masked_reference",  # float32 masked attention on the dequantised cache: CPU smoke runs
}
#: impl names of the first recorded runs (2026-12-02), read as today's.
LEGACY_IMPLS = {"pageweaver_flashinfer": "flashinfer_e4m3"}


def model_description(layers: int, shape=None) -> str:
    s = shape or LLAMA_SHAPE
    return (
        f"Llama-like (width {s['hidden_size']}, {s['num_attention_heads']} heads on "
        f"{s['num_key_value_heads']} KV heads of {s['head_dim']}, FFN {s['intermediate_size']}), random init, "
        f"bf16, {layers} layers"
    )


def bench(
    contexts,
    layers: int,
    backends=BENCH_BACKENDS,
    reps: int = 3,
    budget=(1, 2, 13),
    page_size: int = 64,
    captures_out=None,
    device: str = "cuda",
    log=print,
    shape=None,
) -> list[dict]:
    """Records of whole prefills (batch 1) per context and backend (module docstring); ``shape`` overrides
    :data:`LLAMA_SHAPE` (tiny models for CPU checks)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from .prefill import PrefillAttention, register

    unknown = [b for b in backends if b not in IMPL_OF]
    if unknown:
        raise ValueError(f"unknown backend {unknown[0]!r}; backends: {', '.join(IMPL_OF)}")
    contexts = [int(c) for c in contexts]
    shape = dict(shape or LLAMA_SHAPE)
    config = LlamaConfig(**shape, num_hidden_layers=layers, max_position_embeddings=max(max(contexts), 8192))
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    sink, local, top = budget
    cuda = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    records = []
    for context in contexts:
        gen = torch.Generator(device).manual_seed(1)
        ids = torch.randint(0, config.vocab_size, (1, context), device=device, generator=gen)
        base = dict(
            workload=f"llama_prefill_{context}",
            **{"pass": "prefill"},
            tokens=context,
            layers=layers,
            hidden=config.hidden_size,
            heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads,
            head_dim=shape["head_dim"],
            page_size=page_size,
            sink=sink,
            local=local,
            top=top,
        )
        for backend in backends:
            rec = dict(base, impl=IMPL_OF[backend])
            attn = None
            if backend == "sdpa":
                model.config._attn_implementation = "sdpa"
            else:
                keep = captures_out is not None and backend in ("union", "reference")
                attn = PrefillAttention(
                    backend, page_size, sink, local, top, timed=cuda, keep_selections=keep
                )
                model.config._attn_implementation = register(attn, f"pw_prefill_{backend}")
            t_start = time.perf_counter()
            try:
                times, attn_ms, parts = [], [], []
                for i in range(reps + 1):
                    if attn is not None:
                        attn.reset()
                    sync()
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        model(ids)
                    sync()
                    if i:  # the first is the warm-up (kernel compiles, FlashInfer's JIT)
                        times.append((time.perf_counter() - t0) * 1e3)
                        if attn is not None and cuda:
                            parts.append(attn.part_times())
                            attn_ms.append(sum(parts[-1].values()))  # the parts tile each call
                ms = statistics.median(times)
                rec.update(time_ms=round(ms, 2), tokens_per_s=round(context / ms * 1e3, 1), times_ms=times)
                if attn_ms:
                    rec["attn_ms"] = round(statistics.median(attn_ms), 2)
                    rec["parts_ms"] = {
                        p: round(statistics.median(t.get(p, 0.0) for t in parts), 2) for p in parts[0]
                    }
                if attn is not None and attn.keep_selections:
                    rec["captures"] = _write_captures(attn, context, layers, captures_out)
            except Exception as exc:  # noqa: BLE001 - a failing backend is recorded, the others still run
                rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
            parts_text = ", ".join(f"{p} {t:.1f}" for p, t in rec.get("parts_ms", {}).items())
            log(
                f"[{context}] {rec['impl']}: "
                + (
                    f"{rec['time_ms']:.1f} ms, {rec['tokens_per_s']:,.0f} tokens/s"
                    if "time_ms" in rec
                    else rec["error"]
                )
                + (f"; attention {rec['attn_ms']:.1f} ms ({parts_text})" if "attn_ms" in rec else "")
                + f" [{time.perf_counter() - t_start:.0f} s]"
            )
            records.append(rec)
            if attn is not None:
                attn.reset()
    return records


def _write_captures(attn, context: int, layers: int, out_dir) -> list[str]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [str(c.save(out / f"{c.name}.npz")) for c in attn.captures(context, layers)]


def record_impl(rec: dict) -> str:
    """A record's implementation under today's name (:data:`LEGACY_IMPLS`)."""
    return LEGACY_IMPLS.get(rec["impl"], rec["impl"])


def markdown_table(records: list[dict]) -> str:
    """The README's table: per context, each backend's tokens/s (attention part, ms) and the union's
    throughput over the fastest FlashInfer path and over FlashInfer e4m3."""
    by = {(r["tokens"], record_impl(r)): r for r in records if "time_ms" in r}
    impls = [i for i in IMPL_OF.values() if any(k[1] == i for k in by)]
    names = {
        "pageweaver_union": "union (FP8 cache)",
        "flashinfer_e4m3": "FlashInfer e4m3",
        "flashinfer_bf16": "FlashInfer bf16 cache",
        "sdpa_dense": "dense causal SDPA",
        "masked_reference": "masked reference",
    }
    head = ["context", *(names[i] for i in impls), "union ÷ fastest FlashInfer", "union ÷ FlashInfer e4m3"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for tokens in sorted({k[0] for k in by}):
        cells = [f"{tokens // 1024}K"]
        for impl in impls:
            r = by.get((tokens, impl))
            if r is None:
                cells.append("–")
                continue
            attn = f" ({r['attn_ms']:.1f})" if "attn_ms" in r else ""
            cells.append(f"{r['tokens_per_s']:,.0f}{attn}")
        union = by.get((tokens, "pageweaver_union"))
        fi = [by[(tokens, i)] for i in ("flashinfer_e4m3", "flashinfer_bf16") if (tokens, i) in by]
        best = max(fi, key=lambda r: r["tokens_per_s"]) if fi else None
        e4m3 = by.get((tokens, "flashinfer_e4m3"))
        cells.append(f"{union['tokens_per_s'] / best['tokens_per_s']:.2f}×" if union and best else "–")
        cells.append(f"{union['tokens_per_s'] / e4m3['tokens_per_s']:.2f}×" if union and e4m3 else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    try:
        values = [
            int(t.strip().lower().replace("k", "")) * (1024 if "k" in t.lower() else 1)
            for t in text.split(",")
        ]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a comma list of token counts (8192 or 8k), got {text!r}"
        ) from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"token counts must be positive, got {text!r}")
    return values


def build_parser(prog: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    ap.add_argument(
        "--context", type=_ints, default=[8192, 32768, 65536], help="comma list (default 8k,32k,64k)"
    )
    ap.add_argument("--layers", type=int, default=4, help="layers of the Llama-like model (default 4)")
    ap.add_argument(
        "--backends", default=",".join(BENCH_BACKENDS), help=f"comma list of {', '.join(IMPL_OF)}"
    )
    ap.add_argument("--reps", type=int, default=3, help="timed prefills per record (median; default 3)")
    ap.add_argument("--budget", default="1,2,13", help="sink,local,top pages (default 1,2,13: 16 pages)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--captures-out", default=None, help="write the union run's selections here as captures")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (tiny smoke runs)")
    ap.add_argument("--out", default=None, help="JSON path (default data/bench/llama_prefill_<date>.json)")
    ap.add_argument("--markdown", metavar="JSON", help="print the README table of a recorded run and exit")
    return ap


def main(argv=None, prog: str = "python -m sparseattn.pageweaver.prefill_bench") -> int:
    from ..bench import run_path, write_run
    from ..benchdata import load_run

    args = build_parser(prog).parse_args(argv)
    if args.markdown:
        print(markdown_table(load_run(args.markdown).records))
        return 0
    budget = tuple(int(x) for x in args.budget.split(","))
    if len(budget) != 3:
        raise SystemExit(f"{prog}: --budget takes sink,local,top, got {args.budget!r}")
    records = bench(
        args.context,
        args.layers,
        [b.strip() for b in args.backends.split(",") if b.strip()],
        args.reps,
        budget,
        args.page_size,
        args.captures_out,
        args.device,
    )
    out = write_run(
        run_path(args.out, "llama_prefill"), prog, argv, records, model=model_description(args.layers)
    )
    print(markdown_table(records))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
