"""`sparseattn figures`: every committed figure regenerates from code and data/ (SVGs equal to 0.01 of a
point: the counts behind them go through BLAS and k-means, whose last bits vary between library builds)."""

import re
import subprocess
from pathlib import Path

import matplotlib
import pytest
from matplotlib.text import Text

from sparseattn import cli, figstyle, figures

COMMITTED = figures.DEFAULT_OUT


@pytest.fixture(scope="module")
def inputs():
    return figures.Inputs()


@pytest.fixture(scope="module")
def generated(inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("figures")
    return out, figures.regenerate(out, inputs=inputs)


def test_every_figure_with_data_is_written_in_three_formats(generated):
    out, paths = generated
    stems = {p.stem for p in paths}
    assert {
        "kpage_capacity",
        "kpage_block_fill",
        "kpage_speed",
        "pageweaver_page_loads",
        "pageweaver_union_sizes",
    } <= stems
    for stem in stems:
        for fmt in figstyle.FORMATS:
            assert (out / f"{stem}.{fmt}").stat().st_size > 1000


def test_regenerating_gives_identical_bytes(generated, inputs, tmp_path):
    out, paths = generated
    again = figures.regenerate(tmp_path, inputs=inputs)
    assert [p.name for p in again] == [p.name for p in paths]
    for p in again:
        assert p.read_bytes() == (out / p.name).read_bytes(), p.name


def _committed_files() -> list[str]:
    """Figure files of figures/ that git tracks (the folder itself where git is not available)."""
    try:
        done = subprocess.run(
            ["git", "ls-files", "figures"], cwd=COMMITTED.parent, capture_output=True, text=True, check=True
        )
        names = [Path(line).name for line in done.stdout.split()]
    except (OSError, subprocess.CalledProcessError):
        names = [p.name for p in COMMITTED.iterdir()]
    return sorted(n for n in names if n.rsplit(".", 1)[-1] in figstyle.FORMATS)


def _writer_version(svg_path) -> str | None:
    match = re.search(r"Matplotlib v([0-9][^,<\s]*)", svg_path.read_text())
    return match.group(1) if match else None


def test_committed_figures_are_what_the_code_draws(generated):
    """The committed figures equal a fresh regeneration, i.e. `sparseattn figures` leaves git clean
    (compared when the installed matplotlib is the one that wrote them; its SVG says which)."""
    paths = generated[1]
    assert _committed_files() == sorted(p.name for p in paths), "figures/ holds stale or missing files"
    version = _writer_version(COMMITTED / "kpage_capacity.svg")
    if version != matplotlib.__version__:
        pytest.skip(
            f"committed figures were written by matplotlib {version}, this is {matplotlib.__version__}"
        )
    changed = [
        p.name
        for p in paths
        if p.suffix == ".svg" and _rounded(p.read_text()) != _rounded((COMMITTED / p.name).read_text())
    ]
    assert not changed, f"regenerate with `sparseattn figures`: {changed}"


def _rounded(svg: str) -> str:
    """The SVG with every decimal number rounded to two places (path coordinates, sizes)."""
    return re.sub(r"-?\d+\.\d+", lambda m: f"{float(m.group()):.2f}", svg)


@pytest.mark.parametrize("spec", figures.FIGURES, ids=figures.FIGURE_NAMES)
def test_figures_are_one_column_with_readable_text(spec, inputs):
    fig = spec.draw(inputs)
    if fig is None:
        pytest.skip(f"{spec.stem}: {spec.missing}")
    fig.canvas.draw()
    assert fig.get_size_inches()[0] == pytest.approx(figstyle.ONE_COLUMN)
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
    assert all(t.get_fontsize() >= figstyle.MIN_FONT_PT for t in texts)
    joined = re.sub(r"\S+\.json", "", " ".join(t.get_text() for t in texts))  # data files keep their names
    assert not re.search(r"\b(vsa|ssta|sta|svg2)_\w+", joined), "snake_case workload ids in a figure"
    assert not re.search(r"\b(nsa|dsa)_\d+k\b", joined), "snake_case capture ids in a figure"


def test_page_loads_figure_states_page_size_and_affinity_gain(inputs):
    fig = figures.page_loads_figure(inputs)
    fig.canvas.draw()
    text = " ".join(" ".join(t.get_text().split()) for t in fig.findobj(Text))
    assert "pages of 64 tokens" in text
    rows = {(r["capture"], r["grouping"]): r["page_loads"] for r in inputs.capture_rows}
    gain = 100 * (1 - rows[("nsa_32k", "affinity")] / rows[("nsa_32k", "adjacent")])
    assert f"{gain:.1f}%" in text


def test_cli_figures_only(tmp_path, capsys):
    code = cli.main(
        ["figures", "--out", str(tmp_path), "--only", "pageweaver_speed", "--only", "kpage_speed"]
    )
    err = capsys.readouterr().err
    assert code == 0 and "wrote" in err
    assert (tmp_path / "kpage_speed.svg").is_file() and (tmp_path / "pageweaver_speed.svg").is_file()
    assert not (tmp_path / "kpage_capacity.svg").exists()  # only what was asked for


def test_cli_figures_skips_a_figure_without_data(tmp_path, capsys):
    empty = tmp_path / "bench"
    empty.mkdir()
    code = cli.main(
        ["figures", "--out", str(tmp_path), "--only", "pageweaver_speed", "--bench-dir", str(empty)]
    )
    err = capsys.readouterr().err
    assert code == 0
    assert "skipped pageweaver_speed: no recorded complete-call benchmark yet" in err
    assert not (tmp_path / "pageweaver_speed.png").exists()


def test_cli_figures_errors(tmp_path, capsys):
    assert cli.main(["figures", "--out", str(tmp_path / "missing" / "figs")]) == cli.EXIT_USER_ERROR
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(["figures", "--out", str(tmp_path), "--only", "no_such_figure"]) == cli.EXIT_USER_ERROR
    assert "kpage_capacity" in capsys.readouterr().err  # the error lists the figures
