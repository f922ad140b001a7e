"""The manifest schema: table DDL, views, and the migrations that bring any older file up to date.

Table and view names are a contract with probes/ and queries/ (docs/design.md#the-tables); columns may grow, so
new columns arrive as a new migration step, never by editing an applied one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import duckdb

from store.db import rollback
from store.records import answer_kind

_TABLES_V1 = """
CREATE TABLE schema_version (
    version     INTEGER   NOT NULL,
    description VARCHAR   NOT NULL,
    applied_at  TIMESTAMP NOT NULL DEFAULT current_timestamp
);

CREATE TABLE runs (
    run                 VARCHAR PRIMARY KEY,
    model               VARCHAR NOT NULL,
    revision            VARCHAR,
    adapter             VARCHAR,
    dtype               VARCHAR,           -- the model's compute dtype
    attn_implementation VARCHAR,
    versions            JSON,              -- library versions, {"torch": "2.13.0", ...}
    config              JSON,              -- the run's whole config
    n_samples           BIGINT,            -- set when the row map is registered
    chunk_samples       INTEGER NOT NULL,  -- default samples per chunk
    bf16_policy         VARCHAR NOT NULL,  -- fp16 | bits
    overflow_policy     VARCHAR NOT NULL,  -- error | clip
    status              VARCHAR NOT NULL,  -- running | finished | failed
    host                VARCHAR,
    pid                 INTEGER,
    created_at          TIMESTAMP NOT NULL,
    updated_at          TIMESTAMP,
    finished_at         TIMESTAMP
);

CREATE TABLE stimuli (
    stimulus  VARCHAR PRIMARY KEY,         -- '<dataset>/<id>'
    dataset   VARCHAR NOT NULL,            -- the set name (folder name by default)
    id        VARCHAR NOT NULL,
    family    VARCHAR,
    split     VARCHAR,
    seed      BIGINT,
    prompt    VARCHAR,
    answer    VARCHAR,
    prompts   JSON,
    answers   JSON,
    params    JSON,                        -- per-family parameters
    truth     JSON,                        -- per-family ground truth (or a pointer to it)
    image     VARCHAR,                     -- image path relative to set_path
    set_path  VARCHAR,                     -- the stimulus set folder (holds truth.parquet)
    digest    VARCHAR NOT NULL,            -- sha1 of the row: re-registering must match
    added_at  TIMESTAMP NOT NULL
);

CREATE TABLE samples (
    run          VARCHAR NOT NULL,
    array_row    BIGINT  NOT NULL,         -- row in every array of the run
    stimulus     VARCHAR NOT NULL,
    seq_len      INTEGER,
    image_start  INTEGER,
    image_count  INTEGER,
    grid_h       INTEGER,                  -- image tokens form grid_h x grid_w in raster order
    grid_w       INTEGER,
    last_prompt  INTEGER,                  -- position of the prompt's last token
    answer_start INTEGER,
    answer_count INTEGER,
    spans        JSON,                     -- any other named spans
    recorded_at  TIMESTAMP,                -- when the spans were committed
    PRIMARY KEY (run, array_row),
    UNIQUE (run, stimulus)
);

CREATE TABLE activations (
    run            VARCHAR  NOT NULL,
    tap            VARCHAR  NOT NULL,      -- vision | projector | llm | attn | logits
    layer          INTEGER  NOT NULL,
    site           VARCHAR  NOT NULL,      -- resid_post | pre_merger | in | out ...
    tokens         VARCHAR  NOT NULL,      -- token kind: image | last | answer | ...
    module         VARCHAR,                -- raw module path, e.g. model.visual.blocks.3
    zarr_path      VARCHAR  NOT NULL UNIQUE,
    layout         VARCHAR  NOT NULL,      -- dense | ragged
    shape          BIGINT[] NOT NULL,      -- dense [samples, ...]; ragged [samples, -1, dim...]
    dims           VARCHAR[] NOT NULL,
    chunk_samples  INTEGER  NOT NULL,
    n_chunks       INTEGER  NOT NULL,
    dtype          VARCHAR  NOT NULL,      -- what the model produced
    stored_dtype   VARCHAR  NOT NULL,      -- float16 | float32 | bfloat16 (raw bits as uint16)
    codec          VARCHAR  NOT NULL,      -- none | zstd | bitround<k>
    values_per_row BIGINT   NOT NULL,      -- values per sample (dense) or per token row (ragged)
    bytes          BIGINT   NOT NULL DEFAULT 0,  -- bytes on disk of committed chunks
    created_at     TIMESTAMP NOT NULL,
    PRIMARY KEY (run, tap, layer, site, tokens)
);

