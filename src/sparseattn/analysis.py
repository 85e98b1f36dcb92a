"""Occupancy analysis: useful vs physical query–key pairs of a sparse graph (docs/counting.md).

Per head of one attention call, with ``vq_i``/``vk_j`` the valid rows and ``pq_i``/``pk_j`` the live
16-row pages of Q block ``i`` / K block ``j``:

* ``useful        = Σ_(i,j)∈G vq_i · vk_j``
* ``bsa_physical  = |G| · Bq · Bk``  (one full block tile per selected pair)
* ``kpage_physical = Σ_i M_i·⌈16·pq_i / M_i⌉ · N_i·⌈16·Σ_(j∈G(i)) pk_j / N_i⌉`` where the route
  ``(M_i, N_i)`` is (64, 256) when ``16·pq_i ≤ 64`` and (128, 128) otherwise ("auto"), or one fixed
  route for every block. "No routing" is the fixed (128, 128) route.

A Q block with no valid row has no output rows, so no kernel computes it: its pairs count 0 physical
(the plans in :mod:`sparseattn.planning` skip it too; graphs built with ``drop_empty=True``, the default,
never hold such pairs). Every count here equals ``planning.bsa_plan(g).physical_pairs()`` and
``planning.kpage_plan(g, route).physical_pairs()``, computed without building a plan: one pass of
segment sums over the graph's CSR arrays.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .constants import KPAGE_ROUTES, PAGE_ROWS
from .graph import SparseGraph
from .layouts import BlockLayout
from .planning.tile_plan import kpage_route_of_block
from .synthetic import reuse_factors

#: Route names accepted by the analysis and the CLI, mapped to ``planning.kpage_plan``'s ``route``.
ROUTE_CHOICES = {"auto": "auto", "64x256": 0, "128x128": 1}

#: Bins of the selected-pair fill histogram (fraction of a Bq×Bk tile that is useful).
PAIR_FILL_BINS = np.linspace(0.0, 1.0, 21)


class AnalysisError(ValueError):
    """An analysis argument is invalid; the message names the argument."""


class DroppedPairsWarning(UserWarning):
    """Selected block pairs were left out of a graph because a block has no valid row."""


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise AnalysisError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def parse_route(route) -> str | int:
    """Normalize a route given as ``"auto"``, ``"64x256"``, ``"128x128"``, 0 or 1 to plans' form."""
    if isinstance(route, str) and route in ROUTE_CHOICES:
        return ROUTE_CHOICES[route]
    if not isinstance(route, bool) and route in (0, 1):
        return int(route)
    raise AnalysisError(f"route must be one of {sorted(ROUTE_CHOICES)} (or 0/1), got {route!r}")


def route_name(route) -> str:
    r = parse_route(route)
    return "auto" if r == "auto" else "{}x{}".format(*KPAGE_ROUTES[r])


# --- per-head counts --------------------------------------------------------------------------------
@dataclass(frozen=True)
class PairCounts:
    """QK pair counts per head of one attention call; every array is int64 ``[heads]``.

    ``kpage_physical`` uses the route chosen in :func:`graph_counts`; the three ``kpage_*`` route
    variants are always computed so each KPage mechanism's share is visible.
    """

    route: str
    selected_pairs: np.ndarray  # |G| per head (block pairs)
    useful: np.ndarray
    bsa_physical: np.ndarray
    kpage_physical: np.ndarray
    kpage_routed: np.ndarray  # route "auto"
    kpage_no_routing: np.ndarray  # always 128×128
    kpage_small_tile: np.ndarray  # always 64×256
    dropped_pairs: np.ndarray | None = None  # pairs the graph left out (empty Q or K block)

    @property
    def heads(self) -> int:
        return int(self.useful.size)

    @classmethod
    def concat(cls, parts: list[PairCounts]) -> PairCounts:
        """Heads of several graphs side by side (a workload whose graphs cover different heads)."""
        if not parts:
            raise AnalysisError("parts must hold at least one PairCounts")
        routes = {p.route for p in parts}
        if len(routes) != 1:
            raise AnalysisError(f"parts were counted with different routes {sorted(routes)}")
        arrays = {name: np.concatenate([getattr(p, name) for p in parts]) for name in _COUNT_FIELDS}
        dropped = np.concatenate([p.dropped() for p in parts])
        return cls(route=parts[0].route, dropped_pairs=dropped, **arrays)

    def dropped(self) -> np.ndarray:
        """int64 ``[heads]``: selected pairs left out of the graph for touching an empty block."""
        return np.zeros(self.heads, np.int64) if self.dropped_pairs is None else self.dropped_pairs

    def totals(self) -> dict[str, int]:
        """Sums over heads (Python ints)."""
        return {name: int(getattr(self, name).sum()) for name in _COUNT_FIELDS}


