"""Reading a group's features on a worker: numpy and the store reader only (no torch), so a
worker that runs only streamed statistics kinds stays small (probes/stream.py)."""

from __future__ import annotations

from typing import Any

import numpy as np

from probes.errors import ProbeError
from store import ArrayInfo
from store.location import ArrayRoot


def read_features(root: ArrayRoot, info: ArrayInfo, rows: np.ndarray, dense_tokens: int | None = None,
                  *, stored: bool = False) -> Any:
    """The rows' values as float32 (kinds never see float16: sums in fp16 overflow), C-ordered
    and aligned (misaligned buffers made BLAS 6-8x slower, docs/design.md#blas-threads-and-dask-buffers). A ragged array
    comes back as Ragged, or as dense ``[n, dense_tokens, d]`` when that is asked for.

    ``stored``: float16 stays float16 (half the bytes in memory), for :func:`probes.pooling.pool`,
    which pools it to the same float32 values without a float32 copy of every token."""
    from store import Ragged, reader

    widen = _as_read if stored else as_float32
    if info.layout == "ragged":
        got = reader.read_ragged(root, info, rows, "float32")
        values = widen(got.values)
        if dense_tokens is None:
            return Ragged(values, got.offsets)
        lengths = np.diff(got.offsets)
        if len(lengths) and not np.all(lengths == dense_tokens):
            bad = int(np.flatnonzero(lengths != dense_tokens)[0])
            raise ProbeError(f"{info.key()}: row {int(rows[bad])} has {int(lengths[bad])} tokens, the manifest's"
                             f" grid says {dense_tokens}: the store and its samples table disagree; run store verify")
        return values.reshape(len(rows), dense_tokens, *info.item_shape)
    return widen(reader.read_dense(root, info, rows, None, "float32"))


def _as_read(X: np.ndarray) -> np.ndarray:
    return X if X.dtype == np.float16 else as_float32(X)


def as_float32(X: Any) -> np.ndarray:
    """X as float32, C-ordered and aligned: what every kind computes on."""
    if isinstance(X, np.ndarray) and X.dtype == np.float16 and X.size and X.ndim and X.flags.c_contiguous:
        return _widen_half(X)
    # Dask may hand over misaligned buffers (docs/design.md#blas-threads-and-dask-buffers); an aligned C copy is cheap.
    return np.require(np.asarray(X, dtype=np.float32), requirements=["C", "A"])


#: float16 values widened per step: ~256 KiB of float32, so each step's passes stay in L2.
_WIDEN_STEP = 1 << 16
_SIGN_EXP_MANT = np.uint32(0x8FFFE000).view(np.int32)
_NEG_NONFINITE, _POS_NONFINITE = np.uint16(0xFC00), np.int16(0x7C00)


def has_nonfinite_half(bits: np.ndarray) -> bool:
    """Whether float16 bits (uint16) hold a NaN or inf: exponent all ones, 0x7C00-0x7FFF when
    positive, 0xFC00-0xFFFF when negative. Two read-only max passes."""
    return bool(bits.max() >= _NEG_NONFINITE or bits.view(np.int16).max() >= _POS_NONFINITE)


def half_bits_scaled(bits: np.ndarray, out: np.ndarray) -> np.ndarray:
    """float16 bits (uint16) -> int32 ``out`` holding the bits of the float32 ``v * 2**-112``.

    The sign goes to bit 31 and the 15 exponent-and-mantissa bits to bits 13-27: read as float32,
    that is v's exponent rebased by -112 with v's mantissa, and float16 subnormals land exactly on
    float32 subnormals. Exact for every finite float16; NaN/inf come out finite (callers check).
    numpy casts float16 one value at a time (~200 M values/s here); these three vectorised integer
    passes run several times faster.
    """
    out[...] = bits.view(np.int16)             # sign-extended: bit 31 is the sign
    np.left_shift(out, 13, out=out)            # bits 28-30 now hold copies of the sign: masked off next
    np.bitwise_and(out, _SIGN_EXP_MANT, out=out)
    return out


def _widen_half(X: np.ndarray) -> np.ndarray:
    """float16 -> float32, equal to ``X.astype(np.float32)`` bit for bit (NaN payloads included)."""
    flat = X.reshape(-1).view(np.uint16)
    out = np.empty(flat.shape, np.float32)
    for a in range(0, len(flat), _WIDEN_STEP):
        part, dst = flat[a:a + _WIDEN_STEP], out[a:a + _WIDEN_STEP]
        if has_nonfinite_half(part):   # numpy maps their bits
            dst[...] = part.view(np.float16)
            continue
        half_bits_scaled(part, dst.view(np.int32))
        dst *= np.float32(2.0**112)
    return out.reshape(X.shape)
