"""Benchmark the sparse attention kernels against their peers on one GPU (``sparseattn bench``).

For each workload (full-size layout and selection, ``--heads`` heads, batch 1) it times, side by side:

* ``kpage``: the KPage plan on the paged forward skeleton (:func:`sparseattn.kernels.forward.kpage_forward`);
* ``bsa``: the logical-block BSA plan on the same skeleton (:func:`sparseattn.kernels.forward.bsa_forward`);
* ``bsa_mma``: the mma.sync BSA kernel (:func:`sparseattn.kernels.bsa_mma_forward.bsa_mma_forward`; with
  ``bwd`` / ``fwdbwd`` also :func:`sparseattn.kernels.bsa_backward.bsa_mma_backward`);
* ``flex``: torch FlexAttention with a ``BlockMask`` built from the graph's block lists plus a
  padding ``mask_mod`` (exact), when torch is importable;
* ``cudnn_dense``: cuDNN SDPA over the compact (unpadded) token sequence, the dense ceiling;
* ``vsa_kernel``: on ``vsa_*`` workloads, the VSA system's own kernel (``fastvideo-kernel==0.3.4``, Triton
  path), when installed;
* ``flashinfer_varblock`` / ``flashinfer_varblock_fa3``: on ``svg2_*`` workloads, FlashInfer's
  variable-block sparse wrapper (``flashinfer-python``; backends ``fa2`` / ``fa3``): each head's
  clusters as variable-size blocks, tokens permuted per head, no padding (:func:`varblock_inputs`);
Workloads whose heads have their own layouts (SVG2) run as a :class:`~sparseattn.graph.HeadStack`:
one launch for all heads on our kernels, per-head block masks for FlexAttention.
``physical_pairs`` is what each implementation executes (for the paged skeleton: M · chunk · chunks
over its work items).

Timing: CUDA events around each call, warm-up first, the L2 cache flushed (a 256 MB write) before
every timed call, median of ``--reps`` calls. Rates: useful TFLOP/s = 4·useful·d / t forward
(×3.5 for forward+backward: the backward costs 2.5× the forward), physical likewise with the pairs
the implementation computes. Correctness: each sparse implementation's output for one head is
compared with the float64 reference in the same run on 96 random Q blocks (``correct``;
‖o − ref‖/‖ref‖ < 1e-2 on their valid rows); the skeleton's backward too, before it is timed: dQ on 8
random Q blocks, dK and dV on 8 random K blocks of head 0, against the float64 reference backward from
the kernel's own O and LSE (``rel_err_grads``, the largest of the three; ``correct`` when < 1e-2).

Results go to a JSON file under ``data/bench/`` (the schema in docs/results.md) and a table on stdout.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

try:  # the GPU side is optional: `sparseattn bench --help` works without it
    import cupy
except ImportError:  # pragma: no cover - depends on the machine
    cupy = None

from .benchdata import FLOPS_PER_PAIR
from .flex import to_flex_block_mask
from .graph import HeadStack, SparseGraph
from .kernels.validate import bf16_bits_to_float

DEFAULT_WORKLOADS = ("vsa_wan14b_720p", "ssta_hy15_720p", "svg2_wan14b_720p", "sta_hunyuan_117f")
IMPLS = (
    "kpage",
    "bsa",
    "bsa_mma",
    "flex",
    "cudnn_dense",
    "vsa_kernel",
    "kpage_pair",
    "kpage_packed",
    "flashinfer_varblock",
    "flashinfer_varblock_fa3",
)
#: Opt-in implementations (run only when named with --impl): kpage_pair forces KPage's pair route in both
#: passes (``kpage`` takes it where ``route="auto"`` does); kpage_packed runs the forward's packed route.
OPT_IN_IMPLS = ("kpage_pair", "kpage_packed")
PASSES = ("fwd", "bwd", "fwdbwd", "plan")
TORCH_IMPLS = ("flex", "cudnn_dense", "vsa_kernel", "flashinfer_varblock", "flashinfer_varblock_fa3")
#: The skeleton's plans: backward records per --bwd-impl.
PAGED_IMPLS = ("kpage", "bsa", "kpage_pair", "kpage_packed")
O_REL_TOL = 1e-2
#: Bound on the sampled gradients' ‖g − ref‖/‖ref‖: a backward within twice the bf16-rounding emulation's
#: error sits near 5e-3 (the GPU tests' rule), a wrong one far above.
GRAD_REL_TOL = 1e-2
GRAD_SAMPLE_BLOCKS = 8
L2_FLUSH_BYTES = 256 * 1024 * 1024

#: Dense all-pairs graphs (every block pair selected, 128-token blocks): the skeleton against cuDNN's
#: dense attention on the same tokens. name -> (tokens, heads, head_dim); 75,600: the Wan 720p latent;
#: 16K to 128K tokens with about half a million query rows (tokens · heads) each.
DENSE_WORKLOADS = {
    "dense_16384": (16384, 32, 128),
    "dense_32768": (32768, 16, 128),
    "dense_75600": (75600, 8, 128),
    "dense_131072": (131072, 4, 128),
}


def dense_graph(name: str, heads: int | None = None) -> tuple[SparseGraph, int]:
    from .layouts import contiguous_layout

    tokens, default_heads, head_dim = DENSE_WORKLOADS[name]
    layout = contiguous_layout(tokens, 128, name=f"{name} layout")
    h = int(heads or default_heads)
    mask = np.ones((h, layout.num_blocks, layout.num_blocks), dtype=bool)
    return SparseGraph.from_block_mask(layout, layout, mask, name=name), head_dim


def workload_graph(name: str, heads: int | None = None, seed: int = 0):
    """(graph, workload head_dim) of a built-in workload, first ``heads`` heads: a SparseGraph, or a
    HeadStack when every head has its own layouts (SVG2). ``dense_*`` names give all-pairs graphs."""
    from .workloads import get_workload

    if name in DENSE_WORKLOADS:
        return dense_graph(name, heads)
    wl = get_workload(name)
    graphs = wl.graphs(seed=seed, heads=heads)
    if any(g.q is not graphs[0].q or g.k is not graphs[0].k for g in graphs[1:]):
        return HeadStack.of(graphs), int(wl.head_dim)
    graph = graphs[0] if len(graphs) == 1 else _concat_heads(graphs)
    if heads is not None and graph.heads > heads:
        graph = graph.select_heads(np.arange(int(heads)))
    return graph, int(wl.head_dim)


def _concat_heads(graphs: list[SparseGraph]) -> SparseGraph:
    """One graph holding the heads of several graphs over the same layouts."""
    hs, qs, ks, base = [], [], [], 0
    for g in graphs:
        h, i, j = g.pairs
        hs.append(h + base)
        qs.append(i)
        ks.append(j)
        base += g.heads
    g0 = graphs[0]
    return SparseGraph.from_pairs(
        g0.q,
        g0.k,
        base,
        np.concatenate(hs),
        np.concatenate(qs),
        np.concatenate(ks),
        g0.name,
        drop_empty=False,
    )


def head_graph(graph, head: int) -> SparseGraph:
    """One head of a SparseGraph or HeadStack as a single-head graph."""
    return graph.graphs[head] if isinstance(graph, HeadStack) else graph.select_heads([head])


def graph_slots(graph) -> tuple[int, int]:
    if isinstance(graph, HeadStack):
        return graph.q_slots, graph.k_slots
    return graph.q.num_slots, graph.k.num_slots


# ---- timing ---------------------------------------------------------------------------------------


class Timer:
    """CUDA-event timing with an L2 flush before each timed call; returns the median in ms."""

    def __init__(self, warmup: int, reps: int):
        self.warmup, self.reps = warmup, reps
        self.flush_buf = cupy.empty(L2_FLUSH_BYTES // 4, dtype=cupy.int32)

    def __call__(self, fn, reps: int | None = None) -> tuple[float, list[float]]:
        reps = self.reps if reps is None else reps
        for _ in range(self.warmup):
            fn()
        cupy.cuda.Device().synchronize()
        events = []
        for _ in range(reps):
            self.flush_buf.fill(1)
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            fn()
            end.record()
            events.append((start, end))
        cupy.cuda.Device().synchronize()
        times = [cupy.cuda.get_elapsed_time(s, e) for s, e in events]
        return float(np.median(times)), times


# ---- implementations -------------------------------------------------------------------------------


def _torch():
    try:
        import torch

        return torch if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 (a failing peer or step is recorded, not fatal)
        return None


def _as_cupy_bf16(t):
    """A cupy uint16 (bf16 bits) view of a contiguous torch bf16 CUDA tensor (no copy)."""
    torch = _torch()
    return cupy.from_dlpack(t.contiguous().view(torch.int16)).view(cupy.uint16)


def torch_grad_records(timer: Timer, passes, impl: str, forward, inputs, do, physical: int, reps=None):
    """``fwdbwd`` and ``bwd`` records of a torch peer; ``forward(*inputs)`` returns the attention output,
    ``inputs`` require grad. Forward+backward is one ``torch.autograd.grad`` through a fresh forward;
    the backward alone is that minus the same forward under autograd (compiled FlexAttention donates
    its saved buffers, so its backward cannot be replayed on a retained graph); ``timed_as`` says so."""
    torch = _torch()
    if "bwd" not in passes and "fwdbwd" not in passes:
        return []
    try:
        fwdbwd_ms, _ = timer(lambda: torch.autograd.grad(forward(*inputs), inputs, do), reps=reps)
        fwd_ms = timer(lambda: forward(*inputs), reps=reps)[0] if "bwd" in passes else None
    except Exception as exc:  # noqa: BLE001 (a failing peer or step is recorded, not fatal)
        err = f"{type(exc).__name__}: {exc}"[:300]
        return [dict(impl=impl, **{"pass": p}, error=err) for p in ("bwd", "fwdbwd") if p in passes]
    out = []
    if "bwd" in passes:
        out.append(
            dict(
                impl=impl,
                **{"pass": "bwd"},
                time_ms=fwdbwd_ms - fwd_ms,
                physical_pairs=physical,
                correct=None,
                timed_as="fwdbwd - fwd (the forward under autograd)",
            )
        )
    if "fwdbwd" in passes:
        out.append(
            dict(impl=impl, **{"pass": "fwdbwd"}, time_ms=fwdbwd_ms, physical_pairs=physical, correct=None)
        )
    return out


class Case:
    """Inputs of one workload on the GPU (torch tensors when torch is there, cupy views of them)."""

    def __init__(self, graph: SparseGraph, head_dim: int, batch: int, seed: int):
        self.graph, self.d, self.b = graph, head_dim, batch
        self.scale = 1.0 / np.sqrt(head_dim)
        h = graph.heads
        rs = cupy.random.RandomState(seed)
        sq, sk = graph_slots(graph)
        shape_q = (batch, h, sq, head_dim)
        shape_k = (batch, h, sk, head_dim)

        def rand_bits(shape):
            x = rs.standard_normal(shape, dtype=cupy.float32)
            u = x.view(cupy.uint32)
            return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(cupy.uint16)

        self.q, self.k, self.v = rand_bits(shape_q), rand_bits(shape_k), rand_bits(shape_k)
        self.do = rand_bits(shape_q)

    def head0_inputs(self):
        """float32 host copies of head 0's q, k, v and do ``[batch, 1, slots, d]``, made once per case
        (every check of every implementation reads them)."""
        if not hasattr(self, "_head0"):
            self._head0 = tuple(
                bf16_bits_to_float(cupy.asnumpy(x[:, :1])) for x in (self.q, self.k, self.v, self.do)
            )
        return self._head0

    def rel_err_head0(self, o_head0, sample_q_blocks: int = 96, seed: int = 0) -> float:
        """‖o − ref‖/‖ref‖ of head 0 over the valid rows of ``sample_q_blocks`` random Q blocks
        (float64 reference on the same bf16 inputs, computed once per case)."""
        if not hasattr(self, "_ref"):
            from .reference import attention_forward

            g = head_graph(self.graph, 0)
            sub, rows = sampled_blocks(g, "q", sample_q_blocks, np.random.default_rng(seed))
            q, k, v, _ = self.head0_inputs()
            nq, nk = g.q.num_slots, g.k.num_slots
            ref, _ = attention_forward(q[:, :, :nq], k[:, :, :nk], v[:, :, :nk], sub, scale=self.scale)
            self._ref = (ref[:, 0][:, rows], rows)
        ref, rows = self._ref
        got = np.asarray(o_head0, dtype=np.float64)[:, : rows.size][:, rows]
        return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))

    def grad_err_head0(self, o, lse, grads) -> float:
        """:func:`sampled_grad_error` of head 0: ``o``, ``lse`` the forward's device outputs, ``grads`` the
        backward's ``(dq, dk, dv)`` (device, bf16 bits, every head)."""
        g = head_graph(self.graph, 0)
        nq, nk = g.q.num_slots, g.k.num_slots
        q, k, v, do = self.head0_inputs()
        o0 = bf16_bits_to_float(cupy.asnumpy(o[:, :1]))[:, :, :nq]
        lse0 = cupy.asnumpy(lse[:, :1]).astype(np.float64)[:, :, :nq]
        dq, dk, dv = (bf16_bits_to_float(cupy.asnumpy(x[:, :1])) for x in grads)
        return sampled_grad_error(
            g,
            q[:, :, :nq],
            k[:, :, :nk],
            v[:, :, :nk],
            o0,
            lse0,
            do[:, :, :nq],
            (dq[:, :, :nq], dk[:, :, :nk], dv[:, :, :nk]),
            self.scale,
        )

    def torch_views(self):
        torch = _torch()
        return tuple(
            torch.from_dlpack(x.view(cupy.int16)).view(torch.bfloat16)
            for x in (self.q, self.k, self.v, self.do)
        )