_COUNT_FIELDS = (
    "selected_pairs",
    "useful",
    "bsa_physical",
    "kpage_physical",
    "kpage_routed",
    "kpage_no_routing",
    "kpage_small_tile",
)


def _segment_sums(indptr: np.ndarray, values: np.ndarray) -> np.ndarray:
    """int64 ``[len(indptr) - 1]``: sum of ``values`` over each CSR segment (exact integers)."""
    csum = np.empty(values.size + 1, dtype=np.int64)
    csum[0] = 0
    np.cumsum(values, dtype=np.int64, out=csum[1:])
    return csum[indptr[1:]] - csum[indptr[:-1]]


def _k_pair_stats(graph: SparseGraph) -> tuple[np.ndarray, np.ndarray]:
    """int64 ``[nnz]``: valid rows and live pages of each selected pair's K block (shared by the
    counts and the fill histograms of one graph)."""
    return graph.k.valid_rows[graph.indices], graph.k.live_pages[graph.indices]


def _kpage_row_physical(q_live_pages: np.ndarray, row_k_pages: np.ndarray, route) -> np.ndarray:
    """int64 ``[rows]``: KPage physical pairs of each CSR row for one route choice."""
    routes = np.asarray(KPAGE_ROUTES, dtype=np.int64)
    r = kpage_route_of_block(q_live_pages, route)  # the planner's own routing rule
    m, n = routes[r, 0], routes[r, 1]
    q_rows = PAGE_ROWS * q_live_pages
    k_rows = PAGE_ROWS * row_k_pages
    return m * (-(-q_rows // m)) * n * (-(-k_rows // n))


def graph_counts(graph: SparseGraph, route="auto") -> PairCounts:
    """Useful and physical QK pairs per head of ``graph`` (the counting rules of docs/counting.md).

    Vectorized over the CSR arrays: O(nnz) work, no loop over pairs or heads.
    """
    if not isinstance(graph, SparseGraph):
        raise AnalysisError(f"graph must be a SparseGraph, got {type(graph).__name__}")
    return _graph_counts(graph, parse_route(route), *_k_pair_stats(graph))


def _graph_counts(graph: SparseGraph, route, k_valid: np.ndarray, k_pages: np.ndarray) -> PairCounts:
    q, k = graph.q, graph.k
    nbq = q.num_blocks
    q_block = np.arange(graph.num_rows, dtype=np.int64) % nbq
    q_has_rows = q.valid_rows[q_block] > 0

    row_pairs = np.diff(graph.indptr) * q_has_rows
    row_k_valid = _segment_sums(graph.indptr, k_valid)
    row_k_pages = _segment_sums(graph.indptr, k_pages)
    q_live = q.live_pages[q_block]

    rows = {
        "selected_pairs": row_pairs,
        "useful": q.valid_rows[q_block] * row_k_valid,
        "bsa_physical": row_pairs * (q.block_size * k.block_size),
        "kpage_routed": _kpage_row_physical(q_live, row_k_pages, "auto"),
        "kpage_no_routing": _kpage_row_physical(q_live, row_k_pages, 1),
        "kpage_small_tile": _kpage_row_physical(q_live, row_k_pages, 0),
    }
    chosen = {"auto": "kpage_routed", 0: "kpage_small_tile", 1: "kpage_no_routing"}[route]
    rows["kpage_physical"] = rows[chosen]
    per_head = {name: rows[name].reshape(graph.heads, nbq).sum(axis=1) for name in _COUNT_FIELDS}
    return PairCounts(route=route_name(route), dropped_pairs=graph.dropped_pairs.copy(), **per_head)


# --- block fill distributions ---------------------------------------------------------------------
def _add_hist(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    n = max(a.size, b.size)
    return np.pad(a, (0, n - a.size)) + np.pad(b, (0, n - b.size))


@dataclass(frozen=True)
class BlockFill:
    """How full the blocks of a graph are; every histogram is int64 counts.

    Attributes:
        q_valid_rows, k_valid_rows: ``[B + 1]``, blocks of the layout by valid rows (one count per
            block per head, so layouts of several graphs add up).
        q_live_pages, k_live_pages: ``[B/16 + 1]``, blocks by live 16-row pages.
        selected_k_valid_rows: ``[Bk + 1]``, selected pairs by the valid rows of their K block
            (what a block-sparse kernel streams).
        selected_k_live_pages: ``[Bk/16 + 1]``, selected pairs by the live pages of their K block.
        pair_fill: ``[len(PAIR_FILL_BINS) - 1]``, selected pairs by ``vq·vk / (Bq·Bk)``.
    """

    q_valid_rows: np.ndarray
    k_valid_rows: np.ndarray
    q_live_pages: np.ndarray
    k_live_pages: np.ndarray
    selected_k_valid_rows: np.ndarray
    selected_k_live_pages: np.ndarray
    pair_fill: np.ndarray
    pair_fill_bins: np.ndarray = field(default_factory=lambda: PAIR_FILL_BINS.copy())

    def __add__(self, other: BlockFill) -> BlockFill:
        if not isinstance(other, BlockFill):
            return NotImplemented
        return BlockFill(
            **{name: _add_hist(getattr(self, name), getattr(other, name)) for name in _FILL_FIELDS}
        )


_FILL_FIELDS = (
    "q_valid_rows",
    "k_valid_rows",
    "q_live_pages",
    "k_live_pages",
    "selected_k_valid_rows",
    "selected_k_live_pages",
    "pair_fill",
)


def layout_fill(layout: BlockLayout) -> tuple[np.ndarray, np.ndarray]:
    """(blocks by valid rows ``[B + 1]``, blocks by live pages ``[B/16 + 1]``) of one layout."""
    return (
        np.bincount(layout.valid_rows, minlength=layout.block_size + 1),
        np.bincount(layout.live_pages, minlength=layout.pages_per_block + 1),
    )


def pair_fill(graph: SparseGraph) -> np.ndarray:
    """float64 ``[nnz]``: useful fraction ``vq_i·vk_j / (Bq·Bk)`` of each selected pair's tile."""
    _, qb, kb = graph.pairs
    return (graph.q.valid_rows[qb] * graph.k.valid_rows[kb]) / float(graph.q.block_size * graph.k.block_size)


def graph_fill(graph: SparseGraph) -> BlockFill:
    """Block-fill histograms of ``graph`` (layout histograms counted once per head)."""
    return _graph_fill(graph, *_k_pair_stats(graph))


def _graph_fill(graph: SparseGraph, k_valid: np.ndarray, k_pages: np.ndarray) -> BlockFill:
    q_rows, q_pages = layout_fill(graph.q)
    k_rows, k_pages_hist = layout_fill(graph.k)
    return BlockFill(
        q_valid_rows=q_rows * graph.heads,
        k_valid_rows=k_rows * graph.heads,
        q_live_pages=q_pages * graph.heads,
        k_live_pages=k_pages_hist * graph.heads,
        selected_k_valid_rows=np.bincount(k_valid, minlength=graph.k.block_size + 1),
        selected_k_live_pages=np.bincount(k_pages, minlength=graph.k.pages_per_block + 1),
        pair_fill=_pair_fill_hist(graph, k_valid),
    )


def _pair_fill_hist(graph: SparseGraph, k_valid: np.ndarray) -> np.ndarray:
    """Selected pairs per ``PAIR_FILL_BINS`` bin, in exact integer arithmetic (last bin closed).

    Pairs are counted by (Q valid rows, K valid rows) first when there are fewer such combinations
    than pairs, then each combination goes to its bin.
    """
    nbins = PAIR_FILL_BINS.size - 1
    bq, bk = graph.q.block_size, graph.k.block_size
    q_rows = graph.q.valid_rows[np.arange(graph.num_rows) % graph.q.num_blocks]
    combos = (bq + 1) * (bk + 1)
    if combos > k_valid.size:  # few pairs: bin each pair
        useful = np.repeat(q_rows, np.diff(graph.indptr)) * k_valid
        counts = np.bincount(np.minimum(useful * nbins // (bq * bk), nbins - 1), minlength=nbins)
        return counts.astype(np.int64)
    combo = np.repeat(q_rows * (bk + 1), np.diff(graph.indptr))
    combo += k_valid
    vq, vk = np.divmod(np.arange(combos, dtype=np.int64), bk + 1)
    bins = np.minimum(vq * vk * nbins // (bq * bk), nbins - 1)
    return np.bincount(bins, weights=np.bincount(combo, minlength=combos), minlength=nbins).astype(np.int64)


# --- workload reports -----------------------------------------------------------------------------
def _ratio(num: int, den: int) -> float:
    return float(num) / float(den) if den else float("nan")


@dataclass(frozen=True)
class OccupancyReport:
    """Analysis of one workload: the sum over its graphs (which together cover all its heads).

    ``counts`` holds per-head arrays for ONE attention call (one layer at one step).
    """

    workload: str
    layers: int
    counts: PairCounts
    fill: BlockFill | None  # None when the analysis was asked for counts only (``fill=False``)
    head_dim: int | None = None
    description: str = ""

    @property
    def heads(self) -> int:
        return self.counts.heads

    def record(self, multiply_layers: bool = False) -> dict:
        """Flat JSON-ready dict (ints and floats) of the totals over heads.

        Pair counts are for one attention call unless ``multiply_layers``, which multiplies them by
        ``layers`` (``scope`` says which). Occupancy = useful / physical.
        """
        t = self.counts.totals()
        scale = self.layers if multiply_layers else 1
        rec = {
            "workload": self.workload,
            "heads": self.heads,
            "layers": self.layers,
            "scope": "all_layers" if multiply_layers else "one_call",
            "route": self.counts.route,
            "selected_pairs": t["selected_pairs"] * scale,
            "useful_pairs": t["useful"] * scale,
            "bsa_physical": t["bsa_physical"] * scale,
            "kpage_physical": t["kpage_physical"] * scale,
            "kpage_physical_no_routing": t["kpage_no_routing"] * scale,
            "kpage_physical_routed": t["kpage_routed"] * scale,
            "kpage_physical_64x256": t["kpage_small_tile"] * scale,
        }
        rec.update(record_ratios(rec))
        if self.head_dim is not None:
            rec["head_dim"] = int(self.head_dim)
        dropped = int(self.counts.dropped().sum())
        if dropped:  # only when some were dropped: records of ordinary workloads stay as they were
            rec["dropped_pairs"] = dropped * scale
        return rec

    def per_head_records(self, multiply_layers: bool = False) -> list[dict]:
        """One flat dict per head: ``head`` plus the pair counts and occupancies."""
        c = self.counts
        scale = self.layers if multiply_layers else 1
        out = []
        for h in range(self.heads):
            useful, bsa, kp = int(c.useful[h]), int(c.bsa_physical[h]), int(c.kpage_physical[h])
            out.append(
                {
                    "workload": self.workload,
                    "head": h,
                    "selected_pairs": int(c.selected_pairs[h]) * scale,
                    "useful_pairs": useful * scale,
                    "bsa_physical": bsa * scale,
                    "kpage_physical": kp * scale,
                    "kpage_physical_no_routing": int(c.kpage_no_routing[h]) * scale,
                    "bsa_occupancy": _ratio(useful, bsa),
                    "kpage_occupancy": _ratio(useful, kp),
                }
            )
        dropped = c.dropped()
        if dropped.any():
            for h, row in enumerate(out):
                row["dropped_pairs"] = int(dropped[h]) * scale
        return out

    def warn_dropped(self, where: str = "") -> None:
        """One :class:`DroppedPairsWarning` when the graphs left selected pairs out."""
        dropped = int(self.counts.dropped().sum())
        if dropped:
            warnings.warn(
                DroppedPairsWarning(
                    f"{where or self.workload}: {dropped:,} selected block pairs touch a block without "
                    "valid rows and were dropped (no query-key pair in them; see 'dropped_pairs')"
                ),
                stacklevel=3,
            )


def analyze_graphs(
    graphs,
    workload: str = "",
    layers: int = 1,
    route="auto",
    head_dim: int | None = None,
    description: str = "",
) -> OccupancyReport:
    """Analyse a list of graphs that together cover the heads of one attention call.

    Warns once (:class:`DroppedPairsWarning`) when the graphs left selected pairs out.
    """
    report = _report(graphs, workload, layers, route, head_dim, description)
    report.warn_dropped()
    return report


def _report(
    graphs, workload="", layers=1, route="auto", head_dim=None, description="", fill=True
) -> OccupancyReport:
    graphs = [graphs] if isinstance(graphs, SparseGraph) else graphs
    try:
        graphs = list(graphs)
    except TypeError:
        raise AnalysisError(f"graphs must be a SparseGraph or a list of them, got {graphs!r}") from None
    if not graphs:
        raise AnalysisError("graphs must hold at least one SparseGraph")
    layers = _check_positive_int("layers", layers)
    if head_dim is not None:
        head_dim = _check_positive_int("head_dim", head_dim)
    route = parse_route(route)
    counts, fills = [], None
    for g in graphs:
        if not isinstance(g, SparseGraph):
            raise AnalysisError(f"graph must be a SparseGraph, got {type(g).__name__}")
        stats = _k_pair_stats(g)
        counts.append(_graph_counts(g, route, *stats))
        if fill:
            fills = _graph_fill(g, *stats) if fills is None else fills + _graph_fill(g, *stats)
    counts = PairCounts.concat(counts)
    name = workload or graphs[0].name
    return OccupancyReport(name, layers, counts, fills, head_dim, description)


def analyze_workload(workload, seed: int = 0, route="auto") -> OccupancyReport:
    """Analyse a :class:`sparseattn.workloads.Workload` (its graphs for ``seed``)."""
    report = _report(
        workload.graphs(seed=seed),
        workload.name,
        getattr(workload, "layers", 1),
        route,
        getattr(workload, "head_dim", None),
        getattr(workload, "description", ""),
    )
    report.warn_dropped(_dropped_where(workload))
    return report


#: Heads per task when a workload is analysed in slices (:func:`analyze_workloads`).
HEADS_PER_SLICE = 4
#: Below this estimated work (token-heads, SVG2 counted 4x) everything runs in the calling process.
PARALLEL_MIN_WORK = 4_000_000


@dataclass(frozen=True)
class _Slice:
    """Heads ``heads`` (None: all, in one piece) of ``workloads[index]``: one task."""

    index: int
    workload: object
    heads: tuple | None
    cost: float


def _slices(workloads: list) -> list[_Slice]:
    from .workloads import Workload  # here: the analysis itself does not depend on workloads

    out = []
    for index, w in enumerate(workloads):
        if not isinstance(w, Workload):  # any object with graphs(seed=...): one piece
            out.append(_Slice(index, w, None, 0.0))
            continue
        per_head = w.num_tokens * (4.0 if w.per_head_layouts else 1.0)
        for lo in range(0, w.heads, HEADS_PER_SLICE):
            heads = tuple(range(lo, min(lo + HEADS_PER_SLICE, w.heads)))
            out.append(_Slice(index, w, heads, per_head * len(heads)))
    return out


def _tasks(slices: list[_Slice], seed: int) -> list[list[int]]:
    """Slice indices grouped into tasks, longest first: slices of workloads that draw the same
    synthetic features (same latent, head dim, seed and heads) share a task and draw them once."""
    groups: dict[tuple, list[int]] = {}
    tasks: list[list[int]] = []
    for i, part in enumerate(slices):
        sel = getattr(part.workload, "selection", None)
        if part.heads is None or getattr(sel, "kind", None) not in ("ssta", "vsa", "svg2"):
            tasks.append([i])
            continue
        w = part.workload
        key = (w.grid, w.head_dim, sel.seed if sel.seed is not None else seed, part.heads)
        if key not in groups:
            groups[key] = []
            tasks.append(groups[key])
        groups[key].append(i)
    return sorted(tasks, key=lambda t: -sum(slices[i].cost for i in t))


def _analyze_slice(part: _Slice, seed: int, route, fill: bool = True) -> tuple[PairCounts, BlockFill | None]:
    w = part.workload
    graphs = w.graphs(seed=seed) if part.heads is None else w.graphs(seed=seed, heads=part.heads, workers=1)
    report = _report(graphs, getattr(w, "name", ""), route=route, fill=fill)
    return report.counts, report.fill


def _analyze_task(task) -> list[tuple[PairCounts, BlockFill | None]]:
    parts, seed, route, fill = task
    with reuse_factors():
        return [_analyze_slice(part, seed, route, fill) for part in parts]


def analyze_workloads(
    workloads,
    seed: int = 0,
    route="auto",
    workers: int | None = 1,
    on_progress: Callable | None = None,
    fill: bool = True,
    cache=None,
) -> list[OccupancyReport]:
    """:func:`analyze_workload` of each workload, in order, on ``workers`` processes.

    Workloads are cut into slices of :data:`HEADS_PER_SLICE` heads; the counts are the same as in
    one piece. ``workers``: 1 (default) runs here; ``None`` uses every core, spawning child
    processes (:func:`sparseattn.parallel.run_tasks`) for large jobs — a script doing so must call
    it under ``if __name__ == "__main__":``, as a spawned child imports the main module.
    ``on_progress(workload, heads_done)`` follows every slice (from any thread). ``fill=False``
    leaves the block-fill histograms out (``report.fill`` is None; the counts do not need them).
    ``cache``: a folder (or True: :func:`sparseattn.countcache.default_dir`) that keeps each slice's
    counts for the next run of the same question (:mod:`sparseattn.countcache`); None computes all.
    """
    from .parallel import run_tasks

    route = parse_route(route)
    workloads = list(workloads)
    slices = _slices(workloads)
    by_slice, keys, folder = {}, {}, None
    if cache is not None and cache is not False:
        from . import countcache

        folder = countcache.default_dir() if cache is True else Path(cache)
        for i, part in enumerate(slices):
            key = countcache.slice_key(part.workload, part.heads, seed, route, fill)
            hit = countcache.load(folder, key) if key is not None else None
            if hit is not None and (hit[1] is not None or not fill):
                by_slice[i] = hit
            elif key is not None:
                keys[i] = key
    todo = [i for i in range(len(slices)) if i not in by_slice]
    tasks = [[todo[j] for j in t] for t in _tasks([slices[i] for i in todo], seed)]
    if sum(slices[i].cost for i in todo) < PARALLEL_MIN_WORK:
        workers = 1
    done_heads = [0] * len(workloads)
    lock = threading.Lock()

    def slice_done(i: int) -> None:
        part = slices[i]
        with lock:
            w = workloads[part.index]
            done_heads[part.index] += len(part.heads) if part.heads else getattr(w, "heads", 1)
            heads_done = done_heads[part.index]
        if on_progress is not None:
            on_progress(w, heads_done)

    for i in sorted(by_slice):
        slice_done(i)
    results = run_tasks(
        _analyze_task,
        [([slices[i] for i in t], seed, route, fill) for t in tasks],
        workers=workers,
        on_done=lambda t: [slice_done(i) for i in tasks[t]],
    )
    computed = {i: result for t, task_results in zip(tasks, results) for i, result in zip(t, task_results)}
    if folder is not None:
        _save_slices(folder, {keys[i]: computed[i] for i in computed if i in keys})
    by_slice.update(computed)
    reports = []
    for index, w in enumerate(workloads):
        parts = [by_slice[i] for i, s in enumerate(slices) if s.index == index]
        fills = parts[0][1]
        for _, f in parts[1:]:
            fills = None if fills is None or f is None else fills + f
        report = OccupancyReport(
            w.name,
            int(getattr(w, "layers", 1)),
            PairCounts.concat([c for c, _ in parts]),
            fills,
            getattr(w, "head_dim", None),
            getattr(w, "description", ""),
        )
        report.warn_dropped(_dropped_where(w))
        reports.append(report)
    return reports


def _save_slices(folder, entries: dict) -> None:
    """Store computed slices in the count cache; a cache that cannot be written only warns."""
    from . import countcache

    try:
        for key, (counts, fill) in entries.items():
            countcache.save(folder, key, counts, fill)
    except OSError as err:
        warnings.warn(f"count cache {folder}: not written ({err})", stacklevel=3)


def _dropped_where(workload) -> str:
    """Where dropped pairs come from: a layout file's block list, or the workload's name."""
    selection = getattr(workload, "selection", None)
    if getattr(selection, "kind", None) == "blocks" and getattr(workload, "source", ""):
        return f"{workload.source}: field 'selection.blocks'"
    return getattr(workload, "name", "")


def record_ratios(rec: dict) -> dict:
    """Occupancies and ratios of a record's pair counts (the same for a workload and for the TOTAL line)."""
    return dict(
        bsa_occupancy=_ratio(rec["useful_pairs"], rec["bsa_physical"]),
        kpage_occupancy=_ratio(rec["useful_pairs"], rec["kpage_physical"]),
        kpage_no_routing_occupancy=_ratio(rec["useful_pairs"], rec["kpage_physical_no_routing"]),
        bsa_over_kpage=_ratio(rec["bsa_physical"], rec["kpage_physical"]),
        routing_gain=_ratio(rec["kpage_physical_no_routing"], rec["kpage_physical_routed"]),
    )


def total_record(reports: list[OccupancyReport], multiply_layers: bool = False) -> dict:
    """The TOTAL line: pair counts summed over workloads, occupancies of the sums."""
    recs = [r.record(multiply_layers) for r in reports]
    keys = (
        "selected_pairs",
        "useful_pairs",
        "bsa_physical",
        "kpage_physical",
        "kpage_physical_no_routing",
        "kpage_physical_routed",
        "kpage_physical_64x256",
    )
    tot = {k: sum(r[k] for r in recs) for k in keys}
    out = {"workload": "TOTAL", "heads": sum(r["heads"] for r in recs)}
    out.update(tot)
    out.update(record_ratios(out))
    if any("dropped_pairs" in r for r in recs):
        out["dropped_pairs"] = sum(r.get("dropped_pairs", 0) for r in recs)
    return out
