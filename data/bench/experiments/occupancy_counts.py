"""CPU counts behind the notes of 3912864 (NOTES_kpage_fwd.md v9 and VSA; NOTES_kpage_bwd.md svg2).

    PYTHONPATH=src python data/bench/experiments/occupancy_counts.py masked svg2_wan14b_720p 4
    PYTHONPATH=src python data/bench/experiments/occupancy_counts.py forward vsa_wan14b_480p 8
    PYTHONPATH=src python data/bench/experiments/occupancy_counts.py backward svg2_wan14b_720p 4
    PYTHONPATH=src python data/bench/experiments/occupancy_counts.py backward-split svg2_wan14b_720p 2
    PYTHONPATH=src python data/bench/experiments/occupancy_counts.py q-padding svg2_wan14b_720p 8
    PYTHONPATH=src python data/bench/experiments/occupancy_counts.py q-pages svg2_wan14b_720p 4
    PYTHONPATH=src python data/bench/experiments/occupancy_counts.py packed svg2_wan14b_720p 4

* ``masked``: the share of the forward work list's 128-key chunks holding a partial page (the chunks
  the softmax masks), as built and with every item's full pages first.
* ``forward``: useful / executed pairs of the forward work list, owned-row and streamed-key occupancy.
* ``backward``: executed / useful pairs of the K/V-owned backward, the owned tiles' occupancy, and a
  greedy count of K/V-owned tiles packed at page granularity across blocks (not built).
* ``backward-split``: every K/V block as 64-row halves, the remainders packed (not built).
* ``q-padding``: the forward's executed pairs in partial Q blocks and in their padding rows (each Q block's
  tile rows, 64 where at most 64 rows are valid else 128, times the live keys it streams; NOTES_kpage_fwd.md,
  "What limits the forward against FlashInfer's FA3 path").
* ``q-pages``: the same by the Q blocks' live pages (1-8): blocks, share of the executed pairs, and of them
  the padding pages' share and the padding inside live pages (NOTES_kpage_fwd.md, "The packed route").
* ``packed``: the packed route's work list (``route="packed"``) against the per-block one: executed pairs,
  streamed pages, items.
"""

import sys

import numpy as np

from sparseattn.graph import HeadStack
from sparseattn.kernels.backward import backward_executed_pairs, backward_route
from sparseattn.kernels.forward import work_of
from sparseattn.planning.cache import plan_of
from sparseattn.workloads import get_workload

POPCOUNT = np.unpackbits(np.arange(1 << 16, dtype=">u2").view(np.uint8)).reshape(-1, 16).sum(1)


def graphs_of(name: str, heads: int) -> list:
    built = get_workload(name).build(heads=heads)
    return built if isinstance(built, list) else [built.select_heads([h]) for h in range(built.heads)]


def useful_pairs(g) -> int:
    return int((g.q.valid_rows[g.row_of_nnz % g.q.num_blocks] * g.k.valid_rows[g.indices]).sum())


def entries(wl):
    """(item of each entry, stream index of each entry, position within the item)."""
    info = wl.work_info.astype(np.int64)
    lengths = info[:, 2]
    item = np.repeat(np.arange(len(info)), lengths)
    offsets = np.cumsum(lengths) - lengths
    position = np.arange(lengths.sum()) - offsets[item]
    return item, info[item, 1] + position, position


