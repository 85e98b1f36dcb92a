"""Torch interop: autograd ops over the KPage forward and backward kernels (torch bf16 CUDA tensors in
and out, no copies, on torch's current stream).

>>> o = sparseattn.torch.kpage_attention(q, k, v, graph)   # q, k, v: [batch, heads, slots, d] bf16
>>> o.backward(do)                                          # dq, dk, dv in q.grad, k.grad, v.grad

For selections made per call on the GPU (VSA's top-k, a learned selection): :func:`block_sparse_attention`
(top-k indices and counts, the VSA kernel's arguments) and :func:`block_sparse_attention_mask` (a block
mask) plan every call on the device (:mod:`sparseattn.planning.device`); :func:`vsa_topk` is VSA's
selection, :func:`tokens_to_slots` / :func:`slots_to_tokens` move activations into a layout's slot order.

Rows of padding slots of ``o`` are zero, and padding rows get zero gradients.
"""

from __future__ import annotations

import numpy as np
import torch


def kpage_attention(q, k, v, graph, route="auto", scale=None, deterministic=False):
    """Sparse attention output ``o`` (bf16 ``[batch, heads, q_slots, d]``) with autograd.

    Args:
        q, k, v: torch bf16 CUDA tensors ``[batch, heads, slots, d]`` in ``graph``'s slot layouts.
        graph: a :class:`~sparseattn.graph.SparseGraph` (its plans are built once and cached), or its
            :func:`~sparseattn.torch_ops.handle` (what a ``torch.compile``-traced caller passes).
        route: KPage route (``"auto"``, 0 = 64×256, 1 = 128×128, or ``"pair"``: 64-row blocks joined
            two by two in both passes, not with ``deterministic``; ``"auto"`` takes them where they pay:
            the backward on 64-row K/V blocks, the forward on VSA-like selections); scale: default
            ``1/sqrt(d)``.
        deterministic: gradients bit-identical from run to run (the Q-owned dQ pass, or dQ added in
            64-bit fixed point).

    A ``torch.library`` operator (``torch.ops.sparseattn.kpage_fwd``, its gradient ``kpage_bwd``):
    ``torch.compile`` traces it without a graph break and CUDA graphs capture it. An eager call that
    will be differentiated runs the same implementations behind a plain ``autograd.Function``
    (:class:`~sparseattn.torch_ops.KPageFunction`), whose backward costs the host about 250 µs less than
    the operator's autograd wrapper (``python -m sparseattn.host_cost``, ``host_layers`` records). An
    eager call without gradients on CUDA tensors runs the CUDA implementation itself (the operator's
    autograd wrapper alone costs the host more than a whole no-op operator).
    """
    from .graph import SparseGraph
    from .torch_ops import OPS, KPageFunction, _kpage_fwd_cuda, default_scale, handle

    if not isinstance(graph, (SparseGraph, int)):
        raise TypeError(f"graph must be a SparseGraph (or its handle), got {type(graph).__name__}")
    h = graph if isinstance(graph, int) else handle(graph)
    scale = default_scale(scale, q.shape[-1])
    if not torch.compiler.is_compiling():
        if _needs_grad(q, k, v):
            return KPageFunction.apply(q, k, v, h, str(route), scale, deterministic)
        if q.is_cuda:  # no gradient: the implementation itself, without the dispatcher's autograd wrapper
            return _kpage_fwd_cuda(q, k, v, h, str(route), scale, deterministic)[0]
    return OPS.kpage_fwd.default(q, k, v, h, str(route), scale, deterministic)[0]


# ---- dynamic selections: planned on the GPU per call --------------------------------------------------


def planner_for(q_layout, k_layout=None, **options):
    """The :class:`~sparseattn.planning.device.DevicePlanner` of a call site (layouts and options), built
    once and kept as long as ``q_layout`` lives."""
    from .planning.cache import cached
    from .planning.device import DevicePlanner

    k_layout = q_layout if k_layout is None else k_layout
    key = ("device planner", id(k_layout), tuple(sorted(options.items())))
    planner = cached(q_layout, key, lambda: DevicePlanner(q_layout, k_layout, **options))
    if planner.k is not k_layout:  # another layout took the id of a freed one
        planner = DevicePlanner(q_layout, k_layout, **options)
    return planner


