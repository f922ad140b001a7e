"""The run's rows in the manifest: the run, its row map and its arrays (and their Zarr nodes).

Synchronous (the producer's thread), each a short transaction. A resume finds its run, rows and
arrays already there and checks that they are the same; a changed setting is refused with the
one key that changed. An existing run is marked ``running`` only when this writer first changes
it (:meth:`RunManifest.mark_running`).
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import zarr

from store import arrays as layout
from store import db
from store.depth import assign_depths
from store.dtypes import default_stored
from store.errors import SpecMismatchError, StoreError
from store.records import ARRAY_COLUMNS, ArrayInfo, ArraySpec, array_info_of_row, chunk_size, to_json
from store.writer import nodes
from store.writer.context import RunContext, now
from store.writer.handles import ArrayHandle
from store.writer.state import ManifestState


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


class RunManifest:
    """The run, its row map and its arrays of one writer, as rows of the manifest. Make with :meth:`begin`."""

    def __init__(self, ctx: RunContext, state: ManifestState) -> None:
        self._ctx = ctx
        self._state = state

    @classmethod
    def begin(cls, ctx: RunContext) -> RunManifest:
        """The run's row (inserted, or checked against ``ctx.info`` on a resume), its row map if it
        has one, and the local Zarr root of its arrays."""
        created = _begin_run(ctx)
        stimuli = _load_samples(ctx)
        root = layout.open_root(ctx.ws.path, read_only=False)  # local: metadata, and staging for a remote root
        return cls(ctx, ManifestState(created=created, marked=created, stimuli=stimuli, root=root))

    # ------------------------------------------------------------------ what the other parts ask

    @property
    def created(self) -> bool:
        """Whether this writer inserted the run's row (so no other row of the run can exist yet)."""
        return self._state.created

    @property
    def marked(self) -> bool:
        """Whether this writer changed the run (and so marked it ``running``)."""
        return self._state.marked

    @property
    def root(self) -> Any:
        """The local zarr.Group of the arrays."""
        return self._state.root

    @property
    def stimuli(self) -> list[str] | None:
        """The run's row map, once known."""
        return self._state.stimuli

    @property
    def n_samples(self) -> int:
        if self._state.stimuli is None:
            raise StoreError(f"run {self._ctx.run} has no samples yet: call set_samples(stimulus keys) first")
        return len(self._state.stimuli)

    def stimulus(self, row: int) -> str:
        """The stimulus key of array row ``row``."""
        if self._state.stimuli is None:
            raise StoreError(f"run {self._ctx.run} has no samples yet: call set_samples(stimulus keys) first")
        return self._state.stimuli[row]

    def handles(self) -> list[ArrayHandle]:
        """The arrays declared so far, in the order declared."""
        return list(self._state.handles.values())

    def handle(self, zarr_path: str) -> ArrayHandle:
        """The declared array at ``zarr_path``; a clear error for one this writer did not declare."""
        found = self._state.handles.get(zarr_path)
        if found is None:
            raise StoreError(f"run {self._ctx.run}: array {zarr_path} is not declared by this writer: declare it"
                             " with arrays(specs) before committing chunks written for it")
        return found

    def declared(self, handle: Any) -> bool:
        """Whether ``handle`` is an array this run manifest declared."""
        return isinstance(handle, ArrayHandle) and handle.writer_id == id(self)

    def chunk_for(self, requested: int) -> int:
        """Samples per chunk of an array of this run asked to hold at most ``requested`` per chunk.

        An array the manifest already holds keeps its size, so the run's new arrays take a size
        its arrays have when that size is one ``requested`` gives: the evened-out one
        (:func:`store.records.chunk_size`, at this writer's batch size or at none) or, for a run
        stored before chunks were evened out, ``min(requested, n)``. All arrays of a sharded run then
        agree, and so do the chunks a shard owns.
        """
        n = self.n_samples
        if self._state.chunk_sizes is None:
            with self._ctx.connection() as con:
                rows = con.execute("SELECT DISTINCT chunk_samples FROM activations WHERE run = ?", [self._ctx.run])
                self._state.chunk_sizes = {int(r[0]) for r in rows.fetchall()}
        evened = chunk_size(n, requested, self._ctx.info.batch_size)
        for size in (evened, chunk_size(n, requested), min(requested, n)):
            if size in self._state.chunk_sizes:
                return size
        return evened

    def missing(self, extra: Iterable[Any] = ()) -> dict[str, int]:
        """Chunks this writer owns but has not committed, per array key, once ``extra`` (chunk
        records about to commit) are."""
        done: dict[int, set[int]] = {id(h): set(h.committed) for h in self._state.handles.values()}
        for rec in extra:
            done[id(rec.handle)].add(rec.chunk)
        out = {}
        for h in self._state.handles.values():
            mine = sum(1 for k in range(h.info.n_chunks) if self._ctx.owns(k) and k not in done[id(h)])
            if mine:
                out[h.info.key()] = mine
        return out

    def mark_running(self, con: Any = None) -> None:
        """Mark an existing run ``running`` (this writer's host and pid) before its first change,
        through ``con`` when the caller holds the write connection already."""
        if self._state.marked:
            return
        if con is None:
            with self._ctx.connection() as own:
                self.mark_running(own)
            return
        con.execute(
            "UPDATE runs SET status = 'running', host = ?, pid = ?, updated_at = ?, finished_at = NULL WHERE run = ?",
            [socket.gethostname(), os.getpid(), now(), self._ctx.run],
        )
        self._state.marked = True

    # ------------------------------------------------------------------ the row map

    def set_samples(self, stimuli: Sequence[str]) -> None:
        """Fix the run's row map: row i of every array holds ``stimuli[i]``. Idempotent on resume."""
        keys = [str(s) for s in stimuli]
        if not keys:
            raise StoreError("set_samples needs at least one stimulus key")
        if len(set(keys)) != len(keys):
            raise StoreError("set_samples: each stimulus may appear once per run (a row map), got repeats")
        if self._state.stimuli is not None:
            self._check_same_samples(self._state.stimuli, keys)
            return
        run = self._ctx.run
        with self._ctx.connection() as con:
            # Asked again inside the write connection: a peer shard may have mapped the rows meanwhile.
            stored = con.execute(
                "SELECT stimulus FROM samples WHERE run = ? ORDER BY array_row", [run]
            ).fetchall()
            if stored:
                self._check_same_samples([r[0] for r in stored], keys)
                self._state.stimuli = keys
                return
            db.register_columns(con, "new_rows", {"array_row": range(len(keys)), "stimulus": keys}, {"array_row": "int64"})
            missing = con.execute(
                "SELECT stimulus FROM new_rows WHERE stimulus NOT IN (SELECT stimulus FROM stimuli) LIMIT 5"
            ).fetchall()
            if missing:
                raise StoreError(
                    f"stimuli {[m[0] for m in missing]} are not registered: call register_stimulus_set(...) or"
                    " register_stimuli(...) first (keys are '<dataset>/<id>')"
                )
            self.mark_running(con)
            con.execute("BEGIN TRANSACTION")
            con.execute("INSERT INTO samples (run, array_row, stimulus) SELECT ?, array_row, stimulus FROM new_rows",
                        [run])
            con.execute("UPDATE runs SET n_samples = ? WHERE run = ?", [len(keys), run])
            con.execute("COMMIT")
            con.unregister("new_rows")
        self._state.stimuli = keys

    def _check_same_samples(self, stored: list[str], keys: list[str]) -> None:
        if stored != keys:
            first = next((i for i, (a, b) in enumerate(zip(stored, keys, strict=False)) if a != b),
                         min(len(keys), len(stored)))
            raise SpecMismatchError(
                f"run {self._ctx.run} already maps {len(stored)} rows; this call gives {len(keys)} and differs"
                f" at row {first}. Resume with the same stimuli in the same order, or use a new run id"
            )

    # ------------------------------------------------------------------ arrays

    def arrays(self, specs: Sequence[ArraySpec]) -> list[ArrayHandle]:
        """Declare (or, on resume, reopen) arrays of this run, in the order given: all of them in
        one manifest transaction, so a run's set-up costs one connection however many arrays."""
        handles = self._state.handles
        wanted = [self._describe(spec) for spec in specs]
        for info, _ in wanted:
            if info.zarr_path in handles:
                _check_same_array(handles[info.zarr_path].info, info)
        new = list({info.zarr_path: (info, codec) for info, codec in wanted
                     if info.zarr_path not in handles}.values())
        if new:
            with self._ctx.connection() as con:
                # Declared while holding the write connection, so a peer shard declaring the same
                # array waits, then finds it declared (and never re-creates it over our chunks).
                made = self._open_arrays(con, new)
            handles.update((h.info.zarr_path, h) for h in made)
            if self._state.chunk_sizes is not None:
                self._state.chunk_sizes.update(h.info.chunk_samples for h in made)
        return [handles[info.zarr_path] for info, _ in wanted]

    def _describe(self, spec: ArraySpec) -> tuple[ArrayInfo, layout.Codec]:
        """The manifest row ``spec`` declares in this run, and its codec."""
        n = self.n_samples
        run, info_of_run = self._ctx.run, self._ctx.info
        stored = spec.stored_dtype or default_stored(spec.dtype, info_of_run.bf16)
        codec = layout.parse_codec(spec.codec, stored)
        if self._ctx.shard is not None and spec.chunk_samples not in (None, info_of_run.chunk_samples):
            raise StoreError(
                f"{spec.tap}.{spec.layer}: a sharded run needs every array at the run's chunk_samples"
                f" ({info_of_run.chunk_samples}), got {spec.chunk_samples}; a chunk is the unit a shard owns"
            )
        chunk = self.chunk_for(spec.chunk_samples or info_of_run.chunk_samples)
        info = ArrayInfo(
            run=run, tap=spec.tap, layer=spec.layer, site=spec.site, tokens=spec.tokens, module=spec.module,
            zarr_path=layout.array_path(run, spec.tap, spec.layer, spec.site, spec.tokens),
            layout="ragged" if spec.ragged else "dense",
            shape=(n, -1, *spec.shape) if spec.ragged else (n, *spec.shape),
            dims=("sample", *layout.kind_dims(spec.default_dims(), spec.tokens)),
            chunk_samples=chunk, n_chunks=-(-n // chunk), dtype=spec.dtype, stored_dtype=stored,
            codec=codec.name, values_per_row=int(np.prod(spec.shape)), bytes=0,
        )
        return info, codec

    def _open_arrays(self, con: Any, wanted: list[tuple[ArrayInfo, layout.Codec]]) -> list[ArrayHandle]:
        """Reopen the arrays the manifest knows, create and insert the others, in one transaction."""
        ctx, root = self._ctx, self._state.root
        paths = [info.zarr_path for info, _ in wanted]
        by_path = {row[6]: array_info_of_row(row) for row in con.execute(
            f"SELECT {ARRAY_COLUMNS} FROM activations WHERE run = ? AND list_contains(?, zarr_path)",
            [ctx.run, paths]).fetchall()}
        committed: dict[str, set[int]] = {p: set() for p in paths}
        for path, chunk in con.execute(
            "SELECT zarr_path, chunk FROM chunks WHERE run = ? AND list_contains(?, zarr_path)", [ctx.run, paths]
        ).fetchall():
            committed[path].add(int(chunk))
        for info, _ in wanted:
            if info.zarr_path in by_path:
                _check_same_array(by_path[info.zarr_path], info)
        made: dict[str, Any] = {}
        fresh: list[tuple[ArrayInfo, layout.Codec]] = []  # the nodes to make, all in one call
        con.execute("BEGIN TRANSACTION")
        try:
            for info, codec in wanted:
                stored = by_path.get(info.zarr_path)
                if stored is None:
                    fresh.append((info, codec))
                else:
                    node = nodes.reopen_node(ctx, root, stored, committed[info.zarr_path])
                    if node is None:
                        fresh.append((stored, codec))
                    else:
                        made[info.zarr_path] = node
            insert_arrays(con, [info for info, _ in wanted if info.zarr_path not in by_path])
            if fresh:
                self.mark_running(con)
                created, coords = nodes.create_nodes(ctx, root, fresh, self._state.stimuli or [])
                made.update(created)
                nodes.sync_new_nodes(ctx, list(created), coords)  # before the rows that point at them commit
            if len(by_path) < len(wanted):
                assign_depths(con, ctx.run)  # a deeper layer may renumber the run's arrays
            con.execute("COMMIT")
        except BaseException:
            db.rollback(con)
            raise
        return [ArrayHandle(by_path.get(info.zarr_path, info), codec, made[info.zarr_path],
                            committed[info.zarr_path], id(self)) for info, codec in wanted]


# ---------------------------------------------------------------------- the run's row


def _begin_run(ctx: RunContext) -> bool:
    """Insert the run's row, or check a stored one against ``ctx.info``; whether it was inserted."""
    info = ctx.info
    at = now()
    versions = {**library_versions(), **dict(info.versions)}
    with ctx.connection() as con:
        row = con.execute(
            "SELECT model, revision, adapter, dtype, attn_implementation, config, chunk_samples,"
            " bf16_policy, overflow_policy, intervention FROM runs WHERE run = ?",
            [info.run],
        ).fetchone()
        if row is None:
            if (ctx.ws.zarr_path / info.run).exists():
                # Left by a drop-run killed after its commit: no row points at it, and a new
                # run of that id must not find the old run's chunk files in its arrays.
                ctx.ws.remove_run_folder(info.run, remote=False)
            con.execute(
                "INSERT INTO runs (run, model, revision, adapter, dtype, attn_implementation, versions, config,"
                " chunk_samples, bf16_policy, overflow_policy, intervention, status, host, pid, created_at,"
                " updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'running', ?, ?, ?, ?)",
                [
                    info.run, info.model, info.revision, info.adapter, info.dtype, info.attn_implementation,
                    to_json(versions), to_json(dict(info.config)), info.chunk_samples, info.bf16,
                    info.overflow, to_json(dict(info.intervention)) if info.intervention else None,
                    socket.gethostname(), os.getpid(), at, at,
                ],
            )
            return True
        stored = {
            "model": row[0], "revision": row[1], "adapter": row[2], "dtype": row[3],
            "attn_implementation": row[4], "config": json.loads(row[5]) if row[5] else {},
            "chunk_samples": row[6], "bf16": row[7], "overflow": row[8],
            "intervention": json.loads(row[9]) if row[9] else None,
        }
        wanted = info.identity()
        # A key a newer agnosia added with no value (e.g. model.device_map: null) is no difference.
        diff = [d for k in wanted for d in _differences(k, without_nulls(stored[k]), without_nulls(wanted[k]))]
        if diff:
            detail = "; ".join(f"{k}: stored {a!r}, this writer {b!r}" + _resume_note(k) for k, a, b in diff)
            raise SpecMismatchError(
                f"run {info.run} already exists with different settings ({detail}). Resume it with the same"
                f" settings, choose a new run id, or remove it with `python -m store drop-run {info.run}`"
            )
    # An existing run is marked running only when this writer first changes it: a resume
    # refused by the checks that follow (other stimuli, another codec) leaves its row as it was.
    return False


def _load_samples(ctx: RunContext) -> list[str] | None:
    with ctx.connection() as con:  # the run's own connection: no second open of the file
        rows = con.execute(
            "SELECT array_row, stimulus FROM samples WHERE run = ? ORDER BY array_row", [ctx.run]
        ).fetchall()
    return [r[1] for r in rows] if rows else None


def without_nulls(value: Any) -> Any:
    """``value`` with every mapping entry whose value is None dropped, recursively."""
    if isinstance(value, Mapping):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
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


# ---------------------------------------------------------------------- array rows


_ARRAY_ROW = "(" + ", ".join(["?"] * 16) + ", 0, ?)"


def insert_arrays(con: Any, infos: list[ArrayInfo]) -> None:
    """The manifest rows of new arrays, in one statement (a run declares hundreds; one INSERT each
    cost ~1.4 ms apiece)."""
    if not infos:
        return
    at = now()
    con.execute(
        "INSERT INTO activations (run, tap, layer, site, tokens, module, zarr_path, layout, shape, dims,"
        " chunk_samples, n_chunks, dtype, stored_dtype, codec, values_per_row, bytes, created_at)"
        f" VALUES {', '.join([_ARRAY_ROW] * len(infos))}",
        [v for info in infos for v in (
            info.run, info.tap, info.layer, info.site, info.tokens, info.module, info.zarr_path,
            info.layout, list(info.shape), list(info.dims), info.chunk_samples, info.n_chunks,
            info.dtype, info.stored_dtype, info.codec, info.values_per_row, at,
        )],
    )


def _check_same_array(known: ArrayInfo, wanted: ArrayInfo) -> None:
    fields = ("layout", "shape", "chunk_samples", "dtype", "stored_dtype", "codec")
    diff = [f for f in fields if getattr(known, f) != getattr(wanted, f)]
    if diff:
        detail = "; ".join(f"{f}: stored {getattr(known, f)!r}, now {getattr(wanted, f)!r}" for f in diff)
        raise SpecMismatchError(
            f"array {known.key()} already exists with a different layout ({detail}). Resume with the same"
            " ArraySpec, or store it under another site/tokens name"
        )
