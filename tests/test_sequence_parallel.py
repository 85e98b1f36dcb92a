"""Ulysses sequence parallelism of the Wan processor on CPU: gloo processes with the masked-SDPA backend (and
the KPage backend on its CPU operators; tokens in raster or tile-major order) give the single-process outputs
and gradients (2 ranks, and 4 ranks with a token count the ranks do not divide), the all-to-alls round-trip,
and bad arguments fail clearly. One spawn of 4 processes serves
every test (the 2-rank cases run on a subgroup of ranks 0 and 1). Skipped unless torch and diffusers
import (``pip install -e '.[diffusers]'``)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from diffusers import WanTransformer3DModel

from sparseattn.diffusers_wan import WanSelection, install_sparse_attention, token_order_default
from sparseattn.layouts import video_layout
from sparseattn.sequence_parallel import (
    bench_step,
    gather_tokens,
    heads_to_seq,
    install_sequence_parallel,
    run_ranks,
    seq_to_heads,
    shard_tokens,
    sync_gradients,
    token_range,
    token_split,
)
from sparseattn.wan_training import tiny_wan

RANKS = 4
CASES = {
    # name: (ranks, model, latent (frames, height, width), selection); tokens = frames * height * width / 4
    "2 ranks sta": (2, "two heads", (5, 8, 8), WanSelection.sta((2, 2, 2), (1, 1, 1))),
    "2 ranks vsa": (2, "two heads", (5, 8, 8), WanSelection.vsa((2, 2, 2), 3)),
    "4 ranks sta": (4, "four heads", (5, 6, 6), WanSelection.sta((2, 2, 2), (1, 1, 1))),
    "4 ranks vsa": (4, "four heads", (5, 6, 6), WanSelection.vsa((2, 2, 2), 3)),
    # the tokens tile-major between the blocks (sliced after the permutation, gathered before its inverse);
    # held to the raster-order single process: partial tiles on the frame axis, 45 tokens over 4 ranks
    "2 ranks sta tiles": (2, "two heads", (5, 8, 8), WanSelection.sta((2, 2, 2), (1, 1, 1))),
    "4 ranks vsa tiles": (4, "four heads", (5, 6, 6), WanSelection.vsa((2, 2, 2), 3)),
    # the KPage backend (its CPU operators: the kernels' emulators) on the ranks' heads, against itself in
    # one process: the rank's graph cut by select_heads, VSA's per-rank selection and plans
    "2 ranks sta kpage": (2, "two heads", (5, 8, 8), WanSelection.sta((2, 2, 2), (1, 1, 1))),
    "4 ranks vsa kpage tiles": (4, "four heads", (5, 6, 6), WanSelection.vsa((2, 2, 2), 3)),
}


def token_order(name):
    return "tiles" if name.endswith("tiles") else None


def backend(name):
    return "kpage" if " kpage" in name else "masked_sdpa"


def make_model(kind: str):
    if kind == "two heads":
        return tiny_wan(0, head_dim=32, text_dim=16, ffn_dim=64)
    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=4,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
        cross_attn_norm=True,
        rope_max_seq_len=64,
    )


def inputs(latent, seed=1):
    """(latent [2, 4, *latent] with requires_grad, timesteps, text [2, 7, 16], output weights)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 4, *latent, generator=g).requires_grad_()
    enc = torch.randn(2, 7, 16, generator=g)
    w = torch.randn(2, 4, *latent, generator=g)
    return x, torch.tensor([500, 20]), enc, w


def grid_of(latent):
    return (latent[0], latent[1] // 2, latent[2] // 2)


def run_model(model, latent):
    """Output, input gradient, parameter gradients of ``sum(w * model(x))``, and the hidden states that
    enter the second block."""
    x, t, enc, w = inputs(latent)
    seen = []
    hook = model.blocks[1].register_forward_pre_hook(lambda module, args: seen.append(args[0].detach()))
    out = model(x, t, enc, return_dict=False)[0]
    hook.remove()
    (out * w).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), x.grad, grads, seen[0]


