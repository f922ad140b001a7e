"""The dry run applies the run's own rules: what it lists as to-do is what the run trains."""

from __future__ import annotations

import pytest
import yaml
from probetest_lib import build_workspace, spatial_family, spatial_features, write_run

from probes import parse_plan, run_plan
from probes.cli import main
from store import Workspace

PLAN = {"name": "dry", "probes": [{"runs": "all", "taps": ["vision"], "layers": [-1], "where": "family = 'spatial'",
                                   "targets": ["spatial.relation"], "kinds": ["pooled"]}]}


def dry_run(plan_file, ws_path, capsys) -> str:
    assert main([str(plan_file), "--data", str(ws_path), "--dry-run"]) == 0
    return capsys.readouterr().out


def status_of(out: str, run: str) -> str:
    lines = [line.split() for line in out.splitlines() if f" {run} / vision / 1 /" in line]
    assert len(lines) == 1, out
    return lines[0][1]


@pytest.mark.slow
def test_dry_run_lists_probes_without_samples_as_skipped_and_the_run_trains_exactly_its_todo(tmp_path, capsys):
    ws_path = tmp_path / "ws"
    build_workspace(ws_path, n=48, families=("go", "spatial"))
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(yaml.safe_dump(PLAN))
    out = dry_run(plan_file, ws_path, capsys)
    assert "2 probes, 0 done, 1 to train in 1 Dask tasks, 1 skipped (no samples)" in out, out
    assert "skipped: 1 probes, their where selects no samples in: go (family = 'spatial')" in out
    assert status_of(out, "go") == "skipped" and status_of(out, "spatial") == "todo"
    assert "runs: all → 2 runs (go, spatial); this plan has not been trained in this workspace yet" in out

    logs: list[str] = []
    report = run_plan(parse_plan(PLAN), ws_path, in_process=True, progress=False, log=logs.append)
    assert (report.trained, report.empty, report.skipped) == (1, 1, 0)
    out = dry_run(plan_file, ws_path, capsys)
    assert "2 probes, 1 done, 0 to train in 0 Dask tasks, 1 skipped (no samples)" in out, out
    assert status_of(out, "spatial") == "done"


@pytest.mark.slow
def test_runs_all_says_which_runs_are_new_since_the_plan_was_last_trained(tmp_path, capsys):
    ws_path = tmp_path / "ws"
    build_workspace(ws_path, n=48, families=("spatial",))
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(yaml.safe_dump(PLAN))
    run_plan(parse_plan(PLAN), ws_path, in_process=True, progress=False, log=lambda s: None)
    assert "runs: all → 1 run (spatial); none new since the last training of this plan" in dry_run(
        plan_file, ws_path, capsys)

    rows, rel, latent = spatial_family(48, seed=7)
    write_run(Workspace.open(ws_path), "spatial-b", rows, [spatial_features(rel, latent, layer) for layer in (0, 1)],
              (2, 2))
    note = "runs: all → 2 runs (spatial, spatial-b); 1 new since the last training of this plan: spatial-b"
    out = dry_run(plan_file, ws_path, capsys)
    assert note in out and status_of(out, "spatial-b") == "todo", out
    logs: list[str] = []
    report = run_plan(parse_plan(PLAN), ws_path, in_process=True, progress=False, log=logs.append)
    assert report.trained == 1 and report.skipped == 1
    assert f"plan dry: {note}" in logs
    assert "none new since the last training of this plan" in dry_run(plan_file, ws_path, capsys)
