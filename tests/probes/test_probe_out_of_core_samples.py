"""The per-sample kinds out of core (conv_spatial, detect: probes/trainers/iterative.py, probes/subsample.py
fit_samples): the in-memory probe when every training sample is kept, a recorded and deterministic
subsample of training samples under a cap, the path in the dry run, and plans that cannot fit
(hidden_number included) refused before training with the fix named."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
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
CONV = {"runs": ["g2m"], "layers": [1], "targets": ["g2m.matrix"],
        "kinds": {"conv_spatial": {"iters": 40, "hidden": 16}}}
DETECT = {"runs": ["count"], "layers": [1], "targets": ["counting.boxes"],
          "kinds": {"detect": {"iters": 120, "hidden": 16, "bottleneck": 16}}}
HIDDEN = {"runs": ["go"], "targets": ["go.intersection"], "kinds": ["hidden_number"]}


def _plan(mode: str, *entries: dict, **extra):
    return parse_plan({"name": "oocs", "out_of_core": mode, **extra, "probes": list(entries)})


def _results(ws: Workspace, kind: str) -> dict[str, tuple]:
    rows = ws.rows("SELECT params->>'key', score, control_score, n_train, n_test, artifact, params FROM probes"
                   " WHERE kind = ?", [kind])
    return {r[0]: (r[1], r[2], r[3], r[4], r[5], json.loads(r[6])["metrics"]) for r in rows}


def _predictions(ws: Workspace, key: str) -> list[tuple]:
    return ws.rows("SELECT array_row, prediction, truth, round(score, 9), round(control_score, 9) FROM probe_predictions"
                   " WHERE key = ? ORDER BY array_row", [key])


def _job(ws: Workspace, plan, run: str):
    return next(JobBuilder(ws, plan).job(g) for g in group_tasks(plan_tasks(plan, ws)) if g.run == run)


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Workspace:
    return build_workspace(tmp_path_factory.mktemp("oocs") / "ws", n=64, families=("g2m", "count", "go"))


def _same_as_in_memory(ws: Workspace, entry: dict) -> dict[str, tuple]:
    (kind,) = entry["kinds"]
    run_plan(_plan("never", entry), ws.path, in_process=True, force=True, **QUIET)
    ref = _results(ws, kind)
    ref_preds = {k: _predictions(ws, k) for k in ref}
    run_plan(_plan("always", entry), ws.path, in_process=True, force=True, block_rows=5, **QUIET)   # 5-sample blocks
    got = _results(ws, kind)
    assert set(got) == set(ref) and got
    for key, (score, ctrl, n_train, n_test, artifact, metrics) in got.items():
        r = ref[key]
        assert "streamed" not in r[5] and metrics["streamed"]                     # the two paths did run
        assert abs(score - r[0]) < 0.01 and abs(ctrl - r[1]) < 0.01, (key, score, r[0], ctrl, r[1])
        assert (n_train, n_test) == (r[2], r[3])
        assert metrics["n_train_samples"] == n_train and metrics["n_test_samples"] == n_test   # whole test split
        sub = metrics["subsample"]
        assert sub["rows"] == sub["of"] == n_train and sub["max_train_rows"] is None
        mine_preds = _predictions(ws, key)
        assert len(mine_preds) == len(ref_preds[key]) == n_test
        # The control's per-sample score on the same test samples, against the real target, as in memory.
        assert [r[0] for r in mine_preds] == [r[0] for r in ref_preds[key]]
        assert all(r[4] is not None for r in mine_preds + ref_preds[key])
        assert abs(np.mean([r[4] for r in mine_preds]) - np.mean([r[4] for r in ref_preds[key]])) < 0.02
        mine, theirs = Probe.load(ws.path / artifact), Probe.load(ws.path / r[4])
        for name in ("mean", "scale"):     # moments streamed over every training token = the rows' statistics
            assert np.abs(mine.state_[name] - theirs.state_[name]).max() < 1e-4, name
    return got


def test_conv_spatial_out_of_core_equals_in_memory_when_every_training_sample_is_kept(ws):
    got = _same_as_in_memory(ws, CONV)
    (score, ctrl, *_, metrics), = got.values()
    assert score > 0.9 and ctrl < 0.6                      # the strong layer, learnt, its control not
    assert set(metrics["error_maps"]) == {"4"} and metrics["exact_match"] > 0.5


@pytest.mark.slow
def test_detect_out_of_core_equals_in_memory_when_every_training_sample_is_kept(ws):
    got = _same_as_in_memory(ws, DETECT)
    (score, *_, metrics), = got.values()
    assert score > 0.1 and metrics["n_true"] > 0           # boxes found: not a probe that learnt nothing


def test_a_capped_sample_subsample_is_recorded_deterministic_by_stimulus_and_still_trains(ws):
    plan = _plan("always", CONV, max_train_rows=30)
    (planned,) = plan_work([_job(ws, plan, "g2m")], 5, None, "always", 30)
    spec, mem = planned.spec, planned.memory
    (solve,) = spec.solves
    assert spec.per_sample and solve.pick.shape == solve.train.shape   # whole samples, not tokens
    assert solve.pick.sum() == 30 < solve.candidates and not solve.pick[~solve.train].any()   # by stimulus
    assert "out-of-core conv_spatial (30 training samples per batch, cap 30" in mem.what
    runs = []
    for _ in range(2):
        run_plan(plan, ws.path, in_process=True, force=True, block_rows=5, **QUIET)
        runs.append(_results(ws, "conv_spatial"))
    assert runs[0] == runs[1]                              # same draw, same fit, same files named
    (score, ctrl, n_train, n_test, _, metrics), = runs[0].values()
    assert metrics["subsample"] == {"rows": 30, "of": solve.candidates, "max_train_rows": 30, "seed": 0,
                                    "draw": "uniform over labelled training samples, without replacement"}
    assert metrics["n_train_samples"] == 30 and n_train == solve.candidates and metrics["n_test_samples"] == n_test
    assert score > ctrl + 0.3                              # 30 grids still train the probe


def test_auto_takes_conv_spatial_out_of_core_over_the_limit_and_the_dry_run_shows_it(ws, tmp_path, capsys):
    plan = _plan("auto", CONV)
    job = _job(ws, plan, "g2m")
    peak = plan_in_memory(job).peak_bytes
    (planned,) = plan_work([job], None, 2 * peak, "auto")
    spec = planned.spec
    assert spec is None                                    # fits: the in-memory path
    (planned,) = plan_work([job], None, int(peak / 0.8) - (1 << 20), "auto", check=False)
    spec, mem = planned.spec, planned.memory
    assert isinstance(spec, IterSpec) and spec.per_sample and "out-of-core conv_spatial" in mem.what
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(yaml.safe_dump({"name": "oocs", "out_of_core": "always", "max_train_rows": 40,
                                         "probes": [{**CONV, "seeds": [7]}]}))   # not trained yet
    assert main([str(plan_file), "--data", str(ws.path), "--dry-run", "--memory-limit", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "subsample" in out and "out-of-core conv_spatial" in out and "cap 40" in out, out


def test_plans_that_cannot_fit_are_refused_before_training_with_the_fix_named(ws, tmp_path, capsys):
    job = _job(ws, _plan("always", CONV), "g2m")
    with pytest.raises(ProbeError, match=r"max_train_rows lower .*--memory-limit"):
        plan_work([job], 5, 300 << 20, "always")           # under the torch worker's own footprint
    small = int(plan_in_memory(job).peak_bytes / 0.8) - (1 << 20)
    with pytest.raises(ProbeError, match="out_of_core: auto") as kept:
        plan_work([job], None, small, "never")             # kept in memory over the limit
    assert "kind ridge" not in str(kept.value)             # no remedy of another kind
    hidden = _job(ws, _plan("auto", HIDDEN), "go")
    small = int(plan_in_memory(hidden).peak_bytes / 0.8) - (1 << 20)
    with pytest.raises(ProbeError, match="use kind hidden_number_ridge .*--memory-limit") as err:
        plan_work([hidden], None, small, "auto")
    assert "\n" not in str(err.value)
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(yaml.safe_dump({"name": "oocs", "probes": [{**HIDDEN, "seeds": [3]}]}))
    assert main([str(plan_file), "--data", str(ws.path), "--memory-limit", f"{small}", "--in-process"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "hidden_number_ridge" in lines[0], lines
    assert not ws.rows("SELECT 1 FROM probes WHERE seed = 3")   # refused before any training


def test_a_kind_that_only_says_out_of_core_stays_in_memory(ws):
    job = _job(ws, _plan("always", CONV), "g2m")
    (planned,) = plan_work([job], 5, None, "always")
    spec = planned.spec
    assert isinstance(spec, IterSpec)
    bare = type("Bare", (Probe,), {"trains": ("in_memory", "iterative"), "accepts": ("grid",)})   # no fit_scaled, ...
    (planned,) = plan_work([replace(job, kinds={"conv_spatial": bare})], 5, None, "always")
    spec = planned.spec
    assert spec is None                                    # the in-memory path, not an AttributeError mid-run


def _big_g2m(path: Path, n: int, d: int, chunk: int = 256) -> Workspace:
    """4x4 colour grids seen through 8x8 tokens whose float32 features exceed the test's worker limit."""
    ws = Workspace.open(path)
    rng = np.random.default_rng(0)
    mats = rng.integers(0, 3, (n, 4, 4))
    rows = [{"id": f"m_{i:05d}", "family": "g2m", "split": "test", "seed": i, "params": {"grid_size": 4},
             "truth": {"matrix": mats[i].tolist()}} for i in range(n)]
    under = mats[:, np.arange(8) // 2][:, :, np.arange(8) // 2].reshape(n, 64)
    protos = rng.standard_normal((3, d)).astype(np.float32)
    with ws.writer(RunInfo(run="big", model="synthetic", dtype="float32", chunk_samples=chunk)) as w:
        w.set_samples(w.register_stimuli(rows, dataset="big"))
        h = w.array(ArraySpec(tap="vision", layer=0, tokens="image", shape=(64, d)))      # stored as float16
        for s in range(0, n, chunk):
            x = rng.standard_normal((chunk, 64, d), dtype=np.float32) * 2.0 + protos[under[s : s + chunk]]
            w.write_batch(s, {h: x}, tokens=[TokenSpans(seq_len=68, image_start=1, image_count=64, grid_h=8,
                                                        grid_w=8, last_prompt=67) for _ in range(chunk)])
        w.finish()
    return ws


@pytest.mark.slow
def test_conv_spatial_group_bigger_than_worker_memory_completes_under_the_limit(tmp_path):
    n, d = 3072, 1152                       # float32 features: 3072*64*1152*4 = 864 MiB > the 800 MiB limit
    ws = _big_g2m(tmp_path / "ws", n, d)
    limit = parse_bytes("800MiB")
    plan = parse_plan({"name": "big", "memory_limit": "800MiB", "probes": [
        {"runs": ["big"], "targets": ["g2m.matrix"], "kinds": {"conv_spatial": {"iters": 30, "hidden": 16}}}]})
    job = JobBuilder(ws, plan).job(group_tasks(plan_tasks(plan, ws))[0])
    assert len(job.rows) * 64 * d * 4 > limit
    (planned,) = plan_work([job], 8, limit)        # auto: out of core, a cap the limit holds
    spec, mem = planned.spec, planned.memory
    assert isinstance(spec, IterSpec) and spec.per_sample and mem.peak_bytes <= 0.8 * limit
    cap = spec.solves[0].cap
    assert 32 <= cap < spec.solves[0].candidates
    rep = run_plan(plan, ws.path, workers=2, block_rows=8, **QUIET)
    assert rep.trained == 1 and rep.failed == 0, rep.failures
    assert 0 < rep.rss_peak < 0.95 * limit, rep.rss_peak          # VmHWM measured in the workers
    assert max(rep.worker_peaks.values()) < 0.95 * limit, rep.worker_peaks
    (score, ctrl, n_test, params) = ws.rows("SELECT score, control_score, n_test, params FROM probes")[0]
    metrics = json.loads(params)["metrics"]
    assert metrics["subsample"]["rows"] == cap and metrics["n_test_samples"] == n_test > 0.15 * n
    assert score > 0.9 and ctrl < 0.5, (score, ctrl)               # three colours, one prototype each
    print(f"cap {cap} of {spec.solves[0].candidates}, planned peak {mem.peak_bytes >> 20} MiB, worker peaks"
          f" {sorted(v >> 20 for v in rep.worker_peaks.values())} MiB, score {score:.3f}, control {ctrl:.3f}")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
