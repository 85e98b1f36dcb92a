"""Sparse-graph builders: the selections of STA, SSTA, VSA and SVG2, plus random / mask / list graphs.

Every builder returns :class:`~sparseattn.graph.SparseGraph` objects whose pairs with an empty Q or
K block are dropped. Data-dependent builders (:func:`ssta_graph`, :func:`vsa_graph`,
:func:`svg2_graph`) score blocks from user ``q``/``k`` (float ``[heads, tokens, d]``, tokens in the
latent's raster order) when given, else from the seeded generator of :mod:`sparseattn.synthetic`.
Their ``heads`` is a count or a list of head ids (:func:`head_ids`); head ``h`` comes out the same
whichever other heads are built with it, so large workloads can be built in slices of heads.

Selections are made at the *group* level (a tile, a VSA cube, an SVG2 cluster) and expanded to every
(Q block, K block) pair of the two groups: a 6×8×8 = 384-slot tile is three 128-slot blocks, so one
selected tile pair is 3×3 block pairs.

SVG2 clusters every head separately (as SVG2 does), so its Q and K partitions differ per head while
a SparseGraph has one Q and one K layout: :func:`svg2_graph` returns one single-head graph per head.
"""

from __future__ import annotations

import os
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import scipy.sparse as sp

from .graph import GraphError, SparseGraph
from .layouts import BlockLayout, VideoGrid, partition_layout, video_layout
from .parallel import single_threaded_blas
from .synthetic import synthetic_head_factors


class BuilderError(ValueError):
    """A builder argument is invalid; the message names the argument."""


# --- argument checks -------------------------------------------------------------------------------
def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise BuilderError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _fraction(name: str, value, low_open: bool = True) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise BuilderError(
            f"{name} must be a number in {'(0, 1]' if low_open else '[0, 1]'}, got {value!r}"
        ) from None
    if not (0.0 < v <= 1.0 if low_open else 0.0 <= v <= 1.0):
        raise BuilderError(f"{name} must be in {'(0, 1]' if low_open else '[0, 1]'}, got {value!r}")
    return v


def head_ids(heads, available: int | None = None) -> np.ndarray:
    """int64 ``[n]``: the heads to build — ``0..heads-1`` for a count, else the given head ids.

    Ids must be distinct non-negative integers (below ``available`` when given: the heads of user
    ``q``/``k``). Head ``h`` of a builder is the same whatever other heads are built with it.
    """
    if isinstance(heads, (int, np.integer)) and not isinstance(heads, bool):
        ids = np.arange(_positive_int("heads", heads), dtype=np.int64)
    else:
        try:
            ids = np.asarray(heads)
        except (TypeError, ValueError):
            ids = None
        if ids is None or ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise BuilderError(f"heads must be a positive integer or a list of head ids, got {heads!r}")
        ids = ids.astype(np.int64)
        if ids.min() < 0 or np.unique(ids).size != ids.size:
            raise BuilderError(f"head ids must be distinct and non-negative, got {heads!r}")
    if available is not None and ids.max() >= available:
        raise BuilderError(f"heads asks for head {int(ids.max())} but q holds only {available} heads")
    return ids


def head_windows(window, tiles_per_axis, ids: np.ndarray) -> np.ndarray:
    """int64 ``[len(ids), 3]``: the window of each head in ``ids``.

    ``window`` is one triple for every head or one triple per head (row ``h`` for head ``h``).
    """
    win = check_window(window, tiles_per_axis)
    if win.shape[0] == 1:
        return np.repeat(win, ids.size, axis=0)
    if ids.max() >= win.shape[0]:
        raise BuilderError(f"window has {win.shape[0]} per-head triples, no window for head {int(ids.max())}")
    return win[ids]


def check_window(window, tiles_per_axis, heads: int | None = None) -> np.ndarray:
    """int64 ``[heads or 1, 3]`` window in tiles; each entry positive and at most the tile grid."""
    try:
        w = np.asarray(window)
    except (TypeError, ValueError):
        w = None
    if (
        w is None
        or w.ndim not in (1, 2)
        or w.shape[-1] != 3
        or w.dtype == object
        or not (
            np.issubdtype(w.dtype, np.integer)
            or (np.issubdtype(w.dtype, np.floating) and np.all(w == np.round(w)))
        )
    ):
        raise BuilderError(
            f"window must be three integers (t, h, w) in tiles, or one triple per head, got {window!r}"
        )
    w = w.astype(np.int64).reshape(-1, 3)
    if heads is not None and w.shape[0] not in (1, heads):
        raise BuilderError(f"window has {w.shape[0]} per-head triples but heads={heads}")
    if w.min() <= 0:
        raise BuilderError(f"window entries must be positive, got {window!r}")
    for axis in range(3):
        too_wide = w[:, axis] > tiles_per_axis[axis]
        if too_wide.any():
            raise BuilderError(
                f"window[{axis}]={int(w[too_wide, axis][0])} is wider than the tile grid "
                f"({tiles_per_axis[axis]} tiles along axis {axis})"
            )
    return w


