"""A plain DuckDB client polling a manifest while something writes it (issue 40's promise: one
that retries for db.PLAIN_READER_WAIT_S always gets in). Shared by the store's writer-loop test
and the extraction CLI's; it knows nothing of agnosia, as a user's shell or notebook would not."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# It prints the time of every read it got in (with the committed chunks it saw) and of every read
# that gave up after retrying for the given seconds. The manifest may not exist yet, or be a
# workspace still being built beside it: both are "not in yet", as the lock is.
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
        except duckdb.Error:
            if time.monotonic() - started > retry_s:
                print(json.dumps({"gave_up": time.monotonic()}), flush=True)
                break
            time.sleep(0.01)
            continue
        print(json.dumps({"read": time.monotonic(), "chunks": n}), flush=True)
        break
    time.sleep(0.02)
"""


@dataclass
class Polled:
    reads: list[dict]        # {"read": t, "chunks": n}
    gave_up: list[dict]      # {"gave_up": t}
    stderr: str

    @property
    def chunks(self) -> list[int]:
        return [r["chunks"] for r in self.reads]

    def gaps(self) -> list[tuple[float, int, int]]:
        """(seconds between two reads, chunks before, chunks after), longest last."""
        return sorted((b["read"] - a["read"], a["chunks"], b["chunks"])
                      for a, b in zip(self.reads, self.reads[1:], strict=False))


def poll_during(manifest: Path, write: Callable[[], None], retry_s: float, workdir: Path) -> Polled:
    """Run ``write`` while a plain client polls ``manifest`` in its own process."""
    stop = workdir / "stop-polling"
    poller = subprocess.Popen([sys.executable, "-c", POLLER, str(manifest), str(stop), str(retry_s)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert poller.stdout is not None and poller.stdout.readline().strip() == "ready"
        write()
        stop.touch()
        out, err = poller.communicate(timeout=30)
    finally:
        if poller.poll() is None:
            poller.kill()
    assert poller.returncode == 0, err
    events = [json.loads(line) for line in out.splitlines()]
    return Polled([e for e in events if "read" in e], [e for e in events if "gave_up" in e], err)
