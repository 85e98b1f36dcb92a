"""Triton, when it is installed, and the devices its kernels run on here.

The Triton kernels of the package (:mod:`sparseattn.nearest_centroid`, :mod:`sparseattn.slot_copy`,
:mod:`sparseattn.planning.page_streams`) import ``triton`` and ``tl`` from here (None on a CPU-only
install without Triton) and ask :func:`runs_on` whether a tensor's device can run them: a CUDA device,
or the CPU under ``TRITON_INTERPRET=1`` (Triton's interpreter, for tests; it is chosen when Triton is
first imported).
"""

from __future__ import annotations

import os

try:  # Triton ships with torch's CUDA builds; CPU-only installs may lack it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = tl = None


def interpreting() -> bool:
    """Whether Triton's interpreter is on (``TRITON_INTERPRET`` set and not ``0``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def runs_on(x) -> bool:
    """Whether the Triton kernels can run on tensor ``x``'s device."""
    if triton is None:
        return False
    return x.is_cuda or (interpreting() and x.device.type == "cpu")
