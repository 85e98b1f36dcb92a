"""SVG2's per-call clustering, partition and selection on the device, in torch, batched over rows.

SVG2 re-clusters the Q and K tokens of every head at every call: k-means, a permutation of the
tokens by cluster (each cluster padded to whole blocks), the top-p cluster pairs, and the block mask
of those pairs. :mod:`sparseattn.builders` does this on the host (scipy k-means, numpy layouts); this
module does the same on torch tensors, batched over ``N`` rows (``N = batch · heads``), on any device.

Every function here is free of host synchronisation: no ``.item()``, no ``.cpu()``, no Python
control flow on tensor values, and every output shape depends only on the input shapes and the
Python integers passed in (``max_slots`` is a static bound, :func:`max_slots_bound`). So a call can
be captured in a CUDA graph. The price is that nothing data-dependent is checked: labels must lie in
``[0, num_groups)`` (an out-of-range label is an index error on the CPU, a device assert on CUDA).

Deterministic on the CPU. On CUDA the cluster sums (``scatter_add_``) use atomics, so centroids may
differ in the last bits from run to run; distances follow torch's TF32 setting for float32 matmuls.

Functions:

* :func:`kmeans` — batched Lloyd iterations, warm-started or seeded by batched k-means++.
* :func:`cluster_means` — per-cluster means and sizes of the rows of ``x``.
* :func:`partition_slots` — :func:`~sparseattn.layouts.partition_layout` per row, as a
  :class:`DeviceLayout` of static shape; :func:`scatter_to_slots` / :func:`gather_from_slots` move
  token-ordered data into slot order and back.
* :func:`svg2_select` — :func:`~sparseattn.builders.svg2_select` per row, as a bool cluster mask.
* :func:`cluster_block_mask` — the block pairs of the selected cluster pairs; :func:`cluster_pair_mask`
  the same for any groups (tokens' labels: the token mask).
* :func:`svg2_partition_step` — all of it for one attention call (:class:`SVG2Step`);
  :func:`svg2_step_in_slots` the same with the tokens' move to slots, which also takes the last Lloyd
  step's cluster sums (:func:`slot_sum_index`), so that step assigns labels only (opt-in, in
  ``svg2_step_bench`` only until measured).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field, fields

import torch

from .constants import PAGE_ROWS

#: Distance entries ``[N, chunk, k]`` per chunk of :func:`nearest_centroid` (512 MiB of float32).
ASSIGN_CHUNK_ENTRIES = 1 << 27
#: Build Q's slot layout on a side stream while K's k-means runs (:func:`fit_for_slots` on CUDA tensors;
#: ``SPARSEATTN_SVG2_SIDE_STREAM``, default ``1``; ``0`` builds it after K's; NOTES_svg2_device.md v36): the
#: layout's ~50 small kernels then run beside K's assignment instead of after it.
SIDE_STREAM = os.environ.get("SPARSEATTN_SVG2_SIDE_STREAM", "1") == "1"
#: Build K's slot layout on the same side stream while q moves to slots (``SPARSEATTN_SVG2_K_LAYOUT_BESIDE``,
#: default ``1``; ``0`` builds it before the moves; NOTES_svg2_device.md v47): where a caller asks for it
#: (:func:`fit_for_slots`' ``k_beside``, which the Wan processor passes, and :func:`svg2_step_in_slots` with
#: the selection beside v's move), K's layout is joined after q's move instead of before it.
K_LAYOUT_BESIDE = os.environ.get("SPARSEATTN_SVG2_K_LAYOUT_BESIDE", "1") == "1"
#: How :func:`partition_slots` finds each token's slot on CUDA (``SPARSEATTN_SVG2_LAYOUT_SLOTS``; NOTES_svg2_device.md
#: v40): ``"counts"`` (the default), the tokens of each group counted per chunk of tokens and placed by a warp's
#: running counts (:mod:`sparseattn.kernels.group_slots`, no sort; elsewhere the sort); ``"sort"``, a stable
#: sort of each row's labels.
LAYOUT_SLOTS = os.environ.get("SPARSEATTN_SVG2_LAYOUT_SLOTS", "counts")
LAYOUT_SLOTS_FORMS = ("sort", "counts")
#: How :func:`lloyd` on the wgmma assignment makes its centroids' operands (bf16 centroids, ``|c|²``) and each
#: step's new centroids (``SPARSEATTN_KMEANS_UPDATE``; NOTES_svg2_device.md v43): ``"fused"`` (the default) one
#: Triton pass (:mod:`sparseattn.centroid_update`, where Triton runs); ``"torch"`` ~10 torch operations a step.
#: At SVG2's 720p call (H100) the k-means Q 1.51 → 1.45 ms, K 3.43 → 3.30.
KMEANS_UPDATE = os.environ.get("SPARSEATTN_KMEANS_UPDATE", "fused")
KMEANS_UPDATE_FORMS = ("torch", "fused")
#: How :func:`partition_slots` makes a layout's per-group and per-block arrays from the groups' sizes
#: (``SPARSEATTN_SVG2_LAYOUT_BLOCKS``; NOTES_svg2_device.md v44): ``"triton"`` (the default) two Triton kernels
#: (:mod:`sparseattn.layout_blocks`, where Triton runs; elsewhere torch); ``"torch"`` ~18 torch operations. The
#: same arrays; at SVG2's 720p call (H100) K's layout 0.24 → 0.14 ms.
LAYOUT_BLOCKS = os.environ.get("SPARSEATTN_SVG2_LAYOUT_BLOCKS", "triton")
LAYOUT_BLOCKS_FORMS = ("torch", "triton")
#: How :func:`step_from_slot_sums` turns the clusters' sums into the step's centroids and the selection's float64
#: means (``SPARSEATTN_SVG2_SELECT_MEANS``; NOTES_svg2_device.md v45): ``"fused"`` (the default) one Triton pass
#: a side (:func:`sparseattn.centroid_update.selection_means`, where Triton runs; elsewhere torch); ``"torch"``
#: six torch operations a side. The same bits; at SVG2's 720p call (H100) the selection 0.75 → 0.65 ms.
SELECT_MEANS = os.environ.get("SPARSEATTN_SVG2_SELECT_MEANS", "fused")
SELECT_MEANS_FORMS = ("torch", "fused")
#: Run the selection and the forward's work list on a side stream while v moves to slots
#: (:func:`slots_and_step` on CUDA tensors with a plan asked for; ``SPARSEATTN_SVG2_SELECT_BESIDE``, default
#: ``1``; ``0`` runs them after v's move; NOTES_svg2_device.md v42): they need q's and k's cluster sums, not v,
#: and their ~70 small kernels then run beside v's move instead of between it and the kernel.
SELECT_BESIDE = os.environ.get("SPARSEATTN_SVG2_SELECT_BESIDE", "1") == "1"


def _check_rows(name: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.ndim != 3:
        raise ValueError(f"{name} must be a tensor [N, tokens, d], got {getattr(x, 'shape', type(x))}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must hold floats, got {x.dtype}")


def _check_form(name: str, env: str) -> None:
    """Raise, naming the setting and its variable ``env``, when this module's ``name`` is not one of its
    ``name + "_FORMS"`` (read now, so a script or test that sets the attribute is checked too)."""
    value, forms = globals()[name], globals()[f"{name}_FORMS"]
    if value not in forms:
        raise ValueError(f"svg2_device.{name} ({env}) must be one of {forms}, got {value!r}")


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _block_size(block_size) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive multiple of {PAGE_ROWS}, got {block_size!r}")
    if block_size % PAGE_ROWS:
        raise ValueError(f"block_size must be a positive multiple of {PAGE_ROWS}, got {block_size}")
    return block_size


# --- k-means ---------------------------------------------------------------------------------------
def nearest_centroid(x: torch.Tensor, centroids: torch.Tensor, chunk_tokens: int | None = None):
    """int64 ``[N, tokens]``: index of the nearest centroid (squared Euclidean) of each row of ``x``.

    ``x`` float ``[N, tokens, d]``, ``centroids`` ``[N, k, d]``; both taken as float32. Distances are
    ``|c|² - 2 x·c`` (one ``baddbmm`` per chunk of ``chunk_tokens`` tokens, default: about
    :data:`ASSIGN_CHUNK_ENTRIES` distances per chunk); ties go to the lower centroid index.
    """
    x = x.float()
    c = centroids.float()
    n, t, _ = x.shape
    k = c.shape[1]
    if chunk_tokens is None:
        chunk_tokens = max(1, ASSIGN_CHUNK_ENTRIES // max(1, n * k))
    csq = (c * c).sum(-1).unsqueeze(1)  # [N, 1, k]
    ct = c.transpose(1, 2)  # [N, d, k]
    parts = [
        torch.baddbmm(csq, x[:, s : s + chunk_tokens], ct, alpha=-2.0).argmin(-1)
        for s in range(0, t, chunk_tokens)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def cluster_means(x: torch.Tensor, labels: torch.Tensor, k: int):
    """``(means float32 [N, k, d], sizes int64 [N, k])`` of the rows of ``x`` ``[N, tokens, d]`` per
    cluster of ``labels`` ``[N, tokens]``; empty clusters have zero means (as
    :func:`sparseattn.builders.group_means`)."""
    return _means(*_cluster_sums(x.float(), labels, k))


def _means(sums: torch.Tensor, counts: torch.Tensor):
    """``(means, sizes int64)`` of clusters' float32 sums ``[N, k, d]`` and sizes ``[N, k]`` (empty: 0)."""
    return sums / counts.clamp_min(1).unsqueeze(-1), counts.long()


