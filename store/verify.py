"""``verify``: is every committed chunk there, readable, and what the manifest says it is?

Reads through zarr-python (not the reader's memory-map fast path), so a pass also proves the
arrays are plain Zarr. Problems make ``python -m store verify`` exit non-zero; warnings (NaN/inf
counts, clipped values, leftovers of interrupted writes) are reported but do not fail.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import duckdb
import numpy as np
import zarr

from store import arrays as layout
from store import derived as store_derived
from store import location
from store.checksum import crc32c
from store.dtypes import numpy_dtype
from store.errors import StoreError
from store.lock import live_writers
from store.schema import latest_version

if TYPE_CHECKING:
    from store.records import ArrayInfo
    from store.workspace import Workspace

_TABLES = ("runs", "stimuli", "samples", "activations", "chunks", "tensors", "generations", "probes")


@dataclass
class VerifyReport:
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    runs: int = 0
    arrays: int = 0
    derived: int = 0
    chunks: int = 0
    bytes_checked: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(ws: Workspace, *, run: str | None = None, checksums: bool = True) -> VerifyReport:
    started = time.perf_counter()
    rep = VerifyReport()
    try:
        m = _read_manifest(ws, run)
    except duckdb.Error as err:
        rep.problems.append(f"manifest {ws.manifest_path} is unreadable: {type(err).__name__}: {err}")
        rep.seconds = time.perf_counter() - started
        return rep
    if m.version != latest_version():
        rep.problems.append(f"manifest schema version {m.version}, expected {latest_version()}")
    if run and not m.runs:
        rep.problems.append(f"no run {run!r} in the manifest")
    root_ok = (ws.zarr_path / "zarr.json").is_file()
    if not root_ok:
        rep.problems.append(f"the Zarr group {ws.zarr_path} is missing (no zarr.json)")
    elif ws.root.remote:
        root_ok = _check_remote_root(ws, rep)
        if not root_ok and rep.problems[-1].endswith(_UNREACHABLE):
            # Every array, tensor and derived chunk would fail the same way: one finding, not hundreds.
            rep.problems.append(f"not checked: the {len(m.runs)} run(s)' arrays, tensors and derived arrays"
                                f" at {ws.root.url}, which cannot be reached")
            rep.seconds = time.perf_counter() - started
            return rep
    writing = {h.run for h in live_writers(ws.path)}
    for run_id, status, n_samples in m.runs:
        _check_run(ws, m, run_id, status, n_samples, run_id in writing, checksums, rep)
    _check_tensors(ws, [t for t in m.tensors if not run or t[0] == run], checksums, rep)
    for row in m.derived:
        if not run or row[1] == run:
            _check_derived(ws, row, checksums, rep)
    if root_ok and run is None:
        _check_leftovers(ws, {r[0] for r in m.runs}, rep)
    rep.seconds = time.perf_counter() - started
    return rep


@dataclass
class _Manifest:
    """What verify reads of the manifest, in one read-only connection."""

    runs: list[tuple[Any, ...]]
    chunks: dict[tuple[str, str], list[tuple[Any, ...]]]  # (run, zarr_path) -> chunk rows
    samples: dict[str, tuple[Any, ...]]  # run -> (rows, min row, max row, rows with a registered stimulus)
    tensors: list[tuple[Any, ...]]
    version: int | None
    derived: list[tuple[Any, ...]] = field(default_factory=list)   # derived_arrays rows (schema >= 7)


def _read_manifest(ws: Workspace, run: str | None) -> _Manifest:
    with ws.connect() as con:
        for table in _TABLES:
            con.sql(f"SELECT * FROM {table}").to_arrow_table()  # every block of every table is readable
        runs = con.execute(
            "SELECT run, status, n_samples FROM runs" + (" WHERE run = ?" if run else "") + " ORDER BY run",
            [run] if run else [],
        ).fetchall()
        chunks: dict[tuple[str, str], list[tuple[Any, ...]]] = {}
        for r in con.execute(
            "SELECT run, zarr_path, chunk, row_start, row_stop, n_rows, crc32c, n_nonfinite, n_clipped,"
            " offsets_crc32c FROM chunks ORDER BY run, zarr_path, chunk"
        ).fetchall():
            chunks.setdefault((r[0], r[1]), []).append(r[2:])
        samples = {
            r[0]: r[1:]
            for r in con.execute(
                "SELECT s.run, count(*), min(array_row), max(array_row), count(st.stimulus)"
                " FROM samples s LEFT JOIN stimuli st USING (stimulus) GROUP BY s.run"
            ).fetchall()
        }
        tensors = con.execute("SELECT run, name, zarr_path, stored_dtype, crc32c FROM tensors").fetchall()
        version = con.execute("SELECT max(version) FROM schema_version").fetchone()
        derived = []
        if con.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = 'derived_arrays'"
                       " AND table_catalog = current_database()").fetchone() == (1,):
            derived = con.execute(f"SELECT {store_derived.COLUMNS} FROM derived_arrays ORDER BY zarr_path").fetchall()
    return _Manifest(runs, chunks, samples, tensors, version[0] if version else None, derived)


def _check_run(ws: Workspace, m: _Manifest, run_id: str, status: str, n_samples: int | None, writing: bool,
               checksums: bool, rep: VerifyReport) -> None:
    rep.runs += 1
    stats = m.samples.get(run_id)
    if n_samples is not None:
        if stats is None or stats[0] != n_samples or stats[1] != 0 or stats[2] != n_samples - 1:
            rep.problems.append(
                f"run {run_id}: samples table maps {stats[0] if stats else 0} rows, expected rows 0..{n_samples - 1}"
            )
        elif stats[3] != stats[0]:
            rep.problems.append(f"run {run_id}: {stats[0] - stats[3]} sample rows point at unregistered stimuli")
    if status == "running" and not writing:
        rep.warnings.append(f"run {run_id} is marked running but no writer holds it: it was interrupted; resume it")
    infos = ws.arrays(run_id)
    if status == "failed":  # its chunks may all check out, and it still is not a whole run
        done = sum(len(m.chunks.get((run_id, i.zarr_path), [])) for i in infos)
        rep.warnings.append(
            f"run {run_id} failed: {done} of {sum(i.n_chunks for i in infos)} chunk(s) committed; resume it"
            f" (run its manifest again) or drop it (python -m store drop-run {run_id})")
    for info in infos:
        rep.arrays += 1
        _check_array(ws, info, status, m.chunks.get((run_id, info.zarr_path), []), checksums, rep)


def _check_tensors(ws: Workspace, tensors: list[tuple[Any, ...]], checksums: bool, rep: VerifyReport) -> None:
    for run_id, name, path, _stored, crc in tensors:
        try:
            values = np.ascontiguousarray(ws.root.open(layout.check_zarr_path(path))[...])
            if checksums and crc32c(values) != crc:
                rep.problems.append(f"tensor {run_id}/{name}: checksum mismatch at {ws.root.where(path)}")
        except Exception as err:  # noqa: BLE001 - any failure to read is the finding
            rep.problems.append(f"tensor {run_id}/{name} unreadable at {ws.root.where(path)}: {err}")


def _check_derived(ws: Workspace, row: tuple[Any, ...], checksums: bool, rep: VerifyReport) -> None:
    """A derived array (store/derived.py): its node matches its row and every chunk is there, reads
    back and has the CRC-32C recorded when it was derived (schema v9; older ones: a warning that they
    are unchecked). A source re-extracted since makes it stale, which readers handle (they pool on
    the fly): a note."""
    info = store_derived.from_row(row)
    where = f"derived array {info.zarr_path}"
    rep.derived += 1
    try:
        node = ws.root.open(layout.check_zarr_path(info.zarr_path)) if ws.root.has(info.zarr_path) else None
    except Exception as err:  # noqa: BLE001 - any failure to open is the finding
        rep.problems.append(f"{where}: cannot open {ws.root.where(info.zarr_path)}: {err}")
        return
    fix = f"derive it again: python -m probes derive --run {info.run} --pool {info.op.removeprefix('pool_')}"
    if not isinstance(node, zarr.Array):
        rep.problems.append(f"{where}: array missing at {ws.root.where(info.zarr_path, 'zarr.json')}; {fix}")
        return
    if tuple(node.shape) != info.shape or node.dtype != np.dtype(store_derived.DTYPE) \
            or node.chunks[0] != info.chunk_samples:
        rep.problems.append(f"{where}: on disk {tuple(node.shape)} {node.dtype} in chunks of {node.chunks[0]}, its"
                            f" derived_arrays row says {info.shape} {store_derived.DTYPE} in chunks of"
                            f" {info.chunk_samples}; {fix}")
        return
    expect = info.chunk_samples * int(np.prod(info.shape[1:])) * 4
    for k in range(info.n_chunks):
        name = layout.chunk_file_key(len(info.shape), k)
        size = ws.root.size(info.zarr_path, name)
        lo, hi = k * info.chunk_samples, min((k + 1) * info.chunk_samples, info.shape[0])
        try:
            if size != expect:
                raise StoreError(f"{ws.root.where(info.zarr_path, name)} is "
                                 + ("missing" if size is None else f"{size} bytes, expected {expect}"))
            values = np.asarray(node[lo:hi])
            rep.bytes_checked += values.nbytes
        except Exception as err:  # noqa: BLE001 - any failure to read is the finding
            rep.problems.append(f"{where}: chunk {k} (rows {lo}-{hi - 1}) unreadable: {err}; {fix}")
            return
        if checksums and info.chunk_crc32c is not None and crc32c(values) != info.chunk_crc32c[k]:
            rep.problems.append(f"{where}: chunk {k} (rows {lo}-{hi - 1}) checksum mismatch: its bytes changed after"
                                f" it was derived ({ws.root.where(info.zarr_path, name)}); {fix}")
    if info.chunk_crc32c is None:
        rep.warnings.append(f"{where} was derived before derived chunks were checksummed (manifest schema < 9): its"
                            f" values are checked for size only; {fix}")
    source = ws.rows("SELECT count(*) FROM activations WHERE run = ? AND zarr_path = ?",
                     [info.run, info.source_zarr_path])
    if source != [(1,)] or info.source_digest != store_derived.digest_of(ws, info.run, info.source_zarr_path):
        rep.warnings.append(f"{where} is stale: its source {info.source_zarr_path} was re-extracted or dropped since,"
                            f" so plans pool the tokens on the fly instead of reading it; {fix}")


def _check_leftovers(ws: Workspace, known: set[str], rep: VerifyReport) -> None:
    for child in ws.root.children():
        if child not in known:
            rep.warnings.append(
                f"Zarr folder {ws.root.where(child)} belongs to no run in the manifest (orphan; safe to delete)"
            )
    partial = list(ws.zarr_path.rglob("*.partial"))
    if partial:
        rep.warnings.append(f"{len(partial)} '.partial' file(s) left by interrupted writes, e.g. {partial[0]}")


_UNREACHABLE = (" Check the bucket, and the credentials and endpoint in the environment (AWS_ACCESS_KEY_ID,"
                " AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, $AGNOSIA_STORAGE_OPTIONS)")


def _check_remote_root(ws: Workspace, rep: VerifyReport) -> bool:
    """Whether the object store holds this workspace's root group (the same workspace id)."""
    try:
        what = ws.root.foreign()
    except Exception as err:  # noqa: BLE001 - any failure to reach it is the finding
        rep.problems.append(f"the arrays at {ws.root.url} cannot be reached: {type(err).__name__}: {err}."
                            f"{_UNREACHABLE}")
        return False
    if what is not None:
        rep.problems.append(
            f"the arrays at {ws.root.url} are gone: it holds {what}, not this workspace's arrays"
            f" (id {ws.root.local_meta().get(location.ID_ATTR)})"
        )
        return False
    return True