CREATE TABLE chunks (
    run          VARCHAR NOT NULL,
    zarr_path    VARCHAR NOT NULL,
    chunk        INTEGER NOT NULL,         -- sample chunk index
    row_start    BIGINT  NOT NULL,
    row_stop     BIGINT  NOT NULL,
    n_rows       BIGINT  NOT NULL,         -- samples (dense) or token rows (ragged)
    nbytes       BIGINT  NOT NULL,         -- bytes on disk
    crc32c       BIGINT  NOT NULL,         -- CRC-32C of the stored values (C order)
    n_nonfinite  BIGINT  NOT NULL,         -- NaN/inf in the source values
    n_clipped    BIGINT  NOT NULL,         -- values saturated by overflow='clip'
    committed_at TIMESTAMP NOT NULL,
    PRIMARY KEY (run, zarr_path, chunk)
);

CREATE TABLE tensors (                    -- run-level tensors (e.g. unembedding, final norm)
    run       VARCHAR NOT NULL,
    name      VARCHAR NOT NULL,
    module    VARCHAR,
    zarr_path VARCHAR NOT NULL,
    shape     BIGINT[] NOT NULL,
    dtype     VARCHAR NOT NULL,
    stored_dtype VARCHAR NOT NULL,
    nbytes    BIGINT NOT NULL,
    crc32c    BIGINT NOT NULL,
    created_at TIMESTAMP NOT NULL,
    PRIMARY KEY (run, name)
);

CREATE TABLE generations (
    run         VARCHAR NOT NULL,
    stimulus    VARCHAR NOT NULL,
    array_row   BIGINT,
    text        VARCHAR,
    prediction  JSON,                      -- parsed prediction (matrix, number, word ...)
    parse_ok    BOOLEAN,
    correct     BOOLEAN,
    score       DOUBLE,                    -- e.g. cell accuracy
    metrics     JSON,                      -- e.g. {"cells_correct": 7, "cells_total": 9}
    n_tokens    INTEGER,
    recorded_at TIMESTAMP NOT NULL,
    PRIMARY KEY (run, stimulus)
);

CREATE TABLE probes (
    run           VARCHAR NOT NULL,
    tap           VARCHAR NOT NULL,
    layer         INTEGER NOT NULL,
    site          VARCHAR NOT NULL,
    tokens        VARCHAR NOT NULL,
    target        VARCHAR NOT NULL,
    kind          VARCHAR NOT NULL,
    seed          INTEGER NOT NULL,
    n_train       INTEGER,
    n_test        INTEGER,
    metric        VARCHAR NOT NULL,
    score         DOUBLE  NOT NULL,
    control_score DOUBLE,
    artifact      VARCHAR,                 -- safetensors / npz path of the weights
    params        JSON,
    created_at    TIMESTAMP NOT NULL,
    PRIMARY KEY (run, tap, layer, site, tokens, target, kind, seed)
);
"""

_VIEWS_V1 = """
CREATE OR REPLACE VIEW v_samples AS
SELECT s.run, s.array_row, s.stimulus, st.dataset, st.id, st.family, st.split, st.seed,
       st.prompt, st.answer, st.params, st.truth, st.image, st.set_path,
       s.seq_len, s.image_start, s.image_count, s.grid_h, s.grid_w, s.last_prompt,
       s.answer_start, s.answer_count, s.spans,
       g.text AS generated, g.prediction, g.parse_ok, g.correct, g.score
FROM samples s
JOIN stimuli st USING (stimulus)
LEFT JOIN generations g ON g.run = s.run AND g.stimulus = s.stimulus;

CREATE OR REPLACE VIEW v_arrays AS
SELECT a.run, a.tap, a.layer, a.site, a.tokens, a.layout, a.shape, a.stored_dtype, a.codec,
       a.n_chunks, count(c.chunk) AS chunks_committed,
       coalesce(sum(c.n_rows), 0)::BIGINT AS rows_committed,
       coalesce(sum(c.nbytes), 0)::BIGINT AS bytes,
       coalesce(sum(c.nbytes), 0) / nullif(coalesce(sum(c.n_rows), 0) * a.values_per_row, 0) AS bytes_per_value,
       coalesce(sum(c.n_nonfinite), 0)::BIGINT AS n_nonfinite,
       coalesce(sum(c.n_clipped), 0)::BIGINT AS n_clipped,
       a.module, a.zarr_path
