"""Faults injected into real extraction processes (`python -m extract MANIFEST --data WS` on the
committed toy counting VLM over 80 small Go boards), each compared with one uninterrupted run.

Every extraction here is a real OS process forked from ``fault_zygote.py`` (an interpreter that
has already imported torch and transformers), so it can be killed with SIGKILL or given a tiny
file-size limit; each still loads the model, opens the workspace and runs
``extract.__main__.main`` exactly as the command line does.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from faultlib import assert_same_store, committed, go_set, python, snapshot, wait_for, write_manifest

from store import Workspace, WorkspaceError

pytestmark = pytest.mark.slow  # fault injection drives real extraction or farm processes; `make faults` runs these

N = 80           # samples: 20 chunks of 4 per array, 40 batches of 2
CHUNK = 4
KILLS = 10       # seeded kill points, each followed by a resume


@pytest.fixture(scope="module")
def stimuli(tmp_path_factory) -> Path:
    return go_set(tmp_path_factory.mktemp("stimuli") / "go-faults", counts=f"0-{N - 1}")


@pytest.fixture(scope="module")
def manifest(stimuli, tmp_path_factory) -> Path:
    return write_manifest(tmp_path_factory.mktemp("manifest") / "faults.yaml", stimuli)


@pytest.fixture(scope="module")
def reference(zygote, manifest, tmp_path_factory) -> tuple[Path, dict]:
    """One uninterrupted run: what every faulted-then-resumed run must equal, value for value."""
    data = tmp_path_factory.mktemp("reference") / "ws"
    child = zygote.run(manifest, data)
    assert child.rc == 0, child.log
    assert f"{N} samples ({N} computed now" in child.log
    ws = Workspace.open(data, readonly=True)
    rep = ws.verify()
    assert rep.ok and not rep.warnings, (rep.problems, rep.warnings)
    return data, snapshot(data)


def _chunks_done(data: Path) -> int:
    """Chunk indices committed in every array (what a resume skips)."""
    rows = {(p, c) for p, c, _ in committed(data)}
    arrays = {p for p, _ in rows}
    if len(arrays) < 6:
        return 0
    return sum(all((p, k) in rows for p in arrays) for k in range(N // CHUNK))


def _read_committed(data: Path, ref: dict) -> int:
    """A reader in this process while the writer process writes: what it sees of one dense array
    equals the reference rows of the chunks committed at that moment. Returns the rows read."""
    if not (data / "arrays" / "zarr.json").exists():
        return 0
    ws = Workspace.open(data, readonly=True)
    path = "toy/llm/1/resid_post/image"
    if not ws.rows("SELECT count(*) FROM activations WHERE zarr_path = ?", [path])[0][0]:
        return 0
    sql = "SELECT chunk FROM chunks WHERE zarr_path = ? ORDER BY chunk"
    done = ws.rows(sql, [path])
    got = ws.read("toy", "llm", 1, tokens="image", committed_only=True)
    if ws.rows(sql, [path]) != done:
        return 0  # a commit landed during the read: which chunks it saw is not known
    rows = [r for (c,) in done for r in range(c * CHUNK, (c + 1) * CHUNK)]
    np.testing.assert_array_equal(got, ref[path][rows])
    return len(got)


def test_kill_9_at_ten_seeded_points_then_resume_equals_an_uninterrupted_run(zygote, manifest, reference, tmp_path):
    """Injects: SIGKILL of a real extraction process at 10 seeded random points, each followed by
    a resume that is itself killed: 4 points at a random delay in the set-up (model load,
    workspace creation, writer lock, stimulus registration, array creation, run tensors; at the
    first batch if the set-up ends sooner), 6
    after a random number (1-4) of batches plus a random delay, i.e. between batches, mid-chunk,
    mid-commit. The model is slowed to 0.12 s a batch, like a real one, so the kills land
    between commits. Meanwhile this process reads the committed chunks (a reader during a
    write). Asserts: every kill landed while the process ran; after each, the chunks committed
    before are still there with the same CRC-32C and ``verify`` passes; what a concurrent reader
    read equals the reference rows; the final resume computes only the uncommitted rows, and the
    store then verifies without warnings and equals the uninterrupted run array for array,
    value for value, chunk checksums, samples/spans, generations and run tensors included."""
    ref_path, ref = reference
    data = tmp_path / "ws"
    before: set = set()
    landed = []
    rows_read = 0
    for seed in range(KILLS):
        rng = random.Random(seed)
        child = zygote.start(manifest, data, batch_sleep=0.12)
        started = time.monotonic()
        if seed % 3 == 0:
            delay = rng.uniform(0.0, 2.5)
            point = f"{delay:.2f} s after start"
            # A set-up faster than the delay (a resume with few rows left runs ~1 s in all) is cut
            # at its first batch instead, so the kill still lands while the run is running.
            wait_for(lambda c=child, t0=started, d=delay: time.monotonic() - t0 >= d or c.batches() >= 1
                     or not c.alive(), timeout=60, step=0.005)
        else:
            k, extra = rng.randint(1, 4), rng.uniform(0.0, 0.15)
            point = f"batch {k} + {extra:.2f} s"

            def reached(child=child, k=k) -> bool:
                nonlocal rows_read
                if child.batches() >= k or not child.alive():
                    return True
                rows_read += _read_committed(data, ref)
                return False

            wait_for(reached, timeout=60, step=0.005)
            time.sleep(extra)
        batches = child.batches()
        assert child.kill(), f"kill {seed} ({point}) came too late: rc={child.rc}\n{child.log}"
        after = committed(data)
        assert before <= after, f"kill {seed} ({point}) lost or changed committed chunks: {sorted(before - after)[:3]}"
        if (data / "arrays" / "zarr.json").exists():
            rep = Workspace.open(data, readonly=True).verify()
            assert rep.ok, (seed, point, rep.problems)
        landed.append((seed, point, batches, len(after)))
        before = after

    assert any(n > 0 for *_, n in landed), f"no kill landed after a commit: {landed}"
    assert rows_read > 0, "the concurrent reader never saw a committed chunk"
    done = _chunks_done(data)
    assert 0 < done < N // CHUNK, landed

    final = zygote.run(manifest, data)
    assert final.rc == 0, final.log
    assert f"({N - done * CHUNK} computed now" in final.log, (done, final.log)
    ws = Workspace.open(data, readonly=True)
    rep = ws.verify()
    assert rep.ok and not rep.warnings, (rep.problems, rep.warnings)
    assert not list(data.rglob("*.partial"))
    assert ws.rows("SELECT count(*), count(DISTINCT (zarr_path, chunk)) FROM chunks") == [(6 * N // CHUNK,) * 2]
    assert_same_store(snapshot(data), ref)


def test_kill_9_while_writing_to_an_object_store_then_resume(zygote, manifest, reference, s3, tmp_path):
    """Injects: SIGKILL of a real extraction process whose workspace keeps its arrays in an
    object store (S3 API: a moto server on loopback), 3 times after 2, 5 and 9 batches, i.e.
    while chunks are being staged, uploaded or committed. Asserts: after each kill the chunks
    committed before are still committed with the same CRC-32C and `verify` (which reads them
    back from the bucket) passes; the resume computes only the uncommitted rows; the store then
    verifies without warnings and equals the uninterrupted local run value for value; no chunk
    data is left in the local staging folder."""
    data = tmp_path / "ws"
    init = python("-m", "store", "init", "--data", str(data), "--arrays", s3.url("faults"))
    assert init.returncode == 0 and "arrays at s3://" in init.stdout, init.stderr
    before: set = set()
    for k in (2, 5, 9):
        child = zygote.start(manifest, data, batch_sleep=0.12, env=s3.env)
        wait_for(lambda c=child, k=k: c.batches() >= k or not c.alive(), timeout=60, step=0.005)
        assert child.kill(), f"the kill after {k} batches came too late: rc={child.rc}\n{child.log}"
        after = committed(data)
        assert before <= after, f"the kill after {k} batches lost committed chunks: {sorted(before - after)[:3]}"
        rep = Workspace.open(data, readonly=True).verify()
        assert rep.ok, (k, rep.problems)
        before = after
    done = _chunks_done(data)
    assert 0 < done < N // CHUNK
    final = zygote.run(manifest, data, env=s3.env)
    assert final.rc == 0, final.log
    assert f"({N - done * CHUNK} computed now" in final.log, (done, final.log)
    rep = Workspace.open(data, readonly=True).verify()
    assert rep.ok and not rep.warnings, (rep.problems, rep.warnings)
    assert_same_store(snapshot(data), reference[1])
    # verify read every committed chunk back from the bucket; locally only metadata is left.
    assert {p.name for p in (data / "arrays").rglob("*") if p.is_file()} == {"zarr.json"}


def test_two_extraction_processes_on_one_workspace(zygote, manifest, reference, tmp_path):
    """Injects: two `python -m extract` processes of the same manifest started at once on one
    (new) workspace. Asserts: exactly one writes; the other stops with exit code 2 and
    `WriterLockError`'s message naming the holder's pid and the way out, without a traceback;
    the store equals the uninterrupted run."""
    data = tmp_path / "ws"
    a = zygote.start(manifest, data, batch_sleep=0.1)  # 4 s of batches: the second meets the first's lock
    b = zygote.start(manifest, data, batch_sleep=0.1)
    rcs = sorted([a.wait(), b.wait()])
    assert rcs == [0, 2], (a.log, b.log)
    winner, loser = (a, b) if a.rc == 0 else (b, a)
    assert f"is being written by pid {winner.pid}" in loser.log, loser.log
    assert f"wait for pid {winner.pid} to finish" in loser.log and "Traceback" not in loser.log
    assert_same_store(snapshot(data), reference[1])


def test_kill_9_of_one_shard_resumed_while_its_peer_writes(zygote, manifest, reference, tmp_path):
    """Injects: a sharded run (`--shard 0/2` and `--shard 1/2`: two processes, one new workspace,
    which they create at the same moment); shard 1 is killed with SIGKILL after 3 batches and
    started again while shard 0 keeps writing (with 2 batches per chunk, shard 0 often has a
    chunk file half-written when shard 1 restarts; the store-level twin of this test makes that
    certain). Asserts: shard 0 is not disturbed and both end with exit code 0 (before the fix,
    a restarted shard deleted its peer's in-flight `.partial` chunk file and the peer failed with
    FileNotFoundError); the store verifies without warnings and equals the unsharded
    uninterrupted run."""
    data = tmp_path / "ws"
    first = zygote.start(manifest, data, "--shard", "0/2", batch_sleep=0.15)
    second = zygote.start(manifest, data, "--shard", "1/2", batch_sleep=0.15)
    wait_for(lambda: second.batches() >= 3 or not second.alive(), timeout=120, step=0.01)
    assert second.kill(), second.log
    assert first.alive(), first.log
    again = zygote.start(manifest, data, "--shard", "1/2", batch_sleep=0.15)
    assert again.wait() == 0, again.log
    assert first.wait() == 0, first.log
    assert f"({N // 2} computed now" in first.log, first.log
    ws = Workspace.open(data, readonly=True)
    rep = ws.verify()
    assert rep.ok and not rep.warnings, (rep.problems, rep.warnings)
    assert_same_store(snapshot(data), reference[1])


def test_ctrl_c_keeps_what_is_committed_says_how_to_resume_and_exits_130(zygote, manifest, reference, tmp_path):
    """Injects: SIGINT (Ctrl-C) into a running extraction after 5 batches (chunk 1 or 2 being
    filled). Asserts: exit code 130 and one line, `interrupted: the chunks committed so far are
    kept; run `python -m extract MANIFEST --data WS` to resume`, no traceback (it was a
    KeyboardInterrupt traceback, exit 1); the chunks committed before the signal are still
    committed with their checksums and `verify` finds no problem; the named command resumes,
    computes only the uncommitted rows, and the store equals the uninterrupted run."""
    data = tmp_path / "ws"
    child = zygote.start(manifest, data, batch_sleep=0.15)
    wait_for(lambda: child.batches() >= 5 or not child.alive(), timeout=120, step=0.01)
    before = committed(data)
    assert child.alive(), f"the child finished before the signal: {child.log}"
    os.kill(child.pid, signal.SIGINT)
    assert child.wait() == 130, child.log
    assert "Traceback" not in child.log
    lines = [line for line in child.log.splitlines() if line.strip()]
    assert lines == [f"interrupted: the chunks committed so far are kept; run `python -m extract {manifest}"
                     f" --data {data}` to resume"], child.log
    after = committed(data)
    assert before <= after and len({c for _, c, _ in after}) < N // CHUNK
    rep = Workspace.open(data, readonly=True).verify()
    assert rep.ok, rep.problems
    done = _chunks_done(data) * CHUNK
    again = zygote.run(manifest, data)
    assert again.rc == 0, again.log
    assert f"{N} samples ({N - done} computed now" in again.log, (again.log, done)
    assert_same_store(snapshot(data), reference[1])


@pytest.mark.parametrize("where, limit", [("chunk", 4096), ("manifest", 32000)])
def test_disk_full_during_the_run_is_a_clear_error_and_resumes(zygote, manifest, reference, tmp_path, where, limit):
    """Injects: a full disk mid-run. Once chunk 0 of every array is committed, the test lowers
    the running process's RLIMIT_FSIZE (prlimit; the process ignores SIGXFSZ), so its writes past
    the limit fail with EFBIG as on a full disk: at 4 KiB the next chunk file fails; at 32000 B
    every chunk file (<= 30976 B) still fits but the manifest's WAL outgrows it, so a commit
    fails. Asserts: exit code 2 and one `error: disk full / file too large while writing <a chunk
    file | manifest.duckdb> ... free space ... then re-run the same command to resume`, no
    traceback; the store still verifies and holds what was committed (chunk 0 at least, with the
    reference's checksums); re-run without the limit, it resumes, computing only the uncommitted
    rows, to a store equal to the uninterrupted run."""
    data = tmp_path / "ws"
    child = zygote.start(manifest, data, batch_sleep=0.1)
    wait_for(lambda: _chunks_done(data) >= 1 or not child.alive(), timeout=120, step=0.01)
    assert child.alive(), child.log
    child.fill_disk(limit)
    assert child.wait() == 2, child.log
    err = [line for line in child.log.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "Traceback" not in child.log, child.log
    assert "disk full / file too large while writing" in err[0]
    assert "free space" in err[0] and "re-run the same command to resume" in err[0]
    if where == "chunk":
        # The writer holds one manifest connection for seconds at a time, so its write-ahead log can
        # pass 4 KiB before the next chunk file does: which file fails first is timing, not a fault.
        assert f"{data}/arrays/toy/" in err[0] or f"{data}/manifest.duckdb" in err[0], err[0]
    else:
        assert f"{data}/manifest.duckdb" in err[0], err[0]
    ws = Workspace.open(data, readonly=True)
    rep = ws.verify()
    assert rep.ok, rep.problems
    done = _chunks_done(data)
    assert 1 <= done < N // CHUNK
    ref_crc = {(r[1], r[2]): r[7] for r in reference[1]["chunks"]}  # (zarr_path, chunk) -> crc32c
    assert all(ref_crc[(p, c)] == crc for p, c, crc in committed(data))

    resumed = zygote.run(manifest, data)
    assert resumed.rc == 0, resumed.log
    assert f"({N - done * CHUNK} computed now" in resumed.log, (done, resumed.log)
    rep = ws.verify()
    assert rep.ok and not rep.warnings, (rep.problems, rep.warnings)
    assert_same_store(snapshot(data), reference[1])


def test_disk_full_while_the_workspace_is_created_leaves_no_broken_manifest(zygote, manifest, reference, tmp_path):
    """Injects: a file-size limit of 8 KiB from the start, so creating the workspace's manifest
    fails half-way (DuckDB cannot grow the new file). Asserts: exit code 2 with the disk-full
    message naming manifest.duckdb, no traceback, and no manifest.duckdb left behind (it is
    built aside and linked into place whole: before, a half-written manifest stayed and every
    later run failed with "truncated or corrupted"); re-run without the limit, the extraction
    completes and equals the uninterrupted run."""
    data = tmp_path / "ws"
    full = zygote.run(manifest, data, fsize_limit=8192)
    assert full.rc == 2, full.log
    assert f"error: disk full / file too large while writing {data}/manifest.duckdb" in full.log, full.log
    assert "Traceback" not in full.log
    assert not (data / "manifest.duckdb").exists() and not list(data.glob(".manifest.duckdb.*"))
    again = zygote.run(manifest, data)
    assert again.rc == 0, again.log
    assert_same_store(snapshot(data), reference[1])


def _stimuli_copy(stimuli: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "sets" / stimuli.name  # same folder name: same stimulus keys as the reference
    shutil.copytree(stimuli, copy)
    return copy


def test_truncated_image_fails_its_batch_keeps_what_was_committed_and_resumes(zygote, reference, stimuli, tmp_path):
    """Injects: the PNG of sample 9 (batch 5, chunk 2) cut to half its bytes: its header is
    intact, its pixel data is not. Asserts: exit code 2 with `error: image '<that file>' cannot
    be read (... truncated ...)` and the fix (regenerate or replace it), no traceback; nothing of
    that batch is stored (chunk 2 of no array is committed) while chunks 0-1, written before,
    are committed and verify; with the image restored, the re-run computes only the remaining
    72 samples and the store equals the uninterrupted run."""
    copy = _stimuli_copy(stimuli, tmp_path)
    manifest = write_manifest(tmp_path / "m.yaml", copy)
    image = sorted((copy / "images").iterdir())[9]
    original = image.read_bytes()
    image.write_bytes(original[: len(original) // 2])
    data = tmp_path / "ws"
    bad = zygote.run(manifest, data, batch_sleep=0.1)
    assert bad.rc == 2, bad.log
    assert f"error: image '{image}' cannot be read" in bad.log and "truncated" in bad.log, bad.log
    assert "regenerate or replace it" in bad.log and "Traceback" not in bad.log
    kept = committed(data)
    assert {c for _, c, _ in kept} == {0, 1}, sorted(kept)
    assert len(kept) == 12
    assert Workspace.open(data, readonly=True).verify().ok

    image.write_bytes(original)
    good = zygote.run(manifest, data)
    assert good.rc == 0, good.log
    assert f"({N - 2 * CHUNK} computed now" in good.log, good.log
    assert_same_store(snapshot(data), reference[1])


def test_image_with_a_broken_header_fails_before_the_workspace_is_touched(zygote, stimuli, tmp_path):
    """Injects: the PNG of sample 30 cut to 16 bytes (no readable header). Asserts: exit code 2,
    `error: image '<that file>' of stimulus go-faults/... cannot be read` with the fix, no
    traceback, and no workspace was created (the check of every image header runs before)."""
    copy = _stimuli_copy(stimuli, tmp_path)
    manifest = write_manifest(tmp_path / "m.yaml", copy)
    image = sorted((copy / "images").iterdir())[30]
    image.write_bytes(image.read_bytes()[:16])
    data = tmp_path / "ws"
    bad = zygote.run(manifest, data)
    assert bad.rc == 2, bad.log
    assert f"error: image '{image}' of stimulus go-faults/" in bad.log, bad.log
    assert "regenerate the set" in bad.log and "Traceback" not in bad.log
    assert not data.exists()


def test_truncated_workspace_manifest_is_named_by_verify_and_extract(zygote, manifest, reference, tmp_path):
    """Injects: manifest.duckdb of a finished workspace cut to 4 KiB. Asserts: `python -m store
    verify` and a resume with `python -m extract` both exit 2 with "is not a readable DuckDB
    database ... truncated or corrupted: restore it from a backup", no traceback, and the
    extraction did not replace the damaged manifest or write any array."""
    data = tmp_path / "ws"
    shutil.copytree(reference[0], data)
    with open(data / "manifest.duckdb", "r+b") as f:
        f.truncate(4096)
    got = python("-m", "store", "verify", "--data", str(data))
    assert got.returncode == 2, got.stdout + got.stderr
    assert "not a readable DuckDB database" in got.stderr and "truncated or corrupted" in got.stderr
    assert "Traceback" not in got.stderr
    files = sorted(p.relative_to(data) for p in data.rglob("*"))
    again = zygote.run(manifest, data)
    assert again.rc == 2, again.log
    assert "not a readable DuckDB database" in again.log and "restore it from a backup" in again.log
    assert "Traceback" not in again.log
    assert (data / "manifest.duckdb").stat().st_size == 4096
    assert sorted(p.relative_to(data) for p in data.rglob("*")) == files


def test_deleted_and_flipped_chunks_are_named_by_store_verify(reference, tmp_path):
    """Injects, into a copy of a finished workspace: a deleted dense chunk file, one flipped
    byte in another dense chunk, one flipped byte in a ragged block's rows, a deleted ragged
    block rows file, and one flipped byte in a run tensor. Asserts: `python -m store verify`
    exits 1 and names each damaged array and chunk (and the file), counting 5 problems; the
    undamaged workspace verifies (exit 0); a read of the deleted chunk raises an error naming it
    while the other chunks of that array still read."""
    data = tmp_path / "ws"
    shutil.copytree(reference[0], data)
    ok = python("-m", "store", "verify", "--data", str(data))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    arrays = data / "arrays" / "toy"

    def flip(path: Path, at: int = 100) -> None:
        raw = bytearray(path.read_bytes())
        raw[at] ^= 0xFF
        path.write_bytes(bytes(raw))

    (arrays / "llm/1/resid_post/image/c.2.0.0").unlink()
    flip(arrays / "vision/1/resid_post/image/c.5.0.0")
    flip(arrays / "llm/1/resid_post/answer/b3/rows/c.0.0", at=10)
    (arrays / "attn/1/probs/last/b7/rows/c.0.0").unlink()
    flip(arrays / "_tensors/lm_head.weight/c.0.0", at=8)
    got = python("-m", "store", "verify", "--data", str(data))
    out = got.stdout + got.stderr
    assert got.returncode == 1, out
    assert "toy:llm/1/resid_post/image: chunk 2 unreadable" in out and "c.2.0.0 is missing" in out
    assert "toy:vision/1/resid_post/image: chunk 5 (rows 20-23) checksum mismatch" in out and "c.5.0.0" in out
    assert "toy:llm/1/resid_post/answer: chunk 3 (rows 12-15) checksum mismatch" in out and "b3" in out
    assert "toy:attn/1/probs/last: chunk 7 unreadable" in out
    assert "tensor toy/lm_head.weight: checksum mismatch" in out
    assert "5 problem(s)" in out
    # A read of the deleted chunk fails as clearly; reads do not check CRCs (verify does).
    ws = Workspace.open(data, readonly=True)
    missing = r"chunk 2 of toy:llm/1/resid_post/image is committed .*/c\.2\.0\.0 is missing"
    with pytest.raises(WorkspaceError, match=missing):
        ws.read("toy", "llm", 1, tokens="image")
    assert ws.read("toy", "llm", 1, tokens="image", rows=list(range(8))).shape[0] == 8  # other chunks still read
