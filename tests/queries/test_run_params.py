"""A query parameter that names a run is checked against the runs table (issue: `run=toy-go`
printed a bare header and exit 0 where the run is `toy-counter-go`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from extract.scoring import score_answer
from queries import QueryError, run
from stimuli import get_family
from stimuli.io import read_set, write_set
from store import RunInfo, Workspace


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("params")
    go = get_family("go")
    set_path = write_set(go, go.config(preset="small", counts="3-4"), n=1, seed=0, split="test", out=root / "go")
    rows = read_set(set_path).rows()
    ws = Workspace.open(root / "data")
    for name in ("toy-counter-go", "toy-counter-text"):
        with ws.writer(RunInfo(run=name, model="hand-built")) as w:
            w.set_samples(w.register_stimulus_set(set_path))
            w.record_generations(0, [score_answer(r["family"], next(iter(r["prompts"])), "3", r["answer"], r["truth"])
                                     for r in rows])
            w.finish()
    return Workspace.open(root / "data", readonly=True)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "queries", *args], capture_output=True, text=True)


@pytest.mark.slow
def test_a_run_parameter_naming_no_run_is_one_line_with_did_you_mean(ws):
    out = cli("counting_regimes", "--data", str(ws.path), "--param", "run=toy-go")
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1
    assert "run=toy-go names no run" in out.stderr and "did you mean toy-counter-go" in out.stderr


def test_every_parameter_that_names_a_run_is_checked(ws):
    with pytest.raises(QueryError, match="--param b=toy-heads-text names no run"):
        run(ws, "head_overlap", {"a": "toy-counter-go", "b": "toy-heads-text"})
    with pytest.raises(QueryError, match="names no run"):
        run(ws, "probe_leaderboard", {"run": "qwen%"})


def test_existing_runs_and_patterns_still_answer(ws):
    assert {r["run"] for r in run(ws, "accuracy", {"run": "toy-counter-%"}).to_pylist()} == {
        "toy-counter-go", "toy-counter-text"}
    assert [r["run"] for r in run(ws, "accuracy", {"run": "toy-counter-go"}).to_pylist()] == ["toy-counter-go"]
