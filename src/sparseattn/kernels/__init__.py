"""CUDA kernels (``kernels_cu/*.cu``) and their Python wrappers.

Importing this package imports no GPU library: CuPy is loaded lazily by the wrappers on first
launch, so the validation, the compile check and the plans work on CPU-only machines.

* :mod:`.runtime` — NVRTC/CuPy module loading.
* :mod:`.validate` — argument checks every wrapper runs before a launch.
* :mod:`.forward` — ``kpage_forward`` / ``bsa_forward`` (``sparseattn.kpage_forward`` / ``bsa_forward``):
  the paged wgmma skeleton on the KPage or the BSA plan.
* :mod:`.backward` — ``kpage_backward`` / ``bsa_backward``: the K/V-owned backward on either plan.
* :mod:`.bsa_mma_forward` / :mod:`.bsa_backward` — the ``mma.sync`` BSA baseline (``bsa_mma_forward``,
  ``bsa_mma_backward``; the bench's ``bsa_mma``) and the K/V-owned plan executor ``plan_backward``.
* :mod:`.pageweaver` — PageWeaver's union, KV-page union and per-query kernels.
* :mod:`.compile_check` — CPU-only NVRTC build of every kernel to an sm_90a cubin.
"""
