"""Derived arrays: pooled features stored once per chunk, read by later plans instead of the tokens."""

from __future__ import annotations

import shutil

import duckdb
import numpy as np
import pytest
from probetest_lib import D, probe_rows, spatial_family, spatial_features, write_run

from probes import run_plan
from probes.cli import main as probes_cli
from probes.derived import derive, for_group
from probes.farm import plan_tasks
from probes.features import read_features
from probes.plan import parse_plan
from probes.pooling import pool
from store import ArraySpec, RunInfo, TokenSpans, Workspace
from store import derived as store_derived
from store import schema as schema_mod

QUIET = {"progress": False, "log": lambda s: None}
N = 100  # chunk_samples 32: the store evens that out to 4 chunks of 25 (store.records.chunk_size)
PLAN = {"name": "pooled", "defaults": {"seeds": [0, 1]},
        "probes": [{"runs": ["spatial"], "layers": "all", "targets": ["spatial.relation", "truth:flag_1"],
                    "kinds": {"pooled": {"pool": "mean"}}}]}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    ws = Workspace.open(tmp_path_factory.mktemp("derived") / "ws")
    rows, rel, latent = spatial_family(N)
    write_run(ws, "spatial", rows, [spatial_features(rel, latent, layer) for layer in (0, 1)], (2, 2))
    return ws.path


@pytest.fixture
def ws(base, tmp_path):
    shutil.copytree(base, tmp_path / "ws")
    return Workspace.open(tmp_path / "ws")


def _source_chunks(ws):
    return sorted(p for a in ws.arrays("spatial") for p in (ws.zarr_path / a.zarr_path).glob("c.*"))


@pytest.mark.parametrize("how", ["mean", "max", "last"])
def test_derived_equals_pooling_on_the_fly_to_the_bit(ws, how):
    source = ws.array_info("spatial", "vision", 1)
    got = derive(ws, source, how)
    rows = np.arange(N)
    stored = read_features(ws.root, got.array_info(), rows)
    fly = pool(read_features(ws.root, source, rows), how)
    assert stored.dtype == np.float32 and stored.shape == (N, source.shape[-1])
    assert stored.tobytes() == fly.tobytes()
    some = np.array([3, 31, 32, 99])  # rows across chunks, as a plan's where selects them
    assert read_features(ws.root, got.array_info(), some).tobytes() == pool(read_features(ws.root, source, some),
                                                                             how).tobytes()


def test_provenance_is_a_manifest_row(ws):
    source = ws.array_info("spatial", "vision", 0)
    assert probes_cli(["derive", "--data", str(ws.path), "--run", "spatial", "--pool", "mean", "--layer", "0"]) == 0
    (row,) = ws.query("SELECT run, tap, layer, site, tokens, source_zarr_path, op, shape, dtype, chunk_samples,"
                      " n_chunks, source_digest, code FROM derived_arrays").to_pylist()
    assert (row["run"], row["tap"], row["layer"], row["tokens"], row["op"]) == ("spatial", "vision", 0, "image",
                                                                              "pool_mean")
    assert row["source_zarr_path"] == source.zarr_path and row["shape"] == [N, source.shape[-1]]
    assert (row["dtype"], row["chunk_samples"], row["n_chunks"], row["code"]) == ("float32", 25, 4,
                                                                                   "probes.pooling.pool")
    assert row["source_digest"] == store_derived.source_digest(ws, source)


@pytest.mark.slow
def test_a_later_plan_reads_the_derived_array_not_the_tokens(ws):
    plan = parse_plan(PLAN)
    run_plan(plan, ws.path, in_process=True, **QUIET)
    on_the_fly = probe_rows(ws)
    preds = ws.rows("SELECT key, array_row, prediction, score FROM probe_predictions ORDER BY ALL")
    assert probes_cli(["derive", "--data", str(ws.path), "--run", "spatial", "--pool", "mean"]) == 0
    chunks = _source_chunks(ws)
    assert len(chunks) == 8
    for c in chunks:  # the token arrays are gone: only the derived arrays can feed this plan
        c.rename(c.with_name("moved-" + c.name))
    run_plan(plan, ws.path, in_process=True, force=True, **QUIET)
    assert probe_rows(ws) == on_the_fly  # the same probes, to the last digit recorded
    assert ws.rows("SELECT key, array_row, prediction, score FROM probe_predictions ORDER BY ALL") == preds
    other = {**PLAN, "probes": [{**PLAN["probes"][0], "kinds": {"pooled": {"pool": "max"}}}]}
    report = run_plan(parse_plan(other), ws.path, in_process=True, **QUIET)  # no max derivation: needs the tokens
    assert report.trained == 0 and report.failed == 8
    assert "is committed in the manifest but its file" in report.failures[0][1]  # proof the mean plan read none


