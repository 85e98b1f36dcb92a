"""Numpy emulator of a paged attention kernel: executes a :class:`TilePlan` tile by tile.

It reads only what a kernel reads (``TilePlan.device_arrays()``: work routes/heads, owned pages with
``-1`` padding, streamed pages packed ``N/16`` per tile, uint16 page masks) and does what a kernel
does, in float64:

* gather the owned pages' rows into an ``M``-row tile (``-1`` pages and invalid rows zero-filled),
* gather every ``N``-wide tile of streamed pages (the last one partly empty, its tail zero-filled),
* mask invalid key columns to ``-inf`` from the page-mask bits,
* forward (owner ``"q"``): online softmax with a running max and sum (FlashAttention rescaling),
  then store O/LSE rows of owned pages whose row bit is set;
* backward (owner ``"kv"``): recompute ``P = exp(S - LSE)`` per streamed Q tile, accumulate the
  owned dK/dV, and add dQ contributions into a shared dQ (the kernel's atomics), ``D = rowsum(dO·O)``.

Zero-filling invalid rows on gather (as predicated / zero-size loads do) makes padding contents
irrelevant; a kernel that loads dead rows verbatim must still never let them reach valid outputs.

:func:`emulate_token_work_list` runs a work list as the forward's token-order build addresses memory
(rows gathered from token-ordered tensors through slot -> token maps, outputs stored by token;
:func:`token_rows` / :func:`rows_to_tokens`): a numpy twin of that addressing, which the CPU tests hold to
moving the tensors to slots (the GPU tests compare the kernel with its slot-order build).

:func:`covered_pairs` lists the (head, q slot, k slot) pairs a plan computes, and
:func:`graph_slot_pairs` the pairs a graph asks for, so tests can check exactly-once coverage.
"""

from __future__ import annotations

import numpy as np

from .constants import PAGE_ROWS
from .graph import SparseGraph
from .planning.tile_plan import OWNERS, TilePlan, gather_segments
from .reference import _as_float_array, _check_like, _check_scale


class EmulationError(ValueError):
    """A plan or tensor given to the emulator is inconsistent; the message names the field."""


_BITS = np.uint16(1) << np.arange(PAGE_ROWS, dtype=np.uint16)


def _softmax_init(b: int, m: int, dv: int):
    """Running (max, sum, unnormalized O) of an online softmax over ``m`` rows, ``b`` batches."""
    return np.full((b, m), -np.inf), np.zeros((b, m)), np.zeros((b, m, dv))


def _softmax_step(state, s: np.ndarray, v_tile: np.ndarray):
    """The state after one key tile: scores ``s`` ``[b, m, n]`` (masked keys -inf), values ``[b, n, dv]``."""
    run_max, run_sum, acc = state
    new_max = np.maximum(run_max, s.max(axis=-1))
    base = np.where(np.isfinite(new_max), new_max, 0.0)  # all -inf so far: keep exp() at 0
    p = np.exp(s - base[..., None])
    alpha = np.exp(run_max - base)
    return new_max, alpha * run_sum + p.sum(axis=-1), alpha[..., None] * acc + np.matmul(p, v_tile)


def _softmax_finish(state):
    """(O, LSE) of an online-softmax state; rows without any key get O = 0, LSE = -inf."""
    run_max, run_sum, acc = state
    has_keys = run_sum > 0
    o_tile = acc / np.where(has_keys, run_sum, 1.0)[..., None]
    return o_tile, np.where(has_keys, run_max + np.log(np.where(has_keys, run_sum, 1.0)), -np.inf)


def _page_rows_valid(mask: np.ndarray, pages: np.ndarray) -> np.ndarray:
    """bool ``[len(pages) * 16]``: row validity of the given pages (``-1`` pages are all invalid)."""
    bits = (mask[np.maximum(pages, 0)][:, None] & _BITS) != 0
    bits &= (pages >= 0)[:, None]
    return bits.ravel()


def _page_slots(pages: np.ndarray) -> np.ndarray:
    """int64 ``[len(pages) * 16]``: slot ids of the pages' rows (``-1`` pages map to slot 0)."""
    return (np.maximum(pages, 0)[:, None].astype(np.int64) * PAGE_ROWS + np.arange(PAGE_ROWS)).ravel()


