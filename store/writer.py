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
* Manifest commits are short transactions (connect, write, close) batched: at most every
  ``commit_every`` seconds while the producer keeps the queue busy, within ``min_commit_gap``
  when it goes idle. A crash loses the blocks not yet committed; their rows are recomputed.
* Resume: a re-run with the same ``RunInfo`` asks the manifest which chunks are committed;
  :meth:`todo` names the rows still missing, and blocks already committed are skipped if the
  producer writes them again, so no row is ever stored twice.
* Shards: ``ws.writer(info, shard=Shard(i, k))`` lets k processes fill one run together. Shard i
  owns the chunks ``c % k == i`` of every array (all arrays of a sharded run share the run's
  ``chunk_samples``, so a row belongs to one shard in every array); :meth:`todo` names only its
  own rows and writing another shard's rows is refused. The run is marked finished by whichever
  shard commits the last missing chunk; run tensors are written by shard 0.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import zarr

from store import arrays as layout
from store import db, location
from store.checksum import crc32c
from store.depth import assign_depths
from store.dtypes import as_numpy, cast, count_nonfinite, default_stored, numpy_dtype
from store.errors import (
    DiskFullError,
    ManifestBusyError,
    SpecMismatchError,
    StoreError,
    WorkspaceError,
    WriterError,
    WriterLockError,
    disk_full_error,
    is_disk_full,
)
from store.lock import Holder, WriterLock, live_shards, pid_alive, shard_lock_path
from store.records import (
    ArrayInfo,
    ArraySpec,
    Generation,
    Ragged,
    RunInfo,
    Shard,
    TokenSpans,
    check_name,
    to_json,
)

if TYPE_CHECKING:
    from store.workspace import Workspace

_STIMULUS_FIELDS = ("family", "split", "seed", "prompt", "answer", "prompts", "answers", "params", "truth", "image")


def library_versions() -> dict[str, str]:
    """Versions of what shaped the stored bytes (torch/transformers only if already imported)."""
    import duckdb
    import numcodecs

    out = {
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "zarr": zarr.__version__,
        "numcodecs": numcodecs.__version__,
        "duckdb": duckdb.__version__,
    }
    for name in ("torch", "transformers"):
        mod = sys.modules.get(name)
        if mod is not None:
            out[name] = getattr(mod, "__version__", "?")
    return out


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


@dataclass
class _ChunkRecord:
    handle: ArrayHandle
    chunk: int
    row_start: int
    row_stop: int
    n_rows: int
    nbytes: int
    # Resolves to (crc32c, n_nonfinite, n_clipped, offsets crc32c or None) once the files are in
    # place, computed off the writer thread.
    written: Future[tuple[int, int, int, int | None]]
    # fsynced at commit time, all at once: an fsync per chunk while other chunks are being
    # written stalls those writes several-fold on ext4, a batch of fsyncs does not.
    files: list[Path]
    dirs: list[Path]


@dataclass
class _Assembly:
    """A block of one array being filled by possibly many producer batches."""

    rows: range
    kind: str
    dense: np.ndarray | None
    ragged: list[np.ndarray | None] | None
    filled: np.ndarray

    def complete(self) -> bool:
        return bool(self.filled.all())


@dataclass
class _Stream:
    """An uncompressed dense chunk written in place: each batch goes straight to its byte range
    of a temporary file, so no assembly copy is made and memory stays flat however many arrays
    a run has. Sealed (fsync, rename into place, fsync folder) when every row has arrived."""

    rows: range
    kind: str
    tmp: Path
    final: Path
    fd: int
    filled: np.ndarray
    crc: int = 0
    crc_rows: int = 0
    in_order: bool = True
    n_nonfinite: int = 0
    n_clipped: int = 0


