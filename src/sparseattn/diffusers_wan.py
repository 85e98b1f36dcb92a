"""Block-sparse self-attention inside diffusers' Wan transformer (``WanTransformer3DModel``).

>>> from sparseattn.diffusers_wan import WanSelection, install_sparse_attention
>>> install_sparse_attention(transformer, grid=(frames, height // 2, width // 2),
...                          selection=WanSelection.sta(tile=(4, 4, 4), window=(3, 3, 3)))

After this, every block's self-attention (``attn1``) runs exact sparse attention of the selection
over the latent's token grid. ``grid`` is the token grid after Wan's (1, 2, 2) patching. Cross-attention
(``attn2``) keeps diffusers' processor.

* ``backend="kpage"`` runs :func:`sparseattn.torch.kpage_attention` (bf16, CUDA, with autograd). The
  tokens are scattered into the layout's slot order (tile-major, padded tiles) and gathered back.
* ``backend="masked_sdpa"`` runs ``torch.nn.functional.scaled_dot_product_attention`` with the
  selection's boolean token mask. It is the same sparse graph on any device, and it is what the KPage
  op is checked against.

Selections (:class:`WanSelection`):

* ``sta``: a sliding window of tiles, the same for every head, built once per grid;
* ``vsa``: per head and Q cube, the ``topk`` K cubes of highest mean(q)·mean(k). It is computed from
  each call's rotated Q and K, per batch entry, on their device (:func:`sparseattn.torch.vsa_topk`); the
  KPage backend then plans on the GPU (:func:`sparseattn.torch.block_sparse_attention`): no host round
  trip, so a step can be captured in a CUDA graph;
* ``svg2``: SVG2's semantic-aware permutation: per call and head, k-means of the Q and of the K tokens
  (warm-started from the same layer's previous centroids), the top-p cluster pairs by cluster-size-weighted
  centroid scores (:mod:`sparseattn.svg2_device`, on the tensors' device); masked SDPA, or KPage on the
  per-row layouts of each call's clusters (:mod:`sparseattn.planning.dynamic_layouts`, forward and
  backward planned on the device);
* ``full``: every block pair (dense attention through the sparse path, for checks).

Needs ``torch`` and ``diffusers`` (``pip install -e '.[diffusers]'``), both imported on first use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from .builders import sta_graph, vsa_graph
from .graph import SparseGraph
from .layouts import tile_major_permutation, tile_major_tokens, video_layout

BACKENDS = ("kpage", "masked_sdpa")
#: How the KPage backend plans an SVG2 call (:func:`svg2_plan`).
SVG2_PLANS = ("blocks", "clusters")


@dataclass(frozen=True)
class WanSelection:
    """Which block pairs self-attention keeps (see the module docstring)."""

    kind: str
    tile: tuple[int, int, int]
    window: tuple[int, int, int] | None = None
    topk: int | None = None
    block_size: int | None = None
    #: SVG2: (q_clusters, k_clusters, top_p, min_fraction, Lloyd iterations per call)
    clusters: tuple | None = None

    @classmethod
    def sta(cls, tile=(4, 4, 4), window=(3, 3, 3), block_size=None) -> WanSelection:
        return cls("sta", tuple(tile), window=tuple(window), block_size=block_size)

    @classmethod
    def vsa(cls, tile=(4, 4, 4), topk: int = 8, block_size=None) -> WanSelection:
        return cls("vsa", tuple(tile), topk=int(topk), block_size=block_size)

    @classmethod
    def full(cls, tile=(4, 4, 4), block_size=None) -> WanSelection:
        return cls("full", tuple(tile), block_size=block_size)

    @classmethod
    def svg2(
        cls,
        q_clusters=300,
        k_clusters=1000,
        top_p=0.9,
        min_fraction=0.1,
        iters=2,
        block_size=128,
        init_iters=50,
    ) -> WanSelection:
        """SVG2: per call, k-means of each head's Q and K tokens (``iters`` Lloyd steps warm-started from
        the same layer's previous centroids; a layer's first call seeds k-means++ and runs ``init_iters``
        steps: SVG2's ``kmeans_iter_step`` and ``kmeans_iter_init``, 2 and 50 in its released
        configurations; the labels are the last step's assignment, as SVG2's own k-means returns them),
        the top-``top_p`` cluster pairs (at least ``min_fraction`` of the K clusters) by
        cluster-size-weighted centroid scores; clusters padded to ``block_size``."""
        spec = (
            int(q_clusters),
            int(k_clusters),
            float(top_p),
            float(min_fraction),
            int(iters),
            int(init_iters),
        )
        return cls("svg2", (1, 1, 1), clusters=spec, block_size=block_size)

    def __post_init__(self):
        if self.kind not in ("sta", "vsa", "full", "svg2"):
            raise ValueError(f"selection kind must be 'sta', 'vsa', 'full' or 'svg2', got {self.kind!r}")
        if self.kind == "svg2":
            qc, kc, top_p, min_fraction, iters, init_iters = self.clusters
            if min(qc, kc, iters, init_iters) < 1 or not 0 < top_p <= 1 or not 0 <= min_fraction <= 1:
                raise ValueError(
                    "an 'svg2' selection needs q_clusters, k_clusters, iters, init_iters >= 1, 0 < top_p <= 1 "
                    f"and 0 <= min_fraction <= 1, got {self.clusters!r}"
                )
        if self.kind == "sta" and self.window is None:
            raise ValueError("an 'sta' selection needs a window (tiles per axis)")
        if self.kind == "vsa" and (self.topk is None or self.topk < 1):
            raise ValueError(f"a 'vsa' selection needs topk >= 1, got {self.topk!r}")

    @property
    def dynamic(self) -> bool:
        """True when the graph depends on each call's Q and K (VSA, SVG2)."""
        return self.kind in ("vsa", "svg2")

    def blocks(self) -> int:
        """Block size of the layout: the selection's, else 64 for tiles of at most 64 tokens, else 128."""
        if self.block_size is not None:
            return int(self.block_size)
        return 64 if int(np.prod(self.tile)) <= 64 else 128

    def graph(self, grid, heads: int, q=None, k=None) -> SparseGraph:
        """The graph over ``grid``: static kinds from the grid alone, VSA from ``q``, ``k`` ``[heads, tokens, d]``
        (numpy, raster token order)."""
        grid = tuple(int(x) for x in grid)
        if self.kind == "sta":
            return sta_graph(
                grid, self.tile, self.window, heads=heads, block_size=self.blocks(), name="wan sta"
            )
        if self.kind == "svg2":
            raise ValueError(
                "an 'svg2' selection has per-head layouts made per call: WanSparseAttnProcessor.svg2_step"
            )
        if self.kind == "vsa":
            return vsa_graph(grid, self.tile, self.topk, heads=heads, block_size=self.blocks(), q=q, k=k)
        layout = video_layout(grid, self.tile, self.blocks())
        mask = np.ones((heads, layout.num_blocks, layout.num_blocks), dtype=bool)
        return SparseGraph.from_block_mask(layout, layout, mask, name="wan full")


