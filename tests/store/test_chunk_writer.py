"""A worker's chunk writer and its client: chunks written where the arrays live, committed by the
client alone, equal byte for byte to one writer's run, each chunk committed once."""

from __future__ import annotations

import numpy as np
import pytest
from storetest_lib import DIM, TOKENS, dense_values, ragged_values, stimulus_rows, write_run

from store import ArraySpec, Generation, RunInfo, StoreError, TokenSpans, Workspace
from store.writer.chunk_writer import ChunkWriter

N, CHUNK, BATCH = 40, 8, 4
INFO = RunInfo(run="r1", model="tiny-test", dtype="float32", chunk_samples=CHUNK, config={"n": N})


def _snapshot(ws: Workspace) -> dict[str, object]:
    return {
        "image": ws.read("r1", tap="llm", layer=3, tokens="image"),
        "answer": [a.tolist() for a in ws.read("r1", tap="llm", layer=3, tokens="answer")],
        "chunks": ws.rows("SELECT zarr_path, chunk, row_start, row_stop, n_rows, nbytes, crc32c, n_nonfinite,"
                          " offsets_crc32c FROM chunks ORDER BY zarr_path, chunk"),
        "arrays": ws.rows("SELECT zarr_path, bytes, n_chunks FROM activations ORDER BY zarr_path"),
        "samples": ws.rows("SELECT array_row, stimulus, seq_len, answer_count, spans FROM samples ORDER BY array_row"),
        "generations": ws.rows("SELECT stimulus, array_row, text, correct, metrics FROM generations ORDER BY stimulus"),
        "status": ws.rows("SELECT status FROM runs"),
    }


def _worker(site, infos, keys, rows: range):
    """What a worker does with one task: its rows in batches, through its own chunk writer."""
    with ChunkWriter(site, INFO, infos, {i: keys[i] for i in rows}) as cw:
        img, ans = (cw.handle(i.zarr_path) for i in infos)
        for s in range(rows.start, rows.stop, BATCH):
            e = min(s + BATCH, rows.stop)
            cw.write_batch(
                s, {img: dense_values(range(s, e)), ans: [ragged_values(i) for i in range(s, e)]},
                tokens=[TokenSpans(seq_len=20, image_start=2, image_count=6, grid_h=2, grid_w=3, last_prompt=15,
                                   answer_start=16, answer_count=i % 4) for i in range(s, e)],
                generations=[Generation(text=str(i % 5), prediction=i % 5, parse_ok=True, correct=i % 3 == 0,
                                        metrics={"cells_correct": i % 9, "cells_total": 9}) for i in range(s, e)],
            )
        return cw.close()


def _client_run(ws: Workspace, *, twice: tuple[int, ...] = (), stop_after: int | None = None) -> int:
    """The client: declares the run, hands each chunk to a 'worker', commits what comes back.
    ``twice``: chunks whose task ran twice (both results arrive); ``stop_after``: commit that many
    results, then stop (a client killed mid-run). Returns the chunks the writer skipped."""
    with ws.writer(INFO, min_commit_gap=0.0) as w:
        keys = w.register_stimuli(stimulus_rows(N), dataset="set")
        w.set_samples(keys)
        handles = [w.array(ArraySpec(tap="llm", layer=3, tokens="image", shape=(TOKENS, DIM), module="model.layers.3")),
                   w.array(ArraySpec(tap="llm", layer=3, tokens="answer", shape=(DIM,), ragged=True))]
        infos = [h.info for h in handles]
        site = w.site()
        groups = [range(k, min(k + CHUNK, rows.stop)) for rows in w.todo() for k in range(rows.start, rows.stop, CHUNK)]
        results = []
        for g in groups:
            results.append(_worker(site, infos, keys, g))
            if g.start // CHUNK in twice:
                results.append(_worker(site, infos, keys, g))
        for done, written in enumerate(results):
            if stop_after is not None and done == stop_after:
                return w.stats.chunks_skipped
            w.commit_written(written)
        w.flush()
        w.finish()
        return w.stats.chunks_skipped


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ws = Workspace.open(tmp_path_factory.mktemp("ref") / "ws")
    write_run(ws, n=N, chunk=CHUNK, batch=BATCH)
    return _snapshot(ws)


def _same(a, b):
    np.testing.assert_array_equal(a["image"], b["image"])
    for key in ("answer", "chunks", "arrays", "samples", "generations", "status"):
        assert a[key] == b[key], key


def test_workers_chunks_committed_by_the_client_equal_one_writers_run(tmp_path, reference):
    ws = Workspace.open(tmp_path / "ws")
    assert _client_run(ws) == 0
    _same(_snapshot(ws), reference)
    rep = ws.verify()
    assert rep.ok and not rep.warnings, (rep.problems, rep.warnings)
    assert not list(ws.zarr_path.rglob("*.partial"))