def single_process(name):
    _, kind, latent, selection = CASES[name]
    model = make_model(kind)
    # in raster order, whatever the case's ranks use (install_sparse_attention's own default is tile-major)
    install_sparse_attention(
        model, grid_of(latent), selection, backend=backend(name), token_order=token_order_default()
    )
    return run_model(model, latent)


def full_tensor(shape):
    return torch.arange(float(torch.Size(shape).numel())).reshape(shape) / 7


def _error(fn):
    try:
        fn()
    except ValueError as err:
        return str(err)
    return None


def worker(rank, ranks, names):
    """Every check on every rank of a 4-rank gloo world; returns what the tests compare."""
    pair = dist.new_group([0, 1])  # every rank takes part in creating a group
    result = {}

    # all-to-alls of uneven token slices: [2, L_rank, 4, 3] <-> [2, L, 1, 3], extra leading dims too
    sizes = token_split(11, ranks)
    full = full_tensor((3, 2, 11, 4, 3))
    start = sum(sizes[:rank])
    local = full[:, :, start : start + sizes[rank]].clone().requires_grad_()
    heads = seq_to_heads(local, sizes)
    back = heads_to_seq(heads, sizes)
    weight = full_tensor(local.shape) + rank
    (back * weight).sum().backward()
    result["a2a"] = (heads.detach(), back.detach(), local.grad)
    tokens = full_tensor((2, 11, 5))
    gathered = gather_tokens(shard_tokens(tokens.clone()), 11)
    result["gather"] = gathered

    # bad arguments
    result["errors"] = {
        "heads": _error(lambda: install_sequence_parallel(tiny_wan(0), (4, 4, 4), WanSelection.full())),
        "a2a heads": _error(lambda: seq_to_heads(torch.zeros(1, sizes[rank], 6, 2), sizes)),
        "token_sizes": _error(lambda: seq_to_heads(torch.zeros(1, sizes[rank], 4, 2), [1, 2])),
        "grid": _error(
            lambda: install_sequence_parallel(make_model("four heads"), (5, 3, 4), WanSelection.full())(
                make_model("four heads").blocks[0].attn1, torch.zeros(1, 45, 64)
            )
        ),
    }

    # the models
    for name in names:
        case_ranks, kind, latent, selection = CASES[name]
        group = pair if case_ranks == 2 else None
        if rank >= case_ranks:
            continue
        model = make_model(kind)
        order = token_order(name)
        install_sequence_parallel(
            model, grid_of(latent), selection, group=group, backend=backend(name), token_order=order
        )
        out, xgrad, grads, between = run_model(model, latent)
        sync_gradients(model, group)
        dist.all_reduce(xgrad, group=group)
        result[name] = (out, xgrad, grads, between)

    # the bench's step on all ranks (code path and timer)
    result["bench"] = bench_step(rank, ranks, grid=(4, 4, 4), layers=1, ffn_dim=32, steps=1, warmup=0)
    return result


@pytest.fixture(scope="module")
def ranks_results():
    # fork: the ranks start at once instead of each importing torch and diffusers anew (about 30 s on
    # 2 cores); the spawned path is test_command_line_spawns_the_ranks_and_prints_a_summary's
    return run_ranks(RANKS, worker, list(CASES), start_method="fork")


