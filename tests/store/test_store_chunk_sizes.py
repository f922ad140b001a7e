"""Chunk sizes: Zarr stores a dense array's last chunk full-size, so the writer evens its chunks out
(store/records.py ``chunk_size``) and the last one wastes no space; runs stored before that keep
their chunks, and still read and resume."""

from __future__ import annotations

from pathlib import Path

import duckdb
import numpy as np
import pytest
import zarr
from storetest_lib import TOKENS, dense_values, stimulus_rows

from store import ArraySpec, RunInfo, Shard, Workspace, size_estimate
from store import arrays as layout
from store.records import ArrayInfo, chunk_size
from store.writer.run_manifest import insert_arrays


@pytest.mark.parametrize(("n", "requested", "batch", "size"), [
    (200, 64, 1, 50),      # four chunks of 50, not three of 64 and one of 8 stored as 64
    (200, 64, 8, 40),      # multiples of the batch: five of 40
    (200, 256, 1, 200),    # never larger than the array
    (6400, 256, 8, 256),   # already exact
    (1000, 256, 1, 250),
    (1000, 256, 8, 200),
    (199, 64, 1, 50),      # one padded row
    (199, 64, 8, 40),      # the last batch is short: one padded row
    (10, 4, 3, 4),         # 4 is no multiple of 3: evened by rows
    (80, 4, 2, 4),
])
def test_chunk_size_evens_out_the_last_chunk(n, requested, batch, size):
    got = chunk_size(n, requested, batch)
    chunks = -(-n // got)
    assert got == size and got <= requested
    assert chunks * got - n < max(chunks, batch)  # under a row per chunk, or under one batch in all
    if batch > 1 and requested % batch == 0 and got < n:
        assert got % batch == 0


def _write(ws: Workspace, info: RunInfo, n: int, batch: int, dtype: str = "float32") -> ArrayInfo:
    with ws.writer(info) as w:
        w.set_samples(w.register_stimuli(stimulus_rows(n), dataset="set"))
        h = w.array(ArraySpec(tap="llm", layer=0, tokens="image", shape=(TOKENS, 8), dtype=dtype))
        for rows in w.todo():
            for s in range(rows.start, rows.stop, batch):
                w.write(h, s, dense_values(range(s, min(s + batch, rows.stop))).astype(dtype))
        w.finish()
    return next(iter(ws.arrays(info.run)))


def _chunk_file_bytes(ws: Workspace, info: ArrayInfo) -> int:
    folder = ws.zarr_path / info.zarr_path
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and f.name != "zarr.json")


