"""The streamed farm's pipeline: a plan's streamed layers run as one job (one spec, layers
pipelined), small layers as one Dask task each with the task graph's exact results, a failed
layer loses only its own probes, and the client's fast paths write what the plain ones did."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from probetest_lib import build_spatial_layers, probe_rows

from probes import artifacts, parse_plan, run_plan, stream
from probes.farm import open_workspace, plan_tasks, plan_work
from probes.plan import group_tasks
from probes.prepare import JobBuilder
from probes.trainers import streamed
from probes.trainers.select import merge_layers
from probes.trainers.stream_specs import build_specs

PLAN = {"name": "pipe", "probes": [{"runs": ["spatial"], "targets": ["spatial.relation", "truth:flag_0"],
                                    "seeds": [0, 1], "kinds": {"ridge": {"alphas": [0.1, 10.0]}}}]}
LAYERS = 4
N_PROBES = LAYERS * 2 * 2   # layers x targets x seeds


def _weights(path: Path) -> dict[str, dict[str, np.ndarray]]:
    ws = open_workspace(path)
    return {key: artifacts.load(path / art)[0] for key, art in ws.rows("SELECT params->>'key', artifact FROM probes")}


def _same_weights(a: Path, b: Path) -> None:
    mine, theirs = _weights(a), _weights(b)
    assert mine.keys() == theirs.keys() and len(mine) == N_PROBES
    for key, tensors in mine.items():
        assert all(np.array_equal(tensors[n], theirs[key][n]) for n in tensors), key


def test_streamed_layers_run_as_one_job_with_the_per_layer_results(tmp_path):
    ws = build_spatial_layers(tmp_path / "ws", layers=LAYERS)
    plan = parse_plan(PLAN)   # layers_per_task 1: one group per layer
    prep = JobBuilder(ws, plan)
    jobs = [prep.job(g) for g in group_tasks(plan_tasks(plan, ws), plan.layers_per_task)]
    assert len(jobs) == LAYERS
    (planned,) = plan_work(jobs, None, None)
    job, specs, mem = planned.job, planned.spec, planned.memory
    assert [a.layer for a in job.arrays] == list(range(LAYERS)) and len(job.tasks) == N_PROBES
    assert mem.read_bytes == sum(plan_work([j], None, None)[0].memory.read_bytes for j in jobs)
    merged = streamed.run_local(job, specs)
    alone = [streamed.run_local(j, build_specs(j)) for j in jobs]   # one job per layer, as before
    ref = {r.params["key"]: r for res in alone for r in res.records}
    assert len(merged.records) == len(ref) == N_PROBES and not merged.failures
    for r in merged.records:
        assert (r.score, r.control_score, r.n_train, r.n_test) == (ref[r.params["key"]].score,
                                                                   ref[r.params["key"]].control_score,
                                                                   ref[r.params["key"]].n_train, ref[r.params["key"]].n_test)
    assert merged.weights == {k: v for res in alone for k, v in res.weights.items()}   # the same safetensors bytes


def test_jobs_that_differ_in_more_than_their_layers_stay_apart(tmp_path):
    ws = build_spatial_layers(tmp_path / "ws", layers=2)
    plan = parse_plan({"name": "two", "probes": [
        {**PLAN["probes"][0], "layers": [0]},
        {**PLAN["probes"][0], "layers": [1], "targets": ["truth:flag_0"]}]})   # another probe set on layer 1
    prep = JobBuilder(ws, plan)
    jobs = [prep.job(g) for g in group_tasks(plan_tasks(plan, ws), 1)]
    assert len(merge_layers(jobs, lambda j: True)) == 2


def test_run_plan_ends_with_the_manifest_free_and_every_weight_published(tmp_path):
    build_spatial_layers(tmp_path / "ws", layers=LAYERS)
    rep = run_plan(parse_plan(PLAN), tmp_path / "ws", in_process=True, progress=False, log=lambda s: None)
    assert rep.trained == N_PROBES and rep.failed == 0
    folder = tmp_path / "ws" / "probes"
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == []   # no pending or temporary files
    # The recorder's held connection is closed: another process opens the manifest read-write at once.
    code = ("import duckdb, sys; c = duckdb.connect(sys.argv[1]); print(c.execute('SELECT count(*) FROM probes')"
            ".fetchone()[0])")
    got = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ws" / "manifest.duckdb")], capture_output=True,
                         text=True, timeout=60)
    assert got.returncode == 0 and got.stdout.strip() == str(N_PROBES), got.stderr


def test_write_pending_puts_the_bytes_where_write_would_and_refuses_bad_keys(tmp_path):
    blobs = {"abc123": b"one", "def456": b"two"}
    got = artifacts.write_pending(tmp_path, blobs)
    assert got == {k: str(artifacts.pending_path(tmp_path, k)) for k in blobs}
    assert [Path(got[k]).read_bytes() for k in blobs] == [b"one", b"two"]
    assert Path(artifacts.publish(got["abc123"])) == artifacts.artifact_path(tmp_path, "abc123")
    assert artifacts.artifact_path(tmp_path, "abc123").read_bytes() == b"one"
    assert sorted(os.listdir(tmp_path / "probes")) == [f".def456.{os.getpid()}.pending", "abc123.safetensors"]
    with pytest.raises(Exception, match="not a probe key"):
        artifacts.write_pending(tmp_path, {"../escape": b"x"})


def test_one_blas_thread_limits_and_restores():
    from threadpoolctl import threadpool_info

    before = [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]
    with stream.one_blas_thread():
        assert {lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"} == {1}
    assert [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"] == before


@pytest.mark.slow
def test_fused_layers_equal_the_task_graph_and_a_failed_layer_loses_only_its_probes(tmp_path, monkeypatch):
    build_spatial_layers(tmp_path / "base", layers=LAYERS)
    for name in ("fused", "graph", "broken"):
        shutil.copytree(tmp_path / "base", tmp_path / name)
    plan = parse_plan(PLAN)
    ws = open_workspace(tmp_path / "base")
    prep = JobBuilder(ws, plan)
    (planned,) = plan_work([prep.job(g) for g in group_tasks(plan_tasks(plan, ws))], None, None)
    job, specs = planned.job, planned.spec
    assert streamed.fuses(specs, job, 2, None)
    fused = run_plan(plan, tmp_path / "fused", workers=2, progress=False, log=lambda s: None)
    monkeypatch.setattr(streamed, "FUSE_BYTES", 0)   # every layer as maps, merges, a solve and test maps
    assert not streamed.fuses(specs, job, 2, None)
    graph = run_plan(plan, tmp_path / "graph", workers=2, progress=False, log=lambda s: None)
    assert fused.trained == graph.trained == N_PROBES and fused.failed == graph.failed == 0
    assert probe_rows(open_workspace(tmp_path / "fused")) == probe_rows(open_workspace(tmp_path / "graph"))
    _same_weights(tmp_path / "fused", tmp_path / "graph")   # the same partitions and merges, in one task

    monkeypatch.undo()
    layer2 = next(a for a in job.arrays if a.layer == 2)
    folder = Path(open_workspace(tmp_path / "broken").root.where(layer2.zarr_path))
    chunk = next(p for p in folder.rglob("*") if p.is_file() and p.name != "zarr.json")
    chunk.unlink()   # the workers cannot read layer 2
    broken = run_plan(plan, tmp_path / "broken", workers=2, progress=False, log=lambda s: None)
    assert broken.failed == N_PROBES // LAYERS and broken.trained == N_PROBES - N_PROBES // LAYERS
    assert {r[3] for r in probe_rows(open_workspace(tmp_path / "broken"))} == {0, 1, 3}


def test_a_group_whose_kinds_prefer_different_trainers_becomes_one_job_per_trainer(tmp_path):
    """The farm picks trainers from the kinds' ``trains``, never their types: ridge's part of a
    group goes to the streamed trainer (group name + "s"), pooled's stays in memory, and a
    pooled probe over the limit would go to the iterative trainer only under out_of_core."""
    ws = build_spatial_layers(tmp_path / "ws", layers=1)
    plan = parse_plan({"name": "mixed", "probes": [{"runs": ["spatial"], "targets": ["spatial.relation"],
                                                    "kinds": {"ridge": {}, "pooled": {}}}]})
    (job,) = [JobBuilder(ws, plan).job(g) for g in group_tasks(plan_tasks(plan, ws))]
    work = plan_work([job], None, None)
    assert [(p.trainer.name, p.job.group, sorted({t.kind for t in p.job.tasks})) for p in work] == [
        ("streamed", f"{job.group}s", ["ridge"]), ("in_memory", job.group, ["pooled"])]
    assert isinstance(work[0].spec, list) and work[1].spec is None
    (always,) = plan_work([work[1].job], None, None, "always")
    assert always.trainer.name == "iterative"
