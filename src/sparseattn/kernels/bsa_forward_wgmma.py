"""BSA forward on Hopper wgmma: ``kernels_cu/bsa_fwd_wgmma.cu`` behind the same validation as
:func:`sparseattn.kernels.bsa_forward.bsa_forward`.

The wgmma kernel runs 128×128 tiles (two 64-row warpgroups × 128-key stages) at head_dim 64 and
128, in two schedules: ``overlap=True`` (default) issues O += P·V of stage s − 1 right after S = Q·Kᵀ
of stage s so it runs during stage s's softmax (3 K/V stage buffers, one barrier per stage);
``overlap=False`` runs S, softmax and P·V of each stage one after the other (2 buffers). Routes of a
plan with other tile shapes (the 64×64 tiles of B = 64) run on the mma.sync kernel of
:mod:`.bsa_forward`, so every plan :func:`bsa_forward` accepts runs here too.
"""

from __future__ import annotations

import functools

from . import bsa_forward as mma_sync
from . import runtime

SOURCE = "bsa_fwd_wgmma.cu"

#: Mirrors of the kernel's compile-time configuration (BSA_WG_* and WgTile in the source).
HEAD_DIMS = (64, 128)
TILE_SHAPE = (128, 128)
THREADS = 256
PAGE_ROWS = 16
SMEM_ALIGN_SLACK = 1024
DEFAULT_OVERLAP = True


def kernel_name(head_dim: int, overlap: bool = DEFAULT_OVERLAP) -> str:
    return f"bsa_fwd_wgmma_kernel<{head_dim}, {'true' if overlap else 'false'}>"


NAME_EXPRESSIONS = tuple(kernel_name(d, ov) for d in HEAD_DIMS for ov in (False, True))


def stage_buffers(overlap: bool = DEFAULT_OVERLAP) -> int:
    """K/V stage buffers: 3 when P·V of the previous stage overlaps the current one, else 2."""
    return 3 if overlap else 2


def smem_bytes(head_dim: int, overlap: bool = DEFAULT_OVERLAP) -> int:
    """Dynamic shared memory: alignment slack, Q tile, K and V stage buffers (bf16), and per stage
    buffer 8 (page id, row mask) pairs."""
    tile_m, tile_n = TILE_SHAPE
    nbuf = stage_buffers(overlap)
    return SMEM_ALIGN_SLACK + (tile_m + 2 * nbuf * tile_n) * head_dim * 2 + nbuf * (tile_n // PAGE_ROWS) * 8


def runs_on_wgmma(head_dim: int, tile_m: int, tile_n: int) -> bool:
    """Whether a route of this shape runs on the wgmma kernel (else on the mma.sync kernel)."""
    return (tile_m, tile_n) == TILE_SHAPE and head_dim in HEAD_DIMS


def _launch_target(head_dim: int, tile_m: int, tile_n: int, overlap: bool):
    """(kernel function, threads per CTA, dynamic shared memory) for one route."""
    if runs_on_wgmma(head_dim, tile_m, tile_n):
        fn = runtime.get_function(SOURCE, kernel_name(head_dim, overlap), NAME_EXPRESSIONS)
        return fn, THREADS, smem_bytes(head_dim, overlap)
    return mma_sync.launch_target(head_dim, tile_m, tile_n)


def bsa_forward_wgmma(q, k, v, graph_or_plan, scale=None, out=None, *, overlap: bool = DEFAULT_OVERLAP):
    """Block-sparse attention forward on the GPU, 128×128 tiles on wgmma.

    Same arguments, validation, outputs and guarantees as
    :func:`sparseattn.kernels.bsa_forward.bsa_forward`: ``q``/``k``/``v`` bf16
    ``[batch, heads, slots, d]`` CuPy arrays, ``graph_or_plan`` a :class:`SparseGraph` (its BSA plan)
    or an owner-``"q"`` :class:`TilePlan`; returns ``(o, lse)`` (``o`` bf16 like ``q``, ``lse``
    float32 ``[batch, heads, q_slots]``, natural log); rows without keys get ``o = 0``,
    ``lse = -inf``; invalid query rows are not written. ``overlap`` picks the kernel's schedule
    (module docstring).
    """
    return mma_sync.run_forward(q, k, v, graph_or_plan, scale, out,
                                functools.partial(_launch_target, overlap=bool(overlap)))

