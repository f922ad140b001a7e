"""DuckDB connections to the manifest, with retry on the file lock.

DuckDB lets one process hold a database file read-write *or* many hold it read-only, never both
(docs/design.md#duckdb-one-writer-or-many-readers). So a read is connect -> statements -> close,
and a caller that finds the file held by another process retries with backoff for up to
``timeout`` seconds.

A writer's run keeps one read-write connection (:class:`HeldConnection`) across its short
transactions, since a connect + close (a checkpoint) per commit cost the writer thread half its
time. It gives the file up whenever another connection needs it: another connection of this
process closes it first; a process that meets the lock touches ``manifest.duckdb.wanted``, and
the holder closes its connection within ~0.05 s. A plain DuckDB client (a shell, a notebook, a
dashboard) cannot ask, so the promise is kept by the clock: a held connection keeps the file at
most ``HOLD_S`` (0.4 s) at a stretch, closed by a thread of this module even when its owner is
busy elsewhere, and after letting go it leaves the file free for at least ``REST_S`` (0.15 s).
A read-only client that retries every ~0.1 s for ``PLAIN_READER_WAIT_S`` (1 s) therefore always
gets in during a write (tests/store/test_plain_readers.py). Queries, ``verify`` and the probe farm
get in the same way between a long extraction's commits.

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

import atexit
import ctypes
import hashlib
import os
import random
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import numpy as np

from store.errors import (
    DiskFullError,
    ManifestBusyError,
    StoreError,
    WorkspaceError,
    disk_full_error,
    is_disk_full,
)

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
# The promise to plain DuckDB clients (docs/store.md, "Concurrency model"): one that retries for
# this long gets in during a write. A held connection keeps the file HOLD_S at most (plus the one
# transaction it is in then), then leaves it free REST_S at least, so a retry every ~0.1 s finds
# a gap within a second, with ~0.4 s to spare for a loaded machine.
PLAIN_READER_WAIT_S = 1.0
HOLD_S = 0.4
MAX_HOLD_S = HOLD_S  # a held connection's default limits, read when it is made: see HeldConnection
REST_S = 0.15
_RELEASE_TICK_S = 0.05  # how often the releasing thread looks at the held connections
# A writer's last close rewrites the manifest compactly (HeldConnection.close): ~50 ms for the
# 4 MiB of a small one, ~0.8 s for 7 MiB of 100k rows (DuckDB rebuilds the keys' indexes).
# It holds the file meanwhile, so a bigger manifest keeps its free blocks rather than keep a
# plain reader out for longer than PLAIN_READER_WAIT_S. How long it may wait for the file first:
COMPACT_MAX_BYTES = 8 << 20
COMPACT_WAIT_S = 2.0

_locks: dict[str, threading.RLock] = {}
_locks_guard = threading.Lock()
_held: dict[str, HeldConnection] = {}  # the open held connection of each file, by resolved path
@dataclass
class Opens:
    """How often this process opened manifests: DuckDB instances built (each ~10-40 ms: its catalogue)
    and attaches of a manifest to the shared instance (~1 ms). Figures for benchmarks and tests."""

    instances: int = 0
    attaches: int = 0


OPENS = Opens()
_shared: tuple[int, duckdb.DuckDBPyConnection] | None = None  # (pid, the in-memory DuckDB manifests attach to)
_shared_guard = threading.Lock()
_releaser: threading.Thread | None = None  # lets go of held connections on time (see _watch_held)
_releaser_guard = threading.Lock()
_stopping = threading.Event()


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
                    OPENS.instances += 1
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
            OPENS.instances += 1
            _shared = (os.getpid(), duckdb.connect(":memory:", config=WRITE_CONFIG))
        return _shared[1]


def _forget_after_fork() -> None:
    """In a forked child: never tear down the DuckDB inherited from the parent. Its teardown
    checkpoints every manifest attached to it, from the child, into files the parent still has
    open (seen: the parent's WAL gone when a child dropped its copy). So the child keeps one
    reference it never gives back, even at exit, and builds its own instance when it needs one."""
    global _shared, _releaser, _releaser_guard
    if _shared is not None:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(_shared[1]))
        _shared = None
    _held.clear()  # the parent's connections: closing them here would detach its manifests
    _releaser, _releaser_guard = None, threading.Lock()  # the parent's thread is not in the child


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def _alias(path: Path, read_only: bool) -> str:
    """The manifest's database name in the shared instance: one per file and mode, a valid identifier."""
    return "manifest_" + hashlib.sha1(_key(path).encode()).hexdigest()[:16] + ("_ro" if read_only else "")


def _attach(path: Path, read_only: bool = False) -> duckdb.DuckDBPyConnection:
    """A connection of the shared instance whose default database is ``path``. ``IF NOT EXISTS``:
    a manifest a failed close left attached is this process's still, and is reused."""
    con = _shared_instance().cursor()
    OPENS.attaches += 1
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
    detacher = con
    try:
        if attached:
            try:
                con.execute("USE memory")
            except duckdb.Error:  # a transaction a failed statement aborted: it must end first
                rollback(con)
                if not _use_memory(con):
                    detacher = _shared_instance().cursor()
            try:
                detacher.execute(f"DETACH DATABASE IF EXISTS {_alias(path, read_only)}")
            except duckdb.Error as err:
                # Detached, but its checkpoint failed (a full disk): the commits are in the WAL,
                # fsynced, and the next open replays it. Closing an instance of its own says nothing then.
                if "Detached database" not in str(err):
                    raise
    finally:
        if detacher is not con:
            detacher.close()
        con.close()


def _use_memory(con: duckdb.DuckDBPyConnection) -> bool:
    """Make ``memory`` the cursor's database again; False when DuckDB refuses every statement of
    the cursor because the database it uses was invalidated (its checkpoint failed on a full
    disk): the caller then detaches it from a fresh cursor, and its commits stay in the WAL."""
    try:
        con.execute("USE memory")
        return True
    except duckdb.Error as err:
        if "invalidated" not in str(err):
            raise
        return False


class HeldConnection:
    """One read-write connection to ``path`` kept open across short transactions, given up
    whenever the file's lock rules need that (see the module docstring).

    ``idle_s`` and ``max_hold_s``: let go after that long without use, or that long after opening.
    Above ``HOLD_S`` a plain DuckDB client may wait longer than ``PLAIN_READER_WAIT_S``: a test
    that needs the file held says so.
    """

    def __init__(self, path: Path, *, idle_s: float | None = None, max_hold_s: float | None = None) -> None:
        self.path = path
        self._key = _key(path)
        self.idle_s = HOLD_S if idle_s is None else idle_s
        self.max_hold_s = MAX_HOLD_S if max_hold_s is None else max_hold_s
        self.connects = 0  # how often it had to open the file (a figure for benchmarks and tests)
        self._con: duckdb.DuckDBPyConnection | None = None
        self._opened = self._used = 0.0
        self._let_go = -REST_S  # when it last closed the file: it stays free REST_S after that
        self.compacted = False  # whether its last close rewrote the manifest compactly (for tests)
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
            con = self._con if self._con is not None else self._reopen(timeout)
            try:
                yield con
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

    def _reopen(self, timeout: float) -> duckdb.DuckDBPyConnection:
        other = _held.get(self._key)
        if other is not None:
            other.close()
        self._rest()
        self._con = _open(self.path, False, time.monotonic() + timeout, timeout)
        self._opened = self._used = time.monotonic()
        self.connects += 1
        _held[self._key] = self
        _watch_held()
        return self._con

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

    def close(self, *, compact: bool = False) -> None:
        """Let go of the file. ``compact`` (a writer's last close): first rewrite the manifest
        without the free blocks its checkpoints left (:func:`_compact`), unless it is bigger than
        ``COMPACT_MAX_BYTES`` or kept busy by another process for ``COMPACT_WAIT_S``. Never raises
        for the rewrite: the manifest is whole either way."""
        with self._lock:
            try:
                if compact and _size(self.path) <= COMPACT_MAX_BYTES:
                    self._compact_now()
            finally:
                self._let_go_now()

    def _compact_now(self) -> None:
        # The copy holds the file too: on a hold young enough to take it within HOLD_S, else on a
        # fresh one, after a polling reader's gap.
        if self._con is None or time.monotonic() - self._opened > HOLD_S / 2:
            self._let_go_now()
            try:
                self._reopen(COMPACT_WAIT_S)
            except (StoreError, duckdb.Error, OSError):
                return  # e.g. a client keeps the file: the next writer's close compacts it
        assert self._con is not None
        self.compacted = _compact(self._con, self.path)

    def _let_go_now(self) -> None:
        with self._lock:
            con, self._con = self._con, None
            if _held.get(self._key) is self:
                del _held[self._key]
            if con is not None:
                try:
                    _close(con, self.path, read_only=False)
                finally:
                    self._let_go = time.monotonic()

    def _rest(self) -> None:
        """Wait out the rest of ``REST_S`` after the last let-go: a reader polling the file must
        find the gap between two holds, and the next one may come right after a let-go."""
        rest = self._let_go + REST_S - time.monotonic()
        if rest > 0:
            time.sleep(rest)

    def _should_go(self, now: float) -> bool:
        if now - self._opened >= self.max_hold_s:
            return True
        try:
            return time.time() - wanted_marker(self.path).stat().st_mtime < _MARKER_STALE_S
        except FileNotFoundError:
            return False


def _compact(con: duckdb.DuckDBPyConnection, path: Path) -> bool:
    """Rewrite the attached manifest ``path`` into a fresh file and move that into its place;
    False (and the file as it was) when a WAL is left beside it or the copy fails.

    DuckDB never gives a file's free blocks back except at its end: each checkpoint writes the
    changed tables to new 256 KiB blocks before it frees the old ones, so how many free blocks a
    manifest keeps depends on when its writer let go, i.e. on timing. A copy holds the same
    tables, views, constraints and rows in the fewest blocks, so the same writes give the same
    size. It runs while this connection holds DuckDB's lock, so nobody reads or writes the old
    file meanwhile; the one who opens the path next gets the new file.
    """
    alias = _alias(path, False)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.compact")
    tmp_alias = _alias(tmp, False)
    quoted = str(tmp).replace("'", "''")
    try:
        con.execute(f"CHECKPOINT {alias}")
        if path.with_name(path.name + ".wal").exists():
            return False  # it would be replayed into the new file: keep the old one
        con.execute(f"ATTACH '{quoted}' AS {tmp_alias}")
        try:
            con.execute(f"COPY FROM DATABASE {alias} TO {tmp_alias}")
        finally:
            con.execute(f"DETACH DATABASE IF EXISTS {tmp_alias}")
        _fsync(tmp)
        os.replace(tmp, path)
        _fsync(path.parent)
        return True
    except (duckdb.Error, OSError):
        return False  # e.g. a full disk: the manifest is whole as it was, just not compact
    finally:
        for leftover in (tmp, tmp.with_name(tmp.name + ".wal")):
            leftover.unlink(missing_ok=True)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _watch_held() -> None:
    """Start the thread that lets go of this process's held connections on time, unless it runs.
    Their owners look in only when they use them (a writer thread busy with a batch, a probe
    farm training), and a plain client's wait must not depend on that."""
    global _releaser
    with _releaser_guard:
        if _releaser is None and not _stopping.is_set():
            _releaser = threading.Thread(target=_release_loop, name="agnosia-manifest-release", daemon=True)
            _releaser.start()


def _release_loop() -> None:
    global _releaser
    while not _stopping.wait(_RELEASE_TICK_S):
        with _releaser_guard:
            if not _held:  # under the guard: a connection opened meanwhile starts a new thread
                _releaser = None
                return
            held = list(_held.values())
        for h in held:
            h.release_if_due()


def _stop_releaser() -> None:
    """At exit, before daemon threads are frozen: never leave one halfway through a DETACH."""
    _stopping.set()
    thread = _releaser
    if thread is not None:
        thread.join(timeout=2 * _RELEASE_TICK_S + 1.0)


atexit.register(_stop_releaser)


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
