"""Who may write a workspace: ``flock`` on ``writer.lock``, holding the holder's identity.

One writer per workspace takes ``writer.lock`` exclusively. Shards of one sharded run
(``--shard i/k``: k processes filling one run, each its own chunks) instead take it *shared*, so
they exclude every unsharded writer but not each other, and each takes its own exclusive
``locks/<run>.shard-<i>-of-<k>.lock``, which names it and stops two processes claiming one shard.

The kernel drops a ``flock`` when its process dies (even on ``kill -9``), so liveness never
depends on the file's content: a lock file whose flock is free is stale by definition and is
taken over. The content (pid, host, run, since) is there for the message the second writer gets,
and to report whose stale lock was taken over. Caveat: ``flock`` is per host on most network
file systems, so two hosts must not write one workspace over NFS.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from store.errors import WriterLockError


@dataclass(frozen=True)
class Holder:
    pid: int
    host: str
    run: str | None
    since: float
    shard: str | None = None  # "i/k" for a shard of a sharded run

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        run = f", run {self.run}" if self.run else ""
        shard = f" shard {self.shard}" if self.shard else ""
        return f"pid {self.pid} on host {self.host}{run}{shard}, since {when}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def live_holder(path: Path) -> Holder | None:
    """The writer named in the lock file if it still runs (judged by pid, on this host only).

    Used for reports; it takes no lock, so it can never make a starting writer fail.
    """
    holder = read_holder(path)
    if holder is None:
        return None
    if holder.host == socket.gethostname() and not pid_alive(holder.pid):
        return None
    return holder


def read_holder(path: Path) -> Holder | None:
    try:
        data: dict[str, Any] = json.loads(path.read_text() or "{}")
        return Holder(int(data["pid"]), str(data["host"]), data.get("run"), float(data.get("since", 0)),
                      data.get("shard"))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def shard_lock_path(workspace: Path, run: str, index: int, count: int) -> Path:
    return workspace / "locks" / f"{run}.shard-{index}-of-{count}.lock"


def live_shards(workspace: Path, run: str | None = None) -> list[Holder]:
    """The shard writers named in ``locks/`` that still run (by pid, on this host)."""
    folder = workspace / "locks"
    if not folder.is_dir():
        return []
    out = []
    for f in sorted(folder.glob("*.shard-*.lock")):
        holder = live_holder(f)
        if holder is not None and (run is None or holder.run == run):
            out.append(holder)
    return out


def live_writers(workspace: Path) -> list[Holder]:
    """Every live writer of a workspace: the exclusive one, or the shards of sharded runs."""
    holder = live_holder(workspace / "writer.lock")
    return [holder] if holder is not None else live_shards(workspace)


def open_lock_file(path: Path) -> int:
    """A lock file's descriptor, read-write, created if missing; a symlink in its place is refused.

    O_NOFOLLOW: the holder's name is written with a truncate, and a symlink planted as a lock file
    would aim that truncate at a file outside the workspace."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as err:
        if err.errno != errno.ELOOP:
            raise
    raise WriterLockError(
        f"the lock file {path} is a symbolic link (to {os.readlink(path)!r}); agnosia never writes"
        f" through one, so the target was not touched: remove the link (rm {path}) and run again"
    )


