"""Small ragged layouts and graphs shared by the reference and emulator tests."""

from __future__ import annotations

import numpy as np

from sparseattn.graph import SparseGraph
from sparseattn.layouts import partition_layout, slot_layout, video_layout


def small_layouts(name: str):
    """(q_layout, k_layout) of a named small case: partial tiles, empty blocks, independent partitions."""
    rng = np.random.default_rng(7)
    if name == "video-5x7x9-tile2x4x4-B32-prefix":
        lay = video_layout((5, 7, 9), (2, 4, 4), 32)
        return lay, lay
    if name == "video-5x7x9-tile2x4x4-B64-inplace":
        lay = video_layout((5, 7, 9), (2, 4, 4), 64, padding="inplace")
        return lay, lay
    if name == "video-3x10x10-tile2x8x8-B64-empty-blocks":
        lay = video_layout((3, 10, 10), (2, 8, 8), 64)
        return lay, lay
    if name == "video-3x10x10-tile2x8x8-B128":
        lay = video_layout((3, 10, 10), (2, 8, 8), 128)
        return lay, lay
    if name == "partition-Q32-K64-independent":
        return (partition_layout(rng.integers(0, 7, 300), 32), partition_layout(rng.integers(0, 5, 260), 64))
    if name == "single-page-blocks-B16":
        return slot_layout(rng.random(12 * 16) < 0.6, 16), slot_layout(rng.random(9 * 16) < 0.5, 16)
    raise KeyError(name)


SMALL_CASES = [
    "video-5x7x9-tile2x4x4-B32-prefix",
    "video-5x7x9-tile2x4x4-B64-inplace",
    "video-3x10x10-tile2x8x8-B64-empty-blocks",
    "video-3x10x10-tile2x8x8-B128",
    "partition-Q32-K64-independent",
    "single-page-blocks-B16",
]


def make_graph(q_layout, k_layout, heads, density, seed, drop_empty=False):
    """Random graph with two empty Q rows per head and, where K has empty blocks, a row selecting only those."""
    rng = np.random.default_rng(seed)
    mask = rng.random((heads, q_layout.num_blocks, k_layout.num_blocks)) < density
    valid_q = np.flatnonzero(q_layout.valid_rows > 0)
    empty_rows = rng.choice(valid_q, size=min(2, valid_q.size - 1), replace=False)
    mask[:, empty_rows] = False
    empty_k = np.flatnonzero(k_layout.valid_rows == 0)
    if empty_k.size:
        mask[0, empty_rows[0], empty_k] = True
    return SparseGraph.from_block_mask(q_layout, k_layout, mask, drop_empty=drop_empty)


def rel_err(a, b):
    """‖a − b‖ / ‖b‖ over the finite entries of b (inf patterns are compared separately)."""
    fin = np.isfinite(b)
    return np.linalg.norm(a[fin] - b[fin]) / max(np.linalg.norm(b[fin]), 1e-300)


def head_stack_graphs(rng, heads, block, sizes=(150, 400)):
    """Single-head graphs with their own random partitions (SVG2-like per-head layouts)."""
    graphs = []
    for _ in range(heads):
        q_lay = partition_layout(
            rng.integers(0, int(rng.integers(3, 8)), size=int(rng.integers(*sizes))), block
        )
        k_lay = partition_layout(
            rng.integers(0, int(rng.integers(3, 10)), size=int(rng.integers(*sizes))), block
        )
        graphs.append(
            make_graph(
                q_lay, k_lay, heads=1, density=float(rng.uniform(0.3, 0.8)), seed=int(rng.integers(1000))
            )
        )
    return graphs


def head_stack_backward_problem(rng, graphs, batch, d, q_slots, k_slots):
    """float64 inputs ``(q, k, v, o, lse, do)`` over padded ``[batch, heads, slots, d]`` tensors (o, lse
    from each head's exact forward) and each head's exact ``(dq, dk, dv)``."""
    from sparseattn.reference import attention_backward, attention_forward

    h = len(graphs)
    q, do, o = (rng.standard_normal((batch, h, q_slots, d)) for _ in range(3))
    k, v = (rng.standard_normal((batch, h, k_slots, d)) for _ in range(2))
    lse = np.full((batch, h, q_slots), -np.inf)
    refs = []
    for i, g in enumerate(graphs):
        nq, nk = g.q.num_slots, g.k.num_slots
        qi, ki, vi, doi = (
            q[:, i : i + 1, :nq],
            k[:, i : i + 1, :nk],
            v[:, i : i + 1, :nk],
            do[:, i : i + 1, :nq],
        )
        oh, lh = attention_forward(qi, ki, vi, g)
        o[:, i, :nq], lse[:, i, :nq] = oh[:, 0], lh[:, 0]
        refs.append(attention_backward(qi, ki, vi, oh, lh, doi, g))
    return (q, k, v, o, lse, do), refs


def assert_head_stack_gradients(grads, graphs, refs, atol=1e-10):
    """Every head's valid rows equal its exact gradients; dQ is 0 on its invalid and padding rows."""
    dq, dk, dv = grads
    for i, (g, (rq, rk, rv)) in enumerate(zip(graphs, refs)):
        nq, nk = g.q.num_slots, g.k.num_slots
        np.testing.assert_allclose(dq[:, i, :nq][:, g.q.valid], rq[:, 0][:, g.q.valid], atol=atol)
        np.testing.assert_allclose(dk[:, i, :nk][:, g.k.valid], rk[:, 0][:, g.k.valid], atol=atol)
        np.testing.assert_allclose(dv[:, i, :nk][:, g.k.valid], rv[:, 0][:, g.k.valid], atol=atol)
        assert not dq[:, i, nq:].any() and not dq[:, i, :nq][:, ~g.q.valid].any()


def page_table(rows) -> np.ndarray:
    """int32 ``[len(rows), max(1, longest row)]``: python lists of page ids, rows padded with -1
    (a PageWeaver capture's page table)."""
    pages = np.full((len(rows), max(1, max(len(r) for r in rows))), -1, np.int32)
    for i, r in enumerate(rows):
        pages[i, : len(r)] = r
    return pages


def ragged_valid(rng, blocks: int, block_size: int) -> np.ndarray:
    """Full, empty, single-row, single-page (not the first) and prefix-partial blocks, then random."""
    valid = rng.random(blocks * block_size) < rng.uniform(0.3, 0.9)
    v = valid.reshape(blocks, block_size)
    v[0] = True
    v[1] = False
    v[2] = False
    v[2, int(rng.integers(block_size))] = True
    v[3] = False
    v[3, 16:32] = True
    v[4, : block_size // 2] = True
    v[4, block_size // 2 :] = False
    return valid


def random_ragged_graph(rng) -> SparseGraph:
    """A small random graph: ragged slot layouts (independent Q/K partitions, block sizes 64/128, Q
    blocks with no selection), 1-3 heads."""
    bq = int(rng.choice([64, 128]))
    bk = bq if rng.random() < 0.7 else int(rng.choice([64, 128]))
    q = slot_layout(ragged_valid(rng, int(rng.integers(5, 10)), bq), bq)
    k = slot_layout(ragged_valid(rng, int(rng.integers(5, 14)), bk), bk)
    heads = int(rng.integers(1, 4))
    mask = rng.random((heads, q.num_blocks, k.num_blocks)) < rng.uniform(0.1, 0.9)
    mask[:, int(rng.integers(q.num_blocks))] = False  # a Q block without any selection
    return SparseGraph.from_block_mask(q, k, mask)