@pytest.mark.parametrize(("n", "requested", "batch", "chunks"), [(200, 64, 8, 5), (200, 64, 1, 4), (1000, 256, 1, 4)])
def test_a_run_stores_two_bytes_per_float16_value(tmp_path, n, requested, batch, chunks):
    """200 samples in chunks of at most 64 took 2.56 bytes per value (the last chunk of 8 rows stored
    as 64); now exactly 2, on disk and in the manifest, and `store size` says the same beforehand."""
    ws = Workspace.open(tmp_path / "ws")
    info = _write(ws, RunInfo(run="r", model="m", chunk_samples=requested, batch_size=batch), n, batch, "float16")
    values = n * TOKENS * 8
    assert info.n_chunks == chunks and info.chunk_samples * chunks == n
    assert zarr.open_group(ws.zarr_path, mode="r")[info.zarr_path].chunks == (n // chunks, TOKENS, 8)
    assert _chunk_file_bytes(ws, info) == info.bytes == 2 * values
    assert ws.rows("SELECT bytes_per_value FROM v_arrays WHERE run = 'r'") == [(2.0,)]
    est = size_estimate(samples=n, layers=1, tokens=TOKENS, dim=8, chunk_samples=requested, batch_size=batch)
    assert est.raw_bytes == info.bytes and est.chunk_files == chunks and est.chunk_samples == info.chunk_samples
    np.testing.assert_array_equal(ws.read("r", "llm", 0, tokens="image"), dense_values(range(n)).astype(np.float16))


def _old_layout_run(ws: Workspace, info: RunInfo, n: int) -> ArrayInfo:
    """A run as a writer before evened chunks registered it: its array chunked by min(chunk_samples, n)."""
    with ws.writer(info) as w:
        w.set_samples(w.register_stimuli(stimulus_rows(n), dataset="set"))
    old = ArrayInfo(run=info.run, tap="llm", layer=0, site="resid_post", tokens="image", module=None,
                    zarr_path=layout.array_path(info.run, "llm", 0, "resid_post", "image"), layout="dense",
                    shape=(n, TOKENS, 8), dims=("sample", "image_token", "dim"), chunk_samples=info.chunk_samples,
                    n_chunks=-(-n // info.chunk_samples), dtype="float32", stored_dtype="float16", codec="none",
                    values_per_row=TOKENS * 8, bytes=0)
    con = duckdb.connect(str(ws.manifest_path))
    try:
        insert_arrays(con, [old])
    finally:
        con.close()
    return old


def test_a_run_stored_with_full_size_last_chunks_reads_and_resumes(tmp_path):
    ws = Workspace.open(tmp_path / "ws")
    info = RunInfo(run="old", model="m", chunk_samples=64, batch_size=8)
    old = _old_layout_run(ws, info, 200)
    spec = ArraySpec(tap="llm", layer=0, tokens="image", shape=(TOKENS, 8))
    with ws.writer(info) as w:
        h = w.array(spec)
        assert (h.info.chunk_samples, h.info.n_chunks) == (64, 4)
        w.write(h, 0, dense_values(range(128)))
        w.finish(partial_ok=True)
    with ws.writer(info) as w:
        h, deeper = w.arrays([spec, ArraySpec(tap="llm", layer=1, tokens="image", shape=(TOKENS, 8))])
        assert w.todo() == [range(0, 200)]  # the new array needs every row; the old one only 128..199
        assert h.info.chunk_samples == deeper.info.chunk_samples == 64  # a new array takes the run's chunks
        assert h.committed == {0, 1}
        w.write(h, 128, dense_values(range(128, 200)))
        w.write(deeper, 0, dense_values(range(200)))
        w.finish()
    assert ws.rows("SELECT status FROM runs WHERE run = 'old'") == [("finished",)]
    node = zarr.open_group(ws.zarr_path, mode="r")[old.zarr_path]
    assert node.chunks == (64, TOKENS, 8)
    assert ws.rows("SELECT bytes FROM activations WHERE zarr_path = ?", [old.zarr_path]) == [(256 * TOKENS * 8 * 2,)]
    np.testing.assert_array_equal(ws.read("old", "llm", 0, tokens="image"), dense_values(range(200)).astype(np.float16))
    np.testing.assert_array_equal(ws.read("old", "llm", 1, tokens="image"), dense_values(range(200)).astype(np.float16))
    rep = ws.verify()
    assert rep.ok, rep.problems


@pytest.mark.parametrize(("n", "requested", "batch", "shards"), [
    pytest.param(9, 4, 1, 2, marks=pytest.mark.slow), (200, 64, 8, 3),
    pytest.param(1000, 256, 1, 3, marks=pytest.mark.slow)])
def test_shards_own_every_row_once_with_evened_chunks(tmp_path, n, requested, batch, shards):
    ws = Workspace.open(tmp_path / "ws")
    info = RunInfo(run="r", model="m", chunk_samples=requested, batch_size=batch)
    size = chunk_size(n, requested, batch)
    writers = [ws.writer(info, shard=Shard(i, shards), min_commit_gap=0.0) for i in range(shards)]
    try:
        owned = []
        for i, w in enumerate(writers):
            w.set_samples(w.register_stimuli(stimulus_rows(n), dataset="set"))
            before = w.todo()  # before its arrays exist, a shard already names the rows it will own
            h = w.array(ArraySpec(tap="llm", layer=0, tokens="image", shape=(TOKENS, 8)))
            assert h.info.chunk_samples == size and w.todo() == before
            assert all(r.start % size == 0 and (r.stop % size == 0 or r.stop == n) for r in before)
            assert all((r.start // size) % shards == i for r in before)
            for r in before:
                for s in range(r.start, r.stop, batch):
                    w.write(h, s, dense_values(range(s, min(s + batch, r.stop))))
            owned += [row for r in before for row in r]
        assert sorted(owned) == list(range(n))
        for w in writers:
            w.finish()
    finally:
        for w in writers:
            w.close()
    assert ws.rows("SELECT status FROM runs") == [("finished",)]
    np.testing.assert_array_equal(ws.read("r", "llm", 0, tokens="image"), dense_values(range(n)).astype(np.float16))


def test_store_size_cli_evens_chunks(tmp_path: Path, capsys):
    from store.cli import main as cli

    assert cli(["size", "--samples", "200", "--layers", "1", "--tokens", "4", "--dim", "8", "--chunk-samples", "64",
                "--batch-size", "8", "--data", str(tmp_path / "none")]) == 0
    out = capsys.readouterr().out
    assert "5 chunk files of 40 samples" in out and "(12,800 bytes)" in out  # 200 x 4 x 8 x 2, none padded