FROM activations a
LEFT JOIN chunks c ON c.run = a.run AND c.zarr_path = a.zarr_path
GROUP BY a.run, a.tap, a.layer, a.site, a.tokens, a.layout, a.shape, a.stored_dtype, a.codec,
         a.n_chunks, a.values_per_row, a.module, a.zarr_path;

CREATE OR REPLACE VIEW v_runs AS
SELECT r.run, r.model, r.status, r.n_samples, r.created_at, r.finished_at,
       count(a.zarr_path) AS arrays,
       coalesce(sum(a.bytes), 0)::BIGINT AS bytes,
       coalesce(sum(a.chunks_committed), 0)::BIGINT AS chunks_committed,
       coalesce(sum(a.n_chunks), 0)::BIGINT AS chunks_expected,
       coalesce(sum(a.n_nonfinite), 0)::BIGINT AS n_nonfinite,
       coalesce(sum(a.n_clipped), 0)::BIGINT AS n_clipped
FROM runs r
LEFT JOIN v_arrays a USING (run)
GROUP BY ALL;

CREATE OR REPLACE VIEW v_probe_layers AS
SELECT run, tap, layer, site, tokens, target, kind, metric,
       avg(score) AS score, avg(control_score) AS control_score,
       avg(score) - avg(control_score) AS selectivity, count(*) AS n_seeds
FROM probes
GROUP BY ALL;

CREATE OR REPLACE VIEW v_best_probe AS
SELECT *
FROM v_probe_layers
QUALIFY row_number() OVER (
    PARTITION BY run, tap, site, tokens, target, kind, metric ORDER BY score DESC, layer) = 1;

CREATE OR REPLACE VIEW v_accuracy AS
SELECT g.run, st.family, count(*) AS n,
       avg(g.correct::INTEGER) AS accuracy,
       avg(g.parse_ok::INTEGER) AS parse_rate,
       avg(g.score) AS mean_score
FROM generations g
JOIN stimuli st USING (stimulus)
GROUP BY ALL;
"""


_V2 = """
ALTER TABLE runs ADD COLUMN intervention JSON;     -- {"kind": ..., params}; NULL for a plain run

CREATE TABLE head_ablations (              -- one row per (stimulus, head) of a head-ablation run
    run         VARCHAR NOT NULL,
    stimulus    VARCHAR NOT NULL,
    array_row   BIGINT,
    tap         VARCHAR NOT NULL,          -- llm | vision: whose attention head was zeroed
    layer       INTEGER NOT NULL,
    head        INTEGER NOT NULL,
    n_positions INTEGER NOT NULL,          -- answer positions scored (teacher-forced reference)
    n_flipped   INTEGER NOT NULL,          -- positions whose argmax changed when the head was zeroed
    flipped     BOOLEAN NOT NULL,          -- n_flipped > 0: the head is critical for this stimulus
    flip_mask   BIGINT  NOT NULL,          -- bit p set: answer position p flipped (counting-bottleneck compares)
    logit_drop  DOUBLE,                    -- mean drop of the reference tokens' log-probability
    recorded_at TIMESTAMP NOT NULL,
    PRIMARY KEY (run, stimulus, tap, layer, head)
);

CREATE TABLE vocab (                      -- the tokenizer's vocabulary, for an offline logit lens
    run      VARCHAR NOT NULL,
    token_id INTEGER NOT NULL,
    token    VARCHAR NOT NULL,                -- the token as decoded on its own
    PRIMARY KEY (run, token_id)
);

CREATE OR REPLACE VIEW v_runs AS
SELECT r.run, r.model, r.status, r.n_samples, r.created_at, r.finished_at,
       count(a.zarr_path) AS arrays,
       coalesce(sum(a.bytes), 0)::BIGINT AS bytes,
       coalesce(sum(a.chunks_committed), 0)::BIGINT AS chunks_committed,
       coalesce(sum(a.n_chunks), 0)::BIGINT AS chunks_expected,
       coalesce(sum(a.n_nonfinite), 0)::BIGINT AS n_nonfinite,
       coalesce(sum(a.n_clipped), 0)::BIGINT AS n_clipped,
       r.intervention->>'kind' AS intervention
