"""Sparse prefill of a Llama-like ``transformers`` model with PageWeaver's union attention.

Every attention layer of the model runs (``register`` installs it as a ``transformers`` attention
implementation):

1. a per-query page selection from the layer's own Q and K (:func:`~.page_select.select_pages`: Quest
   scores, sink + local + top pages, causal), on the tensors' device;
2. the layer's K and V in an FP8 cache: e4m3 values with one power-of-two scale per (KV head, page)
   (:func:`fp8_cache`), as a model that keeps an FP8 cache holds them;
3. attention over each query's selected pages, by one of the backends:

   * ``"union"``: PageWeaver's union kernel after the GPU affinity grouping (groups of 8 queries,
     window 64) — :func:`sparseattn.kernels.pageweaver.union_forward`;
   * ``"flashinfer"``: FlashInfer's block-sparse wrapper on the same selection and the same e4m3 cache
     (one row per query, a page per block; ``fa2``): the native path of a model with an FP8 cache;
   * ``"reference"``: masked attention in float32 on the dequantised cache (any device; checks).

Batch 1, head dim 128 for the GPU backends. :func:`bench` times whole prefills (a random-init model, its
layers and width stated in the records) and the attention part (CUDA events around every attention call).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .page_select import select_pages

#: The e4m3 format's largest finite value (a page's scale maps its largest magnitude at most there).
E4M3_MAX = 448.0
BACKENDS = ("union", "flashinfer", "reference")


@dataclass
class PrefillAttention:
    """One sparse-prefill configuration: the selection's budget and the attention backend; ``times``
    collects CUDA-event pairs around each attention call when ``timed``."""

    backend: str = "union"
    page_size: int = 64
    sink: int = 1
    local: int = 2
    top: int = 13
    group_size: int = 8
    window: int = 64
    fp8: bool = True
    timed: bool = False
    times: list = field(default_factory=list)

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")

    @property
    def budget(self) -> int:
        return self.sink + self.local + self.top

    def __call__(self, module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
        """A ``transformers`` attention function: ``query`` ``[1, heads, L, d]``, ``key`` / ``value``
        ``[1, kv_heads, L, d]``; returns ``([1, L, heads, d], None)``."""
        if query.shape[0] != 1:
            raise ValueError(f"sparse prefill runs batch 1, got batch {query.shape[0]}")
        scale = 1.0 / math.sqrt(query.shape[-1]) if scaling is None else float(scaling)
        start = end = None
        if self.timed and query.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        out = self.attend(query[0], key[0], value[0], scale)
        if start is not None:
            end.record()
            self.times.append((start, end))
        return out.transpose(0, 1).unsqueeze(0), None

    def attend(self, q, k, v, scale: float) -> torch.Tensor:
        """``[heads, L, d]`` output of ``q`` ``[heads, L, d]`` on ``k``, ``v`` ``[kv_heads, L, d]``."""
        n = q.shape[1]
        positions = torch.arange(n, device=q.device)
        pages = select_pages(q, k, positions, self.page_size, self.sink, self.local, self.top)
        if self.backend == "reference":
            if self.fp8:
                k, v = (dequantize(*fp8_cache(x, self.page_size), n) for x in (k, v))
            return masked_page_attention(q, k, v, pages, self.page_size, scale).to(q.dtype)
        kc, ks = fp8_cache(k, self.page_size)
        vc, vs = fp8_cache(v, self.page_size)
        if self.backend == "union":
            return self._union(q, kc, vc, ks, vs, pages, positions, scale)
        return self._flashinfer(q, kc, vc, pages, scale)

    def _union(self, q, kc, vc, ks, vs, pages, positions, scale):
        from ..kernels.pageweaver import DeviceCapture, union_forward
        from .grouping_gpu import affinity_groups_device

        n = q.shape[1]
        capture = DeviceCapture(pages, positions.to(torch.int32), n, self.page_size)  # stays on the device
        groups = affinity_groups_device(capture.pages, capture.num_pages, self.group_size, self.window)
        o, _ = union_forward(q.bfloat16().contiguous(), kc, vc, ks, vs, capture, groups, scale=scale)
        return o

    def _flashinfer(self, q, kc, vc, pages, scale):
        import flashinfer

        n = pages.shape[0]
        valid = pages >= 0
        indptr = torch.cat([torch.zeros(1, dtype=torch.int64, device=q.device), valid.sum(1).cumsum(0)])
        indices = pages[valid].to(torch.int32)
        rows = kc.shape[1]
        wrapper = flashinfer.BlockSparseAttentionWrapper(
            torch.empty(512 << 20, dtype=torch.uint8, device=q.device), backend="fa2"
        )
        wrapper.plan(
            indptr.to(torch.int32),
            indices,
            n,
            rows,
            1,
            self.page_size,
            q.shape[0],
            kc.shape[0],
            q.shape[2],
            sm_scale=scale,
            q_data_type=torch.bfloat16,
            kv_data_type=torch.float8_e4m3fn,
            o_data_type=torch.bfloat16,
        )
        qt = q.transpose(0, 1).bfloat16().contiguous()  # [Q, heads, d]
        out = wrapper.run(qt, kc.transpose(0, 1).contiguous(), vc.transpose(0, 1).contiguous())
        return out.transpose(0, 1)


def fp8_cache(x: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, scales)``: ``x`` ``[kv_heads, L, d]`` as e4m3 ``[kv_heads, pages · page_size, d]`` (the last
    page zero-padded) with one power-of-two float32 scale per (KV head, page)."""
    h, n, d = x.shape
    pages = -(-n // page_size)
    xf = torch.nn.functional.pad(x.float(), (0, 0, 0, pages * page_size - n)).view(h, pages, page_size, d)
    peak = xf.abs().amax((2, 3)).clamp(min=1e-30)
    scale = torch.exp2(torch.ceil(torch.log2(peak / E4M3_MAX)))
    values = (xf / scale[:, :, None, None]).to(torch.float8_e4m3fn)
    return values.view(h, pages * page_size, d), scale.float().contiguous()


def dequantize(values: torch.Tensor, scale: torch.Tensor, n: int) -> torch.Tensor:
    """float32 ``[kv_heads, n, d]`` of :func:`fp8_cache`'s output (the first ``n`` rows)."""
    h, rows, d = values.shape
    page_size = rows // scale.shape[1]
    x = values.float().view(h, -1, page_size, d) * scale[:, :, None, None]
    return x.view(h, rows, d)[:, :n]


def masked_page_attention(q, k, v, pages, page_size: int, scale: float) -> torch.Tensor:
    """float32 ``[heads, Q, d]``: each query over the keys of its selected pages up to its position (query
    ``i`` at position ``i``); ``k``, ``v`` ``[kv_heads, L, d]`` (GQA by repetition)."""
    h, nq, _ = q.shape
    hkv, n, _ = k.shape
    g = h // hkv
    key_page = torch.arange(n, device=q.device) // page_size
    sel = torch.zeros(nq, -(-n // page_size) + 1, dtype=torch.bool, device=q.device)
    sel.scatter_(1, torch.where(pages >= 0, pages.long(), sel.shape[1] - 1), True)
    mask = sel[:, key_page] & (
        torch.arange(n, device=q.device)[None, :] <= torch.arange(nq, device=q.device)[:, None]
    )
    from ..torch_ops import masked_attention

    kf, vf = (x.float().repeat_interleave(g, 0) for x in (k, v))
    return masked_attention(q.float(), kf, vf, mask, scale)[0]


def register(config: PrefillAttention, name: str = "pageweaver_prefill") -> str:
    """Install ``config`` as the ``transformers`` attention implementation ``name``; returns ``name`` (pass
    it as ``attn_implementation`` / set ``model.config._attn_implementation``)."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, config)
    return name


# ---- the whole-model bench ----------------------------------------------------------------------------

#: A Llama-like shape: 8 KV heads of 128 (GQA 4), width 4096, FFN 14336 (Llama-3-8B's), random init.
LLAMA_SHAPE = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
)


def bench(
    context: int, layers: int, backends, reps: int = 3, budget=(1, 2, 13), page_size: int = 64, log=print
):
    """Records of whole prefills of ``context`` tokens (batch 1) per backend: ``time_ms`` the median step,
    ``attn_ms`` the attention calls' CUDA-event time (selection, FP8 cache and attention), ``tokens_per_s``;
    ``sdpa_dense`` is the model's own dense attention (its native path without an FP8 cache)."""
    import statistics
    import time

    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**LLAMA_SHAPE, num_hidden_layers=layers, max_position_embeddings=max(context, 8192))
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(
        0, config.vocab_size, (1, context), device="cuda", generator=torch.Generator("cuda").manual_seed(1)
    )
    sink, local, top = budget
    base = dict(
        workload=f"llama_prefill_{context}",
        **{"pass": "prefill"},
        tokens=context,
        layers=layers,
        hidden=config.hidden_size,
        heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads,
        head_dim=128,
        page_size=page_size,
        sink=sink,
        local=local,
        top=top,
    )
    records = []
    for backend in backends:
        rec = dict(base, impl="sdpa_dense" if backend == "sdpa" else f"pageweaver_{backend}")
        attn = None
        if backend == "sdpa":
            model.config._attn_implementation = "sdpa"
        else:
            attn = PrefillAttention(backend, page_size, sink, local, top, timed=True)
            model.config._attn_implementation = register(attn, f"pw_prefill_{backend}")
        try:
            times, attn_ms = [], []
            for i in range(reps + 1):
                if attn is not None:
                    attn.times = []
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with torch.no_grad():
                    model(ids)
                torch.cuda.synchronize()
                if i:  # the first is the warm-up (kernel compiles, FlashInfer's JIT)
                    times.append((time.perf_counter() - t0) * 1e3)
                    if attn is not None:
                        attn_ms.append(sum(a.elapsed_time(b) for a, b in attn.times))
            ms = statistics.median(times)
            rec.update(time_ms=round(ms, 2), tokens_per_s=round(context / ms * 1e3, 1), times_ms=times)
            if attn_ms:
                rec["attn_ms"] = round(statistics.median(attn_ms), 2)
        except Exception as exc:  # noqa: BLE001 - a failing backend is recorded, the others still run
            rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
        log(f"{rec['impl']}: {rec.get('time_ms', rec.get('error'))}")
        records.append(rec)
    return records


def main(argv=None) -> int:
    """``python -m sparseattn.pageweaver.prefill``: whole-model prefills, union against FlashInfer's e4m3
    path on the same selection and FP8 cache, and the dense native path."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m sparseattn.pageweaver.prefill", description=main.__doc__)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=4, help="layers of the Llama-like model (default 4)")
    ap.add_argument("--backends", default="union,flashinfer,sdpa")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget", default="1,2,13", help="sink,local,top pages (default 1,2,13: 16 pages)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from ..bench import run_path, write_run

    budget = tuple(int(x) for x in args.budget.split(","))
    records = bench(args.context, args.layers, args.backends.split(","), args.reps, budget, args.page_size)
    model = f"Llama-like (width 4096, 32 heads on 8 KV heads of 128, FFN 14336), random init, bf16, {args.layers} layers"
    out = write_run(
        run_path(args.out, "llama_prefill"),
        "python -m sparseattn.pageweaver.prefill",
        argv,
        records,
        model=model,
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
