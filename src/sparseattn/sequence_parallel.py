"""Ulysses sequence parallelism for the Wan sparse processor over ``torch.distributed``.

>>> import torch.distributed as dist
>>> from sparseattn.diffusers_wan import WanSelection
>>> from sparseattn.sequence_parallel import install_sequence_parallel, sync_gradients
>>> dist.init_process_group("nccl")          # or "gloo" on CPU; one process per rank (torchrun)
>>> install_sequence_parallel(transformer, grid=(21, 45, 80), selection=WanSelection.sta(),
...                           backend="kpage")          # "masked_sdpa" on any device
>>> out = transformer(latents, t, text, return_dict=False)[0]   # the same full inputs on every rank
>>> loss = criterion(out); loss.backward(); sync_gradients(transformer)   # then the optimizer step

Every rank gets the full model inputs and returns the full output. In between, each rank holds a
slice of the tokens: the hidden states ``[B, L, C]`` are sliced along the sequence before the first block
and gathered after ``proj_out``, so the blocks' per-token layers (norms, FFN, cross-attention,
projections) run on ``[B, L/r, C]``. In self-attention, q, k, v ``[B, L/r, H, d]`` go through one
all-to-all to ``[B, L, H/r, d]`` (all tokens of the rank's heads), sparse attention runs per rank, and a
second all-to-all brings ``[B, L, H/r, d]`` back to ``[B, L/r, H, d]`` (DeepSpeed-Ulysses). Parameter
gradients are then partial per rank: :func:`sync_gradients` sums them over the group. ``H`` must be a
multiple of the ranks (else ``ValueError``); ``L`` need not be: the first ``L % r`` ranks hold one token
more. Launch: ``torchrun --nproc-per-node N``, or :func:`run_ranks` from one process (tests, benches).
Design, what was tested on CPUs and what still needs several GPUs: ``docs/sequence_parallel.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

from .diffusers_wan import BACKENDS, WanSelection, WanSparseAttnProcessor, apply_rotary

_HOOKS_ATTR = "_sparseattn_sequence_parallel_hooks"


# ---- the token split --------------------------------------------------------------------------------


def token_split(num_tokens: int, ranks: int) -> list[int]:
    """Tokens per rank: ``num_tokens // ranks`` each, one more on the first ``num_tokens % ranks`` ranks
    (``torch.tensor_split``'s rule)."""
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, got {ranks}")
    if num_tokens < ranks:
        raise ValueError(f"num_tokens ({num_tokens}) must be at least the number of ranks ({ranks})")
    base, extra = divmod(int(num_tokens), int(ranks))
    return [base + (i < extra) for i in range(ranks)]


def token_range(num_tokens: int, ranks: int, rank: int) -> tuple[int, int]:
    """``(start, stop)`` of ``rank``'s tokens in the raster token order."""
    sizes = token_split(num_tokens, ranks)
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def _dist():
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "sequence parallelism needs an initialised torch.distributed process group "
            "(torch.distributed.init_process_group, torchrun, or sparseattn.sequence_parallel.run_ranks)"
        )
    return dist


def group_rank_size(group=None) -> tuple[int, int]:
    """``(rank, size)`` of this process in ``group`` (default: the whole world)."""
    dist = _dist()
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given group")
    return rank, dist.get_world_size(group)


# ---- timing of the all-to-alls ----------------------------------------------------------------------


class CommTimer:
    """Time spent in this module's collectives (all-to-alls and the output gather, forward and backward)
    while it is active: ``with CommTimer() as t: step()`` then ``t.seconds()``. CUDA tensors are timed
    with CUDA events on the current stream (the time includes waiting for slower ranks); CPU tensors with
    the wall clock around the (blocking) gloo call."""

    _active: CommTimer | None = None

    def __init__(self):
        self._cpu = 0.0
        self._events: list = []
        self.calls = 0

    def __enter__(self):
        self._outer, CommTimer._active = CommTimer._active, self
        return self

    def __exit__(self, *exc):
        CommTimer._active = self._outer
        return False

    def _begin(self, device):
        self.calls += 1
        if device.type == "cuda":
            import torch

            start = torch.cuda.Event(enable_timing=True)
            start.record()
            return start
        return time.perf_counter()

    def _end(self, token):
        if isinstance(token, float):
            self._cpu += time.perf_counter() - token
            return
        import torch

        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._events.append((token, end))

    def seconds(self) -> float:
        """Total seconds so far (synchronises on the recorded CUDA events)."""
        total = self._cpu
        for start, end in self._events:
            end.synchronize()
            total += start.elapsed_time(end) / 1e3
        return total