def token_mask(graph: SparseGraph) -> np.ndarray:
    """bool ``[heads, tokens, tokens]`` in raster token order: which (query, key) pairs the graph keeps."""
    q_block = graph.q.token_slot // graph.q.block_size
    k_block = graph.k.token_slot // graph.k.block_size
    return graph.block_mask()[:, q_block][:, :, k_block]


def apply_rotary(x, freqs_cos, freqs_sin):
    """Wan's rotary embedding on ``x`` ``[B, L, heads, d]``: pairs (2i, 2i+1) rotated by the frequencies."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = x.new_empty(x.shape)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def token_order_default():
    """The ``token_order`` of KPage processors built without one: ``"qo"`` (the default: forward calls run
    the Q/O token build, q and o in token order, k and v moved to slots; bit for bit the slot order's output,
    and faster than it with its moves, NOTES_kpage_fwd.md); ``SPARSEATTN_TOKEN_ORDER=1``: the token-order
    build (no moves; slower than either); ``SPARSEATTN_TOKEN_ORDER=0``: slot order with its moves.
    (``"tiles"``, the model's tokens kept tile-major, is chosen at :func:`install_sparse_attention`.)"""
    value = os.environ.get("SPARSEATTN_TOKEN_ORDER", "qo")
    if value not in ("qo", "1", "0"):
        raise ValueError(f"SPARSEATTN_TOKEN_ORDER must be 'qo', '1' or '0', got {value!r}")
    return "qo" if value == "qo" else value == "1"


def svg2_plan():
    """How the KPage backend plans an SVG2 call, from ``SPARSEATTN_SVG2_PLAN``: ``"clusters"`` (the default)
    one forward page stream per Q cluster and the backward's plan by groups, from the cluster mask
    (:func:`sparseattn.torch.per_row_cluster_attention`); ``"blocks"`` from the ``[rows, q_blocks,
    k_blocks]`` block mask. Both plan the same steps. At SVG2's 720p call (H100, the host ahead) the
    forward's plan takes 0.81 ms by clusters against 1.63 by blocks, the backward's 1.05 against 1.53
    (``data/bench/svg2_step_h100_20261207_676ec32.json``)."""
    value = os.environ.get("SPARSEATTN_SVG2_PLAN") or "clusters"
    if value not in SVG2_PLANS:
        raise ValueError(f"SPARSEATTN_SVG2_PLAN must be one of {SVG2_PLANS}, got {value!r}")
    return value


def slot_tokens(token_slot, slots: int):
    """int32 ``[rows, slots]``: the token each slot of each row holds, -1 where none does; ``token_slot``:
    int ``[rows, tokens]``, each token's slot in its row (a device layout's ``token_slot``)."""
    import torch

    rows, n = token_slot.shape
    out = torch.full((rows, slots), -1, dtype=torch.int32, device=token_slot.device)
    tokens = torch.arange(n, dtype=torch.int32, device=token_slot.device).expand(rows, n)
    return out.scatter_(1, token_slot.long(), tokens)


class WanSparseAttnProcessor:
    """A diffusers attention processor for Wan's self-attention: exact block-sparse attention of a
    :class:`WanSelection` over a token ``grid`` (cross-attention and masked calls go to diffusers').

    ``token_order`` (KPage): ``True``: calls without gradients run the KPage forward's token-order build on
    the model's token-ordered q, k, v, with no move into or out of slot order
    (:func:`sparseattn.torch.token_order_attention` and VSA's :func:`~sparseattn.torch.vsa_topk_tokens`;
    SVG2 with a map per (batch, head) row of its per-call layouts); ``"qo"`` (the default,
    :func:`token_order_default`): static and VSA selections move only k and v to slot order and run the Q/O
    token build, q and o staying in token order (SVG2 then moves as in slot order); ``False``: every tensor
    moves to slot order and back; ``"tiles"`` (STA, VSA, full): the model keeps its tokens tile-major between
    its blocks (:class:`TileMajorTokens`, which :func:`install_sparse_attention` installs with it), so the
    processor's tokens are its layout's valid slots in order (:func:`sparseattn.layouts.tile_major_tokens`),
    and calls without gradients run the tile-major token build: nothing moves, k and v pages are read
    token-major by the tensor-memory accelerator. STA and VSA calls with gradients run in token order where
    the token-order backward is opted in (:func:`sparseattn.torch.token_backward_enabled`), else they move."""

    def __init__(self, grid, selection: WanSelection, backend: str = "kpage", route="auto", token_order=None):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if not isinstance(selection, WanSelection):
            raise TypeError(f"selection must be a WanSelection, got {type(selection).__name__}")
        self.grid = tuple(int(x) for x in grid)
        if len(self.grid) != 3 or min(self.grid) < 1:
            raise ValueError(
                f"grid must be three positive token counts (frames, height, width), got {grid!r}"
            )
        self.selection, self.backend, self.route = selection, backend, route
        if token_order is None:
            token_order = token_order_default()
        if token_order not in (True, False, "qo", "tiles"):
            raise ValueError(f"token_order must be True, False, 'qo' or 'tiles', got {token_order!r}")
        if token_order == "tiles" and selection.kind == "svg2":
            raise ValueError(
                "token_order='tiles' keeps the tokens in a fixed tile order; SVG2 clusters per call"
            )
        self.token_order = token_order
        self._centroids: dict = {}  # SVG2: (layer, rows) -> the previous call's (Q, K) centroids
        self.last_svg2_step = None  # SVG2: the last call's SVG2Step (what it selected, for reports)
        self._layer = None
        self._graphs: dict = {}
        self._layout = None
        self._raster_layout = None
        self._masks: dict = {}
        self._dense = None
        self._planner = None
        self._ids: dict = {}  # heads -> handles (graph, Q layout); "dynamic" -> (layout, planner)
        self.tile_hooks = None  # token_order "tiles": the model's TileMajorTokens

    @property
    def num_tokens(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    def prepare(self, heads: int):
        """Build what a call needs and its selection fixes (the static graph, or the layout and the device
        planner of a dynamic selection) now rather than in the first call, and name them by the integer
        handles the operators take: a ``torch.compile`` trace then finds only constants.
        :func:`install_sparse_attention` calls it with the model's head count."""
        from .torch_ops import handle

        if self.selection.kind == "svg2":  # nothing fixed: every call clusters anew
            return self
        if self.selection.dynamic:
            planner = self.planner() if self.backend == "kpage" else None
            self._ids["dynamic"] = (handle(self.layout), None if planner is None else handle(planner))
        else:
            graph = self.graph_for(heads)
            self._ids[heads] = (handle(graph), handle(graph.q))
        return self

    def _handles(self, key):
        ids = self._ids.get(key)
        if ids is None:
            self.prepare(key if isinstance(key, int) else 0)
            ids = self._ids[key]
        return ids

    def planner(self):
        """The :class:`~sparseattn.planning.device.DevicePlanner` of a dynamic selection (built once)."""
        if self._planner is None:
            from .torch import planner_for

            self._planner = planner_for(self.layout, route=self.route)
        return self._planner

    def graph_for(self, heads: int, q=None, k=None) -> SparseGraph:
        """The static graph (cached per head count), or VSA's from one batch entry's ``[L, heads, d]`` q, k."""
        if self.selection.dynamic:
            if self.token_order == "tiles":
                raise ValueError("a host VSA graph is built from raster-ordered q and k, not tile-major ones")
            qn, kn = (x.detach().float().permute(1, 0, 2).cpu().numpy() for x in (q, k))
            return self.selection.graph(self.grid, heads, qn, kn)
        if heads not in self._graphs:
            graph = self.selection.graph(self.grid, heads)
            if self.token_order == "tiles":  # the model's tokens are the layout's valid slots in order
                graph = graph.tile_major_tokens()
            self._graphs[heads] = graph
        return self._graphs[heads]

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if encoder_hidden_states is not None or attention_mask is not None:
            return self._diffusers_processor()(
                attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb
            )
        self._layer = id(attn)  # SVG2 keeps its centroids per layer
        if hidden_states.shape[1] != self.num_tokens:
            raise ValueError(
                f"hidden_states holds {hidden_states.shape[1]} tokens; the processor's grid "
                f"{self.grid} has {self.num_tokens} (give the token grid after patching)"
            )
        if getattr(attn, "to_qkv", None) is not None and getattr(attn, "fused_projections", False):
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        query, key = attn.norm_q(query), attn.norm_k(key)
        query, key, value = (x.unflatten(2, (attn.heads, -1)) for x in (query, key, value))
        if rotary_emb is not None:
            query, key = apply_rotary(query, *rotary_emb), apply_rotary(key, *rotary_emb)
        out = self.attend(query, key, value)
        out = out.flatten(2, 3).type_as(query)
        out = attn.to_out[0](out)
        return attn.to_out[1](out)

    def attend(self, q, k, v):
        """Sparse attention of ``[B, L, heads, d]`` q, k, v in raster token order; returns the same shape."""
        if self.selection.dynamic:
            return self._attend_dynamic(q, k, v)
        if self.backend == "kpage":
            return self._attend_kpage(q, k, v, *self._handles(q.shape[2]))
        return self._attend_graph(q, k, v, self.graph_for(q.shape[2]))

    @property
    def layout(self):
        """The slot layout of the grid's tokens (tile-major, valid prefix)."""
        if self._layout is None:
            raster = self.raster_layout
            self._layout = tile_major_tokens(raster) if self.token_order == "tiles" else raster
        return self._layout

    @property
    def raster_layout(self):
        """:attr:`layout` with the model's own (raster) token numbering."""
        if self._raster_layout is None:
            self._raster_layout = video_layout(self.grid, self.selection.tile, self.selection.blocks())
        return self._raster_layout

    def _to_slots(self, x, dtype):
        """``[B, L, heads, d]`` tokens -> ``[B, heads, slots, d]`` in the layout's slot order (zeros in padding)."""
        from .torch_ops import token_slot_index

        x = x.transpose(1, 2)
        out = x.new_zeros(x.shape[0], x.shape[1], self.layout.num_slots, x.shape[3], dtype=dtype)
        return out.index_copy(2, token_slot_index(self.layout, x.device), x.to(dtype))

    def select(self, q, k):
        """VSA's ``(q2k_idx, q2k_num)`` of ``[B, L, heads, d]`` q, k (on their device)."""
        from .torch import vsa_topk

        torch = self._torch()
        return vsa_topk(
            self._to_slots(q, torch.float32),
            self._to_slots(k, torch.float32),
            self.layout,
            self.selection.topk,
        )

    def _svg2_fit_args(self, q):
        """What both SVG2 paths start from: ``(rows, iters, init, generator)`` for ``[B, L, heads, d]`` q:
        the ``[B · heads, L, d]`` rows of a tensor, this layer's Lloyd steps and warm start (the first call
        seeds k-means++ with a fixed generator and runs SVG2's longer first fit)."""
        torch = self._torch()
        iters, init_iters = self.selection.clusters[4:6]
        b, n, h, d = q.shape
        # the layer's own dtype: bf16 rows take the tensor-core assignment; k-means sums and cluster means
        # are float32 whatever the input
        rows = lambda x: x.detach().permute(0, 2, 1, 3).reshape(b * h, n, d)
        init = self._centroids.get((self._layer, b * h), (None, None))
        generator = None
        if init[0] is None:
            generator = torch.Generator(device=q.device).manual_seed(0)
            iters = init_iters
        return rows, iters, init, generator

    def svg2_step(self, q, k):
        """SVG2's clustering and selection of ``[B, L, heads, d]`` q, k (a
        :class:`~sparseattn.svg2_device.SVG2Step` over ``B · heads`` rows), warm-started from this layer's
        previous call (the first call seeds k-means++ with a fixed generator)."""
        from .svg2_device import svg2_partition_step

        qc, kc, top_p, min_fraction = self.selection.clusters[:4]
        rows, iters, init, generator = self._svg2_fit_args(q)
        step = svg2_partition_step(
            rows(q),
            rows(k),
            qc,
            kc,
            self.selection.blocks(),
            top_p,
            min_fraction,
            iters,
            *init,
            generator,
            final_assign=False,
        )
        self._keep_centroids(q, step)
        return step

    def _keep_centroids(self, q, step):
        """This layer's warm start for its next call: ``step``'s centroids, keyed by the ``B · heads`` rows.
        Copied in place into the tensors the call started from (kept since the layer's first call), so that
        a call captured in a CUDA graph warm-starts each replay from the one before; a fresh copy where the
        shapes change."""
        key = (self._layer, q.shape[0] * q.shape[2])
        new = (step.q_centroids.detach(), step.k_centroids.detach())
        kept = self._centroids.get(key)
        if kept is not None and all(a.shape == b.shape and a.dtype == b.dtype for a, b in zip(kept, new)):
            for a, b in zip(kept, new):
                a.copy_(b)
        else:
            self._centroids[key] = tuple(c.clone() for c in new)

    def _attend_svg2(self, q, k, v):
        """SVG2: query i attends key j when the pair of their clusters is selected (masked SDPA, or KPage
        on the per-row layouts of this call's clusters)."""
        if self.backend == "kpage" and q.is_cuda:  # on the CPU, KPage's graph is computed by masking
            if self.token_order is True and self._token_order_call(q, k, v):
                step = self.last_svg2_step = self.svg2_step(q, k)
                return self._svg2_kpage_tokens(q, k, v, step)
            return self._svg2_kpage(q, k, v)
        step = self.last_svg2_step = self.svg2_step(q, k)
        return self._svg2_masked(q, k, v, step)

    def _svg2_masked(self, q, k, v, step):
        """Masked SDPA of an SVG2 step's cluster pairs, ``[B, L, heads, d]`` in and out."""
        from .svg2_device import cluster_pair_mask

        torch = self._torch()
        b, n, h, _ = q.shape
        mask = cluster_pair_mask(step.cluster_mask, step.q_labels, step.k_labels).view(b, h, n, n)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
        )
        return out.transpose(1, 2)

    def _svg2_kpage_tokens(self, q, k, v, step):
        """KPage's token-order forward on an SVG2 step's per-row layouts (no moves: a map per row)."""
        from .kernels.forward import torch_token_forward

        work = step.forward_work_list(svg2_plan())
        maps = [slot_tokens(lay.token_slot, lay.max_slots) for lay in (step.q_layout, step.k_layout)]
        return torch_token_forward(q, k, v, work, *maps)[0]

    def _svg2_kpage(self, q, k, v):
        """KPage on this call's per-row layouts (:func:`sparseattn.torch.per_row_layout_attention`, or
        :func:`~sparseattn.torch.per_row_cluster_attention` as :func:`svg2_plan` says): k-means
        whose last step assigns labels only, tokens to each row's cluster-ordered slots with the clusters'
        sums taken on the way (:func:`~sparseattn.svg2_device.fit_for_slots`,
        :func:`~sparseattn.svg2_device.step_from_slot_sums`), SVG2's selection on their means, forward and
        backward planned on the device, back to tokens."""
        from . import svg2_device
        from .svg2_device import fit_for_slots, slot_rows, slots_and_step
        from .torch import per_row_cluster_attention, per_row_layout_attention

        torch = self._torch()
        b, n, h, d = q.shape
        qc, kc, top_p, min_fraction = self.selection.clusters[:4]
        rows, iters, init, generator = self._svg2_fit_args(q)
        fitted = fit_for_slots(
            rows(q),
            rows(k),
            qc,
            kc,
            self.selection.blocks(),
            iters,
            *init,
            generator,
            k_beside=svg2_device.K_LAYOUT_BESIDE,  # K's layout then joined after q's move
        )
        ql, kl = fitted.q_layout, fitted.k_layout

        def in_token_order(layout):  # each [B, L, heads] token's row of the flattened [B·H·slots, d]
            return slot_rows(layout.token_slot, layout.max_slots).view(b, h, n).transpose(1, 2).reshape(-1)

        q_rows, k_rows = in_token_order(ql), lambda: in_token_order(kl)
        flat = lambda x: x.to(torch.bfloat16).reshape(b * n * h, d)  # [B, L, heads, d] as it comes
        # on the GPU only the slots that hold a token are written (DeviceLayout.filled_slots); the forward by
        # clusters is planned with the selection (beside v's move with svg2_device.SELECT_BESIDE)
        plan = "clusters" if svg2_plan() == "clusters" else None
        args = (flat(q), flat(k), flat(v), q_rows, k_rows, top_p, min_fraction, plan)
        qs, ks, vs, step, work = slots_and_step(fitted, *args)
        self.last_svg2_step = step
        self._keep_centroids(q, step)
        slots = [x.view(b * h, -1, d) for x in (qs, ks, vs)]
        if plan == "clusters":
            groups = (ql.block_group, kl.block_group, step.cluster_mask)
            o, _ = per_row_cluster_attention(
                *slots, ql.block_rows, kl.block_rows, *groups, ql.block_size, work=work
            )
        else:
            o, _ = per_row_layout_attention(
                *slots, ql.block_rows, kl.block_rows, step.block_mask, ql.block_size
            )
        out = o.reshape(b * h * ql.max_slots, d).index_select(0, q_rows)  # back to [B, L, heads] order
        return out.view(b, n, h, d).to(q.dtype)

    def _attend_dynamic(self, q, k, v):
        """VSA: the selection from this call's q and k, on their device; KPage plans it on the GPU."""
        torch = self._torch()
        if self.selection.kind == "svg2":
            return self._attend_svg2(q, k, v)
        if self.backend == "masked_sdpa":
            from .torch_ops import selection_block_mask, token_slot_index

            idx, num = self.select(q, k)
            blocks = selection_block_mask(idx, num, None, self.layout.num_blocks)
            token_block = token_slot_index(self.layout, q.device) // self.layout.block_size
            mask = blocks[:, :, token_block][:, :, :, token_block]
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
            )
            return out.transpose(1, 2)
        from .torch import block_sparse_attention, slots_to_tokens, tokens_to_slots, vsa_topk

        layout, planner = self._handles("dynamic")
        if self._token_order_call(q, k, v, differentiable=True):
            from .torch import token_order_attention, vsa_topk_tokens

            with torch.no_grad():
                idx, num = vsa_topk_tokens(q, k, layout, self.selection.topk)
            return token_order_attention(q, k, v, self.planner(), idx, num, **self._kv_build()).to(q.dtype)
        qs, ks, vs = tokens_to_slots(layout, q, k, v)
        with torch.no_grad():
            idx, num = vsa_topk(qs, ks, layout, self.selection.topk)
        out, _ = block_sparse_attention(qs, ks, vs, planner, idx, num)
        return slots_to_tokens(layout, out).to(q.dtype)

    def _attend_graph(self, q, k, v, graph: SparseGraph):
        torch = self._torch()
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B, heads, L, d]
        if self.backend == "masked_sdpa":
            key = (graph.heads, q.device)
            mask = None if self.selection.dynamic else self._masks.get(key)
            if mask is None:
                mask = torch.from_numpy(token_mask(graph)).to(q.device)
                if not self.selection.dynamic:
                    self._masks[key] = mask
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[None])
            return out.transpose(1, 2)
        from .torch_ops import handle

        return self._attend_kpage(*(x.transpose(1, 2) for x in (q, k, v)), handle(graph), handle(graph.q))

    def _attend_kpage(self, q, k, v, graph: int, layout: int):
        """KPage of a static graph named by handles: ``[B, L, heads, d]`` q, k, v to slots, attention, back."""
        from .torch import kpage_attention, slots_to_tokens, tokens_to_slots

        if self._token_order_call(q, k, v, differentiable=True):
            from .torch import token_order_attention
            from .torch_ops import resolve

            return token_order_attention(q, k, v, resolve(graph), route=self.route, **self._kv_build()).to(
                q.dtype
            )
        qs, ks, vs = tokens_to_slots(layout, q, k, v)
        out = kpage_attention(qs, ks, vs, graph, route=self.route)
        return slots_to_tokens(layout, out).to(q.dtype)

    def install_tile_hooks(self, transformer, inverse_after: str = "last_block") -> TileMajorTokens:
        """``token_order="tiles"``: :class:`TileMajorTokens` of this processor's grid on ``transformer`` (kept
        as ``tile_hooks``; ``tile_hooks.remove()`` takes them off). A model takes one set: a second raises."""
        if self.token_order != "tiles":
            raise ValueError(
                f"tile hooks are for token_order='tiles'; this processor has {self.token_order!r}"
            )
        if getattr(transformer, "_sparseattn_tile_hooks", None) is not None:
            raise ValueError("the model keeps its tokens tile-major already: remove its tile hooks first")
        self.tile_hooks = TileMajorTokens(transformer, self.raster_layout, inverse_after)
        return self.tile_hooks

    def _kv_build(self) -> dict:
        """How a token-order call reads k and v: :func:`sparseattn.torch.token_order_attention`'s arguments."""
        return dict(kv_slots=self.token_order == "qo", kv_tma=self.token_order == "tiles")

    def _token_order_call(self, q, k, v, differentiable: bool = False) -> bool:
        """Whether this call runs in token order (see the class): bf16 CUDA q, k, v, not traced by
        ``torch.compile``, and no gradients, or (``differentiable`` paths) the token-order backward opted in
        (:func:`sparseattn.torch.token_backward_enabled`)."""
        from .torch import token_backward_enabled

        torch = self._torch()
        grads = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        return (
            self.token_order
            and q.is_cuda
            and q.dtype == k.dtype == v.dtype == torch.bfloat16
            and (not grads or (differentiable and token_backward_enabled()))
            and not torch.compiler.is_compiling()
        )

    def _diffusers_processor(self):
        if self._dense is None:
            from diffusers.models.transformers.transformer_wan import WanAttnProcessor

            self._dense = WanAttnProcessor()
        return self._dense

    @staticmethod
    def _torch():
        import torch

        return torch


