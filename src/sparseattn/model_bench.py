"""Whole diffusers Wan steps with each sparse self-attention, side by side (``sparseattn bench model wan``).

Models: random-init ``WanTransformer3DModel`` in bf16, shaped like

* ``1.3b``: Wan2.1-1.3B (12 heads of 128, FFN 8960, 30 layers; all 30 run by default);
* ``14b``: Wan2.1-14B (40 heads of 128 = dim 5120, FFN 13824, 40 layers in the real model; a subset of
  its layers runs, ``--layers 14b=N``, default 4). Every record says ``layers`` (run) and ``layers_full``
  (the real model's); nothing is scaled to the full depth.

Resolutions (81 frames): ``480p`` (latent 21 x 60 x 104, tokens after (1, 2, 2) patching 32,760) and
``720p`` (21 x 90 x 160, 75,600 tokens). Batch 1, 512 text tokens.

Implementations of the blocks' self-attention (cross-attention keeps diffusers' processor):

* ``dense``: cuDNN SDPA (flash as fallback) over all tokens, inside the same processor as the sparse
  rows (same projections and rotary);
* ``kpage_sta``: :meth:`WanSelection.sta` on 128-token tiles 4 x 4 x 8 with a 3 x 3 x 3 tile window, run by
  the KPage op (:func:`sparseattn.torch.kpage_attention`);
* ``flex_sta``: the same STA graph as a FlexAttention ``BlockMask`` at 128-token blocks
  (:func:`sparseattn.flex.to_flex_block_mask`), ``torch.compile``'d ``flex_attention`` on the tokens in the
  same tile-major slot order (the token-to-slot scatter and gather are KPage's). FlexAttention's backward
  does not compile at 64-token blocks on the H200, so the whole STA row uses 128-token tiles;
* ``kpage_vsa``: VSA's top 10% of 4 x 4 x 4 cubes selected on the GPU every call, planned on the GPU and run
  by KPage (:mod:`sparseattn.wan_bench`'s processor);
* ``vsa_kernel``: the same selection run by the VSA system's kernel (``fastvideo-kernel``), when installed;
* ``kpage_svg2``: SVG2 (k-means of Q and K per head every call, top-p cluster pairs) through KPage on the
  per-row layouts of each call's clusters, forward and backward planned on the device;
* opt-in (``--impl``): ``dense_diffusers`` (diffusers' own ``WanAttnProcessor``, whole steps only),
  ``masked_sta`` (the STA graph as a boolean mask for SDPA: the reference, for small grids and the CPU), and
  ``kpage_sta_tokens`` / ``kpage_vsa_tokens`` (forward calls in the token-order build, no moves) and
  ``kpage_sta_slots`` / ``kpage_vsa_slots`` (forward calls in slot order, every tensor moved, as
  ``kpage_sta`` / ``kpage_vsa`` ran before the Q/O token build became the processors' default: there q and o
  stay in token order and only k and v move), and ``kpage_sta_tiles`` / ``kpage_vsa_tiles`` (the model's
  tokens kept tile-major between its blocks, :class:`~sparseattn.diffusers_wan.TileMajorTokens`: forward
  calls read token-major k and v pages by TMA, nothing moves); their training calls move as ``kpage_sta`` /
  ``kpage_vsa`` do.

Records (one JSON file in the bench format, rewritten after every implementation so that a stopped run
keeps what it measured): ``step_fwd`` (one denoising forward, no grad) and ``step_train`` (forward and
backward of a squared-error loss, no optimizer) for the whole step; ``attn_fwd`` and ``attn_train`` for the
attention part: CUDA events around every processor's attention call (token-to-slot scatter, selection,
planning, attention, gather), summed over the step's layers, in training also from the gradient reaching
the attention's output to its inputs' last gradient. ``time_ms`` is the median of ``--reps`` steps after
``--warmup`` steps (``warmup_ms``: the warm-up steps, compilation and planning included).

Training steps whose activations would not fit the GPU (an estimate from the model's width, the tokens
and the layers; or, in ``--checkpointing auto``, a step that ran out of memory) run with diffusers'
gradient checkpointing: the record says ``grad_checkpointing`` and its attention part then includes the
recomputed forward.

Checks, before timing: every implementation's attention of one layer on random q, k, v at the step's own
token grid is compared with SDPA in float32 under the selection's token mask on ``--check-rows`` sampled
query rows (VSA's per-call selection: at the grid of :data:`sparseattn.wan_bench.CHECK_GRID`, the whole
output; SVG2's: the cluster pairs of the same call's step, :func:`check_svg2_rows`); ``checked``,
``rel_err``, ``correct`` (``rel_err`` < 2e-2, bf16) in every record of the impl.
A failing implementation (not installed, out of memory) becomes an ``error`` record and the run goes on;
``--budget-s`` stops starting new work once the run has taken that long (``skipped`` records).
``--ranks N`` runs the sparse processors (:data:`RANKS_IMPLS`: ``kpage_sta``, ``kpage_vsa``, their ``_tiles``
forms, ``masked_sta``) under Ulysses sequence parallelism instead (:func:`ranks_bench`: steps at 1 and N ranks,
the all-to-alls' share).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from .wan_bench import LATENTS, WAN_1_3B, token_order_of

#: Wan2.1-14B's transformer (diffusers' config names); 40 layers in the real model.
WAN_14B = dict(WAN_1_3B, num_attention_heads=40, ffn_dim=13824, num_layers=40)
#: A tiny random Wan for CPU smoke runs (``--models tiny --res tiny --device cpu``).
WAN_TINY = dict(
    WAN_1_3B,
    num_attention_heads=2,
    attention_head_dim=32,
    in_channels=4,
    out_channels=4,
    text_dim=16,
    freq_dim=32,
    ffn_dim=64,
    num_layers=2,
)


@dataclass(frozen=True)
class ModelSpec:
    """One model shape: its diffusers config, the real model's depth and the layers run by default."""

    key: str
    label: str
    config: dict
    default_layers: int
    text_tokens: int = 512

    @property
    def layers_full(self) -> int:
        return int(self.config["num_layers"])

    @property
    def heads(self) -> int:
        return int(self.config["num_attention_heads"])

    @property
    def head_dim(self) -> int:
        return int(self.config["attention_head_dim"])

    @property
    def dim(self) -> int:
        return self.heads * self.head_dim


