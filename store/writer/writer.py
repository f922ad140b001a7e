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

The parts, one job each, each owning its state (:mod:`store.writer.state`):
:class:`~store.writer.run_manifest.RunManifest` (the run, its row map and its arrays in the
manifest; stimuli through :mod:`store.writer.stimuli`), :class:`~store.writer.tensors.RunTensors`
(run tensors), :class:`~store.writer.producer.Producer` (validate and queue),
:class:`~store.writer.pipeline.Pipeline` (the writer thread: assembly, pwrite, checksums) and
:class:`~store.writer.committer.Committer` (fsync, upload, the manifest transaction), with
:mod:`store.chunks` (the chunk structures and byte-level helpers) and :mod:`store.writer.opening`
(locks, the remote root's check, leftovers of a killed run). They share
only what they are given: the run's :class:`~store.writer.context.RunContext`, the
:class:`~store.writer.context.Failure` slot and the producer's
:class:`~store.writer.state.Handover` to the thread. :class:`Writer` makes them, owns the locks,
the manifest connection and the fsync pool, and passes each public call to the part it concerns.
"""

from __future__ import annotations

import os
import queue
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from store import db
from store.chunks import Budget
from store.errors import StoreError
from store.lock import Holder
from store.records import ArraySpec, Generation, Ragged, RunInfo, Shard, TokenSpans
from store.writer import opening
from store.writer.committer import Committer
from store.writer.context import Failure, RunContext, now
from store.writer.handles import ArrayHandle, WriterStats
from store.writer.outbox import Written
from store.writer.pipeline import Cadence, Pipeline
from store.writer.producer import Producer
from store.writer.run_manifest import RunManifest
from store.writer.site import ArraySite
from store.writer.state import CommitState, Handover, Lifecycle
from store.writer.stimuli import register_rows, register_set
from store.writer.tensors import RunTensors

if TYPE_CHECKING:
    from store.workspace import Workspace


class Writer:
    """The one writer of a workspace for one run, or one shard of a sharded run.
    Create with :meth:`Workspace.writer`.

    ``workers_writing``: workers of a cluster run (:mod:`store.writer.chunk_writer`) may be writing
    this run's chunks right now, so the ``.partial`` files a killed writer leaves are not removed
    at open (a writer opened before any task of the run was handed out removes them)."""

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
        workers_writing: bool = False,
    ) -> None:
        self.ws = ws
        self.info = info
        self.run = info.run
        self.shard: Shard | None = Shard.parse(shard) if isinstance(shard, str) else shard
        self.stats = WriterStats()
        self._locks = opening.acquire_locks(ws, self.run, self.shard)
        # Held db.HOLD_S at a stretch, so a plain DuckDB client that retries gets in within 1 s;
        # each let-go costs a checkpoint (~10 ms) and the next commit a reopen (docs/benchmarks.md).
        self._manifest = db.HeldConnection(ws.manifest_path)
        self.took_over: Holder | None = self._locks[-1].took_over
        # Its threads start with its first job (the first array or tensor made durable).
        syncers = ThreadPoolExecutor(4, thread_name_prefix=f"agnosia-fsync-{self.run}")
        self._ctx = RunContext(ws, info, self.shard, self.stats, self._manifest, manifest_timeout, syncers)
        try:
            if self.shard is None:
                ws.purge_trash()  # shards share the workspace: a peer may be mid-drop (never; but be safe)
            # Before the run's row: an object store that refuses (a wrong key, a missing bucket) must
            # not leave a run marked running that nothing runs.
            opening.check_remote_root(ws)
            self._runs = RunManifest.begin(self._ctx)
            opening.unstage_committed(self._ctx)
            # The Zarr root's own leftovers (a kill while a workspace was created) and the run's; not
            # while workers of a cluster run write this run's chunks: their files in flight are .partial.
            if not workers_writing:
                opening.remove_stale_partials(ws, self.run, self.shard, [*ws.zarr_path.glob("*.partial"),
                                                                         *(ws.zarr_path / self.run).rglob("*.partial")])
        except BaseException:
            syncers.shutdown()
            self._manifest.close()
            opening.release_locks(self._locks)
            raise
        self._life = Lifecycle()
        self._failure = Failure(self.run, ws.path)
        self._tensors = RunTensors(self._ctx, self._runs)
        self._handover = Handover(queue.Queue(), Budget(max_pending_bytes))
        self._producer = Producer(self._ctx, self._runs, self._handover, self._failure)
        self._committer = Committer(self._ctx, self._runs, CommitState(generated=set() if self._runs.created else None))
        self._pipeline = Pipeline(self._ctx, self._handover, self._failure, self._committer,
                                  Cadence(commit_every, min_commit_gap, records_every))
        self._pipeline.start()

    # ------------------------------------------------------------------ the run's rows

    def owns(self, chunk: int) -> bool:
        """Whether this writer fills ``chunk`` (always, unless it is a shard)."""
        return self._ctx.owns(chunk)

    @property
    def n_samples(self) -> int:
        """Rows per array of the run (once :meth:`set_samples` fixed them)."""
        return self._runs.n_samples

    def register_stimuli(
        self, rows: Iterable[Mapping[str, Any]], *, dataset: str, set_path: str | os.PathLike[str] | None = None
    ) -> list[str]:
        """Add stimuli (rows in the truth.parquet format) to ``stimuli``; returns their keys
        ``<dataset>/<id>`` in input order. Re-registering identical rows is a no-op; a changed row
        with a known key is refused."""
        return register_rows(self._ctx, rows, dataset=dataset, set_path=set_path)

    def register_stimulus_set(self, path: str | os.PathLike[str], *, dataset: str | None = None) -> list[str]:
        """Register a stimulus set folder (``truth.parquet`` inside); dataset defaults to its name.
        One transaction per block of rows: a set refused part-way keeps its earlier blocks' rows,
        which no run points at (registering the mended set again is then a no-op for them)."""
        return register_set(self._ctx, path, dataset=dataset)

    def set_samples(self, stimuli: Sequence[str]) -> None:
        """Fix the run's row map: row i of every array holds ``stimuli[i]``. Idempotent on resume."""
        self._runs.set_samples(stimuli)

    def array(self, spec: ArraySpec) -> ArrayHandle:
        """Declare (or, on resume, reopen) one array of this run."""
        return self.arrays([spec])[0]

    def arrays(self, specs: Sequence[ArraySpec]) -> list[ArrayHandle]:
        """Declare (or, on resume, reopen) arrays of this run, in the order given: all of them in
        one manifest transaction, so a run's set-up costs one connection however many arrays."""
        self._check_open()
        return self._runs.arrays(specs)

    def write_tensor(
        self,
        name: str,
        values: Any,
        *,
        dtype: str = "float32",
        module: str | None = None,
        stored_dtype: str | None = None,
    ) -> None:
        """Store a run-level tensor (e.g. the unembedding matrix and final norm for the logit lens).

        Synchronous and uncompressed. Stored as it came (float32/float16) unless ``stored_dtype``
        says otherwise; bfloat16 follows the run's bf16 policy (``dtype='bfloat16'`` for uint16 bits).
        """
        self.write_tensors({name: values}, dtype=dtype, modules={name: module}, stored_dtype=stored_dtype)

    def write_tensors(
        self,
        tensors: Mapping[str, Any],
        *,
        dtype: str = "float32",
        modules: Mapping[str, str | None] | None = None,
        stored_dtype: str | None = None,
    ) -> None:
        """:meth:`write_tensor` of several tensors (``modules``: each one's module path): one query
        for what is stored, one pass of fsyncs and one transaction for all of them."""
        self._check_open()
        self._tensors.write(tensors, dtype=dtype, modules=modules, stored_dtype=stored_dtype)

    # ------------------------------------------------------------------ batches

    def todo(self) -> list[range]:
        """Row ranges not yet committed in every declared array (declare all arrays first).

        Ranges are unions of whole chunks, so writing them in order fills whole blocks.
        """
        return self._producer.todo()

    def write(self, handle: ArrayHandle, start: int, values: Any) -> None:
        """Queue rows ``start .. start+len(values)`` of a dense array (numpy or torch, any device)."""
        self._check_open()
        self._producer.write(handle, start, values)

    def write_ragged(self, handle: ArrayHandle, start: int, values: Sequence[Any] | Ragged) -> None:
        """Queue variable-length rows: ``values[i]`` (shape [n_i, *row_shape]) belongs to row start+i."""
        self._check_open()
        self._producer.write_ragged(handle, start, values)

    def record_tokens(self, start: int, spans: Sequence[TokenSpans]) -> None:
        """Queue the token spans of rows ``start .. start+len(spans)``."""
        self._check_open()
        self._producer.record_tokens(start, spans)

    def record_generations(self, start: int, generations: Sequence[Generation]) -> None:
        """Queue what the model generated for rows ``start .. start+len(generations)``."""
        self._check_open()
        self._producer.record_generations(start, generations)

    def write_batch(
        self,
        start: int,
        arrays: Mapping[ArrayHandle, Any],
        *,
        tokens: Sequence[TokenSpans] | None = None,
        generations: Sequence[Generation] | None = None,
    ) -> None:
        """One model batch: records first, then arrays, so a committed chunk implies its records are.
        Queued as one item: one hand-over to the writer thread per batch, not one per array."""
        self._check_open()
        self._producer.write_batch(start, arrays, tokens=tokens, generations=generations)

    def commit_written(self, written: Written) -> None:
        """Commit chunks a worker wrote (:class:`store.writer.chunk_writer.ChunkWriter`), with their rows'
        records, on the writer thread's usual cadence (:meth:`flush` waits for it). A chunk committed
        already, or handed over twice, is committed once."""
        self._check_open()
        self._producer.commit_written(written.chunks, written.tokens, written.generations)

    def site(self) -> ArraySite:
        """Where workers write this run's arrays (:class:`store.writer.site.ArraySite`)."""
        return ArraySite.of(self.ws, [h.info.zarr_path for h in self._runs.handles()])

    @property
    def manifest_opens(self) -> int:
        """How often this writer had to open the manifest: once, plus once after each let-go of its
        hold (store/db.py, ``HOLD_S``)."""
        return self._manifest.connects

    def pending(self) -> int:
        """Batches handed over and not yet taken up by the writer thread (0: it has caught up)."""
        return self._handover.queue.qsize()

    def flush(self) -> None:
        """Block until everything queued so far is durable and committed to the manifest."""
        self._check_open()
        self._pipeline.flush()
        self._failure.raise_if_failed()

    def finish(self, *, partial_ok: bool = False) -> None:
        """Flush and, if every chunk of every declared array is committed, mark the run finished
        (in the same transaction as the last chunks)."""
        self._check_open()
        self._pipeline.flush({"partial_ok": partial_ok})
        self._failure.raise_if_failed()
        missing = self._runs.missing()
        if missing and not partial_ok:
            listed = ", ".join(f"{k} ({v} chunks)" for k, v in list(missing.items())[:5])
            raise StoreError(
                f"run {self.run} is not complete: {sum(missing.values())} chunk(s) not written in {listed}."
                " Write the rows todo() names, or pass partial_ok=True to finish anyway"
            )
        self._life.finished = True

    def _check_open(self) -> None:
        if self._life.closed:
            raise StoreError(f"the writer of run {self.run} is closed; open a new one with ws.writer(...)")
        self._failure.raise_if_failed()

    # ------------------------------------------------------------------ the run's manifest connection

    def rows(self, sql: str, params: Sequence[Any] | None = None) -> list[tuple[Any, ...]]:
        """A query on the run's own manifest connection: it sees every commit so far (after
        :meth:`finish`, the whole run) and, unlike ``Workspace.rows``, opens no second connection."""
        with self._ctx.connection() as con:
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
        self._failure.raise_if_failed()

    def _shutdown(self, *, producer_failed: bool) -> None:
        if self._life.closed:
            return
        self._life.closed = True
        try:
            self._pipeline.stop()
            self._ctx.syncers.shutdown(wait=True)
            status = "failed" if (producer_failed or self._failure.error is not None) else None
            if not self._runs.marked:
                return  # this writer changed nothing of the run (e.g. a refused resume): leave its row as it was
            if status is None and self._life.finished:
                return  # finish() already recorded the status in the last commit
            if status is None and self.shard is not None and opening.peer_shards(self.ws, self.run, self.shard):
                return  # peers still write the run: the last shard standing says how it ended
            try:
                with self._ctx.connection() as con:
                    con.execute(
                        "UPDATE runs SET status = CASE WHEN status = 'finished' AND ? IS NULL THEN 'finished'"
                        " ELSE coalesce(?, 'stopped') END, updated_at = ? WHERE run = ?",
                        [status, status, now(), self.run],
                    )
            except StoreError as err:
                if not producer_failed:
                    self._failure.keep(err)
        finally:
            # Before the lock: the next writer finds the file free. Compact: the same writes
            # leave a manifest of the same size, whenever the run let go of it (store/db.py).
            self._manifest.close(compact=True)
            opening.release_locks(self._locks)

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc is not None:
            # The producer failed: keep the durable work (a resume continues from it) and let the
            # producer's exception propagate rather than one of ours.
            self._shutdown(producer_failed=True)
            return
        self.close()
