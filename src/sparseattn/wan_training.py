"""Training check of the Wan processor: the same tiny random-init Wan trained with KPage and with masked SDPA.

``python -m sparseattn.wan_training --out DIR [--steps 300] [--selection sta|vsa] [--device cuda]``

A ``WanTransformer3DModel`` (2 layers, 2 heads of 64, random init, fixed seed) learns a rectified-flow
velocity on synthetic latents: smooth random videos (low-frequency Fourier fields) with random text
embeddings. Every backend starts from the same weights and sees the same batches. Only self-attention
differs, through :class:`~sparseattn.diffusers_wan.WanSparseAttnProcessor`. On the GPU the default
backends are ``kpage`` and ``masked_sdpa``; elsewhere only ``masked_sdpa`` runs. Writes
``DIR/wan_training.json`` (losses per step and backend) and ``DIR/wan_training.png`` (the curves and
their relative difference). ``--replot FILE.json`` redraws the figure of a recorded run, no torch needed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

LATENT = (8, 16, 16)  # frames, height, width of the latent; tokens after (1, 2, 2) patching: (8, 8, 8)


def tiny_wan(seed: int = 0, head_dim: int = 64, text_dim: int = 32, ffn_dim: int = 128):
    """A random-init ``WanTransformer3DModel`` small enough for checks: 2 layers of 2 heads, 4 latent channels."""
    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=head_dim,
        in_channels=4,
        out_channels=4,
        text_dim=text_dim,
        freq_dim=32,
        ffn_dim=ffn_dim,
        num_layers=2,
        cross_attn_norm=True,
        rope_max_seq_len=64,
    )


def selection_of(name: str):
    from .diffusers_wan import WanSelection

    return WanSelection.sta((4, 4, 4), (1, 1, 1)) if name == "sta" else WanSelection.vsa((4, 4, 4), 2)


def smooth_latents(gen, batch: int, device):
    """[batch, 4, *LATENT] sums of a few random low-frequency waves, unit variance."""
    import torch

    f, h, w = LATENT
    grid = torch.stack(
        torch.meshgrid(*(torch.linspace(0, 1, n, device=device) for n in (f, h, w)), indexing="ij")
    )
    freq = torch.randint(0, 3, (batch, 4, 6, 3), generator=gen, device=device).float()
    phase = torch.rand(batch, 4, 6, 1, 1, 1, generator=gen, device=device) * 6.283
    waves = torch.cos(6.283 * torch.einsum("bcwa,afhv->bcwfhv", freq, grid) + phase)
    return waves.sum(2) / 6**0.5


def train(backend: str, selection: str, steps: int, device: str, seed: int = 0, log=print) -> list[float]:
    import torch

    from .diffusers_wan import install_sparse_attention

    model = tiny_wan(seed, ffn_dim=256).to(device)
    grid = (LATENT[0], LATENT[1] // 2, LATENT[2] // 2)
    install_sparse_attention(model, grid, selection_of(selection), backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    text = torch.randn(8, 9, 32, generator=gen, device=device)
    losses = []
    t0 = time.time()
    for step in range(steps):
        x1 = smooth_latents(gen, 4, device)
        x0 = torch.randn(x1.shape, generator=gen, device=device)
        t = torch.rand(4, generator=gen, device=device)
        xt = (1 - t.view(-1, 1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1, 1) * x1
        enc = text[torch.randint(0, 8, (4,), generator=gen, device=device)]
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=device.startswith("cuda")):
            v = model(xt, (t * 1000).long(), enc, return_dict=False)[0]
        loss = (v.float() - (x1 - x0)).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if step % 50 == 0 or step == steps - 1:
            log(f"{backend:12s} step {step:4d} loss {losses[-1]:.4f} ({time.time() - t0:.0f} s)")
    return losses


def plot_curves(record: dict, path: Path) -> None:
    """Loss per step of every backend (top) and each backend's relative difference to masked SDPA
    (bottom, log scale), written to ``path``."""
    import numpy as np
    from matplotlib.figure import Figure

    curves = {b: np.asarray(v, dtype=float) for b, v in record["losses"].items()}
    fig = Figure(figsize=(6.4, 5.0))
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    styles = {
        "masked_sdpa": dict(ls="--", lw=1.6, color="#E69F00"),
        "kpage": dict(ls="-", lw=0.9, color="#0072B2"),
    }
    for b, losses in curves.items():
        top.plot(losses, label=b, **styles.get(b, {}))
    top.set_ylabel("rectified-flow loss")
    where = f" on {record['device']}" if record.get("device") else ""
    top.set_title(f"tiny Wan, {record.get('selection', '?')} self-attention{where}")
    top.legend()
    ref = curves.get("masked_sdpa")
    others = [b for b in curves if b != "masked_sdpa"]
    if ref is not None and others:
        for b in others:
            rel = np.abs(curves[b] - ref) / np.abs(ref)
            label = f"|{b} − masked_sdpa| / masked_sdpa (max {rel.max():.1e})"
            bottom.semilogy(np.maximum(rel, 1e-9), label=label, **styles.get(b, {}))
        bottom.legend(loc="lower left", fontsize=8)
    else:
        bottom.text(
            0.5,
            0.5,
            "one backend only: no difference to draw",
            ha="center",
            va="center",
            transform=bottom.transAxes,
        )
    bottom.set_ylabel("relative difference")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=150)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m sparseattn.wan_training", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--out", help="folder for wan_training.json and .png (required unless --replot)")
    ap.add_argument(
        "--replot", metavar="JSON", help="redraw the figure of a recorded wan_training.json beside it"
    )
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--selection", choices=("sta", "vsa"), default="sta")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--backend", action="append", choices=("kpage", "masked_sdpa"), default=None)
    args = ap.parse_args(argv)
    if args.replot:
        src = Path(args.replot)
        try:
            record = json.loads(src.read_text())
            record["losses"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            ap.error(f"--replot {src}: not a wan_training.json ({err})")
        plot_curves(record, src.with_suffix(".png"))
        print(f"wrote {src.with_suffix('.png')}")
        return 0
    if not args.out:
        ap.error("--out is required (or --replot FILE.json)")
    try:
        import diffusers  # noqa: F401
        import torch
    except ImportError as err:
        print(
            f"wan_training needs torch and diffusers: pip install -e '.[diffusers]' ({err})", file=sys.stderr
        )
        return 1
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    backends = args.backend or (["kpage", "masked_sdpa"] if device.startswith("cuda") else ["masked_sdpa"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    curves = {
        b: train(b, args.selection, args.steps, device, log=lambda m: print(m, flush=True)) for b in backends
    }
    record = {
        "selection": args.selection,
        "steps": args.steps,
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else device,
        "commit": os.environ.get("SPARSEATTN_COMMIT", ""),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "losses": curves,
    }
    (out / "wan_training.json").write_text(json.dumps(record, indent=1))
    plot_curves(record, out / "wan_training.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
