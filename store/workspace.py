"""A workspace: one folder holding the Zarr group of arrays and the DuckDB manifest.

::

    <data>/                       default ./data, or $AGNOSIA_DATA, or --data PATH
        manifest.duckdb           the manifest (tables and views of store/schema.py)
        arrays/                   Zarr v3 group: <run>/<tap>/<layer>/<site>/<tokens>
                                  (or only its metadata and the writer's staging area, when the
                                  arrays live in an object store: store/location.py)
        writer.lock               who writes (pid, host, run); see store/lock.py
        .trash/                   runs being dropped (removed at the next writer start)

Everything that only reads opens the manifest read-only, for the length of one call.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb
import numpy as np
import pyarrow as pa

from store import arrays as layout
from store import db, location, reader
from store import schema as schema_mod
from store.errors import (
    DiskFullError,
    NotCommittedError,
    SchemaVersionError,
    StoreError,
    WorkspaceError,
    disk_full_error,
    is_disk_full,
)
from store.location import ArrayRoot
from store.maintenance import WorkspaceWrites
from store.records import ARRAY_COLUMNS, ArrayInfo, RunInfo, Selection, array_info_of_row

if TYPE_CHECKING:
    from store.ahead import ManifestAhead
    from store.verify import VerifyReport
    from store.writer import Writer

ENV_VAR = "AGNOSIA_DATA"
DEFAULT_PATH = "data"
MANIFEST = "manifest.duckdb"


def resolve_path(path: str | os.PathLike[str] | None = None) -> Path:
    """Where a command's workspace is: ``--data PATH`` wins, then ``$AGNOSIA_DATA``, then ``./data``.

    Parameters
    ----------
    path
        The ``--data`` argument; None or "" when not given.

    Returns
    -------
    Path
        The workspace folder (it need not exist yet).
    """
    if path is not None and str(path) != "":
        return Path(path)
    return Path(os.environ.get(ENV_VAR) or DEFAULT_PATH)


class Workspace(WorkspaceWrites):
    """Open with :meth:`open`. Methods that read never change the workspace."""

    def __init__(self, path: Path, timeout: float = db.DEFAULT_TIMEOUT) -> None:
        self.path = path
        self.manifest_path = path / MANIFEST
        self.zarr_path = path / layout.ZARR_DIR
        self.root = ArrayRoot(self.zarr_path)  # the remote URL, if any, is read from the group at open
        self.timeout = timeout
        self.created = False  # whether open() made this manifest (so it holds no run yet)
        # A read's manifest queries (an attach and three statements) cost more than reading a few
        # MB. What read() needs from the manifest (array rows, committed chunks, selections) is
        # kept while the manifest file and its WAL are unchanged: any commit by any process
        # changes their stat.
        self._cache: dict[tuple[Any, ...], Any] = {}
        self._cache_stamp: tuple[Any, ...] | None = None
        self._cache_lock = threading.Lock()

    # ------------------------------------------------------------------ opening

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str] | None = None,
        *,
        readonly: bool = False,
        timeout: float = db.DEFAULT_TIMEOUT,
        migrations: list[schema_mod.Migration] | None = None,
        arrays_url: str | None = None,
        ahead: ManifestAhead | None = None,
    ) -> Workspace:
        """Open (creating or migrating it unless ``readonly``) the workspace at ``path``.

        ``arrays_url`` (e.g. ``s3://bucket/prefix``) puts a new workspace's arrays in an object
        store (store/location.py); for an existing workspace it must name where they already are.
        ``ahead``: a manifest built beforehand (store/ahead.py), copied into place if the
        workspace is new.
        """
        ws = cls(resolve_path(path).absolute(), timeout)
        if arrays_url is not None:
            arrays_url = location.check_url(arrays_url)
        if migrations is not None:
            ahead = None  # built with the latest schema, not these steps
        migrations = migrations or schema_mod.MIGRATIONS
        latest = schema_mod.latest_version(migrations)
        if not ws.manifest_path.exists():
            if ws.zarr_path.exists():
                raise WorkspaceError(
                    f"{ws.path} has arrays ({ws.zarr_path}) but no manifest ({ws.manifest_path}): the arrays cannot"
                    " be interpreted without it. Restore manifest.duckdb from a backup or choose another --data folder"
                )
            if readonly:
                raise WorkspaceError(
                    f"no workspace at {ws.path} (expected {ws.manifest_path}): create one with"
                    f" `python -m store init --data {ws.path}` or by running an extraction"
                )
            ws.path.mkdir(parents=True, exist_ok=True)
            ws.created = _create_manifest(ws.manifest_path, migrations, timeout, ahead)
        else:
            with db.connect(ws.manifest_path, read_only=True, timeout=timeout, internal=True) as con:
                version = ws._version(con)
            if version > latest:
                raise SchemaVersionError(
                    f"{ws.manifest_path} has schema version {version}, newer than this agnosia reads (up to {latest}):"
                    " upgrade agnosia (pip install -U agnosia / git pull) to open it"
                )
            if version < latest:
                if readonly:
                    raise SchemaVersionError(
                        f"{ws.manifest_path} has schema version {version}; this agnosia needs {latest}. Open it once"
                        f" for writing to migrate (`python -m store init --data {ws.path}`)"
                    )
                with db.connect(ws.manifest_path, read_only=False, timeout=timeout) as con:
                    schema_mod.migrate(con, migrations)
        if not (ws.zarr_path / "zarr.json").exists():
            if readonly:
                raise WorkspaceError(
                    f"{ws.path} has a manifest but its Zarr group {ws.zarr_path} is missing: restore the arrays folder,"
                    f" or run `python -m store init --data {ws.path}` to start an empty one"
                )
            ws._create_root(arrays_url)
        ws.root = ws._read_root(arrays_url)
        return ws

    def _create_root(self, url: str | None) -> None:
        attrs: dict[str, Any] = {"agnosia_layout": layout.LAYOUT_VERSION}
        if url is not None:
            if self.rows("SELECT count(*) FROM runs")[0][0]:
                raise WorkspaceError(
                    f"{self.path} has runs but no arrays folder: its arrays cannot move to {url} now."
                    " Restore the arrays folder (or open it without --arrays)"
                )
            remote = ArrayRoot(self.zarr_path, url)
            try:
                found = remote.remote_meta()
            except OSError as err:
                raise location.describe_remote_error(url, err) from err
            if found is not None:
                raise WorkspaceError(
                    f"{url} already holds the arrays of another workspace (id {found.get(location.ID_ATTR)}):"
                    " choose another prefix, or, to read that workspace, use the folder its manifest is in"
                )
            attrs.update({location.URL_ATTR: url, location.ID_ATTR: uuid.uuid4().hex})
        layout.create_root(self.path, attrs)  # a peer that made it meanwhile keeps its own
        layout.fsync_node_chain(self.path, "")
        if url is not None:
            try:
                ArrayRoot(self.zarr_path, url).upload_meta("")
            except OSError as err:
                self._unbind(attrs[location.ID_ATTR])
                raise location.describe_remote_error(url, err) from err

    def _unbind(self, root_id: str) -> None:
        """Undo this process's root group after its object store refused it (a missing bucket, a
        denied write): left in place, it would bind the folder to a URL that holds nothing, and the
        corrected ``init`` would be refused. A peer's root (another id) stays."""
        meta = self.zarr_path / "zarr.json"
        with contextlib.suppress(OSError, ValueError):
            if ArrayRoot(self.zarr_path).local_meta().get(location.ID_ATTR) == root_id:
                meta.unlink()

    def _read_root(self, wanted: str | None) -> ArrayRoot:
        url = ArrayRoot(self.zarr_path).local_meta().get(location.URL_ATTR)
        if wanted is not None and wanted != url:
            raise WorkspaceError(
                f"{self.path} keeps its arrays {'at ' + url if url else 'locally, in ' + str(self.zarr_path)},"
                f" not at {wanted}: leave --arrays out to use them, or choose a new --data folder for a workspace"
                f" whose arrays live at {wanted}"
            )
        return ArrayRoot(self.zarr_path, url)

    def _version(self, con: duckdb.DuckDBPyConnection) -> int:
        try:
            return schema_mod.current_version(con)
        except duckdb.Error as err:
            raise db.manifest_error(self.manifest_path, err) from err

    def schema_version(self) -> int:
        with self._connect_internal() as con:
            return self._version(con)

    # ------------------------------------------------------------------ SQL (read-only)

    def connect(self) -> Any:
        """A read-only DuckDB connection for a ``with`` block; keep the block short."""
        return db.connect(self.manifest_path, read_only=True, timeout=self.timeout)

    def _connect_internal(self) -> Any:
        """A read-only connection for this class's own statements, never SQL from a caller: it
        attaches to the process's shared DuckDB instead of building a locked-down one (store/db.py)."""
        return db.connect(self.manifest_path, read_only=True, timeout=self.timeout, internal=True)

    def _connect_for(self, where: str | None) -> Any:
        """The connection for a read: internal, unless ``where`` brings a caller's SQL into it."""
        return self._connect_internal() if where is None else self.connect()

    def query(self, sql: str, params: Sequence[Any] | dict[str, Any] | None = None) -> pa.Table:
        """Run SQL on a read-only connection; a write through it is refused by DuckDB."""
        with self.connect() as con:
            try:
                statements = con.extract_statements(sql)
                if len(statements) != 1:
                    raise StoreError(f"query failed: give exactly one SQL statement, got {len(statements)}")
                if _returns_rows(statements[0]):
                    return con.sql(sql, params=params).to_arrow_table()
                return _exec(con, sql, params)
            except duckdb.Error as err:
                hint = ""
                if isinstance(err, (duckdb.PermissionException, duckdb.InvalidInputException)) and (
                    "read-only" in str(err) or "disabled by configuration" in str(err) or "locked" in str(err)
                ):
                    hint = (" (queries run on a read-only connection without file access: they cannot change the"
                            " store or read and write other files)")
                raise StoreError(f"query failed: {type(err).__name__}: {_one_line(str(err))}{hint}") from err

    def rows(self, sql: str, params: Sequence[Any] | dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
        with self.connect() as con:
            return con.execute(sql, params or []).fetchall()

    # ------------------------------------------------------------------ catalogue

    def runs(self) -> list[dict[str, Any]]:
        return self.query("SELECT * FROM v_runs ORDER BY created_at, run").to_pylist()

    def arrays(self, run: str | None = None) -> list[ArrayInfo]:
        sql = f"SELECT {ARRAY_COLUMNS} FROM activations"
        args: list[Any] = []
        if run is not None:
            sql += " WHERE run = ?"
            args.append(run)
        return [array_info_of_row(r) for r in self.rows(sql + " ORDER BY run, tap, layer, site, tokens", args)]

    def array_info_or_none(self, run: str, tap: str, layer: int, site: str, tokens: str) -> ArrayInfo | None:
        with self._connect_internal() as con:
            return self._array_info(con, run, tap, layer, site, tokens, required=False)

    def array_info(self, run: str, tap: str, layer: int, site: str = "resid_post", tokens: str = "image") -> ArrayInfo:
        with self._connect_internal() as con:
            info = self._array_info(con, run, tap, layer, site, tokens, required=True)
            assert info is not None
            return info

    def _array_info(
        self, con: duckdb.DuckDBPyConnection, run: str, tap: str, layer: int, site: str, tokens: str, *, required: bool
    ) -> ArrayInfo | None:
        if layer == -1:  # docs/design.md#the-arrays: -1 aliases the last layer
            last = con.execute(
                "SELECT max(layer) FROM activations WHERE run = ? AND tap = ? AND site = ? AND tokens = ?",
                [run, tap, site, tokens],
            ).fetchone()
            layer = last[0] if last and last[0] is not None else -1
        row = con.execute(
            f"SELECT {ARRAY_COLUMNS} FROM activations WHERE run = ? AND tap = ? AND layer = ? AND site = ? AND tokens = ?",
            [run, tap, layer, site, tokens],
        ).fetchone()
        if row is not None:
            return array_info_of_row(row)
        if not required:
            return None
        have = con.execute(
            "SELECT tap, list(DISTINCT layer ORDER BY layer), list(DISTINCT site), list(DISTINCT tokens)"
            " FROM activations WHERE run = ? GROUP BY tap ORDER BY tap",
            [run],
        ).fetchall()
        if not have:
            known = [r[0] for r in con.execute("SELECT run FROM runs ORDER BY run").fetchall()]
            raise StoreError(f"run {run!r} has no arrays; runs in {self.path}: {known or 'none'}")
        listing = "; ".join(f"{t}: layers {ls}, sites {ss}, tokens {ts}" for t, ls, ss, ts in have)
        raise StoreError(
            f"run {run} has no array tap={tap} layer={layer} site={site} tokens={tokens}. It has {listing}"
        )

    # ------------------------------------------------------------------ selecting and reading

    def select(self, run: str, where: str | None = None, params: Sequence[Any] | None = None) -> Selection:
        """Rows of ``run`` whose ``v_samples`` row matches ``where`` (SQL), ascending."""
        key = ("select", run, where, tuple(params or ()))
        stamp = self._stamp()
        with self._cache_lock:
            if stamp == self._cache_stamp and key in self._cache:
                return self._cache[key]
        with self._connect_for(where) as con:
            sel = self._select(con, run, where, params)
        with self._cache_lock:
            if stamp == self._cache_stamp == self._stamp():
                self._cache[key] = sel
        return sel

    def _select(
        self, con: duckdb.DuckDBPyConnection, run: str, where: str | None, params: Sequence[Any] | None
    ) -> Selection:
        sql = "SELECT array_row, stimulus FROM v_samples WHERE run = ?"
        if where:
            sql += f" AND ({where})"
        try:
            got = con.execute(sql + " ORDER BY array_row", [run, *(params or [])]).fetchall()
        except duckdb.Error as err:
            raise StoreError(
                f"the row filter {where!r} is not valid SQL over v_samples ({err}). Columns: family, split, seed,"
                " params, truth (JSON: params->>'grid_size'), correct, parse_ok, image_count, ..."
            ) from err
        return Selection(run, np.array([g[0] for g in got], dtype=np.int64), tuple(g[1] for g in got))

    def read(
        self,
        run: str,
        tap: str,
        layer: int,
        site: str = "resid_post",
        tokens: str = "image",
        *,
        where: str | None = None,
        params: Sequence[Any] | None = None,
        rows: Any = None,
        index: tuple[Any, ...] | None = None,
        lazy: bool = False,
        committed_only: bool = False,
        bf16_as: str = "float32",
    ) -> Any:
        """Values of one array for the selected rows (all rows by default), in row order.

        ``where`` filters ``v_samples`` by SQL, or ``rows`` gives rows (a Selection, ints, slice).
        ``index`` slices the per-sample dims (e.g. ``(5,)`` = token 5; ``(slice(None), 0)`` = dim 0).
        Dense arrays come back as numpy ``[rows, *per_sample]`` (dask if ``lazy``), ragged ones as
        :class:`Ragged`. bf16 raw-bits arrays decode to float32 unless ``bf16_as='bits'``.
        Rows in uncommitted chunks raise :class:`NotCommittedError` unless ``committed_only``
        (then they are left out; the returned order is still ascending rows).
        """
        if where is not None and rows is not None:
            raise StoreError("give either where=SQL or rows=..., not both")
        info, selected, committed = self._read_plan(
            run, tap, layer, site, tokens, where if rows is None else None, params, want_rows=rows is None
        )
        chosen = selected.rows if rows is None else reader.as_rows(rows, info.n_samples)
        chunks_of_rows = chosen // info.chunk_samples
        missing = np.isin(chunks_of_rows, np.fromiter(committed, dtype=np.int64, count=len(committed)), invert=True)
        if missing.any():
            if not committed_only:
                bad = sorted(set(chunks_of_rows[missing].tolist()))
                raise NotCommittedError(
                    f"{int(missing.sum())} selected rows of {info.key()} are in chunks not committed yet"
                    f" ({len(bad)} chunk(s), first {bad[:5]}): the run is still being written or was interrupted."
                    " Pass committed_only=True to read what is there, or finish the run"
                )
            chosen = chosen[~missing]
        if info.layout == "ragged":
            if lazy:
                raise StoreError("lazy=True reads dense arrays; a ragged array comes back as Ragged (numpy)")
            return reader.read_ragged(self.root, info, chosen, bf16_as)
        if lazy:
            return reader.read_lazy(self.root, info, chosen, index, bf16_as)
        return reader.read_dense(self.root, info, chosen, index, bf16_as)

    def _stamp(self) -> tuple[Any, ...]:
        out: list[Any] = []
        for p in (self.manifest_path, self.manifest_path.with_name(MANIFEST + ".wal")):
            try:
                st = p.stat()
                out.append((st.st_mtime_ns, st.st_size, st.st_ino))
            except FileNotFoundError:
                out.append(None)
        return tuple(out)

    def _read_plan(
        self,
        run: str,
        tap: str,
        layer: int,
        site: str,
        tokens: str,
        where: str | None,
        params: Any,
        *,
        want_rows: bool,
    ) -> tuple[ArrayInfo, Selection, frozenset[int]]:
        """(array, selected rows, committed chunks) from the cache, or from one read-only connection."""
        stamp = self._stamp()
        k_info = ("info", run, tap, layer, site, tokens)
        k_sel = ("select", run, where, tuple(params or ()))
        with self._cache_lock:
            if stamp != self._cache_stamp:
                self._cache.clear()
                self._cache_stamp = stamp
            info = self._cache.get(k_info)
            sel = self._cache.get(k_sel) if want_rows else Selection(run, np.zeros(0, np.int64), ())
            committed = self._cache.get(("committed", run, info.zarr_path)) if info is not None else None
        if info is None or sel is None or committed is None:
            with self._connect_for(where) as con:
                if info is None:
                    info = self._array_info(con, run, tap, layer, site, tokens, required=True)
                    assert info is not None
                if sel is None:
                    sel = self._select(con, run, where, params)
                committed = frozenset(
                    r[0]
                    for r in con.execute(
                        "SELECT chunk FROM chunks WHERE run = ? AND zarr_path = ?", [run, info.zarr_path]
                    ).fetchall()
                )
            if self._stamp() == stamp:  # nothing committed meanwhile: safe to keep
                with self._cache_lock:
                    if self._cache_stamp == stamp:
                        self._cache[k_info] = info
                        if want_rows:
                            self._cache[k_sel] = sel
                        self._cache[("committed", run, info.zarr_path)] = committed
        return info, sel, committed

    def read_tensor(self, run: str, name: str) -> np.ndarray:
        """A run-level tensor stored with ``Writer.write_tensor``."""
        got = self.rows("SELECT zarr_path, stored_dtype FROM tensors WHERE run = ? AND name = ?", [run, name])
        if not got:
            known = [r[0] for r in self.rows("SELECT name FROM tensors WHERE run = ? ORDER BY name", [run])]
            raise StoreError(f"run {run} has no tensor {name!r}; it has {known or 'none'}")
        from store.dtypes import decode_stored

        path, stored = got[0]
        if not self.root.has(layout.check_zarr_path(path)):
            raise WorkspaceError(f"tensor {name} of run {run} is in the manifest but missing at {self.root.where(path)}")
        return decode_stored(self.root.open(path)[...], stored)

    def zarr_group(self) -> Any:
        """The workspace's Zarr group, read-only (remote when its arrays live in an object store)."""
        return self.root.open()

    # ------------------------------------------------------------------ writing

    def writer(self, run: RunInfo, **options: Any) -> Writer:
        """The writer for ``run`` (takes the workspace lock); see :class:`store.writer.Writer`."""
        from store.writer import Writer

        return Writer(self, run, **options)

    # ------------------------------------------------------------------ integrity

    def verify(self, *, run: str | None = None, checksums: bool = True) -> VerifyReport:
        from store.verify import verify

        return verify(self, run=run, checksums=checksums)


def build_manifest(path: Path, migrations: list[schema_mod.Migration] | None = None,
                   timeout: float = db.DEFAULT_TIMEOUT) -> None:
    """A new DuckDB file at ``path`` with every schema step applied, all in the file itself."""
    with db.connect(path, read_only=False, timeout=timeout) as con:
        schema_mod.migrate(con, migrations)
        con.execute("CHECKPOINT")  # no WAL beside it: the file can be copied or linked alone


def _create_manifest(path: Path, migrations: list[schema_mod.Migration], timeout: float,
                     ahead: ManifestAhead | None = None) -> bool:
    """Build a new manifest beside ``path`` (or copy the one built ``ahead``) and link it into place
    whole. A kill or a full disk mid-creation then leaves no half-written manifest.duckdb, which
    every later open would (rightly) refuse as corrupt; at worst a hidden
    ``.manifest.duckdb.<pid>.new`` file. False when another process put its own manifest there first."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.new")
    built = ahead.take() if ahead is not None else None
    try:
        try:
            if built is not None:
                shutil.copyfile(built, tmp)
            else:
                build_manifest(tmp, migrations, timeout)
        except DiskFullError as err:
            raise disk_full_error(path, err.__cause__ or err) from err
        except OSError as err:
            if is_disk_full(err):
                raise disk_full_error(path, err) from err
            raise
        layout.fsync_path(tmp)
        try:
            os.link(tmp, path)  # atomic, and never replaces a manifest another process made meanwhile
        except FileExistsError:
            return False
        except OSError:  # a file system without hard links
            if path.exists():
                return False
            os.replace(tmp, path)
        layout.fsync_path(path.parent)
        return True
    finally:
        for leftover in (tmp, tmp.with_name(tmp.name + ".wal")):
            leftover.unlink(missing_ok=True)


def _returns_rows(statement: Any) -> bool:
    """Whether DuckDB expects the statement to answer with rows and nothing else (SELECT, a
    parenthesised or set-operation query, SHOW, DESCRIBE, PRAGMA, EXPLAIN ...). Asked of DuckDB's
    own parse rather than of the first word, which a '(' or a comment would hide. Anything else
    (INSERT ... RETURNING included) is executed without fetching, and refused by the read-only
    connection if it writes."""
    return list(statement.expected_result_type) == [duckdb.ExpectedResultType.QUERY_RESULT]


def _one_line(message: str) -> str:
    """DuckDB's message on one line: its caret line under the SQL only points into the line above."""
    return " ".join(line.strip() for line in message.splitlines() if line.strip() and set(line.strip()) != {"^"})


def _exec(con: duckdb.DuckDBPyConnection, sql: str, params: Any) -> pa.Table:
    con.execute(sql, params or [])
    return pa.table({})
