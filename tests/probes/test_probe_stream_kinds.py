"""Statistics kinds beyond ridge: the N_H probe (``hidden_number_ridge``) trained from streamed
statistics equals its in-memory fit on the same plan."""

from __future__ import annotations

import json

import numpy as np
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
    from probes.farm import _Preparer, plan_tasks
    from probes.plan import group_tasks

    return _Preparer(ws, plan).job(group_tasks(plan_tasks(plan, ws))[0])


def test_centroid_plan_needs_no_gram_matrix(tmp_path):
    from probes.farm_stream import build_specs, plan_stream
    from probes.stream import accumulate

    ws = build_workspace(tmp_path / "ws", n=96, families=("spatial",))
    plans = {}
    for seeds in ([0], [0, 1, 2, 3]):
        plan = parse_plan({"name": "c", "probes": [{"runs": ["spatial"], "targets": ["truth:relation"], "seeds": seeds,
                                                     "kinds": {"ridge": {}, "nearest_centroid": {}}}]})
        job = _job(ws, plan)
        specs = {g.kind.name: g for g in build_specs(job, 7)}
        plans[len(seeds)] = {k: plan_stream([g], job) for k, g in specs.items()}
        d = job.arrays[0].item_shape[-1]
        centroid = specs["nearest_centroid"].spec
        assert not centroid.shared                       # several seeds: nothing to share without XᵀX
        rows = sum(int(s.train.sum()) for s in centroid.solves)
        cols = centroid.solves[0].Y.shape[-1]
        assert accumulate(centroid, job.arrays[0], 0, len(job.rows)).flops == 2.0 * rows * d * cols   # no XᵀX
    one = plans[1]
    # one design, float64: the map holds its XᵀX and the merge partner's; a centroid plan holds neither
    assert one["ridge"].peak_bytes - one["nearest_centroid"].peak_bytes == 2 * d * d * 8
    assert plans[4]["nearest_centroid"].peak_bytes < plans[4]["ridge"].peak_bytes - 2 * d * d * 8
