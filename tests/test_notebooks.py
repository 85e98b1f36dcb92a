"""The notebooks run top to bottom (nbclient + ipykernel, installed by the dev/notebooks extras)."""

import time
from pathlib import Path

import pytest

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
TIME_LIMIT_S = 60  # each notebook is written to finish in < 20 s; this only guards against hangs

nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (pip install -e '.[dev]')")
nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed (pip install -e '.[dev]')")
pytest.importorskip("ipykernel", reason="ipykernel is not installed (pip install -e '.[dev]')")


def test_notebooks_exist():
    names = [p.name for p in NOTEBOOKS]
    assert {"01_explore_layouts.ipynb", "02_kpage_capacity.ipynb", "03_pageweaver_grouping.ipynb"} <= set(
        names
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path, monkeypatch):
    nb = nbformat.read(path, as_version=4)
    # figures a notebook writes go to a scratch folder, not the repository's figures/
    monkeypatch.setenv("SPARSEATTN_FIGURES_DIR", str(tmp_path))
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
