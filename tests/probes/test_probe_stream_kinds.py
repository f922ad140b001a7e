"""Statistics kinds beyond ridge: the N_H probe (``hidden_number_ridge``) trained from streamed
statistics equals its in-memory fit on the same plan."""

from __future__ import annotations

import json

import numpy as np
import pytest
from probetest_lib import build_workspace

from probes import parse_plan, run_plan
from probes.kinds import Probe
from probes.kinds.hidden_number import HiddenNumberRidgeProbe
from probes.splits import control_permutation, hash_fold

QUIET = {"progress": False, "log": lambda s: None}


def _labels(ws) -> np.ndarray:
    return np.array([json.loads(t[0])["labels"] for t in ws.rows(
        "SELECT truth FROM v_samples WHERE run = 'go' ORDER BY array_row")])


def test_streamed_hidden_number_equals_in_memory_on_the_same_plan(tmp_path):
    ws = build_workspace(tmp_path / "ws", n=96, families=("go",))
    plan = parse_plan({"name": "nh", "probes": [{"runs": ["go"], "targets": ["go.intersection"], "seeds": [0, 1],
                                                  "kinds": {"hidden_number_ridge": {"alphas": [0.5, 5.0]}}}]})
    rep = run_plan(plan, ws.path, in_process=True, block_rows=5, **QUIET)   # 5-board blocks over 32-board chunks
    assert rep.trained == 4 and rep.failed == 0, rep.failures
    y = _labels(ws)
    counts = (y == 0).sum(1)
    rows = ws.rows("SELECT layer, seed, score, control_score, artifact, params, key, n_train, n_test FROM probes"
                   " ORDER BY 1, 2")
    for layer, seed, score, control, artifact, params, key, n_train, n_test in rows:
        fold = hash_fold(ws.select("go").stimuli, seed, 0.2)
        X = ws.read("go", "vision", layer, tokens="image").astype(np.float64)
        got = Probe.load(ws.path / artifact)
        ref = HiddenNumberRidgeProbe(random_state=seed, alphas=[0.5, 5.0]).fit(X[fold.train], y[fold.train])
        assert np.abs(got.state_["coef"] - ref.state_["coef"]).max() < 1e-6, (layer, seed)
        assert np.abs(got.state_["intercept"] - ref.state_["intercept"]).max() < 1e-6
        assert ref.meta_["alpha"] == json.loads(params)["metrics"]["alpha"]
        assert abs(score - ref.score(X[fold.test], y[fold.test])) < 1e-9
        assert (n_train, n_test) == (fold.train.sum(), fold.test.sum())
        m = json.loads(params)["metrics"]
        want = ref.metrics(X[fold.test], y[fold.test])
        assert m["per_regime"] == want["per_regime"] and abs(m["token_accuracy"] - want["token_accuracy"]) < 1e-9
        yc = y[control_permutation(len(y), seed)]
        ctrl = HiddenNumberRidgeProbe(random_state=seed, alphas=[0.5, 5.0]).fit(X[fold.train], yc[fold.train])
        assert abs(control - ctrl.score(X[fold.test], yc[fold.test])) < 1e-9
        stored = ws.rows("SELECT array_row, prediction, truth FROM probe_predictions WHERE key = ? ORDER BY 1", [key])
        assert [r[0] for r in stored] == list(np.flatnonzero(fold.test))
        assert [r[1] for r in stored] == list(ref.hidden_number(X[fold.test]).astype(float))
        assert [r[2] for r in stored] == list(counts[fold.test].astype(float))
    assert max(r[2] for r in rows) > 0.5 > max(r[3] for r in rows)   # the strong layer counts; controls do not


def _job(ws, plan):
    from probes.farm import plan_tasks
    from probes.plan import group_tasks
    from probes.prepare import JobBuilder

    return JobBuilder(ws, plan).job(group_tasks(plan_tasks(plan, ws))[0])


