"""A worker's committer: what its chunk writer made durable, kept for the client to commit.

On a cluster (extract/cluster/) the workers write chunk files where the arrays live and never open
the manifest. The writer thread of a worker's :class:`store.writer.chunk_writer.ChunkWriter` hands
its chunks here instead of to a :class:`store.writer.committer.Committer`: each "commit" makes the
chunks durable (fsync, upload to an object store) exactly as a committer does before its
transaction, then keeps their ``chunks`` rows, with the token spans and generations queued before
them, as :class:`Written`. The client inserts them (:meth:`store.writer.Writer.commit_written`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from store.chunks import WrittenChunk
from store.errors import StoreError
from store.writer.committer import Pending, make_durable
from store.writer.context import RunContext, unstage
from store.writer.state import CommitState


@dataclass
class Written:
    """What a worker wrote for its client to commit: chunks made durable and the records of their rows."""

    chunks: list[WrittenChunk] = field(default_factory=list)
    tokens: list[dict[str, Any]] = field(default_factory=list)  # rows of ``samples`` (token spans)
    generations: list[dict[str, Any]] = field(default_factory=list)  # rows of ``generations``


class Outbox(Pending):
    """The committer of a worker's chunk writer: durable chunks and their records, kept in :attr:`written`."""

    def __init__(self, ctx: RunContext) -> None:
        super().__init__(CommitState(generated=None))
        self._ctx = ctx
        self.written = Written()

    def add_written(self, chunks: list[WrittenChunk]) -> None:
        raise StoreError("a worker's chunk writer commits only what it wrote itself; its client commits chunks")

    def idle(self) -> None:
        """Nothing to let go: a worker holds no manifest connection."""

    def commit(self, timeout: float, finish: bool | None = None) -> None:
        """Make the pending chunks durable where the arrays live and keep their rows (``timeout`` and
        ``finish`` are the manifest's: a worker has none, its client finishes the run)."""
        st, ctx = self._state, self._ctx
        started = time.perf_counter()
        chunks, tokens, gens = list(st.chunks), list(st.tokens), list(st.generations)
        stats = [rec.written.result() for rec in chunks]
        files = make_durable(ctx, chunks)
        if ctx.ws.root.remote:
            unstage(files)
        self.written.chunks += [
            WrittenChunk(rec.handle.info.zarr_path, rec.chunk, rec.row_start, rec.row_stop, rec.n_rows, rec.nbytes,
                         *stat)
            for rec, stat in zip(chunks, stats, strict=True)
        ]
        self.written.tokens += tokens
        self.written.generations += gens
        self.taken(len(chunks), len(tokens), len(gens), ctx.stats)
        ctx.stats.commit_s += time.perf_counter() - started
