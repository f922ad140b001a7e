"""The pooled read: float16 tokens pooled from their stored bits equal, to the bit, pooling their
float32 cast (the derived arrays and the in-memory kinds rely on that), and the streamed pass no
longer holds a float32 copy of every token it pools."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from kernel_lib import PATHS, kernel_or_numpy

from probes import pooling
from probes.features import as_float32, read_features
from probes.pooling import pool
from probes.stream import StreamSpec, read_block
from store import ArraySpec, RunInfo, TokenSpans, Workspace, reader
from store.arrays import dense_chunk_file
from store.errors import WorkspaceError

N, T, D = 11, 37, 24
HOWS = ("mean", "max", "first", "last")
#: Values whose float32 sums are easy to get wrong: signed zeros, float16 subnormals, the largest
#: float16, values that cancel.
EDGES = np.array([0.0, -0.0, 6e-8, -6e-8, 3e-5, -3e-5, 65504.0, -65504.0, 1.0, -1.0, 0.1], np.float16)


def _tokens(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 4).astype(np.float16)
    mask = rng.random(shape) < 0.2
    x[mask] = rng.choice(EDGES, int(mask.sum()))
    return x


def _reference(x16: np.ndarray, how: str) -> np.ndarray:
    """What pooling did before the pooled read: the float32 cast, then numpy's own reductions."""
    x = x16.astype(np.float32)
    return {"mean": lambda: x.mean(1, dtype=np.float32), "max": lambda: x.max(1),
            "first": lambda: x[:, 0], "last": lambda: x[:, -1]}[how]()


def _ragged_reference(values16: np.ndarray, offsets: np.ndarray, how: str) -> np.ndarray:
    v, lengths = values16.astype(np.float32), np.diff(offsets)
    if how == "mean":
        return (np.add.reduceat(v, offsets[:-1], axis=0) / lengths[:, None]).astype(np.float32)
    if how == "max":
        return np.maximum.reduceat(v, offsets[:-1], axis=0)
    return v[offsets[:-1]] if how == "first" else v[offsets[1:] - 1]


@pytest.fixture(params=PATHS)
def pooling_path(request, monkeypatch):
    """Each float16 pooling test runs on the C kernel (probes/_halfpool.c) and on the numpy passes."""
    return kernel_or_numpy(request, monkeypatch, pooling, "_halfpool", "probes._halfpool")


def test_the_kernel_refuses_buffers_that_do_not_match_the_shape():
    if pooling._halfpool is None:
        pytest.skip("probes._halfpool was not built")
    bits = np.zeros((2, 3, 4), np.uint16)
    out, bad = np.empty((2, 4), np.float32), np.zeros(2, np.uint8)
    with pytest.raises(ValueError, match="n \\* T \\* d uint16"):
        pooling._halfpool.reduce(bits, 2, 4, 4, out, bad, 0)
    with pytest.raises(ValueError, match="n \\* d float32"):
        pooling._halfpool.reduce(bits, 2, 3, 4, out[:1], bad, 0)
    with pytest.raises(ValueError, match="how is 0"):
        pooling._halfpool.reduce(bits, 2, 3, 4, out, bad, 2)
    with pytest.raises(TypeError):   # a read-only out
        pooling._halfpool.reduce(bits, 2, 3, 4, bytes(32), bad, 0)


