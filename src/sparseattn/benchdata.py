"""Recorded benchmark results (``data/bench/*.json``) for figures and notebooks.

Only the runs at the top of ``data/bench/`` are read: the canonical results, one measured question per
file (``data/bench/README.md``); ``data/bench/experiments/`` keeps the history and is not searched.

A benchmark file is one run on one GPU: an object with ``gpu``, ``commit``, ``date``, ``command`` and
``records`` (``workload``, ``impl``, ``pass``, ``heads``, ``head_dim``, ``time_ms``, ``useful_pairs``,
``physical_pairs``, ``correct``, optional ``error``). Other JSON files in the folder (summaries,
analyses) are skipped.

A figure compares implementations measured side by side, so it takes all its numbers from ONE run:
:func:`pick_run` returns the newest run (by its ``date``) that holds the implementations the figure
needs, and never mixes records of different runs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_BENCH_DIR = REPO / "data" / "bench"
RUN_FIELDS = ("gpu", "commit", "date", "command", "records")
RECORD_FIELDS = ("workload", "impl", "pass")
#: Useful FLOPs per useful QK pair and head-dim element: 4 (Q·Kᵀ and P·V) forward; the backward's five
#: GEMMs cost 2.5× the forward, so forward + backward is 3.5× the forward.
FLOPS_PER_PAIR = {"fwd": 4.0, "bwd": 10.0, "fwdbwd": 14.0}


class BenchFileError(ValueError):
    """A benchmark file is not a run object (``gpu``, ``commit``, ``date``, ``command``, ``records``)."""


@dataclass(frozen=True)
class BenchRun:
    """One benchmark file: where it came from and its records."""

    path: Path
    gpu: str
    commit: str
    date: str
    command: str
    records: tuple

    def usable(self, impl: str, pass_: str) -> dict[str, dict]:
        """Records of ``impl``/``pass_`` with a time and no failure, by workload (where a run timed several
        backward kernels, ``sparseattn bench --bwd-impl A --bwd-impl B``, the first one's)."""
        found: dict[str, dict] = {}
        for r in self.records:
            if r["impl"] == impl and r["pass"] == pass_ and is_usable(r):
                found.setdefault(r["workload"], r)
        return found

    def failed(self, impl: str, pass_: str) -> dict[str, dict]:
        """Records of ``impl``/``pass_`` that carry an ``error`` or a wrong result, by workload."""
        return {
            r["workload"]: r
            for r in self.records
            if r["impl"] == impl and r["pass"] == pass_ and not is_usable(r)
        }

    def has(self, impl: str, passes=None) -> bool:
        """True if the run holds a usable record of ``impl`` (in one of ``passes``, if given)."""
        return any(
            r["impl"] == impl and (passes is None or r["pass"] in passes) and is_usable(r)
            for r in self.records
        )

    def workloads(self) -> list[str]:
        """Workload names in the order they first appear."""
        return list(dict.fromkeys(r["workload"] for r in self.records))

    @property
    def short_commit(self) -> str:
        head = self.commit.strip().partition(" ")[0]
        core, plus, suffix = head.partition("+")
        if len(core) > 7 and all(c in "0123456789abcdef" for c in core.lower()):
            core = core[:7]
        return core + plus + suffix

    @property
    def day(self) -> str:
        return self.date[:10]

    def source(self) -> str:
        """Caption text: GPU, commit, date and file of the run."""
        return f"Measured on {self.gpu}, {self.day}, commit {self.short_commit}; data: {display_path(self.path)}."


def is_usable(record: dict) -> bool:
    """A record with a positive finite time, no ``error`` and not marked incorrect."""
    t = record.get("time_ms")
    return (
        record.get("error") is None
        and record.get("correct") is not False
        and isinstance(t, (int, float))
        and math.isfinite(t)
        and t > 0
    )


def useful_tflops(record: dict) -> float:
    """Useful TFLOP/s of a record (4 FLOPs per useful pair and head-dim element forward; ×3.5 fwd+bwd)."""
    factor = FLOPS_PER_PAIR.get(record["pass"])
    if factor is None or not is_usable(record):
        return float("nan")
    return factor * record["useful_pairs"] * record["head_dim"] / (record["time_ms"] * 1e-3) / 1e12


def display_path(path: Path) -> str:
    """``data/bench/x.json`` for files of this repository, else the file name."""
    path = Path(path).resolve()
    try:
        return path.relative_to(REPO).as_posix()
    except ValueError:
        return path.name


def load_run(path, record_fields=RECORD_FIELDS) -> BenchRun:
    """Read one benchmark file; :class:`BenchFileError` if it is not a run object whose records all hold
    ``record_fields`` (default :data:`RECORD_FIELDS`; other scripts' runs name theirs)."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise BenchFileError(f"{path}: cannot read: {err}") from None
    if not isinstance(doc, dict):
        raise BenchFileError(f"{path}: not a benchmark run (a JSON object is expected)")
    missing = [k for k in RUN_FIELDS if k not in doc]
    if missing:
        raise BenchFileError(f"{path}: not a benchmark run (no field {missing[0]!r})")
    if not isinstance(doc["records"], list):
        raise BenchFileError(f"{path}: field 'records' must be a list")
    for i, rec in enumerate(doc["records"]):
        if not isinstance(rec, dict) or any(k not in rec for k in record_fields):
            raise BenchFileError(f"{path}: records[{i}] lacks one of {record_fields}")
    return BenchRun(
        path,
        str(doc["gpu"]),
        str(doc["commit"]),
        str(doc["date"]),
        str(doc["command"]),
        tuple(doc["records"]),
    )


def _date_key(run: BenchRun):
    try:
        stamp = datetime.fromisoformat(run.date.replace("Z", "+00:00"))
        if stamp.tzinfo is None:
            stamp = stamp.replace(tzinfo=timezone.utc)  # no zone given: read as UTC
        return (stamp.timestamp(), run.path.name)
    except ValueError:
        return (float("-inf"), run.path.name)


def find_runs(bench_dir=None, record_fields=RECORD_FIELDS) -> list[BenchRun]:
    """Every benchmark run in ``bench_dir`` (default ``data/bench``) whose records hold ``record_fields``
    (:func:`load_run`), newest first; other JSON skipped."""
    folder = Path(bench_dir) if bench_dir is not None else DEFAULT_BENCH_DIR
    runs = []
    for path in sorted(folder.glob("*.json")):
        try:
            runs.append(load_run(path, record_fields))
        except BenchFileError:
            continue
    return newest_first(runs)


def newest_first(runs) -> list[BenchRun]:
    """``runs`` sorted by their ``date``, newest first (ties by file name)."""
    return sorted(runs, key=_date_key, reverse=True)


def pick_run(runs, all_of=(), any_of=(), passes=None) -> BenchRun | None:
    """The newest run holding every impl of ``all_of`` and at least one of ``any_of`` (usable records,
    in ``passes`` if given); None if no run does."""
    for run in newest_first(runs):
        if all(run.has(i, passes) for i in all_of) and (
            not any_of or any(run.has(i, passes) for i in any_of)
        ):
            return run
    return None
