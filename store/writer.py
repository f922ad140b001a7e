"""The background writer: the producer hands over batches, a thread makes them durable chunks.

Life of a run (what the extraction stage calls)::

    with ws.writer(RunInfo(run="qwen2vl-g2m", model=..., ...)) as w:    # takes the workspace lock
        keys = w.register_stimulus_set("sets/g2m")                   # idempotent
        w.set_samples(keys)                                              # row i of every array = keys[i]
        img = w.array(ArraySpec(tap="llm", layer=12, tokens="image", shape=(64, 1536), dtype="bfloat16"))
        for rows in w.todo():                                            # only what is not committed yet
            for start in range(rows.start, rows.stop, batch):
                ...forward + generate...
                w.write_batch(start, {img: acts}, tokens=spans, generations=gens)
        w.finish()                                                       # status 'finished'

Guarantees:

* The producer never touches the disk: ``write*`` validate shapes, then queue the batch. The queue
  is bounded in bytes (``max_pending_bytes``); only when the disk is slower than the model does
  ``write`` wait (the time is counted in ``stats.producer_wait_s``).
* Samples are assembled into chunk-aligned blocks (one block = ``chunk_samples`` rows of one
  array); a block is written only when complete, then fsynced (file + directory), and only then
  is its row inserted into ``chunks`` (with a CRC-32C of the stored values and NaN/inf and clip
  counts). Token spans and generations queued before a block are committed in the same or an
  earlier transaction, so a committed chunk implies its rows' records are committed.
* Manifest commits are short transactions, batched: a written block is committed at most
  ``commit_every`` seconds later while the producer keeps the queue busy, within ``min_commit_gap``
  when it goes idle. Token spans and generations with no block to go with them wait up to
  ``records_every`` seconds (they only show progress: a crash recomputes their rows anyway). A
  crash loses the blocks not yet committed; their rows are recomputed.
  All of a run's transactions share one read-write connection, given up whenever another
  connection needs the file (:class:`store.db.HeldConnection`); :meth:`arrays` declares a run's
  arrays in one transaction.
* Resume: a re-run with the same ``RunInfo`` asks the manifest which chunks are committed;
  :meth:`todo` names the rows still missing, and blocks already committed are skipped if the
  producer writes them again, so no row is ever stored twice.
* Shards: ``ws.writer(info, shard=Shard(i, k))`` lets k processes fill one run together. Shard i
  owns the chunks ``c % k == i`` of every array (all arrays of a sharded run share one chunk size,
  the one the run's ``chunk_samples`` gives, so a row belongs to one shard in every array); :meth:`todo` names only its
  own rows and writing another shard's rows is refused. The run is marked finished by whichever
  shard commits the last missing chunk; run tensors are written by shard 0.

The parts, one job each: :mod:`store.registration` (the run, stimuli, samples and arrays in the
manifest), :mod:`store.tensors` (run tensors), :mod:`store.producer` (validate and queue),
:mod:`store.pipeline` (the writer thread: assembly, pwrite, checksums), :mod:`store.committer`
(fsync, upload, the manifest transaction) and :mod:`store.chunks` (the chunk structures and
byte-level helpers); :class:`Writer` puts them together and owns the locks and the threads.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from store import arrays as layout
from store import db, location
from store.chunks import Assembly, Budget, ChunkRecord, Stream
from store.errors import StoreError, WorkspaceError, WriterLockError
from store.lock import Holder, WriterLock, live_shards, pid_alive, shard_lock_path
from store.pipeline import STOP, Pipeline
from store.producer import Producer
from store.records import RunInfo, Shard
from store.registration import Registration, library_versions
from store.tensors import Tensors
from store.writer_core import ArrayHandle, WriterStats, now

if TYPE_CHECKING:
    from store.workspace import Workspace

__all__ = ["ArrayHandle", "Writer", "WriterStats", "library_versions"]

_LANES = 2


class Writer(Registration, Tensors, Producer, Pipeline):
    """The one writer of a workspace for one run, or one shard of a sharded run.
    Create with :meth:`Workspace.writer`."""

    def __init__(
        self,
        ws: Workspace,
        info: RunInfo,
        *,
        max_pending_bytes: int = 256 << 20,
        commit_every: float = 1.0,
        min_commit_gap: float = 0.2,
        records_every: float = 5.0,
        manifest_timeout: float = db.DEFAULT_TIMEOUT,
        shard: Shard | str | None = None,
    ) -> None:
        self.ws = ws
        self.info = info
        self.run = info.run
        self.shard: Shard | None = Shard.parse(shard) if isinstance(shard, str) else shard
        self.stats = WriterStats()
        self._commit_every = commit_every
        self._min_gap = min_commit_gap
        self._records_every = records_every
        self._manifest_timeout = manifest_timeout
        self._locks = self._acquire_locks()
        # Held db.HOLD_S at a stretch, so a plain DuckDB client that retries gets in within 1 s;
        # each let-go costs a checkpoint (~10 ms) and the next commit a reopen (docs/benchmarks.md).
        self._manifest = db.HeldConnection(ws.manifest_path)
        self.took_over: Holder | None = self._locks[-1].took_over
        self._handles: dict[str, ArrayHandle] = {}
        self._chunk_sizes: set[int] | None = None
        try:
            if self.shard is None:
                ws.purge_trash()  # shards share the workspace: a peer may be mid-drop (never; but be safe)
            # Before the run's row: an object store that refuses (a wrong key, a missing bucket) must
            # not leave a run marked running that nothing runs.
            self._check_remote_root()
            self._begin_run(info)
            self._stimuli: list[str] | None = self._load_samples()
            self._root = layout.open_root(ws.path, read_only=False)  # local: metadata, and staging for a remote root
            self._unstage_committed()
            # The Zarr root's own leftovers (a kill while a workspace was created) and the run's.
            self._remove_stale_partials([*ws.zarr_path.glob("*.partial"),
                                         *(ws.zarr_path / self.run).rglob("*.partial")])
        except BaseException:
            self._manifest.close()
            self._release_locks()
            raise
        self._queue: queue.Queue[Any] = queue.Queue()
        self._budget = Budget(max_pending_bytes)
        self._abort = threading.Event()
        self._error: BaseException | None = None
        self._closed = False
        self._finished = False
        # Writer-thread state.
        self._assembling: dict[tuple[int, int], Assembly] = {}
        self._streams: dict[tuple[int, int], Stream] = {}
        self._pending_chunks: list[ChunkRecord] = []
        self._commit_failed = False
        self._pending_tokens: list[dict[str, Any]] = []
        self._pending_generations: list[dict[str, Any]] = []
        self._last_commit = time.monotonic()
        self._retry_at = 0.0
        # Checksums, NaN/inf counts and renames run beside the writer thread on single-thread
        # lanes: a chunk always goes to the same lane (chunk % lanes), so its running CRC sees
        # its batches in order, and neighbouring chunks are checksummed in parallel.
        self._lanes = [ThreadPoolExecutor(1, thread_name_prefix=f"agnosia-io{i}-{self.run}") for i in range(_LANES)]
        self._item_jobs: list[Future[Any]] = []
        self._handling: tuple[Any, ...] = ("none",)
        self._syncers = ThreadPoolExecutor(4, thread_name_prefix=f"agnosia-fsync-{self.run}")
        self._thread = threading.Thread(target=self._loop, name=f"agnosia-writer-{self.run}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ locks and shards

    def _acquire_locks(self) -> list[WriterLock]:
        if self.shard is None:
            return [WriterLock(self.ws.path / "writer.lock", run=self.run).acquire()]
        shard = str(self.shard)
        shared = WriterLock(self.ws.path / "writer.lock", run=self.run, shared=True, shard=shard).acquire()
        try:
            own = WriterLock(
                shard_lock_path(self.ws.path, self.run, self.shard.index, self.shard.count), run=self.run, shard=shard
            ).acquire()
        except BaseException:
            shared.release()
            raise
        # Shards of different k would claim overlapping chunks (0/2 and 0/3 both own chunk 0).
        others = [h for h in live_shards(self.ws.path, self.run)
                  if h.shard and h.shard.split("/")[-1] != str(self.shard.count)]
        if others:
            own.release()
            shared.release()
            raise WriterLockError(
                f"run {self.run} is being written by shard(s) of another split"
                f" ({'; '.join(h.describe() for h in others)});"
                f" this writer is shard {shard}. All concurrent shards of a run use the same k"
            )
        return [shared, own]

    def _release_locks(self) -> None:
        for lock in reversed(self._locks):
            lock.release()

    def _peer_shards(self) -> list[Holder]:
        me = str(self.shard)
        return [h for h in live_shards(self.ws.path, self.run) if not (h.pid == os.getpid() and h.shard == me)]

    def _remove_stale_partials(self, leftovers: list[Path]) -> None:
        """Remove temporary files of interrupted writes: chunk files (``c.<k>...<pid>.partial``)
        and zarr-python's half-written metadata or blocks (``*.<hex>.partial``, also in group
        folders). Never committed, so safe to remove; except, while peer shards run, the files a
        live process may be filling right now."""
        sharing = self.shard is not None and bool(self._peer_shards())
        for leftover in leftovers:
            if sharing:
                token = leftover.name.rsplit(".", 2)[-2] if leftover.name.count(".") >= 2 else ""
                pid = int(token) if token.isdigit() and len(token) <= 10 else None
                if pid is None or pid == os.getpid() or pid_alive(pid):
                    continue
            leftover.unlink(missing_ok=True)

    def _check_remote_root(self) -> None:
        root = self.ws.root
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

    def _unstage_committed(self) -> None:
        """Remove staged copies of chunks already committed remotely: a kill between a commit and
        its clean-up leaves them, and a resume never writes those chunks again. Uncommitted files
        stay (a peer shard may be about to commit them)."""
        if not self.ws.root.remote or not (self.ws.zarr_path / self.run).is_dir():
            return
        committed = set(self.rows("SELECT zarr_path, chunk FROM chunks WHERE run = ?", [self.run]))
        for f in (self.ws.zarr_path / self.run).rglob("c.*"):
            if f.name.endswith(".partial"):
                continue
            node = f.parent.relative_to(self.ws.zarr_path).as_posix()
            block = f.parent.parent.name if f.parent.name in ("rows", "offsets") else ""
            if block.startswith("b") and block[1:].isdigit():  # a ragged block's rows/offsets
                key = (f.parent.parent.parent.relative_to(self.ws.zarr_path).as_posix(), int(block[1:]))
            else:
                key = (node, int(f.name.split(".")[1]) if f.name.split(".")[1].isdigit() else -1)
            if key in committed:
                f.unlink(missing_ok=True)

    # ------------------------------------------------------------------ the run's manifest connection

    def rows(self, sql: str, params: Sequence[Any] | None = None) -> list[tuple[Any, ...]]:
        """A query on the run's own manifest connection: it sees every commit so far (after
        :meth:`finish`, the whole run) and, unlike ``Workspace.rows``, opens no second connection."""
        with self._write_connection() as con:
            return con.execute(sql, params or []).fetchall()

    def record_vocab(self, tokens: Sequence[str]) -> int:
        """The run's vocabulary (``Workspace.record_vocab``), on the run's own connection."""
        return self.ws.record_vocab(self.run, tokens, held=self._manifest)

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Drain the queue, commit what is durable, stop the threads and release the lock.

        A run closed without :meth:`finish` is left ``stopped`` (``failed`` after an error); a
        later writer with the same RunInfo resumes it. A writer that changed nothing of an
        existing run (a resume refused by its checks) leaves the run's row as it found it.
        """
        self._shutdown(producer_failed=False)
        self._raise_if_failed()

    def _shutdown(self, *, producer_failed: bool) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(STOP)
            self._thread.join()
            for lane in self._lanes:
                lane.shutdown(wait=True)
            self._syncers.shutdown(wait=True)
            status = "failed" if (producer_failed or self._error is not None) else None
            if not self._marked:
                return  # this writer changed nothing of the run (e.g. a refused resume): leave its row as it was
            if status is None and self._finished:
                return  # finish() already recorded the status in the last commit
            if status is None and self.shard is not None and self._peer_shards():
                return  # peers still write the run: the last shard standing says how it ended
            try:
                with self._write_connection() as con:
                    con.execute(
                        "UPDATE runs SET status = CASE WHEN status = 'finished' AND ? IS NULL THEN 'finished'"
                        " ELSE coalesce(?, 'stopped') END, updated_at = ? WHERE run = ?",
                        [status, status, now(), self.run],
                    )
            except StoreError as err:
                if self._error is None and not producer_failed:
                    self._error = err
        finally:
            # Before the lock: the next writer finds the file free. Compact: the same writes
            # leave a manifest of the same size, whenever the run let go of it (store/db.py).
            self._manifest.close(compact=True)
            self._release_locks()

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc is not None:
            # The producer failed: keep the durable work (a resume continues from it) and let the
            # producer's exception propagate rather than one of ours.
            self._shutdown(producer_failed=True)
            return
        self.close()
