"""The worker half of a writer: chunks written where the arrays live, the manifest left to the client.

On a cluster (extract/cluster/) the client holds the run's :class:`store.writer.Writer` (the one
writer of the manifest) and each worker a :class:`ChunkWriter` for the rows of its task. The
chunk writer has the writer's producer and writer thread — the same validation, assembly,
streaming, casts and checksums, so a chunk's bytes are those a single process writes — with an
:class:`store.writer.outbox.Outbox` in place of the committer: the chunks are made durable where
the arrays live (fsynced on a shared file system; uploaded to an object store from a staging
folder of the worker's own) and handed back as :class:`store.writer.outbox.Written`.

Nothing here takes a lock or opens DuckDB. Two workers never hold the same chunk unless one task
ran twice (its first worker died after writing): both write the same bytes, each through a file
renamed into place (or an object uploaded whole), and the client commits the chunk once.
"""

from __future__ import annotations

import queue
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import zarr

from store import arrays as layout
from store.chunks import Budget
from store.errors import StoreError
from store.location import ArrayRoot
from store.records import ArrayInfo, Generation, RunInfo, TokenSpans
from store.workspace import Workspace
from store.writer.context import Failure, RunContext
from store.writer.handles import ArrayHandle, WriterStats
from store.writer.outbox import Outbox, Written
from store.writer.pipeline import Cadence, Pipeline
from store.writer.producer import Producer
from store.writer.site import ArraySite
from store.writer.state import Handover


class GroupRows:
    """The run's rows as a worker's producer sees them: the arrays it was given and the stimuli of
    its task's rows (the client holds the whole row map)."""

    def __init__(self, n_samples: int, stimuli: Mapping[int, str]) -> None:
        self._n = n_samples
        self._stimuli = dict(stimuli)
        self.by_path: dict[str, ArrayHandle] = {}

    @property
    def n_samples(self) -> int:
        return self._n

    def stimulus(self, row: int) -> str:
        try:
            return self._stimuli[row]
        except KeyError:
            raise StoreError(f"row {row} is not one of this task's rows ({min(self._stimuli, default=0)}.."
                             f"{max(self._stimuli, default=-1)}): write only the rows the task names") from None

    def handles(self) -> list[ArrayHandle]:
        return list(self.by_path.values())

    def declared(self, handle: Any) -> bool:
        return isinstance(handle, ArrayHandle) and handle.writer_id == id(self)

    def chunk_for(self, requested: int) -> int:
        raise StoreError("a worker's chunk writer is given its arrays; it declares none")

    def mark_running(self, con: Any = None) -> None:
        """The client marks the run: a worker changes no manifest row."""


class ChunkWriter:
    """Write chunks of a run's declared arrays from a worker, for the client to commit.

    ``arrays``: the run's arrays as the client declared them; ``stimuli``: array row -> stimulus key
    for the rows this writer will be handed. ``write_batch`` is :meth:`store.writer.Writer.write_batch`;
    :meth:`close` makes every whole chunk durable and returns what to commit.
    """

    def __init__(self, site: ArraySite, info: RunInfo, arrays: Sequence[ArrayInfo], stimuli: Mapping[int, str], *,
                 max_pending_bytes: int = 256 << 20) -> None:
        if not arrays:
            raise StoreError("a chunk writer needs the run's declared arrays; got none")
        self._staging: Path | None = None
        if site.url is None:
            base = Path(site.workspace)
        else:
            base = self._staging = Path(tempfile.mkdtemp(prefix=f"agnosia-{info.run}-"))
            for rel, data in (site.metadata or {}).items():
                meta = base / layout.ZARR_DIR / rel
                meta.parent.mkdir(parents=True, exist_ok=True)
                meta.write_bytes(data)
        ws = Workspace(base)
        ws.root = ArrayRoot(ws.zarr_path, site.url)
        if not (ws.zarr_path / "zarr.json").is_file():
            self._remove_staging()
            raise StoreError(f"no arrays at {ws.zarr_path}: a worker writes into the workspace the client opened, so"
                             " --data must name a folder every worker sees at the same path (a shared file system),"
                             " or the workspace's arrays must live in an object store (--arrays s3://...)")
        self._rows = GroupRows(arrays[0].n_samples, stimuli)
        root = zarr.open_group(str(ws.zarr_path), mode="r+", zarr_format=3)
        for a in arrays:
            node = root[a.zarr_path]
            node = node.with_config(layout.WRITE_EMPTY) if isinstance(node, zarr.Array) else node
            self._rows.by_path[a.zarr_path] = ArrayHandle(a, layout.parse_codec(a.codec, a.stored_dtype), node,
                                                          set(), id(self._rows))
        self.stats = WriterStats()
        syncers = ThreadPoolExecutor(4, thread_name_prefix=f"agnosia-fsync-{info.run}")
        ctx = RunContext(ws, info, None, self.stats, None, 0.0, syncers)
        self._ctx = ctx
        self._failure = Failure(info.run, ws.path)
        handover = Handover(queue.Queue(), Budget(max_pending_bytes))
        self._producer = Producer(ctx, self._rows, handover, self._failure)
        self._outbox = Outbox(ctx)
        self._pipeline = Pipeline(ctx, handover, self._failure, self._outbox, Cadence(1.0, 0.2, float("inf")))
        self._pipeline.start()
        self._closed = False

    def handle(self, zarr_path: str) -> ArrayHandle:
        """The handle of the array at ``zarr_path`` (one of those this writer was given)."""
        try:
            return self._rows.by_path[zarr_path]
        except KeyError:
            raise StoreError(f"array {zarr_path} was not given to this chunk writer") from None

    def write_batch(self, start: int, arrays: Mapping[ArrayHandle, Any], *, tokens: Sequence[TokenSpans] | None = None,
                    generations: Sequence[Generation] | None = None) -> None:
        """One model batch (see :meth:`store.writer.Writer.write_batch`)."""
        self._check_open()
        self._producer.write_batch(start, arrays, tokens=tokens, generations=generations)

    def close(self) -> Written:
        """Make every whole chunk durable and return what to commit; rows of a chunk left incomplete are dropped."""
        if self._closed:
            return self._outbox.written
        self._closed = True
        try:
            self._pipeline.flush()
            self._failure.raise_if_failed()
        finally:
            self._pipeline.stop()
            self._ctx.syncers.shutdown(wait=True)
            self._remove_staging()
        self._failure.raise_if_failed()
        return self._outbox.written

    def abort(self) -> None:
        """Stop without returning anything (the task failed): what was written stays uncommitted."""
        if not self._closed:
            self._closed = True
            self._failure.record(StoreError("aborted"))
            self._pipeline.stop()
            self._ctx.syncers.shutdown(wait=True)
            self._remove_staging()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("this chunk writer is closed")
        self._failure.raise_if_failed()

    def _remove_staging(self) -> None:
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)

    def __enter__(self) -> ChunkWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc is not None:
            self.abort()