@pytest.mark.slow
def test_a_stale_derivation_is_not_read_and_says_how_to_refresh(ws, capsys):
    assert probes_cli(["derive", "--data", str(ws.path), "--run", "spatial", "--layer", "1"]) == 0
    source = ws.array_info("spatial", "vision", 1)
    # A re-extracted chunk: new bytes, a new checksum, committed later than the derivation.
    with duckdb.connect(str(ws.manifest_path)) as con:
        con.execute("UPDATE chunks SET crc32c = crc32c + 1, committed_at = now() WHERE zarr_path = ? AND chunk = 2",
                    [source.zarr_path])
    plan = parse_plan(PLAN)
    tasks = [t for t in plan_tasks(plan, ws) if t.layer == 1]
    arrays, note = for_group(ws, [source], tasks)
    assert arrays is None and "is stale" in note and "python -m probes derive --run spatial --pool mean" in note
    logged = []
    run_plan(plan, ws.path, in_process=True, progress=False, log=logged.append)
    assert any("is stale" in line for line in logged)
    capsys.readouterr()
    assert probes_cli(["derive", "--data", str(ws.path), "--run", "spatial", "--layer", "1"]) == 0
    assert "recomputed: its source was re-extracted" in capsys.readouterr().out
    assert for_group(ws, [source], tasks)[0] is not None
    assert probes_cli(["derive", "--data", str(ws.path), "--run", "spatial", "--layer", "1"]) == 0
    assert "up to date" in capsys.readouterr().out


def test_dropping_the_run_drops_its_derived_arrays(ws):
    derive(ws, ws.array_info("spatial", "vision", 0), "mean")
    assert (ws.zarr_path / "spatial" / "_derived").is_dir()
    ws.drop_run("spatial")
    assert ws.rows("SELECT count(*) FROM derived_arrays") == [(0,)]
    assert not (ws.zarr_path / "spatial").exists()  # the bytes went with the run's folder


def test_bad_input_is_one_line(ws, capsys):
    assert probes_cli(["derive", "--data", str(ws.path), "--run", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: run nope has no token array") and err.count("\n") == 1


def test_a_v6_workspace_opens_and_gains_the_table(tmp_path):
    old = Workspace.open(tmp_path / "ws", migrations=schema_mod.MIGRATIONS[:6])
    rows, rel, latent = spatial_family(8)
    write_run(old, "spatial", rows, [spatial_features(rel, latent, 0)], (2, 2), chunk=4)
    with duckdb.connect(str(old.manifest_path)) as con:
        assert con.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = 'derived_arrays'"
                           ).fetchone() == (0,)
    ws = Workspace.open(old.path)
    assert ws.rows("SELECT max(version) FROM schema_version") == [(7,)]
    assert ws.rows("SELECT count(*) FROM chunks") == [(2,)]  # the run written at v6 is still there
    assert derive(ws, ws.array_info("spatial", "vision", 0), "mean").shape == (8, D)
    assert ws.rows("SELECT count(*) FROM derived_arrays") == [(1,)]


@pytest.mark.slow
def test_a_ragged_array_with_empty_samples_is_refused_and_the_rest_derived(tmp_path, capsys):
    """Answer tokens at layer 0: samples 0 and 3 have none (chunks of 3: one in each), so no pooled
    vector exists for them; the run's other arrays are still derived, a ragged one with tokens in every
    sample to the bit."""
    ws = Workspace.open(tmp_path / "ws")
    n, counts = 6, [0, 1, 2, 0, 3, 1]
    rows = [{"id": f"s{i}", "family": "spatial"} for i in range(n)]
    rng = np.random.default_rng(0)
    with ws.writer(RunInfo(run="r", model="m", dtype="float32", chunk_samples=4)) as w:
        w.set_samples(w.register_stimuli(rows, dataset="r"))
        img = w.array(ArraySpec(tap="llm", layer=0, tokens="image", shape=(3, D)))
        ans = w.array(ArraySpec(tap="llm", layer=0, tokens="answer", shape=(D,), ragged=True))
        full = w.array(ArraySpec(tap="llm", layer=1, tokens="answer", shape=(D,), ragged=True))
        w.write_batch(0, {img: rng.standard_normal((n, 3, D)).astype(np.float32),
                          ans: [rng.standard_normal((c, D)).astype(np.float32) for c in counts],
                          full: [rng.standard_normal((c + 1, D)).astype(np.float32) for c in counts]},
                      tokens=[TokenSpans(seq_len=12, image_start=1, image_count=3, grid_h=1, grid_w=3,
                                         answer_start=8, answer_count=c) for c in counts])
        w.finish()
    assert probes_cli(["derive", "--data", str(ws.path), "--run", "r"]) == 2
    out, err = capsys.readouterr()
    assert "llm.0.resid_post.image.pool_mean: derived" in out
    assert err.count("\n") == 1 and "r:llm/0/resid_post/answer chunk 0: 1 samples have no tokens" in err
    assert ws.rows("SELECT layer, tokens FROM derived_arrays ORDER BY ALL") == [(0, "image"), (1, "answer")]
    source = ws.array_info("r", "llm", 1, tokens="answer")
    got = store_derived.find(ws, source, "pool_mean")
    every = np.arange(n)
    assert read_features(ws.root, got.array_info(), every).tobytes() == pool(read_features(ws.root, source, every),
                                                                              "mean").tobytes()
