"""docs/environment.md lists every ``SPARSEATTN_*`` environment variable the code reads, and no other."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "environment.md"
NAME = re.compile(r"SPARSEATTN_[A-Z0-9_]+")
#: A table row's first cell: the variable it documents.
ROW = re.compile(r"^\| `(SPARSEATTN_[A-Z0-9_]+)` \|", re.MULTILINE)


def names_in_code() -> set[str]:
    """Every name in the package's Python sources and in tests/conftest.py."""
    files = [*sorted((ROOT / "src").rglob("*.py")), ROOT / "tests" / "conftest.py"]
    return {name for path in files for name in NAME.findall(path.read_text(encoding="utf-8"))}


def test_every_variable_in_the_code_has_a_row():
    rows = ROW.findall(DOC.read_text(encoding="utf-8"))
    missing = sorted(names_in_code() - set(rows))
    assert not missing, f"docs/environment.md has no row for: {', '.join(missing)}"
    twice = sorted({name for name in rows if rows.count(name) > 1})
    assert not twice, f"docs/environment.md has more than one row for: {', '.join(twice)}"


def test_every_variable_the_doc_names_is_in_the_code():
    stale = sorted(set(NAME.findall(DOC.read_text(encoding="utf-8"))) - names_in_code())
    assert not stale, (
        f"docs/environment.md names variables that src/ and tests/conftest.py never mention: {', '.join(stale)}"
    )
