"""Launchers of the device planner's kernels (``kernels_cu/planner.cu``); the pipeline that calls them is
:mod:`sparseattn.planning.device`.

Every launcher enqueues on CuPy's current stream and returns at once (no synchronisation, no copies
between host and device). Array arguments are CuPy arrays or raw device pointers (``numpy.uint64``).
"""

from __future__ import annotations

import os

import numpy as np

from . import launch

SOURCE = "planner.cu"
NAME_EXPRESSIONS = (
    "plan_bitmap_from_topk",
    "plan_bitmap_from_topk_rows",
    "plan_bitmap_from_mask",
    "plan_bitmap_transpose",
    "plan_pair_weights",
    "plan_pair_match",
    "plan_pair_match_smem",
    "plan_items",
    "plan_items_fused",
    "plan_scan",
    "plan_segment_sort",
    "plan_zero_pages",
)
#: Stream orders, output formats and sort keys of planner.cu (PLAN_MODE_*, PLAN_OUT_*, PLAN_KEY_*).
OUT_WORK_LIST, OUT_TILE_PLAN = 0, 1
KEY_LEN, KEY_COST = 0, 1
#: Stream tables of at most this many bytes are staged in shared memory (PLAN_SMEM_TABLES_MAX).
SMEM_TABLES_MAX = 96 * 1024
#: The item passes' blocks per SM, their warps striding over the items: the kernel is compiled for it
#: (PLAN_ITEMS_MIN_BLOCKS, whose default in planner.cu is ITEMS_BLOCKS_DEFAULT).
#: ``SPARSEATTN_PLAN_ITEMS_BLOCKS`` sets it for a process (A/B runs of the bench). At 4 (64 registers)
#: planning took 0.85× the time of 2 (96 registers) on the H200 (NOTES_device_planner v7).
ITEMS_BLOCKS_DEFAULT = 4
ITEMS_BLOCKS_PER_SM = int(os.environ.get("SPARSEATTN_PLAN_ITEMS_BLOCKS") or ITEMS_BLOCKS_DEFAULT)
#: How the write pass stores a group of selected blocks' pages: "staged" (the lanes place the group's pages
#: in stream order in a per-warp stage in shared memory, then store 32 consecutive entries at a time),
#: "coalesced" (lanes take consecutive entries of each class's run, found by a search over the lanes'
#: prefix: PLAN_WRITE_COALESCED), "per_block" (each lane its block's pages: PLAN_WRITE_PER_BLOCK) or "auto"
#: (staged; NOTES_device_planner v8 and v15); ``SPARSEATTN_PLAN_ITEMS_WRITE``. The first three are compiled
#: apart (PLAN_WRITE_* defines), so an A/B run can time each in one process.
ITEMS_WRITES = {
    "auto": (),
    "staged": (),
    "coalesced": ("PLAN_WRITE_COALESCED",),
    "per_block": ("PLAN_WRITE_PER_BLOCK",),
}
ITEMS_WRITE = os.environ.get("SPARSEATTN_PLAN_ITEMS_WRITE") or "auto"
#: Entries of one warp's stage (the kernel's stage_cap: 256 fits 32 blocks of 128 rows) and the most pages
#: a streamed layout may have (page ids below 2^PLAN_STAGE_LANE_SHIFT).
STAGE_CAP = 256
STAGE_PAGES = 1 << 26
#: Where the pair matching keeps a head's keys, edges, partners and best keys: "smem" (shared memory,
#: plan_pair_match_smem), "global" (partners and best keys in L2, plan_pair_match: any size) or "auto"
#: (shared memory where they fit in PAIR_MATCH_SMEM_MAX bytes, which 480p and 720p VSA layouts do);
#: ``SPARSEATTN_PLAN_PAIR_MATCH``. Both run the same rounds: the same matching; "auto" is the default.
PAIR_MATCH_FORMS = ("auto", "smem", "global")
PAIR_MATCH = os.environ.get("SPARSEATTN_PLAN_PAIR_MATCH") or "auto"
PAIR_MATCH_SMEM_MAX = 200 * 1024
#: Whether the forward work list is counted, offset and written in one pass (``plan_items_fused``: each
#: item finds its offset by a decoupled look-back over the items before it) instead of a count pass, a scan
#: and a write pass (NOTES_device_planner v17); ``SPARSEATTN_PLAN_FUSED_FORWARD=0`` for the three. The
#: same arrays either way.
FUSED_FORWARD = os.environ.get("SPARSEATTN_PLAN_FUSED_FORWARD", "1") == "1"
#: The fused pass writes each forward item's stream at the start of a slice of the buffer fixed by the layout
#: (:meth:`~sparseattn.planning.templates.ItemTemplate.stream_slices`) rather than at the offset a look-back
#: over the earlier items' counts gives: no item waits for another, the streams have gaps and the buffer
#: grows (the matched slots' slices hold a pair's bound); NOTES_device_planner v21. The default;
#: ``SPARSEATTN_PLAN_FORWARD_SLICES=0`` for the look-back (streams back to back, as the host writes them).
FORWARD_SLICES = os.environ.get("SPARSEATTN_PLAN_FORWARD_SLICES", "1") == "1"
#: How a top-k selection becomes the bitmap: "rows" (one warp per row builds its words in shared memory and
#: stores them whole: no zeroed bitmap, no global atomics; rows of at most TOPK_ROW_WORDS words) or
#: "atomic" (one thread per index, ``atomicOr`` into a zeroed bitmap; rows of any length);
#: ``SPARSEATTN_PLAN_BITMAP_TOPK``. The same bitmap either way.
BITMAP_TOPK = os.environ.get("SPARSEATTN_PLAN_BITMAP_TOPK") or "rows"
#: Nanoseconds the fused pass's look-back sleeps before it reads again positions that have not all counted
#: (PLAN_LB_SLEEP_NS; its default compiles the kernel as planner.cu's default); ``SPARSEATTN_PLAN_LB_SLEEP_NS``.
LB_SLEEP_NS_DEFAULT = 32
LB_SLEEP_NS = int(os.environ.get("SPARSEATTN_PLAN_LB_SLEEP_NS") or LB_SLEEP_NS_DEFAULT)
#: The look-back's sleep doubles after every round that waited, up to this many nanoseconds (PLAN_LB_SLEEP_MAX_NS;
#: 0, the default: no growth); ``SPARSEATTN_PLAN_LB_SLEEP_MAX_NS``.
LB_SLEEP_MAX_NS = int(os.environ.get("SPARSEATTN_PLAN_LB_SLEEP_MAX_NS") or 0)
TOPK_ROW_WORDS = 1024
THREADS = 256
NULL = np.uint64(0)