def _needs_grad(*tensors) -> bool:
    """Whether autograd will ask for gradients (decided outside the Function: its forward runs without
    grad mode): the backward's plans are made only then."""
    return torch.is_grad_enabled() and any(x.requires_grad for x in tensors)


def _planner(layout, k_layout, kind, route, deterministic, max_selected):
    from .planning.device import DevicePlanner

    if isinstance(layout, (DevicePlanner, int)):  # a planner, or a planner's handle
        return layout
    return planner_for(
        layout, k_layout, kind=kind, route=route, deterministic=bool(deterministic), max_selected=max_selected
    )


def block_sparse_attention(
    q,
    k,
    v,
    layout,
    q2k_idx,
    q2k_num,
    *,
    k_layout=None,
    kind="kpage",
    route="auto",
    scale=None,
    deterministic=False,
):
    """Sparse attention of a top-k block selection made on the GPU, with autograd: the argument meaning of
    the VSA kernel's ``block_sparse_attn_from_indices(q, k, v, q2k_idx, q2k_num, variable_block_sizes)``,
    with the slot layout in place of the block sizes. Every call plans on the device (no host
    synchronisation; capturable in a CUDA graph).

    Args:
        q, k, v: torch bf16 CUDA ``[batch, heads, slots, d]`` in the layouts' slot order.
        layout: the :class:`~sparseattn.layouts.BlockLayout` of q (and of k, v unless ``k_layout``), e.g.
            ``video_layout(grid, (4, 4, 4), 64)`` for VSA's cubes (valid tokens a prefix of each cube, as
            ``variable_block_sizes`` says); or a :class:`~sparseattn.planning.device.DevicePlanner`.
        q2k_idx: int32 ``[batch, heads, q_blocks, topk]``: the K blocks each Q block selects.
        q2k_num: int32 ``[batch, heads, q_blocks]``: how many of them are used.
        kind, route: ``"kpage"`` (or ``"bsa"``) and its route (``"auto"``: by a rule of the layout).
        scale: softmax scale (default ``1/sqrt(d)``); deterministic: as :func:`kpage_attention`.

    Returns:
        ``(o, lse)``: ``o`` like ``q`` (padding rows zero), ``lse`` float32 ``[batch, heads, q_slots]``.
    """
    planner = _planner(layout, k_layout, kind, route, deterministic, None)
    return _dynamic(q, k, v, planner, q2k_idx, q2k_num, None, scale)


def block_sparse_attention_mask(
    q,
    k,
    v,
    layout,
    mask,
    *,
    k_layout=None,
    kind="kpage",
    route="auto",
    scale=None,
    deterministic=False,
    max_selected=None,
):
    """:func:`block_sparse_attention` of a block mask: bool ``[batch, heads, q_blocks, k_blocks]`` on the GPU.
    ``max_selected``: the most blocks a Q block selects (sizes the plan buffers; default all)."""
    planner = _planner(layout, k_layout, kind, route, deterministic, max_selected)
    return _dynamic(q, k, v, planner, None, None, mask, scale)


def _dynamic(q, k, v, planner, q2k_idx, q2k_num, mask, scale):
    """The ``dynamic_fwd`` operator: plans on the device (the backward's too when gradients are needed); an
    eager call without gradients on CUDA tensors runs its CUDA implementation directly."""
    from .torch_ops import OPS, _dynamic_fwd_cuda, default_scale, handle

    args = (
        q,
        k,
        v,
        q2k_idx,
        q2k_num,
        mask,
        planner if isinstance(planner, int) else handle(planner),
        default_scale(scale, q.shape[-1]),
    )
    needs_grad = _needs_grad(q, k, v)
    if not needs_grad and q.is_cuda and not torch.compiler.is_compiling():
        o, lse, _plans = _dynamic_fwd_cuda(*args, False)
    else:
        o, lse, _plans = OPS.dynamic_fwd.default(*args, needs_grad)
    return o, lse


