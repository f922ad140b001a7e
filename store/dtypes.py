"""The dtype policy: what the producer hands over, what lands on disk, and what is counted.

Policy (documented in docs/store.md):

* Activations are stored as float16 by default (2 bytes per value), float32 on request.
* bfloat16 has no Zarr dtype. Per run, ``bf16="fp16"`` (default) casts bf16 to float16; this is
  exact for every bf16 value with ``6.1e-5 <= |x| <= 65504`` (bf16 has 8 significant bits,
  float16 has 11), tiny values become float16 subnormals or zero, and values beyond 65504 are
  *overflow*. ``bf16="bits"`` stores the raw bf16 bits as uint16 (lossless, dtype recorded as
  ``bfloat16``); the reader turns them into float32.
* Overflow (a finite source value that would become inf) follows the run's ``overflow`` policy:
  ``error`` (default) raises :class:`ArrayOverflowError` (a :class:`DtypeOverflowError` naming the
  array); ``clip`` saturates to +-65504 and the count of clipped values is recorded per chunk.
* An array may ask for its stored dtype (``ArraySpec.stored_dtype``): ``float32`` keeps float32
  and bfloat16 sources exact, ``bfloat16`` keeps bfloat16 sources bit for bit (2 bytes a value,
  like float16, with float32's range).
* NaN/inf already present in the source are stored as they are and counted per chunk
  (``chunks.n_nonfinite``); ``verify`` and ``info`` report them. They are model behaviour worth
  keeping, not a storage failure.

float32 and bfloat16 become float16 in one pass of the C kernel ``store/_halfcast.c`` (numpy's
bits, counted as it goes) where the install built it, else with numpy's cast and scans.

torch is never imported here: a tensor is recognised only if the caller already imported torch.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from store.errors import DtypeOverflowError, StoreError

try:  # built by `make setup` (setup.py); without a C compiler, numpy casts to the same bits
    from store import _halfcast
except ImportError:  # pragma: no cover - depends on the install
    _halfcast = None  # type: ignore[assignment]
HAS_KERNEL = _halfcast is not None  # store/_halfcast.c was compiled at install (a C compiler was there)

FP16_MAX = 65504.0
# Exponent masks: a value is NaN/inf exactly when all its exponent bits are set. Checking bits
# is ~4x faster than np.isfinite on float16 and allocates one bool array.
_EXP: dict[int, tuple[type[np.unsignedinteger[Any]], int]] = {
    2: (np.uint16, 0x7C00), 4: (np.uint32, 0x7F800000), 8: (np.uint64, 0x7FF0000000000000)}
_BF16_EXP = 0x7F80


def numpy_dtype(stored: str) -> np.dtype:
    """The numpy dtype an array of this stored dtype has on disk (bf16 is raw uint16 bits)."""
    return np.dtype(np.uint16) if stored == "bfloat16" else np.dtype(stored)


def default_stored(source: str, bf16: str) -> str:
    if source == "bfloat16":
        return "bfloat16" if bf16 == "bits" else "float16"
    return "float16"


def tensor_stored(source: str, bf16: str) -> str:
    """Run tensors (an unembedding, a norm) are few and read whole: float32 stays float32."""
    return {"float64": "float32", "float32": "float32", "float16": "float16"}.get(source) or default_stored(source, bf16)


def stored_bytes(source: str, bf16: str = "fp16", stored: str | None = None) -> int:
    """Bytes per value on disk for an array whose model produces ``source`` values: ``stored`` when
    the array asks for a dtype, else the default above. Planners size runs with this, so a change
    of policy moves the estimates with it."""
    return numpy_dtype(stored or default_stored(source, bf16)).itemsize


def as_numpy(values: Any, declared: str) -> tuple[np.ndarray, str]:
    """Turn what the producer handed over into (numpy array, source kind) without copying.

    Source kind is float32/float16/float64 or ``bfloat16`` (then the array holds the uint16 bits).
    Accepts numpy arrays (uint16 means bf16 bits when the array was declared bfloat16; an
    ``ml_dtypes.bfloat16`` array is viewed as bits) and torch tensors on any device.
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(values, torch.Tensor):
        t = values.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16), "bfloat16"
        if t.dtype in (torch.float16, torch.float32, torch.float64):
            return t.numpy(), str(t.dtype).removeprefix("torch.")
        raise StoreError(f"expected a floating-point tensor (bfloat16/float16/float32), got {t.dtype}")
    arr = np.asarray(values)
    if arr.dtype.name == "bfloat16":  # ml_dtypes / jax
        return arr.view(np.uint16), "bfloat16"
    if arr.dtype == np.uint16:
        if declared != "bfloat16":
            raise StoreError(
                f"got uint16 values for an array declared {declared}: uint16 is accepted only as raw"
                " bfloat16 bits, so declare the array with dtype='bfloat16' or hand over floats"
            )
        return arr, "bfloat16"
    if arr.dtype.kind != "f":
        raise StoreError(
            f"expected floating-point activations (float16/float32, bfloat16 tensor or bits), got {arr.dtype}"
        )
    return arr, arr.dtype.name


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bf16 bits (for tests and for producers without torch)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((u >> 16) & 1) + np.uint32(0x7FFF)
    out = ((u + rounding) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    out[nan] = 0x7FC0
    return out


def count_nonfinite(arr: np.ndarray, kind: str) -> int:
    if kind == "bfloat16":
        utype, mask = np.uint16, _BF16_EXP
    else:
        utype, mask = _EXP[arr.dtype.itemsize]
    view = arr.reshape(-1).view(utype) if arr.flags.c_contiguous else np.ascontiguousarray(arr).reshape(-1).view(utype)
    if view.size == 0:
        return 0
    # One pass for the common all-finite case: the largest magnitude's exponent below all-ones.
    sign_off = utype(np.iinfo(utype).max >> 1)
    if (view & sign_off).max() < mask:
        return 0
    return int(np.count_nonzero((view & mask) == mask))


@dataclass(frozen=True)
class Cast:
    values: np.ndarray
    n_nonfinite: int
    n_clipped: int


def cast(src: np.ndarray, kind: str, stored: str, overflow: str, where: str, array: str | None = None,
         *, kernel: bool = True) -> Cast:
    """Cast ``src`` (source kind ``kind``) to the stored dtype under the overflow policy; ``array``
    (its zarr path) goes with an overflow error, so a caller can store that array wider. ``kernel``
    False takes numpy's passes even where the C kernel (``HAS_KERNEL``) would: the same bits, for
    comparing the two."""
    if stored == "bfloat16":
        if kind != "bfloat16":
            raise StoreError(
                f"{where} stores raw bfloat16 bits, got {kind} values: hand over bfloat16 tensors or uint16"
                " bits, or create the array with stored_dtype='float16'/'float32'"
            )
        return Cast(src, count_nonfinite(src, kind), 0)
    target = np.dtype(stored)
    if kind == target.name:
        return Cast(src, count_nonfinite(src, kind), 0)
    if (kernel and _halfcast is not None and stored == "float16" and kind in ("float32", "bfloat16")
            and src.flags.c_contiguous and src.flags.aligned):  # what the kernel reads; else numpy's passes
        return _cast_kernel(src, kind, overflow, where, array)
    wide = bf16_bits_to_float32(src) if kind == "bfloat16" else src
    with np.errstate(over="ignore"):  # overflow is detected and handled below
        out = wide.astype(target)
    out_nonfinite = count_nonfinite(out, target.name)
    # A nonfinite source stays nonfinite: an all-finite result (the usual case) needs no scan of
    # the source, the wider of the two (the writer thread's CPU competes with the model's forward).
    if out_nonfinite == 0:
        return Cast(out, 0, 0)
    n_nonfinite = count_nonfinite(src, kind)
    if out_nonfinite == n_nonfinite:   # equal counts: nothing overflowed
        return Cast(out, n_nonfinite, 0)
    over = ~np.isfinite(out) & np.isfinite(wide)
    if overflow == "error":
        raise _overflow_error(wide, over, kind, stored, where, array)
    out[over] = np.copysign(float(np.finfo(target).max), wide[over]).astype(target)
    return Cast(out, n_nonfinite, int(np.count_nonzero(over)))


def _cast_kernel(src: np.ndarray, kind: str, overflow: str, where: str, array: str | None) -> Cast:
    """float32 / bfloat16 bits -> float16 in one pass (store/_halfcast.c), counted as it goes."""
    out = np.empty(src.shape, np.float16)
    n_nonfinite, n_over = _halfcast.to_half(src, 0 if kind == "float32" else 1, out.view(np.uint16),
                                            overflow == "clip")
    if n_over and overflow == "error":
        wide = bf16_bits_to_float32(src) if kind == "bfloat16" else src
        raise _overflow_error(wide, np.isinf(out) & np.isfinite(wide), kind, "float16", where, array)
    return Cast(out, n_nonfinite, n_over)


class ArrayOverflowError(DtypeOverflowError):
    """An overflow in one array's values. ``problem`` says what overflowed, without the store's
    ways out (an extraction names its manifest's keys instead); ``array`` is the array's zarr path
    (None: not an array, e.g. a run tensor), so a caller can store that one array as float32."""

    def __init__(self, problem: str, fix: str, array: str | None = None) -> None:
        super().__init__(f"{problem}. {fix}")
        self.problem = problem
        self.fix = fix
        self.array = array

    def __reduce__(self) -> tuple[Any, ...]:
        # Whole across processes: a cluster worker's overflow reaches its client (extract/cluster/).
        return type(self), (self.problem, self.fix, self.array)


def _overflow_error(wide: np.ndarray, over: np.ndarray, kind: str, stored: str, where: str,
                    array: str | None) -> ArrayOverflowError:
    """What an ``overflow='error'`` run raises: how many values, the largest, and the ways out."""
    limit = float(np.finfo(np.dtype(stored)).max)
    worst = float(np.max(np.abs(wide[over])))
    lossless = "ArraySpec(stored_dtype='bfloat16') (bit-exact for bfloat16 values), " if kind == "bfloat16" else ""
    return ArrayOverflowError(
        f"{where}: {int(np.count_nonzero(over))} finite {kind} value(s) exceed the {stored} range"
        f" (max |x| = {worst:.6g}, limit {limit:.6g})",
        f"Store them with {lossless}ArraySpec(stored_dtype='float32') (exact), or RunInfo(overflow='clip')"
        " (saturate to the limit and count the clipped values)",
        array,
    )


def decode_stored(values: np.ndarray, stored: str, bf16_as: str = "float32") -> np.ndarray:
    """What readers get: bf16 bits become float32 unless ``bf16_as='bits'``."""
    if stored == "bfloat16" and bf16_as != "bits":
        return bf16_bits_to_float32(values)
    return values
