"""What every part of the writer is given: the run's context, its failure slot, and small helpers.

:class:`RunContext` holds what the parts read and never replace (the workspace, the run, the
shard, the statistics, the run's manifest connection, the fsync pool); :class:`Failure` holds the
first error of the writer, which the writer thread records and the producer raises.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb

from store import db, location
from store.errors import DiskFullError, StoreError, WriterError, disk_full_error, is_disk_full
from store.records import RunInfo, Shard
from store.writer.handles import WriterStats

if TYPE_CHECKING:
    from store.workspace import Workspace


@dataclass(frozen=True)
class RunContext:
    """The run a writer writes, as every part of it sees it."""

    ws: Workspace
    info: RunInfo
    shard: Shard | None
    stats: WriterStats
    # The run's one read-write connection (store/db.py); None for a worker's chunk writer
    # (store/writer/chunk_writer.py), which never touches the manifest.
    manifest: db.HeldConnection | None
    manifest_timeout: float
    syncers: ThreadPoolExecutor  # the fsync pool: concurrent fsyncs share journal commits

    @property
    def run(self) -> str:
        return self.info.run

    def owns(self, chunk: int) -> bool:
        """Whether this writer fills ``chunk`` (always, unless it is a shard)."""
        return self.shard is None or self.shard.owns(chunk)

    def connection(self, timeout: float | None = None) -> AbstractContextManager[duckdb.DuckDBPyConnection]:
        """The manifest, read-write, for one short transaction (on the run's held connection)."""
        if self.manifest is None:
            raise StoreError(f"run {self.run}: a worker's chunk writer has no manifest; its client commits what it wrote")
        return self.manifest.use(self.manifest_timeout if timeout is None else timeout)

    def upload(self, send: Callable[[], Any]) -> None:
        """Run ``send`` (an upload) if the arrays live in an object store, timing it."""
        if not self.ws.root.remote:
            return
        started = time.perf_counter()
        try:
            send()
        except OSError as err:
            raise location.describe_remote_error(str(self.ws.root.url), err) from err
        self.stats.upload_s += time.perf_counter() - started


@dataclass
class Failure:
    """The first error of a writer: recorded by whichever part met it, raised to the producer."""

    run: str
    workspace: Path  # what a full disk is reported against when the error names no file
    error: BaseException | None = None
    # Set with the first error: a producer waiting for room in the queue stops waiting.
    abort: threading.Event = field(default_factory=threading.Event)

    def record(self, err: BaseException, where: Path | None = None) -> None:
        """Keep ``err`` if it is the first (a full disk as a DiskFullError naming ``where``) and abort."""
        if self.error is None:
            if is_disk_full(err) and not isinstance(err, DiskFullError):
                full = disk_full_error(getattr(err, "filename", None) or where or self.workspace, err)
                full.__cause__ = err
                err = full
            self.error = err
        self.abort.set()

    def keep(self, err: BaseException) -> None:
        """Keep ``err``, as it is, if it is the first (a close's own failure: nothing is left to abort)."""
        if self.error is None:
            self.error = err

    def raise_if_failed(self) -> None:
        if self.error is not None:
            cls = DiskFullError if isinstance(self.error, DiskFullError) else WriterError
            raise cls(f"the background writer of run {self.run} failed: {self.error}") from self.error


@contextmanager
def disk_full_names(where: Path) -> Iterator[None]:
    """Turn a full disk met while writing ``where`` (synchronously) into a DiskFullError naming it."""
    try:
        yield
    except OSError as err:
        if is_disk_full(err):
            raise disk_full_error(getattr(err, "filename", None) or where, err) from err
        raise


def now() -> datetime.datetime:
    """The time a manifest row records (local, naive: what the TIMESTAMP columns hold)."""
    return datetime.datetime.now()


def unstage(files: list[Path]) -> None:
    """Remove staged chunk data once it is committed remotely (metadata stays, for reopening)."""
    for f in files:
        if f.name != "zarr.json":
            f.unlink(missing_ok=True)
