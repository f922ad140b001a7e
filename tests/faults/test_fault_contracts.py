"""Faults of issue 40, each injected for real: a planted symlink as ``writer.lock``, a flipped byte
in a derived chunk, a derive or a plan racing a drop-run, a read-only workspace, a full disk
while deriving. Each asserts one specific error line or data equality, never only "no crash"."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from faultlib import REPO, env

sys.path.insert(0, str(REPO / "tests" / "probes"))
from probetest_lib import spatial_family, spatial_features, write_run  # noqa: E402

from probes import parse_plan, run_plan  # noqa: E402
from probes.cli import main as probes_cli  # noqa: E402
from probes.derived import derive  # noqa: E402
from probes.derived import main as derive_cli  # noqa: E402
from probes.features import read_features  # noqa: E402
from probes.pooling import pool  # noqa: E402
from store import Workspace  # noqa: E402
from store import arrays as layout  # noqa: E402
from store import derived as store_derived  # noqa: E402
from store.errors import WriterLockError  # noqa: E402
from store.lock import RunLock, WriterLock  # noqa: E402

N = 100
QUIET = {"progress": False, "log": lambda s: None}
PLAN = {"name": "contracts", "defaults": {"seeds": [0]},
        "probes": [{"runs": ["spatial"], "layers": [1], "targets": ["spatial.relation"],
                    "kinds": {"pooled": {"pool": "mean"}}}]}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ws = Workspace.open(tmp_path_factory.mktemp("contracts") / "ws")
    rows, rel, latent = spatial_family(N)
    write_run(ws, "spatial", rows, [spatial_features(rel, latent, layer) for layer in (0, 1)], (2, 2))
    return ws.path


@pytest.fixture
def ws(base: Path, tmp_path: Path) -> Workspace:
    shutil.copytree(base, tmp_path / "ws")
    return Workspace.open(tmp_path / "ws")


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ----------------------------------------------------------------------------- 1. symlinked lock

@pytest.mark.parametrize("dangling", [False, True])
def test_a_symlinked_writer_lock_is_refused_and_its_target_never_touched(ws, tmp_path, dangling):
    """Injects: ``writer.lock`` replaced by a symlink to a file outside the workspace (or to a
    path that does not exist). Asserts: taking the lock (a writer, drop-run) raises one error
    naming the link and the fix; the target keeps its bytes (was: truncated to the lock's JSON),
    a dangling link's target is never created."""
    target = tmp_path / "precious.txt"
    if not dangling:
        target.write_text("a file outside the workspace\n")
    lock = ws.path / "writer.lock"
    lock.unlink(missing_ok=True)
    lock.symlink_to(target)
    with pytest.raises(WriterLockError) as err:
        WriterLock(lock, run="toy").acquire()
    assert f"the lock file {lock} is a symbolic link" in str(err.value) and f"rm {lock}" in str(err.value)
    with pytest.raises(WriterLockError, match="is a symbolic link"):
        ws.drop_run("spatial")
    if dangling:
        assert not target.exists()
    else:
        assert target.read_text() == "a file outside the workspace\n"
    assert ws.rows("SELECT status FROM runs") == [("finished",)]


# ----------------------------------------------------------------------------- 2. derived checksums

def _flip_derived_byte(ws: Workspace, info: store_derived.DerivedInfo, chunk: int) -> Path:
    f = ws.zarr_path / info.zarr_path / layout.chunk_file_key(len(info.shape), chunk)
    data = bytearray(f.read_bytes())
    data[40] ^= 0x10
    f.write_bytes(bytes(data))
    return f


@pytest.mark.slow
def test_a_flipped_byte_in_a_derived_chunk_fails_verify_and_is_never_read_as_data(ws):
    """Injects: one bit of derived chunk 2 flipped after `probes derive`. Asserts: each derived
    chunk's CRC-32C is in its row; `verify` reports that chunk's checksum mismatch (was "ok": only
    its size was checked); a plan (derive: auto) re-derives it and trains on values equal, to
    the bit, to pooling the tokens (was: trained on the damaged vector)."""
    source = ws.array_info("spatial", "vision", 1)
    info = derive(ws, source, "mean")
    assert info.chunk_crc32c is not None and len(info.chunk_crc32c) == info.n_chunks
    assert store_derived.find(ws, source, "pool_mean") == info
    assert ws.verify().ok
    damaged = _flip_derived_byte(ws, info, 2)
    rep = ws.verify()
    assert [p for p in rep.problems if "derived array" in p] == [
        f"derived array {info.zarr_path}: chunk 2 (rows 50-74) checksum mismatch: its bytes changed after it was"
        f" derived ({damaged}); derive it again: python -m probes derive --run spatial --pool mean"], rep.problems
    assert store_derived.damaged_chunks(ws, info) == [
        f"chunk 2 (rows 50-74) checksum mismatch: its bytes changed after it was derived ({damaged})"]

    logs: list[str] = []
    run_plan(parse_plan(PLAN), ws.path, in_process=True, progress=False, log=logs.append)
    assert any("refreshed" in line for line in logs), logs
    fresh = store_derived.find(ws, source, "pool_mean")
    assert fresh is not None and store_derived.damaged_chunks(ws, fresh) == []
    rows = np.arange(N)
    assert read_features(ws.root, fresh.array_info(), rows).tobytes() == pool(read_features(ws.root, source, rows),
                                                                               "mean").tobytes()
    assert ws.verify().ok


def test_a_damaged_derived_array_under_derive_never_pools_on_the_fly_and_derive_repairs_it(ws, capsys):
    """Injects: a flipped byte in a derived chunk, then a plan with `derive: never` and a second
    `probes derive`. Asserts: `verify` names the chunk (was "ok"); the plan pools the tokens, saying why in one log line; `derive`
    recomputes the damaged array (it said "up to date") and the array verifies again."""
    source = ws.array_info("spatial", "vision", 1)
    damaged = _flip_derived_byte(ws, derive(ws, source, "mean"), 0)
    assert any(p.endswith(f"chunk 0 (rows 0-24) checksum mismatch: its bytes changed after it was derived ({damaged});"
                          " derive it again: python -m probes derive --run spatial --pool mean")
               for p in ws.verify().problems)
    logs: list[str] = []
    run_plan(parse_plan({**PLAN, "derive": "never"}), ws.path, in_process=True, progress=False, log=logs.append)
    assert any("checksum mismatch" in line and "pooling on the fly" in line for line in logs), logs
    assert derive_cli(["--data", str(ws.path), "--run", "spatial", "--layer", "1"]) == 0
    assert "recomputed: chunk 0 (rows 0-24) checksum mismatch" in capsys.readouterr().out
    assert ws.verify().ok


# ----------------------------------------------------------------------------- 3. derive and drop-run

def test_derive_takes_the_writer_lock(ws, capsys):
    """Injects: a drop-run (or any writer) holding ``writer.lock`` while `probes derive` starts.
    Asserts: derive exits 2 with the lock's one line naming the holder; no derived_arrays row and
    no derived folder appear (was: it wrote beside the drop, leaving rows of a dropped run)."""
    with WriterLock(ws.path / "writer.lock", run="drop-run spatial"):
        assert derive_cli(["--data", str(ws.path), "--run", "spatial"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: the workspace {ws.path} is being written by pid {os.getpid()}")
    assert "drop-run spatial" in err[0]
    assert ws.rows("SELECT count(*) FROM derived_arrays") == [(0,)]
    assert not (ws.zarr_path / "spatial" / "_derived").exists()


def test_drop_run_waits_for_a_plan_reading_the_run_then_refuses(ws):
    """Injects: a plan holding its run's readers' lock (as `python -m probes PLAN` does while it
    trains) when `drop-run` starts. Asserts: drop-run waits its timeout, then refuses in one
    line naming the run and the fix; every row and file of the run is still there."""
    before = _files(ws.zarr_path)
    with RunLock(ws.path, "spatial"):
        with pytest.raises(WriterLockError) as err:
            ws.drop_run("spatial", timeout=0.3)
    assert str(err.value).startswith("run spatial is being read by a probe plan")
    assert "then drop the run again" in str(err.value)
    assert ws.rows("SELECT status FROM runs") == [("finished",)] and _files(ws.zarr_path) == before
    ws.drop_run("spatial")  # the plan gone, the drop goes through
    assert ws.rows("SELECT count(*) FROM runs") == [(0,)]


def test_a_plan_on_a_run_being_dropped_refuses_in_one_line(ws, tmp_path, capsys):
    """Injects: a drop-run of the plan's run in progress (its readers' lock held exclusive) when
    `python -m probes PLAN` starts. Asserts: exit 2 and one line saying the run is being
    dropped (was: reads failing mid-plan with "missing on disk ... re-extract the run"); no probe."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(PLAN))
    with RunLock(ws.path, "spatial", exclusive=True):
        assert probes_cli([str(plan), "--data", str(ws.path), "--in-process", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: run spatial is being dropped (python -m store drop-run) from {ws.path}: once that ends the"
                   " run is gone; re-extract it first if the plan still needs it"]
    assert ws.rows("SELECT count(*) FROM probes") == [(0,)]


# ----------------------------------------------------------------------------- 5. one line, not a traceback

def _derive_with_file_limit(ws: Path, limit: int) -> subprocess.CompletedProcess[str]:
    """`python -m probes derive` whose files may not grow past ``limit`` bytes: EFBIG, as a full disk's ENOSPC."""
    code = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN);"
            f" resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}));"
            "from probes.cli import main; sys.exit(main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, "derive", "--data", str(ws), "--run", "spatial"], cwd=REPO,
                          env=env(), capture_output=True, text=True, timeout=120)


def test_a_full_disk_while_deriving_is_one_line_and_registers_nothing(ws):
    """Injects: a file-size limit below one derived chunk (EFBIG, as a full disk fails writes
    with ENOSPC) for a real `python -m probes derive`. Asserts: exit 2, one `error: disk full …`
    line naming the chunk file and the fix, no traceback (was a traceback), no derived_arrays row."""
    got = _derive_with_file_limit(ws.path, 1024)
    lines = got.stderr.strip().splitlines()
    assert got.returncode == 2, got.stderr
    assert "Traceback" not in got.stderr and all(line.startswith("error: disk full / file too large") for line in lines)
    assert f"{ws.zarr_path}/spatial/_derived/" in lines[0] and "free space on that file system" in lines[0]
    assert ws.rows("SELECT count(*) FROM derived_arrays") == [(0,)]


def _can_mount() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _can_mount(), reason="needs a private mount namespace (unshare -m, CAP_SYS_ADMIN)")
def test_a_read_only_workspace_is_refused_by_derive_and_by_a_plan_before_any_work(ws, tmp_path):
    """Injects: the workspace on a read-only bind mount (EROFS, even for root), then a real
    `python -m probes derive` and a real `python -m probes PLAN`. Asserts: each exits 2 with one
    line saying the workspace is on a read-only file system and how to fix it, before training
    (the plan used to train every probe, then fail every weight save); every file unchanged."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(PLAN))
    before = _files(ws.path)
    data = ws.path
    for args in (["derive", "--data", str(data), "--run", "spatial"],
                 [str(plan), "--data", str(data), "--in-process", "--no-progress"]):
        script = (f'mount --bind "{data}" "{data}" && mount -o remount,bind,ro "{data}" && touch "{data}/x" 2>/dev/null'
                  f' && echo "mount is writable" && exit 9; exec "{sys.executable}" -m probes '
                  + " ".join(f'"{a}"' for a in args))
        got = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], cwd=REPO, env=env(),
                             capture_output=True, text=True, timeout=120)
        lines = got.stderr.strip().splitlines()
        assert got.returncode == 2, got.stdout + got.stderr
        assert len(lines) == 1 and lines[0].startswith(f"error: the workspace {data} is on a read-only file system")
        assert "remount it read-write" in lines[0]
    assert _files(ws.path) == before


def test_an_unknown_storage_option_is_one_line_and_leaves_no_manifest(tmp_path, monkeypatch, capsys):
    """Injects: `$AGNOSIA_STORAGE_OPTIONS` with a misspelt key (`endpoit_url`) for a new workspace
    whose arrays go to s3://. Asserts: `python -m store init` exits 2 with one line naming the key,
    its likely spelling and the fix, before anything is written: no manifest is left behind (was:
    a TypeError from aiobotocore's session at the first request, and a manifest without arrays)."""
    from store.cli import main as store_cli

    monkeypatch.setenv("AGNOSIA_STORAGE_OPTIONS", '{"endpoit_url": "http://127.0.0.1:9"}')
    data = tmp_path / "ws"
    assert store_cli(["init", "--data", str(data), "--arrays", "s3://bucket/ws"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: $AGNOSIA_STORAGE_OPTIONS has key(s) the s3:// filesystem does"
                                               " not take: 'endpoit_url' (did you mean 'endpoint_url'?)")
    assert not (data / "manifest.duckdb").exists()


@pytest.fixture(scope="module")
def go_boards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from faultlib import go_set

    return go_set(tmp_path_factory.mktemp("sets") / "go-contracts", "0,1,2")


DAMAGES = [("seed", float("nan"), "row 1 (id {id!r}) has seed nan, not a whole number"),
           ("image", None, "1 row(s) have no image (null), e.g. row 1 (id {id!r})")]


def _damaged_set(go_boards: Path, bad: Path, column: str, value: object) -> str:
    """A copy of the set whose truth.parquet has ``value`` in ``column`` of row 1; that row's id."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    shutil.copytree(go_boards, bad)
    table = pq.read_table(bad / "truth.parquet")
    values = table.column(column).to_pylist()
    if column == "seed":  # as a pandas round trip leaves it: float64 (seeds past 2**53 do not fit it)
        values = [float(k) for k in range(len(values))]
    values[1] = value
    kind = pa.float64() if column == "seed" else table.schema.field(column).type
    table = table.set_column(table.column_names.index(column), pa.field(column, kind), pa.array(values, kind))
    pq.write_table(table, bad / "truth.parquet")
    return str(table.column("id")[1].as_py())


@pytest.mark.parametrize(("column", "value", "expect"), DAMAGES)
def test_a_damaged_truth_table_is_refused_when_the_set_is_read(go_boards, tmp_path, column, value, expect):
    """Injects: truth.parquet with a NaN `seed` or a null `image` in row 1. Asserts: reading the
    set raises one StimulusError naming the file, the row, its id and the fix."""
    from stimuli.base import StimulusError
    from stimuli.io import read_set

    stim_id = _damaged_set(go_boards, tmp_path / "go-bad", column, value)
    with pytest.raises(StimulusError) as err:
        read_set(tmp_path / "go-bad")
    assert str(err.value).startswith(f"{tmp_path / 'go-bad' / 'truth.parquet'}: ")
    assert expect.format(id=stim_id) in str(err.value) and "regenerate the set" in str(err.value)


@pytest.mark.slow
@pytest.mark.parametrize(("column", "value", "expect"), DAMAGES)
def test_a_damaged_truth_table_is_one_line_before_the_model_loads(go_boards, tmp_path, column, value, expect):
    """Injects: truth.parquet rewritten with a NaN `seed` or a null `image` in row 1, then a real
    `python -m extract MANIFEST --dry-run`. Asserts: exit 2 and one `error:` line naming the file,
    the row, its id and the fix (was: a ValueError converting NaN to an int while registering, or
    a TypeError joining None to the set's path, as tracebacks)."""
    from faultlib import write_manifest

    bad = tmp_path / "go-bad"
    stim_id = _damaged_set(go_boards, bad, column, value)
    got = subprocess.run([sys.executable, "-m", "extract", str(write_manifest(tmp_path / "m.yaml", bad)), "--data",
                          str(tmp_path / "ws"), "--dry-run"], cwd=REPO, env=env(), capture_output=True, text=True,
                         timeout=300)
    lines = [line for line in got.stderr.splitlines() if line.strip()]
    assert got.returncode == 2 and "Traceback" not in got.stderr, got.stderr
    assert len(lines) == 1 and lines[0].startswith(f"error: {bad / 'truth.parquet'}: "), lines
    assert expect.format(id=stim_id) in lines[0] and "regenerate the set" in lines[0]
    assert not (tmp_path / "ws").exists()


# ----------------------------------------------------------------------------- 4. the farm's Dask client

def test_a_killed_worker_is_reported_with_the_memory_limit_and_the_fix():
    """Injects: Dask's KilledWorker as the farm's collector receives it for a lost group. Asserts:
    the failure names the memory limit the plan was checked against and the fix (plan
    `memory_limit:` / `--memory-limit`), where Dask's text said only that workers died."""
    from types import SimpleNamespace

    from distributed import KilledWorker

    from probes.farm import killed_worker_message

    err = KilledWorker("probes-abc", SimpleNamespace(address="tcp://127.0.0.1:1"), 3)
    got = killed_worker_message(err, 384 << 20)
    assert got is not None and got.startswith("KilledWorker: 4 workers died running 'probes-abc', most likely past"
                                              " their memory limit (384 MiB per worker;")
    assert "memory_limit:" in got and "--memory-limit 768MiB" in got
    assert killed_worker_message(ValueError("x"), 384 << 20) is None


def _start_cluster(folder: Path, n_workers: int, **extra: str) -> tuple[str, list[subprocess.Popen[bytes]]]:
    """A real `dask scheduler` and `dask worker` processes on loopback."""
    import json
    import time

    sched_file = folder / "scheduler.json"
    common = {"cwd": REPO, "env": env(**extra), "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    procs = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port",
                               "0", "--no-dashboard", "--scheduler-file", str(sched_file)], **common)]
    deadline = time.monotonic() + 60
    while not (sched_file.exists() and sched_file.stat().st_size) and time.monotonic() < deadline:
        time.sleep(0.1)
    address = json.loads(sched_file.read_text())["address"]
    procs += [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", address, "--nthreads", "1",
                                "--host", "127.0.0.1", "--no-dashboard"], **common) for _ in range(n_workers)]
    return address, procs


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)


