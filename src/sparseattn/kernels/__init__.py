"""CUDA kernels (``kernels_cu/*.cu``) and their Python wrappers.

Importing this package imports no GPU library: CuPy is loaded lazily by the wrappers on first
launch, so the validation, the compile check and the plans work on CPU-only machines.

* :mod:`.runtime` — NVRTC/CuPy module loading.
* :mod:`.validate` — argument checks every wrapper runs before a launch.
* :mod:`.bsa_forward` — ``bsa_forward(q, k, v, graph_or_plan, scale=None, out=None) -> (o, lse)``.
* :mod:`.compile_check` — CPU-only NVRTC build of every kernel to an sm_90a cubin.
"""