# --- group (tile / cube / cluster) helpers ----------------------------------------------------------
def token_groups(layout: BlockLayout, level: str = "block") -> np.ndarray:
    """int64 ``[num_tokens]``: the block (``level="block"``) or group/tile (``"group"``) of each token."""
    block = layout.token_slot // layout.block_size
    return block if level == "block" else layout.block_group[block]


def group_averager(groups: np.ndarray, num_groups: int) -> tuple[sp.csr_matrix, np.ndarray]:
    """``(avg, counts)``: float32 CSR ``[num_groups, n]`` with ``avg @ x`` the group means of ``x``'s
    rows, and int64 ``counts [num_groups]``. Build it once to average several arrays over one grouping."""
    counts = np.bincount(groups, minlength=num_groups).astype(np.int64)
    inv = 1.0 / np.maximum(counts, 1)
    avg = sp.csr_matrix(
        (inv[groups].astype(np.float32), (groups, np.arange(groups.size))), shape=(num_groups, groups.size)
    )
    return avg, counts


def group_means(groups: np.ndarray, x: np.ndarray, num_groups: int, averager=None):
    """Means of the rows of ``x`` ``[n, d]`` per group over the rows present (valid tokens only).

    Returns ``(means float32 [num_groups, d], counts int64 [num_groups])``; empty groups have zero means.
    ``averager``: :func:`group_averager` of ``(groups, num_groups)``, when already built.
    """
    avg, counts = group_averager(groups, num_groups) if averager is None else averager
    return np.asarray(avg @ np.asarray(x, dtype=np.float32), dtype=np.float32), counts


def group_indicator(layout: BlockLayout, num_groups: int | None = None) -> sp.csr_matrix:
    """0/1 CSR ``[num_blocks, num_groups]``: block ``b`` belongs to group ``g`` (empty blocks left out)."""
    n = int(layout.block_group.max()) + 1 if num_groups is None else int(num_groups)
    live = np.flatnonzero(layout.valid_rows > 0)
    return sp.csr_matrix(
        (np.ones(live.size, dtype=np.int32), (live, layout.block_group[live])), shape=(layout.num_blocks, n)
    )


def graph_from_group_masks(
    q: BlockLayout,
    k: BlockLayout,
    masks,
    name: str = "",
    q_groups: int | None = None,
    k_groups: int | None = None,
) -> SparseGraph:
    """Graph selecting every (Q block, K block) pair of the selected (Q group, K group) pairs.

    ``masks[h]`` is a bool ``[q groups, k groups]`` (dense or scipy sparse) per head; groups are
    ``layout.block_group`` ids (tiles, cubes or clusters). Empty blocks are never selected. Built as
    the sparse product ``Pq · M_h · Pkᵀ`` of block-to-group indicators (no sort over pairs).
    """
    pq = group_indicator(q, q_groups)
    pkt = group_indicator(k, k_groups).T.tocsr()
    per_head = [pq @ sp.csr_matrix(m, dtype=np.int32) @ pkt for m in masks]
    stacked = sp.vstack(per_head, format="csr")
    stacked.sum_duplicates()
    stacked.sort_indices()
    return SparseGraph(q, k, len(per_head), stacked.indptr, stacked.indices, name)


def _repeat_heads(graph: SparseGraph, heads: int, name: str) -> SparseGraph:
    """A ``heads``-head graph whose every head selects what head 0 of ``graph`` selects."""
    nb = graph.q.num_blocks
    row_nnz = np.diff(graph.indptr[: nb + 1])
    indptr = np.concatenate([[0], np.cumsum(np.tile(row_nnz, heads))])
    return SparseGraph(
        graph.q, graph.k, heads, indptr, np.tile(graph.indices[: graph.indptr[nb]], heads), name
    )


def _graph_from_rows(
    q: BlockLayout, k: BlockLayout, per_head_rows: list[np.ndarray], name: str
) -> SparseGraph:
    """CSR graph from ``per_head_rows[h]`` int ``[q.num_blocks, m]`` K blocks per Q block (m may be 0).

    Rows of empty Q blocks are left empty; K blocks must be non-empty, distinct and ascending within a
    row (as :func:`_topk_rows` returns them).
    """
    q_alive = q.valid_rows > 0
    lens, cols = [], []
    for sel in per_head_rows:
        lens.append(np.where(q_alive, sel.shape[1], 0))
        cols.append(sel[q_alive].ravel())
    indptr = np.concatenate([[0], np.cumsum(np.concatenate(lens))])
    return SparseGraph(q, k, len(per_head_rows), indptr, np.concatenate(cols), name)