@pytest.mark.slow
def test_the_client_exits_in_one_line_when_the_scheduler_dies_and_keeps_what_it_recorded(tmp_path):
    """Injects: SIGKILL of the `dask scheduler` process once a real `python -m probes PLAN
    --scheduler ADDR` client (2 workers, tasks slowed to 1 s) has recorded its first probes.
    Asserts: the client exits 2 within 30 s with one `error:` line naming the scheduler and the
    fix, no traceback (was: still running 150 s after Dask's "closing client"); every probe
    recorded before the kill stays, once each, with its weight file."""
    import time

    from probetest_lib import build_spatial_layers

    data = tmp_path / "ws"
    build_spatial_layers(data, layers=16)
    slow = tmp_path / "slow"
    slow.touch()
    extra = {"AGNOSIA_FAULT_SLOW_FLAG": str(slow), "AGNOSIA_FAULT_SLOW_S": "1.0"}
    address, procs = _start_cluster(tmp_path, 2, **extra)
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"name": "faults", "plugins": ["fault_slow"], "probes": [
        {"runs": ["spatial"], "targets": ["spatial.relation", "truth:flag_0"], "kinds": ["fault_pooled"]}]}))
    ws = Workspace.open(data, readonly=True)
    client = subprocess.Popen([sys.executable, "-m", "probes", str(plan), "--data", str(data), "--scheduler", address,
                               "--no-progress"], cwd=REPO, env=env(**extra), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while client.poll() is None and time.monotonic() < deadline and not _recorded(ws):
            time.sleep(0.1)
        assert client.poll() is None, client.communicate()
        procs[0].kill()
        killed = time.monotonic()
        _, err = client.communicate(timeout=60)
        took = time.monotonic() - killed
    finally:
        if client.poll() is None:
            client.kill()
        _stop(procs)
    assert client.returncode == 2 and took <= 30, (client.returncode, took, err[-2000:])
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert "Traceback" not in err and len(errors) == 1, err[-3000:]
    assert errors[0].startswith(f"error: lost the Dask scheduler at {address} mid-plan")
    assert "restart the scheduler and its workers, then run the same command" in errors[0]
    rows = ws.rows("SELECT params->>'key', artifact FROM probes")
    assert 0 < len(rows) < 32 and len({k for k, _ in rows}) == len(rows)
    assert f"the {len(rows)} probe(s) finished before are recorded and kept" in errors[0]
    assert all((data / artifact).is_file() for _, artifact in rows)


def _recorded(ws: Workspace) -> int:
    from store.errors import ManifestBusyError

    try:
        return int(ws.rows("SELECT count(*) FROM probes")[0][0])
    except ManifestBusyError:
        return 0


@pytest.mark.slow
def test_a_worker_that_keeps_dying_is_reported_with_the_memory_limit(tmp_path):
    """Injects: a real LocalCluster (`python -m probes PLAN --scheduler local --workers 1
    --memory-limit 2GiB`) whose probe kind SIGKILLs its own worker process, as the nanny kills a
    worker past its memory limit. Asserts: the plan reports the group as failed with Dask's
    KilledWorker, the memory limit it ran under and the fix (`memory_limit:` / `--memory-limit`),
    where it said only "workers died"."""
    from probetest_lib import build_spatial_layers

    data = tmp_path / "ws"
    build_spatial_layers(data, n=32, layers=1)
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"name": "dying", "plugins": ["fault_dying"], "probes": [
        {"runs": ["spatial"], "targets": ["spatial.relation"], "kinds": ["fault_dying"]}]}))
    got = subprocess.run([sys.executable, "-m", "probes", str(plan), "--data", str(data), "--scheduler", "local",
                          "--workers", "1", "--memory-limit", "2GiB", "--no-progress"], cwd=REPO,
                         env=env(AGNOSIA_FAULT_DIE="1", DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES="0"),
                         capture_output=True, text=True, timeout=300)
    assert got.returncode == 1, got.stderr[-3000:]
    assert "0 trained, 0 skipped (done), 1 failed" in got.stdout
    line = next(line for line in got.stderr.splitlines() if "failed" in line and "KilledWorker" in line)
    assert "KilledWorker: 1 worker died running 'probes-" in line and "memory limit (2048 MiB per worker;" in line
    assert "raise the plan's memory_limit: or --memory-limit (e.g. --memory-limit 4096MiB)" in line
