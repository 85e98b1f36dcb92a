"""The count cache of the analysis (``sparseattn analyze --cache``): a second run of the same question
builds no graph and prints the same numbers; any other question is computed."""

import json

import pytest

from sparseattn import analysis, cli, countcache
from sparseattn.workloads import Selection, Workload

SVG2 = Workload(
    "small_svg2", "", 9, 2, 64, (4, 8, 8), None, Selection("svg2", q_clusters=5, k_clusters=7), 32
)
STA = Workload("small_sta", "", 2, 3, 64, (4, 8, 8), (2, 4, 4), Selection("sta", window=(1, 1, 1)), 32)


def _no_graphs(monkeypatch):
    def fail(self, *args, **kwargs):
        raise AssertionError(f"{self.name}: graphs built although cached")

    monkeypatch.setattr(Workload, "graphs", fail)


def test_second_run_reads_the_cache_and_counts_the_same(tmp_path, monkeypatch):
    first = analysis.analyze_workloads([SVG2, STA], seed=3, cache=tmp_path)
    assert len(list(tmp_path.glob("*.npz"))) == 4  # svg2: heads 0-3, 4-7, 8; sta: one slice
    _no_graphs(monkeypatch)
    seen = []
    second = analysis.analyze_workloads(
        [SVG2, STA], seed=3, cache=tmp_path, on_progress=lambda w, n: seen.append(n)
    )
    for a, b in zip(first, second):
        assert a.record() == b.record() and a.per_head_records() == b.per_head_records()
        for name in analysis._FILL_FIELDS:
            assert (getattr(a.fill, name) == getattr(b.fill, name)).all()
    assert sorted(seen) == [2, 4, 8, 9]


@pytest.mark.parametrize(
    "change",
    [dict(seed=4), dict(route="128x128"), dict(workloads=[SVG2.__class__(**{**SVG2.__dict__, "heads": 5})])],
    ids=["seed", "route", "workload"],
)
def test_another_question_is_computed(tmp_path, change):
    analysis.analyze_workloads([SVG2], seed=3, cache=tmp_path)
    before = set(tmp_path.glob("*.npz"))
    kwargs = dict(workloads=[SVG2], seed=3) | change
    analysis.analyze_workloads(cache=tmp_path, **kwargs)
    assert set(tmp_path.glob("*.npz")) > before


def test_counts_only_entries_do_not_serve_a_fill_request(tmp_path):
    (counts_only,) = analysis.analyze_workloads([STA], cache=tmp_path, fill=False)
    assert counts_only.fill is None
    (full,) = analysis.analyze_workloads([STA], cache=tmp_path)
    assert full.fill is not None and full.record() == counts_only.record()
    assert len(list(tmp_path.glob("*.npz"))) == 2


def test_the_code_digest_is_part_of_the_key(monkeypatch):
    key = countcache.slice_key(STA, None, 0, "auto", False)
    monkeypatch.setattr(countcache, "code_digest", lambda: "other code")
    assert countcache.slice_key(STA, None, 0, "auto", False) != key
    assert countcache.slice_key(object(), None, 0, "auto", False) is None


def test_an_unreadable_entry_is_a_miss(tmp_path):
    analysis.analyze_workloads([STA], cache=tmp_path)
    (entry,) = tmp_path.glob("*.npz")
    entry.write_bytes(b"not a zip")
    (report,) = analysis.analyze_workloads([STA], cache=tmp_path)
    assert report.record() == analysis.analyze_workload(STA).record()


def test_command_line_cache_gives_the_same_json(tmp_path, capsys, monkeypatch):
    module = type("M", (), {"WORKLOADS": {"small_svg2": SVG2}, "get_workload": staticmethod(lambda n: SVG2)})
    monkeypatch.setattr(cli, "_workloads_module", lambda: module)
    monkeypatch.setenv("SPARSEATTN_CACHE_DIR", str(tmp_path / "default"))
    assert cli.main(["analyze", "--format", "json"]) == 0
    plain = capsys.readouterr().out
    assert cli.main(["analyze", "--format", "json", "--cache"]) == 0
    assert capsys.readouterr().out == plain and list((tmp_path / "default").glob("*.npz"))
    _no_graphs(monkeypatch)
    assert cli.main(["analyze", "--format", "json", "--cache", str(tmp_path / "default")]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(plain)
