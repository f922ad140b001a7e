"""A real Dask scheduler and two workers on loopback: same rows as a LocalCluster, and a worker
killed mid-plan loses no result and duplicates none."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
from child_env import child_env
from probetest_lib import HERE, REPO, build_spatial_layers, probe_rows, wait_for

from probes import parse_plan, run_plan
from probes.farm import open_workspace

PLAN = {
    "name": "dask",
    "plugins": ["probetest_slow"],
    "probes": [{"runs": ["spatial"], "targets": ["spatial.relation", "truth:flag_0", "truth:flag_1"],
                "kinds": ["slow_pooled", "pooled"]}],
}
N_LAYERS = 8
N_PROBES = N_LAYERS * 3 * 2


def _env():
    return child_env(HERE)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("dask") / "base"
    build_spatial_layers(path, layers=N_LAYERS)
    return path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """`dask scheduler` + 2 `dask worker` processes on 127.0.0.1, torn down whatever happens."""
    folder = tmp_path_factory.mktemp("cluster")
    sched_file = folder / "scheduler.json"
    procs: list[subprocess.Popen] = []
    common = {"cwd": REPO, "env": _env(), "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    try:
        procs.append(subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                                       "--port", "0", "--no-dashboard", "--scheduler-file", str(sched_file)], **common))
        wait_for(lambda: sched_file.exists() and sched_file.stat().st_size > 0, timeout=60)
        import json

        address = json.loads(sched_file.read_text())["address"]
        for i in range(2):
            procs.append(subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", address, "--nthreads", "1",
                                           "--no-nanny", "--host", "127.0.0.1", "--no-dashboard", "--name", f"w{i}"], **common))
        from dask.distributed import Client

        with Client(address, timeout="30s") as c:
            c.wait_for_workers(2, timeout=90)
        yield address, procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 3  # a graceful close can wait on peers; the test needs no grace
        for p in procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


@pytest.fixture(scope="module")
def local_rows(base, tmp_path_factory):
    path = tmp_path_factory.mktemp("local") / "ws"
    shutil.copytree(base, path)
    report = run_plan(parse_plan(PLAN), path, workers=2, progress=False, log=lambda s: None)
    assert report.failed == 0 and report.trained == N_PROBES, report.failures
    assert report.dashboard and report.dashboard.startswith("http://")
    return probe_rows(open_workspace(path))


@pytest.mark.slow
def test_scheduler_and_two_cli_workers_give_the_local_clusters_rows(cluster, base, local_rows, tmp_path):
    address, _ = cluster
    path = tmp_path / "ws"
    shutil.copytree(base, path)
    report = run_plan(parse_plan(PLAN), path, scheduler=address, progress=False, log=lambda s: None)
    assert report.failed == 0 and report.workers == 2
    ws = open_workspace(path)
    assert probe_rows(ws) == local_rows
    assert ws.rows("SELECT count(DISTINCT params->>'worker') FROM probes") == [(2,)]  # both workers took groups


@pytest.mark.slow
def test_worker_killed_mid_plan_loses_nothing_and_duplicates_nothing(cluster, base, local_rows, tmp_path):
    from dask.distributed import Client

    address, _ = cluster
    path = tmp_path / "ws"
    shutil.copytree(base, path)
    written: list[int] = []
    outcome: dict = {}

    def farm():
        try:
            outcome["report"] = run_plan(parse_plan(PLAN), path, scheduler=address, progress=False, flush_every=0.0,
                                         log=lambda s: None, on_record=lambda recs: written.append(len(recs)))
        except BaseException as err:  # surfaced by the assertions below
            outcome["error"] = err

    thread = threading.Thread(target=farm, daemon=True)
    thread.start()
    with Client(address, timeout="30s") as c:
        pids = c.run(os.getpid)
        wait_for(lambda: sum(written) >= 6 or not thread.is_alive(), timeout=60, step=0.02)
        # The victim is a worker with a group in flight, so that group's work is really lost.
        busy = wait_for(lambda: [w for w, keys in c.processing().items() if keys] or not thread.is_alive(), timeout=30, step=0.01)
        assert thread.is_alive() and isinstance(busy, list), "the plan finished before the kill"
        at_kill = sum(written)
        os.kill(pids[busy[0]], signal.SIGKILL)
    thread.join(120)
    assert not thread.is_alive() and "error" not in outcome, outcome.get("error")
    report = outcome["report"]
    assert at_kill < N_PROBES, "the kill must land mid-plan"
    assert report.failed == 0 and report.trained == N_PROBES
    ws = open_workspace(path)
    assert ws.rows("SELECT count(*), count(DISTINCT params->>'key') FROM probes") == [(N_PROBES, N_PROBES)]
    assert probe_rows(ws) == local_rows
    assert sum(written) == N_PROBES  # each result was written once
    # The survivor finished the plan; nothing to redo on a re-run.
    again = run_plan(parse_plan(PLAN), path, scheduler=address, progress=False, log=lambda s: None)
    assert again.trained == 0 and again.skipped == N_PROBES
    time.sleep(0.1)
