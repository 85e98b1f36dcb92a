"""data/bench: every recorded file the README, the docs and the indexes cite exists, and file names carry
what they measure, never an internal work-period number."""

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "data" / "bench"
CITING = [
    REPO / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
    BENCH / "README.md",
    BENCH / "experiments" / "README.md",
]
WORK_PERIOD = re.compile(r"(^|_)s\d{1,2}_|session", re.IGNORECASE)


@pytest.mark.parametrize("doc", CITING, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_cited_bench_file_exists(doc):
    text = doc.read_text(encoding="utf-8")
    cited = {m.group(0) for m in re.finditer(r"data/bench/[\w./-]*\w", text) if "*" not in m.group(0)}
    # names in backticks inside the indexes are relative to their folder
    if doc.parent in (BENCH, BENCH / "experiments"):
        for m in re.finditer(r"`([\w.-]+\.(?:json|log|png|txt|py|md|sh))`", text):
            cited.add((doc.parent / m.group(1)).relative_to(REPO).as_posix())
    missing = sorted(p for p in cited if not (REPO / p).exists())
    assert not missing, missing


def test_no_work_period_numbers_in_bench_file_names():
    names = [p.relative_to(BENCH).as_posix() for p in BENCH.rglob("*") if p.is_file()]
    assert names and not [n for n in names if WORK_PERIOD.search(Path(n).name)]


def test_the_figures_read_the_canonical_runs_only():
    from sparseattn.benchdata import find_runs

    runs = find_runs()
    assert runs and all(r.path.parent == BENCH for r in runs)
    assert not list(BENCH.glob("NOTES*")), "per-version notes belong in data/bench/experiments/"


def test_the_index_names_every_canonical_file():
    """A result added to data/bench/ gets a row in data/bench/README.md (what it measures)."""
    index = (BENCH / "README.md").read_text(encoding="utf-8")
    unlisted = [
        p.name for p in BENCH.iterdir() if p.is_file() and p.name != "README.md" and p.name not in index
    ]
    assert not unlisted, f"add to data/bench/README.md: {unlisted}"


def test_the_opt_in_decision_run_names_what_exists():
    """``opt_in_decisions_run.sh``, the GPU run kept for a later machine: the tests and scripts it runs exist,
    its modules import, and the ``svg2_step_bench`` methods it names are the bench's."""
    from sparseattn.svg2_step_bench import ASSIGNS

    script = (BENCH / "experiments" / "opt_in_decisions_run.sh").read_text(encoding="utf-8")
    paths = set(re.findall(r"(?:tests|data)/[\w./-]+\.py", script))
    assert len(paths) >= 5 and not sorted(p for p in paths if not (REPO / p).exists())
    modules = set(re.findall(r"python -m (sparseattn[\w.]+)", script))
    assert len(modules) >= 3 and all(importlib.util.find_spec(m) is not None for m in modules)
    methods = re.search(r"--methods (\S+)", script).group(1).split(",")
    assert methods and set(methods) <= set(ASSIGNS)
