"""Planning: from a selection to what the kernels execute.

selection -> :class:`~sparseattn.graph.SparseGraph` -> tile plans -> work lists. The host builders
(CPU, numpy), in dependency order:

* :mod:`.tile_plan` — :class:`TilePlan`: BSA and KPage tile plans of a graph (:func:`bsa_plan`,
  :func:`kpage_plan`), their launch orders and per-head stacking;
* :mod:`.work_list` — :class:`WorkList`: the flat arrays one persistent paged launch reads
  (:func:`work_list` for the forward, :func:`backward_work_list` for a K/V-owned backward);
* :mod:`.pair_forward` — pair work lists: two 64-row Q blocks in one 128-row item
  (:func:`pair_work_list`, :func:`stacked_pair_work_list`);
* :mod:`.packed_forward` — packed work lists: partial 64-row Q blocks of several Q blocks in one
  64-row item (:func:`packed_work_list`, :func:`stacked_packed_work_list`);
* :mod:`.pair_backward` — pair backward plans: two 64-row K/V blocks in one 128-row item
  (:func:`pair_backward_plan`);
* :mod:`.cache` — the plans a kernel wrapper launches, built once per graph (:func:`plan_of`); the only
  module that reads the cache, it passes the cached base plans to the pair and packed builders.

The device builders, for selections that live on the GPU:

* :mod:`.templates` — what a device plan takes from the layouts alone (host, cached per call site);
* :mod:`.layout_pairs` — the pair items the device planner makes from the layout and the selection;
* :mod:`.device` — :class:`DevicePlanner`: forward work list and backward plans on the caller's stream
  (:mod:`.device_emulation`: the same steps in numpy; :mod:`.plan_recipe`: a call recorded and replayed);
* :mod:`.dynamic_layouts`, :mod:`.forward_items`, :mod:`.page_streams` — work lists of per-head layouts
  made per call (SVG2), in torch and Triton.
"""

from .cache import plan_of
from .packed_forward import packed_work_list, stacked_packed_work_list
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
    "packed_work_list",
    "pair_backward_plan",
    "pair_work_list",
    "plan_of",
    "stacked_packed_work_list",
    "stacked_pair_work_list",
    "work_list",
]