FROM runs r
LEFT JOIN v_arrays a USING (run)
GROUP BY ALL;
"""


# Bit rot in a ragged block's offsets shifts every later sample's rows, so verify checksums them
# too. NULL: a dense chunk (no offsets), or a ragged chunk committed before v3 (unknown; verify
# says how many it could check only for shape).
_V3_OFFSETS_CRC = "ALTER TABLE chunks ADD COLUMN offsets_crc32c BIGINT;  -- CRC-32C of a ragged block's int64 offsets"

_V4_GENERATIONS = """
ALTER TABLE generations ADD COLUMN stop_reason VARCHAR;   -- eos | cap (ran into max_new_tokens); NULL: not recorded
ALTER TABLE generations ADD COLUMN answer_kind VARCHAR;   -- empty | word | digits | runaway (store.records.answer_kind)

CREATE OR REPLACE VIEW v_samples AS
SELECT s.run, s.array_row, s.stimulus, st.dataset, st.id, st.family, st.split, st.seed,
       st.prompt, st.answer, st.params, st.truth, st.image, st.set_path,
       s.seq_len, s.image_start, s.image_count, s.grid_h, s.grid_w, s.last_prompt,
       s.answer_start, s.answer_count, s.spans,
       g.text AS generated, g.prediction, g.parse_ok, g.correct, g.score, g.stop_reason, g.answer_kind
FROM samples s
JOIN stimuli st USING (stimulus)
LEFT JOIN generations g ON g.run = s.run AND g.stimulus = s.stimulus;
"""


def _v4_generations(con: duckdb.DuckDBPyConnection) -> None:
    """Rows written before v4 get their kind from the text alone: whether they ran into the cap
    was not recorded, so none of them is called runaway (stop_reason stays NULL)."""
    con.execute(_V4_GENERATIONS)
    rows = con.execute("SELECT DISTINCT text FROM generations").fetchall()
    if rows:
        con.execute("CREATE TEMP TABLE _kinds (text VARCHAR, kind VARCHAR)")
        con.executemany("INSERT INTO _kinds VALUES (?, ?)", [(t, answer_kind(t, None)) for (t,) in rows])
        con.execute("UPDATE generations SET answer_kind = k.kind FROM _kinds k"
                    " WHERE generations.text IS NOT DISTINCT FROM k.text")
        con.execute("DROP TABLE _kinds")


# Seeds are averaged only over probes split alike: plans that hold out different test fractions
# (params->'split'->>'test_fraction'; NULL for a split by column) score different things.
_V5_PROBE_VIEWS = """
CREATE OR REPLACE VIEW v_probe_layers AS
SELECT run, tap, layer, site, tokens, target, kind, metric,
       avg(score) AS score, avg(control_score) AS control_score,
       avg(score) - avg(control_score) AS selectivity, count(*) AS n_seeds,
       (params->'split'->>'test_fraction')::DOUBLE AS test_fraction
FROM probes
GROUP BY ALL;

CREATE OR REPLACE VIEW v_best_probe AS
SELECT *
FROM v_probe_layers
QUALIFY row_number() OVER (
    PARTITION BY run, tap, site, tokens, target, kind, metric, test_fraction ORDER BY score DESC, layer) = 1;
"""


def _v5_probe_views(con: duckdb.DuckDBPyConnection) -> None:
    con.execute(_V5_PROBE_VIEWS)


# Probes keyed by their full identity (kind parameters, split, train_where ...), so two plans that
# differ only there keep both rows; per-sample test predictions in their own table (not JSON in
# params) to join with v_samples; each array's place along the model's data path (store/depth.py).
_PROBES_V6 = """
CREATE TABLE probes_v6 (
    key           VARCHAR PRIMARY KEY,       -- probes/plan.py's task key: everything that defines the probe
    run           VARCHAR NOT NULL,
    tap           VARCHAR NOT NULL,
    layer         INTEGER NOT NULL,
    site          VARCHAR NOT NULL,
    tokens        VARCHAR NOT NULL,
    target        VARCHAR NOT NULL,
    kind          VARCHAR NOT NULL,
    seed          INTEGER NOT NULL,
    series        VARCHAR,                   -- the key without tap/layer/site/seed: one curve along depth
    kind_params   JSON,
    split         VARCHAR,                   -- the split rule, e.g. hash(seed=0, test=0.25)
    test_fraction DOUBLE,
    train_where   VARCHAR,
    n_train       INTEGER,
    n_test        INTEGER,
    metric        VARCHAR NOT NULL,
    score         DOUBLE  NOT NULL,
    control_score DOUBLE,
    artifact      VARCHAR,
    params        JSON,
    created_at    TIMESTAMP NOT NULL
);

