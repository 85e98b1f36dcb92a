"""Whole Wan steps with sparse self-attention selected on the GPU every call (``python -m sparseattn.wan_bench``).

A Wan2.1-1.3B-shaped ``WanTransformer3DModel`` (30 layers, 12 heads of 128, FFN 8960; random init, bf16)
runs one denoising step at 480p and 720p (81 frames: latents of 21 x 60 x 104 and 21 x 90 x 160, tokens
after (1, 2, 2) patching 32,760 and 75,600), as a forward step (no grad) and as a training step (forward
and backward of a squared-error loss, no optimizer). Self-attention runs, in every block:

* ``dense``: cuDNN SDPA over all tokens;
* ``kpage_vsa``: VSA's selection on the GPU every call (cube means of q and k, each Q cube's top 10% of the
  cubes; :func:`sparseattn.torch.vsa_topk`), planned on the GPU and run by the KPage kernels
  (:func:`sparseattn.torch.block_sparse_attention`);
* ``kpage_vsa_tokens`` (opt-in, ``--impl``): ``kpage_vsa`` with the token-order forward (no moves into or out of slot order,
  the selection's cube sums gathered from the tokens; :func:`sparseattn.torch.token_order_attention`);
  a training step runs ``kpage_vsa``'s path unless ``SPARSEATTN_TOKEN_BACKWARD=1`` asks for the backward's
  token-order build too;
* ``kpage_vsa_slots`` (opt-in): ``kpage_vsa`` in slot order in forward calls too (every tensor moved; the
  processors' default runs the Q/O token build there: q and o stay in token order, k and v move to slots);
* ``vsa_kernel``: the same selection, run by the VSA system's kernel (``fastvideo-kernel`` 0.3.4, its
  Triton path, ``block_sparse_attn_from_indices``), when installed.

Records: ``step_fwd`` / ``step_train`` (the whole step) and ``attn_fwd`` / ``attn_train`` (the attention
part: CUDA events around every processor's attention call — token-to-slot scatter, selection, planning,
attention, gather — summed over the step's layers; in training also its backward, from the gradient reaching
the attention's output to the last gradient of its inputs), median of ``--reps`` steps after a warm-up.
Before timing, one layer's attention output of every sparse impl is checked against masked SDPA on the
same selection (``rel_err``, ``correct``). Writes one JSON (``--out``) in the bench format.

``sparseattn bench model wan`` (:mod:`sparseattn.model_bench`) runs these rows beside STA (KPage and
compiled FlexAttention on 128-token tiles), on Wan2.1-1.3B- and 14B-shaped models, at both resolutions in
training as well; this script stays as the VSA-only run behind ``data/bench/wan_steps_vsa_*``.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

#: Wan2.1-1.3B's transformer (diffusers' config names).
WAN_1_3B = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=12,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=8960,
    num_layers=30,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
)
#: Latent (frames, height, width) of 81 frames: 480p and 720p.
LATENTS = {"480p": (21, 60, 104), "720p": (21, 90, 160)}
IMPLS = ("dense", "kpage_vsa", "vsa_kernel")
#: Run only when named (``--impl``).
OPT_IN_IMPLS = ("kpage_vsa_tokens", "kpage_vsa_slots")
TOPK_FRACTION = 0.1


#: A KPage impl's name suffix -> its processors' ``token_order`` (no suffix: the processors' default; forward
#: calls only: training calls move as the default's do).
TOKEN_ORDER_SUFFIXES = {"_tokens": True, "_slots": False, "_tiles": "tiles"}


def token_order_of(impl: str):
    """The ``token_order`` of a KPage impl (``kpage_vsa_tiles`` -> ``"tiles"``; None: the default)."""
    return next((order for s, order in TOKEN_ORDER_SUFFIXES.items() if impl.endswith(s)), None)


def processors(grid, impl: str):
    """The self-attention processor of an impl (one instance shared by the blocks)."""
    import torch

    from .diffusers_wan import WanSelection, WanSparseAttnProcessor

    blocks = math.prod(-(-g // t) for g, t in zip(grid, (4, 4, 4)))
    selection = WanSelection.vsa((4, 4, 4), topk=math.ceil(TOPK_FRACTION * blocks))
    if impl == "kpage_vsa" or impl.startswith("kpage_vsa_"):
        return WanSparseAttnProcessor(grid, selection, backend="kpage", token_order=token_order_of(impl))
    if impl == "dense":
        processor = WanSparseAttnProcessor(grid, WanSelection.full((4, 4, 4)), backend="masked_sdpa")

        def dense(q, k, v):
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
                out = torch.nn.functional.scaled_dot_product_attention(
                    *(x.transpose(1, 2) for x in (q, k, v))
                )
            return out.transpose(1, 2)

        processor.attend = dense
        return processor
    if impl == "vsa_kernel":
        os.environ.setdefault("FASTVIDEO_VSA_TRITON", "1")
        from fastvideo_kernel.block_sparse_attn import block_sparse_attn_from_indices

        from .torch import slots_to_tokens, tokens_to_slots, vsa_topk

        processor = WanSparseAttnProcessor(grid, selection, backend="kpage")
        sizes = {}

        def vsa_kernel(q, k, v):  # the kpage_vsa processor's steps, the VSA kernel for the attention
            lay = processor.layout
            qs, ks, vs = tokens_to_slots(lay, q, k, v)
            with torch.no_grad():
                idx, num = vsa_topk(qs, ks, lay, selection.topk)
            if q.device not in sizes:
                sizes[q.device] = torch.tensor(lay.valid_rows.astype("int32"), device=q.device)
            out, _ = block_sparse_attn_from_indices(qs, ks, vs, idx, num, sizes[q.device])
            return slots_to_tokens(lay, out).to(q.dtype)

        processor.attend = vsa_kernel
        return processor
    raise ValueError(f"impl must be one of {IMPLS + OPT_IN_IMPLS}, got {impl!r}")


#: Token grid of the one-layer check (masked SDPA holds a [heads, tokens, tokens] mask).
CHECK_GRID = (8, 16, 24)


def check_layer(grid, impl: str, heads: int, head_dim: int, seed: int = 0) -> float:
    """‖attend − masked SDPA‖ / ‖masked SDPA‖ of one layer's attention (the impl's processor on ``grid``)
    on random q, k, v, the same selection in both."""
    import torch

    from .diffusers_wan import WanSparseAttnProcessor

    processor = processors(grid, impl)
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (1, math.prod(grid), heads, head_dim)
    q, k, v = (torch.randn(shape, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    order = "tiles" if getattr(processor, "token_order", None) == "tiles" else None  # the same token order
    reference = WanSparseAttnProcessor(grid, processor.selection, backend="masked_sdpa", token_order=order)
    with torch.no_grad():
        got = processor.attend(q, k, v).float()
        want = reference.attend(q.float(), k.float(), v.float())
    return float((got - want).norm() / want.norm())


def run(args) -> list[dict]:
    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = WanTransformer3DModel(**{**WAN_1_3B, "num_layers": args.layers}).to(torch.bfloat16)
    records = []
    for name in args.resolution:
        frames, height, width = LATENTS[name]
        grid = (frames, height // 2, width // 2)
        g = torch.Generator(device="cuda").manual_seed(1)
        x = torch.randn(1, 16, frames, height, width, device="cuda", dtype=torch.bfloat16, generator=g)
        t = torch.tensor([500], device="cuda")
        text = torch.randn(1, 512, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
        for impl in args.impl:
            base = dict(
                workload=f"wan1.3b_{name}", impl=impl, layers=args.layers, tokens=math.prod(grid), heads=12
            )
            try:
                processor = processors(grid, impl)
            except Exception as exc:  # noqa: BLE001 - a peer that does not load is recorded
                records.append(dict(base, **{"pass": "step_fwd"}, error=f"{type(exc).__name__}: {exc}"[:300]))
                continue
            checked = {}
            if impl != "dense":
                rel = check_layer(CHECK_GRID, impl, 12, 128)
                checked = dict(rel_err=rel, correct=bool(rel < 2e-2))
            from .model_bench import AttentionClock, time_mode  # (model_bench imports this module)

            clock = AttentionClock()
            processor.attend = clock.wrap(processor.attend)
            for block in model.blocks:
                block.attn1.set_processor(processor)
            modes = [("fwd", False)] + ([("train", True)] if name in args.train else [])
            for mode, train in modes:
                try:
                    steps, attention, _ = time_mode(
                        model, (x, t, text), clock, train, args.warmup, args.reps, "cuda"
                    )
                except Exception as exc:  # noqa: BLE001 - recorded, the other impls still run
                    records.append(
                        dict(base, **{"pass": f"step_{mode}"}, error=f"{type(exc).__name__}: {exc}"[:300])
                    )
                    continue
                for pass_, times in ((f"step_{mode}", steps), (f"attn_{mode}", attention)):
                    records.append(
                        dict(
                            base,
                            **{"pass": pass_},
                            time_ms=round(statistics.median(times), 2),
                            times_ms=[round(x, 2) for x in times],
                            **checked,
                        )
                    )
                print(
                    f"{base['workload']} {impl} {mode}: step {statistics.median(steps):.1f} ms, "
                    f"attention {statistics.median(attention):.1f} ms {checked}",
                    flush=True,
                )
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sparseattn.wan_bench", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--resolution", action="append", choices=sorted(LATENTS), help="default: 480p and 720p"
    )
    parser.add_argument(
        "--train", action="append", choices=sorted(LATENTS), help="training steps at (default 480p)"
    )
    parser.add_argument(
        "--no-train",
        action="store_true",
        help="forward steps only (a 480p training step of all 30 layers does not fit 80 GB)",
    )
    parser.add_argument(
        "--impl", action="append", choices=IMPLS + OPT_IN_IMPLS, help=f"default: {', '.join(IMPLS)}"
    )
    parser.add_argument("--layers", type=int, default=WAN_1_3B["num_layers"])
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=None, help="JSON path (default data/bench/wan_steps_<date>.json)")
    args = parser.parse_args(argv)
    args.resolution = args.resolution or ["480p", "720p"]
    args.train = [] if args.no_train else args.train or ["480p"]
    args.impl = args.impl or list(IMPLS)
    from .bench import run_path, write_run

    records = run(args)
    model = "Wan2.1-1.3B-shaped WanTransformer3DModel, random init, bf16, " + f"{args.layers} layers"
    out = write_run(
        run_path(args.out, "wan_steps"), "python -m sparseattn.wan_bench", argv, records, model=model
    )
    print(f"wrote {out}")
    return 0 if all(r.get("correct") is not False for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