def validate_plan(plan: TilePlan, num_own_pages: int | None = None, num_stream_pages: int | None = None):
    """Check every index a kernel would follow; raise :class:`EmulationError` naming the bad field."""
    if not isinstance(plan, TilePlan):
        raise EmulationError(f"plan must be a TilePlan, got {type(plan).__name__}")
    if plan.owner not in OWNERS:
        raise EmulationError(f"plan.owner must be one of {OWNERS}, got {plan.owner!r}")
    arrays = plan.device_arrays()
    w = plan.num_work
    for name in ("work_route", "work_head", "own_pages"):
        if arrays[name].shape[0] != w:
            raise EmulationError(f"plan.{name} has {arrays[name].shape[0]} rows, expected {w} work items")
    routes = np.asarray(plan.routes, dtype=np.int64).reshape(-1, 2)
    if routes.size == 0 or np.any(routes <= 0) or np.any(routes % PAGE_ROWS):
        raise EmulationError(f"plan.routes must be positive multiples of {PAGE_ROWS}, got {plan.routes}")
    if w and (arrays["work_route"].min() < 0 or arrays["work_route"].max() >= len(routes)):
        raise EmulationError(f"plan.work_route must index plan.routes (0..{len(routes) - 1})")
    if w and (arrays["work_head"].min() < 0 or arrays["work_head"].max() >= plan.heads):
        raise EmulationError(f"plan.work_head must lie in [0, {plan.heads})")
    n_own = plan.own_page_mask.size if num_own_pages is None else num_own_pages
    n_stream = plan.stream_page_mask.size if num_stream_pages is None else num_stream_pages
    if plan.own_page_mask.size != n_own:
        raise EmulationError(f"plan.own_page_mask has {plan.own_page_mask.size} pages, tensors have {n_own}")
    if plan.stream_page_mask.size != n_stream:
        raise EmulationError(
            f"plan.stream_page_mask has {plan.stream_page_mask.size} pages, tensors have {n_stream}"
        )
    own = arrays["own_pages"]
    if own.ndim != 2 or (own.size and (own.min() < -1 or own.max() >= n_own)):
        raise EmulationError(f"plan.own_pages must be [W, P] page ids in [-1, {n_own})")
    if w:
        rows_per_work = routes[arrays["work_route"], 0] // PAGE_ROWS
        beyond = np.arange(own.shape[1])[None, :] >= rows_per_work[:, None]
        if np.any(beyond & (own >= 0)):
            raise EmulationError("plan.own_pages holds pages beyond the M rows of its work item's route")
    ptr = arrays["stream_indptr"].astype(np.int64)
    pages = arrays["stream_pages"]
    if ptr.shape != (w + 1,) or ptr[0] != 0 or np.any(np.diff(ptr) < 0) or ptr[-1] != pages.size:
        raise EmulationError(
            "plan.stream_indptr must be [W + 1], start at 0, not decrease, end at len(stream_pages)"
        )
    if pages.size and (pages.min() < 0 or pages.max() >= n_stream):
        raise EmulationError(f"plan.stream_pages must be page ids in [0, {n_stream})")
    if "stream_vis" in arrays:
        vis = arrays["stream_vis"]
        if vis.shape != pages.shape or (vis.size and (vis.min() < 1 or vis.max() > 3)):
            raise EmulationError("plan.stream_vis must hold 1, 2 or 3 for every entry of plan.stream_pages")
        if w:
            rows = np.repeat(routes[arrays["work_route"], 0], np.diff(ptr))
            if np.any((rows != 128) & (vis != 3)):
                raise EmulationError("plan.stream_vis may restrict entries of 128-row work items only")


