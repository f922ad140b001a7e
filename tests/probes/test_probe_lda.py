"""The streamed ``lda`` and ``nearest_centroid`` kinds: scikit-learn's answers in memory, and the same
weights from ridge's streamed statistics as from the rows."""

from __future__ import annotations

import json

import numpy as np
import pytest
from probetest_lib import build_workspace
from sklearn.discriminant_analysis import LinearDiscriminantAnalysis
from sklearn.neighbors import NearestCentroid

from probes import ProbeError, parse_plan, run_plan
from probes.kinds import Probe
from probes.kinds.lda import LDAProbe, NearestCentroidProbe
from probes.splits import hash_fold
from store import ArraySpec, RunInfo, TokenSpans, Workspace

QUIET = {"progress": False, "log": lambda s: None}


def _classes(n: int, d: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, k, n)
    centres = rng.standard_normal((k, d)) * 0.8
    X = centres[y] + rng.standard_normal((n, d)) * rng.uniform(0.3, 2.0, d) + rng.standard_normal(d)
    return X, y


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("shrinkage", [0.0, 0.3])
def test_lda_matches_sklearn_lsqr_with_shrinkage(k, shrinkage):
    X, y = _classes(400, 12, k)
    mine = LDAProbe(shrinkage=shrinkage).fit(X[:, None, :], y)
    ref = LinearDiscriminantAnalysis(solver="lsqr", shrinkage=shrinkage if shrinkage else None).fit(X, y)
    coef, icpt = mine.state_["coef"], mine.state_["intercept"]
    if k == 2:   # sklearn keeps the difference of the two class columns
        coef, icpt = coef[1:] - coef[:1], icpt[1:] - icpt[:1]
    assert np.abs(coef - ref.coef_).max() < 1e-6 and np.abs(icpt - ref.intercept_).max() < 1e-6
    assert (mine.predict(X[:, None, :]) == ref.predict(X)).all()


def test_centroid_matches_sklearn_nearest_centroid():
    X, y = _classes(300, 9, 5, seed=1)
    mine = NearestCentroidProbe().fit(X[:, None, :], y)
    ref = NearestCentroid().fit(X, y)
    assert (mine.predict(X[:, None, :]) == ref.predict(X)).all()
    assert np.abs(mine.state_["coef"] / 2 - ref.centroids_).max() < 1e-6


def test_lda_refuses_a_singular_covariance_naming_shrinkage():
    X, y = _classes(6, 20, 2)
    with pytest.raises(ProbeError, match="shrinkage above 0"):
        LDAProbe().fit(X[:, None, :], y)
    assert LDAProbe(shrinkage=0.2).fit(X[:, None, :], y).state_["coef"].shape == (2, 20)


def _truth(ws, run: str, key: str) -> np.ndarray:
    vals = [json.loads(t[0])[key] for t in ws.rows(f"SELECT truth FROM v_samples WHERE run = '{run}' ORDER BY array_row")]
    if key == "labels":
        return np.array(vals)
    classes = sorted(set(vals))
    return np.array([classes.index(v) for v in vals])


@pytest.mark.slow
def test_streamed_lda_and_centroid_equal_in_memory_and_sklearn(tmp_path):
    ws = build_workspace(tmp_path / "ws", n=96, families=("go", "spatial"))
    plan = parse_plan({"name": "lda", "probes": [
        {"runs": ["go"], "targets": ["go.intersection"], "kinds": {"lda": {"shrinkage": 0.2}, "nearest_centroid": {}}},
        {"runs": ["spatial"], "targets": ["truth:relation"], "kinds": {"lda": {"shrinkage": 0.1}, "nearest_centroid": {}}},
    ]})
    rep = run_plan(plan, ws.path, in_process=True, block_rows=5, **QUIET)   # 5-sample blocks over 32-sample chunks
    assert rep.trained == 8 and rep.failed == 0, rep.failures
    rows = ws.rows("SELECT run, layer, target, kind, score, control_score, artifact, params FROM probes ORDER BY 1, 2, 3, 4")
    for run, layer, target, kind, score, control, artifact, params in rows:
        fold = hash_fold(ws.select(run).stimuli, 0, 0.2)
        X = ws.read(run, "vision", layer, tokens="image").astype(np.float64)
        got = Probe.load(ws.path / artifact)
        y = _truth(ws, run, "labels" if target == "go.intersection" else "relation")
        ref = type(got)(**got.params.model_dump()).fit(X[fold.train], y[fold.train])
        assert np.abs(got.state_["coef"] - ref.state_["coef"]).max() < 1e-6, (run, layer, target, kind)
        assert np.abs(got.state_["intercept"] - ref.state_["intercept"]).max() < 1e-6
        assert abs(score - ref.score(X[fold.test], y[fold.test])) < 1e-9
        F = X.reshape(-1, X.shape[-1]) if y.ndim == 2 else X.mean(1)
        tr = np.repeat(fold.train, y.shape[1]) if y.ndim == 2 else fold.train
        te = np.repeat(fold.test, y.shape[1]) if y.ndim == 2 else fold.test
        skl = (LinearDiscriminantAnalysis(solver="lsqr", shrinkage=got.params.shrinkage) if kind == "lda"
               else NearestCentroid()).fit(F[tr], y.reshape(-1)[tr])
        skl_acc = float((skl.predict(F[te]) == y.reshape(-1)[te]).mean())
        assert abs(score - skl_acc) <= 0.01, (run, layer, target, kind, score, skl_acc)
        assert control is not None and json.loads(params)["metrics"]["streamed"]


def _numeric_run(path, n: int = 64, t: int = 3, d: int = 8) -> Workspace:
    ws = Workspace.open(path)
    rng = np.random.default_rng(0)
    rows = [{"id": f"x_{i:03d}", "family": "spatial", "split": "test", "seed": i, "truth": {"level": float(rng.random())}}
            for i in range(n)]
    with ws.writer(RunInfo(run="num", model="synthetic", dtype="float32", chunk_samples=32)) as w:
        w.set_samples(w.register_stimuli(rows, dataset="num"))
        h = w.array(ArraySpec(tap="vision", layer=0, tokens="image", shape=(t, d)))
        spans = [TokenSpans(seq_len=t + 2, image_start=1, image_count=t, grid_h=1, grid_w=t, last_prompt=t + 1)] * 32
        for s in range(0, n, 32):
            w.write_batch(s, {h: rng.standard_normal((32, t, d), dtype=np.float32)}, tokens=spans)
        w.finish()
    return ws


def test_lda_on_a_numeric_target_is_refused_before_training(tmp_path):
    ws = _numeric_run(tmp_path / "ws")
    plan = parse_plan({"name": "n", "probes": [{"runs": ["num"], "targets": ["truth:level"], "kinds": ["lda"]}]})
    with pytest.raises(ProbeError, match="kind lda classifies; target truth:level holds numbers: use kind ridge"):
        run_plan(plan, ws.path, in_process=True, **QUIET)
    assert ws.rows("SELECT count(*) FROM probes")[0][0] == 0
    with pytest.raises(ProbeError, match="use kind ridge"):
        LDAProbe().fit(np.zeros((4, 1, 2)), np.array([0.5, 1.5, 0.25, 2.0]))