# --- Q/K features ---------------------------------------------------------------------------------
class _Features:
    """Per-head Q/K features in raster token order: the user's arrays, or synthetic factors."""

    def __init__(self, q, k, heads, num_tokens_q, num_tokens_k, head_dim, seed, grid=None, positions=None):
        self.grid, self.positions, self.seed = grid, positions, seed
        if (q is None) != (k is None):
            raise BuilderError("give both q and k, or neither (then synthetic features are used)")
        if q is None:
            self.ids = head_ids(1 if heads is None else heads)
            self.head_dim = _positive_int("head_dim", head_dim)
            if num_tokens_q != num_tokens_k:
                raise BuilderError("synthetic features need the same tokens on Q and K")
            self.q = self.k = None
            return
        q, k = np.asarray(q), np.asarray(k)
        for label, arr, n in (("q", q, num_tokens_q), ("k", k, num_tokens_k)):
            if arr.ndim != 3:
                raise BuilderError(f"{label} must be [heads, tokens, d], got shape {arr.shape}")
            if not np.issubdtype(arr.dtype, np.floating):
                raise BuilderError(f"{label} must hold floats, got dtype {arr.dtype}")
            if not np.isfinite(arr).all():
                raise BuilderError(f"{label} holds NaN or infinite values")
            if arr.shape[1] != n:
                raise BuilderError(f"{label} has {arr.shape[1]} tokens, the layout has {n}")
        if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
            raise BuilderError(f"q {q.shape} and k {k.shape} must agree in heads and head_dim")
        if isinstance(heads, (int, np.integer)) and not isinstance(heads, bool) and heads > q.shape[0]:
            raise BuilderError(f"heads={heads} but q holds only {q.shape[0]} heads")
        self.ids = head_ids(q.shape[0] if heads is None else heads, available=q.shape[0])
        self.q, self.k, self.head_dim = q, k, q.shape[2]

    @property
    def heads(self) -> int:
        return int(self.ids.size)

    def head(self, h: int):
        """``(q_h, k_h)`` float32 ``[tokens, r]``; dot products equal the full features' ones."""
        if self.q is not None:
            return np.asarray(self.q[h], dtype=np.float32), np.asarray(self.k[h], dtype=np.float32)
        return synthetic_head_factors(
            h, grid=self.grid, positions=self.positions, dim=self.head_dim, seed=self.seed
        )


def _video(grid, tile, block_size, padding) -> tuple[BlockLayout, VideoGrid]:
    try:
        vg = VideoGrid(tuple(grid), tuple(tile))
    except TypeError:
        raise BuilderError(
            f"grid and tile must be triples of positive integers, got {grid!r}, {tile!r}"
        ) from None
    return video_layout(vg.grid, vg.tile, block_size, padding), vg


def _video_features(grid, tile, block_size, padding, q, k, heads, head_dim, seed):
    """(layout, grid, features) of a video builder whose Q and K share one tile layout."""
    layout, vg = _video(grid, tile, block_size, padding)
    n = layout.num_tokens
    feats = _Features(q, k, heads, n, n, head_dim, seed, grid=vg.grid)
    return layout, vg, feats


def _map_heads(fn, ids: np.ndarray, workers: int | None):
    """``[fn(h) for h in ids]`` on a thread pool, BLAS single-threaded inside.

    The per-head work is many small matrix products: one BLAS thread per head and one head per core
    is about 2x faster on 2 cores than multi-threaded BLAS over heads one by one.
    """
    ids = [int(h) for h in ids]
    workers = min(len(ids), os.cpu_count() or 1) if workers is None else _positive_int("workers", workers)
    with single_threaded_blas():
        if workers == 1:
            return [fn(h) for h in ids]
        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(fn, ids))


