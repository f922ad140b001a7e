"""What a writer does before it writes: take the locks, check the array root, clear leftovers.

Functions of the workspace and the run only; :class:`store.writer.Writer` calls them while it
opens (and :func:`peer_shards` again when it closes).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from store import location
from store.errors import WorkspaceError, WriterLockError
from store.lock import Holder, WriterLock, live_shards, pid_alive, shard_lock_path
from store.records import Shard
from store.writer.context import RunContext

if TYPE_CHECKING:
    from store.workspace import Workspace


def acquire_locks(ws: Workspace, run: str, shard: Shard | None) -> list[WriterLock]:
    """The workspace's writer lock (shared by the shards of one run, with each shard's own)."""
    if shard is None:
        return [WriterLock(ws.path / "writer.lock", run=run).acquire()]
    name = str(shard)
    shared = WriterLock(ws.path / "writer.lock", run=run, shared=True, shard=name).acquire()
    try:
        own = WriterLock(shard_lock_path(ws.path, run, shard.index, shard.count), run=run, shard=name).acquire()
    except BaseException:
        shared.release()
        raise
    # Shards of different k would claim overlapping chunks (0/2 and 0/3 both own chunk 0).
    others = [h for h in live_shards(ws.path, run) if h.shard and h.shard.split("/")[-1] != str(shard.count)]
    if others:
        own.release()
        shared.release()
        raise WriterLockError(
            f"run {run} is being written by shard(s) of another split"
            f" ({'; '.join(h.describe() for h in others)});"
            f" this writer is shard {name}. All concurrent shards of a run use the same k"
        )
    return [shared, own]


def release_locks(locks: list[WriterLock]) -> None:
    for lock in reversed(locks):
        lock.release()


def peer_shards(ws: Workspace, run: str, shard: Shard | None) -> list[Holder]:
    """The other live shards of ``run`` (not this process's ``shard``)."""
    me = str(shard)
    return [h for h in live_shards(ws.path, run) if not (h.pid == os.getpid() and h.shard == me)]


def remove_stale_partials(ws: Workspace, run: str, shard: Shard | None, leftovers: list[Path]) -> None:
    """Remove temporary files of interrupted writes: chunk files (``c.<k>...<pid>.partial``)
    and zarr-python's half-written metadata or blocks (``*.<hex>.partial``, also in group
    folders). Never committed, so safe to remove; except, while peer shards run, the files a
    live process may be filling right now."""
    sharing = shard is not None and bool(peer_shards(ws, run, shard))
    for leftover in leftovers:
        if sharing:
            token = leftover.name.rsplit(".", 2)[-2] if leftover.name.count(".") >= 2 else ""
            pid = int(token) if token.isdigit() and len(token) <= 10 else None
            if pid is None or pid == os.getpid() or pid_alive(pid):
                continue
        leftover.unlink(missing_ok=True)


def check_remote_root(ws: Workspace) -> None:
    """Refuse an object store whose prefix holds something other than this workspace's arrays."""
    root = ws.root
    if not root.remote:
        return
    try:
        what = root.foreign()
    except OSError as err:
        raise location.describe_remote_error(str(root.url), err) from err
    if what is not None:
        raise WorkspaceError(
            f"{root.url} holds {what}, not this workspace's arrays (id {root.local_meta().get(location.ID_ATTR)}):"
            " the bucket or prefix was emptied or reused. Writing there could mix two workspaces; restore the"
            " objects, or start a new workspace (python -m store init --data NEW --arrays URL)"
        )


def unstage_committed(ctx: RunContext) -> None:
    """Remove staged copies of chunks already committed remotely: a kill between a commit and
    its clean-up leaves them, and a resume never writes those chunks again. Uncommitted files
    stay (a peer shard may be about to commit them)."""
    ws, run = ctx.ws, ctx.run
    if not ws.root.remote or not (ws.zarr_path / run).is_dir():
        return
    with ctx.connection() as con:
        committed = set(con.execute("SELECT zarr_path, chunk FROM chunks WHERE run = ?", [run]).fetchall())
    for f in (ws.zarr_path / run).rglob("c.*"):
        if f.name.endswith(".partial"):
            continue
        node = f.parent.relative_to(ws.zarr_path).as_posix()
        block = f.parent.parent.name if f.parent.name in ("rows", "offsets") else ""
        if block.startswith("b") and block[1:].isdigit():  # a ragged block's rows/offsets
            key = (f.parent.parent.parent.relative_to(ws.zarr_path).as_posix(), int(block[1:]))
        else:
            key = (node, int(f.name.split(".")[1]) if f.name.split(".")[1].isdigit() else -1)
        if key in committed:
            f.unlink(missing_ok=True)
