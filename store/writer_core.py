"""What every part of the writer shares: the array handle, the statistics, and the run's state.

:class:`store.writer.Writer` is assembled from parts with one job each (registration in the
manifest, run tensors, the producer side, the writer thread); each part is a subclass of
:class:`WriterCore`, which declares the state they share and the few helpers all of them call.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb

from store import arrays as layout
from store import db, location
from store.errors import DiskFullError, StoreError, WriterError, disk_full_error, is_disk_full
from store.records import ArrayInfo, RunInfo, Shard, chunk_size

if TYPE_CHECKING:
    from store.chunks import Assembly, Budget, ChunkRecord, Stream
    from store.workspace import Workspace


@dataclass(eq=False)
class ArrayHandle:
    """A declared array of the writer's run; pass it to :meth:`Writer.write`."""

    info: ArrayInfo
    codec: layout.Codec
    node: Any  # zarr.Array (dense) or zarr.Group (ragged)
    committed: set[int] = field(default_factory=set)
    writer_id: int = 0

    @property
    def ragged(self) -> bool:
        return self.info.layout == "ragged"


@dataclass
class WriterStats:
    chunks_written: int = 0
    chunks_skipped: int = 0
    bytes_written: int = 0
    commits: int = 0
    commit_s: float = 0.0
    producer_wait_s: float = 0.0
    partial_chunks_dropped: int = 0
    upload_s: float = 0.0                  # time spent uploading to a remote array root



class WriterCore:
    """The state of one writer (set by :class:`store.writer.Writer`) and the helpers its parts share."""

    ws: Workspace
    info: RunInfo
    run: str
    shard: Shard | None
    stats: WriterStats
    _manifest_timeout: float
    _manifest: db.HeldConnection  # the run's one read-write connection (store/db.py)
    _commit_every: float
    _min_gap: float
    _records_every: float  # how long token spans and generations alone wait for a commit
    _handles: dict[str, ArrayHandle]
    _chunk_sizes: set[int] | None  # the chunk sizes of the run's arrays in the manifest, once asked
    _stimuli: list[str] | None
    _marked: bool
    _root: Any  # the local zarr.Group of the arrays
    _queue: queue.Queue[Any]
    _budget: Budget
    _abort: threading.Event
    _error: BaseException | None
    _closed: bool
    _finished: bool
    _assembling: dict[tuple[int, int], Assembly]
    _streams: dict[tuple[int, int], Stream]
    _pending_chunks: list[ChunkRecord]
    _pending_tokens: list[dict[str, Any]]
    _pending_generations: list[dict[str, Any]]
    # The stimuli whose generations this writer committed, when its run was new (so no other row
    # can exist); None for a run that was there already (a resume: any row may exist).
    _generated: set[str] | None
    _commit_failed: bool  # a commit of this writer failed: its COMMIT may have landed, so its rows may exist
    _last_commit: float
    _retry_at: float
    _lanes: list[ThreadPoolExecutor]
    _item_jobs: list[Future[Any]]
    _handling: tuple[Any, ...]
    _syncers: ThreadPoolExecutor
    _thread: threading.Thread

    def owns(self, chunk: int) -> bool:
        """Whether this writer fills ``chunk`` (always, unless it is a shard)."""
        return self.shard is None or self.shard.owns(chunk)

    @property
    def n_samples(self) -> int:
        if self._stimuli is None:
            raise StoreError(f"run {self.run} has no samples yet: call set_samples(stimulus keys) first")
        return len(self._stimuli)

    def _chunk_for(self, requested: int) -> int:
        """Samples per chunk of an array of this run asked to hold at most ``requested`` per chunk.

        An array the manifest already holds keeps its size, so the run's new arrays take a size
        its arrays have when that size is one ``requested`` gives: the evened-out one
        (:func:`store.records.chunk_size`, at this writer's batch size or at none) or, for a run
        stored before chunks were evened out, ``min(requested, n)``. All arrays of a sharded run then
        agree, and so do the chunks a shard owns.
        """
        n = self.n_samples
        if self._chunk_sizes is None:
            with self._write_connection() as con:
                rows = con.execute("SELECT DISTINCT chunk_samples FROM activations WHERE run = ?", [self.run])
                self._chunk_sizes = {int(r[0]) for r in rows.fetchall()}
        evened = chunk_size(n, requested, self.info.batch_size)
        for size in (evened, chunk_size(n, requested), min(requested, n)):
            if size in self._chunk_sizes:
                return size
        return evened

    def _write_connection(self, timeout: float | None = None) -> AbstractContextManager[duckdb.DuckDBPyConnection]:
        """The manifest, read-write, for one short transaction (on the run's held connection)."""
        return self._manifest.use(self._manifest_timeout if timeout is None else timeout)

    def _missing(self, extra: list[ChunkRecord] | None = None) -> dict[str, int]:
        done: dict[int, set[int]] = {id(h): set(h.committed) for h in self._handles.values()}
        for rec in extra or []:
            done[id(rec.handle)].add(rec.chunk)
        out = {}
        for h in self._handles.values():
            mine = sum(1 for k in range(h.info.n_chunks) if self.owns(k) and k not in done[id(h)])
            if mine:
                out[h.info.key()] = mine
        return out

    def _mark_running(self, con: Any = None) -> None:
        """Mark an existing run ``running`` (this writer's host and pid) before its first change,
        through ``con`` when the caller holds the write connection already."""
        if self._marked:
            return
        if con is None:
            with self._write_connection() as own:
                self._mark_running(own)
            return
        con.execute(
            "UPDATE runs SET status = 'running', host = ?, pid = ?, updated_at = ?, finished_at = NULL WHERE run = ?",
            [socket.gethostname(), os.getpid(), now(), self.run],
        )
        self._marked = True

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"the writer of run {self.run} is closed; open a new one with ws.writer(...)")
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            cls = DiskFullError if isinstance(self._error, DiskFullError) else WriterError
            raise cls(f"the background writer of run {self.run} failed: {self._error}") from self._error

    def _upload(self, send: Callable[[], Any]) -> None:
        if not self.ws.root.remote:
            return
        started = time.perf_counter()
        try:
            send()
        except OSError as err:
            raise location.describe_remote_error(str(self.ws.root.url), err) from err
        self.stats.upload_s += time.perf_counter() - started


    def _fail(self, err: BaseException, where: Path | None = None) -> None:
        if self._error is None:
            if is_disk_full(err) and not isinstance(err, DiskFullError):
                full = disk_full_error(getattr(err, "filename", None) or where or self.ws.path, err)
                full.__cause__ = err
                err = full
            self._error = err
        self._abort.set()


@contextmanager
def disk_full_names(where: Path) -> Iterator[None]:
    """Turn a full disk met while writing ``where`` (synchronously) into a DiskFullError naming it."""
    try:
        yield
    except OSError as err:
        if is_disk_full(err):
            raise disk_full_error(getattr(err, "filename", None) or where, err) from err
        raise


def now() -> Any:
    import datetime as _dt

    return _dt.datetime.now()


def unstage(files: list[Path]) -> None:
    """Remove staged chunk data once it is committed remotely (metadata stays, for reopening)."""
    for f in files:
        if f.name != "zarr.json":
            f.unlink(missing_ok=True)