@pytest.mark.parametrize("how", ["mean", "max"])
def test_every_float16_bit_pattern_pools_like_numpy(pooling_path, how):
    """All 65,536 patterns, each beside others in its column (sums and maxima that round, signed
    zeros against each other, subnormals) and NaN/inf flagged to numpy's own cast."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    rng = np.random.default_rng(0)
    x = np.stack([bits, rng.permutation(bits), rng.permutation(bits), bits[::-1]]).reshape(4, 64, 1024)
    x = x.transpose(1, 0, 2).copy().view(np.float16)    # [64 samples, 4 tokens, 1024]
    with np.errstate(invalid="ignore"):   # inf - inf in the reference's sums
        assert pool(x, how).tobytes() == _reference(x, how).tobytes()
    finite = x.copy()
    finite[~np.isfinite(finite)] = 0
    finite[::2, 0, 0] = np.inf if how == "mean" else np.nan    # every other sample falls back
    assert pool(finite, how).tobytes() == _reference(finite, how).tobytes()
    reduce = pooling._reduce_kernel if pooling_path == "kernel" else pooling._reduce_numpy
    flagged = reduce(finite, how, np.empty((64, 1024), np.float32))
    assert (flagged == np.isfinite(finite).all((1, 2))).all() and flagged.sum() == 32


@pytest.mark.parametrize("how", ["mean", "max"])
def test_float16_at_an_odd_address_pools_like_numpy(how):
    """Arrays deserialised by Dask may start at an odd address; the kernel reads aligned uint16
    only, so such an array takes the numpy passes instead of failing."""
    x = _tokens(3, (N, T, D))
    raw = np.empty(x.nbytes + 1, np.uint8)
    odd = raw[1:].view(np.float16).reshape(x.shape)
    odd[...] = x
    assert not odd.flags.aligned and odd.flags.c_contiguous
    assert pool(odd, how).tobytes() == _reference(x, how).tobytes()


def test_every_float16_bit_pattern_widens_like_numpys_cast():
    bits = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    assert as_float32(bits).tobytes() == bits.astype(np.float32).tobytes()
    assert as_float32(bits.reshape(256, 256)).tobytes() == bits.reshape(256, 256).astype(np.float32).tobytes()


@pytest.mark.parametrize("slab_tokens", [1, 5, T])
@pytest.mark.parametrize("how", HOWS)
def test_pooling_float16_bits_equals_pooling_the_float32_cast(monkeypatch, pooling_path, how, slab_tokens):
    """Slabs of 1, 5 (the last one short) and all tokens carry the running sum / max across slabs."""
    monkeypatch.setattr(pooling, "SLAB_VALUES", slab_tokens * D)
    x = _tokens(0, (N, T, D))
    x[3, :, 5] = -0.0             # a column of negative zeros: its sum's sign is numpy's start value's
    x[4, :, 7] = 65504.0          # float16 overflows here, the float32 sum does not
    finite = x.copy()
    x[5, 2, 3], x[6, 0, 0], x[6, 9, 1] = np.nan, np.inf, -np.inf   # these samples take numpy's cast
    for data in (finite, x):
        got = pool(data, how)
        assert got.dtype == np.float32 and got.flags.c_contiguous
        assert got.tobytes() == _reference(data, how).tobytes()
    assert pool(x, how).tobytes() == pool(x.astype(np.float32), how).tobytes()


def _store(path: Path, stored: str, ragged: bool, t: int = T, d: int = D) -> tuple[Workspace, np.ndarray,
                                                                                  list[np.ndarray]]:
    """One run of N samples in chunks of 4: a dense [t, d] image array or a ragged answer array
    (1..7 tokens per sample), stored as ``stored``."""
    dense = _tokens(1, (N, t, d))
    counts = [1 + i % 7 for i in range(N)]
    answers = [_tokens(2 + i, (1, c, d))[0] for i, c in enumerate(counts)]
    ws = Workspace.open(path)
    with ws.writer(RunInfo(run="r", model="synthetic", dtype="float32", chunk_samples=4)) as w:
        w.set_samples(w.register_stimuli([{"id": f"s{i:02d}", "family": "spatial"} for i in range(N)], dataset="r"))
        spec = ArraySpec(tap="llm", layer=0, tokens="answer" if ragged else "image",
                         shape=(d,) if ragged else (t, d), ragged=ragged, stored_dtype=stored)
        h = w.array(spec)
        for s in range(0, N, 4):
            e = min(s + 4, N)
            values = [a.astype(np.float32) for a in answers[s:e]] if ragged else dense[s:e].astype(np.float32)
            w.write_batch(s, {h: values}, tokens=[TokenSpans(seq_len=t + 12, image_start=1, image_count=t, grid_h=1,
                                                             grid_w=t, answer_start=t + 2, answer_count=counts[i])
                                                  for i in range(s, e)])
        w.finish()
    return ws, dense, answers


@pytest.mark.parametrize("ragged", [False, True], ids=["dense", "ragged"])
@pytest.mark.parametrize("stored", ["float16", "float32"])
def test_pooled_reads_equal_float32_pooling_on_every_path(tmp_path, stored, ragged):
    """The streamed pass (read_block), pool() over the stored dtype and pool() over float32 (the
    derived arrays' path) give the same bytes as pooling the float32 values, on chunk-crossing,
    gapped row selections."""
    ws, dense, answers = _store(tmp_path / "ws", stored, ragged)
    info = ws.array_info("r", "llm", 0, tokens="answer" if ragged else "image")
    assert (info.stored_dtype, info.layout) == (stored, "ragged" if ragged else "dense")
    for rows in (np.arange(N), np.array([0, 2, 3, 4, 7, 10])):
        for how in HOWS:
            if ragged:
                picked = [answers[r] for r in rows]
                offsets = np.concatenate([[0], np.cumsum([len(a) for a in picked])])
                want = _ragged_reference(np.concatenate(picked), offsets, how)
            else:
                want = _reference(dense[rows], how)
            spec = StreamSpec(root=ws.root, rows=rows, level="sample", pool=how, alphas=(1.0,), standardize=False,
                              precision="float64", block_rows=len(rows), solves=[])
            block, nbytes = read_block(spec, info, rows)
            assert block.shape == (len(rows), 1, D) and block.dtype == np.float32
            tokens = int(offsets[-1]) if ragged else len(rows) * T
            assert nbytes == tokens * D * np.dtype(stored).itemsize
            assert block[:, 0].tobytes() == want.tobytes(), how
            for stored_read in (True, False):
                X = read_features(ws.root, info, rows, stored=stored_read)
                assert pool(X, how).tobytes() == want.tobytes(), (how, stored_read)


def test_a_pooled_block_holds_no_float32_copy_of_its_tokens(tmp_path):
    """The streamed pooled pass used to decode every block to float32 [m, T, d] before averaging
    it: three times the stored bytes in flight. It now holds the stored block and small buffers."""
    t, d = 256, 1024   # 5.5 MiB stored: large beside the reader's fixed allocations
    ws, _, _ = _store(tmp_path / "ws", "float16", False, t, d)
    info = ws.array_info("r", "llm", 0, tokens="image")
    rows = np.arange(N)
    spec = StreamSpec(root=ws.root, rows=rows, level="sample", pool="mean", alphas=(1.0,), standardize=False,
                      precision="float64", block_rows=N, solves=[])
    read_block(spec, info, rows)   # imports and first-call allocations out of the measurement
    tracemalloc.start()
    try:
        read_block(spec, info, rows)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    stored = N * t * d * 2
    assert peak < 1.5 * stored, f"peak {peak} B for a block of {stored} stored bytes"


def test_dense_rows_read_straight_from_the_chunk_files(tmp_path):
    """Runs of consecutive rows and single rows, inside and across chunks, equal the chunk files'
    bytes; a chunk file cut short is named, not read."""
    ws, dense, _ = _store(tmp_path / "ws", "float16", False)
    info = ws.array_info("r", "llm", 0, tokens="image")
    for rows in (np.arange(N), np.array([1, 2, 3, 5, 8, 9, 10]), np.array([6])):
        got = reader.read_dense(ws.root, info, rows, None, "float32")
        assert got.dtype == np.float16 and got.tobytes() == dense[rows].tobytes()
    out = np.empty((3, T, D + 1), np.float16)[..., :D]   # a strided target: read, then copied in
    reader.read_chunk_rows(ws.root, info, 1, np.array([0, 1, 3]), None, raw=True, out=out)
    assert out.tobytes() == dense[[4, 5, 7]].tobytes()
    chunk = dense_chunk_file(ws.root.local.parent, info.zarr_path, len(info.shape), 1)
    chunk.write_bytes(chunk.read_bytes()[:-2])
    with pytest.raises(WorkspaceError, match="has .* bytes, expected"):
        reader.read_dense(ws.root, info, np.array([5]), None, "float32")


def test_pooled_blocks_are_accumulated_together(tmp_path):
    """A pooled block is a few rows (the farm's blocks are sized for the tokens: 3 samples at real
    shape), and each XᵀX update of a few rows streams all of the d×d matrix through memory; the
    map task gathers pooled rows up to the tokens a block holds before it updates."""
    from probes.stream import Part, _units

    ws, dense, _ = _store(tmp_path / "ws", "float16", False)
    info = ws.array_info("r", "llm", 0, tokens="image")
    pos = np.array([0, 1, 2, 4, 5, 7, 8, 9, 10])
    for level, sizes in (("sample", [len(pos)]), ("token", [2, 2, 2, 2, 1])):
        spec = StreamSpec(root=ws.root, rows=np.arange(N), level=level, pool="mean", alphas=(1.0,),
                          standardize=False, precision="float64", block_rows=2, solves=[])
        part = Part([])
        got = list(_units(spec, info, pos, part))
        assert [len(idx) for idx, _ in got] == sizes
        assert np.concatenate([idx for idx, _ in got]).tolist() == pos.tolist()
        U = np.concatenate([u for _, u in got])
        want = _reference(dense[pos], "mean")[:, None, :] if level == "sample" else dense[pos].astype(np.float32)
        assert U.tobytes() == want.tobytes()
        assert part.read_bytes == len(pos) * T * D * 2
