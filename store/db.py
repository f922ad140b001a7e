"""DuckDB connections to the manifest, with retry on the file lock.

DuckDB lets one process hold a database file read-write *or* many hold it read-only, never both
(docs/design.md#duckdb-one-writer-or-many-readers). So a read is connect -> statements -> close,
and a caller that finds the file held by another process retries with backoff for up to
``timeout`` seconds.

A writer's run keeps one read-write connection (:class:`HeldConnection`) across its short
transactions, since a connect + close (a checkpoint) per commit cost the writer thread half its
time. It gives the file up whenever another connection needs it: another connection of this
process closes it first; a process that meets the lock touches ``manifest.duckdb.wanted``, and
the holder closes its connection at its next use or idle check (within ~0.1 s when idle); it is
closed after ``idle_s`` without use and at most ``max_hold_s`` after it was opened, so even a plain
DuckDB client that retries gets in. Queries, ``verify`` and the probe farm therefore still get in
between a long extraction's commits.

DuckDB's lock is a try-lock with no queue, so a busy reader loop could starve a writer. A writer
that meets a conflict touches ``manifest.duckdb.writer-waiting``; readers step aside (up to a
second) while it exists, and ignore it once it is older than a few seconds (a dead writer's).

Within one process, a lock per file serialises our own connections, since DuckDB also refuses
a read-only and a read-write connection to one file in one process.

A read-write connection is a cursor of one in-memory DuckDB per process, with the manifest
ATTACHed to it and DETACHed when the connection closes (which checkpoints the file and frees its
lock, as closing a database of its own does). Building and tearing down a DuckDB instance costs
~12 ms, most of it the built-in catalog, where ATTACH + DETACH cost ~1 ms
(docs/design.md#duckdb-one-writer-or-many-readers). So do the read-only connections the store
opens for its own statements (``internal``). A read-only connection that may run a user's SQL
keeps an instance of its own: that one is locked down (``READ_ONLY_CONFIG``), and a locked-down
instance cannot attach.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import random
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import duckdb
import numpy as np

from store.errors import DiskFullError, ManifestBusyError, WorkspaceError, disk_full_error, is_disk_full

DEFAULT_TIMEOUT = 30.0
# A read-only DuckDB connection still writes files through COPY ... TO, EXPORT DATABASE or
# ATTACH (even over the store's own chunk files), and reads any file through read_csv & co.
# Readers get neither: no file system access beyond the manifest itself, and the setting locked
# so that SQL cannot turn it back on (docs/reliability.md, "Security").
READ_ONLY_CONFIG: dict[str, str | bool | int | float | list[str]] = {
    "enable_external_access": False, "lock_configuration": True}
# Writes are short transactions (a commit, a registration): one thread does them as fast, and
# DuckDB's default pool (one thread per core) would wake beside an extraction's torch threads.
WRITE_CONFIG: dict[str, str | bool | int | float | list[str]] = {"threads": 1}
_MARKER_STALE_S = 5.0
_READER_YIELD_S = 1.0

_locks: dict[str, threading.RLock] = {}
_locks_guard = threading.Lock()
_held: dict[str, HeldConnection] = {}  # the open held connection of each file, by resolved path
_shared: tuple[int, duckdb.DuckDBPyConnection] | None = None  # (pid, the in-memory DuckDB manifests attach to)
_shared_guard = threading.Lock()


def _process_lock(path: Path) -> threading.RLock:
    with _locks_guard:
        return _locks.setdefault(_key(path), threading.RLock())


def _key(path: Path) -> str:
    return str(path.resolve())


def is_lock_conflict(err: BaseException) -> bool:
    text = str(err)
    return isinstance(err, duckdb.IOException) and ("Could not set lock" in text or "Conflicting lock" in text)


def waiting_marker(path: Path) -> Path:
    return path.with_name(path.name + ".writer-waiting")


def wanted_marker(path: Path) -> Path:
    """Touched by any connection that meets the file's lock: a held connection lets go when it is fresh."""
    return path.with_name(path.name + ".wanted")


