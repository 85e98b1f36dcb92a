"""SVG2's top-p selection of cluster pairs, one Triton program per Q cluster.

:func:`sparseattn.svg2_device.svg2_select` in torch runs about twenty passes over its ``[N, q_clusters,
k_clusters]`` float64 tensors (softmax, a float64 sort for the descending order, cumulative sums, the tie
rule): 2.5 ms of SVG2's 720p call (40 heads, 300 × 1,000 clusters, H100). Here one program holds a row of
``k_clusters`` scores in registers: it takes the softmax, finds the ``keep``-th largest probability (the
rule needs that value, not the order) and writes the row's mask once. Same rule,
same precision (float64 or float32, as the scores); sums are taken in a different order than torch's, so
a score within rounding of the top-p boundary may fall the other way.

Float64 scores take a bisection by default (``method="bisect_words"``): it finds the ``keep``-th largest
probability without sorting, by a bisection on the probabilities' bit patterns (they order like the values,
p ≥ 0), each step one masked sum over the row, and a second bisection by count only where ``min_fraction``
or the live clusters move ``keep``. Each bisection starts from the row's smallest and largest live patterns
and snaps its bounds to the row's patterns nearest its midpoint, so it ends when they meet: 5–14 steps at
1,000 clusters (counted on random scores), where bisecting the whole range of patterns takes 64.
``method="bisect_words"`` finds the pattern by its high word first, bit for bit the same as
``method="bisect"`` (``SPARSEATTN_SVG2_SELECT=bisect``), which bisects whole 64-bit patterns: compares,
selects and the reduction's minimum and maximum are then one 32-bit instruction each where a 64-bit pattern
takes two (177 instructions a step against 417 in the sm_90 SASS), and only the few lanes that share the
winning high word are bisected by whole patterns: 0.884 → 0.571 ms where the minimum fraction decides,
0.700 → 0.475 where top-p does, equal masks (H100,
``data/bench/experiments/select_bisect_ab_h100_20261207_49ea0f4.json``).
``method="sort"`` (``tl.sort``; float32 scores always take it) is the other form
(``SPARSEATTN_SVG2_SELECT=sort``). Measured at SVG2's 720p shape (40 heads, 300 × 1,000
clusters, H100): bisection 1.17 ms, the Triton sort 1.80, the torch sort 2.91, with equal masks.

Runs on CUDA tensors (or on the CPU under ``TRITON_INTERPRET=1``, for tests); :func:`available` says
whether it can run on a tensor.
"""

from __future__ import annotations

import math
import os

import torch

from .triton_support import runs_on, tl, triton

#: The largest ``k_clusters`` one program holds (a row of scores in registers).
MAX_K_CLUSTERS = 4096
#: How a program finds the keep-th largest probability: "sort" (``tl.sort``), "bisect" (float64 only) or
#: "bisect_words" (the same bisection by the patterns' high words first; float64 only, their default).
METHODS = ("sort", "bisect", "bisect_words")
#: The method :func:`select_mask` takes when not told; None: :func:`method_for` the scores' dtype.
METHOD = os.environ.get("SPARSEATTN_SVG2_SELECT") or None


#: Warps per program (one Q cluster's row); None: 2 up to 1,024 K clusters (measured 6–10% faster than 4 at
#: SVG2's 720p shape, with equal masks: ``data/bench/experiments/svg2_select_warps_h100_20261206_85986d5.json``),
#: else 8. An A/B knob (``SPARSEATTN_SVG2_SELECT_WARPS``; ``data/bench/experiments/select_warps_ab.py``).
NUM_WARPS = (
    int(os.environ["SPARSEATTN_SVG2_SELECT_WARPS"])
    if os.environ.get("SPARSEATTN_SVG2_SELECT_WARPS")
    else None
)


def method_for(dtype: torch.dtype) -> str:
    """The method :func:`select_mask` takes on scores of ``dtype`` when not told: :data:`METHOD` if set,
    else "bisect_words" for float64 and "sort" for float32."""
    return METHOD or ("bisect_words" if dtype == torch.float64 else "sort")


def available(x: torch.Tensor) -> bool:
    """Whether :func:`select_mask` runs its kernel on ``x``'s device and size: Triton importable, a CUDA
    device (or the CPU under ``TRITON_INTERPRET=1``) and at most :data:`MAX_K_CLUSTERS` K clusters."""
    return runs_on(x) and x.shape[-1] <= MAX_K_CLUSTERS


