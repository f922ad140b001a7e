"""The manifest's size on disk (issue 40): the same writes give the same size, and `store info`
says what the whole folder costs per value beside what the arrays do.

Before: two identical runs left manifests of 5,255,168 and 7,090,176 bytes. DuckDB keeps the
free 256 KiB blocks its checkpoints leave, and how many a run leaves depends on when its writer
let go of the file (store/db.py).
"""

from __future__ import annotations

import os

import duckdb
from storetest_lib import write_run

from store import Workspace
from store.cli import main
from store.workspace import build_manifest


def _blocks(path: os.PathLike[str]) -> tuple[int, int]:
    con = duckdb.connect(str(path), read_only=True)
    try:
        total, free = con.execute("SELECT total_blocks, free_blocks FROM pragma_database_size()").fetchone()
        return total, free
    finally:
        con.close()


def _catalog(path: os.PathLike[str]) -> list[list[tuple[str, ...]]]:
    con = duckdb.connect(str(path), read_only=True)
    try:
        return [con.execute(sql).fetchall() for sql in (
            "SELECT table_name, sql FROM duckdb_tables() ORDER BY 1",
            "SELECT view_name, sql FROM duckdb_views() WHERE NOT internal ORDER BY 1",
            "SELECT table_name, constraint_type, constraint_text FROM duckdb_constraints() ORDER BY ALL")]
    finally:
        con.close()


def test_the_same_writes_leave_manifests_of_the_same_size_whatever_the_timing(tmp_path):
    """Asserts: one run written flat out and the same run paced like an extraction and read
    from meanwhile (so its writer lets go of the manifest at other moments, each let-go a
    checkpoint) leave manifests of equal size, with no free blocks and no WAL (before: 4,206,592
    and 6,565,888 bytes, 6 free blocks in the second); the rewritten manifest keeps every table,
    view and constraint of a freshly built one, and its rows."""
    sizes = []
    for name, sleep in (("fast", 0.0), ("paced", 0.02)):
        ws = Workspace.open(tmp_path / name)

        def read_now(end: int, ws: Workspace = ws, sleep: float = sleep) -> None:
            if sleep and end % 16 == 0:  # a reader of this process: the writer lets go for it
                ws.rows("SELECT count(*) FROM chunks")

        write_run(ws, n=160, chunk=8, batch=2, sleep=sleep, after_batch=read_now)
        assert not ws.manifest_path.with_name("manifest.duckdb.wal").exists()
        assert _blocks(ws.manifest_path)[1] == 0, _blocks(ws.manifest_path)
        assert ws.rows("SELECT count(*) FROM chunks")[0][0] == 40
        assert ws.verify().ok
        sizes.append(ws.manifest_path.stat().st_size)
    assert sizes[0] == sizes[1], sizes
    build_manifest(tmp_path / "fresh.duckdb")
    assert _catalog(tmp_path / "paced" / "manifest.duckdb") == _catalog(tmp_path / "fresh.duckdb")
    assert not list((tmp_path / "paced").glob(".manifest.duckdb.*"))  # no copy left behind


def test_store_info_gives_bytes_per_value_of_the_arrays_and_of_the_whole_folder(tmp_path, capsys):
    """Asserts: `store info` prints the arrays' bytes per value (v_arrays' bytes over the values
    stored) and the whole folder's (every file under it, manifest included, over the same
    values), and --json gives both with the bytes they come from."""
    ws = Workspace.open(tmp_path / "ws")
    write_run(ws, n=40, chunk=8, batch=4)
    values, array_bytes = ws.rows(
        "SELECT sum(c.n_rows * a.values_per_row), sum(c.nbytes) FROM activations a JOIN chunks c USING (run, zarr_path)")[0]
    folder = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(ws.path) for f in files)
    assert main(["info", "--data", str(ws.path)]) == 0
    out = capsys.readouterr().out
    assert (f"bytes/value: arrays {array_bytes / values:.3f}, whole folder {folder / values:.3f}") in out, out
    assert main(["info", "--data", str(ws.path), "--json"]) == 0
    import json

    got = json.loads(capsys.readouterr().out)
    assert got["values"] == values and got["array_bytes"] == array_bytes and got["folder_bytes"] == folder
    assert got["manifest_bytes"] == ws.manifest_path.stat().st_size
    assert got["bytes_per_value"] == {"arrays": array_bytes / values, "folder": folder / values}
