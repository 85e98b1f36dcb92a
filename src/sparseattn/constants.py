"""Tile geometry shared by the planners and the CUDA kernels.

The same names are defined in ``kernels_cu/tile_config.cuh``; a test checks they agree.
"""

#: Rows of one K/V (and Q) page: two 8-row atoms of the 128-byte shared-memory swizzle and
#: exactly one bf16 wgmma k-step in O = P·V.
PAGE_ROWS = 16

#: KPage tile shapes (M query rows, N key columns): route 0 is the short-Q tile, route 1 the square one.
KPAGE_TILE_SMALL_M = 64
KPAGE_TILE_SMALL_N = 256
KPAGE_TILE_LARGE_M = 128
KPAGE_TILE_LARGE_N = 128
KPAGE_ROUTES = ((KPAGE_TILE_SMALL_M, KPAGE_TILE_SMALL_N), (KPAGE_TILE_LARGE_M, KPAGE_TILE_LARGE_N))

#: A Q block whose live rows (16 · live pages) are at most this many takes the 64×256 route.
KPAGE_SMALL_ROUTE_MAX_QROWS = 64

#: Logical block sizes the BSA baseline supports (square tiles B×B).
BSA_BLOCK_SIZES = (64, 128)
