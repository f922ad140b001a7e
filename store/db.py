"""Short DuckDB connections to the manifest, with retry on the file lock.

DuckDB lets one process hold a database file read-write *or* many hold it read-only, never both
(docs/design.md#duckdb-one-writer-or-many-readers). So no agnosia process keeps the manifest open:
every read and every write is connect -> statements -> close, and a caller that finds the file held
by another process retries with backoff for up to ``timeout`` seconds. A long extraction therefore
holds the file for a few tens of milliseconds per commit, and queries, ``verify`` and the probe
farm get in between.

DuckDB's lock is a try-lock with no queue, so a busy reader loop could starve a writer. A writer
that meets a conflict touches ``manifest.duckdb.writer-waiting``; readers step aside (up to a
second) while it exists, and ignore it once it is older than a few seconds (a dead writer's).

Within one process, a lock per file serialises our own connections, since DuckDB also refuses
a read-only and a read-write connection to one file in one process.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import duckdb

from store.errors import DiskFullError, ManifestBusyError, WorkspaceError, disk_full_error, is_disk_full

DEFAULT_TIMEOUT = 30.0
# A read-only DuckDB connection still writes files through COPY ... TO, EXPORT DATABASE or
# ATTACH (even over the store's own chunk files), and reads any file through read_csv & co.
# Readers get neither: no file system access beyond the manifest itself, and the setting locked
# so that SQL cannot turn it back on (docs/reliability.md, "Security").
READ_ONLY_CONFIG: dict[str, str | bool | int | float | list[str]] = {"enable_external_access": False, "lock_configuration": True}
_MARKER_STALE_S = 5.0
_READER_YIELD_S = 1.0

_locks: dict[str, threading.RLock] = {}
_locks_guard = threading.Lock()


def _process_lock(path: Path) -> threading.RLock:
    key = str(path.resolve())
    with _locks_guard:
        return _locks.setdefault(key, threading.RLock())


def is_lock_conflict(err: BaseException) -> bool:
    text = str(err)
    return isinstance(err, duckdb.IOException) and ("Could not set lock" in text or "Conflicting lock" in text)


def waiting_marker(path: Path) -> Path:
    return path.with_name(path.name + ".writer-waiting")


@contextmanager
def connect(path: Path, *, read_only: bool, timeout: float = DEFAULT_TIMEOUT) -> Iterator[duckdb.DuckDBPyConnection]:
    """A connection that is closed (and the file released) when the block ends."""
    lock = _process_lock(path)
    deadline = time.monotonic() + timeout
    if not lock.acquire(timeout=max(timeout, 0.001)):
        raise ManifestBusyError(f"another thread of this process held {path} for more than {timeout:.0f} s")
    try:
        if read_only:
            _yield_to_writer(path, min(deadline, time.monotonic() + _READER_YIELD_S))
        con = _open(path, read_only, deadline, timeout)
        try:
            yield con
        except duckdb.Error as err:
            if is_disk_full(err):  # e.g. the WAL append of a COMMIT on a full disk
                raise disk_full_error(path, err) from err
            raise
        finally:
            con.close()
    finally:
        lock.release()


def _yield_to_writer(path: Path, until: float) -> None:
    marker = waiting_marker(path)
    while time.monotonic() < until:
        try:
            age = time.time() - marker.stat().st_mtime
        except FileNotFoundError:
            return
        if age > _MARKER_STALE_S:
            return
        time.sleep(0.01)


def _open(path: Path, read_only: bool, deadline: float, timeout: float) -> duckdb.DuckDBPyConnection:
    delay = 0.005
    marker: Path | None = None
    try:
        while True:
            try:
                return duckdb.connect(str(path), read_only=read_only, config=READ_ONLY_CONFIG if read_only else {})
            except duckdb.Error as err:
                if not is_lock_conflict(err):
                    raise manifest_error(path, err) from err
                if not read_only:
                    marker = waiting_marker(path)
                    marker.touch()
                if time.monotonic() + delay > deadline:
                    raise ManifestBusyError(
                        f"the manifest {path} stayed locked by another process for {timeout:.1f} s: {err}."
                        " A process is holding it open (a DuckDB CLI or notebook connection?): close it, and open"
                        " the file read-only for short queries (`python -m store query`, Workspace.query)"
                    ) from err
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 0.1)
    finally:
        if marker is not None:
            marker.unlink(missing_ok=True)


def rollback(con: duckdb.DuckDBPyConnection) -> None:
    """ROLLBACK after a failed statement, without masking its error: when DuckDB could not write
    the COMMIT (a full disk), the transaction is already gone and ROLLBACK itself raises
    "no transaction is active", which would replace the real cause."""
    try:
        con.execute("ROLLBACK")
    except duckdb.Error:
        pass


def manifest_error(path: Path, err: BaseException) -> WorkspaceError | DiskFullError:
    if is_disk_full(err):  # not a corrupt manifest: DuckDB could not write (creating it, replaying its WAL)
        return disk_full_error(path, err)
    if isinstance(err, duckdb.ConnectionException) and "different configuration" in str(err):
        return WorkspaceError(
            f"this process already holds {path} open with another mode ({err}); close that connection"
            " (agnosia opens the manifest only briefly, so it is a connection opened outside agnosia)"
        )
    return WorkspaceError(
        f"the manifest {path} is not a readable DuckDB database ({type(err).__name__}: {err}). It may be"
        " truncated or corrupted: restore it from a backup, or move it away and re-run the extraction"
        " (the Zarr arrays beside it are not enough to rebuild it)"
    )