CREATE TABLE probe_predictions (           -- one row per test sample of a probe
    key        VARCHAR NOT NULL,             -- probes.key
    run        VARCHAR NOT NULL,
    array_row  BIGINT  NOT NULL,             -- join v_samples on (run, array_row)
    prediction DOUBLE,                       -- the probe's number for the sample (class code, value, N_H, boxes)
    truth      DOUBLE,                       -- the target's number for the sample, where it is one number
    score      DOUBLE,                       -- per-sample quality in the probe's metric (1/0, token/cell accuracy, AP)
    PRIMARY KEY (key, array_row)
);

ALTER TABLE activations ADD COLUMN depth INTEGER;   -- position along the data path (store/depth.py)
ALTER TABLE activations ADD COLUMN stage VARCHAR;   -- vision | merger | projector | llm | logits
"""

_VIEWS_V6 = """
CREATE OR REPLACE VIEW v_probe_layers AS
SELECT p.run, p.tap, p.layer, p.site, p.tokens, p.target, p.kind, p.metric, p.series, p.test_fraction,
       any_value(a.depth) AS depth, any_value(a.stage) AS stage,
       avg(p.score) AS score, avg(p.control_score) AS control_score,
       -- R^2's chance floor is 0 (the mean); a shuffled ridge can score far below it
       avg(p.score) - CASE WHEN p.metric = 'r2' THEN greatest(avg(p.control_score), 0) ELSE avg(p.control_score) END
           AS selectivity,
       count(*) AS n_seeds
FROM probes p
LEFT JOIN activations a ON a.run = p.run AND a.tap = p.tap AND a.layer = p.layer AND a.site = p.site
                       AND a.tokens = p.tokens
GROUP BY p.run, p.tap, p.layer, p.site, p.tokens, p.target, p.kind, p.metric, p.series, p.test_fraction;

CREATE OR REPLACE VIEW v_best_probe AS
SELECT *
FROM v_probe_layers
QUALIFY row_number() OVER (
    PARTITION BY run, tap, site, tokens, target, kind, metric, series, test_fraction ORDER BY score DESC, layer) = 1;
"""


def _probe_rows_v6(con: duckdb.DuckDBPyConnection) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """Old probes rows in the v6 layout, and their predictions moved out of params."""
    from store.records import ProbeResult

    cols = ["run", "tap", "layer", "site", "tokens", "target", "kind", "seed", "n_train", "n_test", "metric", "score",
            "control_score", "artifact", "params", "created_at"]
    probes, predictions = [], []
    for values in con.execute(f"SELECT {', '.join(cols)} FROM probes").fetchall():
        row = dict(zip(cols, values, strict=True))
        params = json.loads(row["params"]) if row["params"] else {}
        kind_params = params.get("kind_params")
        split = None if params.get("split") is None else json.dumps(params["split"], sort_keys=True)
        key = ProbeResult(run=row["run"], tap=row["tap"], layer=row["layer"], target=row["target"], kind=row["kind"],
                          score=row["score"], site=row["site"], tokens=row["tokens"], seed=row["seed"],
                          params=params, kind_params=kind_params, split=split,
                          train_where=params.get("train_where")).probe_key()
        got = params.pop("predictions", None) or {}
        for r, v in zip(got.get("array_row", []), got.get("value", []), strict=False):
            predictions.append((key, row["run"], int(r), None if v is None else float(v)))
        series = series_of(row["tokens"], row["target"], row["kind"], kind_params, params.get("where"),
                           params.get("train_where"), split, params.get("control"))
        rule = params.get("split")
        fraction = rule.get("test_fraction") if isinstance(rule, dict) else None
        probes.append((key, *(row[c] for c in cols[:8]), series, json.dumps(kind_params), split, fraction,
                       params.get("train_where"), *(row[c] for c in cols[8:14]), json.dumps(params), row["created_at"]))
    return probes, predictions


def series_of(*identity: Any) -> str:
    """A probe's curve along depth: its identity without tap, layer, site and seed."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def series_rule(rule: dict[str, Any]) -> str:
    """The split rule as a series sees it: every seed, and the k folds of a kfold seed, are one
    curve, whose seeds the queries average (a series per seed never averaged)."""
    return json.dumps({k: v for k, v in rule.items() if k not in ("fold", "seed")}, sort_keys=True)


