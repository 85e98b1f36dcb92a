"""Pair work lists: two 64-row Q blocks in one 128-row item over the ordered union of their K pages.

KPage's 64-row route runs a Q block with at most four live pages as a 64-row item whose two consumer
warpgroups split the key chunks. Every K/V byte it loads then serves 64 query rows, and the route is
bound by K/V traffic. A *pair item* joins two such Q blocks of one head, A and B, into one 128-row item
(:func:`pair_partners`: every head's blocks matched by the K pages both select; the backward's K/V pairs
take neighbours 2i and 2i + 1 first):
- A's pages own rows 0–63 and B's rows 64–127;
- the stream is the union of the K pages the two select, ordered [A only | shared | B only], each part in
  K block order; the forward list then alternates whole chunks of A-only and B-only pages ahead of the
  rest (:func:`interleave_exclusive_chunks`), so the two row halves compute their own chunks side by side;
- bits 16–23 of an entry's row mask say which owned page slots see it (``VIS_HALF0``: rows 0–63,
  ``VIS_HALF1``: rows 64–127).

Partial Q blocks (1–3 live pages: a video's border cubes) are packed first (:func:`packed_groups`): up
to four live pages of blocks that select alike fill one 64-row half, each owned page slot with its own
visibility bit, and two such halves make an item (:func:`group_items`). wgmma's M is 64 per warpgroup,
so an unpacked one-page block costs a 64-row half for 16 rows.

A row half computes only the key chunks that hold pages it sees, and masks the other pages inside its
boundary chunk. So the tensor work stays near the two 64-row items' (waste only in boundary chunks),
while the shared pages are loaded once for 128 rows.

The float64 emulator (:func:`sparseattn.emulator.emulate_work_list`), :meth:`WorkList.executed_pairs`
and the forward kernel's pair instantiation (``paged_fwd_kernel<D, 128, true>``, ``route="pair"``)
follow the visibility bits.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..constants import PAGE_ROWS
from ..graph import HeadStack, SparseGraph
from .layout_pairs import (
    forward_layout_groups,
    forward_matched_pairs,
    greedy_matching,
    neighbour_firsts,
    small_blocks,
)
from .tile_plan import TilePlan, gather_segments, kpage_plan, stable_partition
from .work_list import (
    OWN_PAGES,
    VIS_HALF0,
    VIS_HALF1,
    VIS_SHIFT,
    WorkList,
    chunk_for,
    stack_head_lists,
    work_list,
    work_order,
)

# KernelTypeError (sparseattn.kernels.validate) is imported where raised: `import sparseattn` loads no
# kernel module.


def pair_blocks(graph: SparseGraph, eligible: np.ndarray | None = None) -> np.ndarray:
    """int64 ``[P]``: first row block b of each pair (b, b + 1). Both blocks must be on the 64-row route
    (1–4 live pages), and ``eligible`` (bool ``[blocks]``) if given; b is even."""
    return neighbour_firsts(_pairable(graph.q, eligible))


def _pairable(layout, eligible: np.ndarray | None) -> np.ndarray:
    """bool ``[blocks]``: blocks on the 64-row route (1–4 live pages), and ``eligible`` if given."""
    small = small_blocks(layout)
    return small if eligible is None else small & eligible


def pair_partners(
    rows: SparseGraph, eligible: np.ndarray | None = None, neighbours_first: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """int64 ``(firsts [P], seconds [P])``: the row blocks each pair item joins (``rows``: a graph whose
    rows are the blocks to pair: the graph itself for the forward's Q blocks, its transpose for the
    backward's K/V blocks). With ``neighbours_first``, neighbours (2i, 2i + 1) both on the 64-row route
    first (:func:`pair_blocks`); then the other 64-row blocks with live pages, matched by the streamed
    pages they share (:func:`_sharing_pairs`: SVG2's cluster remainders, the partial blocks at a video's
    edges); the rest two by two in block order. Every 64-row block is in at most one pair; one may be
    left over. ``eligible`` (bool ``[blocks]``): pair only these blocks."""
    small = _pairable(rows.q, eligible)
    firsts = neighbour_firsts(small) if neighbours_first else np.zeros(0, dtype=np.int64)
    small[firsts] = False
    small[firsts + 1] = False
    shared_a, shared_b, rest = _sharing_pairs(rows, np.flatnonzero(small))
    rest = rest[: rest.size - rest.size % 2]
    return (
        np.concatenate([firsts, shared_a, rest[0::2]]),
        np.concatenate([firsts + 1, shared_b, rest[1::2]]),
    )


#: Candidate pairs the greedy matching considers at most (those sharing the most pages).
MAX_PAIR_CANDIDATES = 200_000


def _sharing_pairs(rows: SparseGraph, blocks: np.ndarray):
    """Greedy matching of ``blocks`` (sorted row block ids of ``rows``) by the pages of the column blocks
    both select, summed over heads: the pair sharing most first, each block in one pair at most. Returns
    ``(a, b, left)``: the pairs (a < b, in order of a) and the blocks that share no page with another
    free block.

    A shared page is loaded once for both row halves of the pair item, and its steps keep both consumer
    warpgroups busy. Backward, SVG2's K cluster remainders then stream 0.60–0.64× the Q pages of the
    unpaired blocks, against 0.90–0.96× for pairs in block order (heads 0–2 of svg2_wan14b_720p);
    forward, its Q cluster remainders 0.58–0.65× the K pages."""
    import scipy.sparse as sp

    n = blocks.size
    if n < 2:
        return blocks[:0], blocks[:0], blocks
    row_ids, cols, weights = _selections(rows, blocks)
    shape = (n, rows.heads * rows.k.num_blocks)
    selects = _matrix(row_ids, cols, np.ones(row_ids.size), shape)
    weighted = _matrix(row_ids, cols, weights, shape)
    if isinstance(selects, np.ndarray):
        shared = np.triu(weighted @ selects.T, k=1)
        r, c = np.nonzero(shared)
        v = shared[r, c]
    else:
        shared = sp.triu(weighted @ selects.T, k=1).tocoo()
        r, c, v = shared.row, shared.col, shared.data
    if v.size > MAX_PAIR_CANDIDATES:
        top = np.argpartition(-v, MAX_PAIR_CANDIDATES)[:MAX_PAIR_CANDIDATES]
        r, c, v = r[top], c[top], v[top]
    chosen = greedy_matching(r, c, v, n)
    a, b = r[chosen].astype(np.int64), c[chosen].astype(np.int64)
    used = np.zeros(n, dtype=bool)
    used[a] = used[b] = True
    order = np.argsort(a, kind="stable")
    return blocks[a[order]], blocks[b[order]], blocks[~used]


def _selections(rows: SparseGraph, blocks: np.ndarray):
    """What row blocks ``blocks`` select, every head: ``(row, column, live pages)`` per selection, the row
    being the block's index in ``blocks`` and the column ``head · column blocks + column block`` (so that
    products of these rows add over heads); the value is the selected block's live pages."""
    nb, nc = rows.q.num_blocks, rows.k.num_blocks
    indptr, indices = rows.indptr.astype(np.int64), rows.indices.astype(np.int64)
    row_ids, cols = [], []
    for h in range(rows.heads):
        sel, counts = gather_segments(indptr, indices, h * nb + blocks)
        row_ids.append(np.repeat(np.arange(blocks.size), counts))
        cols.append(h * nc + sel)
    row_ids, cols = np.concatenate(row_ids), np.concatenate(cols)
    return row_ids, cols, rows.k.live_pages.astype(np.float64)[cols % nc]


