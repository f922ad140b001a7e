"""Run-level tensors (the unembedding matrix and final norm the logit lens needs).

Written synchronously and uncompressed, one Zarr array each under ``<run>/_tensors/<name>``,
recorded in the ``tensors`` table with a CRC-32C of the stored values. A resume that writes the
same tensor leaves the committed copy alone; a changed tensor loses its row before its files
change, so a kill mid-write leaves no row rather than a row pointing at half-written bytes.
Tensors written in one call commit in one transaction: they land together or not at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from store import arrays as layout
from store.checksum import crc32c
from store.dtypes import as_numpy, cast, numpy_dtype, tensor_stored
from store.errors import StoreError
from store.records import check_name
from store.writer.context import RunContext, disk_full_names, now, unstage
from store.writer.run_manifest import RunManifest


class RunTensors:
    """The run tensors of a writer; they mark the run running through its :class:`RunManifest`."""

    def __init__(self, ctx: RunContext, runs: RunManifest) -> None:
        self._ctx = ctx
        self._runs = runs

    def write(
        self,
        tensors: Mapping[str, Any],
        *,
        dtype: str = "float32",
        modules: Mapping[str, str | None] | None = None,
        stored_dtype: str | None = None,
    ) -> None:
        """Store ``tensors`` (``modules``: each one's module path): one query for what is stored,
        one pass of fsyncs and one transaction for all of them."""
        ctx = self._ctx
        for name in tensors:
            check_name("tensor name", name)
        if ctx.shard is not None and ctx.shard.index != 0:
            raise StoreError(
                f"run tensors of a sharded run are written by shard 0 (this is shard {ctx.shard}): skip"
                " write_tensor on the other shards"
            )
        prepared = [self._prepared(name, values, dtype, stored_dtype, (modules or {}).get(name))
                    for name, values in tensors.items()]
        todo = self._not_stored(prepared)
        if not todo:
            return  # a resume: the committed copies are these tensors; rewriting them could leave half-written ones
        self._runs.mark_running()
        paths = [t.path for t in todo]
        with disk_full_names(ctx.ws.zarr_path / paths[0]):
            files = {t.path: self._write_tensor_files(t) for t in todo}
            every_file = [f for fs in files.values() for f in fs]
            layout.fsync_node_chains(ctx.ws.path, paths, ctx.syncers, every_file)

        def upload() -> None:
            ctx.ws.root.upload(every_file)
            for path in paths:
                ctx.ws.root.upload_meta(path)

        ctx.upload(upload)
        at = now()
        with ctx.connection() as con:
            con.execute("BEGIN TRANSACTION")
            con.execute("DELETE FROM tensors WHERE run = ? AND list_contains(?, name)", [ctx.run, [t.name for t in todo]])
            for t in todo:
                nbytes = sum(f.stat().st_size for f in files[t.path] if f.name != "zarr.json")
                con.execute(
                    "INSERT INTO tensors VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    [ctx.run, t.name, t.module, t.path, list(t.values.shape), t.kind, t.stored_dtype, nbytes, t.crc,
                     at],
                )
            con.execute("COMMIT")
        if ctx.ws.root.remote:
            unstage(every_file)

    def _prepared(self, name: str, values: Any, dtype: str, stored_dtype: str | None,
                  module: str | None) -> _Tensor:
        """``values`` cast as they will be stored, with their checksum."""
        arr, kind = as_numpy(values, dtype)
        stored = stored_dtype or tensor_stored(kind, self._ctx.info.bf16)
        c = cast(np.ascontiguousarray(arr), kind, stored, self._ctx.info.overflow, f"tensor {name}")
        vals = np.ascontiguousarray(c.values)
        if vals.ndim == 0:
            vals = vals.reshape(1)
        return _Tensor(name, f"{self._ctx.run}/_tensors/{name}", vals, kind, stored, module, crc32c(vals))

    def _not_stored(self, tensors: list[_Tensor]) -> list[_Tensor]:
        """The tensors whose committed copy is not this one. The row of one that has another copy
        goes before its files change: a kill mid-write then leaves no row, not a broken one."""
        with self._ctx.connection() as con:
            known = {name: rest for name, *rest in con.execute(
                "SELECT name, shape, stored_dtype, crc32c FROM tensors WHERE run = ? AND list_contains(?, name)",
                [self._ctx.run, [t.name for t in tensors]]).fetchall()}
            if not known:
                return tensors
            todo = [t for t in tensors if t.name not in known or known[t.name] != [list(t.values.shape), t.stored_dtype, t.crc]
                    or not self._ctx.ws.root.has(t.path)]
            changed = [t.name for t in todo if t.name in known]
            if changed:
                self._runs.mark_running(con)
                con.execute("DELETE FROM tensors WHERE run = ? AND list_contains(?, name)", [self._ctx.run, changed])
        return todo

    def _write_tensor_files(self, t: _Tensor) -> list[Path]:
        """The tensor's Zarr array (not yet durable); returns its files."""
        per_row = max(1, t.values[:1].nbytes)
        meta = layout.array_metadata(
            t.values.shape, (max(1, min(t.values.shape[0], (16 << 20) // per_row)), *t.values.shape[1:]),
            numpy_dtype(t.stored_dtype), None, (),
            {"run": self._ctx.run, "name": t.name, "module": t.module, "source_dtype": t.kind, "stored_dtype": t.stored_dtype},
        )
        arr_z = layout.create_array(self._runs.root, t.path, meta)
        arr_z[...] = t.values
        return sorted((self._ctx.ws.zarr_path / t.path).iterdir())


@dataclass(frozen=True)
class _Tensor:
    """A run tensor as it will be stored."""

    name: str
    path: str
    values: np.ndarray
    kind: str           # the source dtype
    stored_dtype: str
    module: str | None
    crc: int
