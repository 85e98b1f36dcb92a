"""sparseattn: hardware-efficient sparse attention research toolkit.

The CPU toolkit is importable from the package: layouts, :class:`SparseGraph`, the built-in
workloads and layout files, graph builders, tile plans, the occupancy analysis, the float64
reference and the plan emulator. The kernel entry points (``kpage_forward``, ``bsa_forward``,
``kpage_backward``, ``bsa_backward``) are loaded on first access, so ``import sparseattn`` never
imports CuPy.
"""

import importlib

from .analysis import (
    OccupancyReport,
    PairCounts,
    analyze_graphs,
    analyze_workload,
    analyze_workloads,
    graph_counts,
    total_record,
)
from .builders import (
    block_list_graph,
    random_graph,
    ssta_graph,
    sta_graph,
    svg2_graph,
    token_mask_graph,
    vsa_graph,
)
from .emulator import emulate_backward, emulate_forward
from .graph import GraphError, HeadStack, SparseGraph
from .layout_file import LayoutFileError, load_layout_file
from .layouts import (
    BlockLayout,
    LayoutError,
    VideoGrid,
    contiguous_layout,
    partition_layout,
    slot_layout,
    video_layout,
)
from .planning import TilePlan, bsa_plan, kpage_plan
from .reference import attention_backward, attention_forward
from .workloads import WORKLOADS, Selection, Workload, WorkloadError, get_workload

__version__ = "0.1.0"

#: Kernel entry points: name -> module, imported on first access (they need CuPy and a GPU to run).
_KERNELS = {
    "kpage_forward": "sparseattn.kernels.forward",
    "bsa_forward": "sparseattn.kernels.forward",
    "kpage_backward": "sparseattn.kernels.backward",
    "bsa_backward": "sparseattn.kernels.backward",
}

# bsa_backward, bsa_forward, kpage_backward, kpage_forward: kernels, loaded on first access (_KERNELS)
__all__ = [
    "WORKLOADS",
    "BlockLayout",
    "GraphError",
    "HeadStack",
    "LayoutError",
    "LayoutFileError",
    "OccupancyReport",
    "PairCounts",
    "Selection",
    "SparseGraph",
    "TilePlan",
    "VideoGrid",
    "Workload",
    "WorkloadError",
    "__version__",
    "analyze_graphs",
    "analyze_workload",
    "analyze_workloads",
    "attention_backward",
    "attention_forward",
    "block_list_graph",
    "bsa_backward",
    "bsa_forward",
    "bsa_plan",
    "contiguous_layout",
    "emulate_backward",
    "emulate_forward",
    "get_workload",
    "graph_counts",
    "kpage_backward",
    "kpage_forward",
    "kpage_plan",
    "load_layout_file",
    "partition_layout",
    "random_graph",
    "slot_layout",
    "ssta_graph",
    "sta_graph",
    "svg2_graph",
    "token_mask_graph",
    "total_record",
    "video_layout",
    "vsa_graph",
]


def __getattr__(name: str):
    if name in _KERNELS:
        return getattr(importlib.import_module(_KERNELS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