def _cluster_sums(x32: torch.Tensor, labels: torch.Tensor, k: int):
    n, _, d = x32.shape
    sums = x32.new_zeros(n, k, d).scatter_add_(1, labels.unsqueeze(-1).expand(-1, -1, d), x32)
    counts = x32.new_zeros(n, k).scatter_add_(1, labels, x32.new_ones(labels.shape))
    return sums, counts


def kmeans_pp_init(
    x: torch.Tensor, k: int, generator: torch.Generator | None = None, seed_points: int | None = None
) -> torch.Tensor:
    """float32 ``[N, k, d]``: k-means++ (D² sampling) seeds of each row of ``x`` ``[N, tokens, d]``.

    As :func:`sparseattn.builders.kmeans_labels` seeds: each row draws a random pool of
    ``m = min(tokens, max(2k, seed_points or 0))`` distinct tokens, and D² sampling runs on the pool
    (first seed uniform, then each next seed with probability ∝ squared distance to the nearest seed
    so far). A row with fewer distinct pool points than ``k`` repeats points at distance 0. All random
    numbers come from ``generator`` (on ``x``'s device; default: torch's global generator), drawn
    the same way whatever the data, so a seeded generator gives reproducible seeds. One loop of
    ``k - 1`` steps, batched over ``N``.
    """
    n, t, d = x.shape
    m = min(t, max(2 * k, seed_points or 0))
    dev = x.device
    pool = torch.rand(n, t, generator=generator, device=dev).argsort(dim=1)[:, :m]
    p = x.float().gather(1, pool.unsqueeze(-1).expand(-1, -1, d))  # [N, m, d]
    sq = (p * p).sum(-1)  # [N, m]
    first = (torch.rand(n, 1, generator=generator, device=dev) * m).long().clamp_(max=m - 1)
    u = torch.rand(n, k, generator=generator, device=dev)
    chosen = torch.empty(n, k, dtype=torch.long, device=dev)
    chosen[:, :1] = first

    def dist_to(j):  # [N, m] squared distances of the pool points to pool point j [N, 1]
        c = p.gather(1, j.unsqueeze(-1).expand(-1, -1, d))  # [N, 1, d]
        return (sq - 2.0 * torch.bmm(p, c.transpose(1, 2)).squeeze(-1) + sq.gather(1, j)).clamp_min_(0.0)

    d2 = dist_to(first)
    for i in range(1, k):
        cum = d2.cumsum(1)
        target = u[:, i : i + 1] * cum[:, -1:]
        j = torch.searchsorted(cum, target, right=True).clamp_(max=m - 1)  # [N, 1]
        chosen[:, i : i + 1] = j
        d2 = torch.minimum(d2, dist_to(j))
    return p.gather(1, chosen.unsqueeze(-1).expand(-1, -1, d))


def kmeans(
    x: torch.Tensor,
    k: int,
    iters: int,
    init: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    *,
    seed_points: int | None = None,
    chunk_tokens: int | None = None,
    assign: str = "auto",
    final_assign: bool = True,
):
    """Batched k-means of the rows of ``x``: ``(labels int64 [N, tokens], centroids float32 [N, k, d])``.

    Args:
        x: float ``[N, tokens, d]`` (any float dtype; distances and means in float32).
        k: clusters per row (at most ``tokens``).
        iters: Lloyd steps (assign every token to its nearest centroid, move each centroid to the
            mean of its tokens; a cluster left empty keeps its centroid). A fixed count: no
            convergence test, so no host synchronisation. ``iters=0`` only assigns.
        init: ``[N, k, d]`` starting centroids (warm start: the previous call's centroids, as SVG2
            reuses them from one denoising step to the next); default :func:`kmeans_pp_init`.
        generator: the ``torch.Generator`` of the k-means++ seeding (unused with ``init``).
        seed_points: k-means++ pool size (:func:`kmeans_pp_init`); chunk_tokens: see
            :func:`nearest_centroid`.
        assign: how tokens find their nearest centroid: ``"torch"`` (:func:`nearest_centroid`, float32
            distances), ``"fused"`` (:func:`sparseattn.nearest_centroid.nearest_centroid_fused`: one
            Triton kernel on half-precision ``x``, centroids rounded to its dtype), ``"wgmma"``
            (:func:`sparseattn.kernels.kmeans_assign.nearest_centroid_wgmma`: the same metric on the
            tensor cores, bf16 CUDA ``x`` on an sm_90 GPU), or ``"auto"`` (wgmma where it can run, else
            fused where it can, else torch; the wgmma assignment takes 0.59–0.62× the fused
            one's time on the H200, see the README's SVG2 section).
        final_assign: with True (default) the labels are the nearest centroids of the returned
            centroids (one assignment after the last step), as :func:`sparseattn.builders.kmeans_labels`
            returns them; with False they are the last step's assignment and the returned centroids
            its cluster means (SVG2's own k-means returns this pair; it saves one assignment, and
            :func:`lloyd` gives the clusters' sums and sizes with it).

    Unlike :func:`~sparseattn.builders.kmeans_labels`, the Lloyd steps run on every token rather than a
    subsample (as SVG2 does).
    """
    labels, c, _, _ = lloyd(x, k, iters, init, generator, seed_points, chunk_tokens, assign, final_assign)
    return labels, c


