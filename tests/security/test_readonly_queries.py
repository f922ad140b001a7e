"""Rule 1: queries are read-only. A write, or any file access, through ``python -m queries --sql``,
``python -m store query``, a named query or ``Workspace.query`` is refused with a clear error and
leaves every file of the workspace unchanged."""

from __future__ import annotations

import pytest
from securitytest_lib import digest

import queries.__main__ as queries_cli
import queries.named as named
from store import StoreError, Workspace
from store.cli import main as store_cli

WRITES = [
    "INSERT INTO runs (run, model, status) VALUES ('x', 'y', 'finished')",
    "DELETE FROM runs",
    "UPDATE activations SET zarr_path = '../../elsewhere'",
    "DROP TABLE chunks",
    "CREATE TABLE extra AS SELECT 1",
    "ALTER TABLE runs ADD COLUMN x INT",
]


@pytest.mark.parametrize("sql", WRITES)
def test_writes_through_the_queries_cli_are_refused(workspace, sql, capsys):
    before = digest(workspace)
    assert queries_cli.main(["--data", str(workspace), "--sql", sql]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: query failed") and "read-only" in err
    assert digest(workspace) == before


@pytest.mark.slow
def test_file_writes_through_sql_are_refused_inside_and_outside_the_store(workspace, tmp_path, capsys):
    """A read-only DuckDB connection would still write files (COPY TO, EXPORT DATABASE, ATTACH):
    over a chunk of the store, or anywhere else. Readers run with file system access off."""
    before = digest(workspace)
    chunk = next(p for p in (workspace / "arrays").rglob("c.*") if p.is_file())
    outside = tmp_path / "outside.csv"
    for sql in (f"COPY (SELECT 42) TO '{chunk}' (FORMAT csv)", f"COPY (SELECT * FROM runs) TO '{outside}'",
                f"EXPORT DATABASE '{tmp_path / 'export'}'", f"ATTACH '{tmp_path / 'new.duckdb'}' AS other",
                f"SELECT * FROM read_csv('{workspace / 'writer.lock'}')", "SET enable_external_access = true"):
        assert queries_cli.main(["--data", str(workspace), "--sql", sql]) == 2, sql
        err = capsys.readouterr().err
        assert "query failed" in err and "read-only connection without file access" in err, err
    assert digest(workspace) == before
    assert not outside.exists() and not (tmp_path / "export").exists() and not (tmp_path / "new.duckdb").exists()


def test_writes_through_store_query_are_refused(workspace, capsys):
    before = digest(workspace)
    assert store_cli(["query", "DELETE FROM chunks", "--data", str(workspace)]) == 2
    assert "read-only" in capsys.readouterr().err
    assert digest(workspace) == before


def test_writes_through_a_named_query_are_refused(workspace, tmp_path, monkeypatch, capsys):
    """A named query is only a documented SQL file: one that writes is refused like ad-hoc SQL."""
    sql_dir = tmp_path / "sql"
    sql_dir.mkdir()
    (sql_dir / "wipe.sql").write_text("-- wipes the manifest\nDELETE FROM chunks;\n")
    (sql_dir / "leak.sql").write_text(f"-- writes a file\nCOPY (SELECT * FROM runs) TO '{tmp_path / 'leak.csv'}';\n")
    monkeypatch.setattr(named, "SQL_DIR", sql_dir)
    before = digest(workspace)
    ws = Workspace.open(workspace, readonly=True)
    for name in ("wipe", "leak"):
        with pytest.raises(named.QueryError, match="read-only"):
            named.run(ws, name)
        assert queries_cli.main([name, "--data", str(workspace)]) == 2
        assert "read-only" in capsys.readouterr().err
    assert digest(workspace) == before and not (tmp_path / "leak.csv").exists()
    assert ws.rows("SELECT count(*) FROM chunks")[0][0] > 0


def test_reads_still_work_on_the_locked_connection(workspace):
    ws = Workspace.open(workspace, readonly=True)
    assert ws.query("SELECT run FROM runs").to_pylist() == [{"run": "r1"}]
    assert ws.read("r1", "llm", 0, tokens="image").shape == (8, 3, 4)
    assert named.run(ws, "storage").num_rows >= 1
    with pytest.raises(StoreError, match="read-only"):
        ws.query("DELETE FROM runs")
