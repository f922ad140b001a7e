"""What a workspace writes outside an extraction run: probe results, head ablations, a run's
vocabulary, and dropping a run. Each is one short read-write transaction, safe while a writer runs.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa

from store import arrays as layout
from store import db, location
from store.errors import StoreError
from store.location import ArrayRoot
from store.lock import RunLock, WriterLock, acquire_within
from store.records import ProbeResult, check_name, to_json


class WorkspaceWrites:
    """The writing half of :class:`store.workspace.Workspace` (set up by its ``__init__``)."""

    path: Path
    manifest_path: Path
    zarr_path: Path
    root: ArrayRoot
    timeout: float

    rows: Callable[..., list[tuple[Any, ...]]]  # Workspace.rows

    def _writing(self, held: db.HeldConnection | None = None) -> AbstractContextManager[duckdb.DuckDBPyConnection]:
        """A read-write connection for one transaction: the caller's held one, else one opened for it."""
        return held.use(self.timeout) if held is not None else db.connect(self.manifest_path, read_only=False,
                                                                           timeout=self.timeout)

    def record_probes(self, results: Sequence[ProbeResult], held: db.HeldConnection | None = None) -> int:
        """Insert or replace probe results and their per-sample predictions, by probe key (one
        short transaction). Safe while a writer runs. ``held``: a caller's read-write connection
        kept across its transactions (the probe farm's recorder), else one opened for this one."""
        if not results:
            return 0
        now = _now()
        rows = [
            {
                "key": r.probe_key(), "run": r.run, "tap": r.tap, "layer": int(r.layer), "site": r.site,
                "tokens": r.tokens, "target": r.target, "kind": r.kind, "seed": int(r.seed), "series": r.series,
                "kind_params": to_json(r.kind_params), "split": r.split,
                "test_fraction": None if r.test_fraction is None else float(r.test_fraction),
                "train_where": r.train_where, "n_train": r.n_train, "n_test": r.n_test,
                "metric": r.metric, "score": float(r.score),
                "control_score": None if r.control_score is None else float(r.control_score),
                "artifact": r.artifact, "params": to_json(r.params), "created_at": now,
                "fold": None if r.fold is None else int(r.fold),
            }
            for r in results
        ]
        preds = _prediction_columns(results)
        with self._writing(held) as con:
            db.register_records(con, "new_probes", rows, _PROBE_KINDS)  # numpy columns: no pandas import
            db.register_columns(con, "new_predictions", preds, _PREDICTION_KINDS)
            con.execute("BEGIN TRANSACTION")
            con.execute("DELETE FROM probes p USING new_probes n WHERE p.key = n.key")
            con.execute("DELETE FROM probe_predictions p USING new_probes n WHERE p.key = n.key")
            con.execute(
                "INSERT INTO probes SELECT key, run, tap, layer, site, tokens, target, kind, seed, series,"
                " kind_params::JSON, split, test_fraction, train_where, n_train, n_test, metric,"
                " score, control_score, artifact, params::JSON, created_at, fold FROM new_probes"
            )
            con.execute("INSERT INTO probe_predictions SELECT key, run, array_row, prediction, truth, score,"
                        " control_prediction, control_score FROM new_predictions")
            con.execute("COMMIT")
            con.unregister("new_probes")   # a held connection outlives this call: let the tables go
            con.unregister("new_predictions")
        return len(results)

    def record_head_ablations(self, run: str, rows: Sequence[Mapping[str, Any]]) -> int:
        """Insert or replace ``head_ablations`` rows (keys: stimulus, array_row, tap, layer, head,
        n_positions, n_flipped, flipped, flip_mask, logit_drop) in one short transaction."""
        if not rows:
            return 0
        now = _now()
        table = pa.Table.from_pylist([
            {"run": run, "stimulus": r["stimulus"], "array_row": r.get("array_row"), "tap": r["tap"],
             "layer": int(r["layer"]), "head": int(r["head"]), "n_positions": int(r["n_positions"]),
             "n_flipped": int(r["n_flipped"]), "flipped": bool(r["flipped"]), "flip_mask": int(r["flip_mask"]),
             "logit_drop": None if r.get("logit_drop") is None else float(r["logit_drop"]), "recorded_at": now}
            for r in rows
        ])
        with self._writing() as con:
            con.register("new_rows", table)
            con.execute("BEGIN TRANSACTION")
            con.execute(
                "DELETE FROM head_ablations h USING new_rows n WHERE h.run = n.run AND h.stimulus = n.stimulus"
                " AND h.tap = n.tap AND h.layer = n.layer AND h.head = n.head"
            )
            con.execute(
                "INSERT INTO head_ablations SELECT run, stimulus, array_row, tap, layer, head, n_positions, n_flipped,"
                " flipped, flip_mask, logit_drop, recorded_at FROM new_rows"
            )
            con.execute("COMMIT")
        return len(rows)

    def record_vocab(self, run: str, tokens: Sequence[str], held: db.HeldConnection | None = None) -> int:
        """Store a run's vocabulary (``tokens[i]`` is token id i as decoded alone), replacing any.
        ``held``: a caller's read-write connection (a run's writer), else one opened for this one."""
        with self._writing(held) as con:
            db.register_columns(con, "new_vocab", {"token_id": range(len(tokens)), "token": tokens}, {"token_id": "int32"})
            con.execute("BEGIN TRANSACTION")
            con.execute("DELETE FROM vocab WHERE run = ?", [run])
            con.execute("INSERT INTO vocab SELECT ?, token_id, token FROM new_vocab", [run])
            con.execute("COMMIT")
            con.unregister("new_vocab")  # a held connection outlives this call
        return len(tokens)

    def vocab(self, run: str) -> list[str]:
        """The run's vocabulary by token id (empty if the run stored none)."""
        return [r[0] for r in self.rows("SELECT token FROM vocab WHERE run = ? ORDER BY token_id", [run])]

    def drop_run(self, run: str, *, timeout: float = 0.0) -> dict[str, int]:
        """Remove a run, its arrays and every manifest row of it, atomically for readers.

        Takes the writer lock, then the run's readers' lock (store.lock.RunLock): a probe plan
        reading the run makes it wait up to ``timeout`` seconds, then refuse. One transaction
        deletes the run's rows first (readers then see no run); only after that commit is its Zarr
        folder renamed into ``.trash`` and deleted. A kill between the two leaves an orphan folder
        that no row points at (verify warns; the next writer of that run id, or drop-run again,
        removes it), never rows pointing at deleted arrays.
        """
        check_name("run", run)  # the run id names a folder under arrays/: "../x" must not reach outside
        started = time.monotonic()
        lock = WriterLock(self.path / "writer.lock", run=f"drop-run {run}")
        acquire_within(lock, timeout)
        readers = RunLock(self.path, run, exclusive=True)  # a plan reading the run finishes first
        try:
            acquire_within(readers, max(timeout - (time.monotonic() - started), 0.0))
            known = self.rows("SELECT count(*) FROM runs WHERE run = ?", [run])[0][0]
            remote = self.root.remote and run in self.root.children()
            if not known and not (self.zarr_path / run).exists() and not remote:
                raise StoreError(f"no run {run!r} in {self.path}; `python -m store info` lists the runs")
            counts = self._delete_run_rows(run)
            self.remove_run_folder(run)
        finally:
            readers.release()
            lock.release()
        return counts

    def _delete_run_rows(self, run: str) -> dict[str, int]:
        counts: dict[str, int] = {}
        with self._writing() as con:
            con.execute("BEGIN TRANSACTION")
            try:
                for table in ("chunks", "activations", "derived_arrays", "samples", "generations", "probes",
                              "probe_predictions", "tensors", "head_ablations", "vocab", "runs"):
                    n = con.execute(f"SELECT count(*) FROM {table} WHERE run = ?", [run]).fetchone()
                    counts[table] = int(n[0]) if n else 0
                    con.execute(f"DELETE FROM {table} WHERE run = ?", [run])
                con.execute("COMMIT")
            except BaseException:
                db.rollback(con)
                raise
        return counts

    def remove_run_folder(self, run: str, *, remote: bool = True) -> None:
        """Delete the arrays of a run that no manifest row points at any more (the caller holds
        the writer lock): renamed into ``.trash`` first, so a kill mid-delete leaves no half-removed
        folder under ``arrays/``, and the trash is emptied at the next writer start."""
        folder = self.zarr_path / run
        if folder.exists():
            trash = self.path / ".trash"
            parked = trash / f"{run}.{os.getpid()}.{int(time.time() * 1000)}"
            trash.mkdir(exist_ok=True)
            os.replace(folder, parked)
            layout.fsync_path(self.zarr_path)
            shutil.rmtree(parked, ignore_errors=True)
            try:
                trash.rmdir()
            except OSError:
                pass  # not empty (another drop's leftovers)
        if remote and self.root.remote:
            # Not atomic there, but nothing points at these objects any more; a drop cut short
            # leaves orphans that verify lists and a second drop-run removes.
            try:
                self.root.remove(run)
            except OSError as err:
                raise location.describe_remote_error(str(self.root.url), err) from err

    def purge_trash(self) -> None:
        trash = self.path / ".trash"
        if trash.is_dir():
            shutil.rmtree(trash, ignore_errors=True)


