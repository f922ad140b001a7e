"""`python -m probes P1 P2 ...`: several plans in one process (`make demo` trains three; each process
imported Dask and torch again). The probes recorded are those of separate invocations, and a plan
that does not fit the workspace stops the command before any plan trains."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from probetest_lib import build_workspace, probe_rows

from probes.cli import main
from store import Workspace


def _plan(path: Path, name: str, run: str, target: str, kind: str) -> str:
    path.write_text(yaml.safe_dump({"name": name, "defaults": {"seeds": [0]}, "probes": [
        {"runs": [run], "taps": ["vision"], "targets": [target], "kinds": [kind]}]}))
    return str(path)


@pytest.fixture
def plans(tmp_path: Path) -> list[str]:
    return [_plan(tmp_path / "a.yaml", "a", "go", "go.intersection", "linear"),
            _plan(tmp_path / "b.yaml", "b", "spatial", "spatial.relation", "pooled")]


@pytest.mark.slow
def test_many_plans_record_what_separate_invocations_record(tmp_path, plans, capsys):
    for name in ("one-by-one", "together"):
        build_workspace(tmp_path / name, n=48, families=("go", "spatial"))
    for plan in plans:
        assert main([plan, "--data", str(tmp_path / "one-by-one"), "--in-process", "--no-progress"]) == 0
    assert main([*plans, "--data", str(tmp_path / "together"), "--in-process", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert out.count("trained, 0 skipped (done), 0 failed") == 4, out  # a summary per plan and call
    one = probe_rows(Workspace.open(tmp_path / "one-by-one", readonly=True))
    assert len(one) == 4 and {r[1] for r in one} == {"go", "spatial"}  # two layers per plan
    assert probe_rows(Workspace.open(tmp_path / "together", readonly=True)) == one


def test_a_plan_that_does_not_fit_stops_the_command_before_any_plan_trains(tmp_path, plans, capsys):
    ws = tmp_path / "ws"
    build_workspace(ws, n=48, families=("go", "spatial"))
    bad = Path(_plan(Path(plans[1]), "b", "no-such-run", "spatial.relation", "pooled"))  # valid, but not here
    assert main([*plans, "--data", str(ws), "--in-process", "--no-progress"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {bad}: ") and "no-such-run" in lines[0], err
    assert probe_rows(Workspace.open(ws, readonly=True)) == []  # plan a, before it, trained nothing
