"""The diffusers Wan processor on CPU (masked-SDPA backend): plumbing against diffusers' own processor,
the selections' token masks against brute-force definitions, and a whole random-init model.
Skipped unless torch and diffusers import (``pip install -e '.[diffusers]'``)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from sparseattn.diffusers_wan import (
    WanSelection,
    WanSparseAttnProcessor,
    contiguous_hidden_states,
    install_sparse_attention,
    install_token_order,
    token_mask,
)
from sparseattn.layouts import video_layout
from sparseattn.wan_training import tiny_wan

LATENT = (5, 8, 12)  # frames, height, width of the latent; tokens after (1, 2, 2) patching: (5, 4, 6)
GRID = (5, 4, 6)
HEADS, HEAD_DIM = 2, 32


def tiny_model(seed=0):
    return tiny_wan(seed, head_dim=HEAD_DIM, text_dim=16, ffn_dim=64).eval()


def model_inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(2, 4, *LATENT, generator=g),
        torch.tensor([500, 20]),
        torch.randn(2, 7, 16, generator=g),
    )


def self_attention_call(model, seed=2):
    """(attn module, hidden states [2, L, C], rotary (cos, sin)) of the first block."""
    g = torch.Generator().manual_seed(seed)
    attn = model.blocks[0].attn1
    x = model_inputs()[0]
    rotary = model.rope(x)
    hidden = torch.randn(2, int(np.prod(GRID)), HEADS * HEAD_DIM, generator=g)
    return attn, hidden, rotary


def tile_window_mask(grid, tile, window) -> np.ndarray:
    """STA by definition: query tile c sees key tiles [s, s + w) per axis, s = clip(c - w//2, 0, n - w)."""
    coords = np.stack(np.meshgrid(*[np.arange(n) for n in grid], indexing="ij"), -1).reshape(-1, 3)
    t = coords // np.asarray(tile)
    n = -(-np.asarray(grid) // np.asarray(tile))
    w = np.minimum(np.asarray(window), n)
    s = np.clip(t - w // 2, 0, n - w)
    ok = np.ones((len(t), len(t)), dtype=bool)
    for a in range(3):
        ok &= (t[None, :, a] >= s[:, None, a]) & (t[None, :, a] < s[:, None, a] + w[a])
    return ok


def test_full_selection_equals_diffusers_processor():
    model = tiny_model()
    attn, hidden, rotary = self_attention_call(model)
    with torch.no_grad():
        ref = WanAttnProcessor()(attn, hidden, None, None, rotary)
        got = WanSparseAttnProcessor(GRID, WanSelection.full(tile=(2, 2, 2)), "masked_sdpa")(
            attn, hidden, None, None, rotary
        )
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "tile,window", [((2, 2, 2), (1, 1, 1)), ((2, 2, 3), (3, 1, 2)), ((1, 4, 4), (2, 1, 1))]
)
def test_sta_equals_diffusers_processor_under_the_window_mask(tile, window):
    model = tiny_model()
    attn, hidden, rotary = self_attention_call(model)
    mask = torch.from_numpy(tile_window_mask(GRID, tile, window))
    processor = WanSparseAttnProcessor(GRID, WanSelection.sta(tile, window), "masked_sdpa")
    assert np.array_equal(token_mask(processor.graph_for(HEADS))[0], mask.numpy())
    with torch.no_grad():
        ref = WanAttnProcessor()(attn, hidden, None, mask, rotary)
        got = processor(attn, hidden, None, None, rotary)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_vsa_keeps_the_topk_cubes_of_each_query_cube_per_head_and_batch_entry():
    tile, topk = (1, 2, 2), 3
    processor = WanSparseAttnProcessor(GRID, WanSelection.vsa(tile, topk), "masked_sdpa")
    g = torch.Generator().manual_seed(5)
    q, k = (torch.randn(int(np.prod(GRID)), HEADS, HEAD_DIM, generator=g) for _ in range(2))
    graph = processor.graph_for(HEADS, q, k)
    mask = token_mask(graph)
    coords = np.stack(np.meshgrid(*[np.arange(n) for n in GRID], indexing="ij"), -1).reshape(-1, 3)
    cube = np.ravel_multi_index((coords // np.asarray(tile)).T, tuple(np.asarray(GRID) // np.asarray(tile)))
    for h in range(HEADS):
        qm = np.stack([q[cube == c, h].double().mean(0).numpy() for c in range(cube.max() + 1)])
        km = np.stack([k[cube == c, h].double().mean(0).numpy() for c in range(cube.max() + 1)])
        top = np.argsort(-(qm @ km.T), axis=1, kind="stable")[:, :topk]
        want = np.zeros((len(cube), len(cube)), dtype=bool)
        for i in range(len(cube)):
            want[i] = np.isin(cube, top[cube[i]])
        assert np.array_equal(mask[h], want)


def test_installed_model_runs_sparse_self_attention():
    """Whole model: a full selection matches the stock model; an STA window changes the output."""
    x, t, enc = model_inputs()
    stock = tiny_model()
    with torch.no_grad():
        ref = stock(x, t, enc, return_dict=False)[0]
    full = tiny_model()
    processor = install_sparse_attention(full, GRID, WanSelection.full((2, 2, 2)), backend="masked_sdpa")
    assert all(b.attn1.processor is processor for b in full.blocks)
    assert all(isinstance(b.attn2.processor, WanAttnProcessor) for b in full.blocks)
    sta = tiny_model()
    install_sparse_attention(sta, GRID, WanSelection.sta((2, 2, 2), (1, 1, 1)), backend="masked_sdpa")
    with torch.no_grad():
        got = full(x, t, enc, return_dict=False)[0]
        windowed = sta(x, t, enc, return_dict=False)[0]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert (windowed - ref).abs().max() > 1e-3


@pytest.mark.parametrize("selection", ["sta", "vsa"])
def test_tile_major_tokens_keep_the_models_output_and_gradients(selection):
    """token_order="tiles": the model's tokens tile-major between its blocks (hooks), the processor's layout
    renumbered to match; same output and parameter gradients as the raster-order model, and the hooks come
    off again."""
    sel = (
        WanSelection.sta((2, 2, 4), (1, 1, 1))
        if selection == "sta"
        else WanSelection.vsa((2, 2, 4), topk=2, block_size=16)
    )
    x, t, enc = model_inputs()
    raster, tiles = tiny_model(), tiny_model()
    install_sparse_attention(raster, GRID, sel, backend="masked_sdpa")
    processor = install_sparse_attention(tiles, GRID, sel, backend="masked_sdpa", token_order="tiles")
    seen = {}

    def record(name):
        def hook(module, args):
            seen.setdefault(name, args[0].detach())

        return hook

    for name, model in (("raster", raster), ("tiles", tiles)):  # what enters the second block
        model.blocks[1].register_forward_pre_hook(record(name))
    outs = []
    for model in (raster, tiles):
        out = model(x, t, enc, return_dict=False)[0]
        out.square().mean().backward()
        outs.append((out.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-4, atol=1e-5)
    for g1, g0 in zip(outs[1][1], outs[0][1]):
        torch.testing.assert_close(g1, g0, rtol=1e-3, atol=1e-6)
    # between blocks token i is the i-th valid slot's token of the raster layout
    perm = np.argsort(video_layout(GRID, sel.tile, sel.blocks()).token_slot, kind="stable")
    assert not np.array_equal(perm, np.arange(perm.size))  # else the test would prove nothing
    torch.testing.assert_close(seen["tiles"], seen["raster"][:, torch.as_tensor(perm)], rtol=1e-4, atol=1e-5)
    processor.tile_hooks.remove()
    assert not processor.tile_hooks.handles


def test_contiguous_hidden_states_keep_the_output_and_make_the_residual_stream_contiguous():
    x, t, enc = model_inputs()
    model = tiny_model()
    seen = []
    model.blocks[1].register_forward_pre_hook(lambda m, args: seen.append(args[0].is_contiguous()) and None)
    with torch.no_grad():
        ref = model(x, t, enc, return_dict=False)[0]
        handle = contiguous_hidden_states(model)
        got = model(x, t, enc, return_dict=False)[0]
    handle.remove()
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert seen[-1]  # (diffusers' own layout depends on the convolution's: transposed on the GPU)


def test_a_second_install_replaces_the_tile_major_hooks():
    """Installing again (tiles or not) takes the earlier tile-major hooks off: they never stack."""
    sel = WanSelection.sta((2, 2, 4), (1, 1, 1))
    x, t, enc = model_inputs()
    raster = tiny_model()
    install_sparse_attention(raster, GRID, sel, backend="masked_sdpa")
    with torch.no_grad():
        want = raster(x, t, enc, return_dict=False)[0]
    model = tiny_model()
    for order in ("tiles", "tiles", None, "tiles", None):
        processor = install_sparse_attention(model, GRID, sel, backend="masked_sdpa", token_order=order)
        with torch.no_grad():
            torch.testing.assert_close(model(x, t, enc, return_dict=False)[0], want, rtol=1e-4, atol=1e-5)
    processor = install_sparse_attention(model, GRID, sel, backend="masked_sdpa", token_order="tiles")
    with pytest.raises(ValueError, match="tile-major already"):
        processor.install_tile_hooks(model)


def test_tile_major_tokens_refuse_svg2():
    with pytest.raises(ValueError, match="tiles"):
        WanSparseAttnProcessor(GRID, WanSelection.svg2(4, 4), token_order="tiles")


def test_bad_arguments():
    with pytest.raises(ValueError, match="backend"):
        WanSparseAttnProcessor(GRID, WanSelection.full(), backend="flash")
    with pytest.raises(ValueError, match="grid"):
        WanSparseAttnProcessor((5, 4), WanSelection.full(), backend="masked_sdpa")
    with pytest.raises(ValueError, match="window"):
        WanSelection("sta", (2, 2, 2))
    with pytest.raises(ValueError, match="topk"):
        WanSelection.vsa(topk=0)
    model = tiny_model()
    attn, hidden, rotary = self_attention_call(model)
    with pytest.raises(ValueError, match="tokens"):
        WanSparseAttnProcessor((5, 4, 5), WanSelection.full(), "masked_sdpa")(
            attn, hidden, None, None, rotary
        )
    with pytest.raises(TypeError, match="WanTransformer3DModel"):
        install_sparse_attention(object(), GRID, WanSelection.full())


def test_install_keeps_kpage_tokens_tile_major_unless_told(monkeypatch):
    """``install_sparse_attention`` without ``token_order``: the KPage backend's STA, VSA and full selections
    get tile-major tokens (the hooks installed, the model's output unchanged); SVG2, masked SDPA and
    ``SPARSEATTN_TOKEN_ORDER`` keep the processor's default; an explicit order wins."""
    monkeypatch.delenv("SPARSEATTN_TOKEN_ORDER", raising=False)
    sta = WanSelection.sta((2, 2, 4), (1, 1, 1))
    for sel in (sta, WanSelection.vsa((2, 2, 4), 2), WanSelection.full((2, 2, 4))):
        assert install_token_order(sel, "kpage") == "tiles"
        assert install_token_order(sel, "masked_sdpa") is None
    assert install_token_order(WanSelection.svg2(4, 4), "kpage") is None
    x, t, enc = model_inputs()
    raster = tiny_model()
    install_sparse_attention(raster, GRID, sta, backend="kpage", token_order="qo")
    model = tiny_model()
    processor = install_sparse_attention(model, GRID, sta, backend="kpage")
    assert processor.token_order == "tiles" and processor.tile_hooks is not None
    with torch.no_grad():
        want = raster(x, t, enc, return_dict=False)[0]
        torch.testing.assert_close(model(x, t, enc, return_dict=False)[0], want, rtol=1e-4, atol=1e-5)
    monkeypatch.setenv("SPARSEATTN_TOKEN_ORDER", "qo")
    assert install_token_order(sta, "kpage") is None
    assert install_sparse_attention(tiny_model(), GRID, sta, backend="kpage").token_order == "qo"


def test_token_order_defaults_to_the_qo_build(monkeypatch):
    """Processors built without ``token_order`` take the Q/O token build (``"qo"``: q and o in token order, k
    and v moved to slots); ``SPARSEATTN_TOKEN_ORDER=1`` the token-order build, ``=0`` slot order, other
    values refused; any other ``token_order`` is refused; CPU tensors never take a token build (its kernels
    are CUDA's)."""
    sta = WanSelection.sta((2, 2, 2), (1, 1, 1))
    monkeypatch.delenv("SPARSEATTN_TOKEN_ORDER", raising=False)
    proc = WanSparseAttnProcessor(GRID, sta)
    assert proc.token_order == "qo"
    monkeypatch.setenv("SPARSEATTN_TOKEN_ORDER", "1")
    assert WanSparseAttnProcessor(GRID, sta).token_order is True
    monkeypatch.setenv("SPARSEATTN_TOKEN_ORDER", "0")
    assert WanSparseAttnProcessor(GRID, sta).token_order is False
    monkeypatch.setenv("SPARSEATTN_TOKEN_ORDER", "true")  # a typo is refused, not read as slot order
    with pytest.raises(ValueError, match="SPARSEATTN_TOKEN_ORDER"):
        WanSparseAttnProcessor(GRID, sta)
    monkeypatch.setenv("SPARSEATTN_TOKEN_ORDER", "0")
    assert WanSparseAttnProcessor(GRID, WanSelection.full(), token_order=False).token_order is False
    x = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)
    assert not proc._token_order_call(x, x, x)
    with pytest.raises(ValueError, match="token_order"):
        WanSparseAttnProcessor(GRID, WanSelection.full(), token_order="kv")


def test_slot_tokens_inverts_each_rows_token_slots():
    from sparseattn.diffusers_wan import slot_tokens

    g = torch.Generator().manual_seed(0)
    token_slot = torch.stack([torch.randperm(12, generator=g)[:7] for _ in range(3)])  # 7 tokens, 12 slots
    got = slot_tokens(token_slot, 12)
    assert got.dtype == torch.int32 and got.shape == (3, 12)
    for r in range(3):
        assert torch.equal(got[r, token_slot[r]], torch.arange(7, dtype=torch.int32))
        assert int((got[r] == -1).sum()) == 5


def test_training_script_runs_a_few_steps_on_cpu(tmp_path):
    import json

    from sparseattn.wan_training import main

    assert main(["--out", str(tmp_path), "--steps", "3", "--device", "cpu"]) == 0
    record = json.loads((tmp_path / "wan_training.json").read_text())
    losses = record["losses"]["masked_sdpa"]
    assert len(losses) == 3 and all(np.isfinite(losses))
    assert (tmp_path / "wan_training.png").stat().st_size > 0


SVG2 = dict(q_clusters=6, k_clusters=9, top_p=0.7, min_fraction=0.2, iters=2, block_size=16)


def test_svg2_attends_the_selected_cluster_pairs_of_each_head():
    """SVG2 on masked SDPA: each head's query attends exactly the keys whose cluster pair the rule
    (:func:`sparseattn.builders.svg2_select`, on the host, from the step's own cluster means) selects."""
    from sparseattn.builders import svg2_select

    processor = WanSparseAttnProcessor(GRID, WanSelection.svg2(**SVG2), backend="masked_sdpa")
    g = torch.Generator().manual_seed(3)
    n = int(np.prod(GRID))
    q, k, v = (torch.randn(2, n, HEADS, HEAD_DIM, generator=g) for _ in range(3))
    step = processor.svg2_step(q, k)
    processor._centroids.clear()  # the same seeded start again: attend clusters as this step did
    out = processor.attend(q, k, v)
    for row in range(2 * HEADS):
        b, h = divmod(row, HEADS)
        ql, kl = step.q_labels[row].numpy(), step.k_labels[row].numpy()
        qx, kx = q[b, :, h].double().numpy(), k[b, :, h].double().numpy()
        qm = np.stack([qx[ql == c].mean(0) if np.any(ql == c) else np.zeros(HEAD_DIM) for c in range(6)])
        km = np.stack([kx[kl == c].mean(0) if np.any(kl == c) else np.zeros(HEAD_DIM) for c in range(9)])
        i, j = svg2_select(qm, km, np.bincount(kl, minlength=9), HEAD_DIM, 0.7, 0.2)
        pairs = np.zeros((6, 9), dtype=bool)
        pairs[i, j] = True
        np.testing.assert_array_equal(step.cluster_mask[row].numpy(), pairs)
        mask = torch.as_tensor(pairs[ql][:, kl])
        scores = (q[b, :, h] @ k[b, :, h].T / HEAD_DIM**0.5).masked_fill(~mask, float("-inf"))
        want = torch.softmax(scores, -1).nan_to_num() @ v[b, :, h]
        torch.testing.assert_close(out[b, :, h], want, rtol=1e-4, atol=1e-5)


def test_svg2_warm_starts_each_layer_from_its_previous_centroids():
    """The model's two layers keep their own centroids; a second step starts from them (a call with the
    stored centroids as init reproduces the next call's clustering)."""
    from sparseattn.svg2_device import kmeans

    x, t, enc = model_inputs()
    model = tiny_model()
    processor = install_sparse_attention(model, GRID, WanSelection.svg2(**SVG2), backend="masked_sdpa")
    with torch.no_grad():
        model(x, t, enc, return_dict=False)
    layers = {key[0] for key in processor._centroids}
    assert layers == {id(b.attn1) for b in model.blocks}
    key = (id(model.blocks[0].attn1), 2 * HEADS)
    q_cent = processor._centroids[key][0].clone()
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, int(np.prod(GRID)), HEADS, HEAD_DIM, generator=g)
    processor._layer = key[0]
    step = processor.svg2_step(q, q)
    rows = q.permute(0, 2, 1, 3).reshape(2 * HEADS, -1, HEAD_DIM)
    labels, _ = kmeans(rows, 6, 2, q_cent, final_assign=False)  # SVG2's pairing, as the processor runs
    assert torch.equal(step.q_labels, labels)


def test_svg2_keeps_its_warm_start_in_the_same_tensors():
    """A layer's later calls copy their centroids into the tensors of its first call (what a CUDA graph
    replays read), and those hold the latest call's centroids."""
    processor = WanSparseAttnProcessor(GRID, WanSelection.svg2(**SVG2), backend="masked_sdpa")
    g = torch.Generator().manual_seed(7)
    n = int(np.prod(GRID))
    key = (None, 2 * HEADS)
    kept = None
    for call in range(3):
        q, k = (torch.randn(2, n, HEADS, HEAD_DIM, generator=g) for _ in range(2))
        step = processor.svg2_step(q, k)
        now = processor._centroids[key]
        if kept is None:
            kept = now
        assert now[0] is kept[0] and now[1] is kept[1], call
        assert torch.equal(now[0], step.q_centroids) and torch.equal(now[1], step.k_centroids), call
        assert now[0] is not step.q_centroids  # a copy: the step's own tensors stay what it computed


def test_svg2_model_trains_on_masked_sdpa():
    x, t, enc = model_inputs()
    model = tiny_model().train()
    install_sparse_attention(model, GRID, WanSelection.svg2(**SVG2), backend="masked_sdpa")
    model(x, t, enc, return_dict=False)[0].square().mean().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    with pytest.raises(ValueError, match="top_p"):
        WanSelection.svg2(top_p=0)


def test_svg2_plan_defaults_to_blocks_and_refuses_other_names(monkeypatch):
    from sparseattn.diffusers_wan import svg2_plan

    monkeypatch.delenv("SPARSEATTN_SVG2_PLAN", raising=False)
    assert svg2_plan() == "clusters"
    monkeypatch.setenv("SPARSEATTN_SVG2_PLAN", "blocks")
    assert svg2_plan() == "blocks"
    monkeypatch.setenv("SPARSEATTN_SVG2_PLAN", "cluster")
    with pytest.raises(ValueError, match="SPARSEATTN_SVG2_PLAN"):
        svg2_plan()


def svg2_kpage_against_masked(kpage, q, k, v):
    """``(rel_o, [rel_dq, rel_dk, rel_dv])``: one SVG2 call of ``kpage`` (a KPage-backend processor) through
    its KPage path (clusters' sums taken while the tokens move to slots) against masked SDPA of the step it
    made, output and gradients (the GPU test uses it too)."""
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = [x.detach().float().requires_grad_() for x in (q, k, v)]
    got = kpage._svg2_kpage(*leaves).float()
    step = kpage.last_svg2_step
    want = kpage._svg2_masked(*ref, step)
    do = torch.randn_like(want)
    got.backward(do)
    want.backward(do)
    assert got.shape == q.shape and torch.isfinite(got).all()
    rel = lambda a, b: float((a.detach().float() - b.detach()).norm() / b.detach().norm())
    return rel(got, want), [rel(a.grad, b.grad) for a, b in zip(leaves, ref)]


@pytest.mark.parametrize("plan", ["blocks", "clusters"])
def test_svg2_kpage_path_on_the_cpu_equals_masked_sdpa_on_the_same_step(plan, monkeypatch):
    """The KPage path of an SVG2 step (tokens to each row's slots straight from the ``[B, L, heads, d]``
    layout, per-row plans from the block mask or by clusters, the kernels' emulators on the CPU, back to
    tokens) against masked SDPA of the same clustering: output and gradients within bf16 rounding."""
    from sparseattn.diffusers_wan import WanSparseAttnProcessor

    monkeypatch.setenv("SPARSEATTN_SVG2_PLAN", plan)

    sel = WanSelection.svg2(**{**SVG2, "block_size": 64})  # the backward owns 64- or 128-row tiles
    kpage = WanSparseAttnProcessor(GRID, sel, backend="kpage")
    g = torch.Generator().manual_seed(4)
    n = int(np.prod(GRID))
    q, k, v = (torch.randn(2, n, HEADS, HEAD_DIM, generator=g).bfloat16() for _ in range(3))
    rel_o, rel_grads = svg2_kpage_against_masked(kpage, q, k, v)
    assert rel_o < 2e-2
    assert max(rel_grads) < 5e-2
