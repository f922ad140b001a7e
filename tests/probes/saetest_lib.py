"""A hand-built workspace with planted sparse features, for the SAE tests.

One run ``planted`` of Go-family rows on a 4x4 board (16 image tokens, d=32) and two layers. A token
is a sparse sum of known unit directions plus a little noise:

* ``black``: on every token whose intersection is black (per token: ``go.intersection`` = black);
* ``flag``: on every token of a sample whose ``truth.flag`` is 1 (binary, per sample, 30% of samples);
* ``level``: on a random 30% of each sample's tokens, with magnitude ``truth.level`` / 2 (1..5,
  ordinal, per sample);
* three ``noise`` features, each on a random 10% of tokens, tied to nothing.

Layer 0 holds the same tokens at a tenth of the scale under 10x the noise (nothing to recover).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from store import ArraySpec, RunInfo, TokenSpans, Workspace

D, BOARD, T = 32, 4, 16
PLANTED = ("black", "flag", "level", "noise0", "noise1", "noise2")


def directions(seed: int = 5) -> np.ndarray:
    """The planted unit directions ``[6, D]`` (nearly orthogonal in 32 dims)."""
    q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((D, D)))
    return q[: len(PLANTED)].astype(np.float32)


def planted_rows(n: int, seed: int = 0) -> tuple[list[dict[str, Any]], np.ndarray, np.ndarray, np.ndarray]:
    """Stimulus rows, per-token labels ``[n, T]`` (0 black, 1 white, 2 empty), flags, levels."""
    rng = np.random.default_rng(seed)
    labels = rng.choice(3, size=(n, T), p=(0.3, 0.3, 0.4))
    flags = (rng.random(n) < 0.3).astype(np.int64)
    levels = rng.integers(1, 6, n)
    rows = []
    for i in range(n):
        count = int((labels[i] == 0).sum())
        rows.append({"id": f"pl_{i:04d}", "family": "go", "split": "train" if i % 5 else "test", "seed": i,
                     "params": {"board_size": BOARD, "preset": "test"},
                     "truth": {"count": count, "labels": labels[i].tolist(), "regime": "ID",
                               "flag": int(flags[i]), "level": int(levels[i])}})
    return rows, labels, flags, levels


def planted_acts(labels: np.ndarray, flags: np.ndarray, levels: np.ndarray, seed: int = 1) -> np.ndarray:
    """Activations ``[n, T, D]`` and the per-token feature magnitudes behind them."""
    rng = np.random.default_rng(seed)
    n = len(labels)
    mags = np.zeros((n, T, len(PLANTED)), np.float32)
    mags[..., 0] = (labels == 0) * rng.uniform(1.5, 2.5, (n, T))
    mags[..., 1] = flags[:, None] * rng.uniform(1.5, 2.5, (n, T))
    mags[..., 2] = (rng.random((n, T)) < 0.3) * levels[:, None] * 0.5
    mags[..., 3:] = (rng.random((n, T, 3)) < 0.1) * rng.uniform(1.5, 2.5, (n, T, 3))
    return mags @ directions() + rng.standard_normal((n, T, D)).astype(np.float32) * 0.03


def build_planted(path: Path, n: int = 240, chunk: int = 32, sites: tuple[str, ...] = ("resid_post",)) -> Workspace:
    """The workspace described above; each extra site stores the same tokens (its own noise)."""
    ws = Workspace.open(path)
    rows, labels, flags, levels = planted_rows(n)
    strong = planted_acts(labels, flags, levels)
    weak = strong * 0.1 + np.random.default_rng(9).standard_normal(strong.shape).astype(np.float32) * 0.3
    feats = {(layer, site): (weak if layer == 0 else strong) + 0.01 * j
             for layer in (0, 1) for j, site in enumerate(sites)}
    with ws.writer(RunInfo(run="planted", model="synthetic", dtype="float32", chunk_samples=chunk)) as w:
        w.set_samples(w.register_stimuli(rows, dataset="planted"))
        handles = {key: w.array(ArraySpec(tap="vision", layer=key[0], site=key[1], tokens="image", shape=(T, D)))
                   for key in feats}
        for rng in w.todo():
            for s in range(rng.start, rng.stop, chunk):
                e = min(s + chunk, rng.stop)
                w.write_batch(s, {h: feats[key][s:e] for key, h in handles.items()},
                              tokens=[TokenSpans(seq_len=T + 4, image_start=1, image_count=T, grid_h=BOARD, grid_w=BOARD,
                                                 last_prompt=T + 3) for _ in range(s, e)])
        w.finish()
    return ws
