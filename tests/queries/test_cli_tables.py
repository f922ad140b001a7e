"""What the query CLI prints: whole run ids, readable INTERVALs, the leaderboard per site and per
test fraction (issue: run ids cut at 20 characters, ``MonthDayNano(...)`` cells, no site column,
seeds of plans with different test fractions averaged together)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from queries import run
from stimuli import get_family
from stimuli.io import write_set
from store import ProbeResult, RunInfo, Workspace

LONG = "toy-counter-go-resumed-on-a-second-machine"


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("tables")
    go = get_family("go")
    set_path = write_set(go, go.config(preset="small", counts="3-4"), n=1, seed=0, split="test", out=root / "go")
    ws = Workspace.open(root / "data")
    with ws.writer(RunInfo(run=LONG, model="hand-built")) as w:
        w.set_samples(w.register_stimulus_set(set_path))
        w.finish()
    # Two plans over the same probe: seeds 0-1 hold out 20 %, seeds 2-3 hold out 50 %.
    ws.record_probes([
        ProbeResult(run=LONG, tap="llm", layer=layer, site="resid_post", tokens="last", target="count", kind="linear",
                    seed=seed, score=score + 0.1 * layer, control_score=0.1,
                    params={"split": {"by": "hash", "seed": seed, "test_fraction": frac}})
        for layer in (0, 1) for seed, frac, score in ((0, 0.2, 0.8), (1, 0.2, 0.8), (2, 0.5, 0.4), (3, 0.5, 0.4))
    ])
    return Workspace.open(root / "data", readonly=True)


def cli(ws: Workspace, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "queries", "--data", str(ws.path), *args],
                          capture_output=True, text=True)


def test_best_probe_averages_seeds_of_one_test_fraction_only(ws):
    rows = ws.query("SELECT test_fraction, layer, n_seeds, round(score, 4) AS score FROM v_best_probe"
                    " ORDER BY test_fraction").to_pylist()
    assert rows == [{"test_fraction": 0.2, "layer": 1, "n_seeds": 2, "score": 0.9},
                    {"test_fraction": 0.5, "layer": 1, "n_seeds": 2, "score": 0.5}]


@pytest.mark.slow
def test_leaderboard_names_site_tokens_and_test_fraction(ws):
    board = run(ws, "probe_leaderboard").to_pylist()
    assert [(r["site"], r["tokens"], r["test_fraction"], r["n_seeds"]) for r in board] == [
        ("resid_post", "last", 0.2, 2), ("resid_post", "last", 0.5, 2)]
    out = cli(ws, "probe_leaderboard")
    assert out.returncode == 0 and LONG in out.stdout and "site" in out.stdout.splitlines()[0]


@pytest.mark.slow
def test_intervals_print_as_durations_in_every_format(ws, tmp_path):
    sql = "SELECT run, INTERVAL 78500 MILLISECOND AS took, INTERVAL 2 MONTH + INTERVAL 3 DAY AS span FROM runs"
    table = cli(ws, "--sql", sql)
    assert table.returncode == 0 and "MonthDayNano" not in table.stdout
    assert "00:01:18.5" in table.stdout and "2 months 3 days" in table.stdout and LONG in table.stdout
    csv = cli(ws, "--sql", sql, "--format", "csv")  # Arrow cannot write an interval to CSV at all
    assert csv.returncode == 0 and '"00:01:18.5"' in csv.stdout, csv.stderr
    js = json.loads(cli(ws, "--sql", sql, "--format", "json").stdout)
    assert js[0]["took"] == "00:01:18.5"
    assert cli(ws, "--sql", sql, "--format", "parquet", "--out", str(tmp_path / "t.parquet")).returncode == 0


@pytest.mark.slow
def test_probe_farm_summary_prints_whole_run_ids(tmp_path, capsys):
    from types import SimpleNamespace

    from probes.cli import _summary

    data = tmp_path / "data"
    Workspace.open(data).record_probes([ProbeResult(run=LONG, tap="llm", layer=0, target="count", kind="linear",
                                                    score=0.5, params={"key": "k0"})])
    report = SimpleNamespace(trained=1, skipped=0, failed=0, probes_per_s=1.0, gflops_per_s=1.0, workers=1,
                             startup_seconds=0.5, seconds=1.0)
    _summary(report, str(data), {"k0"}, wall=2.0)
    out = capsys.readouterr().out
    assert f"{LONG} llm/resid_post" in out
    assert "wall time 2.0 s: 0.5 s starting the workers, 1.0 s training, 0.5 s" in out


@pytest.mark.slow
def test_store_and_queries_print_one_table(ws):
    """`python -m store query` and `python -m queries --sql` render through one table function: the
    same SQL prints the same text (no trailing padding in either)."""
    sql = "SELECT run, stimulus, family FROM v_samples ORDER BY stimulus"
    store = subprocess.run([sys.executable, "-m", "store", "query", sql, "--data", str(ws.path)],
                           capture_output=True, text=True, check=True)
    queries = cli(ws, "--sql", sql)
    assert queries.returncode == 0, queries.stderr
    assert store.stdout == queries.stdout and LONG in store.stdout
    assert all(line == line.rstrip() for line in store.stdout.splitlines())
