"""Read-write manifest connections attach to one in-memory DuckDB per process (store/db.py).

Found by timing a tiny model's extraction (issue 19): building and tearing down a DuckDB instance
costs ~12 ms a connection, where ATTACH + DETACH costs ~1 ms. What must not change: the file is
free for other processes once a connection closes, whatever state the connection was left in,
and each manifest sees only its own tables.
"""

from __future__ import annotations

import duckdb
import pytest
from storetest_lib import python

from store import db, schema
from store.errors import WorkspaceError
from store.workspace import build_manifest


def _open_elsewhere(path) -> str:
    """Open ``path`` read-write from another process with no retry: 'ok <rows>' or the error's class."""
    got = python("-c", "import duckdb, sys\n"
                 "try:\n"
                 "    con = duckdb.connect(sys.argv[1])\n"
                 "except duckdb.Error as err:\n"
                 "    print(type(err).__name__)\n"
                 "else:\n"
                 "    print('ok', con.execute('SELECT count(*) FROM t').fetchone()[0])",
                 str(path))
    assert got.returncode == 0, got.stderr
    return got.stdout.strip()


def _table(path, rows: int = 2) -> None:
    with db.connect(path, read_only=False) as con:
        con.execute("CREATE TABLE t (a INTEGER)")
        con.execute(f"INSERT INTO t SELECT range FROM range({rows})")


def test_write_connections_attach_to_one_instance_and_their_rows_last(tmp_path, connects):
    """Asserts: ten read-write connections to two manifests build at most one DuckDB instance (the
    shared one; before, one each) and never connect to a manifest file itself; what they wrote is
    in each file for a read-only connection and for another process."""
    paths = [tmp_path / "a.duckdb", tmp_path / "b.duckdb"]
    for p in paths:
        _table(p)
    for i in range(8):
        with db.connect(paths[i % 2], read_only=False) as con:
            con.execute("INSERT INTO t VALUES (?)", [100 + i])
    assert len(connects) <= 1 and all(c == ":memory:" for c in connects), connects
    with db.connect(paths[0], read_only=True) as con:
        assert con.execute("SELECT count(*) FROM t").fetchone() == (6,)
    assert _open_elsewhere(paths[1]) == "ok 6"


def test_a_closed_connection_frees_the_file_even_after_a_failed_transaction(tmp_path):
    """Asserts: a connection left inside a transaction that a failed statement aborted still
    detaches on close: another process opens the file read-write at once (no retry) and finds
    the rows from before the transaction, none of the aborted ones."""
    path = tmp_path / "m.duckdb"
    _table(path, rows=3)
    with pytest.raises(duckdb.Error), db.connect(path, read_only=False) as con:
        con.execute("BEGIN TRANSACTION")
        con.execute("INSERT INTO t VALUES (7)")
        con.execute("INSERT INTO t VALUES ('not a number')")
    assert _open_elsewhere(path) == "ok 3"


def test_a_held_connection_holds_the_file_until_it_closes(tmp_path):
    """Asserts: while a HeldConnection is open another process cannot take the file (so the
    attach really holds DuckDB's lock), and once it closes it can, with the held rows committed."""
    path = tmp_path / "m.duckdb"
    _table(path)
    held = db.HeldConnection(path, idle_s=60, max_hold_s=60)
    with held.use() as con:
        con.execute("INSERT INTO t VALUES (9)")
    assert held.is_open
    assert _open_elsewhere(path) == "IOException"
    held.close()
    assert _open_elsewhere(path) == "ok 3"


def test_each_manifest_sees_its_own_schema_while_another_is_attached(tmp_path):
    """Asserts: with one workspace's manifest held (attached) in this process, a new empty file
    reads schema version 0 and migrates to the latest; the held one still reads the latest.
    Before the catalog filter, the held manifest's schema_version table made the empty file
    look migrated."""
    built = tmp_path / "built.duckdb"
    build_manifest(built)
    held = db.HeldConnection(built, idle_s=60, max_hold_s=60)
    try:
        with held.use() as con:
            assert schema.current_version(con) == schema.latest_version()
        with db.connect(tmp_path / "new.duckdb", read_only=False) as con:
            assert schema.current_version(con) == 0
            assert schema.migrate(con)[-1] == schema.latest_version()
        with held.use() as con:
            assert schema.current_version(con) == schema.latest_version()
    finally:
        held.close()


