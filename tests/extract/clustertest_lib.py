"""A Dask cluster started from Dask's own command lines, for the cluster extraction tests:
``dask scheduler`` and ``dask worker --resources GPU=1 --nthreads 1`` processes on loopback
(CPU standing in for GPUs), each worker with tests/extract/cluster_preload.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
from child_env import child_env, dask_cli
from waiting import wait_for

from store import Workspace

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# Every process of a comparison computes with one thread: fp32 sums in another order round apart.
ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


class Cluster:
    """A scheduler and ``n`` GPU-resource workers; ``markers`` is where the preload marks each batch."""

    def __init__(self, root: Path, n: int = 2, pause: float = 0.0, extra_env: dict[str, str] | None = None) -> None:
        self.root = root
        self.markers = root / "markers"
        self.markers.mkdir(parents=True, exist_ok=True)
        self.file = root / "scheduler.json"
        self.env = child_env(HERE, **ENV, AGNOSIA_TEST_MARKERS=str(self.markers), AGNOSIA_TEST_BATCH_SLEEP=str(pause),
                             **(extra_env or {}))
        self.procs: list[subprocess.Popen[bytes]] = []
        self.scheduler: subprocess.Popen[bytes] | None = None
        self.n = n

    def start(self) -> Cluster:
        self.file.unlink(missing_ok=True)
        self.scheduler = self._spawn(dask_cli("scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                                          "--scheduler-file", str(self.file)), "scheduler")
        wait_for(self.file.exists, 60)
        for i in range(self.n):
            self._spawn(dask_cli("worker", "--scheduler-file", str(self.file), "--nthreads", "1", "--resources", "GPU=1",
                             "--host", "127.0.0.1", "--no-dashboard", "--name", f"gpu{i}",
                             "--preload", str(HERE / "cluster_preload.py")), f"worker{i}")
        self.wait_workers(self.n)
        return self

    def _spawn(self, cmd: list[str], name: str) -> subprocess.Popen[bytes]:
        log = open(self.root / f"{name}.log", "ab")  # noqa: SIM115 - the process keeps it
        proc = subprocess.Popen(cmd, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    @property
    def address(self) -> str:
        return str(json.loads(self.file.read_text())["address"])

    def wait_workers(self, n: int, timeout: float = 90) -> None:
        from dask.distributed import Client

        with Client(self.address, timeout="30s", set_as_default=False) as client:
            client.wait_for_workers(n, timeout=timeout)

    def worker_facts(self, fn: Any) -> dict[str, Any]:
        """``fn(dask_worker)`` on every worker, by worker name."""
        from dask.distributed import Client

        with Client(self.address, timeout="30s", set_as_default=False) as client:
            out = client.run(fn)
            names = {a: w["name"] for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}
        return {names[a]: v for a, v in out.items()}

    def busy_worker_pid(self, timeout: float = 120) -> int:
        """The pid of a worker process that has started a batch (the newest marker)."""
        wait_for(lambda: any(self.markers.iterdir()), timeout)
        newest = max(self.markers.iterdir(), key=lambda p: p.stat().st_mtime)
        return int(newest.name.split("-")[0])

    def kill_scheduler(self) -> None:
        assert self.scheduler is not None
        self.scheduler.send_signal(signal.SIGKILL)
        self.scheduler.wait(10)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
                    os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
                p.wait(10)
        self.procs.clear()


def extract(*args: str, env: dict[str, str] | None = None, timeout: float = 300, wait: bool = True,
            cwd: Path = REPO) -> subprocess.CompletedProcess[str] | subprocess.Popen[str]:
    """``python -m extract ARGS`` as a process in ``cwd``, one thread, offline."""
    cmd = [sys.executable, "-m", "extract", *args, "--no-progress"]
    full = child_env(HERE, **ENV, **(env or {}))
    if not wait:
        return subprocess.Popen(cmd, cwd=cwd, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    return subprocess.run(cmd, cwd=cwd, env=full, capture_output=True, text=True, timeout=timeout)


def everything(path: Path, run: str) -> dict[str, Any]:
    """Every value and manifest row of ``run`` a reader sees (timestamps, hosts and pids left out)."""
    ws = Workspace.open(path, readonly=True)
    out: dict[str, Any] = {}
    for a in ws.arrays(run):
        values = ws.read(run, tap=a.tap, layer=a.layer, site=a.site, tokens=a.tokens)
        out[a.zarr_path] = values if isinstance(values, np.ndarray) else [v.tolist() for v in values]
    for table in ("runs", "activations", "chunks", "samples", "generations", "tensors", "vocab"):
        columns = [c[0] for c in ws.rows(f"DESCRIBE {table}") if not c[0].endswith("_at") and c[0] not in ("host", "pid")]
        out[table] = ws.rows(f"SELECT {', '.join(columns)} FROM {table} WHERE run = ? ORDER BY ALL", [run])
    return out


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        if isinstance(a[key], np.ndarray):
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
        else:
            assert a[key] == b[key], key
