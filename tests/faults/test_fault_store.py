"""Store-level faults that the extraction tests cannot place exactly: a shard restarting while its
peer has a chunk half-written, leftovers of a write killed inside zarr-python, a foreign process
holding the manifest open during a run.

Faults already covered elsewhere, listed so nothing is tested twice (docs/reliability.md has
the full table): kill -9 of a writer process and resume, a second writer refused with the
holder's pid, a reader process reading while a writer process writes, plain duckdb/zarr reading
a workspace (tests/store/test_store_processes.py); a truncated manifest and a missing array
(tests/store/test_store_manifest.py); shard locks (tests/store/test_store_shards.py).
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from faultlib import REPO, env, kill_at_rename, python, wait_for

pytestmark = pytest.mark.slow  # fault injection drives real extraction or farm processes; `make faults` runs these

sys.path.insert(0, str(REPO / "tests" / "store"))
from storetest_lib import dense_values, write_run  # noqa: E402

from store import ArraySpec, RunInfo, Shard, Workspace  # noqa: E402
from store.errors import ManifestBusyError, WriterError  # noqa: E402


def _committed(ws: Workspace) -> int:
    try:
        return ws.rows("SELECT count(*) FROM chunks")[0][0]
    except ManifestBusyError:
        return 0


def test_a_shard_restarting_keeps_its_peers_half_written_chunk(tmp_path):
    """Injects: shard 1 of a 2-shard run (re)starts while shard 0 has chunk 0 half-written (its
    `c.0.0.0.<pid>.partial` file open), and a dead shard's leftover `c.1.0.0.<dead pid>.partial`
    lies beside it. Asserts: the restart removes only the dead process's leftover; shard 0 then
    completes chunk 0 and commits it (before the fix the restart deleted the live file and shard
    0 failed with FileNotFoundError); the chunk holds the values written, and verify passes."""
    ws = Workspace.open(tmp_path / "ws")
    info = RunInfo(run="r", model="m", chunk_samples=4)
    first = ws.writer(info, shard=Shard(0, 2))
    try:
        first.set_samples(first.register_stimuli([{"id": str(i)} for i in range(16)], dataset="d"))
        spec = ArraySpec(tap="llm", layer=0, tokens="image", shape=(6, 8))
        a = first.array(spec)
        first.write(a, 0, dense_values(range(0, 2)))  # rows 0-1 of chunk 0: the chunk file is open
        folder = ws.zarr_path / "r/llm/0/resid_post/image"
        live = wait_for(lambda: list(folder.glob("c.0.0.0.*.partial")), timeout=10)
        dead = folder / "c.1.0.0.4194303.partial"  # a pid above pid_max: that process is gone
        dead.write_bytes(b"\0" * 10)
        with ws.writer(info, shard=Shard(1, 2)) as second:
            second.set_samples([f"d/{i}" for i in range(16)])
            second.array(spec)
            assert live[0].exists() and not dead.exists()
            first.write(a, 2, dense_values(range(2, 4)))
            first.flush()
            second.close()
    finally:
        first.close()
    assert ws.rows("SELECT chunk FROM chunks") == [(0,)]
    np.testing.assert_array_equal(ws.read("r", "llm", 0, rows=[0, 1, 2, 3]), dense_values(range(4)).astype(np.float16))
    assert ws.verify().ok


def test_zarr_partial_left_in_a_group_folder_is_removed_by_the_next_writer(tmp_path):
    """Injects: what a kill inside zarr-python's atomic write leaves (found by the kill -9
    extraction test): a `zarr.<hex>.partial` file in a group folder of the run and a
    `c.0.0.<hex>.partial` in a ragged block. Asserts: verify warns about them; the next writer
    of the run removes them (before the fix only `.partial` files inside array folders were,
    so the warning stayed forever); then verify has no warning."""
    ws = Workspace.open(tmp_path / "ws")
    write_run(ws, n=16, chunk=8)
    leftovers = [ws.zarr_path / "r1/llm/3/resid_post/zarr.3d311a2ad52c4b5da370aff10f8d8c97.partial",
                 ws.zarr_path / "r1/llm/3/resid_post/answer/b1/rows/c.0.0.0f1e2d3c4b5a69788796a5b4c3d2e1f0.partial"]
    for p in leftovers:
        p.write_bytes(b"{")
    assert any("'.partial' file(s) left by interrupted writes" in w for w in ws.verify().warnings)
    write_run(ws, n=16, chunk=8)  # the run is finished: the writer only checks and closes
    assert not any(p.exists() for p in leftovers)
    rep = ws.verify()
    assert rep.ok and not rep.warnings, rep.warnings


def test_a_resume_never_leaves_a_committed_run_tensor_half_rewritten(tmp_path, monkeypatch):
    """Injects (found by the kill -9 extraction test: a kill while a resume rewrote
    `lm_head.weight` left its committed manifest row pointing at a half-written array, and
    verify failed): (1) a resume writing the same run tensor again; (2) a writer that dies in
    the middle of rewriting a changed run tensor, after zarr-python replaced its files and
    before the manifest row (simulated in process by an exception at the final fsync).
    Asserts: (1) the committed copy's files are not touched (same inode and mtime) and verify
    passes; (2) verify still passes (the old row was removed before the files changed, so no
    row points at the new bytes), and the next writer writes the tensor, which then reads back
    equal and verifies."""
    ws = Workspace.open(tmp_path / "ws")
    info = RunInfo(run="r", model="m", chunk_samples=4)
    weight = np.arange(48, dtype=np.float32).reshape(6, 8)
    with ws.writer(info) as w:
        w.write_tensor("lm_head.weight", weight)
    chunk = ws.zarr_path / "r/_tensors/lm_head.weight/c.0.0"
    stat = chunk.stat()
    with ws.writer(info) as w:
        w.write_tensor("lm_head.weight", weight)  # a resume: same tensor
    assert (chunk.stat().st_ino, chunk.stat().st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)
    assert ws.verify().ok

    from store import arrays as layout

    real = layout.fsync_node_chains

    def dies(workspace, zarr_paths, pool=None, files=()):
        if any("_tensors" in p for p in zarr_paths):
            raise KeyboardInterrupt("killed while rewriting the tensor")
        return real(workspace, zarr_paths, pool, files)

    monkeypatch.setattr(layout, "fsync_node_chains", dies)
    with pytest.raises(KeyboardInterrupt), ws.writer(info) as w:
        w.write_tensor("lm_head.weight", weight * 2)
    rep = ws.verify()
    assert rep.ok, rep.problems
    assert ws.rows("SELECT count(*) FROM tensors") == [(0,)]
    monkeypatch.setattr(layout, "fsync_node_chains", real)
    with ws.writer(info) as w:
        w.write_tensor("lm_head.weight", weight * 2)
    np.testing.assert_array_equal(ws.read_tensor("r", "lm_head.weight"), weight * 2)
    assert ws.verify().ok


def test_a_writer_refused_in_the_instant_the_holder_takes_the_lock_names_it(tmp_path):
    """Injects (found by the two-simultaneous-extractions test, about 1 run in 4): a second
    writer that meets the lock in the instant between the holder's flock and the holder writing
    its name, while the file still names the dead writer of an earlier, killed run. Asserts: the
    refusal names the live holder's pid (before the fix: "a process that has not written its
    name yet ... wait for pid ?", or the dead writer's pid)."""
    from store.errors import WriterLockError
    from store.lock import WriterLock

    ws = Workspace.open(tmp_path / "ws")
    lock = ws.path / "writer.lock"
    host = __import__("socket").gethostname()
    lock.write_text(f'{{"pid": 4194303, "host": "{host}", "run": "killed", "since": 0}}\n')
    code = ("import fcntl, json, os, socket, sys, time\n"
            f"fd = os.open({str(lock)!r}, os.O_RDWR)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('locked', flush=True)\n"
            "time.sleep(0.3)  # the instant, stretched\n"
            "me = {'pid': os.getpid(), 'host': socket.gethostname(), 'run': 'r', 'since': time.time()}\n"
            "os.ftruncate(fd, 0); os.pwrite(fd, (json.dumps(me) + '\\n').encode(), 0)\n"
            "time.sleep(30)\n")
    holder = subprocess.Popen([sys.executable, "-c", code], env=env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(WriterLockError) as err:
            WriterLock(lock, run="second").acquire()
        assert f"is being written by pid {holder.pid} " in str(err.value), str(err.value)
        assert f"wait for pid {holder.pid} to finish" in str(err.value)
    finally:
        holder.kill()
        holder.wait(10)


def test_manifest_held_open_by_another_process_fails_late_and_clearly_then_resumes(tmp_path):
    """Injects: once 2 chunks are committed, another process opens manifest.duckdb read-write and
    keeps it (a DuckDB CLI or notebook session) while the writer (manifest_timeout 2 s) goes on.
    Asserts: the writer keeps writing chunk files meanwhile and fails only at finish, with
    "stayed locked by another process ... (a DuckDB CLI or notebook connection?)" naming the
    holder's PID; what was committed before verifies; once the holder exits, a re-run resumes
    and the store equals an uninterrupted run value for value and checksum for checksum.

    Synchronised by events, not sleeps: the writer stops after row 24 (chunks 0-2 queued) until
    the holder has the manifest, so chunks 3-5 are always written while it is held, however
    loaded the machine (a full `make test` once let the writer finish before the holder started)."""
    path = tmp_path / "ws"
    ws = Workspace.open(path)
    outcome: dict = {}
    paused, held = threading.Event(), threading.Event()

    def pause() -> None:
        paused.set()
        if not held.wait(120):
            raise AssertionError("the holder never took the manifest")

    def writer() -> None:
        try:
            write_run(ws, n=48, after_batch=lambda end: pause() if end == 24 else None, manifest_timeout=2.0)
        except BaseException as err:  # noqa: BLE001 - asserted below
            outcome["error"] = err

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    assert paused.wait(120), outcome
    wait_for(lambda: _committed(ws) >= 2, timeout=120)  # the committer thread goes on while the loop waits
    code = ("import duckdb, sys, time\n"
            "while True:\n"
            "    try:\n"
            f"        con = duckdb.connect({str(ws.manifest_path)!r})\n"
            "        break\n"
            "    except duckdb.IOException:\n"
            "        time.sleep(0.01)  # the writer is committing: try again, as a person would\n"
            "print('holding', flush=True)\n"
            "time.sleep(600)\n")
    holder = subprocess.Popen([sys.executable, "-c", code], env=env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        held.set()
        thread.join(300)
        assert not thread.is_alive()
    finally:
        held.set()
        holder.kill()
        holder.wait(10)
    err = outcome.get("error")
    assert isinstance(err, WriterError), err
    msg = str(err)
    assert "stayed locked by another process" in msg and "a DuckDB CLI or notebook connection?" in msg, msg
    assert f"PID {holder.pid}" in msg, msg
    rep = ws.verify()
    assert rep.ok, rep.problems
    before = _committed(ws)
    assert 2 <= before <= 6  # chunks 3-5 (rows 24-47) of both arrays were queued only once it was held
    image = ws.zarr_path / "r1/llm/3/resid_post/image"
    on_disk = len(list(image.glob("c.*.0.0")))
    recorded = ws.rows("SELECT count(*) FROM chunks WHERE zarr_path LIKE '%image'")[0][0]
    assert on_disk == 6 and recorded <= 3, (on_disk, recorded)  # written (durable) meanwhile, just not recorded
    write_run(ws, n=48, chunk=8, batch=4)
    ref = Workspace.open(tmp_path / "ref")
    write_run(ref, n=48, chunk=8, batch=4)
    rep = ws.verify()
    assert rep.ok and not rep.warnings, (rep.problems, rep.warnings)
    crc = "SELECT zarr_path, chunk, n_rows, crc32c FROM chunks ORDER BY ALL"
    assert ws.rows(crc) == ref.rows(crc)
    np.testing.assert_array_equal(ws.read("r1", "llm", 3, tokens="image"), ref.read("r1", "llm", 3, tokens="image"))
    a, b = ws.read("r1", "llm", 3, tokens="answer"), ref.read("r1", "llm", 3, tokens="answer")
    np.testing.assert_array_equal(a.values, b.values)
    np.testing.assert_array_equal(a.offsets, b.offsets)
    gens = "SELECT stimulus, array_row, text, correct FROM generations ORDER BY array_row"
    assert ws.rows(gens) == ref.rows(gens)


def _manifest_rows(ws: Workspace) -> dict[str, list[tuple]]:
    """Every row of every table of the manifest, in a fixed order."""
    tables = [t for (t,) in ws.rows("SELECT table_name FROM information_schema.tables WHERE table_type = 'BASE TABLE'")]
    return {t: ws.rows(f"SELECT * FROM {t} ORDER BY ALL") for t in sorted(tables)}


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _one_error_line(stderr: str, needle: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], stderr
    return lines[0]


def _flip_an_offset(block: Path) -> None:
    """Add 1 to one inner offset of a ragged block (one flipped bit in its low byte), choosing one
    where the offsets still rise and still end at the row count: only a checksum can tell."""
    f = block / "offsets" / "c.0"
    offsets = np.frombuffer(f.read_bytes(), dtype="<i8").copy()
    j = next(j for j in range(1, len(offsets) - 1) if offsets[j] % 2 == 0 and offsets[j] + 1 <= offsets[j + 1])
    offsets[j] += 1
    f.write_bytes(offsets.astype("<i8").tobytes())


def test_a_flipped_byte_in_ragged_offsets_is_found_by_verify(tmp_path):
    """Injects (issue 16, item 1): one flipped bit in the offsets chunk of a ragged block, so the
    offsets still rise and end at the row count, and reads would return shifted per-sample
    splits. Asserts: `python -m store verify` exits 1 naming the block's offsets checksum
    mismatch (before the fix: "ok", exit 0), no traceback; the committed values are unchanged."""
    ws = Workspace.open(tmp_path / "ws")
    write_run(ws, n=16, chunk=8)
    assert ws.verify().ok
    _flip_an_offset(ws.zarr_path / "r1/llm/3/resid_post/answer/b1")
    got = python("-m", "store", "verify", "--data", str(ws.path))
    assert got.returncode == 1, got.stdout
    assert "Traceback" not in got.stderr, got.stderr
    problems = [line for line in got.stdout.splitlines() if line.startswith("PROBLEM: ")]
    assert len(problems) == 1, got.stdout
    want = "PROBLEM: r1:llm/3/resid_post/answer: chunk 1 (rows 8-15) offsets checksum mismatch"
    assert problems[0].startswith(want), problems
    assert "answer/b1/offsets" in problems[0], problems
    assert got.stdout.strip().endswith("1 problem(s)"), got.stdout


def test_a_manifest_from_before_offsets_checksums_migrates_and_verify_says_what_it_cannot_check(tmp_path):
    """Injects: ragged chunks committed before offsets were checksummed (what schema step 3 leaves
    for them: a NULL offsets_crc32c). Asserts: verify passes with one warning per ragged array
    that its offsets are checked for shape only, and reads are unchanged; a resume of the finished
    run keeps it finished. (Opening an older schema read-only asks for the migration, as for any
    step: tests/store/test_store_manifest.py.)"""
    ws = Workspace.open(tmp_path / "ws")
    write_run(ws, n=16, chunk=8)
    want = ws.read("r1", "llm", 3, tokens="answer")
    import duckdb

    con = duckdb.connect(str(ws.manifest_path))
    con.execute("UPDATE chunks SET offsets_crc32c = NULL")
    con.close()
    ws = Workspace.open(ws.path)
    assert ws.rows("SELECT count(*), count(offsets_crc32c) FROM chunks") == [(4, 0)]
    rep = ws.verify()
    assert rep.ok, rep.problems
    assert rep.warnings == [("r1:llm/3/resid_post/answer: 2 ragged chunk(s) were committed before offsets were"
                             " checksummed (manifest schema < 3): their offsets are checked for shape only; re-extract"
                             " the run to checksum them")]
    got = ws.read("r1", "llm", 3, tokens="answer")
    np.testing.assert_array_equal(got.values, want.values)
    np.testing.assert_array_equal(got.offsets, want.offsets)
    write_run(ws, n=16, chunk=8)
    assert ws.rows("SELECT status FROM runs") == [("finished",)]


@pytest.mark.parametrize("when", ["before", "after"])
def test_drop_run_killed_at_the_rename_leaves_a_valid_workspace(tmp_path, when):
    """Injects (issue 16, item 2): `python -m store drop-run r1 --yes` killed with SIGKILL just
    before or just after it renames the run's arrays folder into `.trash`. Asserts: the run's
    rows are gone (the commit came first) and verify passes with every other run still
    finished (before the fix, the kill after the rename left 12 chunk rows pointing at arrays in
    `.trash`, which the next writer emptied); a folder left under arrays/ is only an orphan
    warning; the next writer of any run clears what is left, and a new run with the dropped id
    equals one written in a fresh workspace."""
    ws = Workspace.open(tmp_path / "ws")
    write_run(ws, run="keep", n=16, chunk=8)
    write_run(ws, run="r1", n=16, chunk=8)
    got = kill_at_rename(ws.zarr_path / "r1", when, "drop-run", "r1", "--yes", "--data", str(ws.path))
    assert got.returncode == -9, got
    assert ws.rows("SELECT run, status FROM runs") == [("keep", "finished")]
    assert ws.rows("SELECT count(*) FROM chunks WHERE run = 'r1'") == [(0,)]
    rep = ws.verify()
    assert rep.ok, rep.problems
    assert (ws.zarr_path / "r1").exists() == (when == "before")
    if when == "before":
        assert any("arrays/r1 belongs to no run" in w for w in rep.warnings), rep.warnings
    write_run(ws, run="r1", n=16, chunk=8)
    assert not (ws.path / ".trash").exists()
    rep = ws.verify()
    assert rep.ok and not rep.warnings, (rep.problems, rep.warnings)
    ref = Workspace.open(tmp_path / "ref")
    write_run(ref, run="r1", n=16, chunk=8)
    crc = "SELECT zarr_path, chunk, n_rows, crc32c, offsets_crc32c FROM chunks WHERE run = 'r1' ORDER BY ALL"
    assert ws.rows(crc) == ref.rows(crc)
    assert _files(ws.zarr_path / "r1") == _files(ref.zarr_path / "r1")


def test_drop_run_runs_whole_and_says_what_went(tmp_path):
    """Guard for the reordered drop-run: uninterrupted, it removes the run's rows and folder,
    leaves no `.trash`, and a second drop names the missing run (exit 2, one line)."""
    ws = Workspace.open(tmp_path / "ws")
    write_run(ws, n=16, chunk=8)
    got = python("-m", "store", "drop-run", "r1", "--yes", "--data", str(ws.path))
    assert got.returncode == 0 and got.stdout.startswith("dropped run r1: 4 chunks, 2 activations"), got
    assert not (ws.zarr_path / "r1").exists() and not (ws.path / ".trash").exists()
    assert ws.rows("SELECT count(*) FROM runs") == [(0,)]
    again = python("-m", "store", "drop-run", "r1", "--yes", "--data", str(ws.path))
    assert again.returncode == 2
    _one_error_line(again.stderr, "no run 'r1'")


def test_a_parenthesised_query_returns_its_rows(tmp_path):
    """Injects (issue 16, item 5): `python -m queries --sql "(SELECT count(*) FROM chunks)"`, a
    set operation of parenthesised SELECTs, and a query behind a comment. Asserts: each prints
    its rows, exit 0 (before the fix: blank lines, exit 0); two statements are refused in one
    line (exit 2); writes stay refused; the workspace is byte-identical."""
    ws = Workspace.open(tmp_path / "ws")
    write_run(ws, n=16, chunk=8)
    before = _files(ws.path)
    got = python("-m", "queries", "--data", str(ws.path), "--sql", "(SELECT count(*) AS n FROM chunks)",
                 "--format", "csv")
    assert got.returncode == 0 and got.stdout.split() == ['"n"', "4"], got
    got = python("-m", "queries", "--data", str(ws.path), "--format", "csv",
                 "--sql", "/* two */ (SELECT 1 AS x) UNION ALL (SELECT 2) ORDER BY x")
    assert got.returncode == 0 and got.stdout.split() == ['"x"', "1", "2"], got
    for sql, needle in [("SELECT 1; SELECT 2", "give exactly one SQL statement, got 2"),
                        ("(DELETE FROM runs)", "syntax error"),
                        ("DELETE FROM runs", "read-only"),
                        ("INSERT INTO runs (run) VALUES ('x') RETURNING run", "read-only"),
                        ("SELEC 1", 'syntax error at or near "SELEC"')]:
        got = python("-m", "queries", "--data", str(ws.path), "--sql", sql)
        assert got.returncode == 2, (sql, got)
        _one_error_line(got.stderr, needle)
    assert _files(ws.path) == before


def test_queries_out_never_overwrites_a_workspace_file(tmp_path):
    """Injects (issue 16, item 6): `python -m queries --out` naming the workspace's manifest, its
    writer lock, a file under arrays/, a symlink to the manifest, another workspace's manifest,
    and a file in a missing folder. Asserts: each is refused with one line, exit 2 (before the
    fix: the manifest was overwritten with the result, exit 0; a missing folder gave a
    traceback); the workspaces are byte-identical; a result file beside the manifest is fine."""
    ws = Workspace.open(tmp_path / "ws")
    write_run(ws, n=16, chunk=8)
    other = Workspace.open(tmp_path / "other")
    (tmp_path / "link.csv").symlink_to(ws.manifest_path)
    before = (_files(ws.path), _files(other.path))
    refused = [ws.manifest_path, ws.path / "writer.lock", ws.zarr_path / "r1" / "zarr.json",
               tmp_path / "link.csv", other.manifest_path]
    for out in refused:
        got = python("-m", "queries", "--data", str(ws.path), "--sql", "SELECT 1", "--format", "csv",
                     "--out", str(out))
        assert got.returncode == 2, (out, got)
        _one_error_line(got.stderr, "a file of the workspace")
    got = python("-m", "queries", "--data", str(ws.path), "storage", "--out", str(tmp_path / "missing" / "r.csv"))
    assert got.returncode == 2
    _one_error_line(got.stderr, f"folder {tmp_path / 'missing'} does not exist; create it first")
    assert (_files(ws.path), _files(other.path)) == before
    got = python("-m", "queries", "--data", str(ws.path), "--sql", "SELECT 1 AS x", "--format", "csv",
                 "--out", str(ws.path / "result.csv"))
    assert got.returncode == 0 and (ws.path / "result.csv").read_text().split() == ['"x"', "1"], got


def test_verify_reports_a_failed_run_as_incomplete(tmp_path):
    """Injects (issue 21, item 8): a run left `failed` (a crash, Ctrl-C). Asserts: verify still
    checks its chunks and passes them, and says, as a warning, that the run is incomplete, how many
    of its chunks are committed and how to resume or drop it (before: a silent "ok")."""
    ws = Workspace.open(tmp_path / "ws")
    write_run(ws, n=16, chunk=8)
    import duckdb

    con = duckdb.connect(str(ws.manifest_path))
    con.execute("UPDATE runs SET status = 'failed'")
    n = con.execute("SELECT count(*) FROM chunks").fetchone()[0]
    con.close()
    rep = Workspace.open(ws.path, readonly=True).verify()
    assert rep.ok, rep.problems
    assert (f"run r1 failed: {n} of {n} chunk(s) committed; resume it (run its manifest again) or drop it"
            " (python -m store drop-run r1)") in rep.warnings
