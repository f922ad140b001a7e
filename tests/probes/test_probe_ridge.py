"""The streamed ``ridge`` kind: scikit-learn's answers, the same from chunks as from memory, and
bounded worker memory (planned, enforced, measured)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from probetest_lib import build_workspace, python
from sklearn.linear_model import Ridge, RidgeClassifier

from probes import ProbeError, parse_plan, run_plan
from probes.farm import plan_tasks
from probes.kinds import Probe
from probes.kinds.ridge import RidgeProbe
from probes.plan import group_tasks
from probes.prepare import JobBuilder
from probes.splits import hash_fold
from probes.stream import accumulate
from probes.trainers.base import Settings
from probes.trainers.in_memory import TRAINER as IN_MEMORY
from probes.trainers.stream_specs import build_specs
from probes.trainers.streamed import run_local
from store import ArraySpec, RunInfo, TokenSpans, Workspace

QUIET = {"progress": False, "log": lambda s: None}


def test_ridge_matches_sklearn_ridge_and_ridge_classifier():
    rng = np.random.default_rng(0)
    n, d = 300, 20
    X = rng.standard_normal((n, d)) * rng.uniform(0.1, 3.0, d) + rng.standard_normal(d)
    w = rng.standard_normal(d)
    for alpha in (0.01, 1.0, 50.0):
        y_num = X @ w + rng.standard_normal(n) * 0.5 + 0.37
        mine = RidgeProbe(alphas=[alpha], task="regress").fit(X[:, None, :], y_num)
        ref = Ridge(alpha=alpha).fit(X, y_num)
        assert np.abs(mine.state_["coef"][0] - ref.coef_).max() < 1e-6
        assert abs(mine.state_["intercept"][0] - ref.intercept_) < 1e-6
        for k in (2, 4):
            y = np.digitize(X @ w + rng.standard_normal(n), np.quantile(X @ w, np.linspace(0, 1, k + 1)[1:-1]))
            mine = RidgeProbe(alphas=[alpha]).fit(X[:, None, :], y)
            ref = RidgeClassifier(alpha=alpha).fit(X, y)
            coef = mine.state_["coef"][1:] if k == 2 else mine.state_["coef"]     # binary: sklearn keeps the +1 column
            icpt = mine.state_["intercept"][1:] if k == 2 else mine.state_["intercept"]
            assert np.abs(coef - ref.coef_).max() < 1e-6 and np.abs(icpt - ref.intercept_).max() < 1e-6
            assert (mine.predict(X[:, None, :]) == ref.predict(X)).all()



def test_ridge_evaluates_in_memory_with_the_labels_the_farm_reads():
    """Probe.evaluate (the in-memory trainer's call) regresses a numeric sample target's numbers
    and classifies codes, as the streamed trainer decides, through the same solver."""
    from probes.kinds import Job
    from probes.targets import encode

    rng = np.random.default_rng(4)
    n, d = 400, 16
    X = rng.standard_normal((n, d))
    w = rng.standard_normal(d)
    quantity = (X @ w * 3 + rng.standard_normal(n)).round(1).tolist()     # many values: a regression
    classes = (X @ w > 0).astype(int).tolist()
    fold = hash_fold([f"s/{i}" for i in range(n)], seed=1, test_fraction=0.25)
    for raw, ref, metric in ((quantity, Ridge(alpha=1.0), "r2"), (classes, RidgeClassifier(alpha=1.0), "accuracy")):
        (out,), = RidgeProbe.evaluate([X[:, None, :]], [Job("k", encode("t", raw), fold, {"alphas": [1.0]})])
        y = np.asarray(raw)
        expected = ref.fit(X[fold.train], y[fold.train]).score(X[fold.test], y[fold.test])
        assert out.metric == metric and abs(out.score - expected) < 1e-9, (metric, out.score, expected)
        assert out.control_score is not None and len(out.predictions.positions) == fold.test.sum()


def _ridge_plan(**extra):
    return parse_plan({"name": "ridge", **extra, "probes": [
        {"runs": ["go"], "targets": ["go.intersection"], "kinds": {"ridge": {"alphas": [0.5, 5.0, 50.0]}}},
        {"runs": ["spatial"], "targets": ["truth:relation", "truth:flag_0"], "kinds": {"ridge": {"pool": "mean"}}},
    ]})


@pytest.mark.slow
def test_streamed_ridge_equals_in_memory_and_sklearn_on_the_same_split(tmp_path):
    ws = build_workspace(tmp_path / "ws", n=96, families=("go", "spatial"))
    rep = run_plan(_ridge_plan(), ws.path, in_process=True, block_rows=5, **QUIET)   # 5-sample blocks over 32-sample chunks
    assert rep.trained == 6 and rep.failed == 0
    rows = ws.rows("SELECT run, layer, target, score, control_score, artifact, params FROM probes ORDER BY 1, 2, 3")
    for run, layer, target, score, control, artifact, params in rows:
        p = json.loads(params)
        sel = ws.select(run)
        fold = hash_fold(sel.stimuli, 0, 0.2)
        X = ws.read(run, "vision", layer, tokens="image").astype(np.float64)
        got = Probe.load(ws.path / artifact)
        if target == "go.intersection":
            y = np.array([json.loads(t[0])["labels"] for t in ws.rows(
                "SELECT truth FROM v_samples WHERE run = 'go' ORDER BY array_row")])
            y = np.where(y == 2, 2, y)
            ref = RidgeProbe(alphas=[0.5, 5.0, 50.0]).fit(X[fold.train], y[fold.train])
            assert ref.meta_["alpha"] == p["metrics"]["alpha"]                      # GCV picked the same alpha
            skl = RidgeClassifier(alpha=ref.meta_["alpha"]).fit(X[fold.train].reshape(-1, X.shape[-1]), y[fold.train].reshape(-1))
            skl_acc = float((skl.predict(X[fold.test].reshape(-1, X.shape[-1])) == y[fold.test].reshape(-1)).mean())
        else:
            key = target.split(":")[1]
            vals = [json.loads(t[0])[key] for t in ws.rows(f"SELECT truth FROM v_samples WHERE run = '{run}' ORDER BY array_row")]
            classes = sorted(set(vals))
            y = np.array([classes.index(v) for v in vals])
            ref = RidgeProbe(alphas=[1.0]).fit(X[fold.train], y[fold.train])
            Xm = X.mean(1)
            skl = RidgeClassifier(alpha=1.0).fit(Xm[fold.train], y[fold.train])
            skl_acc = float((skl.predict(Xm[fold.test]) == y[fold.test]).mean())
        assert np.abs(got.state_["coef"] - ref.state_["coef"]).max() < 1e-6, (run, layer, target)
        assert np.abs(got.state_["intercept"] - ref.state_["intercept"]).max() < 1e-6
        assert abs(score - ref.score(X[fold.test], y[fold.test])) < 1e-9
        assert abs(score - skl_acc) < 1e-9
        assert control is not None and p["metrics"]["streamed"]


def _tensors(blob: bytes) -> dict[str, np.ndarray]:
    from safetensors.numpy import load

    return load(blob)


def test_seeds_share_one_pass_and_give_each_split_its_own_probe(tmp_path):
    ws = build_workspace(tmp_path / "ws", n=96, families=("spatial",))
    plan = parse_plan({"name": "seeds", "probes": [{
        "runs": ["spatial"], "targets": ["truth:relation", "truth:flag_0"], "seeds": [0, 1, 2, 3],
        "kinds": {"ridge": {"alphas": [0.5, 5.0]}, "lda": {"shrinkage": 0.1}}}]})
    job = JobBuilder(ws, plan).job(group_tasks(plan_tasks(plan, ws))[0])
    shared = build_specs(job, 7)
    assert [g.spec.shared for g in shared] == [True, True] and [len(g.spec.solves) for g in shared] == [4, 4]
    own = [replace(g, spec=replace(g.spec, shared=False)) for g in shared]
    got, ref = run_local(job, shared), run_local(job, own)
    assert len(got.records) == len(ref.records) == 16 and not got.failures
    info = job.arrays[0]
    maps = [accumulate(g.spec, info, 0, len(job.rows)).flops for g in (shared[0], own[0])]
    trains = [s.train for s in shared[0].spec.solves]
    union = np.logical_or.reduce(trains)
    rows_own, rows_shared = sum(t.sum() for t in trains), union.sum() + sum((union & ~t).sum() for t in trains)
    assert rows_shared <= 0.65 * rows_own                # XᵀX over the union + 4 test-sized sets, not 4 training sets
    d = info.item_shape[-1]
    assert maps[1] - maps[0] == (rows_own - rows_shared) * d * (d + 1)   # and the map did only those (XᵀY alike)
    assert [r.params["key"] for r in got.records] == [r.params["key"] for r in ref.records]
    assert np.allclose([(r.score, r.control_score) for r in got.records], [(r.score, r.control_score) for r in ref.records],
                       rtol=0, atol=1e-9)
    for key, blob in got.weights.items():
        mine, theirs = _tensors(blob), _tensors(ref.weights[key])
        assert all(np.abs(mine[k] - theirs[k]).max() < 1e-6 for k in ("coef", "intercept")), key
    X = ws.read("spatial", "vision", 0, tokens="image").astype(np.float64)
    y = np.array([json.loads(t[0])["flag_0"] for t in ws.rows(
        "SELECT truth FROM v_samples WHERE run = 'spatial' ORDER BY array_row")])
    for r in got.records:                                # and each seed's probe is its own split's fit
        if r.layer == 0 and r.target == "truth:flag_0" and r.kind == "ridge":
            fold = hash_fold(ws.select("spatial").stimuli, r.seed, 0.2)
            fit = RidgeProbe(alphas=[0.5, 5.0]).fit(X[fold.train], y[fold.train])
            assert np.abs(_tensors(got.weights[r.params["key"]])["coef"] - fit.state_["coef"]).max() < 1e-6


def _big_run(path: Path, n: int, t: int, d: int) -> Workspace:
    """Features whose float32 copy is larger than the worker limit of the memory test."""
    ws = Workspace.open(path)
    rng = np.random.default_rng(0)
    lab = rng.integers(0, 2, n)
    rows = [{"id": f"b_{i:05d}", "family": "spatial", "split": "test", "seed": i, "truth": {"flag_0": int(lab[i])}}
            for i in range(n)]
    with ws.writer(RunInfo(run="big", model="synthetic", dtype="float32", chunk_samples=256)) as w:
        w.set_samples(w.register_stimuli(rows, dataset="big"))
        h = w.array(ArraySpec(tap="vision", layer=0, tokens="image", shape=(t, d)))      # stored as float16
        for s in range(0, n, 256):
            x = rng.standard_normal((256, t, d), dtype=np.float32) + lab[s : s + 256, None, None] * 0.5
            w.write_batch(s, {h: x}, tokens=[TokenSpans(seq_len=t + 4, image_start=1, image_count=t, grid_h=1, grid_w=t,
                                                        last_prompt=t + 3) for _ in range(256)])
        w.finish()
    return ws


@pytest.mark.slow
def test_group_bigger_than_worker_memory_completes_under_the_limit(tmp_path):
    n, t, d = 2048, 64, 512                 # float32 features: 2048*64*512*4 = 256 MiB > the 240 MiB limit
    ws = _big_run(tmp_path / "ws", n, t, d)
    limit = 240 << 20
    plan = parse_plan({"name": "big", "derive": "never", "probes": [{"runs": ["big"], "targets": ["truth:flag_0"],
                                                   "kinds": {"ridge": {"pool": "mean"}}}]})
    job = JobBuilder(ws, plan).job(group_tasks(plan_tasks(plan, ws))[0])
    assert len(job.rows) * t * d * 4 > limit
    with pytest.raises(ProbeError, match="use kind ridge"):
        IN_MEMORY.check(IN_MEMORY.plan(job, Settings()), Settings(limit=limit), None)
    rep = run_plan(plan, ws.path, workers=2, memory_limit="240MiB", block_rows=16, **QUIET)
    assert rep.trained == 1 and rep.failed == 0, rep.failures
    assert 0 < rep.rss_peak < 0.95 * limit, rep.rss_peak          # measured in the workers (psutil)
    assert rep.read_bytes == n * t * d * 2                         # float16 store: every byte read once
    (score,) = ws.rows("SELECT score FROM probes")[0]
    assert score > 0.9
    assert build_specs(job, 16)[0].spec.block_rows == 16           # read in blocks, never the whole layer


@pytest.mark.slow
def test_impossible_plan_is_refused_before_training_naming_the_fix(tmp_path):
    ws = build_workspace(tmp_path / "ws", n=64, families=("spatial",))
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text("name: r\nmemory_limit: 100MiB\nprobes:\n  - runs: [spatial]\n    targets: ['truth:flag_0']\n"
                         "    kinds: [ridge]\n")
    got = python("-m", "probes", str(plan_file), "--data", str(ws.path), "--in-process")
    assert got.returncode == 2, got.stderr
    line = got.stderr.strip().splitlines()[-1]
    assert "Traceback" not in got.stderr and "--memory-limit" in line and "--block-rows" in line
    assert ws.rows("SELECT count(*) FROM probes")[0][0] == 0
    dry = python("-m", "probes", str(plan_file), "--data", str(ws.path), "--dry-run", "--memory-limit", "1GiB")
    assert dry.returncode == 0, dry.stderr
    assert "streamed" in dry.stdout and "peak MiB" in dry.stdout and "reads MiB" in dry.stdout


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