def token_order_attention(
    q,
    k,
    v,
    graph_or_planner,
    q2k_idx=None,
    q2k_num=None,
    *,
    mask=None,
    route="auto",
    scale=None,
    kv_slots=False,
    kv_tma=False,
):
    """Sparse attention of token-ordered q, k, v (a model's ``[batch, tokens, heads, d]``): ``o`` of the same
    shape, as :func:`tokens_to_slots`, :func:`kpage_attention` (or :func:`block_sparse_attention`) and
    :func:`slots_to_tokens` give it.

    Args:
        q, k, v: bf16 ``[batch, tokens, heads, d]`` in token order (k, v may hold another token count).
        graph_or_planner: a :class:`~sparseattn.graph.SparseGraph` (a static selection; its layouts
            ``graph.q`` / ``graph.k`` place the tokens), or a
            :class:`~sparseattn.planning.device.DevicePlanner` (:func:`planner_for`) with the selection
            ``q2k_idx`` / ``q2k_num`` or ``mask``, as :func:`block_sparse_attention` /
            :func:`block_sparse_attention_mask` take them.
        route, scale: as :func:`kpage_attention` (``route`` for a graph; a planner has its own).
        kv_slots: calls without gradients move k and v to slot order (one launch) and run the Q/O token
            build, which streams their pages as the slot-order build does; q and o stay in token order.
        kv_tma: calls without gradients run the tile-major token build: nothing moves, k and v pages are read
            token-major by the tensor-memory accelerator. Needs a K layout whose every page holds consecutive
            tokens (tokens numbered tile-major: :func:`sparseattn.layouts.tile_major_tokens`).

    On CUDA, in bf16, without gradients, outside ``torch.compile``, the KPage forward's token-order build
    runs: it gathers each slot's row from its token and stores each output row to its token, so nothing is moved
    into or out of slot order (:func:`sparseattn.kernels.forward.torch_token_forward`). With gradients and
    :func:`token_backward_enabled` (opt-in: slower than the slot order), the backward's token-order build too
    (:func:`sparseattn.kernels.backward.torch_token_backward`; where it does not run the plan, the slot-order
    backward behind moves). Otherwise (gradients, a trace, the CPU) the three steps above run, with autograd.
    """
    from .graph import SparseGraph
    from .planning.device import DevicePlanner

    static = isinstance(graph_or_planner, SparseGraph)
    if not static and not isinstance(graph_or_planner, DevicePlanner):
        raise TypeError(
            f"graph_or_planner must be a SparseGraph or a DevicePlanner, got {type(graph_or_planner).__name__}"
        )
    if static and (q2k_idx is not None or q2k_num is not None or mask is not None):
        raise ValueError("a SparseGraph is the selection: pass no q2k_idx, q2k_num or mask with it")
    if not static and (q2k_idx is None) == (mask is None):
        raise ValueError("a DevicePlanner needs one selection: q2k_idx with q2k_num, or mask")
    q_layout, k_layout = graph_or_planner.q, graph_or_planner.k
    for name, x, layout in (("q", q, q_layout), ("k", k, k_layout), ("v", v, k_layout)):
        if x.dim() != 4 or x.shape[1] != layout.num_tokens:
            raise ValueError(
                f"{name} must be [batch, {layout.num_tokens} tokens (its layout's), heads, d], got "
                f"{tuple(x.shape)}"
            )
    eager_cuda = q.is_cuda and not torch.compiler.is_compiling()
    token_build = eager_cuda and q.dtype == k.dtype == v.dtype == torch.bfloat16
    if token_build and not _needs_grad(q, k, v):
        kv = "tma" if kv_tma else "slots" if kv_slots else "tokens"
        return _token_order_forward(q, k, v, graph_or_planner, q2k_idx, q2k_num, mask, route, scale, kv)
    if token_build and token_backward_enabled():
        return _TokenOrderFunction.apply(q, k, v, graph_or_planner, q2k_idx, q2k_num, mask, route, scale)
    qs = tokens_to_slots(q_layout, q)[0]
    ks, vs = tokens_to_slots(k_layout, k, v)
    if static:
        o = kpage_attention(qs, ks, vs, graph_or_planner, route=route, scale=scale)
    else:
        o, _ = _dynamic(qs, ks, vs, graph_or_planner, q2k_idx, q2k_num, mask, scale)
    return slots_to_tokens(q_layout, o).to(q.dtype)


