"""Where G2M transcriptions go wrong (study g2m): per-cell error maps and positional-bias scalars.

The error map of a run at grid size N is each cell's error rate over the run's N x N grids. A
failed parse counts every cell as wrong, the paper's denominator. Heatmaps do not compare across
models and sizes at a glance, so four scalars summarise a map:

- ``error_entropy``: Shannon entropy of the error mass over the cells divided by log(N²). It is 1
  when errors spread evenly and 0 when they all fall on one cell (None without errors).
- ``spectral_nonuniformity``: the share of the map's energy outside the 2-D Fourier DC term after
  removing the mean, relative to the map's total energy: 0 for a flat map, toward 1 for structure.
- ``row_slope`` / ``col_slope``: least-squares slope of the mean error per row (column) against the
  row (column) position scaled to 0..1. A positive value means more errors toward the bottom
  (right), e.g. the reading-order drift of long transcriptions.

Patch alignment splits the grids by whether every cell boundary falls on a patch boundary of the
model's LLM image-token grid. Patch size in pixels = image size / grid_w from the token spans,
with a tolerance of half a pixel.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa

from store import Workspace


def _rows(ws: Workspace, run: str, where: str | None = None) -> list[tuple[Any, ...]]:
    sql = ("SELECT (params->>'grid_size')::INTEGER, (params->>'image_size')::INTEGER, truth->>'matrix', prediction,"
           " grid_w FROM v_samples WHERE run = ? AND family = 'g2m'")
    return ws.rows(sql + (f" AND ({where})" if where else ""), [run])


def cell_errors(truth: Any, prediction: Any) -> np.ndarray:
    """``[N, N]`` booleans: the cell is wrong (every cell when the answer did not parse)."""
    gt = np.asarray(json.loads(truth) if isinstance(truth, str) else truth, dtype=np.int64)
    pred = json.loads(prediction) if isinstance(prediction, str) else prediction
    if pred is None:
        return np.ones(gt.shape, dtype=bool)
    try:
        pred = np.asarray(pred, dtype=np.int64)
    except (TypeError, ValueError):  # ragged rows: not a grid
        return np.ones(gt.shape, dtype=bool)
    if pred.shape != gt.shape:
        return np.ones(gt.shape, dtype=bool)
    return pred != gt


def error_maps(ws: Workspace, run: str, where: str | None = None) -> dict[int, tuple[np.ndarray, int]]:
    """N -> (error rate per cell ``[N, N]``, number of grids)."""
    sums: dict[int, np.ndarray] = {}
    counts: dict[int, int] = {}
    for n, _, truth, pred, _ in _rows(ws, run, where):
        err = cell_errors(truth, pred)
        sums[n] = sums.get(n, np.zeros(err.shape)) + err
        counts[n] = counts.get(n, 0) + 1
    return {n: (sums[n] / counts[n], counts[n]) for n in sorted(sums)}


def positional_bias(errors: np.ndarray) -> dict[str, float | None]:
    """The four scalars of an error-rate map (see the module docstring)."""
    e = np.asarray(errors, dtype=np.float64)
    total = e.sum()
    if total <= 0:
        return {"error_entropy": None, "spectral_nonuniformity": 0.0, "row_slope": 0.0, "col_slope": 0.0}
    p = (e / total).ravel()
    nz = p[p > 0]
    entropy = float(-(nz * np.log(nz)).sum() / np.log(e.size)) if e.size > 1 else 1.0
    energy = float((np.abs(np.fft.fft2(e)) ** 2).sum())
    dc = float(np.abs(e.sum()) ** 2)
    spectral = (energy - dc) / energy if energy > 0 else 0.0

    def slope(profile: np.ndarray) -> float:
        if profile.size < 2:
            return 0.0
        x = np.linspace(0.0, 1.0, profile.size)
        return float(np.polyfit(x, profile, 1)[0])

    return {"error_entropy": entropy, "spectral_nonuniformity": float(spectral),
            "row_slope": slope(e.mean(1)), "col_slope": slope(e.mean(0))}


def bias_table(ws: Workspace, run: str, where: str | None = None) -> pa.Table:
    """Per grid size N: grids, cell accuracy and the positional-bias scalars of the error map."""
    out = []
    for n, (err, count) in error_maps(ws, run, where).items():
        out.append({"run": run, "grid_size": n, "grids": count, "cell_accuracy": float(1 - err.mean()),
                    **positional_bias(err)})
    return pa.Table.from_pylist(out) if out else pa.table({"run": pa.array([], pa.string())})


def aligned(n: int, image_size: int, patch_px: float, tol: float = 0.5) -> bool:
    """Whether every boundary of an ``n`` x ``n`` grid over ``image_size`` px lies on a patch edge."""
    edges = np.arange(n + 1) * image_size / n
    off = np.abs(edges / patch_px - np.round(edges / patch_px)) * patch_px
    return bool((off <= tol).all())


def alignment_table(ws: Workspace, run: str, where: str | None = None) -> pa.Table:
    """Cell accuracy of grids whose cells align with the patch grid vs those that do not."""
    acc: dict[bool, list[float]] = {True: [], False: []}
    for n, size, truth, pred, grid_w in _rows(ws, run, where):
        if not grid_w or not size:
            continue
        acc[aligned(n, size, size / grid_w)].append(1 - float(cell_errors(truth, pred).mean()))
    return pa.Table.from_pylist([{"run": run, "aligned": k, "grids": len(v), "cell_accuracy": float(np.mean(v))}
                                 for k, v in acc.items() if v])
