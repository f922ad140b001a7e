"""Registration in the manifest: the run, its stimuli, its row map and its arrays.

Synchronous (the producer's thread), each a short transaction. A resume finds its run, stimuli,
rows and arrays already there and checks that they are the same; a changed setting is refused
with the one key that changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import zarr

from store import arrays as layout
from store import db
from store.depth import assign_depths
from store.dtypes import default_stored
from store.errors import SpecMismatchError, StoreError
from store.records import ARRAY_COLUMNS, ArrayInfo, ArraySpec, RunInfo, array_info_of_row, check_name, json_object, to_json
from store.writer_core import ArrayHandle, WriterCore, disk_full_names, now

_REGISTER_ROWS = 256  # stimuli per registration transaction of a set
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


class Registration(WriterCore):
    """The run, stimuli, samples and arrays of a writer, as rows of the manifest."""

    def _begin_run(self, info: RunInfo) -> None:
        at = now()
        versions = {**library_versions(), **dict(info.versions)}
        with self._write_connection() as con:
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
                        socket.gethostname(), os.getpid(), at, at,
                    ],
                )
                self._marked = True
                self._generated = set()
                return
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
        self._marked = False
        self._generated = None

    def _load_samples(self) -> list[str] | None:
        with self._write_connection() as con:  # the run's own connection: no second open of the file
            rows = con.execute(
                "SELECT array_row, stimulus FROM samples WHERE run = ? ORDER BY array_row", [self.run]
            ).fetchall()
        return [r[1] for r in rows] if rows else None


    def register_stimuli(
        self, rows: Iterable[Mapping[str, Any]], *, dataset: str, set_path: str | os.PathLike[str] | None = None
    ) -> list[str]:
        """Add stimuli (rows in the truth.parquet format) to ``stimuli``; returns their keys
        ``<dataset>/<id>`` in input order. Re-registering identical rows is a no-op; a changed row
        with a known key is refused."""
        check_name("dataset", dataset)
        return self._register_block(rows, dataset, set_path, set())

    def _register_block(self, rows: Iterable[Mapping[str, Any]], dataset: str,
                        set_path: str | os.PathLike[str] | None, seen: set[str]) -> list[str]:
        """One transaction of :meth:`register_stimuli`; ``seen``: the keys of the set's earlier blocks."""
        records = []
        set_text = None if set_path is None else str(set_path)
        for r in rows:
            if "id" not in r or r["id"] in (None, ""):
                raise StoreError(f"every stimulus row needs an 'id' (the truth.parquet format), got keys {sorted(r)}")
            encoded = {k: to_json(r.get(k)) for k in ("id", *_STIMULUS_FIELDS)}
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
                    "prompts": encoded["prompts"],
                    "answers": encoded["answers"],
                    "params": encoded["params"],
                    "truth": encoded["truth"],
                    "image": r.get("image"),
                    "set_path": set_text,
                    # of the row's fields as one canonical JSON object: what a re-registration compares
                    "digest": hashlib.sha1(json_object(encoded).encode()).hexdigest(),
                }
            )
        keys = [str(r["stimulus"]) for r in records]
        if len(set(keys)) != len(keys) or not seen.isdisjoint(keys):
            dup = sorted({k for k in keys if keys.count(k) > 1 or k in seen})[:5]
            raise StoreError(f"stimulus ids must be unique within dataset {dataset}, repeated: {dup}")
        seen.update(keys)
        if not records:
            return []
        with self._write_connection() as con:
            db.register_records(con, "new_stimuli", records, {"seed": "int64"})
            changed = con.execute(
                "SELECT n.stimulus FROM new_stimuli n JOIN stimuli s USING (stimulus)"
                " WHERE s.digest <> n.digest LIMIT 5"
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
                [now()],
            )
            con.unregister("new_stimuli")  # the run's connection outlives this call
        return keys

    def register_stimulus_set(self, path: str | os.PathLike[str], *, dataset: str | None = None) -> list[str]:
        """Register a stimulus set folder (``truth.parquet`` inside); dataset defaults to its name.
        One transaction per block of rows: a set refused part-way keeps its earlier blocks' rows,
        which no run points at (registering the mended set again is then a no-op for them)."""
        folder = Path(path)
        truth = folder / "truth.parquet"
        if not truth.is_file():
            raise StoreError(
                f"{folder} is not a stimulus set (expected {truth}): write one with `python -m stimuli`"
            )
        name = dataset or folder.name
        check_name("dataset", name)
        keys: list[str] = []
        seen: set[str] = set()
        # Block by block: a whole set as Python rows held ~12 KiB per stimulus at once (and the
        # allocators keep it), so the run's peak memory grew with the set. Not read_table: it
        # imports pandas (~0.5 s).
        for block in pq.ParquetFile(truth).iter_batches(batch_size=_REGISTER_ROWS):
            keys += self._register_block(block.to_pylist(), name, folder.resolve(), seen)
        return keys

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
        with self._write_connection() as con:
            # Asked again inside the write connection: a peer shard may have mapped the rows meanwhile.
            stored = con.execute(
                "SELECT stimulus FROM samples WHERE run = ? ORDER BY array_row", [self.run]
            ).fetchall()
            if stored:
                self._check_same_samples([r[0] for r in stored], keys)
                self._stimuli = keys
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
            self._mark_running(con)
            con.execute("BEGIN TRANSACTION")
            con.execute("INSERT INTO samples (run, array_row, stimulus) SELECT ?, array_row, stimulus FROM new_rows",
                        [self.run])
            con.execute("UPDATE runs SET n_samples = ? WHERE run = ?", [len(keys), self.run])
            con.execute("COMMIT")
            con.unregister("new_rows")
        self._stimuli = keys

    def _check_same_samples(self, stored: list[str], keys: list[str]) -> None:
        if stored != keys:
            first = next((i for i, (a, b) in enumerate(zip(stored, keys, strict=False)) if a != b),
                         min(len(keys), len(stored)))
            raise SpecMismatchError(
                f"run {self.run} already maps {len(stored)} rows; this call gives {len(keys)} and differs"
                f" at row {first}. Resume with the same stimuli in the same order, or use a new run id"
            )

    def array(self, spec: ArraySpec) -> ArrayHandle:
        """Declare (or, on resume, reopen) one array of this run."""
        return self.arrays([spec])[0]

    def arrays(self, specs: Sequence[ArraySpec]) -> list[ArrayHandle]:
        """Declare (or, on resume, reopen) arrays of this run, in the order given: all of them in
        one manifest transaction, so a run's set-up costs one connection however many arrays."""
        self._check_open()
        wanted = [self._describe(spec) for spec in specs]
        for info, _ in wanted:
            if info.zarr_path in self._handles:
                _check_same_array(self._handles[info.zarr_path].info, info)
        new = list({info.zarr_path: (info, codec) for info, codec in wanted
                     if info.zarr_path not in self._handles}.values())
        if new:
            with self._write_connection() as con:
                # Declared while holding the write connection, so a peer shard declaring the same
                # array waits, then finds it declared (and never re-creates it over our chunks).
                handles = self._open_arrays(con, new)
            self._handles.update((h.info.zarr_path, h) for h in handles)
            if self._chunk_sizes is not None:
                self._chunk_sizes.update(h.info.chunk_samples for h in handles)
        return [self._handles[info.zarr_path] for info, _ in wanted]

    def _describe(self, spec: ArraySpec) -> tuple[ArrayInfo, layout.Codec]:
        """The manifest row ``spec`` declares in this run, and its codec."""
        n = self.n_samples
        stored = spec.stored_dtype or default_stored(spec.dtype, self.info.bf16)
        codec = layout.parse_codec(spec.codec, stored)
        if self.shard is not None and spec.chunk_samples not in (None, self.info.chunk_samples):
            raise StoreError(
                f"{spec.tap}.{spec.layer}: a sharded run needs every array at the run's chunk_samples"
                f" ({self.info.chunk_samples}), got {spec.chunk_samples}; a chunk is the unit a shard owns"
            )
        chunk = self._chunk_for(spec.chunk_samples or self.info.chunk_samples)
        info = ArrayInfo(
            run=self.run, tap=spec.tap, layer=spec.layer, site=spec.site, tokens=spec.tokens, module=spec.module,
            zarr_path=layout.array_path(self.run, spec.tap, spec.layer, spec.site, spec.tokens),
            layout="ragged" if spec.ragged else "dense",
            shape=(n, -1, *spec.shape) if spec.ragged else (n, *spec.shape),
            dims=("sample", *layout.kind_dims(spec.default_dims(), spec.tokens)),
            chunk_samples=chunk, n_chunks=-(-n // chunk), dtype=spec.dtype, stored_dtype=stored,
            codec=codec.name, values_per_row=int(np.prod(spec.shape)), bytes=0,
        )
        return info, codec

    def _open_arrays(self, con: Any, wanted: list[tuple[ArrayInfo, layout.Codec]]) -> list[ArrayHandle]:
        """Reopen the arrays the manifest knows, create and insert the others, in one transaction."""
        paths = [info.zarr_path for info, _ in wanted]
        by_path = {row[6]: array_info_of_row(row) for row in con.execute(
            f"SELECT {ARRAY_COLUMNS} FROM activations WHERE run = ? AND list_contains(?, zarr_path)",
            [self.run, paths]).fetchall()}
        committed: dict[str, set[int]] = {p: set() for p in paths}
        for path, chunk in con.execute(
            "SELECT zarr_path, chunk FROM chunks WHERE run = ? AND list_contains(?, zarr_path)", [self.run, paths]
        ).fetchall():
            committed[path].add(int(chunk))
        for info, _ in wanted:
            if info.zarr_path in by_path:
                _check_same_array(by_path[info.zarr_path], info)
        nodes: dict[str, Any] = {}
        fresh: list[tuple[ArrayInfo, layout.Codec]] = []  # the nodes to make, all in one call
        con.execute("BEGIN TRANSACTION")
        try:
            for info, codec in wanted:
                stored = by_path.get(info.zarr_path)
                if stored is None:
                    fresh.append((info, codec))
                else:
                    node = self._reopen_node(stored, committed[info.zarr_path])
                    if node is None:
                        fresh.append((stored, codec))
                    else:
                        nodes[info.zarr_path] = node
            _insert_arrays(con, [info for info, _ in wanted if info.zarr_path not in by_path])
            if fresh:
                self._mark_running(con)
                made, coords = self._create_nodes(fresh)
                nodes.update(made)
                self._sync_new_nodes(list(made), coords)  # before the rows that point at them commit
            if len(by_path) < len(wanted):
                assign_depths(con, self.run)  # a deeper layer may renumber the run's arrays
            con.execute("COMMIT")
        except BaseException:
            db.rollback(con)
            raise
        return [ArrayHandle(by_path.get(info.zarr_path, info), codec, nodes[info.zarr_path],
                            committed[info.zarr_path], id(self)) for info, codec in wanted]

    def _reopen_node(self, info: ArrayInfo, committed: set[int]) -> Any:
        """The Zarr node of an array the manifest knows; None (to be made again) if it is missing
        on disk and none of its chunks is committed."""
        try:
            node = self._root[info.zarr_path]
            # As when it was made: zarr would skip (and delete) an all-zero chunk, which then has no file.
            return node.with_config(layout.WRITE_EMPTY) if isinstance(node, zarr.Array) else node
        except KeyError:
            if committed:
                raise StoreError(
                    f"array {info.zarr_path} has {len(committed)} committed chunks in the manifest but is missing"
                    f" on disk: the workspace lost data; run `python -m store verify --data {self.ws.path}` and"
                    f" re-extract (drop-run {self.run})"
                ) from None
            return None

    def _sync_new_nodes(self, zarr_paths: list[str], coords: dict[str, list[Path]]) -> None:
        """Sync new nodes and the coordinates made with them, all at once on the fsync pool (each
        shared parent once), and, for a remote root, upload them."""
        with disk_full_names(self.ws.zarr_path / zarr_paths[0]):
            layout.fsync_node_chains(self.ws.path, [*zarr_paths, *coords], self._syncers,
                                     [f for files in coords.values() for f in files])
        for path in zarr_paths:
            self._upload(partial(self.ws.root.upload_meta, path))
        if self.ws.root.remote:
            for files in coords.values():
                self._upload(partial(self.ws.root.upload, files))
                files[-1].unlink()  # its ids, staged like a chunk: once uploaded, only metadata stays local

    def _create_nodes(self, todo: list[tuple[ArrayInfo, layout.Codec]]) -> tuple[dict[str, Any], dict[str, list[Path]]]:
        """The new arrays' Zarr nodes, in one call, and the ``sample`` coordinate of each dense
        array's group that has none yet (node path: its files); not yet durable: see :meth:`_sync_new_nodes`."""
        metas = {info.zarr_path: self._node_metadata(info, codec) for info, codec in todo}
        groups = dict.fromkeys(info.zarr_path.rsplit("/", 1)[0] for info, _ in todo if info.layout == "dense")
        with disk_full_names(self.ws.zarr_path / todo[0][0].zarr_path):
            nodes = layout.create_nodes(self._root, metas, layout.WRITE_EMPTY)
            coords = {f"{group}/{layout.COORD}": layout.ensure_sample_coord(self._root, group, self._stimuli or [])
                      for group in groups}
        return nodes, {path: files for path, files in coords.items() if files}

    def _node_metadata(self, info: ArrayInfo, codec: layout.Codec) -> layout.NodeMetadata:
        """The ``zarr.json`` document of a new array: a dense array, or a ragged array's group."""
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
        if info.layout == "dense":
            return layout.dense_metadata(info.n_samples, info.item_shape, info.chunk_samples, info.stored_dtype,
                                         codec, info.dims[1:], attrs)
        attrs["row_shape"] = list(info.item_shape)
        attrs["blocks"] = "b<k>/rows [n_rows, ...] and b<k>/offsets [n+1] per chunk of chunk_samples samples"
        return layout.ragged_metadata(attrs)


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


_ARRAY_ROW = "(" + ", ".join(["?"] * 16) + ", 0, ?)"


def _insert_arrays(con: Any, infos: list[ArrayInfo]) -> None:
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

