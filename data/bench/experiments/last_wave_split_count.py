"""The persistent grid's last wave split by 64-row halves: how much earlier would the forward end? (CPU)

    PYTHONPATH=src python data/bench/experiments/last_wave_split_count.py [CTAS]

The forward runs one CTA per SM, each taking the next item when it is free. Splitting trailing 128-row items
into two 64-row items (owned pages 0-3 and 4-7, the same stream; the 64-row route's warpgroups split the key
chunks) gives the last wave's idle CTAs work. This simulates the scheduler on item costs (a 128-row item:
its chunks; a 64-row item: KEY_SPLIT_COST times its chunks), finds the best number of trailing items to
split, checks the split list executes the same pairs, and prints the simulated saving per workload
(NOTES_kpage_fwd.md, "What the dense gap to cuDNN is made of").
"""

import heapq
import sys

import numpy as np

from sparseattn.bench import dense_graph
from sparseattn.graph import HeadStack
from sparseattn.kernels.forward import work_of
from sparseattn.planning.work_list import OWN_PAGES, WorkList
from sparseattn.workloads import get_workload

#: Time of a 64-row (key-split) item relative to a 128-row item streaming the same chunks: half the pairs
#: at the key split's lower rate (~435 against ~640 physical TFLOP/s on svg2, H100; NOTES_kpage_fwd.md).
KEY_SPLIT_COST = 0.74
#: The least relative saving of the simulated call for which a list is split.
MIN_SAVING = 0.005


def _finish(starts: list[float], costs: np.ndarray) -> float:
    """The simulated call's end: CTAs free at ``starts`` (a heap) take ``costs`` in order."""
    free = list(starts)
    for c in costs:
        heapq.heapreplace(free, free[0] + float(c))
    return max(free)


def split_last_wave(wl: WorkList, ctas: int) -> WorkList:
    """``wl`` with its trailing 128-row items (in ``work_order``) split into two 64-row items each, as many
    as end the simulated call of ``ctas`` persistent CTAs earliest; ``wl`` itself where that saves less than
    :data:`MIN_SAVING` or the list has visibility bits (pair and packed lists keep their items)."""
    if ctas < 1 or wl.num_work == 0 or wl.has_visibility():
        return wl
    info = wl.work_info.astype(np.int64)
    order = wl.work_order.astype(np.int64)
    chunks = wl.chunks_per_item()[order].astype(np.float64)
    rows = info[order, 3]
    cost = np.where(rows > 64, chunks, KEY_SPLIT_COST * chunks)
    splittable = np.flatnonzero(rows > 64)
    # candidates: the last x splittable items in order, x = 0 .. 2·ctas; the prefix before the earliest
    # candidate is simulated once
    tail = splittable[-min(splittable.size, 2 * ctas) :] if splittable.size else splittable
    if tail.size == 0:
        return wl
    first = int(tail[0])
    free = [0.0] * ctas
    for c in cost[:first]:
        heapq.heapreplace(free, free[0] + float(c))
    best_x, best = 0, _finish(free, cost[first:])
    for x in range(1, tail.size + 1):
        split = np.zeros(order.size - first, dtype=bool)
        split[tail[-x:] - first] = True
        rest = cost[first:]
        costs = np.repeat(np.where(split, KEY_SPLIT_COST * chunks[first:], rest), np.where(split, 2, 1))
        end = _finish(free, costs)
        if end < best - 1e-9:
            best_x, best = x, end
    if best_x == 0 or best > (1 - MIN_SAVING) * _finish([0.0] * ctas, cost):
        return wl
    return _split_items(wl, order[tail[-best_x:]])


def _split_items(wl: WorkList, items: np.ndarray) -> WorkList:
    """``wl`` with each of ``items`` (128-row items) replaced, at its place in the order, by two 64-row
    items owning its page slots 0–3 and 4–7 over the same stream."""
    w = wl.num_work
    info = wl.work_info.astype(np.int64)
    second = w + np.arange(items.size)  # the new items: the second halves, appended
    new_info = info[items].copy()
    info[items, 3] = new_info[:, 3] = 64
    half = OWN_PAGES // 2
    own, own_mask = wl.own_pages.copy(), wl.own_mask.copy()
    new_own = np.full((items.size, OWN_PAGES), -1, dtype=own.dtype)
    new_mask = np.zeros((items.size, OWN_PAGES), dtype=own_mask.dtype)
    new_own[:, :half], new_mask[:, :half] = own[items, half:], own_mask[items, half:]
    own[items, half:], own_mask[items, half:] = -1, 0
    # each split item's second half right after its first in the order
    order = wl.work_order.astype(np.int64)
    follow = np.full(w, -1, dtype=np.int64)
    follow[items] = second
    expanded = np.stack([order, follow[order]], axis=1).ravel()
    return WorkList(
        work_info=np.concatenate([info, new_info]).astype(np.int32),
        work_order=expanded[expanded >= 0].astype(np.int32),
        own_pages=np.concatenate([own, new_own]).astype(np.int32),
        own_mask=np.concatenate([own_mask, new_mask]).astype(np.uint32),
        stream_pages=wl.stream_pages,
        stream_mask=wl.stream_mask,
        heads=wl.heads,
        chunk=wl.chunk,
    )


def simulated_end(wl: WorkList, ctas: int) -> float:
    order = wl.work_order.astype(np.int64)
    chunks = wl.chunks_per_item()[order].astype(np.float64)
    rows = wl.work_info[order, 3]
    return _finish([0.0] * ctas, np.where(rows > 64, chunks, KEY_SPLIT_COST * chunks))


def main(ctas: int) -> None:
    names = (
        "dense_16384",
        "dense_32768",
        "dense_75600",
        "dense_131072",
        "ssta_hy15_720p",
        "sta_wan14b_69f",
        "svg2_wan14b_720p",
    )
    for name in names:
        if name.startswith("dense_"):
            graph = dense_graph(name)[0]
        else:
            built = get_workload(name).build()
            graph = HeadStack.of(built) if isinstance(built, list) else built
        wl = work_of(graph, "kpage", "auto")
        split = split_last_wave(wl, ctas)
        before, after = simulated_end(wl, ctas), simulated_end(split, ctas)
        assert split.executed_pairs() == wl.executed_pairs()
        print(f"{name}: items {wl.num_work} -> {split.num_work}, simulated end x{after / before:.4f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 132)