def _timed(x, collective):
    timer = CommTimer._active
    if timer is None:
        return collective()
    token = timer._begin(x.device)
    out = collective()
    timer._end(token)
    return out


# ---- differentiable collectives ---------------------------------------------------------------------


def _all_to_all(x, scatter_dim, scatter_sizes, gather_dim, gather_sizes, group):
    """Rank ``j`` receives chunk ``j`` of every rank's ``x`` split along ``scatter_dim`` (sizes
    ``scatter_sizes``), and concatenates them along ``gather_dim`` in rank order (rank ``i``'s chunk holds
    ``gather_sizes[i]`` along it). One ``all_to_all_single`` of flat buffers (uneven sizes allowed)."""
    import torch

    dist = _dist()
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    if len(set(scatter_sizes)) == 1:  # [r, ..., size, ...]: one copy
        send = x.unflatten(scatter_dim, (ranks, scatter_sizes[0])).movedim(scatter_dim, 0).contiguous()
        send_counts = [send[0].numel()] * ranks
        send = send.view(-1)
    else:
        chunks = [c.reshape(-1) for c in x.split(list(scatter_sizes), dim=scatter_dim)]
        send_counts = [c.numel() for c in chunks]
        send = torch.cat(chunks)
    shapes = []
    for size in gather_sizes:
        shape = list(x.shape)
        shape[scatter_dim], shape[gather_dim] = scatter_sizes[rank], size
        shapes.append(shape)
    recv_counts = [int(np.prod(shape)) for shape in shapes]
    recv = x.new_empty(sum(recv_counts))
    _timed(x, lambda: dist.all_to_all_single(recv, send, recv_counts, send_counts, group=group))
    parts = [part.view(shape) for part, shape in zip(recv.split(recv_counts), shapes)]
    return torch.cat(parts, dim=gather_dim)


def _autograd():
    import torch

    class AllToAll(torch.autograd.Function):
        """:func:`_all_to_all` with autograd: the gradient goes back through the reverse all-to-all."""

        @staticmethod
        def forward(ctx, x, scatter_dim, scatter_sizes, gather_dim, gather_sizes, group):
            ctx.args = (scatter_dim, scatter_sizes, gather_dim, gather_sizes, group)
            return _all_to_all(x, scatter_dim, scatter_sizes, gather_dim, gather_sizes, group)

        @staticmethod
        def backward(ctx, grad):
            scatter_dim, scatter_sizes, gather_dim, gather_sizes, group = ctx.args
            dx = _all_to_all(grad, gather_dim, gather_sizes, scatter_dim, scatter_sizes, group)
            return dx, None, None, None, None, None

    class GatherTokens(torch.autograd.Function):
        """``[B, L_rank, ...]`` slices -> ``[B, L, ...]`` on every rank; the gradient is the rank's slice of
        the output's gradient (the loss is taken to be computed alike on every rank from the full output:
        summed over the ranks, the parameter gradients are then the single-process ones)."""

        @staticmethod
        def forward(ctx, x, sizes, group):
            dist = _dist()
            rank = dist.get_rank(group)
            most = max(sizes)
            if x.shape[1] < most:  # equal shapes for all_gather: pad, then trim
                pad = x.new_zeros(x.shape[0], most - x.shape[1], *x.shape[2:])
                x = torch.cat([x, pad], dim=1)
            parts = [torch.empty_like(x) for _ in sizes]
            _timed(x, lambda: dist.all_gather(parts, x.contiguous(), group=group))
            ctx.range = (sum(sizes[:rank]), sum(sizes[: rank + 1]))
            return torch.cat([p[:, :n] for p, n in zip(parts, sizes)], dim=1)

        @staticmethod
        def backward(ctx, grad):
            start, stop = ctx.range
            return grad[:, start:stop], None, None

    return AllToAll, GatherTokens


_FUNCTIONS = None


