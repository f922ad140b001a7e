"""Hand-built workspaces with planted signal for the probe-farm tests (not a conftest, so
sibling test folders never clash).

Four runs, one per stimulus family, each with a weak layer 0 and a strong layer 1:

* ``go``: 10x10 boards (one token per intersection, d=16); a token is its stone's prototype
  plus noise. Counts span 0..100 (regimes ID / VE / FE).
* ``g2m``: 4x4 colour grids (3 colours) seen through an 8x8 patch grid (T=64).
* ``count``: 1-4 objects on a 6x6 patch grid (384 px, 64 px patches); an object's token
  carries a prototype. Boxes in pixels in truth.objects, as the CountingTricks generator writes.
* ``spatial``: 4 tokens whose mean encodes the relation; plus binary ``truth.flag_k`` targets.
"""

from __future__ import annotations

import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import waiting
from child_env import child_env

from store import ArraySpec, RunInfo, TokenSpans, Workspace

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
D = 16
RELATIONS = ("left", "right", "above", "below")


def _protos(seed: int, k: int, scale: float = 1.0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((k, D)).astype(np.float32) * scale


def go_family(n: int, seed: int = 0, board: int = 10) -> tuple[list[dict[str, Any]], np.ndarray]:
    rng = np.random.default_rng(seed)
    cells = board * board
    rows, labels = [], np.empty((n, cells), np.int64)
    for i in range(n):
        count = int(rng.integers(0, cells + 1)) if i % 3 else int(rng.integers(0, 50))
        lab = np.full(cells, 2)
        black = rng.choice(cells, count, replace=False)
        lab[black] = 0
        rest = np.setdiff1d(np.arange(cells), black)
        lab[rng.choice(rest, min(len(rest), int(rng.integers(0, 20))), replace=False)] = 1
        labels[i] = lab
        rows.append({"id": f"go_{i:04d}", "family": "go", "split": "train" if i % 5 else "test", "seed": i,
                     "params": {"board_size": board, "preset": "test"},
                     "truth": {"count": count, "labels": lab.tolist(),
                               "regime": "ID" if count <= 49 else "VE" if count <= 99 else "FE"}})
    return rows, labels


def go_features(labels: np.ndarray, layer: int, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed + 10 * layer)
    scale = (0.25, 3.0)[layer]
    return _protos(7, 3, scale)[labels] + rng.standard_normal((*labels.shape, D)).astype(np.float32) * 0.5


def g2m_family(n: int, seed: int = 0, grid: int = 4, colors: int = 3) -> tuple[list[dict[str, Any]], np.ndarray]:
    rng = np.random.default_rng(seed)
    mats = rng.integers(0, colors, (n, grid, grid))
    rows = [{"id": f"g2m_{i:04d}", "family": "g2m", "split": "test", "seed": i,
             "params": {"grid_size": grid, "num_colors": colors}, "truth": {"matrix": mats[i].tolist()}} for i in range(n)]
    return rows, mats


def g2m_features(mats: np.ndarray, layer: int, side: int = 8, seed: int = 2) -> np.ndarray:
    n, grid = mats.shape[0], mats.shape[1]
    cell = ((np.arange(side) + 0.5) / side * grid).astype(int)
    under = mats[:, cell][:, :, cell].reshape(n, side * side)
    rng = np.random.default_rng(seed + 10 * layer)
    return _protos(8, 3, (0.2, 2.5)[layer])[under] + rng.standard_normal((n, side * side, D)).astype(np.float32) * 0.5


def count_family(n: int, seed: int = 0, grid: int = 6, size: int = 384) -> tuple[list[dict[str, Any]], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    patch = size // grid
    rows, cells_of = [], []
    for i in range(n):
        k = int(rng.integers(1, 5))
        cells = rng.choice(grid * grid, k, replace=False)
        objs = []
        for j, c in enumerate(cells):
            r, q = divmod(int(c), grid)
            x, y, rad = q * patch + patch // 2, r * patch + patch // 2, patch // 2 - 4
            objs.append({"index": j, "x": x, "y": y, "size": float(rad), "bbox": [x - rad, y - rad, x + rad, y + rad]})
        rows.append({"id": f"count_{i:04d}", "family": "counting", "split": "test", "seed": i,
                     "params": {"case": "1A", "image_size": size},
                     "truth": {"count": k, "image_size": size, "patch_size": patch, "objects": objs}})
        cells_of.append(cells)
    return rows, cells_of


def count_features(cells_of: list[np.ndarray], layer: int, grid: int = 6, seed: int = 3) -> np.ndarray:
    rng = np.random.default_rng(seed + 10 * layer)
    x = rng.standard_normal((len(cells_of), grid * grid, D)).astype(np.float32) * 0.5
    proto = _protos(9, 1, (0.1, 2.5)[layer])[0]
    for i, cells in enumerate(cells_of):
        x[i, cells] += proto
    return x


def spatial_family(n: int, seed: int = 0, flags: int = 4) -> tuple[list[dict[str, Any]], np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    rel = rng.integers(0, len(RELATIONS), n)
    latent = rng.standard_normal((n, flags))
    fl = (latent > 0).astype(int)
    rows = [{"id": f"sp_{i:04d}", "family": "spatial", "split": "test", "seed": i, "params": {"image_size": 64},
             "truth": {"relation": RELATIONS[rel[i]], **{f"flag_{k}": int(fl[i, k]) for k in range(flags)}}}
            for i in range(n)]
    return rows, rel, latent


def spatial_features(rel: np.ndarray, latent: np.ndarray, layer: int, seed: int = 4) -> np.ndarray:
    rng = np.random.default_rng(seed + 10 * layer)
    n = len(rel)
    s = (0.05, 2.0)[layer % 2]
    x = rng.standard_normal((n, 4, D)).astype(np.float32)
    x += (_protos(10, len(RELATIONS), s)[rel] + latent @ _protos(11, latent.shape[1], s))[:, None, :]
    return x


def build_spatial_layers(path: Path, n: int = 96, layers: int = 8) -> Workspace:
    """One run, many layers (odd ones informative): many small groups for the Dask tests."""
    ws = Workspace.open(path)
    rows, rel, latent = spatial_family(n)
    write_run(ws, "spatial", rows, [spatial_features(rel, latent, layer) for layer in range(layers)], (2, 2))
    return ws


def write_run(ws: Workspace, run: str, rows: list[dict[str, Any]], feats: list[np.ndarray], grid: tuple[int, int],
              chunk: int = 32, dataset: str | None = None) -> None:
    t = feats[0].shape[1]
    with ws.writer(RunInfo(run=run, model="synthetic", dtype="float32", chunk_samples=chunk)) as w:
        w.set_samples(w.register_stimuli(rows, dataset=dataset or run))
        handles = [w.array(ArraySpec(tap="vision", layer=layer, tokens="image", shape=(t, D))) for layer in range(len(feats))]
        for rng in w.todo():
            for s in range(rng.start, rng.stop, chunk):
                e = min(s + chunk, rng.stop)
                w.write_batch(s, {h: f[s:e] for h, f in zip(handles, feats, strict=False)},
                              tokens=[TokenSpans(seq_len=t + 4, image_start=1, image_count=t, grid_h=grid[0], grid_w=grid[1],
                                                 last_prompt=t + 3) for _ in range(s, e)])
        w.finish()


def build_workspace(path: Path, n: int = 160, families: tuple[str, ...] = ("go", "g2m", "count", "spatial")) -> Workspace:
    ws = Workspace.open(path)
    if "go" in families:
        rows, labels = go_family(n)
        write_run(ws, "go", rows, [go_features(labels, layer) for layer in (0, 1)], (10, 10))
    if "g2m" in families:
        rows, mats = g2m_family(n)
        write_run(ws, "g2m", rows, [g2m_features(mats, layer) for layer in (0, 1)], (8, 8))
    if "count" in families:
        rows, cells = count_family(n)
        write_run(ws, "count", rows, [count_features(cells, layer) for layer in (0, 1)], (6, 6))
    if "spatial" in families:
        rows, rel, latent = spatial_family(n)
        write_run(ws, "spatial", rows, [spatial_features(rel, latent, layer) for layer in (0, 1)], (2, 2))
    return ws


def probe_rows(ws: Workspace) -> list[tuple[Any, ...]]:
    """The farm's results, comparable across runs: key, score, control, n_train, n_test."""
    return ws.rows(
        "SELECT params->>'key', run, tap, layer, target, kind, seed, round(score, 6), round(control_score, 6),"
        " n_train, n_test FROM probes ORDER BY 1"
    )


def python(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=child_env(HERE, **(env or {})), capture_output=True,
                          text=True, timeout=timeout)


wait_for = partial(waiting.wait_for, timeout=60, step=0.1)
