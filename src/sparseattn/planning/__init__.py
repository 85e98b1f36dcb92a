"""Planning: from a selection to what the kernels execute.

selection -> :class:`~sparseattn.graph.SparseGraph` -> tile plans -> work lists. The host builders
(CPU, numpy), in dependency order:

* :mod:`.tile_plan` — :class:`TilePlan`: BSA and KPage tile plans of a graph (:func:`bsa_plan`,
  :func:`kpage_plan`), their launch orders and per-head stacking;
* :mod:`.work_list` — :class:`WorkList`: the flat arrays one persistent paged launch reads
  (:func:`work_list` for the forward, :func:`backward_work_list` for a K/V-owned backward);
* :mod:`.pair_forward` — pair work lists: two 64-row Q blocks in one 128-row item
  (:func:`pair_work_list`, :func:`stacked_pair_work_list`);
* :mod:`.pair_backward` — pair backward plans: two 64-row K/V blocks in one 128-row item
  (:func:`pair_backward_plan`);
* :mod:`.cache` — the plans a kernel wrapper launches, built once per graph (:func:`plan_of`); the only
  module that reads the cache, it passes the cached base plans to the pair builders.

A device planner will sit beside the host builders (``planning/device*.py``).
"""

from .cache import plan_of
from .pair_backward import pair_backward_plan
from .pair_forward import pair_work_list, stacked_pair_work_list
from .tile_plan import PlanError, TilePlan, bsa_plan, kpage_plan
from .work_list import WorkList, backward_work_list, work_list

__all__ = [
    "PlanError",
    "TilePlan",
    "WorkList",
    "backward_work_list",
    "bsa_plan",
    "kpage_plan",
    "pair_backward_plan",
    "pair_work_list",
    "plan_of",
    "stacked_pair_work_list",
    "work_list",
]
