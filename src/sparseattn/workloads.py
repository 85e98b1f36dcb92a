"""Workloads: a latent layout plus a sparse selection, and the six built-in public configurations.

A :class:`Workload` is what the analysis and benchmarks consume: ``heads``/``layers``/``head_dim``
of the model, the latent ``grid`` cut into ``tile``\\ s of ``block_size`` slots, and a
:class:`Selection`. ``Workload.graphs(seed)`` always returns a list of graphs that together cover all
heads: one graph for layouts shared by every head, one single-head graph per head for SVG2 (whose
k-means partitions differ per head).

Users define their own workloads in Python (construct :class:`Workload`; invalid fields raise
:class:`WorkloadError` naming the field) or in a JSON/YAML file (:mod:`sparseattn.layout_file`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import numpy as np

from .builders import (
    BuilderError,
    block_list_graph,
    check_window,
    head_ids,
    random_graph,
    ssta_graph,
    sta_graph,
    svg2_graph,
    vsa_graph,
)
from .graph import SparseGraph
from .layouts import PADDING_MODES, BlockLayout, LayoutError, VideoGrid, check_block_size, video_layout
from .limits import (
    FEATURE_BYTES_PER_TOKEN,
    GRAPH_BYTES_PER_PAIR,
    LAYOUT_BYTES_PER_TOKEN,
    RESULT_BYTES_PER_HEAD,
    memory_problem,
)

SELECTION_KINDS = ("sta", "ssta", "vsa", "svg2", "random", "blocks")

#: Parameters each selection kind needs (``None`` = required, else the default).
SELECTION_PARAMS = {
    "sta": {"window": None, "clamp": True},
    "ssta": {"window": None, "topk": None, "clamp": True},
    "vsa": {"topk": None},
    "svg2": {"q_clusters": 300, "k_clusters": 1000, "top_p": 0.9, "min_fraction": 0.1},
    "random": {"density": None},
    "blocks": {"blocks": None},
}
#: Fields of :class:`Selection` every kind accepts.
COMMON_SELECTION_PARAMS = ("kind", "seed")


class WorkloadError(ValueError):
    """An invalid workload field; ``field`` names it (e.g. ``"tile"`` or ``"selection.window"``)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"field '{field}': {message}")
        self.field = field
        self.detail = message

    def __reduce__(self):
        return type(self), (self.field, self.detail)


@dataclass(frozen=True)
class Selection:
    """Which block pairs a workload computes.

    kind: ``sta`` (sliding tile ``window``), ``ssta`` (``window`` ∪ per-head ``topk`` tiles),
    ``vsa`` (``topk`` K blocks per Q block), ``svg2`` (``q_clusters``/``k_clusters`` k-means,
    cumulative ``top_p``, at least ``min_fraction`` of K clusters), ``random`` (``density``),
    ``blocks`` (explicit ``blocks``: rows (head, q_block, k_block) or per-head lists).
    ``seed``, when set, pins the seed of data-dependent kinds (overrides ``build(seed=...)``).
    """

    kind: str
    window: tuple | None = None
    topk: int | None = None
    clamp: bool = True
    q_clusters: int | None = None
    k_clusters: int | None = None
    top_p: float | None = None
    min_fraction: float | None = None
    density: float | None = None
    blocks: tuple | None = field(default=None, repr=False)
    seed: int | None = None

    def __str__(self) -> str:
        win = ""
        if self.window is not None:
            w = np.asarray(self.window).reshape(-1, 3)
            win = "×".join(str(v) for v in w[0]) + (" (per head)" if len(w) > 1 else "")
        if self.kind == "sta":
            return f"STA window {win} tiles"
        if self.kind == "ssta":
            return f"SSTA window {win} ∪ top-{self.topk} tiles"
        if self.kind == "vsa":
            return f"VSA top-{self.topk} blocks"
        if self.kind == "svg2":
            return (
                f"SVG2 k-means Q {self.q_clusters} / K {self.k_clusters} clusters, top-p {self.top_p}, "
                f"≥ {self.min_fraction:.0%} of K clusters"
            )
        if self.kind == "random":
            return f"random, density {self.density}"
        return "explicit block list"


