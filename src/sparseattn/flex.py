"""SparseGraph ↔ FlexAttention ``BlockMask`` (``torch.nn.attention.flex_attention``).

A BlockMask lists, per (batch, head, Q block), the K blocks a kernel visits, in two groups: *full*
blocks, where every query attends to every key, and *partial* blocks, where ``mask_mod`` decides per
(query, key). A graph maps onto it exactly: a selected pair whose Q and K blocks are both entirely
valid is full; every other selected pair is partial, and ``mask_mod`` removes the layouts' padding.
The compiled FlexAttention kernel skips unlisted blocks, but its eager (uncompiled) path evaluates
``mask_mod`` everywhere, so by default ``mask_mod`` also holds the block selection
(``mask_mod="exact"``); ``"padding"`` keeps only the padding test, enough for compiled kernels and
cheaper inside partial blocks. Going back, the union of both groups is the selection; ``mask_mod`` is
not evaluated (block-level sparsity is the graph's, padding is the layouts').

The index arithmetic is plain numpy (:func:`kv_blocks_from_graph`, :func:`graph_from_kv_blocks`);
torch is imported only by :func:`to_flex_block_mask` and :func:`from_flex_block_mask`.

Array shapes (``H`` heads, ``nq``/``nk`` Q/K blocks): ``kv_num_blocks`` int32 ``[H, nq]``;
``kv_indices`` int32 ``[H, nq, nk]`` — the first ``kv_num_blocks[h, i]`` entries of row ``(h, i)``
are its K blocks in ascending order, the unselected blocks follow (the layout BlockMask expects).
"""

from __future__ import annotations

import numpy as np

from .graph import GraphError, GraphTypeError, HeadStack, SparseGraph
from .layouts import BlockLayout
from .limits import memory_problem


class FlexError(GraphError):
    """A BlockMask (or its index arrays) does not match the layouts; the message names the field."""


