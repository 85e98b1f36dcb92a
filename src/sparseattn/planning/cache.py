"""The plans a kernel wrapper launches: built once per graph, checked once per tensor size.

Every cache is weak: a plan lives as long as its graph (or the caller's plan object) does. The builders
(:mod:`.tile_plan`, :mod:`.work_list`, :mod:`.pair_forward`, :mod:`.packed_forward`,
:mod:`.pair_backward`) never read this cache; the pair and packed builders take the base KPage plan they
extend as an argument, and this module passes the cached one.
"""

from __future__ import annotations

import weakref

from ..graph import HeadStack, SparseGraph
from .packed_forward import packed_work_list, stacked_packed_work_list
from .pair_backward import pair_backward_plan
from .pair_forward import pair_work_list, stacked_pair_work_list
from .tile_plan import TilePlan, bsa_plan, kpage_plan
from .work_list import WorkList

# KernelTypeError, KernelValueError and check_plan (sparseattn.kernels.validate) are imported where used:
# `import sparseattn` loads no kernel module.

_DERIVED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cached(owner, key, build):
    """``build()``, computed once per (``owner``, ``key``) and kept as long as ``owner`` lives."""
    per = _DERIVED.setdefault(owner, {})
    value = per.get(key)
    if value is None:
        value = per[key] = build()
    return value


def plan_of(graph: SparseGraph, kind: str = "kpage", route="auto", owner: str = "q") -> TilePlan:
    """The graph's ``"bsa"`` or ``"kpage"`` plan of one orientation, built once per graph."""
    if kind == "bsa":
        if route == "pair":
            from ..kernels.validate import KernelValueError

            raise KernelValueError("route='pair' pairs KPage's 64-row blocks (kind='kpage'), not BSA tiles")
        return cached(graph, ("plan", "bsa", owner), lambda: bsa_plan(graph, owner=owner))
    if route == "pair":  # the backward's pair items (pair_backward_plan); the forward's are a WorkList
        if owner != "kv":
            from ..kernels.validate import KernelValueError

            raise KernelValueError("route='pair' has a TilePlan for the backward (owner='kv') only")

        # on the backward's cached KPage plan (not a graph: pair_backward_plan raises the error)
        def build() -> TilePlan:
            base = plan_of(graph, "kpage", "auto", owner="kv") if isinstance(graph, SparseGraph) else None
            return pair_backward_plan(graph, base=base)

        return cached(graph, ("plan", kind, route, owner), build)
    return cached(graph, ("plan", kind, route, owner), lambda: kpage_plan(graph, route=route, owner=owner))


def pair_work_of(graph_or_stack: SparseGraph | HeadStack) -> WorkList:
    """The forward's pair work list of a graph (:func:`pair_work_list`) or a HeadStack
    (:func:`stacked_pair_work_list`), built once per object on each head's cached KPage plan
    (:func:`plan_of` ``(g, "kpage", "auto")``)."""
    build = pair_work_list if isinstance(graph_or_stack, SparseGraph) else stacked_pair_work_list
    return cached(graph_or_stack, ("work", "pair"), lambda: build(graph_or_stack, base_of=_forward_plan))


def packed_work_of(graph_or_stack: SparseGraph | HeadStack) -> WorkList:
    """The forward's packed work list of a graph (:func:`packed_work_list`) or a HeadStack
    (:func:`stacked_packed_work_list`), built once per object on each head's cached KPage plan."""
    build = packed_work_list if isinstance(graph_or_stack, SparseGraph) else stacked_packed_work_list
    return cached(graph_or_stack, ("work", "packed"), lambda: build(graph_or_stack, base_of=_forward_plan))


def _forward_plan(graph: SparseGraph) -> TilePlan:
    """The forward's cached KPage plan of a one-head graph: the base of its pair and packed work lists."""
    return plan_of(graph, "kpage", "auto", owner="q")


class PlanCache:
    """BSA plans of one orientation (``owner`` ``"q"`` forward, ``"kv"`` backward) for one kernel."""

    def __init__(self, owner: str, tile_shapes):
        self.owner = owner
        self.tile_shapes = tuple(tile_shapes)
        self._checked: weakref.WeakKeyDictionary[TilePlan, set] = weakref.WeakKeyDictionary()

    def plan_for(self, graph_or_plan) -> TilePlan:
        """The graph's BSA plan (built on first use) or the given plan itself."""
        if isinstance(graph_or_plan, TilePlan):
            return graph_or_plan
        if isinstance(graph_or_plan, SparseGraph):
            return plan_of(graph_or_plan, "bsa", owner=self.owner)
        from ..kernels.validate import KernelTypeError

        raise KernelTypeError(
            f"graph_or_plan must be a SparseGraph or a TilePlan, got {type(graph_or_plan).__name__}"
        )

    def checked(self, plan: TilePlan, q_pages: int, k_pages: int, heads: int) -> TilePlan:
        """``check_plan`` for this kernel's owner and tile shapes, once per (plan, sizes)."""
        done = self._checked.setdefault(plan, set())
        if (q_pages, k_pages, heads) not in done:
            from ..kernels.validate import check_plan

            check_plan(plan, q_pages, k_pages, heads, owner=self.owner, tile_shapes=self.tile_shapes)
            done.add((q_pages, k_pages, heads))
        return plan

    def resolve(
        self, graph_or_plan, heads: int, q_slots: int, k_slots: int, q_pages: int, k_pages: int
    ) -> TilePlan:
        """The checked plan for tensors of these sizes; a graph must match them too."""
        if isinstance(graph_or_plan, SparseGraph):
            check_graph_matches(graph_or_plan, heads, q_slots, k_slots)
        return self.checked(self.plan_for(graph_or_plan), q_pages, k_pages, heads)


def check_graph_matches(graph: SparseGraph, heads: int, q_slots: int, k_slots: int) -> None:
    """The graph's heads and slot counts equal the tensors' (``q`` ``[b, heads, q_slots, d]``)."""
    from ..kernels.validate import KernelValueError

    if graph.heads != heads:
        raise KernelValueError(f"graph has {graph.heads} heads but q has {heads}")
    if graph.q.num_slots != q_slots:
        raise KernelValueError(f"graph.q has {graph.q.num_slots} slots but q has {q_slots}")
    if graph.k.num_slots != k_slots:
        raise KernelValueError(f"graph.k has {graph.k.num_slots} slots but k has {k_slots}")
