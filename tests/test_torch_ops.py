"""The ``torch.library`` operators (``torch.ops.sparseattn``) on the CPU: their CPU implementations against
the float64 reference, their fake implementations and autograd formulas (``torch.library.opcheck``), and
``torch.compile(fullgraph=True)`` of a random-init diffusers Wan transformer with the KPage processor
(no graph break, compiled equals eager). The CUDA implementations are tested in
``tests/gpu/test_torch_ops_gpu.py``. Skipped unless torch imports (diffusers for the model tests)."""

from __future__ import annotations

import gc

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from small_cases import random_ragged_graph

from sparseattn import reference
from sparseattn.torch_ops import OPS, handle, resolve


def _qkv(graph, batch=2, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = lambda n: (batch, graph.heads, n, d)
    q = torch.randn(shape(graph.q.num_slots), generator=g)
    k = torch.randn(shape(graph.k.num_slots), generator=g)
    v = torch.randn(shape(graph.k.num_slots), generator=g)
    return q, k, v


@pytest.mark.parametrize("seed", range(4), ids=lambda s: f"ragged{s}")
def test_kpage_op_cpu_matches_the_float64_reference(seed):
    import sparseattn.torch as st

    graph = random_ragged_graph(np.random.default_rng(seed))
    q, k, v = (x.requires_grad_() for x in _qkv(graph, seed=seed))
    o = st.kpage_attention(q, k, v, graph)
    do = torch.randn_like(o)
    o.backward(do)
    args = [x.detach().double().numpy() for x in (q, k, v)]
    o_ref, lse_ref = reference.attention_forward(*args, graph)
    grads = reference.attention_backward(*args, o_ref, lse_ref, do.double().numpy(), graph)
    valid = torch.tensor(graph.q.valid)
    np.testing.assert_allclose(o.detach()[:, :, valid].numpy(), o_ref[:, :, graph.q.valid], atol=2e-5)
    assert not o.detach()[:, :, ~valid].any(), "padding rows must be zero"
    for got, want in zip((q.grad, k.grad, v.grad), grads):
        np.testing.assert_allclose(got.numpy(), want, atol=5e-5)


def test_kpage_op_passes_opcheck():
    graph = random_ragged_graph(np.random.default_rng(7))
    q, k, v = (x.requires_grad_() for x in _qkv(graph, seed=7))
    torch.library.opcheck(OPS.kpage_fwd, (q, k, v, handle(graph), "auto", 0.2, False))


def test_tokens_slots_ops_round_trip_and_gradients():
    import sparseattn.torch as st
    from sparseattn.layouts import video_layout

    layout = video_layout((3, 5, 6), (2, 2, 2), 16)
    x = torch.randn(2, layout.num_tokens, 3, 16, requires_grad=True)
    (slots,) = st.tokens_to_slots(layout, x)
    assert slots.shape == (2, 3, layout.num_slots, 16) and slots.dtype == torch.bfloat16
    assert not slots[:, :, ~torch.tensor(layout.valid)].any(), "padding slots must be zero"
    back = st.slots_to_tokens(layout, slots)
    torch.testing.assert_close(back.float(), x.detach().bfloat16().float())
    w = torch.randn_like(slots, dtype=torch.float32)
    (slots.float() * w).sum().backward()
    want = w[:, :, torch.tensor(layout.token_slot)].transpose(1, 2).bfloat16().float()
    torch.testing.assert_close(x.grad, want)
    torch.library.opcheck(OPS.tokens_to_slots, ([x.detach().bfloat16().requires_grad_()], handle(layout)))
    torch.library.opcheck(OPS.slots_to_tokens, (slots.detach().requires_grad_(), handle(layout)))


def _dynamic_problem(seed=0, batch=2, heads=3, topk=4):
    from sparseattn.layouts import video_layout

    layout = video_layout((4, 6, 8), (2, 2, 4), 16)
    g = torch.Generator().manual_seed(seed)
    nb = layout.num_blocks
    q, k, v = (torch.randn(batch, heads, layout.num_slots, 32, generator=g) for _ in range(3))
    idx = torch.stack([torch.randperm(nb, generator=g)[:topk] for _ in range(batch * heads * nb)])
    idx = idx.reshape(batch, heads, nb, topk).to(torch.int32)
    num = torch.randint(0, topk + 1, (batch, heads, nb), generator=g, dtype=torch.int32)
    return layout, q, k, v, idx, num


def test_dynamic_op_cpu_matches_the_reference_and_mask_form():
    import sparseattn.torch as st
    from sparseattn.graph import SparseGraph
    from sparseattn.torch_ops import selection_block_mask

    layout, q, k, v, idx, num = _dynamic_problem()
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    o, _ = st.block_sparse_attention(q, k, v, layout, idx, num)
    do = torch.randn_like(o)
    o.backward(do)
    mask = selection_block_mask(idx, num, None, layout.num_blocks)
    o2, _ = st.block_sparse_attention_mask(q.detach(), k.detach(), v.detach(), layout, mask)
    torch.testing.assert_close(o2, o.detach())
    for b in range(q.shape[0]):
        graph = SparseGraph.from_block_mask(layout, layout, mask[b].numpy())
        args = [x.detach()[b : b + 1].double().numpy() for x in (q, k, v)]
        o_ref, lse_ref = reference.attention_forward(*args, graph)
        np.testing.assert_allclose(o.detach()[b : b + 1].numpy(), o_ref, atol=2e-5)
        grads = reference.attention_backward(*args, o_ref, lse_ref, do[b : b + 1].double().numpy(), graph)
        for got, want in zip((q.grad, k.grad, v.grad), grads):
            np.testing.assert_allclose(got[b : b + 1].numpy(), want, atol=5e-5)


def test_dynamic_op_passes_opcheck():
    import sparseattn.torch as st

    layout, q, k, v, idx, num = _dynamic_problem(seed=3)
    planner = st.planner_for(layout)
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), idx, num, None, handle(planner))
    torch.library.opcheck(OPS.dynamic_fwd, (*args, 0.25, True))


