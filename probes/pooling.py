"""Pooling tokens into one vector per sample (numpy only: streamed kinds import it on workers)."""

from __future__ import annotations

from typing import Any

import numpy as np

from probes.errors import ProbeError
from probes.features import as_float32


def pool(X: Any, how: str) -> np.ndarray:
    """[n, T, d] or Ragged -> [n, d] float32."""
    if hasattr(X, "offsets"):  # store.Ragged: variable rows per sample
        vals, offs = np.asarray(X.values, dtype=np.float32), np.asarray(X.offsets)
        lengths = np.diff(offs)
        if (lengths == 0).any():
            raise ProbeError(
                f"{int((lengths == 0).sum())} samples have no tokens in this ragged array: select them out with where:")
        if how == "mean":
            return as_float32(np.add.reduceat(vals, offs[:-1], axis=0) / lengths[:, None])
        if how == "max":
            return as_float32(np.maximum.reduceat(vals, offs[:-1], axis=0))
        return as_float32(vals[offs[:-1]] if how == "first" else vals[offs[1:] - 1])
    X = np.asarray(X)
    if X.ndim == 2:
        return as_float32(X)
    if X.ndim != 3:
        raise ProbeError(f"pooled reads X [n, T, d] or a Ragged array, got shape {X.shape}")
    if how == "mean":
        return as_float32(X.mean(1, dtype=np.float32))  # float32 accumulate: fp16 sums overflow
    if how == "max":
        return as_float32(X.max(1))
    return as_float32(X[:, 0] if how == "first" else X[:, -1])
