"""Derived arrays: a function of one stored array (a pooled vector per sample), computed once per
chunk, kept in the run's folder beside its source and registered in ``derived_arrays`` with what it
was computed from, so later readers reuse it without reading the source's token arrays again.

The store knows nothing of the function (probes/ computes it); it keeps the bytes, their
provenance, and whether they still match their source: ``source_digest`` hashes the source's
committed chunk rows (crc32c, n_rows, committed_at), so a re-extracted or re-committed chunk makes
the derived array stale, never silently reused. Each derived chunk's CRC-32C is recorded
(``chunk_crc32c``, schema v9) as the main arrays' chunks record theirs: ``verify`` checks it, and
:func:`damaged_chunks` lets a reader refuse bytes that changed after they were written.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb
import numpy as np

from store import arrays as layout
from store import db, location
from store.checksum import crc32c
from store.errors import StoreError, disk_full_error, is_disk_full
from store.records import ArrayInfo

if TYPE_CHECKING:
    from store.workspace import Workspace

DTYPE = "float32"
COLUMNS = ("zarr_path, run, tap, layer, site, tokens, source_zarr_path, op, shape, dtype, chunk_samples, n_chunks,"
            " source_digest, code, created_at, chunk_crc32c")


@dataclass(frozen=True)
class DerivedInfo:
    """One ``derived_arrays`` row: a dense ``[n_samples, d]`` float32 array and its provenance."""

    zarr_path: str
    run: str
    tap: str
    layer: int
    site: str
    tokens: str
    source_zarr_path: str
    op: str
    shape: tuple[int, ...]
    chunk_samples: int
    n_chunks: int
    source_digest: str
    code: str
    chunk_crc32c: tuple[int, ...] | None = None   # None: derived before schema v9 (unchecked)

    def array_info(self) -> ArrayInfo:
        """The derived array as the store's readers take it (dense, float32, no codec)."""
        d = int(np.prod(self.shape[1:]))
        return ArrayInfo(run=self.run, tap=self.tap, layer=self.layer, site=self.site, tokens=self.tokens,
                         module=None, zarr_path=self.zarr_path, layout="dense", shape=self.shape,
                         dims=("sample", "feature"), chunk_samples=self.chunk_samples, n_chunks=self.n_chunks,
                         dtype=DTYPE, stored_dtype=DTYPE, codec="none", values_per_row=d,
                         bytes=self.shape[0] * d * 4)


def derived_path(source: ArrayInfo, op: str) -> str:
    # Inside the run's folder (a leading '_' like _tensors): dropping the run removes it too.
    return f"{source.run}/_derived/{source.tap}.{source.layer}.{source.site}.{source.tokens}.{op}"


def source_digest(ws: Workspace, source: ArrayInfo) -> str:
    """What the source's committed chunks are now: changes when any chunk is re-written."""
    return digest_of(ws, source.run, source.zarr_path)


def digest_of(ws: Workspace, run: str, zarr_path: str) -> str:
    rows = ws.rows("SELECT chunk, n_rows, crc32c, CAST(committed_at AS VARCHAR) FROM chunks"
                   " WHERE run = ? AND zarr_path = ? ORDER BY chunk", [run, zarr_path])
    return hashlib.sha256(repr(rows).encode()).hexdigest()


def find(ws: Workspace, source: ArrayInfo, op: str) -> DerivedInfo | None:
    got = ws.rows(f"SELECT {COLUMNS} FROM derived_arrays WHERE zarr_path = ?", [derived_path(source, op)])
    return from_row(got[0]) if got else None


def from_row(r: tuple[Any, ...]) -> DerivedInfo:
    """A ``SELECT {COLUMNS} FROM derived_arrays`` row as a DerivedInfo."""
    return DerivedInfo(zarr_path=r[0], run=r[1], tap=r[2], layer=int(r[3]), site=r[4], tokens=r[5],
                       source_zarr_path=r[6], op=r[7], shape=tuple(int(x) for x in r[8]), chunk_samples=int(r[10]),
                       n_chunks=int(r[11]), source_digest=r[12], code=r[13],
                       chunk_crc32c=None if r[15] is None else tuple(int(c) for c in r[15]))


def is_fresh(ws: Workspace, derived: DerivedInfo, source: ArrayInfo) -> bool:
    return derived.source_zarr_path == source.zarr_path and derived.source_digest == source_digest(ws, source)


def planned(source: ArrayInfo, op: str, shape: tuple[int, ...]) -> DerivedInfo:
    """The row ``write`` would register for ``source`` (a dry run's bytes; nothing is written)."""
    return DerivedInfo(zarr_path=derived_path(source, op), run=source.run, tap=source.tap, layer=source.layer,
                       site=source.site, tokens=source.tokens, source_zarr_path=source.zarr_path, op=op,
                       shape=tuple(shape), chunk_samples=source.chunk_samples, n_chunks=source.n_chunks,
                       source_digest="", code="")


