"""The notebooks run top to bottom (nbclient + ipykernel, installed by the dev/notebooks extras), are
committed without outputs, and write only into $SPARSEATTN_FIGURES_DIR (never into the checkout)."""

import json
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = REPO / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
EXPECTED = {
    "01_tour.ipynb",
    "02_kpage_reproduction.ipynb",
    "03_pageweaver_reproduction.ipynb",
    "04_your_own_layout.ipynb",
}
TIME_LIMIT_S = 60  # each notebook is written to finish in < 30 s on 2 cores; this only guards against hangs


def _git_status() -> str | None:
    try:
        done = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=all"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return done.stdout


def test_notebooks_exist():
    assert EXPECTED <= {p.name for p in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_committed_without_outputs(path):
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    assert code
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in code)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (pip install -e '.[dev]')")
    nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed (pip install -e '.[dev]')")
    pytest.importorskip("ipykernel", reason="ipykernel is not installed (pip install -e '.[dev]')")
    nb = nbformat.read(path, as_version=4)
    # figures a notebook writes go to a scratch folder, not into the repository
    monkeypatch.setenv("SPARSEATTN_FIGURES_DIR", str(tmp_path))
    before = _git_status()
    client = nbclient.NotebookClient(
        nb, timeout=TIME_LIMIT_S, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError (with the cell's traceback) on any failing cell
    elapsed = time.perf_counter() - start
    assert elapsed < TIME_LIMIT_S, f"{path.name} took {elapsed:.1f} s"
    assert any(
        o.get("output_type") in ("display_data", "execute_result") and "image/png" in o.get("data", {})
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
    ), "no figure was shown"
    assert any(tmp_path.iterdir()), "the notebook wrote no figure into $SPARSEATTN_FIGURES_DIR"
    assert _git_status() == before, "running the notebook changed the checkout"