MODELS = {
    "1.3b": ModelSpec("1.3b", "Wan2.1-1.3B", WAN_1_3B, default_layers=30),
    "14b": ModelSpec("14b", "Wan2.1-14B", WAN_14B, default_layers=4),
    "tiny": ModelSpec("tiny", "tiny Wan", WAN_TINY, default_layers=2, text_tokens=8),
}
DEFAULT_MODELS = ("1.3b", "14b")
#: Latent (frames, height, width): 81 frames at 480p and 720p, and a tiny one for CPU smoke runs.
RESOLUTIONS = {**LATENTS, "tiny": (4, 8, 16)}
DEFAULT_RES = ("480p", "720p")
IMPLS = ("dense", "kpage_sta", "flex_sta", "kpage_vsa", "vsa_kernel", "kpage_svg2")
OPT_IN_IMPLS = (
    "dense_diffusers",
    "masked_sta",
    "kpage_sta_tokens",
    "kpage_sta_slots",
    "kpage_vsa_tokens",
    "kpage_vsa_slots",
    "kpage_sta_tiles",
    "kpage_vsa_tiles",
)
ALL_IMPLS = IMPLS + OPT_IN_IMPLS
MODES = ("fwd", "train")
PASSES = ("step_fwd", "attn_fwd", "step_train", "attn_train")
#: The STA row: 128-token tiles (4 x 4 x 8) and a window of 3 x 3 x 3 tiles, for every implementation.
STA_TILE = (4, 4, 8)
STA_WINDOW = (3, 3, 3)
VSA_TILE = (4, 4, 4)
REL_TOL = 2e-2
CHECK_ROWS = 512
#: Activation bytes a training step keeps per token and layer: ACT_BYTES_PER_DIM x dim + ACT_BYTES_PER_FFN
#: x ffn_dim (measured with saved-tensor hooks on diffusers' Wan block, flash-like attention saving q, k, v,
#: o and the LSE: about 140 kB per token and layer for 1.3B, 404 kB for 14B).
ACT_BYTES_PER_DIM = 68
ACT_BYTES_PER_FFN = 4
SVG2_MISSING = "SVG2 on KPage is not available in this processor"


class Skip(Exception):
    """An implementation that cannot run here for a known reason (recorded as ``skipped``)."""


# ---- parsing ---------------------------------------------------------------------------------------
def _names(text: str, choices, what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in choices]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"{what}: unknown {bad[0]!r}; choose from {', '.join(choices)}" if bad else f"{what}: empty list"
        )
    return list(dict.fromkeys(names))


def _triple(text: str) -> tuple[int, int, int]:
    try:
        parts = tuple(int(x) for x in text.lower().replace("×", "x").split("x"))
    except ValueError:
        parts = ()
    if len(parts) != 3 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"expected three positive integers like 4x4x8, got {text!r}")
    return parts


def _layers(text: str) -> dict[str, int]:
    """``14b=4`` / ``1.3b=30,14b=8``: layers run per model."""
    out = {}
    for item in text.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep or key not in MODELS or not value.isdigit() or int(value) < 1:
            raise argparse.ArgumentTypeError(
                f"--layers: expected MODEL=N with MODEL one of {', '.join(MODELS)}, got {item!r}"
            )
        out[key] = int(value)
    return out


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _nonneg(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return int(text)


def build_parser(prog: str = "sparseattn bench model") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n")[0],
        epilog="Records: docs/results.md; time_ms is a median of --reps steps.",
    )
    parser.add_argument(
        "model_family",
        choices=("wan",),
        help="the model family: wan (diffusers' Wan transformer); "
        "`sparseattn bench model prefill --help`: a Llama-like prefill with PageWeaver's attention",
    )
    parser.add_argument(
        "--models",
        type=lambda t: _names(t, tuple(MODELS), "--models"),
        default=list(DEFAULT_MODELS),
        help=f"comma list of {', '.join(MODELS)} (default {','.join(DEFAULT_MODELS)}; tiny: CPU smoke runs)",
    )
    parser.add_argument(
        "--res",
        type=lambda t: _names(t, tuple(RESOLUTIONS), "--res"),
        default=list(DEFAULT_RES),
        help=f"comma list of {', '.join(RESOLUTIONS)} (default {','.join(DEFAULT_RES)}; 81 frames)",
    )
    parser.add_argument(
        "--impl",
        type=lambda t: _names(t, ALL_IMPLS, "--impl"),
        default=list(IMPLS),
        help=f"comma list (default {','.join(IMPLS)}; opt-in: {', '.join(OPT_IN_IMPLS)})",
    )
    parser.add_argument(
        "--modes",
        type=lambda t: _names(t, MODES, "--modes"),
        default=list(MODES),
        help="fwd (step_fwd, attn_fwd) and/or train (step_train, attn_train); default both",
    )
    parser.add_argument(
        "--layers",
        type=_layers,
        default={},
        metavar="MODEL=N[,...]",
        help="layers run per model (default 1.3b=30, 14b=4; the records say layers and layers_full)",
    )
    parser.add_argument(
        "--reps", type=_positive, default=2, help="timed steps per record (median; default 2)"
    )
    parser.add_argument("--warmup", type=_nonneg, default=1, help="untimed steps first (default 1)")
    parser.add_argument(
        "--checkpointing",
        choices=("auto", "on", "off"),
        default="auto",
        help="gradient checkpointing of training steps: auto = where the activations would not fit "
        "(estimate), or after running out of memory (default auto)",
    )
    parser.add_argument(
        "--sta-tile", type=_triple, default=STA_TILE, metavar="TxHxW", help="STA tile (default 4x4x8)"
    )
    parser.add_argument(
        "--sta-window", type=_triple, default=STA_WINDOW, metavar="TxHxW", help="STA window in tiles (3x3x3)"
    )
    parser.add_argument(
        "--check-rows", type=_nonneg, default=CHECK_ROWS, help="query rows checked (0: no check; default 512)"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=0.0,
        help="start no new implementation or mode after this many seconds (0: no limit)",
    )
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (tiny smoke runs)")
    parser.add_argument(
        "--contiguous-tokens",
        action="store_true",
        help="hand every impl's first block contiguous hidden states (diffusers' Wan passes a transposed view; "
        "sparseattn.diffusers_wan.contiguous_hidden_states); records say contiguous_tokens",
    )
    parser.add_argument(
        "--ranks",
        type=_positive,
        default=1,
        help="Ulysses sequence parallelism over N processes (one GPU each over NCCL, gloo on the CPU): "
        "steps of the sparse processors at 1 and N ranks in the same run, with the all-to-alls' share",
    )
    parser.add_argument(
        "--out", metavar="PATH", help="JSON result file (default data/bench/model_wan_<time>.json)"
    )
    parser.add_argument(
        "--markdown",
        metavar="JSON",
        help="print the README table of a recorded run (this command's JSON) and exit; runs nothing",
    )
    return parser


