"""A streamed, shuffled source of activation rows over the store, for any torch training.

The rows are chosen by SQL over the manifest (``where``, and ``train_where`` on top of it), from one
array or from several arrays of one run that share their samples (a transcoder reads two sites of
one layer side by side). A row is a token (``rows="tokens"``: each sample's ``[T, d]`` becomes T
rows) or a sample's mean over its tokens (``rows="pooled"``).

Shuffling is bounded: each epoch cuts the selection into *units* (the selected samples of one
chunk, split so that a unit never holds more than ``buffer_rows`` rows), visits the units in a
seeded random order, packs consecutive units into buffers of at most ``buffer_rows`` rows, reads a
buffer's units straight from their chunk files (store/reader.py: one ``read()`` per run of
consecutive rows), permutes the buffer and cuts the concatenated stream into batches. So every
selected row comes once per epoch, the order depends on ``(seed, epoch)`` only, and at most one
buffer (plus the batch being handed out) is held. Resuming at batch ``b`` skips whole buffers
without reading them: the batch cuts follow from the units' sizes alone.

numpy only: a streamed worker never imports torch for it; :meth:`ActivationSource.torch` wraps it
as a ``torch.utils.data.IterableDataset`` when torch is wanted.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from probes.errors import ProbeError
from store import Workspace
from store.dtypes import decode_stored, numpy_dtype
from store.reader import group_by_chunk, read_chunk_rows
from store.records import ArrayInfo

RowKind = Literal["tokens", "pooled"]


@dataclass(frozen=True)
class ArrayRef:
    """One stored array of a run: (tap, layer, site, tokens)."""

    tap: str
    layer: int
    site: str = "resid_post"
    tokens: str = "image"

    @classmethod
    def parse(cls, value: Any) -> ArrayRef:
        """From an ArrayRef, a dict, or ``"tap:layer[:site[:tokens]]"``."""
        if isinstance(value, ArrayRef):
            return value
        if isinstance(value, dict):
            return cls(**value)
        if isinstance(value, str):
            parts = value.split(":")
            if 2 <= len(parts) <= 4:
                try:
                    return cls(parts[0], int(parts[1]), *parts[2:])
                except ValueError:
                    pass
        raise ProbeError(f"an array is 'tap:layer[:site[:tokens]]' (e.g. 'vision:3:resid_post:image'), got {value!r}")


@dataclass
class _Unit:
    chunk: int
    local: np.ndarray          # rows inside the chunk, ascending
    first: int                 # position of its first sample in the selection

    def n_rows(self, per_sample: int) -> int:
        return len(self.local) * per_sample


@dataclass
class SourceStats:
    """What the source read: rows and bytes handed out, the largest buffer it held."""

    rows: int = 0
    bytes_read: int = 0
    peak_buffer_rows: int = 0
    buffers: int = 0


@dataclass
class ActivationSource:
    """Shuffled batches of activation rows from a workspace, out of core.

    ``arrays`` are read side by side (same samples, same row order); each batch is a tuple with
    one ``[batch, d_i]`` float32 array per array (``with_ids`` adds ``[batch, 2]`` int64: array row
    and token, -1 for pooled rows). ``only_rows`` keeps only those array rows of the selection (a
    split's side). ``dtype='stored'`` hands float16 arrays out as float16 (half the bytes; torch
    casts them faster than numpy: the training loop does). Iterating yields epoch ``epoch`` (default 0); ``epochs(n)``
    yields n epochs in turn, ``batches(epoch, start)`` resumes at batch ``start``.
    """

    ws: Workspace
    run: str
    arrays: Sequence[Any]
    where: str | None = None
    train_where: str | None = None
    rows: RowKind = "tokens"
    batch_size: int = 4096
    buffer_rows: int = 65536
    seed: int = 0
    drop_last: bool = False
    with_ids: bool = False
    only_rows: np.ndarray | None = None
    dtype: Literal["float32", "stored"] = "float32"
    stats: SourceStats = field(default_factory=SourceStats)

    def __post_init__(self) -> None:
        if self.rows not in ("tokens", "pooled"):
            raise ProbeError(f"rows must be 'tokens' or 'pooled', got {self.rows!r}")
        if self.batch_size < 1 or self.buffer_rows < 1:
            raise ProbeError(f"batch_size and buffer_rows must be >= 1, got {self.batch_size}, {self.buffer_rows}")
        self.refs = [ArrayRef.parse(a) for a in self.arrays]
        if not self.refs:
            raise ProbeError("an activation source needs at least one array")
        self.infos = [self.ws.array_info(self.run, r.tap, r.layer, r.site, r.tokens) for r in self.refs]
        self._check_infos()
        where = self.where
        if self.train_where:
            where = f"({where}) AND ({self.train_where})" if where else self.train_where
        self.sample_rows = self.ws.select(self.run, where).rows
        if self.only_rows is not None:  # e.g. a split's side, chosen by the caller from stimulus keys
            self.sample_rows = np.intersect1d(self.sample_rows, np.asarray(self.only_rows, dtype=np.int64))
        if len(self.sample_rows) == 0:
            raise ProbeError(f"no samples of run {self.run!r} match where={where!r}; loosen the filter")
        self._check_committed()
        info = self.infos[0]
        self.tokens_per_sample = info.item_shape[0] if len(info.item_shape) == 2 else 1
        self.per_sample = self.tokens_per_sample if self.rows == "tokens" else 1
        self.dims = tuple(int(i.item_shape[-1]) for i in self.infos)
        self._units = self._cut_units()
        self._bufs: dict[int, np.ndarray] = {}

    # ------------------------------------------------------------------ checks

    def _check_infos(self) -> None:
        for ref, info in zip(self.refs, self.infos, strict=True):
            if info.layout != "dense" or len(info.item_shape) not in (1, 2):
                raise ProbeError(
                    f"array {info.key()} is {info.layout} with per-sample shape {info.item_shape}: the activation"
                    " source reads dense [T, d] or [d] arrays; pick a dense token array (image, last, ...)"
                )
            if ref.tokens != self.refs[0].tokens and info.item_shape[:-1] != self.infos[0].item_shape[:-1]:
                raise ProbeError(f"arrays read side by side need the same tokens per sample: {info.key()} has"
                                 f" {info.item_shape}, {self.infos[0].key()} has {self.infos[0].item_shape}")
        first = self.infos[0]
        for info in self.infos[1:]:
            if info.item_shape[:-1] != first.item_shape[:-1] or info.n_samples != first.n_samples:
                raise ProbeError(f"arrays read side by side need the same samples and tokens: {info.key()} is"
                                 f" {info.shape}, {first.key()} is {first.shape}")

    def _check_committed(self) -> None:
        for info in self.infos:
            done = {r[0] for r in self.ws.rows("SELECT chunk FROM chunks WHERE run = ? AND zarr_path = ?",
                                               [self.run, info.zarr_path])}
            need = set(np.unique(self.sample_rows // info.chunk_samples).tolist())
            if need - done:
                raise ProbeError(f"{len(need - done)} chunk(s) of {info.key()} holding selected rows are not committed"
                                 " (the run is still being written or was interrupted): finish the run or narrow where")

    # ------------------------------------------------------------------ the epoch's plan

    def _cut_units(self) -> list[_Unit]:
        # Chunk boundaries follow the first array; others with another chunking are read by rows.
        per_unit = max(1, self.buffer_rows // self.per_sample)
        units = []
        for k, local, a, _b in group_by_chunk(self.sample_rows, self.infos[0].chunk_samples):
            for s in range(0, len(local), per_unit):
                units.append(_Unit(k, local[s:s + per_unit], a + s))
        return units

    @property
    def n_rows(self) -> int:
        """Rows one epoch yields."""
        return len(self.sample_rows) * self.per_sample

    def n_batches(self) -> int:
        """Batches one epoch yields."""
        full, rest = divmod(self.n_rows, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def _plan(self, epoch: int) -> tuple[list[list[_Unit]], list[np.ndarray]]:
        """Buffers (lists of units) in visiting order, and each buffer's row permutation."""
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(len(self._units))
        buffers: list[list[_Unit]] = []
        size = 0
        for i in order:
            u = self._units[i]
            n = u.n_rows(self.per_sample)
            if not buffers or size + n > self.buffer_rows:
                buffers.append([])
                size = 0
            buffers[-1].append(u)
            size += n
        perms = [rng.permutation(sum(u.n_rows(self.per_sample) for u in b)) for b in buffers]
        return buffers, perms

    # ------------------------------------------------------------------ reading

    def _read_unit(self, info: ArrayInfo, u: _Unit, out: np.ndarray | None) -> np.ndarray:
        """A unit's rows of one array as stored (into ``out`` where given: token rows reuse one buffer,
        so no epoch pays the page faults of a fresh one), or pooled over tokens in float32."""
        rows = u.local + u.chunk * self.infos[0].chunk_samples
        shaped = None if out is None else out.reshape(len(u.local), *info.item_shape)
        if info.chunk_samples == self.infos[0].chunk_samples:
            x = read_chunk_rows(self.ws.root, info, u.chunk, u.local, None, raw=True, out=shaped)
        else:
            x = np.concatenate([read_chunk_rows(self.ws.root, info, k, loc, None, raw=True)
                                for k, loc, _a, _b in group_by_chunk(rows, info.chunk_samples)])
            if shaped is not None:
                shaped[...] = x
        self.stats.bytes_read += x.nbytes
        if x.ndim == 3 and self.rows == "pooled":
            return decode_stored(x, info.stored_dtype).astype(np.float32).mean(axis=1, dtype=np.float32)
        return x.reshape(-1, x.shape[-1])

    def _ids(self, u: _Unit) -> np.ndarray:
        rows = u.local + u.chunk * self.infos[0].chunk_samples
        if self.per_sample == 1:
            return np.stack([rows, np.full(len(rows), -1 if self.tokens_per_sample > 1 else 0)], axis=1)
        t = np.arange(self.per_sample)
        return np.stack([np.repeat(rows, self.per_sample), np.tile(t, len(rows))], axis=1).astype(np.int64)

    def _buffer(self, j: int, n: int) -> np.ndarray:
        info = self.infos[j]
        want = max(min(self.buffer_rows, self.n_rows), self.per_sample)  # no buffer of any epoch is larger
        if j not in self._bufs:
            self._bufs[j] = np.empty((want, info.item_shape[-1]), np.dtype(numpy_dtype(info.stored_dtype)))
        return self._bufs[j][:n]

    def _read_buffer(self, units: list[_Unit], n: int) -> list[np.ndarray]:
        """The buffer's rows in unit order (not yet permuted), one array per array (ids last)."""
        out = []
        for j, info in enumerate(self.infos):
            if self.rows == "tokens":
                buf, at = self._buffer(j, n), 0
                for u in units:
                    m = u.n_rows(self.per_sample)
                    self._read_unit(info, u, buf[at:at + m])
                    at += m
                out.append(buf)
            else:
                out.append(np.concatenate([self._read_unit(info, u, None) for u in units]))
        if self.with_ids:
            out.append(np.concatenate([self._ids(u) for u in units]))
        self.stats.buffers += 1
        self.stats.peak_buffer_rows = max(self.stats.peak_buffer_rows, n)
        return out

    def _finish(self, cols: list[np.ndarray]) -> tuple[np.ndarray, ...]:
        """A batch as handed out: float32 (or float16 as stored, ``dtype='stored'``); ids as they are."""
        out = []
        for j, c in enumerate(cols):
            if j < len(self.infos):
                c = decode_stored(c, self.infos[j].stored_dtype)
                if self.dtype == "float32" and c.dtype != np.float32:
                    c = c.astype(np.float32)
            out.append(c)
        self.stats.rows += len(out[0])
        return tuple(out)

    def batches(self, epoch: int = 0, start: int = 0) -> Iterator[tuple[np.ndarray, ...]]:
        """Epoch ``epoch``'s batches from batch ``start`` on (resuming reads no skipped buffer).

        Parameters
        ----------
        epoch : int
            Which epoch: its order follows ``(seed, epoch)``.
        start : int
            The first batch to yield; the batches before it are not read.

        Yields
        ------
        tuple of numpy.ndarray
            One ``[batch, d_i]`` per array (float32, or as stored with ``dtype='stored'``; plus ids
            where asked). Each batch is its own copy: holding it never pins a buffer.
        """
        buffers, perms = self._plan(epoch)
        skip, bs = start * self.batch_size, self.batch_size
        carry: list[np.ndarray] | None = None
        for units, perm in zip(buffers, perms, strict=True):
            if skip >= len(perm):
                skip -= len(perm)
                continue
            raw = self._read_buffer(units, len(perm))
            order, skip = perm[skip:], 0
            s = 0
            if carry is not None:  # a batch that spans two buffers
                s = min(bs - len(carry[0]), len(order))
                carry = [np.concatenate([c, np.take(r, order[:s], axis=0)]) for c, r in zip(carry, raw, strict=True)]
                if len(carry[0]) < bs:
                    continue
                yield self._finish(carry)
                carry = None
            while s + bs <= len(order):
                yield self._finish([np.take(r, order[s:s + bs], axis=0) for r in raw])
                s += bs
            if s < len(order):
                carry = [np.take(r, order[s:], axis=0) for r in raw]
        if carry is not None and not self.drop_last:
            yield self._finish(carry)

    def __iter__(self) -> Iterator[tuple[np.ndarray, ...]]:
        return self.batches(0)

    def epochs(self, n: int, first: int = 0) -> Iterator[tuple[np.ndarray, ...]]:
        """Epochs ``first .. first+n-1`` in turn."""
        for e in range(first, first + n):
            yield from self.batches(e)

    def torch(self, epochs: int = 1) -> Any:
        """This source as a ``torch.utils.data.IterableDataset`` of float32 tensors (one per array).

        With a ``DataLoader(num_workers=k, batch_size=None)``, worker i reads every k-th buffer,
        so the k workers together still yield each row once an epoch.
        """
        from probes.sae.torch_source import TorchSource

        return TorchSource(self, epochs)

    def buffer_plan(self, epoch: int) -> list[int]:
        """Rows of each buffer of epoch ``epoch`` in visiting order (for sharding and tests)."""
        return [len(p) for p in self._plan(epoch)[1]]

    def read_buffers(self, epoch: int, which: Sequence[int]) -> Iterator[list[np.ndarray]]:
        """The permuted buffers ``which`` of epoch ``epoch`` (each a list of arrays, ids last)."""
        buffers, perms = self._plan(epoch)
        for i in which:
            raw = self._read_buffer(buffers[i], len(perms[i]))
            yield list(self._finish([np.take(r, perms[i], axis=0) for r in raw]))

