"""Sparse prefill of a tiny random-init Llama (transformers) with the reference backend on the CPU: with
every page selected and no FP8 it is the model's own attention; a budget changes the output; the FP8 cache
round-trips within e4m3's precision."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from sparseattn.pageweaver.prefill import PrefillAttention, dequantize, fp8_cache, register

TINY_SHAPE = dict(
    vocab_size=97,
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
)


def _model(attn: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**TINY_SHAPE, num_hidden_layers=2, max_position_embeddings=512)
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


def test_prefill_bench_on_the_cpu_writes_records_captures_and_a_table(tmp_path):
    """The bench's loop on a tiny model (reference backend and dense SDPA on the CPU): records per context
    and backend, each layer's selection as a capture that loads back, and the README table."""
    from sparseattn.pageweaver.captures import load_capture
    from sparseattn.pageweaver.prefill_bench import bench, markdown_table

    records = bench(
        [128, 200],
        2,
        ("reference", "sdpa"),
        reps=1,
        budget=(1, 1, 2),
        page_size=16,
        captures_out=tmp_path,
        device="cpu",
        log=lambda m: None,
        shape=TINY_SHAPE,
    )
    assert [(r["tokens"], r["impl"]) for r in records] == [
        (128, "masked_reference"),
        (128, "sdpa_dense"),
        (200, "masked_reference"),
        (200, "sdpa_dense"),
    ]
    assert all(r["time_ms"] > 0 and r["tokens_per_s"] > 0 for r in records)
    paths = records[2]["captures"]
    assert len(paths) == 2
    cap = load_capture(paths[1])
    assert cap.context == 200 and cap.pages.shape == (200, 4) and cap.page_size == 16
    assert "random" in cap.meta["source"]
    own_page = cap.positions // 16
    assert ((cap.pages == own_page[:, None]).any(1)).all()  # the local page is always selected
    table = markdown_table(records).splitlines()
    assert table[0].startswith("| context | dense causal SDPA | masked reference")
    assert len(table) == 4


def test_prefill_bench_table_reads_the_first_recorded_runs():
    """The runs recorded before the bf16 path and the parts (impl pageweaver_flashinfer) still make a table."""
    from pathlib import Path

    from sparseattn.benchdata import load_run
    from sparseattn.pageweaver.prefill_bench import markdown_table

    history = Path(__file__).resolve().parents[1] / "data" / "bench" / "experiments"
    runs = sorted(history.glob("llama_prefill_*k_h200_*_d4b036b.json"))
    assert len(runs) == 2
    records = [r for p in runs for r in load_run(p).records]
    table = markdown_table(records)
    assert "FlashInfer e4m3" in table and "32K" in table
    assert "×" in table.splitlines()[-1]


def test_bench_model_prefill_cli_help(capsys):
    from sparseattn.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "model", "prefill", "--help"])
    assert exit_info.value.code == 0
    assert "--captures-out" in capsys.readouterr().out


def test_paged_bf16_pads_to_whole_pages():
    from sparseattn.pageweaver.prefill import paged_bf16

    x = torch.randn(2, 70, 32)
    y = paged_bf16(x, 16)
    assert y.shape == (2, 80, 32) and y.dtype == torch.bfloat16
    assert torch.equal(y[:, :70], x.bfloat16()) and not y[:, 70:].any()