def _check_array(ws: Workspace, info: ArrayInfo, status: str, chunks: list[tuple], checksums: bool,
                 rep: VerifyReport) -> None:
    where = info.key()
    node = _open_node(ws, info, rep)
    if node is None:
        return
    nonfinite = sum(c[5] for c in chunks)
    clipped = sum(c[6] for c in chunks)
    if nonfinite:
        worst = [c[0] for c in chunks if c[5]][:5]
        rep.warnings.append(
            f"{where}: {nonfinite} NaN/inf value(s) stored as the model produced them (chunks {worst}...)")
    if clipped:
        rep.warnings.append(f"{where}: {clipped} value(s) clipped to the float16 range (overflow='clip')")
    unknown = sum(_check_chunk(ws, info, node, c, checksums, rep) for c in chunks)
    if unknown:
        rep.warnings.append(
            f"{where}: {unknown} ragged chunk(s) were committed before offsets were checksummed (manifest schema < 3):"
            " their offsets are checked for shape only; re-extract the run to checksum them"
        )
    committed = {c[0] for c in chunks}
    if status == "finished" and len(committed) != info.n_chunks:
        missing = sorted(set(range(info.n_chunks)) - committed)
        rep.problems.append(
            f"{where}: run is finished but {len(missing)} chunk(s) are not committed, e.g. {missing[:5]}")


