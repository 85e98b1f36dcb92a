"""PageWeaver planning: selection captures, query grouping (numpy reference + GPU search), analysis.

* :mod:`.captures` — :class:`Capture` (per-query selected page ids), the seeded generator, built-ins;
* :mod:`.quest` — Quest-style selector turning real Q/K arrays into a capture;
* :mod:`.grouping` — adjacent and affinity groupings (numpy reference), union sizes;
* :mod:`.grouping_gpu` — the same affinity search as a CuPy kernel (``kernels_cu/pw_grouping.cu``);
* :mod:`.analysis` — page loads, physical pairs and occupancy of per-query vs union paths;
* :mod:`.union_plan` — per-group page unions with member masks, their validation and numpy emulator;
* :mod:`.kv_page_plan` — the direct KV-page union's entries, items and float64 emulator;
* :mod:`.fp8` — paged e4m3 K/V cache with per-(KV head, page) scales;
* :mod:`.reference` — float64 reference of per-query paged sparse attention (GQA);
* :mod:`.gpu_bench` — ``python -m sparseattn.pageweaver.gpu_bench --out DIR``.

Names are imported lazily, so ``python -m sparseattn.pageweaver.<module>`` runs each module once.
"""

import importlib

_EXPORTS = {
    "captures": (
        "BUILTIN_CAPTURES",
        "Capture",
        "CaptureError",
        "GeneratorConfig",
        "builtin_capture_paths",
        "builtin_config",
        "capture_stats",
        "generate_capture",
        "load_capture",
    ),
    "grouping": (
        "Grouping",
        "GroupingError",
        "adjacent_groups",
        "affinity_groups",
        "union_sizes",
        "validate_grouping",
    ),
    "quest": ("quest_select",),
    "analysis": ("analyze_capture", "analyze_captures", "grouping_counts"),
    "union_plan": (
        "build_union_plan",
        "MEMBER_SLOTS",
        "UnionPlan",
        "UnionPlanError",
        "emulate_union",
        "union_counts",
        "validate_union_plan",
    ),
    "kv_page_plan": ("KvPagePlan", "build_kv_page_plan", "emulate_kv_page"),
    "fp8": ("Fp8CacheError", "Fp8KVCache", "dequantize", "quantize_kv", "random_cache"),
    "reference": ("paged_attention_reference",),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = [name for names in _EXPORTS.values() for name in names]


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