class TileMajorTokens:
    """Hooks that keep a diffusers ``WanTransformer3DModel``'s tokens tile-major between its blocks: the
    hidden states are permuted into ``layout``'s tile-major order (:func:`sparseattn.layouts.tile_major_tokens`)
    before the first block and back after the last, the rotary tables as the model makes them, and a
    per-token timestep projection (Wan2.2 TI2V) before each block. Every other layer of the model acts on
    each token alone, so the model's output is unchanged; its self-attention then sees tile-major tokens.
    ``remove()`` takes the hooks off.

    ``inverse_after``: where the tokens go back to raster order, ``"last_block"`` (after the last block's
    output) or ``"proj_out"`` (after the output projection's: what sequence parallelism takes, whose ranks
    hold a slice of the tokens until its own hook on ``proj_out`` gathers them; registered after that hook,
    this one then sees every token). The layers between are per token, but for Wan2.2 TI2V's per-token
    timestep in the output norm, which only ``"last_block"`` keeps in raster order."""

    def __init__(self, transformer, layout, inverse_after: str = "last_block"):
        """``layout``: the grid's layout in the model's own (raster) token order."""
        import torch

        if inverse_after not in ("last_block", "proj_out"):
            raise ValueError(f"inverse_after must be 'last_block' or 'proj_out', got {inverse_after!r}")
        blocks = list(transformer.blocks)
        perm = torch.as_tensor(tile_major_permutation(layout))
        self.num_tokens = int(perm.numel())
        self._index = {"perm": perm, "inverse": torch.argsort(perm)}
        self._on: dict = {}  # (name, device) -> the index on that device
        last = blocks[-1] if inverse_after == "last_block" else transformer.proj_out
        self.handles = [
            transformer.rope.register_forward_hook(self._rope),
            blocks[0].register_forward_pre_hook(self._first_block, with_kwargs=True),
            last.register_forward_hook(self._last_block),
        ]
        self.handles += [
            block.register_forward_pre_hook(self._timestep, with_kwargs=True) for block in blocks
        ]
        self._model = transformer
        transformer._sparseattn_tile_hooks = self  # (install_sparse_attention replaces, never stacks, them)

    def _take(self, x, name: str):
        import torch

        index = self._on.get((name, x.device))
        if index is None:
            index = self._on[(name, x.device)] = self._index[name].to(x.device)
        if x.shape[1] != self.num_tokens:
            raise ValueError(
                f"a tensor of {x.shape[1]} tokens met the tile-major hooks of a {self.num_tokens}-token grid"
            )
        out = x.index_select(1, index)
        # in x's own memory layout: diffusers' Wan hands its blocks a transposed [batch, tokens, channels]
        # view, and a contiguous one would speed up every layer after it (contiguous_hidden_states), which
        # would be no effect of the token order
        return out if x.is_contiguous() else torch.empty_like(x).copy_(out)

    def _rope(self, module, args, out):
        return tuple(self._take(x, "perm") for x in out)

    @staticmethod
    def _replace(args, kwargs, position: int, name: str, f):
        if len(args) > position:
            return (*args[:position], f(args[position]), *args[position + 1 :]), kwargs
        if name in kwargs:
            return args, {**kwargs, name: f(kwargs[name])}
        return args, kwargs

    def _first_block(self, module, args, kwargs):
        return self._replace(args, kwargs, 0, "hidden_states", lambda x: self._take(x, "perm"))

    def _timestep(self, module, args, kwargs):  # temb [batch, tokens, 6, dim] only (Wan2.2 TI2V)
        per_token = lambda t: self._take(t, "perm") if t.dim() == 4 else t
        return self._replace(args, kwargs, 2, "temb", per_token)

    def _last_block(self, module, args, out):
        return self._take(out, "inverse")

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []
        if getattr(self._model, "_sparseattn_tile_hooks", None) is self:
            del self._model._sparseattn_tile_hooks


