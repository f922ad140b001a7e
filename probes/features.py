"""Reading a group's features on a worker: numpy and the store reader only (no torch), so a
worker that runs only streamed statistics kinds stays small (probes/stream.py)."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from probes.errors import ProbeError
from store import ArrayInfo
from store.location import ArrayRoot


def read_features(root: ArrayRoot, info: ArrayInfo, rows: np.ndarray, dense_tokens: int | None = None) -> Any:
    """The rows' values as float32 (kinds never see float16: sums in fp16 overflow), C-ordered
    and aligned (misaligned buffers made BLAS 6-8x slower, docs/design.md#blas-threads-and-dask-buffers). A ragged array
    comes back as Ragged, or as dense ``[n, dense_tokens, d]`` when that is asked for."""
    from store import Ragged, reader

    if info.layout == "ragged":
        got = reader.read_ragged(root, info, rows, "float32")
        values = np.require(got.values, np.float32, ["C", "A"])
        if dense_tokens is None:
            return Ragged(values, got.offsets)
        lengths = np.diff(got.offsets)
        if len(lengths) and not np.all(lengths == dense_tokens):
            bad = int(np.flatnonzero(lengths != dense_tokens)[0])
            raise ProbeError(f"{info.key()}: row {int(rows[bad])} has {int(lengths[bad])} tokens, the manifest's"
                             f" grid says {dense_tokens}: the store and its samples table disagree; run store verify")
        return values.reshape(len(rows), dense_tokens, *info.item_shape)
    return np.require(reader.read_dense(root, info, rows, None, "float32"), np.float32, ["C", "A"])


_MALLOC_TUNED = False


def tune_malloc() -> None:
    """Undo Dask's ``MALLOC_TRIM_THRESHOLD_=65536`` for this process (Linux/glibc only).

    Dask's nanny sets it so workers hand freed memory back to the OS. But setting it also
    freezes glibc's mmap threshold at 128 KiB, so every solver temporary (an [n, P] float32 block
    is ~1 MB) is mmap'd, page-faulted in and unmapped again on each of ~40 L-BFGS evaluations:
    measured 1.5x slower than the same group in a plain process. Thresholds of 64 / 128 MiB keep
    temporaries on the heap while big feature arrays are still returned to the OS when freed.
    """
    global _MALLOC_TUNED
    if _MALLOC_TUNED or not sys.platform.startswith("linux"):
        return
    _MALLOC_TUNED = True
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 64 << 20)   # M_MMAP_THRESHOLD
        libc.mallopt(-1, 128 << 20)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc: nothing to undo


def as_float32(X: Any) -> np.ndarray:
    """X as float32, C-ordered and aligned: what every kind computes on."""
    # Dask may hand over misaligned buffers (docs/design.md#blas-threads-and-dask-buffers); an aligned C copy is cheap.
    return np.require(np.asarray(X, dtype=np.float32), requirements=["C", "A"])
