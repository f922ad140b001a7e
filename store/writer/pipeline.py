"""The writer thread: assemble queued batches into chunks, write them, and commit them.

Samples are assembled into chunk-aligned blocks (one block = ``chunk_samples`` rows of one
array); a block is written only when complete. An uncompressed dense chunk is streamed instead:
each batch goes straight to its byte range of a temporary file (:class:`store.chunks.Stream`).
Checksums and renames run on I/O lanes beside the thread (a small stream's checksums on the thread
itself); the committer makes the chunks durable and records them (:mod:`store.writer.committer`).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from store import arrays as layout
from store.chunks import (
    Assembly,
    ChunkRecord,
    Stream,
    WrittenChunk,
    bytes_view,
    crc_block,
    pwrite_all,
    seal,
    stream_stats,
)
from store.dtypes import cast
from store.errors import ManifestBusyError, StoreError, WriterError
from store.writer.context import Failure, RunContext
from store.writer.handles import ArrayHandle
from store.writer.state import Handover, PipelineState

_STOP = object()
_LANES = 2
_POLL_S = 0.1  # how often an idle writer thread checks whether to let the manifest go (a stat)
# A batch of a stream at most this big has its checksum computed on the writer thread (~25 us at
# most): handing it to an I/O lane costs more, a thread wake-up and the GIL passed back and forth
# beside the model's thread, and a batch of 1 of a tiny model hands over four a batch.
_INLINE_STATS_BYTES = 256 << 10


@dataclass(frozen=True)
class Cadence:
    """How often the writer thread commits (:meth:`store.workspace.Workspace.writer`'s options)."""

    commit_every: float  # a written chunk waits at most this long while the producer keeps the queue busy
    min_gap: float  # ... and this long once the queue is idle
    records_every: float  # how long token spans and generations alone wait for a commit


class Commits(Protocol):
    """Where the writer thread hands what it wrote: :class:`store.writer.committer.Committer` (the
    manifest) for a writer, :class:`store.writer.outbox.Outbox` (its client) for a worker's chunk writer."""

    @property
    def last_commit(self) -> float: ...

    def add_chunk(self, rec: ChunkRecord) -> None: ...

    def add_tokens(self, rows: list[dict[str, Any]]) -> None: ...

    def add_generations(self, rows: list[dict[str, Any]]) -> None: ...

    def add_written(self, chunks: list[WrittenChunk]) -> None: ...

    def has_pending(self) -> bool: ...

    def has_chunks(self) -> bool: ...

    def commit(self, timeout: float, finish: bool | None = None) -> None: ...

    def idle(self) -> None: ...


class Pipeline:
    """The writer thread: takes the queued batches, fills and writes chunks, hands them to the committer."""

    def __init__(self, ctx: RunContext, handover: Handover, failure: Failure, committer: Commits,
                 cadence: Cadence) -> None:
        self._ctx = ctx
        self._handover = handover
        self._failure = failure
        self._committer = committer
        self._cadence = cadence
        self._state = PipelineState()
        # Checksums, NaN/inf counts and renames run beside the writer thread on single-thread
        # lanes: a chunk always goes to the same lane (chunk % lanes), so its running CRC sees
        # its batches in order, and neighbouring chunks are checksummed in parallel.
        self._lanes = [ThreadPoolExecutor(1, thread_name_prefix=f"agnosia-io{i}-{ctx.run}") for i in range(_LANES)]
        self._thread = threading.Thread(target=self._loop, name=f"agnosia-writer-{ctx.run}", daemon=True)

    # ------------------------------------------------------------------ what the writer asks

    def start(self) -> None:
        self._thread.start()

    def flush(self, finishing: dict[str, Any] | None = None) -> None:
        """Block until everything queued so far is handled and committed; ``finishing``
        (``{"partial_ok": ...}``) commits even with nothing pending, and may close the run."""
        done = threading.Event()
        self._handover.queue.put(("flush", done, finishing))
        while not done.wait(0.5):
            if not self._thread.is_alive():
                stopped = f"the background writer of run {self._ctx.run} stopped unexpectedly"
                raise WriterError(stopped) from self._failure.error

    def stop(self) -> None:
        """Drop the chunks not yet whole, commit what is durable, and end the thread and its lanes."""
        self._handover.queue.put(_STOP)
        self._thread.join()
        for lane in self._lanes:
            lane.shutdown(wait=True)

    # ------------------------------------------------------------------ the thread

    def _loop(self) -> None:
        st, committer, cadence = self._state, self._committer, self._cadence
        while True:
            due = self._commit_due()
            # Never block for long: the run's held manifest connection (opened by a commit or by
            # the producer's registration) is looked in on, since another process may want the file.
            timeout = _POLL_S if due is None else min(_POLL_S, max(0.0, due - time.monotonic()))
            try:
                item = self._handover.queue.get(timeout=timeout)
            except queue.Empty:
                if due is not None and time.monotonic() >= due:
                    self._try_commit(blocking=False)
                self._committer.idle()
                continue
            if item is _STOP:
                self._finalize()
                return
            kind = item[0]
            if kind == "flush":
                try:
                    finishing = item[2]
                    if finishing is not None and self._failure.error is None:
                        committer.commit(self._ctx.manifest_timeout, finish=finishing["partial_ok"])
                    elif committer.has_pending():
                        self._try_commit(blocking=True)
                except BaseException as err:  # noqa: BLE001 - surfaced to the producer
                    self._failure.record(err)
                item[1].set()
                continue
            nbytes = item[-1]
            try:
                if self._failure.error is None:
                    self._handle(item)
            except BaseException as err:  # noqa: BLE001 - surfaced to the producer
                part = st.handling
                where = self._ctx.ws.zarr_path / part[1].info.zarr_path if part[0] in ("data", "ragged") else None
                self._failure.record(err, where=where)
            finally:
                # The batch's memory counts against the budget until its checksums are done.
                self._release_after(st.item_jobs, nbytes)
                st.item_jobs = []
            if committer.has_pending() and time.monotonic() >= st.retry_at:
                elapsed = time.monotonic() - committer.last_commit
                if committer.has_chunks():
                    due = elapsed >= cadence.commit_every or (self._handover.queue.empty() and elapsed >= cadence.min_gap)
                else:  # records alone: each commit is CPU beside the model's, for progress only
                    due = elapsed >= cadence.records_every
                if due:
                    self._try_commit(blocking=False)

    def _commit_due(self) -> float | None:
        """When the pending records are to be committed (None: nothing pending)."""
        committer = self._committer
        if not committer.has_pending():
            return None
        wait = self._cadence.min_gap if committer.has_chunks() else self._cadence.records_every
        return max(committer.last_commit + wait, self._state.retry_at)

    def _lane(self, chunk: int) -> ThreadPoolExecutor:
        return self._lanes[chunk % len(self._lanes)]

    def _release_after(self, jobs: list[Future[Any]], nbytes: int) -> None:
        if not jobs:
            self._handover.budget.give(nbytes)
            return
        left = [len(jobs)]
        guard = threading.Lock()

        def done(_: Future[Any]) -> None:
            with guard:
                left[0] -= 1
                last = left[0] == 0
            if last:
                self._handover.budget.give(nbytes)

        for job in jobs:
            job.add_done_callback(done)

    def _finalize(self) -> None:
        state = self._state
        dropped = len(state.assembling) + len(state.streams)
        self._ctx.stats.partial_chunks_dropped += dropped
        state.assembling.clear()
        for st in state.streams.values():
            os.close(st.fd)
            st.tmp.unlink(missing_ok=True)
        state.streams.clear()
        try:
            if self._committer.has_pending():
                self._try_commit(blocking=True)
        except BaseException as err:  # noqa: BLE001
            self._failure.record(err)

    def _handle(self, item: tuple[Any, ...]) -> None:
        kind = item[0]
        self._state.handling = item  # what a failure names
        if kind == "batch":  # one model batch: its records, then its arrays
            for part in item[1]:
                self._handle(part)
        elif kind == "tokens":
            self._committer.add_tokens(item[1])
        elif kind == "generations":
            self._committer.add_generations(item[1])
        elif kind == "written":
            self._committer.add_written(item[1])
        elif kind in ("data", "ragged"):
            _, handle, start, values, src_kind, _ = item
            self._assemble(handle, start, values, src_kind, ragged=kind == "ragged")
        else:  # pragma: no cover - internal
            raise AssertionError(kind)

    def _assemble(self, h: ArrayHandle, start: int, values: Any, kind: str, *, ragged: bool) -> None:
        info = h.info
        count = len(values)
        cs = info.chunk_samples
        pos = 0
        while pos < count:
            row = start + pos
            k = row // cs
            rows = info.chunk_rows(k)
            take = min(count - pos, rows.stop - row)
            if k in h.committed:
                pos += take
                continue
            key = (id(h), k)
            if not ragged and h.codec.name == "none":
                self._stream(h, k, rows, row - rows.start, values[pos : pos + take], kind)
                pos += take
                continue
            a = self._state.assembling.get(key)
            if a is None and not ragged and row == rows.start and take == len(rows):
                # A batch that is exactly one block needs no copy.
                self._write_chunk(h, k, rows, values[pos : pos + take], kind)
                pos += take
                continue
            if a is None:
                if ragged:
                    a = Assembly(rows, kind, None, [None] * len(rows), np.zeros(len(rows), bool))
                else:
                    buf = np.empty((len(rows), *info.item_shape), dtype=values.dtype)
                    a = Assembly(rows, kind, buf, None, np.zeros(len(rows), bool))
                self._state.assembling[key] = a
            if a.kind != kind:
                raise StoreError(f"{info.key()}: rows of one chunk arrived as {a.kind} and {kind}; hand over one dtype")
            lo = row - rows.start
            if ragged:
                assert a.ragged is not None
                for j in range(take):
                    a.ragged[lo + j] = values[pos + j]
            else:
                assert a.dense is not None
                a.dense[lo : lo + take] = values[pos : pos + take]
            a.filled[lo : lo + take] = True
            pos += take
            if a.complete():
                del self._state.assembling[key]
                block = a.dense if not ragged else a.ragged
                self._write_chunk(h, k, rows, block, kind)

    def _stream(self, h: ArrayHandle, k: int, rows: range, lo: int, block: np.ndarray, kind: str) -> None:
        info = h.info
        key = (id(h), k)
        st = self._state.streams.get(key)
        if st is None:
            final = layout.dense_chunk_file(self._ctx.ws.path, info.zarr_path, len(info.shape), k)
            tmp = final.with_name(f"{final.name}.{os.getpid()}.partial")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            st = Stream(rows, kind, tmp, final, fd, np.zeros(len(rows), bool))
            self._state.streams[key] = st
        if st.kind != kind:
            raise StoreError(f"{info.key()}: rows of one chunk arrived as {st.kind} and {kind}; hand over one dtype")
        where = f"{info.key()} chunk {k} (rows {rows.start + lo}-{rows.start + lo + len(block) - 1})"
        same = kind == info.stored_dtype
        if same:
            # No cast, so nothing can overflow: NaN/inf are counted off the writer thread.
            vals = np.ascontiguousarray(block)
        else:
            c = cast(block, kind, info.stored_dtype, self._ctx.info.overflow, where, info.zarr_path)
            vals = np.ascontiguousarray(c.values)
            st.n_nonfinite += c.n_nonfinite
            st.n_clipped += c.n_clipped
        view = bytes_view(vals)
        row_bytes = len(view) // len(block)
        try:
            pwrite_all(st.fd, view, lo * row_bytes)
        except OSError as err:  # name the chunk file: a full disk is reported with its path
            raise OSError(err.errno, err.strerror, str(st.final)) from err
        in_order = st.in_order and lo == st.crc_rows
        if not in_order:
            st.in_order = False
        else:
            st.crc_rows += len(block)
        if in_order or same:
            if st.inline is None:
                st.inline = len(view) <= _INLINE_STATS_BYTES
            if st.inline:
                stream_stats(st, vals if same else None, vals if in_order else None)
            else:
                # The single pool thread runs jobs in order, so the running crc sees rows in order.
                self._state.item_jobs.append(
                    self._lane(k).submit(stream_stats, st, vals if same else None, vals if in_order else None)
                )
        st.filled[lo : lo + len(block)] = True
        if not st.filled.all():
            return
        del self._state.streams[key]
        full = info.chunk_samples * row_bytes
        if len(rows) < info.chunk_samples:
            os.ftruncate(st.fd, full)  # Zarr stores edge chunks full-size; the tail reads as zeros
        written = self._lane(k).submit(seal, st, len(rows) * row_bytes)
        self._committer.add_chunk(
            ChunkRecord(
                h, k, rows.start, rows.stop, len(rows), full, written, [st.final], [st.final.parent]
            )
        )
        self._ctx.stats.chunks_written += 1
        self._ctx.stats.bytes_written += full

    def _write_chunk(self, h: ArrayHandle, k: int, rows: range, block: Any, kind: str) -> None:
        info = h.info
        where = f"{info.key()} chunk {k} (rows {rows.start}-{rows.stop - 1})"
        if info.layout == "dense":
            c = cast(block, kind, info.stored_dtype, self._ctx.info.overflow, where, info.zarr_path)
            vals = np.ascontiguousarray(h.codec.prepare(c.values, info.stored_dtype))
            h.node[rows.start : rows.stop] = vals
            files = [layout.dense_chunk_file(self._ctx.ws.path, info.zarr_path, len(info.shape), k)]
            new_dirs: list[Path] = []
            n_rows = len(rows)
            nbytes = files[0].stat().st_size
        else:
            lengths = np.array([len(b) for b in block], dtype=np.int64)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            flat = (
                np.concatenate(block, axis=0)
                if int(offsets[-1])
                else np.empty((0, *info.item_shape), dtype=block[0].dtype)
            )
            c = cast(flat, kind, info.stored_dtype, self._ctx.info.overflow, where, info.zarr_path)
            vals = np.ascontiguousarray(h.codec.prepare(c.values, info.stored_dtype))
            files = layout.write_ragged_block(h.node, k, vals, offsets, h.codec, info.dims[1:])
            # The block's folder is new: its entry in the array's folder must be durable too.
            new_dirs = [self._ctx.ws.zarr_path / info.zarr_path]
            n_rows = int(offsets[-1])
            nbytes = sum(f.stat().st_size for f in files if f.name != "zarr.json")
        ragged_offsets = None if info.layout == "dense" else offsets
        written = self._lane(k).submit(crc_block, vals, c.n_nonfinite, c.n_clipped, ragged_offsets)
        self._state.item_jobs.append(written)
        self._committer.add_chunk(
            ChunkRecord(
                h, k, rows.start, rows.stop, n_rows, nbytes, written,
                files, [*dict.fromkeys(f.parent for f in files), *new_dirs],
            )
        )
        self._ctx.stats.chunks_written += 1
        self._ctx.stats.bytes_written += nbytes

    def _try_commit(self, *, blocking: bool) -> None:
        """Commit what is pending. Not blocking: a busy manifest is retried in 0.5 s, any other
        failure is recorded for the producer (and retried too: durable chunks stay committable)."""
        try:
            # Not blocking: give readers a second to let go; data keeps queueing meanwhile.
            self._committer.commit(self._ctx.manifest_timeout if blocking else 1.0)
            self._state.retry_at = 0.0
        except ManifestBusyError:
            self._state.retry_at = time.monotonic() + 0.5
            if blocking:
                raise
        except BaseException as err:  # noqa: BLE001 - surfaced to the producer
            self._state.retry_at = time.monotonic() + 0.5
            self._failure.record(err)
            if blocking:
                raise