def _functions():
    global _FUNCTIONS
    if _FUNCTIONS is None:
        _FUNCTIONS = _autograd()
    return _FUNCTIONS


def _check_heads(heads: int, ranks: int, what: str = "heads") -> int:
    if heads % ranks:
        raise ValueError(
            f"{what} ({heads}) must be a multiple of the sequence-parallel ranks ({ranks}): "
            "Ulysses gives every rank the same number of heads"
        )
    return heads // ranks


def seq_to_heads(x, token_sizes=None, group=None):
    """Token slices -> head slices: ``[..., L_rank, H, d]`` -> ``[..., L, H/r, d]`` (all tokens of this
    rank's heads ``[rank·H/r, (rank+1)·H/r)``), with autograd. ``token_sizes``: every rank's ``L_rank``
    (default: all equal to this rank's)."""
    rank, ranks = group_rank_size(group)
    if x.dim() < 3:
        raise ValueError(f"x must be [..., tokens, heads, d], got shape {tuple(x.shape)}")
    hr = _check_heads(x.shape[-2], ranks)
    sizes = [x.shape[-3]] * ranks if token_sizes is None else [int(n) for n in token_sizes]
    if len(sizes) != ranks or sizes[rank] != x.shape[-3]:
        raise ValueError(
            f"token_sizes must give the {ranks} ranks' token counts, this rank's being {x.shape[-3]}; "
            f"got {sizes}"
        )
    all_to_all, _ = _functions()
    return all_to_all.apply(x, x.dim() - 2, [hr] * ranks, x.dim() - 3, sizes, group)


def heads_to_seq(x, token_sizes=None, group=None):
    """:func:`seq_to_heads`'s inverse: ``[..., L, H/r, d]`` -> ``[..., L_rank, H, d]``, with autograd.
    ``token_sizes``: every rank's token count (default: ``L`` split by :func:`token_split`)."""
    _, ranks = group_rank_size(group)
    if x.dim() < 3:
        raise ValueError(f"x must be [..., tokens, heads, d], got shape {tuple(x.shape)}")
    sizes = token_split(x.shape[-3], ranks) if token_sizes is None else [int(n) for n in token_sizes]
    if len(sizes) != ranks or sum(sizes) != x.shape[-3]:
        raise ValueError(f"token_sizes must be {ranks} counts adding up to {x.shape[-3]}, got {sizes}")
    all_to_all, _ = _functions()
    return all_to_all.apply(x, x.dim() - 3, sizes, x.dim() - 2, [x.shape[-2]] * ranks, group)


def shard_tokens(x, group=None):
    """This rank's slice ``[B, L_rank, ...]`` of ``[B, L, ...]`` (:func:`token_split`; a view, with autograd:
    the other tokens get zero gradient on this rank)."""
    rank, ranks = group_rank_size(group)
    start, stop = token_range(x.shape[1], ranks, rank)
    return x[:, start:stop]


def gather_tokens(x, num_tokens: int, group=None):
    """Every rank's ``[B, L_rank, ...]`` slice -> ``[B, num_tokens, ...]`` on every rank (autograd: each
    rank's gradient is its slice of the output's gradient; see :func:`sync_gradients`)."""
    rank, ranks = group_rank_size(group)
    sizes = token_split(num_tokens, ranks)
    if x.shape[1] != sizes[rank]:
        raise ValueError(
            f"x holds {x.shape[1]} tokens; rank {rank} of {ranks} holds {sizes[rank]} of {num_tokens}"
        )
    _, gather = _functions()
    return gather.apply(x, sizes, group)


def sync_gradients(module_or_params, group=None) -> None:
    """Sum the parameters' gradients over ``group`` (one all-reduce per dtype and device). Under sequence
    parallelism each rank's gradient only holds its tokens' part; the sum is the single-process gradient
    (the same holds for a gradient of the model's input: all-reduce it). Data parallelism over other
    groups averages on top of this, as usual."""
    import torch

    dist = _dist()
    params = module_or_params.parameters() if hasattr(module_or_params, "parameters") else module_or_params
    buckets: dict = {}
    for p in params:
        if p.grad is not None:
            buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        _timed(flat, lambda flat=flat: dist.all_reduce(flat, group=group))
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


# ---- the processor ----------------------------------------------------------------------------------


