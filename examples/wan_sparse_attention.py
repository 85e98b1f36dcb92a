"""Sparse self-attention inside diffusers' Wan transformer on a GPU, end to end.

    python examples/wan_sparse_attention.py                     # Wan2.1-1.3B-shaped, random init, 480p
    python examples/wan_sparse_attention.py --model DIR         # a local diffusers Wan transformer folder
    python examples/wan_sparse_attention.py --selection vsa     # VSA's top 10% selected on the GPU
    python examples/wan_sparse_attention.py --raster            # the model's tokens kept in raster order
    python examples/wan_sparse_attention.py --tiny --device cpu --backend masked_sdpa   # anywhere

One denoising forward of an 81-frame 480p latent (21 x 60 x 104; 32,760 tokens after patching) with
diffusers' own attention, then the same with the sparse processor installed in every block; prints both
times and how far the sparse output is from the dense one. Needs torch, diffusers and, for the KPage
backend, a CUDA GPU with cupy: ``pip install -e '.[gpu,diffusers]'``.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from diffusers import WanTransformer3DModel

from sparseattn.diffusers_wan import WanSelection, install_sparse_attention
from sparseattn.model_bench import WAN_1_3B, WAN_TINY


def forward(model, inputs, device) -> tuple[torch.Tensor, float]:
    """(output, milliseconds) of one forward without gradients."""
    with torch.no_grad():
        model(*inputs, return_dict=False)  # warm-up: plans, kernels
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = model(*inputs, return_dict=False)[0]
        if device == "cuda":
            torch.cuda.synchronize()
    return out, (time.perf_counter() - start) * 1e3


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="folder of a diffusers WanTransformer3DModel (default: random init)")
    parser.add_argument("--selection", choices=("sta", "vsa"), default="sta")
    parser.add_argument("--backend", choices=("kpage", "masked_sdpa"), default="kpage")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer toy model and latent (CPU checks)")
    parser.add_argument(
        "--raster",
        action="store_true",
        help="keep the model's tokens in raster order (KPage's default here: tile-major between the blocks, "
        "so no token moves around the kernel)",
    )
    args = parser.parse_args(argv)
    device, dtype = args.device, torch.bfloat16 if args.device == "cuda" else torch.float32

    # 1. A Wan transformer (a local checkpoint, or random init in Wan2.1-1.3B's shape).
    torch.manual_seed(0)
    if args.model:
        model = WanTransformer3DModel.from_pretrained(args.model, torch_dtype=dtype).to(device)
    else:
        with torch.device(device):
            model = WanTransformer3DModel(**(WAN_TINY if args.tiny else WAN_1_3B)).to(dtype)
    cfg = model.config

    # 2. Inputs: a latent of 81 frames at 480p, a timestep, text states.
    latent = (4, 8, 16) if args.tiny else (21, 60, 104)
    x = torch.randn(1, cfg.in_channels, *latent, device=device, dtype=dtype)
    t = torch.tensor([500], device=device)
    text = torch.randn(1, 8 if args.tiny else 512, cfg.text_dim, device=device, dtype=dtype)
    dense, dense_ms = forward(model, (x, t, text), device)

    # 3. The sparse processor in every block: the token grid after Wan's (1, 2, 2) patching, a selection.
    grid = (latent[0], latent[1] // 2, latent[2] // 2)
    if args.selection == "sta":  # a window of 3 x 3 x 3 tiles of 4 x 4 x 8 tokens (128-token blocks)
        tile, window = ((2, 2, 4), (1, 1, 1)) if args.tiny else ((4, 4, 8), (3, 3, 3))
        selection = WanSelection.sta(tile=tile, window=window)
    else:  # each query cube's top 10% of the 4 x 4 x 4 cubes, selected on the GPU every call
        cubes = math.prod(-(-g // 4) for g in grid)
        selection = WanSelection.vsa(tile=(4, 4, 4), topk=max(1, math.ceil(0.1 * cubes)))
    order = "qo" if args.raster else None  # None: install_sparse_attention's (KPage: tile-major tokens)
    install_sparse_attention(model, grid=grid, selection=selection, backend=args.backend, token_order=order)
    sparse, sparse_ms = forward(model, (x, t, text), device)

    diff = float((sparse.float() - dense.float()).norm() / dense.float().norm())
    print(f"{math.prod(grid):,} tokens, {len(model.blocks)} layers on {device}")
    print(f"dense (diffusers' attention): {dense_ms:8.1f} ms")
    print(f"sparse ({args.selection}, {args.backend}):  {sparse_ms:8.1f} ms  ({dense_ms / sparse_ms:.2f}x)")
    print(f"‖sparse − dense‖ / ‖dense‖ = {diff:.3f} (the sparse graph drops pairs; it is not an error)")
    return diff


if __name__ == "__main__":
    main()
