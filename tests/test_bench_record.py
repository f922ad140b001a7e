"""bench/record.py: a run's figures become one JSON file, and docs/benchmarks.md's table is rebuilt
from the newest run of each benchmark part."""

from __future__ import annotations

import json

import pytest

from bench import record


def _run(results, monkeypatch, started, figures, topic="store"):
    monkeypatch.setattr(record, "_git", lambda *a: "abc1234def" if a[0] == "rev-parse" else "")
    run = record.start(["python", "-m", "bench", topic])
    run.started = started
    record.topic(topic)
    for part, name, value in figures:
        record.figure(part, name, value, "x", aim=">= 0.8x", setting="805 MB; median of 7")
    record.end_topic()
    return record.finish(results)


def test_a_run_is_one_file_with_commit_machine_and_load(tmp_path, monkeypatch):
    path = _run(tmp_path, monkeypatch, "2026-12-06T10:00:00Z", [("write", "writer / numpy", 0.73)])
    raw = json.loads(path.read_text())
    assert path.name == "2026-12-06T100000Z-store.json"
    assert raw["commit"] == "abc1234def" and raw["dirty"] is False
    assert raw["machine"]["cores"] >= 1 and len(raw["loads"]["store"]) == 2
    assert raw["figures"] == [{"topic": "store", "part": "write", "name": "writer / numpy", "value": 0.73,
                               "unit": "x", "aim": ">= 0.8x", "setting": "805 MB; median of 7"}]


def test_no_run_no_figures_no_file(tmp_path):
    record.figure("p", "outside a run", 1.0, "s")  # a notebook calling a bench function: no error, nothing kept
    assert record.finish(tmp_path) is None and not list(tmp_path.iterdir())


def test_the_table_takes_each_part_from_its_newest_run(tmp_path, monkeypatch):
    _run(tmp_path, monkeypatch, "2026-12-01T10:00:00Z", [("write", "ratio", 0.5), ("read", "ratio", 0.9),
                                                         ("write", "dropped since", 7.0)])
    _run(tmp_path, monkeypatch, "2026-12-02T10:00:00Z", [("write", "ratio", 0.75)])
    table = record.table(record.load_runs(tmp_path))
    assert "| store · write | ratio **0.75 x** | >= 0.8x | 805 MB; median of 7 | R2 |" in table
    assert "| store · read | ratio **0.9 x** |" in table and "R1 |" in table
    assert "dropped since" not in table  # the newer run of that part no longer records it
    assert "- commit abc1234, " in table and "R2 2026-12-02 10:00 UTC `store`" in table


def test_write_table_replaces_only_between_the_markers(tmp_path, monkeypatch):
    _run(tmp_path, monkeypatch, "2026-12-02T10:00:00Z", [("write", "ratio", 0.75)])
    doc = tmp_path / "bench.md"
    doc.write_text(f"intro\n{record.BEGIN}\nold table\n{record.END}\noutro\n")
    record.write_table(doc, tmp_path)
    text = doc.read_text()
    assert text.startswith(f"intro\n{record.BEGIN}\n| benchmark |") and text.endswith(f"{record.END}\noutro\n")
    assert "old table" not in text
    doc.write_text("no markers")
    with pytest.raises(SystemExit, match="no .* markers"):
        record.write_table(doc, tmp_path)


def test_the_committed_results_load_and_the_doc_table_is_current():
    runs = record.load_runs()
    assert runs, "bench/results/ holds the runs behind docs/benchmarks.md's figures"
    doc = record.REPO / "docs" / "benchmarks.md"
    assert record.table(runs) in doc.read_text(), "docs/benchmarks.md is stale: run `python -m bench table`"
