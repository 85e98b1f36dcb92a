"""Launchers of ``kernels_cu/page_streams.cu``: the page streams of per-row layouts, one warp per work item,
the same bytes as the Triton writers of :mod:`sparseattn.planning.page_streams` (which dispatches here when
its ``WRITER`` is ``"cuda"``).

Torch CUDA tensors on an sm_90 GPU, on torch's current stream. Arguments as
:func:`sparseattn.planning.page_streams.stream_lengths` / :func:`~sparseattn.planning.page_streams.write_streams`
take them: ``sel`` bool ``[R, owner, other]`` (any strides), ``full`` / ``part`` / ``rows`` / ``other_group``
int32 ``[R, other_blocks]`` (contiguous), ``start`` int64 ``[R · owner]``, ``out`` int32 ``[≥ capacity, 2]``
(split) or ``[≥ capacity]``. The kernels take the callers' page counts (``full`` in ``[0, pages_per_block]``,
``part`` 0 or 1, ``rows`` ≥ 0) as given; every tensor's shape, dtype, device and layout is checked here.
"""

from __future__ import annotations

import numpy as np

from . import launch

SOURCE = "page_streams.cu"
NAME_EXPRESSIONS = (
    "page_stream_lengths<false>",
    "page_stream_lengths<true>",
    "page_stream_write<false, false>",
    "page_stream_write<false, true>",
    "page_stream_write<true, false>",
    "page_stream_write<true, true>",
    "page_stream_lengths_split<false>",
    "page_stream_lengths_split<true>",
    "page_stream_write_one_walk<false>",
    "page_stream_write_one_walk<true>",
)
# Geometry mirrored from the kernels.
WARPS = 8  # work items per CTA
THREADS = 32 * WARPS
INT32_MAX = 2**31 - 1


def available(x) -> bool:
    """Whether the kernels can run on ``x``'s device: a CUDA tensor on an sm_90 GPU, CuPy importable."""
    return launch.runs_sm90(x)


def _kernel_name(kind: str, split: bool, grouped: bool) -> str:
    flag = lambda b: "true" if b else "false"
    if kind in ("lengths", "lengths_split", "write_one_walk"):
        return f"page_stream_{kind}<{flag(grouped)}>"
    return f"page_stream_write<{flag(split)}, {flag(grouped)}>"


