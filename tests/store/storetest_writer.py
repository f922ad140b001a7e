"""A writer process for the store tests: ``python storetest_writer.py WORKSPACE [--sleep S] [--shard I/K] [--hold]``.

Prints JSON lines: {"event": "started", "pid": ...} once it holds the lock, then {"event": "done", ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from storetest_lib import write_run  # noqa: E402

from store import RunInfo, Workspace  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("workspace")
    p.add_argument("--n", type=int, default=40)
    p.add_argument("--chunk", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--shard", default=None, help="i/k: write one shard of the run")
    p.add_argument("--hold", action="store_true", help="take the lock and wait to be killed")
    a = p.parse_args()
    ws = Workspace.open(a.workspace)
    if a.hold:
        with ws.writer(RunInfo(run="holder", model="tiny-test")):
            print(json.dumps({"event": "started", "pid": os.getpid()}), flush=True)
            time.sleep(120)
        return
    print(json.dumps({"event": "started", "pid": os.getpid()}), flush=True)
    # min_commit_gap 0: commit each chunk as soon as the queue idles, so a kill lands between commits.
    result = write_run(ws, n=a.n, chunk=a.chunk, batch=a.batch, sleep=a.sleep, min_commit_gap=0.0, commit_every=0.2,
                       shard=a.shard)
    print(json.dumps({"event": "done", **result}), flush=True)


if __name__ == "__main__":
    main()