def lloyd(
    x,
    k,
    iters,
    init=None,
    generator=None,
    seed_points=None,
    chunk_tokens=None,
    assign="auto",
    final_assign=True,
    last_sums=True,
):
    """:func:`kmeans`, returning ``(labels, centroids, sums float32 [N, k, d], sizes float32 [N, k])``:
    the float32 sums and sizes of the clusters of the last Lloyd step's assignment (all zeros when
    ``iters == 0``). With ``final_assign=False`` these are the returned labels' clusters, so their means
    need no second pass over the tokens. ``last_sums=False`` (with ``final_assign=False``) makes the last
    step an assignment alone: the centroids are those the labels were assigned to, sums and sizes None
    (the caller takes the clusters' sums elsewhere, e.g. :func:`scatter_to_slots` with ``sums``)."""
    _check_rows("x", x)
    n, t, d = x.shape
    k = _positive("k", k)
    if k > t:
        raise ValueError(f"k={k} is more than the {t} tokens to cluster")
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 0:
        raise ValueError(f"iters must be a non-negative integer, got {iters!r}")
    if init is None:
        c = kmeans_pp_init(x, k, generator, seed_points)
    else:
        if tuple(init.shape) != (n, k, d):
            raise ValueError(f"init must be [N, k, d] = {[n, k, d]}, got {list(init.shape)}")
        c = init.to(device=x.device, dtype=torch.float32)
    if not final_assign and iters < 1:
        raise ValueError("final_assign=False needs iters >= 1 (the labels are the last step's)")
    if not last_sums and final_assign:
        raise ValueError("last_sums=False needs final_assign=False (the labels are the last step's)")
    _check_form("KMEANS_UPDATE", "SPARSEATTN_KMEANS_UPDATE")
    nearest, step, takes_operands = _assigner(x, k, assign, chunk_tokens)
    if iters == 0:
        zeros = x.new_zeros(n, k, d, dtype=torch.float32)
        return nearest(c), c, zeros, zeros[..., 0]
    from . import centroid_update

    # the assignment's operands and each step's centroids in one pass (wgmma assignment, where Triton runs)
    fused = takes_operands and KMEANS_UPDATE == "fused" and centroid_update.available(c)
    ops = centroid_update.operands(c) if fused else None
    for i in range(iters):
        if i == iters - 1 and not last_sums:
            return nearest(c, ops), c, None, None
        labels, sums, counts = step(c, ops)
        if fused:
            c, ops = centroid_update.update(sums, counts, c)
        else:
            c = torch.where(counts.unsqueeze(-1) > 0, _means(sums, counts)[0], c)
    return (nearest(c, ops) if final_assign else labels), c, sums, counts


def _assigner(x: torch.Tensor, k: int, assign: str, chunk_tokens: int | None):
    """``(nearest, step, takes_operands)`` of ``x`` by the ``assign`` method of :func:`kmeans`:
    ``nearest(c, ops=None)`` the labels, ``step(c, ops=None)`` the labels with their clusters' float32 sums
    and sizes (one Lloyd assignment; fused into the assignment kernel on the fused path, so ``x`` is never
    copied to float32 there); ``takes_operands``: whether they use ``ops``, the centroids' operands
    (:mod:`sparseattn.centroid_update`; the wgmma assignment only)."""
    from .nearest_centroid import fused_available, lloyd_step_fused, nearest_centroid_fused

    if assign not in ("auto", "torch", "fused", "wgmma"):
        raise ValueError(f"assign must be 'auto', 'torch', 'fused' or 'wgmma', got {assign!r}")
    from .kernels import kmeans_assign

    if assign == "wgmma" or (assign == "auto" and kmeans_assign.available(x)):
        from .kernels.kmeans_assign import lloyd_step_wgmma, nearest_centroid_wgmma

        nearest = lambda c, ops=None: nearest_centroid_wgmma(x, c, operands=ops)
        return nearest, (lambda c, ops=None: lloyd_step_wgmma(x, c, operands=ops)), True
    if assign == "fused" or (assign == "auto" and fused_available(x)):
        nearest = lambda c, ops=None: nearest_centroid_fused(x, c)
        return nearest, (lambda c, ops=None: lloyd_step_fused(x, c)), False
    x32 = x.float()

    def nearest(c, ops=None):
        return nearest_centroid(x32, c, chunk_tokens)

    def step(c, ops=None):
        labels = nearest(c)
        return (labels, *_cluster_sums(x32, labels, k))

    return nearest, step, False


# --- partition layouts ------------------------------------------------------------------------------
def max_slots_bound(tokens: int, num_groups: int, block_size: int) -> int:
    """Slots that every partition of ``tokens`` tokens into ``num_groups`` groups fits in.

    A group of ``s`` tokens takes ``ceil(s / B) = floor((s + B - 1) / B)`` blocks (0 when empty) and
    at most ``G = min(num_groups, tokens)`` groups are non-empty; a sum of floors is at most the floor
    of the sum, so a row never needs more than ``floor((tokens + G · (B - 1)) / B)`` blocks. The bound
    is reached (every token its own group; one group of ``tokens`` a multiple of ``B``).
    """
    tokens, num_groups = _positive("tokens", tokens), _positive("num_groups", num_groups)
    block_size = _block_size(block_size)
    return (tokens + min(num_groups, tokens) * (block_size - 1)) // block_size * block_size


@dataclass(frozen=True, eq=False)
class DeviceLayout:
    """Per-row :func:`~sparseattn.layouts.partition_layout` of ``N`` rows, padded to static shapes.

    Row ``r`` holds the layout of ``labels[r]``; its first ``num_slots[r]`` slots (``num_slots[r] /
    block_size`` blocks) are the host layout's, the rest is padding (``valid`` False,
    ``block_group`` -1, zero counts).

    Attributes:
        block_size: slots per block (a multiple of 16).
        token_slot: int64 ``[N, tokens]``, the slot of each token.
        valid: bool ``[N, max_slots]``, slot holds a token.
        block_group: int64 ``[N, max_blocks]``, the group of each block, -1 past the row's blocks.
        num_slots: int64 ``[N]``, slots of each row's layout (a multiple of ``block_size``).
        group_sizes: int64 ``[N, num_groups]``, tokens per group.
        block_rows: int64 ``[N, max_blocks]``, valid slots per block (``BlockLayout.valid_rows``).
        block_pages: int64 ``[N, max_blocks]``, live 16-row pages per block (``BlockLayout.live_pages``).
    """

    block_size: int
    token_slot: torch.Tensor
    valid: torch.Tensor
    block_group: torch.Tensor
    num_slots: torch.Tensor
    group_sizes: torch.Tensor
    block_rows: torch.Tensor
    block_pages: torch.Tensor

    @property
    def max_slots(self) -> int:
        return self.valid.shape[1]

    def used_slots(self) -> torch.Tensor:
        """bool ``[N · max_slots]``: the slots of each row's blocks (its first ``num_slots``), flattened as
        the rows of :func:`scatter_rows`' output; the plans read no others."""
        slots = torch.arange(self.max_slots, device=self.num_slots.device)
        return (slots < self.num_slots.unsqueeze(1)).reshape(-1)

    def filled_slots(self) -> torch.Tensor:
        """bool ``[N · max_slots]``: the slots that hold a token (``valid``), flattened as the rows of
        :func:`scatter_rows`' output; the kernels read no others (their producers zero a page's rows past
        its tokens), so a move to slots need write only these."""
        return self.valid.reshape(-1)

    @property
    def max_blocks(self) -> int:
        return self.block_group.shape[1]


