"""The block-level sparse graph G: which (Q block, K block) pairs each head computes.

Inside a selected pair every valid query row attends to every valid key row. The selection is
stored per head in CSR form over ``heads * q.num_blocks`` rows (row ``h * nbq + i`` is Q block ``i``
of head ``h``), K block ids sorted and unique within a row.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .layouts import BlockLayout, as_bool_mask, tile_major_tokens
from .limits import memory_problem


class GraphError(ValueError):
    """A sparse graph argument is invalid; the message names the argument."""


class GraphTypeError(GraphError, TypeError):
    """A sparse graph argument has the wrong type or dtype; the message names the argument."""


def _check_layouts(q, k) -> None:
    for name, layout in (("q", q), ("k", k)):
        if not isinstance(layout, BlockLayout):
            raise GraphTypeError(f"{name} must be a BlockLayout, got {type(layout).__name__}")


def _check_heads(heads) -> int:
    if isinstance(heads, (bool, np.bool_)) or not isinstance(heads, (int, np.integer)):
        raise GraphTypeError(f"heads must be a positive integer, got {heads!r}")
    if heads <= 0:
        raise GraphError(f"heads must be a positive integer, got {heads!r}")
    return int(heads)


_INT64_MAX = int(np.iinfo(np.int64).max)


def _int_array(name: str, value) -> np.ndarray:
    """int64 1-D copy of ``value``; floats (which would be truncated), strings and ids too large for
    int64 (which would wrap) raise."""
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError, OverflowError):
        arr = np.asarray(None)
    if arr.dtype == object and arr.size and all(isinstance(v, int) for v in arr.ravel()):
        raise GraphError(f"{name} holds {max(arr.ravel(), key=abs)}, too large for a 64-bit integer")
    if arr.dtype == np.bool_ or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise GraphTypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    return _to_int64(name, arr).ravel()


def _to_int64(name: str, arr: np.ndarray) -> np.ndarray:
    """``arr`` (any integer dtype) as int64, refusing values an int64 cannot hold (uint64 above 2^63 - 1
    would wrap to negative numbers)."""
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > _INT64_MAX:
        raise GraphError(f"{name} holds {int(arr.max())}, too large for a 64-bit integer")
    return arr.astype(np.int64)


def _sorted_unique(keys: np.ndarray) -> np.ndarray:
    """``np.unique`` of an int64 array by one sort (numpy's hash-based unique takes seconds on the ~10⁷
    pair keys of the 720p workloads)."""
    keys = np.sort(keys)
    return keys[np.concatenate([[True], keys[1:] != keys[:-1]])] if keys.size else keys


@dataclass(frozen=True, eq=False)
class SparseGraph:
    """Selected block pairs of one attention call, for every head.

    Attributes:
        q, k: the Q and K/V layouts (independent partitions allowed).
        heads: number of heads.
        indptr: int64 ``[heads * q.num_blocks + 1]``.
        indices: int32 ``[nnz]``, K block ids, sorted and unique within each row.
        name: short description.
        dropped_pairs: int64 ``[heads]``, pairs given to a constructor (``from_pairs`` and the
            builders on it) that were left out because their Q or K block has no valid row.
    """

    q: BlockLayout
    k: BlockLayout
    heads: int
    indptr: np.ndarray
    indices: np.ndarray
    name: str = ""
    dropped_pairs: np.ndarray | None = None

    def __post_init__(self):
        _check_layouts(self.q, self.k)
        _check_heads(self.heads)
        dropped = np.zeros(self.heads, np.int64) if self.dropped_pairs is None else self.dropped_pairs
        dropped = np.array(dropped, dtype=np.int64)
        if dropped.shape != (self.heads,) or (dropped < 0).any():
            raise GraphError(
                f"dropped_pairs must be {self.heads} non-negative counts, got {self.dropped_pairs!r}"
            )
        dropped.setflags(write=False)
        object.__setattr__(self, "dropped_pairs", dropped)
        rows = self.heads * self.q.num_blocks
        indptr = np.asarray(self.indptr)
        if indptr.dtype == np.bool_ or (indptr.size and not np.issubdtype(indptr.dtype, np.integer)):
            raise GraphTypeError(f"indptr must hold integers, got dtype {indptr.dtype}")
        indptr = np.ascontiguousarray(_to_int64("indptr", indptr))
        indices = np.asarray(self.indices)
        if indptr.shape != (rows + 1,):
            raise GraphError(
                f"indptr must have heads*num_q_blocks+1 = {rows + 1} entries, got {indptr.shape}"
            )
        if indptr[0] != 0 or np.any(np.diff(indptr) < 0) or indptr[-1] != indices.size:
            raise GraphError("indptr must start at 0, be non-decreasing and end at len(indices)")
        if indices.size and not np.issubdtype(indices.dtype, np.integer):
            raise GraphError(f"indices must be integers, got dtype {indices.dtype}")
        indices = np.ascontiguousarray(_to_int64("indices", indices))
        if indices.size and (indices.min() < 0 or indices.max() >= self.k.num_blocks):
            bad = indices[(indices < 0) | (indices >= self.k.num_blocks)][0]
            raise GraphError(f"indices holds K block {int(bad)} outside [0, {self.k.num_blocks})")
        row = np.repeat(np.arange(rows, dtype=np.int64), np.diff(indptr))
        if indices.size > 1:
            same_row = row[1:] == row[:-1]
            if np.any(same_row & (indices[1:] <= indices[:-1])):
                raise GraphError(
                    "indices must be sorted and unique within each row (use SparseGraph.from_pairs)"
                )
        indices = indices.astype(np.int32)
        for arr in (indptr, indices):
            arr.setflags(write=False)
        object.__setattr__(self, "indptr", indptr)
        object.__setattr__(self, "indices", indices)

    # --- constructors ------------------------------------------------------------------------
    @classmethod
    def from_pairs(
        cls,
        q: BlockLayout,
        k: BlockLayout,
        heads: int,
        head,
        q_block,
        k_block,
        name: str = "",
        drop_empty: bool = True,
    ) -> SparseGraph:
        """Build from parallel arrays of (head, Q block, K block); order and duplicates do not matter.

        With ``drop_empty`` pairs whose Q or K block has no valid row are dropped (they carry no
        useful work and an honest block-sparse kernel skips them); ``dropped_pairs`` counts them.
        """
        _check_layouts(q, k)
        heads = _check_heads(heads)
        head, q_block, k_block = (
            _int_array(n, a) for n, a in (("head", head), ("q_block", q_block), ("k_block", k_block))
        )
        if not (head.size == q_block.size == k_block.size):
            raise GraphError("head, q_block and k_block must have the same length")
        for label, arr, bound in (
            ("head", head, heads),
            ("q_block", q_block, q.num_blocks),
            ("k_block", k_block, k.num_blocks),
        ):
            if arr.size and (arr.min() < 0 or arr.max() >= bound):
                bad = arr[(arr < 0) | (arr >= bound)][0]
                raise GraphError(f"{label} holds {int(bad)} outside [0, {bound})")
        dropped = np.zeros(heads, dtype=np.int64)
        if drop_empty and head.size:
            keep = (q.valid_rows[q_block] > 0) & (k.valid_rows[k_block] > 0)
            gone = _sorted_unique((head * q.num_blocks + q_block)[~keep] * k.num_blocks + k_block[~keep])
            dropped = np.bincount(gone // (q.num_blocks * k.num_blocks), minlength=heads).astype(np.int64)
            head, q_block, k_block = head[keep], q_block[keep], k_block[keep]
        rows = head * q.num_blocks + q_block
        key = _sorted_unique(rows * k.num_blocks + k_block)
        rows, cols = key // k.num_blocks, key % k.num_blocks
        counts = np.bincount(rows, minlength=heads * q.num_blocks)
        return cls(q, k, heads, np.concatenate([[0], np.cumsum(counts)]), cols, name, dropped)

    @classmethod
    def from_block_mask(
        cls, q: BlockLayout, k: BlockLayout, mask, name: str = "", drop_empty: bool = True
    ) -> SparseGraph:
        """Build from a dense bool mask ``[heads, q.num_blocks, k.num_blocks]`` (or 2-D for one head).

        The mask must hold bools (or integers 0/1): a float, -1 or string mask raises
        :class:`GraphTypeError` rather than selecting everything.
        """
        _check_layouts(q, k)
        mask = as_bool_mask("mask", mask, GraphTypeError)
        if mask.ndim == 2:
            mask = mask[None]
        if mask.ndim != 3 or mask.shape[1:] != (q.num_blocks, k.num_blocks):
            raise GraphError(f"mask must be [heads, {q.num_blocks}, {k.num_blocks}], got {mask.shape}")
        h, i, j = np.nonzero(mask)
        return cls.from_pairs(q, k, mask.shape[0], h, i, j, name, drop_empty)

    @classmethod
    def from_block_lists(
        cls, q: BlockLayout, k: BlockLayout, lists, name: str = "", drop_empty: bool = True
    ) -> SparseGraph:
        """Build from ``lists[h][i]`` = iterable of K blocks selected by Q block ``i`` of head ``h``."""
        _check_layouts(q, k)
        heads = len(lists)
        hs, qs, ks = [], [], []
        for h, per_head in enumerate(lists):
            if len(per_head) != q.num_blocks:
                raise GraphError(f"lists[{h}] has {len(per_head)} Q blocks, layout has {q.num_blocks}")
            for i, sel in enumerate(per_head):
                sel = _int_array(f"lists[{h}][{i}]", list(sel))
                hs.append(np.full(sel.size, h))
                qs.append(np.full(sel.size, i))
                ks.append(sel)
        cat = lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.int64)
        return cls.from_pairs(q, k, heads, cat(hs), cat(qs), cat(ks), name, drop_empty)

    @classmethod
    def from_flex_block_mask(
        cls, block_mask, q: BlockLayout, k: BlockLayout, batch_index: int = 0, name: str = ""
    ):
        """The graph of a FlexAttention ``BlockMask`` over layouts ``q``/``k`` (needs torch; see
        :func:`sparseattn.flex.from_flex_block_mask`)."""
        from .flex import from_flex_block_mask

        return from_flex_block_mask(block_mask, q, k, batch_index, name)

    def to_flex_block_mask(self, batch: int = 1, device=None, mask_mod: str = "exact"):
        """This graph as a FlexAttention ``BlockMask`` (needs torch; see
        :func:`sparseattn.flex.to_flex_block_mask`)."""
        from .flex import to_flex_block_mask

        return to_flex_block_mask(self, batch, device, mask_mod)

    # --- views -------------------------------------------------------------------------------
    @property
    def nnz(self) -> int:
        return self.indices.size

    @property
    def num_rows(self) -> int:
        return self.heads * self.q.num_blocks

    @cached_property
    def row_of_nnz(self) -> np.ndarray:
        """int64 ``[nnz]``: the CSR row (``h * nbq + i``) of each selected pair."""
        return np.repeat(np.arange(self.num_rows, dtype=np.int64), np.diff(self.indptr))

    @cached_property
    def pairs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(head, q_block, k_block) int64 arrays of every selected pair, CSR order."""
        r = self.row_of_nnz
        return r // self.q.num_blocks, r % self.q.num_blocks, self.indices.astype(np.int64)

    def row(self, head: int, q_block: int) -> np.ndarray:
        """int32: the K blocks selected by Q block ``q_block`` of head ``head``."""
        for name, value, bound in (("head", head, self.heads), ("q_block", q_block, self.q.num_blocks)):
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
                raise GraphTypeError(f"{name} must be an integer, got {value!r}")
            if not 0 <= value < bound:
                raise GraphError(f"{name} {value} is outside [0, {bound})")
        r = head * self.q.num_blocks + q_block
        return self.indices[self.indptr[r] : self.indptr[r + 1]]

    def useful_pairs(self) -> int:
        """Σ over heads and selected block pairs of valid Q rows × valid K rows."""
        _, i, j = self.pairs
        return int((self.q.valid_rows[i] * self.k.valid_rows[j]).sum())

    def head_nnz(self) -> np.ndarray:
        """int64 ``[heads]``: selected pairs per head."""
        ends = self.indptr[np.arange(1, self.heads + 1) * self.q.num_blocks]
        starts = self.indptr[np.arange(self.heads) * self.q.num_blocks]
        return ends - starts

    def select_heads(self, heads) -> SparseGraph:
        """The graph restricted to the given heads (renumbered 0..len-1)."""
        heads = _int_array("heads", heads)
        if heads.size and (heads.min() < 0 or heads.max() >= self.heads):
            raise GraphError(f"heads must lie in [0, {self.heads}), got {heads.tolist()}")
        if np.unique(heads).size != heads.size:
            raise GraphError(f"heads must not repeat, got {heads.tolist()}")
        nb = self.q.num_blocks
        rows = (heads[:, None] * nb + np.arange(nb)).ravel()  # the kept heads' CSR rows, in order
        starts, lengths = self.indptr[rows], np.diff(self.indptr)[rows]
        indptr = np.concatenate([[0], np.cumsum(lengths)])
        entries = np.repeat(starts - indptr[:-1], lengths) + np.arange(indptr[-1])
        return SparseGraph(
            self.q, self.k, heads.size, indptr, self.indices[entries], self.name, self.dropped_pairs[heads]
        )

    def tile_major_tokens(self) -> SparseGraph:
        """The same selection with both layouts' tokens numbered tile-major
        (:func:`sparseattn.layouts.tile_major_tokens`; one layout stays shared by Q and K)."""
        q = tile_major_tokens(self.q)
        k = q if self.k is self.q else tile_major_tokens(self.k)
        return SparseGraph(q, k, self.heads, self.indptr, self.indices, self.name, self.dropped_pairs)

    def transpose(self) -> SparseGraph:
        """The graph with Q and K swapped: rows are K blocks (what a K/V-owned backward iterates)."""
        h, i, j = self.pairs
        graph = SparseGraph.from_pairs(
            self.k, self.q, self.heads, h, j, i, self.name + " (transposed)", drop_empty=False
        )
        object.__setattr__(graph, "dropped_pairs", self.dropped_pairs)
        return graph

    def block_mask(self) -> np.ndarray:
        """Dense bool ``[heads, nbq, nbk]`` (small graphs only)."""
        problem = memory_problem(self.heads * self.q.num_blocks * self.k.num_blocks, "a dense block mask")
        if problem:
            raise GraphError(problem)
        m = np.zeros((self.heads, self.q.num_blocks, self.k.num_blocks), dtype=bool)
        h, i, j = self.pairs
        m[h, i, j] = True
        return m

    def token_mask(self, head: int) -> np.ndarray:
        """Dense bool ``[q.num_slots, k.num_slots]`` of one head: which slot pairs attend (small graphs)."""
        problem = memory_problem(3 * self.q.num_slots * self.k.num_slots, "a dense token mask")
        if problem:
            raise GraphError(problem)
        bm = self.block_mask()[head]
        m = np.repeat(np.repeat(bm, self.q.block_size, axis=0), self.k.block_size, axis=1)
        return m & self.q.valid[:, None] & self.k.valid[None, :]


