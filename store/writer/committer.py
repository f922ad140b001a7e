"""The committer: make written chunks durable, then record them in one short transaction.

Bytes are durable before the manifest says so: every chunk file is fsynced, then every folder
entry, then (for a remote array root) uploaded, and only then are the chunk rows inserted, with
the token spans and generations queued before them, in one transaction. A crash before the
COMMIT loses only chunks the manifest never named; their rows are recomputed on resume.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

from store import arrays as layout
from store import db
from store.chunks import ChunkRecord, WrittenChunk
from store.writer.context import RunContext, now, unstage
from store.writer.handles import WriterStats
from store.writer.run_manifest import RunManifest
from store.writer.state import CommitState


class Pending:
    """What the writer thread has handed over and the next commit takes: chunks, token spans, generations."""

    def __init__(self, state: CommitState) -> None:
        self._state = state

    def add_chunk(self, rec: ChunkRecord) -> None:
        """A chunk written (its checksums perhaps still running), to commit."""
        self._state.chunks.append(rec)

    def add_tokens(self, rows: list[dict[str, Any]]) -> None:
        self._state.tokens.extend(rows)

    def add_generations(self, rows: list[dict[str, Any]]) -> None:
        self._state.generations.extend(rows)

    def has_pending(self) -> bool:
        st = self._state
        return bool(st.chunks or st.tokens or st.generations)

    def has_chunks(self) -> bool:
        """Whether a chunk awaits its commit (records alone may wait longer: they only show progress)."""
        return bool(self._state.chunks)

    @property
    def last_commit(self) -> float:
        """When (time.monotonic) the last commit landed, or the committer was made."""
        return self._state.last_commit

    def taken(self, chunks: int, tokens: int, generations: int, stats: WriterStats) -> None:
        """The first ``chunks``, ``tokens`` and ``generations`` pending went out in one commit: drop
        them (what arrived meanwhile stays) and count the commit."""
        st = self._state
        del st.chunks[:chunks]
        del st.tokens[:tokens]
        del st.generations[:generations]
        st.last_commit = time.monotonic()
        stats.commits += 1


class Committer(Pending):
    """What awaits the next manifest transaction of the writer thread, and that transaction."""

    def __init__(self, ctx: RunContext, runs: RunManifest, state: CommitState) -> None:
        super().__init__(state)
        self._ctx = ctx
        self._runs = runs

    def add_written(self, chunks: list[WrittenChunk]) -> None:
        """Chunks a worker wrote and made durable, to commit (a cluster run: extract/cluster/). A chunk
        already committed, or already awaiting this commit, is skipped: a task that ran twice (its
        first worker died after writing) writes the same bytes, and its chunk is counted once."""
        pending = {(rec.handle.info.zarr_path, rec.chunk) for rec in self._state.chunks}
        for w in chunks:
            handle = self._runs.handle(w.zarr_path)
            if w.chunk in handle.committed or (w.zarr_path, w.chunk) in pending:
                self._ctx.stats.chunks_skipped += 1
                continue
            pending.add((w.zarr_path, w.chunk))
            done: Future[tuple[int, int, int, int | None]] = Future()
            done.set_result((w.crc32c, w.n_nonfinite, w.n_clipped, w.offsets_crc32c))
            self._state.chunks.append(ChunkRecord(handle, w.chunk, w.row_start, w.row_stop, w.n_rows, w.nbytes,
                                                  done, [], []))

    def idle(self) -> None:
        """The writer thread has nothing queued: let the manifest go if another process waits for it."""
        if self._ctx.manifest is not None:
            self._ctx.manifest.release_if_due()

    # ------------------------------------------------------------------ the transaction

    def commit(self, timeout: float, finish: bool | None = None) -> None:
        """One short transaction for everything pending; ``finish`` (partial_ok) also closes the run."""
        ctx, st = self._ctx, self._state
        started, cpu = time.perf_counter(), time.thread_time()
        chunks = list(st.chunks)
        tokens = list(st.tokens)
        gens = list(st.generations)
        stats = [rec.written.result() for rec in chunks]
        files = make_durable(self._ctx, chunks)
        at = now()
        began = False
        try:
            with ctx.connection(timeout) as con:
                con.execute("BEGIN TRANSACTION")
                began = True
                try:
                    if chunks:
                        _insert_chunks(con, ctx.run, chunks, stats, at, may_exist=st.commit_failed)
                    if tokens:
                        _update_tokens(con, ctx.run, tokens)
                    if gens:
                        _replace_generations(con, ctx.run, gens, fresh=self._fresh(gens))
                    if finish is not None and (finish or self._run_complete(con, chunks)):
                        con.execute(
                            "UPDATE runs SET status = 'finished', finished_at = ?, updated_at = ? WHERE run = ?",
                            [at, at, ctx.run],
                        )
                    else:
                        con.execute("UPDATE runs SET updated_at = ? WHERE run = ?", [at, ctx.run])
                    con.execute("COMMIT")
                except BaseException:
                    db.rollback(con)  # keeps the failed statement's error (e.g. a full disk), not ROLLBACK's
                    raise
        except BaseException:
            if began:
                # A COMMIT that failed, or whose connection failed after it, may have landed: its rows
                # may be there when they are committed again, so replace and skip from now on.
                st.generated = None
                st.commit_failed = True
            raise
        for rec in chunks:
            rec.handle.committed.add(rec.chunk)
        if st.generated is not None:
            st.generated.update(g["stimulus"] for g in gens)
        if ctx.ws.root.remote:
            unstage(files)
        self.taken(len(chunks), len(tokens), len(gens), ctx.stats)
        ctx.stats.commit_s += time.perf_counter() - started
        ctx.stats.commit_cpu_s += time.thread_time() - cpu

    def _fresh(self, gens: list[dict[str, Any]]) -> bool:
        """Whether ``gens`` are all first rows: a new run's stimuli this writer has not committed,
        each once."""
        generated = self._state.generated
        if generated is None:
            return False
        stimuli = {g["stimulus"] for g in gens}
        return len(stimuli) == len(gens) and generated.isdisjoint(stimuli)

    def _run_complete(self, con: Any, chunks: list[ChunkRecord]) -> bool:
        """Whether every chunk of the run is committed once ``chunks`` are (asked of the manifest
        for a shard, whose peers commit the chunks it does not own)."""
        if self._runs.missing(chunks):
            return False
        if self._ctx.shard is None:
            return True
        row = con.execute(
            "SELECT count(*) FROM activations a WHERE a.run = ? AND a.n_chunks >"
            " (SELECT count(*) FROM chunks c WHERE c.run = a.run AND c.zarr_path = a.zarr_path)",
            [self._ctx.run],
        ).fetchone()
        return not (row and row[0])


def make_durable(ctx: RunContext, chunks: list[ChunkRecord]) -> list[Any]:
    """fsync every file of ``chunks``, then every folder entry; upload them to a remote root.
    Returns the files."""
    # Concurrent fsyncs let the file system group them into fewer journal commits.
    files = list(dict.fromkeys(f for rec in chunks for f in rec.files))
    if len(files) > 1:
        list(ctx.syncers.map(layout.fsync_path, files))
    elif files:
        layout.fsync_path(files[0])
    for folder in dict.fromkeys(d for rec in chunks for d in rec.dirs):
        layout.fsync_path(folder)
    # An object store shows an object only once it is whole: uploaded, then committed.
    if files:
        ctx.upload(lambda: ctx.ws.root.upload(files))
    return files


_CHUNK_KINDS = {"chunk": "int32", **dict.fromkeys(("row_start", "row_stop", "n_rows", "nbytes", "crc32c",
                                                    "n_nonfinite", "n_clipped", "offsets_crc32c"), "int64")}
_TOKEN_KINDS = dict.fromkeys(("array_row", "seq_len", "image_start", "image_count", "grid_h", "grid_w",
                              "last_prompt", "answer_start", "answer_count"), "int64")
_GENERATION_KINDS = {"array_row": "int64", "parse_ok": "bool", "correct": "bool", "score": "float64", "n_tokens": "int64"}


def _insert_chunks(con: Any, run: str, chunks: list[ChunkRecord], stats: list[tuple[int, int, int, int | None]],
                   at: Any, *, may_exist: bool = True) -> None:
    """The rows of ``chunks``, and their bytes added to their arrays' totals. ``may_exist``: some
    rows may be there already (a retried commit whose first COMMIT landed); without it a row that
    is there fails the insert, and the statement costs ~1.4 ms less (no conflict check)."""
    db.register_columns(con, "new_chunks", {
        "zarr_path": [r.handle.info.zarr_path for r in chunks],
        "chunk": [r.chunk for r in chunks],
        "row_start": [r.row_start for r in chunks],
        "row_stop": [r.row_stop for r in chunks],
        "n_rows": [r.n_rows for r in chunks],
        "nbytes": [r.nbytes for r in chunks],
        "crc32c": [x[0] for x in stats],
        "n_nonfinite": [x[1] for x in stats],
        "n_clipped": [x[2] for x in stats],
        "offsets_crc32c": [x[3] for x in stats],
    }, _CHUNK_KINDS)
    # A retried commit whose first COMMIT landed finds its rows there: they are not inserted again
    # and, as RETURNING leaves them out, not counted again.
    inserted = con.execute(
        "INSERT INTO chunks (run, zarr_path, chunk, row_start, row_stop, n_rows, nbytes, crc32c,"
        " n_nonfinite, n_clipped, committed_at, offsets_crc32c) SELECT ?, zarr_path, chunk, row_start,"
        " row_stop, n_rows, nbytes, crc32c, n_nonfinite, n_clipped, ?, offsets_crc32c FROM new_chunks"
        + (" ON CONFLICT DO NOTHING" if may_exist else "") + " RETURNING zarr_path, nbytes",
        [run, at],
    ).fetchall()
    con.unregister("new_chunks")
    added: dict[str, int] = {}
    for path, nbytes in inserted:
        added[path] = added.get(path, 0) + int(nbytes)
    if added:
        # Added to the totals, not summed over every chunk of the run again: a commit's cost stays
        # that of its own chunks however long the run grows.
        con.execute(
            "UPDATE activations SET bytes = bytes + a.b FROM (VALUES "
            + ", ".join(["(?, ?)"] * len(added)) + ") a(zarr_path, b)"
            " WHERE activations.run = ? AND activations.zarr_path = a.zarr_path",
            [x for item in added.items() for x in item] + [run],
        )


def _update_tokens(con: Any, run: str, tokens: list[dict[str, Any]]) -> None:
    db.register_records(con, "new_tokens", tokens, _TOKEN_KINDS)
    con.execute(
        "UPDATE samples SET seq_len = t.seq_len, image_start = t.image_start, image_count = t.image_count,"
        " grid_h = t.grid_h, grid_w = t.grid_w, last_prompt = t.last_prompt, answer_start = t.answer_start,"
        " answer_count = t.answer_count, spans = t.spans::JSON, recorded_at = t.recorded_at"
        " FROM new_tokens t WHERE samples.run = ? AND samples.array_row = t.array_row",
        [run],
    )
    con.unregister("new_tokens")


def _replace_generations(con: Any, run: str, gens: list[dict[str, Any]], *, fresh: bool = False) -> None:
    """Insert ``gens``, replacing any row of the same stimulus; ``fresh``: none can exist (no
    DELETE, no de-duplication: about half the statement's cost)."""
    db.register_records(con, "new_gens", gens, _GENERATION_KINDS)
    if not fresh:
        con.execute("DELETE FROM generations WHERE run = ? AND stimulus IN (SELECT stimulus FROM new_gens)", [run])
    # Last one wins when a row was generated twice before one commit.
    con.execute(
        "INSERT INTO generations (run, stimulus, array_row, text, prediction, parse_ok, correct, score,"
        " metrics, n_tokens, recorded_at, stop_reason, answer_kind)"
        " SELECT run, stimulus, array_row, text, prediction::JSON, parse_ok, correct,"
        " score, metrics::JSON, n_tokens, recorded_at, stop_reason, answer_kind FROM new_gens"
        + ("" if fresh else " QUALIFY row_number() OVER (PARTITION BY stimulus ORDER BY recorded_at DESC) = 1")
    )
    con.unregister("new_gens")
