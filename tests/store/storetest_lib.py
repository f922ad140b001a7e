"""Shared helpers of the store tests (not a conftest, so sibling test folders never clash)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from store import ArraySpec, Generation, RunInfo, TokenSpans, Workspace

REPO = Path(__file__).resolve().parents[2]
WRITER_SCRIPT = Path(__file__).with_name("storetest_writer.py")

# Sizes of the synthetic run every test shares: small, but several chunks per array.
TOKENS, DIM = 6, 8


def stimulus_rows(n: int) -> list[dict[str, Any]]:
    """Rows in the truth.parquet format of stimuli/io.py."""
    fam = ("g2m", "count")
    return [
        {
            "id": f"s{i:04d}", "family": fam[i % 2], "split": "test", "seed": i, "image": f"images/s{i:04d}.png",
            "prompt": f"prompt {i}", "answer": str(i % 5), "prompts": {"default": f"prompt {i}"},
            "answers": {"default": str(i % 5)}, "params": {"grid_size": 3 + i % 3}, "truth": {"count": i % 5},
        }
        for i in range(n)
    ]


def dense_values(rows: np.ndarray | range) -> np.ndarray:
    """Deterministic per-row activations, so any run can be checked against any other."""
    r = np.asarray(rows, dtype=np.float32)[:, None, None]
    t = np.arange(TOKENS, dtype=np.float32)[None, :, None]
    d = np.arange(DIM, dtype=np.float32)[None, None, :]
    return np.sin(r * 0.37 + t * 0.11 + d * 0.05) * (1 + r % 7)


def ragged_values(row: int) -> np.ndarray:
    n = row % 4  # 0..3 answer tokens, including none
    return np.full((n, DIM), row + 0.5, dtype=np.float32) + np.arange(n, dtype=np.float32)[:, None]


def write_run(
    ws: Workspace,
    run: str = "r1",
    n: int = 40,
    chunk: int = 8,
    batch: int = 4,
    sleep: float = 0.0,
    after_batch: Callable[[int], None] | None = None,
    **writer_options: Any,
) -> dict[str, Any]:
    """The reference extraction loop: resumable, with dense + ragged arrays, spans, generations.

    ``after_batch(end_row)`` runs once each batch is queued: a fault test decides there what
    happens next (pause, hold a lock), with no clock."""
    with ws.writer(RunInfo(run=run, model="tiny-test", dtype="float32", chunk_samples=chunk,
                           config={"n": n}), **writer_options) as w:
        keys = w.register_stimuli(stimulus_rows(n), dataset="set")
        w.set_samples(keys)
        img = w.array(ArraySpec(tap="llm", layer=3, tokens="image", shape=(TOKENS, DIM), module="model.layers.3"))
        ans = w.array(ArraySpec(tap="llm", layer=3, tokens="answer", shape=(DIM,), ragged=True))
        todo = w.todo()
        for rows in todo:
            for s in range(rows.start, rows.stop, batch):
                e = min(s + batch, rows.stop)
                w.write_batch(
                    s,
                    {img: dense_values(range(s, e)), ans: [ragged_values(i) for i in range(s, e)]},
                    tokens=[TokenSpans(seq_len=20, image_start=2, image_count=6, grid_h=2, grid_w=3,
                                       last_prompt=15, answer_start=16, answer_count=i % 4) for i in range(s, e)],
                    generations=[Generation(text=str(i % 5), prediction=i % 5, parse_ok=True, correct=i % 3 == 0,
                                            metrics={"cells_correct": i % 9, "cells_total": 9}) for i in range(s, e)],
                )
                if sleep:
                    time.sleep(sleep)
                if after_batch is not None:
                    after_batch(e)
        w.finish()
        return {"todo": [[r.start, r.stop] for r in todo], "took_over": None if w.took_over is None else w.took_over.pid,
                "chunks_written": w.stats.chunks_written}


def python(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 60,
           **kw: Any) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, *args], cwd=cwd or REPO, env=full_env, capture_output=True, text=True,
                          timeout=timeout, **kw)


def start_writer(ws_path: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(WRITER_SCRIPT), str(ws_path), *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read_event(proc: subprocess.Popen[str], timeout: float = 30) -> dict[str, Any]:
    """Next JSON line the writer script prints (readline blocks; the script flushes each line)."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise AssertionError(f"writer exited: rc={proc.wait(timeout)} stderr={proc.stderr.read() if proc.stderr else ''}")
    return json.loads(line)


def wait_for(predicate: Any, timeout: float = 30, step: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(step)
    raise AssertionError("condition not met in time")