def _work_items(plan: TilePlan):
    """Yield ``(head, M, N, own_pages[M/16], stream_tiles)``; each stream tile is ``N/16`` pages, -1 padded."""
    arrays = plan.device_arrays()
    routes = np.asarray(plan.routes, dtype=np.int64).reshape(-1, 2)
    ptr = arrays["stream_indptr"].astype(np.int64)
    for w in range(plan.num_work):
        m, n = (int(x) for x in routes[arrays["work_route"][w]])
        own = arrays["own_pages"][w, : m // PAGE_ROWS].astype(np.int64)
        streamed = arrays["stream_pages"][ptr[w] : ptr[w + 1]].astype(np.int64)
        per_tile = n // PAGE_ROWS
        n_tiles = -(-streamed.size // per_tile)
        padded = np.full(n_tiles * per_tile, -1, dtype=np.int64)
        padded[: streamed.size] = streamed
        yield int(arrays["work_head"][w]), m, n, own, padded.reshape(n_tiles, per_tile)


def _gather(x_h: np.ndarray, pages: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Rows of ``x_h`` ``[b, slots, d]`` for the pages' slots, invalid rows zero-filled: ``[b, rows, d]``."""
    tile = x_h[:, _page_slots(pages)].astype(np.float64)
    tile[:, ~valid] = 0.0
    return tile


def _check_tensors(q, k, v, plan: TilePlan):
    if not isinstance(plan, TilePlan):
        raise EmulationError(f"plan must be a TilePlan, got {type(plan).__name__}")
    q, k, v = _as_float_array("q", q), _as_float_array("k", k), _as_float_array("v", v)
    for name, arr in (("q", q), ("k", k), ("v", v)):
        if arr.ndim != 4 or arr.shape[1] != plan.heads or arr.shape[2] % PAGE_ROWS:
            raise EmulationError(
                f"{name} must be [batch, {plan.heads} heads, slots (multiple of {PAGE_ROWS}), head_dim], "
                f"got shape {arr.shape}"
            )
    if k.shape != (q.shape[0], q.shape[1], k.shape[2], q.shape[3]):
        raise EmulationError(f"k must match q's batch, heads and head_dim, got {k.shape} vs q {q.shape}")
    if v.shape[:3] != k.shape[:3]:
        raise EmulationError(f"v must match k's batch, heads and slots, got {v.shape} vs k {k.shape}")
    return q, k, v


def _unwritten_error(name: str, written: np.ndarray, valid: np.ndarray):
    missing = np.argwhere((written == 0) & valid[None, :])
    if missing.size:
        h, s = missing[0]
        raise EmulationError(
            f"plan never writes {name} row (head {h}, slot {s}) ({len(missing)} valid rows unwritten)"
        )


def emulate_forward(plan: TilePlan, q, k, v, scale=None):
    """Run an owner ``"q"`` plan (BSA or KPage) like the forward kernel, in float64.

    Args:
        plan: a TilePlan with ``owner == "q"``.
        q: ``[batch, heads, sq, d]``; k, v: ``[batch, heads, sk, d]`` (v: ``[..., dv]``).

    Returns:
        ``(o, lse)`` float64 ``[batch, heads, sq, dv]``, ``[batch, heads, sq]``; padded rows 0 / -inf.

    Raises:
        EmulationError: bad plan indices, a valid Q row stored twice (a race) or never stored.
    """
    q, k, v = _check_tensors(q, k, v, plan)
    if plan.owner != "q":
        raise EmulationError(f"emulate_forward needs an owner='q' plan, got plan.owner={plan.owner!r}")
    validate_plan(plan, q.shape[2] // PAGE_ROWS, k.shape[2] // PAGE_ROWS)
    scale = _check_scale(scale, q.shape[-1])
    b, heads, sq, _ = q.shape
    q_valid = _page_rows_valid(plan.own_page_mask, np.arange(plan.own_page_mask.size))
    o = np.full((b, heads, sq, v.shape[-1]), np.nan)
    lse = np.full((b, heads, sq), np.nan)
    written = np.zeros((heads, sq), dtype=np.int64)
    for h, m, _n, own, tiles in _work_items(plan):
        row_ok = _page_rows_valid(plan.own_page_mask, own)
        q_tile = _gather(q[:, h], own, row_ok)
        state = _softmax_init(b, m, v.shape[-1])
        for pages in tiles:
            col_ok = _page_rows_valid(plan.stream_page_mask, pages)
            k_tile = _gather(k[:, h], pages, col_ok)
            s = scale * np.matmul(q_tile, k_tile.transpose(0, 2, 1))
            s[:, :, ~col_ok] = -np.inf
            state = _softmax_step(state, s, _gather(v[:, h], pages, col_ok))
        o_tile, lse_tile = _softmax_finish(state)
        slots = _page_slots(own)[row_ok]
        if np.any(written[h, slots]):
            raise EmulationError(
                f"plan writes Q row (head {h}, slot {slots[written[h, slots] > 0][0]}) twice"
            )
        written[h, slots] += 1
        o[:, h, slots] = o_tile[:, row_ok]
        lse[:, h, slots] = lse_tile[:, row_ok]
    _unwritten_error("O", written, q_valid)
    o[:, :, ~q_valid] = 0.0
    lse[:, :, ~q_valid] = -np.inf
    return o, lse


def _backward_item(tensors, h, own, col_ok, steps, dq, scale):
    """One K/V-owned work item of head ``h``: its owned K/V rows (``own`` pages, ``col_ok`` valid) against
    each streamed Q step ``(pages, row_ok, seen)``; ``seen`` is None or bool ``[streamed rows, owned
    rows]`` (pair items: which owned half sees each streamed row). dQ is added into ``dq``, ``(dK, dV)``
    of the owned rows returned. ``tensors``: float64 ``(q, k, v, do, lse, delta)`` of all heads."""
    q, k, v, do, lse, delta = tensors
    k_tile, v_tile = _gather(k[:, h], own, col_ok), _gather(v[:, h], own, col_ok)
    dk_acc = np.zeros((q.shape[0], col_ok.size, q.shape[-1]))
    dv_acc = np.zeros((q.shape[0], col_ok.size, v.shape[-1]))
    for pages, row_ok, seen in steps:
        slots = _page_slots(pages)
        q_tile = _gather(q[:, h], pages, row_ok)
        do_tile = np.where(row_ok[None, :, None], do[:, h, slots], 0.0)
        lse_tile = np.where(row_ok[None, :], lse[:, h, slots], -np.inf)  # invalid rows contribute nothing
        live = np.isfinite(lse_tile)
        p = np.exp(
            scale * np.matmul(q_tile, k_tile.transpose(0, 2, 1)) - np.where(live, lse_tile, 0.0)[..., None]
        )
        p = np.where(live[..., None] & col_ok[None, None, :], p, 0.0)
        if seen is not None:
            p = np.where(seen[None], p, 0.0)
        delta_tile = np.where(row_ok, delta[:, h, slots], 0.0)
        ds = p * (np.matmul(do_tile, v_tile.transpose(0, 2, 1)) - delta_tile[..., None])
        dv_acc += np.matmul(p.transpose(0, 2, 1), do_tile)
        dk_acc += scale * np.matmul(ds.transpose(0, 2, 1), q_tile)
        np.add.at(dq, (slice(None), h, slots[row_ok]), scale * np.matmul(ds, k_tile)[:, row_ok])
    return dk_acc, dv_acc


def _store_owned(outs, accs, written, h, own, col_ok, what):
    """Store an item's dK/dV on its valid owned rows, once each."""
    own_slots = _page_slots(own)[col_ok]
    if np.any(written[h, own_slots]):
        bad = own_slots[written[h, own_slots] > 0][0]
        raise EmulationError(f"{what} writes K/V row (head {h}, slot {bad}) twice")
    written[h, own_slots] += 1
    for out, acc in zip(outs, accs):
        out[:, h, own_slots] = acc[:, col_ok]


def emulate_backward(plan_kv: TilePlan, q, k, v, o, lse, do, scale=None):
    """Run an owner ``"kv"`` plan like the K/V-owned backward kernel, in float64.

    Args:
        plan_kv: a TilePlan with ``owner == "kv"`` (own pages are K/V pages, streamed pages Q pages).
        q, k, v: as in :func:`emulate_forward`; o, do: ``[batch, heads, sq, dv]``; lse: ``[batch, heads, sq]``.

    Returns:
        ``(dq, dk, dv)`` float64 with q/k/v's shapes; invalid slots hold 0. dQ is accumulated across
        work items (atomics in a kernel); dK/dV rows are stored once by their owning work item.
    """
    q, k, v = _check_tensors(q, k, v, plan_kv)
    if plan_kv.owner != "kv":
        raise EmulationError(
            f"emulate_backward needs an owner='kv' plan, got plan_kv.owner={plan_kv.owner!r}"
        )
    validate_plan(plan_kv, k.shape[2] // PAGE_ROWS, q.shape[2] // PAGE_ROWS)
    scale = _check_scale(scale, q.shape[-1])
    b, heads, sq, d = q.shape
    o = _check_like("o", o, (b, heads, sq, v.shape[-1]))
    lse = _check_like("lse", lse, (b, heads, sq))
    do = _check_like("do", do, (b, heads, sq, v.shape[-1]))
    q_valid = _page_rows_valid(plan_kv.stream_page_mask, np.arange(plan_kv.stream_page_mask.size))
    k_valid = _page_rows_valid(plan_kv.own_page_mask, np.arange(plan_kv.own_page_mask.size))
    o64 = np.where(q_valid[None, None, :, None], o, 0.0).astype(np.float64)
    do64 = np.where(q_valid[None, None, :, None], do, 0.0).astype(np.float64)
    delta = (o64 * do64).sum(axis=-1)  # D = rowsum(dO · O), a separate pre-pass in a kernel
    lse64 = lse.astype(np.float64)
    dq = np.zeros((b, heads, sq, d))
    dk = np.zeros((b, heads, k.shape[2], d))
    dv = np.zeros((b, heads, k.shape[2], v.shape[-1]))
    written = np.zeros((heads, k.shape[2]), dtype=np.int64)
    tensors = (q, k, v, do64, lse64, delta)
    vis = plan_kv.device_arrays().get("stream_vis")
    ptr = plan_kv.stream_indptr.astype(np.int64)
    for w, (h, m, n, own, tiles) in enumerate(_work_items(plan_kv)):
        col_ok = _page_rows_valid(plan_kv.own_page_mask, own)
        seen = (None,) * len(tiles)
        if vis is not None:  # entry bit b: seen by owned rows 64·b .. 64·b + 63 (pair items)
            item_vis = np.zeros(tiles.size, dtype=np.int64)
            item_vis[: ptr[w + 1] - ptr[w]] = vis[ptr[w] : ptr[w + 1]]
            half = np.arange(m) // 64
            rows_vis = np.repeat(item_vis, PAGE_ROWS).reshape(len(tiles), n)
            seen = [((tile_vis[:, None] >> half[None, :]) & 1).astype(bool) for tile_vis in rows_vis]
        steps = (
            (pages, _page_rows_valid(plan_kv.stream_page_mask, pages), s) for pages, s in zip(tiles, seen)
        )
        dk_acc, dv_acc = _backward_item(tensors, h, own, col_ok, steps, dq, scale)
        _store_owned((dk, dv), (dk_acc, dv_acc), written, h, own, col_ok, "plan")
    _unwritten_error("dK/dV", written, k_valid)
    return dq, dk, dv


# --- coverage ---------------------------------------------------------------------------------


def _valid_slot_csr(page_lists_ptr: np.ndarray, page_lists: np.ndarray, mask: np.ndarray):
    """Per segment of a page-list CSR, the valid slots of its pages: ``(indptr, slots)``."""
    rows = _page_rows_valid(mask, page_lists)
    slots = _page_slots(page_lists)[rows]
    seg_of_slot = np.repeat(np.repeat(np.arange(page_lists_ptr.size - 1), np.diff(page_lists_ptr)), PAGE_ROWS)
    counts = np.bincount(seg_of_slot[rows], minlength=page_lists_ptr.size - 1)
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), slots


def _cross_product(ptr_a, vals_a, ptr_b, vals_b):
    """For every segment s, all pairs of ``vals_a[seg s] × vals_b[seg s]``: ``(seg, a, b)`` arrays."""
    na, nb = np.diff(ptr_a), np.diff(ptr_b)
    per_seg = na * nb
    seg = np.repeat(np.arange(na.size), per_seg)
    local = np.arange(int(per_seg.sum()), dtype=np.int64) - np.repeat(np.cumsum(per_seg) - per_seg, per_seg)
    a = vals_a[ptr_a[seg] + local // nb[seg]] if seg.size else vals_a[:0]
    b = vals_b[ptr_b[seg] + local % nb[seg]] if seg.size else vals_b[:0]
    return seg, a, b


def covered_pairs(plan: TilePlan):
    """Every (head, q slot, k slot) pair the plan computes between a valid Q row and a valid K row.

    Returns three int64 arrays of equal length, one entry per computed pair (duplicates kept, so a
    plan that computes a pair twice shows it twice). Small plans only: the output has one entry
    per useful pair.
    """
    validate_plan(plan)
    own = plan.own_pages.astype(np.int64)
    own_ptr = np.arange(plan.num_work + 1, dtype=np.int64) * own.shape[1]
    own_ptr_v, own_slots = _valid_slot_csr(own_ptr, own.ravel(), plan.own_page_mask)
    st_ptr_v, st_slots = _valid_slot_csr(
        plan.stream_indptr.astype(np.int64), plan.stream_pages.astype(np.int64), plan.stream_page_mask
    )
    work, own_s, stream_s = _cross_product(own_ptr_v, own_slots, st_ptr_v, st_slots)
    head = plan.work_head.astype(np.int64)[work]
    return (head, own_s, stream_s) if plan.owner == "q" else (head, stream_s, own_s)


def graph_slot_pairs(graph: SparseGraph):
    """Every (head, q slot, k slot) pair the graph asks for (valid rows of selected block pairs)."""
    h, i, j = graph.pairs
    q_ptr = np.concatenate([[0], np.cumsum(graph.q.valid_rows)])
    k_ptr = np.concatenate([[0], np.cumsum(graph.k.valid_rows)])
    qs, q_len = gather_segments(q_ptr, np.flatnonzero(graph.q.valid), i)
    ks, k_len = gather_segments(k_ptr, np.flatnonzero(graph.k.valid), j)
    pair, a, b = _cross_product(
        np.concatenate([[0], np.cumsum(q_len)]), qs, np.concatenate([[0], np.cumsum(k_len)]), ks
    )
    return h[pair], a, b


def coverage_report(plan: TilePlan, graph: SparseGraph) -> dict:
    """Compare :func:`covered_pairs` with :func:`graph_slot_pairs`.

    Returns a dict of counts: ``computed`` (pairs the plan computes, with repeats), ``useful``
    (pairs the graph asks for), ``duplicated`` (pairs computed more than once), ``missing``
    (useful pairs never computed) and ``outside`` (computed pairs not in the graph). A correct plan
    has ``computed == useful`` and zeros elsewhere.
    """
    if plan.heads != graph.heads:
        raise EmulationError(f"plan has {plan.heads} heads, graph has {graph.heads}")
    sq, sk = graph.q.num_slots, graph.k.num_slots
    q_mask, k_mask = plan.q_page_mask, plan.k_page_mask
    if q_mask.size * PAGE_ROWS != sq or k_mask.size * PAGE_ROWS != sk:
        raise EmulationError("plan page masks do not match the graph's layouts")

    def keys(h, qs, ks):
        return (h * sq + qs) * sk + ks

    computed, counts = np.unique(keys(*covered_pairs(plan)), return_counts=True)
    useful = np.unique(keys(*graph_slot_pairs(graph)))
    return {
        "computed": int(counts.sum()),
        "useful": int(useful.size),
        "duplicated": int((counts > 1).sum()),
        "missing": int(np.setdiff1d(useful, computed, assume_unique=True).size),
        "outside": int(np.setdiff1d(computed, useful, assume_unique=True).size),
    }


def emulate_work_list(work, q, k, v, scale=None):
    """Run a paged-forward :class:`~sparseattn.planning.work_list.WorkList` as the kernel does, in float64.

    Reads only the work list's arrays: (page, row mask) of each owned Q page and of each streamed K/V
    page, items in ``work_order``, keys in chunks of ``work.chunk``. A 128-row item processes every
    chunk with both row halves; a 64-row item splits the chunks between two running softmax states
    (even / odd chunks) and merges them, as the kernel's two warpgroups do. Visibility bits (pair items,
    :mod:`sparseattn.planning.pair_forward`) hide an entry's keys from the owned page slots without its bit.

    Args:
        work: the WorkList; q ``[batch, heads, sq, d]``; k, v ``[batch, heads, sk, d]``.

    Returns:
        ``(o, lse)`` float64; rows no item owns stay NaN (so tests see what the kernel would not write).

    Raises:
        EmulationError: a row written twice.
    """
    q, k, v = (_as_float_array(n, x) for n, x in (("q", q), ("k", k), ("v", v)))
    scale = _check_scale(scale, q.shape[-1])
    b, heads, sq, _ = q.shape
    o = np.full((b, heads, sq, v.shape[-1]), np.nan)
    lse = np.full((b, heads, sq), np.nan)
    written = np.zeros((heads, sq), dtype=np.int64)
    per_chunk = work.chunk // PAGE_ROWS
    bits = _BITS.astype(np.uint32)

    def rows_ok(pages, masks):  # row validity of (page, row mask) entries; -1 pages are empty
        valid = ((masks.astype(np.uint32)[:, None] & bits) != 0) & (pages >= 0)[:, None]
        return valid.ravel()

    for w in work.work_order:
        head, begin, length, m = (int(x) for x in work.work_info[w])
        own = work.own_pages[w, : m // PAGE_ROWS].astype(np.int64)
        q_ok = rows_ok(own, work.own_mask[w, : m // PAGE_ROWS])
        pages = work.stream_pages[begin : begin + length].astype(np.int64)
        masks = work.stream_mask[begin : begin + length]
        n_chunks = -(-length // per_chunk)
        qt = _gather(q[:, head], own, q_ok)
        # visibility (pair items): per owned page slot and streamed key row, whether the slot's rows see it
        seen = np.repeat(work.stream_visibility(begin, length), PAGE_ROWS, axis=1)
        states = []
        for part in (range(n_chunks),) if m > 64 else (range(0, n_chunks, 2), range(1, n_chunks, 2)):
            state = _softmax_init(b, m, v.shape[-1])
            for c in part:
                chunk = slice(c * per_chunk, (c + 1) * per_chunk)
                k_ok = rows_ok(pages[chunk], masks[chunk])
                s = scale * np.matmul(qt, _gather(k[:, head], pages[chunk], k_ok).transpose(0, 2, 1))
                s[:, :, ~k_ok] = -np.inf
                keys_seen = seen[:, c * per_chunk * PAGE_ROWS : (c + 1) * per_chunk * PAGE_ROWS]
                for slot in range(m // PAGE_ROWS):
                    s[:, slot * PAGE_ROWS : (slot + 1) * PAGE_ROWS, ~keys_seen[slot]] = -np.inf
                state = _softmax_step(state, s, _gather(v[:, head], pages[chunk], k_ok))
            states.append(state)
        run_max = np.maximum.reduce([st[0] for st in states])
        base = np.where(np.isfinite(run_max), run_max, 0.0)
        weights = [np.exp(st[0] - base) for st in states]
        merged = (
            run_max,
            sum(wt * st[1] for wt, st in zip(weights, states)),
            sum(wt[..., None] * st[2] for wt, st in zip(weights, states)),
        )
        o_tile, lse_tile = _softmax_finish(merged)
        q_slots = _page_slots(own)
        slots = q_slots[q_ok]
        if np.any(written[head, slots]):
            raise EmulationError(
                f"work list writes Q row (head {head}, slot {slots[written[head, slots] > 0][0]}) twice"
            )
        written[head, slots] += 1
        o[:, head, slots] = o_tile[:, q_ok]
        lse[:, head, slots] = lse_tile[:, q_ok]
    return o, lse


def emulate_backward_work_list(work, q, k, v, o, lse, do, scale=None):
    """Run a K/V-owned backward :class:`~sparseattn.planning.work_list.WorkList`
    (:func:`~sparseattn.planning.work_list.backward_work_list`) as a kernel reading only its arrays would,
    in float64: each item owns the (page, row mask) entries of its K/V pages and streams the (page, row
    mask) entries of its Q pages ``work.chunk`` rows at a time.

    Args:
        work: the WorkList; q, o, do ``[batch, heads, sq, d]``; k, v ``[batch, heads, sk, d]``;
            lse ``[batch, heads, sq]`` (natural log).

    Returns:
        ``(dq, dk, dv)`` float64. dQ is summed over items (0 where nothing contributes); dK/dV rows no
        item owns stay NaN, so tests see what a kernel would not write.

    Raises:
        EmulationError: a K/V row written twice.
    """
    q, k, v, o, do = (_as_float_array(n, x) for n, x in (("q", q), ("k", k), ("v", v), ("o", o), ("do", do)))
    lse = _as_float_array("lse", lse)
    scale = _check_scale(scale, q.shape[-1])
    b, heads, sq, d = q.shape
    dq = np.zeros((b, heads, sq, d))
    dk = np.full((b, heads, k.shape[2], d), np.nan)
    dv = np.full((b, heads, k.shape[2], v.shape[-1]), np.nan)
    written = np.zeros((heads, k.shape[2]), dtype=np.int64)
    bits = _BITS.astype(np.uint32)
    per_step = work.chunk // PAGE_ROWS

    def rows_ok(pages, masks):  # row validity of (page, row mask) entries; -1 pages are empty
        return (((masks.astype(np.uint32)[:, None] & bits) != 0) & (pages >= 0)[:, None]).ravel()

    delta = (o * do).sum(axis=-1)  # per row; a step uses it only on valid rows
    tensors = (q, k, v, do, lse, delta)
    for w in work.work_order:
        head, begin, length, m = (int(x) for x in work.work_info[w])
        own = work.own_pages[w, : m // PAGE_ROWS].astype(np.int64)
        col_ok = rows_ok(own, work.own_mask[w, : m // PAGE_ROWS])
        steps = (
            (pages, rows_ok(pages, work.stream_mask[start : start + pages.size]), None)
            for start in range(begin, begin + length, per_step)
            for pages in [work.stream_pages[start : min(start + per_step, begin + length)].astype(np.int64)]
        )
        dk_acc, dv_acc = _backward_item(tensors, head, own, col_ok, steps, dq, scale)
        _store_owned((dk, dv), (dk_acc, dv_acc), written, head, own, col_ok, "work list")
    return dq, dk, dv


# ---- the token-order builds (PAGED_FWD_TOKENS): rows read and written by token ---------------------------


def token_rows(x, slot_token) -> np.ndarray:
    """float64 ``[R, slots, d]``: the slot rows a token-order kernel reads from token-ordered ``x`` ``[batch,
    tokens, heads, d]``. Row ``r`` is (batch ``r // heads``, head ``r % heads``); ``slot_token``: int ``[slots]``
    (one layout for every row) or ``[R, slots]``, the token each slot holds; a slot whose token is -1 or out
    of range reads as zeros, as the kernels zero-fill it."""
    x = np.asarray(x, dtype=np.float64)
    b, n, h, d = x.shape
    rows = b * h
    maps = np.broadcast_to(np.asarray(slot_token, dtype=np.int64), (rows, np.shape(slot_token)[-1]))
    ok = (maps >= 0) & (maps < n)
    r = np.broadcast_to(np.arange(rows)[:, None], maps.shape)
    out = np.zeros((rows, maps.shape[1], d))
    out[ok] = x[r[ok] // h, maps[ok], r[ok] % h]
    return out


def rows_to_tokens(rows, slot_token, shape: tuple) -> np.ndarray:
    """:func:`token_rows`' inverse for an output: ``rows`` ``[R, slots, d]`` stored to the tokens their slots
    hold, in ``[batch, tokens, heads, d]`` (``shape``); tokens no row is stored to stay NaN, NaN rows (not
    written by a work list) are not stored, and a token stored twice raises :class:`EmulationError`."""
    _, n, h, d = shape
    maps = np.broadcast_to(np.asarray(slot_token, dtype=np.int64), rows.shape[:2])
    written = ~np.isnan(rows).all(axis=-1)
    ok = (maps >= 0) & (maps < n) & written
    r = np.broadcast_to(np.arange(rows.shape[0])[:, None], maps.shape)
    out = np.full(shape, np.nan)
    flat = (r[ok] // h * n + maps[ok]) * h + r[ok] % h
    if np.unique(flat).size != flat.size:
        raise EmulationError("two slots store to the same token")
    out.reshape(-1, d)[flat] = rows[ok]
    return out


def emulate_token_work_list(work, q, k, v, q_map, k_map, scale=None, folded: bool = False):
    """:func:`emulate_work_list` of the forward's token-order build: ``q`` ``[batch, q_tokens, heads, d]``,
    ``k``, ``v`` ``[batch, k_tokens, heads, d]`` in token order, read through the slot -> token maps ``q_map`` /
    ``k_map`` (``[slots]`` or ``[batch · heads, slots]``, see :func:`token_rows`). ``folded``: the list's heads
    are the batch · heads rows (device plans, per-row layouts) rather than the heads of each batch entry.
    Returns ``(o [batch, q_tokens, heads, d], lse [batch, heads, q_slots])`` float64 (o NaN where no item
    writes, lse NaN likewise)."""
    b, _, h, d = np.shape(q)
    qs, ks, vs = (token_rows(x, m) for x, m in ((q, q_map), (k, k_map), (v, k_map)))
    shape = (
        (lambda x: x.reshape(1, b * h, *x.shape[1:])) if folded else (lambda x: x.reshape(b, h, *x.shape[1:]))
    )
    o, lse = emulate_work_list(work, shape(qs), shape(ks), shape(vs), scale)
    o_tok = rows_to_tokens(o.reshape(b * h, -1, d), q_map, (b, np.shape(q)[1], h, d))
    return o_tok, lse.reshape(b, h, -1)