def sampled_blocks(graph: SparseGraph, side: str, count: int, rng) -> tuple[SparseGraph, np.ndarray]:
    """``count`` random blocks of a one-head ``graph``'s ``side`` (``"q"`` or ``"k"``): the graph of every
    pair they are in, and bool ``[side's slots]``: their valid rows. A reference on that graph is exact on
    those rows."""
    layout = graph.q if side == "q" else graph.k
    h, i, j = graph.pairs
    chosen = rng.choice(layout.num_blocks, size=min(count, layout.num_blocks), replace=False)
    keep = np.isin(i if side == "q" else j, chosen)
    sub = SparseGraph.from_pairs(graph.q, graph.k, 1, h[keep], i[keep], j[keep], drop_empty=False)
    rows = np.zeros(layout.num_blocks, dtype=bool)
    rows[chosen] = True
    return sub, np.repeat(rows, layout.block_size) & layout.valid


def sampled_grad_error(
    graph: SparseGraph,
    q,
    k,
    v,
    o,
    lse,
    do,
    grads,
    scale,
    sample_blocks: int = GRAD_SAMPLE_BLOCKS,
    seed: int = 0,
) -> float:
    """The largest ‖g − ref‖/‖ref‖ of a backward's dQ, dK and dV on a one-head ``graph``: dQ on the valid
    rows of ``sample_blocks`` random Q blocks, dK and dV on those of ``sample_blocks`` random K blocks,
    each against the float64 reference backward over every pair of its blocks, from the kernel's own
    ``o`` and ``lse`` (so the backward is checked on its own).

    Args:
        q, o, do: ``[batch, 1, q slots, d]``; k, v: ``[batch, 1, k slots, d]``; lse: ``[batch, 1, q slots]``
            (natural log, as the forward kernels write it).
        grads: ``(dq, dk, dv)`` shaped as ``q``, ``k``, ``v``.
    """
    from .reference import attention_backward

    rng = np.random.default_rng(seed)
    errors = []
    for side, which in (("q", (0,)), ("k", (1, 2))):
        sub, rows = sampled_blocks(graph, side, sample_blocks, rng)
        ref = attention_backward(q, k, v, o, lse, do, sub, scale=scale)
        for n in which:
            got = np.asarray(grads[n], dtype=np.float64)[:, :, rows]
            want = ref[n][:, :, rows]
            errors.append(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
    return float(max(errors))


#: The backward kernel of each ``SPARSEATTN_BWD_IMPL`` value, as the fwdbwd records name it.
BACKWARD_KERNELS = {
    "mma": "mma.sync (kernels_cu/bsa_bwd.cu)",
    "wgmma": "wgmma: warp-specialized on 128-row tiles; on plans of 64-row tiles only, dK/dV then a Q-owned dQ "
    "pass, else bulk dQ reductions on them (kernels_cu/paged_bwd.cu)",
    "wgmma_sync": "wgmma, dQ by bulk page reductions on 64-row tiles, by atomics on 128-row tiles (kernels_cu/paged_bwd.cu)",
    "wgmma_atomic": "wgmma, dQ by fp32 atomics (kernels_cu/paged_bwd.cu)",
    "wgmma_qsplit": "wgmma, Q split on 64-row tiles (kernels_cu/paged_bwd.cu)",
    "wgmma_bulk": "wgmma, dQ by bulk page reductions (kernels_cu/paged_bwd.cu)",
    "wgmma_qsplit_bulk": "wgmma, Q split, dQ by bulk page reductions (kernels_cu/paged_bwd.cu)",
    "wgmma_dq_pass": "wgmma, dK/dV without dQ, then dQ in a Q-owned pass (kernels_cu/paged_bwd.cu)",
    "wgmma_ws": "wgmma, warp-specialized on 128-row tiles, as wgmma on 64-row tiles (kernels_cu/paged_bwd.cu)",
}


def bench_paged(
    case: Case,
    timer: Timer,
    passes,
    check: bool,
    kind: str,
    bwd_impls=((None, False),),
    route="auto",
    record_impl: str | None = None,
) -> list[dict]:
    """``kpage`` or ``bsa`` (its plan) on the paged forward skeleton; ``bwd`` / ``fwdbwd`` add the backward
    of the same plan kind (K/V-owned, :mod:`sparseattn.kernels.backward`), once per ``(impl,
    deterministic)`` of ``bwd_impls`` (impl ``None``: ``SPARSEATTN_BWD_IMPL`` or the default); each record
    names its kernel. A ``bwd`` record's ``physical_pairs`` are the backward plan's (its kernel's step)."""
    from .kernels.backward import backward_executed_pairs, backward_route, paged_backward
    from .kernels.bsa_backward import DEFINES as bwd_defines
    from .kernels.bsa_backward import default_impl
    from .kernels.forward import DEFINES as fwd_defines
    from .kernels.forward import executed_pairs, forward_route, paged_forward

    g = case.graph
    fwd_route = str(forward_route(g, kind, route))
    o, lse = paged_forward(case.q, case.k, case.v, g, scale=case.scale, kind=kind, route=route)
    cupy.cuda.Device().synchronize()
    rel = None
    if check:
        rel = case.rel_err_head0(bf16_bits_to_float(cupy.asnumpy(o[:, 0])).astype(np.float64))
    buffers = (o, lse)
    physical = executed_pairs(g, kind, route) * case.b
    out = []
    if "fwd" in passes:
        ms, _ = timer(
            lambda: paged_forward(
                case.q, case.k, case.v, g, scale=case.scale, out=buffers, kind=kind, route=route
            )
        )
        out.append(
            dict(
                impl=record_impl or kind,
                **{"pass": "fwd"},
                time_ms=ms,
                physical_pairs=physical,
                rel_err_o=rel,
                correct=None if rel is None else bool(rel < O_REL_TOL),
                route=fwd_route,
                **({"fwd_variant": ",".join(fwd_defines)} if fwd_defines else {}),
            )
        )
    for impl, deterministic in bwd_impls:
        name = impl or default_impl()
        bwd_physical = backward_executed_pairs(g, case.d, kind, name, route, deterministic) * case.b

        def backward(o2=o, l2=lse, impl=impl, deterministic=deterministic):
            return paged_backward(
                case.q,
                case.k,
                case.v,
                o2,
                l2,
                case.do,
                g,
                scale=case.scale,
                kind=kind,
                route=route,
                impl=impl,
                deterministic=deterministic,
            )

        def fwdbwd(backward=backward):
            backward(
                *paged_forward(
                    case.q, case.k, case.v, g, scale=case.scale, out=buffers, kind=kind, route=route
                )
            )

        checked = {}  # the gradients against the reference, once per backward kernel, before timing
        if check and ("bwd" in passes or "fwdbwd" in passes):
            try:
                grads = backward()
                cupy.cuda.Device().synchronize()
                rel_g = case.grad_err_head0(o, lse, grads)
                del grads
                checked = dict(rel_err_grads=rel_g, correct=bool(rel_g < GRAD_REL_TOL))
            except Exception as exc:  # noqa: BLE001 - recorded; the timing below still runs
                checked = dict(check_error=f"{type(exc).__name__}: {exc}"[:300])
        for pass_, fn in (("bwd", backward), ("fwdbwd", fwdbwd)):
            if pass_ not in passes:
                continue
            label = dict(
                bwd_impl=name + ("+deterministic" if deterministic else ""),
                deterministic=deterministic,
                route=fwd_route,
                bwd_route=str(backward_route(g, kind, route, name, deterministic)),
                **({"bwd_variant": ",".join(bwd_defines)} if bwd_defines else {}),
            )
            try:
                ms, _ = timer(fn)
                out.append(
                    dict(
                        impl=record_impl or kind,
                        **{"pass": pass_},
                        time_ms=ms,
                        # forward + backward: the forward's pairs again (the rates are per useful pair)
                        physical_pairs=bwd_physical if pass_ == "bwd" else physical,
                        backward=BACKWARD_KERNELS[name],
                        **label,
                        **{"correct": None, **checked},
                    )
                )
            except Exception as exc:  # noqa: BLE001 - a plan the backward cannot run is recorded, not fatal
                out.append(
                    dict(
                        impl=record_impl or kind,
                        **{"pass": pass_},
                        **label,
                        error=f"{type(exc).__name__}: {exc}"[:300],
                    )
                )
    return out


def bench_kpage(case: Case, timer: Timer, passes, check: bool, bwd_impls=((None, False),)) -> list[dict]:
    out = bench_paged(case, timer, passes, check, "kpage", bwd_impls)
    if "plan" in passes:
        out += bench_device_plans(case, timer, check)
    return out


def topk_selection(graph: SparseGraph, batch: int):
    """The graph's selection as the VSA kernel's arguments on the GPU: :func:`topk_arrays` as CuPy arrays."""
    return tuple(cupy.asarray(x) for x in topk_arrays(graph, batch))


def topk_arrays(graph: SparseGraph, batch: int):
    """The graph's selection as the VSA kernel's arguments (numpy): int32 ``q2k_idx [batch, heads,
    q_blocks, k]`` (each row's K blocks, k = the longest row, padded with 0) and ``q2k_num [batch, heads,
    q_blocks]``, every batch entry alike."""
    counts = np.diff(graph.indptr).astype(np.int64)
    k = max(1, int(counts.max(initial=0)))
    idx = np.zeros((graph.num_rows, k), dtype=np.int32)
    pos = np.arange(graph.nnz) - np.repeat(graph.indptr[:-1], counts)
    idx[graph.row_of_nnz, pos] = graph.indices
    shape = (graph.heads, graph.q.num_blocks)
    idx = np.broadcast_to(idx.reshape(*shape, k), (batch, *shape, k))
    num = np.broadcast_to(counts.reshape(shape).astype(np.int32), (batch, *shape))
    return np.ascontiguousarray(idx), np.ascontiguousarray(num)


def _graph_replay_ms(timer: Timer, call):
    """Median ms of ``call`` captured in a CUDA graph and replayed (its GPU time without the host's
    launches); None without torch."""
    torch = _torch()
    if torch is None:
        return None
    from .kernels import launch

    def in_torch():
        with launch.torch_context():
            return call()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        in_torch()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kept = in_torch()  # noqa: F841 - the graph's buffers live as long as its outputs
    ms, _ = timer(graph.replay)
    return ms


def bench_device_plans(case: Case, timer: Timer, check: bool) -> list[dict]:
    """The device planner on the graph's selection given as top-k indices on the GPU (every batch entry
    planned on its own): pass ``plan`` (impl ``kpage``): the forward and backward plans of one call, timed
    eagerly (``time_ms``: CUDA events around the call, so it includes the GPU's wait for the host's
    launches when those take longer), as a replayed CUDA graph (``gpu_ms``: the GPU's time) and on the host
    (``host_us``: the call's CPU time), the forward's alone (``forward_plan_ms``, eager) and, as a replayed graph,
    the same plans with the backward's chain after the forward's instead of beside it (``gpu_ms_in_order``,
    ``DevicePlanner(overlap_backward=False)``); pass ``fwd``
    (impl ``kpage_device``): the forward on the device plans, checked like ``kpage``'s."""
    from .kernels.forward import paged_forward
    from .planning.device import DevicePlanner

    g = case.graph
    if not isinstance(g, SparseGraph):
        return [dict(impl="kpage", **{"pass": "plan"}, error="per-head layouts: planned on the host")]
    idx, num = topk_selection(g, case.b)
    planner = DevicePlanner(g.q, g.k)
    forward_only = DevicePlanner(g.q, g.k, backward=False)
    plans = planner.plan(idx, num)
    plans.check()
    out = []
    plan_ms, _ = timer(lambda: planner.plan(idx, num))
    fwd_plan_ms, _ = timer(lambda: forward_only.plan(idx, num))
    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        planner.plan(idx, num)
    host_us = (time.perf_counter() - t0) / 20 * 1e6
    gpu = _graph_replay_ms(timer, lambda: planner.plan(idx, num))
    in_order = DevicePlanner(g.q, g.k, overlap_backward=False)
    gpu_in_order = _graph_replay_ms(timer, lambda: in_order.plan(idx, num))
    route = "pair" if planner.forward.has_pairs else "auto"
    bwd_route = "pair" if planner.backward.has_pairs else "auto"
    out.append(
        dict(
            impl="kpage",
            **{"pass": "plan"},
            time_ms=plan_ms,
            forward_plan_ms=fwd_plan_ms,
            gpu_ms=gpu,
            gpu_ms_in_order=gpu_in_order,
            host_us=round(host_us, 1),
            route=route,
            bwd_route=bwd_route,
            selection=f"q2k_idx [batch, heads, q_blocks, {idx.shape[3]}]",
        )
    )
    o, lse = paged_forward(case.q, case.k, case.v, plans, scale=case.scale)
    cupy.cuda.Device().synchronize()
    rel = case.rel_err_head0(bf16_bits_to_float(cupy.asnumpy(o[:, 0])).astype(np.float64)) if check else None
    ms, _ = timer(lambda: paged_forward(case.q, case.k, case.v, plans, scale=case.scale, out=(o, lse)))
    out.append(
        dict(
            impl="kpage_device",
            **{"pass": "fwd"},
            time_ms=ms,
            rel_err_o=rel,
            correct=None if rel is None else bool(rel < O_REL_TOL),
            route=route,
            plans="device",
        )
    )
    return out


def bench_bsa(case: Case, timer: Timer, passes, check: bool, bwd_impls=((None, False),)) -> list[dict]:
    return bench_paged(case, timer, passes, check, "bsa", bwd_impls)


def bench_kpage_pair(case: Case, timer: Timer, passes, check: bool, bwd_impls=((None, False),)) -> list[dict]:
    """KPage's pair route: 64-row Q blocks two by two in the forward (:mod:`.planning.pair_forward`), 64-row
    K/V blocks two by two in the backward (:mod:`.planning.pair_backward`; the default backward kernel,
    not deterministic); head by head on per-head layouts."""
    impls = tuple((impl, False) for impl, deterministic in bwd_impls if not deterministic)
    return bench_paged(case, timer, passes, check, "kpage", impls, "pair", "kpage_pair")


def bench_kpage_packed(
    case: Case, timer: Timer, passes, check: bool, bwd_impls=((None, False),)
) -> list[dict]:
    """KPage's forward with the partial 64-row Q blocks packed into shared 64-row items
    (:mod:`.planning.packed_forward`); a forward route only: the other passes get a record saying so."""
    out = bench_paged(case, timer, passes, check, "kpage", (), "packed", "kpage_packed")
    return out + [
        dict(impl="kpage_packed", **{"pass": p}, error="the packed route is a forward route")
        for p in passes
        if p in ("bwd", "fwdbwd")
    ]


def bench_bsa_mma(case: Case, timer: Timer, passes, check: bool) -> list[dict]:
    from .kernels.bsa_mma_forward import bsa_mma_forward, plan_for

    g = case.graph
    if isinstance(g, HeadStack):
        return [
            dict(impl="bsa_mma", **{"pass": p}, error="per-head layouts: only the paged skeleton runs them")
            for p in passes
        ]
    plan = plan_for(g)
    out = []
    o, lse = bsa_mma_forward(case.q, case.k, case.v, g, scale=case.scale)
    cupy.cuda.Device().synchronize()
    rel = None
    if check:
        o0 = bf16_bits_to_float(cupy.asnumpy(o[:, 0])).astype(np.float64)
        rel = case.rel_err_head0(o0)
    buffers = (o, lse)
    if "fwd" in passes:
        ms, _ = timer(lambda: bsa_mma_forward(case.q, case.k, case.v, g, scale=case.scale, out=buffers))
        out.append(
            dict(
                impl="bsa_mma",
                **{"pass": "fwd"},
                time_ms=ms,
                physical_pairs=plan.physical_pairs() * case.b,
                rel_err_o=rel,
                correct=None if rel is None else bool(rel < O_REL_TOL),
            )
        )
    from .kernels.bsa_backward import bsa_mma_backward

    def backward(o2=o, l2=lse):
        bsa_mma_backward(case.q, case.k, case.v, o2, l2, case.do, g, scale=case.scale)

    def fwdbwd():
        backward(*bsa_mma_forward(case.q, case.k, case.v, g, scale=case.scale, out=buffers))

    for pass_, fn in (("bwd", backward), ("fwdbwd", fwdbwd)):
        if pass_ not in passes:
            continue
        try:
            ms, _ = timer(fn)
            phys = plan.physical_pairs() * case.b
            out.append(dict(impl="bsa_mma", **{"pass": pass_}, time_ms=ms, physical_pairs=phys, correct=None))
        except Exception as exc:  # noqa: BLE001 (a failing peer or step is recorded, not fatal)
            out.append(dict(impl="bsa_mma", **{"pass": pass_}, error=f"{type(exc).__name__}: {exc}"[:300]))
    return out


def bench_flex(case: Case, timer: Timer, passes, check: bool) -> list[dict]:
    torch = _torch()
    from torch.nn.attention.flex_attention import flex_attention

    g = case.graph
    # torch-owned copies (the compiled FlexAttention refused tensors imported through DLPack on the H200)
    q, k, v, do = (x.clone() for x in case.torch_views())
    block_mask = to_flex_block_mask(g, case.b, device="cuda", mask_mod="padding")
    g0 = head_graph(g, 0)
    opts = None
    if g0.q.block_size < 128 or g0.k.block_size < 128:
        opts = {"BLOCK_M": g0.q.block_size, "BLOCK_N": g0.k.block_size}
    # static shapes: a process that compiles FlexAttention for a second workload would otherwise switch to
    # a dynamic-shape kernel (measured 10-60% slower on the H200) for every later one
    torch._dynamo.reset()
    flex = torch.compile(flex_attention, dynamic=False)
    assert abs(case.scale - 1.0 / np.sqrt(case.d)) < 1e-12  # FlexAttention's default scale
    physical = g.nnz * g0.q.block_size * g0.k.block_size * case.b
    out = []
    t0 = time.time()
    try:
        o = flex(q, k, v, block_mask=block_mask, kernel_options=opts)
    except Exception:  # noqa: BLE001 - one retry from a clean dynamo state (the first compile in a process can trip)
        traceback.print_exc()
        torch._dynamo.reset()
        flex = torch.compile(flex_attention, dynamic=False)
        o = flex(q, k, v, block_mask=block_mask, kernel_options=opts)
    torch.cuda.synchronize()
    compile_s = time.time() - t0
    rel = None
    if check:
        o0 = o[:, 0].float().cpu().numpy().astype(np.float64)
        rel = case.rel_err_head0(o0)
    if "fwd" in passes:
        ms, _ = timer(lambda: flex(q, k, v, block_mask=block_mask, kernel_options=opts))
        out.append(
            dict(
                impl="flex",
                **{"pass": "fwd"},
                time_ms=ms,
                physical_pairs=physical,
                rel_err_o=rel,
                correct=None if rel is None else bool(rel < O_REL_TOL),
                compile_s=round(compile_s, 1),
            )
        )
    grads_in = tuple(x.detach().clone().requires_grad_() for x in (q, k, v))
    out += torch_grad_records(
        timer,
        passes,
        "flex",
        lambda q, k, v: flex(q, k, v, block_mask=block_mask, kernel_options=opts),
        grads_in,
        do,
        physical,
    )
    return out


def cudnn_dense_inputs(case: Case):
    """Random bf16 ``q, k, v`` ``[batch, heads, tokens, d]`` of the workload's compact (unpadded) token
    count, heads and head dim: what ``cudnn_dense`` attends over."""
    torch = _torch()
    n = head_graph(case.graph, 0).q.num_tokens
    q = torch.randn(case.b, case.graph.heads, n, case.d, dtype=torch.bfloat16, device="cuda")
    return q, torch.randn_like(q), torch.randn_like(q)


def bench_cudnn_dense(case: Case, timer: Timer, passes, check: bool) -> list[dict]:
    torch = _torch()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = cudnn_dense_inputs(case)
    do = torch.randn_like(q)
    b, h, n, _ = q.shape
    physical = n * n * h * b
    out = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        if "fwd" in passes:
            ms, _ = timer(lambda: sdpa(q, k, v), reps=max(3, timer.reps // 4))
            out.append(
                dict(impl="cudnn_dense", **{"pass": "fwd"}, time_ms=ms, physical_pairs=physical, correct=None)
            )
        grads_in = tuple(x.detach().clone().requires_grad_() for x in (q, k, v))
        out += torch_grad_records(
            timer, passes, "cudnn_dense", sdpa, grads_in, do, physical, reps=max(3, timer.reps // 4)
        )
    return out


def bench_vsa_kernel(case: Case, timer: Timer, passes, check: bool) -> list[dict]:
    """The VSA system's own kernel (``fastvideo-kernel`` 0.3.4, its Triton path) on 64-slot cube layouts
    with valid-prefix padding (the ``vsa_*`` workloads); skipped elsewhere."""
    g = case.graph
    if isinstance(g, HeadStack) or g.q.block_size != 64 or g.q is not g.k:
        return []
    vr = g.q.valid_rows
    if not np.array_equal(g.q.valid.reshape(-1, 64), np.arange(64)[None, :] < vr[:, None]):
        return []  # the kernel assumes each cube's valid tokens are a prefix of its 64 slots
    os.environ.setdefault("FASTVIDEO_VSA_TRITON", "1")
    try:
        from fastvideo_kernel.block_sparse_attn import block_sparse_attn_from_indices
    except Exception as exc:  # noqa: BLE001 - the optional peer is not installed
        return [
            dict(impl="vsa_kernel", **{"pass": p}, error=f"fastvideo_kernel not importable: {exc}"[:300])
            for p in passes
        ]
    torch = _torch()
    q, k, v, do = (x.clone() for x in case.torch_views())
    cnt = np.diff(g.indptr).reshape(g.heads, g.q.num_blocks).astype(np.int32)
    idx = np.zeros((g.heads, g.q.num_blocks, max(int(cnt.max()), 1)), np.int32)
    rows = np.arange(g.num_rows)
    pos = np.arange(g.nnz) - np.repeat(g.indptr[:-1], np.diff(g.indptr))
    idx.reshape(g.num_rows, -1)[np.repeat(rows, np.diff(g.indptr)), pos] = g.indices
    q2k_idx = torch.tensor(idx, device="cuda")[None].expand(case.b, *idx.shape).contiguous()
    q2k_num = torch.tensor(cnt, device="cuda")[None].expand(case.b, *cnt.shape).contiguous()
    vbs = torch.tensor(vr.astype(np.int32), device="cuda")
    physical = g.nnz * 64 * 64 * case.b
    o, _ = block_sparse_attn_from_indices(q, k, v, q2k_idx, q2k_num, vbs)
    torch.cuda.synchronize()
    rel = case.rel_err_head0(o[:, 0].float().cpu().numpy().astype(np.float64)) if check else None
    out = []
    if "fwd" in passes:
        ms, _ = timer(lambda: block_sparse_attn_from_indices(q, k, v, q2k_idx, q2k_num, vbs))
        out.append(
            dict(
                impl="vsa_kernel",
                **{"pass": "fwd"},
                time_ms=ms,
                physical_pairs=physical,
                rel_err_o=rel,
                correct=None if rel is None else bool(rel < O_REL_TOL),
            )
        )
    grads_in = tuple(x.detach().clone().requires_grad_() for x in (q, k, v))
    out += torch_grad_records(
        timer,
        passes,
        "vsa_kernel",
        lambda q, k, v: block_sparse_attn_from_indices(q, k, v, q2k_idx, q2k_num, vbs)[0],
        grads_in,
        do,
        physical,
    )
    return out


def launch_overhead(case: Case, calls: int = 200) -> dict:
    """Host microseconds per kpage_forward call (validation, cached plan lookup, launch; no sync)."""
    from .kernels.forward import kpage_forward

    out = kpage_forward(case.q, case.k, case.v, case.graph, scale=case.scale)
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        kpage_forward(case.q, case.k, case.v, case.graph, scale=case.scale, out=out)
        times.append(time.perf_counter() - t0)
        if len(times) % 20 == 0:
            cupy.cuda.Device().synchronize()  # keep the launch queue short
    return dict(impl="kpage", **{"pass": "host_launch"}, host_us=round(float(np.median(times)) * 1e6, 1))


def varblock_inputs(graph, batch: int = 1):
    """FlashInfer's variable-block form of a per-head partition graph (SVG2): per head, its clusters as
    blocks of their token counts (padding dropped, empty clusters dropped, short heads padded with empty
    blocks), the selected cluster pairs as the block mask, and the slots of each head's tokens in that
    order. Returns ``(mask [H, MB, NB] bool, row_sz [H, MB], col_sz [H, NB], q_slots [H, tq], k_slots
    [H, tk])`` as numpy (int32 sizes; ``tq``/``tk`` the tokens, the same in every head)."""
    stack = HeadStack.of(graph)

    def clusters(layout):
        groups = np.asarray(layout.block_group)
        rows = layout.valid_rows.astype(np.int64)
        ids, first = np.unique(groups, return_index=True)
        ids = ids[np.argsort(first)]  # in slot order
        sizes = np.array([rows[groups == g].sum() for g in ids], dtype=np.int64)
        keep = sizes > 0
        return ids[keep], sizes[keep], np.flatnonzero(layout.valid)

    per_head = []
    for g in stack.graphs:
        qi, qs, qslots = clusters(g.q)
        ki, ks, kslots = clusters(g.k)
        bm = g.block_mask()[0]
        q_index = {c: n for n, c in enumerate(qi)}
        k_index = {c: n for n, c in enumerate(ki)}
        pairs = np.zeros((qi.size, ki.size), dtype=bool)
        i, j = np.nonzero(bm)
        qg, kg = np.asarray(g.q.block_group)[i], np.asarray(g.k.block_group)[j]
        for a, b in zip(qg, kg):
            if a in q_index and b in k_index:
                pairs[q_index[a], k_index[b]] = True
        per_head.append((pairs, qs, ks, qslots, kslots))
    mb = max(x[1].size for x in per_head)
    nb = max(x[2].size for x in per_head)
    h = len(per_head)
    mask = np.zeros((h, mb, nb), dtype=bool)
    row_sz = np.zeros((h, mb), dtype=np.int32)
    col_sz = np.zeros((h, nb), dtype=np.int32)
    for n, (pairs, qs, ks, _, _) in enumerate(per_head):
        mask[n, : qs.size, : ks.size] = pairs
        row_sz[n, : qs.size] = qs
        col_sz[n, : ks.size] = ks
    q_slots = np.stack([x[3] for x in per_head])
    k_slots = np.stack([x[4] for x in per_head])
    return mask, row_sz, col_sz, q_slots, k_slots


def bench_flashinfer_varblock(
    case: Case, timer: Timer, passes, check: bool, backend: str = "fa2"
) -> list[dict]:
    """FlashInfer's ``VariableBlockSparseAttentionWrapper`` (the peer SVG2 ships with) on the same
    partitions: per head its clusters as variable-size blocks, tokens permuted by cluster, no padding;
    forward only. Its ``plan`` (host work) is not timed."""
    impl = "flashinfer_varblock" if backend == "fa2" else f"flashinfer_varblock_{backend}"
    if not isinstance(case.graph, HeadStack) or "fwd" not in passes:
        return []  # per-head partitions (SVG2) only; forward only
    try:
        import flashinfer
    except Exception as exc:  # noqa: BLE001 - the optional peer is not installed
        return [dict(impl=impl, **{"pass": "fwd"}, error=f"flashinfer not importable: {exc}"[:300])]
    torch = _torch()
    mask, row_sz, col_sz, q_slots, k_slots = varblock_inputs(case.graph)
    h = mask.shape[0]
    dev = "cuda"
    q, k, v, _ = case.torch_views()
    qi = torch.as_tensor(q_slots, device=dev)
    ki = torch.as_tensor(k_slots, device=dev)
    # [batch 0, H, slots, d] -> per head its tokens in cluster order: [H, tokens, d]
    qc = torch.stack([q[0, n].index_select(0, qi[n]) for n in range(h)]).contiguous()
    kc = torch.stack([k[0, n].index_select(0, ki[n]) for n in range(h)]).contiguous()
    vc = torch.stack([v[0, n].index_select(0, ki[n]) for n in range(h)]).contiguous()
    wrapper = flashinfer.VariableBlockSparseAttentionWrapper(
        torch.empty(512 << 20, dtype=torch.uint8, device=dev), backend=backend
    )
    t0 = time.time()
    wrapper.plan(
        torch.as_tensor(mask, device=dev),
        torch.as_tensor(row_sz, device=dev),
        torch.as_tensor(col_sz, device=dev),
        h,
        h,
        case.d,
        sm_scale=case.scale,
        q_data_type=torch.bfloat16,
    )
    _grow_vector_sparse_buffers(wrapper, torch)
    o = wrapper.run(qc, kc, vc)
    torch.cuda.synchronize()
    plan_s = time.time() - t0
    rel = None
    if check:  # head 0 back in slot order, padding rows zero, against the float64 reference
        tokens = q_slots.shape[1]
        o_heads = o if tuple(o.shape[:2]) == (h, tokens) else o.transpose(0, 1)  # [H, tokens, d]
        o0 = torch.zeros(graph_slots(case.graph)[0], case.d, dtype=torch.float32, device=dev)
        o0.index_copy_(0, qi[0], o_heads[0].float())
        rel = case.rel_err_head0(o0.cpu().numpy().astype(np.float64)[None])
    ms, _ = timer(lambda: wrapper.run(qc, kc, vc))
    useful = case.graph.useful_pairs() * case.b
    return [
        dict(
            impl=impl,
            **{"pass": "fwd"},
            time_ms=ms,
            physical_pairs=int(useful),
            rel_err_o=rel,
            correct=None if rel is None else bool(rel < O_REL_TOL),
            plan_first_s=round(plan_s, 1),
            backend=backend,
        )
    ]


def _grow_vector_sparse_buffers(wrapper, torch) -> None:
    """FlashInfer's FA3 path expands the plan's page indices into a buffer of fixed size (16M entries in
    0.5.3) at each run and refuses a plan that needs more (``_vector_sparse_indices_buffer is not large
    enough``); a user of a long sequence gives it room after ``plan``: one entry more than the plan's
    indices (its check is ``<=``). The run writes that buffer before reading it."""
    have = getattr(wrapper, "_vector_sparse_indices_buffer", None)
    need = getattr(wrapper, "_paged_kv_indices_buf", None)
    if have is not None and need is not None and have.numel() <= need.numel():
        wrapper._vector_sparse_indices_buffer = torch.empty(
            need.numel() + 1, dtype=have.dtype, device=have.device
        )


def bench_flashinfer_varblock_fa3(case: Case, timer: Timer, passes, check: bool) -> list[dict]:
    return bench_flashinfer_varblock(case, timer, passes, check, backend="fa3")


BENCHES = {
    "kpage": bench_kpage,
    "bsa": bench_bsa,
    "bsa_mma": bench_bsa_mma,
    "flex": bench_flex,
    "cudnn_dense": bench_cudnn_dense,
    "vsa_kernel": bench_vsa_kernel,
    "kpage_pair": bench_kpage_pair,
    "kpage_packed": bench_kpage_packed,
    "flashinfer_varblock": bench_flashinfer_varblock,
    "flashinfer_varblock_fa3": bench_flashinfer_varblock_fa3,
}


# ---- CLI ------------------------------------------------------------------------------------------


def add_arguments(parser) -> None:
    parser.add_argument(
        "--workload",
        action="append",
        metavar="NAME",
        help=f"built-in workload (repeatable; default {', '.join(DEFAULT_WORKLOADS)})",
    )
    parser.add_argument("--heads", type=int, default=None, help="heads to run (default: all of the workload)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument(
        "--impl",
        action="append",
        choices=IMPLS,
        help="implementations (default: all available but the opt-in kpage_pair, KPage's forced pair route, "
        "and kpage_packed, its forward's packed route)",
    )
    parser.add_argument(
        "--pass", dest="passes", action="append", choices=PASSES, help="passes (default: fwd)"
    )
    parser.add_argument(
        "--bwd-impl",
        action="append",
        choices=tuple(BACKWARD_KERNELS),
        default=None,
        help="backward kernel of the kpage/bsa bwd and fwdbwd records (repeatable: one record per kernel; "
        "default: SPARSEATTN_BWD_IMPL or wgmma)",
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="also time the kpage/bsa backward in its deterministic mode (fixed-point dQ; the first --bwd-impl)",
    )
    parser.add_argument("--reps", type=int, default=20, help="timed calls per measurement (median)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-check", action="store_true", help="skip the float64 reference check (head 0)")
    parser.add_argument(
        "--launch-overhead",
        action="store_true",
        help="also record the host time of one kpage_forward call (no GPU sync)",
    )
    parser.add_argument(
        "--out", metavar="PATH", help="JSON result file (default data/bench/bench_<date>.json)"
    )


def _git_commit() -> str:
    env = os.environ.get("SPARSEATTN_COMMIT")
    if env:
        return env
    try:
        return (
            subprocess.run(  # noqa: PLW1510 (the exit status is read)
                ["git", "rev-parse", "HEAD"],
                capture_output=True,
                text=True,
                timeout=5,
                cwd=Path(__file__).parent,
            ).stdout.strip()
            or "unknown"
        )
    except Exception:  # noqa: BLE001 (a failing peer or step is recorded, not fatal)
        return "unknown"


def run_path(out, stem: str) -> Path:
    """``out``, or ``data/bench/<stem>_<today>.json`` (folders made)."""
    from datetime import datetime, timezone

    path = Path(out or f"data/bench/{stem}_{datetime.now(timezone.utc).strftime('%Y%m%d')}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def write_run(path: Path, prog: str, argv, records: list, **meta) -> Path:
    """Write a run in the bench format (docs/results.md) to ``path``: the GPU, the commit, the date, the
    command (``prog`` and ``argv``, default the process's), the torch version, ``meta`` and ``records``."""
    import json
    import sys
    from datetime import datetime, timezone

    import torch

    args = sys.argv[1:] if argv is None else argv
    payload = dict(
        gpu=_gpu_name(),
        commit=_git_commit(),
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        command=" ".join([prog, *args]),
        torch=torch.__version__,
        **meta,
        records=records,
    )
    path.write_text(json.dumps(payload, indent=1))
    return path


def _gpu_name() -> str:
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def _rates(rec: dict, useful: int, head_dim: int) -> dict:
    if "time_ms" not in rec or rec["pass"] not in FLOPS_PER_PAIR:  # planning computes no attention
        return rec
    factor = FLOPS_PER_PAIR[rec["pass"]] * head_dim
    sec = rec["time_ms"] * 1e-3
    rec["useful_tflops"] = round(factor * useful / sec / 1e12, 1)
    if "physical_pairs" in rec:
        rec["physical_tflops"] = round(factor * rec["physical_pairs"] / sec / 1e12, 1)
    return rec


def _rate(record: dict, key: str) -> str:
    return f"{record[key]:.0f}" if key in record else "-"


def print_table(records: list[dict], file=None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="sparseattn bench (median ms; TFLOP/s useful / physical)")
    for col in (
        "workload",
        "impl",
        "pass",
        "heads",
        "time ms",
        "useful TF/s",
        "phys TF/s",
        "rel err",
        "correct",
    ):
        table.add_column(col)
    for r in records:
        if "error" in r:
            table.add_row(
                r["workload"],
                r["impl"],
                r["pass"],
                str(r.get("heads", "")),
                "-",
                "-",
                "-",
                "-",
                f"ERROR {r['error'][:60]}",
            )
            continue
        if "host_us" in r:
            table.add_row(
                r["workload"],
                r["impl"],
                r["pass"],
                str(r["heads"]),
                f"host {r['host_us']:.1f} us",
                "-",
                "-",
                "-",
                "-",
            )
            continue
        rel = r.get("rel_err_o", r.get("rel_err_grads"))
        table.add_row(
            r["workload"],
            r["impl"] + (f" [{r['bwd_impl']}]" if r.get("bwd_impl") else ""),
            r["pass"],
            str(r["heads"]),
            f"{r['time_ms']:.3f}",
            _rate(r, "useful_tflops"),
            _rate(r, "physical_tflops"),
            "-" if rel is None else f"{rel:.1e}",
            str(r.get("correct")),
        )
    Console(file=file or sys.stdout, width=150).print(table)


def write_results(path: Path, records: list[dict], now, torch) -> None:
    """The benchmark JSON object of docs/results.md (gpu, commit, date, command, records)."""
    argv = sys.argv[1:]
    if sys.argv[1:2] == ["bench"]:
        command = " ".join(["sparseattn", *argv])
    elif sys.argv[0].endswith("bench.py"):
        command = " ".join(["python -m sparseattn.bench", *argv])
    else:
        command = " ".join(sys.argv)
    result = {
        "gpu": _gpu_name(),
        "commit": _git_commit(),
        "date": now.isoformat(timespec="seconds"),
        "command": command,
        "host": platform.node(),
        "software": {
            "cupy": cupy.__version__,
            "torch": getattr(torch, "__version__", None),
            "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
        },
        "records": records,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=lambda x: None))


def run(args) -> int:
    if cupy is None:
        raise ImportError("sparseattn bench needs cupy and a CUDA GPU: pip install -e '.[gpu]'")
    workloads = args.workload or list(DEFAULT_WORKLOADS)
    passes = tuple(args.passes or ("fwd",))
    bwd_impls = tuple((impl, False) for impl in args.bwd_impl or (None,))
    if args.deterministic:
        bwd_impls += ((bwd_impls[0][0], True),)
    torch = _torch()
    impls = list(
        args.impl
        or [i for i in IMPLS if (i not in TORCH_IMPLS or torch is not None) and i not in OPT_IN_IMPLS]
    )
    timer = Timer(args.warmup, args.reps)
    records = []
    now = datetime.datetime.now(datetime.timezone.utc)
    path = Path(args.out) if args.out else Path("data/bench") / f"bench_{now.strftime('%Y%m%dT%H%M%SZ')}.json"
    for name in workloads:
        t0 = time.time()
        graph, head_dim = workload_graph(name, args.heads, seed=args.seed)
        useful = graph.useful_pairs() * args.batch
        case = Case(graph, head_dim, args.batch, seed=args.seed + 1)
        sq, sk = graph_slots(graph)
        print(
            f"[{name}] heads={graph.heads} slots q/k={sq}/{sk} "
            f"pairs={graph.nnz} "
            f"graph {time.time() - t0:.1f}s",
            flush=True,
        )
        for impl in impls:
            if impl in TORCH_IMPLS and torch is None:
                continue
            t1 = time.time()
            try:
                extra = {"bwd_impls": bwd_impls} if impl in PAGED_IMPLS else {}
                recs = BENCHES[impl](case, timer, passes, check=not args.no_check, **extra)
            except Exception as exc:  # noqa: BLE001 (a failing peer or step is recorded, not fatal)
                traceback.print_exc()
                recs = [
                    dict(impl=impl, **{"pass": p}, error=f"{type(exc).__name__}: {exc}"[:300]) for p in passes
                ]
            for r in recs:
                r.update(
                    workload=name, heads=graph.heads, head_dim=head_dim, batch=args.batch, useful_pairs=useful
                )
                records.append(_rates(r, useful, head_dim))
            print(f"  {impl}: {time.time() - t1:.1f}s", flush=True)
        if getattr(args, "launch_overhead", False) and name == workloads[0]:
            records.append(
                dict(
                    launch_overhead(case),
                    workload=name,
                    heads=graph.heads,
                    head_dim=head_dim,
                    batch=args.batch,
                    useful_pairs=useful,
                )
            )
        write_results(path, records, now, torch)  # after every workload: a killed run keeps what it measured
        del case
        cupy.get_default_memory_pool().free_all_blocks()
        if torch is not None:
            torch.cuda.empty_cache()
    print_table(records)
    print(f"wrote {path}")
    bad = [r for r in records if r.get("correct") is False]
    return 1 if bad else 0


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m sparseattn.bench", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
