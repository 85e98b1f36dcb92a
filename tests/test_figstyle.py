"""The figure style: readable names, sizes, and reproducible PNG/PDF/SVG files."""

import re

import numpy as np
import pytest
from matplotlib.text import Text

from sparseattn import figstyle
from sparseattn.analysis import analyze_graphs
from sparseattn.graph import SparseGraph
from sparseattn.layouts import video_layout
from sparseattn.plots import block_fill_histogram, capacity_bar_chart


def _small_report():
    lay = video_layout((5, 10, 12), (4, 4, 4), block_size=64)
    mask = np.abs(np.subtract.outer(np.arange(lay.num_blocks), np.arange(lay.num_blocks))) <= 1
    return analyze_graphs([SparseGraph.from_block_mask(lay, lay, mask[None])], "band")


def _records():
    rec = _small_report().record()
    return [rec, dict(rec, workload="vsa_wan14b_720p")]


def test_readable_names():
    assert figstyle.workload_label("vsa_wan14b_720p") == "VSA · Wan2.1-14B 720p"
    assert figstyle.workload_label("my_layout") == "my_layout"
    assert figstyle.capture_label("nsa_32k") == "NSA-like 32K"
    assert figstyle.capture_label("dsa_8k") == "DSA-like 8K"
    assert figstyle.capture_label("my_capture") == "my_capture"
    assert figstyle.impl_label("flex") == "FlexAttention"
    assert figstyle.canonical_order(["mine", "svg2_wan14b_720p", "vsa_wan14b_720p"]) == [
        "vsa_wan14b_720p",
        "svg2_wan14b_720p",
        "mine",
    ]


def test_pair_unit_follows_the_largest_count():
    assert figstyle.pair_unit(3e11) == (1e9, "10⁹ pairs")
    assert figstyle.pair_unit(5e6) == (1e6, "10⁶ pairs")
    assert figstyle.pair_unit(5e3) == (1.0, "pairs")


def test_source_lines_fit_the_column():
    lines = figstyle.wrap_source("word " * 60)
    assert len(lines) > 1
    assert max(len(line) for line in lines) <= figstyle.ONE_COLUMN * 72 / (0.56 * figstyle.MIN_FONT_PT)


def test_a_path_longer_than_a_line_breaks_after_a_slash():
    name = "x" * 40 + ".json."
    assert figstyle.wrap_source(f"data: data/bench/{name} More.") == ["data: data/bench/", f"{name} More."]


@pytest.mark.parametrize(
    "draw",
    [
        lambda: capacity_bar_chart(_records(), source="a source line"),
        lambda: block_fill_histogram(_small_report().fill, title="t", source="s"),
    ],
    ids=["capacity", "block_fill"],
)
def test_figures_are_one_column_with_text_of_at_least_8pt(draw):
    fig = draw()
    fig.canvas.draw()
    assert fig.get_size_inches()[0] == pytest.approx(figstyle.ONE_COLUMN)
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
    assert texts
    small = [(t.get_text(), t.get_fontsize()) for t in texts if t.get_fontsize() < figstyle.MIN_FONT_PT]
    assert not small


def test_capacity_chart_labels_ratio_and_readable_names():
    fig = capacity_bar_chart(_records())
    texts = {t.get_text() for t in fig.findobj(Text)}
    rec = _records()[0]
    assert f"{rec['bsa_physical'] / rec['kpage_physical']:.2f}×" in texts
    assert "VSA · Wan2.1-14B 720p" in texts and "vsa_wan14b_720p" not in texts
    assert any("pairs" in t and "(" in t for t in texts)  # the axis states its unit


def test_save_rejects_unknown_extension_and_missing_folder(tmp_path):
    fig = capacity_bar_chart(_records())
    with pytest.raises(ValueError, match="extension"):
        figstyle.save(fig, tmp_path / "x.jpg")
    with pytest.raises(FileNotFoundError):
        figstyle.save(fig, tmp_path / "nope" / "x.png")


def test_saved_files_carry_no_dates_and_are_reproducible(tmp_path):
    first, second = tmp_path / "1", tmp_path / "2"
    first.mkdir()
    second.mkdir()
    figstyle.save_all(capacity_bar_chart(_records(), source="s"), first, "cap")
    figstyle.save_all(capacity_bar_chart(_records(), source="s"), second, "cap")
    for fmt in figstyle.FORMATS:
        assert (first / f"cap.{fmt}").read_bytes() == (second / f"cap.{fmt}").read_bytes(), fmt
    pdf = (first / "cap.pdf").read_bytes()
    assert b"CreationDate" not in pdf and b"Producer" not in pdf
    svg = (first / "cap.svg").read_text()
    assert "<dc:date>" not in svg
    assert re.search(r"font-family: 'DejaVu Sans'", svg)  # text stays text, in the bundled font
    from PIL import Image

    with Image.open(first / "cap.png") as png:
        assert png.info["dpi"][0] == pytest.approx(figstyle.PNG_DPI, abs=0.5)
        assert png.size[0] == round(figstyle.ONE_COLUMN * figstyle.PNG_DPI)


def test_output_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEATTN_FIGURES_DIR", str(tmp_path / "figs"))
    assert figstyle.output_dir() == tmp_path / "figs" and (tmp_path / "figs").is_dir()
