"""Values come back exactly as the dtype policy says, for every layout and codec."""

from __future__ import annotations

import numpy as np
import pytest
from storetest_lib import DIM, TOKENS, dense_values, ragged_values, stimulus_rows, write_run

from store import (
    ArraySpec,
    DtypeOverflowError,
    NotCommittedError,
    RunInfo,
    StoreError,
    Workspace,
    WriterError,
)
from store.dtypes import bf16_bits_to_float32, float32_to_bf16_bits

torch = pytest.importorskip("torch")


@pytest.fixture(params=["inline", "lanes"])
def stats_path(request, monkeypatch):
    """A small stream's checksums and NaN/inf counts run on the writer thread; a big one's on the
    I/O lanes (store/writer/pipeline.py ``_INLINE_STATS_BYTES``): both paths, whatever the batch size."""
    import store.writer.pipeline

    if request.param == "lanes":
        monkeypatch.setattr(store.writer.pipeline, "_INLINE_STATS_BYTES", 0)
    return request.param


def _open_run(tmp_path, n=20, chunk=8, **run_kw):
    ws = Workspace.open(tmp_path / "ws")
    w = ws.writer(RunInfo(run=run_kw.pop("run", "r"), model="m", chunk_samples=chunk, **run_kw))
    w.set_samples(w.register_stimuli(stimulus_rows(n), dataset="set"))
    return ws, w


@pytest.mark.slow
def test_reference_run_round_trips_dense_ragged_spans_and_generations(tmp_path):
    ws = Workspace.open(tmp_path / "ws")
    write_run(ws, n=40, chunk=8, batch=3)  # batches straddle chunk boundaries
    got = ws.read("r1", "llm", 3, tokens="image")
    assert got.dtype == np.float16 and got.shape == (40, TOKENS, DIM)
    assert np.array_equal(got, dense_values(range(40)).astype(np.float16))  # exact after the fp16 cast
    rag = ws.read("r1", "llm", 3, tokens="answer")
    assert len(rag) == 40 and list(rag.lengths) == [i % 4 for i in range(40)]
    for i in (0, 1, 3, 39):
        assert np.array_equal(rag[i], ragged_values(i).astype(np.float16))
    spans = ws.rows("SELECT count(*), min(grid_h * grid_w), max(answer_count) FROM samples WHERE recorded_at IS NOT NULL")
    assert spans == [(40, 6, 3)]
    acc = ws.query("SELECT family, n, accuracy FROM v_accuracy ORDER BY family").to_pylist()
    assert [a["n"] for a in acc] == [20, 20]
    cells = ws.rows("SELECT sum((metrics->>'cells_total')::INT) FROM generations")
    assert cells == [(360,)]