# ---- models and inputs -----------------------------------------------------------------------------
def build_model(spec: ModelSpec, layers: int, device, dtype):
    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    with torch.device(device):
        model = WanTransformer3DModel(**{**spec.config, "num_layers": int(layers)})
    return model.to(dtype)


def token_grid(latent) -> tuple[int, int, int]:
    frames, height, width = latent
    return (frames, height // 2, width // 2)


def make_inputs(spec: ModelSpec, latent, device, dtype):
    """(latent, timestep, text states) of one batch entry, seeded."""
    import torch

    g = torch.Generator(device=device).manual_seed(1)
    cfg = spec.config
    x = torch.randn(1, cfg["in_channels"], *latent, device=device, dtype=dtype, generator=g)
    t = torch.tensor([500], device=device)
    text = torch.randn(1, spec.text_tokens, cfg["text_dim"], device=device, dtype=dtype, generator=g)
    return x, t, text


def activation_bytes(spec: ModelSpec, tokens: int, layers: int) -> int:
    """Estimated bytes a training step keeps for the backward (see :data:`ACT_BYTES_PER_DIM`)."""
    per = ACT_BYTES_PER_DIM * spec.dim + ACT_BYTES_PER_FFN * int(spec.config["ffn_dim"])
    return int(tokens) * int(layers) * per


def _sync(device) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _free(device) -> None:
    gc.collect()
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.empty_cache()
        cupy = sys.modules.get("cupy")
        if cupy is not None:
            cupy.get_default_memory_pool().free_all_blocks()


# ---- attention clock -------------------------------------------------------------------------------
class _HostEvent:
    """A ``torch.cuda.Event`` stand-in on the CPU (where every op is synchronous)."""

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, end) -> float:
        return (end.t - self.t) * 1e3


class AttentionClock:
    """Events around attention calls (and, under autograd, around their backward), summed per step: CUDA
    events on a GPU, host clocks on the CPU. Calls made while gradient checkpointing recomputes a block
    count with their forward only (their backward is the first call's)."""

    def __init__(self, device="cuda"):
        self.cuda = str(device).startswith("cuda")
        self.calls: list[dict] = []

    def event(self):
        import torch

        if self.cuda:
            return torch.cuda.Event(enable_timing=True)
        return _HostEvent()

    def wrap(self, attend):
        import torch

        clock = self

        class Mark(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, entry, key):
                ctx.entry, ctx.key = entry, key
                return x.view_as(x)

            @staticmethod
            def backward(ctx, grad):
                event = clock.event()
                event.record()
                ctx.entry.setdefault(ctx.key, []).append(event)
                return grad, None, None

        def timed(q, k, v):
            entry = {}
            grad = torch.is_grad_enabled() and q.requires_grad
            if grad:
                q, k, v = (Mark.apply(x, entry, "bwd_end") for x in (q, k, v))
            start, end = clock.event(), clock.event()
            start.record()
            out = attend(q, k, v)
            end.record()
            entry["fwd"] = (start, end)
            clock.calls.append(entry)
            return Mark.apply(out, entry, "bwd_start") if grad else out

        return timed

    def reset(self) -> None:
        self.calls = []

    def total_ms(self) -> float:
        """The attention time of the calls since the last reset (synchronizes); resets."""
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        total = 0.0
        for entry in self.calls:
            total += entry["fwd"][0].elapsed_time(entry["fwd"][1])
            if "bwd_start" in entry and "bwd_end" in entry:
                start = entry["bwd_start"][0]
                total += max(start.elapsed_time(e) for e in entry["bwd_end"])
        self.calls = []
        return total


# ---- implementations -------------------------------------------------------------------------------
@dataclass
class Impl:
    """An implementation set up for one grid: the processor installed in every block, the object whose
    ``attend`` is timed (None: whole steps only), what it selects and how it is checked."""

    processor: object
    timed: object | None
    meta: dict = field(default_factory=dict)
    graph: object | None = None  # static graph of the check's token mask (None with dense)
    check: str = "rows"  # rows | vsa_grid | svg2_rows | none


def sta_selection(args):
    from .diffusers_wan import WanSelection

    return WanSelection.sta(tile=tuple(args.sta_tile), window=tuple(args.sta_window))


def _sta_meta(selection) -> dict:
    return dict(
        selection="sta",
        tile=list(selection.tile),
        window=list(selection.window),
        block_size=selection.blocks(),
    )


def dense_attend(q, k, v):
    """cuDNN SDPA (flash as fallback) of ``[B, L, heads, d]`` q, k, v on a GPU; torch's choice elsewhere."""
    import torch

    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    if q.is_cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return out.transpose(1, 2)