@contextmanager
def connect(path: Path, *, read_only: bool, timeout: float = DEFAULT_TIMEOUT,
            internal: bool = False) -> Iterator[duckdb.DuckDBPyConnection]:
    """A connection that is closed (and the file released) when the block ends.

    ``internal``: a read-only connection for the store's own statements, never SQL a user wrote:
    it attaches to the shared instance (~1 ms) instead of building a locked-down one (~12 ms).
    """
    lock = _process_lock(path)
    deadline = time.monotonic() + timeout
    if not lock.acquire(timeout=max(timeout, 0.001)):
        raise ManifestBusyError(f"another thread of this process held {path} for more than {timeout:.0f} s")
    try:
        held = _held.get(_key(path))
        if held is not None:
            held.close()  # one connection per file and process: this one needs the file now
        if read_only:
            _yield_to_writer(path, min(deadline, time.monotonic() + _READER_YIELD_S))
        con = _open(path, read_only, deadline, timeout, internal)
        try:
            yield con
        except duckdb.Error as err:
            if is_disk_full(err):  # e.g. the WAL append of a COMMIT on a full disk
                raise disk_full_error(path, err) from err
            raise
        finally:
            _close(con, path, read_only, attached=internal or not read_only)
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


def _open(path: Path, read_only: bool, deadline: float, timeout: float,
          internal: bool = False) -> duckdb.DuckDBPyConnection:
    delay = 0.005
    marker: Path | None = None
    wanted: Path | None = None
    try:
        while True:
            try:
                if read_only and not internal:
                    return duckdb.connect(str(path), read_only=True, config=READ_ONLY_CONFIG)
                return _attach(path, read_only)
            except duckdb.Error as err:
                if not is_lock_conflict(err):
                    raise manifest_error(path, err) from err
                wanted = wanted_marker(path)
                wanted.touch()
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
        # Whoever got in (or gave up) no longer wants the file: a held connection need not let go
        # at each use for the marker's lifetime. A process still waiting touches it again.
        for m in (marker, wanted):
            if m is not None:
                m.unlink(missing_ok=True)


def _shared_instance() -> duckdb.DuckDBPyConnection:
    """The process's in-memory DuckDB that the store's attached connections are cursors of (a
    forked child builds its own: see :func:`_forget_after_fork`)."""
    global _shared
    with _shared_guard:
        if _shared is None or _shared[0] != os.getpid():
            _shared = (os.getpid(), duckdb.connect(":memory:", config=WRITE_CONFIG))
        return _shared[1]


def _forget_after_fork() -> None:
    """In a forked child: never tear down the DuckDB inherited from the parent. Its teardown
    checkpoints every manifest attached to it, from the child, into files the parent still has
    open (seen: the parent's WAL gone when a child dropped its copy). So the child keeps one
    reference it never gives back, even at exit, and builds its own instance when it needs one."""
    global _shared
    if _shared is not None:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(_shared[1]))
        _shared = None
    _held.clear()  # the parent's connections: closing them here would detach its manifests


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def _alias(path: Path, read_only: bool) -> str:
    """The manifest's database name in the shared instance: one per file and mode, a valid identifier."""
    return "manifest_" + hashlib.sha1(_key(path).encode()).hexdigest()[:16] + ("_ro" if read_only else "")


def _attach(path: Path, read_only: bool = False) -> duckdb.DuckDBPyConnection:
    """A connection of the shared instance whose default database is ``path``. ``IF NOT EXISTS``:
    a manifest a failed close left attached is this process's still, and is reused."""
    con = _shared_instance().cursor()
    alias = _alias(path, read_only)
    quoted = str(path).replace("'", "''")
    try:
        con.execute(f"ATTACH IF NOT EXISTS '{quoted}' AS {alias}{' (READ_ONLY)' if read_only else ''}")
        con.execute(f"USE {alias}")
    except BaseException:
        con.close()
        raise
    return con


def _close(con: duckdb.DuckDBPyConnection, path: Path, read_only: bool, attached: bool = True) -> None:
    """Close a connection of :func:`_open`; an attached one detaches its manifest first, which
    (read-write) checkpoints it, and frees the file for other processes."""
    try:
        if attached:
            try:
                con.execute("USE memory")
            except duckdb.Error:  # a transaction a failed statement aborted: it must end first
                rollback(con)
                con.execute("USE memory")
            try:
                con.execute(f"DETACH DATABASE IF EXISTS {_alias(path, read_only)}")
            except duckdb.Error as err:
                # Detached, but its checkpoint failed (a full disk): the commits are in the WAL,
                # fsynced, and the next open replays it. Closing an instance of its own says nothing then.
                if "Detached database" not in str(err):
                    raise
    finally:
        con.close()


