"""The ``torch.library`` operators on the GPU: the static op against the float64 reference (forward and
gradients, ragged layouts), ``opcheck`` of the CUDA implementations against their fake ones, the
token <-> slot operators against their CPU implementations, ``torch.compile(fullgraph=True)`` of a
random-init Wan transformer with the KPage processor (inductor; equal to eager within bf16 noise), and a
training step with the op captured in a CUDA graph (replay equals eager)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from small_cases import random_ragged_graph, rel_err

from sparseattn import reference
from sparseattn.torch_ops import OPS, handle

pytestmark = pytest.mark.gpu


def _bf16_inputs(graph, batch, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = lambda n: (batch, graph.heads, n, d)
    n = (graph.q.num_slots, graph.k.num_slots, graph.k.num_slots, graph.q.num_slots)
    return [torch.randn(shape(s), device="cuda", generator=g).bfloat16() for s in n]


@pytest.mark.parametrize("seed", range(6), ids=lambda s: f"ragged{s}")
def test_kpage_op_matches_the_float64_reference(seed):
    import sparseattn.torch as st

    graph = random_ragged_graph(np.random.default_rng(100 + seed))
    q, k, v, do = _bf16_inputs(graph, 2, 128 if seed % 2 else 64, seed)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    o = st.kpage_attention(q, k, v, graph)
    o.backward(do)
    args = [x.detach().double().cpu().numpy() for x in (q, k, v)]
    o_ref, lse_ref = reference.attention_forward(*args, graph)
    grads = reference.attention_backward(*args, o_ref, lse_ref, do.double().cpu().numpy(), graph)
    qv, kv = graph.q.valid, graph.k.valid
    got = o.detach().double().cpu().numpy()
    assert rel_err(got[:, :, qv], o_ref[:, :, qv]) < 1e-2
    assert not np.any(got[:, :, ~qv]), "padding rows must be zero"
    for name, x, r, valid in zip("qkv", (q, k, v), grads, (qv, kv, kv)):
        g = x.grad.double().cpu().numpy()
        assert np.isfinite(g).all(), f"d{name} not finite"
        assert rel_err(g[:, :, valid], r[:, :, valid]) < 1e-2, f"d{name}"


def test_ops_pass_opcheck_on_cuda():
    import sparseattn.torch as st
    from sparseattn.layouts import video_layout

    graph = random_ragged_graph(np.random.default_rng(5))
    q, k, v, _ = _bf16_inputs(graph, 1, 64, 5)
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), handle(graph), "auto", 0.125, False)
    torch.library.opcheck(OPS.kpage_fwd, args)
    lay = video_layout((4, 8, 8), (2, 4, 4), 64)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 2, lay.num_slots, 64, device="cuda", generator=g).bfloat16() for _ in range(3))
    idx, num = st.vsa_topk(q, k, lay, 2)
    planner = st.planner_for(lay)
    dyn = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), idx, num, None, handle(planner))
    # the plans output holds uninitialised bytes (buffer tails past each stream's end): opcheck's
    # eager-vs-traced comparison of outputs cannot hold for it, the other checks run
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(OPS.dynamic_fwd, (*dyn, 0.125, True), test_utils=checks)


def test_eager_calls_without_gradients_equal_the_operators():
    """kpage_attention and block_sparse_attention without gradients run the CUDA implementations directly
    (no dispatcher): the same outputs as the operators, bit for bit."""
    import sparseattn.torch as st
    from sparseattn.layouts import video_layout

    graph = random_ragged_graph(np.random.default_rng(7))
    q, k, v, _ = _bf16_inputs(graph, 2, 128, 7)
    with torch.no_grad():
        direct = st.kpage_attention(q, k, v, graph)
        through_op = OPS.kpage_fwd.default(q, k, v, handle(graph), "auto", 128**-0.5, False)[0]
    assert torch.equal(direct, through_op)
    lay = video_layout((4, 8, 8), (2, 4, 4), 64)
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(2, 2, lay.num_slots, 64, device="cuda", generator=g).bfloat16() for _ in range(3))
    idx, num = st.vsa_topk(q, k, lay, 2)
    planner = st.planner_for(lay)
    with torch.no_grad():
        direct, _ = st.block_sparse_attention(q, k, v, planner, idx, num)
        through_op = OPS.dynamic_fwd.default(q, k, v, idx, num, None, handle(planner), 0.125, False)[0]
    assert torch.equal(direct, through_op)


def test_tokens_slots_cuda_equals_cpu():
    import sparseattn.torch as st
    from sparseattn.layouts import video_layout

    lay = video_layout((5, 6, 7), (2, 4, 4), 64)
    x = torch.randn(2, lay.num_tokens, 3, 64, device="cuda").bfloat16()
    (gpu,) = st.tokens_to_slots(lay, x)
    (cpu,) = st.tokens_to_slots(lay, x.cpu())
    assert torch.equal(gpu.cpu(), cpu)
    assert torch.equal(st.slots_to_tokens(lay, gpu).cpu(), st.slots_to_tokens(lay, cpu))
    # three tensors in one launch, d = 128
    xs = [torch.randn(2, lay.num_tokens, 3, 128, device="cuda").bfloat16() for _ in range(3)]
    for gpu, cpu in zip(st.tokens_to_slots(lay, *xs), st.tokens_to_slots(lay, *(x.cpu() for x in xs))):
        assert torch.equal(gpu.cpu(), cpu)
        assert torch.equal(st.slots_to_tokens(lay, gpu).cpu(), st.slots_to_tokens(lay, cpu))
    # more (batch, head) matrices / batch entries than a grid's second dimension holds (65,535)
    tiny = video_layout((1, 4, 6), (1, 4, 4), 16)
    for b, h in ((1, 70_000), (70_000, 1)):
        x = torch.randn(b, tiny.num_tokens, h, 8, device="cuda").bfloat16()
        (gpu,) = st.tokens_to_slots(tiny, x)
        (cpu,) = st.tokens_to_slots(tiny, x.cpu())
        assert torch.equal(gpu.cpu(), cpu), (b, h)
        assert torch.equal(st.slots_to_tokens(tiny, gpu).cpu(), st.slots_to_tokens(tiny, cpu)), (b, h)


# ---- a Wan transformer: torch.compile and CUDA graphs -----------------------------------------------------

LATENT = (8, 16, 16)  # tokens after (1, 2, 2) patching: (8, 8, 8)
GRID = (8, 8, 8)


def _wan(selection, seed=0):
    pytest.importorskip("diffusers")
    from sparseattn.diffusers_wan import install_sparse_attention
    from sparseattn.wan_training import tiny_wan

    model = tiny_wan(seed).cuda().bfloat16()
    install_sparse_attention(model, GRID, selection, backend="kpage")
    return model


def _inputs(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(2, 4, *LATENT, device="cuda", generator=g).bfloat16()
    enc = torch.randn(2, 9, 32, device="cuda", generator=g).bfloat16()
    return x, torch.tensor([700, 30], device="cuda"), enc


def _selection(kind):
    from sparseattn.diffusers_wan import WanSelection

    return WanSelection.sta((4, 4, 4), (1, 1, 1)) if kind == "sta" else WanSelection.vsa((4, 4, 4), 2)


@pytest.mark.parametrize("kind", ["sta", "vsa"])
def test_compiled_wan_on_the_gpu_has_no_graph_break_and_equals_eager(kind):
    """``fullgraph=True`` makes any graph break an error (one compile; ``torch._dynamo.explain`` would trace
    the model a second time), and the compiled step equals eager in output and input gradient."""
    torch._dynamo.reset()
    model = _wan(_selection(kind))
    x, t, enc = _inputs(1)
    xe = x.clone().requires_grad_()
    eager = model(xe, t, enc, return_dict=False)[0]
    eager.float().square().mean().backward()
    compiled = torch.compile(model, fullgraph=True)
    xc = x.clone().requires_grad_()
    out = compiled(xc, t, enc, return_dict=False)[0]
    out.float().square().mean().backward()
    assert rel_err(out.detach().float().cpu().numpy(), eager.detach().float().cpu().numpy()) < 2e-2
    assert rel_err(xc.grad.float().cpu().numpy(), xe.grad.float().cpu().numpy()) < 5e-2


@pytest.mark.parametrize("kind", ["sta", "vsa"])
def test_cuda_graph_training_step_replays_like_eager(kind):
    """A whole training step (forward, loss, backward into the parameters' .grad) captured once; replayed on
    new inputs copied into the captured buffers, it gives the eager step's loss and gradients."""
    from sparseattn.wan_compile import captured_training_step

    model = _wan(_selection(kind))
    params = [p for p in model.parameters() if p.requires_grad]
    static = [x.clone() for x in _inputs(2)]
    graph, loss, captured, step = captured_training_step(model, static)
    for seed in (3, 4):
        for buf, x in zip(static, _inputs(seed)):
            buf.copy_(x)
        graph.replay()
        replayed_loss = loss.clone()
        replayed = torch.cat([g.float().flatten() for g in captured])
        eager_loss = step()
        eager = torch.cat([p.grad.float().flatten() for p in params])
        assert torch.allclose(replayed_loss, eager_loss, rtol=1e-3), (replayed_loss, eager_loss)
        assert (replayed - eager).norm() / eager.norm() < 1e-2


@pytest.mark.parametrize(
    "grid", [(21, 30, 52), (21, 45, 80), (5, 6, 7)], ids=["wan480p", "wan720p", "ragged"]
)
def test_vsa_topk_by_bisection_picks_torch_topks_values(grid):
    """vsa_topk's Triton top-k (bisection, ascending indices) chooses the values torch.topk chooses from the
    same scores, on Wan-sized layouts and a ragged one (partial and empty cubes), and on all-equal scores."""
    from triton_interpreted_checks import vsa_topk_agrees

    import sparseattn.torch as st
    from sparseattn.layouts import video_layout

    lay = video_layout(grid, (4, 4, 4), 64)
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k = (torch.randn(2, lay.num_tokens, 3, 128, device="cuda", generator=g).bfloat16() for _ in range(2))
    topk = -(-lay.num_blocks // 10)
    for scale in (1.0, 0.0):  # 0: every score equal, the whole row tied
        qs, ks = st.tokens_to_slots(lay, q * scale, k * scale)
        idx, num = st.vsa_topk(qs, ks, lay, topk)
        weight, alive = st._block_weights(st._layout_handle(lay), qs.device)
        b, h, _, d = qs.shape
        means = [
            x.reshape(b, h, lay.num_blocks, 64, d).sum(3, dtype=torch.float32) * weight for x in (qs, ks)
        ]
        scores = means[0] @ means[1].transpose(-1, -2)
        kept = min(topk, int(alive.sum()))
        assert torch.equal(num, torch.full_like(num, kept))
        vsa_topk_agrees(scores, alive, kept, idx)
