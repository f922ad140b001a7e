"""Shared helpers of the fault-injection suite (not a conftest, so sibling test folders never clash).

* :class:`Zygote` forks real extraction processes from one interpreter that has already imported
  torch and transformers (``fault_zygote.py``): a kill -9 and a resume cost the model load and
  the run, not 5-10 s of imports each time.
* :func:`kill_at_rename` kills a ``python -m store`` command at an exact point (``fault_pause.py``).
* :func:`snapshot` is everything a run leaves in a workspace, comparable value for value.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import waiting
import yaml
from child_env import child_env

from store import Workspace

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
TOY_MODEL = REPO / "lab" / "checkpoints" / "toy-counter"
ZYGOTE = HERE / "fault_zygote.py"

# Same thread count in every process that computes activations: fp32 sums in another order
# round apart, and the suite compares stores bit for bit.
ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def env(**extra: str) -> dict[str, str]:
    return child_env(HERE, **{**ENV, **extra})


def python(*args: str, timeout: float = 120, **kw: Any) -> subprocess.CompletedProcess[str]:
    """A real ``python ...`` process in the repository root."""
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env(), capture_output=True, text=True,
                          timeout=timeout, **kw)


def kill_at_rename(folder: Path, when: str, *store_args: str) -> subprocess.CompletedProcess[str]:
    """``python -m store STORE_ARGS`` killed with SIGKILL just ``before`` or ``after`` it renames
    ``folder`` (``fault_pause.py``): a kill at an exact point of a store command, not at a
    random delay. Returns the dead process's exit code (-9) and output."""
    proc = subprocess.Popen([sys.executable, str(HERE / "fault_pause.py"), str(folder), when, *store_args], cwd=REPO,
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if line == "paused":
            os.kill(proc.pid, 9)
    finally:
        out, err = proc.communicate(timeout=60)
    assert line == "paused", f"the command never reached the rename of {folder}: rc={proc.returncode}\n{err}"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


wait_for = partial(waiting.wait_for, timeout=60, step=0.02)


def go_set(out: Path, counts: str, seed: int = 1) -> Path:
    """Small Go boards (11x11, 88 px) through the real CLI: one board per count."""
    got = python("-m", "stimuli", "go", "--out", str(out), "--preset", "small", "--variation", "mild",
                 "--counts", counts, "--n", "1", "--seed", str(seed))
    assert got.returncode == 0, got.stderr
    return out


def write_manifest(path: Path, stimuli: Path, run: str = "toy", **extra: Any) -> Path:
    """The toy counting VLM with dense (image, last), ragged (answer, attention rows) arrays and
    run tensors: every kind of file the writer makes. Chunks of 4 samples, batches of 2, so a
    chunk is filled by two batches and a kill can land between them."""
    data = {
        "run": run,
        "model": {"path": str(TOY_MODEL), "dtype": "float32", "device": "cpu"},
        "stimuli": [{"set": str(stimuli), "task": "multimodal_num"}],
        "taps": [
            {"tap": "vision", "layers": [-1]},
            {"tap": "projector", "layers": 0},
            {"tap": "llm", "layers": [-1], "tokens": ["image", "last", "answer"]},
        ],
        "attention": {"layers": [-1], "queries": ["last"]},
        "generation": {"max_new_tokens": 4},
        "batch_size": 2,
        "chunk_samples": 4,
        **extra,
    }
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


class Zygote:
    """``fault_zygote.py`` as a subprocess; :meth:`start` forks one extraction process."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.proc = subprocess.Popen([sys.executable, str(ZYGOTE)], cwd=REPO, env=env(), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        ready = self._read()
        assert ready.get("ready"), ready
        self.children: set[int] = set()
        self._n = 0

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"the zygote exited: rc={self.proc.wait(10)}")
        return json.loads(line)

    def _send(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def start(self, manifest: Path, data: Path, *extra: str, batch_sleep: float = 0.0,
              fsize_limit: int | None = None, env: dict[str, str] | None = None) -> Child:
        """``python -m extract MANIFEST --data DATA --no-progress EXTRA`` in a fresh process."""
        self._n += 1
        log, progress = self.folder / f"child-{self._n}.log", self.folder / f"child-{self._n}.progress"
        got = self._send(op="run", argv=[str(manifest), "--data", str(data), "--no-progress", *extra], log=str(log),
                         progress=str(progress), batch_sleep=batch_sleep, fsize_limit=fsize_limit, env=env)
        self.children.add(got["pid"])
        return Child(self, got["pid"], log, progress)

    def run(self, manifest: Path, data: Path, *extra: str, **kw: Any) -> Child:
        child = self.start(manifest, data, *extra, **kw)
        child.wait()
        return child

    def reap(self, pid: int) -> int:
        rc = self._send(op="wait", pid=pid)["rc"]
        self.children.discard(pid)
        return rc

    def close(self) -> None:
        for pid in list(self.children):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
            self.reap(pid)
        try:
            self._send(op="quit")
        except (AssertionError, BrokenPipeError, OSError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


class Child:
    """One forked extraction process."""

    def __init__(self, zygote: Zygote, pid: int, log: Path, progress: Path) -> None:
        self.zygote, self.pid, self.log_path, self.progress_path = zygote, pid, log, progress
        self.rc: int | None = None

    def batches(self) -> int:
        """Batches the process has handed to the writer so far."""
        try:
            return self.progress_path.read_text().count("\n")
        except FileNotFoundError:
            return 0

    def alive(self) -> bool:
        """Running (a finished child stays a zombie until reaped: /proc says 'Z')."""
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except FileNotFoundError:
            return False
        return stat.rsplit(")", 1)[1].split()[0] != "Z"

    def kill(self) -> bool:
        """kill -9; True if the process was still running when the signal was sent."""
        running = self.alive()
        os.kill(self.pid, 9)
        self.wait()
        return running and self.rc == -9

    def fill_disk(self, limit: int) -> None:
        """From now on, the process's writes past ``limit`` bytes of any file fail with EFBIG (its
        RLIMIT_FSIZE, set from outside with prlimit; the zygote's children ignore SIGXFSZ)."""
        import resource

        hard = resource.prlimit(self.pid, resource.RLIMIT_FSIZE)[1]
        resource.prlimit(self.pid, resource.RLIMIT_FSIZE, (limit, hard))

    def wait(self) -> int:
        if self.rc is None:
            self.rc = self.zygote.reap(self.pid)
        return self.rc

    @property
    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""


def snapshot(data: Path, run: str = "toy") -> dict[str, Any]:
    """Everything a run stores, comparable across workspaces: every array's values, the chunk
    rows with their CRC-32C, row map and token spans, generations, run tensors, the run row."""
    ws = Workspace.open(data, readonly=True)
    out: dict[str, Any] = {}
    for a in ws.arrays(run):
        values = ws.read(run, tap=a.tap, layer=a.layer, site=a.site, tokens=a.tokens)
        out[a.zarr_path] = values if isinstance(values, np.ndarray) else (values.values, values.offsets)
    out["activations"] = ws.rows("SELECT * EXCLUDE (created_at) FROM activations WHERE run = ? ORDER BY ALL", [run])
    out["chunks"] = ws.rows("SELECT * EXCLUDE (committed_at) FROM chunks WHERE run = ? ORDER BY ALL", [run])
    out["samples"] = ws.rows("SELECT * EXCLUDE (recorded_at) FROM samples WHERE run = ? ORDER BY array_row", [run])
    out["generations"] = ws.rows("SELECT * EXCLUDE (recorded_at) FROM generations WHERE run = ? ORDER BY array_row",
                                 [run])
    out["tensors"] = ws.rows(
        "SELECT name, shape, stored_dtype, nbytes, crc32c FROM tensors WHERE run = ? ORDER BY name", [run])
    out["run"] = ws.rows("SELECT status, n_samples, chunk_samples FROM runs WHERE run = ?", [run])
    return out


def assert_same_store(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(got[key], value, err_msg=key)
        elif isinstance(value, tuple):
            np.testing.assert_array_equal(got[key][0], value[0], err_msg=key)
            np.testing.assert_array_equal(got[key][1], value[1], err_msg=key)
        else:
            assert got[key] == value, key


def committed(data: Path, run: str = "toy") -> set[tuple[str, int, int]]:
    """(array, chunk, crc32c) of every committed chunk; empty before the manifest exists."""
    if not (data / "manifest.duckdb").exists():
        return set()
    ws = Workspace(data.absolute())  # no open(): the zarr group may not exist yet, reading the manifest is enough
    rows = ws.rows("SELECT zarr_path, chunk, crc32c FROM chunks WHERE run = ?", [run])
    return {(p, int(c), int(crc)) for p, c, crc in rows}
