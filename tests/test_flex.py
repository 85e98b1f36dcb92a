"""SparseGraph <-> FlexAttention BlockMask: the index arithmetic in numpy, the BlockMask with torch."""

import warnings

import numpy as np
import pytest

from sparseattn.flex import FlexError, graph_from_kv_blocks, kv_blocks_from_graph
from sparseattn.graph import SparseGraph
from sparseattn.layouts import contiguous_layout, slot_layout, video_layout
from sparseattn.reference import attention_forward

# 3 Q blocks: 64, 64, 8 valid rows; 4 K blocks: 64, 64, 64, 8
Q = contiguous_layout(136, 64)
K = contiguous_layout(200, 64)
MASK = np.array(
    [
        [[1, 0, 1, 1], [0, 1, 0, 0], [1, 1, 0, 1]],
        [[0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 1, 0]],
    ],
    dtype=bool,
)


def test_full_and_partial_blocks_by_hand():
    arrays = kv_blocks_from_graph(SparseGraph.from_block_mask(Q, K, MASK))
    # full: both blocks entirely valid (Q blocks 0, 1; K blocks 0, 1, 2)
    assert arrays["full_kv_num_blocks"].tolist() == [[2, 1, 0], [0, 3, 0]]
    assert arrays["kv_num_blocks"].tolist() == [[1, 0, 3], [0, 1, 1]]
    assert arrays["full_kv_indices"][0, 0, :2].tolist() == [0, 2]
    assert arrays["kv_indices"][0, 2, :3].tolist() == [0, 1, 3]
    assert arrays["kv_indices"][0, 0].tolist() == [3, 0, 1, 2]  # selected first, then the rest, ascending
    assert all(a.dtype == np.int32 for a in arrays.values())


@pytest.mark.parametrize("seed", range(5))
def test_round_trip_is_the_identity(seed):
    lay = video_layout((4, 6, 10), (2, 4, 4), block_size=32)
    mask = np.random.default_rng(seed).random((3, lay.num_blocks, lay.num_blocks)) < 0.3
    graph = SparseGraph.from_block_mask(lay, lay, mask)
    back = graph_from_kv_blocks(lay, lay, **kv_blocks_from_graph(graph))
    assert np.array_equal(back.indptr, graph.indptr) and np.array_equal(back.indices, graph.indices)
    assert back.dropped_pairs.sum() == 0


def test_partial_only_arrays_and_dropped_pairs():
    num = np.array([[1, 0, 0]])
    idx = np.array([[[3, 0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3]]])
    k = slot_layout(np.r_[np.ones(150, bool), np.zeros(106, bool)], 64)  # K block 3 is empty
    graph = graph_from_kv_blocks(Q, k, num, idx)
    assert graph.nnz == 0 and graph.dropped_pairs.tolist() == [1]


@pytest.mark.parametrize(
    "num, idx, needle",
    [
        (np.zeros((1, 2), int), np.zeros((1, 3, 4), int), "kv_num_blocks must have shape"),
        (np.ones((1, 3), int), np.zeros((1, 3), int), "kv_indices must have shape"),
        (np.full((1, 3), 5), np.zeros((1, 3, 4), int), "kv_num_blocks must lie in"),
        (np.ones((1, 3), int), np.full((1, 3, 4), 4), "outside the 4 K blocks"),
        (np.ones((1, 3)), np.zeros((1, 3, 4), int), "must hold integers"),
    ],
    ids=["num-shape", "indices-shape", "count-too-large", "index-out-of-range", "float-counts"],
)
def test_bad_index_arrays_name_the_field(num, idx, needle):
    with pytest.raises(FlexError, match=needle):
        graph_from_kv_blocks(Q, K, num, idx)


def test_full_arrays_come_in_pairs():
    with pytest.raises(FlexError, match="both"):
        graph_from_kv_blocks(
            Q, K, np.zeros((1, 3), int), np.zeros((1, 3, 4), int), full_kv_num_blocks=np.zeros((1, 3), int)
        )


def test_block_mask_round_trip_and_attention_with_torch():
    torch = pytest.importorskip("torch")
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    graph = SparseGraph.from_block_mask(Q, K, MASK)
    block_mask = graph.to_flex_block_mask(batch=2, device="cpu")
    assert isinstance(block_mask, flex.BlockMask)
    assert tuple(block_mask.kv_indices.shape) == (2, 2, 3, 4)
    back = SparseGraph.from_flex_block_mask(block_mask, Q, K, batch_index=1)
    assert np.array_equal(back.block_mask(), graph.block_mask())
    # eager FlexAttention evaluates mask_mod everywhere: the exact mask_mod gives the reference output
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 2, n, 16)) for n in (Q.num_slots, K.num_slots, K.num_slots))
    o_ref, lse_ref = attention_forward(q, k, v, graph)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        o = flex.flex_attention(*(torch.from_numpy(x) for x in (q, k, v)), block_mask=block_mask).numpy()
    rows = np.isfinite(lse_ref)
    np.testing.assert_allclose(o[rows], o_ref[rows], atol=1e-12)
