"""Sizing: the bytes an extraction will write, before it runs (``python -m store size``).

One byte planner for both estimates: :func:`array_bytes` sizes one array as the store lays it out
(dense chunks full-size, in the evened-out chunk size of :func:`store.records.chunk_size`; ragged
blocks with their offsets), used by ``python -m store size`` (every
array dense, ``[tokens, dim]`` per sample) and by ``python -m extract MANIFEST --dry-run`` (per
array, from the model and the stimuli). Bytes per value are the stored dtype's (store/dtypes.py).
The codec ratios are the ones measured on fp16 activations (docs/store.md, `python -m bench store`);
they are estimates, so the estimate reports the uncompressed size as well.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from store.dtypes import numpy_dtype
from store.errors import StoreError
from store.records import STORED_DTYPES, chunk_size

# Measured compression ratios on fp16 activations (lossless gains little; BitRound is the lever).
CODEC_RATIO = {"none": 1.0, "zstd": 1.08, "bitround8": 1.22, "bitround7": 1.30}


@dataclass(frozen=True)
class SizeEstimate:
    models: int
    samples: int
    taps: int
    layers: int
    tokens: int
    dim: int
    dtype: str
    codec: str
    chunk_samples: int
    values: int
    raw_bytes: int
    bytes: int
    arrays: int
    chunk_files: int
    free_bytes: int | None

    @property
    def fits(self) -> bool | None:
        return None if self.free_bytes is None else self.bytes <= self.free_bytes


def size_estimate(
    *,
    samples: int,
    layers: int,
    tokens: int,
    dim: int,
    dtype: str = "float16",
    models: int = 1,
    taps: int = 1,
    codec: str = "none",
    chunk_samples: int = 64,
    data: Path | None = None,
    batch_size: int = 1,
) -> SizeEstimate:
    """What a planned extraction stores, before any model runs (``python -m store size``).

    Parameters
    ----------
    samples, layers, tokens, dim
        Stimuli per model; layers per tap; tokens kept per sample and layer; the hidden size.
    dtype
        The stored dtype (``float16``, ``bfloat16`` or ``float32``).
    models, taps
        How many models and taps multiply the arrays.
    codec
        The arrays' codec (``none``, ``zstd``, ``bitround8``, ...): its typical ratio on activations.
    chunk_samples, batch_size
        The manifest's chunk and batch sizes: chunks are evened out as the writer does it.
    data
        A workspace path whose file system's free space is checked against the estimate.

    Returns
    -------
    SizeEstimate
        Bytes on disk, values, arrays, chunk size and, with ``data``, the free space.

    Raises
    ------
    StoreError
        A count below 1, or an unknown dtype or codec; the message names the option.
    """
    for name, value in (("samples", samples), ("layers", layers), ("tokens", tokens), ("dim", dim),
                        ("models", models), ("taps", taps), ("chunk_samples", chunk_samples),
                        ("batch_size", batch_size)):
        if not isinstance(value, int) or value < 1:
            raise StoreError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
    if dtype not in STORED_DTYPES:
        raise StoreError(f"--dtype must be one of {sorted(STORED_DTYPES)} (the stored dtype), got {dtype!r}")
    if codec not in CODEC_RATIO:
        raise StoreError(f"--codec must be one of {sorted(CODEC_RATIO)}, got {codec!r}")
    values = models * samples * taps * layers * tokens * dim
    arrays = models * taps * layers
    chunk_samples = chunk_size(samples, chunk_samples, batch_size)  # as the writer chooses it
    raw = arrays * array_bytes([tokens * dim] * samples, ragged=False, chunk_samples=chunk_samples,
                               value_bytes=numpy_dtype(dtype).itemsize)
    free = None
    if data is not None:
        probe = data if data.exists() else next((p for p in data.parents if p.exists()), None)
        if probe is not None:
            free = shutil.disk_usage(probe).free
    return SizeEstimate(
        models=models, samples=samples, taps=taps, layers=layers, tokens=tokens, dim=dim, dtype=dtype, codec=codec,
        chunk_samples=chunk_samples, values=values, raw_bytes=raw, bytes=int(raw / CODEC_RATIO[codec]), arrays=arrays,
        chunk_files=arrays * -(-samples // chunk_samples), free_bytes=free,
    )


# A ragged block's offsets: int64, one more than its samples (store/arrays.py's CSR layout).
OFFSET_BYTES = 8


def array_bytes(per_sample: Sequence[int], *, ragged: bool, chunk_samples: int, value_bytes: int) -> int:
    """The bytes one array's chunks hold, as the store counts them: a dense chunk is stored full-size
    (the last one padded, by less than a row per chunk at the store's sizes), a ragged block holds
    its rows plus its offsets."""
    n = len(per_sample)
    n_chunks = -(-n // chunk_samples)
    if ragged:
        return sum(per_sample) * value_bytes + (n + n_chunks) * OFFSET_BYTES
    return n_chunks * chunk_samples * max(per_sample, default=0) * value_bytes


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
