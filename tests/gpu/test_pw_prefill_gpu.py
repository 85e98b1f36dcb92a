"""PageWeaver's union kernel inside a Llama prefill (selection, FP8 cache, GPU grouping and the union on a
device capture, no host copy) against the reference backend on the same selection and cache."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("context", [300, 1100])
def test_union_prefill_equals_the_reference_backend(context):
    from transformers import LlamaConfig, LlamaForCausalLM

    from sparseattn.pageweaver.prefill import PrefillAttention, register

    config = LlamaConfig(
        vocab_size=101,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, 101, (1, context), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    logits = {}
    for backend in ("reference", "union"):
        attn = PrefillAttention(backend, page_size=64, sink=1, local=1, top=3)
        model.config._attn_implementation = register(attn, f"pw_test_{backend}")
        with torch.no_grad():
            logits[backend] = model(ids).logits.float()
    ref, got = logits["reference"], logits["union"]
    rel = (got - ref).norm() / ref.norm()
    assert torch.isfinite(got).all() and rel < 2e-2, f"relative difference {rel:.3e}"