if triton is not None:

    @triton.jit
    def _sum_min_max(a0, a1, a2, b0, b1, b2):
        return a0 + b0, tl.minimum(a1, b1), tl.maximum(a2, b2)

    @triton.jit
    def _largest_key_reaching(keys, weight, target, lo, hi, LARGEST: tl.constexpr):
        """The largest k with ``sum(weight | keys >= k) >= target``, a key of the row, from ``lo`` (a key that
        reaches it) and ``hi`` (the row's largest; non-live lanes hold -1, live keys are >= 0; ``LARGEST``:
        the keys' dtype's largest value): a bisection whose bounds snap to the row's keys nearest its
        midpoint, so it ends when they meet (5–14 steps at 1,000 clusters, not the 64 of the whole range of
        float64 patterns); each step one reduction of the masked sum and the two nearest keys. The keys are
        the probabilities' 64-bit patterns, or their int32 high words (each compare, select, minimum and
        maximum then one instruction, where a 64-bit key takes two)."""
        while lo < hi:
            mid = lo + (hi - lo + 1) // 2
            ge = keys >= mid
            reach, above, below = tl.reduce(
                (tl.where(ge, weight, 0.0), tl.where(ge, keys, LARGEST), tl.where(ge, -1, keys)),
                0,
                _sum_min_max,
            )
            ok = reach >= target  # then the smallest key at or above mid reaches it too
            lo = tl.where(ok, above, lo)
            hi = tl.where(ok, hi, below)  # else the largest below mid is the highest candidate left
        return lo

    @triton.jit
    def _largest_bits_reaching(bits, weight, target, lo, hi):
        """:func:`_largest_key_reaching` over the probabilities' 64-bit patterns."""
        return _largest_key_reaching(bits, weight, target, lo, hi, 9223372036854775807)

    @triton.jit
    def _largest_bits_by_words(bits, weight, target, lo, hi):
        """:func:`_largest_bits_reaching`'s pattern (bit for bit: every sum it compares is a masked sum over
        the same lanes, ``bits >= b`` for some b), found first by its high word — the largest high word h
        with ``sum(weight | bits >= h · 2³²) >= target`` is the answer's — then among the few patterns of the
        row that share it (usually one: the high word holds the exponent and 20 mantissa bits)."""
        words = (bits >> 32).to(tl.int32)  # p >= 0: the words order like the patterns; non-live lanes -1
        word = _largest_key_reaching(
            words, weight, target, (lo >> 32).to(tl.int32), (hi >> 32).to(tl.int32), 2147483647
        )
        same = words == word
        first = tl.min(tl.where(same, bits, 9223372036854775807), 0)  # reaches: the same lanes as h · 2³²
        last = tl.max(tl.where(same, bits, -1), 0)
        return _largest_bits_reaching(bits, weight, target, first, last)

    @triton.jit
    def _largest_pattern(bits, weight, target, lo, hi, WORDS: tl.constexpr):
        """The largest pattern b of the row with ``sum(weight | bits >= b) >= target``, by whole patterns or
        (``WORDS``) by high words first: the same pattern either way."""
        if WORDS:
            return _largest_bits_by_words(bits, weight, target, lo, hi)
        return _largest_bits_reaching(bits, weight, target, lo, hi)

    @triton.jit
    def _select_kernel(
        dots_ptr,  # [N, CQ, CK]: qc_i · kc_j
        bias_ptr,  # [N, CK]: log(max(size, 1)) of a live cluster, -inf of an empty one
        params_ptr,  # [2] in the scores' dtype: sqrt(head_dim), top_p · (1 − 1e-12)
        alive_ptr,  # int64 [N]: live K clusters per row
        least_ptr,  # int64 [N]: the fewest clusters a Q cluster keeps
        out_ptr,  # bool (uint8) [N, CQ, CK]
        q_clusters,
        k_clusters,
        BLOCK: tl.constexpr,
        BISECT: tl.constexpr,
        WORDS: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)  # n · CQ + i
        n = row // q_clusters
        j = tl.arange(0, BLOCK)
        in_row = j < k_clusters
        bias = tl.load(bias_ptr + n * k_clusters + j, mask=in_row, other=float("-inf"))
        live = in_row & (bias > float("-inf"))
        dot = tl.load(dots_ptr + row * k_clusters + j, mask=in_row, other=0.0)
        root = tl.load(params_ptr)
        top_p = tl.load(params_ptr + 1)
        logits = tl.where(live, dot / root + bias, float("-inf"))
        top = tl.max(logits, 0)
        n_alive = tl.load(alive_ptr + n)
        shift = tl.where(n_alive > 0, top, 0.0)
        e = tl.where(live, tl.exp(logits - shift), 0.0)
        p = e / tl.sum(e, 0)
        least = tl.load(least_ptr + n)
        if BISECT:
            # the keep-th largest probability by bisection on the bit patterns (p >= 0: they order like
            # the values), each step a masked sum or count over the row, instead of sorting it
            bits = tl.where(live, p.to(tl.int64, bitcast=True), -1)
            total = tl.sum(tl.where(live, p, 0.0), 0)
            top_bits = tl.max(bits, 0)
            low_bits = tl.min(tl.where(live, bits, 9223372036854775807), 0)  # reaches top_p where reached
            lo = _largest_pattern(bits, p, top_p, low_bits, top_bits, WORDS)  # sum(p | bits >= lo) >= top_p
            t = lo.to(tl.float64, bitcast=True)
            above_sum = tl.sum(tl.where(bits > lo, p, 0.0), 0)
            n_above = tl.sum((bits > lo).to(tl.int64), 0)
            n_tied = tl.sum((bits == lo).to(tl.int64), 0)
            # ties at t: the fewest of them that bring the sum to top_p (at least one)
            need = tl.where(t > 0, (top_p - above_sum) / tl.where(t > 0, t, 1.0), 1.0)
            m = tl.minimum(tl.maximum(tl.ceil(need).to(tl.int64), 1), n_tied)
            reached = (n_alive > 0) & (total >= top_p)
            keep_top_p = tl.where(reached, n_above + m, n_alive)
            keep = tl.maximum(tl.minimum(keep_top_p, n_alive), least)
            last_bits = lo
            if (keep != keep_top_p) | (total < top_p):  # the floor or the cap moved keep: its value anew
                ones = tl.where(live, 1.0, 0.0).to(p.dtype)  # counts as exact float64 sums
                last_bits = _largest_pattern(bits, ones, keep.to(p.dtype), low_bits, top_bits, WORDS)
            last = last_bits.to(tl.float64, bitcast=True)
        else:
            descending = tl.sort(p, 0, descending=True)
            cum = tl.cumsum(descending, 0)
            keep = tl.minimum(tl.sum((cum < top_p).to(tl.int64), 0) + 1, n_alive)
            keep = tl.maximum(keep, least)
            last = tl.sum(tl.where(j == keep - 1, descending, 0.0), 0)
        above = live & (p > last)
        tied = live & (p == last)
        tied_needed = keep - tl.sum(above.to(tl.int64), 0)
        chosen = above | (tied & (tl.cumsum(tied.to(tl.int64), 0) <= tied_needed))
        chosen = chosen & (keep > 0)
        tl.store(out_ptr + row * k_clusters + j, chosen.to(tl.uint8), mask=in_row)