#: Largest row-by-column matrix the pairing heuristics hold dense (float32 entries); larger ones stay sparse.
DENSE_ENTRIES = 1 << 24


def _matrix(rows: np.ndarray, cols: np.ndarray, values: np.ndarray, shape: tuple[int, int]):
    """The ``shape`` matrix with ``values`` at (``rows``, ``cols``) (each place once): a float32 ndarray
    up to :data:`DENSE_ENTRIES` entries (BLAS products, fast row reads), else a scipy CSR matrix."""
    if shape[0] * shape[1] <= DENSE_ENTRIES:
        dense = np.zeros(shape, dtype=np.float32)
        dense[rows, cols] = values
        return dense
    import scipy.sparse as sp

    return sp.csr_matrix((values, (rows, cols)), shape=shape)


#: How pair items choose their blocks: matched by the K pages they select alike, per head ("shared"), or
#: by the rule of the layout the device planner uses (:func:`~.layout_pairs.forward_layout_pairs`).
PARTNERS = ("shared", "layout")


def pair_work_list(
    graph: SparseGraph,
    order: str | None = None,
    *,
    base_of: Callable[[SparseGraph], TilePlan] | None = None,
    partners: str = "shared",
) -> WorkList:
    """The KPage forward work list of ``graph`` with its 64-row Q blocks joined two by two into 128-row
    pair items (:func:`pair_partners`, matched by shared K pages; see the module docstring); the other
    items are the KPage plan's. Every head pairs and packs its own blocks (heads select differently),
    items head by head.

    Args:
        graph: a :class:`SparseGraph` (one layout for every head; per-head layouts:
            :func:`stacked_pair_work_list`).
        order: as :func:`sparseattn.planning.work_list.work_list`.
        base_of: ``base_of(g)`` returns the KPage plan (owner ``"q"``, route ``"auto"``) of ``g``, one
            head of ``graph``, whose unpaired items the list keeps; default: built by :func:`kpage_plan`
            (:func:`sparseattn.planning.cache.pair_work_of` passes the cached
            :func:`~sparseattn.planning.cache.plan_of` plans).
        partners: one of :data:`PARTNERS`; ``"layout"`` gives the device planner's pair items (the same
            blocks paired in every head).
    """
    if not isinstance(graph, SparseGraph):
        from ..kernels.validate import KernelTypeError

        raise KernelTypeError(f"graph must be a SparseGraph, got {type(graph).__name__}")
    if partners not in PARTNERS:
        from ..kernels.validate import KernelValueError

        raise KernelValueError(f"partners must be one of {PARTNERS}, got {partners!r}")

    def one_head(g: SparseGraph) -> WorkList:
        return _one_head_pair_work_list(g, None if base_of is None else base_of(g), partners)

    if graph.heads == 1:
        return one_head(graph)
    lists = [one_head(graph.select_heads([h])) for h in range(graph.heads)]
    return stack_head_lists(lists, order)


