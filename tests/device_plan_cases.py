"""Random selections for the device planner's tests (CPU: its numpy twin against the host planners; GPU:
the device against the numpy twin and the kernels against the float64 reference), and the canonical forms
plans are compared in."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from small_cases import ragged_valid

from sparseattn.graph import SparseGraph
from sparseattn.layouts import slot_layout, video_layout
from sparseattn.planning.pair_backward import pair_backward_plan
from sparseattn.planning.pair_forward import pair_work_list
from sparseattn.planning.tile_plan import bsa_plan, kpage_plan
from sparseattn.planning.work_list import work_list

ROUTES = ("auto", "pair", 0, 1)


@dataclass
class SelectionCase:
    """One call: layouts, plan kind and route, and a selection of ``batch`` x ``heads`` rows."""

    name: str
    q: object
    k: object
    kind: str
    route: object
    batch: int
    heads: int
    q2k_idx: np.ndarray | None = None
    q2k_num: np.ndarray | None = None
    mask: np.ndarray | None = None

    def selection(self) -> dict:
        if self.mask is not None:
            return {"mask": self.mask}
        return {"q2k_idx": self.q2k_idx, "q2k_num": self.q2k_num}


def _layouts(rng, shape: str):
    if shape == "video64":  # VSA-like cubes: every block 64 rows, ragged border cubes
        t = int(rng.integers(1, 5))
        grid = (int(rng.integers(t, 11)), int(rng.integers(4, 11)), int(rng.integers(4, 11)))
        lay = video_layout(grid, (t, 4, 4), 64)
        return lay, lay
    if shape == "video128":  # SSTA-like tiles of 3 blocks, partial tiles at the borders
        grid = (int(rng.integers(4, 9)), int(rng.integers(6, 13)), int(rng.integers(8, 17)))
        lay = video_layout(grid, (3, 4, 8), 128)
        return lay, lay
    if shape == "single-page":  # blocks of 16 slots: one page each
        lay = slot_layout(rng.random(int(rng.integers(6, 20)) * 16) < 0.6, 16)
        return lay, slot_layout(rng.random(int(rng.integers(6, 20)) * 16) < 0.6, 16)
    bq = int(rng.choice([64, 128]))
    bk = bq if rng.random() < 0.6 else int(rng.choice([64, 128]))
    q = slot_layout(ragged_valid(rng, int(rng.integers(5, 12)), bq), bq)
    k = slot_layout(ragged_valid(rng, int(rng.integers(5, 14)), bk), bk)
    return q, k


def random_case(rng, index: int = 0) -> SelectionCase:
    """A random call: ragged or video layouts (64- and 128-row blocks, single-page blocks, independent Q and
    K), 1–2 batch entries with their own selections, 1–3 heads; a top-k selection (rows selecting nothing,
    repeated indices, counts short of k) or a block mask (sometimes every block, sometimes none)."""
    shape = str(rng.choice(["ragged", "video64", "video128", "single-page"], p=[0.4, 0.3, 0.2, 0.1]))
    q, k = _layouts(rng, shape)
    kind = "bsa" if shape != "single-page" and rng.random() < 0.15 else "kpage"
    route = "auto" if kind == "bsa" else ROUTES[int(rng.integers(len(ROUTES)))]
    if kind == "bsa" and (q.block_size not in (64, 128) or k.block_size not in (64, 128)):
        kind = "kpage"
    batch, heads = int(rng.integers(1, 3)), int(rng.integers(1, 4))
    nq, nk = q.num_blocks, k.num_blocks
    case = SelectionCase(f"{index}-{shape}-{kind}-{route}", q, k, kind, route, batch, heads)
    if rng.random() < 0.6:
        top = int(rng.integers(1, min(nk, 9) + 1))
        case.q2k_idx = rng.integers(0, nk, size=(batch, heads, nq, top)).astype(np.int32)
        case.q2k_num = rng.integers(0, top + 1, size=(batch, heads, nq)).astype(np.int32)
        case.q2k_num[..., int(rng.integers(nq))] = 0  # a Q block selecting nothing
        if rng.random() < 0.3:
            case.q2k_num[:] = top
    else:
        density = float(rng.choice([rng.uniform(0.05, 0.9), 1.0, 0.0], p=[0.8, 0.15, 0.05]))
        case.mask = rng.random((batch, heads, nq, nk)) < density
    return case


def graph_of(rows: np.ndarray, q, k) -> SparseGraph:
    """The host graph of a selection matrix ``[batch · heads, q_blocks, k_blocks]``."""
    h, i, j = np.nonzero(rows)
    return SparseGraph.from_pairs(q, k, rows.shape[0], h, i, j)


def host_forward(graph: SparseGraph, kind: str, route):
    """The host planners' forward work list for the route the device runs."""
    if kind == "bsa":
        return work_list(bsa_plan(graph))
    if route == "pair":
        return pair_work_list(graph, partners="layout")
    return work_list(kpage_plan(graph, route))


def host_owned(graph: SparseGraph, kind: str, route, owner: str):
    """The host planners' K/V-owned plan (or the dQ pass's Q-owned one) for the route the device runs."""
    if kind == "bsa":
        return bsa_plan(graph, owner=owner)
    if route == "pair" and owner == "kv":
        return pair_backward_plan(graph, partners="layout")
    return kpage_plan(graph, "auto" if route == "pair" else route, owner=owner)


def canonical_work_list(wl) -> list:
    """Every item as (head, M, owned pages and masks, stream pages and masks in order), sorted; items that
    own nothing and stream nothing (a matched pair's second slot) are left out."""
    items = []
    for w in range(wl.work_info.shape[0]):
        head, begin, length, m = (int(x) for x in wl.work_info[w])
        if length == 0 and (wl.own_pages[w] < 0).all():
            continue
        items.append(
            (
                head,
                m,
                tuple(wl.own_pages[w].tolist()),
                tuple(wl.own_mask[w].tolist()),
                tuple(wl.stream_pages[begin : begin + length].tolist()),
                tuple(wl.stream_mask[begin : begin + length].tolist()),
            )
        )
    return sorted(items)


def canonical_plan(plan) -> list:
    """Every item of a TilePlan as (head, route, owned pages, stream pages, visibility), sorted."""
    vis = plan.stream_vis if plan.stream_vis is not None else np.full(plan.stream_pages.size, 3)
    items = []
    for w in range(plan.num_work):
        a, b = int(plan.stream_indptr[w]), int(plan.stream_indptr[w + 1])
        own = plan.own_pages[w].tolist() + [-1] * (8 - plan.own_pages.shape[1])
        items.append(
            (
                int(plan.work_head[w]),
                int(plan.work_route[w]),
                tuple(own[:8]),
                tuple(plan.stream_pages[a:b].tolist()),
                tuple((vis[a:b] & 3).tolist()),
            )
        )
    return sorted(items)
