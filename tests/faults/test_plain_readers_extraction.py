"""A plain DuckDB client reads the manifest throughout a real extraction (issue 40, item 1): the
toy counting VLM over 121 Go boards through `python -m extract`, polled by a client that knows
nothing of agnosia (tests/store/test_plain_readers.py polls a writer loop; this one the CLI)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from faultlib import REPO, env, go_set, write_manifest

from store import db

POLLER = """
import json, os, sys, time
import duckdb
path, stop, retry_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
print("ready", flush=True)
while not os.path.exists(stop):
    if not os.path.exists(path):
        time.sleep(0.02)
        continue
    started = time.monotonic()
    while True:
        try:
            con = duckdb.connect(path, read_only=True)
            n = con.execute("SELECT count(*) FROM chunks").fetchone()[0]
            con.close()
        except duckdb.Error:   # the file is held, or not a manifest yet (built beside it, then linked)
            if time.monotonic() - started > retry_s:
                print(json.dumps({"gave_up": time.monotonic()}), flush=True)
                break
            time.sleep(0.01)
            continue
        print(json.dumps({"read": time.monotonic(), "chunks": n}), flush=True)
        break
    time.sleep(0.02)
"""


@pytest.mark.slow
def test_a_plain_client_gets_in_within_a_second_throughout_an_extraction(tmp_path):
    """Asserts: while `python -m extract` runs the toy VLM over 121 boards (chunks of 4, so a
    commit every few batches), a plain read-only client retrying for 1 s never gives up, every gap
    between its reads is under 1 s, and it sees the committed chunks grow."""
    stimuli = go_set(tmp_path / "go", counts="0-120")
    manifest = write_manifest(tmp_path / "m.yaml", stimuli)
    data, stop = tmp_path / "ws", tmp_path / "stop"
    poller = subprocess.Popen([sys.executable, "-c", POLLER, str(data / "manifest.duckdb"), str(stop),
                               str(db.PLAIN_READER_WAIT_S)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        assert poller.stdout is not None and poller.stdout.readline().strip() == "ready"
        run = subprocess.run([sys.executable, "-m", "extract", str(manifest), "--data", str(data), "--no-progress"],
                             cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        stop.touch()
        out, err = poller.communicate(timeout=30)
    finally:
        if poller.poll() is None:
            poller.kill()
    events = [json.loads(line) for line in out.splitlines()]
    reads = [e for e in events if "read" in e]
    assert not [e for e in events if "gave_up" in e], f"reads gave up: {events[:5]} {err[-500:]}"
    counts = [e["chunks"] for e in reads]
    assert counts[-1] > 0 and len(set(counts)) >= 3, counts   # it read while chunks were committed
    gaps = sorted(b["read"] - a["read"] for a, b in zip(reads, reads[1:], strict=False))
    assert gaps[-1] < db.PLAIN_READER_WAIT_S, gaps[-5:]