@dataclass(frozen=True, eq=False)
class HeadStack:
    """One attention call whose heads each have their own Q and K layouts (SVG2's per-head k-means
    partitions): one single-head :class:`SparseGraph` per head.

    Kernels see the call as tensors ``[batch, heads, slots, d]`` with ``slots`` = the largest slot
    count over the heads (``q_slots`` / ``k_slots``); head ``h`` uses its first
    ``graphs[h].q.num_slots`` (``k.num_slots``) slots, the rest is never read or written.
    """

    graphs: tuple

    def __post_init__(self):
        graphs = tuple(self.graphs)
        if not graphs:
            raise GraphError("HeadStack needs at least one graph")
        for h, g in enumerate(graphs):
            if not isinstance(g, SparseGraph):
                raise GraphError(f"graphs[{h}] must be a SparseGraph, got {type(g).__name__}")
            if g.heads != 1:
                raise GraphError(f"graphs[{h}] has {g.heads} heads; a HeadStack holds single-head graphs")
        object.__setattr__(self, "graphs", graphs)

    @classmethod
    def of(cls, graphs) -> HeadStack:
        """A HeadStack from a list of graphs (each multi-head graph is split into its heads)."""
        if isinstance(graphs, HeadStack):
            return graphs
        if isinstance(graphs, SparseGraph):
            graphs = [graphs]
        out = []
        for g in graphs:
            if not isinstance(g, SparseGraph):
                raise GraphError(f"expected SparseGraph objects, got {type(g).__name__}")
            out.extend([g] if g.heads == 1 else [g.select_heads([h]) for h in range(g.heads)])
        return cls(tuple(out))

    @property
    def heads(self) -> int:
        return len(self.graphs)

    @property
    def q_slots(self) -> int:
        return max(g.q.num_slots for g in self.graphs)

    @property
    def k_slots(self) -> int:
        return max(g.k.num_slots for g in self.graphs)

    @property
    def nnz(self) -> int:
        return sum(g.nnz for g in self.graphs)

    def useful_pairs(self) -> int:
        """Σ over heads and selected block pairs of valid Q rows × valid K rows."""
        return sum(g.useful_pairs() for g in self.graphs)

    def q_valid(self) -> np.ndarray:
        """bool ``[heads, q_slots]``: valid query slots of every head (padding past a head's layout is False)."""
        out = np.zeros((self.heads, self.q_slots), dtype=bool)
        for h, g in enumerate(self.graphs):
            out[h, : g.q.num_slots] = g.q.valid
        return out
