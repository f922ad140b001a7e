"""Each kind learns the synthetic target planted for it, its control stays near chance, and a
saved probe re-scores to the recorded value from the artifact and the recorded split alone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from probetest_lib import build_workspace

from probes import Probe, parse_plan, run_plan
from probes.splits import hash_fold
from store import Workspace

PLAN = {
    "name": "kinds",
    "probes": [
        {"runs": ["go"], "targets": ["go.intersection"], "kinds": ["linear", "hidden_number"]},
        {"runs": ["g2m"], "targets": ["g2m.cell_color"], "kinds": ["linear"]},
        {"runs": ["g2m"], "targets": ["g2m.matrix"], "kinds": {"conv_spatial": {"iters": 150}}},
        {"runs": ["count"], "targets": ["counting.boxes"], "kinds": {"detect": {"iters": 150, "hidden": 32}}},
        {"runs": ["count"], "targets": ["counting.count"], "kinds": ["pooled"]},
        {"runs": ["count"], "targets": ["counting.count"], "kinds": {"pooled": {"task": "regress"}}, "tag": "regress"},
        {"runs": ["spatial"], "targets": ["spatial.relation", "truth:flag_0"], "kinds": {"pooled": {"pool": "max"}}},
    ],
}


# make test-fast trains the Go and spatial probes only; the G2M and counting ones (conv_spatial and detect
# iterate on a GPU-less machine for seconds) are trained on a copy of that workspace for the slow tests.
QUICK_RUNS = ("go", "spatial")
QUICK = [p for p in PLAN["probes"] if p["runs"][0] in QUICK_RUNS]
REST = [p for p in PLAN["probes"] if p not in QUICK]


def _train(path, probes):
    report = run_plan(parse_plan({"name": PLAN["name"], "probes": probes}), path, in_process=True, progress=False,
                      log=lambda s: None)
    ws = Workspace.open(path)
    rows = ws.query("SELECT * FROM probes ORDER BY run, target, kind, layer").to_pylist()
    for r in rows:
        r["params"] = json.loads(r["params"])
    return ws, report, rows


@pytest.fixture(scope="module")
def quick_farm(tmp_path_factory):
    """A workspace of the Go and spatial runs with their probes of PLAN trained."""
    path = tmp_path_factory.mktemp("kinds") / "ws"
    build_workspace(path, families=QUICK_RUNS)
    return _train(path, QUICK)


@pytest.fixture(scope="module")
def farm(quick_farm, tmp_path_factory):
    """Every probe of PLAN: the rest trained on a copy of quick_farm's workspace (which stays as it was)."""
    assert quick_farm[1].failed == 0, quick_farm[1].failures
    path = Path(shutil.copytree(quick_farm[0].path, tmp_path_factory.mktemp("kinds-all") / "ws"))
    build_workspace(path, families=("g2m", "count"))
    return _train(path, REST)


def _get(rows, run, target, kind, layer):
    (hit,) = [r for r in rows if (r["run"], r["target"], r["kind"], r["layer"]) == (run, target, kind, layer)]
    return hit


# (run, target, kind, metric, min score at the strong layer, max control score)
EXPECT = [
    ("go", "go.intersection", "linear", "accuracy", 0.95, None),
    ("go", "go.intersection", "hidden_number", "exact_match", 0.8, 0.2),
    ("g2m", "g2m.cell_color", "linear", "accuracy", 0.95, 0.5),
    ("g2m", "g2m.matrix", "conv_spatial", "cell_accuracy", 0.9, 0.5),
    ("count", "counting.boxes", "detect", "ap50", 0.4, 0.1),
    ("count", "counting.count", "pooled", "accuracy", 0.6, 0.5),
    ("spatial", "spatial.relation", "pooled", "accuracy", 0.9, 0.5),
    ("spatial", "truth:flag_0", "pooled", "accuracy", 0.85, 0.7),
]


