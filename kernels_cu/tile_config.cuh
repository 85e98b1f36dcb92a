// Tile geometry shared by the planners (src/sparseattn/constants.py) and the CUDA kernels.
// Same names and values as constants.py; tests/test_compile.py parses both and checks they agree.
#pragma once

// Rows of one K/V (and Q) page: two 8-row atoms of the 128-byte swizzle, one bf16 k-step of P·V.
#define PAGE_ROWS 16

// KPage tile shapes (M query rows, N key columns): route 0 = short-Q tile, route 1 = square tile.
#define KPAGE_TILE_SMALL_M 64
#define KPAGE_TILE_SMALL_N 256
#define KPAGE_TILE_LARGE_M 128
#define KPAGE_TILE_LARGE_N 128

// A Q block whose live rows (16 * live pages) are at most this many takes the 64x256 route.
#define KPAGE_SMALL_ROUTE_MAX_QROWS 64

// Logical block sizes of the BSA baseline (square B x B tiles).
#define BSA_BLOCK_SIZE_SMALL 64
#define BSA_BLOCK_SIZE_LARGE 128

// Rows of a warp's slice of the query tile in the mma.sync kernels: one page, one m16 tile.
#define WARP_ROWS 16