def partition_slots(
    labels: torch.Tensor, num_groups: int, block_size: int = 128, max_slots: int | None = None
) -> DeviceLayout:
    """The slot layout of :func:`~sparseattn.layouts.partition_layout` for every row of ``labels``.

    Args:
        labels: int ``[N, tokens]``, the group of each token, in ``[0, num_groups)`` (not checked).
        num_groups: groups per row; groups are laid out one after another in id order, each padded to
            a whole number of blocks (empty groups take no slots); tokens keep their relative order
            inside a group.
        block_size: slots per block, a multiple of 16.
        max_slots: the static slot count of every row (a multiple of ``block_size``); default and
            minimum :func:`max_slots_bound` ``(tokens, num_groups, block_size)``, which always
            suffices (so no labels can overflow it).

    Returns a :class:`DeviceLayout`, with no host synchronisation: the slots from counts of each group per
    chunk of tokens on an sm_90 GPU (:data:`LAYOUT_SLOTS` ``"counts"``), else from one stable sort per row,
    the blocks' groups, rows and pages and the valid slots from the group sizes (a group fills its first
    slots).
    """
    if not isinstance(labels, torch.Tensor) or labels.ndim != 2:
        raise ValueError(f"labels must be a tensor [N, tokens], got {getattr(labels, 'shape', type(labels))}")
    if labels.is_floating_point() or labels.dtype == torch.bool or labels.is_complex():
        raise TypeError(f"labels must hold integers, got {labels.dtype}")
    n, t = labels.shape
    g = _positive("num_groups", num_groups)
    b = _block_size(block_size)
    bound = max_slots_bound(t, g, b)
    if max_slots is None:
        max_slots = bound
    if isinstance(max_slots, bool) or not isinstance(max_slots, int) or max_slots % b or max_slots < bound:
        raise ValueError(
            f"max_slots must be a multiple of block_size={b} and at least {bound} "
            f"(max_slots_bound({t}, {g}, {b})), got {max_slots!r}"
        )
    dev = labels.device
    _check_form("LAYOUT_SLOTS", "SPARSEATTN_SVG2_LAYOUT_SLOTS")
    _check_form("LAYOUT_BLOCKS", "SPARSEATTN_SVG2_LAYOUT_BLOCKS")
    counting = LAYOUT_SLOTS == "counts" and _counts_available(labels, g)
    if counting:
        from .kernels import group_slots

        labels = labels.contiguous()
        counts = group_slots.chunk_counts(labels, g)
        sizes = counts.sum(1)
    else:
        sorted_labels, order = _sorted_rows(labels, g)
        # each group's first position in its row's sorted labels (and the row's end): the sizes without an
        # atomic per token
        bounds = torch.arange(g + 1, device=dev, dtype=sorted_labels.dtype).expand(n, -1).contiguous()
        first = torch.searchsorted(sorted_labels, bounds)
        sizes = first.diff(dim=1)
    from . import layout_blocks

    if LAYOUT_BLOCKS == "triton" and layout_blocks.available(sizes):  # two kernels, the same arrays
        sizes = sizes.to(torch.int64)
        group_start, block_end, num_slots = layout_blocks.group_starts(sizes, b)
        if counting:
            token_slot = group_slots.token_slots(labels, g, group_start, counts)
        else:
            token_slot = _token_slots(sorted_labels, order, first[:, :-1], group_start)
        arrays = layout_blocks.block_arrays(sizes, block_end, b, max_slots // b)
        block_group, block_rows, block_pages, valid = arrays
        return DeviceLayout(b, token_slot, valid, block_group, num_slots, sizes, block_rows, block_pages)
    blocks = (sizes + (b - 1)) // b
    block_end = blocks.cumsum(1)  # [N, G]
    group_first_block = block_end - blocks
    if counting:
        token_slot = group_slots.token_slots(labels, g, group_first_block * b, counts)
    else:
        token_slot = _token_slots(sorted_labels, order, first[:, :-1], group_first_block * b)
    max_blocks = max_slots // b
    block_ids = torch.arange(max_blocks, device=dev).expand(n, max_blocks).contiguous()
    block_group = torch.searchsorted(block_end, block_ids, right=True)
    inside = block_group < g
    group = block_group.clamp(max=g - 1)
    # a group's tokens fill its first slots: all its blocks are full but the last, which holds a prefix
    first_block = group_first_block.gather(1, group)
    block_rows = (sizes.gather(1, group) - (block_ids - first_block) * b).clamp(0, b)
    block_rows = torch.where(inside, block_rows, 0)
    block_group = torch.where(inside, block_group, -1)
    block_pages = (block_rows + (PAGE_ROWS - 1)) // PAGE_ROWS
    row_in_block = torch.arange(b, device=dev)
    valid = (row_in_block < block_rows.unsqueeze(-1)).view(n, max_slots)
    return DeviceLayout(
        b, token_slot, valid, block_group, block_end[:, -1] * b, sizes, block_rows, block_pages
    )


def _counts_available(labels: torch.Tensor, num_groups: int) -> bool:
    """Whether :mod:`sparseattn.kernels.group_slots` takes these labels (int64 on an sm_90 GPU, its bounds)."""
    from .kernels import group_slots

    return (
        group_slots.available(labels)
        and num_groups <= group_slots.MAX_GROUPS
        and 0 < labels.shape[0] <= group_slots.MAX_ROWS
        and labels.shape[1] > 0
    )


def _sorted_rows(labels: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_labels, order)`` ``[N, tokens]``: each row's labels sorted stably (int16 keys where the groups
    fit, int32 else: a radix sort takes a pass per key byte) and the tokens in that order (int64)."""
    # int16 while it also holds num_groups itself, the last bound partition_slots searches for
    narrow = labels.to(torch.int16 if num_groups < 2**15 - 1 else torch.int32)
    return torch.sort(narrow, dim=1, stable=True)


def _token_slots(
    sorted_labels: torch.Tensor, order: torch.Tensor, first: torch.Tensor, group_start: torch.Tensor
) -> torch.Tensor:
    """int64 ``[N, tokens]``: each token's slot in :func:`partition_slots`, its group's first slot
    (``group_start`` ``[N, G]``) plus its rank in the group, from the rows' stable sort (:func:`_sorted_rows`)
    and each group's first sorted position ``first`` ``[N, G]``: the ``i``-th sorted token's slot is
    ``i + group_start − first`` of its group."""
    t = sorted_labels.shape[1]
    shift = (group_start - first).gather(1, sorted_labels.long())
    slots = torch.arange(t, device=sorted_labels.device).unsqueeze(0) + shift
    return torch.empty_like(order).scatter_(1, order, slots)


def slot_rows(token_slot: torch.Tensor, max_slots: int) -> torch.Tensor:
    """int64 ``[N, tokens]``: each token's row in the slots flattened to ``[N · max_slots, d]``."""
    n = token_slot.shape[0]
    return token_slot.long() + torch.arange(n, device=token_slot.device).unsqueeze(1) * max_slots


