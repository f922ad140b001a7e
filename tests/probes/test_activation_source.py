"""The streamed shuffled activation source (probes/sae/source.py) over a real workspace: every
selected row once an epoch, the order a function of (seed, epoch), at most one buffer held,
resuming mid-epoch without reading the skipped buffers, and arrays read side by side."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from saetest_lib import D, T, build_planted

from probes.errors import ProbeError
from probes.sae import ActivationSource, ArrayRef
from store import Workspace


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    return build_planted(tmp_path_factory.mktemp("src") / "ws", n=100, chunk=16, sites=("resid_post", "resid_mid"))


def _src(ws: Workspace, **kw) -> ActivationSource:
    kw.setdefault("arrays", ["vision:1"])
    return ActivationSource(ws, "planted", with_ids=True, **kw)


def _collect(batches) -> tuple[np.ndarray, np.ndarray]:
    xs, ids = zip(*[(b[0], b[-1]) for b in batches], strict=True)
    return np.concatenate(xs), np.concatenate(ids)


def test_every_token_row_once_per_epoch_with_its_stored_values(ws: Workspace) -> None:
    src = _src(ws, batch_size=50, buffer_rows=200)
    x, ids = _collect(src.batches(0))
    assert x.shape == (100 * T, D) and src.n_rows == 100 * T
    keys = ids[:, 0] * T + ids[:, 1]
    assert np.array_equal(np.sort(keys), np.arange(100 * T))          # each (sample, token) exactly once
    full = ws.read("planted", "vision", 1)                              # [n, T, D] in row order
    assert np.array_equal(x, full[ids[:, 0], ids[:, 1]])
    assert not np.array_equal(keys, np.sort(keys))                      # and shuffled
    assert src.n_batches() == 32 and all(len(b[0]) == 50 for b in src.batches(1))


def test_order_is_a_function_of_seed_and_epoch(ws: Workspace) -> None:
    def order(seed: int, epoch: int) -> np.ndarray:
        return _collect(_src(ws, seed=seed, batch_size=64, buffer_rows=256).batches(epoch))[1][:, 0] * T

    a = order(3, 0)
    assert np.array_equal(a, order(3, 0))
    assert not np.array_equal(a, order(3, 1))
    assert not np.array_equal(a, order(4, 0))


def test_rows_mix_across_chunks_and_the_buffer_bounds_memory(ws: Workspace) -> None:
    src = _src(ws, batch_size=32, buffer_rows=128)                      # 8 samples x 16 tokens
    tracemalloc.start()
    for _ in src.batches(0):
        pass
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert 0 < src.stats.peak_buffer_rows <= 128
    assert peak < 0.5 * 100 * T * D * 4                                 # far below the epoch's rows
    assert src.stats.buffers >= 100 * T // 128
    # a buffer holds several chunks' rows when they fit: with room for 4 chunks, a batch draws from >1
    wide = _src(ws, batch_size=256, buffer_rows=16 * 16 * 4)
    assert len(set((next(iter(wide))[-1][:, 0] // 16).tolist())) > 1


def test_resume_mid_epoch_yields_the_same_tail_and_skips_reading(ws: Workspace) -> None:
    whole = list(_src(ws, batch_size=48, buffer_rows=160, seed=7).batches(2))
    late = _src(ws, batch_size=48, buffer_rows=160, seed=7)
    tail = list(late.batches(2, start=20))
    assert len(tail) == len(whole) - 20
    for a, b in zip(whole[20:], tail, strict=True):
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[-1], b[-1])
    assert late.stats.bytes_read < 0.5 * ws.array_info("planted", "vision", 1).bytes


def test_pooled_rows_where_and_train_where(ws: Workspace) -> None:
    src = _src(ws, rows="pooled", batch_size=16, where="(truth->>'flag')::INT = 1",
               train_where="(truth->>'level')::INT >= 3")
    x, ids = _collect(src.batches(0))
    want = ws.select("planted", "(truth->>'flag')::INT = 1 AND (truth->>'level')::INT >= 3").rows
    assert np.array_equal(np.sort(ids[:, 0]), want) and (ids[:, 1] == -1).all()
    full = ws.read("planted", "vision", 1).astype(np.float32).mean(axis=1)
    np.testing.assert_allclose(x, full[ids[:, 0]], rtol=1e-6, atol=1e-6)


def test_two_sites_side_by_side_stay_aligned(ws: Workspace) -> None:
    src = _src(ws, arrays=["vision:1:resid_mid", ArrayRef("vision", 1, "resid_post")], batch_size=100, buffer_rows=300)
    mid = ws.read("planted", "vision", 1, "resid_mid")
    post = ws.read("planted", "vision", 1, "resid_post")
    for a, b, ids in src.batches(0):
        assert np.array_equal(a, mid[ids[:, 0], ids[:, 1]]) and np.array_equal(b, post[ids[:, 0], ids[:, 1]])


def test_torch_dataset_yields_the_same_rows(ws: Workspace) -> None:
    torch = pytest.importorskip("torch")
    src = _src(ws, batch_size=64, buffer_rows=256)
    loader = torch.utils.data.DataLoader(src.torch(epochs=2), batch_size=None)
    got = [b for b in loader]
    assert len(got) == 2 * src.n_batches() and got[0][0].dtype == torch.float32
    assert np.array_equal(got[0][0].numpy(), next(iter(src))[0])
    shards = [list(src.read_buffers(0, range(i, len(src.buffer_plan(0)), 2))) for i in (0, 1)]
    ids = np.concatenate([b[-1] for shard in shards for b in shard])
    assert np.array_equal(np.sort(ids[:, 0] * T + ids[:, 1]), np.arange(100 * T))


def test_clear_errors_at_the_edges(ws: Workspace, tmp_path: Path) -> None:
    with pytest.raises(ProbeError, match="tap:layer"):
        ArrayRef.parse("vision")
    with pytest.raises(ProbeError, match="no samples"):
        _src(ws, where="family = 'nope'")
    with pytest.raises(ProbeError, match="rows must be"):
        _src(ws, rows="cls")  # type: ignore[arg-type]


def test_stored_dtype_hands_out_the_stored_halves(ws: Workspace) -> None:
    src = _src(ws, dtype="stored", batch_size=100, buffer_rows=300)
    full = ws.read("planted", "vision", 1)
    assert full.dtype == np.float16
    for x, ids in src.batches(0):
        assert x.dtype == np.float16 and np.array_equal(x, full[ids[:, 0], ids[:, 1]])


def test_dataloader_workers_share_an_epoch_between_them(ws: Workspace) -> None:
    torch = pytest.importorskip("torch")
    src = _src(ws, batch_size=64, buffer_rows=256)
    got = list(torch.utils.data.DataLoader(src.torch(epochs=1), batch_size=None, num_workers=2))
    ids = torch.cat([b[-1] for b in got]).numpy()
    assert np.array_equal(np.sort(ids[:, 0] * T + ids[:, 1]), np.arange(100 * T))     # each row once, over both
