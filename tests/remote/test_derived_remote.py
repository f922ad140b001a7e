"""Derived arrays in a workspace whose arrays live in an object store (a real moto server on
loopback): derived on the client, uploaded before their row is committed, read back from the
bucket to the bit, checked by verify, and read by a plan instead of the token chunks."""

from __future__ import annotations

import numpy as np
import pytest

from probes.derived import derive
from probes.farm import run_plan
from probes.features import read_features
from probes.plan import parse_plan
from probes.pooling import pool
from store import ArraySpec, RunInfo, Workspace

pytestmark = pytest.mark.slow  # a real object store per test

N, CHUNK, TOKENS, DIM = 40, 16, 5, 6
PLAN = {"name": "remote", "defaults": {"seeds": [0]},
        "probes": [{"runs": ["r"], "layers": "all", "targets": ["truth:flag"],
                    "kinds": {"ridge": {"pool": "mean"}, "nearest_centroid": {"pool": "mean"}}}]}


def _write(ws: Workspace) -> None:
    rng = np.random.default_rng(0)
    flag = rng.integers(0, 2, N)
    stimuli = [{"id": f"s{i:02d}", "family": "go", "split": "test", "seed": i, "prompt": "p", "answer": "a",
                "truth": {"flag": int(flag[i])}} for i in range(N)]
    values = (rng.standard_normal((N, TOKENS, DIM)) + flag[:, None, None]).astype(np.float32)
    with ws.writer(RunInfo(run="r", model="m", dtype="float32", chunk_samples=CHUNK)) as w:
        w.set_samples(w.register_stimuli(stimuli, dataset="set"))
        handles = [w.array(ArraySpec(tap="llm", layer=layer, tokens="image", shape=(TOKENS, DIM)))
                   for layer in (0, 1)]
        w.write_batch(0, {h: values for h in handles})
        w.finish()


def test_derived_arrays_live_in_the_bucket(s3, tmp_path):
    ws = Workspace.open(tmp_path / "ws", arrays_url=s3.url("ws"))
    _write(ws)
    source = ws.array_info("r", "llm", 0)
    got = derive(ws, source, "mean")
    keys = s3.fs.find(f"{s3.bucket}/ws/{got.zarr_path}")
    assert sorted(k.rsplit("/", 1)[1] for k in keys) == ["c.0.0", "c.1.0", "c.2.0", "zarr.json"]
    staged = [p.name for p in (ws.zarr_path / got.zarr_path).iterdir()]
    assert staged == ["zarr.json"]                     # committed: the local copies are gone, as the writer's
    rows = np.array([0, 3, 17, 31, 39])
    assert read_features(ws.root, got.array_info(), rows).tobytes() == pool(
        read_features(ws.root, source, rows), "mean").tobytes()
    rep = Workspace.open(ws.path, readonly=True).verify()
    assert rep.ok and rep.derived == 1 and not rep.warnings, (rep.problems, rep.warnings)

    # A plan (derive: auto) derives layer 1 too, then reads only derived arrays: the token objects can go.
    logged: list[str] = []
    run_plan(parse_plan(PLAN), ws.path, in_process=True, progress=False, log=logged.append)
    assert any("vision" not in x and "pool_mean derived" in x for x in logged), logged
    before = {r[0]: r[1:] for r in ws.rows("SELECT params->>'key', score, control_score FROM probes")}
    for layer in (0, 1):
        s3.fs.rm(f"{s3.bucket}/ws/r/llm/{layer}/resid_post/image", recursive=True)
    report = run_plan(parse_plan(PLAN), ws.path, in_process=True, force=True, progress=False, log=logged.append)
    assert report.trained == 4 and report.failed == 0, report.failures[:2]
    assert {r[0]: r[1:] for r in ws.rows("SELECT params->>'key', score, control_score FROM probes")} == before

    s3.fs.rm(f"{s3.bucket}/ws/{got.zarr_path}/c.1.0")
    problems = Workspace.open(ws.path, readonly=True).verify().problems
    # 40 samples in chunks of at most 16 are stored as chunks of 14 (store.records.chunk_size)
    assert any(f"{got.zarr_path}: chunk 1 (rows 14-27) unreadable: {s3.url('ws')}/{got.zarr_path}/c.1.0 is missing"
               in p for p in problems), problems
