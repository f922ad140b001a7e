"""Pooling tokens into one vector per sample (numpy and a small C kernel, no torch: streamed kinds
import it on workers).

Every caller (the in-memory kinds, the streamed pass, derived arrays) pools through :func:`pool`,
so pooled features agree to the bit whichever path computed them. float16 tokens may be handed
over as stored: mean and max then run on the float16 bits directly (:func:`_pool_half`), with the
same float32 results as pooling the float32 cast, several times faster than numpy's float16 cast:
in one pass of the C kernel ``probes/_halfpool.c`` where the install built it, else in numpy
passes over ~1 MiB steps.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from probes.errors import ProbeError
from probes.features import as_float32, half_bits_scaled, has_nonfinite_half

try:  # built by `pip install` (setup.py) where a C compiler is present
    from probes import _halfpool
except ImportError:  # no compiler at install time: the numpy passes below give the same bits, slower
    _halfpool = None  # type: ignore[assignment]

#: Values reduced per step of :func:`_reduce_half` (the numpy path): ~1 MiB of float32 bits, so
#: each step's six numpy passes stay near the core's cache instead of streaming a whole sample
#: through memory once per pass, while a sample of 256 tokens at d = 3,584 takes 4 steps, not 14
#: (each step costs ~10 numpy calls: read + mean-pool of a layer of the real-shape bench store ran
#: ~15 % slower in 256 KiB steps, measured in one process).
SLAB_VALUES = 1 << 18
_UNSCALE = np.float32(2.0**112)


def pool(X: Any, how: str) -> np.ndarray:
    """[n, T, d] (float16 or float32) or Ragged -> [n, d] float32."""
    if hasattr(X, "offsets"):  # store.Ragged: variable rows per sample
        vals, offs = as_float32(X.values), np.asarray(X.offsets)
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
    if how in ("mean", "max") and _half_ok(X):
        return _pool_half(X, how)
    if how in ("first", "last"):
        return as_float32(X[:, 0] if how == "first" else X[:, -1])
    X = as_float32(X)
    if how == "mean":
        return as_float32(X.mean(1, dtype=np.float32))  # float32 accumulate: fp16 sums overflow
    return as_float32(X.max(1))


def _half_ok(X: np.ndarray) -> bool:
    return X.dtype == np.float16 and X.shape[1] > 0 and X.size > 0 and X.flags.c_contiguous


def _pool_half(X: np.ndarray, how: str) -> np.ndarray:
    """Mean / max over axis 1 of float16 [n, T, d], equal to the bit to pooling ``X.astype(float32)``.

    Each token's bits become the float32 ``v * 2**-112`` (:func:`probes.features.half_bits_scaled`,
    exact for every finite float16, subnormals included). Scaling by a power of two commutes with
    float32 rounding while no partial result leaves the normal range, and sums of float16 values
    that fall below it are exact on both sides; so the float32 sums (and maxima) of the scaled
    values, taken in the same order as numpy's, are the unscaled ones times 2**-112 exactly. The C
    kernel multiplies each scaled token back by 2**112 (exact) before adding it, in numpy's order.
    """
    n, T, d = X.shape
    out = np.empty((n, d), np.float32)
    # Dask can hand over arrays at odd addresses (docs/design.md): the kernel reads aligned uint16 only.
    kernel = _halfpool is not None and X.flags.aligned
    finite = _reduce_kernel(X, how, out) if kernel else _reduce_numpy(X, how, out)
    for i in np.flatnonzero(~finite):   # NaN/inf tokens: numpy's own cast
        x = X[i].astype(np.float32)
        out[i] = x.sum(0, dtype=np.float32) if how == "mean" else x.max(0)
    if how == "mean":   # as ndarray.mean divides its float32 sums: by an intp count, in place
        np.true_divide(out, np.intp(T), out=out, casting="unsafe")
    return out


def _reduce_kernel(X: np.ndarray, how: str, out: np.ndarray) -> np.ndarray:
    """out = sum / max over axis 1, in one pass of the C kernel; bool [n]: samples without NaN/inf."""
    n, T, d = X.shape
    bad = np.zeros(n, np.uint8)
    _halfpool.reduce(X.view(np.uint16), n, T, d, out, bad, 0 if how == "mean" else 1)
    return bad == 0


def _reduce_numpy(X: np.ndarray, how: str, out: np.ndarray) -> np.ndarray:
    """As :func:`_reduce_kernel`, in numpy passes over ~1 MiB steps (:data:`SLAB_VALUES`)."""
    n, T, d = X.shape
    finite = np.ones(n, bool)
    slab = max(1, min(T, SLAB_VALUES // d))
    work = np.empty((slab + 1, d), np.int32)     # row 0 carries the running result into the next slab
    for i in range(n):
        finite[i] = _reduce_half(X[i], how, work, out[i])
        if finite[i]:
            out[i] *= _UNSCALE
    return finite


def _reduce_half(x: np.ndarray, how: str, work: np.ndarray, acc: np.ndarray) -> bool:
    """acc = sum / max over axis 0 of float16 [T, d] ``x``, scaled by 2**-112; False (acc not
    usable) when a token is NaN or inf, whose bits the trick does not map."""
    ufunc = np.add if how == "mean" else np.maximum
    bits = x.view(np.uint16)
    step = len(work) - 1
    for t0 in range(0, len(x), step):
        k = min(step, len(x) - t0)
        part = bits[t0:t0 + k]
        if has_nonfinite_half(part):
            return False
        half_bits_scaled(part, work[1:1 + k])
        if t0 == 0:   # the first slab starts the reduction exactly as numpy's own does
            ufunc.reduce(work[1:1 + k].view(np.float32), axis=0, out=acc)
        else:
            work[0] = acc.view(np.int32)
            ufunc.reduce(work[:1 + k].view(np.float32), axis=0, out=acc)
    return True