def test_token_order_attention_on_the_cpu_equals_moving_to_slots():
    """Off CUDA (and with gradients) ``token_order_attention`` moves to slots, attends and moves back: the
    same output as those steps by hand, static graph and top-k selection alike, with gradients."""
    import sparseattn.torch as st
    from sparseattn.graph import SparseGraph

    layout, qs, ks, vs, idx, num = _dynamic_problem(seed=5)
    to_tokens = lambda x: st.slots_to_tokens(layout, x.bfloat16()).float().requires_grad_()
    q, k, v = (to_tokens(x) for x in (qs, ks, vs))
    planner = st.planner_for(layout)
    o = st.token_order_attention(q, k, v, planner, idx, num)
    want, _ = st.block_sparse_attention(*st.tokens_to_slots(layout, q, k, v), layout, idx, num)
    torch.testing.assert_close(o, st.slots_to_tokens(layout, want).float())
    o.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape
    mask = np.random.default_rng(0).random((3, layout.num_blocks, layout.num_blocks)) < 0.3
    graph = SparseGraph.from_block_mask(layout, layout, mask)
    with torch.no_grad():
        o = st.token_order_attention(q, k, v, graph)
        want = st.kpage_attention(*st.tokens_to_slots(layout, q, k, v), graph)
    torch.testing.assert_close(o, st.slots_to_tokens(layout, want).float())


def test_token_order_attention_refuses_a_mixed_up_selection():
    import sparseattn.torch as st
    from sparseattn.graph import SparseGraph

    layout, *_, idx, num = _dynamic_problem(seed=6)
    q = k = v = torch.zeros(2, layout.num_tokens, 3, 32)
    graph = SparseGraph.from_block_mask(
        layout, layout, np.ones((3, layout.num_blocks, layout.num_blocks), bool)
    )
    with pytest.raises(ValueError, match="a SparseGraph is the selection"):
        st.token_order_attention(q, k, v, graph, idx, num)
    with pytest.raises(ValueError, match="needs one selection"):
        st.token_order_attention(q, k, v, st.planner_for(layout))
    with pytest.raises(TypeError, match="graph_or_planner must be"):
        st.token_order_attention(q, k, v, layout)
    with pytest.raises(ValueError, match=f"k must be \\[batch, {layout.num_tokens} tokens"):
        st.token_order_attention(q, k[:, :-1], v, graph)  # a token count other than the layout's


