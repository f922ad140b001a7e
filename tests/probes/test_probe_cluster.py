"""Where the farm's tasks run (`--scheduler auto | inline | local | ADDRESS`): a small plan runs on one
Dask worker in this process, with the LocalCluster's results bit for bit and none of its start-up, and
the CLI says what the start-up cost beside the training (issue 21 item 10)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from probetest_lib import build_spatial_layers, python

from probes import parse_plan, run_plan
from probes.cluster import INLINE, LOCAL, SMALL_PLAN, resolve
from probes.farm import open_workspace

pytestmark = pytest.mark.slow  # spawns extraction or Dask processes per test

PLAN = {"name": "cluster", "probes": [
    {"runs": ["spatial"], "targets": ["truth:relation", "truth:flag_0"], "kinds": ["pooled"]},
    {"runs": ["spatial"], "targets": ["truth:flag_1"], "kinds": {"ridge": {"pool": "mean"}}},  # streamed
]}
N_LAYERS = 4
N_PROBES = N_LAYERS * 3


def test_auto_is_inline_for_a_small_plan_without_workers():
    assert resolve(None, None, SMALL_PLAN) == INLINE
    assert resolve("auto", None, SMALL_PLAN + 1) == LOCAL
    assert resolve(None, 2, 3) == LOCAL  # --workers asks for worker processes
    assert resolve("local", None, 1) == LOCAL and resolve("inline", 8, 10_000) == INLINE
    assert resolve("tcp://10.0.0.5:8786", None, 1) == "tcp://10.0.0.5:8786"


def _results(path: Path) -> tuple[list, list, dict[str, bytes]]:
    ws = open_workspace(path)
    rows = ws.rows("SELECT params->>'key', kind, target, layer, score, control_score, metric, n_train, n_test"
                   " FROM probes ORDER BY 1")
    predictions = ws.rows("SELECT * FROM probe_predictions ORDER BY ALL")
    weights = {p.name: p.read_bytes() for p in sorted((path / "probes").glob("*.safetensors"))}
    return rows, predictions, weights


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("cluster") / "base"
    build_spatial_layers(path, layers=N_LAYERS)
    return path


@pytest.fixture(scope="module")
def local(base, tmp_path_factory):
    path = tmp_path_factory.mktemp("local") / "ws"
    shutil.copytree(base, path)
    # One worker process, as inline has one thread: a streamed kind (ridge) sums its blocks in one
    # partition per worker, so its weights' last bits follow the worker count on any cluster.
    report = run_plan(parse_plan(PLAN), path, scheduler=LOCAL, workers=1, progress=False, log=lambda s: None)
    assert report.trained == N_PROBES and report.failed == 0 and report.workers == 1, report.failures
    return _results(path)


def test_inline_gives_the_local_clusters_results_exactly(base, local, tmp_path):
    shutil.copytree(base, tmp_path / "ws")
    lines: list[str] = []
    report = run_plan(parse_plan(PLAN), tmp_path / "ws", scheduler=INLINE, progress=False, log=lines.append)
    assert report.trained == N_PROBES and report.failed == 0 and report.workers == 1, report.failures
    rows, predictions, weights = _results(tmp_path / "ws")
    assert len(rows) == N_PROBES and len(weights) == N_PROBES and predictions
    assert (rows, predictions, weights) == local
    assert any(line.startswith("starting an in-process Dask worker") for line in lines), lines
    assert any(" ready in " in line for line in lines), lines


def test_the_cli_runs_a_small_plan_in_process_and_reports_its_wall_time(base, local, tmp_path):
    shutil.copytree(base, tmp_path / "ws")
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(PLAN))
    got = python("-m", "probes", str(tmp_path / "plan.yaml"), "--data", str(tmp_path / "ws"), "--no-progress",
                 env={"DASK_SCHEDULER_ADDRESS": ""}, timeout=300)
    assert got.returncode == 0, got.stderr[-3000:]
    assert f"starting an in-process Dask worker (auto: {N_PROBES} probes; --scheduler local" in got.stderr, got.stderr
    assert "dask: 1 worker(s) at inproc://" in got.stderr, got.stderr
    trained = next(line for line in got.stderr.splitlines() if " trained " in line)
    assert f"trained {N_PROBES} probes in " in trained and " s starting them" in trained, trained
    wall = next(line for line in got.stdout.splitlines() if line.startswith("wall time "))
    assert " s starting the workers, " in wall and " s training, " in wall, wall
    assert _results(tmp_path / "ws") == local
