"""Token layouts: where each token of a Q or K sequence sits in the kernel's slot space.

A kernel sees one side of attention (Q, or K/V) as a tensor ``[batch, heads, slots, head_dim]``.
Slots are cut into *logical blocks* of ``block_size`` consecutive slots and into 16-row *pages*.
Some slots are padding (``valid == False``): they never contribute and produce no output.

Two layout families build a :class:`BlockLayout`:

* :func:`video_layout` — a T×H×W latent cut into (t, h, w) tiles, stored tile-major (tiles in raster
  order, raster order inside a tile). Edge tiles hold fewer tokens; by default their valid tokens are
  a prefix of the tile's slots (``padding="prefix"``, as VSA's ``variable_block_sizes``), or they stay
  at their padded 3D position (``padding="inplace"``).
* :func:`partition_layout` — an arbitrary partition of tokens into variable-size groups (SVG2's
  k-means clusters): groups are laid out one after another, each padded to a whole number of blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from .constants import PAGE_ROWS
from .limits import LAYOUT_BYTES_PER_TOKEN, memory_problem

PADDING_MODES = ("prefix", "inplace")


class LayoutError(ValueError):
    """A layout parameter is invalid; the message names the field."""


class LayoutTypeError(LayoutError, TypeError):
    """A layout argument has the wrong type (e.g. ``grid=None``); the message names it."""


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _positive_triple(name: str, value) -> tuple[int, int, int]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise LayoutTypeError(f"{name} must be three positive integers (T, H, W), got {value!r}")
    items = tuple(value)
    if len(items) != 3:
        raise LayoutError(f"{name} must have exactly three entries (T, H, W), got {len(items)}")
    for axis, v in enumerate(items):
        if not _is_int(v):
            raise LayoutTypeError(f"{name}[{axis}] must be an integer, got {v!r}")
        if v <= 0:
            raise LayoutError(f"{name}[{axis}]={v} must be positive")
    return tuple(int(v) for v in items)  # type: ignore[return-value]


def check_block_size(name: str, block_size: int) -> int:
    if not _is_int(block_size):
        raise LayoutTypeError(f"{name} must be an integer multiple of {PAGE_ROWS}, got {block_size!r}")
    if block_size <= 0 or block_size % PAGE_ROWS:
        raise LayoutError(f"{name} must be a positive multiple of {PAGE_ROWS}, got {block_size!r}")
    return int(block_size)


def as_bool_mask(name: str, value, error: type[Exception] = LayoutTypeError) -> np.ndarray:
    """``value`` as a bool array: bools, or integers that are all 0 or 1.

    Floats, strings, ``None`` and integers such as -1 raise ``error`` naming ``name``: such a mask
    is a mistake, not a selection of every entry.
    """
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError):
        arr = np.asarray(None)
    if arr.dtype == np.bool_:
        return arr
    if np.issubdtype(arr.dtype, np.integer) and (arr.size == 0 or (arr.min() >= 0 and arr.max() <= 1)):
        return arr.astype(bool)
    what = f"dtype {arr.dtype}" if arr.dtype != object else type(value).__name__
    if np.issubdtype(arr.dtype, np.integer):
        what = f"integers from {arr.min()} to {arr.max()}"
    raise error(f"{name} must be a bool array (or integers 0/1), got {what}")


def _index_array(name: str, value) -> np.ndarray:
    """``value`` as a contiguous int64 array: floats (which would be truncated), bools and integers an int64
    cannot hold (which would wrap) raise :class:`LayoutTypeError` / :class:`LayoutError` naming ``name``."""
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError, OverflowError):
        arr = np.asarray(None)
    if arr.dtype == np.bool_ or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise LayoutTypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise LayoutError(f"{name} holds {int(arr.max())}, too large for a 64-bit integer")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _check_layout_size(field: str, tokens: int, slots: int) -> None:
    problem = memory_problem(LAYOUT_BYTES_PER_TOKEN * max(tokens, slots), f"a layout of {tokens:,} tokens")
    if problem:
        raise LayoutError(f"{field}: {problem}")


@dataclass(frozen=True, eq=False)
class BlockLayout:
    """One side of an attention call in slot space.

    Attributes:
        block_size: slots per logical block (a multiple of 16).
        valid: bool ``[num_slots]``; ``num_slots = num_blocks * block_size``.
        token_slot: int64 ``[num_tokens]``, the slot of each token in its original order
            (raster order of the latent for video layouts).
        block_group: int64 ``[num_blocks]``, the partition group (tile or cluster) each block belongs to.
        name: a short description for reports.
        tile_grid: for a video layout, ``(tiles along t, h, w, blocks per tile)``: block ``b`` is block
            ``b % blocks_per_tile`` of tile ``b // blocks_per_tile`` in raster order (what tells the device
            planner which blocks are spatial neighbours); ``None`` for other layouts.
    """

    block_size: int
    valid: np.ndarray
    token_slot: np.ndarray
    block_group: np.ndarray
    name: str = ""
    tile_grid: tuple | None = None

    def __post_init__(self):
        check_block_size("block_size", self.block_size)
        valid = np.ascontiguousarray(as_bool_mask("valid", self.valid))
        if valid.ndim != 1 or valid.size % self.block_size:
            raise LayoutError(
                f"valid must be 1-D with a multiple of block_size={self.block_size} slots, got shape {valid.shape}"
            )
        token_slot = _index_array("token_slot", self.token_slot)
        if token_slot.size != int(valid.sum()):
            raise LayoutError(
                f"token_slot has {token_slot.size} tokens but valid marks {int(valid.sum())} slots"
            )
        if token_slot.size:  # each valid slot holds exactly one token
            if token_slot.min() < 0 or token_slot.max() >= valid.size:
                bad = int(token_slot[(token_slot < 0) | (token_slot >= valid.size)][0])
                raise LayoutError(f"token_slot holds slot {bad} outside [0, {valid.size})")
            hit = np.zeros(valid.size, dtype=bool)
            hit[token_slot] = True
            if not np.array_equal(hit, valid):
                raise LayoutError("token_slot must name every valid slot once (and no padding slot)")
        block_group = _index_array("block_group", self.block_group)
        if block_group.shape != (valid.size // self.block_size,):
            raise LayoutError(f"block_group must have one entry per block, got shape {block_group.shape}")
        if self.tile_grid is not None:
            grid = tuple(self.tile_grid)
            if (
                len(grid) != 4
                or not all(_is_int(x) and x > 0 for x in grid)
                or int(np.prod(grid)) != block_group.size
            ):
                raise LayoutError(
                    f"tile_grid must be four positive integers (tiles along t, h, w, blocks per tile) whose "
                    f"product is the {block_group.size} blocks, got {self.tile_grid!r}"
                )
            object.__setattr__(self, "tile_grid", tuple(int(x) for x in grid))
        object.__setattr__(self, "valid", valid)
        object.__setattr__(self, "token_slot", token_slot)
        object.__setattr__(self, "block_group", block_group)
        for arr in (valid, token_slot, block_group):
            arr.setflags(write=False)

    # --- sizes -------------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self.valid.size

    @property
    def num_blocks(self) -> int:
        return self.valid.size // self.block_size

    @property
    def num_pages(self) -> int:
        return self.valid.size // PAGE_ROWS

    @property
    def num_tokens(self) -> int:
        return self.token_slot.size

    @property
    def pages_per_block(self) -> int:
        return self.block_size // PAGE_ROWS

    # --- per-block and per-page statistics (cached, read-only) -------------------------------
    @cached_property
    def valid_rows(self) -> np.ndarray:
        """int64 ``[num_blocks]``: valid slots of each block (vq_i / vk_j in the counting rules)."""
        return self.valid.reshape(self.num_blocks, self.block_size).sum(axis=1, dtype=np.int64)

    @cached_property
    def page_valid_rows(self) -> np.ndarray:
        """int64 ``[num_pages]``: valid slots of each 16-row page."""
        return self.valid.reshape(self.num_pages, PAGE_ROWS).sum(axis=1, dtype=np.int64)

    @cached_property
    def page_live(self) -> np.ndarray:
        """bool ``[num_pages]``: a page is live if it holds at least one valid row."""
        return self.page_valid_rows > 0

    @cached_property
    def live_pages(self) -> np.ndarray:
        """int64 ``[num_blocks]``: live pages of each block (pq_i / pk_j)."""
        return self.page_live.reshape(self.num_blocks, self.pages_per_block).sum(axis=1, dtype=np.int64)

    @cached_property
    def page_mask(self) -> np.ndarray:
        """uint16 ``[num_pages]``: bit r set when row r of the page is valid (what kernels read)."""
        bits = self.valid.reshape(self.num_pages, PAGE_ROWS).astype(np.uint32)
        weights = np.uint32(1) << np.arange(PAGE_ROWS, dtype=np.uint32)
        return (bits * weights).sum(axis=1).astype(np.uint16)

    @cached_property
    def slot_token(self) -> np.ndarray:
        """int64 ``[num_slots]``: the token in each slot, -1 for padding."""
        out = np.full(self.num_slots, -1, dtype=np.int64)
        out[self.token_slot] = np.arange(self.num_tokens, dtype=np.int64)
        return out

    # --- moving data between token order and slot order ---------------------------------------
    def to_slots(self, x: np.ndarray, axis: int = -2, fill: float = 0.0) -> np.ndarray:
        """Scatter token-ordered ``x`` (``[..., num_tokens, d]`` along ``axis``) into slot order."""
        x = np.asarray(x)
        axis = axis % x.ndim
        if x.shape[axis] != self.num_tokens:
            raise LayoutError(f"x has {x.shape[axis]} tokens on axis {axis}, layout has {self.num_tokens}")
        shape = list(x.shape)
        shape[axis] = self.num_slots
        out = np.full(shape, fill, dtype=x.dtype)
        index = [slice(None)] * x.ndim
        index[axis] = self.token_slot
        out[tuple(index)] = x
        return out

    def from_slots(self, x: np.ndarray, axis: int = -2) -> np.ndarray:
        """Gather slot-ordered ``x`` back into token order (padding slots dropped)."""
        x = np.asarray(x)
        axis = axis % x.ndim
        if x.shape[axis] != self.num_slots:
            raise LayoutError(f"x has {x.shape[axis]} slots on axis {axis}, layout has {self.num_slots}")
        return np.take(x, self.token_slot, axis=axis)

    def summary(self) -> dict:
        return {
            "name": self.name,
            "block_size": self.block_size,
            "blocks": self.num_blocks,
            "slots": self.num_slots,
            "tokens": self.num_tokens,
            "full_blocks": int((self.valid_rows == self.block_size).sum()),
            "partial_blocks": int(((self.valid_rows > 0) & (self.valid_rows < self.block_size)).sum()),
            "empty_blocks": int((self.valid_rows == 0).sum()),
            "live_pages": int(self.page_live.sum()),
        }


@dataclass(frozen=True)
class VideoGrid:
    """A T×H×W latent cut into (t, h, w) tiles; see :func:`video_layout`."""

    grid: tuple[int, int, int]
    tile: tuple[int, int, int]

    def __post_init__(self):
        grid = _positive_triple("grid", self.grid)
        tile = _positive_triple("tile", self.tile)
        for axis, (g, t) in enumerate(zip(grid, tile)):
            if t > g:
                raise LayoutError(f"tile[{axis}]={t} is larger than grid[{axis}]={g}")
        object.__setattr__(self, "grid", grid)
        object.__setattr__(self, "tile", tile)

    @property
    def tiles_per_axis(self) -> tuple[int, int, int]:
        return tuple(-(-g // t) for g, t in zip(self.grid, self.tile))  # type: ignore[return-value]

    @property
    def num_tiles(self) -> int:
        a, b, c = self.tiles_per_axis
        return a * b * c

    @property
    def num_tokens(self) -> int:
        t, h, w = self.grid
        return t * h * w

    @property
    def tile_volume(self) -> int:
        t, h, w = self.tile
        return t * h * w

    def tile_extents(self) -> np.ndarray:
        """int64 ``[num_tiles, 3]``: real extent of each tile along (t, h, w), raster tile order."""
        ext = []
        for g, t, n in zip(self.grid, self.tile, self.tiles_per_axis):
            e = np.full(n, t, dtype=np.int64)
            e[-1] = g - t * (n - 1)
            ext.append(e)
        a, b, c = np.meshgrid(*ext, indexing="ij")
        return np.stack([a.ravel(), b.ravel(), c.ravel()], axis=1)

    def tile_coords(self) -> np.ndarray:
        """int64 ``[num_tiles, 3]``: tile index along each axis, raster tile order."""
        a, b, c = np.meshgrid(*(np.arange(n) for n in self.tiles_per_axis), indexing="ij")
        return np.stack([a.ravel(), b.ravel(), c.ravel()], axis=1).astype(np.int64)

    def token_tile(self) -> np.ndarray:
        """int64 ``[num_tokens]``: the tile of each token (tokens in raster order of the latent)."""
        T, H, W = self.grid
        t, h, w = self.tile
        _, nb, nc = self.tiles_per_axis
        ti = np.arange(T) // t
        hi = np.arange(H) // h
        wi = np.arange(W) // w
        return (
            ((ti[:, None, None] * nb + hi[None, :, None]) * nc + wi[None, None, :]).ravel().astype(np.int64)
        )


def video_layout(grid, tile, block_size: int = 128, padding: str = "prefix", name: str = "") -> BlockLayout:
    """Tile-major slot layout of a video latent.

    Each tile occupies ``ceil(t*h*w / block_size) * block_size`` slots (6×8×8 = 384 → three 128-slot
    blocks; 4×4×4 = 64 → one 64-slot block). Tokens are in raster order of the T×H×W latent.
    """
    vg = VideoGrid(grid, tile)
    block_size = check_block_size("block_size", block_size)
    if not isinstance(padding, str) or padding not in PADDING_MODES:
        raise LayoutError(f"padding must be one of {PADDING_MODES}, got {padding!r}")
    T, H, W = vg.grid
    t, h, w = vg.tile
    blocks_per_tile = -(-vg.tile_volume // block_size)
    slots_per_tile = blocks_per_tile * block_size
    _check_layout_size("grid", vg.num_tokens, vg.num_tiles * slots_per_tile)

    tt, hh, ww = np.meshgrid(np.arange(T), np.arange(H), np.arange(W), indexing="ij")
    tt, hh, ww = tt.ravel(), hh.ravel(), ww.ravel()
    tile_of_token = vg.token_tile()
    lt, lh, lw = tt % t, hh % h, ww % w
    if padding == "inplace":
        local = (lt * h + lh) * w + lw
    else:
        ext = vg.tile_extents()[tile_of_token]
        local = (lt * ext[:, 1] + lh) * ext[:, 2] + lw
    token_slot = tile_of_token * slots_per_tile + local
    valid = np.zeros(vg.num_tiles * slots_per_tile, dtype=bool)
    valid[token_slot] = True
    block_group = np.repeat(np.arange(vg.num_tiles, dtype=np.int64), blocks_per_tile)
    label = name or f"{T}x{H}x{W} tiles {t}x{h}x{w} B={block_size} {padding}"
    grid_of_blocks = (*vg.tiles_per_axis, blocks_per_tile)
    return BlockLayout(block_size, valid, token_slot, block_group, label, tile_grid=grid_of_blocks)


def partition_layout(
    groups: np.ndarray, block_size: int = 128, num_groups: int | None = None, name: str = ""
) -> BlockLayout:
    """Slot layout of an arbitrary partition (e.g. k-means clusters of tokens).

    Args:
        groups: int ``[num_tokens]``, the group (cluster) id of each token, in ``[0, num_groups)``.
        block_size: logical block size; each group is padded to a whole number of blocks so a block
            never mixes groups. Inside a group, tokens keep their original relative order.
        num_groups: number of groups (default ``groups.max() + 1``); empty groups take no slots.
    """
    block_size = check_block_size("block_size", block_size)
    groups = np.asarray(groups)
    if groups.ndim != 1 or groups.size == 0:
        raise LayoutError("groups must be a non-empty 1-D array of group ids")
    if not np.issubdtype(groups.dtype, np.integer):
        raise LayoutTypeError(f"groups must hold integers, got dtype {groups.dtype}")
    if groups.min() < 0:
        raise LayoutError("groups must be non-negative")
    if groups.dtype == np.uint64:  # bincount takes int64: refuse what would wrap
        groups = _index_array("groups", groups)
    if num_groups is not None and not _is_int(num_groups):
        raise LayoutTypeError(f"num_groups must be an integer, got {num_groups!r}")
    n_groups = int(groups.max()) + 1 if num_groups is None else int(num_groups)
    if groups.max() >= n_groups:
        raise LayoutError(f"groups holds id {int(groups.max())} >= num_groups={n_groups}")
    _check_layout_size("num_groups", groups.size, groups.size + n_groups * block_size)
    sizes = np.bincount(groups, minlength=n_groups).astype(np.int64)
    blocks = -(-sizes // block_size)
    group_start = np.concatenate([[0], np.cumsum(blocks * block_size)[:-1]])
    small = np.uint16 if n_groups <= np.iinfo(np.uint16).max else groups.dtype  # radix sort: ~5x faster
    order = np.argsort(groups.astype(small, copy=False), kind="stable")
    rank_in_group = np.empty(groups.size, dtype=np.int64)
    first = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    rank_in_group[order] = np.arange(groups.size) - np.repeat(first, sizes)
    token_slot = group_start[groups] + rank_in_group
    valid = np.zeros(int(blocks.sum()) * block_size, dtype=bool)
    valid[token_slot] = True
    block_group = np.repeat(np.arange(n_groups, dtype=np.int64), blocks)
    return BlockLayout(
        block_size, valid, token_slot, block_group, name or f"{n_groups} groups B={block_size}"
    )


def contiguous_layout(num_tokens: int, block_size: int = 128, name: str = "") -> BlockLayout:
    """A 1-D sequence of ``num_tokens`` cut into blocks; only the last block may be partial."""
    if not _is_int(num_tokens):
        raise LayoutTypeError(f"num_tokens must be a positive integer, got {num_tokens!r}")
    if num_tokens <= 0:
        raise LayoutError(f"num_tokens must be a positive integer, got {num_tokens!r}")
    block_size = check_block_size("block_size", block_size)
    _check_layout_size("num_tokens", int(num_tokens), int(num_tokens) + block_size)
    nb = -(-int(num_tokens) // block_size)
    valid = np.zeros(nb * block_size, dtype=bool)
    valid[:num_tokens] = True
    return BlockLayout(
        block_size, valid, np.arange(num_tokens), np.arange(nb), name or f"1-D {num_tokens} B={block_size}"
    )


def tile_major_tokens(layout: BlockLayout) -> BlockLayout:
    """``layout`` with its tokens renumbered in slot order: token ``i`` is the one in the ``i``-th valid slot,
    the order of a model that keeps its tokens tile-major (each page's tokens then consecutive). A tensor
    in ``layout``'s token order goes to this one by :func:`tile_major_permutation`."""
    return replace(layout, token_slot=np.sort(layout.token_slot), name=f"{layout.name}, tile-major tokens")


def tile_major_permutation(layout: BlockLayout) -> np.ndarray:
    """int64 ``[tokens]``: the token (in ``layout``'s order) that each token of :func:`tile_major_tokens`
    is: ``x_tiles = x[..., perm, ...]`` along the token axis, and ``x = x_tiles[..., argsort(perm), ...]``."""
    return np.argsort(layout.token_slot, kind="stable")


def slot_layout(valid, block_size: int = 128, name: str = "") -> BlockLayout:
    """A layout given directly by its slot validity mask (tokens are the valid slots in order)."""
    valid = as_bool_mask("valid", valid)
    block_size = check_block_size("block_size", block_size)
    if valid.ndim != 1 or valid.size == 0 or valid.size % block_size:
        raise LayoutError(f"valid must be 1-D with a positive multiple of block_size={block_size} slots")
    return BlockLayout(
        block_size,
        valid,
        np.flatnonzero(valid),
        np.arange(valid.size // block_size),
        name or f"custom {valid.size} slots B={block_size}",
    )
