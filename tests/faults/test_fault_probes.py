"""The probe farm on a real Dask cluster (`dask scheduler` + two `dask worker` processes, each
under its nanny, on loopback) while its worker and its client are killed with SIGKILL."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from faultlib import REPO, env, wait_for

pytestmark = pytest.mark.slow  # fault injection drives real extraction or farm processes; `make faults` runs these

sys.path.insert(0, str(REPO / "tests" / "probes"))
from probetest_lib import build_spatial_layers, probe_rows  # noqa: E402

from probes import parse_plan, run_plan  # noqa: E402
from probes.artifacts import load as load_artifact  # noqa: E402
from probes.farm import done_keys, open_workspace, plan_tasks  # noqa: E402
from store.errors import ManifestBusyError  # noqa: E402

N_LAYERS = 16
PLAN = {
    "name": "faults",
    "plugins": ["fault_slow"],
    "probes": [{"runs": ["spatial"], "targets": ["spatial.relation", "truth:flag_0", "truth:flag_1"],
                "kinds": ["fault_pooled", "pooled"]}],
}
N_PROBES = N_LAYERS * 3 * 2  # one Dask task per layer, 6 probes each


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dask-faults")


@pytest.fixture(scope="module")
def slow_flag(folder) -> Path:
    return folder / "slow"


@pytest.fixture(scope="module")
def cluster(folder, slow_flag):
    """A scheduler and 2 workers (nanny-managed, 1 thread each) as real processes."""
    sched_file = folder / "scheduler.json"
    cluster_env = env(AGNOSIA_FAULT_SLOW_FLAG=str(slow_flag), AGNOSIA_FAULT_SLOW_S="1.0")
    common = {"cwd": REPO, "env": cluster_env, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    procs: list[subprocess.Popen] = []
    try:
        procs.append(subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                                       "--port", "0", "--no-dashboard", "--scheduler-file", str(sched_file)], **common))
        wait_for(lambda: sched_file.exists() and sched_file.stat().st_size > 0, timeout=60, step=0.1)
        address = json.loads(sched_file.read_text())["address"]
        for i in range(2):
            procs.append(subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", address, "--nthreads",
                                           "1", "--host", "127.0.0.1", "--no-dashboard", "--name", f"w{i}"], **common))
        from dask.distributed import Client

        with Client(address, timeout="30s") as c:
            c.wait_for_workers(2, timeout=120)
        yield address
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 5
        for p in procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def _count(ws) -> tuple[int, int]:
    try:
        return ws.rows("SELECT count(*), count(DISTINCT params->>'key') FROM probes")[0]
    except ManifestBusyError:
        return (0, 0)


def _farm(plan: Path, data: Path, address: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "probes", str(plan), "--data", str(data), "--scheduler", address,
                             "--no-progress"], cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_worker_and_client_killed_mid_plan_lose_and_duplicate_nothing(cluster, folder, slow_flag, tmp_path):
    """Injects: a `python -m probes PLAN --scheduler ADDR` client on a real cluster, slowed to
    1 s per Dask task (16 tasks, 96 probes, 2 workers); once its first results are recorded,
    SIGKILL of a worker process that has a task in flight (its nanny starts a new one); once more
    results are recorded, SIGKILL of the client itself. Then the same command again. Asserts:
    at the client's kill the plan was part done (0 < recorded < 96) and no key was recorded
    twice; the re-run reports the recorded probes as skipped and trains exactly the rest; the
    table then holds each of the 96 probe keys exactly once, equal (key, score, control, sizes)
    to an uninterrupted run of the plan on the same cluster, every row's safetensors artifact
    loads and names its key, and the plan has nothing left to train."""
    address = cluster
    base = folder / "base"
    if not base.exists():
        build_spatial_layers(base, layers=N_LAYERS)
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(yaml.safe_dump(PLAN))
    slow_flag.unlink(missing_ok=True)
    ref = tmp_path / "ref"
    shutil.copytree(base, ref)
    report = run_plan(parse_plan(PLAN), ref, scheduler=address, progress=False, log=lambda s: None)
    assert report.failed == 0 and report.trained == N_PROBES, report.failures
    want = probe_rows(open_workspace(ref))

    data = tmp_path / "ws"
    shutil.copytree(base, data)
    ws = open_workspace(data)
    slow_flag.touch()
    client = _farm(plan_file, data, address)
    try:
        wait_for(lambda: _count(ws)[0] > 0 or client.poll() is not None, timeout=120, step=0.05)
        assert client.poll() is None, client.communicate()
        from dask.distributed import Client

        with Client(address, timeout="30s") as c:
            pids = c.run(os.getpid)
            busy = wait_for(lambda: [w for w, keys in c.processing().items() if keys], timeout=30, step=0.01)
            os.kill(pids[busy[0]], signal.SIGKILL)
        after_worker = _count(ws)[0]
        wait_for(lambda: _count(ws)[0] > after_worker or client.poll() is not None, timeout=120, step=0.05)
        assert client.poll() is None, "the plan finished before the client could be killed"
        client.send_signal(signal.SIGKILL)
        client.wait(30)
    finally:
        if client.poll() is None:
            client.kill()
        client.wait(30)
        slow_flag.unlink(missing_ok=True)
    assert client.returncode == -signal.SIGKILL
    recorded, distinct = _count(ws)
    assert 0 < recorded < N_PROBES and recorded == distinct, (recorded, distinct)
    before = ws.rows("SELECT params->>'key', score, created_at FROM probes ORDER BY 1")

    again = subprocess.run([sys.executable, "-m", "probes", str(plan_file), "--data", str(data), "--scheduler", address,
                            "--no-progress"], cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{N_PROBES - recorded} trained, {recorded} skipped (done), 0 failed" in again.stdout, again.stdout
    assert ws.rows("SELECT count(*), count(DISTINCT params->>'key') FROM probes") == [(N_PROBES, N_PROBES)]
    assert probe_rows(ws) == want
    kept = {k: (s, t) for k, s, t in ws.rows("SELECT params->>'key', score, created_at FROM probes")}
    assert all(kept[k] == (s, t) for k, s, t in before), "a recorded probe was written again"
    for key, artifact in ws.rows("SELECT params->>'key', artifact FROM probes"):
        _, meta = load_artifact(data / artifact)
        assert meta["key"] == key
    tasks = plan_tasks(parse_plan(PLAN), ws)  # what `python -m probes PLAN --dry-run` lists
    assert len(tasks) == N_PROBES and done_keys(ws, ["spatial"]) == {t.key for t in tasks}
