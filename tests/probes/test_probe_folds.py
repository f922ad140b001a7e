"""k-fold probes and seeds as one series: every sample held out exactly once per seed, the seeds
and folds of one probe definition one curve, averaged with their spread in the views; workspaces
written before (one series per seed) are migrated to the same."""

from __future__ import annotations

import json

import numpy as np
import pytest
from probetest_lib import spatial_family, spatial_features, write_run

from probes import parse_plan, run_plan
from probes.errors import ProbeError
from probes.splits import hash_unit, kfold_fold
from store import ProbeResult, Workspace
from store import schema as schema_mod

PLAN = {
    "name": "folds",
    "defaults": {"seeds": [0, 1], "split": "kfold", "folds": 4},
    "probes": [{"taps": ["vision"], "layers": [0], "runs": ["spatial"], "targets": ["spatial.relation"],
                "kinds": {"pooled": {"pool": "mean"}}}],
}


def test_kfold_tests_every_sample_once_and_refuses_too_few():
    keys = [f"s{i}" for i in range(40)]
    folds = [kfold_fold(keys, seed=3, folds=4, fold=i) for i in range(4)]
    tested = np.sum([f.test for f in folds], axis=0)
    assert (tested == 1).all() and all(not (f.train & f.test).any() for f in folds)
    # The same hash as the hash split: fold i holds the stimuli whose unit value falls in bin i.
    assert (folds[0].test == (hash_unit(keys, 3) < 0.25)).all()
    assert folds[2].rule["fold"] == 2 and folds[2].rule["test_fraction"] == 0.25
    with pytest.raises(ProbeError, match="needs at least 4 samples"):
        kfold_fold(keys[:3], seed=0, folds=4, fold=0)


def test_a_kfold_plan_stores_one_series_with_every_sample_once_per_seed(tmp_path):
    ws = Workspace.open(tmp_path / "ws")
    rows, rel, latent = spatial_family(48)
    write_run(ws, "spatial", rows, [spatial_features(rel, latent, 0)], (2, 2), chunk=16)
    run_plan(parse_plan(PLAN), ws.path, in_process=True, progress=False, log=lambda s: None)
    ws = Workspace.open(ws.path, readonly=True)
    assert ws.rows("SELECT count(*), count(DISTINCT series), count(DISTINCT fold) FROM probes") == [(8, 1, 4)]
    per_seed = ws.rows("SELECT p.seed, count(*), count(DISTINCT pp.array_row) FROM probes p"
                       " JOIN probe_predictions pp USING (key) GROUP BY 1 ORDER BY 1")
    assert per_seed == [(0, 48, 48), (1, 48, 48)]   # each sample held out exactly once per seed
    assert ws.rows("SELECT count(*) FROM probe_predictions WHERE control_score IS NULL") == [(0,)]
    (view,) = ws.rows("SELECT n_seeds, n_folds, score_sd IS NOT NULL FROM v_probe_layers")
    assert view == (2, 4, True)


def test_a_v7_workspace_gets_one_series_per_probe_definition(tmp_path):
    old = Workspace.open(tmp_path / "ws", migrations=schema_mod.MIGRATIONS[:7])
    rows, rel, latent = spatial_family(8)
    write_run(old, "spatial", rows, [spatial_features(rel, latent, 0)], (2, 2), chunk=4)
    results = []
    for seed in (0, 1):   # as the farm recorded them before: the split's seed inside the series
        rule = {"by": "hash", "rule": "...", "seed": seed, "test_fraction": 0.25}
        results.append(ProbeResult(run="spatial", tap="vision", layer=0, target="spatial.relation", kind="pooled",
                                   seed=seed, score=0.5 + seed / 10, key=f"k{seed}", series=f"old-{seed}",
                                   split=json.dumps(rule, sort_keys=True), kind_params={"pool": "mean"},
                                   params={"plan": "p", "where": None, "control": "shuffle"}))
    results.append(ProbeResult(run="spatial", tap="vision", layer=1, target="t", kind="pooled", score=0.1,
                               series="hand-made"))
    import duckdb

    with duckdb.connect(str(old.manifest_path)) as con:   # v7's columns: no fold
        for r in results:
            con.execute("INSERT INTO probes (key, run, tap, layer, site, tokens, target, kind, seed, series,"
                        " kind_params, split, metric, score, params, created_at) VALUES"
                        " (?, ?, ?, ?, 'resid_post', 'image', ?, ?, ?, ?, ?, ?, 'accuracy', ?, ?, now())",
                        [r.probe_key(), r.run, r.tap, r.layer, r.target, r.kind, r.seed, r.series,
                         json.dumps(r.kind_params), r.split, r.score, json.dumps(r.params)])
    ws = Workspace.open(old.path)
    assert ws.schema_version() == schema_mod.latest_version()
    series = dict(ws.rows("SELECT key, series FROM probes"))
    assert series["k0"] == series["k1"] != "old-0" and "hand-made" in series.values()
    (view,) = ws.rows("SELECT n_seeds, round(score, 3) FROM v_probe_layers WHERE layer = 0")
    assert view == (2, 0.55)