def _open_node(ws: Workspace, info: ArrayInfo, rep: VerifyReport) -> Any:
    """The array's Zarr node if it is there and matches the manifest's layout (else None, and why)."""
    where = info.key()
    try:
        zarr_path = layout.check_zarr_path(info.zarr_path)
    except StoreError as err:
        rep.problems.append(f"{where}: {err}")
        return None
    folder = ws.root.where(zarr_path)
    try:
        there = ws.root.has(zarr_path)
    except OSError as err:   # the object store refused or dropped the request: the finding, not a crash
        rep.problems.append(f"{where}: cannot reach {folder}: {type(err).__name__}: {err}")
        return None
    if not there:
        rep.problems.append(f"{where}: array missing on disk (expected {folder}/zarr.json)")
        return None
    try:
        node = ws.root.open(zarr_path)
    except Exception as err:  # noqa: BLE001
        rep.problems.append(f"{where}: cannot open {folder}: {err}")
        return None
    if info.layout == "dense":
        if not isinstance(node, zarr.Array):
            rep.problems.append(f"{where}: expected a Zarr array at {folder}, found a group")
            return None
        if tuple(node.shape) != info.shape:
            rep.problems.append(f"{where}: shape on disk {tuple(node.shape)} != manifest {info.shape}")
        if node.dtype != numpy_dtype(info.stored_dtype):
            rep.problems.append(f"{where}: dtype on disk {node.dtype} != stored dtype {info.stored_dtype}")
        if node.chunks[0] != info.chunk_samples:
            rep.problems.append(f"{where}: chunks on disk {node.chunks} != {info.chunk_samples} samples per chunk")
    elif not isinstance(node, zarr.Group):
        rep.problems.append(f"{where}: expected a ragged group at {folder}, found an array")
        return None
    return node