def _ordered_rows(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(counts int32 ``[..., nq]``, indices int32 ``[..., nq, nk]``: selected K blocks first)."""
    counts = mask.sum(axis=-1, dtype=np.int32)
    order = np.argsort(~mask, axis=-1, kind="stable").astype(np.int32)
    return counts, order


def _block_view(graph) -> dict:
    """Selection, full-block flags and padding of a SparseGraph or a HeadStack (every head its own
    layouts, block counts padded to the largest head's): ``selected`` bool ``[H, nq, nk]``, ``full``
    likewise, ``q_valid`` / ``k_valid`` bool ``[H, slots]``, block sizes and slot counts."""
    if isinstance(graph, SparseGraph):
        heads = [graph]
        sq, sk = graph.q.num_slots, graph.k.num_slots
    elif isinstance(graph, HeadStack):
        heads = list(graph.graphs)
        sq, sk = graph.q_slots, graph.k_slots
    else:
        raise GraphTypeError(f"graph must be a SparseGraph or a HeadStack, got {type(graph).__name__}")
    bq, bk = heads[0].q.block_size, heads[0].k.block_size
    if any(g.q.block_size != bq or g.k.block_size != bk for g in heads):
        raise FlexError("every head of a HeadStack needs the same block sizes for one BlockMask")
    nq, nk = -(-sq // bq), -(-sk // bk)
    problem = memory_problem(10 * graph.heads * nq * nk, "the BlockMask index arrays")
    if problem:
        raise FlexError(problem)
    if isinstance(graph, SparseGraph):
        selected = graph.block_mask()
        full_q = (graph.q.valid_rows == bq)[None]
        full_k = (graph.k.valid_rows == bk)[None]
        q_valid, k_valid = graph.q.valid[None], graph.k.valid[None]
    else:
        selected = np.zeros((graph.heads, nq, nk), dtype=bool)
        full_q = np.zeros((graph.heads, nq), dtype=bool)
        full_k = np.zeros((graph.heads, nk), dtype=bool)
        q_valid = np.zeros((graph.heads, sq), dtype=bool)
        k_valid = np.zeros((graph.heads, sk), dtype=bool)
        for h, g in enumerate(heads):
            _, i, j = g.pairs
            selected[h, i, j] = True
            full_q[h, : g.q.num_blocks] = g.q.valid_rows == bq
            full_k[h, : g.k.num_blocks] = g.k.valid_rows == bk
            q_valid[h, : g.q.num_slots] = g.q.valid
            k_valid[h, : g.k.num_slots] = g.k.valid
    full = selected & full_q[:, :, None] & full_k[:, None, :]
    return dict(
        selected=selected, full=full, q_valid=q_valid, k_valid=k_valid, block=(bq, bk), seq_lengths=(sq, sk)
    )


def kv_blocks_from_graph(graph) -> dict[str, np.ndarray]:
    """The four BlockMask index arrays of ``graph`` (a SparseGraph or a HeadStack; numpy, no batch axis).

    Returns ``kv_num_blocks``/``kv_indices`` (partial blocks) and ``full_kv_num_blocks``/
    ``full_kv_indices`` (full blocks); see the module docstring for shapes.
    """
    view = _block_view(graph)
    partial_num, partial_idx = _ordered_rows(view["selected"] & ~view["full"])
    full_num, full_idx = _ordered_rows(view["full"])
    return {
        "kv_num_blocks": partial_num,
        "kv_indices": partial_idx,
        "full_kv_num_blocks": full_num,
        "full_kv_indices": full_idx,
    }


def _selected_pairs(name: str, num, idx, heads: int, nq: int, nk: int):
    """(head, q_block, k_block) int64 of the counted prefix of each row of one index-array pair."""
    num, idx = np.asarray(num), np.asarray(idx)
    for label, arr in ((f"{name}kv_num_blocks", num), (f"{name}kv_indices", idx)):
        if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
            raise FlexError(f"{label} must hold integers, got dtype {arr.dtype}")
    if num.shape != (heads, nq):
        raise FlexError(f"{name}kv_num_blocks must have shape ({heads}, {nq}), got {num.shape}")
    if idx.ndim != 3 or idx.shape[:2] != (heads, nq):
        raise FlexError(f"{name}kv_indices must have shape ({heads}, {nq}, K), got {idx.shape}")
    if num.size and (num.min() < 0 or num.max() > min(idx.shape[2], nk)):
        raise FlexError(
            f"{name}kv_num_blocks must lie in [0, {min(idx.shape[2], nk)}], got {num.min()}..{num.max()}"
        )
    counted = np.arange(idx.shape[2])[None, None, :] < num[:, :, None]
    h, i, slot = np.nonzero(counted)
    j = idx[h, i, slot].astype(np.int64)
    if j.size and (j.min() < 0 or j.max() >= nk):
        bad = int(np.flatnonzero((j < 0) | (j >= nk))[0])
        raise FlexError(
            f"{name}kv_indices[{h[bad]}, {i[bad]}, {slot[bad]}] = {j[bad]} is outside the {nk} K blocks"
        )
    return h, i, j


def graph_from_kv_blocks(
    q: BlockLayout,
    k: BlockLayout,
    kv_num_blocks,
    kv_indices,
    full_kv_num_blocks=None,
    full_kv_indices=None,
    name: str = "",
) -> SparseGraph:
    """The graph selecting the partial and full K blocks of BlockMask index arrays (numpy, no batch).

    Pairs touching a block without valid rows are dropped and counted (``dropped_pairs``).
    """
    if not isinstance(q, BlockLayout) or not isinstance(k, BlockLayout):
        raise GraphTypeError("q and k must be BlockLayouts")
    num = np.asarray(kv_num_blocks)
    heads = num.shape[0] if num.ndim == 2 else 0
    if heads == 0:
        raise FlexError(f"kv_num_blocks must have shape (heads, {q.num_blocks}), got {num.shape}")
    parts = [_selected_pairs("", num, kv_indices, heads, q.num_blocks, k.num_blocks)]
    if (full_kv_num_blocks is None) != (full_kv_indices is None):
        raise FlexError("give both full_kv_num_blocks and full_kv_indices, or neither")
    if full_kv_num_blocks is not None:
        parts.append(
            _selected_pairs("full_", full_kv_num_blocks, full_kv_indices, heads, q.num_blocks, k.num_blocks)
        )
    h, i, j = (np.concatenate(arrays) for arrays in zip(*parts))
    return SparseGraph.from_pairs(q, k, heads, h, i, j, name)


# --- torch ----------------------------------------------------------------------------------------
def _torch():
    try:
        import torch
    except ImportError:
        raise ImportError("FlexAttention BlockMasks need PyTorch (pip install torch)") from None
    return torch


MASK_MODS = ("exact", "padding")


def to_flex_block_mask(graph, batch: int = 1, device=None, mask_mod: str = "exact"):
    """A FlexAttention ``BlockMask`` of ``graph`` for ``batch`` sequences (the same mask each).

    ``graph``: a SparseGraph, or a HeadStack (every head its own padding; the tensors have the
    largest head's slot count). ``device`` defaults to CUDA when available, else the CPU.
    ``mask_mod``: ``"exact"`` (block selection and padding: right for eager and compiled
    FlexAttention) or ``"padding"`` (compiled kernels only; see the module docstring).
    ``BLOCK_SIZE`` and ``seq_lengths`` are the layouts'.
    """
    torch = _torch()
    from torch.nn.attention.flex_attention import BlockMask

    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch <= 0:
        raise GraphTypeError(f"batch must be a positive integer, got {batch!r}")
    if mask_mod not in MASK_MODS:
        raise FlexError(f"mask_mod must be one of {MASK_MODS}, got {mask_mod!r}")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    view = _block_view(graph)
    arrays = kv_blocks_from_graph(graph)

    def batched(a: np.ndarray):
        return torch.from_numpy(a).to(device)[None].expand(int(batch), *a.shape).contiguous()

    def on_device(a: np.ndarray):
        return torch.from_numpy(np.array(a)).to(device)  # a writable copy

    selected = on_device(view["selected"])  # [H, nq, nk]
    bq, bk = view["block"]
    if isinstance(graph, HeadStack):  # every head its own padding
        q_valid, k_valid = on_device(view["q_valid"]), on_device(view["k_valid"])

        def padding_mask(b, h, q_idx, kv_idx):
            return q_valid[h, q_idx] & k_valid[h, kv_idx]
    else:  # one padding mask for all heads (a 1-D lookup: what FlexAttention compiles best)
        q_valid, k_valid = on_device(view["q_valid"][0]), on_device(view["k_valid"][0])

        def padding_mask(b, h, q_idx, kv_idx):
            return q_valid[q_idx] & k_valid[kv_idx]

    def exact_mask(b, h, q_idx, kv_idx):
        return selected[h, q_idx // bq, kv_idx // bk] & padding_mask(b, h, q_idx, kv_idx)

    return BlockMask.from_kv_blocks(
        batched(arrays["kv_num_blocks"]),
        batched(arrays["kv_indices"]),
        batched(arrays["full_kv_num_blocks"]),
        batched(arrays["full_kv_indices"]),
        BLOCK_SIZE=view["block"],
        mask_mod=exact_mask if mask_mod == "exact" else padding_mask,
        seq_lengths=view["seq_lengths"],
    )


def from_flex_block_mask(
    block_mask, q: BlockLayout, k: BlockLayout, batch_index: int = 0, name: str = ""
) -> SparseGraph:
    """The graph of one batch entry of a FlexAttention ``BlockMask`` over layouts ``q`` and ``k``.

    The mask's block sizes must be the layouts' and its Q/K block counts must match them.
    """
    _torch()
    if not isinstance(q, BlockLayout) or not isinstance(k, BlockLayout):
        raise GraphTypeError("q and k must be BlockLayouts")
    for field in ("kv_num_blocks", "kv_indices", "BLOCK_SIZE"):
        if not hasattr(block_mask, field):
            raise GraphTypeError(f"block_mask must be a FlexAttention BlockMask (no '{field}')")
    sizes = tuple(int(s) for s in block_mask.BLOCK_SIZE)
    if sizes != (q.block_size, k.block_size):
        raise FlexError(
            f"BLOCK_SIZE {sizes} differs from the layouts' block sizes {(q.block_size, k.block_size)}"
        )

    def host(t):
        if t is None:
            return None
        batches = t.shape[0]
        if not 0 <= batch_index < batches:
            raise FlexError(f"batch_index {batch_index} is outside the mask's {batches} batch entries")
        return t[batch_index].detach().cpu().numpy()

    return graph_from_kv_blocks(
        q,
        k,
        host(block_mask.kv_num_blocks),
        host(block_mask.kv_indices),
        host(block_mask.full_kv_num_blocks),
        host(block_mask.full_kv_indices),
        name,
    )
