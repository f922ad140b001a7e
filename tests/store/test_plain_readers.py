"""A plain DuckDB client gets into the manifest during a write (issue 40).

The README promises that any tool reads the manifest and that readers work while a run writes.
agnosia's own readers ask the writer to let go (store/db.py), but a DuckDB shell, notebook or
dashboard cannot: before, the writer's held connection kept it out for 2.4-3.7 s at a time.
"""

from __future__ import annotations

from plain_reader import poll_during
from storetest_lib import write_run

from store import Workspace, db


def test_a_plain_read_only_client_gets_in_within_a_second_throughout_a_write(tmp_path):
    """Asserts: a plain `duckdb.connect(path, read_only=True)` client that retries for up to
    db.PLAIN_READER_WAIT_S (1 s) never gives up while a run writes ~5 s of chunks, every gap
    between its successful reads is under that, and it sees the committed chunks grow (so it read
    during the write). Before: the writer held the file for up to 10 s, and polls gave up."""
    ws = Workspace.open(tmp_path / "ws")
    # 200 batches of 2, one every ~25 ms: a chunk of 8 every ~0.1 s, so the writer commits as often
    # as it does in a real extraction (every min_commit_gap) all along.
    got = poll_during(ws.manifest_path, lambda: write_run(ws, n=400, chunk=8, batch=2, sleep=0.02),
                      db.PLAIN_READER_WAIT_S, tmp_path)
    assert not got.gave_up, f"{len(got.gave_up)} reads gave up after {db.PLAIN_READER_WAIT_S} s"
    counts = got.chunks
    assert counts[0] < counts[-1] == 100 and len({c for c in counts if 0 < c < 100}) >= 5, counts
    # Each gap with the committed chunks around it: where in the run a too long one fell.
    assert got.gaps()[-1][0] < db.PLAIN_READER_WAIT_S, got.gaps()[-5:]