def test_a_manifest_open_outside_agnosia_in_this_process_is_named(tmp_path):
    """Asserts: a manifest this process already holds through its own duckdb.connect is refused
    with an error that says so and what to close, not reported as a corrupt file."""
    path = tmp_path / "m.duckdb"
    _table(path)
    outside = duckdb.connect(str(path), read_only=True)
    try:
        with pytest.raises(WorkspaceError, match="this process already holds .* close that connection"):
            with db.connect(path, read_only=False, timeout=1):
                pass
    finally:
        outside.close()
    assert _open_elsewhere(path) == "ok 2"


def _workspace(path):
    import numpy as np
    from storetest_lib import DIM, TOKENS, dense_values, stimulus_rows

    from store import ArraySpec, RunInfo, Workspace

    ws = Workspace.open(path)
    with ws.writer(RunInfo(run="r", model="m", chunk_samples=4)) as w:
        w.set_samples(w.register_stimuli(stimulus_rows(8), dataset="d"))
        (h,) = w.arrays([ArraySpec(tap="llm", layer=0, tokens="image", shape=(TOKENS, DIM), dtype="float32")])
        w.write(h, 0, dense_values(range(8)))
        w.finish()
    return dense_values(range(8)).astype(np.float16)


def test_the_stores_own_reads_attach_and_a_callers_sql_stays_locked_down(tmp_path, connects):
    """Asserts: opening an existing workspace and reading an array (a fresh Workspace each time)
    builds no DuckDB instance for the manifest (before: two, ~12 ms each; the read is the stored
    values); SQL a caller wrote, through ``query`` or a read's ``where``, still runs without file
    access."""
    import numpy as np

    from store import Workspace
    from store.errors import StoreError

    expected = _workspace(tmp_path / "ws")
    before = len(connects)
    for _ in range(3):
        ws = Workspace.open(tmp_path / "ws", readonly=True)
        np.testing.assert_array_equal(ws.read("r", "llm", 0, tokens="image"), expected)
        assert ws.array_info("r", "llm", 0).n_samples == 8
    assert all(c == ":memory:" for c in connects[before:]), connects[before:]
    secret = tmp_path / "secret.csv"
    secret.write_text("a\n1\n")
    with pytest.raises(StoreError, match="without file access"):
        Workspace.open(tmp_path / "ws", readonly=True).query(f"SELECT * FROM read_csv('{secret}')")
    with pytest.raises(StoreError, match="file system operations are disabled"):
        Workspace.open(tmp_path / "ws", readonly=True).read(
            "r", "llm", 0, tokens="image", where=f"stimulus IN (SELECT a::VARCHAR FROM read_csv('{secret}'))")


_FORK = """
import os, sys
from pathlib import Path
from store import db
parent, child = Path(sys.argv[1]), Path(sys.argv[2])
held = db.HeldConnection(parent, idle_s=60, max_hold_s=60)
with held.use() as con:
    con.execute("INSERT INTO t VALUES (5)")
wal = parent.with_name(parent.name + ".wal")
before = wal.stat().st_size
pid = os.fork()
if pid == 0:
    with db.connect(child, read_only=False) as con:
        con.execute("INSERT INTO t VALUES (6)")
    sys.exit(0 if db._shared[0] == os.getpid() else 3)  # a normal exit: the interpreter's teardown runs
_, status = os.waitpid(pid, 0)
after = wal.stat().st_size if wal.exists() else None
with held.use() as con:
    con.execute("INSERT INTO t VALUES (7)")
held.close()
print(os.waitstatus_to_exitcode(status), before == after)
"""


def test_a_forked_child_leaves_the_parents_attached_manifest_alone(tmp_path):
    """Asserts: a child forked while the parent holds a manifest attached (a writer mid-run)
    writes its own manifest through an instance of its own and exits normally without touching
    the parent's file: the parent's WAL is as it was (before the fix, the child's teardown of the
    inherited instance checkpointed the parent's manifest from the child: the WAL was gone); the
    parent then still commits, and both files hold their rows."""
    parent, child = tmp_path / "parent.duckdb", tmp_path / "child.duckdb"
    _table(parent)
    _table(child)
    got = python("-c", _FORK, str(parent), str(child))
    assert got.returncode == 0 and got.stdout.split() == ["0", "True"], (got.stdout, got.stderr)
    assert _open_elsewhere(parent) == "ok 4"
    assert _open_elsewhere(child) == "ok 3"
