"""The writer's cast to float16: the C kernel (store/_halfcast.c) and numpy's passes, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_lib import PATHS, kernel_or_numpy

from store import dtypes
from store.errors import DtypeOverflowError


@pytest.fixture(params=PATHS)
def cast_path(request, monkeypatch):
    """Each cast test runs on the C kernel and on the numpy passes."""
    return kernel_or_numpy(request, monkeypatch, dtypes, "_halfcast", "store._halfcast")


def _rounding_boundaries() -> np.ndarray:
    """Every float32 high half with the low halves where float16 rounding turns: the 13 dropped bits
    just below, at and above half, ties with odd and even kept bits, NaN payloads, overflow."""
    high = np.arange(1 << 16, dtype=np.uint32) << 16
    low = np.array([0, 1, 0x0FFF, 0x1000, 0x1001, 0x1FFF, 0x2000, 0x2001, 0x3000, 0x7FFF, 0x8000, 0x8001,
                    0xEFFF, 0xF000, 0xF001, 0xFFFF], np.uint32)
    return (high[:, None] | low[None, :]).reshape(-1).view(np.float32)


def test_every_float32_rounding_boundary_casts_to_numpys_bits(cast_path):
    x = _rounding_boundaries()
    with np.errstate(all="ignore"):
        want = x.astype(np.float16)
    over = np.isinf(want) & np.isfinite(x)
    want[over] = np.copysign(np.float16(65504), x[over])  # overflow='clip' saturates
    got = dtypes.cast(x, "float32", "float16", "clip", "test")
    assert np.array_equal(got.values.view(np.uint16), want.view(np.uint16))  # NaN payloads and signed zeros too
    assert (got.n_nonfinite, got.n_clipped) == (int(np.count_nonzero(~np.isfinite(x))), int(np.count_nonzero(over)))
    assert got.n_clipped > 0 and got.n_nonfinite > 0  # the set has both


def test_every_bfloat16_bit_pattern_casts_to_numpys_bits(cast_path):
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    wide = dtypes.bf16_bits_to_float32(bits)
    with np.errstate(all="ignore"):
        want = wide.astype(np.float16)
    over = np.isinf(want) & np.isfinite(wide)
    want[over] = np.copysign(np.float16(65504), wide[over])
    got = dtypes.cast(bits, "bfloat16", "float16", "clip", "test")
    assert np.array_equal(got.values.view(np.uint16), want.view(np.uint16))
    assert (got.n_nonfinite, got.n_clipped) == (int(np.count_nonzero(~np.isfinite(wide))), int(np.count_nonzero(over)))


def test_cast_counts_nonfinite_and_overflow_and_scans_an_all_finite_source_once(monkeypatch, cast_path):
    """float32 -> float16 as the writer thread casts: NaN/inf counted, overflow counted apart from
    them (clip) or refused (error). The kernel counts as it casts; numpy's path scans only the
    (narrower) result when it is all finite, proof enough that the source was."""
    x = np.ones((4, 8), np.float32)
    x[0, 0], x[1, 1], x[2, 2] = np.nan, -np.inf, 1e6
    got = dtypes.cast(x, "float32", "float16", "clip", "test")
    assert (got.n_nonfinite, got.n_clipped) == (2, 1) and got.values[2, 2] == np.float16(65504)
    assert got.values.shape == x.shape and got.values.dtype == np.float16
    with pytest.raises(DtypeOverflowError, match=r"test: 1 finite float32 value\(s\).*max \|x\| = 1e\+06"):
        dtypes.cast(x, "float32", "float16", "error", "test")
    nan_only = np.ones((4, 8), np.float32)
    nan_only[3, 3] = np.nan
    assert dtypes.cast(nan_only, "float32", "float16", "error", "test").n_nonfinite == 1

    scanned: list[np.dtype] = []
    real = dtypes.count_nonfinite
    monkeypatch.setattr(dtypes, "count_nonfinite", lambda a, kind: scanned.append(a.dtype) or real(a, kind))
    finite = dtypes.cast(np.ones((4, 8), np.float32), "float32", "float16", "error", "test")
    assert (finite.n_nonfinite, finite.n_clipped) == (0, 0)
    assert scanned == ([] if cast_path == "kernel" else [np.dtype(np.float16)])


def test_strided_and_odd_address_sources_cast_through_numpy_to_the_same_bits(cast_path):
    """The kernel reads aligned C-order buffers; a transposed view, or float32 at an odd address (as
    a buffer handed over from elsewhere may be), takes numpy's passes instead of failing."""
    x = np.random.default_rng(0).standard_normal((6, 5)).astype(np.float32) * 1e3
    raw = np.empty(x.size * 4 + 1, np.uint8)
    odd = raw[1:].view(np.float32).reshape(x.shape)
    odd[...] = x
    assert not odd.flags.aligned
    for src in (x.T, odd):
        got = dtypes.cast(src, "float32", "float16", "error", "test")
        assert np.array_equal(got.values, src.astype(np.float16))


def test_the_cast_kernel_refuses_buffers_that_do_not_match():
    if dtypes._halfcast is None:
        pytest.skip("store._halfcast was not built")
    out = np.empty(4, np.uint16)
    with pytest.raises(ValueError, match="one uint16 per value"):
        dtypes._halfcast.to_half(np.zeros(3, np.float32), 0, out, False)
    with pytest.raises(ValueError, match="kind is 0"):
        dtypes._halfcast.to_half(np.zeros(4, np.float32), 2, out, False)
