"""Sparse prefill of a tiny random-init Llama (transformers) with the reference backend on the CPU: with
every page selected and no FP8 it is the model's own attention; a budget changes the output; the FP8 cache
round-trips within e4m3's precision."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from sparseattn.pageweaver.prefill import PrefillAttention, dequantize, fp8_cache, register


def _model(attn: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
    )
    config._attn_implementation = attn
    return LlamaForCausalLM(config).eval()


def _logits(attn: str, ids):
    with torch.no_grad():
        return _model(attn)(ids).logits


def test_every_page_selected_equals_the_models_own_attention():
    ids = torch.randint(0, 97, (1, 150), generator=torch.Generator().manual_seed(1))
    name = register(PrefillAttention(backend="reference", page_size=16, sink=1, local=1, top=20, fp8=False))
    torch.testing.assert_close(_logits(name, ids), _logits("eager", ids), rtol=1e-4, atol=1e-4)


def test_a_budget_changes_the_output_and_fp8_stays_close():
    ids = torch.randint(0, 97, (1, 150), generator=torch.Generator().manual_seed(2))
    dense = _logits("eager", ids)
    sparse = _logits(
        register(
            PrefillAttention(backend="reference", page_size=16, sink=1, local=1, top=2, fp8=False), "pw_small"
        ),
        ids,
    )
    assert (sparse - dense).abs().max() > 1e-3
    fp8 = _logits(
        register(PrefillAttention(backend="reference", page_size=16, sink=1, local=1, top=2), "pw_fp8"), ids
    )
    assert ((fp8 - sparse).norm() / sparse.norm()) < 5e-2


def test_fp8_cache_scales_are_powers_of_two_and_round_trip():
    x = torch.randn(2, 100, 32, generator=torch.Generator().manual_seed(3)) * 5
    values, scale = fp8_cache(x, 16)
    assert values.shape == (2, 112, 32) and values.dtype == torch.float8_e4m3fn and scale.shape == (2, 7)
    assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)
    back = dequantize(values, scale, 100)
    assert ((back - x).norm() / x.norm()) < 0.05
