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
   * ``"flashinfer_bf16"``: the same wrapper and selection on K and V kept in bf16 (twice the cache's
     memory; no FP8 step);
   * ``"reference"``: masked attention in float32 on the dequantised cache (any device; checks).

Batch 1, head dim 128 for the GPU backends. With ``timed``, CUDA events split every call into its parts
(:data:`PARTS`: selection, cache, grouping, FlashInfer's plan, the attention kernel); with
``keep_selections``, each call's page selection is kept (:meth:`PrefillAttention.captures` turns them
into PageWeaver captures). :mod:`.prefill_bench` times whole prefills.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from .page_select import select_pages

#: The e4m3 format's largest finite value (a page's scale maps its largest magnitude at most there).
E4M3_MAX = 448.0
BACKENDS = ("union", "flashinfer", "flashinfer_bf16", "reference")
#: The parts of an attention call, in call order (a backend records those it has).
PARTS = ("select", "cache", "group", "plan", "kernel")


@dataclass
class PrefillAttention:
    """One sparse-prefill configuration: the selection's budget and the attention backend.

    ``timed``: ``parts`` collects a list of ``(part, event)`` CUDA-event marks per call (the first mark is
    the call's start; :meth:`part_times` sums them). ``keep_selections``:
    ``selections`` collects each call's int32 ``[Q, budget]`` page selection, in call order (one call per
    layer and forward)."""

    backend: str = "union"
    page_size: int = 64
    sink: int = 1
    local: int = 2
    top: int = 13
    group_size: int = 8
    window: int = 64
    fp8: bool = True
    timed: bool = False
    keep_selections: bool = False
    parts: list = field(default_factory=list)
    selections: list = field(default_factory=list)
    _workspace_buffer: object = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")

    @property
    def budget(self) -> int:
        return self.sink + self.local + self.top

    def reset(self) -> None:
        """Forget the recorded parts and selections."""
        self.parts, self.selections = [], []

    def __call__(self, module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
        """A ``transformers`` attention function: ``query`` ``[1, heads, L, d]``, ``key`` / ``value``
        ``[1, kv_heads, L, d]``; returns ``([1, L, heads, d], None)``."""
        if query.shape[0] != 1:
            raise ValueError(f"sparse prefill runs batch 1, got batch {query.shape[0]}")
        scale = 1.0 / math.sqrt(query.shape[-1]) if scaling is None else float(scaling)
        out = self.attend(query[0], key[0], value[0], scale, self._marker(query))
        return out.transpose(0, 1).unsqueeze(0), None

    def _marker(self, x: torch.Tensor):
        """``mark(part)``: a CUDA event after ``part`` of this call (a no-op unless timed on CUDA)."""
        if not (self.timed and x.is_cuda):
            return lambda part: None
        marks = []
        self.parts.append(marks)

        def mark(part: str) -> None:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            marks.append((part, event))

        mark("start")
        return mark

    def part_times(self) -> dict:
        """Milliseconds per part summed over the recorded calls (synchronises)."""
        torch.cuda.synchronize()
        total: dict = {}
        for marks in self.parts:
            for (_, a), (part, b) in itertools.pairwise(marks):
                total[part] = total.get(part, 0.0) + a.elapsed_time(b)
        return total

    def attend(self, q, k, v, scale: float, mark=None) -> torch.Tensor:
        """``[heads, L, d]`` output of ``q`` ``[heads, L, d]`` on ``k``, ``v`` ``[kv_heads, L, d]``."""
        mark = mark or (lambda part: None)
        n = q.shape[1]
        positions = torch.arange(n, device=q.device)
        # None: query i at position i, so the selection scores each chunk of queries on its causal pages only
        pages = select_pages(q, k, None, self.page_size, self.sink, self.local, self.top)
        if self.keep_selections:
            self.selections.append(pages)
        mark("select")
        if self.backend == "reference":
            if self.fp8:
                k, v = (dequantize(*fp8_cache(x, self.page_size), n) for x in (k, v))
            return masked_page_attention(q, k, v, pages, self.page_size, scale).to(q.dtype)
        if self.backend == "flashinfer_bf16":
            kc, vc = (paged_bf16(x, self.page_size) for x in (k, v))
            mark("cache")
            return self._flashinfer(q, kc, vc, pages, scale, mark)
        kc, ks = fp8_cache(k, self.page_size)
        vc, vs = fp8_cache(v, self.page_size)
        mark("cache")
        if self.backend == "union":
            return self._union(q, kc, vc, ks, vs, pages, positions, scale, mark)
        return self._flashinfer(q, kc, vc, pages, scale, mark)

    def captures(self, context: int, layers: int, name: str = "llama_prefill"):
        """PageWeaver captures (:class:`~.captures.Capture`) of the kept selections: the last forward's
        ``layers`` calls, one capture per layer, named ``{name}_{context}_layer{i}``."""
        from .captures import Capture

        if len(self.selections) < layers:
            raise ValueError(
                f"{len(self.selections)} selections kept, fewer than the {layers} layers asked for"
            )
        out = []
        for i, pages in enumerate(self.selections[-layers:]):
            arr = pages.cpu().numpy()
            out.append(
                Capture(
                    pages=arr,
                    positions=np.arange(arr.shape[0], dtype=np.int64),
                    context=int(context),
                    page_size=self.page_size,
                    causal=True,
                    name=f"{name}_{context}_layer{i}",
                    meta=dict(
                        source="the page selector of a random-init Llama-like model (weights are random, "
                        "not a trained model's)",
                        layer=i,
                        selector=f"Quest page scores over all query heads; sink {self.sink}, local "
                        f"{self.local}, top {self.top} pages",
                    ),
                )
            )
        return out

    def _union(self, q, kc, vc, ks, vs, pages, positions, scale, mark):
        from ..kernels.pageweaver import DeviceCapture, union_forward
        from .grouping_gpu import affinity_groups_device

        n = q.shape[1]
        capture = DeviceCapture(pages, positions.to(torch.int32), n, self.page_size)  # stays on the device
        groups = affinity_groups_device(capture.pages, capture.num_pages, self.group_size, self.window)
        mark("group")
        o, _ = union_forward(q.bfloat16().contiguous(), kc, vc, ks, vs, capture, groups, scale=scale)
        mark("kernel")
        return o

    def _flashinfer(self, q, kc, vc, pages, scale, mark):
        """FlashInfer's block-sparse wrapper: one row per query, a page per column block, K/V as stored
        (``kc``/``vc`` e4m3 or bf16 ``[kv_heads, pages · page_size, d]``)."""
        from .flashinfer_peer import block_sparse_wrapper

        n = pages.shape[0]
        valid = pages >= 0
        indptr = torch.cat([torch.zeros(1, dtype=torch.int64, device=q.device), valid.sum(1).cumsum(0)])
        indices = pages[valid].to(torch.int32)
        rows = kc.shape[1]
        wrapper = block_sparse_wrapper(self._workspace(q.device), n, backend="fa2")
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
            kv_data_type=kc.dtype,
            o_data_type=torch.bfloat16,
        )
        qt = q.transpose(0, 1).bfloat16().contiguous()  # [Q, heads, d]
        kt, vt = (x.transpose(0, 1).contiguous() for x in (kc, vc))
        mark("plan")
        out = wrapper.run(qt, kt, vt)
        mark("kernel")
        return out.transpose(0, 1)

    def _workspace(self, device) -> torch.Tensor:
        """FlashInfer's float workspace, allocated once per configuration and device."""
        ws = self._workspace_buffer
        if ws is None or ws.device != torch.device(device):
            ws = self._workspace_buffer = torch.empty(512 << 20, dtype=torch.uint8, device=device)
        return ws


def paged_bf16(x: torch.Tensor, page_size: int) -> torch.Tensor:
    """``x`` ``[kv_heads, L, d]`` as bf16 ``[kv_heads, pages · page_size, d]``, the last page zero-padded."""
    pad = -x.shape[1] % page_size
    return torch.nn.functional.pad(x.to(torch.bfloat16), (0, 0, 0, pad)).contiguous()


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
