"""The Wan processor's KPage backend on the GPU against its masked-SDPA backend (the same graph): a
random-init WanTransformer3DModel (head_dim 64, 2 heads), forward outputs and parameter gradients within
bf16 noise, STA and VSA selections. Needs torch and diffusers on the GPU machine."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from test_diffusers_wan import svg2_kpage_against_masked

pytestmark = pytest.mark.gpu

LATENT = (8, 16, 16)  # tokens after (1, 2, 2) patching: (8, 8, 8)
GRID = (8, 8, 8)


def model_and_inputs(seed: int):
    from sparseattn.wan_training import tiny_wan

    model = tiny_wan(seed).cuda()
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    x = torch.randn(2, 4, *LATENT, device="cuda", generator=g)
    enc = torch.randn(2, 9, 32, device="cuda", generator=g)
    return model, (x, torch.tensor([700, 30], device="cuda"), enc)


@pytest.mark.parametrize("selection", ["sta", "vsa"])
def test_kpage_backend_matches_masked_sdpa_forward_and_backward(selection):
    from sparseattn.diffusers_wan import WanSelection, install_sparse_attention

    chosen = WanSelection.sta((4, 4, 4), (1, 1, 1)) if selection == "sta" else WanSelection.vsa((4, 4, 4), 2)
    results = {}
    for backend in ("masked_sdpa", "kpage"):
        model, inputs = model_and_inputs(0)
        install_sparse_attention(model, GRID, chosen, backend=backend)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(*inputs, return_dict=False)[0]
        out.float().square().mean().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results[backend] = (out.float().detach(), grads.float())
    (o_ref, g_ref), (o, g) = results["masked_sdpa"], results["kpage"]
    assert torch.isfinite(o).all() and torch.isfinite(g).all()
    rel_o = (o - o_ref).norm() / o_ref.norm()
    rel_g = (g - g_ref).norm() / g_ref.norm()
    assert rel_o < 2e-2, f"forward: relative difference {rel_o:.3e}"
    assert rel_g < 5e-2, f"gradients: relative difference {rel_g:.3e}"


@pytest.mark.parametrize("plan", ["blocks", "clusters"])
@pytest.mark.parametrize("block", [64, 128], ids=lambda b: f"B{b}")
def test_svg2_kpage_equals_masked_sdpa_on_the_same_step(block, plan, monkeypatch):
    """SVG2 through KPage (per-row layouts of this call's clusters, planned on the GPU from the block mask
    or by clusters) against masked SDPA of the same clustering and selection, output and gradients within
    bf16 noise."""
    from sparseattn.diffusers_wan import WanSelection, WanSparseAttnProcessor

    monkeypatch.setenv("SPARSEATTN_SVG2_PLAN", plan)

    grid = (6, 10, 12)
    sel = WanSelection.svg2(q_clusters=20, k_clusters=40, top_p=0.8, min_fraction=0.1, block_size=block)
    kpage = WanSparseAttnProcessor(grid, sel, backend="kpage")
    g = torch.Generator(device="cuda").manual_seed(block)
    n = grid[0] * grid[1] * grid[2]
    q, k, v = (torch.randn(2, n, 3, 64, device="cuda", generator=g).bfloat16() for _ in range(3))
    rel_o, rel_grads = svg2_kpage_against_masked(kpage, q, k, v)
    assert rel_o < 2e-2, f"relative difference {rel_o:.3e}"
    for name, rel in zip(("dq", "dk", "dv"), rel_grads):
        assert rel < 5e-2, f"{name}: relative difference {rel:.3e}"


def test_the_model_benchs_svg2_check_runs_the_kpage_path():
    """``bench model``'s SVG2 check on the GPU (KPage's own call, which makes its step) holds its tolerance;
    on the CPU the same check takes the masked path."""
    from sparseattn import model_bench
    from sparseattn.diffusers_wan import WanSelection, WanSparseAttnProcessor

    grid = (6, 10, 12)
    proc = WanSparseAttnProcessor(grid, WanSelection.svg2(q_clusters=20, k_clusters=40), backend="kpage")
    rel = model_bench.check_svg2_rows(proc, grid, heads=3, head_dim=64, rows=256)
    assert proc.last_svg2_step is not None
    assert rel < model_bench.REL_TOL, f"relative error {rel:.3e}"


@pytest.mark.parametrize("plan", ["blocks", "clusters"])
def test_svg2_call_replays_in_a_cuda_graph_with_its_warm_start(plan, monkeypatch):
    """An SVG2 KPage call captured once with ``torch.cuda.graph`` and replayed on new q, k, v gives what the
    eager processor gives on the same sequence of calls: each replay warm-starts from the centroids of the
    one before (both processors' centroids compared after every call), and the outputs agree."""
    from sparseattn.diffusers_wan import WanSelection, WanSparseAttnProcessor
    from sparseattn.torch import capture_cuda_graph

    monkeypatch.setenv("SPARSEATTN_SVG2_PLAN", plan)
    grid = (6, 10, 12)
    sel = WanSelection.svg2(q_clusters=20, k_clusters=40, top_p=0.8, min_fraction=0.1)
    eager, graphed = (WanSparseAttnProcessor(grid, sel, backend="kpage") for _ in range(2))
    g = torch.Generator(device="cuda").manual_seed(11)
    n = grid[0] * grid[1] * grid[2]
    calls = [
        tuple(torch.randn(1, n, 3, 64, device="cuda", generator=g).bfloat16() for _ in range(3))
        for _ in range(5)
    ]
    key = (None, 3)

    def centroids_agree(call):
        for a, b in zip(eager._centroids[key], graphed._centroids[key]):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4, msg=lambda m: f"call {call}: {m}")

    with torch.no_grad():
        for p in (eager, graphed):  # the seeded first fit
            p.attend(*calls[0])
        eager.attend(*calls[1])  # the graphed processor's warm-up call below is its second call
        static = [x.clone() for x in calls[1]]
        graph, out = capture_cuda_graph(lambda: graphed.attend(*static), warmup=1)
        centroids_agree(1)
        for i in range(2, len(calls)):
            want = eager.attend(*calls[i])
            for dst, src in zip(static, calls[i]):
                dst.copy_(src)
            graph.replay()
            torch.cuda.synchronize()
            centroids_agree(i)
            rel = ((out.float() - want.float()).norm() / want.float().norm()).item()
            assert rel < 1e-2, f"call {i}: relative difference {rel:.3e}"
