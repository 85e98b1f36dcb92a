"""``torch.compile`` and CUDA graphs of a Wan transformer with the KPage processor
(``python -m sparseattn.wan_compile``).

A Wan2.1-1.3B-shaped ``WanTransformer3DModel`` (random init, bf16; 30 layers by default) at 480p, 81 frames
(32,760 tokens), every block's self-attention KPage STA over 128-token tiles (4 x 4 x 8, window 3 x 3 x 3):

1. ``torch._dynamo.explain`` of the forward: graph count, graph breaks and their reasons (written to
   ``<out>.explain.txt``);
2. ``torch.compile(model, fullgraph=True)`` (inductor): the forward step's output against eager, and the
   forward and training step times (median of ``--reps`` after warm-up), eager and compiled;
3. a training step (forward, loss, backward into the parameters' ``.grad``) of the first
   ``--graph-layers`` layers captured with ``torch.cuda.graph``: replayed on new inputs, its loss and
   gradients against eager, and the step time of replay against eager.

Records (bench format, ``--out``): workload ``wan1.3b_480p``, impl ``kpage_sta`` (eager),
``kpage_sta_compiled``, ``kpage_sta_cuda_graph`` (``--token-order tiles``: ``kpage_sta_tiles`` ..., the model's
tokens kept tile-major); pass ``step_fwd`` / ``step_train``; ``time_ms``; the checks
(``rel_err``, ``correct``) and ``graph_breaks``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

TILE, WINDOW = (4, 4, 8), (3, 3, 3)


def _model(layers: int):
    import torch
    from diffusers import WanTransformer3DModel

    from .wan_bench import WAN_1_3B

    torch.manual_seed(0)
    with torch.device("cuda"):
        return WanTransformer3DModel(**{**WAN_1_3B, "num_layers": layers}).to(torch.bfloat16)


def _inputs(seed: int, latent):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(1, 16, *latent, device="cuda", dtype=torch.bfloat16, generator=g)
    text = torch.randn(1, 512, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    return x, torch.tensor([500], device="cuda"), text


def _timed(fn, warmup: int, reps: int) -> list[float]:
    import torch

    out = []
    for i in range(warmup + reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i >= warmup:
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _order(args):
    """``install_sparse_attention``'s ``token_order`` of the run (None: the processors' default)."""
    return "tiles" if args.token_order == "tiles" else None


def _impl(args) -> str:
    return "kpage_sta_tiles" if _order(args) else "kpage_sta"


def run(args, explain_path: Path) -> list[dict]:
    import torch

    from .diffusers_wan import WanSelection, install_sparse_attention
    from .wan_bench import LATENTS

    latent = LATENTS["480p"]
    grid = (latent[0], latent[1] // 2, latent[2] // 2)
    base = dict(workload="wan1.3b_480p", tokens=math.prod(grid), heads=12, tile=TILE, window=WINDOW)
    selection = WanSelection.sta(TILE, WINDOW)
    records = []

    model = _model(args.layers)
    install_sparse_attention(model, grid, selection, backend="kpage", token_order=_order(args))
    x, t, text = _inputs(1, latent)
    base["layers"] = args.layers

    explained = torch._dynamo.explain(model)(x, t, text, return_dict=False)
    explain_path.write_text(str(explained))
    breaks = int(explained.graph_break_count)
    print(f"explain: {explained.graph_count} graph(s), {breaks} break(s)", file=sys.stderr, flush=True)
    torch._dynamo.reset()

    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        eager_out = model(x, t, text, return_dict=False)[0]
        t0 = time.perf_counter()
        compiled_out = compiled(x, t, text, return_dict=False)[0]
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
    rel = _rel(compiled_out, eager_out)
    check = dict(rel_err=rel, correct=bool(rel < 2e-2), graph_breaks=breaks)
    print(
        f"compiled forward vs eager: rel {rel:.2e} (compile {compile_s:.0f} s)", file=sys.stderr, flush=True
    )

    def fwd(m):
        with torch.no_grad():
            m(x, t, text, return_dict=False)

    def train(m):
        m.zero_grad(set_to_none=True)
        m(x, t, text, return_dict=False)[0].float().square().mean().backward()

    name = _impl(args)
    for impl, m in ((name, model), (f"{name}_compiled", compiled)):
        for pass_, step in (("step_fwd", fwd), ("step_train", train)):
            model.train(pass_ == "step_train")
            try:
                times = _timed(lambda step=step, m=m: step(m), args.warmup, args.reps)
            except Exception as exc:  # noqa: BLE001 - recorded, the rest still runs
                records.append(
                    dict(base, impl=impl, **{"pass": pass_}, error=f"{type(exc).__name__}: {exc}"[:300])
                )
                continue
            extra = dict(check, compile_s=round(compile_s, 1)) if impl.endswith("compiled") else {}
            records.append(
                dict(
                    base,
                    impl=impl,
                    **{"pass": pass_},
                    time_ms=round(statistics.median(times), 2),
                    times_ms=[round(v, 2) for v in times],
                    **extra,
                )
            )
            print(f"{impl} {pass_}: {statistics.median(times):.1f} ms", file=sys.stderr, flush=True)
    compiled = model = None
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    records.extend(graph_step(args, latent, grid, selection, base))
    return records


def captured_training_step(model, static: list):
    """A training step of ``model`` on the tensors ``static`` (forward, squared-output loss, backward into
    the parameters' ``.grad``) captured in a CUDA graph after two warm-up steps on a side stream.

    Returns ``(graph, loss, grads, eager_step)``: replaying ``graph`` refills the captured ``loss`` and
    ``grads`` (one per parameter that requires grad) from whatever ``static`` holds; ``eager_step()`` runs
    the same step eagerly and returns its loss (the parameters' ``.grad`` then hold its gradients)."""
    from .torch import capture_cuda_graph

    params = [p for p in model.parameters() if p.requires_grad]

    def eager_step():
        for p in params:
            p.grad = None
        loss = model(*static, return_dict=False)[0].float().square().mean()
        loss.backward()
        return loss.detach()

    # the captured step sets every .grad to None first, so the capture makes them and replays rewrite them
    graph, loss = capture_cuda_graph(eager_step, warmup=2)
    return graph, loss, [p.grad for p in params], eager_step


def graph_step(args, latent, grid, selection, base) -> list[dict]:
    """A training step of ``--graph-layers`` layers captured in a CUDA graph, replay against eager."""
    import torch

    from .diffusers_wan import install_sparse_attention

    model = _model(args.graph_layers)
    install_sparse_attention(model, grid, selection, backend="kpage", token_order=_order(args))
    model.train()
    static = [v.clone() for v in _inputs(2, latent)]
    graph, loss, grads, eager_step = captured_training_step(model, static)
    params = [p for p in model.parameters() if p.requires_grad]
    worst = 0.0
    for seed in (3, 4):
        for buf, v in zip(static, _inputs(seed, latent)):
            buf.copy_(v)
        graph.replay()
        replayed_loss, replayed = loss.clone(), torch.cat([g.float().flatten() for g in grads])
        eager_loss = eager_step()
        eager = torch.cat([p.grad.float().flatten() for p in params])
        worst = max(worst, _rel(replayed, eager), abs(float(replayed_loss / eager_loss) - 1))
    check = dict(rel_err=worst, correct=bool(worst < 1e-2))
    print(f"CUDA graph replay vs eager: rel {worst:.2e}", file=sys.stderr, flush=True)
    out = []
    name = _impl(args)
    for impl, fn in ((name, eager_step), (f"{name}_cuda_graph", graph.replay)):
        times = _timed(fn, args.warmup, args.reps)
        out.append(
            dict(
                base,
                layers=args.graph_layers,
                impl=impl,
                **{"pass": "step_train"},
                time_ms=round(statistics.median(times), 2),
                times_ms=[round(v, 2) for v in times],
                **(check if impl.endswith("graph") else {}),
            )
        )
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sparseattn.wan_compile", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--graph-layers", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--token-order",
        choices=("default", "tiles"),
        default="default",
        help="tiles: the model's tokens kept tile-major (install_sparse_attention(..., token_order='tiles')); "
        "impls kpage_sta_tiles*",
    )
    parser.add_argument("--out", default=None, help="JSON path (default data/bench/wan_compile_<date>.json)")
    args = parser.parse_args(argv)
    from .bench import run_path, write_run

    out = run_path(args.out, "wan_compile")
    records = run(args, out.with_suffix(".explain.txt"))
    model = f"Wan2.1-1.3B-shaped WanTransformer3DModel, random init, bf16, {args.layers} layers"
    write_run(out, "python -m sparseattn.wan_compile", argv, records, model=model)
    for r in records:
        if "error" in r:
            print(f"{r['impl']:<22} {r['pass']:<11} {r['error']}")
        else:
            extra = "" if "rel_err" not in r else f"  rel {r['rel_err']:.1e} correct={r['correct']}"
            print(f"{r['impl']:<22} {r['pass']:<11} {r['layers']:>3} layers {r['time_ms']:9.1f} ms{extra}")
    print(f"wrote {out}")
    return 0 if all(r.get("correct") is not False for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
