"""Run-level tensors (the unembedding matrix and final norm the logit lens needs).

Written synchronously and uncompressed, one Zarr array each under ``<run>/_tensors/<name>``,
recorded in the ``tensors`` table with a CRC-32C of the stored values. A resume that writes the
same tensor leaves the committed copy alone; a changed tensor loses its row before its files
change, so a kill mid-write leaves no row rather than a row pointing at half-written bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from store import arrays as layout
from store.checksum import crc32c
from store.dtypes import as_numpy, cast, numpy_dtype, tensor_stored
from store.errors import StoreError
from store.records import check_name
from store.writer_core import WriterCore, disk_full_names, now, unstage


class Tensors(WriterCore):
    """``write_tensor`` of a writer."""

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
            stored_dtype = tensor_stored(kind, self.info.bf16)
        c = cast(np.ascontiguousarray(arr), kind, stored_dtype, self.info.overflow, f"tensor {name}")
        vals = np.ascontiguousarray(c.values)
        if vals.ndim == 0:
            vals = vals.reshape(1)
        path = f"{self.run}/_tensors/{name}"
        crc = crc32c(vals)
        if self._tensor_is_stored(name, path, vals.shape, stored_dtype, crc):
            return  # a resume: the committed copy is this tensor; rewriting it could leave a half-written one
        self._mark_running()
        files = self._write_tensor_files(path, name, vals, module, kind, stored_dtype)
        nbytes = sum(f.stat().st_size for f in files if f.name != "zarr.json")

        def upload() -> None:
            self.ws.root.upload(files)
            self.ws.root.upload_meta(path)

        self._upload(upload)
        with self._write_connection() as con:
            con.execute("BEGIN TRANSACTION")
            con.execute("DELETE FROM tensors WHERE run = ? AND name = ?", [self.run, name])
            con.execute(
                "INSERT INTO tensors VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [self.run, name, module, path, list(vals.shape), kind, stored_dtype, nbytes, crc, now()],
            )
            con.execute("COMMIT")
        if self.ws.root.remote:
            unstage(files)

    def _tensor_is_stored(self, name: str, path: str, shape: tuple[int, ...], stored_dtype: str, crc: int) -> bool:
        """Whether the committed copy of ``name`` is this tensor; if another one is, forget its row
        before its files change: a kill mid-write then leaves no row, not a broken one."""
        with self._write_connection() as con:
            known = con.execute("SELECT shape, stored_dtype, crc32c FROM tensors WHERE run = ? AND name = ?",
                                [self.run, name]).fetchall()
            if not known:
                return False
            old_shape, stored, known_crc = known[0]
            if (list(old_shape) == list(shape) and stored == stored_dtype and known_crc == crc
                    and self.ws.root.has(path)):
                return True
            self._mark_running(con)
            con.execute("DELETE FROM tensors WHERE run = ? AND name = ?", [self.run, name])
        return False

    def _write_tensor_files(self, path: str, name: str, vals: np.ndarray, module: str | None, kind: str,
                            stored_dtype: str) -> list[Path]:
        """The tensor's Zarr array, fsynced with its folder chain; returns its files."""
        per_row = max(1, vals[:1].nbytes)
        with disk_full_names(self.ws.zarr_path / path):
            meta = layout.array_metadata(
                vals.shape, (max(1, min(vals.shape[0], (16 << 20) // per_row)), *vals.shape[1:]),
                numpy_dtype(stored_dtype), None, (),
                {"run": self.run, "name": name, "module": module, "source_dtype": kind, "stored_dtype": stored_dtype},
            )
            arr_z = layout.create_array(self._root, path, meta)
            arr_z[...] = vals
            files = sorted((self.ws.zarr_path / path).iterdir())
            layout.fsync_node_chains(self.ws.path, [path], self._syncers, files)
        return files