@pytest.mark.parametrize("run,target,kind,metric,min_score,max_control", EXPECT, ids=[f"{e[2]}-{e[1]}" for e in EXPECT])
@pytest.mark.slow
def test_kind_learns_its_target_and_control_stays_near_chance(farm, run, target, kind, metric, min_score, max_control):
    _, report, rows = farm
    assert report.failed == 0, report.failures
    strong, weak = _get(rows, run, target, kind, 1), _get(rows, run, target, kind, 0)
    assert strong["metric"] == metric
    assert strong["score"] >= min_score, strong
    assert strong["score"] > weak["score"], "the planted signal is stronger in layer 1"
    if max_control is None:  # chance is the majority class here
        max_control = strong["params"]["metrics"]["majority"] + 0.05
    assert strong["control_score"] <= max_control, strong
    p = strong["params"]
    assert p["selectivity"] == pytest.approx(strong["score"] - strong["control_score"])
    assert p["split"]["by"] == "hash" and p["split"]["seed"] == 0 and p["split"]["test_fraction"] == 0.2
    assert strong["n_train"] > 3 * strong["n_test"] > 0


def test_hidden_number_reports_regimes(quick_farm):
    _, _, rows = quick_farm
    m = _get(rows, "go", "go.intersection", "hidden_number", 1)["params"]["metrics"]
    assert {"ID", "VE"} <= set(m["per_regime"]) and m["mean_abs_error"] < 1.0
    assert all(v["n"] > 0 for v in m["per_regime"].values())


def _predictions(ws, key):
    got = ws.query("SELECT array_row, prediction, truth, score FROM probe_predictions WHERE key = ? ORDER BY array_row",
                   [key]).to_pydict()
    return {"array_row": got["array_row"], "value": got["prediction"], "truth": got["truth"], "score": got["score"]}


@pytest.mark.slow
def test_every_kind_stores_per_sample_test_predictions(farm):
    ws, _, rows = farm
    kinds = set()
    for row in rows:
        pred = _predictions(ws, row["key"])
        assert len(pred["array_row"]) == row["n_test"] > 0, (row["kind"], row["target"])
        assert "predictions" not in row["params"]  # in their table, not in JSON
        kinds.add(row["kind"])
        if row["metric"] == "r2":  # a regression: value and truth per sample, R^2 from them matches
            y, p = np.array(pred["truth"]), np.array(pred["value"])
            assert 1 - ((y - p) ** 2).sum() / ((y - y.mean()) ** 2).sum() == pytest.approx(row["score"], abs=1e-5)
        elif row["kind"] != "detect":  # per-sample scores average to the score (AP is not a mean)
            assert np.nanmean(pred["score"]) == pytest.approx(row["score"], abs=0.05 if row["kind"] == "linear" else 1e-6)
    assert kinds == {"linear", "hidden_number", "conv_spatial", "detect", "pooled"}
    pooled = _get(rows, "count", "counting.count", "pooled", 1)
    pred = _predictions(ws, pooled["key"])
    counts = dict(ws.rows("SELECT array_row, (truth->>'count')::INT FROM v_samples WHERE run = 'count'"))
    assert pred["truth"] == [counts[r] for r in pred["array_row"]]  # class codes become the counts they name
    detect = _predictions(ws, _get(rows, "count", "counting.boxes", "detect", 1)["key"])
    assert detect["truth"] == [counts[r] for r in detect["array_row"]]  # boxes per image: the count