def contiguous_hidden_states(transformer):
    """Hand a diffusers ``WanTransformer3DModel``'s first block contiguous hidden states. The model passes its
    blocks the patch embedding's ``[batch, tokens, channels]`` as a transposed view
    (``flatten(2).transpose(1, 2)``); the blocks' residual additions keep that layout, so every layer then
    reads and writes its residual stream with a stride of ``tokens`` elements. Same values; returns the hook's
    handle (``handle.remove()`` takes it off)."""

    def hook(module, args, kwargs):
        if args:
            return (args[0].contiguous(), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": kwargs["hidden_states"].contiguous()}

    return transformer.blocks[0].register_forward_pre_hook(hook, with_kwargs=True)


def install_token_order(selection: WanSelection, backend: str):
    """The ``token_order`` :func:`install_sparse_attention` gives processors when not told: ``"tiles"`` for
    the KPage backend's STA, VSA and full selections (the model's tokens tile-major between its blocks: the
    1.3B model's 480p forward attention 39.6 → 35.0 ms on an H100, and it compiles without a graph break and
    replays in a CUDA graph equal to eager, ``data/bench/wan_compile_tiles_h100_20261207_49ea0f4.json``);
    else None (the processor's :func:`token_order_default`). ``SPARSEATTN_TOKEN_ORDER`` set: None."""
    if os.environ.get("SPARSEATTN_TOKEN_ORDER") or backend != "kpage" or selection.kind == "svg2":
        return None
    return "tiles"


def install_sparse_attention(
    transformer, grid, selection: WanSelection, backend: str = "kpage", route="auto", token_order=None
):
    """Give every block's self-attention of a ``WanTransformer3DModel`` a :class:`WanSparseAttnProcessor`
    (one shared instance, so the static graph is built once); returns it. ``token_order`` as the processor
    takes it; ``"tiles"`` also installs :class:`TileMajorTokens` on the model (the processor's
    ``tile_hooks``). A later call replaces an earlier one's tile-major hooks rather than stacking them.
    Without ``token_order`` (and without ``SPARSEATTN_TOKEN_ORDER``), the KPage backend's static and VSA
    selections take ``"tiles"`` (:func:`install_token_order`); SVG2 and the masked-SDPA backend take the
    processor's default."""
    blocks = getattr(transformer, "blocks", None)
    if blocks is None:
        raise TypeError(
            f"transformer must be a diffusers WanTransformer3DModel, got {type(transformer).__name__}"
        )
    if token_order is None:
        token_order = install_token_order(selection, backend)
    processor = WanSparseAttnProcessor(grid, selection, backend, route, token_order=token_order)
    earlier = getattr(transformer, "_sparseattn_tile_hooks", None)
    if earlier is not None:  # an earlier install's tile-major order: the new processors set their own
        earlier.remove()
    if token_order == "tiles":
        processor.install_tile_hooks(transformer)
    heads = getattr(getattr(transformer, "config", None), "num_attention_heads", None)
    if heads is not None:
        processor.prepare(int(heads))
    for block in blocks:
        block.attn1.set_processor(processor)
    return processor
