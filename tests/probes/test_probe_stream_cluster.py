"""A streamed plan on a real cluster started from Dask's own CLIs (`dask scheduler`, two
`dask worker --nworkers 1 --nthreads 1 --memory-limit 300MiB`), run by `python -m probes
--scheduler`: the same probes, scores and weights as on a LocalCluster (docs/probes.md)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from child_env import child_env, dask_cli
from probetest_lib import HERE, REPO, build_spatial_layers, probe_rows, python, wait_for

from probes import parse_plan, run_plan
from probes.artifacts import load
from probes.farm import open_workspace, plan_tasks
from probes.plan import group_tasks
from probes.prepare import JobBuilder
from probes.trainers.stream_specs import build_specs

PLAN = ("name: streamed\nmemory_limit: 300MiB\nprobes:\n  - runs: [spatial]\n"
        "    targets: ['spatial.relation', 'truth:flag_0']\n    seeds: [0, 1, 2]\n"
        "    kinds: {ridge: {alphas: [0.1, 10.0]}, lda: {shrinkage: 0.1}, nearest_centroid: {}}\n")
N_PROBES = 4 * 2 * 3 * 3   # layers x targets x kinds x seeds (ridge's and lda's seeds share one XᵀX pass)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 5   # a nanny's graceful close can wait on its peers; the test needs none
    for p in procs:
        try:
            p.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def _weights(path: Path) -> dict[str, dict[str, np.ndarray]]:
    ws = open_workspace(path)
    return {key: load(path / artifact)[0] for key, artifact in ws.rows("SELECT params->>'key', artifact FROM probes")}


@pytest.mark.slow
def test_streamed_plan_on_cli_scheduler_and_workers_equals_local_cluster(tmp_path):
    base = tmp_path / "base"
    build_spatial_layers(base, layers=4)
    (tmp_path / "plan.yaml").write_text(PLAN)
    local, remote = tmp_path / "local", tmp_path / "remote"
    shutil.copytree(base, local)
    shutil.copytree(base, remote)
    plan = parse_plan(yaml.safe_load(PLAN))
    ws = open_workspace(base)
    job = JobBuilder(ws, plan).job(group_tasks(plan_tasks(plan, ws))[0])
    shared = {g.kind.name: g.spec.shared for g in build_specs(job)}
    assert shared == {"ridge": True, "lda": True, "nearest_centroid": False}   # the Dask merges carry shared statistics
    # too; class means have no XᵀX to share
    rep = run_plan(plan, local, workers=2, progress=False, log=lambda s: None)
    assert rep.trained == N_PROBES and rep.failed == 0, rep.failures

    sched_file = tmp_path / "scheduler.json"
    env = child_env(HERE)
    common = {"cwd": REPO, "env": env, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(subprocess.Popen(dask_cli("scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                                            "--scheduler-file", str(sched_file)), **common))
        wait_for(lambda: sched_file.exists() and sched_file.stat().st_size > 0, timeout=60)
        address = json.loads(sched_file.read_text())["address"]
        for i in range(2):
            procs.append(subprocess.Popen(dask_cli("worker", "--scheduler-file", str(sched_file), "--nworkers", "1",
                                                "--nthreads", "1", "--memory-limit", "300MiB", "--host", "127.0.0.1",
                                                "--no-dashboard", "--name", f"w{i}"), **common))
        from dask.distributed import Client

        with Client(address, timeout="30s") as c:
            c.wait_for_workers(2, timeout=90)
            limits = [w["memory_limit"] for w in c.scheduler_info()["workers"].values()]
        assert limits == [300 << 20] * 2
        got = python("-m", "probes", str(tmp_path / "plan.yaml"), "--data", str(remote), "--scheduler", address,
                     "--no-progress", timeout=300)
        assert got.returncode == 0, got.stderr
        assert f"trained {N_PROBES} probes" in got.stderr and "on 2 worker(s)" in got.stderr
    finally:
        _stop(procs)
    assert probe_rows(open_workspace(remote)) == probe_rows(open_workspace(local))
    mine, theirs = _weights(remote), _weights(local)
    assert mine.keys() == theirs.keys() and len(mine) == N_PROBES
    for key, tensors in mine.items():     # the same partitions and merges: bit-identical weights
        assert all(np.array_equal(tensors[name], theirs[key][name]) for name in tensors), key
