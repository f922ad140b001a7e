"""Streamed statistics kinds record per-sample test predictions (probe_predictions) equal to the
in-memory reference's on the same split, with their shuffled-label control beside them, scored
against the real target; and ``ridge``'s task auto regresses a count as ``pooled`` does."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from probetest_lib import D, build_workspace, write_run

from probes import parse_plan, run_plan
from probes.kinds.hidden_number import HiddenNumberRidgeProbe
from probes.kinds.lda import LDAProbe
from probes.kinds.ridge import RidgeProbe
from probes.splits import control_permutation, hash_fold
from store import Workspace

QUIET = {"progress": False, "log": lambda s: None}
COLUMNS = "array_row, prediction, truth, score, control_prediction, control_score"


def _numbers_run(ws: Workspace, n: int = 96, t: int = 3) -> dict[str, np.ndarray]:
    """A run whose truth holds a real number (level), a count 0..120 and a 3-valued k, each
    written into the features so a linear probe finds them."""
    rng = np.random.default_rng(5)
    truth = {"level": rng.random(n), "count": rng.integers(0, 121, n), "k": rng.integers(0, 3, n)}
    rows = [{"id": f"nb_{i:03d}", "family": "numbers", "split": "test", "seed": i,
             "truth": {"level": float(truth["level"][i]), "count": int(truth["count"][i]), "k": int(truth["k"][i])}}
            for i in range(n)]
    dirs = rng.standard_normal((3, D))
    signal = truth["level"][:, None] * dirs[0] + truth["count"][:, None] / 40 * dirs[1] + truth["k"][:, None] * dirs[2]
    feats = (rng.standard_normal((n, t, D)) * 0.3 + signal[:, None, :]).astype(np.float32)
    write_run(ws, "numbers", rows, [feats], (1, t))
    return truth


def _stored(ws: Workspace, key: str) -> list[tuple[Any, ...]]:
    return ws.rows(f"SELECT {COLUMNS} FROM probe_predictions WHERE key = ? ORDER BY array_row", [key])


def _probes(ws: Workspace) -> list[tuple[Any, ...]]:
    return ws.rows("SELECT key, run, layer, target, kind, seed, metric, params FROM probes ORDER BY 1")


def _codes(ws: Workspace, run: str, path: str) -> tuple[np.ndarray, list[Any]]:
    vals = [json.loads(t[0])[path] for t in ws.rows(f"SELECT truth FROM v_samples WHERE run = '{run}' ORDER BY array_row")]
    classes = sorted(set(vals), key=lambda v: v if not isinstance(v, str) else str(v))
    return np.array([classes.index(v) for v in vals]), classes


def _column(rows: list[tuple[Any, ...]], i: int) -> np.ndarray:
    return np.array([np.nan if r[i] is None else r[i] for r in rows], dtype=np.float64)


@pytest.mark.parametrize("block_rows", [5, 64])   # several blocks per chunk; one block over the chunks
def test_streamed_ridge_stores_the_in_memory_probes_per_sample_output_and_its_controls(tmp_path, block_rows):
    ws = build_workspace(tmp_path / "ws", n=96, families=("go", "spatial"))
    truth = _numbers_run(ws)
    plan = parse_plan({"name": "ps", "probes": [
        {"runs": ["go"], "targets": ["go.intersection"], "layers": [1], "kinds": {"ridge": {"alphas": [0.5, 5.0]}}},
        {"runs": ["spatial"], "targets": ["truth:relation", "truth:flag_0"], "layers": [1], "kinds": ["ridge"]},
        {"runs": ["numbers"], "targets": ["truth:level", "truth:k"], "kinds": {"ridge": {"alphas": [0.1, 10.0]}}},
    ]})
    rep = run_plan(plan, ws.path, in_process=True, block_rows=block_rows, **QUIET)
    assert rep.trained == 5 and rep.failed == 0, rep.failures
    seen = set()
    for key, run, layer, target, _, seed, metric, params in _probes(ws):
        fold = hash_fold(ws.select(run).stimuli, seed, 0.2)
        perm = control_permutation(len(fold.test), seed)
        X = ws.read(run, "vision", layer, tokens="image").astype(np.float64)
        alphas = json.loads(params)["metrics"]["alphas"]
        stored = _stored(ws, key)
        assert [r[0] for r in stored] == list(np.flatnonzero(fold.test)), target
        pred, truth_col, score, cpred, cscore = (_column(stored, i) for i in range(1, 6))
        if target == "go.intersection":   # token classification: each board's token accuracy
            y = np.array([json.loads(t[0])["labels"] for t in ws.rows(
                "SELECT truth FROM v_samples WHERE run = 'go' ORDER BY array_row")])
            for labels, col in ((y, score), (y[perm], cscore)):
                ref = RidgeProbe(alphas=alphas).fit(X[fold.train], labels[fold.train])
                hit = ref.predict(X[fold.test], token_level=True).reshape(y[fold.test].shape) == y[fold.test]
                assert np.abs(col - hit.mean(1)).max() < 1e-12
            assert np.isnan(pred).all() and np.isnan(truth_col).all() and np.isnan(cpred).all()
        elif target == "truth:level":     # regression: the value, the truth, no per-sample score
            assert metric == "r2"
            y = truth["level"]
            for values, col in ((y, pred), (y[perm], cpred)):
                ref = RidgeProbe(alphas=alphas).fit(X[fold.train], values[fold.train])
                assert ref.meta_["task"] == "regress"
                assert np.abs(col - ref.predict(X[fold.test])).max() < 1e-6
            assert np.abs(truth_col - y[fold.test]).max() < 1e-12
            assert np.isnan(score).all() and np.isnan(cscore).all()
        else:                             # sample classification: 1/0, the class's number where it is one
            y, classes = _codes(ws, run, target.split(":")[1])
            numeric = all(isinstance(c, int) for c in classes)
            for labels, got, right in ((y, pred, score), (y[perm], cpred, cscore)):
                ref = RidgeProbe(alphas=alphas).fit(X[fold.train], labels[fold.train])
                codes = ref.predict(X[fold.test])
                assert (right == (codes == y[fold.test])).all()
                if numeric:
                    assert (got == np.asarray(classes, dtype=float)[codes]).all()
                else:
                    assert np.isnan(got).all()
            assert not np.isnan(cscore).any() and 0.0 < np.nanmean(score)
            if numeric:
                assert (truth_col == np.asarray(classes, dtype=float)[y[fold.test]]).all()
        seen.add(target)
    assert seen == {"go.intersection", "truth:relation", "truth:flag_0", "truth:level", "truth:k"}


def test_streamed_lda_and_counting_controls_are_scored_against_the_real_target(tmp_path):
    ws = build_workspace(tmp_path / "ws", n=96, families=("go", "spatial"))
    plan = parse_plan({"name": "lc", "probes": [
        {"runs": ["spatial"], "targets": ["truth:relation"], "layers": [1], "kinds": {"lda": {"shrinkage": 0.1}}},
        {"runs": ["go"], "targets": ["go.intersection"], "layers": [1], "kinds": ["hidden_number_ridge"]},
    ]})
    rep = run_plan(plan, ws.path, in_process=True, block_rows=7, **QUIET)
    assert rep.trained == 2 and rep.failed == 0, rep.failures
    for key, run, layer, _, kind, seed, _, _ in _probes(ws):
        fold = hash_fold(ws.select(run).stimuli, seed, 0.2)
        perm = control_permutation(len(fold.test), seed)
        X = ws.read(run, "vision", layer, tokens="image").astype(np.float64)
        stored = _stored(ws, key)
        if kind == "lda":
            y, _ = _codes(ws, run, "relation")
            ctl = LDAProbe(shrinkage=0.1).fit(X[fold.train], y[perm][fold.train]).predict(X[fold.test])
            assert (_column(stored, 5) == (ctl == y[fold.test])).all()
        else:   # the control's N_H on the probe's test boards, against their real count
            y = np.array([json.loads(t[0])["labels"] for t in ws.rows(
                "SELECT truth FROM v_samples WHERE run = 'go' ORDER BY array_row")])
            ctl = HiddenNumberRidgeProbe(random_state=seed).fit(X[fold.train], y[perm][fold.train])
            n_h = ctl.hidden_number(X[fold.test]).astype(float)
            assert (_column(stored, 4) == n_h).all()
            assert (_column(stored, 5) == (n_h == (y[fold.test] == 0).sum(1))).all()


def test_ridge_task_auto_regresses_a_count_and_classifies_a_few_values(tmp_path):
    ws = Workspace.open(tmp_path / "ws")
    truth = _numbers_run(ws)
    plan = parse_plan({"name": "auto", "probes": [{"runs": ["numbers"], "targets": ["truth:count", "truth:k"],
                                                   "kinds": ["ridge"]}]})
    rep = run_plan(plan, ws.path, in_process=True, **QUIET)
    assert rep.trained == 2 and rep.failed == 0, rep.failures
    got = {target: (metric, score) for _, _, _, target, _, _, metric, score in
           ws.rows("SELECT key, run, layer, target, kind, seed, metric, score FROM probes")}
    assert got["truth:count"][0] == "r2" and got["truth:count"][1] > 0.5   # a number, not one of 121 classes
    assert got["truth:k"][0] == "accuracy"
    # The in-memory reference follows the same rule.
    X = np.ones((96, 1, 2)) * truth["count"][:, None, None]
    assert RidgeProbe().fit(X, truth["count"]).meta_["task"] == "regress"
    assert RidgeProbe().fit(X, truth["k"]).meta_["task"] == "classify"
    assert RidgeProbe().fit(X, truth["level"]).meta_["task"] == "regress"