class UlyssesWanSparseAttnProcessor(WanSparseAttnProcessor):
    """:class:`~sparseattn.diffusers_wan.WanSparseAttnProcessor` under Ulysses sequence parallelism.

    Self-attention gets this rank's hidden states ``[B, L_rank, C]`` (and Wan's rotary tables for all
    ``L`` tokens, or for this rank's); q, k, v ``[B, L_rank, H, d]`` are projected, normed and rotated
    locally, one all-to-all makes them ``[B, L, H/r, d]``, the selection's sparse attention runs on the
    rank's heads (the static graph built once with ``H/r`` heads: heads ``[rank·H/r, (rank+1)·H/r)`` of
    the model-wide graph; VSA selected from the rank's own heads' q, k each call; the KPage backend
    scatters all ``L`` tokens of the rank's heads into the layout's slots), and a second all-to-all
    brings the output back to ``[B, L_rank, H, d]`` before ``to_out``. Cross-attention runs per token
    on the rank's slice (diffusers' processor).
    """

    def __init__(
        self,
        grid,
        selection: WanSelection,
        backend: str = "kpage",
        route="auto",
        group=None,
        token_order=None,
    ):
        super().__init__(grid, selection, backend, route, token_order=token_order)
        self.group = group
        self.rank, self.ranks = group_rank_size(group)
        self.token_sizes = token_split(self.num_tokens, self.ranks)
        self.tokens = token_range(self.num_tokens, self.ranks, self.rank)

    def graph_for(self, heads: int, q=None, k=None):
        """The rank's graph of ``heads`` (= H/r) heads: static kinds cut from the model-wide graph of
        ``heads · ranks`` heads once; VSA from the rank's q, k as in the single-device processor."""
        if self.selection.dynamic:
            return super().graph_for(heads, q, k)
        if heads not in self._graphs:
            full = self.selection.graph(self.grid, heads * self.ranks)
            if self.token_order == "tiles":  # the model's tokens are the layout's valid slots in order
                full = full.tile_major_tokens()
            first = self.rank * heads
            self._graphs[heads] = full.select_heads(np.arange(first, first + heads))
        return self._graphs[heads]

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if encoder_hidden_states is not None:  # cross-attention: per token, on this rank's slice
            return self._diffusers_processor()(
                attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb
            )
        if attention_mask is not None:
            raise ValueError("attention_mask is not supported in sequence-parallel self-attention")
        start, stop = self.tokens
        if hidden_states.shape[1] != stop - start:
            raise ValueError(
                f"hidden_states holds {hidden_states.shape[1]} tokens; rank {self.rank} of {self.ranks} "
                f"holds {stop - start} of the grid {self.grid}'s {self.num_tokens} "
                "(install_sequence_parallel slices the sequence before the blocks)"
            )
        _check_heads(attn.heads, self.ranks, "attn.heads")
        if getattr(attn, "to_qkv", None) is not None and getattr(attn, "fused_projections", False):
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        query, key = attn.norm_q(query), attn.norm_k(key)  # across heads, per token: local
        query, key, value = (x.unflatten(2, (attn.heads, -1)) for x in (query, key, value))
        if rotary_emb is not None:
            cos, sin = rotary_emb
            if cos.shape[1] == self.num_tokens and self.ranks > 1:
                cos, sin = cos[:, start:stop], sin[:, start:stop]
            query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
        import torch

        if query.dtype == key.dtype == value.dtype:  # one all-to-all for the three
            qkv = torch.stack([query, key, value])  # [3, B, L_rank, H, d]
            qkv = seq_to_heads(qkv, self.token_sizes, self.group).unbind(0)  # 3 x [B, L, H/r, d]
        else:  # mixed dtypes (autocast): one each
            qkv = [seq_to_heads(x, self.token_sizes, self.group) for x in (query, key, value)]
        out = self.attend(*qkv)  # [B, L, H/r, d]
        out = heads_to_seq(out.to(query.dtype), self.token_sizes, self.group)  # [B, L_rank, H, d]
        out = out.flatten(2, 3).type_as(query)
        out = attn.to_out[0](out)
        return attn.to_out[1](out)


