"""The writer's one manifest connection: kept across a run's transactions, given up to others.

Found by profiling an extraction (issue 19): a DuckDB connect + close (a checkpoint) for every
commit, and a read and a write connection for every declared array, kept the writer thread busy
for 9-22 % of the run, half of it in ``duckdb.connect``.
"""

from __future__ import annotations

import time

import duckdb
import numpy as np
import pytest
from storetest_lib import DIM, TOKENS, dense_values, python, stimulus_rows, wait_for

from store import ArraySpec, Generation, RunInfo, Workspace, db


@pytest.fixture
def connects(monkeypatch):
    """Every duckdb.connect of this process, by path (the real connect still runs)."""
    calls: list[str] = []
    real = duckdb.connect

    def counting(database=":memory:", *args, **kwargs):
        calls.append(str(database))
        return real(database, *args, **kwargs)

    monkeypatch.setattr(duckdb, "connect", counting)
    return calls


def _specs() -> list[ArraySpec]:
    return [ArraySpec(tap=tap, layer=layer, tokens="image", shape=(TOKENS, DIM), dtype="float32")
            for tap in ("vision", "llm") for layer in (0, 1)]


def test_a_run_keeps_one_manifest_connection_across_its_transactions(tmp_path, connects):
    """Asserts: declaring 4 arrays opens the manifest at most once (before: 8 times, a read and a
    write connection each); 6 commits in a row reuse one connection (before: one connect each;
    2 allowed, as a loaded machine may pass the 10 s a connection is held at most); and the run
    reads back whole."""
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