class _Budget:
    """Bytes queued but not yet taken over by the writer thread."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0
        self.cv = threading.Condition()

    def take(self, n: int, abort: threading.Event) -> float:
        start = time.perf_counter()
        with self.cv:
            # A batch larger than the whole budget still goes through once the queue is empty.
            while self.used > 0 and self.used + n > self.limit and not abort.is_set():
                self.cv.wait(0.1)
            self.used += n
        return time.perf_counter() - start

    def give(self, n: int) -> None:
        with self.cv:
            self.used -= n
            self.cv.notify_all()


_STOP = object()
_LANES = 2
_FADV_DONTNEED = getattr(os, "POSIX_FADV_DONTNEED", None)


class Writer:
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
        self._manifest_timeout = manifest_timeout
        self._locks = self._acquire_locks()
        self.took_over: Holder | None = self._locks[-1].took_over
        self._handles: dict[str, ArrayHandle] = {}
        try:
            if self.shard is None:
                ws.purge_trash()  # shards share the workspace: a peer may be mid-drop (never; but be safe)
            self._begin_run(info)
            self._stimuli: list[str] | None = self._load_samples()
            self._root = layout.open_root(ws.path, read_only=False)  # local: metadata, and staging for a remote root
            self._check_remote_root()
            self._unstage_committed()
            # The Zarr root's own leftovers (a kill while a workspace was created) and the run's.
            self._remove_stale_partials([*ws.zarr_path.glob("*.partial"),
                                         *(ws.zarr_path / self.run).rglob("*.partial")])
        except BaseException:
            self._release_locks()
            raise
        self._queue: queue.Queue[Any] = queue.Queue()
        self._budget = _Budget(max_pending_bytes)
        self._abort = threading.Event()
        self._error: BaseException | None = None
        self._closed = False
        self._finished = False
        # Writer-thread state.
        self._assembling: dict[tuple[int, int], _Assembly] = {}
        self._streams: dict[tuple[int, int], _Stream] = {}
        self._pending_chunks: list[_ChunkRecord] = []
        self._pending_tokens: list[dict[str, Any]] = []
        self._pending_generations: list[dict[str, Any]] = []
        self._last_commit = time.monotonic()
        self._retry_at = 0.0
        # Checksums, NaN/inf counts and renames run beside the writer thread on single-thread
        # lanes: a chunk always goes to the same lane (chunk % lanes), so its running CRC sees
        # its batches in order, and neighbouring chunks are checksummed in parallel.
        self._lanes = [ThreadPoolExecutor(1, thread_name_prefix=f"agnosia-io{i}-{self.run}") for i in range(_LANES)]
        self._item_jobs: list[Future[Any]] = []
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
                f"run {self.run} is being written by shard(s) of another split ({'; '.join(h.describe() for h in others)});"
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
        committed = set(self.ws.rows("SELECT zarr_path, chunk FROM chunks WHERE run = ?", [self.run]))
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

    def owns(self, chunk: int) -> bool:
        """Whether this writer fills ``chunk`` (always, unless it is a shard)."""
        return self.shard is None or self.shard.owns(chunk)

    # ------------------------------------------------------------------ run setup (synchronous)

    def _begin_run(self, info: RunInfo) -> None:
        now = _now()
        versions = {**library_versions(), **dict(info.versions)}
        with db.connect(self.ws.manifest_path, read_only=False, timeout=self._manifest_timeout) as con:
            row = con.execute(
                "SELECT model, revision, adapter, dtype, attn_implementation, config, chunk_samples,"
                " bf16_policy, overflow_policy, intervention FROM runs WHERE run = ?",
                [info.run],
            ).fetchone()
            if row is None:
                if (self.ws.zarr_path / info.run).exists():
                    # Left by a drop-run killed after its commit: no row points at it, and a new
                    # run of that id must not find the old run's chunk files in its arrays.
                    self.ws.remove_run_folder(info.run, remote=False)
                con.execute(
                    "INSERT INTO runs (run, model, revision, adapter, dtype, attn_implementation, versions, config,"
                    " chunk_samples, bf16_policy, overflow_policy, intervention, status, host, pid, created_at,"
                    " updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'running', ?, ?, ?, ?)",
                    [
                        info.run, info.model, info.revision, info.adapter, info.dtype, info.attn_implementation,
                        to_json(versions), to_json(dict(info.config)), info.chunk_samples, info.bf16,
                        info.overflow, to_json(dict(info.intervention)) if info.intervention else None,
                        socket.gethostname(), os.getpid(), now, now,
                    ],
                )
                self._marked = True
                return
            stored = {
                "model": row[0], "revision": row[1], "adapter": row[2], "dtype": row[3],
                "attn_implementation": row[4], "config": json.loads(row[5]) if row[5] else {},
                "chunk_samples": row[6], "bf16": row[7], "overflow": row[8],
                "intervention": json.loads(row[9]) if row[9] else None,
            }
            wanted = info.identity()
            # A key a newer agnosia added with no value (e.g. model.device_map: null) is no difference.
            diff = [d for k in wanted for d in _differences(k, _without_nulls(stored[k]), _without_nulls(wanted[k]))]
            if diff:
                detail = "; ".join(f"{k}: stored {a!r}, this writer {b!r}" + _resume_note(k) for k, a, b in diff)
                raise SpecMismatchError(
                    f"run {info.run} already exists with different settings ({detail}). Resume it with the same"
                    f" settings, choose a new run id, or remove it with `python -m store drop-run {info.run}`"
                )
        # An existing run is marked running only when this writer first changes it: a resume
        # refused by the checks that follow (other stimuli, another codec) leaves its row as it was.
        self._marked = False

    def _mark_running(self, con: Any = None) -> None:
        """Mark an existing run ``running`` (this writer's host and pid) before its first change,
        through ``con`` when the caller holds the write connection already."""
        if self._marked:
            return
        if con is None:
            with db.connect(self.ws.manifest_path, read_only=False, timeout=self._manifest_timeout) as own:
                self._mark_running(own)
            return
        con.execute(
            "UPDATE runs SET status = 'running', host = ?, pid = ?, updated_at = ?, finished_at = NULL WHERE run = ?",
            [socket.gethostname(), os.getpid(), _now(), self.run],
        )
        self._marked = True

    def _load_samples(self) -> list[str] | None:
        rows = self.ws.rows(
            "SELECT array_row, stimulus FROM samples WHERE run = ? ORDER BY array_row", [self.run]
        )
        return [r[1] for r in rows] if rows else None

    @property
    def n_samples(self) -> int:
        if self._stimuli is None:
            raise StoreError(f"run {self.run} has no samples yet: call set_samples(stimulus keys) first")
        return len(self._stimuli)

    def register_stimuli(
        self, rows: Iterable[Mapping[str, Any]], *, dataset: str, set_path: str | os.PathLike[str] | None = None
    ) -> list[str]:
        """Add stimuli (rows in the truth.parquet format) to ``stimuli``; returns their keys
        ``<dataset>/<id>`` in input order. Re-registering identical rows is a no-op; a changed row
        with a known key is refused."""
        check_name("dataset", dataset)
        records = []
        for r in rows:
            if "id" not in r or r["id"] in (None, ""):
                raise StoreError(f"every stimulus row needs an 'id' (the truth.parquet format), got keys {sorted(r)}")
            content = {k: r.get(k) for k in ("id", *_STIMULUS_FIELDS)}
            blob = to_json(content) or ""
            records.append(
                {
                    "stimulus": f"{dataset}/{r['id']}",
                    "dataset": dataset,
                    "id": str(r["id"]),
                    "family": r.get("family"),
                    "split": r.get("split"),
                    "seed": None if r.get("seed") is None else int(r["seed"]),
                    "prompt": r.get("prompt"),
                    "answer": r.get("answer"),
                    "prompts": to_json(r.get("prompts")),
                    "answers": to_json(r.get("answers")),
                    "params": to_json(r.get("params")),
                    "truth": to_json(r.get("truth")),
                    "image": r.get("image"),
                    "set_path": None if set_path is None else str(set_path),
                    "digest": hashlib.sha1(blob.encode()).hexdigest(),
                }
            )
        keys = [str(r["stimulus"]) for r in records]
        if len(set(keys)) != len(keys):
            dup = sorted({k for k in keys if keys.count(k) > 1})[:5]
            raise StoreError(f"stimulus ids must be unique within dataset {dataset}, repeated: {dup}")
        if not records:
            return []
        table = pa.Table.from_pylist(records)
        with db.connect(self.ws.manifest_path, read_only=False, timeout=self._manifest_timeout) as con:
            con.register("new_stimuli", table)
            changed = con.execute(
                "SELECT n.stimulus FROM new_stimuli n JOIN stimuli s USING (stimulus) WHERE s.digest <> n.digest LIMIT 5"
            ).fetchall()
            if changed:
                raise SpecMismatchError(
                    f"stimuli {[c[0] for c in changed]} are already registered with different content (a set"
                    " regenerated in place?). A regenerated set needs a new dataset name (its folder name, or"
                    " dataset=...), or drop the runs that use the old one (python -m store drop-run RUN)"
                )
            con.execute(
                "INSERT INTO stimuli SELECT stimulus, dataset, id, family, split, seed, prompt, answer,"
                " prompts::JSON, answers::JSON, params::JSON, truth::JSON, image, set_path, digest, ? FROM new_stimuli"
                " WHERE stimulus NOT IN (SELECT stimulus FROM stimuli)",
                [_now()],
            )
        return keys

    def register_stimulus_set(self, path: str | os.PathLike[str], *, dataset: str | None = None) -> list[str]:
        """Register a stimulus set folder (``truth.parquet`` inside); dataset defaults to its name."""
        folder = Path(path)
        truth = folder / "truth.parquet"
        if not truth.is_file():
            raise StoreError(
                f"{folder} is not a stimulus set (expected {truth}): write one with `python -m stimuli`"
            )
        rows = pq.read_table(truth).to_pylist()
        return self.register_stimuli(rows, dataset=dataset or folder.name, set_path=folder.resolve())

    def set_samples(self, stimuli: Sequence[str]) -> None:
        """Fix the run's row map: row i of every array holds ``stimuli[i]``. Idempotent on resume."""
        keys = [str(s) for s in stimuli]
        if not keys:
            raise StoreError("set_samples needs at least one stimulus key")
        if len(set(keys)) != len(keys):
            raise StoreError("set_samples: each stimulus may appear once per run (a row map), got repeats")
        if self._stimuli is not None:
            self._check_same_samples(self._stimuli, keys)
            return
        table = pa.table({"array_row": np.arange(len(keys), dtype=np.int64), "stimulus": keys})
        with db.connect(self.ws.manifest_path, read_only=False, timeout=self._manifest_timeout) as con:
            # Asked again inside the write connection: a peer shard may have mapped the rows meanwhile.
            stored = con.execute(
                "SELECT stimulus FROM samples WHERE run = ? ORDER BY array_row", [self.run]
            ).fetchall()
            if stored:
                self._check_same_samples([r[0] for r in stored], keys)
                self._stimuli = keys
                return
            con.register("new_rows", table)
            missing = con.execute(
                "SELECT stimulus FROM new_rows WHERE stimulus NOT IN (SELECT stimulus FROM stimuli) LIMIT 5"
            ).fetchall()
            if missing:
                raise StoreError(
                    f"stimuli {[m[0] for m in missing]} are not registered: call register_stimulus_set(...) or"
                    " register_stimuli(...) first (keys are '<dataset>/<id>')"
                )
            self._mark_running(con)
            con.execute("BEGIN TRANSACTION")
            con.execute("INSERT INTO samples (run, array_row, stimulus) SELECT ?, array_row, stimulus FROM new_rows", [self.run])
            con.execute("UPDATE runs SET n_samples = ? WHERE run = ?", [len(keys), self.run])
            con.execute("COMMIT")
        self._stimuli = keys

    def _check_same_samples(self, stored: list[str], keys: list[str]) -> None:
        if stored != keys:
            first = next((i for i, (a, b) in enumerate(zip(stored, keys, strict=False)) if a != b), min(len(keys), len(stored)))
            raise SpecMismatchError(
                f"run {self.run} already maps {len(stored)} rows; this call gives {len(keys)} and differs"
                f" at row {first}. Resume with the same stimuli in the same order, or use a new run id"
            )

    def array(self, spec: ArraySpec) -> ArrayHandle:
        """Declare (or, on resume, reopen) one array of this run."""
        self._check_open()
        n = self.n_samples
        stored = spec.stored_dtype or default_stored(spec.dtype, self.info.bf16)
        codec = layout.parse_codec(spec.codec, stored)
        if self.shard is not None and spec.chunk_samples not in (None, self.info.chunk_samples):
            raise StoreError(
                f"{spec.tap}.{spec.layer}: a sharded run needs every array at the run's chunk_samples"
                f" ({self.info.chunk_samples}), got {spec.chunk_samples}; a chunk is the unit a shard owns"
            )
        # Zarr chunks never exceed the array, so neither does the recorded chunk size.
        chunk = min(spec.chunk_samples or self.info.chunk_samples, n)
        path = layout.array_path(self.run, spec.tap, spec.layer, spec.site, spec.tokens)
        dims = ("sample", *layout.kind_dims(spec.default_dims(), spec.tokens))
        shape = (n, -1, *spec.shape) if spec.ragged else (n, *spec.shape)
        per_row = int(np.prod(spec.shape))
        info = ArrayInfo(
            run=self.run, tap=spec.tap, layer=spec.layer, site=spec.site, tokens=spec.tokens, module=spec.module,
            zarr_path=path, layout="ragged" if spec.ragged else "dense", shape=shape, dims=dims,
            chunk_samples=chunk, n_chunks=-(-n // chunk), dtype=spec.dtype, stored_dtype=stored,
            codec=codec.name, values_per_row=per_row, bytes=0,
        )
        if path in self._handles:
            existing = self._handles[path]
            _check_same_array(existing.info, info)
            return existing
        known = self.ws.array_info_or_none(self.run, spec.tap, spec.layer, spec.site, spec.tokens)
        if known is not None:
            _check_same_array(known, info)
            committed = {
                r[0] for r in self.ws.rows("SELECT chunk FROM chunks WHERE run = ? AND zarr_path = ?", [self.run, path])
            }
            try:
                node = self._root[path]
            except KeyError:
                if committed:
                    raise StoreError(
                        f"array {path} has {len(committed)} committed chunks in the manifest but is missing on disk:"
                        f" the workspace lost data; run `python -m store verify --data {self.ws.path}` and"
                        f" re-extract (drop-run {self.run})"
                    ) from None
                self._mark_running()
                node = self._create_node(info, codec)
            handle = ArrayHandle(known, codec, node, committed, id(self))
        else:
            with db.connect(self.ws.manifest_path, read_only=False, timeout=self._manifest_timeout) as con:
                # Created while holding the write connection, so a peer shard declaring the same
                # array waits, then finds it declared (and never re-creates it over our chunks).
                row = con.execute(
                    "SELECT count(*) FROM activations WHERE run = ? AND zarr_path = ?", [self.run, path]
                ).fetchone()
                raced = bool(row and row[0])
                if not raced:
                    self._mark_running(con)
                    node = self._create_node(info, codec)
                    con.execute(
                        "INSERT INTO activations (run, tap, layer, site, tokens, module, zarr_path, layout, shape, dims,"
                        " chunk_samples, n_chunks, dtype, stored_dtype, codec, values_per_row, bytes, created_at)"
                        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0, ?)",
                        [
                            info.run, info.tap, info.layer, info.site, info.tokens, info.module, info.zarr_path,
                            info.layout, list(info.shape), list(info.dims), info.chunk_samples, info.n_chunks,
                            info.dtype, info.stored_dtype, info.codec, info.values_per_row, _now(),
                        ],
                    )
                    assign_depths(con, self.run)  # a deeper layer may renumber the run's arrays
            if raced:
                return self.array(spec)  # declared by a peer shard meanwhile: reopen it as on resume
            handle = ArrayHandle(info, codec, node, set(), id(self))
        self._handles[path] = handle
        return handle

    def _create_node(self, info: ArrayInfo, codec: layout.Codec) -> Any:
        attrs: dict[str, Any] = {
            "run": info.run, "tap": info.tap, "layer": info.layer, "site": info.site, "tokens": info.tokens,
            "module": info.module, "layout": info.layout, "source_dtype": info.dtype,
            "stored_dtype": info.stored_dtype, "bf16_policy": self.info.bf16, "overflow_policy": self.info.overflow,
            "codec": info.codec, "lossy": not codec.lossless, "chunk_samples": info.chunk_samples,
            "agnosia_layout": layout.LAYOUT_VERSION,
        }
        if info.stored_dtype == "bfloat16":
            attrs["note"] = "raw bfloat16 bits stored as uint16: float32 = (bits.astype(uint32) << 16).view(float32)"
        if not codec.lossless:
            attrs["keepbits"] = codec.keepbits
        node: zarr.Array | zarr.Group
        with _disk_full_names(self.ws.zarr_path / info.zarr_path):
            if info.layout == "dense":
                node = layout.create_dense(
                    self._root, info.zarr_path, info.n_samples, info.item_shape, info.chunk_samples,
                    info.stored_dtype, codec, info.dims[1:], attrs,
                )
                group = info.zarr_path.rsplit("/", 1)[0]
                coord = layout.ensure_sample_coord(self._root, group, self._stimuli or [])
                for f in coord:
                    layout.fsync_path(f)
                if coord and self.ws.root.remote:
                    self._upload(lambda: self.ws.root.upload(coord))
                    coord[-1].unlink()  # staged like a chunk: once uploaded, only metadata stays local
            else:
                attrs["row_shape"] = list(info.item_shape)
                attrs["blocks"] = "b<k>/rows [n_rows, ...] and b<k>/offsets [n+1] per chunk of chunk_samples samples"
                node = layout.create_ragged_group(self._root, info.zarr_path, attrs)
            layout.fsync_node_chain(self.ws.path, info.zarr_path)
        self._upload(lambda: self.ws.root.upload_meta(info.zarr_path))
        return node

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
        self._check_open()
        check_name("tensor name", name)
        if self.shard is not None and self.shard.index != 0:
            raise StoreError(
                f"run tensors of a sharded run are written by shard 0 (this is shard {self.shard}): skip"
                " write_tensor on the other shards"
            )
        arr, kind = as_numpy(values, dtype)
        if stored_dtype is None:
            stored_dtype = {"float64": "float32", "float32": "float32", "float16": "float16"}.get(kind) or default_stored(
                kind, self.info.bf16
            )
        c = cast(np.ascontiguousarray(arr), kind, stored_dtype, self.info.overflow, f"tensor {name}")
        vals = np.ascontiguousarray(c.values)
        if vals.ndim == 0:
            vals = vals.reshape(1)
        path = f"{self.run}/_tensors/{name}"
        per_row = max(1, vals[:1].nbytes)
        crc = crc32c(vals)
        known = self.ws.rows("SELECT shape, stored_dtype, crc32c FROM tensors WHERE run = ? AND name = ?",
                             [self.run, name])
        if known:
            shape, stored, known_crc = known[0]
            if (list(shape) == list(vals.shape) and stored == stored_dtype and known_crc == crc
                    and self.ws.root.has(path)):
                return  # a resume: the committed copy is this tensor; rewriting it could leave a half-written one
        self._mark_running()
        if known:
            # Forget the old copy before its files change: a kill mid-write leaves no row, not a broken one.
            with db.connect(self.ws.manifest_path, read_only=False, timeout=self._manifest_timeout) as con:
                con.execute("DELETE FROM tensors WHERE run = ? AND name = ?", [self.run, name])
        with _disk_full_names(self.ws.zarr_path / path):
            arr_z = self._root.create_array(
                path,
                shape=vals.shape,
                chunks=(max(1, min(vals.shape[0], (16 << 20) // per_row)), *vals.shape[1:]),
                dtype=numpy_dtype(stored_dtype),
                compressors=None,
                filters=None,
                fill_value=0,
                chunk_key_encoding={"name": "default", "separator": "."},
                overwrite=True,
                attributes={"run": self.run, "name": name, "module": module, "source_dtype": kind,
                            "stored_dtype": stored_dtype},
                config={"write_empty_chunks": True},
            )
            arr_z[...] = vals
            folder = self.ws.zarr_path / path
            files = sorted(folder.iterdir())
            for f in files:
                layout.fsync_path(f)
            layout.fsync_node_chain(self.ws.path, path)
        nbytes = sum(f.stat().st_size for f in files if f.name != "zarr.json")
        def upload() -> None:
            self.ws.root.upload(files)
            self.ws.root.upload_meta(path)

        self._upload(upload)
        with db.connect(self.ws.manifest_path, read_only=False, timeout=self._manifest_timeout) as con:
            con.execute("BEGIN TRANSACTION")
            con.execute("DELETE FROM tensors WHERE run = ? AND name = ?", [self.run, name])
            con.execute(
                "INSERT INTO tensors VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [self.run, name, module, path, list(vals.shape), kind, stored_dtype, nbytes, crc, _now()],
            )
            con.execute("COMMIT")
        if self.ws.root.remote:
            _unstage(files)

    # ------------------------------------------------------------------ what is left to do

    def todo(self) -> list[range]:
        """Row ranges not yet committed in every declared array (declare all arrays first).

        Ranges are unions of whole chunks, so writing them in order fills whole blocks.
        """
        n = self.n_samples
        if not self._handles and self.shard is None:
            return [range(0, n)]
        need = np.zeros(n, dtype=bool)
        if not self._handles:
            for k in range(-(-n // min(self.info.chunk_samples, n))):
                if self.owns(k):
                    r = range(k * self.info.chunk_samples, min((k + 1) * self.info.chunk_samples, n))
                    need[r.start : r.stop] = True
        for h in self._handles.values():
            for k in range(h.info.n_chunks):
                if k not in h.committed and self.owns(k):
                    r = h.info.chunk_rows(k)
                    need[r.start : r.stop] = True
        out, i = [], 0
        while i < n:
            if need[i]:
                j = i
                while j < n and need[j]:
                    j += 1
                out.append(range(i, j))
                i = j
            else:
                i += 1
        return out

    # ------------------------------------------------------------------ producer side

    def write(self, handle: ArrayHandle, start: int, values: Any) -> None:
        """Queue rows ``start .. start+len(values)`` of a dense array (numpy or torch, any device)."""
        self._check_open()
        self._check_handle(handle)
        if handle.ragged:
            raise StoreError(f"{handle.info.key()} is ragged: use write_ragged(handle, start, list_of_arrays)")
        arr, kind = as_numpy(values, handle.info.dtype)
        want = handle.info.item_shape
        if arr.ndim != len(want) + 1 or tuple(arr.shape[1:]) != want:
            raise StoreError(
                f"{handle.info.key()}: expected a batch of shape [batch, {', '.join(map(str, want))}], got"
                f" {list(arr.shape)}; reshape or slice the tap output to the declared per-sample shape"
            )
        self._check_rows(start, arr.shape[0])
        self._put(("data", handle, int(start), arr, kind), arr.nbytes)

    def write_ragged(self, handle: ArrayHandle, start: int, values: Sequence[Any] | Ragged) -> None:
        """Queue variable-length rows: ``values[i]`` (shape [n_i, *row_shape]) belongs to row start+i."""
        self._check_open()
        self._check_handle(handle)
        if not handle.ragged:
            raise StoreError(f"{handle.info.key()} is dense: use write(handle, start, batch)")
        items = values.split() if isinstance(values, Ragged) else list(values)
        want = handle.info.item_shape
        converted, kinds, nbytes = [], set(), 0
        for i, v in enumerate(items):
            arr, kind = as_numpy(v, handle.info.dtype)
            if arr.ndim != len(want) + 1 or tuple(arr.shape[1:]) != want:
                raise StoreError(
                    f"{handle.info.key()}: sample {start + i} must have shape [n_rows, {', '.join(map(str, want))}],"
                    f" got {list(arr.shape)}"
                )
            converted.append(arr)
            kinds.add(kind)
            nbytes += arr.nbytes
        if len(kinds) > 1:
            raise StoreError(f"{handle.info.key()}: one batch mixes dtypes {sorted(kinds)}; hand over one dtype")
        self._check_rows(start, len(converted))
        self._put(("ragged", handle, int(start), converted, kinds.pop() if kinds else handle.info.dtype), nbytes)

    def record_tokens(self, start: int, spans: Sequence[TokenSpans]) -> None:
        """Queue the token spans of rows ``start .. start+len(spans)``."""
        self._check_open()
        self._check_rows(start, len(spans))
        now = _now()
        rows = []
        for i, s in enumerate(spans):
            if not isinstance(s, TokenSpans):
                raise StoreError(f"record_tokens takes TokenSpans, got {type(s).__name__} at row {start + i}")
            rows.append({
                "array_row": start + i, "seq_len": s.seq_len, "image_start": s.image_start,
                "image_count": s.image_count, "grid_h": s.grid_h, "grid_w": s.grid_w,
                "last_prompt": s.last_prompt, "answer_start": s.answer_start, "answer_count": s.answer_count,
                "spans": to_json(dict(s.extra)) if s.extra else None, "recorded_at": now,
            })
        self._put(("tokens", rows), 0)

    def record_generations(self, start: int, generations: Sequence[Generation]) -> None:
        """Queue what the model generated for rows ``start .. start+len(generations)``."""
        self._check_open()
        self._check_rows(start, len(generations))
        stimuli = self._stimuli or []
        now = _now()
        rows = []
        for i, g in enumerate(generations):
            if not isinstance(g, Generation):
                raise StoreError(f"record_generations takes Generation, got {type(g).__name__} at row {start + i}")
            rows.append({
                "run": self.run, "stimulus": stimuli[start + i], "array_row": start + i, "text": g.text,
                "prediction": to_json(g.prediction), "parse_ok": g.parse_ok, "correct": g.correct,
                "score": None if g.score is None else float(g.score), "metrics": to_json(g.metrics),
                "n_tokens": g.n_tokens, "recorded_at": now, "stop_reason": g.stop_reason, "answer_kind": g.kind,
            })
        self._put(("generations", rows), 0)

    def write_batch(
        self,
        start: int,
        arrays: Mapping[ArrayHandle, Any],
        *,
        tokens: Sequence[TokenSpans] | None = None,
        generations: Sequence[Generation] | None = None,
    ) -> None:
        """One model batch: records first, then arrays, so a committed chunk implies its records are."""
        if tokens is not None:
            self.record_tokens(start, tokens)
        if generations is not None:
            self.record_generations(start, generations)
        for handle, values in arrays.items():
            if handle.ragged:
                self.write_ragged(handle, start, values)
            else:
                self.write(handle, start, values)

    def flush(self) -> None:
        """Block until everything queued so far is durable and committed to the manifest."""
        self._check_open()
        done = threading.Event()
        self._queue.put(("flush", done, None))
        self._wait(done)
        self._raise_if_failed()

    def finish(self, *, partial_ok: bool = False) -> None:
        """Flush and, if every chunk of every declared array is committed, mark the run finished
        (in the same transaction as the last chunks)."""
        self._check_open()
        done = threading.Event()
        self._queue.put(("flush", done, {"partial_ok": partial_ok}))
        self._wait(done)
        self._raise_if_failed()
        missing = self._missing()
        if missing and not partial_ok:
            listed = ", ".join(f"{k} ({v} chunks)" for k, v in list(missing.items())[:5])
            raise StoreError(
                f"run {self.run} is not complete: {sum(missing.values())} chunk(s) not written in {listed}."
                " Write the rows todo() names, or pass partial_ok=True to finish anyway"
            )
        self._finished = True

    def _wait(self, done: threading.Event) -> None:
        while not done.wait(0.5):
            if not self._thread.is_alive():
                raise WriterError(f"the background writer of run {self.run} stopped unexpectedly") from self._error

    def _missing(self, extra: list[_ChunkRecord] | None = None) -> dict[str, int]:
        done: dict[int, set[int]] = {id(h): set(h.committed) for h in self._handles.values()}
        for rec in extra or []:
            done[id(rec.handle)].add(rec.chunk)
        out = {}
        for h in self._handles.values():
            mine = sum(1 for k in range(h.info.n_chunks) if self.owns(k) and k not in done[id(h)])
            if mine:
                out[h.info.key()] = mine
        return out

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
            self._queue.put(_STOP)
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
                with db.connect(self.ws.manifest_path, read_only=False, timeout=self._manifest_timeout) as con:
                    con.execute(
                        "UPDATE runs SET status = CASE WHEN status = 'finished' AND ? IS NULL THEN 'finished'"
                        " ELSE coalesce(?, 'stopped') END, updated_at = ? WHERE run = ?",
                        [status, status, _now(), self.run],
                    )
            except StoreError as err:
                if self._error is None and not producer_failed:
                    self._error = err
        finally:
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

    # ------------------------------------------------------------------ helpers (producer side)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"the writer of run {self.run} is closed; open a new one with ws.writer(...)")
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            cls = DiskFullError if isinstance(self._error, DiskFullError) else WriterError
            raise cls(f"the background writer of run {self.run} failed: {self._error}") from self._error

    def _check_handle(self, handle: ArrayHandle) -> None:
        if not isinstance(handle, ArrayHandle) or handle.writer_id != id(self):
            raise StoreError("write takes an ArrayHandle returned by this writer's array(spec)")

    def _check_rows(self, start: int, count: int) -> None:
        n = self.n_samples
        if count < 1 or start < 0 or start + count > n:
            raise StoreError(
                f"rows [{start}, {start + count}) must lie inside the run's {n} samples [0, {n}) and be non-empty"
            )
        if self.shard is not None:
            size = min(self.info.chunk_samples, n)
            foreign = [k for k in range(start // size, (start + count - 1) // size + 1) if not self.shard.owns(k)]
            if foreign:
                raise StoreError(
                    f"rows [{start}, {start + count}) reach chunk(s) {foreign[:5]} of another shard (this is shard"
                    f" {self.shard}, chunks of {size} samples): write only the rows todo() names"
                )

    def _put(self, item: tuple[Any, ...], nbytes: int) -> None:
        self._mark_running()
        self.stats.producer_wait_s += self._budget.take(nbytes, self._abort)
        self._raise_if_failed()
        self._queue.put((*item, nbytes))

    # ------------------------------------------------------------------ writer thread

    def _loop(self) -> None:
        while True:
            timeout = None
            if self._has_pending():
                due = self._last_commit + (self._min_gap if self._pending_chunks else self._commit_every)
                timeout = max(0.0, max(due, self._retry_at) - time.monotonic())
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                self._try_commit(blocking=False)
                continue
            if item is _STOP:
                self._finalize()
                return
            kind = item[0]
            if kind == "flush":
                try:
                    finishing = item[2]
                    if finishing is not None and self._error is None:
                        self._commit(self._manifest_timeout, finish=finishing["partial_ok"])
                    elif self._has_pending():
                        self._try_commit(blocking=True)
                except BaseException as err:  # noqa: BLE001 - surfaced to the producer
                    self._fail(err)
                item[1].set()
                continue
            nbytes = item[-1]
            try:
                if self._error is None:
                    self._handle(item)
            except BaseException as err:  # noqa: BLE001 - surfaced to the producer
                where = self.ws.zarr_path / item[1].info.zarr_path if kind in ("data", "ragged") else None
                self._fail(err, where=where)
            finally:
                # The batch's memory counts against the budget until its checksums are done.
                self._release_after(self._item_jobs, nbytes)
                self._item_jobs = []
            if self._has_pending() and time.monotonic() >= self._retry_at:
                elapsed = time.monotonic() - self._last_commit
                if elapsed >= self._commit_every or (
                    self._pending_chunks and self._queue.empty() and elapsed >= self._min_gap
                ):
                    self._try_commit(blocking=False)

    def _lane(self, chunk: int) -> ThreadPoolExecutor:
        return self._lanes[chunk % len(self._lanes)]

    def _release_after(self, jobs: list[Future[Any]], nbytes: int) -> None:
        if not jobs:
            self._budget.give(nbytes)
            return
        left = [len(jobs)]
        guard = threading.Lock()

        def done(_: Future[Any]) -> None:
            with guard:
                left[0] -= 1
                last = left[0] == 0
            if last:
                self._budget.give(nbytes)

        for job in jobs:
            job.add_done_callback(done)

    def _fail(self, err: BaseException, where: Path | None = None) -> None:
        if self._error is None:
            if is_disk_full(err) and not isinstance(err, DiskFullError):
                full = disk_full_error(getattr(err, "filename", None) or where or self.ws.path, err)
                full.__cause__ = err
                err = full
            self._error = err
        self._abort.set()

    def _finalize(self) -> None:
        dropped = len(self._assembling) + len(self._streams)
        self.stats.partial_chunks_dropped += dropped
        self._assembling.clear()
        for st in self._streams.values():
            os.close(st.fd)
            st.tmp.unlink(missing_ok=True)
        self._streams.clear()
        try:
            if self._has_pending():
                self._try_commit(blocking=True)
        except BaseException as err:  # noqa: BLE001
            self._fail(err)

    def _has_pending(self) -> bool:
        return bool(self._pending_chunks or self._pending_tokens or self._pending_generations)

    def _handle(self, item: tuple[Any, ...]) -> None:
        kind = item[0]
        if kind == "tokens":
            self._pending_tokens.extend(item[1])
        elif kind == "generations":
            self._pending_generations.extend(item[1])
        elif kind in ("data", "ragged"):
            _, handle, start, values, src_kind, _ = item
            self._assemble(handle, start, values, src_kind, ragged=kind == "ragged")
        else:  # pragma: no cover - internal
            raise AssertionError(kind)

    def _assemble(self, h: ArrayHandle, start: int, values: Any, kind: str, *, ragged: bool) -> None:
        info = h.info
        count = len(values)
        cs = info.chunk_samples
        pos = 0
        while pos < count:
            row = start + pos
            k = row // cs
            rows = info.chunk_rows(k)
            take = min(count - pos, rows.stop - row)
            if k in h.committed:
                pos += take
                continue
            key = (id(h), k)
            if not ragged and h.codec.name == "none":
                self._stream(h, k, rows, row - rows.start, values[pos : pos + take], kind)
                pos += take
                continue
            a = self._assembling.get(key)
            if a is None and not ragged and row == rows.start and take == len(rows):
                # A batch that is exactly one block needs no copy.
                self._write_chunk(h, k, rows, values[pos : pos + take], kind)
                pos += take
                continue
            if a is None:
                if ragged:
                    a = _Assembly(rows, kind, None, [None] * len(rows), np.zeros(len(rows), bool))
                else:
                    buf = np.empty((len(rows), *info.item_shape), dtype=values.dtype)
                    a = _Assembly(rows, kind, buf, None, np.zeros(len(rows), bool))
                self._assembling[key] = a
            if a.kind != kind:
                raise StoreError(f"{info.key()}: rows of one chunk arrived as {a.kind} and {kind}; hand over one dtype")
            lo = row - rows.start
            if ragged:
                assert a.ragged is not None
                for j in range(take):
                    a.ragged[lo + j] = values[pos + j]
            else:
                assert a.dense is not None
                a.dense[lo : lo + take] = values[pos : pos + take]
            a.filled[lo : lo + take] = True
            pos += take
            if a.complete():
                del self._assembling[key]
                block = a.dense if not ragged else a.ragged
                self._write_chunk(h, k, rows, block, kind)

    def _stream(self, h: ArrayHandle, k: int, rows: range, lo: int, block: np.ndarray, kind: str) -> None:
        info = h.info
        key = (id(h), k)
        st = self._streams.get(key)
        if st is None:
            final = layout.dense_chunk_file(self.ws.path, info.zarr_path, len(info.shape), k)
            tmp = final.with_name(f"{final.name}.{os.getpid()}.partial")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            st = _Stream(rows, kind, tmp, final, fd, np.zeros(len(rows), bool))
            self._streams[key] = st
        if st.kind != kind:
            raise StoreError(f"{info.key()}: rows of one chunk arrived as {st.kind} and {kind}; hand over one dtype")
        where = f"{info.key()} chunk {k} (rows {rows.start + lo}-{rows.start + lo + len(block) - 1})"
        same = kind == info.stored_dtype
        if same:
            # No cast, so nothing can overflow: NaN/inf are counted off the writer thread.
            vals = np.ascontiguousarray(block)
        else:
            c = cast(block, kind, info.stored_dtype, self.info.overflow, where)
            vals = np.ascontiguousarray(c.values)
            st.n_nonfinite += c.n_nonfinite
            st.n_clipped += c.n_clipped
        view = _bytes_view(vals)
        row_bytes = len(view) // len(block)
        try:
            _pwrite_all(st.fd, view, lo * row_bytes)
        except OSError as err:  # name the chunk file: a full disk is reported with its path
            raise OSError(err.errno, err.strerror, str(st.final)) from err
        in_order = st.in_order and lo == st.crc_rows
        if not in_order:
            st.in_order = False
        else:
            st.crc_rows += len(block)
        if in_order or same:
            # The single pool thread runs jobs in order, so the running crc sees rows in order.
            self._item_jobs.append(
                self._lane(k).submit(_stream_stats, st, vals if same else None, vals if in_order else None)
            )
        st.filled[lo : lo + len(block)] = True
        if not st.filled.all():
            return
        del self._streams[key]
        full = info.chunk_samples * row_bytes
        if len(rows) < info.chunk_samples:
            os.ftruncate(st.fd, full)  # Zarr stores edge chunks full-size; the tail reads as zeros
        written = self._lane(k).submit(_seal, st, len(rows) * row_bytes)
        self._pending_chunks.append(
            _ChunkRecord(
                h, k, rows.start, rows.stop, len(rows), full, written, [st.final], [st.final.parent]
            )
        )
        self.stats.chunks_written += 1
        self.stats.bytes_written += full

    def _write_chunk(self, h: ArrayHandle, k: int, rows: range, block: Any, kind: str) -> None:
        info = h.info
        where = f"{info.key()} chunk {k} (rows {rows.start}-{rows.stop - 1})"
        if info.layout == "dense":
            c = cast(block, kind, info.stored_dtype, self.info.overflow, where)
            vals = np.ascontiguousarray(h.codec.prepare(c.values, info.stored_dtype))
            h.node[rows.start : rows.stop] = vals
            files = [layout.dense_chunk_file(self.ws.path, info.zarr_path, len(info.shape), k)]
            new_dirs: list[Path] = []
            n_rows = len(rows)
            nbytes = files[0].stat().st_size
        else:
            lengths = np.array([len(b) for b in block], dtype=np.int64)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            flat = (
                np.concatenate(block, axis=0)
                if int(offsets[-1])
                else np.empty((0, *info.item_shape), dtype=block[0].dtype)
            )
            c = cast(flat, kind, info.stored_dtype, self.info.overflow, where)
            vals = np.ascontiguousarray(h.codec.prepare(c.values, info.stored_dtype))
            files = layout.write_ragged_block(h.node, k, vals, offsets, h.codec, info.dims[1:])
            # The block's folder is new: its entry in the array's folder must be durable too.
            new_dirs = [self.ws.zarr_path / info.zarr_path]
            n_rows = int(offsets[-1])
            nbytes = sum(f.stat().st_size for f in files if f.name != "zarr.json")
        ragged_offsets = None if info.layout == "dense" else offsets
        written = self._lane(k).submit(_crc, vals, c.n_nonfinite, c.n_clipped, ragged_offsets)
        self._item_jobs.append(written)
        self._pending_chunks.append(
            _ChunkRecord(
                h, k, rows.start, rows.stop, n_rows, nbytes, written,
                files, [*dict.fromkeys(f.parent for f in files), *new_dirs],
            )
        )
        self.stats.chunks_written += 1
        self.stats.bytes_written += nbytes

    def _try_commit(self, *, blocking: bool) -> None:
        """Commit what is pending. Not blocking: a busy manifest is retried in 0.5 s, any other
        failure is recorded for the producer (and retried too: durable chunks stay committable)."""
        try:
            # Not blocking: give readers a second to let go; data keeps queueing meanwhile.
            self._commit(self._manifest_timeout if blocking else 1.0)
            self._retry_at = 0.0
        except ManifestBusyError:
            self._retry_at = time.monotonic() + 0.5
            if blocking:
                raise
        except BaseException as err:  # noqa: BLE001 - surfaced to the producer
            self._retry_at = time.monotonic() + 0.5
            self._fail(err)
            if blocking:
                raise

    def _commit(self, timeout: float, finish: bool | None = None) -> None:
        """One short transaction for everything pending; ``finish`` (partial_ok) also closes the run."""
        started = time.perf_counter()
        chunks = list(self._pending_chunks)
        tokens = list(self._pending_tokens)
        gens = list(self._pending_generations)
        stats = [rec.written.result() for rec in chunks]
        # Bytes durable before the manifest says so: every file, then every folder entry.
        # Concurrent fsyncs let the file system group them into fewer journal commits.
        files = list(dict.fromkeys(f for rec in chunks for f in rec.files))
        if len(files) > 1:
            list(self._syncers.map(layout.fsync_path, files))
        elif files:
            layout.fsync_path(files[0])
        for folder in dict.fromkeys(d for rec in chunks for d in rec.dirs):
            layout.fsync_path(folder)
        # An object store shows an object only once it is whole: uploaded, then committed.
        self._upload(lambda: self.ws.root.upload(files))
        now = _now()
        with db.connect(self.ws.manifest_path, read_only=False, timeout=timeout) as con:
            con.execute("BEGIN TRANSACTION")
            try:
                if chunks:
                    con.register("new_chunks", pa.table({
                        "zarr_path": [r.handle.info.zarr_path for r in chunks],
                        "chunk": pa.array([r.chunk for r in chunks], pa.int32()),
                        "row_start": pa.array([r.row_start for r in chunks], pa.int64()),
                        "row_stop": pa.array([r.row_stop for r in chunks], pa.int64()),
                        "n_rows": pa.array([r.n_rows for r in chunks], pa.int64()),
                        "nbytes": pa.array([r.nbytes for r in chunks], pa.int64()),
                        "crc32c": pa.array([x[0] for x in stats], pa.int64()),
                        "n_nonfinite": pa.array([x[1] for x in stats], pa.int64()),
                        "n_clipped": pa.array([x[2] for x in stats], pa.int64()),
                        "offsets_crc32c": pa.array([x[3] for x in stats], pa.int64()),
                    }))
                    con.execute(
                        "INSERT INTO chunks (run, zarr_path, chunk, row_start, row_stop, n_rows, nbytes, crc32c,"
                        " n_nonfinite, n_clipped, committed_at, offsets_crc32c) SELECT ?, zarr_path, chunk, row_start,"
                        " row_stop, n_rows, nbytes, crc32c, n_nonfinite, n_clipped, ?, offsets_crc32c FROM new_chunks"
                        " ON CONFLICT DO NOTHING",
                        [self.run, now],
                    )
                    con.execute(
                        "UPDATE activations SET bytes = s.b FROM (SELECT zarr_path, sum(nbytes) AS b FROM chunks"
                        " WHERE run = ? GROUP BY zarr_path) s WHERE activations.run = ? AND activations.zarr_path = s.zarr_path"
                        " AND activations.zarr_path IN (SELECT zarr_path FROM new_chunks)",
                        [self.run, self.run],
                    )
                    con.unregister("new_chunks")
                if tokens:
                    con.register("new_tokens", pa.Table.from_pylist(tokens))
                    con.execute(
                        "UPDATE samples SET seq_len = t.seq_len, image_start = t.image_start, image_count = t.image_count,"
                        " grid_h = t.grid_h, grid_w = t.grid_w, last_prompt = t.last_prompt, answer_start = t.answer_start,"
                        " answer_count = t.answer_count, spans = t.spans::JSON, recorded_at = t.recorded_at"
                        " FROM new_tokens t WHERE samples.run = ? AND samples.array_row = t.array_row",
                        [self.run],
                    )
                    con.unregister("new_tokens")
                if gens:
                    con.register("new_gens", pa.Table.from_pylist(gens))
                    con.execute(
                        "DELETE FROM generations WHERE run = ? AND stimulus IN (SELECT stimulus FROM new_gens)", [self.run]
                    )
                    # Last one wins when a row was generated twice before one commit.
                    con.execute(
                        "INSERT INTO generations (run, stimulus, array_row, text, prediction, parse_ok, correct, score,"
                        " metrics, n_tokens, recorded_at, stop_reason, answer_kind)"
                        " SELECT run, stimulus, array_row, text, prediction::JSON, parse_ok, correct,"
                        " score, metrics::JSON, n_tokens, recorded_at, stop_reason, answer_kind FROM new_gens"
                        " QUALIFY row_number() OVER (PARTITION BY stimulus ORDER BY recorded_at DESC) = 1"
                    )
                    con.unregister("new_gens")
                if finish is not None and (finish or self._run_complete(con, chunks)):
                    con.execute(
                        "UPDATE runs SET status = 'finished', finished_at = ?, updated_at = ? WHERE run = ?",
                        [now, now, self.run],
                    )
                else:
                    con.execute("UPDATE runs SET updated_at = ? WHERE run = ?", [now, self.run])
                con.execute("COMMIT")
            except BaseException:
                db.rollback(con)  # keeps the failed statement's error (e.g. a full disk), not ROLLBACK's
                raise
        for rec in chunks:
            rec.handle.committed.add(rec.chunk)
        if self.ws.root.remote:
            _unstage(files)
        del self._pending_chunks[: len(chunks)]
        del self._pending_tokens[: len(tokens)]
        del self._pending_generations[: len(gens)]
        self._last_commit = time.monotonic()
        self.stats.commits += 1
        self.stats.commit_s += time.perf_counter() - started


    def _run_complete(self, con: Any, chunks: list[_ChunkRecord]) -> bool:
        """Whether every chunk of the run is committed once ``chunks`` are (asked of the manifest
        for a shard, whose peers commit the chunks it does not own)."""
        if self._missing(chunks):
            return False
        if self.shard is None:
            return True
        row = con.execute(
            "SELECT count(*) FROM activations a WHERE a.run = ? AND a.n_chunks >"
            " (SELECT count(*) FROM chunks c WHERE c.run = a.run AND c.zarr_path = a.zarr_path)",
            [self.run],
        ).fetchone()
        return not (row and row[0])


    def _upload(self, send: Callable[[], Any]) -> None:
        if not self.ws.root.remote:
            return
        started = time.perf_counter()
        try:
            send()
        except OSError as err:
            raise location.describe_remote_error(str(self.ws.root.url), err) from err
        self.stats.upload_s += time.perf_counter() - started


def _unstage(files: list[Path]) -> None:
    """Remove staged chunk data once it is committed remotely (metadata stays, for reopening)."""
    for f in files:
        if f.name != "zarr.json":
            f.unlink(missing_ok=True)


def _without_nulls(value: Any) -> Any:
    """``value`` with every mapping entry whose value is None dropped, recursively."""
    if isinstance(value, Mapping):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


# Why a setting that looks harmless still blocks a resume (config holds the extraction manifest).
_RESUME_NOTES = {
    "config.batch_size": "a sample's answer-token values depend on the batch it shares (its padding),"
                         " so a resume must keep the original batch_size",
}


def _resume_note(key: str) -> str:
    return f" — {_RESUME_NOTES[key]}" if key in _RESUME_NOTES else ""


def _differences(key: str, stored: Any, wanted: Any) -> list[tuple[str, Any, Any]]:
    """(dotted key, stored, wanted) of every leaf where two settings differ: the one key that
    changed, not two whole configs."""
    if isinstance(stored, dict) and isinstance(wanted, dict):
        return [d for k in sorted(set(stored) | set(wanted), key=str)
                for d in _differences(f"{key}.{k}", stored.get(k), wanted.get(k))]
    return [] if stored == wanted else [(key, stored, wanted)]


def _check_same_array(known: ArrayInfo, wanted: ArrayInfo) -> None:
    fields = ("layout", "shape", "chunk_samples", "dtype", "stored_dtype", "codec")
    diff = [f for f in fields if getattr(known, f) != getattr(wanted, f)]
    if diff:
        detail = "; ".join(f"{f}: stored {getattr(known, f)!r}, now {getattr(wanted, f)!r}" for f in diff)
        raise SpecMismatchError(
            f"array {known.key()} already exists with a different layout ({detail}). Resume with the same"
            " ArraySpec, or store it under another site/tokens name"
        )


@contextmanager
def _disk_full_names(where: Path) -> Iterator[None]:
    """Turn a full disk met while writing ``where`` (synchronously) into a DiskFullError naming it."""
    try:
        yield
    except OSError as err:
        if is_disk_full(err):
            raise disk_full_error(getattr(err, "filename", None) or where, err) from err
        raise


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _crc_of_file(path: Path, nbytes: int) -> int:
    crc = 0
    with open(path, "rb") as f:
        while nbytes > 0:
            block = f.read(min(nbytes, 16 << 20))
            if not block:
                break
            crc = crc32c(block, crc)
            nbytes -= len(block)
    return crc


def _stream_stats(st: _Stream, values: np.ndarray | None, stored: np.ndarray | None) -> None:
    if values is not None:
        st.n_nonfinite += count_nonfinite(values, st.kind)
    if stored is not None:
        st.crc = crc32c(stored, st.crc)


def _seal(st: _Stream, nbytes: int) -> tuple[int, int, int, int | None]:
    """Close the finished temporary file and rename it into place; returns its CRC-32C.

    Renaming before fsync is safe here: a chunk counts only once the commit has fsynced it, and
    a crash before that leaves an uncommitted file that the resumed run overwrites.
    """
    try:
        if not st.in_order:
            st.crc = _crc_of_file(st.tmp, nbytes)
        if _FADV_DONTNEED is not None:
            # Start writeback now (Linux: DONTNEED on dirty pages queues them and keeps them
            # cached), so the commit's fsync finds little left to do: the disk works while
            # the next chunks are being written instead of after.
            os.posix_fadvise(st.fd, 0, 0, _FADV_DONTNEED)
    finally:
        os.close(st.fd)
    os.replace(st.tmp, st.final)
    return st.crc, st.n_nonfinite, st.n_clipped, None


def _crc(values: np.ndarray, n_nonfinite: int, n_clipped: int,
         offsets: np.ndarray | None) -> tuple[int, int, int, int | None]:
    return crc32c(values), n_nonfinite, n_clipped, None if offsets is None else crc32c(offsets.astype(np.int64))


def _bytes_view(values: np.ndarray) -> memoryview:
    return np.ascontiguousarray(values).reshape(-1).view(np.uint8).data


def _now() -> Any:
    import datetime as _dt

    return _dt.datetime.now()
