"""One writer per workspace: an exclusive ``flock`` on ``writer.lock`` holding the holder's identity.

The kernel drops a ``flock`` when its process dies (even on ``kill -9``), so liveness never
depends on the file's content: a lock file whose flock is free is stale by definition and is
taken over. The content (pid, host, run, since) is there for the message the second writer gets,
and to report whose stale lock was taken over. Caveat: ``flock`` is per host on most network
file systems, so two hosts must not write one workspace over NFS.
"""

from __future__ import annotations

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

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        run = f", run {self.run}" if self.run else ""
        return f"pid {self.pid} on host {self.host}{run}, since {when}"


def _pid_alive(pid: int) -> bool:
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
    if holder.host == socket.gethostname() and not _pid_alive(holder.pid):
        return None
    return holder


def read_holder(path: Path) -> Holder | None:
    try:
        data: dict[str, Any] = json.loads(path.read_text() or "{}")
        return Holder(int(data["pid"]), str(data["host"]), data.get("run"), float(data.get("since", 0)))
    except (OSError, ValueError, KeyError, TypeError):
        return None


class WriterLock:
    """Acquire with :meth:`acquire`; ``took_over`` names a stale holder that was replaced."""

    def __init__(self, path: Path, run: str | None = None) -> None:
        self.path = path
        self.run = run
        self.took_over: Holder | None = None
        self._fd: int | None = None

    def acquire(self) -> "WriterLock":
        if self._fd is not None:
            return self
        for _ in range(10):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                holder = read_holder(self.path)
                who = holder.describe() if holder else "a process that has not written its name yet"
                alive = "" if holder is None or holder.host != socket.gethostname() or _pid_alive(holder.pid) else (
                    " (that pid is gone on this host, yet the lock is held: a child process inherited it?)"
                )
                raise WriterLockError(
                    f"the workspace {self.path.parent} is being written by {who}{alive}. One writer per"
                    f" workspace: wait for pid {holder.pid if holder else '?'} to finish, stop it, or write to"
                    " another workspace (--data / AGNOSIA_DATA)"
                ) from None
            # The file may have been unlinked and recreated between open and flock; lock the live one.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            previous = read_holder(self.path)
            if previous is not None and previous.pid != os.getpid():
                self.took_over = previous
            me = {"pid": os.getpid(), "host": socket.gethostname(), "run": self.run, "since": time.time()}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
            os.fsync(fd)
            self._fd = fd
            return self
        raise WriterLockError(f"could not lock {self.path}: it kept being replaced; is another agnosia cleaning it?")

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            # Empty the file before unlocking so nobody reads our identity as a live holder.
            os.ftruncate(fd, 0)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> "WriterLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