def masked(gs: list) -> None:
    wl = work_of(HeadStack.of(gs) if len(gs) > 1 else gs[0], "kpage", "auto")
    per_chunk = wl.chunk // 16
    info = wl.work_info.astype(np.int64)
    chunks = -(-info[:, 2] // per_chunk)
    item, index, position = entries(wl)
    partial = (wl.stream_mask[index] & 0xFFFF) != 0xFFFF
    chunk = (np.cumsum(chunks) - chunks)[item] + position // per_chunk
    held = np.bincount(chunk, minlength=chunks.sum()) < per_chunk

    def share(partial_in_order):
        hit = np.bincount(chunk, weights=partial_in_order, minlength=chunks.sum()) > 0
        return (hit | held).mean()

    # block order: live page ids grow with the block, so an item's pages sorted by id (the order before
    # plans.full_pages_first)
    block_order = np.lexsort((wl.stream_pages[index], item))
    print(
        f"chunks {chunks.sum()} holding a partial page: in block order {share(partial[block_order]):.3f}, "
        f"as built {share(partial):.3f}"
    )


def forward(gs: list) -> None:
    wl = work_of(HeadStack.of(gs) if len(gs) > 1 else gs[0], "kpage", "auto")
    info = wl.work_info.astype(np.int64)
    chunks = -(-info[:, 2] // (wl.chunk // 16))
    valid_q = POPCOUNT[wl.own_mask & 0xFFFF].sum(1)
    item, index, _ = entries(wl)
    keys = np.bincount(item, weights=POPCOUNT[wl.stream_mask[index] & 0xFFFF], minlength=len(info))
    useful = sum(useful_pairs(g) for g in gs)
    print(f"useful / executed {useful / wl.executed_pairs():.3f}")
    print(
        f"owned rows valid (weighted by chunks) {(valid_q * chunks).sum() / (info[:, 3] * chunks).sum():.3f}"
    )
    print(f"streamed keys valid {keys.sum() / (chunks * wl.chunk).sum():.3f}")
    rows, counts = np.unique(gs[0].q.valid_rows, return_counts=True)
    print("Q blocks by valid rows (head 0):", dict(zip(rows.tolist(), counts.tolist())))


def backward(gs: list) -> None:
    useful = executed = packed = 0
    own_rows = own_capacity = 0
    for g in gs:
        useful += useful_pairs(g)
        executed += backward_executed_pairs(g, 128)
        plan = plan_of(g, "kpage", backward_route(g), owner="kv")
        pages = plan.own_pages
        live = np.where(pages >= 0, POPCOUNT[plan.own_page_mask[np.maximum(pages, 0)]], 0).sum(1)
        own_rows += int((live * plan.stream_lengths()).sum())
        own_capacity += int((plan.tile_shapes()[:, 0] * plan.stream_lengths()).sum())
        packed += greedy_packing(g)
    print(
        f"backward executed / useful {executed / useful:.3f}; owned tiles {own_rows / own_capacity:.3f} full"
    )
    print(
        f"K/V tiles packed across blocks (greedy): {packed / useful:.3f} x useful ({packed / executed:.3f})"
    )
    print(
        "K blocks of head 0 by live pages (1..8):", np.bincount(gs[0].k.live_pages, minlength=9)[1:].tolist()
    )


def greedy_packing(g) -> int:
    """Executed pairs if K/V-owned tiles took 8 live pages from several blocks (128 rows on every step
    of the union of their Q streams): largest blocks first, each filled with the unpacked blocks adding
    the fewest new Q pages, none adding more than its own stream."""
    t = g.transpose()
    blocks, pages = g.k.num_blocks, g.k.live_pages
    q_pages = g.q.live_pages.astype(np.int64)
    selects = np.zeros((blocks, g.q.num_blocks), bool)
    selects[t.row_of_nnz % blocks, t.indices] = True
    packed = np.zeros(blocks, bool)
    total = 0
    for b in np.argsort(-pages, kind="stable"):
        if packed[b] or pages[b] == 0:
            continue
        packed[b] = True
        room, union = 8 - pages[b], selects[b].copy()
        while room > 0:
            cand = np.flatnonzero(~packed & (pages > 0) & (pages <= room))
            if cand.size == 0:
                break
            add = ((selects[cand] & ~union) * q_pages).sum(1)
            own = (selects[cand] * q_pages).sum(1)
            j = int(np.argmin(add - 0.5 * own))
            if add[j] > own[j]:
                break
            packed[cand[j]] = True
            room -= pages[cand[j]]
            union |= selects[cand[j]]
        total += 128 * 64 * -(-int(q_pages[union].sum()) // 4)
    return total


def _steps(q_pages: np.ndarray, q_blocks: np.ndarray) -> int:
    """64-row steps of a stream of the live pages of ``q_blocks``."""
    return -(-int(q_pages[q_blocks].sum()) // 4)


def backward_split(gs: list, window: int = 32) -> None:
    """Executed pairs if every K/V block ran as 64-row halves (its full 4-page halves alone, its remainder
    of 1-3 pages packed with other blocks' remainders, greedily in block order within ``window``, while
    a remainder adds no more Q pages than it shares): Σ over halves of 64 × the 64-row steps of the union
    of their blocks' Q streams. Needs per-slot visibility in the backward's pair kernel (not built)."""
    useful = executed = split = 0
    for g in gs:
        useful += useful_pairs(g)
        executed += backward_executed_pairs(g, 128)
        t = g.transpose()  # rows: K/V blocks
        blocks, q_pages, k_pages = t.q.num_blocks, t.k.live_pages.astype(np.int64), t.q.live_pages
        for h in range(t.heads):
            selects = [
                t.indices[t.indptr[h * blocks + b] : t.indptr[h * blocks + b + 1]] for b in range(blocks)
            ]
            rest = [(b, int(k_pages[b]) % 4) for b in range(blocks) if k_pages[b] % 4]
            split += sum(
                64 * 64 * (int(k_pages[b]) // 4) * _steps(q_pages, selects[b]) for b in range(blocks)
            )
            free = [True] * len(rest)
            for i, (b, pages) in enumerate(rest):
                if not free[i]:
                    continue
                free[i], room, union = False, 4 - pages, set(selects[b].tolist())
                while room > 0:
                    best, score = None, None
                    for j in range(i + 1, min(len(rest), i + 1 + window)):
                        if not free[j] or rest[j][1] > room:
                            continue
                        other = set(selects[rest[j][0]].tolist())
                        shared, added = q_pages[list(other & union)].sum(), q_pages[list(other - union)].sum()
                        if added <= shared and (score is None or shared - added > score):
                            best, score = j, shared - added
                    if best is None:
                        break
                    free[best], room = False, room - rest[best][1]
                    union |= set(selects[rest[best][0]].tolist())
                split += 64 * 64 * _steps(q_pages, np.array(sorted(union), dtype=np.int64))
    print(
        f"backward executed / useful {executed / useful:.3f}; 64-row halves, remainders packed {split / useful:.3f}"
    )


def q_padding(gs: list) -> None:
    executed = in_partial = padding = 0
    for g in gs:
        valid = g.q.valid_rows.astype(np.int64)
        tile = np.where(valid <= 64, 64, 128)
        keys = np.zeros(g.q.num_blocks, np.int64)
        np.add.at(keys, g.row_of_nnz % g.q.num_blocks, g.k.live_pages[g.indices] * 16)
        pairs = tile * keys
        executed += pairs.sum()
        in_partial += pairs[valid < g.q.block_size].sum()
        padding += ((tile - valid) * keys).sum()
    print(
        f"executed pairs in partial Q blocks {in_partial / executed:.3f}, in their padding rows {padding / executed:.3f}"
    )


def q_pages(gs: list) -> None:
    per = np.zeros(
        (9, 4)
    )  # by live pages: blocks, executed pairs, in padding pages, in padding rows of live pages
    total = 0
    for g in gs:
        valid, live = g.q.valid_rows.astype(np.int64), g.q.live_pages.astype(np.int64)
        keys = np.zeros(g.q.num_blocks, np.int64)
        np.add.at(keys, g.row_of_nnz % g.q.num_blocks, g.k.live_pages[g.indices] * 16)
        tile = np.where(live <= 4, 64, 128)
        total += (tile * keys).sum()
        for n in range(1, 9):
            m = live == n
            per[n] += [
                m.sum(),
                (tile[m] * keys[m]).sum(),
                ((tile[m] - 16 * n) * keys[m]).sum(),
                ((16 * n - valid[m]) * keys[m]).sum(),
            ]
    print("live pages: blocks, share of executed pairs, in padding pages, in padding rows of live pages")
    for n in range(1, 9):
        print(
            f"{n}: {int(per[n, 0])}  {per[n, 1] / total:.3f}  {per[n, 2] / total:.4f}  "
            f"{per[n, 3] / total:.4f}"
        )


def packed(gs: list) -> None:
    stack = HeadStack.of(gs) if len(gs) > 1 else gs[0]
    base, pack = work_of(stack, "kpage", "auto"), work_of(stack, "kpage", "packed")
    print(
        f"packed / per-block: executed pairs {pack.executed_pairs() / base.executed_pairs():.4f}, "
        f"streamed pages "
        f"{pack.stream_pages.size / base.stream_pages.size:.4f}, items {base.num_work} -> {pack.num_work} "
        f"({int((pack.work_info[:, 3] == 64).sum())} of 64 rows)"
    )


if __name__ == "__main__":
    what, name, heads = sys.argv[1], sys.argv[2], int(sys.argv[3])
    run = {
        "masked": masked,
        "forward": forward,
        "backward": backward,
        "backward-split": backward_split,
        "q-padding": q_padding,
        "q-pages": q_pages,
        "packed": packed,
    }[what]
    run(graphs_of(name, heads))
