"""Launchers of ``kernels_cu/slots.cu``: activations between token order ``[batch, tokens, heads, d]`` and a
layout's slot order ``[batch, heads, slots, d]`` (padding slots zero), up to three tensors per launch, on
the current stream. Tensors are raw device pointers (``numpy.uint64``) or CuPy arrays, bf16, contiguous,
``d`` a multiple of 8; the torch side is the ``sparseattn::tokens_to_slots`` operator (:mod:`sparseattn.torch_ops`)."""

from __future__ import annotations

import numpy as np

from . import launch

SOURCE = "slots.cu"
NAME_EXPRESSIONS = ("slots_from_tokens", "tokens_from_slots")
THREADS = 256
NULL = np.uint64(0)


#: The most grid rows (CUDA's limit on ``gridDim.y``); the kernels stride over more matrices.
MAX_GRID_Y = 65535
#: The most 16-byte chunks one grid row covers (the kernels' index arithmetic is 32-bit).
MAX_CHUNKS = 2**31 - 1


def _launch(
    name: str,
    sources,
    targets,
    index,
    batch: int,
    tokens: int,
    heads: int,
    slots: int,
    d: int,
    rows: int,
    matrices: int,
):
    """``rows``: the rows one grid row covers (slots of one (batch, head) matrix, or tokens · heads of one
    batch entry); ``matrices``: how many such units the grid's second dimension runs over."""
    n = len(sources)
    chunks = d // 8
    per_row = rows * chunks
    if per_row == 0 or matrices == 0:
        return
    if per_row > MAX_CHUNKS:
        raise ValueError(f"{name}: {per_row} chunks of 16 bytes per grid row exceed {MAX_CHUNKS}")
    pad = lambda xs: tuple(xs) + (NULL,) * (3 - n)
    launch.function(SOURCE, name, NAME_EXPRESSIONS)(
        (-(-per_row // THREADS), min(matrices, MAX_GRID_Y)),
        (THREADS,),
        (
            *pad(sources),
            *pad(targets),
            np.int32(n),
            index,
            np.int32(batch),
            np.int32(tokens),
            np.int32(heads),
            np.int32(slots),
            np.int32(chunks),
        ),
    )


def slots_from_tokens(sources, targets, slot_token, batch: int, tokens: int, heads: int, slots: int, d: int):
    """``targets[i][b, h, s] = sources[i][b, slot_token[s], h]`` (zeros where ``slot_token[s] < 0``)."""
    _launch(
        "slots_from_tokens",
        sources,
        targets,
        slot_token,
        batch,
        tokens,
        heads,
        slots,
        d,
        slots,
        batch * heads,
    )


def tokens_from_slots(sources, targets, token_slot, batch: int, tokens: int, heads: int, slots: int, d: int):
    """``targets[i][b, t, h] = sources[i][b, h, token_slot[t]]``."""
    _launch(
        "tokens_from_slots",
        sources,
        targets,
        token_slot,
        batch,
        tokens,
        heads,
        slots,
        d,
        tokens * heads,
        batch,
    )