def scatter_rows(
    x: torch.Tensor,
    rows: torch.Tensor,
    total: int,
    used: torch.Tensor | None = None,
    sums: torch.Tensor | None = None,
    sum_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[total, d]``: the rows of ``x`` ``[R, d]`` copied to rows ``rows`` ``[R]`` (distinct) of zeros.
    One index per row, not per element; differentiable in ``x``.

    With ``used`` (bool ``[total]``, e.g. :meth:`DeviceLayout.used_slots`) and Triton on ``x``'s device,
    rows outside ``used`` are left unwritten (:func:`sparseattn.slot_copy.rows_to_slots`: one pass, no
    zero fill of the static bound's unused slots); otherwise every other row is zero (``index_copy``).
    With ``sums`` (float32 ``[S, d]``) and ``sum_index`` (int32 ``[total]``, each output row's sums row or
    -1, e.g. :func:`slot_sum_index`), every row of ``x`` is also added into its target's sums row, in
    place (in the same pass on the Triton path)."""
    from . import slot_copy

    if used is not None and slot_copy.available(x):
        return slot_copy.rows_to_slots(x, rows, used, sums, sum_index)
    if sums is not None:
        target = sum_index.long()[rows]
        keep = target >= 0
        sums.index_add_(0, target[keep], x.detach()[keep].float())
    return x.new_zeros(total, x.shape[-1]).index_copy(0, rows, x)


def scatter_to_slots(
    x: torch.Tensor,
    token_slot: torch.Tensor,
    max_slots: int,
    used: torch.Tensor | None = None,
    sums: torch.Tensor | None = None,
    sum_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[N, max_slots, d]``: token-ordered ``x`` ``[N, tokens, d]`` moved to the slots ``token_slot``
    ``[N, tokens]``; padding slots are zero, or with ``used`` (bool ``[N · max_slots]``) those outside it
    may be left unwritten; ``sums`` and ``sum_index`` as :func:`scatter_rows`. Differentiable."""
    n, t, d = x.shape
    rows = slot_rows(token_slot, max_slots).reshape(-1)
    return scatter_rows(x.reshape(n * t, d), rows, n * max_slots, used, sums, sum_index).view(n, max_slots, d)


def slot_sum_index(layout: DeviceLayout) -> torch.Tensor:
    """int32 ``[N · max_slots]``: the row of each slot's group in a ``[N · num_groups, d]`` sums matrix
    (``n · num_groups + group``), -1 past each row's blocks: :func:`scatter_to_slots`' ``sum_index`` for
    the groups' sums."""
    n, g = layout.group_sizes.shape
    row = torch.arange(n, device=layout.block_group.device).unsqueeze(1) * g
    per_block = torch.where(layout.block_group >= 0, layout.block_group + row, -1)
    return per_block.repeat_interleave(layout.block_size, dim=1).reshape(-1).to(torch.int32)


def gather_from_slots(y: torch.Tensor, token_slot: torch.Tensor) -> torch.Tensor:
    """``[N, tokens, d]``: slot-ordered ``y`` ``[N, slots, d]`` back in token order (padding dropped)."""
    n, s, d = y.shape
    rows = slot_rows(token_slot, s).reshape(-1)
    return y.reshape(n * s, d).index_select(0, rows).view(n, token_slot.shape[1], d)


# --- selection -------------------------------------------------------------------------------------
def svg2_select(
    q_centroids: torch.Tensor,
    k_centroids: torch.Tensor,
    k_sizes: torch.Tensor,
    head_dim: int,
    top_p: float,
    min_fraction: float,
) -> torch.Tensor:
    """bool ``[N, q_clusters, k_clusters]``: SVG2's cluster pairs, the rule of
    :func:`sparseattn.builders.svg2_select` on every row.

    For Q cluster ``i`` of row ``r``: ``p_ij ∝ k_sizes[r, j] · exp(qc_i · kc_j / sqrt(head_dim))`` over
    non-empty K clusters; keep the smallest set of highest ``p`` whose sum reaches ``top_p``, and at
    least ``ceil(min_fraction · non-empty K clusters)``; among equal ``p`` the lower index first.
    Empty K clusters are never selected (nor is anything in a row without non-empty K clusters).

    ``q_centroids`` ``[N, q_clusters, d]``, ``k_centroids`` ``[N, k_clusters, d]``, ``k_sizes`` int
    ``[N, k_clusters]``. Computed in float64 when ``q_centroids`` is float64 (on a device Triton runs on,
    by :func:`sparseattn.cluster_select.select_mask`, one program per Q cluster), else in float32.
    """
    from . import cluster_select

    dots, bias, least = selection_inputs(q_centroids, k_centroids, k_sizes, min_fraction)
    if dots.dtype == torch.float64 and cluster_select.available(dots):  # one program per Q cluster
        return cluster_select.select_mask(dots, bias, head_dim, top_p, least)
    return _select_by_sort(dots, bias, head_dim, top_p, least)


def selection_inputs(q_centroids, k_centroids, k_sizes, min_fraction: float):
    """What both forms of :func:`svg2_select` start from: ``dots`` ``[N, Cq, Ck]`` (the centroids' dot
    products, float64 when ``q_centroids`` is, else float32), ``bias`` ``[N, Ck]`` (``log(max(size, 1))``
    of a live K cluster, ``-inf`` of an empty one) and ``least`` int64 ``[N]`` (the fewest clusters a Q
    cluster keeps: ``ceil(min_fraction · live K clusters)``)."""
    dtype = torch.float64 if q_centroids.dtype == torch.float64 else torch.float32
    qc, kc = q_centroids.to(dtype), k_centroids.to(dtype)
    alive = k_sizes > 0  # [N, Ck]
    n_alive = alive.sum(-1)  # [N]
    least = torch.ceil(min_fraction * n_alive.to(torch.float64) - 1e-9).long().minimum(n_alive)
    bias = k_sizes.to(dtype).clamp_min(1).log().masked_fill(~alive, -math.inf)
    return torch.bmm(qc, kc.transpose(1, 2)), bias, least


def _select_by_sort(dots, bias, head_dim: int, top_p: float, least):
    """:func:`svg2_select` in torch from :func:`selection_inputs`: a sort of every row's probabilities (the
    CPU path and the Triton kernel's reference)."""
    alive = torch.isfinite(bias)  # [N, Ck]
    n_alive = alive.sum(-1, keepdim=True)  # [N, 1]
    least = least.unsqueeze(-1)
    logits = dots / math.sqrt(head_dim) + bias.unsqueeze(1)
    logits = logits.masked_fill(~alive.unsqueeze(1), -math.inf)
    top = logits.amax(-1, keepdim=True)
    p = (logits - torch.where(torch.isfinite(top), top, 0.0)).exp()
    p = p / p.sum(-1, keepdim=True)  # a row without live K clusters: 0/0, selects nothing below
    descending = p.sort(-1, descending=True).values
    cum = descending.cumsum(-1)
    keep = ((cum < top_p * (1 - 1e-12)).sum(-1) + 1).minimum(n_alive)  # [N, Cq]
    keep = keep.maximum(least)
    last = descending.gather(-1, (keep - 1).clamp_min(0).unsqueeze(-1))
    above = (p > last) & alive.unsqueeze(1)
    tied = (p == last) & alive.unsqueeze(1)
    tied_needed = keep - above.sum(-1)
    chosen = above | (tied & (tied.cumsum(-1) <= tied_needed.unsqueeze(-1)))
    return chosen & (keep > 0).unsqueeze(-1)


def cluster_block_mask(
    cluster_mask: torch.Tensor, q_block_group: torch.Tensor, k_block_group: torch.Tensor
) -> torch.Tensor:
    """bool ``[N, q_max_blocks, k_max_blocks]``: block pair ``(i, j)`` is selected when the pair of
    their clusters is (``cluster_mask`` bool ``[N, q_clusters, k_clusters]``; ``q_block_group`` /
    ``k_block_group`` int ``[N, max_blocks]`` from :class:`DeviceLayout`). Blocks with group -1 (past a
    row's layout) are never selected; every other block of a partition layout holds a token.

    On a device Triton runs on, one kernel writes it (:func:`sparseattn.cluster_blocks.block_mask`);
    elsewhere two gathers over the expanded groups."""
    from . import cluster_blocks

    if cluster_blocks.available(cluster_mask):
        return cluster_blocks.block_mask(cluster_mask, q_block_group, k_block_group)
    return _block_mask_by_gathers(cluster_mask, q_block_group, k_block_group)


def _block_mask_by_gathers(cluster_mask, q_block_group, k_block_group):
    """:func:`cluster_block_mask` in torch: two gathers over the expanded groups (the CPU path and the
    Triton kernel's reference)."""
    qg, kg = q_block_group.long(), k_block_group.long()
    out = cluster_pair_mask(cluster_mask, qg.clamp_min(0), kg.clamp_min(0))
    return out & (qg >= 0).unsqueeze(-1) & (kg >= 0).unsqueeze(1)


def cluster_pair_mask(
    cluster_mask: torch.Tensor, q_groups: torch.Tensor, k_groups: torch.Tensor
) -> torch.Tensor:
    """bool ``[N, A, B]``: whether the pair of clusters of ``q_groups[:, a]`` and ``k_groups[:, b]`` is
    selected (``cluster_mask`` bool ``[N, q_clusters, k_clusters]``; groups int ``[N, A]`` / ``[N, B]`` in
    range: tokens' labels, or blocks' groups)."""
    n, _, ck = cluster_mask.shape
    a, b = q_groups.shape[1], k_groups.shape[1]
    rows = cluster_mask.gather(1, q_groups.long().unsqueeze(-1).expand(n, a, ck))  # [N, A, Ck]
    return rows.gather(2, k_groups.long().unsqueeze(1).expand(n, a, b))


def selected_pair_fraction(step: SVG2Step) -> torch.Tensor:
    """float64 ``[N]``: the fraction of each row's (query, key) token pairs whose cluster pair ``step``
    selected (its useful density: 1.0 is dense attention)."""
    n, qc, _ = step.cluster_mask.shape
    q_sizes = torch.zeros(n, qc, dtype=torch.float64, device=step.q_labels.device)
    q_sizes.scatter_add_(1, step.q_labels, torch.ones_like(step.q_labels, dtype=torch.float64))
    pairs = torch.einsum("nij,ni,nj->n", step.cluster_mask.double(), q_sizes, step.k_sizes.double())
    return pairs / (step.q_labels.shape[1] * step.k_labels.shape[1])


# --- one call --------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class SVG2Step:
    """What :func:`svg2_partition_step` computes for one attention call (``N`` rows).

    Attributes:
        q_labels, k_labels: int64 ``[N, q_tokens]`` / ``[N, k_tokens]``, the cluster of each token.
        q_centroids, k_centroids: float32 ``[N, clusters, d]``, the k-means centroids (pass them as
            ``q_init`` / ``k_init`` to warm-start the next call).
        q_layout, k_layout: the :class:`DeviceLayout` of each side (``token_slot``, ``valid``,
            ``block_group``, ...).
        k_sizes: int64 ``[N, k_clusters]``, tokens per K cluster.
        cluster_mask: bool ``[N, q_clusters, k_clusters]``, the selected cluster pairs.
        block_mask: bool ``[N, q_max_blocks, k_max_blocks]``, the selected block pairs
            (:func:`cluster_block_mask`, made on first use: the forward's planner by clusters,
            :func:`~sparseattn.planning.dynamic_layouts.cluster_forward_work_list`, does not need it).
    """

    q_labels: torch.Tensor
    k_labels: torch.Tensor
    q_centroids: torch.Tensor
    k_centroids: torch.Tensor
    q_layout: DeviceLayout
    k_layout: DeviceLayout
    k_sizes: torch.Tensor
    cluster_mask: torch.Tensor

    @functools.cached_property
    def block_mask(self) -> torch.Tensor:
        return cluster_block_mask(self.cluster_mask, self.q_layout.block_group, self.k_layout.block_group)

    def forward_work_list(self, plan: str = "clusters", rows_per_chunk: int = 4):
        """The KPage forward's work list of this step's layouts and selection: ``plan="clusters"`` one
        stream per Q cluster from the cluster mask
        (:func:`~sparseattn.planning.dynamic_layouts.cluster_forward_work_list`), ``"blocks"`` from the
        block mask (:func:`~sparseattn.planning.dynamic_layouts.forward_work_list`); the same steps."""
        from .planning import dynamic_layouts as dl

        if self._planned_by_clusters(plan):
            return dl.cluster_forward_work_list(*self._group_args(), rows_per_chunk=rows_per_chunk)
        ql, kl = self.q_layout, self.k_layout
        return dl.forward_work_list(
            ql.block_rows, kl.block_rows, self.block_mask, ql.block_size, rows_per_chunk=rows_per_chunk
        )

    def backward_plan(self, plan: str = "clusters", rows_per_chunk: int = 4):
        """The KPage backward's K/V-owned plan of this step, by clusters
        (:func:`~sparseattn.planning.dynamic_layouts.cluster_backward_plan`) or from the block mask
        (:func:`~sparseattn.planning.dynamic_layouts.backward_plan`), as :meth:`forward_work_list`."""
        from .planning import dynamic_layouts as dl

        if self._planned_by_clusters(plan):
            return dl.cluster_backward_plan(*self._group_args(), rows_per_chunk=rows_per_chunk)
        ql, kl = self.q_layout, self.k_layout
        return dl.backward_plan(
            ql.block_rows, kl.block_rows, self.block_mask, ql.block_size, rows_per_chunk=rows_per_chunk
        )

    @staticmethod
    def _planned_by_clusters(plan: str) -> bool:
        if plan not in ("blocks", "clusters"):
            raise ValueError(f"plan must be 'blocks' or 'clusters', got {plan!r}")
        return plan == "clusters"

    def _group_args(self):
        """The planners by groups' arguments up to ``block_size``."""
        ql, kl = self.q_layout, self.k_layout
        return (
            ql.block_rows,
            kl.block_rows,
            ql.block_group,
            kl.block_group,
            self.cluster_mask,
            ql.block_size,
        )


def svg2_partition_step(
    q: torch.Tensor,
    k: torch.Tensor,
    q_clusters: int,
    k_clusters: int,
    block_size: int,
    top_p: float,
    min_fraction: float,
    iters: int,
    q_init: torch.Tensor | None = None,
    k_init: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    assign: str = "auto",
    final_assign: bool = True,
    mark=None,
) -> SVG2Step:
    """SVG2's clustering, partition and selection for ``q`` ``[N, q_tokens, d]`` and ``k``
    ``[N, k_tokens, d]``, as :func:`sparseattn.builders.svg2_graph` does per head on the host.

    :func:`kmeans` of each side (``iters`` Lloyd steps from ``q_init`` / ``k_init``, else k-means++
    seeds from ``generator``, Q first; ``assign`` and ``final_assign`` as there: ``final_assign=False``
    is SVG2's own pairing of labels and centroids, one assignment and one pass over the tokens fewer),
    :func:`partition_slots` of the labels (default ``max_slots``), :func:`svg2_select` on the float32
    cluster means of the labels (as the host's :func:`~sparseattn.builders.group_means`) in float64 with
    ``head_dim = d`` (the block mask, :func:`cluster_block_mask`, on first use of the step's
    ``block_mask``). ``mark(part)``, when given, is called after
    ``"kmeans_q"``, ``"kmeans_k"`` and ``"layouts_select"`` (timing hooks).
    """
    mark = mark or (lambda part: None)
    fit = dict(assign=assign, final_assign=final_assign)
    q_fit, k_fit = _fit_sides(q, k, q_clusters, k_clusters, iters, q_init, k_init, generator, fit, mark)
    q_layout = partition_slots(q_fit[0], q_clusters, block_size)
    k_layout = partition_slots(k_fit[0], k_clusters, block_size)
    if final_assign:  # the labels moved after the last step: their clusters' means take another pass
        q_means, _ = cluster_means(q, q_fit[0], q_clusters)
        k_means, k_sizes = cluster_means(k, k_fit[0], k_clusters)
    else:  # the last step's sums are the labels' clusters
        q_means, _ = _means(*q_fit[2:])
        k_means, k_sizes = _means(*k_fit[2:])
    step = _selected_step(q_fit, k_fit, (q_layout, k_layout), q_means, k_means, k_sizes, top_p, min_fraction)
    mark("layouts_select")
    return step


def _fit_sides(q, k, q_clusters, k_clusters, iters, q_init, k_init, generator, fit: dict, mark, after_q=None):
    """:func:`lloyd` of each side (Q first), ``mark`` after each; ``after_q(q_fit)`` between the two."""
    _check_rows("q", q)
    _check_rows("k", k)
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {list(q.shape)} and k {list(k.shape)} must agree in N and d")
    q_fit = lloyd(q, q_clusters, iters, q_init, generator, **fit)
    mark("kmeans_q")
    if after_q is not None:
        after_q(q_fit)
    k_fit = lloyd(k, k_clusters, iters, k_init, generator, **fit)
    mark("kmeans_k")
    return q_fit, k_fit


def _selected_step(q_fit, k_fit, layouts, q_means, k_means, k_sizes, top_p, min_fraction) -> SVG2Step:
    """The step of fitted sides and their layouts: SVG2's selection on the clusters' means."""
    q_layout, k_layout = layouts
    mask = svg2_select(q_means.double(), k_means.double(), k_sizes, q_means.shape[2], top_p, min_fraction)
    return SVG2Step(q_fit[0], k_fit[0], q_fit[1], k_fit[1], q_layout, k_layout, k_sizes, mask)


@dataclass(frozen=True, eq=False)
class FittedSides:
    """Both sides' k-means, their last step's labels without sums, and their layouts: what
    :func:`fit_for_slots` hands to the tokens' move (``(labels, centroids)`` per side)."""

    q_fit: tuple
    k_fit: tuple
    q_layout: DeviceLayout
    k_layout: DeviceLayout
    #: with :func:`fit_for_slots`' ``k_beside``: the join of K's layout, built on a side stream (its tensors
    #: are read on the caller's stream only after :meth:`k_ready`); empty once joined or without it
    k_join: list = field(default_factory=list)

    def k_ready(self) -> None:
        """Make the caller's stream wait for K's layout where it is built beside (once; else nothing)."""
        while self.k_join:
            self.k_join.pop()()

    def sums_buffers(self, d: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed float32 ``[N · clusters, d]`` sums of each side, for :func:`scatter_rows`' ``sums``."""
        n, qc = self.q_layout.group_sizes.shape
        kc = self.k_layout.group_sizes.shape[1]
        return tuple(torch.zeros(n * c, d, dtype=torch.float32, device=device) for c in (qc, kc))


def fit_for_slots(
    q,
    k,
    q_clusters,
    k_clusters,
    block_size,
    iters,
    q_init=None,
    k_init=None,
    generator=None,
    assign="auto",
    mark=None,
    k_beside: bool = False,
) -> FittedSides:
    """The first half of :func:`svg2_step_in_slots`: :func:`lloyd` of each side whose last step assigns
    labels only, and their :func:`partition_slots`. ``mark`` after ``"kmeans_q"``, ``"kmeans_k"``,
    ``"layouts"``. ``k_beside`` (on CUDA tensors with :data:`SIDE_STREAM`): K's layout is enqueued on the
    side stream and returned unjoined: read its tensors only after :meth:`FittedSides.k_ready` (what
    :func:`slots_and_step` does after q's move)."""
    mark = mark or (lambda part: None)
    fit = dict(assign=assign, final_assign=False, last_sums=False)
    beside = []  # with SIDE_STREAM: Q's layout on a side stream, beside K's k-means, and its join
    after_q = None
    if SIDE_STREAM and q.is_cuda:
        after_q = lambda q_fit: beside.append(_layout_beside(q_fit[0], q_clusters, block_size))
    q_fit, k_fit = _fit_sides(
        q, k, q_clusters, k_clusters, iters, q_init, k_init, generator, fit, mark, after_q
    )
    k_join = []
    if beside:
        q_lay, join = beside[0]
        if k_beside:  # Q's layout joined first: the side stream then builds K's behind it
            join()
            k_lay, late = _layout_beside(k_fit[0], k_clusters, block_size)
            k_join.append(late)
        else:
            k_lay = partition_slots(k_fit[0], k_clusters, block_size)
            join()
    else:
        q_lay = partition_slots(q_fit[0], q_clusters, block_size)
        k_lay = partition_slots(k_fit[0], k_clusters, block_size)
    mark("layouts")
    return FittedSides(q_fit, k_fit, q_lay, k_lay, k_join)


_SIDE_STREAMS: dict = {}


#: The side stream's priority (``SPARSEATTN_SVG2_SIDE_PRIORITY``): -1 (the default) a higher one than the
#: caller's default stream, so its blocks are scheduled before the caller's waiting blocks as SMs free up
#: (v42 hides 0.17 ms of the selection and plan where the default priority, 0, hid 0.05).
SIDE_PRIORITY = int(os.environ.get("SPARSEATTN_SVG2_SIDE_PRIORITY", "-1"))


def _side_stream(device) -> torch.cuda.Stream:
    side = _SIDE_STREAMS.get(device)
    if side is None:
        side = _SIDE_STREAMS[device] = torch.cuda.Stream(device, priority=SIDE_PRIORITY)
    return side


def _record_on(value, stream) -> None:
    """``record_stream(stream)`` of every tensor in ``value``: a tensor, a dataclass's fields, a tuple or list
    of them (nested)."""
    if isinstance(value, torch.Tensor):
        value.record_stream(stream)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _record_on(item, stream)
    elif hasattr(value, "__dataclass_fields__"):
        for f in fields(value):
            _record_on(getattr(value, f.name), stream)


def _beside(work, inputs, device):
    """``(result, join)``: ``work()`` enqueued on a side stream that starts after the work queued so far on the
    current stream; ``join()`` makes the current stream wait for it. The result's tensors are marked as used on
    the current stream (``record_stream``), ``inputs``' as used on the side stream, so the caching allocator
    reuses neither before both streams are done with it."""
    main = torch.cuda.current_stream(device)
    side = _side_stream(device)
    side.wait_stream(main)
    _record_on(inputs, side)
    with torch.cuda.stream(side):
        result = work()
    _record_on(result, main)
    return result, lambda: main.wait_stream(side)


def _layout_beside(labels: torch.Tensor, num_groups: int, block_size: int):
    """``(layout, join)``: :func:`partition_slots` of CUDA ``labels`` on a side stream (:func:`_beside`)."""
    return _beside(lambda: partition_slots(labels, num_groups, block_size), labels, labels.device)


def move_rows_to_slots(fitted: FittedSides, q, k, v, q_rows, k_rows, used=None):
    """``(qs, ks, vs, q_sums, k_sums)``: the rows of q ``[R_q, d]`` and of k, v ``[R_k, d]`` copied to rows
    ``q_rows`` / ``k_rows`` of the fitted sides' slots flattened to ``[N · max_slots, d]``
    (:func:`scatter_rows`), each side's cluster sums (float32 ``[N · clusters, d]``) taken on the way.
    ``used``: the ``(q, k)`` masks of the slots written (default :meth:`DeviceLayout.filled_slots`, the
    slots that hold a token; :meth:`DeviceLayout.used_slots` writes the padding inside the blocks as zeros).
    ``k_rows`` may be a function that makes them, called once K's layout is joined (:meth:`FittedSides.k_ready`,
    after q's move)."""
    qs, ks, q_sums, k_sums, k_rows = _move_qk(fitted, q, k, q_rows, k_rows, used)
    return qs, ks, _move_v(fitted, v, k_rows, used), q_sums, k_sums


def _written(layout: DeviceLayout, used, side: int) -> torch.Tensor:
    """The slots a move writes on one side (0: Q, 1: K): ``used[side]``, default the layout's filled slots."""
    return layout.filled_slots() if used is None else used[side]


def _move_qk(fitted: FittedSides, q, k, q_rows, k_rows, used):
    """:func:`move_rows_to_slots`' q and k with their sums: ``(qs, ks, q_sums, k_sums, k_rows)``; K's layout
    is joined (and ``k_rows`` made, where it is a function) after q's move."""
    q_lay, k_lay = fitted.q_layout, fitted.k_layout
    q_sums, k_sums = fitted.sums_buffers(q.shape[-1], q.device)
    qs = scatter_rows(q, q_rows, q_lay.valid.numel(), _written(q_lay, used, 0), q_sums, slot_sum_index(q_lay))
    fitted.k_ready()
    k_rows = k_rows() if callable(k_rows) else k_rows
    ks = scatter_rows(k, k_rows, k_lay.valid.numel(), _written(k_lay, used, 1), k_sums, slot_sum_index(k_lay))
    return qs, ks, q_sums, k_sums, k_rows


def _move_v(fitted: FittedSides, v, k_rows, used):
    """:func:`move_rows_to_slots`' v (no sums), after :func:`_move_qk` (K's layout joined, ``k_rows`` made)."""
    k_lay = fitted.k_layout
    return scatter_rows(v, k_rows, k_lay.valid.numel(), _written(k_lay, used, 1))


def slots_and_step(
    fitted: FittedSides,
    q,
    k,
    v,
    q_rows,
    k_rows,
    top_p: float,
    min_fraction: float,
    plan=None,
    used=None,
    beside: bool | None = None,
    mark=None,
):
    """``(qs, ks, vs, step, work)``: :func:`move_rows_to_slots` then :func:`step_from_slot_sums`, and with
    ``plan`` (``"clusters"`` or ``"blocks"``) the step's forward work list (:meth:`SVG2Step.forward_work_list`;
    else ``work`` is None). ``mark(part)`` after ``"to_slots"``, ``"select"`` and (with a plan) ``"plan_fwd"``.
    ``k_rows`` may be a function making them, called after q's move once K's layout is joined (a layout
    :func:`fit_for_slots` built beside, ``k_beside``).

    ``beside`` (default :data:`SELECT_BESIDE`), on CUDA tensors with a plan: q and k move first; the
    selection and the work list are then enqueued on a side stream while v moves on the caller's stream, which
    waits for them before the ``"to_slots"`` mark and the return (so what the caller queues next sees all
    five; ``"select"`` and ``"plan_fwd"`` then follow at once). The same tensors either way."""
    mark = mark or (lambda part: None)
    beside = SELECT_BESIDE if beside is None else beside
    if not (beside and plan is not None and q.is_cuda):
        qs, ks, vs, q_sums, k_sums = move_rows_to_slots(fitted, q, k, v, q_rows, k_rows, used)
        mark("to_slots")
        step = step_from_slot_sums(fitted, q_sums, k_sums, top_p, min_fraction)
        mark("select")
        work = None if plan is None else step.forward_work_list(plan)
    else:
        qs, ks, q_sums, k_sums, k_rows = _move_qk(fitted, q, k, q_rows, k_rows, used)

        def select_and_plan():
            step = step_from_slot_sums(fitted, q_sums, k_sums, top_p, min_fraction)
            return step, step.forward_work_list(plan)

        (step, work), join = _beside(select_and_plan, (q_sums, k_sums), q.device)
        vs = _move_v(fitted, v, k_rows, used)
        join()
        mark("to_slots")
        mark("select")
    if plan is not None:
        mark("plan_fwd")
    return qs, ks, vs, step, work


def _flat_rows(layout: DeviceLayout) -> torch.Tensor:
    """int64 ``[N · tokens]``: :func:`slot_rows` of token-ordered rows ``[N, tokens]`` flattened."""
    return slot_rows(layout.token_slot, layout.max_slots).reshape(-1)


def _per_row_slots(fitted: FittedSides, qs, ks, vs):
    """``qs`` as ``[N, q_slots, d]`` and ``ks``, ``vs`` as ``[N, k_slots, d]`` (views of the flat moves)."""
    n, d = fitted.q_layout.valid.shape[0], qs.shape[-1]
    q_shape, k_shape = (n, fitted.q_layout.max_slots, d), (n, fitted.k_layout.max_slots, d)
    return qs.view(q_shape), ks.view(k_shape), vs.view(k_shape)


def move_to_slots(fitted: FittedSides, q, k, v, used=None):
    """:func:`move_rows_to_slots` of token-ordered q, k, v ``[N, tokens, d]``: ``(qs, ks, vs, q_sums,
    k_sums)`` with ``qs`` ``[N, q_slots, d]`` and ``ks``, ``vs`` ``[N, k_slots, d]`` as
    :func:`scatter_to_slots` moves them."""
    d = q.shape[-1]
    flat = lambda x: x.reshape(-1, d)
    qs, ks, vs, q_sums, k_sums = move_rows_to_slots(
        fitted,
        flat(q),
        flat(k),
        flat(v),
        _flat_rows(fitted.q_layout),
        lambda: _flat_rows(fitted.k_layout),
        used,
    )
    return (*_per_row_slots(fitted, qs, ks, vs), q_sums, k_sums)


def step_from_slot_sums(fitted: FittedSides, q_sums, k_sums, top_p: float, min_fraction: float) -> SVG2Step:
    """The second half of :func:`svg2_step_in_slots`: from each side's cluster sums (float32 ``[N ·
    clusters, d]``, taken while its tokens moved to the layout's slots, :func:`slot_sum_index`) the means,
    the step's centroids (an empty cluster keeps the one it had) and SVG2's selection on the means."""
    from . import centroid_update

    _check_form("SELECT_MEANS", "SPARSEATTN_SVG2_SELECT_MEANS")
    fitted.k_ready()
    q_lay, k_lay = fitted.q_layout, fitted.k_layout
    n, qc = q_lay.group_sizes.shape
    kc = k_lay.group_sizes.shape[1]
    if SELECT_MEANS == "fused" and centroid_update.available(q_sums):  # one pass a side, the same bits
        sides = []
        for fit, lay, sums, c in ((fitted.q_fit, q_lay, q_sums, qc), (fitted.k_fit, k_lay, k_sums, kc)):
            sizes = lay.group_sizes.to(torch.int64)
            cent, means = centroid_update.selection_means(sums.view(n, c, -1), sizes, fit[1])
            sides.append(((fit[0], cent), means, sizes))
        (q_fit, q_means, _), (k_fit, k_means, k_sizes) = sides
        return _selected_step(q_fit, k_fit, (q_lay, k_lay), q_means, k_means, k_sizes, top_p, min_fraction)
    q_means, q_sizes = _means(q_sums.view(n, qc, -1), q_lay.group_sizes.float())
    k_means, k_sizes = _means(k_sums.view(n, kc, -1), k_lay.group_sizes.float())
    fitted_side = lambda f, means, sizes: (f[0], torch.where(sizes.unsqueeze(-1) > 0, means, f[1]))
    q_fit, k_fit = fitted_side(fitted.q_fit, q_means, q_sizes), fitted_side(fitted.k_fit, k_means, k_sizes)
    return _selected_step(q_fit, k_fit, (q_lay, k_lay), q_means, k_means, k_sizes, top_p, min_fraction)


def svg2_step_in_slots(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_clusters: int,
    k_clusters: int,
    block_size: int,
    top_p: float,
    min_fraction: float,
    iters: int,
    q_init: torch.Tensor | None = None,
    k_init: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    assign: str = "auto",
    mark=None,
    plan=None,
    beside: bool | None = None,
):
    """:func:`svg2_partition_step` with ``final_assign=False`` and the tokens' move to slots, in another
    order: ``(step, qs, ks, vs, work)`` with ``qs`` ``[N, q_slots, d]`` and ``ks``, ``vs`` ``[N, k_slots, d]``
    as :func:`scatter_to_slots` moves them (slots without a token unwritten where Triton runs) and with
    ``plan`` (``"clusters"`` or ``"blocks"``) the forward's work list (else None).

    The last Lloyd step of each side assigns labels only (:func:`fit_for_slots`); its clusters' sums
    are taken while q and k move to slots (each copied row added into its group's sums,
    :func:`slot_sum_index`), and their means, the step's centroids and the selection follow from them
    (:func:`step_from_slot_sums`; ``beside``: with the work list beside v's move, :func:`slots_and_step`).
    Same clusters, layouts and selection as :func:`svg2_partition_step` but for float32 summation order.
    ``mark(part)`` after ``"kmeans_q"``, ``"kmeans_k"``, ``"layouts"``, ``"to_slots"``, ``"select"`` and
    (with a plan) ``"plan_fwd"``."""
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape {list(k.shape)}, got {list(v.shape)}")
    beside = SELECT_BESIDE if beside is None else beside
    k_beside = K_LAYOUT_BESIDE and beside and plan is not None
    fitted = fit_for_slots(
        q, k, q_clusters, k_clusters, block_size, iters, q_init, k_init, generator, assign, mark, k_beside
    )
    d = q.shape[-1]
    flat = lambda x: x.reshape(-1, d)
    qs, ks, vs, step, work = slots_and_step(
        fitted,
        flat(q),
        flat(k),
        flat(v),
        _flat_rows(fitted.q_layout),
        lambda: _flat_rows(fitted.k_layout),  # after K's layout is joined
        top_p,
        min_fraction,
        plan,
        beside=beside,
        mark=mark,
    )
    return step, *_per_row_slots(fitted, qs, ks, vs), work
