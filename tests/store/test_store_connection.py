"""The writer's one manifest connection: kept across a run's transactions, given up to others.

Found by profiling an extraction (issue 19): a DuckDB connect + close (a checkpoint) for every
commit, and a read and a write connection for every declared array, kept the writer thread busy
for 9-22 % of the run, half of it in ``duckdb.connect``.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from storetest_lib import DIM, TOKENS, dense_values, python, stimulus_rows, wait_for

from store import ArraySpec, Generation, RunInfo, TokenSpans, Workspace, db
from store.errors import StoreError


def _specs() -> list[ArraySpec]:
    return [ArraySpec(tap=tap, layer=layer, tokens="image", shape=(TOKENS, DIM), dtype="float32")
            for tap in ("vision", "llm") for layer in (0, 1)]


def test_a_run_keeps_one_manifest_connection_across_its_transactions(tmp_path, connects):
    """Asserts: declaring 4 arrays builds at most one DuckDB instance (before: 8 connections, a read
    and a write one each); 6 commits in a row build at most 2 (before: one connect each; the
    writer's held connection re-attaches to the process's one instance after each let-go, every
    0.4 s at most, store/db.py HOLD_S, which builds none); and the run reads back whole."""
    ws = Workspace.open(tmp_path / "ws")
    with ws.writer(RunInfo(run="r", model="m", chunk_samples=4)) as w:
        w.set_samples(w.register_stimuli(stimulus_rows(24), dataset="d"))
        before = len(connects)
        handles = w.arrays(_specs())
        assert len(connects) - before <= 1, connects[before:]
        assert [h.info.tap for h in handles] == ["vision", "vision", "llm", "llm"]
        assert w.array(_specs()[2]) is handles[2]  # declared once; asking again returns it
        before, commits = len(connects), w.stats.commits
        for start in range(0, 24, 4):
            w.write_batch(start, {h: dense_values(range(start, start + 4)) for h in handles})
            w.flush()
        assert w.stats.commits - commits >= 6
        assert len(connects) - before <= 2, connects[before:]
        w.finish()
    assert ws.verify().ok
    np.testing.assert_array_equal(ws.read("r", "llm", 1, tokens="image"),
                                  dense_values(range(24)).astype(np.float16))
    # Depths numbered once all four are in (vision 0-1, then the merger and projector, then llm 0-1).
    assert ws.rows("SELECT tap, layer, depth FROM activations ORDER BY depth") == [
        ("vision", 0, 0), ("vision", 1, 1), ("llm", 0, 5), ("llm", 1, 6)]


@pytest.mark.slow
def test_other_processes_read_while_a_writer_holds_the_manifest(tmp_path):
    """Asserts: while a writer holds its connection (here idle, between registration and its
    first batch), a reader in another process gets in through agnosia (it signals, the writer
    lets go within ~0.1 s) and so does a plain DuckDB client that retries (the writer lets go of
    an idle connection within 6 s); the writer then goes on and its run is whole."""
    path = tmp_path / "ws"
    ws = Workspace.open(path)
    with ws.writer(RunInfo(run="r", model="m", chunk_samples=4)) as w:
        w.set_samples(w.register_stimuli(stimulus_rows(8), dataset="d"))
        (h,) = w.arrays(_specs()[:1])
        assert w._manifest.is_open
        started = time.monotonic()
        agnosia = python("-c", "import sys; from store import Workspace; "
                         "print(Workspace.open(sys.argv[1], readonly=True).rows('SELECT count(*) FROM samples')[0][0])",
                         str(path))
        assert agnosia.returncode == 0 and agnosia.stdout.strip() == "8", agnosia.stderr
        plain = python("-c", "import duckdb, sys, time\n"
                       "for _ in range(600):\n"
                       "    try:\n"
                       "        con = duckdb.connect(sys.argv[1], read_only=True)\n"
                       "        break\n"
                       "    except duckdb.IOException:\n"
                       "        time.sleep(0.05)\n"
                       "print(con.execute('SELECT count(*) FROM activations').fetchone()[0])",
                       str(ws.manifest_path))
        assert plain.returncode == 0 and plain.stdout.strip() == "1", plain.stderr
        assert time.monotonic() - started < 30
        w.write(h, 0, dense_values(range(8)))
        w.finish()
    np.testing.assert_array_equal(ws.read("r", "vision", 0, tokens="image"),
                                  dense_values(range(8)).astype(np.float16))


def test_records_alone_wait_for_records_every_while_chunks_commit_at_once(tmp_path):
    """Asserts: generations with no chunk to go with them are not committed within commit_every
    (before: a commit every second for progress alone, CPU beside the model's); a complete chunk
    is committed at once, its records with it; and manifest writes run DuckDB on one thread."""
    ws = Workspace.open(tmp_path / "ws")
    with ws.writer(RunInfo(run="r", model="m", chunk_samples=4), commit_every=0.05, min_commit_gap=0.0,
                   records_every=60.0) as w:
        w.set_samples(w.register_stimuli(stimulus_rows(8), dataset="d"))
        (h,) = w.arrays(_specs()[:1])
        commits = w.stats.commits
        w.record_generations(0, [Generation(text="1"), Generation(text="2")])
        time.sleep(0.6)  # 12 x commit_every
        assert w.stats.commits == commits
        w.write(h, 0, dense_values(range(4)))
        wait_for(lambda: w.stats.commits > commits, timeout=10)
        with db.connect(ws.manifest_path, read_only=False) as con:
            assert con.execute("SELECT count(*) FROM generations").fetchone() == (2,)
            assert con.execute("SELECT current_setting('threads')").fetchone() == (1,)
        w.write(h, 4, dense_values(range(4, 8)))
        w.finish()


WRITER_RUN = """
import sys
import numpy as np
from store import ArraySpec, Generation, RunInfo, TokenSpans, Workspace
ws = Workspace.open(sys.argv[1])
rows = [{"id": str(i), "family": "g2m", "seed": i if i % 2 else None, "prompt": "p", "answer": "a",
         "truth": {"matrix": [[i]]}} for i in range(8)]
with ws.writer(RunInfo(run="r", model="m", chunk_samples=4)) as w:
    w.set_samples(w.register_stimuli(rows, dataset="d"))
    dense, ragged = w.arrays([ArraySpec(tap="llm", layer=0, tokens="image", shape=(2, 3), dtype="float32"),
                              ArraySpec(tap="llm", layer=0, tokens="answer", shape=(3,), ragged=True,
                                        dtype="float32")])
    w.write_tensor("lm_head.weight", np.ones((4, 3), np.float32))
    w.record_vocab(["a", "b", "c", "d"])
    for start in (0, 4):
        w.write_batch(start, {dense: np.full((4, 2, 3), start, np.float32),
                              ragged: [np.ones((k % 3, 3), np.float32) for k in range(4)]},
                      tokens=[TokenSpans(seq_len=5, image_start=1, image_count=2) for _ in range(4)],
                      generations=[Generation(text="x", parse_ok=k % 2 == 0, correct=None if k == 1 else k == 0,
                                              score=None if k == 2 else 0.5, n_tokens=k) for k in range(4)])
    w.finish()
from store import ProbeResult
ws.record_probes([ProbeResult(run="r", tap="llm", layer=0, target="t", kind="ridge", score=0.5, n_train=6,
                              predictions={"array_row": [0, 1], "prediction": [1.0, float("nan")],
                                           "truth": [1.0, 0.0]})])
print("pandas" in sys.modules)
"""


def test_a_writer_run_does_not_import_pandas_and_stores_nulls_as_nulls(tmp_path):
    """Asserts: a whole writer run (stimuli, row map, dense and ragged arrays, a run tensor, the
    vocabulary, token spans, generations) and a probe result with its predictions do not import
    pandas (before: each pyarrow table built for DuckDB imported it, ~0.5 s of every extraction's
    start and ~0.9 s of a probe plan's), and the NULLs and types stored are the ones given."""
    out = python("-c", WRITER_RUN, str(tmp_path / "ws"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False"], out.stdout
    ws = Workspace.open(tmp_path / "ws", readonly=True)
    assert ws.verify().ok
    assert ws.rows("SELECT array_row, parse_ok, correct, score, n_tokens FROM generations ORDER BY array_row")[:4] == [
        (0, True, True, 0.5, 0), (1, False, None, 0.5, 1), (2, True, False, None, 2), (3, False, False, 0.5, 3)]
    assert ws.rows("SELECT seed FROM stimuli ORDER BY id") == [(None,), (1,), (None,), (3,), (None,), (5,),
                                                                   (None,), (7,)]
    assert ws.rows("SELECT count(*), min(seq_len), max(image_count) FROM samples") == [(8, 5, 2)]
    assert ws.vocab("r") == ["a", "b", "c", "d"]
    assert ws.rows("SELECT count(*), count(offsets_crc32c) FROM chunks WHERE zarr_path LIKE '%answer%'") == [(2, 2)]
    assert ws.rows("SELECT count(offsets_crc32c) FROM chunks WHERE zarr_path LIKE '%image%'") == [(0,)]
    assert ws.rows("SELECT layer, n_train, n_test, control_score, score FROM probes") == [(0, 6, None, None, 0.5)]
    assert ws.rows("SELECT array_row, prediction, truth, score FROM probe_predictions ORDER BY array_row") == [
        (0, 1.0, 1.0, None), (1, None, 0.0, None)]


def test_a_batch_is_one_hand_over_to_the_writer_thread_and_a_bad_part_queues_none_of_it(tmp_path):
    """Asserts: write_batch with 4 arrays, token spans and generations puts one item on the writer
    thread's queue (before: 6, each waking the writer thread beside the model's forward); a batch
    whose last array has the wrong shape is refused whole: its records are not queued either; and
    the run then stores what the good batches held."""
    ws = Workspace.open(tmp_path / "ws")
    with ws.writer(RunInfo(run="r", model="m", chunk_samples=4)) as w:
        w.set_samples(w.register_stimuli(stimulus_rows(8), dataset="d"))
        handles = w.arrays(_specs())
        puts: list[str] = []
        real_put = w._handover.queue.put
        w._handover.queue.put = lambda item, *a, **k: (  # type: ignore[method-assign]
            puts.append(item[0] if isinstance(item, tuple) else "stop"), real_put(item, *a, **k))[1]
        spans = [TokenSpans(seq_len=9, image_start=1, image_count=TOKENS) for _ in range(4)]
        w.write_batch(0, {h: dense_values(range(4)) for h in handles}, tokens=spans,
                      generations=[Generation(text=str(i)) for i in range(4)])
        assert puts == ["batch"]
        bad = {h: dense_values(range(4, 8)) for h in handles} | {handles[-1]: np.zeros((4, 1), np.float32)}
        with pytest.raises(StoreError, match="expected a batch of shape"):
            w.write_batch(4, bad, generations=[Generation(text="bad") for _ in range(4)])
        assert puts == ["batch"]
        w.write_batch(4, {h: dense_values(range(4, 8)) for h in handles}, tokens=spans,
                      generations=[Generation(text=str(i)) for i in range(4, 8)])
        w.finish()
    assert ws.rows("SELECT string_agg(text, '' ORDER BY array_row) FROM generations") == [("01234567",)]
    assert ws.rows("SELECT count(*) FROM samples WHERE seq_len = 9") == [(8,)]
    np.testing.assert_array_equal(ws.read("r", "llm", 1, tokens="image"), dense_values(range(8)).astype(np.float16))


def test_a_set_registers_block_by_block_with_ids_still_unique_across_blocks(tmp_path):
    """Asserts: a 600-stimulus set (3 registration blocks) registers every row in file order, and
    again as a no-op; an id repeated 500 rows apart (two blocks) is still refused, naming it
    (found while cutting the run's peak memory: the set is no longer held as Python rows at once)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    good, bad = tmp_path / "good", tmp_path / "bad"
    rows = stimulus_rows(600)
    for folder, table_rows in ((good, rows), (bad, [*rows[:500], rows[0], *rows[501:]])):
        folder.mkdir()
        pq.write_table(pa.Table.from_pylist(table_rows), folder / "truth.parquet")
    ws = Workspace.open(tmp_path / "ws")
    with ws.writer(RunInfo(run="r", model="m", chunk_samples=4)) as w:
        keys = w.register_stimulus_set(good)
        assert keys == [f"good/{r['id']}" for r in rows]
        assert w.register_stimulus_set(good) == keys
        with pytest.raises(StoreError, match=r"unique within dataset bad, repeated: \['bad/s0000'\]"):
            w.register_stimulus_set(bad)
    assert ws.rows("SELECT count(*) FROM stimuli WHERE dataset = 'good'") == [(600,)]