def install_sequence_parallel(
    transformer,
    grid,
    selection: WanSelection,
    group=None,
    backend: str = "kpage",
    route="auto",
    token_order=None,
):
    """Run a diffusers ``WanTransformer3DModel`` under Ulysses sequence parallelism over ``group``
    (default: the world); returns the shared :class:`UlyssesWanSparseAttnProcessor`.

    Every block's ``attn1`` gets the processor; a pre-hook on ``blocks[0]`` slices the hidden states
    ``[B, L, C]`` to this rank's ``[B, L_rank, C]``; a hook on ``proj_out`` gathers ``[B, L_rank, C_out]``
    back to ``[B, L, C_out]`` on every rank, so the model's inputs and output are the single-process
    ones. Call it on every rank of ``group`` with the same arguments. Installing again replaces the
    hooks. ``ValueError``: heads not a multiple of the group's size, or a grid unlike the input's.

    ``token_order`` as :class:`~sparseattn.diffusers_wan.WanSparseAttnProcessor` takes it. With ``"tiles"``
    the tokens are put tile-major before they are sliced and back to raster order after they are gathered
    (:class:`~sparseattn.diffusers_wan.TileMajorTokens` with ``inverse_after="proj_out"``).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    blocks = getattr(transformer, "blocks", None)
    if blocks is None or getattr(transformer, "proj_out", None) is None:
        raise TypeError(
            f"transformer must be a diffusers WanTransformer3DModel, got {type(transformer).__name__}"
        )
    _, ranks = group_rank_size(group)
    for block in blocks:
        _check_heads(block.attn1.heads, ranks, "the transformer's num_attention_heads")
    processor = UlyssesWanSparseAttnProcessor(grid, selection, backend, route, group, token_order)
    if processor.num_tokens < ranks:
        raise ValueError(f"grid {processor.grid} has fewer tokens than the {ranks} ranks")
    for block in blocks:
        block.attn1.set_processor(processor)
    uninstall_sequence_parallel(transformer)  # an earlier install's hooks, tile-major ones too
    if processor.token_order == "tiles":  # its first-block hook before the slicing one, registered below
        processor.install_tile_hooks(transformer, inverse_after="proj_out")

    def shard(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.shape[1] != processor.num_tokens:
            raise ValueError(
                f"hidden_states holds {hidden.shape[1]} tokens; the processor's grid {processor.grid} "
                f"has {processor.num_tokens} (give the token grid after patching)"
            )
        temb = args[2] if len(args) > 2 else kwargs.get("temb")
        if temb is not None and temb.dim() == 4:
            raise ValueError("per-token timesteps (Wan2.2 TI2V) are not supported under sequence parallelism")
        start, stop = processor.tokens
        hidden = hidden[:, start:stop].contiguous()
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}

    def gather(module, args, output):
        return gather_tokens(output, processor.num_tokens, group)

    setattr(
        transformer,
        _HOOKS_ATTR,
        (
            blocks[0].register_forward_pre_hook(shard, with_kwargs=True),
            # before the tile-major hooks' own on proj_out: they take the gathered tokens back to raster order
            transformer.proj_out.register_forward_hook(gather, prepend=True),
        ),
    )
    return processor


def uninstall_sequence_parallel(transformer) -> None:
    """Remove the slicing and gathering hooks, and the tile-major hooks of a ``token_order="tiles"`` install
    (the processors stay: install single-device ones)."""
    for handle in getattr(transformer, _HOOKS_ATTR, ()):
        handle.remove()
    setattr(transformer, _HOOKS_ATTR, ())
    tiles = getattr(transformer, "_sparseattn_tile_hooks", None)
    if tiles is not None:
        tiles.remove()


# ---- launching ranks --------------------------------------------------------------------------------


def _rank_main(rank, ranks, backend, folder, fn, args, mp_start="spawn"):
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(rank)
    elif mp_start == "fork":  # no OpenMP pool across a fork
        torch.set_num_threads(1)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))
    dist.init_process_group(backend, init_method=f"file://{folder}/store", rank=rank, world_size=ranks)
    try:
        result = fn(rank, ranks, *args)
        torch.save(result, os.path.join(folder, f"result{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(n: int, fn, *args, backend: str | None = None, start_method: str = "spawn"):
    """Run ``fn(rank, n, *args)`` in ``n`` new processes joined in one ``torch.distributed`` group (the
    default group; a file store in a temporary folder) and return their results ``[rank 0, ..., n-1]``.

    ``backend``: ``"nccl"`` (rank ``i`` on ``cuda:i``) when CUDA has ``n`` devices, else ``"gloo"`` (CPU,
    ``cpu_count // n`` threads per rank). ``fn`` must be importable by name (a module-level function) and
    its result picklable (``torch.save``). A rank that raises makes this raise. ``start_method="fork"``
    starts the ranks in a second instead of importing torch anew in each (CPU only; the ranks then run
    one thread each).

    What a bench of ``sparseattn bench model wan --ranks N`` built on this (or on torchrun with
    :func:`bench_step`) must measure: the per-step time (forward + backward of the whole model, and the
    forward alone for sampling) on every rank, max over ranks, against the one-GPU step; and the share
    of it in the all-to-alls (:class:`CommTimer`: CUDA events around each collective on GPUs, including
    the wait for slower ranks), reported with the rank count, grid, heads, selection and backend.
    """
    import torch
    import torch.multiprocessing as mp

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= n else "gloo"
    with tempfile.TemporaryDirectory(prefix="sparseattn-ranks-") as folder:
        mp.start_processes(
            _rank_main,
            args=(n, backend, folder, fn, args, start_method),
            nprocs=n,
            join=True,
            start_method=start_method,
        )
        return [torch.load(os.path.join(folder, f"result{r}.pt"), weights_only=False) for r in range(n)]


def bench_step(
    rank: int,
    ranks: int,
    grid=(8, 8, 8),
    selection="sta",
    backend: str = "masked_sdpa",
    heads: int = 4,
    head_dim: int = 32,
    layers: int = 2,
    ffn_dim: int = 256,
    steps: int = 3,
    warmup: int = 1,
    backward: bool = True,
    config: dict | None = None,
    text_tokens: int = 16,
    token_order=None,
) -> dict:
    """Per-step seconds and seconds in the collectives of a random-init Wan under sequence parallelism on
    this rank (float32 weights, bf16 autocast on CUDA as :mod:`sparseattn.wan_training`; float32 on CPU),
    one batch entry; ``ranks == 1`` runs the single-device
    processor. Called on every rank (:func:`run_ranks` or torchrun).

    ``selection``: ``"sta"`` / ``"vsa"`` / ``"full"`` (clipped to small grids) or a :class:`WanSelection`;
    ``config``: ``WanTransformer3DModel`` arguments (a model shape such as Wan2.1-1.3B's) in place of
    ``heads``, ``head_dim``, ``layers`` and ``ffn_dim``; ``text_tokens`` of the text embedding;
    ``token_order`` as :func:`install_sequence_parallel` takes it (``None``: the processors' default)."""
    import torch
    from diffusers import WanTransformer3DModel

    from .diffusers_wan import install_sparse_attention, token_order_default

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    if config is None:
        config = dict(
            patch_size=(1, 2, 2),
            num_attention_heads=heads,
            attention_head_dim=head_dim,
            in_channels=16,
            out_channels=16,
            text_dim=64,
            freq_dim=64,
            ffn_dim=ffn_dim,
            num_layers=layers,
        )
    config = dict(config, rope_max_seq_len=max(1024, *grid, config.get("rope_max_seq_len", 1024)))
    heads, head_dim = config["num_attention_heads"], config["attention_head_dim"]
    layers, ffn_dim = config["num_layers"], config["ffn_dim"]
    model = WanTransformer3DModel(**config).to(device)
    tiles = [-(-n // 4) for n in grid]
    sel = selection
    if isinstance(selection, str):
        sel = {  # STA's 3x3x3 window and VSA's top 8 of 4x4x4 cubes, clipped to small grids
            "sta": WanSelection.sta((4, 4, 4), tuple(min(3, n) for n in tiles)),
            "vsa": WanSelection.vsa((4, 4, 4), min(8, int(np.prod(tiles)))),
            "full": WanSelection.full((4, 4, 4)),
        }[selection]
    if ranks > 1:
        processor = install_sequence_parallel(model, grid, sel, backend=backend, token_order=token_order)
    else:
        # the ranks' token order on one rank too (install_sparse_attention's own default is tile-major)
        order = token_order_default() if token_order is None else token_order
        processor = install_sparse_attention(model, grid, sel, backend=backend, token_order=order)
    g = torch.Generator(device=device).manual_seed(1)
    channels = config["in_channels"]
    x = torch.randn(1, channels, grid[0], 2 * grid[1], 2 * grid[2], generator=g, device=device)
    text = torch.randn(1, text_tokens, config["text_dim"], generator=g, device=device)
    t = torch.tensor([500], device=device)
    step_s, comm_s = [], []
    for i in range(warmup + steps):
        with CommTimer() as timer:
            t0 = time.perf_counter()
            with torch.set_grad_enabled(backward), torch.autocast(device.type, torch.bfloat16, enabled=cuda):
                out = model(x, t, text, return_dict=False)[0]
                if backward:
                    out.float().square().mean().backward()
            if cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
        if i >= warmup:
            step_s.append(elapsed)
            comm_s.append(timer.seconds())
        model.zero_grad(set_to_none=True)
    return {
        "rank": rank,
        "ranks": ranks,
        "grid": list(grid),
        "selection": sel.kind,
        "backend": backend,
        "token_order": processor.token_order,
        "heads": heads,
        "head_dim": head_dim,
        "layers": layers,
        "backward": backward,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "step_s": step_s,
        "all_to_all_s": comm_s,
    }


def _summary(results: list[dict]) -> dict:
    step = [float(np.median(r["step_s"])) for r in results]
    comm = [float(np.median(r["all_to_all_s"])) for r in results]
    head = {k: v for k, v in results[0].items() if k not in ("rank", "step_s", "all_to_all_s")}
    return {
        **head,
        "step_s": max(step),
        "all_to_all_s": max(comm),
        "all_to_all_share": max(c / s for c, s in zip(comm, step)),
        "per_rank": results,
    }


def main(argv=None) -> int:
    """``python -m sparseattn.sequence_parallel --ranks N [...]``: spawns the ranks itself, or runs as one
    rank of ``torchrun --nproc-per-node N -m sparseattn.sequence_parallel`` (``WORLD_SIZE`` set); rank 0
    prints the JSON summary (max over ranks of the median step and all-to-all seconds)."""
    ap = argparse.ArgumentParser(prog="python -m sparseattn.sequence_parallel", description=main.__doc__)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--grid", default="8,8,8", help="token grid after patching: frames,height,width")
    ap.add_argument("--selection", choices=("sta", "vsa", "full"), default="sta")
    ap.add_argument("--backend", choices=BACKENDS, default=None, help="default: kpage on CUDA")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--ffn-dim", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--forward-only", action="store_true")
    ap.add_argument(
        "--token-order",
        choices=("default", "tiles"),
        default="default",
        help="tiles: the model's tokens kept tile-major between its blocks (token_order='tiles')",
    )
    args = ap.parse_args(argv)
    try:
        import diffusers  # noqa: F401
        import torch
    except ImportError as err:
        print(f"needs torch and diffusers: pip install -e '.[diffusers]' ({err})", file=sys.stderr)
        return 1
    grid = tuple(int(v) for v in args.grid.split(","))
    backend = args.backend or ("kpage" if torch.cuda.is_available() else "masked_sdpa")
    options = dict(
        grid=grid,
        selection=args.selection,
        backend=backend,
        heads=args.heads,
        head_dim=args.head_dim,
        layers=args.layers,
        ffn_dim=args.ffn_dim,
        steps=args.steps,
        backward=not args.forward_only,
        token_order="tiles" if args.token_order == "tiles" else None,
    )
    if "WORLD_SIZE" in os.environ:  # one rank of torchrun
        import torch.distributed as dist

        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
        try:
            result = bench_step(dist.get_rank(), dist.get_world_size(), **options)
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, result)
        finally:
            dist.destroy_process_group()
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(_summary(gathered), indent=1))
        return 0
    import importlib

    # by the module's name, which the spawned ranks import (run as a script, this one is __main__)
    worker = importlib.import_module("sparseattn.sequence_parallel")._bench_rank
    results = run_ranks(args.ranks, worker, options)
    print(json.dumps(_summary(results), indent=1))
    return 0


def _bench_rank(rank, ranks, options):
    return bench_step(rank, ranks, **options)


if __name__ == "__main__":
    raise SystemExit(main())