def _now() -> Any:
    import datetime as _dt

    return _dt.datetime.now()



_PROBE_KINDS = {"layer": "int32", "seed": "int32", "test_fraction": "float64", "n_train": "int32", "n_test": "int32",
                "score": "float64", "control_score": "float64", "fold": "int32"}   # the other columns: str, datetime or NULL
_PREDICTION_KINDS = {"array_row": "int64", "prediction": "float64", "truth": "float64", "score": "float64",
                     "control_prediction": "float64", "control_score": "float64"}
#: The per-sample columns a result may carry (``ProbeResult.predictions``), in the table's order.
PREDICTION_COLUMNS = ("prediction", "truth", "score", "control_prediction", "control_score")


def _prediction_columns(results: Sequence[ProbeResult]) -> dict[str, list[Any]]:
    """Every result's per-sample predictions as columns (NaN -> NULL)."""
    cols: dict[str, list[Any]] = {c: [] for c in ("key", "run", "array_row", *PREDICTION_COLUMNS)}
    for r in results:
        got = r.predictions or {}
        n = len(got.get("array_row", ()))
        if not n:
            continue
        cols["key"] += [r.probe_key()] * n
        cols["run"] += [r.run] * n
        cols["array_row"] += [int(v) for v in got["array_row"]]
        for c in PREDICTION_COLUMNS:
            vals = got.get(c)
            cols[c] += [None] * n if vals is None else [None if v is None or np.isnan(v) else float(v) for v in vals]
    return cols