def _v6_probes(con: duckdb.DuckDBPyConnection) -> None:
    from store.depth import assign_depths

    probes, predictions = _probe_rows_v6(con)
    con.execute(_PROBES_V6)
    if probes:
        con.executemany(f"INSERT INTO probes_v6 VALUES ({', '.join('?' * 22)})", probes)
    if predictions:
        # An old hidden_number / conv_spatial row kept one number per sample: N_H, or the cell accuracy.
        con.executemany("INSERT INTO probe_predictions (key, run, array_row, prediction) VALUES (?, ?, ?, ?)",
                        predictions)
        con.execute("UPDATE probe_predictions SET score = prediction, prediction = NULL WHERE key IN"
                    " (SELECT key FROM probes_v6 WHERE kind = 'conv_spatial')")
    con.execute("DROP VIEW IF EXISTS v_best_probe; DROP VIEW IF EXISTS v_probe_layers; DROP TABLE probes;"
                " ALTER TABLE probes_v6 RENAME TO probes")
    con.execute(_VIEWS_V6)
    assign_depths(con)


# A derived array: a function of one stored array computed once per chunk (a pooled vector per sample),
# with what it was computed from, so a later reader can tell whether the source has changed since.
_V7_DERIVED = """
CREATE TABLE derived_arrays (
    zarr_path        VARCHAR PRIMARY KEY,      -- derived/<run>/<tap>.<layer>.<site>.<tokens>.<op>
    run              VARCHAR NOT NULL,         -- the source array's identity
    tap              VARCHAR NOT NULL,
    layer            INTEGER NOT NULL,
    site             VARCHAR NOT NULL,
    tokens           VARCHAR NOT NULL,
    source_zarr_path VARCHAR NOT NULL,
    op               VARCHAR NOT NULL,         -- pool_mean | pool_max | pool_first | pool_last
    shape            BIGINT[] NOT NULL,        -- [n_samples, d]
    dtype            VARCHAR NOT NULL,         -- float32: what kinds compute on
    chunk_samples    INTEGER NOT NULL,         -- the source's: derived chunk k holds source chunk k's rows
    n_chunks         INTEGER NOT NULL,
    source_digest    VARCHAR NOT NULL,         -- sha256 of the source's chunk rows (crc32c, n_rows, committed_at)
    code             VARCHAR NOT NULL,         -- what computed it, e.g. probes.pooling.pool
    created_at       TIMESTAMP NOT NULL
);
"""


def _v7_derived(con: duckdb.DuckDBPyConnection) -> None:
    con.execute(_V7_DERIVED)


# k-fold probes (one row per fold: ``fold``), the shuffled-label control's per-sample output beside the
# probe's (a verdict compares the two per group, queries/verdicts.py), and seeds averaged in the
# views: folds first within a seed, then mean and spread over seeds.
_V8_FOLDS_CONTROLS = """
ALTER TABLE probes ADD COLUMN fold INTEGER;                       -- split kfold: which fold this probe tested
ALTER TABLE probe_predictions ADD COLUMN control_prediction DOUBLE; -- the shuffled-label control's number
ALTER TABLE probe_predictions ADD COLUMN control_score DOUBLE;      -- ... and its per-sample score

CREATE OR REPLACE VIEW v_probe_layers AS
WITH per_seed AS (
    SELECT run, tap, layer, site, tokens, target, kind, metric, series, test_fraction, seed,
           avg(score) AS score, avg(control_score) AS control_score, count(*) AS n_folds
    FROM probes
    GROUP BY run, tap, layer, site, tokens, target, kind, metric, series, test_fraction, seed
)
SELECT p.run, p.tap, p.layer, p.site, p.tokens, p.target, p.kind, p.metric, p.series, p.test_fraction,
       any_value(a.depth) AS depth, any_value(a.stage) AS stage,
       avg(p.score) AS score, avg(p.control_score) AS control_score,
       -- R^2's chance floor is 0 (the mean); a shuffled ridge can score far below it
       avg(p.score) - CASE WHEN p.metric = 'r2' THEN greatest(avg(p.control_score), 0) ELSE avg(p.control_score) END
           AS selectivity,
       count(*) AS n_seeds,
       stddev_samp(p.score) AS score_sd,            -- spread over seeds (NULL with one seed)
       stddev_samp(p.control_score) AS control_sd,
       max(p.n_folds) AS n_folds
FROM per_seed p
LEFT JOIN activations a ON a.run = p.run AND a.tap = p.tap AND a.layer = p.layer AND a.site = p.site
                       AND a.tokens = p.tokens
GROUP BY p.run, p.tap, p.layer, p.site, p.tokens, p.target, p.kind, p.metric, p.series, p.test_fraction;

CREATE OR REPLACE VIEW v_best_probe AS
SELECT *
FROM v_probe_layers
QUALIFY row_number() OVER (
    PARTITION BY run, tap, site, tokens, target, kind, metric, series, test_fraction ORDER BY score DESC, layer) = 1;
"""


