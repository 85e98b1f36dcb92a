"""A stand-in for CuPy on machines without it (CPU tests of the launch caches): ``install`` puts a ``cupy``
module into ``sys.modules`` whose ``cuda.Device`` is a no-op context and whose ``int32`` is numpy's, and
makes ``launch.function`` and ``launch.sm_count`` answer without a GPU."""

from __future__ import annotations

import sys
import types

import numpy as np

from sparseattn.kernels import launch


class NoDevice:
    """``cupy.cuda.Device(n)`` as a context that does nothing."""

    def __init__(self, device):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def install(monkeypatch, **attributes) -> types.ModuleType:
    """The stand-in module with ``attributes`` (e.g. ``zeros``, ``asarray``) set on it."""
    cupy = types.ModuleType("cupy")
    cupy.int32 = np.int32
    cupy.cuda = types.SimpleNamespace(Device=NoDevice)
    for name, value in attributes.items():
        setattr(cupy, name, value)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    kernel = types.SimpleNamespace(ptr=1, max_dynamic_shared_size_bytes=0)
    monkeypatch.setattr(launch, "function", lambda *args, **kwargs: kernel)
    monkeypatch.setattr(launch, "sm_count", lambda device: 132)
    return cupy
