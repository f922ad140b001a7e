"""Sharded runs: k writers fill one run of one workspace, each its own chunks, none twice, none lost."""

from __future__ import annotations

import numpy as np
import pytest
from storetest_lib import dense_values, read_event, start_writer, write_run

from store import ArraySpec, RunInfo, Shard, StoreError, Workspace, WriterLockError


def _snapshot(ws: Workspace, run: str = "r1") -> dict[str, object]:
    """Everything a reader sees of a run: values, checksums, spans, generations."""
    return {
        "image": ws.read(run, tap="llm", layer=3, tokens="image"),
        "answer": [a.tolist() for a in ws.read(run, tap="llm", layer=3, tokens="answer")],
        "chunks": ws.rows("SELECT zarr_path, chunk, row_start, row_stop, crc32c FROM chunks WHERE run = ?"
                          " ORDER BY zarr_path, chunk", [run]),
        "samples": ws.rows("SELECT array_row, stimulus, seq_len, answer_count FROM samples WHERE run = ?"
                           " ORDER BY array_row", [run]),
        "generations": ws.rows("SELECT stimulus, text, correct FROM generations WHERE run = ? ORDER BY stimulus", [run]),
    }


def _assert_same(a: dict[str, object], b: dict[str, object]) -> None:
    np.testing.assert_array_equal(a["image"], b["image"])
    for key in ("answer", "chunks", "samples", "generations"):
        assert a[key] == b[key], key


def test_shard_parse_and_ownership():
    s = Shard.parse(" 1/3 ")
    assert (s.index, s.count, str(s)) == (1, 3, "1/3")
    assert [k for k in range(8) if s.owns(k)] == [1, 4, 7]
    for bad in ("3/3", "-1/2", "1", "a/b", "1/2/3", "0/0"):
        with pytest.raises(StoreError, match="i/k"):
            Shard.parse(bad)


@pytest.mark.slow
def test_two_shards_in_turn_equal_one_writer(tmp_path):
    ref = Workspace.open(tmp_path / "ref")
    write_run(ref, n=44, chunk=8)  # 6 chunks, the last partial
    ws = Workspace.open(tmp_path / "ws")
    first = write_run(ws, n=44, chunk=8, shard=Shard(0, 2))
    assert first["todo"] == [[0, 8], [16, 24], [32, 40]]
    # One shard done: its chunks are committed, the run is not finished.
    assert ws.rows("SELECT status FROM runs") == [("running",)]
    assert ws.rows("SELECT list_sort(list(DISTINCT chunk)) FROM chunks") == [([0, 2, 4],)]
    second = write_run(ws, n=44, chunk=8, shard="1/2")
    assert second["todo"] == [[8, 16], [24, 32], [40, 44]]
    assert ws.rows("SELECT status FROM runs") == [("finished",)]
    assert ws.rows("SELECT count(*), count(DISTINCT (zarr_path, chunk)) FROM chunks") == [(12, 12)]
    rep = ws.verify()
    assert rep.ok and not rep.warnings, (rep.problems, rep.warnings)
    _assert_same(_snapshot(ws), _snapshot(ref))


@pytest.mark.slow
def test_shards_interleaved_in_one_process(tmp_path):
    """Both shards open at once (their locks coexist), batches interleaved, commits interleaved."""
    ws = Workspace.open(tmp_path / "ws")
    info = RunInfo(run="r1", model="tiny-test", chunk_samples=4)
    writers = [ws.writer(info, shard=Shard(i, 2), min_commit_gap=0.0) for i in range(2)]
    arrays = []
    for w in writers:
        from storetest_lib import stimulus_rows

        w.set_samples(w.register_stimuli(stimulus_rows(16), dataset="set"))
        arrays.append(w.array(ArraySpec(tap="llm", layer=0, tokens="image", shape=(6, 8))))
    todos = [w.todo() for w in writers]
    assert [[(r.start, r.stop) for r in t] for t in todos] == [[(0, 4), (8, 12)], [(4, 8), (12, 16)]]
    for w, h, t in zip(writers, arrays, todos, strict=False):
        w.write(h, t[0].start, dense_values(t[0]))
        w.flush()
    for i in (1, 0):  # shard 1 ends first: the run is finished by shard 0's last chunk
        writers[i].write(arrays[i], todos[i][1].start, dense_values(todos[i][1]))
        writers[i].finish()
        assert ws.rows("SELECT status FROM runs") == [("running" if i else "finished",)]
    assert ws.rows("SELECT status FROM runs") == [("finished",)]
    for w in writers:
        w.close()
    np.testing.assert_array_equal(ws.read("r1", tap="llm", layer=0, tokens="image"),
                                  dense_values(range(16)).astype(np.float16))
    assert ws.verify().ok