def flex_processor(grid, selection):
    """A Wan processor running the STA graph with compiled FlexAttention on the tile-major slot order
    (the graph's layout; a 128-token block per tile), the graph's BlockMask built once per head count."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    from .diffusers_wan import WanSparseAttnProcessor
    from .flex import to_flex_block_mask
    from .torch import slots_to_tokens, tokens_to_slots

    processor = WanSparseAttnProcessor(grid, selection, backend="kpage")
    # static shapes, a clean dynamo state per grid (as sparseattn bench's flex rows)
    torch._dynamo.reset()
    flex = torch.compile(flex_attention, dynamic=False)
    masks = {}

    def attend(q, k, v):
        graph = processor.graph_for(q.shape[2])
        key = (graph.heads, q.shape[0], str(q.device))
        if key not in masks:
            masks[key] = to_flex_block_mask(graph, batch=q.shape[0], device=q.device, mask_mod="padding")
        qs, ks, vs = tokens_to_slots(graph.q, q, k, v)
        out = flex(qs, ks, vs, block_mask=masks[key])
        return slots_to_tokens(graph.q, out.contiguous()).to(q.dtype)

    processor.attend = attend
    return processor


def _prepare(processor, heads: int) -> None:
    """Build the processor's graph or planner now, as ``install_sparse_attention`` does (not in the
    first timed call)."""
    prepare = getattr(processor, "prepare", None)
    if prepare is not None:
        prepare(heads)


def build_impl(impl: str, grid, heads: int, args) -> Impl:
    """The processor of ``impl`` for ``grid``; :class:`Skip` where it cannot exist yet."""
    from .diffusers_wan import WanSelection, WanSparseAttnProcessor

    if impl == "dense":
        processor = WanSparseAttnProcessor(grid, WanSelection.full(VSA_TILE), backend="masked_sdpa")
        processor.attend = dense_attend
        return Impl(processor, processor, dict(selection="dense"))
    if impl == "dense_diffusers":
        from diffusers.models.transformers.transformer_wan import WanAttnProcessor

        return Impl(WanAttnProcessor(), None, dict(selection="dense"), check="none")
    if impl in ("kpage_sta", "masked_sta", "flex_sta") or impl.startswith("kpage_sta_"):
        selection = sta_selection(args)
        if impl == "flex_sta":
            processor = flex_processor(grid, selection)
        else:
            backend = "masked_sdpa" if impl == "masked_sta" else "kpage"
            processor = WanSparseAttnProcessor(
                grid, selection, backend=backend, token_order=token_order_of(impl)
            )
        _prepare(processor, heads)
        return Impl(processor, processor, _sta_meta(selection), graph=processor.graph_for(heads))
    if impl in ("kpage_vsa", "vsa_kernel") or impl.startswith("kpage_vsa_"):
        from .wan_bench import TOPK_FRACTION, processors

        processor = processors(grid, impl)
        if impl != "vsa_kernel":  # the VSA kernel's processor only borrows the layout
            _prepare(processor, heads)
        meta = dict(
            selection="vsa",
            tile=list(processor.selection.tile),
            topk=processor.selection.topk,
            topk_fraction=TOPK_FRACTION,
            block_size=processor.selection.blocks(),
        )
        return Impl(processor, processor, meta, check="vsa_grid")
    if impl == "kpage_svg2":
        tokens = math.prod(grid)
        clusters = dict(
            q_clusters=min(300, tokens // 4), k_clusters=min(1000, tokens // 2)
        )  # SVG2's 300 / 1000
        try:
            processor = WanSparseAttnProcessor(grid, WanSelection.svg2(**clusters), backend="kpage")
        except NotImplementedError:
            raise Skip(SVG2_MISSING) from None
        _prepare(processor, heads)
        iters, init_iters = processor.selection.clusters[4:6]
        meta = dict(selection="svg2", **clusters, iters=iters, init_iters=init_iters)
        return Impl(processor, processor, meta, check="svg2_rows")
    raise ValueError(f"impl must be one of {ALL_IMPLS}, got {impl!r}")


# ---- checks ----------------------------------------------------------------------------------------
def _rows_check(attend_and_mask, grid, heads: int, head_dim: int, rows: int, device, seed: int) -> float:
    """‖out − reference‖ / ‖reference‖ on ``rows`` sampled query rows of one attention call on random
    ``[1, tokens, heads, head_dim]`` q, k, v at ``grid`` (bf16 on a GPU, float32 on the CPU).
    ``attend_and_mask(q, k, v, idx)`` returns the call's output and the bool token mask ``[1, heads, rows,
    tokens]`` of the sampled rows ``idx`` (None: dense); the reference is float32 SDPA under that mask."""
    import torch

    tokens = math.prod(grid)
    dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (1, tokens, heads, head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, generator=g) for _ in range(3))
    with torch.no_grad():
        idx = torch.randperm(tokens, device=device, generator=g)[: min(rows, tokens)].sort().values
        got, mask = attend_and_mask(q, k, v, idx)
        want = torch.nn.functional.scaled_dot_product_attention(
            q[:, idx].transpose(1, 2).float(),
            k.transpose(1, 2).float(),
            v.transpose(1, 2).float(),
            attn_mask=mask,
        ).transpose(1, 2)
        got = got[:, idx].float()
    return float((got - want).norm() / want.norm())


def check_rows(
    attend, grid, heads: int, head_dim: int, graph=None, rows: int = CHECK_ROWS, device="cuda", seed=0
):
    """:func:`_rows_check` of ``attend`` against SDPA under ``graph``'s token mask (None: dense)."""
    import torch

    def run(q, k, v, idx):
        mask = None
        if graph is not None:
            blocks = torch.as_tensor(graph.block_mask(), device=device)  # [heads, q blocks, k blocks]
            q_block = torch.as_tensor(graph.q.token_slot // graph.q.block_size, device=device)[idx]
            k_block = torch.as_tensor(graph.k.token_slot // graph.k.block_size, device=device)
            mask = blocks[:, q_block][:, :, k_block][None]  # [1, heads, rows, tokens]
        return attend(q, k, v), mask

    return _rows_check(run, grid, heads, head_dim, rows, device, seed)


def check_svg2_rows(
    processor, grid, heads: int, head_dim: int, rows: int = CHECK_ROWS, device="cuda", seed=0
):
    """:func:`_rows_check` of one SVG2 call of ``processor``: the reference lets query ``i`` see key ``j``
    when the call's own step selected the pair of their clusters (the same k-means labels)."""
    from .svg2_device import cluster_pair_mask

    def run(q, k, v, idx):
        got = processor._attend_svg2(q, k, v)  # the processor's own path; it keeps the step it made
        step = processor.last_svg2_step
        # batch 1: the step's rows are the heads
        return got, cluster_pair_mask(step.cluster_mask, step.q_labels[:, idx], step.k_labels)[None]

    return _rows_check(run, grid, heads, head_dim, rows, device, seed)


def run_check(impl: str, built: Impl, grid, spec: ModelSpec, args) -> dict:
    """The record fields of the impl's check: ``checked``, ``check``, ``rel_err``, ``correct``."""
    if built.check == "none" or args.check_rows == 0:
        return dict(checked=False)
    if built.check == "vsa_grid":
        from .wan_bench import CHECK_GRID, check_layer

        rel = check_layer(CHECK_GRID, impl, spec.heads, spec.head_dim)
        what = f"one layer at grid {'x'.join(map(str, CHECK_GRID))}, the same selection, masked SDPA float32"
    elif built.check == "svg2_rows":
        rel = check_svg2_rows(built.timed, grid, spec.heads, spec.head_dim, args.check_rows, args.device)
        what = (
            f"one layer at the step's grid, {args.check_rows} sampled query rows, masked SDPA float32 over the "
            "same call's selected cluster pairs"
        )
    else:
        rel = check_rows(
            built.timed.attend, grid, spec.heads, spec.head_dim, built.graph, args.check_rows, args.device
        )
        what = f"one layer at the step's grid, {args.check_rows} sampled query rows, masked SDPA float32"
    return dict(checked=True, check=what, rel_err=rel, correct=bool(rel < REL_TOL))


def svg2_selection_stats(model) -> dict:
    """``svg2_selected_pairs``: the mean fraction of (query, key) pairs the SVG2 processors' last calls
    selected (the last layer's call of the last timed step; {} without an SVG2 processor). Random weights
    give near-uniform attention scores, so top-p keeps far more pairs than in a trained model."""
    from .svg2_device import selected_pair_fraction

    steps = {
        id(p): p.last_svg2_step
        for p in getattr(model, "attn_processors", {}).values()
        if getattr(p, "last_svg2_step", None) is not None
    }
    if not steps:
        return {}
    fractions = [float(selected_pair_fraction(step).mean()) for step in steps.values()]
    return dict(svg2_selected_pairs=round(sum(fractions) / len(fractions), 4))


# ---- timing ----------------------------------------------------------------------------------------
def time_mode(model, inputs, clock, train: bool, warmup: int, reps: int, device):
    """(step ms per timed step, attention ms per timed step or None, warm-up step ms)."""
    import torch

    model.train(train)

    def step():
        if train:
            out = model(*inputs, return_dict=False)[0]
            out.float().square().mean().backward()
        else:
            with torch.no_grad():
                model(*inputs, return_dict=False)

    steps, attention, warm = [], [], []
    for rep in range(warmup + reps):
        model.zero_grad(set_to_none=True)
        _sync(device)
        if clock is not None:
            clock.reset()
        t0 = time.perf_counter()
        step()
        _sync(device)
        wall = (time.perf_counter() - t0) * 1e3
        attn = clock.total_ms() if clock is not None else None
        if rep < warmup:
            warm.append(round(wall, 2))
        else:
            steps.append(wall)
            attention.append(attn)
    model.zero_grad(set_to_none=True)
    return steps, (None if clock is None else attention), warm


def _is_oom(exc: BaseException) -> bool:
    import torch

    oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    return isinstance(exc, oom) or "out of memory" in str(exc).lower()


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


def _mode_passes(mode: str) -> tuple[str, str]:
    return (f"step_{mode}", f"attn_{mode}")


# ---- the run ---------------------------------------------------------------------------------------
class Run:
    """One ``bench model wan`` run: its records and where they go."""

    def __init__(self, args, log=None):
        self.args = args
        self.records: list[dict] = []
        self.start = time.monotonic()
        self.log = log or (lambda message: print(message, file=sys.stderr, flush=True))

    def over_budget(self) -> bool:
        return bool(self.args.budget_s) and time.monotonic() - self.start > self.args.budget_s

    def budget_note(self) -> str:
        return f"time budget spent (--budget-s {self.args.budget_s:g})"

    def add(self, base: dict, passes, **fields) -> None:
        for pass_ in passes:
            self.records.append(dict(base, **{"pass": pass_}, **fields))

    def all_passes(self) -> list[str]:
        return [p for m in self.args.modes for p in _mode_passes(m)]

    def bench(self, emit=None) -> list[dict]:
        import torch

        args = self.args
        device = args.device
        dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
        for key in args.models:
            spec = MODELS[key]
            layers = int(args.layers.get(key, spec.default_layers))
            model_fields = dict(
                model=spec.label,
                layers=layers,
                layers_full=spec.layers_full,
                heads=spec.heads,
                head_dim=spec.head_dim,
                dim=spec.dim,
                ffn_dim=int(spec.config["ffn_dim"]),
                batch=1,
                dtype=str(dtype).replace("torch.", ""),
                contiguous_tokens=bool(getattr(args, "contiguous_tokens", False)),
            )
            model = None
            for i, res in enumerate(args.res):
                latent = RESOLUTIONS[res]
                grid = token_grid(latent)
                workload_fields = dict(
                    workload=f"wan{key}_{res}",
                    res=res,
                    latent=list(latent),
                    grid=list(grid),
                    tokens=math.prod(grid),
                )
                if self.over_budget():
                    for impl in args.impl:
                        base = dict(workload_fields, impl=impl, **model_fields)
                        self.add(base, self.all_passes(), skipped=self.budget_note())
                    continue
                if model is None:
                    try:
                        model = build_model(spec, layers, device, dtype)
                        if model_fields["contiguous_tokens"]:
                            from .diffusers_wan import contiguous_hidden_states

                            contiguous_hidden_states(model)
                    except Exception as exc:  # noqa: BLE001 - recorded; the next model still runs
                        self.log(f"[{key}] model: {_error_text(exc)}")
                        for r in args.res[i:]:
                            wf = dict(workload_fields, workload=f"wan{key}_{r}", res=r)
                            wf.update(latent=list(RESOLUTIONS[r]), grid=list(token_grid(RESOLUTIONS[r])))
                            wf["tokens"] = math.prod(wf["grid"])
                            for impl in args.impl:
                                base = dict(wf, impl=impl, **model_fields)
                                self.add(base, self.all_passes(), error=_error_text(exc))
                        break
                inputs = make_inputs(spec, latent, device, dtype)
                self.log(
                    f"[{key} {res}] {spec.label}-shaped, {layers} of {spec.layers_full} layers, "
                    f"grid {'x'.join(map(str, grid))} = {math.prod(grid):,} tokens "
                    f"[{time.monotonic() - self.start:.0f} s]"
                )
                for impl in args.impl:
                    base = dict(workload_fields, impl=impl, **model_fields)
                    self.bench_impl(model, spec, inputs, grid, impl, base, layers)
                    if emit is not None:
                        emit(self.records)
                del inputs
                _free(device)
            del model
            _free(device)
        return self.records

    def bench_impl(self, model, spec: ModelSpec, inputs, grid, impl: str, base: dict, layers: int) -> None:
        args = self.args
        tag = f"[{spec.key} {base['res']}] {impl}"
        if self.over_budget():
            self.add(base, self.all_passes(), skipped=self.budget_note())
            self.log(f"{tag}: skipped, {self.budget_note()}")
            return
        t0 = time.monotonic()
        try:
            built = build_impl(impl, grid, spec.heads, args)
        except Skip as why:
            self.add(base, self.all_passes(), skipped=str(why))
            self.log(f"{tag}: skipped, {why}")
            return
        except Exception as exc:  # noqa: BLE001 - a peer that does not load is recorded, the run goes on
            self.add(base, self.all_passes(), error=_error_text(exc))
            self.log(f"{tag}: error, {_error_text(exc)}")
            return
        base = dict(base, **built.meta)
        order = getattr(built.processor, "token_order", None)
        if order is not None and getattr(built.processor, "backend", None) == "kpage":
            base["token_order"] = order if isinstance(order, str) else ("tokens" if order else "slots")
        failure = None
        try:
            checked = run_check(impl, built, grid, spec, args)
        except Exception as exc:  # noqa: BLE001 - the check failing is an error of the impl
            failure = f"check: {_error_text(exc)}"
        if failure is not None:  # out of the except block, so that the check's tensors can be freed
            self.add(base, self.all_passes(), error=failure)
            self.log(f"{tag}: error, {failure}")
            _free(args.device)
            return
        if checked.get("checked"):
            self.log(
                f"{tag}: checked, rel_err {checked['rel_err']:.2e} ({'ok' if checked['correct'] else 'WRONG'})"
            )
        base = dict(base, **checked)
        clock = None
        if built.timed is not None:
            clock = AttentionClock(args.device)
            built.timed.attend = clock.wrap(built.timed.attend)
        for block in model.blocks:
            block.attn1.set_processor(built.processor)
        tile_hooks = None  # token_order "tiles": the model's tokens tile-major between its blocks
        if getattr(built.processor, "token_order", None) == "tiles":
            tile_hooks = built.processor.install_tile_hooks(model)
        try:
            for mode in args.modes:
                self.bench_mode(model, spec, inputs, clock, mode, base, layers, tag)
        finally:
            if tile_hooks is not None:
                tile_hooks.remove()
            model.disable_gradient_checkpointing()
            model.zero_grad(set_to_none=True)
            _free(args.device)
        self.log(f"{tag}: done in {time.monotonic() - t0:.1f} s")

    def checkpointing_wanted(self, spec: ModelSpec, tokens: int, layers: int) -> tuple[bool, str]:
        policy = self.args.checkpointing
        if policy != "auto":
            return policy == "on", f"--checkpointing {policy}"
        if not str(self.args.device).startswith("cuda"):
            return False, ""
        import torch

        total = torch.cuda.get_device_properties(torch.device(self.args.device)).total_memory
        need = activation_bytes(spec, tokens, layers)
        if need > total:
            return True, f"activations estimated at {need / 2**30:.0f} GiB > {total / 2**30:.0f} GiB"
        return False, ""

    def bench_mode(self, model, spec, inputs, clock, mode: str, base: dict, layers: int, tag: str) -> None:
        args = self.args
        passes = _mode_passes(mode)
        if self.over_budget():
            self.add(base, passes, skipped=self.budget_note())
            self.log(f"{tag} {mode}: skipped, {self.budget_note()}")
            return
        train = mode == "train"
        extra = {}
        ckpt, why = self.checkpointing_wanted(spec, base["tokens"], layers) if train else (False, "")
        for attempt in range(2):
            if ckpt:
                model.enable_gradient_checkpointing()
                extra = dict(grad_checkpointing=True, checkpointing_reason=why)
            elif train:
                model.disable_gradient_checkpointing()
                extra = dict(grad_checkpointing=False)
            failure = None
            try:
                steps, attention, warm = time_mode(
                    model, inputs, clock, train, args.warmup, args.reps, args.device
                )
            except Exception as exc:  # noqa: BLE001 - recorded, the other modes and impls still run
                failure = (_error_text(exc), _is_oom(exc))
            if failure is None:
                extra.update(svg2_selection_stats(model))
                break
            # out of the except block: the traceback's frames (and the step's tensors) are gone now
            model.zero_grad(set_to_none=True)
            if clock is not None:
                clock.reset()
            _free(args.device)
            text, oom = failure
            if train and not ckpt and args.checkpointing == "auto" and attempt == 0 and oom:
                ckpt, why = True, "out of memory without"
                self.log(f"{tag} {mode}: out of memory; again with gradient checkpointing")
                continue
            self.add(base, passes, error=text, **extra)
            self.log(f"{tag} {mode}: error, {text}")
            return
        step_ms = statistics.median(steps)
        self.records.append(
            dict(
                base,
                **{"pass": passes[0]},
                time_ms=round(step_ms, 2),
                times_ms=[round(x, 2) for x in steps],
                warmup_ms=warm,
                **extra,
            )
        )
        line = f"{tag} {passes[0]}: {step_ms:.1f} ms"
        if attention is not None:
            attn_ms = statistics.median(attention)
            self.records.append(
                dict(
                    base,
                    **{"pass": passes[1]},
                    time_ms=round(attn_ms, 2),
                    times_ms=[round(x, 2) for x in attention],
                    **extra,
                )
            )
            line += f"; {passes[1]}: {attn_ms:.1f} ms"
        if extra.get("grad_checkpointing"):
            line += " (gradient checkpointing)"
        if "svg2_selected_pairs" in extra:
            line += f"; SVG2 selected {100 * extra['svg2_selected_pairs']:.1f}% of the pairs"
        self.log(line + f"; warm-up {', '.join(f'{w:.0f}' for w in warm)} ms")


# ---- output ----------------------------------------------------------------------------------------
def device_name(device) -> str:
    import torch

    if str(device).startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine() or "cpu"


#: Implementations under sequence parallelism: (selection, backend, token_order) of the processor on every rank.
RANKS_IMPLS = {
    "kpage_sta": ("sta", "kpage", None),
    "kpage_vsa": ("vsa", "kpage", None),
    "kpage_sta_tiles": ("sta", "kpage", "tiles"),
    "kpage_vsa_tiles": ("vsa", "kpage", "tiles"),
    "masked_sta": ("sta", "masked_sdpa", None),
}


def ranks_bench(args, run, emit=None) -> list[dict]:
    """``--ranks N``: each sparse processor's whole step at 1 and at N ranks (Ulysses: tokens sliced over
    the ranks, all-to-alls over heads around attention; :mod:`sparseattn.sequence_parallel`), one process
    per rank (:func:`~sparseattn.sequence_parallel.run_ranks`), float32 weights with bf16 autocast on
    GPUs. Records: ``step_fwd`` / ``step_train`` with ``ranks``, ``time_ms`` (the slowest rank's median
    step), ``all_to_all_ms`` and ``all_to_all_share`` (the collectives' time, CUDA events on GPUs)."""
    from .diffusers_wan import WanSelection
    from .sequence_parallel import _bench_rank, run_ranks
    from .wan_bench import TOPK_FRACTION

    start = "spawn" if str(args.device).startswith("cuda") else "fork"  # CPU smoke runs: a second per group
    for key in args.models:
        spec = MODELS[key]
        layers = int(args.layers.get(key, spec.default_layers))
        config = dict(spec.config, num_layers=layers)
        for res in args.res:
            grid = token_grid(RESOLUTIONS[res])
            for impl in (i for i in args.impl if i not in RANKS_IMPLS):
                for mode in args.modes:
                    run.records.append(
                        dict(
                            workload=f"wan{key}_{res}",
                            impl=impl,
                            **{"pass": f"step_{mode}"},
                            ranks=args.ranks,
                            skipped=f"{impl} does not run under sequence parallelism (only {', '.join(RANKS_IMPLS)})",
                        )
                    )
            for impl in (i for i in args.impl if i in RANKS_IMPLS):
                kind, backend, token_order = RANKS_IMPLS[impl]
                if kind == "sta":
                    selection = sta_selection(args)
                else:
                    blocks = math.prod(-(-g // t) for g, t in zip(grid, VSA_TILE))
                    selection = WanSelection.vsa(VSA_TILE, topk=max(1, math.ceil(TOPK_FRACTION * blocks)))
                base = dict(
                    workload=f"wan{key}_{res}",
                    impl=impl,
                    model=spec.label,
                    layers=layers,
                    layers_full=spec.layers_full,
                    heads=spec.heads,
                    tokens=math.prod(grid),
                    grid=list(grid),
                    selection=kind,
                )
                for mode in args.modes:
                    for ranks in (1, args.ranks):
                        rec = dict(base, **{"pass": f"step_{mode}"}, ranks=ranks)
                        if run.over_budget():
                            run.records.append(dict(rec, skipped=run.budget_note()))
                            continue
                        options = dict(
                            grid=grid,
                            selection=selection,
                            backend=backend,
                            steps=args.reps,
                            warmup=args.warmup,
                            backward=mode == "train",
                            config=config,
                            text_tokens=spec.text_tokens,
                            token_order=token_order,
                        )
                        try:
                            results = run_ranks(ranks, _bench_rank, options, start_method=start)
                        except Exception as exc:  # noqa: BLE001 - recorded; the run goes on
                            lines = [x for x in str(exc).splitlines() if x.strip()]  # a rank's: its last line
                            error = f"{type(exc).__name__}: {lines[-1] if lines else ''}"[:300]
                            run.records.append(dict(rec, error=error))
                            run.log(f"[{key} {res}] {impl} {mode} x{ranks}: {error}")
                            continue
                        step = max(float(np.median(r["step_s"])) for r in results)
                        comm = max(float(np.median(r["all_to_all_s"])) for r in results)
                        run.records.append(
                            dict(
                                rec,
                                time_ms=round(step * 1e3, 2),
                                all_to_all_ms=round(comm * 1e3, 2),
                                all_to_all_share=round(comm / step, 4) if step else None,
                                device=results[0]["device"],
                                token_order=results[0]["token_order"],
                                per_rank_ms=[[round(t * 1e3, 2) for t in r["step_s"]] for r in results],
                            )
                        )
                        run.log(
                            f"[{key} {res}] {impl} {mode} x{ranks}: {step * 1e3:.1f} ms, all-to-all {comm * 1e3:.1f} ms"
                        )
                        if emit is not None:
                            emit(run.records)
    return run.records


def print_ranks_summary(records: list[dict]) -> None:
    """The ``--ranks`` table: step time at 1 and N ranks, the scaling and the all-to-alls' share."""
    one = {
        (r["workload"], r["impl"], r["pass"]): r for r in records if r.get("ranks") == 1 and "time_ms" in r
    }
    print(
        f"{'workload':<16} {'impl':<11} {'pass':<10} {'ranks':>5} {'step ms':>10} {'scaling':>8} {'all-to-all':>10}"
    )
    for r in records:
        if r.get("ranks", 1) == 1 and "time_ms" in r:
            continue
        head = f"{r['workload']:<16} {r['impl']:<11} {r['pass']:<10} {r.get('ranks', ''):>5}"
        if "time_ms" not in r:
            print(f"{head} {r.get('skipped') or r.get('error')}")
            continue
        base = one.get((r["workload"], r["impl"], r["pass"]))
        scaling = f"{base['time_ms'] / r['time_ms']:.2f}x" if base else "-"
        print(f"{head} {r['time_ms']:10.1f} {scaling:>8} {100 * r['all_to_all_share']:9.1f}%")


def payload(records: list[dict], args, command: str, now, commit: str) -> dict:
    """The bench JSON object (docs/results.md): gpu, commit, date, command, records, and the setup."""
    import torch

    try:
        import diffusers

        diffusers_version = diffusers.__version__
    except ImportError:  # pragma: no cover - the run needs it anyway
        diffusers_version = None
    models = {}
    for key in args.models:
        spec = MODELS[key]
        layers = int(args.layers.get(key, spec.default_layers))
        models[f"wan{key}"] = (
            f"{spec.label}-shaped WanTransformer3DModel, random init, {layers} of {spec.layers_full} layers, "
            f"{spec.heads} heads x {spec.head_dim}, ffn {spec.config['ffn_dim']}"
        )
    name = device_name(args.device)
    return dict(
        gpu=name,
        device=name,
        commit=commit,
        date=now.isoformat(timespec="seconds"),
        command=command,
        host=platform.node(),
        software=dict(torch=torch.__version__, diffusers=diffusers_version),
        models=models,
        sta=dict(tile=list(args.sta_tile), window=list(args.sta_window)),
        records=records,
    )


def _ms(value) -> str:
    return "–" if value is None else f"{value:,.1f}"


def summary_rows(records: list[dict]) -> list[dict]:
    """One row per (workload, impl): step and attention ms per mode, the step's speedup over dense,
    the check, and why a cell is missing."""
    rows: dict[tuple, dict] = {}
    dense: dict[tuple, float] = {}
    for r in records:
        key = (r["workload"], r["impl"])
        row = rows.setdefault(key, dict(workload=r["workload"], impl=r["impl"], note=""))
        if "time_ms" in r:
            row[r["pass"]] = r["time_ms"]
            if r["impl"] == "dense" and r["pass"].startswith("step_"):
                dense[(r["workload"], r["pass"])] = r["time_ms"]
        for k in ("error", "skipped"):
            if r.get(k) and not row["note"]:
                row["note"] = f"{k}: {r[k]}"
        if r.get("grad_checkpointing") and "ckpt" not in row["note"]:
            row["note"] = (row["note"] + "; " if row["note"] else "") + "train with ckpt"
        if "correct" in r:
            row["check"] = f"{r['rel_err']:.1e}" + ("" if r["correct"] else " WRONG")
    for (workload, _), row in rows.items():
        for pass_ in ("step_fwd", "step_train"):
            base = dense.get((workload, pass_))
            if base and row.get(pass_):
                row[f"x_{pass_}"] = base / row[pass_]
    return list(rows.values())


#: Columns of the README table: dense, the STA row (KPage, FlexAttention) and the VSA row.
MARKDOWN_IMPLS = ("dense", "kpage_sta", "flex_sta", "kpage_vsa", "vsa_kernel", "kpage_svg2")
MARKDOWN_NAMES = dict(
    dense="dense (cuDNN)",
    kpage_sta="KPage STA",
    flex_sta="FlexAttention STA",
    kpage_vsa="KPage VSA",
    vsa_kernel="VSA kernel",
    kpage_svg2="KPage SVG2",
)


def _markdown_cell(rec: dict, part: dict, dense) -> str:
    if "time_ms" not in rec:
        return "skipped" if rec.get("skipped") else "failed" if rec.get("error") else "–"
    cell = f"{rec['time_ms']:,.0f} ms"
    if "time_ms" in part:
        cell += f" ({part['time_ms']:,.0f})"
    if dense and rec["impl"] != "dense":
        cell += f", {dense / rec['time_ms']:.2f}×"
    return cell + (" WRONG" if rec.get("correct") is False else "")


def markdown_table(records: list[dict]) -> str:
    """The README's table of a run: per model, resolution and step, each implementation's step time (its
    attention part) and the step's speedup over dense, and FlexAttention STA's attention ÷ KPage STA's."""
    index = {(r["workload"], r["impl"], r["pass"]): r for r in records}
    impls = [i for i in MARKDOWN_IMPLS if any(r["impl"] == i and "time_ms" in r for r in records)]
    ratio = "kpage_sta" in impls and "flex_sta" in impls
    head = ["step", *(MARKDOWN_NAMES[i] for i in impls)]
    head += ["attention: Flex STA ÷ KPage STA"] if ratio else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for workload in dict.fromkeys(r["workload"] for r in records):
        first = next(r for r in records if r["workload"] == workload)
        model = str(first.get("model", workload)).replace("Wan2.1-", "")
        if first.get("layers") != first.get("layers_full"):
            model += f" ({first.get('layers')} of {first.get('layers_full')} layers)"
        for mode, what in (("fwd", "forward"), ("train", "training")):
            step, attn = _mode_passes(mode)
            if not any((workload, i, step) in index for i in impls):
                continue
            dense = index.get((workload, "dense", step), {}).get("time_ms")
            ran = [index[(workload, i, step)] for i in impls if (workload, i, step) in index]
            ckpt_all = all(r.get("grad_checkpointing") for r in ran)
            cells = [f"{model} {first.get('res', '')} {what}" + (" (checkpointed)" if ckpt_all else "")]
            for impl in impls:
                rec = index.get((workload, impl, step), {"impl": impl})
                cell = _markdown_cell(rec, index.get((workload, impl, attn), {}), dense)
                cells.append(
                    cell + (", checkpointed" if rec.get("grad_checkpointing") and not ckpt_all else "")
                )
            if ratio:
                kp = index.get((workload, "kpage_sta", attn), {}).get("time_ms")
                fx = index.get((workload, "flex_sta", attn), {}).get("time_ms")
                cells.append(f"{fx / kp:.2f}×" if kp and fx else "–")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def print_summary(records: list[dict], file=None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="sparseattn bench model wan (median ms; × = dense step ÷ step)")
    for col in (
        "workload",
        "impl",
        "fwd step",
        "fwd attn",
        "×",
        "train step",
        "train attn",
        "×",
        "check",
        "note",
    ):
        table.add_column(col)
    for row in summary_rows(records):
        table.add_row(
            row["workload"],
            row["impl"],
            _ms(row.get("step_fwd")),
            _ms(row.get("attn_fwd")),
            f"{row['x_step_fwd']:.2f}" if "x_step_fwd" in row else "–",
            _ms(row.get("step_train")),
            _ms(row.get("attn_train")),
            f"{row['x_step_train']:.2f}" if "x_step_train" in row else "–",
            row.get("check", "–"),
            row["note"][:70],
        )
    Console(file=file or sys.stdout, width=200).print(table)


def main(argv=None, prog: str = "sparseattn bench model") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(prog).parse_args(argv)
    if args.markdown:
        print(markdown_table(json.loads(Path(args.markdown).read_text(encoding="utf-8"))["records"]))
        return 0
    try:
        import diffusers  # noqa: F401
        import torch  # noqa: F401
    except ImportError as err:
        print(
            f"{prog}: error: needs torch and diffusers (pip install -e '.[diffusers]'): {err}",
            file=sys.stderr,
        )
        return 1
    now = datetime.now(timezone.utc)
    out = Path(args.out or f"data/bench/model_wan_{now.strftime('%Y%m%dT%H%M%SZ')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    command = " ".join([prog, *argv])
    os.environ.setdefault("FASTVIDEO_VSA_TRITON", "1")

    from .bench import _git_commit

    commit = _git_commit()

    def emit(records):
        out.write_text(json.dumps(payload(records, args, command, now, commit), indent=1))

    run = Run(args)
    run.log(f"{command}  # {device_name(args.device)}")
    records = ranks_bench(args, run, emit) if args.ranks > 1 else run.bench(emit)
    emit(records)
    if args.ranks > 1:
        print_ranks_summary(records)
    else:
        print_summary(records)
    print(f"wrote {out}")
    return 0 if all(r.get("correct") is not False for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