def test_centroid_plan_needs_no_gram_matrix(tmp_path):
    from probes.stream import accumulate
    from probes.trainers.stream_specs import build_specs, task_peaks

    ws = build_workspace(tmp_path / "ws", n=96, families=("spatial",))
    maps = {}
    for seeds in ([0], [0, 1, 2, 3]):
        plan = parse_plan({"name": "c", "probes": [{"runs": ["spatial"], "targets": ["truth:relation"], "seeds": seeds,
                                                     "kinds": {"ridge": {}, "nearest_centroid": {}}}]})
        job = _job(ws, plan)
        specs = {g.kind.name: g for g in build_specs(job, 7)}
        # The map's planned peak (the first task of a spec's plan); the score pass's per-sample
        # sums are the same for both kinds.
        maps[len(seeds)] = {k: task_peaks(g.spec, job.arrays[0])[0][0] for k, g in specs.items()}
        d = job.arrays[0].item_shape[-1]
        centroid = specs["nearest_centroid"].spec
        assert not centroid.shared                       # several seeds: nothing to share without XᵀX
        rows = sum(int(s.train.sum()) for s in centroid.solves)
        cols = centroid.solves[0].Y.shape[-1]
        assert accumulate(centroid, job.arrays[0], 0, len(job.rows)).flops == 2.0 * rows * d * cols   # no XᵀX
    one = maps[1]
    # one design, float64: the map holds its XᵀX and the merge partner's; a centroid plan holds neither
    assert one["ridge"] - one["nearest_centroid"] == 2 * d * d * 8
    assert maps[4]["nearest_centroid"] < maps[4]["ridge"] - 2 * d * d * 8


def test_the_memory_plan_counts_the_stored_chunk_the_reader_decodes(tmp_path):
    """The reader decodes a whole stored chunk beside each block it reads: a plan over bigger
    chunks must plan that much more (it did not, and a 384 MiB real-shape run passed its plan)."""
    from dataclasses import replace

    from probes.trainers.stream_specs import build_specs, plan_stream

    ws = build_workspace(tmp_path / "ws", n=96, families=("spatial",))
    plan = parse_plan({"name": "c", "probes": [{"runs": ["spatial"], "targets": ["truth:relation"],
                                                 "kinds": {"nearest_centroid": {}}}]})
    job = _job(ws, plan)
    info = job.arrays[0]
    (group,) = build_specs(job, 1)
    peaks = {}
    for chunk in (8, 32):
        sized = replace(job, arrays=[replace(a, chunk_samples=chunk) for a in job.arrays])
        peaks[chunk] = plan_stream([group], sized)
    per_row = info.values_per_row * np.dtype(info.stored_dtype).itemsize
    assert peaks[32].peak_bytes - peaks[8].peak_bytes == 24 * per_row
    assert "map" in peaks[32].what or "score" in peaks[32].what

def _sklearn_lda(F: np.ndarray, y: np.ndarray):
    from sklearn.discriminant_analysis import LinearDiscriminantAnalysis

    return LinearDiscriminantAnalysis(solver="lsqr", shrinkage="auto").fit(F, y)


def _same_as_sklearn(probe, ref) -> None:
    coef, icpt = probe.state_["coef"], probe.state_["intercept"]
    if len(probe.state_["classes"]) == 2:   # sklearn keeps the difference of the two class columns
        coef, icpt = coef[1:] - coef[:1], icpt[1:] - icpt[:1]
    assert np.abs(coef - ref.coef_).max() < 1e-6 and np.abs(icpt - ref.intercept_).max() < 1e-6


def test_lda_ledoit_wolf_matches_sklearn_in_memory():
    from probes.kinds.lda import LDAProbe

    rng = np.random.default_rng(3)
    for k, n, d in ((2, 60, 40), (4, 300, 12)):                     # d near n: where shrinkage matters
        y = rng.integers(0, k, n)
        X = rng.standard_normal((k, d))[y] + rng.standard_normal((n, d)) * rng.uniform(0.2, 3.0, d) + 20.0
        X[:, 1] += 2 * X[:, 0]
        X = X.astype(np.float32).astype(np.float64)                 # the kind pools features as float32
        mine = LDAProbe(shrinkage="auto").fit(X[:, None, :], y)
        ref = _sklearn_lda(X, y)
        _same_as_sklearn(mine, ref)
        assert (mine.predict(X[:, None, :]) == ref.predict(X)).all()


