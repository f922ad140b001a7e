"""The batched torch solver gives scikit-learn's answers: same splits, within 1 point of accuracy."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import StandardScaler
from threadpoolctl import threadpool_limits

from probes.kinds import Job, LinearProbe, PooledProbe
from probes.logreg import fit_logistic
from probes.splits import control_permutation, hash_fold
from probes.targets import TargetValues, encode


def _sklearn_acc(Xtr, ytr, Xte, yte):
    sc = StandardScaler().fit(Xtr)
    with threadpool_limits(1), warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        m = LogisticRegression(C=1.0).fit(sc.transform(Xtr), ytr)  # sklearn's defaults: lbfgs, max_iter 100
    pred = m.predict(sc.transform(Xte))
    return float((pred == yte).mean()), pred


@pytest.mark.slow
def test_pooled_batched_matches_sklearn_per_probe_and_control():
    rng = np.random.default_rng(0)
    n, d, k = 700, 48, 12
    z = rng.standard_normal((n, 8))
    layers = [(z @ rng.standard_normal((8, d)) + rng.standard_normal((n, d)) * s).astype(np.float32) for s in (1.0, 3.0)]
    binary = (z @ rng.standard_normal((8, k)) + rng.standard_normal((n, k)) > 0).astype(int)
    four = np.digitize(z @ rng.standard_normal((8, 3)) + rng.standard_normal((n, 3)), [-1.0, 0.0, 1.0])
    targets = ([encode(f"b{j}", binary[:, j].tolist()) for j in range(k)]
               + [encode(f"m{j}", four[:, j].tolist()) for j in range(3)])
    stimuli = [f"set/s{i:05d}" for i in range(n)]
    fold = hash_fold(stimuli, seed=3, test_fraction=0.25)
    jobs = [Job(key=t.name, target=t, fold=fold, params={}, control=True) for t in targets]
    outcomes = PooledProbe.evaluate([x[:, None, :] for x in layers], jobs)   # both layers in one solve (G = 2)
    diffs = []
    for g, X in enumerate(layers):
        for j, t in enumerate(targets):
            y = t.values
            acc, _ = _sklearn_acc(X[fold.train], y[fold.train], X[fold.test], y[fold.test])
            yc = y[control_permutation(n, fold.seed)]
            cacc, _ = _sklearn_acc(X[fold.train], yc[fold.train], X[fold.test], yc[fold.test])
            out = outcomes[g][j]
            diffs += [abs(out.score - acc), abs(out.control_score - cacc)]
            assert abs(out.score - acc) <= 0.01 + 1e-9, (g, t.name, out.score, acc)
            assert abs(out.control_score - cacc) <= 0.02 + 1e-9, (g, t.name, out.control_score, cacc)
    assert np.mean(diffs) <= 0.005


@pytest.mark.slow
def test_per_token_linear_matches_sklearn_on_flattened_tokens():
    rng = np.random.default_rng(1)
    n, T, d = 120, 25, 24
    y = rng.integers(0, 3, (n, T))
    y[rng.random((n, T)) < 0.05] = -1                                         # unlabelled tokens are ignored
    X = (rng.standard_normal((3, d))[np.maximum(y, 0)] * 0.6 + rng.standard_normal((n, T, d))).astype(np.float32)
    fold = hash_fold([f"s{i}" for i in range(n)], seed=0, test_fraction=0.3)
    target = TargetValues("tok", "token", y, ("a", "b", "c"))
    out = LinearProbe.evaluate([X], [Job(key="k", target=target, fold=fold, control=False)])[0][0]
    flat = lambda m: (X[m].reshape(-1, d), y[m].reshape(-1))  # noqa: E731
    (Xtr, ytr), (Xte, yte) = flat(fold.train), flat(fold.test)
    acc, pred = _sklearn_acc(Xtr[ytr >= 0], ytr[ytr >= 0], Xte[yte >= 0], yte[yte >= 0])
    assert abs(out.score - acc) <= 0.01, (out.score, acc)
    mine = out.probe.predict(X[fold.test]).reshape(-1)[yte >= 0]
    assert (mine == pred).mean() >= 0.98


@pytest.mark.parametrize("precondition", [True, False])
def test_solver_reaches_sklearns_optimum(precondition):
    rng = np.random.default_rng(2)
    X = rng.standard_normal((400, 10)).astype(np.float32)
    y = (X @ rng.standard_normal(10) + rng.standard_normal(400) > 0).astype(int)
    fit = fit_logistic(torch.from_numpy(X)[None], y[:, None], [2], C=0.7, max_iter=500, tol=1e-6, precondition=precondition)
    ref = LogisticRegression(C=0.7, tol=1e-8, max_iter=1000).fit(X, y)
    coef, intercept = fit.weights(0, 0)
    np.testing.assert_allclose(coef, ref.coef_, atol=2e-3)
    np.testing.assert_allclose(intercept, ref.intercept_, atol=2e-3)