def stage_blocks(tables: dict) -> int:
    """Selected blocks per group of the staged write pass (the default form; 0 under the other forms):
    as many as fit their pages in one warp's stage, at most 32 and at least 1 (a block with more pages
    than the stage holds goes through in windows)."""
    if ITEMS_WRITE not in ("auto", "staged"):
        return 0
    return min(32, max(1, STAGE_CAP // max(int(tables["t_max_pages"]), 1)))


def settings() -> tuple:
    """The module settings that choose what the launchers launch (part of a recorded call's key); raises
    on a setting out of range (the planner reads them before its first launch)."""
    if not 0 <= int(LB_SLEEP_NS) <= 1_000_000:
        raise ValueError(f"planner.LB_SLEEP_NS must be in [0, 1e6] ns, got {LB_SLEEP_NS}")
    if not 0 <= int(LB_SLEEP_MAX_NS) <= 1_000_000:
        raise ValueError(f"planner.LB_SLEEP_MAX_NS must be in [0, 1e6] ns, got {LB_SLEEP_MAX_NS}")
    return (
        ITEMS_WRITE,
        int(ITEMS_BLOCKS_PER_SM),
        PAIR_MATCH,
        int(STAGE_CAP),
        bool(FUSED_FORWARD),
        bool(FORWARD_SLICES),
        BITMAP_TOPK,
        int(LB_SLEEP_NS),
        int(LB_SLEEP_MAX_NS),
    )


def _fn(name: str):
    return launch.function(SOURCE, name, NAME_EXPRESSIONS)


#: While a list, every launch and memory operation of these launchers is also appended to it, in order:
#: ``("launch", fn, grid, block, args, smem)``, ``("memset", pointer, bytes)``, ``("copy", dst, src, bytes)``.
#: The device planner records its first call of each shape and replays it (``planning.plan_recipe``).
RECORD: list | None = None


def _run(fn, grid, block, args, smem: int = 0) -> None:
    if RECORD is not None:
        RECORD.append(("launch", fn, tuple(grid), tuple(block), tuple(args), int(smem)))
    fn(grid, block, args, shared_mem=smem)


def memset_zero(pointer, nbytes: int) -> None:
    """Zero ``nbytes`` bytes at ``pointer`` on the current stream."""
    import cupy

    if RECORD is not None:
        RECORD.append(("memset", pointer, int(nbytes)))
    cupy.cuda.runtime.memsetAsync(int(pointer), 0, int(nbytes), cupy.cuda.get_current_stream().ptr)


def copy(dst, src, nbytes: int) -> None:
    """Copy ``nbytes`` bytes from ``src`` to ``dst`` (device pointers) on the current stream."""
    import cupy

    if RECORD is not None:
        RECORD.append(("copy", dst, src, int(nbytes)))
    rt = cupy.cuda.runtime
    rt.memcpyAsync(
        int(dst), int(src), int(nbytes), rt.memcpyDeviceToDevice, cupy.cuda.get_current_stream().ptr
    )


def _blocks(n: int, per_block: int = THREADS) -> int:
    return max(1, -(-int(n) // per_block))


def topk_by_rows(k: int, words: int) -> bool:
    """Whether :func:`bitmap_from_topk` writes every word of the bitmap itself (one warp per row); if not,
    the bitmap must be zeroed before it."""
    if BITMAP_TOPK not in ("rows", "atomic"):
        raise ValueError(f"planner.BITMAP_TOPK must be 'rows' or 'atomic', got {BITMAP_TOPK!r}")
    return BITMAP_TOPK == "rows" and k > 0 and 0 < words <= TOPK_ROW_WORDS


def bitmap_from_topk(
    idx, num, rows: int, k: int, row_blocks: int, cols: int, words: int, row_alive, col_alive, bitmap, invalid
):
    """Set bit c of row r for every used index c of ``idx [rows, k]``: every word of ``bitmap [rows, words]``
    where :func:`topk_by_rows`, else into a bitmap zeroed before."""
    if rows * k == 0:
        return
    args = (idx, num, np.int64(rows), np.int32(k), np.int32(row_blocks), np.int32(cols), np.int32(words))
    args += (row_alive, col_alive, bitmap, invalid)
    if topk_by_rows(k, words):  # one warp per row, its words in shared memory
        warps = THREADS // 32
        smem = warps * words * 4
        fn = launch.prepare(_fn("plan_bitmap_from_topk_rows"), smem)
        _run(fn, (_blocks(rows, warps),), (THREADS,), args, smem)
    else:  # one thread per index
        _run(_fn("plan_bitmap_from_topk"), (_blocks(rows * k),), (THREADS,), args)


def bitmap_from_mask(mask, rows: int, row_blocks: int, cols: int, words: int, row_alive, col_alive, bitmap):
    """Pack a bool mask ``[rows, cols]`` into ``bitmap [rows, words]``."""
    if rows * words == 0:
        return
    _run(
        _fn("plan_bitmap_from_mask"),
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
    _run(
        _fn("plan_bitmap_transpose"),
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
    matched=None,
    void_counts=NULL,
    fused=None,
):
    """One pass of ``plan_items`` over every (head, item): count (``write`` False) or write. ``tables``:
    the template's device arrays (:class:`sparseattn.planning.device.DeviceTemplate`); ``matched``: the
    matched slots' items of every head (``info``, ``members``, ``bits``, ``own`` pointers, and ``slots``);
    ``void_counts`` int32 ``[heads]``, zeroed (the forward's count pass): each head's void items (no stream
    entry, no owned page), which the count pass also marks with M = -1 in ``cnt``. ``fused``: the forward
    work list's one pass (``plan_items_fused``, ``write`` True, no ``perm``), a dict of its ``lookback``
    (int64 ``[n]``) and ``claim`` (int32) pointers, zeroed before, and ``begin`` (int32 ``[n + 1]``), where it
    writes the offsets that :func:`scan` would; with ``slices`` (int64 ``[items + 1]``, see
    :data:`FORWARD_SLICES`), the items' slice starts instead."""
    n = heads * tables["items"]
    if n == 0:
        return
    import cupy

    if ITEMS_WRITE not in ITEMS_WRITES:
        raise ValueError(f"planner.ITEMS_WRITE must be one of {sorted(ITEMS_WRITES)}, got {ITEMS_WRITE!r}")
    in_smem = tables["smem_bytes"] <= SMEM_TABLES_MAX
    smem = tables["smem_bytes"] if in_smem else 0
    group = stage_blocks(tables) if write else 0
    if group:
        smem += (THREADS // 32) * STAGE_CAP * 4
    per_sm = int(ITEMS_BLOCKS_PER_SM)
    defines = () if per_sm == ITEMS_BLOCKS_DEFAULT else (f"PLAN_ITEMS_MIN_BLOCKS={per_sm}",)
    defines += ITEMS_WRITES[ITEMS_WRITE]
    if fused is not None and int(LB_SLEEP_NS) != LB_SLEEP_NS_DEFAULT:
        defines += (f"PLAN_LB_SLEEP_NS={int(LB_SLEEP_NS)}",)
    if fused is not None and int(LB_SLEEP_MAX_NS) > int(LB_SLEEP_NS):
        defines += (f"PLAN_LB_SLEEP_MAX_NS={int(LB_SLEEP_MAX_NS)}",)
    name = "plan_items" if fused is None else "plan_items_fused"
    fn = launch.prepare(launch.function(SOURCE, name, NAME_EXPRESSIONS, defines), smem)
    extra = (
        ()
        if fused is None
        else (fused["lookback"], fused["claim"], fused["begin"], fused.get("slices", NULL))
    )
    blocks = min(_blocks(n * 32), per_sm * launch.sm_count(cupy.cuda.runtime.getDevice()))
    _run(
        fn,
        (blocks,),
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
            np.int32(tables["t_blocks"]),
            np.int32(tables["t_listed"]),
            np.int32(tables["t_pages_total"]),
            np.int32(1 if in_smem else 0),
            np.int32(0 if matched is None else matched["slots"]),
            *((NULL,) * 4 if matched is None else (matched[n] for n in ("info", "members", "bits", "own"))),
            void_counts,
            np.int32(group),
            np.int32(STAGE_CAP),
            *extra,
        ),
        smem,
    )


def pair_weights(bitmap, row_blocks: int, words: int, heads: int, edges, n_edges: int, slot_block, keys):
    """``keys [heads, n_edges]``: each candidate edge's shared selected K blocks, packed with its slots."""
    if heads * n_edges == 0:
        return
    _run(
        _fn("plan_pair_weights"),
        (_blocks(heads * n_edges),),
        (THREADS,),
        (
            bitmap,
            np.int32(row_blocks),
            np.int32(words),
            np.int32(heads),
            edges,
            np.int32(n_edges),
            slot_block,
            keys,
        ),
    )


def pair_match_smem_bytes(slots: int, n_edges: int) -> int:
    """Dynamic shared memory of plan_pair_match_smem: keys (8 bytes) and both ends (4) per edge, best key
    (8) and partner (4) per slot, as planner.cu lays them out, and alignment slack."""
    return 12 * int(n_edges) + 12 * int(slots) + 16


def pair_match_form(slots: int, n_edges: int) -> str:
    """``"smem"`` or ``"global"``: which kernel :func:`pair_match` launches (see :data:`PAIR_MATCH`)."""
    if PAIR_MATCH not in PAIR_MATCH_FORMS:
        raise ValueError(f"planner.PAIR_MATCH must be one of {PAIR_MATCH_FORMS}, got {PAIR_MATCH!r}")
    fits = slots < 1 << 16 and pair_match_smem_bytes(slots, n_edges) <= PAIR_MATCH_SMEM_MAX
    if PAIR_MATCH == "smem" and not fits:
        raise ValueError(
            f"planner.PAIR_MATCH='smem': {slots} slots and {n_edges} edges need "
            f"{pair_match_smem_bytes(slots, n_edges)} bytes of shared memory (at most {PAIR_MATCH_SMEM_MAX})"
        )
    return "global" if PAIR_MATCH == "global" or not fits else "smem"


def pair_match(
    keys, edges, n_edges: int, slots: int, heads: int, slot_block, slot_own, partner, best, matched
):
    """Every head's greedy matching of its slots into ``partner`` ``[heads, slots]``, and the slots' items
    into ``matched``'s arrays (``best``: scratch of the global form, ``[heads, slots]``)."""
    if heads == 0 or slots == 0:
        return
    outputs = tuple(matched[n] for n in ("info", "members", "bits", "own"))
    if pair_match_form(slots, n_edges) == "smem":
        smem = pair_match_smem_bytes(slots, n_edges)
        fn = launch.prepare(_fn("plan_pair_match_smem"), smem)
        _run(
            fn,
            (heads,),
            (1024,),
            (keys, edges, np.int32(n_edges), np.int32(slots), slot_block, slot_own, partner, *outputs),
            smem,
        )
        return
    _run(
        _fn("plan_pair_match"),
        (heads,),
        (1024,),
        (
            keys,
            edges,
            np.int32(n_edges),
            np.int32(slots),
            slot_block,
            slot_own,
            partner,
            best,
            *outputs,
        ),
    )


def scan(cnt, n: int, cap: int, out, overflow, perm=NULL):
    """``out[p]`` = Σ of the stream lengths of the items before position p (item = ``perm[p]`` or p),
    for p in ``[0, n]``, clamped to ``cap``."""
    _run(_fn("plan_scan"), (1,), (1024,), (cnt, perm, np.int32(n), np.int64(cap), out, overflow))


def segment_sort(
    segs,
    num_segs: int,
    max_items: int,
    cnt,
    out,
    key_kind: int,
    chunk_pages: int = 1,
    indirect=NULL,
    void_counts=NULL,
    first_live=NULL,
):
    """Sort each segment's items (``segs`` int32 ``[num_segs, 4]``: source, destination, items) largest
    first by ``key_kind`` (stream length, or rows × chunks: the count pass's ``cnt``) into ``out``. With
    ``void_counts`` (one segment per head, the count pass's): every void item first, then every live item,
    segment by segment; ``first_live`` (int32) gets the number of void items."""
    if num_segs == 0:
        return
    size = 1 << max(0, int(max_items) - 1).bit_length()
    fn = launch.prepare(_fn("plan_segment_sort"), 8 * size)
    _run(
        fn,
        (num_segs,),
        (1024,),
        (segs, cnt, indirect, np.int32(key_kind), np.int32(chunk_pages), out, void_counts, first_live),
        8 * size,
    )


def zero_pages(x, heads: int, head_elems: int, page_elems: int, pages, n: int):
    """Zero pages ``pages[:n]`` of every head of ``x`` (bf16 ``[heads, pages per head, 16, d]``)."""
    total = heads * n * (page_elems // 8)
    if total == 0:
        return
    _run(
        _fn("plan_zero_pages"),
        (_blocks(total),),
        (THREADS,),
        (x, np.int32(heads), np.int64(head_elems), np.int32(page_elems), pages, np.int32(n)),
    )
