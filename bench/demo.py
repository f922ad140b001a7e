"""``make demo`` end to end, timed: stimuli, every extraction, the probe plans, the queries and the report,
written to a temporary folder (the checkout's data/, sets/ and report/ are left alone)."""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path

from bench import record

REPO = Path(__file__).resolve().parents[1]


def main(quick: bool = False) -> None:
    if quick:
        print("   the demo has no smaller size: run it without --quick")
        return
    with tempfile.TemporaryDirectory(prefix="agnosia-bench-demo-") as tmp:
        out = Path(tmp)
        started = time.perf_counter()
        done = subprocess.run(["make", "-s", "demo", f"DATA={out / 'data'}", f"STIMULI={out / 'sets'}",
                               f"REPORT={out / 'report'}"], cwd=REPO, capture_output=True, text=True)
        seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"make demo failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    print(f"   make demo into a fresh folder, .venv already set up: {seconds:.0f} s")
    record.figure("", "make demo, wall", seconds, "s",
                  setting="a fresh data/sets/report folder, .venv set up; the committed toy models, every stage")