# --- STA / SSTA -----------------------------------------------------------------------------------
def sta_tile_pairs(tiles_per_axis, window, clamp: bool = True):
    """(q_tile, k_tile) int64 arrays of a sliding tile window over a raster grid of tiles.

    Along each axis with ``n`` tiles and window ``w``, Q tile ``c`` sees K tiles ``[s, s + w)`` with
    ``s = clip(c - w // 2, 0, n - w)`` when ``clamp`` (STA: the window centre is clamped inward so
    every window keeps its full size; for odd ``w`` this is STA's ``|clamp(c, w//2, n-1-w//2) - j| <= w//2``).
    Without ``clamp`` the window ``[c - w//2, c - w//2 + w)`` is cut at the borders.
    """
    n = np.asarray(tiles_per_axis, dtype=np.int64)
    w = np.asarray(window, dtype=np.int64).reshape(3)
    axes_lo, axes_ok = [], []
    for a in range(3):
        c = np.arange(n[a])
        lo = c - w[a] // 2
        if clamp:
            lo = np.clip(lo, 0, n[a] - w[a])
        cand = lo[:, None] + np.arange(w[a])[None, :]
        axes_lo.append(cand)
        axes_ok.append((cand >= 0) & (cand < n[a]))
    # Q tile (a, b, c) x window offsets (x, y, z): broadcast to [na, nb, nc, wa, wb, wc].
    ka = axes_lo[0][:, None, None, :, None, None]
    kb = axes_lo[1][None, :, None, None, :, None]
    kc = axes_lo[2][None, None, :, None, None, :]
    ok = (
        axes_ok[0][:, None, None, :, None, None]
        & axes_ok[1][None, :, None, None, :, None]
        & axes_ok[2][None, None, :, None, None, :]
    )
    k_tile = (ka * n[1] + kb) * n[2] + kc
    q_tile = np.broadcast_to(np.arange(n.prod()).reshape(n[0], n[1], n[2], 1, 1, 1), k_tile.shape)
    return q_tile[ok].astype(np.int64), k_tile[ok].astype(np.int64)


def sta_graph(
    grid,
    tile,
    window,
    heads=1,
    block_size: int = 128,
    padding: str = "prefix",
    clamp: bool = True,
    name: str = "sta",
) -> SparseGraph:
    """STA: every Q tile attends to a ``window`` (in tiles, ``(wt, wh, ww)``) of K tiles.

    ``window`` is one triple for all heads or ``[heads, 3]`` (per-head windows, as STA's calibrated
    mask strategies). See :func:`sta_tile_pairs` for the border rule (``clamp``). ``heads``: a count,
    or the ids of the heads to build (rows of a per-head ``window``).
    """
    ids = head_ids(heads)
    layout, vg = _video(grid, tile, block_size, padding)
    if isinstance(heads, (int, np.integer)):
        check_window(window, vg.tiles_per_axis, ids.size)
    win = head_windows(window, vg.tiles_per_axis, ids)
    heads = ids.size
    nt = vg.num_tiles
    masks = {}
    for w in map(tuple, win):
        if w not in masks:
            qt, kt = sta_tile_pairs(vg.tiles_per_axis, w, clamp)
            masks[w] = sp.csr_matrix((np.ones(qt.size, dtype=np.int32), (qt, kt)), shape=(nt, nt))
    if len(masks) == 1:
        return _repeat_heads(
            graph_from_group_masks(layout, layout, list(masks.values()), name, nt, nt), heads, name
        )
    return graph_from_group_masks(layout, layout, [masks[tuple(win[h])] for h in range(heads)], name, nt, nt)


def _topk_rows(scores: np.ndarray, topk: int, alive_cols: np.ndarray) -> np.ndarray:
    """int64 ``[rows, min(topk, alive)]``: the highest-scoring alive columns of each row, ascending.

    Rows whose ``m``-th highest score is tied with another column take ``np.argpartition``'s choice;
    every other row has a unique top-``m`` set, found here from one value partition and a threshold
    (about twice as fast as ``argpartition`` and already sorted by column).
    """
    m = min(int(topk), int(alive_cols.sum()))
    rows = scores.shape[0]
    if m == 0:
        return np.zeros((rows, 0), dtype=np.int64)
    neg = -scores if alive_cols.all() else np.where(alive_cols[None, :], -scores, np.inf)
    if m == neg.shape[1]:
        return np.broadcast_to(np.arange(m, dtype=np.int64), neg.shape).copy()
    kth = np.partition(neg, m - 1, axis=1)[:, m - 1 : m]
    chosen = neg <= kth
    tied = np.flatnonzero(np.count_nonzero(chosen, axis=1) != m)
    if tied.size:
        chosen[tied] = False
        picks = np.argpartition(neg[tied], m - 1, axis=1)[:, :m]
        chosen[tied[:, None], picks] = True
    flat = np.flatnonzero(chosen).reshape(rows, m)
    return flat - (np.arange(rows, dtype=np.int64) * neg.shape[1])[:, None]