def _v8_folds_controls(con: duckdb.DuckDBPyConnection) -> None:
    con.execute(_V8_FOLDS_CONTROLS)
    # The farm's probes of earlier versions: one series per seed. Recompute their series so the
    # seeds of one probe definition are one curve (hand-recorded probes keep the series they were given).
    rows = con.execute("SELECT key, tokens, target, kind, kind_params::VARCHAR, params::VARCHAR, train_where, split"
                       " FROM probes WHERE params->>'plan' IS NOT NULL AND split IS NOT NULL").fetchall()
    updates = []
    for key, tokens, target, kind, kind_params, params, train_where, split in rows:
        p = json.loads(params) if params else {}
        updates.append((series_of(tokens, target, kind, json.loads(kind_params) if kind_params else None, p.get("where"),
                                  train_where, series_rule(json.loads(split)), p.get("control")), key))
    if updates:
        con.executemany("UPDATE probes SET series = ? WHERE key = ?", updates)


# A derived chunk's CRC-32C, as the main arrays' chunks carry theirs: without it a flipped byte in a
# pooled vector passed verify and plans trained on it. NULL for arrays derived before this step
# (verify says they are unchecked; derive them again to checksum them).
_V9_DERIVED_CRC = "ALTER TABLE derived_arrays ADD COLUMN chunk_crc32c BIGINT[];  -- CRC-32C of each chunk's float32 values"


def _v9_derived_crc(con: duckdb.DuckDBPyConnection) -> None:
    con.execute(_V9_DERIVED_CRC)


# Sparse autoencoders trained from the store (probes/sae/): one row per SAE with its reconstruction
# metrics, each feature's association with each truth variable beside its shuffled-truth control,
# and the features' activations on the test samples as a sparse table (non-zero values only).
_V10_SAE = """
CREATE TABLE sae_models (
    key                VARCHAR PRIMARY KEY,   -- sha256 of the identity (plan entry, array, architecture, seed)
    plan               VARCHAR,
    run                VARCHAR NOT NULL,
    tap                VARCHAR NOT NULL,
    layer              INTEGER NOT NULL,
    site               VARCHAR NOT NULL,
    tokens             VARCHAR NOT NULL,
    out_site           VARCHAR,               -- transcoder: the site it predicts (same tap, layer, tokens)
    rows               VARCHAR NOT NULL,      -- tokens | pooled
    architecture       VARCHAR NOT NULL,      -- topk | standard (ReLU + L1) | transcoder
    d_in               INTEGER NOT NULL,
    d_sae              INTEGER NOT NULL,
    k                  INTEGER,               -- topk
    l1                 DOUBLE,                -- standard, transcoder
    seed               INTEGER NOT NULL,
    test_fraction      DOUBLE,
    where_sql          VARCHAR,
    train_where        VARCHAR,
    n_train            BIGINT,                -- rows (tokens or samples) trained on, per epoch
    n_test             BIGINT,
    epochs             INTEGER,
    steps              BIGINT,
    mse                DOUBLE,                -- on the test rows
    explained_variance DOUBLE,
    l0                 DOUBLE,                -- mean active features per row
    dead_share         DOUBLE,                -- features never active on the test rows
    rows_per_s         DOUBLE,
    seconds            DOUBLE,
    path               VARCHAR NOT NULL,      -- folder under the workspace: cfg.json + sae_weights.safetensors
    params             JSON,
    created_at         TIMESTAMP NOT NULL
);

CREATE TABLE sae_feature_scores (
    sae           VARCHAR NOT NULL,           -- sae_models.key
    feature       INTEGER NOT NULL,
    target        VARCHAR NOT NULL,           -- a probe target (probes/targets.py)
    class         VARCHAR NOT NULL,           -- the class scored one-vs-rest; '' for an ordinal target
    metric        VARCHAR NOT NULL,           -- auroc | spearman | iou
    score         DOUBLE,
    control_score DOUBLE,                     -- the same feature against shuffled truth
    ci_low        DOUBLE,                     -- interval of score (queries/intervals.py conventions)
    ci_high       DOUBLE,
    p_value       DOUBLE,                     -- against the permutation null
    q_value       DOUBLE,                     -- Benjamini-Hochberg over every (feature, target, class) of the SAE
    n             INTEGER,                    -- test samples (tokens for iou)
    n_positive    INTEGER,
    PRIMARY KEY (sae, feature, target, class, metric)
);

CREATE TABLE sae_activations (
    sae       VARCHAR NOT NULL,
    run       VARCHAR NOT NULL,
    array_row BIGINT NOT NULL,
    token     INTEGER NOT NULL,               -- -1: a pooled row
    feature   INTEGER NOT NULL,
    value     REAL NOT NULL                   -- only non-zero activations are stored
);
"""