def _check_int32(name: str, x, shape) -> None:
    import torch

    if not isinstance(x, torch.Tensor) or x.dtype != torch.int32 or tuple(x.shape) != tuple(shape):
        got = f"{x.dtype} {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be an int32 tensor {list(shape)}, got {got}")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_common(sel, full, part, other_group):
    """``(items, n_owner, n_other, n_groups)`` of the arguments, each checked (ValueError naming it)."""
    import torch

    if not isinstance(sel, torch.Tensor) or sel.dtype != torch.bool or sel.ndim != 3:
        got = f"{sel.dtype} {list(sel.shape)}" if isinstance(sel, torch.Tensor) else type(sel).__name__
        raise ValueError(f"sel must be a bool tensor [R, owner, other], got {got}")
    if not available(sel):
        raise ValueError(
            f"sel must be a CUDA tensor on an sm_90 GPU (CuPy installed), got one on {sel.device}"
        )
    r, n_owner, n_cols = sel.shape
    n_other = n_cols if other_group is None else (full.shape[1] if getattr(full, "ndim", 0) == 2 else -1)
    _check_int32("full", full, (r, n_other))
    _check_int32("part", part, (r, n_other))
    if other_group is not None:
        _check_int32("other_group", other_group, (r, n_other))
    for name, x in (("full", full), ("part", part), ("other_group", other_group)):
        if x is not None and x.device != sel.device:
            raise ValueError(f"{name} must be on {sel.device} (sel's device), got {x.device}")
    for name, value in (("sel.shape[1]", n_owner), ("the other side's blocks", n_other), ("groups", n_cols)):
        if value > INT32_MAX:
            raise ValueError(f"{name} ({value}) must fit int32")
    if -(-r * n_owner // WARPS) > INT32_MAX:
        raise ValueError(f"sel's {r * n_owner} items exceed the grid ({INT32_MAX} CTAs of {WARPS} items)")
    return r * n_owner, n_owner, n_other, n_cols


def _selection_args(sel, other_group, n_owner: int, n_other: int, n_groups: int):
    """The kernels' selection arguments: sel's bytes, the group array (0 without groups), sizes, strides."""
    import torch

    sel_u8 = sel.view(torch.uint8)
    grp = np.uint64(0) if other_group is None else np.uint64(other_group.data_ptr())
    strides = (np.int64(s) for s in sel_u8.stride())
    return (np.uint64(sel_u8.data_ptr()), grp), (
        np.int32(n_owner),
        np.int32(n_other),
        np.int32(n_groups),
        *strides,
    )


def _launch(name: str, items: int, args, device) -> None:
    import torch

    with torch.cuda.device(device):
        fn = launch.function(SOURCE, name, NAME_EXPRESSIONS)
        grid = (-(-items // WARPS),)
        launch.PackedLaunch(fn, grid, (THREADS,), args)(launch.torch_stream_ptr(device.index))


def stream_lengths(sel, full, part, other_group=None, with_partials: bool = False):
    """int64 ``[R · owner]``: entries of each item's stream, ``Σ_j sel[r, i, j] · (full + part)[r, j]`` (with
    ``other_group``, ``sel[r, i, other_group[r, j]]``; a group outside ``[0, sel.shape[2])`` selects nothing).
    ``with_partials``: ``(lengths, partials)``, ``partials`` int64 ``[R · owner]`` the partial-page entries
    ``Σ_j sel · part`` (what :func:`write_streams`' ``one_walk`` takes)."""
    import torch

    items, n_owner, n_other, n_groups = _check_common(sel, full, part, other_group)
    out = torch.empty(items, dtype=torch.int64, device=sel.device)
    partials = torch.empty_like(out) if with_partials else None
    if items:
        (sel_p, grp), sizes = _selection_args(sel, other_group, n_owner, n_other, n_groups)
        ptr = lambda t: np.uint64(t.data_ptr())
        outs = (ptr(out), ptr(partials)) if with_partials else (ptr(out),)
        args = (sel_p, grp, ptr(full), ptr(part), *outs, np.int64(items), *sizes)
        kind = "lengths_split" if with_partials else "lengths"
        _launch(_kernel_name(kind, False, other_group is not None), items, args, sel.device)
    return (out, partials) if with_partials else out


def write_streams(
    sel,
    full,
    part,
    rows,
    start,
    out,
    capacity: int,
    pages_per_block: int,
    row_page_stride: int,
    split_partial: bool,
    other_group=None,
    one_walk=None,
) -> None:
    """Write every item's stream at ``start[item]`` into ``out`` (nothing at or past ``capacity``).

    Args:
        sel, full, part, other_group: as :func:`stream_lengths`.
        rows: int32 ``[R, other_blocks]``, valid rows of each block (the partial pages' masks;
            ``split_partial`` only, else unused and may be None).
        start: int64 ``[R · owner]``, each item's first entry.
        out: int32 ``[≥ capacity, 2]`` (``split_partial``: (page, mask) pairs, 8-byte aligned) or
            ``[≥ capacity]``, contiguous.
        pages_per_block: pages per block (``P``); a page id is ``r · row_page_stride + j · P + p``.
        one_walk: ``(lengths, partials)`` of :func:`stream_lengths` (``with_partials``), with
            ``split_partial``: the same bytes written in one walk of the other side's blocks, the partial
            pages at ``start + lengths − partials`` (``page_stream_write_one_walk``), instead of two.
    """
    import torch

    items, n_owner, n_other, n_groups = _check_common(sel, full, part, other_group)
    r = sel.shape[0]
    capacity, pages, stride = int(capacity), int(pages_per_block), int(row_page_stride)
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    if not 1 <= pages <= INT32_MAX:
        raise ValueError(f"pages_per_block must be in [1, {INT32_MAX}], got {pages}")
    if split_partial:
        _check_int32("rows", rows, (r, n_other))
        if rows.device != sel.device:
            raise ValueError(f"rows must be on {sel.device} (sel's device), got {rows.device}")
    if not (
        isinstance(start, torch.Tensor) and start.dtype == torch.int64 and tuple(start.shape) == (items,)
    ):
        got = (
            f"{start.dtype} {list(start.shape)}" if isinstance(start, torch.Tensor) else type(start).__name__
        )
        raise ValueError(f"start must be an int64 tensor [{items}], got {got}")
    if not start.is_contiguous() or start.device != sel.device:
        raise ValueError(f"start must be contiguous on {sel.device}")
    shape = "[>= capacity, 2]" if split_partial else "[>= capacity]"
    if (
        not isinstance(out, torch.Tensor)
        or out.dtype != torch.int32
        or out.ndim != (2 if split_partial else 1)
        or (split_partial and out.shape[1] != 2)
        or out.shape[0] < capacity
    ):
        got = f"{out.dtype} {list(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"out must be an int32 tensor {shape} (capacity {capacity}), got {got}")
    if not out.is_contiguous() or out.device != sel.device:
        raise ValueError(f"out must be contiguous on {sel.device}")
    if split_partial and out.data_ptr() % 8:
        raise ValueError("out must be 8-byte aligned (each (page, mask) pair is one 8-byte store)")
    if not items:
        return
    walk = []  # one_walk's lengths and partials, checked
    if one_walk is not None and split_partial:
        for name, x in zip(("one_walk's lengths", "one_walk's partials"), one_walk):
            if not isinstance(x, torch.Tensor) or x.dtype != torch.int64 or tuple(x.shape) != (items,):
                got = f"{x.dtype} {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"{name} must be an int64 tensor [{items}], got {got}")
            if not x.is_contiguous() or x.device != sel.device:
                raise ValueError(f"{name} must be contiguous on {sel.device}")
            walk.append(np.uint64(x.data_ptr()))
    (sel_p, grp), sizes = _selection_args(sel, other_group, n_owner, n_other, n_groups)
    ptr = lambda t: np.uint64(t.data_ptr())
    rows_p = ptr(rows) if split_partial else ptr(full)  # not read without the split
    args = (
        sel_p,
        grp,
        ptr(full),
        ptr(part),
        rows_p,
        ptr(start),
        *walk,
        ptr(out),
        np.int64(items),
        *sizes,
        np.int64(capacity),
        np.int64(stride),
        np.int32(pages),
    )
    kind = "write_one_walk" if walk else "write"
    _launch(_kernel_name(kind, bool(split_partial), other_group is not None), items, args, sel.device)
