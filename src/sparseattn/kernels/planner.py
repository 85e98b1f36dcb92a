"""Launchers of the device planner's kernels (``kernels_cu/planner.cu``); the pipeline that calls them is
:mod:`sparseattn.planning.device`.

Every launcher enqueues on CuPy's current stream and returns at once (no synchronisation, no copies
between host and device). Array arguments are CuPy arrays or raw device pointers (``numpy.uint64``).
"""

from __future__ import annotations

import numpy as np

from . import launch

SOURCE = "planner.cu"
NAME_EXPRESSIONS = (
    "plan_bitmap_from_topk",
    "plan_bitmap_from_mask",
    "plan_bitmap_transpose",
    "plan_items",
    "plan_scan",
    "plan_segment_sort",
    "plan_zero_pages",
)
#: Stream orders, output formats and sort keys of planner.cu (PLAN_MODE_*, PLAN_OUT_*, PLAN_KEY_*).
OUT_WORK_LIST, OUT_TILE_PLAN = 0, 1
KEY_LEN, KEY_COST = 0, 1
#: Items of one segment the sort takes (PLAN_SORT_MAX).
SORT_MAX = 16384
THREADS = 256
NULL = np.uint64(0)


def _fn(name: str):
    return launch.function(SOURCE, name, NAME_EXPRESSIONS)


def _blocks(n: int, per_block: int = THREADS) -> int:
    return max(1, -(-int(n) // per_block))


def bitmap_from_topk(
    idx, num, rows: int, k: int, row_blocks: int, cols: int, words: int, row_alive, col_alive, bitmap, invalid
):
    """Set bit c of row r for every used index c of ``idx [rows, k]`` (``bitmap`` zeroed before)."""
    if rows * k == 0:
        return
    _fn("plan_bitmap_from_topk")(
        (_blocks(rows * k),),
        (THREADS,),
        (
            idx,
            num,
            np.int64(rows),
            np.int32(k),
            np.int32(row_blocks),
            np.int32(cols),
            np.int32(words),
            row_alive,
            col_alive,
            bitmap,
            invalid,
        ),
    )


def bitmap_from_mask(mask, rows: int, row_blocks: int, cols: int, words: int, row_alive, col_alive, bitmap):
    """Pack a bool mask ``[rows, cols]`` into ``bitmap [rows, words]``."""
    if rows * words == 0:
        return
    _fn("plan_bitmap_from_mask")(
        (_blocks(rows * words),),
        (THREADS,),
        (
            mask,
            np.int64(rows),
            np.int32(row_blocks),
            np.int32(cols),
            np.int32(words),
            row_alive,
            col_alive,
            bitmap,
        ),
    )


def bitmap_transpose(bitmap, heads: int, rows: int, cols: int, in_words: int, out_words: int, out):
    """``out [heads, cols, out_words]`` = the transpose of ``bitmap [heads, rows, in_words]``."""
    warps = heads * out_words * in_words
    if warps == 0:
        return
    _fn("plan_bitmap_transpose")(
        (_blocks(warps * 32),),
        (THREADS,),
        (
            bitmap,
            np.int32(heads),
            np.int32(rows),
            np.int32(cols),
            np.int32(in_words),
            np.int32(out_words),
            out,
        ),
    )


def items(
    bitmap,
    row_blocks: int,
    words: int,
    heads: int,
    tables: dict,
    chunk_pages: int,
    write: bool,
    out_format: int,
    cnt,
    base=NULL,
    perm=NULL,
    cap: int = 0,
    work_info=NULL,
    own_entries=NULL,
    stream_entries=NULL,
    work_head=NULL,
    own_pages=NULL,
    stream_pages=NULL,
    pair_pages=NULL,
    overflow=NULL,
):
    """One pass of ``plan_items`` over every (head, item): count (``write`` False) or write. ``tables``:
    the template's device arrays (:class:`sparseattn.planning.device.DeviceTemplate`)."""
    n = heads * tables["items"]
    if n == 0:
        return
    _fn("plan_items")(
        (_blocks(n * 32),),
        (THREADS,),
        (
            bitmap,
            np.int32(row_blocks),
            np.int32(words),
            np.int32(heads),
            np.int32(tables["items"]),
            tables["info"],
            tables["members"],
            tables["bits"],
            tables["own"],
            tables["t_first"],
            tables["t_pages"],
            tables["t_full"],
            tables["t_mask"],
            tables["o_mask"],
            np.int32(chunk_pages),
            np.int32(1 if write else 0),
            np.int32(out_format),
            cnt,
            base,
            perm,
            np.int64(cap),
            work_info,
            own_entries,
            stream_entries,
            work_head,
            own_pages,
            stream_pages,
            pair_pages,
            overflow,
        ),
    )


def scan(cnt, n: int, cap: int, out, overflow, perm=NULL):
    """``out[p]`` = Σ of the stream lengths of the items before position p (item = ``perm[p]`` or p),
    for p in ``[0, n]``, clamped to ``cap``."""
    _fn("plan_scan")((1,), (1024,), (cnt, perm, np.int32(n), np.int64(cap), out, overflow))


def segment_sort(
    segs,
    num_segs: int,
    max_items: int,
    cnt,
    out,
    key_kind: int,
    info=NULL,
    items_per_head: int = 1,
    chunk_pages: int = 1,
    indirect=NULL,
):
    """Sort each segment's items (``segs`` int32 ``[num_segs, 4]``: source, destination, items) largest
    first by ``key_kind`` into ``out``."""
    if num_segs == 0:
        return
    size = 1 << max(0, int(max_items) - 1).bit_length()
    fn = launch.prepare(_fn("plan_segment_sort"), 8 * size)
    fn(
        (num_segs,),
        (1024,),
        (segs, cnt, indirect, info, np.int32(items_per_head), np.int32(key_kind), np.int32(chunk_pages), out),
        shared_mem=8 * size,
    )


def zero_pages(x, heads: int, head_elems: int, page_elems: int, pages, n: int):
    """Zero pages ``pages[:n]`` of every head of ``x`` (bf16 ``[heads, pages per head, 16, d]``)."""
    total = heads * n * (page_elems // 8)
    if total == 0:
        return
    _fn("plan_zero_pages")(
        (_blocks(total),),
        (THREADS,),
        (x, np.int32(heads), np.int64(head_elems), np.int32(page_elems), pages, np.int32(n)),
    )