@pytest.mark.slow
def test_streamed_lda_ledoit_wolf_equals_sklearn_on_the_same_plan(tmp_path):
    from probes.trainers.stream_specs import build_specs, plan_stream

    ws = build_workspace(tmp_path / "ws", n=96, families=("go", "spatial"))
    plan = parse_plan({"name": "lw", "probes": [
        {"runs": ["go"], "targets": ["go.intersection"], "kinds": {"lda": {"shrinkage": "auto"}}},
        {"runs": ["spatial"], "targets": ["truth:relation", "truth:flag_0"], "seeds": [0, 1],
         "kinds": {"lda": {"shrinkage": "auto"}}}]})
    rep = run_plan(plan, ws.path, in_process=True, block_rows=5, **QUIET)   # 5-sample blocks over 32-sample chunks
    assert rep.trained == 10 and rep.failed == 0, rep.failures
    for run, layer, target, seed, score, artifact in ws.rows(
            "SELECT run, layer, target, seed, score, artifact FROM probes ORDER BY 1, 2, 3, 4"):
        fold = hash_fold(ws.select(run).stimuli, seed, 0.2)
        X = ws.read(run, "vision", layer, tokens="image").astype(np.float64)
        key = "labels" if target == "go.intersection" else target.split(":")[1]
        vals = [json.loads(t[0])[key] for t in ws.rows(
            f"SELECT truth FROM v_samples WHERE run = '{run}' ORDER BY array_row")]
        y = np.array(vals) if key == "labels" else np.array([sorted(set(vals)).index(v) for v in vals])
        F = X.reshape(-1, X.shape[-1]) if y.ndim == 2 else X.mean(1)
        tr = np.repeat(fold.train, y.shape[1]) if y.ndim == 2 else fold.train
        te = np.repeat(fold.test, y.shape[1]) if y.ndim == 2 else fold.test
        ref = _sklearn_lda(F[tr], y.reshape(-1)[tr])
        _same_as_sklearn(Probe.load(ws.path / artifact), ref)
        assert abs(score - float((ref.predict(F[te]) == y.reshape(-1)[te]).mean())) < 1e-9, (run, layer, target)
    job = _job(ws, parse_plan({"name": "p", "probes": [{"runs": ["spatial"], "targets": ["truth:relation"],
                                                        "kinds": {"lda": {"shrinkage": "auto"}, "ridge": {}}}]}))
    specs = {g.kind.name: g for g in build_specs(job, 7)}
    d, k = job.arrays[0].item_shape[-1], 4 * 2                      # 4 relations, the target and its control
    planned = {name: plan_stream([g], job).peak_bytes for name, g in specs.items()}
    assert planned["lda"] - planned["ridge"] >= 2 * k * 3 * d * d * 8 - 2 * d * d * 8   # the moments, not one XᵀX


def test_lda_auto_plan_over_the_limit_names_the_fixed_shrinkage(tmp_path):
    import pytest

    from probes import ProbeError

    ws = build_workspace(tmp_path / "ws", n=64, families=("spatial",))
    plan = {"name": "m", "probes": [{"runs": ["spatial"], "targets": ["truth:relation"],
                                     "kinds": {"lda": {"shrinkage": "auto"}}}]}
    with pytest.raises(ProbeError, match=r"lda shrinkage auto's per-class moments.*a fixed shrinkage needs one XᵀX"):
        run_plan(parse_plan({**plan, "memory_limit": "200MiB"}), ws.path, in_process=True, **QUIET)
    assert ws.rows("SELECT count(*) FROM probes")[0][0] == 0
