"""Helpers of the security tests: a small real workspace and a content digest of a folder."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from store import ArraySpec, RunInfo, Workspace

N, TOKENS, DIM = 8, 3, 4


def build(path: Path) -> Path:
    ws = Workspace.open(path)
    rows = [{"id": f"s{i}", "family": "g2m", "split": "test", "seed": i, "image": f"images/s{i}.png",
             "prompt": "p", "answer": "a", "prompts": {"t": "p"}, "answers": {"t": "a"}, "params": {}, "truth": {}}
            for i in range(N)]
    with ws.writer(RunInfo(run="r1", model="hand-built", chunk_samples=4)) as w:
        w.set_samples(w.register_stimuli(rows, dataset="set"))
        img = w.array(ArraySpec(tap="llm", layer=0, tokens="image", shape=(TOKENS, DIM)))
        ans = w.array(ArraySpec(tap="llm", layer=0, tokens="answer", shape=(DIM,), ragged=True))
        w.write_tensor("lm_head.weight", np.ones((5, DIM), dtype=np.float32))
        for start in range(0, N, 4):
            w.write(img, start, np.full((4, TOKENS, DIM), start, dtype=np.float32))
            w.write_ragged(ans, start, [np.full((2, DIM), i, dtype=np.float32) for i in range(start, start + 4)])
        w.finish()
    return path


def digest(folder: Path) -> dict[str, str]:
    """Every file of a folder (manifest and chunks) by content: what "unchanged" means."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}