@pytest.mark.slow
def test_a_shard_cannot_write_another_shards_rows(tmp_path):
    ws = Workspace.open(tmp_path / "ws")
    from storetest_lib import stimulus_rows

    with ws.writer(RunInfo(run="r1", model="tiny-test", chunk_samples=4), shard=Shard(1, 2)) as w:
        w.set_samples(w.register_stimuli(stimulus_rows(8), dataset="set"))
        h = w.array(ArraySpec(tap="llm", layer=0, tokens="image", shape=(6, 8)))
        with pytest.raises(StoreError, match=r"chunk\(s\) \[0\] of another shard"):
            w.write(h, 2, dense_values(range(2, 6)))
        with pytest.raises(StoreError, match="chunk_samples"):
            w.array(ArraySpec(tap="llm", layer=1, tokens="image", shape=(6, 8), chunk_samples=2))
        with pytest.raises(StoreError, match="written by shard 0"):
            w.write_tensor("lm_head.weight", np.zeros((3, 2), np.float32))
        w.write(h, 4, dense_values(range(4, 8)))
        w.finish()  # its share is complete; the run is not (chunk 0 belongs to shard 0)
    assert ws.rows("SELECT status FROM runs") == [("running",)]
    assert ws.rows("SELECT chunk FROM chunks") == [(1,)]


@pytest.mark.slow
def test_locks_between_shards_and_plain_writers(tmp_path):
    ws = Workspace.open(tmp_path / "ws")
    info = RunInfo(run="r1", model="tiny-test", chunk_samples=4)
    a = ws.writer(info, shard="0/2")
    try:
        with pytest.raises(WriterLockError, match="shard 0/2 of run r1 is already being written by pid"):
            ws.writer(info, shard="0/2")
        with pytest.raises(WriterLockError, match="shards of a sharded run"):
            ws.writer(RunInfo(run="other", model="tiny-test"))
        with pytest.raises(WriterLockError, match="another split"):
            ws.writer(info, shard="1/3")
        b = ws.writer(info, shard="1/2")  # the peer shard coexists
        b.close()
    finally:
        a.close()
    plain = ws.writer(info)
    try:
        with pytest.raises(WriterLockError, match="being written by pid"):
            ws.writer(info, shard="1/2")
    finally:
        plain.close()


@pytest.mark.slow
def test_shard_processes_write_concurrently(tmp_path):
    """Two real processes, each a shard, at once: the same run as one writer makes, value for value."""
    path = tmp_path / "ws"
    Workspace.open(path)
    procs = [start_writer(path, "--n", "40", "--chunk", "4", "--batch", "2", "--sleep", "0.01", "--shard", f"{i}/2")
             for i in range(2)]
    for p in procs:
        read_event(p)
    done = [read_event(p, timeout=60) for p in procs]
    assert [p.wait(30) for p in procs] == [0, 0]
    assert [d["chunks_written"] for d in done] == [10, 10]  # 5 chunks x 2 arrays each
    ws = Workspace.open(path, readonly=True)
    assert ws.rows("SELECT status FROM runs") == [("finished",)]
    rep = ws.verify()
    assert rep.ok and not rep.warnings, (rep.problems, rep.warnings)
    ref = Workspace.open(tmp_path / "ref")
    write_run(ref, n=40, chunk=4, batch=2)
    _assert_same(_snapshot(ws), _snapshot(ref))

