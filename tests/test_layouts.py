import numpy as np
import pytest

from sparseattn.constants import PAGE_ROWS
from sparseattn.layouts import (
    LayoutError,
    VideoGrid,
    contiguous_layout,
    partition_layout,
    slot_layout,
    video_layout,
)


def test_anchor_layout_partial_tiles():
    # Wan 720p latent 21x45x80 in 4x4x8 tiles: 6*12*10 = 720 tiles; full tiles 5*11*10 = 550.
    lay = video_layout((21, 45, 80), (4, 4, 8), 128)
    s = lay.summary()
    assert (s["blocks"], s["full_blocks"], s["partial_blocks"], s["tokens"]) == (720, 550, 170, 75600)


def test_prefix_layout_small_by_hand():
    # grid 3x2x2, tile 2x2x2 (8 slots), B=16 -> one 16-slot block per tile (8 padding slots).
    # Tile 0 holds frames 0-1 (8 tokens), tile 1 holds frame 2 only (4 tokens).
    lay = video_layout((3, 2, 2), (2, 2, 2), 16)
    assert lay.num_blocks == 2 and lay.num_slots == 32
    np.testing.assert_array_equal(lay.valid_rows, [8, 4])
    # token (t=2,h=1,w=0) is token 2*4+1*2+0 = 10; it is the 3rd valid token of tile 1 -> slot 16+2
    assert lay.token_slot[10] == 18
    assert lay.token_slot[0] == 0 and lay.token_slot[7] == 7


def test_inplace_layout_keeps_3d_position():
    # grid 2x3x2, tile 2x2x2: tile (0,1,0) holds h=2 only -> padded local rows (lh=0) are valid,
    # in-place: local index (lt*2 + lh)*2 + lw with lh=0 -> slots 0,1,4,5 of that tile.
    lay = video_layout((2, 3, 2), (2, 2, 2), 16, padding="inplace")
    tile1 = lay.valid[16:32]
    np.testing.assert_array_equal(np.flatnonzero(tile1), [0, 1, 4, 5])
    pre = video_layout((2, 3, 2), (2, 2, 2), 16, padding="prefix")
    np.testing.assert_array_equal(np.flatnonzero(pre.valid[16:32]), [0, 1, 2, 3])


def test_384_slot_tile_is_three_blocks():
    lay = video_layout((6, 8, 8), (6, 8, 8), 128)
    assert lay.num_blocks == 3
    np.testing.assert_array_equal(lay.block_group, [0, 0, 0])
    np.testing.assert_array_equal(lay.valid_rows, [128, 128, 128])


def test_vsa_cube_with_one_live_page():
    # grid 5x4x4, 4x4x4 cubes, B=64: cube 1 holds one frame of 16 tokens = one live page of 4.
    lay = video_layout((5, 4, 4), (4, 4, 4), 64)
    np.testing.assert_array_equal(lay.valid_rows, [64, 16])
    np.testing.assert_array_equal(lay.live_pages, [4, 1])
    assert lay.page_mask[4] == 0xFFFF and lay.page_mask[5] == 0


def test_page_mask_bits():
    valid = np.zeros(32, bool)
    valid[[0, 3, 17]] = True
    lay = slot_layout(valid, 32)
    np.testing.assert_array_equal(lay.page_mask, [0b1001, 0b10])
    np.testing.assert_array_equal(lay.live_pages, [2])


def test_slot_roundtrip_and_slot_token():
    lay = video_layout((5, 7, 9), (2, 4, 4), 32)
    x = np.random.default_rng(0).normal(size=(2, lay.num_tokens, 3))
    back = lay.from_slots(lay.to_slots(x, axis=1), axis=1)
    np.testing.assert_array_equal(back, x)
    assert (lay.slot_token[lay.valid] >= 0).all() and (lay.slot_token[~lay.valid] == -1).all()


def test_partition_layout_pads_each_group():
    groups = np.array([1, 0, 1, 1, 2] + [0] * 20)
    lay = partition_layout(groups, block_size=16)
    # group 0: 21 tokens -> 2 blocks; group 1: 3 -> 1 block; group 2: 1 -> 1 block
    np.testing.assert_array_equal(lay.block_group, [0, 0, 1, 2])
    np.testing.assert_array_equal(lay.valid_rows, [16, 5, 3, 1])
    assert lay.token_slot[0] == 32 and lay.token_slot[2] == 33 and lay.token_slot[4] == 48


def test_contiguous_layout():
    lay = contiguous_layout(97, 64)
    np.testing.assert_array_equal(lay.valid_rows, [64, 33])
    assert lay.num_pages == 128 // PAGE_ROWS


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(grid=(4, 4, 4), tile=(8, 4, 4)), "tile[0]"),
        (dict(grid=(4, 0, 4), tile=(2, 2, 2)), "grid"),
        (dict(grid=(4, 4, -1), tile=(2, 2, 2)), "grid"),
        (dict(grid=(4, 4), tile=(2, 2, 2)), "grid"),
        (dict(grid=(4, 4, 4), tile=(2, 2, 2), block_size=24), "block_size"),
        (dict(grid=(4, 4, 4), tile=(2, 2, 2), padding="middle"), "padding"),
    ],
    ids=["tile-larger-than-grid", "zero-dim", "negative-dim", "two-dims", "block-not-x16", "bad-padding"],
)
def test_bad_video_layout_names_field(kwargs, field):
    with pytest.raises(LayoutError, match=field.replace("[", r"\[").replace("]", r"\]")):
        video_layout(**kwargs)


def test_video_grid_tile_extents():
    vg = VideoGrid((5, 4, 4), (2, 4, 4))
    np.testing.assert_array_equal(vg.tile_extents()[:, 0], [2, 2, 1])
