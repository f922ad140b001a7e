"""Real processes: kill -9 mid-run and resume, the writer lock, reading while another process writes."""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest
from storetest_lib import dense_values, python, read_event, start_writer, wait_for, write_run

from store import Workspace, WriterLockError
from store.errors import ManifestBusyError


def _committed(ws: Workspace) -> int:
    try:
        return ws.rows("SELECT count(*) FROM chunks")[0][0]
    except ManifestBusyError:
        return 0


@pytest.mark.slow
def test_kill_9_mid_run_then_resume_holds_every_row_once(tmp_path):
    path = tmp_path / "ws"
    ws = Workspace.open(path)
    proc = start_writer(path, "--n", "48", "--chunk", "8", "--batch", "2", "--sleep", "0.08")
    pid = read_event(proc)["pid"]
    try:
        wait_for(lambda: _committed(ws) >= 3, timeout=60)
    finally:
        os.kill(pid, signal.SIGKILL)
        proc.wait(10)
    assert proc.returncode == -signal.SIGKILL
    before = _committed(ws)
    assert 3 <= before < 12, "the kill must land mid-run (12 chunks in all)"
    # The dead writer's lock is stale, its run 'running'; what it committed already verifies.
    lock = json.loads((path / "writer.lock").read_text())
    assert lock["pid"] == pid
    rep = ws.verify()
    assert rep.ok, rep.problems
    assert any("interrupted; resume it" in w for w in rep.warnings), rep.warnings

    rerun = start_writer(path, "--n", "48", "--chunk", "8", "--batch", "2")
    read_event(rerun)
    done = read_event(rerun, timeout=60)
    assert rerun.wait(30) == 0
    assert done["took_over"] == pid  # the stale lock was detected and taken over
    assert done["todo"] and done["todo"][0][0] > 0  # committed chunks were not redone
    assert done["chunks_written"] <= 12 * 2 - before + 2

    assert ws.verify().ok
    assert ws.rows("SELECT count(*), count(DISTINCT (zarr_path, chunk)) FROM chunks") == [(12, 12)]
    assert ws.rows("SELECT count(*), count(DISTINCT stimulus) FROM samples") == [(48, 48)]
    assert ws.rows("SELECT count(*), count(recorded_at) FROM samples") == [(48, 48)]
    assert ws.rows("SELECT count(*) FROM generations") == [(48,)]
    assert ws.rows("SELECT status FROM runs") == [("finished",)]
    # Equal to an uninterrupted run, value for value and checksum for checksum.
    ref = Workspace.open(tmp_path / "ref")
    write_run(ref, n=48, chunk=8, batch=2)
    for tokens in ("image", "answer"):
        a, b = ws.read("r1", "llm", 3, tokens=tokens), ref.read("r1", "llm", 3, tokens=tokens)
        if tokens == "image":
            assert np.array_equal(a, b) and np.array_equal(a, dense_values(range(48)).astype(np.float16))
        else:
            assert np.array_equal(a.values, b.values) and np.array_equal(a.offsets, b.offsets)
    crc = "SELECT zarr_path, chunk, crc32c FROM chunks ORDER BY ALL"
    assert ws.rows(crc) == ref.rows(crc)
    assert not list((path / "arrays").rglob("*.partial"))


@pytest.mark.slow
def test_second_writer_gets_the_holder_pid_and_readers_read_meanwhile(tmp_path):
    path = tmp_path / "ws"
    ws = Workspace.open(path)
    holder = start_writer(path, "--hold")
    try:
        pid = read_event(holder)["pid"]
        with pytest.raises(WriterLockError) as err:
            write_run(ws)
        assert f"pid {pid}" in str(err.value) and "One writer per workspace" in str(err.value)
        # The workspace stays readable while the writer holds its lock.
        assert ws.rows("SELECT run, status FROM runs") == [("holder", "running")]
    finally:
        holder.kill()
        holder.wait(10)
    write_run(ws, n=8)  # the lock died with its holder
    assert ws.verify().ok


