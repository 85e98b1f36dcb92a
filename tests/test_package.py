"""`import sparseattn`: the CPU names a user reaches for, and lazy kernel entry points."""

import subprocess
import sys

import numpy as np

import sparseattn


def test_cpu_names_work_from_the_package():
    q = sparseattn.video_layout((4, 8, 8), (4, 4, 4), block_size=64)
    mask = np.eye(q.num_blocks, dtype=bool)
    graph = sparseattn.SparseGraph.from_block_mask(q, q, mask)
    report = sparseattn.analyze_graphs([graph], "eye")
    assert report.record()["useful_pairs"] == 4 * 64 * 64
    assert sparseattn.bsa_plan(graph).physical_pairs() == report.record()["bsa_physical"]
    assert sparseattn.get_workload("sta_wan14b_69f") is sparseattn.WORKLOADS["sta_wan14b_69f"]
    assert issubclass(sparseattn.LayoutError, ValueError)


def test_every_listed_cpu_name_exists_and_kernels_are_listed():
    kernels = {"kpage_forward", "bsa_forward", "kpage_backward", "bsa_backward"}
    assert kernels <= set(sparseattn.__all__) and kernels <= set(dir(sparseattn))
    for name in set(sparseattn.__all__) - kernels:
        assert getattr(sparseattn, name) is not None, name


def test_one_name_per_function():
    """A name of the package's API names one function: no module of ``sparseattn.kernels`` defines
    another function under it (the mma.sync baseline is ``bsa_mma_forward`` / ``bsa_mma_backward``)."""
    import importlib
    import inspect
    import pkgutil

    from sparseattn import kernels

    api = set(sparseattn.__all__)
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"{kernels.__name__}.{info.name}")
        for name, obj in vars(module).items():
            if name in api and inspect.isfunction(obj) and obj.__module__ == module.__name__:
                assert obj is getattr(sparseattn, name), f"{module.__name__}.{name} is not sparseattn.{name}"
    from sparseattn.kernels.backward import bsa_backward, kpage_backward
    from sparseattn.kernels.bsa_backward import bsa_mma_backward
    from sparseattn.kernels.bsa_mma_forward import bsa_mma_forward
    from sparseattn.kernels.forward import bsa_forward

    assert (sparseattn.bsa_forward, sparseattn.bsa_backward) == (bsa_forward, bsa_backward)
    assert sparseattn.kpage_backward is kpage_backward
    assert bsa_mma_forward is not bsa_forward and bsa_mma_backward is not bsa_backward


def test_import_does_not_load_cupy():
    code = "import sys, sparseattn; print('cupy' in sys.modules, 'sparseattn.kernels' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