def write(ws: Workspace, source: ArrayInfo, op: str, code: str,
          compute: Callable[[int, range], np.ndarray]) -> DerivedInfo:
    """Compute ``compute(chunk, rows) -> [len(rows), ...]`` for every chunk of ``source``, write the
    values as float32 and register them (replacing an older derivation of the same op) in one
    short transaction once every chunk is on disk, or, when the workspace's arrays live in an object
    store, uploaded (then the staged local copies go, as the writer's do)."""
    committed = {int(c) for (c,) in ws.rows("SELECT chunk FROM chunks WHERE run = ? AND zarr_path = ?",
                                            [source.run, source.zarr_path])}
    missing = sorted(set(range(source.n_chunks)) - committed)
    if missing:
        raise StoreError(f"{source.key()}: {len(missing)} chunk(s) not committed (first {missing[:3]}): finish the"
                         " extraction before deriving from it")
    digest = source_digest(ws, source)
    path = derived_path(source, op)
    with _disk_full_names(ws.root.where(path)):
        shape, files, crcs = _write_chunks(ws, source, path, op, code, compute)
    if ws.root.remote:
        # An object shows only once whole: every chunk and the metadata up, then the row.
        try:
            ws.root.upload(files)
            ws.root.upload_meta(path)
        except OSError as err:
            raise location.describe_remote_error(str(ws.root.url), err) from err
    info = replace(planned(source, op, shape), source_digest=digest, code=code, chunk_crc32c=tuple(crcs))
    with _disk_full_names(ws.manifest_path), db.connect(ws.manifest_path, read_only=False, timeout=ws.timeout) as con:
        con.execute("BEGIN TRANSACTION")
        try:
            con.execute("DELETE FROM derived_arrays WHERE zarr_path = ?", [path])
            con.execute(f"INSERT INTO derived_arrays ({COLUMNS}) VALUES ({', '.join('?' * 16)})",
                        [path, info.run, info.tap, info.layer, info.site, info.tokens, info.source_zarr_path, op,
                         list(info.shape), DTYPE, info.chunk_samples, info.n_chunks, digest, code,
                         datetime.now(UTC).replace(tzinfo=None), crcs])
            con.execute("COMMIT")
        except BaseException:
            db.rollback(con)
            raise
    if ws.root.remote:
        for f in files:
            f.unlink(missing_ok=True)
    return info


def damaged_chunks(ws: Workspace, info: DerivedInfo) -> list[str]:
    """What is wrong with ``info``'s chunks as they are now: a missing file, a checksum that no longer
    matches the one recorded at derive time (empty: every chunk reads back as written). An array
    derived before checksums (schema < 9) is checked for presence only."""
    problems = []
    node: Any = ws.root.open(layout.check_zarr_path(info.zarr_path))
    for k in range(info.n_chunks):
        name = layout.chunk_file_key(len(info.shape), k)
        lo, hi = k * info.chunk_samples, min((k + 1) * info.chunk_samples, info.shape[0])
        if ws.root.size(info.zarr_path, name) is None:  # zarr would read a missing chunk as zeros
            problems.append(f"chunk {k} (rows {lo}-{hi - 1}) is missing ({ws.root.where(info.zarr_path, name)})")
            continue
        if info.chunk_crc32c is not None and crc32c(np.asarray(node[lo:hi])) != info.chunk_crc32c[k]:
            problems.append(f"chunk {k} (rows {lo}-{hi - 1}) checksum mismatch: its bytes changed after it was derived"
                            f" ({ws.root.where(info.zarr_path, name)})")
    return problems


@contextmanager
def _disk_full_names(where: object) -> Iterator[None]:
    """A full disk met while deriving becomes one DiskFullError naming the file (a StoreError the
    command line prints as one line); the derived array is only registered once whole, so nothing is lost."""
    try:
        yield
    except (OSError, duckdb.Error) as err:
        if is_disk_full(err):
            raise disk_full_error(getattr(err, "filename", None) or where, err) from err
        raise


def _write_chunks(ws: Workspace, source: ArrayInfo, path: str, op: str, code: str,
                  compute: Callable[[int, range], np.ndarray]) -> tuple[tuple[int, ...], list[Path], list[int]]:
    """Every chunk computed and written (fsynced) under the workspace's ``arrays/``: (shape, chunk
    files, each chunk's CRC-32C)."""
    root = layout.open_root(ws.path, read_only=False)
    arr: Any = None
    files, crcs = [], []
    for k in range(source.n_chunks):
        rows = source.chunk_rows(k)
        values = np.ascontiguousarray(compute(k, rows), dtype=np.float32)
        if values.shape[0] != len(rows):
            raise StoreError(f"derived {op} of {source.key()} chunk {k}: {values.shape[0]} rows for {len(rows)}")
        if arr is None:
            arr = layout.create_array(root, path, layout.dense_metadata(
                source.n_samples, values.shape[1:], source.chunk_samples, DTYPE, layout.parse_codec("none", DTYPE),
                ("feature",) * (values.ndim - 1), {"source": source.zarr_path, "op": op, "code": code}))
        arr[rows.start:rows.stop] = values
        crcs.append(crc32c(values))
        files.append(layout.dense_chunk_file(ws.path, path, values.ndim, k))
        layout.fsync_path(files[-1])
    if arr is None:
        raise StoreError(f"{source.key()} has no rows to derive from")
    layout.fsync_node_chain(ws.path, path)
    return tuple(arr.shape), files, crcs
