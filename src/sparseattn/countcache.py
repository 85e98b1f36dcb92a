"""On-disk cache of the analysis' per-slice counts (``sparseattn analyze --cache``).

Building the graphs of the built-in workloads is what an analysis spends its time on (SVG2's per-head
k-means above all); their counts are a few hundred integers per slice of heads. With a cache folder,
:func:`sparseattn.analysis.analyze_workloads` stores the counts (and block-fill histograms) of every
slice it computes and takes them back on the next run instead of building the graphs again.

An entry is used only for the very same question: the workload's full definition (block lists
included), the heads of the slice, the seed, the KPage route and whether block fills were asked for,
counted by the same code (a digest of every ``.py`` file of the package) with the same numpy and scipy
on the same kind of CPU (the SVG2 clustering runs BLAS, whose rounding can differ between CPU families).
Anything else is a miss and is computed. Entries are small ``.npz`` files written atomically; delete the
folder to clear it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import tempfile
from pathlib import Path

import numpy as np

#: Bumped when the layout of an entry changes.
CACHE_FORMAT = 1
#: The folder ``--cache`` uses when given no path (``$SPARSEATTN_CACHE_DIR`` overrides).
DEFAULT_DIR = Path("~/.cache/sparseattn/analyze")


def default_dir() -> Path:
    return Path(os.environ.get("SPARSEATTN_CACHE_DIR") or DEFAULT_DIR).expanduser()


@functools.cache
def code_digest() -> str:
    """Digest of the package's Python sources and of what else the counts depend on."""
    import scipy

    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    for part in (np.__version__, scipy.__version__, platform.machine(), platform.system(), _cpu_model()):
        h.update(str(part).encode() + b"\0")
    return h.hexdigest()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def slice_key(workload, heads, seed: int, route, fill: bool) -> str | None:
    """The entry name of one slice, or None for workloads the cache cannot describe (objects that are
    not :class:`~sparseattn.workloads.Workload`)."""
    from .workloads import Workload

    if not isinstance(workload, Workload):
        return None
    h = hashlib.sha256()
    for part in (
        CACHE_FORMAT,
        code_digest(),
        repr(workload),
        repr(workload.selection.blocks),
        heads,
        seed,
        route,
    ):
        h.update(repr(part).encode() + b"\0")
    h.update(b"fill" if fill else b"counts")
    return h.hexdigest()[:40]


def load(folder: Path, key: str):
    """``(PairCounts, BlockFill or None)`` of an entry, or None when there is none (or it is unreadable)."""
    from .analysis import _COUNT_FIELDS, _FILL_FIELDS, BlockFill, PairCounts

    path = Path(folder) / f"{key}.npz"
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {name: z[name] for name in z.files}
        counts = PairCounts(
            route=str(arrays["route"]),
            dropped_pairs=arrays["dropped_pairs"],
            **{name: arrays[name] for name in _COUNT_FIELDS},
        )
        fill = None
        if "fill_pair_fill" in arrays:
            fill = BlockFill(**{name: arrays[f"fill_{name}"] for name in _FILL_FIELDS})
        return counts, fill
    except (OSError, KeyError, ValueError, EOFError):
        return None


def save(folder: Path, key: str, counts, fill) -> None:
    """Write one entry (atomically: a reader sees the whole file or none)."""
    from .analysis import _COUNT_FIELDS, _FILL_FIELDS

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {name: getattr(counts, name) for name in _COUNT_FIELDS}
    arrays["route"] = np.array(counts.route)
    arrays["dropped_pairs"] = counts.dropped()
    if fill is not None:
        arrays.update({f"fill_{name}": getattr(fill, name) for name in _FILL_FIELDS})
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, **arrays)
        os.replace(tmp, folder / f"{key}.npz")
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