def select_mask(
    dots: torch.Tensor,
    bias: torch.Tensor,
    head_dim: int,
    top_p: float,
    least: torch.Tensor,
    method: str | None = None,
):
    """bool ``[N, q_clusters, k_clusters]``: SVG2's rule (:func:`sparseattn.svg2_device.svg2_select`) from
    ``dots`` ``[N, q_clusters, k_clusters]`` (centroid dot products, float64 or float32), ``bias``
    ``[N, k_clusters]`` of the same dtype (``log(max(size, 1))`` of a live K cluster, ``-inf`` of an empty
    one) and ``least`` int64 ``[N]`` (the fewest clusters a Q cluster keeps); ``method``: one of
    :data:`METHODS` (default :func:`method_for` the dtype; ``"bisect"`` needs float64). Needs
    :func:`available`."""
    method = method_for(dots.dtype) if method is None else method
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r} (SPARSEATTN_SVG2_SELECT?)")
    if not available(dots):
        raise ValueError(
            f"select_mask needs Triton, a CUDA tensor and at most {MAX_K_CLUSTERS} K clusters, got "
            f"{list(dots.shape)} on {dots.device}"
        )
    if dots.ndim != 3 or dots.dtype not in (torch.float32, torch.float64):
        raise ValueError(
            f"dots must be float32/float64 [N, q_clusters, k_clusters], got {dots.dtype} {list(dots.shape)}"
        )
    n, cq, ck = dots.shape
    if bias.shape != (n, ck) or bias.dtype != dots.dtype:
        raise ValueError(f"bias must be {dots.dtype} [{n}, {ck}], got {bias.dtype} {list(bias.shape)}")
    if method != "sort" and dots.dtype != torch.float64:
        raise ValueError(f"method={method!r} bisects float64 bit patterns; dots are {dots.dtype}")
    dots, bias = dots.contiguous(), bias.contiguous()
    alive = torch.isfinite(bias).sum(-1)
    # filled on the device: a tensor from a host list is a synchronising copy, which would drain the queue
    # the host keeps ahead of the GPU (what follows the selection then waited for its launches)
    params = torch.full((2,), math.sqrt(head_dim), dtype=dots.dtype, device=dots.device)
    params[1:].fill_(top_p * (1 - 1e-12))
    out = torch.empty(n, cq, ck, dtype=torch.bool, device=dots.device)
    if out.numel():
        block = max(16, triton.next_power_of_2(ck))
        _select_kernel[(n * cq,)](
            dots,
            bias,
            params,
            alive,
            least.to(torch.int64).contiguous(),
            out.view(torch.uint8),
            cq,
            ck,
            BLOCK=block,
            BISECT=method != "sort",
            WORDS=method == "bisect_words",
            num_warps=NUM_WARPS or (2 if block <= 1024 else 8),
        )
    return out