def _one_head_pair_work_list(
    graph: SparseGraph, plan: TilePlan | None = None, partners: str = "shared"
) -> WorkList:
    """:func:`pair_work_list` of a one-head graph; ``plan``: its KPage plan (owner ``"q"``, route
    ``"auto"``) if already built, else built here."""
    plan = kpage_plan(graph, route="auto", owner="q") if plan is None else plan
    base = work_list(plan)
    nb = graph.q.num_blocks
    if partners == "layout":
        firsts, seconds = forward_matched_pairs(graph.q, graph.block_mask()[0])
        halves_a, halves_b = forward_layout_groups(graph.q)
    else:
        live = graph.q.live_pages.astype(np.int64)
        partial = small_blocks(graph.q) & (live < OWN_PAGES // 2)
        groups = packed_groups(graph, np.flatnonzero(partial))
        firsts, seconds = pair_partners(graph, eligible=~partial, neighbours_first=False)
        halves_a, halves_b = groups[0::2], groups[1::2] + [np.zeros(0, np.int64)] * (len(groups) % 2)
    paired = np.zeros((graph.heads, nb), dtype=bool)
    paired[:, firsts] = True
    paired[:, seconds] = True
    for group in (*halves_a, *halves_b):
        paired[:, group] = True
    keep = ~paired[plan.work_head.astype(np.int64), plan.work_block.astype(np.int64)]

    pairs = pair_items(graph, firsts, seconds)
    packed = group_items(graph, halves_a, halves_b)
    info = np.concatenate([pairs[0], packed[0]])
    info[pairs[0].shape[0] :, 1] += pairs[3].size
    own, own_mask, stream, stream_mask = (np.concatenate([a, b]) for a, b in zip(pairs[1:], packed[1:]))
    chunk = chunk_for([plan])
    order = interleave_exclusive_chunks(stream_mask, info[:, 1], info[:, 2], chunk // PAGE_ROWS)
    return with_base_items(
        base, keep, (info, own, own_mask, stream[order], stream_mask[order]), chunk, graph.heads
    )


def with_base_items(base: WorkList, keep: np.ndarray, items: tuple, chunk: int, heads: int) -> WorkList:
    """A work list of new ``items`` (``(info [N, 4], own [N, 8], own_mask [N, 8], stream [S], stream_mask
    [S])``, streams back to back from entry 0) followed by the items of ``base`` where ``keep`` (bool
    ``[base items]``), their streams re-based after the new ones'; items ordered head by head."""
    info, own, own_mask, stream, stream_mask = items
    # the base list's items are its plan's, in the plan's order, streams back to back
    kept = np.flatnonzero(keep)
    base_info = base.work_info.astype(np.int64)
    base_indptr = np.concatenate([base_info[:, 1], [base.stream_pages.size]])
    entries, kept_len = gather_segments(base_indptr, np.arange(base.stream_pages.size), kept)
    b_info = base_info[kept]
    b_info[:, 1] = stream.size + np.concatenate([[0], np.cumsum(kept_len)[:-1]]).astype(np.int64)
    all_info = np.concatenate([info, b_info])
    return WorkList(
        work_info=all_info.astype(np.int32),
        work_order=work_order(all_info, chunk, "head"),
        own_pages=np.concatenate([own, base.own_pages[kept]]).astype(np.int32),
        own_mask=np.concatenate([own_mask, base.own_mask[kept]]).astype(np.uint32),
        stream_pages=np.concatenate([stream, base.stream_pages[entries]]).astype(np.int32),
        stream_mask=np.concatenate([stream_mask, base.stream_mask[entries]]).astype(np.uint32),
        heads=heads,
        chunk=chunk,
    )


def stacked_pair_work_list(
    stack: HeadStack, order: str | None = None, *, base_of: Callable[[SparseGraph], TilePlan] | None = None
) -> WorkList:
    """Pair work lists of per-head layouts (a :class:`HeadStack`) as one list: head h's
    :func:`pair_work_list` with its items' head set to h, streams laid back to back, items ordered as
    :func:`sparseattn.planning.work_list.work_list` orders them. ``base_of`` as :func:`pair_work_list`'s."""
    if not isinstance(stack, HeadStack):
        from ..kernels.validate import KernelTypeError

        raise KernelTypeError(f"stack must be a HeadStack, got {type(stack).__name__}")
    lists = [pair_work_list(g, base_of=base_of) for g in stack.graphs]
    return stack_head_lists(lists, order)


def interleave_exclusive_chunks(stream_mask: np.ndarray, begin: np.ndarray, length: np.ndarray, pages: int):
    """int64 ``[S]``: a permutation of the entries of pair items streamed [A only | shared | B only] that
    alternates whole ``pages``-entry chunks of A-only and B-only entries ahead of the rest:
    ``[a₀, b₀, a₁, b₁, …, A rest | shared | B rest]``, each part in its old order.

    A row half skips the chunks it does not see, so in an A-only run the B half waits for the ring and
    one consumer warpgroup computes alone; alternating the halves' own chunks lets the two warpgroups
    compute them side by side. Items are ``begin`` / ``length`` (entries, back to back from 0); an entry's
    visibility bits are those of ``stream_mask`` (``VIS_HALF0`` / ``VIS_HALF1``)."""
    total = int(stream_mask.size)
    begin = np.asarray(begin, dtype=np.int64)
    indptr = np.concatenate([begin, [total]])
    item = np.repeat(np.arange(length.size), length)
    offset = np.arange(total) - begin[item]  # position within the item
    mask = stream_mask.astype(np.uint32)
    sees_a, sees_b = (mask & VIS_HALF0) != 0, (mask & VIS_HALF1) != 0
    a_only, b_only = sees_a & ~sees_b, sees_b & ~sees_a
    n_a = np.bincount(item, weights=a_only, minlength=length.size).astype(np.int64)
    n_b = np.bincount(item, weights=b_only, minlength=length.size).astype(np.int64)
    runs = np.minimum(n_a, n_b) // pages  # chunk pairs to alternate per item
    # rank among the half's own entries: A-only entries open the item, B-only ones close it
    rank = np.where(a_only, offset, offset - (length - n_b)[item])
    moved = (a_only | b_only) & (rank < runs[item] * pages)
    # the rest keeps its order after the alternated chunks; those go chunk by chunk, A's then B's
    alternated = begin[item] + 2 * pages * (rank // pages) + np.where(b_only, pages, 0) + rank % pages
    position = np.where(moved, alternated, stable_partition(moved, indptr))
    order = np.empty(total, dtype=np.int64)
    order[position] = np.arange(total)
    return order


#: Partial blocks a packed half considers joining, after it in block order.
PACK_WINDOW = 32


def packed_groups(graph: SparseGraph, blocks: np.ndarray) -> list[np.ndarray]:
    """Partial 64-row Q blocks (``blocks``: sorted ids with 1–3 live pages) packed into groups of at most
    four live pages, one 64-row half of a pair item each. A group starts at its first free block and
    takes, among the next :data:`PACK_WINDOW` free blocks that fit, the one whose selected K pages
    (summed over heads) overlap the group's the most net of the pages it adds, while it adds no more than
    it shares: the group streams the union of its blocks' pages, so the blocks should select alike (a
    video's border cubes next to each other do). Groups in order of their first block."""
    if blocks.size == 0:
        return []
    rows, cols, weights = _selections(graph, blocks)
    selects = _matrix(rows, cols, weights, (blocks.size, graph.heads * graph.k.num_blocks))

    def selected(i: int) -> np.ndarray:
        row = selects[i] if isinstance(selects, np.ndarray) else selects[i].toarray().ravel()
        return row > 0

    live = graph.q.live_pages.astype(np.int64)[blocks]
    free = np.ones(blocks.size, dtype=bool)
    groups = []
    for i in range(blocks.size):
        if not free[i]:
            continue
        free[i] = False
        members, room = [i], OWN_PAGES // 2 - live[i]
        union = selected(i)
        while room > 0:
            cand = np.flatnonzero(
                free[i + 1 : i + 1 + PACK_WINDOW] & (live[i + 1 : i + 1 + PACK_WINDOW] <= room)
            )
            if cand.size == 0:
                break
            cand += i + 1
            weights = selects[cand]
            shared = weights @ union
            added = np.asarray(weights.sum(axis=1)).ravel() - shared
            best = int(np.argmax(shared - added))
            if added[best] > shared[best]:
                break
            j = int(cand[best])
            free[j] = False
            members.append(j)
            room -= live[j]
            union |= selected(j)
        groups.append(blocks[np.asarray(members, dtype=np.int64)])
    return groups


def group_items(graph: SparseGraph, halves_a: list, halves_b: list | None = None):
    """Pair items whose halves are groups of Q blocks (:func:`packed_groups`), for every head, in the
    format of :func:`pair_items`. Half A's blocks own slots 0–3 in group order, half B's slots 4–7 (an
    empty group leaves its slots empty); the item streams the union of the K pages any slot's block
    selects, ordered [A only | shared | B only] in K block order, each entry's visibility bit 16 + s set
    for every slot s whose block selects it. Without ``halves_b``: 64-row items, one group each (its two
    consumer warpgroups split the key chunks, :mod:`.packed_forward`)."""
    rows = 64 if halves_b is None else 2 * 64
    if halves_b is None:
        halves_b = [np.zeros(0, np.int64)] * len(halves_a)
    heads, nb, nkb = graph.heads, graph.q.num_blocks, graph.k.num_blocks
    indptr, indices = graph.indptr.astype(np.int64), graph.indices.astype(np.int64)
    k_pages = np.flatnonzero(graph.k.page_live).astype(np.int64)
    k_indptr = np.concatenate([[0], np.cumsum(graph.k.live_pages)]).astype(np.int64)
    q_ppb = graph.q.pages_per_block
    q_live = graph.q.page_live.reshape(nb, q_ppb)
    slots = []  # per item: (owned page ids [8], block of each slot [8])
    for group_a, group_b in zip(halves_a, halves_b):
        own = np.full(OWN_PAGES, -1, dtype=np.int64)
        block = np.full(OWN_PAGES, -1, dtype=np.int64)
        for half, group in enumerate((group_a, group_b)):
            slot = half * OWN_PAGES // 2
            for b in np.asarray(group, dtype=np.int64):
                page_ids = b * q_ppb + np.flatnonzero(q_live[b])
                own[slot : slot + page_ids.size] = page_ids
                block[slot : slot + page_ids.size] = b
                slot += page_ids.size
        slots.append((own, block))
    infos, owns, streams, masks = [], [], [], []
    begin = 0
    for h in range(heads):
        for own, block in slots:
            vis = np.zeros(nkb, dtype=np.int64)
            for s in np.flatnonzero(block >= 0):
                row = h * nb + block[s]
                vis[indices[indptr[row] : indptr[row + 1]]] |= 1 << s
            union = np.flatnonzero(vis)
            sees_a = (vis[union] & (VIS_HALF0 >> VIS_SHIFT)) != 0
            sees_b = (vis[union] & (VIS_HALF1 >> VIS_SHIFT)) != 0
            union = union[np.argsort(np.where(sees_a & sees_b, 1, np.where(sees_a, 0, 2)), kind="stable")]
            stream, lengths = gather_segments(k_indptr, k_pages, union)
            mask = graph.k.page_mask.astype(np.uint32)[stream] | np.repeat(
                vis[union] << VIS_SHIFT, lengths
            ).astype(np.uint32)
            infos.append([h, begin, stream.size, rows])
            owns.append(own)
            streams.append(stream)
            masks.append(mask)
            begin += stream.size
    if not infos:
        return (
            np.zeros((0, 4), np.int64),
            np.zeros((0, OWN_PAGES), np.int64),
            np.zeros((0, OWN_PAGES), np.uint32),
            np.zeros(0, np.int64),
            np.zeros(0, np.uint32),
        )
    own = np.stack(owns)
    own_mask = np.where(own >= 0, graph.q.page_mask.astype(np.uint32)[np.maximum(own, 0)], 0).astype(
        np.uint32
    )
    return np.asarray(infos, dtype=np.int64), own, own_mask, np.concatenate(streams), np.concatenate(masks)


def pair_items(graph: SparseGraph, firsts: np.ndarray, seconds: np.ndarray | None = None):
    """Pair items of every head (vectorized): ``(info [P, 4], own [P, 8], own_mask [P, 8], stream [S],
    stream_mask [S])``, pairs head-major, streams back to back from entry 0. Pair i joins blocks
    ``firsts[i]`` (A) and ``seconds[i]`` (B; default ``firsts + 1``) of every head."""
    heads, nb = graph.heads, graph.q.num_blocks
    seconds = firsts + 1 if seconds is None else seconds
    pair_row = (np.arange(heads)[:, None] * nb + firsts[None, :]).ravel()  # block A's CSR row per pair
    second_row = (np.arange(heads)[:, None] * nb + seconds[None, :]).ravel()
    n_pairs = pair_row.size
    # every (pair, selected K block) as one sorted key per side (CSR rows are sorted), then their union
    # per pair in stream order with a tag: 1 = A selects the block, 2 = B does, 3 = both
    nkb = graph.k.num_blocks
    keys = []
    for rows in (pair_row, second_row):
        kb, counts = gather_segments(graph.indptr.astype(np.int64), graph.indices.astype(np.int64), rows)
        keys.append(np.repeat(np.arange(n_pairs, dtype=np.int64) * nkb, counts) + kb)
    union, tags = _ordered_union(keys[0], keys[1], n_pairs, nkb)
    u_pair, u_block = union // nkb, union % nkb
    # K blocks -> their live pages, in order
    k_live = graph.k.page_live
    k_pages = np.flatnonzero(k_live).astype(np.int64)
    k_indptr = np.concatenate([[0], np.cumsum(graph.k.live_pages)]).astype(np.int64)
    stream, lengths = gather_segments(k_indptr, k_pages, u_block)
    vis = np.repeat(np.where(tags & 1, VIS_HALF0, 0) | np.where(tags & 2, VIS_HALF1, 0), lengths)
    stream_mask = graph.k.page_mask.astype(np.uint32)[stream] | vis.astype(np.uint32)
    per_pair = np.bincount(u_pair, weights=lengths, minlength=n_pairs).astype(np.int64)
    begin = np.cumsum(per_pair) - per_pair  # (no pairs: empty, as every other array)
    info = np.stack([pair_row // nb, begin, per_pair, np.full(n_pairs, 128)], axis=1).astype(np.int64)
    # owned Q pages: A's live pages in slots 0-3, B's in 4-7
    q_ppb = graph.q.pages_per_block
    q_live = graph.q.page_live.reshape(nb, q_ppb)
    own = np.full((n_pairs, OWN_PAGES), -1, dtype=np.int64)
    for half, blocks in enumerate((firsts, seconds)):
        qb = np.tile(blocks, heads)
        live = q_live[qb]  # [P, ppb]
        rank = np.cumsum(live, axis=1) - 1
        pid, col = np.nonzero(live)
        own[pid, half * OWN_PAGES // 2 + rank[pid, col]] = qb[pid] * q_ppb + col
    own_mask = np.where(own >= 0, graph.q.page_mask.astype(np.uint32)[np.maximum(own, 0)], 0).astype(
        np.uint32
    )
    return info, own, own_mask, stream, stream_mask


def _ordered_union(key_a: np.ndarray, key_b: np.ndarray, n_pairs: int, nkb: int):
    """The union of two sorted key arrays (``pair · nkb + block``, each key once per side) ordered pair by
    pair as [A only | shared | B only], block order within each part, and each key's tag (1 A only,
    3 shared, 2 B only). Linear-time placement instead of a sort of the union."""
    pos = np.searchsorted(key_a, key_b)
    shared_b = pos < key_a.size
    shared_b[shared_b] = key_a[pos[shared_b]] == key_b[shared_b]
    shared_a = np.zeros(key_a.size, dtype=bool)
    shared_a[pos[shared_b]] = True
    parts = (key_a[~shared_a], key_a[shared_a], key_b[~shared_b])
    counts = np.stack([np.bincount(p // nkb, minlength=n_pairs) for p in parts])  # [3, pairs]
    first_of_pair = np.cumsum(counts, axis=1) - counts  # each part's index of a pair's first key
    start = np.cumsum(counts.sum(axis=0)) - counts.sum(axis=0)  # a pair's first stream position
    union = np.empty(sum(p.size for p in parts), dtype=np.int64)
    tags = np.empty(union.size, dtype=np.int64)
    before = np.zeros(n_pairs, dtype=np.int64)  # keys of the earlier parts of the pair
    for part, tag, count, first in zip(parts, (1, 3, 2), counts, first_of_pair):
        pair = part // nkb
        dest = start[pair] + before[pair] + np.arange(part.size) - first[pair]
        union[dest] = part
        tags[dest] = tag
        before += count
    return union, tags