def ssta_graph(
    grid,
    tile,
    window,
    topk: int,
    heads=None,
    block_size: int = 128,
    padding: str = "prefix",
    q=None,
    k=None,
    head_dim: int = 128,
    seed: int = 0,
    clamp: bool = True,
    workers: int | None = None,
    name: str = "ssta",
) -> SparseGraph:
    """SSTA: STA window ∪ the ``topk`` K tiles of highest tile-mean score, per head and Q tile.

    Tile score = ``mean_q(tile_i) · mean_k(tile_j)``, means over the tile's valid tokens only; the
    top-k is taken over all non-empty K tiles (it may overlap the window).
    """
    topk = _positive_int("topk", topk)
    layout, vg, feats = _video_features(grid, tile, block_size, padding, q, k, heads, head_dim, seed)
    if heads is None or isinstance(heads, (int, np.integer)):
        check_window(window, vg.tiles_per_axis, feats.heads)
    win = dict(zip(feats.ids.tolist(), map(tuple, head_windows(window, vg.tiles_per_axis, feats.ids))))
    nt = vg.num_tiles
    groups = token_groups(layout, "group")
    windows = {}
    for w in set(win.values()):
        mask = np.zeros((nt, nt), dtype=bool)
        mask[sta_tile_pairs(vg.tiles_per_axis, w, clamp)] = True
        windows[w] = mask

    averager = group_averager(groups, nt)  # the same for Q, K and every head

    def one_head(h: int) -> np.ndarray:
        qh, kh = feats.head(h)
        qm, _ = group_means(groups, qh, nt, averager)
        km, kc = group_means(groups, kh, nt, averager)
        sel = _topk_rows(qm @ km.T, topk, kc > 0)
        mask = windows[win[h]].copy()
        mask[np.arange(nt)[:, None], sel] = True
        return mask

    return graph_from_group_masks(layout, layout, _map_heads(one_head, feats.ids, workers), name, nt, nt)


# --- VSA ------------------------------------------------------------------------------------------
def vsa_graph(
    grid,
    tile,
    topk: int,
    heads=None,
    block_size: int = 64,
    padding: str = "prefix",
    q=None,
    k=None,
    head_dim: int = 128,
    seed: int = 0,
    workers: int | None = None,
    name: str = "vsa",
) -> SparseGraph:
    """VSA: each Q block (cube) keeps the ``topk`` K blocks of highest coarse score, per head.

    Coarse score = ``mean_q(block_i) · mean_k(block_j)``, means over the block's valid tokens only
    (a partial cube averages its real tokens). Each non-empty Q block selects
    ``min(topk, number of non-empty K blocks)`` blocks.
    """
    topk = _positive_int("topk", topk)
    layout, _, feats = _video_features(grid, tile, block_size, padding, q, k, heads, head_dim, seed)
    nb = layout.num_blocks
    blocks = token_groups(layout, "block")
    alive = layout.valid_rows > 0

    averager = group_averager(blocks, nb)  # the same for Q, K and every head

    def one_head(h: int) -> np.ndarray:
        qh, kh = feats.head(h)
        qm, _ = group_means(blocks, qh, nb, averager)
        km, _ = group_means(blocks, kh, nb, averager)
        return _topk_rows(qm @ km.T, topk, alive)

    return _graph_from_rows(layout, layout, _map_heads(one_head, feats.ids, workers), name)


