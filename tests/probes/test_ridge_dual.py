"""Ridge's dual (kernel) solve for n < d (probes/ridge_dual.py): chosen by cost, recorded in the
probes' metrics, planned as n×d rows, and equal to the primal XᵀX solve and to scikit-learn."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from sklearn.linear_model import Ridge, RidgeClassifier

from probes import parse_plan, run_plan
from probes.farm import plan_tasks
from probes.plan import group_tasks
from probes.prepare import JobBuilder
from probes.ridge_dual import chooses_dual, dual_flops, solve_rows
from probes.splits import hash_fold
from probes.stream import Stats, solve_stats
from probes.stream_layer import run_layer
from probes.trainers.stream_specs import build_specs, plan_stream
from probes.trainers.streamed import layers_in_flight
from store import ArraySpec, RunInfo, TokenSpans, Workspace

QUIET = {"progress": False, "log": lambda s: None}
N, T, D = 60, 4, 96                       # pooled: ~48 training rows < 96 features


def _wide_run(path: Path, n: int = N, t: int = T, d: int = D) -> Workspace:
    """Two layers of [n, t, d] float16 tokens; a binary, a 3-class and a numeric truth per sample."""
    ws = Workspace.open(path)
    rng = np.random.default_rng(0)
    flag, shape, size = rng.integers(0, 2, n), rng.integers(0, 3, n), rng.uniform(0.5, 3.0, n)
    rows = [{"id": f"w_{i:04d}", "family": "spatial", "split": "test", "seed": i,
             "truth": {"flag_0": int(flag[i]), "shape": int(shape[i]), "size": float(size[i])}} for i in range(n)]
    protos = rng.standard_normal((4, d)).astype(np.float32)
    with ws.writer(RunInfo(run="wide", model="synthetic", dtype="float32", chunk_samples=16)) as w:
        w.set_samples(w.register_stimuli(rows, dataset="wide"))
        hs = [w.array(ArraySpec(tap="vision", layer=layer, tokens="image", shape=(t, d))) for layer in (0, 1)]
        for s in range(0, n, 16):
            e = min(s + 16, n)
            signal = protos[0] * flag[s:e, None] + protos[1 + shape[s:e]] * 0.7 + protos[0] * size[s:e, None] * 0.3
            batch = {h: rng.standard_normal((e - s, t, d), dtype=np.float32) + signal[:, None, :] * (1 + layer)
                     for layer, h in enumerate(hs)}
            w.write_batch(s, batch, tokens=[TokenSpans(seq_len=t + 4, image_start=1, image_count=t, grid_h=1, grid_w=t,
                                                       last_prompt=t + 3) for _ in range(s, e)])
        w.finish()
    return ws


def _plan(seeds=(0,), **ridge):
    return parse_plan({"name": "dual", "probes": [{"runs": ["wide"], "targets": ["truth:flag_0", "truth:shape", "truth:size"],
                                                   "seeds": list(seeds), "kinds": {"ridge": {"pool": "mean", **ridge}}}]})


def _job(ws, plan):
    return JobBuilder(ws, plan).job(group_tasks(plan_tasks(plan, ws))[0])


def _stats(X: np.ndarray, Y: np.ndarray, dtype: str) -> Stats:
    mx, my = X.mean(0), Y.mean(0)
    Xc = X - mx
    return Stats(float(len(X)), mx, my, np.asfortranarray(Xc.T @ Xc, dtype=dtype), Xc.T @ (Y - my),
                 ((Y - my) ** 2).sum(0))


@pytest.mark.parametrize("standardize", [False, True])
def test_dual_solve_equals_the_primal_solve_of_the_statistics(standardize):
    rng = np.random.default_rng(1)
    n, d, c = 40, 120, 4
    X = rng.standard_normal((n, d)) * rng.uniform(0.2, 3.0, d) + rng.standard_normal(d)
    Y = np.c_[X[:, :3] @ rng.standard_normal((3, c - 1)), rng.standard_normal(n)]   # classes' ±1 and numbers alike
    alphas = (0.1, 1.0, 10.0, 100.0)
    W, b, gcv, flops = solve_rows(X, Y, alphas, standardize)
    Wp, bp, gcvp, flops_p = solve_stats(_stats(X, Y, "float64"), alphas, standardize)
    assert np.abs(W - Wp).max() < 1e-6 and np.abs(b - bp).max() < 1e-6
    assert np.isfinite(gcv).all() and np.abs(gcv - gcvp).max() < 1e-6 * np.abs(gcvp).max()
    assert flops < flops_p / 4                                # n² d + 9 n³, not d³
    one = solve_rows(X.astype(np.float32), Y, (1.0,), standardize)   # float32 rows, float64 arithmetic
    assert np.abs(one[0][..., 0] - Wp[..., 1]).max() < 1e-6 and np.isnan(one[2]).all()   # GCV: one alpha, none


def test_dual_ridge_agrees_with_sklearn_when_rows_are_fewer_than_features():
    rng = np.random.default_rng(2)
    n, d = 30, 80
    X = rng.standard_normal((n, d)) + rng.standard_normal(d)
    y = X[:, :5].sum(1) + rng.standard_normal(n) * 0.3 + 1.5
    for alpha in (0.01, 1.0, 50.0):
        W, b, _, _ = solve_rows(X, y[:, None], (alpha,), False)
        ref = Ridge(alpha=alpha).fit(X, y)
        assert np.abs(W[:, 0, 0] - ref.coef_).max() < 1e-6 and abs(b[0, 0] - ref.intercept_) < 1e-6
        k = np.digitize(y, np.quantile(y, [1 / 3, 2 / 3]))
        Y = np.where(k[:, None] == np.arange(3), 1.0, -1.0)
        W, b, _, _ = solve_rows(X, Y, (alpha,), False)
        skl = RidgeClassifier(alpha=alpha).fit(X, k)
        assert np.abs(W[:, :, 0].T - skl.coef_).max() < 1e-6 and np.abs(b[:, 0] - skl.intercept_).max() < 1e-6


def test_the_dual_is_chosen_by_cost():
    assert chooses_dual([349.0], 349, 3584, [6], 1)            # the pooled 7B bench layer
    assert not chooses_dual([5000.0], 5000, 3584, [6], 1)       # more rows than features: XᵀX
    assert not chooses_dual([3000.0], 3000, 3584, [6], 1)       # fewer, but 9n³ of eigh beats d³/3 + n d²


@pytest.mark.parametrize("precision", ["float64", "float32"])
@pytest.mark.parametrize("standardize", [False, True])
def test_streamed_dual_equals_streamed_primal_on_the_same_split(tmp_path, precision, standardize):
    ws = _wide_run(tmp_path / "ws")
    job = _job(ws, _plan(seeds=(0, 1), alphas=[0.3, 3.0, 30.0], precision=precision, standardize=standardize))
    (g,) = build_specs(job, 5)
    assert g.spec.dual and not g.spec.shared and len(g.spec.solves) == 2   # a split per seed: rows of their union
    assert [s.Y.shape[-1] for s in g.spec.solves] == [2 * (2 + 3 + 1)] * 2   # 3 targets and their controls
    info = job.arrays[0]
    dual = run_layer(g.spec, info, 2, job.rows)
    ref = run_layer(replace(g.spec, dual=False, precision="float64"), info, 2, job.rows)
    for s in range(2):
        assert dual[0].n_train[s] == ref[0].n_train[s] < D
        assert np.abs(dual[0].W[s] - ref[0].W[s]).max() < 1e-6 and np.abs(dual[0].b[s] - ref[0].b[s]).max() < 1e-6
        assert np.abs(dual[0].gcv[s] - ref[0].gcv[s]).max() < 1e-6 * np.abs(ref[0].gcv[s]).max()
        for f in ("hits", "count", "sse", "sy", "syy"):
            assert np.allclose(getattr(dual[1], f)[s], getattr(ref[1], f)[s], rtol=1e-9, atol=1e-9), f
        # Per sample (values, class codes, and the controls' on the real test units): as the weights agree.
        assert dual[1].per_sample[s].any() and np.allclose(dual[1].per_sample[s], ref[1].per_sample[s], atol=1e-5)
    assert dual[0].flops == sum(dual_flops(n, D, 12, 3) for n in dual[0].n_train) < ref[0].flops   # no XᵀX counted
    # One read of each selected byte: the dual maps keep the test rows too, and the solve scores them.
    stored = len(job.rows) * T * D * 2   # float16 tokens
    assert (dual[0].read_bytes, dual[1].read_bytes) == (stored, 0)
    # The primal's test pass reads again the rows one seed tests and the other trains on.
    assert ref[0].read_bytes + ref[1].read_bytes > stored and ref[1].read_bytes > 0


def test_dual_records_say_so_and_equal_sklearn(tmp_path):
    ws = _wide_run(tmp_path / "ws")
    rep = run_plan(_plan(alphas=[1.0]), ws.path, in_process=True, block_rows=5, **QUIET)
    assert rep.trained == 6 and rep.failed == 0
    X = ws.read("wide", "vision", 1, tokens="image").astype(np.float64).mean(1)
    fold = hash_fold(ws.select("wide").stimuli, 0, 0.2)
    truth = [json.loads(t[0]) for t in ws.rows("SELECT truth FROM v_samples WHERE run = 'wide' ORDER BY array_row")]
    for target, score, params in ws.rows("SELECT target, score, params FROM probes WHERE layer = 1"):
        metrics = json.loads(params)["metrics"]
        assert metrics["solve"] == "dual" and metrics["n_train_rows"] < D
        y = np.array([t[target.split(":")[1]] for t in truth])
        ref = (Ridge if target == "truth:size" else RidgeClassifier)(alpha=1.0).fit(X[fold.train], y[fold.train])
        assert abs(score - ref.score(X[fold.test], y[fold.test])) < 1e-6, target   # features pooled in float32


def test_dual_plan_holds_rows_not_gram_matrices(tmp_path):
    ws = _wide_run(tmp_path / "ws", d=512)
    job = _job(ws, _plan(precision="float64"))
    (g,) = build_specs(job, 5)
    primal = replace(g, spec=replace(g.spec, dual=False))
    n = int(np.logical_or.reduce([s.train | s.test for s in g.spec.solves]).sum())   # the rows held: test rows too
    got, ref = plan_stream([g], job), plan_stream([primal], job)
    assert got.peak_bytes < ref.peak_bytes and f"({n} x 512, dual ridge)" in got.what   # what the dry run prints
    # a d×d pair less; the rows held, one Solve's copy of them and its float64 copy more
    assert ref.peak_bytes - got.peak_bytes > 2 * 512 * 512 * 8 - 3 * n * (512 * 8 + 8)
    limit = 205 << 20                     # room for one layer's pair of 2 MiB XᵀX, or for 8 layers' rows
    assert (layers_in_flight([g], job, limit), layers_in_flight([primal], job, limit)) == (8, 1)


@pytest.mark.slow
def test_dual_on_the_dask_graph_equals_the_in_process_run(tmp_path, monkeypatch):
    from probetest_lib import probe_rows

    from probes.trainers import streamed

    ws = _wide_run(tmp_path / "ws")
    shutil.copytree(tmp_path / "ws", tmp_path / "graph")
    plan = _plan(seeds=(0, 1), alphas=[0.5, 5.0])
    here = run_plan(plan, ws.path, in_process=True, block_rows=5, **QUIET)
    monkeypatch.setattr(streamed, "FUSE_BYTES", 0)   # maps on both workers, a merge of their rows, a solve
    graph = run_plan(plan, tmp_path / "graph", workers=2, memory_limit="400MiB", block_rows=5, **QUIET)
    assert here.trained == graph.trained == 12 and graph.failed == 0
    assert probe_rows(Workspace.open(tmp_path / "graph", readonly=True)) == probe_rows(ws)
    assert graph.flops == pytest.approx(here.flops)     # the dual's flops, wherever it ran
    got = Workspace.open(tmp_path / "graph", readonly=True).rows("SELECT DISTINCT params->'metrics'->>'solve' FROM probes")
    assert got == [("dual",)]


def test_dual_of_token_units_equals_the_primal(tmp_path):
    """Token targets: every token a unit (ids position x R + token); forced dual, as n > d here."""
    from probetest_lib import build_workspace

    ws = build_workspace(tmp_path / "ws", n=12, families=("g2m",))
    plan = parse_plan({"name": "tok", "probes": [{"runs": ["g2m"], "targets": ["g2m.cell_color"],
                                                  "kinds": {"ridge": {"alphas": [0.5, 5.0], "standardize": True}}}]})
    job = _job(ws, plan)
    (g,) = build_specs(job, 3)
    assert g.spec.level == "token" and not g.spec.dual             # 64 tokens a sample: more units than d = 16
    dual, ref = (run_layer(replace(g.spec, dual=flag), job.arrays[0], 2, job.rows) for flag in (True, False))
    assert dual[0].n_train == ref[0].n_train and dual[0].n_train[0] > 16
    assert np.abs(dual[0].W[0] - ref[0].W[0]).max() < 1e-6 and np.abs(dual[0].b[0] - ref[0].b[0]).max() < 1e-6
    assert np.abs(dual[0].gcv[0] - ref[0].gcv[0]).max() < 1e-6 * np.abs(ref[0].gcv[0]).max()
    assert np.array_equal(dual[1].hits[0], ref[1].hits[0])