def _freeze(value):
    if isinstance(value, (list, tuple, np.ndarray)):
        return tuple(_freeze(v) for v in value)
    return value


@dataclass(frozen=True)
class Workload:
    """A model's attention call: layout, selection, and the sizes used to aggregate counts.

    Attributes:
        name, description: identification for reports.
        heads, layers, head_dim: the model's attention heads per layer, layers, and head dimension.
        grid: latent ``(T, H, W)``; tokens in raster order.
        tile: ``(t, h, w)`` tile (None for ``svg2``, whose blocks come from k-means clusters).
        block_size: slots per logical block; padding: ``prefix`` or ``inplace`` (see layouts).
        selection: the :class:`Selection`.
        source: where the numbers come from.
    """

    name: str
    description: str
    heads: int
    layers: int
    head_dim: int
    grid: tuple
    tile: tuple | None
    selection: Selection
    block_size: int = 128
    padding: str = "prefix"
    source: str = ""

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise WorkloadError("name", f"must be a non-empty string, got {self.name!r}")
        if not isinstance(self.description, str):
            raise WorkloadError("description", f"must be a string, got {self.description!r}")
        for label in ("heads", "layers", "head_dim"):
            value = getattr(self, label)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise WorkloadError(label, f"must be a positive integer, got {value!r}")
        object.__setattr__(self, "grid", _triple("grid", self.grid))
        sel = self.selection
        if not isinstance(sel, Selection):
            raise WorkloadError("selection", f"must be a Selection, got {type(sel).__name__}")
        if sel.kind not in SELECTION_KINDS:
            raise WorkloadError(
                "selection.kind", f"must be one of {', '.join(SELECTION_KINDS)}, got {sel.kind!r}"
            )
        if self.tile is None:
            if sel.kind != "svg2":
                raise WorkloadError("tile", f"is required for selection kind '{sel.kind}'")
        else:
            tile = _triple("tile", self.tile)
            for axis, (t, g) in enumerate(zip(tile, self.grid)):
                if t > g:
                    raise WorkloadError("tile", f"tile[{axis}]={t} is larger than grid[{axis}]={g}")
            object.__setattr__(self, "tile", tile)
        try:
            check_block_size("block_size", self.block_size)
        except LayoutError as err:
            raise WorkloadError("block_size", str(err).removeprefix("block_size ")) from None
        if not isinstance(self.padding, str) or self.padding not in PADDING_MODES:
            raise WorkloadError("padding", f"must be one of {', '.join(PADDING_MODES)}, got {self.padding!r}")
        self._check_layout_memory()
        object.__setattr__(self, "selection", self._checked_selection(sel))
        self.check_memory(1)

    # --- memory estimates (checked before anything large is allocated) ----------------------------
    def _slots(self, clusters: int = 0) -> int:
        """Slots of the Q (= K) layout; for SVG2 an upper bound with ``clusters`` padded clusters."""
        if self.tile is None:
            return self.num_tokens + clusters * self.block_size
        vg = VideoGrid(self.grid, self.tile)
        return vg.num_tiles * -(-vg.tile_volume // self.block_size) * self.block_size

    def _check_layout_memory(self) -> None:
        layout = LAYOUT_BYTES_PER_TOKEN * self._slots()
        results = RESULT_BYTES_PER_HEAD * self.heads
        what = f"a workload of {self.num_tokens:,} tokens × {self.heads:,} heads"
        problem = memory_problem(layout + results, what)
        if problem:
            raise WorkloadError("heads" if results > layout else "grid", problem)

    def memory_estimate(self, heads: int | None = None) -> int:
        """Rough peak bytes of building (and analysing) ``heads`` heads at once (default: all)."""
        sel = self.selection
        heads = self.heads if heads is None else int(heads)
        slots = self._slots(max(sel.q_clusters or 0, sel.k_clusters or 0))
        nb = slots // self.block_size
        per_head = transient = 0  # bytes kept per head; bytes per head being scored
        if sel.kind in ("sta", "ssta"):
            vg = VideoGrid(self.grid, self.tile)
            per_tile = -(-vg.tile_volume // self.block_size)
            window = int(np.prod(np.asarray(sel.window).reshape(-1, 3), axis=1).max())
            extra = sel.topk if sel.kind == "ssta" else 0
            per_head = GRAPH_BYTES_PER_PAIR * vg.num_tiles * min(window + extra, vg.num_tiles) * per_tile**2
            if sel.kind == "ssta":
                per_head += vg.num_tiles**2  # the dense tile mask of each head
                transient = FEATURE_BYTES_PER_TOKEN * self.num_tokens + 8 * vg.num_tiles**2
        elif sel.kind == "vsa":
            per_head = GRAPH_BYTES_PER_PAIR * nb * min(sel.topk, nb)
            transient = FEATURE_BYTES_PER_TOKEN * self.num_tokens + 16 * nb**2
        elif sel.kind == "random":
            per_head = GRAPH_BYTES_PER_PAIR * nb * max(1, round(sel.density * nb))
            transient = 24 * nb**2
        elif sel.kind == "svg2":
            q_blocks = -(-self.num_tokens // self.block_size) + sel.q_clusters
            k_blocks = -(-self.num_tokens // self.block_size) + sel.k_clusters
            per_head = GRAPH_BYTES_PER_PAIR * q_blocks * k_blocks + 40 * self.num_tokens
            transient = FEATURE_BYTES_PER_TOKEN * self.num_tokens
        else:
            per_head = GRAPH_BYTES_PER_PAIR * len(sel.blocks)
        concurrent = min(heads, os.cpu_count() or 1)
        layout = LAYOUT_BYTES_PER_TOKEN * slots
        return layout + heads * per_head + concurrent * transient + RESULT_BYTES_PER_HEAD * self.heads

    def check_memory(self, heads: int | None = None) -> None:
        """Raise :class:`WorkloadError` when building ``heads`` heads at once would not fit in memory."""
        heads = self.heads if heads is None else int(heads)
        problem = memory_problem(self.memory_estimate(heads), f"building {heads:,} heads of '{self.name}'")
        if problem is None:
            return
        if heads > 1 and memory_problem(self.memory_estimate(1), "") is None:
            raise WorkloadError("heads", problem + "; build fewer heads at a time (graphs(heads=[...]))")
        field = {"sta": "window", "ssta": "topk", "vsa": "topk", "random": "density", "blocks": "blocks"}
        kind = self.selection.kind
        raise WorkloadError(f"selection.{field[kind]}" if kind in field else "grid", problem)

    # --- validation of the selection against the layout -------------------------------------------
    def _checked_selection(self, sel: Selection) -> Selection:
        params = SELECTION_PARAMS[sel.kind]
        values = {}
        for key, default in params.items():
            value = getattr(sel, key)
            if value is None:
                if default is None:
                    raise WorkloadError(f"selection.{key}", f"is required for selection kind '{sel.kind}'")
                value = default
            values[key] = value
        for key in (
            "window",
            "topk",
            "q_clusters",
            "k_clusters",
            "top_p",
            "min_fraction",
            "density",
            "blocks",
        ):
            if key not in params and getattr(sel, key) is not None:
                raise WorkloadError(f"selection.{key}", f"does not apply to selection kind '{sel.kind}'")
        if sel.seed is not None and (
            isinstance(sel.seed, bool) or not isinstance(sel.seed, (int, np.integer)) or sel.seed < 0
        ):
            raise WorkloadError("selection.seed", f"must be a non-negative integer, got {sel.seed!r}")
        if "window" in values:
            try:
                win = check_window(
                    values["window"], VideoGrid(self.grid, self.tile).tiles_per_axis, self.heads
                )
            except BuilderError as err:
                raise WorkloadError("selection.window", str(err)) from None
            values["window"] = tuple(win[0]) if win.shape[0] == 1 else tuple(map(tuple, win))
        for key in ("topk", "q_clusters", "k_clusters"):
            if key in values:
                v = values[key]
                if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
                    raise WorkloadError(f"selection.{key}", f"must be a positive integer, got {v!r}")
        for key in ("q_clusters", "k_clusters"):
            if key in values and values[key] > self.num_tokens:
                raise WorkloadError(
                    f"selection.{key}", f"{values[key]} clusters exceed the {self.num_tokens} tokens"
                )
        for key, low_open in (("top_p", True), ("density", True), ("min_fraction", False)):
            if key in values:
                v = values[key]
                ok = (
                    isinstance(v, (int, float, np.number))
                    and not isinstance(v, bool)
                    and (0 < v <= 1 if low_open else 0 <= v <= 1)
                )
                if not ok:
                    raise WorkloadError(
                        f"selection.{key}", f"must be in {'(0, 1]' if low_open else '[0, 1]'}, got {v!r}"
                    )
        if "clamp" in values and not isinstance(values["clamp"], (bool, np.bool_)):
            raise WorkloadError("selection.clamp", f"must be true or false, got {values['clamp']!r}")
        if "blocks" in values:
            values["blocks"] = _freeze(values["blocks"])
            try:
                self._build_blocks(values["blocks"], self.heads)
            except BuilderError as err:
                raise WorkloadError("selection.blocks", str(err).removeprefix("blocks: ")) from None
        return Selection(kind=sel.kind, seed=sel.seed, **values)

    # --- sizes and layouts ------------------------------------------------------------------------
    @property
    def latent(self) -> tuple:
        return self.grid

    @property
    def num_tokens(self) -> int:
        return int(np.prod(self.grid))

    @property
    def per_head_layouts(self) -> bool:
        """True when Q/K partitions differ per head (SVG2): ``graphs()`` gives one graph per head."""
        return self.selection.kind == "svg2"

    def layout(self) -> BlockLayout:
        """The Q (= K) layout shared by all heads."""
        if self.tile is None:
            raise WorkloadError(
                "tile", f"workload '{self.name}' has per-head k-means partitions, no shared layout"
            )
        return video_layout(self.grid, self.tile, self.block_size, self.padding, name=f"{self.name} layout")

    # --- graphs -----------------------------------------------------------------------------------
    def _build_blocks(self, blocks, heads: int) -> SparseGraph:
        layout = self.layout()
        return block_list_graph(layout, layout, blocks, heads=heads, name=self.name)

    def build(
        self, seed: int = 0, heads=None, q=None, k=None, workers: int | None = None
    ) -> SparseGraph | list[SparseGraph]:
        """The workload's sparse graph for ``heads`` (default: all heads).

        ``heads`` is a count (heads ``0..heads-1``) or a list of head ids; head ``h`` is the same
        whichever other heads are built, so a workload can be built in slices. Returns one
        :class:`SparseGraph` (layouts shared by all heads), or for ``svg2`` a list of single-head
        graphs (one per head). ``q``/``k`` (float ``[heads, tokens, d]``, raster token order) replace
        the synthetic features of data-dependent selections. ``workers``: threads over heads.
        """
        sel = self.selection
        seed = int(sel.seed if sel.seed is not None else seed)
        if heads is None:
            heads = self.heads if q is None else int(np.shape(q)[0])
        try:
            ids = head_ids(heads)
        except BuilderError as err:
            raise WorkloadError("heads", str(err).removeprefix("heads ")) from None
        fixed_heads = sel.kind == "blocks" or (sel.window is not None and np.ndim(sel.window) == 2)
        if fixed_heads and ids.max() >= self.heads:
            raise WorkloadError(
                "heads", f"the selection defines {self.heads} heads, asked for head {int(ids.max())}"
            )
        self.check_memory(ids.size)
        ids = ids.tolist()
        video = {"grid": self.grid, "tile": self.tile, "block_size": self.block_size, "padding": self.padding}
        data = {"q": q, "k": k, "head_dim": self.head_dim, "seed": seed, "workers": workers}
        if sel.kind == "sta":
            return sta_graph(window=sel.window, heads=ids, clamp=sel.clamp, name=self.name, **video)
        if sel.kind == "ssta":
            return ssta_graph(
                window=sel.window, topk=sel.topk, heads=ids, clamp=sel.clamp, name=self.name, **video, **data
            )
        if sel.kind == "vsa":
            return vsa_graph(topk=sel.topk, heads=ids, name=self.name, **video, **data)
        if sel.kind == "svg2":
            return svg2_graph(
                self.grid,
                heads=ids,
                q_clusters=sel.q_clusters,
                k_clusters=sel.k_clusters,
                top_p=sel.top_p,
                min_fraction=sel.min_fraction,
                block_size=self.block_size,
                name=self.name,
                **data,
            )
        layout = self.layout()
        if sel.kind == "random":
            return random_graph(layout, layout, ids, sel.density, seed=seed, name=self.name)
        graph = self._build_blocks(sel.blocks, self.heads)
        return graph if ids == list(range(self.heads)) else graph.select_heads(ids)

    def graphs(
        self, seed: int = 0, heads=None, q=None, k=None, workers: int | None = None
    ) -> list[SparseGraph]:
        """Always a list of graphs that together cover the heads asked for (one graph, or one per head)."""
        built = self.build(seed=seed, heads=heads, q=q, k=k, workers=workers)
        return built if isinstance(built, list) else [built]

    def summary(self) -> dict:
        return {
            "name": self.name,
            "latent": self.grid,
            "tile": self.tile,
            "block_size": self.block_size,
            "padding": self.padding,
            "heads": self.heads,
            "layers": self.layers,
            "head_dim": self.head_dim,
            "selection": str(self.selection),
            "description": self.description,
            "source": self.source,
        }


def _triple(label: str, value) -> tuple[int, int, int]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 3:
        raise WorkloadError(label, f"must be three positive integers (t, h, w), got {value!r}")
    out = []
    for axis, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise WorkloadError(label, f"{label}[{axis}] must be an integer, got {v!r}")
        if v <= 0:
            raise WorkloadError(label, f"{label}[{axis}]={v} must be positive")
        out.append(int(v))
    return tuple(out)  # type: ignore[return-value]


# --- the six built-in workloads (public model configurations) -------------------------------------------
# Wan2.1-T2V-14B: 40 transformer blocks, hidden 5120 = 40 heads x 128 (Wan2.1 config: dim 5120, num_heads 40,
# num_layers 40). VAE 4x temporal / 8x spatial compression and 1x2x2 patches: 81 frames 1280x720 ->
# 21 x 45 x 80 = 75,600 tokens; 832x480 -> 21 x 30 x 52 = 32,760; 69 frames 1280x768 -> 18 x 48 x 80.
WAN14B = {"heads": 40, "layers": 40, "head_dim": 128}
# HunyuanVideo (13B): 20 dual-stream + 40 single-stream blocks = 60 attention layers, hidden 3072 = 24 heads x 128.
# 117 frames 1280x768 -> 30 x 48 x 80 (the STA paper's setting; its kernel requires this latent).
HUNYUAN = {"heads": 24, "layers": 60, "head_dim": 128}
# HunyuanVideo-1.5 (8.3B): hidden 2048 = 16 heads x 128; 54 transformer blocks per its public config
# (heads and head_dim are certain; the block count is the documented 54). 16x spatial VAE:
# 121 frames 1280x720 -> 31 x 45 x 80 = 111,600 tokens.
HUNYUAN15 = {"heads": 16, "layers": 54, "head_dim": 128}

WAN_720P = (21, 45, 80)
WAN_480P = (21, 30, 52)


def _vsa_topk(grid, cube=(4, 4, 4), fraction=0.1) -> int:
    """VSA keeps ceil(fraction x number of cubes) K cubes per Q cube (its 90 % sparsity setting)."""
    cubes = math.prod(-(-g // c) for g, c in zip(grid, cube))
    return math.ceil(fraction * cubes)


_BUILTINS = [
    Workload(
        name="vsa_wan14b_720p",
        description="VSA on Wan2.1-14B 720p: 4x4x4 cubes (B=64, 1440 cubes, partial at the T and H edges), "
        "top-144 K cubes per Q cube from block-mean scores",
        grid=WAN_720P,
        tile=(4, 4, 4),
        block_size=64,
        selection=Selection("vsa", topk=_vsa_topk(WAN_720P)),  # ceil(0.1 * 1440) = 144
        source="VSA (Video Sparse Attention, FastVideo): 4x4x4 cubes, top-k = 10 % of cubes; Wan2.1 config",
        **WAN14B,
    ),
    Workload(
        name="vsa_wan14b_480p",
        description="VSA on Wan2.1-14B 480p: 4x4x4 cubes (B=64, 624 cubes), top-63 from block-mean scores",
        grid=WAN_480P,
        tile=(4, 4, 4),
        block_size=64,
        selection=Selection("vsa", topk=_vsa_topk(WAN_480P)),  # ceil(0.1 * 624) = 63
        source="VSA: 4x4x4 cubes, top-k = 10 % of cubes; Wan2.1 config",
        **WAN14B,
    ),
    Workload(
        name="ssta_hy15_720p",
        description="SSTA on HunyuanVideo-1.5 720p 121f: 6x8x8 tiles (3 blocks of 128; 31x45x80 pads to "
        "36x48x80), 3x3x3-tile window ∪ per-head top-32 tiles by tile-mean score",
        grid=(31, 45, 80),
        tile=(6, 8, 8),
        block_size=128,
        selection=Selection("ssta", window=(3, 3, 3), topk=32),
        source="HunyuanVideo-1.5 SSTA (selective and sliding tile attention): 6x8x8 tiles, window 3x3x3, top-k 32",
        **HUNYUAN15,
    ),
    Workload(
        name="sta_hunyuan_117f",
        description="STA on HunyuanVideo 117f 768x1280 (30x48x80): 6x8x8 tiles, window 3x3x5 tiles (18x24x40 "
        "tokens), centres clamped inward; no partial tiles",
        grid=(30, 48, 80),
        tile=(6, 8, 8),
        block_size=128,
        # (3, 3, 5) tiles = the (18, 24, 40)-token window, one of the candidates of STA's window calibration
        # for HunyuanVideo (tile 6x8x8 over the 5x6x10 tile grid).
        selection=Selection("sta", window=(3, 3, 5)),
        source="STA (Sliding Tile Attention, arXiv 2502.04507): tile 6x8x8; window candidate (18,24,40) tokens",
        **HUNYUAN,
    ),
    Workload(
        name="sta_wan14b_69f",
        description="STA on Wan2.1-14B 69f 768x1280 (18x48x80): 6x8x8 tiles, window 3x3x3 tiles, centres "
        "clamped inward; no partial tiles",
        grid=(18, 48, 80),
        tile=(6, 8, 8),
        block_size=128,
        selection=Selection("sta", window=(3, 3, 3)),  # FastVideo STA's documented example window (3, 3, 3)
        source="STA in FastVideo: Wan2.1 69x768x1280 setting, window (3, 3, 3) tiles",
        **WAN14B,
    ),
    Workload(
        name="svg2_wan14b_720p",
        description="SVG2 on Wan2.1-14B 720p: per-head k-means, Q 300 / K 1000 clusters (independent "
        "partitions, B=128), centroid scores weighted by K-cluster size, top-p 0.9, ≥ 10 % of K kept",
        grid=WAN_720P,
        tile=None,
        block_size=128,
        selection=Selection("svg2", q_clusters=300, k_clusters=1000, top_p=0.9, min_fraction=0.1),
        source="Sparse VideoGen2 (semantic-aware permutation): QC=300, KC=1000, top-p 0.9",
        **WAN14B,
    ),
]

#: The built-in workloads by name.
WORKLOADS: dict[str, Workload] = {w.name: w for w in _BUILTINS}


def get_workload(name: str) -> Workload:
    """The built-in workload ``name``; unknown names raise a KeyError listing the valid ones."""
    try:
        return WORKLOADS[name]
    except (KeyError, TypeError):
        raise UnknownWorkloadError(name) from None


class UnknownWorkloadError(KeyError, ValueError):
    """No built-in workload of that name."""

    def __init__(self, name):
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return f"unknown workload {self.name!r}; valid names: {', '.join(WORKLOADS)}"
