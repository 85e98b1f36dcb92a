"""Launchers of ``kernels_cu/group_slots.cu``: a partition layout's slots by counting tokens per group and
chunk, without a sort (:func:`token_slots`; the counting form of :func:`sparseattn.svg2_device.partition_slots`).
On torch CUDA tensors, torch's current stream, no host synchronisation."""

from __future__ import annotations

import numpy as np

from . import launch

SOURCE = "group_slots.cu"
NAME_EXPRESSIONS = ("group_chunk_counts", "group_token_slots")
# Geometry mirrored from the kernels.
WARPS = 8
THREADS = 32 * WARPS
CHUNK_TOKENS = 256 * WARPS
#: The most groups the kernels take: each CTA keeps WARPS int32 counters per group in shared memory
#: (128 KiB at this bound).
MAX_GROUPS = 4096
#: The most rows (CUDA's limit on ``gridDim.y``).
MAX_ROWS = 65535


def available(labels) -> bool:
    """Whether the kernels can run on ``labels``: an int64 CUDA tensor on an sm_90 GPU, CuPy importable."""
    return launch.runs_sm90(labels) and str(labels.dtype) == "torch.int64"


def _check(labels, groups: int) -> None:
    if labels.ndim != 2 or not labels.is_contiguous():
        raise ValueError(f"labels must be a contiguous tensor [N, tokens], got shape {list(labels.shape)}")
    if not 1 <= groups <= MAX_GROUPS:
        raise ValueError(f"groups must be in [1, {MAX_GROUPS}] for the counting kernels, got {groups}")
    if labels.shape[1] >= 2**31 or labels.shape[0] > MAX_ROWS:
        raise ValueError(
            f"labels must be [N <= {MAX_ROWS}, tokens < 2**31] for the counting kernels, got {list(labels.shape)}"
        )


def _launch(name: str, labels, args: tuple, groups: int) -> None:
    n, t = labels.shape
    smem = WARPS * groups * 4
    fn = launch.prepare(launch.function(SOURCE, name, NAME_EXPRESSIONS), smem)
    with launch.torch_stream():
        fn((-(-t // CHUNK_TOKENS), n), (THREADS,), args, shared_mem=smem)


def chunk_counts(labels, groups: int):
    """int32 ``[N, chunks, groups]``: the tokens of each group in each chunk of ``CHUNK_TOKENS`` tokens of
    each row of ``labels`` (int64 ``[N, tokens]``; labels outside ``[0, groups)`` are not counted)."""
    import torch

    _check(labels, groups)
    n, t = labels.shape
    counts = torch.empty(n, -(-t // CHUNK_TOKENS), groups, dtype=torch.int32, device=labels.device)
    if counts.numel():
        ptr = lambda a: np.uint64(a.data_ptr())
        _launch(
            "group_chunk_counts", labels, (ptr(labels), ptr(counts), np.int32(t), np.int32(groups)), groups
        )
    return counts


def token_slots(labels, groups: int, group_start, counts=None):
    """int64 ``[N, tokens]``: each token's slot, ``group_start[n, g] +`` the tokens of its group ``g`` before it
    in its row (``group_start`` int ``[N, groups]``, each group's first slot); -1 for labels outside
    ``[0, groups)``. ``counts``: :func:`chunk_counts` of the same labels, if already made."""
    import torch

    _check(labels, groups)
    n, t = labels.shape
    if group_start.shape != (n, groups):
        raise ValueError(f"group_start must be [{n}, {groups}], got {list(group_start.shape)}")
    if counts is None:
        counts = chunk_counts(labels, groups)
    # each chunk's first slot per group: the group's start plus its tokens in the chunks before
    base = (group_start.unsqueeze(1) + (counts.cumsum(1) - counts)).to(torch.int32).contiguous()
    out = torch.empty(n, t, dtype=torch.int64, device=labels.device)
    if out.numel():
        ptr = lambda a: np.uint64(a.data_ptr())
        args = (ptr(labels), ptr(base), ptr(out), np.int32(t), np.int32(groups))
        _launch("group_token_slots", labels, args, groups)
    return out