def _check_chunk(ws: Workspace, info: ArrayInfo, node: Any, row: tuple[Any, ...], checksums: bool,
                 rep: VerifyReport) -> int:
    """Check one committed chunk; returns 1 if its offsets predate offsets checksums, else 0."""
    where = info.key()
    chunk, row_start, row_stop, n_rows, crc, _, _, offsets_crc = row
    rep.chunks += 1
    expect = info.chunk_rows(chunk) if 0 <= chunk < info.n_chunks else None
    if expect is None or (row_start, row_stop) != (expect.start, expect.stop):
        rep.problems.append(f"{where}: chunk {chunk} rows [{row_start}, {row_stop}) do not match the chunk grid")
        return 0
    try:
        values, offsets = _read_chunk(ws, info, node, chunk, row_start, row_stop, n_rows)
    except Exception as err:  # noqa: BLE001
        rep.problems.append(f"{where}: chunk {chunk} unreadable: {type(err).__name__}: {err}")
        return 0
    rep.bytes_checked += values.nbytes
    if checksums and crc32c(values) != crc:
        rep.problems.append(
            f"{where}: chunk {chunk} (rows {row_start}-{row_stop - 1}) checksum mismatch: its bytes changed after"
            f" commit ({_chunk_location(ws, info, chunk)})"
        )
    if offsets is None or not checksums:
        return 0
    if offsets_crc is None:
        return 1
    if crc32c(offsets.astype(np.int64)) != offsets_crc:
        rep.problems.append(
            f"{where}: chunk {chunk} (rows {row_start}-{row_stop - 1}) offsets checksum mismatch: the per-sample"
            f" splits changed after commit ({ws.root.where(info.zarr_path, layout.block_name(chunk))}/offsets)"
        )
    return 0


def _chunk_location(ws: Workspace, info: ArrayInfo, chunk: int) -> str:
    if info.layout == "dense":
        return ws.root.where(info.zarr_path, layout.chunk_file_key(len(info.shape), chunk))
    return ws.root.where(info.zarr_path, layout.block_name(chunk))


def _read_chunk(ws: Workspace, info: ArrayInfo, node: object, chunk: int, start: int, stop: int,
                n_rows: int) -> tuple[np.ndarray, np.ndarray | None]:
    """The chunk's stored values, and its offsets when ragged."""
    if info.layout == "dense":
        name = layout.chunk_file_key(len(info.shape), chunk)
        if ws.root.size(info.zarr_path, name) is None:
            # zarr would silently return fill values for a missing chunk.
            raise StoreError(f"chunk file {ws.root.where(info.zarr_path, name)} is missing")
        assert isinstance(node, zarr.Array)
        values = np.asarray(node[start:stop])
        if values.shape[0] != n_rows:
            raise StoreError(f"{values.shape[0]} rows read, manifest says {n_rows}")
        return values, None
    assert isinstance(node, zarr.Group)
    block = node[layout.block_name(chunk)]
    assert isinstance(block, zarr.Group)
    offsets_node, rows = block["offsets"], block["rows"]
    assert isinstance(offsets_node, zarr.Array) and isinstance(rows, zarr.Array)
    offsets = np.asarray(offsets_node[...])
    if len(offsets) != stop - start + 1 or offsets[0] != 0 or np.any(np.diff(offsets) < 0):
        raise StoreError(f"offsets {offsets[:4]}... do not describe {stop - start} samples")
    if int(offsets[-1]) != rows.shape[0] or rows.shape[0] != n_rows:
        raise StoreError(f"block holds {rows.shape[0]} rows, offsets end at {offsets[-1]}, manifest says {n_rows}")
    rows_path = f"{info.zarr_path}/{layout.block_name(chunk)}/rows"
    if n_rows and not ws.root.has(rows_path, layout.chunk_file_key(rows.ndim, 0)):
        raise StoreError("rows chunk file is missing")
    return np.asarray(rows[...]), offsets