def test_a_task_that_ran_twice_is_committed_once(tmp_path, reference):
    ws = Workspace.open(tmp_path / "ws")
    assert _client_run(ws, twice=(0, 3)) == 4  # two chunks (image + answer) of each task run twice
    _same(_snapshot(ws), reference)
    assert ws.rows("SELECT count(*), count(DISTINCT (zarr_path, chunk)) FROM chunks") == [(10, 10)]


def test_a_client_stopped_mid_run_resumes_with_only_the_missing_chunks(tmp_path, reference):
    ws = Workspace.open(tmp_path / "ws")
    _client_run(ws, stop_after=2)
    assert ws.rows("SELECT count(*) FROM chunks") == [(4,)]
    assert ws.rows("SELECT status FROM runs") == [("stopped",)]
    _client_run(ws)
    _same(_snapshot(ws), reference)


@pytest.mark.slow
def test_workers_stage_and_upload_to_an_object_store(s3, tmp_path, reference):
    ws = Workspace.open(tmp_path / "ws", arrays_url=s3.url("cluster"))
    _client_run(ws)
    _same(_snapshot(ws), reference)
    rep = ws.verify()
    assert rep.ok and not rep.warnings, (rep.problems, rep.warnings)
    staged = [p for p in ws.zarr_path.rglob("*") if p.is_file() and p.name != "zarr.json"]
    assert staged == [] or all(p.parent.name == "sample" for p in staged), staged  # no chunk data stays local


def _declared(tmp_path):
    """(workspace, stimulus keys, image array, site) of a run the client declared and let go of."""
    ws = Workspace.open(tmp_path / "ws")
    with ws.writer(INFO) as w:
        keys = w.register_stimuli(stimulus_rows(N), dataset="set")
        w.set_samples(keys)
        info = w.array(ArraySpec(tap="llm", layer=3, tokens="image", shape=(TOKENS, DIM))).info
        return ws, keys, info, w.site()


def test_a_worker_writes_only_its_tasks_rows(tmp_path):
    _, keys, info, site = _declared(tmp_path)
    with ChunkWriter(site, INFO, [info], {i: keys[i] for i in range(8)}) as cw, pytest.raises(StoreError, match="row 8"):
        cw.write_batch(8, {cw.handle(info.zarr_path): dense_values(range(8, 12))},
                       generations=[Generation(text="1") for _ in range(4)])


def test_a_worker_that_cannot_see_the_workspace_is_told_why(tmp_path):
    from store.writer.site import ArraySite

    with pytest.raises(StoreError, match="shared file system"):
        ChunkWriter(ArraySite(str(tmp_path / "elsewhere")), INFO, [_info()], {0: "set/s0000"})


def _info():
    from store.records import ArrayInfo

    return ArrayInfo(run="r1", tap="llm", layer=3, site="resid_post", tokens="image", module=None,
                     zarr_path="r1/llm/3/resid_post/image", layout="dense", shape=(N, TOKENS, DIM),
                     dims=("sample", "token", "dim"), chunk_samples=CHUNK, n_chunks=5, dtype="float32",
                     stored_dtype="float16", codec="none", values_per_row=TOKENS * DIM, bytes=0)


@pytest.mark.parametrize("workers_writing", [True, False])
def test_a_writer_opened_while_workers_write_leaves_their_files_in_flight(tmp_path, workers_writing):
    """The client reopens the run's writer to commit while a worker's chunk is half written: that
    chunk's temporary file must survive the open (a writer opened with no task out tidies it away)."""
    ws, keys, info, site = _declared(tmp_path)
    cw = ChunkWriter(site, INFO, [info], {i: keys[i] for i in range(CHUNK)})
    handle = cw.handle(info.zarr_path)
    cw.write_batch(0, {handle: dense_values(range(BATCH))})  # half of chunk 0: streamed to a .partial file
    from waiting import wait_for

    wait_for(lambda: list(ws.zarr_path.rglob("*.partial")), 10)
    with ws.writer(INFO, workers_writing=workers_writing) as w:
        w.array(ArraySpec(tap="llm", layer=3, tokens="image", shape=(TOKENS, DIM)))
        if not workers_writing:
            assert not list(ws.zarr_path.rglob("*.partial"))  # tidied: no task of the run is out
            cw.abort()
            return
        cw.write_batch(BATCH, {handle: dense_values(range(BATCH, CHUNK))})
        w.commit_written(cw.close())
        w.flush()
    np.testing.assert_array_equal(ws.read("r1", tap="llm", layer=3, tokens="image", committed_only=True),
                                  dense_values(range(CHUNK)).astype(np.float16))
