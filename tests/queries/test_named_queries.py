"""Named queries on hand-built workspaces where the right answer is known."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time

import pytest

from extract.scoring import score_answer
from queries import QueryError, available, run
from stimuli import get_family
from stimuli.io import read_set, write_set
from store import RunInfo, Workspace


def build_run(data, set_path, run, answer_for, stop_for=lambda r: None, config=None):
    """A run whose 'model' answers ``answer_for(row)`` for every stimulus of the set, stopping for
    ``stop_for(row)`` ('eos', 'cap' or None)."""
    rows = read_set(set_path).rows()
    ws = Workspace.open(data)
    with ws.writer(RunInfo(run=run, model="hand-built", config=config or {})) as w:
        keys = w.register_stimulus_set(set_path)
        w.set_samples(keys)
        gens = [dataclasses.replace(score_answer(r["family"], next(iter(r["prompts"])), answer_for(r), r["answer"],
                                                 r["truth"]), stop_reason=stop_for(r)) for r in rows]
        w.record_generations(0, gens)
        w.finish()
    return Workspace.open(data, readonly=True)


@pytest.fixture(scope="module")
def go_ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("q")
    go = get_family("go")
    set_path = write_set(go, go.config(preset="small", counts="45-54,100-101"), n=2, seed=0, split="test",
                         out=root / "go")
    return build_run(root / "data", set_path, "always49", lambda r: "4 9")


def table(ws, name, **params):
    return run(ws, name, {k: str(v) for k, v in params.items()}).to_pylist()


def test_a_model_that_always_answers_49(go_ws):
    regimes = {r["regime"]: r for r in table(go_ws, "counting_regimes")}
    assert regimes["ID"]["n"] == 10 and regimes["ID"]["accuracy"] == pytest.approx(0.2)  # the two 49-boards
    assert regimes["VE"]["accuracy"] == 0 and regimes["FE"]["accuracy"] == 0
    assert regimes["VE"]["mean_abs_error"] == pytest.approx(sum(abs(49 - c) for c in range(50, 55)) / 5)
    assert regimes["FE"]["mean_digits"] == 2 and regimes["FE"]["empty_rate"] == 0
    assert regimes["FE"]["number_rate"] == 1 and regimes["FE"]["runaway_rate"] == 0
    attractors = [r for r in table(go_ws, "attractors") if r["regime"] == "VE"]
    assert attractors == [{"run": "always49", "regime": "VE", "prediction": 49, "n": 10, "share": 1.0,
                           "lift": 1.0, "kind": "boundary", "answer": None, "max_new_tokens": None}]


# VE boards 50..53 (two each): the model says False, nothing, a number, or runs into the cap.
MIXED = {50: ("False", "eos"), 51: ("", "eos"), 52: ("4 9", "eos"), 53: ("1 1 0 1 0 0 0 1 1 0", "cap")}


@pytest.fixture(scope="module")
def mixed_ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixed")
    go = get_family("go")
    set_path = write_set(go, go.config(preset="small", counts="50-53"), n=2, seed=0, split="test", out=root / "go")
    return build_run(root / "data", set_path, "mixed", lambda r: MIXED[r["truth"]["count"]][0],
                     lambda r: MIXED[r["truth"]["count"]][1], config={"generation": {"max_new_tokens": 10}})


def test_word_empty_and_runaway_answers_are_their_own_outcomes(mixed_ws):
    (ve,) = table(mixed_ws, "counting_regimes")
    assert (ve["regime"], ve["n"], ve["max_new_tokens"], ve["accuracy"]) == ("VE", 8, "10", 0)
    rates = {k: ve[f"{k}_rate"] for k in ("number", "runaway", "word", "empty")}
    assert rates == {"number": 0.25, "runaway": 0.25, "word": 0.25, "empty": 0.25}
    # the error is the number answers' (49 for 52 boards), never the cut runaway's digits joined
    assert (ve["mean_abs_error"], ve["mean_digits"], ve["stop_unknown"]) == (3.0, 2.0, 0)
    assert table(mixed_ws, "attractors") == []  # four groups at 0.25 each: an even spread (lift 1), no attractor
    rows = {r["kind"]: r for r in table(mixed_ws, "attractors", min_lift=1)}
    assert set(rows) == {"word", "empty", "runaway", "boundary"}
    assert (rows["word"]["answer"], rows["word"]["prediction"], rows["word"]["n"]) == ("False", None, 2)
    assert rows["runaway"]["prediction"] is None and rows["runaway"]["max_new_tokens"] == "10"
    assert all(r["share"] == 0.25 and r["lift"] == 1.0 for r in rows.values())


def test_accuracy_counts_every_sample(go_ws):
    (row,) = table(go_ws, "accuracy")
    assert (row["family"], row["n"], row["accuracy"], row["parse_rate"]) == ("go", 24, pytest.approx(2 / 24, abs=1e-4), 1.0)
    with pytest.raises(QueryError, match="names no run"):  # not an empty table that reads as an answer
        table(go_ws, "accuracy", run="'nope'")


@pytest.mark.slow
def test_g2m_metrics_use_the_papers_denominators(tmp_path):
    g2m = get_family("g2m")
    set_path = write_set(g2m, g2m.config(grid_sizes=(3, 6), colors=(3,)), n=2, seed=0, split="test",
                         out=tmp_path / "g2m")
    # Perfect on 3x3 grids, unparseable on 6x6 grids.
    ws = build_run(tmp_path / "data", set_path, "half",
                   lambda r: r["answer"] if r["params"]["grid_size"] == 3 else "I cannot tell")
    rows = {r["grid_size"]: r for r in table(ws, "g2m_metrics")}
    assert (rows[3]["exact_match"], rows[3]["cell_accuracy"], rows[3]["parse_failures"]) == (1.0, 1.0, 0)
    assert (rows[6]["exact_match"], rows[6]["cell_accuracy"], rows[6]["parse_failures"]) == (0.0, 0.0, 2)


@pytest.mark.slow
def test_every_named_query_runs_fast_on_a_workspace(go_ws):
    for name, query in available().items():
        required = {p.name: "always49" for p in query.params if p.default is None}  # e.g. two run ids to compare
        started = time.perf_counter()
        run(go_ws, name, required)
        assert time.perf_counter() - started < 5  # the benchmark reports the real figure


def test_unknown_query_and_parameter_name_the_fix(go_ws):
    with pytest.raises(QueryError, match="choose one of"):
        run(go_ws, "nope", {})
    with pytest.raises(QueryError, match="has no parameter colour"):
        run(go_ws, "accuracy", {"colour": "red"})


def cli(*args):
    return subprocess.run([sys.executable, "-m", "queries", *args], capture_output=True, text=True)


@pytest.mark.slow
def test_cli_is_read_only(go_ws):
    data = str(go_ws.path)
    refused = cli("--data", data, "--sql", "DELETE FROM generations")
    assert refused.returncode == 2 and "read-only" in refused.stderr
    assert go_ws.rows("SELECT count(*) FROM generations") == [(24,)]


@pytest.mark.slow
def test_cli_formats(go_ws, tmp_path):
    data = str(go_ws.path)
    out = cli("--data", data, "counting_regimes", "--format", "csv")
    assert out.returncode == 0 and out.stdout.splitlines()[0].startswith('"run","regime"')
    js = cli("--data", data, "accuracy", "--format", "json", "--param", "run=always49")
    assert '"accuracy": 0.0833' in js.stdout
    pq_out = tmp_path / "a.parquet"
    assert cli("--data", data, "accuracy", "--format", "parquet", "--out", str(pq_out)).returncode == 0
    assert pq_out.stat().st_size > 0
    listing = cli("--list")
    assert all(name in listing.stdout for name in available())
    schema = cli("--data", data, "--schema")
    assert "generations" in schema.stdout and "prediction" in schema.stdout