class WriterLock:
    """Acquire with :meth:`acquire`; ``took_over`` names a stale holder that was replaced.

    ``shared=True`` is the shards' mode: a shared flock, no identity written (the shard's own
    lock file carries it).
    """

    def __init__(self, path: Path, run: str | None = None, *, shared: bool = False, shard: str | None = None) -> None:
        self.path = path
        self.run = run
        self.shared = shared
        self.shard = shard
        self.took_over: Holder | None = None
        self._fd: int | None = None

    def acquire(self) -> WriterLock:
        if self._fd is not None:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(10):
            fd = open_lock_file(self.path)
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise self._busy() from None
            # The file may have been unlinked and recreated between open and flock; lock the live one.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            if self.shared:
                self._fd = fd
                return self
            previous = read_holder(self.path)
            if previous is not None and previous.pid != os.getpid():
                self.took_over = previous
            me = {"pid": os.getpid(), "host": socket.gethostname(), "run": self.run, "since": time.time(),
                  "shard": self.shard}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
            os.fsync(fd)
            self._fd = fd
            return self
        raise WriterLockError(f"could not lock {self.path}: it kept being replaced; is another agnosia cleaning it?")

    def _busy(self) -> WriterLockError:
        holder = read_holder(self.path)
        deadline = time.monotonic() + 1.0
        # The holder writes its name just after taking the flock. Caught in between, the file is
        # empty or still names the dead writer being taken over: wait that moment out, so the
        # message names the live holder (found by the fault suite's two simultaneous writers).
        while (holder is None or (holder.host == socket.gethostname() and not pid_alive(holder.pid))) and (
            time.monotonic() < deadline and not (self.path.name == "writer.lock" and live_shards(self.path.parent))
        ):
            time.sleep(0.01)
            holder = read_holder(self.path)
        if holder is None and self.path.name == "writer.lock":
            shards = live_shards(self.path.parent)
            if shards:
                names = "; ".join(h.describe() for h in shards)
                return WriterLockError(
                    f"the workspace {self.path.parent} is being written by the shards of a sharded run ({names})."
                    " Shards of one run share a workspace with each other only: wait for them to finish, or"
                    " write to another workspace (--data / AGNOSIA_DATA)"
                )
        who = holder.describe() if holder else "a process that has not written its name yet"
        alive = "" if holder is None or holder.host != socket.gethostname() or pid_alive(holder.pid) else (
            " (that pid is gone on this host, yet the lock is held: a child process inherited it?)"
        )
        if self.shard is not None and self.path.name != "writer.lock":
            return WriterLockError(
                f"shard {self.shard} of run {self.run} is already being written by {who}{alive}: each shard"
                " index goes to one process; give this one another --shard i/k, or wait for that one"
            )
        return WriterLockError(
            f"the workspace {self.path.parent} is being written by {who}{alive}. One writer per"
            f" workspace (or the shards of one sharded run): wait for pid {holder.pid if holder else '?'} to"
            " finish, stop it, or write to another workspace (--data / AGNOSIA_DATA)"
        )

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            # Empty the file before unlocking so nobody reads our identity as a live holder.
            if not self.shared:
                os.ftruncate(fd, 0)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> WriterLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def run_lock_path(workspace: Path, run: str) -> Path:
    return workspace / "locks" / f"{run}.readers.lock"


class RunLock:
    """A run's readers against its removal: a probe plan (or ``probes derive``) holds
    ``locks/<run>.readers.lock`` shared while it reads the run, ``drop-run`` holds it exclusive
    while it deletes. Without it a drop in the middle of a plan made the plan's reads fail as if
    the user's data were damaged ("missing on disk ... re-extract the run").

    Non-blocking both ways: the caller decides whether to retry (drop-run's ``--wait``) or say so.
    The file is never unlinked (a tiny file per run ever read), so no inode race needs handling.
    """

    def __init__(self, workspace: Path, run: str, *, exclusive: bool = False) -> None:
        self.workspace = workspace
        self.run = run
        self.exclusive = exclusive
        self.path = run_lock_path(workspace, run)
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        if self._fd is not None:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = open_lock_file(self.path)  # the same refusal of a planted symlink
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if self.exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise self._busy() from None
        self._fd = fd
        return self

    def _busy(self) -> WriterLockError:
        if self.exclusive:
            return WriterLockError(
                f"run {self.run} is being read by a probe plan or `python -m probes derive` on {self.workspace}:"
                f" wait for it to finish (or stop it), then drop the run again (--wait SECONDS waits for it)"
            )
        return WriterLockError(
            f"run {self.run} is being dropped (python -m store drop-run) from {self.workspace}: once that ends the"
            " run is gone; re-extract it first if the plan still needs it"
        )

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def acquire_within(lock: WriterLock | RunLock, timeout: float) -> None:
    """Take ``lock``, retrying every 0.1 s for up to ``timeout`` seconds; then its refusal."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            lock.acquire()
            return
        except WriterLockError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


def check_writable(workspace: Path, doing: str) -> None:
    """Refuse, before any work, a workspace this process cannot write: ``doing`` (e.g. "a probe
    plan records its rows and weights") would otherwise compute everything and fail at its first
    write. Root passes ``os.access``, so a read-only mount is judged by the mount's flag."""
    if os.statvfs(workspace).f_flag & os.ST_RDONLY:
        raise WriterLockError(f"the workspace {workspace} is on a read-only file system, and {doing} there: remount it"
                              " read-write, or copy the workspace to a writable folder and pass --data")
    for p in (workspace, workspace / "manifest.duckdb", workspace / "probes", workspace / "locks"):
        if p.exists() and not os.access(p, os.W_OK):
            raise WriterLockError(f"the workspace {workspace}: {p} is not writable by this user, and {doing} there:"
                                  f" fix its permissions (chmod u+w {p}) or copy the workspace and pass --data")