# --- SVG2 -----------------------------------------------------------------------------------------
def _kmeans_pp_init(x: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ seeding (D² sampling), updated incrementally: O(k·n·d) instead of scipy's O(k²·n·d)."""
    n = x.shape[0]
    sq = np.einsum("ij,ij->i", x, x, dtype=np.float64)
    xm2 = -2.0 * x  # (-2 x)·x_j equals -2 (x·x_j) bit for bit: scaling by a power of two is exact
    idx = np.empty(k, dtype=np.int64)
    idx[0] = rng.integers(n)
    d2 = np.maximum(sq - 2.0 * (x @ x[idx[0]]) + sq[idx[0]], 0.0)
    u = rng.random(k)
    cum = np.empty(n)
    d2_new = np.empty(n)
    for i in range(1, k):
        np.add.accumulate(d2, out=cum)
        if cum[-1] <= 0:  # fewer distinct points than clusters: the rest repeat existing centres
            idx[i:] = idx[rng.integers(i, size=k - i)]
            break
        j = min(int(cum.searchsorted(u[i] * cum[-1], side="right")), n - 1)
        idx[i] = j
        # d2_new = max(sq - 2 x·x_j + sq_j, 0), in place
        np.matmul(xm2, x[j], out=d2_new)
        d2_new += sq
        d2_new += sq[j]
        np.maximum(d2_new, 0.0, out=d2_new)
        np.minimum(d2, d2_new, out=d2)
    return x[idx].astype(np.float64)


#: Distance entries per chunk of :func:`nearest_centroid` (8 MB of float32: fastest on 2 cores here).
NEAREST_CHUNK_ENTRIES = 1 << 21


def nearest_centroid(x: np.ndarray, centroids: np.ndarray, chunk: int | None = None) -> np.ndarray:
    """int64 ``[n]``: index of the nearest centroid (squared Euclidean) of each row of ``x``.

    Same result as ``scipy.cluster.vq.vq`` but through chunked matrix products, 3-10x faster here:
    ``argmin_c |c|^2 - 2 x·c`` is one product of ``[x, 1]`` with ``[-2 c; |c|^2]``. ``chunk`` rows per
    product (default: about :data:`NEAREST_CHUNK_ENTRIES` distances, 512 to 8192 rows).
    """
    x = np.asarray(x, dtype=np.float32)
    c = np.asarray(centroids, dtype=np.float32)
    if chunk is None:
        chunk = max(512, min(8192, NEAREST_CHUNK_ENTRIES // max(1, c.shape[0])))
    n, d = x.shape
    cols = np.empty((d + 1, c.shape[0]), dtype=np.float32)
    cols[:d] = -2.0 * c.T
    cols[d] = np.einsum("ij,ij->i", c, c)
    rows = np.ones((min(chunk, n), d + 1), dtype=np.float32)
    dist = np.empty((min(chunk, n), c.shape[0]), dtype=np.float32)
    out = np.empty(n, dtype=np.int64)
    for s in range(0, n, chunk):
        m = min(chunk, n - s)
        rows[:m, :d] = x[s : s + m]
        np.matmul(rows[:m], cols, out=dist[:m])
        out[s : s + m] = dist[:m].argmin(axis=1)
    return out


def kmeans_labels(x: np.ndarray, k: int, rng: np.random.Generator, fit_points: int = 4096, iters: int = 3):
    """Cluster the rows of ``x`` ``[n, d]`` into ``k`` groups: k-means fitted on a subsample.

    ``scipy.cluster.vq.kmeans2`` (``iters`` Lloyd steps) runs on ``max(fit_points, 2k)`` sampled rows
    from a seeded k-means++ start (D² seeding over the first ``2k`` of them); every row is then
    assigned to its nearest centroid.
    Returns int64 labels ``[n]`` in ``[0, k)`` (some clusters may end up empty).
    """
    n = x.shape[0]
    m = min(n, max(int(fit_points), 2 * k))
    sub = x[rng.permutation(n)[:m]].astype(np.float64)  # random order: its first 2k rows are a random pool
    init = _kmeans_pp_init(sub[: min(m, 2 * k)], k, rng)
    from scipy.cluster.vq import kmeans2  # here: its import (scipy.spatial) is slow and only SVG2 needs it

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # empty clusters keep their centre (scipy warns)
        centroids, _ = kmeans2(sub, init, iter=iters, minit="matrix", missing="warn")
    return nearest_centroid(x, centroids)


def svg2_select(
    qc: np.ndarray, kc: np.ndarray, k_sizes: np.ndarray, head_dim: int, top_p: float, min_fraction: float
) -> tuple[np.ndarray, np.ndarray]:
    """SVG2's cluster selection: (q_cluster, k_cluster) pairs, int64.

    For each Q cluster ``i``: ``p_ij ∝ size_j · exp(qc_i · kc_j / sqrt(head_dim))`` over non-empty K
    clusters; keep the smallest set of highest ``p`` whose sum reaches ``top_p``, and at least
    ``ceil(min_fraction · non-empty K clusters)``. Among equal ``p`` the lower cluster index goes
    first. Pairs come in row-major order.
    """
    alive = k_sizes > 0
    n_alive = int(alive.sum())
    logits = (qc.astype(np.float64) @ kc.astype(np.float64).T) / np.sqrt(head_dim)
    logits = np.where(alive[None, :], logits + np.log(np.maximum(k_sizes, 1))[None, :], -np.inf)
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    descending = -np.sort(-p, axis=1)
    cum = np.cumsum(descending, axis=1)
    keep = np.minimum((cum < top_p * (1 - 1e-12)).sum(axis=1) + 1, n_alive)
    keep = np.maximum(keep, min(n_alive, int(np.ceil(min_fraction * n_alive - 1e-9))))
    # The first `keep` clusters by decreasing p, ties by lower index (a stable sort), without sorting
    # indices: everything above the keep-th value, then the lowest-index clusters tied with it.
    last = np.take_along_axis(descending, (keep - 1)[:, None], axis=1)
    above = p > last
    tied = p == last
    tied_needed = keep - above.sum(axis=1)
    chosen = above | (tied & (np.cumsum(tied, axis=1) <= tied_needed[:, None]))
    i, j = np.nonzero(chosen)
    return i.astype(np.int64), j.astype(np.int64)


def svg2_graph(
    grid=None,
    heads=None,
    q_clusters: int = 300,
    k_clusters: int = 1000,
    top_p: float = 0.9,
    min_fraction: float = 0.1,
    block_size: int = 128,
    q=None,
    k=None,
    head_dim: int = 128,
    seed: int = 0,
    fit_points: int = 4096,
    iters: int = 3,
    workers: int | None = None,
    name: str = "svg2",
) -> list[SparseGraph]:
    """SVG2 (semantic-aware permutation): independent k-means partitions of Q and K, per head.

    Each head's Q tokens are clustered into ``q_clusters`` and its K tokens into ``k_clusters``
    (:func:`kmeans_labels`); each side becomes a :func:`~sparseattn.layouts.partition_layout`
    (clusters padded to whole ``block_size`` blocks). Cluster pairs are chosen by :func:`svg2_select`
    from cluster-centroid scores and expanded to all their block pairs.

    Because the partitions differ per head, the result is a list of single-head graphs, one per head
    asked for (``heads`` a count: graph ``h`` is head ``h``; a list of ids: in that order). ``grid`` gives token positions for the synthetic features; with user
    ``q``/``k`` it may be None. Heads run on ``workers`` threads (default: CPU count) with BLAS
    limited to one thread each; every head has its own seeded generator, so the result does not
    depend on ``workers``.
    """
    q_clusters = _positive_int("q_clusters", q_clusters)
    k_clusters = _positive_int("k_clusters", k_clusters)
    top_p = _fraction("top_p", top_p)
    min_fraction = _fraction("min_fraction", min_fraction, low_open=False)
    if q is None:
        if grid is None:
            raise BuilderError("grid is required when q and k are not given (synthetic features)")
        vg = VideoGrid(tuple(grid), (1, 1, 1))
        n_q = n_k = vg.num_tokens
        grid = vg.grid
    else:
        n_q, n_k = np.shape(q)[1] if np.ndim(q) == 3 else -1, np.shape(k)[1] if np.ndim(k) == 3 else -1
    feats = _Features(q, k, heads, n_q, n_k, head_dim, seed, grid=grid)
    for label, c, n in (("q_clusters", q_clusters, n_q), ("k_clusters", k_clusters, n_k)):
        if c > n:
            raise BuilderError(f"{label}={c} is more than the {n} tokens to cluster")

    def one_head(h: int) -> SparseGraph:
        qh, kh = feats.head(h)
        rng = np.random.default_rng(np.random.SeedSequence(int(seed), spawn_key=(h, 2 << 20)))
        q_lab = kmeans_labels(qh, q_clusters, rng, fit_points, iters)
        k_lab = kmeans_labels(kh, k_clusters, rng, fit_points, iters)
        q_lay = partition_layout(
            q_lab, block_size, q_clusters, name=f"{name} head {h} Q: {q_clusters} clusters"
        )
        k_lay = partition_layout(
            k_lab, block_size, k_clusters, name=f"{name} head {h} K: {k_clusters} clusters"
        )
        qc, _ = group_means(q_lab, qh, q_clusters)
        kc, k_sizes = group_means(k_lab, kh, k_clusters)
        gi, gj = svg2_select(qc, kc, k_sizes, feats.head_dim, top_p, min_fraction)
        mask = sp.csr_matrix((np.ones(gi.size, dtype=np.int32), (gi, gj)), shape=(q_clusters, k_clusters))
        return graph_from_group_masks(q_lay, k_lay, [mask], f"{name} head {h}", q_clusters, k_clusters)

    # Load scipy's own BLAS (k-means) before _map_heads limits BLAS to one thread: a library loaded
    # inside the limit keeps its default thread count and oversubscribes the cores.
    import scipy.cluster.vq  # noqa: F401

    return _map_heads(one_head, feats.ids, workers)


# --- generic graphs -------------------------------------------------------------------------------
def random_graph(
    q: BlockLayout, k: BlockLayout, heads, density: float, seed: int = 0, name: str = "random"
) -> SparseGraph:
    """Each non-empty Q block of each head selects ``max(1, round(density · non-empty K blocks))``
    distinct non-empty K blocks uniformly at random. ``heads``: a count or a list of head ids (head
    ``h`` draws after heads ``0..h-1`` from one generator)."""
    ids = head_ids(heads)
    density = _fraction("density", density)
    alive = k.valid_rows > 0
    m = max(1, round(density * int(alive.sum())))
    rng = np.random.default_rng(seed)
    wanted = set(ids.tolist())
    rows = {}
    for h in range(int(ids.max()) + 1):
        scores = rng.random((q.num_blocks, k.num_blocks))
        if h in wanted:
            rows[h] = _topk_rows(scores, m, alive)
    return _graph_from_rows(q, k, [rows[h] for h in ids.tolist()], name)


def token_mask_graph(
    q: BlockLayout, k: BlockLayout, token_mask, heads: int | None = None, name: str = "token mask"
) -> SparseGraph:
    """Blocks from a token-level mask: a block pair is selected if any (query, key) pair inside is True.

    ``token_mask``: bool ``[q.num_tokens, k.num_tokens]`` (same for every head) or
    ``[heads, q.num_tokens, k.num_tokens]``; tokens in each layout's token order.
    """
    m = np.asarray(token_mask)
    if m.dtype != bool:
        raise BuilderError(f"token_mask must be a bool array, got dtype {m.dtype}")
    if m.ndim == 2:
        m = m[None]
    if m.ndim != 3 or m.shape[1:] != (q.num_tokens, k.num_tokens):
        raise BuilderError(
            f"token_mask must be [{q.num_tokens}, {k.num_tokens}] or "
            f"[heads, {q.num_tokens}, {k.num_tokens}], got {np.shape(token_mask)}"
        )
    n_heads = m.shape[0] if heads is None else _positive_int("heads", heads)
    if m.shape[0] not in (1, n_heads):
        raise BuilderError(f"token_mask has {m.shape[0]} heads but heads={n_heads}")
    h, a, b = np.nonzero(m)
    qb = q.token_slot[a] // q.block_size
    kb = k.token_slot[b] // k.block_size
    if m.shape[0] == 1 and n_heads > 1:
        g = SparseGraph.from_pairs(q, k, 1, h, qb, kb, name)
        return _repeat_heads(g, n_heads, name)
    return SparseGraph.from_pairs(q, k, n_heads, h, qb, kb, name)


def _is_triples(blocks) -> bool:
    if isinstance(blocks, np.ndarray):
        return True
    try:
        first = blocks[0]
        return len(first) == 3 and all(np.ndim(x) == 0 for x in first)
    except (TypeError, IndexError, KeyError):
        return False


def block_list_graph(
    q: BlockLayout, k: BlockLayout, blocks, heads: int | None = None, name: str = "block list"
) -> SparseGraph:
    """Graph from explicit blocks: an int array ``[n, 3]`` of (head, q_block, k_block) rows, or
    per-head lists ``blocks[h][i]`` = K blocks of Q block ``i``. Out-of-range entries raise
    :class:`BuilderError` naming ``blocks``."""
    if _is_triples(blocks):
        arr = np.asarray(blocks)
        if arr.size == 0:
            arr = arr.reshape(0, 3)
        if arr.dtype == object and all(isinstance(v, int) for v in arr.ravel()):
            raise BuilderError("blocks holds an id too large for a 64-bit integer")
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise BuilderError(
                f"blocks must hold integer ids (head, q_block, k_block), got dtype {arr.dtype}"
            )
        if arr.ndim != 2 or arr.shape[1] != 3 or not np.issubdtype(arr.dtype, np.integer):
            raise BuilderError(f"blocks must be integer rows (head, q_block, k_block), got shape {arr.shape}")
        n_heads = int(arr[:, 0].max()) + 1 if heads is None and arr.size else (heads or 1)
        n_heads = _positive_int("heads", n_heads)
        for col, (label, bound) in enumerate(
            (("head", n_heads), ("q_block", q.num_blocks), ("k_block", k.num_blocks))
        ):
            bad = np.flatnonzero((arr[:, col] < 0) | (arr[:, col] >= bound))
            if bad.size:
                r = int(bad[0])
                raise BuilderError(
                    f"blocks[{r}] = {tuple(int(v) for v in arr[r])}: {label} {int(arr[r, col])} "
                    f"is outside [0, {bound})"
                )
        return SparseGraph.from_pairs(q, k, n_heads, arr[:, 0], arr[:, 1], arr[:, 2], name)
    if heads is not None and len(blocks) != heads:
        raise BuilderError(f"blocks has {len(blocks)} per-head lists but heads={heads}")
    try:
        return SparseGraph.from_block_lists(q, k, blocks, name)
    except GraphError as err:
        raise BuilderError(f"blocks: {str(err).replace('lists[', 'blocks[')}") from None
    except (TypeError, ValueError) as err:
        raise BuilderError(f"blocks must be per-head lists of per-Q-block K block lists: {err}") from None