def _v10_sae(con: duckdb.DuckDBPyConnection) -> None:
    con.execute(_V10_SAE)


@dataclass(frozen=True)
class Migration:
    """One schema step: ``apply`` runs inside the migration's transaction."""

    version: int
    description: str
    apply: Callable[[duckdb.DuckDBPyConnection], None]


def _v1(con: duckdb.DuckDBPyConnection) -> None:
    con.execute(_TABLES_V1)
    con.execute(_VIEWS_V1)


def _v2(con: duckdb.DuckDBPyConnection) -> None:
    con.execute(_V2)


def _v3_offsets_crc(con: duckdb.DuckDBPyConnection) -> None:
    con.execute(_V3_OFFSETS_CRC)


MIGRATIONS: list[Migration] = [
    Migration(1, "initial manifest: runs, stimuli, samples, activations, chunks, tensors, generations, probes", _v1),
    Migration(2, "interventions (runs.intervention, head_ablations) and the vocabulary for the logit lens",
              _v2),
    Migration(3, "chunks.offsets_crc32c: a checksum of each ragged block's offsets", _v3_offsets_crc),
    Migration(4, "generations.stop_reason (eos | cap) and generations.answer_kind (empty | word | digits | runaway)",
              _v4_generations),
    Migration(5, "v_probe_layers and v_best_probe average seeds per test fraction", _v5_probe_views),
    Migration(6, "probes keyed by their full identity, probe_predictions per test sample, activations.depth/stage",
              _v6_probes),
    Migration(7, "derived_arrays: pooled features computed once per chunk, with their source's identity", _v7_derived),
    Migration(8, "probes.fold (k-fold splits), per-sample control predictions, seeds' mean and spread in the views",
              _v8_folds_controls),
    Migration(9, "derived_arrays.chunk_crc32c: a checksum of each derived chunk", _v9_derived_crc),
    Migration(10, "sae_models, sae_feature_scores, sae_activations: sparse autoencoders scored against truth", _v10_sae),
]


def latest_version(migrations: list[Migration] | None = None) -> int:
    return max(m.version for m in (migrations or MIGRATIONS))


def current_version(con: duckdb.DuckDBPyConnection) -> int:
    """0 for an empty file; the highest applied step otherwise."""
    exists = con.execute(
        "SELECT count(*) FROM information_schema.tables WHERE table_name = 'schema_version'"
        " AND table_catalog = current_database()"  # the shared instance attaches other manifests too
    ).fetchone()
    if not exists or exists[0] == 0:
        return 0
    row = con.execute("SELECT max(version) FROM schema_version").fetchone()
    return int(row[0]) if row and row[0] is not None else 0


def pending(version: int, migrations: list[Migration] | None = None) -> list[Migration]:
    return sorted((m for m in (migrations or MIGRATIONS) if m.version > version), key=lambda m: m.version)


def migrate(con: duckdb.DuckDBPyConnection, migrations: list[Migration] | None = None) -> list[int]:
    """Apply every pending step, each in its own transaction, so an upgrade that stops keeps the
    steps it finished; returns the versions applied. A new file takes every step in one
    transaction: it has nothing to keep (it is built beside the manifest and linked into place
    whole), and each COMMIT costs a WAL write and sync (~5 ms of a fresh workspace's ~110)."""
    version = current_version(con)
    steps = pending(version, migrations)
    for group in ([steps] if version == 0 else [[step] for step in steps]):
        con.execute("BEGIN TRANSACTION")
        try:
            for step in group:
                step.apply(con)
                con.execute(
                    "INSERT INTO schema_version (version, description) VALUES (?, ?)", [step.version, step.description]
                )
            con.execute("COMMIT")
        except BaseException:
            rollback(con)
            raise
    return [step.version for step in steps]
