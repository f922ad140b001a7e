"""The producer side of the writer: validate a batch, then queue it; never touch the disk.

``write*`` check shapes and rows on the caller's thread and hand the batch to the writer thread
through a queue bounded in bytes (:class:`store.writer.state.Handover`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from store.chunks import WrittenChunk
from store.dtypes import as_numpy
from store.errors import StoreError
from store.records import Generation, Ragged, TokenSpans, to_json
from store.writer.context import Failure, RunContext, now
from store.writer.handles import ArrayHandle
from store.writer.state import Handover


class RunRows(Protocol):
    """What the producer asks of the run's rows: :class:`store.writer.run_manifest.RunManifest` for a
    writer, :class:`store.writer.chunk_writer.GroupRows` for a worker's chunk writer."""

    @property
    def n_samples(self) -> int: ...

    def stimulus(self, row: int) -> str: ...

    def handles(self) -> list[ArrayHandle]: ...

    def declared(self, handle: Any) -> bool: ...

    def chunk_for(self, requested: int) -> int: ...

    def mark_running(self, con: Any = None) -> None: ...


class Producer:
    """What the extraction stage calls while it runs the model: checked batches onto the queue."""

    def __init__(self, ctx: RunContext, runs: RunRows, handover: Handover, failure: Failure) -> None:
        self._ctx = ctx
        self._runs = runs
        self._handover = handover
        self._failure = failure

    def todo(self) -> list[range]:
        """Row ranges not yet committed in every declared array (declare all arrays first).

        Ranges are unions of whole chunks, so writing them in order fills whole blocks.
        """
        n = self._runs.n_samples
        handles = self._runs.handles()
        if not handles and self._ctx.shard is None:
            return [range(0, n)]
        need = np.zeros(n, dtype=bool)
        if not handles:
            size = self._runs.chunk_for(self._ctx.info.chunk_samples)  # what the shard's arrays will be chunked by
            for k in range(-(-n // size)):
                if self._ctx.owns(k):
                    need[k * size : min((k + 1) * size, n)] = True
        for h in handles:
            for k in range(h.info.n_chunks):
                if k not in h.committed and self._ctx.owns(k):
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

    def write(self, handle: ArrayHandle, start: int, values: Any) -> None:
        """Queue rows ``start .. start+len(values)`` of a dense array (numpy or torch, any device)."""
        self._put(*self._dense_item(handle, start, values))

    def write_ragged(self, handle: ArrayHandle, start: int, values: Sequence[Any] | Ragged) -> None:
        """Queue variable-length rows: ``values[i]`` (shape [n_i, *row_shape]) belongs to row start+i."""
        self._put(*self._ragged_item(handle, start, values))

    def record_tokens(self, start: int, spans: Sequence[TokenSpans]) -> None:
        """Queue the token spans of rows ``start .. start+len(spans)``."""
        self._put(*self._tokens_item(start, spans))

    def record_generations(self, start: int, generations: Sequence[Generation]) -> None:
        """Queue what the model generated for rows ``start .. start+len(generations)``."""
        self._put(*self._generations_item(start, generations))

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
        parts = []
        if tokens is not None:
            parts.append(self._tokens_item(start, tokens))
        if generations is not None:
            parts.append(self._generations_item(start, generations))
        for handle, values in arrays.items():
            parts.append(self._ragged_item(handle, start, values) if handle.ragged
                         else self._dense_item(handle, start, values))
        self._put(("batch", [(*item, nbytes) for item, nbytes in parts]), sum(nbytes for _, nbytes in parts))

    def commit_written(self, chunks: Sequence[WrittenChunk], tokens: Sequence[dict[str, Any]],
                       generations: Sequence[dict[str, Any]]) -> None:
        """Queue chunks a worker wrote, with the records of their rows, for the writer thread to commit:
        records first, as in :meth:`write_batch`, in one item."""
        for row in [*tokens, *generations]:
            self._check_rows(int(row["array_row"]), 1)
        parts = [("tokens", list(tokens), 0), ("generations", list(generations), 0), ("written", list(chunks), 0)]
        self._put(("batch", parts), 0)

    # ------------------------------------------------------------------ validated queue items: (item, bytes)

    def _dense_item(self, handle: ArrayHandle, start: int, values: Any) -> tuple[tuple[Any, ...], int]:
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
        return ("data", handle, int(start), arr, kind), arr.nbytes

    def _ragged_item(self, handle: ArrayHandle, start: int,
                     values: Sequence[Any] | Ragged) -> tuple[tuple[Any, ...], int]:
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
        return ("ragged", handle, int(start), converted, kinds.pop() if kinds else handle.info.dtype), nbytes

    def _tokens_item(self, start: int, spans: Sequence[TokenSpans]) -> tuple[tuple[Any, ...], int]:
        self._check_rows(start, len(spans))
        at = now()
        rows = []
        for i, s in enumerate(spans):
            if not isinstance(s, TokenSpans):
                raise StoreError(f"record_tokens takes TokenSpans, got {type(s).__name__} at row {start + i}")
            rows.append({
                "array_row": start + i, "seq_len": s.seq_len, "image_start": s.image_start,
                "image_count": s.image_count, "grid_h": s.grid_h, "grid_w": s.grid_w,
                "last_prompt": s.last_prompt, "answer_start": s.answer_start, "answer_count": s.answer_count,
                "spans": to_json(dict(s.extra)) if s.extra else None, "recorded_at": at,
            })
        return ("tokens", rows), 0

    def _generations_item(self, start: int, generations: Sequence[Generation]) -> tuple[tuple[Any, ...], int]:
        self._check_rows(start, len(generations))
        at = now()
        rows = []
        for i, g in enumerate(generations):
            if not isinstance(g, Generation):
                raise StoreError(f"record_generations takes Generation, got {type(g).__name__} at row {start + i}")
            rows.append({
                "run": self._ctx.run, "stimulus": self._runs.stimulus(start + i), "array_row": start + i, "text": g.text,
                "prediction": to_json(g.prediction), "parse_ok": g.parse_ok, "correct": g.correct,
                "score": None if g.score is None else float(g.score), "metrics": to_json(g.metrics),
                "n_tokens": g.n_tokens, "recorded_at": at, "stop_reason": g.stop_reason, "answer_kind": g.kind,
            })
        return ("generations", rows), 0

    def _check_handle(self, handle: ArrayHandle) -> None:
        if not self._runs.declared(handle):
            raise StoreError("write takes an ArrayHandle returned by this writer's array(spec)")

    def _check_rows(self, start: int, count: int) -> None:
        n = self._runs.n_samples
        if count < 1 or start < 0 or start + count > n:
            raise StoreError(
                f"rows [{start}, {start + count}) must lie inside the run's {n} samples [0, {n}) and be non-empty"
            )
        shard = self._ctx.shard
        if shard is not None:
            size = self._runs.chunk_for(self._ctx.info.chunk_samples)  # every array of a sharded run has it
            foreign = [k for k in range(start // size, (start + count - 1) // size + 1) if not shard.owns(k)]
            if foreign:
                raise StoreError(
                    f"rows [{start}, {start + count}) reach chunk(s) {foreign[:5]} of another shard (this is shard"
                    f" {shard}, chunks of {size} samples): write only the rows todo() names"
                )

    def _put(self, item: tuple[Any, ...], nbytes: int) -> None:
        self._runs.mark_running()
        self._ctx.stats.producer_wait_s += self._handover.budget.take(nbytes, self._failure.abort)
        self._failure.raise_if_failed()
        self._handover.queue.put((*item, nbytes))