def test_token_forward_refuses_cpu_tensors_before_any_launch():
    from sparseattn.kernels.forward import torch_token_forward
    from sparseattn.kernels.validate import KernelTypeError

    layout, *_ = _dynamic_problem()
    x = torch.zeros(1, layout.num_tokens, 2, 64, dtype=torch.bfloat16)
    slot_map = torch.zeros(layout.num_slots, dtype=torch.int32)
    with pytest.raises(KernelTypeError, match="q must be a bf16 CUDA tensor"):
        torch_token_forward(x, x, x, None, slot_map, slot_map)
    from sparseattn.kernels.backward import torch_token_backward

    lse = torch.zeros(1, 2, layout.num_slots)
    with pytest.raises(KernelTypeError, match="q must be a bf16 CUDA tensor"):
        torch_token_backward(x, x, x, x, lse, x, None, slot_map, slot_map)


def test_consecutive_page_check_of_the_tile_major_build():
    """check_consecutive_pages (what kv_tma reads each page by): tile-major numberings of video and 1-D
    layouts pass; the raster numbering, a shuffled page and a page whose first slot is padding do not."""
    from sparseattn.kernels.forward import check_consecutive_pages
    from sparseattn.kernels.validate import KernelValueError
    from sparseattn.layouts import contiguous_layout, slot_layout, tile_major_tokens, video_layout

    slot_map = lambda lay: torch.as_tensor(lay.slot_token.astype(np.int32))
    raster = video_layout((5, 7, 9), (2, 4, 4), 64)
    for lay in (
        tile_major_tokens(raster),
        contiguous_layout(100, 64),
        tile_major_tokens(video_layout((3, 5, 11), (1, 4, 8), 128)),
    ):
        check_consecutive_pages(slot_map(lay))
    bad = [slot_map(raster)]
    shuffled = slot_map(tile_major_tokens(raster)).clone()
    shuffled[[0, 1]] = shuffled[[1, 0]]
    bad.append(shuffled)
    valid = np.ones(64, dtype=bool)
    valid[16] = False  # the second page starts with a padding slot, its other rows hold tokens
    bad.append(slot_map(slot_layout(valid, 64)))
    for m in bad:
        with pytest.raises(KernelValueError, match="k_map: the tile-major token build"):
            check_consecutive_pages(m)
    good = slot_map(contiguous_layout(64, 64))
    check_consecutive_pages(good)
    good[[3, 4]] = good[[4, 3]]  # changed in place after a check: checked again
    with pytest.raises(KernelValueError, match="k_map"):
        check_consecutive_pages(good)


def test_a_layouts_uploaded_map_answers_the_page_check_without_a_read_back(monkeypatch):
    """The slot -> token map _slot_indices uploads carries its pages_consecutive answer (taken from the host
    layout), so check_consecutive_pages reads nothing back (a read-back would fail in a CUDA-graph capture)."""
    from sparseattn.kernels import forward
    from sparseattn.kernels.validate import KernelValueError
    from sparseattn.layouts import tile_major_tokens, video_layout
    from sparseattn.torch_ops import _slot_indices

    raster = video_layout((5, 7, 9), (2, 4, 4), 64)
    tiles = tile_major_tokens(raster)
    good, bad = _slot_indices(tiles, "cpu")[0], _slot_indices(raster, "cpu")[0]

    def no_read_back(_):
        raise AssertionError("read back")

    monkeypatch.setattr(forward, "pages_consecutive", no_read_back)
    forward.check_consecutive_pages(good)
    with pytest.raises(KernelValueError, match="k_map"):
        forward.check_consecutive_pages(bad)
    good[[0, 1]] = good[[1, 0]]  # changed in place: checked again, by reading it back
    with pytest.raises(AssertionError, match="read back"):
        forward.check_consecutive_pages(good)


