"""The Triton kernels (the SVG2 planner's page streams and forward work list items, the fused nearest
centroid, tokens to slots, the block mask, the top-p selection of the cluster pairs, VSA's per-block
top-k and per-block sums of token-ordered rows) under Triton's interpreter on the CPU, against
their torch references (``triton_interpreted_checks.py``, in a fresh process: the interpreter is chosen
when Triton is imported). The GPU tests run them compiled."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
triton = pytest.importorskip("triton")

if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 7):
    pytest.skip(
        f"Triton {triton.__version__}'s interpreter cannot run loops with a runtime bound (3.7 can)",
        allow_module_level=True,
    )

CHECKS = Path(__file__).with_name("triton_interpreted_checks.py")


@pytest.mark.parametrize(
    "kernel",
    [
        "page_streams",
        "forward_items",
        "nearest_centroid",
        "slot_copy",
        "cluster_blocks",
        "cluster_select",
        "cluster_select_words",
        "vsa_select",
        "token_block_sums",
        "centroid_update",
        "layout_blocks",
    ],
)
def test_triton_kernel_under_the_interpreter_equals_torch(kernel):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, str(CHECKS), kernel],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "cases agree" in run.stdout


def test_fused_nearest_centroid_refuses_what_it_cannot_run():
    import torch

    from sparseattn.nearest_centroid import nearest_centroid_fused

    with pytest.raises(ValueError, match="nearest_centroid_fused"):
        nearest_centroid_fused(torch.randn(1, 8, 64), torch.randn(1, 2, 64))  # float32


def test_token_block_sums_refuses_what_it_cannot_run():
    import torch

    from sparseattn.vsa_select import token_block_sums

    with pytest.raises(ValueError, match="token_block_sums needs Triton and a CUDA tensor"):
        token_block_sums(torch.zeros(1, 4, 2, 64), torch.zeros(64, dtype=torch.int32), 64)
