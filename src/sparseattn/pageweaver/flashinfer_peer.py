"""FlashInfer's block-sparse wrapper as PageWeaver's peer: one query row per block row.

FlashInfer 0.5.3 sizes two per-row buffers of ``BlockSparseAttentionWrapper`` for at most 32,768 block
rows (``_kv_lens_buffer``, and on the ``fa3``/``auto`` backends ``_vector_sparse_indptr_buffer``); a
prefill of 64K queries with one row per query overflows them (``The size of tensor a (32768) must match
the size of tensor b (65536)`` in ``plan``). :func:`block_sparse_wrapper` gives them room for the rows
the caller will plan; ``plan`` writes them before any run reads them.
"""

from __future__ import annotations


def block_sparse_wrapper(workspace, rows: int, backend: str = "fa2"):
    """A ``flashinfer.BlockSparseAttentionWrapper`` on ``workspace`` (uint8 device tensor) whose per-row
    buffers hold ``rows`` block rows (one more for the indptr)."""
    import flashinfer
    import torch

    wrapper = flashinfer.BlockSparseAttentionWrapper(workspace, backend=backend)
    for name, need in (("_kv_lens_buffer", rows), ("_vector_sparse_indptr_buffer", rows + 1)):
        have = getattr(wrapper, name, None)
        if isinstance(have, torch.Tensor) and have.numel() < need:
            setattr(wrapper, name, torch.empty(need, dtype=have.dtype, device=have.device))
    return wrapper