def token_backward_enabled() -> bool:
    """``SPARSEATTN_TOKEN_BACKWARD=1``: differentiated :func:`token_order_attention` calls run the token-order
    backward build (opt-in: correct, but slower than the slot order with its moves)."""
    import os

    return os.environ.get("SPARSEATTN_TOKEN_BACKWARD", "0") == "1"


def _token_maps(graph_or_planner, device):
    from .torch_ops import _slot_indices

    return _slot_indices(graph_or_planner.q, device)[0], _slot_indices(graph_or_planner.k, device)[0]


class _TokenOrderFunction(torch.autograd.Function):
    """:func:`token_order_attention` with gradients: both passes in token order (the forward's plans, and
    for a planner the backward's, made in the forward and kept for the backward)."""

    @staticmethod
    def forward(ctx, q, k, v, graph_or_planner, q2k_idx, q2k_num, mask, route, scale):
        from .kernels.forward import torch_token_forward
        from .torch_ops import default_scale

        q, k, v = (x.contiguous() for x in (q, k, v))
        scale = default_scale(scale, q.shape[-1])
        # (a planner's plans, backward included, and their memory, kept until the backward)
        target, ctx.memory = _token_target(graph_or_planner, q, q2k_idx, q2k_num, mask, backward=True)
        maps = _token_maps(graph_or_planner, q.device)
        o, lse = torch_token_forward(q, k, v, target, *maps, route=route, scale=scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.target, ctx.maps, ctx.route, ctx.scale = target, maps, route, scale
        ctx.layouts = (graph_or_planner.q, graph_or_planner.k)
        return o

    @staticmethod
    def backward(ctx, do):
        from .kernels.backward import kpage_backward, torch_token_backward

        q, k, v, o, lse = ctx.saved_tensors
        do = do.contiguous()
        grads = torch_token_backward(
            q, k, v, o, lse, do, ctx.target, *ctx.maps, route=ctx.route, scale=ctx.scale
        )
        if grads is None:  # the token-order build does not run this plan: the slot-order one behind moves
            q_layout, k_layout = ctx.layouts
            qs, os_, dos = tokens_to_slots(q_layout, q, o, do)
            ks, vs = tokens_to_slots(k_layout, k, v)
            dqs, dks, dvs = kpage_backward(
                qs, ks, vs, os_, lse, dos, ctx.target, route=ctx.route, scale=ctx.scale
            )
            grads = (
                slots_to_tokens(q_layout, dqs),
                slots_to_tokens(k_layout, dks),
                slots_to_tokens(k_layout, dvs),
            )
        return (*grads, None, None, None, None, None, None)


def _token_target(graph_or_planner, q, q2k_idx, q2k_num, mask, backward: bool):
    """``(what the token-order kernels run, memory)``: a graph as it is, or a planner's plans of the
    selection (for token-ordered ``q`` ``[batch, tokens, heads, d]``) with the device memory holding them."""
    from .planning.device import DevicePlanner
    from .torch_ops import plan_selection

    if not isinstance(graph_or_planner, DevicePlanner):
        return graph_or_planner, None
    return plan_selection(
        graph_or_planner, q.shape[0], q.shape[2], q2k_idx, q2k_num, mask, backward, q.device
    )


def _token_order_forward(q, k, v, graph_or_planner, q2k_idx, q2k_num, mask, route, scale, kv="tokens"):
    """The no-gradient forward of :func:`token_order_attention`; ``kv``: how the kernel reads k and v
    (``"tokens"`` gathered by token, ``"slots"`` moved to slot order first, ``"tma"`` token-major pages)."""
    from .kernels.forward import torch_token_forward

    target, _memory = _token_target(graph_or_planner, q, q2k_idx, q2k_num, mask, backward=False)
    q_map, k_map = _token_maps(graph_or_planner, q.device)
    if kv == "tma":  # the tile-major token build: k and v read token-major, page by page
        return torch_token_forward(q, k, v, target, q_map, k_map, route=route, scale=scale, kv_tma=True)[0]
    if kv == "slots":  # the Q/O token build: k and v streamed from slot order
        ks, vs = tokens_to_slots(graph_or_planner.k, k, v)
        return torch_token_forward(
            q, ks, vs, target, q_map, None, route=route, scale=scale, kv_in_slots=True
        )[0]
    return torch_token_forward(q, k, v, target, q_map, k_map, route=route, scale=scale)[0]


def _layout_handle(layout) -> int:
    from .torch_ops import handle

    return layout if isinstance(layout, int) else handle(layout)


@torch.compiler.assume_constant_result
def _layout_sizes(layout_handle: int) -> tuple[int, int, int, int]:
    """``(blocks, block size, slots, blocks with valid rows)`` of a layout's handle (constants of a trace)."""
    from .torch_ops import resolve

    lay = resolve(layout_handle)
    return lay.num_blocks, lay.block_size, lay.num_slots, int(np.count_nonzero(lay.valid_rows))


@torch.compiler.assume_constant_result
def _block_weights(layout_handle: int, device):
    """``(1 / valid rows [1, 1, blocks, 1] (0 for empty blocks), alive [blocks])`` on ``device``, uploaded
    once per layout and device (a call then copies nothing from the host)."""
    from .planning.cache import cached
    from .torch_ops import resolve

    layout = resolve(layout_handle)

    def build():
        rows = torch.as_tensor(layout.valid_rows, dtype=torch.float32, device=device)
        alive = rows > 0
        return torch.where(alive, 1.0 / rows.clamp(min=1), torch.zeros_like(rows))[None, None, :, None], alive

    return cached(layout, ("block weights", str(device)), build)


def vsa_topk(q, k, layout, topk: int):
    """VSA's selection on the device: per (batch, head) and Q block, the ``topk`` K blocks of highest
    ``mean(q_block) · mean(k_block)`` (means over each block's valid tokens; blocks without valid rows
    never selected), as ``block_sparse_attention``'s ``(q2k_idx, q2k_num)``.

    Args:
        q, k: torch ``[batch, heads, slots, d]`` in ``layout``'s slot order, padding slots zero.
        layout: their :class:`~sparseattn.layouts.BlockLayout` (or its handle).
        topk: blocks per Q block (at most the blocks with valid rows).

    Returns:
        int32 ``q2k_idx [batch, heads, q_blocks, topk']`` and ``q2k_num [batch, heads, q_blocks]``, with
        ``topk' = min(topk, blocks with valid rows)``. A row's blocks come in ascending order from the
        Triton top-k (:mod:`sparseattn.vsa_select`, on CUDA tensors) and by descending score from
        ``torch.topk`` (elsewhere, and under ``torch.compile``); the sets are the same but for equal
        scores at the boundary. The scores are float32 under autocast too.
    """
    b, h, slots, d = q.shape
    lh = _layout_handle(layout)
    nb, bs, num_slots, _ = _layout_sizes(lh)
    if slots != num_slots or k.shape[2] != num_slots:
        raise ValueError(f"q and k must have the layout's {num_slots} slots, got {slots} and {k.shape[2]}")
    qm = q.reshape(b, h, nb, bs, d).sum(3, dtype=torch.float32)  # fp32 sums, no fp32 copy of q
    km = k.reshape(b, h, nb, bs, d).sum(3, dtype=torch.float32)
    return _topk_of_block_sums(qm, km, lh, topk)


def vsa_topk_tokens(q, k, layout, topk: int):
    """:func:`vsa_topk` of token-ordered ``[batch, tokens, heads, d]`` q and k (a model's layout): each
    block's sums gathered from its tokens (:func:`sparseattn.vsa_select.token_block_sums`, on CUDA
    tensors) instead of moving q and k into slot order first. The sums are the same up to float32
    rounding (another summation order), so near-tied scores may pick other blocks than :func:`vsa_topk`."""
    from . import vsa_select
    from .torch_ops import _slot_indices, resolve

    lh = _layout_handle(layout)
    bs = _layout_sizes(lh)[1]
    if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(
            f"q and k must be [batch, tokens, heads, d] alike, got {list(q.shape)} and {list(k.shape)}"
        )
    lay = resolve(lh)
    if q.shape[1] != lay.num_tokens or k.shape[1] != lay.num_tokens:
        raise ValueError(
            f"q and k must have the layout's {lay.num_tokens} tokens, got {q.shape[1]} and {k.shape[1]}"
        )
    if vsa_select.runs_on(q) and not torch.compiler.is_compiling():
        slot_token = _slot_indices(lay, q.device)[0]
        qm = vsa_select.token_block_sums(q, slot_token, bs)
        km = vsa_select.token_block_sums(k, slot_token, bs)
    else:  # (CPU, or a trace) moved to slots first
        return vsa_topk(*tokens_to_slots(lh, q, k), lh, topk)
    return _topk_of_block_sums(qm, km, lh, topk)


def _topk_of_block_sums(qm, km, layout_handle: int, topk: int):
    """VSA's top-k of per-block float32 sums ``[batch, heads, blocks, d]`` (see :func:`vsa_topk`)."""
    from . import vsa_select

    b, h, nb, _ = qm.shape
    _, _, _, alive_blocks = _layout_sizes(layout_handle)
    weight, alive = _block_weights(layout_handle, qm.device)
    qm, km = qm * weight, km * weight  # means over each block's valid tokens
    with torch.autocast(qm.device.type, enabled=False):  # float32 scores under autocast too
        scores = qm @ km.transpose(-1, -2)
    kept = min(int(topk), alive_blocks)
    # (a torch.compile trace takes torch.topk)
    if vsa_select.available(scores) and not torch.compiler.is_compiling():
        idx = vsa_select.row_topk(scores, alive, kept)
    else:
        idx = scores.masked_fill(~alive, float("-inf")).topk(kept, dim=-1).indices.to(torch.int32)
    num = torch.full((b, h, nb), kept, dtype=torch.int32, device=qm.device)
    return idx.contiguous(), num


# ---- tokens <-> slots ------------------------------------------------------------------------------


def tokens_to_slots(layout, *xs):
    """Token-ordered ``[B, tokens, heads, d]`` tensors in ``layout``'s slot order ``[B, heads, slots, d]``,
    bf16, padding slots zero, with autograd (one fused launch for bf16 CUDA tensors; torch ops otherwise;
    the operator ``torch.ops.sparseattn.tokens_to_slots``). ``layout``: a BlockLayout or its handle."""
    from .torch_ops import OPS

    return tuple(OPS.tokens_to_slots.default(list(xs), _layout_handle(layout)))


def slots_to_tokens(layout, y):
    """:func:`tokens_to_slots`'s inverse for one ``[B, heads, slots, d]`` tensor: ``[B, tokens, heads, d]``."""
    from .torch_ops import OPS

    return OPS.slots_to_tokens.default(y, _layout_handle(layout))


# ---- per-row layouts made per call (SVG2) ------------------------------------------------------------


def capture_cuda_graph(step, warmup: int = 2, before_capture=None):
    """``(graph, out)``: ``step()`` run ``warmup`` times on a side stream (what ``torch.cuda.graph`` asks
    before a capture), then ``before_capture()`` when given, then captured once; ``out`` is what the
    captured call returned, and every ``graph.replay()`` refills it from the tensors ``step`` reads."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    if before_capture is not None:
        before_capture()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def _slot_valid(block_rows, block_size: int):
    """bool ``[R, blocks · block_size]``: slot holds a row (each block's rows are a prefix)."""
    slot = torch.arange(block_size, device=block_rows.device)
    return (slot < block_rows.unsqueeze(-1)).reshape(block_rows.shape[0], -1)


def per_row_forward(q, k, v, work, scale):
    """``(o [R, q_slots, d], lse [R, q_slots])`` of a
    :class:`~sparseattn.planning.dynamic_layouts.DynamicWorkList` on ``q`` ``[R, q_slots, d]``, ``k``,
    ``v`` ``[R, k_slots, d]`` (contiguous): the KPage kernel on CUDA tensors, its numpy emulator (float64;
    small problems) on CPU tensors. Rows no item owns: ``o`` zero, ``lse`` ``-inf``."""
    if q.is_cuda:
        from .kernels.forward import torch_dynamic_forward

        o, lse = torch_dynamic_forward(q[None], k[None], v[None], work, scale)
        return o[0], lse[0]
    from .emulator import emulate_work_list

    o64, lse64 = emulate_work_list(work.to_work_list(), *(x[None].double().numpy() for x in (q, k, v)), scale)
    o = torch.from_numpy(o64[0]).nan_to_num(0.0).to(q.dtype)
    lse = torch.from_numpy(lse64[0]).nan_to_num(float("-inf"), float("-inf"), float("-inf"))
    return o, lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)


class _PerRowLayouts(torch.autograd.Function):
    """``mask``: the block mask, or with ``q_group`` / ``k_group`` (the blocks' groups) the groups' mask."""

    @staticmethod
    def forward(ctx, q, k, v, q_rows, k_rows, mask, q_group, k_group, block_size, scale, work):
        from .planning.dynamic_layouts import cluster_forward_work_list, forward_work_list

        q, k, v = (x.contiguous() for x in (q, k, v))
        if work is None:  # not planned by the caller
            if q_group is None:
                work = forward_work_list(q_rows, k_rows, mask, block_size, rows_per_chunk=4)
            else:
                work = cluster_forward_work_list(
                    q_rows, k_rows, q_group, k_group, mask, block_size, rows_per_chunk=4
                )
        o, lse = per_row_forward(q, k, v, work, scale)
        ctx.save_for_backward(q, k, v, o, lse, q_rows, k_rows, mask, q_group, k_group)
        ctx.block_size, ctx.scale = block_size, scale
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        from .kernels.bsa_backward import torch_plan_backward
        from .planning.dynamic_layouts import backward_plan, cluster_backward_plan

        q, k, v, o, lse, q_rows, k_rows, mask, q_group, k_group = ctx.saved_tensors
        if q_group is None:
            plan = backward_plan(q_rows, k_rows, mask, ctx.block_size, rows_per_chunk=4)
        else:
            plan = cluster_backward_plan(
                q_rows, k_rows, q_group, k_group, mask, ctx.block_size, rows_per_chunk=4
            )
        flat = lambda x: x.reshape(1, 1, -1, x.shape[-1])
        if q.is_cuda:
            grads = torch_plan_backward(
                flat(q),
                flat(k),
                flat(v),
                flat(o),
                lse.reshape(1, 1, -1),
                flat(do.contiguous()),
                plan.device_plan(),
                ctx.scale,
            )
        else:  # the backward kernel's numpy emulator on the same plan
            from .emulator import emulate_backward

            arrays = [flat(x).double().numpy() for x in (q, k, v, o, do)]
            lse64 = lse.reshape(1, 1, -1).double().numpy()
            out = emulate_backward(plan.tile_plan(), *arrays[:4], lse64, arrays[4], ctx.scale)
            grads = tuple(torch.from_numpy(g).to(q.dtype) for g in out)
        if grads is None:
            raise RuntimeError(
                "per_row_layout_attention: the backward's tensors are not what the kernel takes"
            )
        dq, dk, dv = (g.view(x.shape) for g, x in zip(grads, (q, k, v)))
        k_ok = _slot_valid(k_rows, ctx.block_size).unsqueeze(-1)  # pages no item owns are not written
        q_ok = _slot_valid(q_rows, ctx.block_size).unsqueeze(-1)
        zero = torch.zeros((), dtype=dq.dtype, device=dq.device)
        return (
            torch.where(q_ok, dq, zero),
            torch.where(k_ok, dk, zero),
            torch.where(k_ok, dv, zero),
            *(None,) * 8,
        )


def per_row_layout_attention(q, k, v, q_block_rows, k_block_rows, block_mask, block_size: int, scale=None):
    """KPage attention where every row (batch entry × head) has its own slot layout, made per call (SVG2's
    clusters padded to blocks, :func:`sparseattn.svg2_device.partition_slots`), with autograd: the forward
    work list and the backward's plan are built on the device each call
    (:mod:`sparseattn.planning.dynamic_layouts`).

    Args:
        q: bf16 CUDA ``[R, q_slots, d]``, each row in its layout's slot order; k, v: ``[R, k_slots, d]``
            (CPU tensors run the kernels' numpy emulators on the same plans: small problems, checks).
        q_block_rows, k_block_rows: int ``[R, q_slots / block_size]`` / ``[R, k_slots / block_size]``:
            the rows each block holds (a prefix; ``DeviceLayout.block_rows``).
        block_mask: bool ``[R, q_blocks, k_blocks]``: the selected block pairs.
        block_size: 64 or 128. scale: default ``1/sqrt(d)``.

    Returns:
        ``(o, lse)``: ``o`` like ``q`` (padding rows zero), ``lse`` float32 ``[R, q_slots]``.
    """
    scale = 1.0 / float(q.shape[-1]) ** 0.5 if scale is None else float(scale)
    return _PerRowLayouts.apply(
        q, k, v, q_block_rows, k_block_rows, block_mask, None, None, int(block_size), scale, None
    )


def per_row_cluster_attention(
    q,
    k,
    v,
    q_block_rows,
    k_block_rows,
    q_block_group,
    k_block_group,
    cluster_mask,
    block_size: int,
    scale=None,
    work=None,
):
    """:func:`per_row_layout_attention` of partition layouts from their groups' selection: block pair
    ``(i, j)`` of row ``r`` is selected when ``cluster_mask[r, q_block_group[r, i], k_block_group[r, j]]``
    is. The forward is planned by clusters
    (:func:`~sparseattn.planning.dynamic_layouts.cluster_forward_work_list`: one stream per Q cluster, no
    block mask), and so is the backward's plan
    (:func:`~sparseattn.planning.dynamic_layouts.cluster_backward_plan`).

    Args:
        q, k, v, q_block_rows, k_block_rows, block_size, scale: as :func:`per_row_layout_attention`.
        q_block_group, k_block_group: int ``[R, q_blocks]`` / ``[R, k_blocks]``: each block's group in
            ``[0, groups)``, ``-1`` past a row's layout (``DeviceLayout.block_group``).
        cluster_mask: bool ``[R, q_groups, k_groups]``: the selected pairs of groups.
        work: the forward's work list of these layouts and this selection, when the caller planned it
            (:func:`~sparseattn.svg2_device.slots_and_step`, e.g. beside the tokens' move to slots);
            default: planned here (the same list). Not checked against the layouts and selection.
    """
    scale = 1.0 / float(q.shape[-1]) ** 0.5 if scale is None else float(scale)
    return _PerRowLayouts.apply(
        q,
        k,
        v,
        q_block_rows,
        k_block_rows,
        cluster_mask,
        q_block_group,
        k_block_group,
        int(block_size),
        scale,
        work,
    )
