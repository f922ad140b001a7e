"""A plain DuckDB client gets into the manifest during a write (issue 40).

The README promises that any tool reads the manifest and that readers work while a run writes.
agnosia's own readers ask the writer to let go (store/db.py), but a DuckDB shell, notebook or
dashboard cannot: before, the writer's held connection kept it out for 2.4-3.7 s at a time.
"""

from __future__ import annotations

import json
import subprocess
import sys

from storetest_lib import REPO, write_run

from store import Workspace, db

# A plain client, as a user would write it: read-only, retrying on the lock, nothing of agnosia.
# It prints the time of every read it got in and of every read that gave up after RETRY_S.
POLLER = """
import json, os, sys, time
import duckdb
path, stop, retry_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
print("ready", flush=True)
while not os.path.exists(stop):
    started = time.monotonic()
    while True:
        try:
            con = duckdb.connect(path, read_only=True)
        except duckdb.IOException:
            if time.monotonic() - started > retry_s:
                print(json.dumps({"gave_up": time.monotonic()}), flush=True)
                break
            time.sleep(0.01)
            continue
        n = con.execute("SELECT count(*) FROM chunks").fetchone()[0]
        con.close()
        print(json.dumps({"read": time.monotonic(), "chunks": n}), flush=True)
        break
    time.sleep(0.02)
"""


def test_a_plain_read_only_client_gets_in_within_a_second_throughout_a_write(tmp_path):
    """Asserts: a plain `duckdb.connect(path, read_only=True)` client that retries for up to
    db.PLAIN_READER_WAIT_S (1 s) never gives up while a run writes ~5 s of chunks, every gap
    between its successful reads is under that, and it sees the committed chunks grow (so it read
    during the write). Before: the writer held the file for up to 10 s, and polls gave up."""
    ws = Workspace.open(tmp_path / "ws")
    stop = tmp_path / "stop"
    poller = subprocess.Popen([sys.executable, "-c", POLLER, str(ws.manifest_path), str(stop),
                               str(db.PLAIN_READER_WAIT_S)], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert poller.stdout is not None and poller.stdout.readline().strip() == "ready", poller.stderr
        # 200 batches of 2, one every ~25 ms: a chunk of 8 every ~0.1 s, so the writer commits
        # as often as it does in a real extraction (every min_commit_gap) all along.
        write_run(ws, n=400, chunk=8, batch=2, sleep=0.02)
        stop.touch()
        out, err = poller.communicate(timeout=30)
    finally:
        if poller.poll() is None:
            poller.kill()
    events = [json.loads(line) for line in out.splitlines()]
    gave_up = [e for e in events if "gave_up" in e]
    reads = [e for e in events if "read" in e]
    assert poller.returncode == 0, err
    assert not gave_up, f"{len(gave_up)} of {len(events)} reads gave up after {db.PLAIN_READER_WAIT_S} s"
    counts = [e["chunks"] for e in reads]
    assert counts[0] < counts[-1] == 100 and len({c for c in counts if 0 < c < 100}) >= 5, counts
    # Each gap with the committed chunks around it: where in the run a too long one fell.
    gaps = sorted((b["read"] - a["read"], a["chunks"], b["chunks"]) for a, b in zip(reads, reads[1:], strict=False))
    assert gaps[-1][0] < db.PLAIN_READER_WAIT_S, gaps[-5:]
