"""``python -m sparseattn.wan_training --replot``: the training figure redrawn from a recorded run (no torch)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sparseattn.wan_training import main

RECORDED = Path(__file__).resolve().parents[1] / "data" / "bench" / "wan_training_h200_20261201_8bdd2a9.json"


def test_replot_draws_the_recorded_curves(tmp_path):
    src = tmp_path / "run.json"
    shutil.copy(RECORDED, src)
    assert main(["--replot", str(src)]) == 0
    assert (tmp_path / "run.png").stat().st_size > 10_000


def test_replot_with_one_backend(tmp_path):
    src = tmp_path / "cpu.json"
    src.write_text(json.dumps({"selection": "sta", "losses": {"masked_sdpa": [1.0, 0.9, 0.8]}}))
    assert main(["--replot", str(src)]) == 0
    assert (tmp_path / "cpu.png").exists()


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"steps": 3}'], ids=["text", "list", "no-losses"])
def test_replot_refuses_other_files(tmp_path, capsys, content):
    src = tmp_path / "bad.json"
    src.write_text(content)
    with pytest.raises(SystemExit) as exc:
        main(["--replot", str(src)])
    assert exc.value.code == 2
    assert "not a wan_training.json" in capsys.readouterr().err


def test_out_is_required_without_replot(capsys):
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2
    assert "--out is required" in capsys.readouterr().err