def test_hidden_number_stores_n_h_per_test_board_and_the_gap_query_reads_it(quick_farm):
    ws, _, rows = quick_farm
    row = _get(rows, "go", "go.intersection", "hidden_number", 1)
    pred = _predictions(ws, row["key"])
    assert len(pred["array_row"]) == len(pred["value"]) == row["n_test"]
    # N_H re-derived from the recorded per-board values agrees with the recorded exact match
    counts = dict(ws.rows("SELECT array_row, (truth->>'count')::INT FROM v_samples WHERE run = 'go'"))
    exact = np.mean([v == counts[r] for r, v in zip(pred["array_row"], pred["value"], strict=False)])
    assert exact == pytest.approx(row["score"])
    assert pred["truth"] == [counts[r] for r in pred["array_row"]]
    from queries.named import run as run_query

    gaps = [g for g in run_query(ws, "counting_gaps", {"run": "go"}).to_pylist() if g["layer"] == 1]
    assert sum(g["boards"] for g in gaps) == row["n_test"]  # distinct test boards, whatever the number of seeds
    assert all(g["vision_gap"] is not None and g["vision_gap"] < 1.0 for g in gaps)


@pytest.mark.slow
def test_spatial_probe_stores_cell_accuracy_per_grid_for_the_gap_curve(farm):
    ws, _, rows = farm
    row = _get(rows, "g2m", "g2m.matrix", "conv_spatial", 1)
    pred = _predictions(ws, row["key"])
    assert len(pred["array_row"]) == row["n_test"]
    # every grid is 4x4 and fully labelled: the mean per-grid accuracy is the recorded score
    assert np.mean(pred["score"]) == pytest.approx(row["score"])
    from queries.named import run as run_query

    curve = [r for r in run_query(ws, "g2m_gap", {"run": "g2m"}).to_pylist() if r["layer"] == 1]
    assert [r["grid_size"] for r in curve] == [4]
    assert curve[0]["probe_cell_accuracy"] == pytest.approx(row["score"], abs=1e-4)
    assert curve[0]["model_cell_accuracy"] is None  # this synthetic run generated nothing


@pytest.mark.parametrize("run,target,kind", [
    ("go", "go.intersection", "linear"), ("spatial", "spatial.relation", "pooled"),
    pytest.param("g2m", "g2m.matrix", "conv_spatial", marks=pytest.mark.slow),
])
def test_saved_probe_rescores_from_artifact_and_recorded_split(request, run, target, kind):
    ws, _, rows = request.getfixturevalue("quick_farm" if run in QUICK_RUNS else "farm")
    row = _get(rows, run, target, kind, 1)
    probe = Probe.load(ws.path / row["artifact"])
    assert probe.name == kind and row["artifact"].endswith(".safetensors")
    assert not list((ws.path / "probes").glob("*.pkl"))
    # Everything needed is recorded: the rows (where), the split rule and seed, the target.
    sel = ws.select(run, row["params"]["where"])
    split = row["params"]["split"]
    fold = hash_fold(sel.stimuli, split["seed"], split["test_fraction"])
    X = ws.read(run, "vision", 1, rows=sel.rows[fold.test])
    from probes.prepare import JobBuilder

    prep = JobBuilder(ws, parse_plan(PLAN))
    y = prep.target(run, row["params"]["where"], target, X.shape[1]).values[fold.test]
    assert probe.score(X, y) == pytest.approx(row["score"], abs=1e-9)


def test_sklearn_like_surface_on_plain_arrays():
    from probes.kinds import LinearProbe, PooledProbe

    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, (120, 5))
    X = np.eye(3, 8, dtype=np.float32)[y] * 3 + rng.standard_normal((120, 5, 8)).astype(np.float32) * 0.3
    p = LinearProbe(C=0.5).fit(X[:100], y[:100])
    assert p.predict(X[100:]).shape == (20, 5) and p.score(X[100:], y[100:]) > 0.95
    counts = (y == 0).sum(1).astype(float) + rng.normal(0, 0.1, 120)
    r = PooledProbe(task="regress").fit(X[:100], counts[:100])
    assert r.score(X[100:], counts[100:]) > 0.8  # R^2
    with pytest.raises(ValueError, match="unknown parameter 'c' — did you mean 'C'"):
        LinearProbe(c=1.0)