@pytest.mark.slow
def test_select_by_sql_reads_only_those_rows(tmp_path):
    ws = Workspace.open(tmp_path / "ws")
    write_run(ws, n=40, chunk=8)
    where = "family = 'g2m' AND (params->>'grid_size')::INT = 4"
    sel = ws.select("r1", where)
    expect = [i for i in range(40) if i % 2 == 0 and 3 + i % 3 == 4]
    assert sel.rows.tolist() == expect and sel.stimuli[0] == f"set/s{expect[0]:04d}"
    ref = dense_values(expect).astype(np.float16)
    assert np.array_equal(ws.read("r1", "llm", 3, tokens="image", where=where), ref)
    assert np.array_equal(ws.read("r1", "llm", 3, tokens="image", rows=sel), ref)
    assert np.array_equal(ws.read("r1", "llm", -1, tokens="image", rows=sel, index=(2,)), ref[:, 2])
    lazy = ws.read("r1", "llm", 3, tokens="image", where=where, lazy=True)
    assert lazy.shape == ref.shape and np.array_equal(lazy.compute(scheduler="sync"), ref)
    # A lazy read builds tasks only for chunks holding selected rows.
    assert lazy.numblocks[0] == len({r // 8 for r in expect})


@pytest.mark.slow
def test_float32_stored_exactly_and_float16_passthrough(tmp_path):
    ws, w = _open_run(tmp_path)
    x32 = np.random.default_rng(0).standard_normal((20, 3, 4)).astype(np.float32)
    x16 = x32.astype(np.float16)
    with w:
        a = w.array(ArraySpec(tap="vision", layer=0, tokens="all", shape=(3, 4), stored_dtype="float32"))
        b = w.array(ArraySpec(tap="vision", layer=1, tokens="all", shape=(3, 4), dtype="float16"))
        w.write(a, 0, x32)
        w.write(b, 0, x16)
        w.finish()
    assert np.array_equal(ws.read("r", "vision", 0, tokens="all"), x32)
    assert np.array_equal(ws.read("r", "vision", 1, tokens="all"), x16)


@pytest.mark.slow
def test_bf16_from_torch_and_raw_bits_under_both_policies(tmp_path):
    t = (torch.randn(20, 3, 4) * 100).to(torch.bfloat16)
    exact = t.float().numpy()
    bits = float32_to_bf16_bits(exact)
    assert np.array_equal(bf16_bits_to_float32(bits), exact)  # our rounding matches torch's
    ws, w = _open_run(tmp_path, run="fp16")
    with w:
        a = w.array(ArraySpec(tap="llm", layer=0, tokens="last", shape=(3, 4), dtype="bfloat16"))
        b = w.array(ArraySpec(tap="llm", layer=1, tokens="last", shape=(3, 4), dtype="bfloat16"))
        w.write(a, 0, t)  # a torch bf16 tensor
        w.write(b, 0, bits)  # the same values as raw uint16 bits
        w.finish()
    info = ws.array_info("fp16", "llm", 0, tokens="last")
    assert (info.dtype, info.stored_dtype) == ("bfloat16", "float16")
    # |x| >= 6.1e-5 and <= 65504: bf16 -> fp16 is exact.
    assert np.array_equal(ws.read("fp16", "llm", 0, tokens="last").astype(np.float32), exact)
    assert np.array_equal(ws.read("fp16", "llm", 1, tokens="last").astype(np.float32), exact)

    with ws.writer(RunInfo(run="bits", model="m", chunk_samples=8, bf16="bits")) as w2:
        w2.set_samples([f"set/s{i:04d}" for i in range(20)])
        c = w2.array(ArraySpec(tap="llm", layer=0, tokens="last", shape=(3, 4), dtype="bfloat16"))
        w2.write(c, 0, t)
        w2.finish()
    assert ws.array_info("bits", "llm", 0, tokens="last").stored_dtype == "bfloat16"
    assert np.array_equal(ws.read("bits", "llm", 0, tokens="last"), exact)  # decoded to float32
    assert np.array_equal(ws.read("bits", "llm", 0, tokens="last", bf16_as="bits"), bits)
    z = ws.zarr_group()["bits/llm/0/resid_post/last"]
    assert z.dtype == np.uint16 and z.attrs["stored_dtype"] == "bfloat16"


@pytest.mark.slow
def test_overflow_errors_by_default_and_is_counted_when_clipped(tmp_path):
    big = np.full((8, 2, 2), 1.0, np.float32)
    big[0, 0, 0] = 1e6
    ws, w = _open_run(tmp_path, n=8, chunk=8)
    a = w.array(ArraySpec(tap="llm", layer=0, tokens="last", shape=(2, 2)))
    w.write(a, 0, big)
    with pytest.raises(WriterError) as err:
        w.flush()
    assert isinstance(err.value.__cause__, DtypeOverflowError) and "overflow='clip'" in str(err.value)
    with pytest.raises(WriterError):
        w.close()
    assert ws.rows("SELECT status FROM runs WHERE run = 'r'") == [("failed",)]

    with ws.writer(RunInfo(run="c", model="m", chunk_samples=8, overflow="clip")) as w2:
        w2.set_samples([f"set/s{i:04d}" for i in range(8)])
        b = w2.array(ArraySpec(tap="llm", layer=0, tokens="last", shape=(2, 2)))
        w2.write(b, 0, big)
        w2.finish()
    got = ws.read("c", "llm", 0, tokens="last")
    assert got[0, 0, 0] == np.float16(65504) and got[1, 0, 0] == 1
    assert ws.rows("SELECT n_clipped FROM v_arrays WHERE run = 'c'") == [(1,)]


@pytest.mark.slow
def test_nan_and_inf_are_stored_and_counted_per_chunk(tmp_path, stats_path):
    x = np.zeros((16, 2, 2), np.float16)
    x[1, 0, 0], x[9, 1, 1], x[10, 0, 1] = np.nan, np.inf, -np.inf
    ws, w = _open_run(tmp_path, n=16, chunk=8)
    with w:
        a = w.array(ArraySpec(tap="llm", layer=0, tokens="last", shape=(2, 2), dtype="float16"))
        w.write(a, 0, x)
        w.finish()
    assert ws.rows("SELECT chunk, n_nonfinite FROM chunks ORDER BY chunk") == [(0, 1), (1, 2)]
    got = ws.read("r", "llm", 0, tokens="last")
    assert np.isnan(got[1, 0, 0]) and got[9, 1, 1] == np.inf and got[10, 0, 1] == -np.inf
    rep = ws.verify()
    assert rep.ok and any("NaN/inf" in m or "nonfinite" in m for m in rep.warnings)


@pytest.mark.slow
def test_codecs_lossless_and_bitround_bounds(tmp_path):
    x = (np.random.default_rng(1).standard_normal((16, 32, 16)) * 3).astype(np.float16)
    ws, w = _open_run(tmp_path, n=16, chunk=8)
    with w:
        z = w.array(ArraySpec(tap="llm", layer=0, tokens="image", shape=(32, 16), dtype="float16", codec="zstd"))
        r = w.array(ArraySpec(tap="llm", layer=1, tokens="image", shape=(32, 16), dtype="float16", codec="bitround7"))
        with pytest.raises(StoreError, match="keepbits must be 1..9"):
            w.array(ArraySpec(tap="llm", layer=2, tokens="image", shape=(2,), dtype="float16", codec="bitround12"))
        w.write(z, 0, x)
        w.write(r, 0, x)
        w.finish()
    assert np.array_equal(ws.read("r", "llm", 0, tokens="image"), x)
    lossy = ws.read("r", "llm", 1, tokens="image").astype(np.float32)
    ref = x.astype(np.float32)
    nz = np.abs(ref) >= 2.0**-14  # normal fp16 values: relative error <= 2^-8
    assert np.max(np.abs(lossy[nz] - ref[nz]) / np.abs(ref[nz])) <= 2.0**-8
    sizes = dict(ws.rows("SELECT layer, bytes_per_value FROM v_arrays"))
    assert sizes[1] < sizes[0] <= 2.0
    z_attrs = ws.zarr_group()["r/llm/1/resid_post/image"].attrs
    assert z_attrs["codec"] == "bitround7" and z_attrs["lossy"] is True and z_attrs["keepbits"] == 7


def test_attention_rows_layout(tmp_path):
    att = np.random.default_rng(2).random((12, 2, 3, 10)).astype(np.float32)  # [samples, heads, query_rows, keys]
    ws, w = _open_run(tmp_path, n=12, chunk=4)
    with w:
        a = w.array(ArraySpec(tap="attn", layer=5, tokens="answer", shape=(2, 3, 10)))
        w.write(a, 0, att)
        w.finish()
    info = ws.array_info("r", "attn", 5, tokens="answer")
    assert info.dims == ("sample", "head", "answer_query", "answer_key") and info.shape == (12, 2, 3, 10)
    assert np.array_equal(ws.read("r", "attn", 5, tokens="answer", rows=[1, 7], index=(1,)), att[[1, 7], 1].astype(np.float16))


def test_shape_and_row_errors_say_expected_and_got(tmp_path):
    ws, w = _open_run(tmp_path, n=8, chunk=8)
    with w:
        a = w.array(ArraySpec(tap="llm", layer=0, tokens="last", shape=(2, 2)))
        with pytest.raises(StoreError, match=r"expected a batch of shape \[batch, 2, 2\], got \[1, 3, 2\]"):
            w.write(a, 0, np.zeros((1, 3, 2), np.float32))
        with pytest.raises(StoreError, match=r"rows \[7, 9\) must lie inside"):
            w.write(a, 7, np.zeros((2, 2, 2), np.float32))
        with pytest.raises(StoreError, match="uint16"):
            w.write(a, 0, np.zeros((1, 2, 2), np.uint16))
        w.write(a, 0, np.zeros((4, 2, 2), np.float32))
        w.flush()
    with pytest.raises(NotCommittedError, match="committed_only"):
        ws.read("r", "llm", 0, tokens="last")
    assert ws.read("r", "llm", 0, tokens="last", committed_only=True).shape == (0, 2, 2)


@pytest.mark.slow
def test_resume_in_process_skips_committed_chunks_and_refuses_changed_settings(tmp_path):
    ws = Workspace.open(tmp_path / "ws")
    ws_ref = Workspace.open(tmp_path / "ref")
    write_run(ws_ref, n=24, chunk=8)
    with ws.writer(RunInfo(run="r1", model="tiny-test", dtype="float32", chunk_samples=8, config={"n": 24})) as w:
        w.set_samples(w.register_stimuli(stimulus_rows(24), dataset="set"))
        img = w.array(ArraySpec(tap="llm", layer=3, tokens="image", shape=(TOKENS, DIM), module="model.layers.3"))
        w.write(img, 0, dense_values(range(8)))
        w.write(img, 8, dense_values(range(8, 12)))  # half a chunk: dropped at close
    again = write_run(ws, n=24, chunk=8)
    assert again["todo"] == [[0, 24]]  # the ragged array has nothing yet, so every row is still needed
    assert ws.rows("SELECT count(*), count(DISTINCT (zarr_path, chunk)) FROM chunks") == [(6, 6)]
    assert np.array_equal(ws.read("r1", "llm", 3, tokens="image"), ws_ref.read("r1", "llm", 3, tokens="image"))
    with pytest.raises(StoreError, match="different settings"):
        ws.writer(RunInfo(run="r1", model="other", chunk_samples=8))


@pytest.mark.slow
def test_batches_out_of_order_and_checksums_match_what_zarr_reads(tmp_path, stats_path):
    import google_crc32c

    from store.checksum import crc32c

    x = np.random.default_rng(3).standard_normal((20, 3, 4)).astype(np.float16)
    assert crc32c(x) == google_crc32c.value(x.tobytes()) and crc32c(x[10:], crc32c(x[:10])) == crc32c(x)
    ws, w = _open_run(tmp_path, n=20, chunk=8)
    with w:
        a = w.array(ArraySpec(tap="llm", layer=0, tokens="last", shape=(3, 4), dtype="float16"))
        for s in (16, 12, 4, 8, 0):  # backwards, across chunk boundaries
            w.write(a, s, x[s : s + 4])
        w.finish()
    assert np.array_equal(ws.read("r", "llm", 0, tokens="last"), x)
    z = ws.zarr_group()["r/llm/0/resid_post/last"]
    for chunk, start, stop, crc in ws.rows("SELECT chunk, row_start, row_stop, crc32c FROM chunks ORDER BY chunk"):
        assert crc == crc32c(z[start:stop]), chunk
    assert ws.verify().ok


@pytest.mark.parametrize("pooled", [False, True], ids=["serial", "pool"])
def test_new_nodes_sync_each_metadata_file_and_folder_once(tmp_path, monkeypatch, pooled):
    """A run's new arrays share their parents: each zarr.json and folder up to the workspace is
    synced exactly once, whether the writer's fsync pool runs them concurrently or not."""
    from concurrent.futures import ThreadPoolExecutor

    from store import arrays as layout

    root = tmp_path / layout.ZARR_DIR
    nodes = ["r/llm/0/resid_post/image", "r/llm/1/resid_post/image"]
    for node in nodes:
        for p in [root / node, *(root / node).parents]:
            if root in (p, *p.parents):
                p.mkdir(parents=True, exist_ok=True)
                (p / "zarr.json").write_text("{}")
    synced: list[str] = []
    monkeypatch.setattr(layout, "fsync_path", lambda p: synced.append(str(p.relative_to(tmp_path))))
    with ThreadPoolExecutor(4) as pool:
        layout.fsync_node_chains(tmp_path, nodes, pool if pooled else None)
    metas = [s for s in synced if s.endswith("zarr.json")]
    assert len(synced) == len(set(synced)) and len(metas) == 9 and len(synced) == 2 * 9 + 1
    assert "." in synced and f"{layout.ZARR_DIR}/r/llm/1/resid_post/image/zarr.json" in metas
