"""Recording SAE results in the manifest (the client's side; one short transaction per SAE)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pyarrow as pa

from probes.sae.job import SaeResult
from store import Workspace, db

MODEL_COLUMNS = ("key", "plan", "run", "tap", "layer", "site", "tokens", "out_site", "rows", "architecture", "d_in",
                 "d_sae", "k", "l1", "seed", "test_fraction", "where_sql", "train_where", "n_train", "n_test", "epochs",
                 "steps", "mse", "explained_variance", "l0", "dead_share", "rows_per_s", "seconds", "path", "params",
                 "created_at")
SCORE_COLUMNS = ("sae", "feature", "target", "class", "metric", "score", "control_score", "ci_low", "ci_high",
                 "p_value", "q_value", "n", "n_positive")


def _finite(v: Any) -> Any:
    return None if isinstance(v, float) and not np.isfinite(v) else v


def record(ws: Workspace, result: SaeResult) -> None:
    """Insert or replace one SAE's rows in ``sae_models``, ``sae_feature_scores``, ``sae_activations``.

    Parameters
    ----------
    ws : Workspace
        The workspace (opened writable by the caller's process).
    result : SaeResult
        What the task handed back.
    """
    m = {**result.model, "params": json.dumps(result.model["params"], default=str), "created_at": datetime.now(UTC)}
    models = pa.Table.from_pylist([{c: _finite(m[c]) for c in MODEL_COLUMNS}])
    scores = pa.Table.from_pylist([{c: _finite(s.get(c)) for c in SCORE_COLUMNS} for s in result.scores],
                                  schema=_score_schema())
    a = result.activations
    acts = pa.table({"sae": pa.array([result.key] * len(a.get("array_row", ())), pa.string()),
                     "run": pa.array([result.model["run"]] * len(a.get("array_row", ())), pa.string()),
                     "array_row": pa.array(a.get("array_row", np.zeros(0, np.int64)), pa.int64()),
                     "token": pa.array(a.get("token", np.zeros(0, np.int32)), pa.int32()),
                     "feature": pa.array(a.get("feature", np.zeros(0, np.int32)), pa.int32()),
                     "value": pa.array(a.get("value", np.zeros(0, np.float32)), pa.float32())})
    with db.connect(ws.manifest_path, read_only=False, timeout=ws.timeout) as con:
        con.register("new_models", models)
        con.register("new_scores", scores)
        con.register("new_acts", acts)
        con.execute("BEGIN TRANSACTION")
        try:
            for table, col in (("sae_models", "key"), ("sae_feature_scores", "sae"), ("sae_activations", "sae")):
                con.execute(f"DELETE FROM {table} WHERE {col} = ?", [result.key])
            con.execute(f"INSERT INTO sae_models SELECT {', '.join(MODEL_COLUMNS[:-2])}, params::JSON, created_at"
                        " FROM new_models")
            con.execute(f"INSERT INTO sae_feature_scores SELECT {', '.join(SCORE_COLUMNS)} FROM new_scores")
            con.execute("INSERT INTO sae_activations SELECT sae, run, array_row, token, feature, value FROM new_acts")
            con.execute("COMMIT")
        except BaseException:
            db.rollback(con)
            raise
        for name in ("new_models", "new_scores", "new_acts"):
            con.unregister(name)


def _score_schema() -> pa.Schema:
    return pa.schema([("sae", pa.string()), ("feature", pa.int32()), ("target", pa.string()), ("class", pa.string()),
                      ("metric", pa.string()), ("score", pa.float64()), ("control_score", pa.float64()),
                      ("ci_low", pa.float64()), ("ci_high", pa.float64()), ("p_value", pa.float64()),
                      ("q_value", pa.float64()), ("n", pa.int32()), ("n_positive", pa.int32())])


def done_keys(ws: Workspace) -> set[str]:
    """Keys of the SAEs already recorded."""
    return {r[0] for r in ws.rows("SELECT key FROM sae_models")}