@pytest.mark.slow
def test_reader_process_reads_while_writer_process_writes(tmp_path):
    path = tmp_path / "ws"
    ws = Workspace.open(path)
    # The writer must outlast several reader polls on a slow machine: each poll opens the manifest
    # three times, and each open waits for the writer to hand its connection over (a CI run with
    # 0.03 s per batch saw the writer finish within four polls).
    samples = 160
    writer = start_writer(path, "--n", str(samples), "--chunk", "8", "--batch", "4", "--sleep", "0.1")
    read_event(writer)
    seen, reads = [], 0
    try:
        while writer.poll() is None:
            n = _committed(ws)
            seen.append(n)
            if n:
                got = ws.read("r1", "llm", 3, tokens="image", committed_only=True)
                done = {c for (c,) in ws.rows("SELECT chunk FROM chunks WHERE zarr_path LIKE '%image'")}
                # Chunks committed between the read and this query may be missing from `got`.
                assert len(got) % 8 == 0 and len(got) // 8 <= len(done)
                expect = dense_values(range(samples)).astype(np.float16)
                rows = [r for r in range(samples) if r // 8 in done][: len(got)]
                assert np.array_equal(got, expect[rows])
                reads += 1
            time.sleep(0.05)
    finally:
        if writer.poll() is None:
            writer.kill()
    assert writer.wait(30) == 0, writer.stderr.read() if writer.stderr else ""
    assert reads >= 3 and len(set(seen)) >= 3, (reads, seen)
    assert seen == sorted(seen)  # readers only ever see more committed chunks
    assert ws.verify().ok


@pytest.mark.slow
def test_plain_duckdb_and_plain_zarr_read_the_workspace_without_agnosia(tmp_path):
    path = tmp_path / "ws"
    write_run(Workspace.open(path), n=16)
    code_duck = (
        "import sys, duckdb\n"
        f"con = duckdb.connect({str(path / 'manifest.duckdb')!r}, read_only=True)\n"
        "print(con.sql('SELECT tap, layer, count(*) FROM activations GROUP BY ALL ORDER BY ALL').fetchall())\n"
        "assert 'store' not in sys.modules\n"
    )
    out = python("-c", code_duck, cwd=tmp_path, env={"PYTHONPATH": ""})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[('llm', 3, 2)]"
    code_zarr = (
        "import sys, zarr, numpy as np\n"
        f"g = zarr.open_group({str(path / 'arrays')!r}, mode='r')\n"
        "a = g['r1/llm/3/resid_post/image']\n"
        "print(a.shape, a.dtype, a.attrs['tap'], a.attrs['layer'], a.attrs['module'], a.metadata.dimension_names)\n"
        "print(float(np.asarray(a[5, 1, 2], dtype=np.float64)))\n"
        "b = g['r1/llm/3/resid_post/answer/b0']\n"
        "print(b['offsets'][:].tolist(), b['rows'].shape)\n"
        "assert 'store' not in sys.modules\n"
    )
    out = python("-c", code_zarr, cwd=tmp_path, env={"PYTHONPATH": ""})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "(16, 6, 8) float16 llm 3 model.layers.3 ('sample', 'image_token', 'dim')"
    assert float(lines[1]) == float(dense_values([5])[0, 1, 2].astype(np.float16))
    assert lines[2] == "[0, 0, 1, 3, 6, 6, 7, 9, 12] (12, 8)"


@pytest.mark.slow
def test_store_never_imports_torch(tmp_path):
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # any import of torch now fails\n"
        "import numpy as np, store\n"
        "from store.dtypes import float32_to_bf16_bits\n"
        f"ws = store.Workspace.open({str(tmp_path / 'ws')!r})\n"
        "with ws.writer(store.RunInfo(run='r', model='m', chunk_samples=4)) as w:\n"
        "    w.set_samples(w.register_stimuli([{'id': str(i)} for i in range(4)], dataset='d'))\n"
        "    a = w.array(store.ArraySpec(tap='llm', layer=0, tokens='last', shape=(3,), dtype='bfloat16'))\n"
        "    w.write(a, 0, float32_to_bf16_bits(np.arange(12, dtype=np.float32).reshape(4, 3)))\n"
        "    w.finish()\n"
        "print(ws.read('r', 'llm', 0, tokens='last').sum())\n"
    )
    out = python("-c", code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "66.0"


@pytest.mark.slow
def test_xarray_opens_an_array_group_without_agnosia(tmp_path):
    """Runs only where xarray is installed (it is not in requirements.lock)."""
    xr = pytest.importorskip("xarray")
    from store import ArraySpec, RunInfo

    ws = Workspace.open(tmp_path / "ws")
    with ws.writer(RunInfo(run="r", model="m", chunk_samples=4)) as w:
        w.set_samples(w.register_stimuli([{"id": str(i)} for i in range(8)], dataset="d"))
        a = w.array(ArraySpec(tap="llm", layer=0, tokens="last", shape=(5,)))
        w.write(a, 0, np.arange(40, dtype=np.float32).reshape(8, 5))
        w.finish()
    ds = xr.open_zarr(str(ws.zarr_path), group="r/llm/0/resid_post", consolidated=False)
    assert ds["last"].dims == ("sample", "dim") and float(ds["last"][7, 4]) == 39.0
