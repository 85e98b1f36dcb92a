"""Two kernel source trees of the KPage forward alternated in one process (lab script, GPU).

``sparseattn bench variants`` alternates compile-time builds of one source tree. A change to the source
itself (not behind a macro) is compared here the same way: every forward kernel is compiled first from
``--baseline-dir`` (an earlier ``kernels_cu/``) under the marker macro ``KERNEL_TREE_BASELINE`` (which no
source reads; it only keeps the two trees' kernels apart in the compile caches), then the default build
from this checkout's ``kernels_cu/``. The baseline build is labelled ``KERNEL_TREE_BASELINE`` in the
records, and every other argument goes to ``sparseattn bench variants``. Paired ratios are to the first
``--variant``, as there.

.. code-block:: text

    PYTHONPATH=src SPARSEATTN_KERNEL_WARMUP=0 python data/bench/experiments/kernel_tree_ab.py \\
        --baseline-dir /tmp/kernels_cu_before --workload dense_32768 --variant KERNEL_TREE_BASELINE \\
        --variant default --cudnn --rounds 10 --reps 5 --out tree_ab.json
"""

from __future__ import annotations

import argparse
import os
import sys

MARKER = "KERNEL_TREE_BASELINE"


def compile_baseline(baseline_dir: str) -> None:
    """Every forward instantiation of ``baseline_dir``'s ``paged_fwd.cu`` into the launch cache under
    :data:`MARKER` (the kernel folder is read at compile time only)."""
    from sparseattn.kernels import forward, launch

    before = os.environ.get("SPARSEATTN_KERNEL_DIR")
    os.environ["SPARSEATTN_KERNEL_DIR"] = baseline_dir
    try:
        for name in forward.NAME_EXPRESSIONS:
            launch.function(forward.SOURCE, name, forward.NAME_EXPRESSIONS, (MARKER,))
    finally:
        if before is None:
            del os.environ["SPARSEATTN_KERNEL_DIR"]
        else:
            os.environ["SPARSEATTN_KERNEL_DIR"] = before


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], add_help=True)
    ap.add_argument("--baseline-dir", required=True, help="the earlier kernels_cu/ folder")
    args, rest = ap.parse_known_args(argv)
    if not os.path.isfile(os.path.join(args.baseline_dir, "paged_fwd.cu")):
        ap.error(f"--baseline-dir {args.baseline_dir!r} holds no paged_fwd.cu")
    from sparseattn import variant_ab
    from sparseattn.kernels import forward

    forward.VARIANTS = (*forward.VARIANTS, MARKER)  # so that --variant accepts the marker
    compile_baseline(args.baseline_dir)
    return variant_ab.main(rest, prog="kernel_tree_ab.py")


if __name__ == "__main__":
    sys.exit(main())