def test_handle_of_a_freed_object_is_a_clear_error():
    from sparseattn.layouts import video_layout

    layout = video_layout((2, 4, 4), (2, 2, 2), 16)
    h = handle(layout)
    assert handle(layout) == h and resolve(h) is layout
    del layout
    gc.collect()
    with pytest.raises(ValueError, match="no live graph"):
        resolve(h)


# ---- torch.compile of a diffusers Wan transformer with the KPage processor -------------------------------

LATENT = (5, 8, 12)  # tokens after (1, 2, 2) patching: (5, 4, 6)
GRID = (5, 4, 6)


def _wan(selection, seed=0, token_order=None):
    pytest.importorskip("diffusers")
    from sparseattn.diffusers_wan import install_sparse_attention
    from sparseattn.wan_training import tiny_wan

    model = tiny_wan(seed, head_dim=32, text_dim=16, ffn_dim=64)
    install_sparse_attention(model, GRID, selection, backend="kpage", token_order=token_order)
    g = torch.Generator().manual_seed(seed + 1)
    inputs = (
        torch.randn(2, 4, *LATENT, generator=g),
        torch.tensor([500, 20]),
        torch.randn(2, 7, 16, generator=g),
    )
    return model, inputs


SELECTIONS = {
    "sta": lambda W: W.sta(tile=(1, 2, 2), window=(3, 1, 3)),
    "vsa": lambda W: W.vsa(tile=(1, 2, 2), topk=3),
}


@pytest.mark.parametrize("order", [None, "tiles"], ids=["default", "tiles"])
@pytest.mark.parametrize("kind", sorted(SELECTIONS))
def test_compiled_wan_with_the_kpage_processor_has_no_graph_break(kind, order):
    """(``tiles``: with the model's tokens kept tile-major by TileMajorTokens' hooks, traced with it.)"""
    pytest.importorskip("diffusers")
    from sparseattn.diffusers_wan import WanSelection

    torch._dynamo.reset()
    model, (x, t, enc) = _wan(SELECTIONS[kind](WanSelection), token_order=order)
    explained = torch._dynamo.explain(model)(x, t, enc, return_dict=False)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1

    xe = x.clone().requires_grad_()
    eager = model(xe, t, enc, return_dict=False)[0]
    eager.square().mean().backward()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    xc = x.clone().requires_grad_()
    out = compiled(xc, t, enc, return_dict=False)[0]
    out.square().mean().backward()
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(xc.grad, xe.grad)


def test_host_cost_floor_operator_allocates_and_differentiates():
    """The host-cost script's floor: a Python operator that only allocates, with an autograd formula."""
    from sparseattn.host_cost import _noop_operator

    op = _noop_operator()
    assert _noop_operator() is op
    x = torch.randn(2, 3, requires_grad=True)
    y = op(x)
    assert y.shape == x.shape
    y.backward(torch.ones_like(y))
    assert x.grad.shape == x.shape


def test_host_cost_capture_failure_is_a_recorded_error():
    """A step that cannot be captured (here: no CUDA) gives a callable raising the capture's error, which
    the host-cost loop records instead of stopping the run."""
    from sparseattn.host_cost import _captured

    calls = []
    replay = _captured(lambda: calls.append(1))
    with pytest.raises(RuntimeError, match="capture failed"):
        replay()


def test_plain_function_equals_the_operator():
    """``KPageFunction`` (the operator's implementations behind a plain autograd.Function, the host-cost
    comparison) gives the operator's output and gradients."""
    from sparseattn.torch_ops import KPageFunction

    graph = random_ragged_graph(np.random.default_rng(11))
    q, k, v = _qkv(graph, seed=11)
    outs = []
    for run in (
        lambda a, b, c: KPageFunction.apply(a, b, c, handle(graph), "auto", 0.2, False),
        lambda a, b, c: OPS.kpage_fwd.default(a, b, c, handle(graph), "auto", 0.2, False)[0],
    ):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        o = run(*leaves)
        o.square().sum().backward()
        outs.append([o.detach(), *(x.grad for x in leaves)])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b)