@pytest.mark.slow
def test_pooled_reads_ragged_answer_tokens_and_linear_refuses_them(tmp_path):
    from probetest_lib import RELATIONS, D, spatial_family

    from probes import PlanError
    from store import ArraySpec, RunInfo, TokenSpans, Workspace

    rows, rel, _ = spatial_family(120)
    rng = np.random.default_rng(5)
    protos = rng.standard_normal((len(RELATIONS), D)).astype(np.float32) * 2
    answers = [protos[r] + rng.standard_normal((1 + i % 3, D)).astype(np.float32) * 0.5 for i, r in enumerate(rel)]
    ws = Workspace.open(tmp_path / "ws")
    with ws.writer(RunInfo(run="rag", model="synthetic", dtype="float32", chunk_samples=32)) as w:
        w.set_samples(w.register_stimuli(rows, dataset="rag"))
        h = w.array(ArraySpec(tap="llm", layer=0, tokens="answer", shape=(D,), ragged=True))
        w.write_batch(0, {h: answers}, tokens=[TokenSpans(seq_len=10, answer_start=6, answer_count=len(a)) for a in answers])
        w.finish()
    plan = {"probes": [{"tokens": ["answer"], "targets": ["spatial.relation"], "kinds": {"pooled": {"pool": "mean"}}}]}
    report = run_plan(parse_plan(plan), ws.path, in_process=True, progress=False, log=lambda s: None)
    assert report.trained == 1 and report.failed == 0
    (score, control), = ws.rows("SELECT score, control_score FROM probes")
    assert score > 0.9 and control < 0.5
    with pytest.raises(PlanError, match="is ragged .* Use kind pooled for ragged tokens"):
        run_plan(parse_plan({"probes": [{"tokens": ["answer"], "targets": ["go.intersection"], "kinds": ["linear"]}]}),
                 ws.path, in_process=True, progress=False, log=lambda s: None)


@pytest.mark.slow
def test_spatial_probe_records_its_error_map_per_grid_size(farm):
    _, _, rows = farm
    row = _get(rows, "g2m", "g2m.matrix", "conv_spatial", 1)
    maps = row["params"]["metrics"]["error_maps"]
    assert list(maps) == ["4"] and np.asarray(maps["4"]).shape == (4, 4)
    # its mean error is the complement of the recorded cell accuracy (every 4x4 cell is labelled)
    assert 1 - np.mean(maps["4"]) == pytest.approx(row["score"], abs=1e-3)


def test_pooled_regresses_on_counts_by_default_and_classifies_few_values():
    from probes.kinds.pooled import PooledProbe

    rng = np.random.default_rng(0)
    counts = rng.integers(0, 121, 200)
    X = (counts[:, None, None] * np.ones((1, 3, 4)) + rng.standard_normal((200, 3, 4))).astype(np.float32)
    probe = PooledProbe().fit(X, counts)
    assert probe.regressor and abs(probe.predict(X[:5]) - counts[:5]).max() < 3  # a number, not one of 121 classes
    flags = counts % 2
    assert not PooledProbe().fit(X, flags).regressor


def test_kinds_registry_refuses_a_second_class_under_one_name_and_inherits_how_a_kind_trains():
    from probes import KINDS, ProbeError, get_kind, register_kind
    from probes.kinds import HiddenNumberProbe, LinearProbe, PooledProbe

    with pytest.raises(ProbeError, match="already registered"):
        register_kind("linear")(type("Other", (LinearProbe,), {}))
    assert get_kind("linear") is LinearProbe and "linear" in KINDS
    with pytest.raises(ProbeError, match="unknown probe kind 'linaer' — did you mean 'linear'"):
        get_kind("linaer")
    assert PooledProbe.trains == LinearProbe.trains == ("in_memory", "iterative")   # inherited
    assert HiddenNumberProbe.trains == ("in_memory",) and HiddenNumberProbe.memory_fix
