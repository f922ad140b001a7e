"""Iterative kinds out of core (probes/trainers/iterative.py, probes/subsample.py): the same probes as
in memory when the subsample holds every row, a recorded and deterministic subsample under a cap,
the split by stimulus, a planned and enforced worker memory (measured RSS)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from probetest_lib import build_workspace

from probes import ProbeError, parse_plan, run_plan
from probes.cli import main
from probes.farm import parse_bytes, plan_tasks, plan_work
from probes.kinds import Probe
from probes.plan import group_tasks
from probes.prepare import JobBuilder
from probes.subsample import IterSpec
from probes.trainers.in_memory import plan_in_memory
from store import ArraySpec, RunInfo, TokenSpans, Workspace

QUIET = {"progress": False, "log": lambda s: None}
ENTRIES = [
    {"runs": ["go"], "targets": ["go.intersection"], "kinds": ["linear"], "seeds": [0, 1]},
    {"runs": ["spatial"], "targets": ["truth:relation", "truth:flag_0"], "kinds": {"pooled": {"pool": "mean"}}},
]


def _plan(mode: str, **extra):
    return parse_plan({"name": "ooc", "out_of_core": mode, **extra, "probes": ENTRIES})


def _results(ws: Workspace) -> dict[str, tuple]:
    rows = ws.rows("SELECT params->>'key', score, control_score, n_train, n_test, artifact, params FROM probes")
    return {r[0]: (r[1], r[2], r[3], r[4], r[5], json.loads(r[6])["metrics"]) for r in rows}


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Workspace:
    return build_workspace(tmp_path_factory.mktemp("ooc") / "ws", n=96, families=("go", "spatial"))


def _controls(ws: Workspace, key: str) -> np.ndarray:
    """[m, 2]: the control's per-sample prediction and score (NaN: none) of a probe's test samples."""
    rows = ws.rows("SELECT control_prediction, control_score FROM probe_predictions WHERE key = ? ORDER BY array_row",
                   [key])
    return np.array([[np.nan if v is None else v for v in r] for r in rows], dtype=np.float64).reshape(-1, 2)


def test_out_of_core_equals_in_memory_when_the_subsample_holds_every_row(ws):
    run_plan(_plan("never"), ws.path, in_process=True, force=True, **QUIET)
    ref = _results(ws)
    ref_controls = {key: _controls(ws, key) for key in ref}
    run_plan(_plan("always"), ws.path, in_process=True, force=True, block_rows=7, **QUIET)   # 7-sample blocks
    got = _results(ws)
    assert set(got) == set(ref) and len(got) == 8
    for key, (score, ctrl, n_train, n_test, artifact, metrics) in got.items():
        r = ref[key]
        assert "streamed" not in r[5] and metrics["streamed"]                     # the two paths did run
        assert abs(score - r[0]) < 0.01 and abs(ctrl - r[1]) < 0.01, key          # within a point
        assert (n_train, n_test) == (r[2], r[3])
        assert metrics["n_train_rows"] == r[5]["n_train_rows"]
        sub = metrics["subsample"]
        assert sub["rows"] == sub["of"] and sub["max_train_rows"] is None
        mine, theirs = Probe.load(ws.path / artifact), Probe.load(ws.path / r[4])
        for name in ("mean", "scale"):                     # streamed moments = the in-memory rows' statistics
            assert np.abs(mine.state_[name] - theirs.state_[name]).max() < 1e-4, name
        assert np.abs(mine.state_["coef"] - theirs.state_["coef"]).max() < 0.05 * np.abs(theirs.state_["coef"]).max()
        # The control's per-sample output, scored against the real labels, as in memory.
        ctl, want = _controls(ws, key), ref_controls[key]
        assert ctl.shape == want.shape and not np.isnan(ctl[:, 1]).any()
        assert np.abs(ctl[:, 1] - want[:, 1]).mean() < 0.05, key
        assert (np.isnan(ctl[:, 0]) == np.isnan(want[:, 0])).all()    # a number only where the classes are numbers
        numbers = ~np.isnan(want[:, 0])
        assert not numbers.any() or (ctl[numbers, 0] == want[numbers, 0]).mean() > 0.9
    n_test_rows = [m["n_test_rows"] for *_, m in got.values()]
    assert sorted(set(n_test_rows)) == [22, 2400]          # every test unit scored: 24 boards x 100, 22 samples


@pytest.mark.slow
def test_a_capped_subsample_is_recorded_deterministic_by_stimulus_and_within_a_point(ws):
    plan = _plan("always", max_train_rows=2000)
    job = next(JobBuilder(ws, plan).job(g) for g in group_tasks(plan_tasks(plan, ws)) if g.run == "go")
    (planned,) = plan_work([job], 7, None, "always", 2000)
    spec = planned.spec
    for solve in spec.solves:
        assert solve.pick.sum() == 2000 and solve.candidates == 7200
        assert not solve.pick[~solve.train].any()          # drawn inside training boards only: split by stimulus
    scores = []
    for _ in range(2):
        run_plan(plan, ws.path, in_process=True, force=True, **QUIET)
        scores.append(_results(ws))
    assert scores[0] == scores[1]                          # same draw, same fit, same files named
    run_plan(_plan("never"), ws.path, in_process=True, force=True, **QUIET)
    ref = _results(ws)
    for key, (score, _, _, _, _, metrics) in scores[0].items():
        sub = metrics["subsample"]
        if sub["of"] > 2000:                               # the go probes: capped
            assert sub == {"rows": 2000, "of": 7200, "max_train_rows": 2000, "seed": sub["seed"],
                           "draw": "uniform over labelled training units, without replacement"}
            assert metrics["n_train_rows"] == 2000 and metrics["n_test_rows"] == 2400
            assert abs(score - ref[key][0]) < 0.01, (key, score, ref[key][0])
    strong = [s for k, (s, *_, m) in scores[0].items() if m["subsample"]["of"] > 2000 and ref[k][0] == 1.0]
    assert strong and all(s == 1.0 for s in strong)        # the separable layer stays separable


def test_auto_goes_out_of_core_only_over_the_limit_and_the_dry_run_shows_its_plan(ws, tmp_path, capsys):
    plan = _plan("auto")
    job = next(JobBuilder(ws, plan).job(g) for g in group_tasks(plan_tasks(plan, ws)) if g.run == "go")
    peak = plan_in_memory(job).peak_bytes
    (planned,) = plan_work([job], None, 2 * peak, "auto")
    spec = planned.spec
    assert spec is None                                    # fits in memory: the in-memory path
    (planned,) = plan_work([job], None, int(peak / 0.8) - (1 << 20), "auto", check=False)
    spec, mem = planned.spec, planned.memory
    assert isinstance(spec, IterSpec) and "out-of-core L-BFGS" in mem.what     # just over: out of core
    (planned,) = plan_work([job], None, int(peak / 0.8) - (1 << 20), "never", check=False)
    spec = planned.spec
    assert spec is None
    with pytest.raises(ProbeError, match="out_of_core: auto"):    # kept in memory over the limit: the fix named
        plan_work([job], None, int(peak / 0.8) - (1 << 20), "never")
    with pytest.raises(ProbeError, match=r"max_train_rows lower .*--memory-limit"):
        plan_work([job], 7, 300 << 20, "always")           # under the torch worker's own footprint: refused
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(yaml.safe_dump({"name": "ooc", "out_of_core": "always", "max_train_rows": 500,
                                         "probes": [{**ENTRIES[0], "seeds": [5]}]}))   # not trained yet
    assert main([str(plan_file), "--data", str(ws.path), "--dry-run", "--memory-limit", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "subsample" in out and "cap 500" in out and "peak MiB" in out, out


def _big_go(path: Path, n: int, board: int, d: int, chunk: int = 256) -> Workspace:
    """Go boards whose float32 token features exceed the worker limit of the memory test."""
    ws = Workspace.open(path)
    rng = np.random.default_rng(0)
    T = board * board
    labels = rng.integers(0, 3, (n, T))
    rows = [{"id": f"g_{i:05d}", "family": "go", "split": "test", "seed": i, "params": {"board_size": board},
             "truth": {"count": int((labels[i] == 0).sum()), "labels": labels[i].tolist(), "regime": "ID"}}
            for i in range(n)]
    protos = rng.standard_normal((3, d)).astype(np.float32)
    with ws.writer(RunInfo(run="big", model="synthetic", dtype="float32", chunk_samples=chunk)) as w:
        w.set_samples(w.register_stimuli(rows, dataset="big"))
        h = w.array(ArraySpec(tap="vision", layer=0, tokens="image", shape=(T, d)))      # stored as float16
        for s in range(0, n, chunk):
            x = rng.standard_normal((chunk, T, d), dtype=np.float32) * 2.0 + protos[labels[s : s + chunk]]
            w.write_batch(s, {h: x}, tokens=[TokenSpans(seq_len=T + 4, image_start=1, image_count=T, grid_h=board,
                                                        grid_w=board, last_prompt=T + 3) for _ in range(chunk)])
        w.finish()
    return ws


@pytest.mark.slow
def test_per_token_group_bigger_than_worker_memory_completes_under_the_limit(tmp_path):
    n, board, d = 2304, 12, 512             # float32 token features: 2304*144*512*4 = 648 MiB > the 600 MiB limit
    ws = _big_go(tmp_path / "ws", n, board, d)
    limit = parse_bytes("600MiB")
    plan = parse_plan({"name": "big", "memory_limit": "600MiB",
                       "probes": [{"runs": ["big"], "targets": ["go.intersection"], "kinds": ["linear"]}]})
    job = JobBuilder(ws, plan).job(group_tasks(plan_tasks(plan, ws))[0])
    assert len(job.rows) * board * board * d * 4 > limit
    (planned,) = plan_work([job], 8, limit)        # auto: out of core, a cap the limit holds
    spec, mem = planned.spec, planned.memory
    assert isinstance(spec, IterSpec) and mem.peak_bytes <= 0.8 * limit
    cap = spec.solves[0].cap
    assert 1000 < cap < spec.solves[0].candidates
    rep = run_plan(plan, ws.path, workers=2, block_rows=8, **QUIET)
    assert rep.trained == 1 and rep.failed == 0, rep.failures
    assert 0 < rep.rss_peak < 0.95 * limit, rep.rss_peak          # VmHWM measured in the workers
    assert max(rep.worker_peaks.values()) < 0.95 * limit, rep.worker_peaks
    (score, ctrl, params) = ws.rows("SELECT score, control_score, params FROM probes")[0]
    metrics = json.loads(params)["metrics"]
    assert metrics["subsample"]["rows"] == cap and metrics["n_test_rows"] > 0.15 * n * board * board
    assert score > 0.95 and ctrl < 0.5                              # three token classes, one per prototype


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