class HeldConnection:
    """One read-write connection to ``path`` kept open across short transactions, given up
    whenever the file's lock rules need that (see the module docstring)."""

    def __init__(self, path: Path, *, idle_s: float = 2.0, max_hold_s: float = 5.0) -> None:
        self.path = path
        self._key = _key(path)
        self.idle_s, self.max_hold_s = idle_s, max_hold_s
        self.connects = 0  # how often it had to open the file (a figure for benchmarks and tests)
        self._con: duckdb.DuckDBPyConnection | None = None
        self._opened = self._used = 0.0
        self._lock = _process_lock(path)

    @property
    def is_open(self) -> bool:
        return self._con is not None

    @contextmanager
    def use(self, timeout: float = DEFAULT_TIMEOUT) -> Iterator[duckdb.DuckDBPyConnection]:
        """The connection for one transaction, opened (waiting up to ``timeout`` s) if it is not open."""
        if not self._lock.acquire(timeout=max(timeout, 0.001)):
            raise ManifestBusyError(f"another thread of this process held {self.path} for more than {timeout:.0f} s")
        try:
            if self._con is None:
                other = _held.get(self._key)
                if other is not None:
                    other.close()
                self._con = _open(self.path, False, time.monotonic() + timeout, timeout)
                self._opened = time.monotonic()
                self.connects += 1
                _held[self._key] = self
            try:
                yield self._con
            except BaseException as err:
                self.close()  # a failed transaction may leave it unusable: the next use opens afresh
                if isinstance(err, duckdb.Error) and is_disk_full(err):
                    raise disk_full_error(self.path, err) from err
                raise
            self._used = time.monotonic()
            if self._should_go(self._used):
                self.close()
        finally:
            self._lock.release()

    def release_if_due(self) -> None:
        """Close the connection if it has been idle for ``idle_s``, open for ``max_hold_s``, or
        another process wants the file; never waits (a use in progress is left alone)."""
        if self._con is None or not self._lock.acquire(blocking=False):
            return
        try:
            now = time.monotonic()
            if self._con is not None and (now - self._used >= self.idle_s or self._should_go(now)):
                self.close()
        finally:
            self._lock.release()

    def close(self) -> None:
        with self._lock:
            con, self._con = self._con, None
            if _held.get(self._key) is self:
                del _held[self._key]
            if con is not None:
                _close(con, self.path, read_only=False)

    def _should_go(self, now: float) -> bool:
        if now - self._opened >= self.max_hold_s:
            return True
        try:
            return time.time() - wanted_marker(self.path).stat().st_mtime < _MARKER_STALE_S
        except FileNotFoundError:
            return False


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
    if ((isinstance(err, duckdb.ConnectionException) and "different configuration" in str(err))
            or "Unique file handle conflict" in str(err)):
        return WorkspaceError(
            f"this process already holds {path} open with another mode ({err}); close that connection"
            " (agnosia opens the manifest only briefly, so it is a connection opened outside agnosia)"
        )
    return WorkspaceError(
        f"the manifest {path} is not a readable DuckDB database ({type(err).__name__}: {err}). It may be"
        " truncated or corrupted: restore it from a backup, or move it away and re-run the extraction"
        " (the Zarr arrays beside it are not enough to rebuild it)"
    )


# Column kinds of :func:`register_columns`: numpy dtypes, or Python objects (str, datetime; None is NULL).
_DTYPES: dict[str, type[np.generic]] = {"int32": np.int32, "int64": np.int64, "float64": np.float64, "bool": np.bool_}


def register_columns(con: duckdb.DuckDBPyConnection, name: str, columns: Mapping[str, Sequence[Any]],
                     kinds: Mapping[str, str]) -> None:
    """Register Python columns as the relation ``name``, with no pyarrow in between.

    Building any pyarrow array imports pandas (pyarrow's pandas shim checks every input), about
    0.5 s of an extraction's start, and DuckDB scans a dict of numpy arrays as it is. ``kinds``
    names each column's numpy type (``int32``, ``int64``, ``float64``, ``bool``; None values are
    masked, i.e. NULL); a column not named there is an object column (str, datetime or None).
    """
    con.register(name, {col: _column(values, kinds.get(col)) for col, values in columns.items()})


def register_records(con: duckdb.DuckDBPyConnection, name: str, records: Sequence[Mapping[str, Any]],
                     kinds: Mapping[str, str]) -> None:
    """:func:`register_columns` of rows given as mappings (the keys of the first row)."""
    keys = list(records[0]) if records else list(kinds)
    register_columns(con, name, {k: [r.get(k) for r in records] for k in keys}, kinds)


def _column(values: Sequence[Any], kind: str | None) -> np.ndarray:
    if kind is None:
        out = np.empty(len(values), dtype=object)
        for i, v in enumerate(values):  # element by element: a list-valued item must not become a 2-D array
            out[i] = v
        return out
    missing = np.fromiter((v is None for v in values), dtype=bool, count=len(values))
    data = np.array([0 if v is None else v for v in values], dtype=_DTYPES[kind])
    return np.ma.masked_array(data, mask=missing) if missing.any() else data