@pytest.mark.parametrize("name", list(CASES))
def test_outputs_and_gradients_equal_the_single_process_run(ranks_results, name):
    case_ranks = CASES[name][0]
    out, xgrad, grads, between = single_process(name)
    assert xgrad.abs().max() > 0 and len(grads) > 10
    _, _, latent, selection = CASES[name]
    grid = grid_of(latent)
    order = np.arange(int(np.prod(grid)))
    if token_order(name) == "tiles":  # between the blocks the ranks hold slices of the tile-major order
        order = np.argsort(video_layout(grid, selection.tile, selection.blocks()).token_slot, kind="stable")
        assert not np.array_equal(order, np.arange(order.size))  # else the check would prove nothing
    for rank in range(case_ranks):
        got_out, got_xgrad, got_grads, got_between = ranks_results[rank][name]
        start, stop = token_range(order.size, case_ranks, rank)
        torch.testing.assert_close(
            got_between, between[:, torch.as_tensor(order[start:stop])], rtol=1e-5, atol=1e-5
        )
        torch.testing.assert_close(got_out, out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_xgrad, xgrad, rtol=1e-5, atol=1e-5)
        assert got_grads.keys() == grads.keys()
        for key, grad in grads.items():
            torch.testing.assert_close(got_grads[key], grad, rtol=1e-4, atol=1e-5, msg=f"{name}: {key}")
    for rank in range(case_ranks, RANKS):
        assert name not in ranks_results[rank]


def test_the_sparse_selection_matters():
    """The equality above is not that of dense attention: STA's output differs from the full selection's."""
    _, kind, latent, _ = CASES["4 ranks sta"]
    sta = single_process("4 ranks sta")[0]
    model = make_model(kind)
    install_sparse_attention(model, grid_of(latent), WanSelection.full((2, 2, 2)), backend="masked_sdpa")
    assert (run_model(model, latent)[0] - sta).abs().max() > 1e-3


def test_all_to_all_round_trip_with_uneven_token_slices(ranks_results):
    sizes = token_split(11, RANKS)
    assert sizes == [3, 3, 3, 2]
    full = full_tensor((3, 2, 11, 4, 3))
    for rank, result in enumerate(ranks_results):
        heads, back, grad = result["a2a"]
        start = sum(sizes[:rank])
        torch.testing.assert_close(heads, full[:, :, :, rank : rank + 1], rtol=0, atol=0)
        torch.testing.assert_close(back, full[:, :, start : start + sizes[rank]], rtol=0, atol=0)
        torch.testing.assert_close(grad, full_tensor(back.shape) + rank, rtol=0, atol=0)
        torch.testing.assert_close(result["gather"], full_tensor((2, 11, 5)), rtol=0, atol=0)


def test_bad_arguments_fail_clearly(ranks_results):
    for result in ranks_results:
        errors = result["errors"]
        assert (
            "num_attention_heads (2) must be a multiple of the sequence-parallel ranks (4)" in errors["heads"]
        )
        assert "heads (6) must be a multiple" in errors["a2a heads"]
        assert "token_sizes" in errors["token_sizes"]
        assert "hidden_states holds 45 tokens" in errors["grid"]
    with pytest.raises(RuntimeError, match="init_process_group"):
        install_sequence_parallel(tiny_wan(0), (4, 4, 4), WanSelection.full())
    with pytest.raises(ValueError, match="num_tokens"):
        token_split(3, 4)


def test_bench_step_reports_step_and_all_to_all_time(ranks_results):
    for rank, result in enumerate(ranks_results):
        bench = result["bench"]
        assert bench["rank"] == rank and bench["ranks"] == RANKS
        assert len(bench["step_s"]) == 1 and 0 < bench["all_to_all_s"][0] < bench["step_s"][0]
    single = bench_step(0, 1, grid=(4, 4, 4), layers=1, ffn_dim=32, steps=1, warmup=0)
    assert single["all_to_all_s"] == [0.0]


def test_command_line_spawns_the_ranks_and_prints_a_summary(capsys):
    import json

    from sparseattn.sequence_parallel import main

    assert main(["--ranks", "2", "--grid", "4,4,4", "--layers", "1", "--ffn-dim", "32", "--steps", "1"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ranks"] == 2 and summary["backend"] == "masked_sdpa" and len(summary["per_rank"]) == 2
    assert 0 < summary["all_to_all_share"] < 1
