"""Storage dtypes in the store: an overflow names its array and the store's ways out, and every
reader (eager, lazy, index, ragged, the probe farm's feature reader, plain Zarr) honours float32
and bfloat16 arrays as they were stored."""

from __future__ import annotations

import numpy as np
import pytest
import zarr
from storetest_lib import stimulus_rows

from store import ArraySpec, RunInfo, Workspace, WriterError
from store.dtypes import ArrayOverflowError, bf16_bits_to_float32, cast, float32_to_bf16_bits

N = 6
BIG = 3.0e5  # beyond float16's 65504, well inside bfloat16 and float32


def _values(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    """float32 values that float16 cannot hold: a few beyond its range, most with more than 11 significant bits."""
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * np.float32(1000.0) + np.float32(0.1234567)
    x.reshape(-1)[::7] = BIG
    return x


def _bf16(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to bfloat16, as its raw bits."""
    return float32_to_bf16_bits(x)


def test_cast_overflow_names_the_array_and_the_store_keys():
    x = np.array([1.0, 1e6], np.float32)
    with pytest.raises(ArrayOverflowError) as err:
        cast(x, "float32", "float16", "error", "here", "r/llm/0/resid_post/last")
    assert err.value.array == "r/llm/0/resid_post/last"
    assert err.value.problem.startswith("here: 1 finite float32 value(s) exceed the float16 range")
    assert "ArraySpec(stored_dtype='float32')" in str(err.value) and "RunInfo(overflow='clip')" in str(err.value)
    assert "bfloat16" not in str(err.value)  # a float32 source has no bit-exact bfloat16 way out
    with pytest.raises(ArrayOverflowError, match=r"ArraySpec\(stored_dtype='bfloat16'\) \(bit-exact"):
        cast(_bf16(x), "bfloat16", "float16", "error", "here")


def test_writer_overflow_names_the_array(tmp_path):
    ws = Workspace.open(tmp_path / "ws")
    with pytest.raises(WriterError) as err, ws.writer(RunInfo(run="r", model="m", chunk_samples=N)) as w:
        w.set_samples(w.register_stimuli(stimulus_rows(N), dataset="set"))
        a = w.array(ArraySpec(tap="llm", layer=2, tokens="last", shape=(1, 4)))
        w.write(a, 0, _values(0, (N, 1, 4)))
        w.flush()
    cause = err.value.__cause__
    assert isinstance(cause, ArrayOverflowError) and cause.array == "r/llm/2/resid_post/last"


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """One run holding float32 and bfloat16 arrays, dense and ragged, of values float16 cannot hold."""
    ws = Workspace.open(tmp_path_factory.mktemp("ws") / "ws")
    dense32 = _values(1, (N, 3, 8))
    dense_bf = _bf16(_values(2, (N, 3, 8)))
    rag32 = [_values(10 + i, (i % 3, 8)) for i in range(N)]
    rag_bf = [_bf16(_values(20 + i, (i % 3 + 1, 8))) for i in range(N)]
    with ws.writer(RunInfo(run="r", model="m", chunk_samples=4)) as w:
        w.set_samples(w.register_stimuli(stimulus_rows(N), dataset="set"))
        a, b, c, d = w.arrays([
            ArraySpec(tap="llm", layer=0, tokens="image", shape=(3, 8), stored_dtype="float32"),
            ArraySpec(tap="llm", layer=1, tokens="image", shape=(3, 8), dtype="bfloat16", stored_dtype="bfloat16"),
            ArraySpec(tap="llm", layer=0, tokens="answer", shape=(8,), ragged=True, stored_dtype="float32"),
            ArraySpec(tap="llm", layer=1, tokens="answer", shape=(8,), ragged=True, dtype="bfloat16",
                      stored_dtype="bfloat16"),
        ])
        w.write(a, 0, dense32)
        w.write(b, 0, dense_bf)
        w.write_ragged(c, 0, rag32)
        w.write_ragged(d, 0, rag_bf)
        w.finish()
    return ws, dense32, dense_bf, rag32, rag_bf


def test_every_reader_returns_float32_arrays_exactly(stored):
    ws, dense32, _, rag32, _ = stored
    info = ws.array_info("r", "llm", 0, tokens="image")
    assert (info.dtype, info.stored_dtype) == ("float32", "float32")
    got = ws.read("r", "llm", 0, tokens="image")
    assert got.dtype == np.float32 and np.array_equal(got, dense32)
    assert np.array_equal(ws.read("r", "llm", 0, tokens="image", rows=[1, 5], index=(2,)), dense32[[1, 5], 2])
    assert np.array_equal(ws.read("r", "llm", 0, tokens="image", lazy=True).compute(), dense32)
    rag = ws.read("r", "llm", 0, tokens="answer")
    assert all(np.array_equal(rag[i], rag32[i]) for i in range(N)) and rag.values.dtype == np.float32
    z = ws.zarr_group()["r/llm/0/resid_post/image"]
    assert z.dtype == np.float32 and z.attrs["stored_dtype"] == "float32" and np.array_equal(z[...], dense32)


def test_every_reader_decodes_bfloat16_arrays_bit_for_bit(stored):
    ws, _, dense_bf, _, rag_bf = stored
    info = ws.array_info("r", "llm", 1, tokens="image")
    assert (info.dtype, info.stored_dtype) == ("bfloat16", "bfloat16")
    got = ws.read("r", "llm", 1, tokens="image")
    assert got.dtype == np.float32 and np.array_equal(got, bf16_bits_to_float32(dense_bf))
    assert np.array_equal(ws.read("r", "llm", 1, tokens="image", bf16_as="bits"), dense_bf)
    assert np.array_equal(ws.read("r", "llm", 1, tokens="image", lazy=True).compute(), bf16_bits_to_float32(dense_bf))
    assert np.array_equal(ws.read("r", "llm", 1, tokens="image", rows=[0, 4], index=(1,)),
                          bf16_bits_to_float32(dense_bf[[0, 4], 1]))
    rag = ws.read("r", "llm", 1, tokens="answer")
    assert all(np.array_equal(rag[i], bf16_bits_to_float32(rag_bf[i])) for i in range(N))
    z = zarr.open_group(ws.path / "arrays", mode="r")["r/llm/1/resid_post/image"]
    assert z.dtype == np.uint16 and z.attrs["stored_dtype"] == "bfloat16" and np.array_equal(z[...], dense_bf)


def test_the_probe_farms_feature_reader_widens_both(stored):
    """probes/features.py reads through store.reader with the manifest's ArrayInfo: float32 and
    bfloat16 arrays come back as their float32 values, dense and ragged, with or without ``stored``."""
    from probes.features import read_features

    ws, dense32, dense_bf, rag32, rag_bf = stored
    rows = np.array([0, 2, 5])
    for layer, want in ((0, dense32), (1, bf16_bits_to_float32(dense_bf))):
        info = ws.array_info("r", "llm", layer, tokens="image")
        for keep in (False, True):
            got = read_features(ws.root, info, rows, stored=keep)
            assert got.dtype == np.float32 and np.array_equal(got, want[rows])
    for layer, parts in ((0, rag32), (1, [bf16_bits_to_float32(r) for r in rag_bf])):
        got = read_features(ws.root, ws.array_info("r", "llm", layer, tokens="answer"), rows)
        assert np.array_equal(got.values, np.concatenate([parts[i] for i in rows]))
