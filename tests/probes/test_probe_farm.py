"""Plans: validation messages, expansion, deterministic keys, re-runs that skip finished probes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from child_env import child_env
from probetest_lib import REPO, build_workspace, probe_rows, python

from probes import PlanError, ProbeError, parse_plan, run_plan
from probes.farm import plan_tasks
from probes.plan import group_tasks

QUIET = {"progress": False, "log": lambda s: None}

PLAN = {
    "name": "farm",
    "defaults": {"seeds": [0, 1]},
    "probes": [
        {"runs": ["go"], "layers": "all", "targets": ["go.intersection"], "kinds": ["linear"]},
        {"runs": "all", "taps": ["vision"], "layers": [-1], "where": "family = 'spatial'",
         "targets": ["spatial.relation", "truth:flag_1"], "kinds": {"pooled": {"C": 0.5}}},
    ],
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("farm") / "ws"
    build_workspace(path, n=96, families=("go", "spatial"))
    return path


@pytest.fixture
def ws_path(base, tmp_path):
    path = tmp_path / "ws"
    shutil.copytree(base, path)
    return path


def test_plan_errors_say_what_is_wrong_and_how_to_fix_it():
    cases = [
        ({"probes": [{"targets": ["go.count"], "kinds": ["pooled"], "layer": 3}]}, "unknown key 'layer' — did you mean 'layers'"),
        ({"probes": [{"targets": ["go.count"], "kinds": ["lineer"]}]}, "unknown probe kind 'lineer' — did you mean 'linear'"),
        ({"probes": [{"targets": ["go.cnt"], "kinds": ["pooled"]}]}, "unknown target 'go.cnt' — did you mean 'go.count'"),
        ({"probes": [{"targets": ["go.count"], "kinds": ["linear"]}]},
         "kind linear learns token targets; go.count is a sample target."
         " Kinds for sample targets: lda, nearest_centroid, pooled, ridge"),
        ({"probes": [{"targets": ["go.count"], "kinds": {"pooled": {"pool": "median"}}}]},
         "pool: Input should be 'mean', 'max', 'first' or 'last'"),
        ({"probes": [{"targets": ["go.count"], "kinds": {"pooled": {"Cc": 1}}}]}, "unknown parameter 'Cc' — did you mean 'C'"),
        ({"probes": []}, "probes: List should have at least 1 item"),
        ({"defaults": {"test_fraction": 1.5}, "probes": [{"targets": ["go.count"], "kinds": "pooled"}]},
         "test_fraction: Input should be less than 1"),
        ({"probes": [{"kinds": "pooled"}]}, "probes.0.targets: required key is missing"),
    ]
    for data, message in cases:
        with pytest.raises(PlanError) as err:
            parse_plan(data, "p.yaml")
        assert message in str(err.value), (message, str(err.value))
        assert str(err.value).startswith("p.yaml is not a valid probe plan")


def test_expansion_against_the_workspace(ws_path):
    from probes.farm import open_workspace

    ws = open_workspace(ws_path)
    tasks = plan_tasks(parse_plan(PLAN), ws)
    # go: 2 layers x 1 target x 2 seeds; runs: all -> the last layer of both runs x 2 targets
    # x 2 seeds (the where selects no rows of run go: the farm skips those, see below)
    assert len(tasks) == 4 + 2 * 2 * 2
    assert len({t.key for t in tasks}) == len(tasks)
    assert {t.layer for t in tasks if t.kind == "pooled"} == {1}
    assert all(t.params["C"] == 0.5 for t in tasks if t.kind == "pooled")
    again = plan_tasks(parse_plan(PLAN), ws)
    assert tasks == again and [t.key for t in tasks] == [t.key for t in again]
    groups = group_tasks(tasks, layers_per_task=2)
    assert sorted(len(g.layers) for g in groups) == [1, 1, 2]
    with pytest.raises(PlanError, match=r"layer 7 of go vision/resid_post/image is not stored; stored layers: \[0, 1\]"):
        plan_tasks(parse_plan({"probes": [{"runs": ["go"], "layers": [7], "targets": ["go.count"], "kinds": "pooled"}]}), ws)
    with pytest.raises(PlanError, match="run 'og' has no arrays in this workspace; known: go, spatial"):
        plan_tasks(parse_plan({"probes": [{"runs": ["og"], "targets": ["go.count"], "kinds": "pooled"}]}), ws)
    with pytest.raises(PlanError, match="selects no stored array"):
        plan_tasks(parse_plan({"probes": [{"runs": ["go"], "tokens": ["answer"], "targets": ["go.count"],
                                           "kinds": "pooled"}]}), ws)


@pytest.mark.slow
def test_rerun_skips_finished_probes_and_resumes_after_loss(ws_path):
    plan = parse_plan(PLAN)
    first = run_plan(plan, ws_path, in_process=True, **QUIET)
    assert first.tasks == 12 and first.empty == 4  # run go has no spatial rows
    assert first.trained == 8 and first.failed == 0 and first.skipped == 0
    from probes.farm import open_workspace

    ws = open_workspace(ws_path)
    rows = probe_rows(ws)
    stamp = ws.rows("SELECT key, created_at FROM probes ORDER BY 1")
    again = run_plan(plan, ws_path, in_process=True, **QUIET)
    assert again.trained == 0 and again.skipped == 8
    assert ws.rows("SELECT key, created_at FROM probes ORDER BY 1") == stamp  # untouched
    # Lose some results (a farm killed before its last flush): only those are trained again.
    from store import db

    with db.connect(ws.manifest_path, read_only=False) as con:
        con.execute("DELETE FROM probes WHERE kind = 'pooled' AND seed = 1")
    resumed = run_plan(plan, ws_path, in_process=True, **QUIET)
    assert resumed.trained == 2 and resumed.skipped == 6
    assert probe_rows(ws) == rows  # same rows, same scores, no duplicates
    assert ws.rows("SELECT count(*), count(DISTINCT params->>'key') FROM probes") == [(8, 8)]
    # Packing layers into one batched solve gives the same probes (keys) and near-identical scores.
    other = ws_path.parent / "packed"
    shutil.copytree(ws_path, other)
    with db.connect(other / "manifest.duckdb", read_only=False) as con:
        con.execute("DELETE FROM probes")
    packed = run_plan(parse_plan({**plan.model_dump(), "layers_per_task": 2}), other, in_process=True, **QUIET)
    assert packed.groups < first.groups
    got = probe_rows(open_workspace(other))
    assert [r[:7] for r in got] == [r[:7] for r in rows]
    assert max(abs(a[7] - b[7]) for a, b in zip(got, rows, strict=False)) <= 0.03


@pytest.mark.slow
def test_plans_differing_only_in_kind_parameters_keep_both_rows(ws_path):
    # Before probes were keyed by their full identity, the second plan's C replaced the first's row.
    entry = {"runs": ["spatial"], "layers": [1], "targets": ["spatial.relation"], "control": "none"}
    for name, C in (("c-half", 0.5), ("c-two", 2.0)):
        report = run_plan(parse_plan({"name": name, "probes": [{**entry, "kinds": {"pooled": {"C": C}}}]}), ws_path,
                          in_process=True, **QUIET)
        assert report.trained == 1 and report.failed == 0
    from probes.farm import open_workspace

    ws = open_workspace(ws_path)
    got = ws.rows("SELECT kind_params->>'C', params->>'plan', count(DISTINCT series) OVER () FROM probes ORDER BY 1")
    assert got == [("0.5", "c-half", 2), ("2.0", "c-two", 2)]
    per_probe = ws.rows("SELECT count(DISTINCT key), count(*) FROM probe_predictions")
    assert per_probe[0][0] == 2 and per_probe[0][1] > 0


@pytest.mark.slow
def test_cli_dry_run_lists_probes_and_bad_plans_exit_2(ws_path, tmp_path, capsys):
    from probes.cli import main

    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({**PLAN, "probes": PLAN["probes"][:1]}))
    got = python("-m", "probes", str(plan), "--data", str(ws_path), "--dry-run")
    assert got.returncode == 0, got.stderr
    assert "4 probes, 0 done, 4 to train in 2 Dask tasks" in got.stdout
    assert "go / vision / 1 / resid_post / image -> go.intersection : linear (1)" in got.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("probes:\n  - {targets: [go.count], kinds: [linear]}\n")
    assert main([str(bad), "--data", str(ws_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Kinds for sample targets: lda, nearest_centroid, pooled, ridge" in err
    assert main([str(plan), "--data", str(tmp_path / "nowhere"), "--dry-run"]) == 2
    assert "no workspace at" in capsys.readouterr().err


@pytest.mark.parametrize("path", sorted((REPO / "manifests").glob("probes-*.yaml")), ids=lambda p: p.name)
def test_shipped_plans_are_valid(path):
    from probes import load_plan

    plan = load_plan(path)
    assert plan.probes


@pytest.mark.slow
def test_killed_farm_process_resumes_without_duplicates(tmp_path):
    import signal
    import subprocess
    import sys

    from probetest_lib import HERE, build_spatial_layers, wait_for

    from probes.farm import open_workspace
    from store.errors import ManifestBusyError

    plan = {"name": "resume", "plugins": ["probetest_slow"],
            "probes": [{"targets": ["spatial.relation", "truth:flag_0"], "kinds": ["slow_pooled"]}]}
    # Long enough that the farm's 2 s flush records some rows before the kill: 8 layers (16 probes)
    # could finish within one flush interval on a quiet machine, recording nothing until the end.
    total = 16 * 2
    build_spatial_layers(tmp_path / "ws", layers=16)
    shutil.copytree(tmp_path / "ws", tmp_path / "ref")
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(plan))
    env = child_env(HERE)
    proc = subprocess.Popen([sys.executable, "-m", "probes", str(tmp_path / "plan.yaml"), "--data", str(tmp_path / "ws"),
                             "--in-process", "--no-progress"], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    ws = open_workspace(tmp_path / "ws")

    def recorded() -> int:
        try:
            return ws.rows("SELECT count(*) FROM probes")[0][0]
        except ManifestBusyError:
            return 0

    try:
        wait_for(lambda: recorded() > 0 or proc.poll() is not None, timeout=60, step=0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    before = recorded()
    assert 0 < before < total, f"the kill must land mid-plan, {before} of {total} recorded"
    resumed = run_plan(parse_plan(plan), tmp_path / "ws", in_process=True, **QUIET)
    assert resumed.skipped == before and resumed.trained == total - before
    assert ws.rows("SELECT count(*), count(DISTINCT params->>'key') FROM probes") == [(total, total)]
    run_plan(parse_plan(plan), tmp_path / "ref", in_process=True, **QUIET)
    assert probe_rows(ws) == probe_rows(open_workspace(tmp_path / "ref"))


@pytest.mark.slow
def test_ragged_image_tokens_of_one_size_are_probed_like_a_dense_array(tmp_path):
    """One run holding grids of two sizes (4x4 and 6x6 image tokens: a ragged image array); a
    per-size entry trains on it exactly as on a dense run of that size alone, and a selection that
    mixes sizes is refused with the fix."""
    from probetest_lib import D, g2m_family, g2m_features

    from store import ArraySpec, RunInfo, TokenSpans, Workspace

    sizes = {4: g2m_family(48, seed=1, grid=4), 6: g2m_family(48, seed=2, grid=6)}
    feats = {side: g2m_features(mats, 1, side=side) for side, (_, mats) in sizes.items()}
    mixed, dense = Workspace.open(tmp_path / "mixed"), Workspace.open(tmp_path / "dense")
    rows = [dict(r, id=f"{r['id']}_{side}") for side, (rs, _) in sizes.items() for r in rs]
    values = [f for side in sizes for f in feats[side]]
    with mixed.writer(RunInfo(run="g2m", model="synthetic", dtype="float32", chunk_samples=16)) as w:
        w.set_samples(w.register_stimuli(rows, dataset="g2m"))
        h = w.array(ArraySpec(tap="vision", layer=0, tokens="image", shape=(D,), ragged=True))
        for s in range(0, len(rows), 16):
            w.write_batch(s, {h: values[s:s + 16]},
                          tokens=[TokenSpans(seq_len=len(v) + 4, image_start=1, image_count=len(v),
                                             grid_h=int(len(v) ** 0.5), grid_w=int(len(v) ** 0.5), last_prompt=len(v) + 3)
                                  for v in values[s:s + 16]])
        w.finish()
    rows6 = [dict(r, id=f"{r['id']}_6") for r in sizes[6][0]]
    with dense.writer(RunInfo(run="g2m", model="synthetic", dtype="float32", chunk_samples=16)) as w:
        w.set_samples(w.register_stimuli(rows6, dataset="g2m"))
        h = w.array(ArraySpec(tap="vision", layer=0, tokens="image", shape=(36, D)))
        w.write_batch(0, {h: feats[6]}, tokens=[TokenSpans(seq_len=40, image_start=1, image_count=36, grid_h=6,
                                                           grid_w=6, last_prompt=39)] * 48)
        w.finish()
    entry = {"taps": ["vision"], "tokens": ["image"], "targets": ["g2m.cell_color"], "kinds": ["linear"]}
    spatial = {**entry, "targets": ["g2m.matrix"], "kinds": ["conv_spatial"]}
    six = "(params->>'grid_size')::INT = 6"
    plan = parse_plan({"name": "sizes", "defaults": {"seeds": [0, 1]},
                       "probes": [{**entry, "where": six}, {**spatial, "where": six}]})
    run_plan(plan, mixed.path, in_process=True, **QUIET)
    run_plan(plan, dense.path, in_process=True, **QUIET)
    sql = "SELECT target, kind, n_train, n_test, round(score, 6), round(control_score, 6) FROM probes ORDER BY ALL"
    got = mixed.rows(sql)
    assert len(got) == 4 and got == dense.rows(sql)  # 2 kinds x 2 seeds
    assert all(score > 0.9 for *_, score, _ in got if score is not None)
    everything = parse_plan({"name": "all", "defaults": {"seeds": [0]}, "probes": [entry]})
    with pytest.raises(ProbeError, match=r"same number of image tokens .* has \[16, 36\]: select one image size"):
        run_plan(everything, mixed.path, in_process=True, **QUIET)


@pytest.mark.slow
def test_workers_write_nothing_the_client_writes_each_weight_file(tmp_path):
    """A group runs where the workspace folder cannot even be created (as on a cluster node that
    only sees the arrays): it still trains and hands back the weights, which load as the probe."""
    import dataclasses

    from probes import Probe
    from probes.prepare import JobBuilder
    from probes.trainers.in_memory import run_group

    ws = build_workspace(tmp_path / "ws", n=64, families=("go",))
    plan = parse_plan({"name": "w", "defaults": {"seeds": [0]},
                       "probes": [{"taps": ["vision"], "targets": ["go.intersection"], "kinds": ["linear"]}]})
    prep = JobBuilder(ws, plan)
    (tmp_path / "file").write_text("not a folder")
    group = group_tasks(plan_tasks(plan, ws), plan.layers_per_task)[0]
    job = dataclasses.replace(prep.job(group), workspace=str(tmp_path / "file" / "ws"))
    result = run_group(job)
    assert not result.failures and len(result.records) == len(result.weights) == len(group.tasks) >= 1
    assert not (ws.path / "probes").exists()
    key, blob = next(iter(result.weights.items()))
    (tmp_path / "w.safetensors").write_bytes(blob)
    assert Probe.load(tmp_path / "w.safetensors").name == "linear"
    run_plan(plan, ws.path, in_process=True, **QUIET)  # the client writes them, then records the rows
    for row in ws.query("SELECT artifact FROM probes").to_pylist():
        assert Probe.load(ws.path / row["artifact"]).name == "linear"


@pytest.mark.slow
def test_killed_client_leaves_no_weight_file_without_a_row(tmp_path):
    """Issue 16 item 7: weights wait under a pending name until their row commits; a client killed
    between the two leaves none under a final name, and the next run publishes or deletes them."""
    import signal
    import subprocess
    import sys

    from probetest_lib import HERE, build_spatial_layers, wait_for

    from probes.farm import open_workspace

    plan = {"name": "orphans", "plugins": ["probetest_slow"],
            "probes": [{"targets": ["spatial.relation", "truth:flag_0"], "kinds": ["slow_pooled"]}]}
    build_spatial_layers(tmp_path / "ws", layers=8)
    script = ("import sys; from probes import parse_plan, run_plan; import yaml;"
              f"run_plan(parse_plan(yaml.safe_load({yaml.safe_dump(plan)!r})), sys.argv[1], in_process=True,"
              " progress=False, flush_every=3600, flush_size=10**6)")   # rows only at the end: the kill lands before
    env = child_env(HERE)
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "ws")], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    folder = tmp_path / "ws" / "probes"
    try:
        wait_for(lambda: (folder.is_dir() and len(list(folder.iterdir())) >= 2) or proc.poll() is not None, timeout=60,
                 step=0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    ws = open_workspace(tmp_path / "ws")
    assert ws.rows("SELECT count(*) FROM probes")[0][0] == 0
    assert len(list(folder.iterdir())) >= 2, "the kill must land after weights were written"
    assert list(folder.glob("*.safetensors")) == []              # nothing under a final name without its row
    resumed = run_plan(parse_plan(plan), tmp_path / "ws", in_process=True, **QUIET)
    assert resumed.trained == 16
    files = sorted(p.name for p in folder.iterdir())
    rows = sorted(Path(r[0]).name for r in ws.rows("SELECT artifact FROM probes"))
    assert files == rows and len(rows) == 16                      # pending files of the dead client are gone
