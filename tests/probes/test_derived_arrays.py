"""Derived arrays: pooled features stored once per chunk, read by later plans instead of the tokens."""

from __future__ import annotations

import re
import shutil

import duckdb
import numpy as np
import pytest
import yaml
from probetest_lib import D, probe_rows, spatial_family, spatial_features, write_run

from probes import run_plan
from probes.cli import main as probes_cli
from probes.derived import derive, for_group, group_status
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
    run_plan(parse_plan({**PLAN, "derive": "never"}), ws.path, in_process=True, **QUIET)
    assert ws.rows("SELECT count(*) FROM derived_arrays") == [(0,)]  # never: the store is left as it is
    plan = parse_plan(PLAN)
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
    other = {**PLAN, "derive": "never", "probes": [{**PLAN["probes"][0], "kinds": {"pooled": {"pool": "max"}}}]}
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
    plan = parse_plan({**PLAN, "derive": "never"})
    tasks = [t for t in plan_tasks(plan, ws) if t.layer == 1]
    arrays, note = for_group(ws, [source], tasks)
    assert arrays is None and "is stale" in note and "python -m probes derive --run spatial --pool mean" in note
    logged = []
    run_plan(plan, ws.path, in_process=True, progress=False, log=logged.append)
    assert any("is stale" in line for line in logged)
    assert for_group(ws, [source], tasks)[0] is None     # never: still stale after the plan
    logged.clear()
    run_plan(parse_plan(PLAN), ws.path, in_process=True, force=True, progress=False, log=logged.append)
    assert any("vision.1.resid_post.image.pool_mean refreshed (its source was re-extracted)" in line for line in logged)
    assert not any("is stale" in line for line in logged)
    assert for_group(ws, [source], tasks)[0] is not None  # auto refreshed it before dispatching
    with duckdb.connect(str(ws.manifest_path)) as con:    # stale again, for derive's own refresh
        con.execute("UPDATE chunks SET crc32c = crc32c + 1, committed_at = now() WHERE zarr_path = ? AND chunk = 2",
                    [source.zarr_path])
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
    assert ws.rows("SELECT max(version) FROM schema_version") == [(schema_mod.latest_version(),)]
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


STREAMED = {"name": "streamed", "defaults": {"seeds": [0, 1]},
            "probes": [{"runs": ["spatial"], "layers": "all", "targets": ["spatial.relation", "truth:flag_1"],
                        "kinds": {"ridge": {"pool": "mean", "alphas": [0.1, 1.0, 10.0]},
                                  "lda": {"pool": "mean", "shrinkage": 0.1},
                                  "nearest_centroid": {"pool": "mean"}}}]}


def _tasks(ws, plan, layer=0):
    return [t for t in plan_tasks(parse_plan(plan), ws) if t.layer == layer]


@pytest.mark.slow
def test_streamed_kinds_read_the_derived_array_not_the_tokens(ws):
    """ridge, lda and nearest_centroid pool inside probes/stream.py: with a fresh derived array they
    read it instead, to the same records and predictions, and none of the token chunks."""
    tokens = run_plan(parse_plan({**STREAMED, "derive": "never"}), ws.path, in_process=True, **QUIET)
    assert tokens.trained == 24 and tokens.failed == 0, tokens.failures[:2]
    on_the_fly = probe_rows(ws)
    preds = ws.rows("SELECT key, array_row, prediction, score FROM probe_predictions ORDER BY ALL")
    assert probes_cli(["derive", "--data", str(ws.path), "--run", "spatial", "--pool", "mean"]) == 0
    for c in _source_chunks(ws):
        c.rename(c.with_name("moved-" + c.name))
    derived = run_plan(parse_plan(STREAMED), ws.path, in_process=True, force=True, **QUIET)
    assert derived.trained == 24 and derived.failed == 0, derived.failures[:2]
    assert probe_rows(ws) == on_the_fly
    assert ws.rows("SELECT key, array_row, prediction, score FROM probe_predictions ORDER BY ALL") == preds
    source = ws.array_info("spatial", "vision", 0)
    per_row = source.shape[1] * np.dtype(source.stored_dtype).itemsize  # T stored values per feature
    assert derived.read_bytes * per_row == tokens.read_bytes * 4        # d float32 per sample instead of T x d


def test_which_groups_pool_one_way(ws):
    """A group reads a derived array only when every task's features are pool(X, how) with one how."""
    derive(ws, ws.array_info("spatial", "vision", 0), "mean")
    sources = [ws.array_info("spatial", "vision", 0)]
    mixed = {**STREAMED, "probes": [{**STREAMED["probes"][0], "kinds": {"pooled": {"pool": "mean"},
                                                                        "ridge": {"pool": "mean"}}}]}
    assert for_group(ws, sources, _tasks(ws, mixed))[0] is not None      # pooled and ridge on sample targets
    token = {**STREAMED, "probes": [{**STREAMED["probes"][0], "targets": ["spatial.relation", "g2m.cell_color"],
                                     "kinds": {"ridge": {"pool": "mean"}}}]}
    assert for_group(ws, sources, _tasks(ws, token))[0] is None          # a token target needs every token
    two = {**STREAMED, "probes": [{**STREAMED["probes"][0], "kinds": {"ridge": {"pool": "mean"},
                                                                      "lda": {"pool": "max"}}}]}
    assert for_group(ws, sources, _tasks(ws, two))[0] is None            # two poolings: no one array serves both
    linear = {**STREAMED, "probes": [{**STREAMED["probes"][0], "targets": ["g2m.cell_color"],
                                      "kinds": {"linear": {}}}]}
    assert for_group(ws, sources, _tasks(ws, linear))[0] is None
    assert group_status(ws, sources, _tasks(ws, linear), auto=True).status is None   # auto derives nothing for it
    fresh = group_status(ws, [ws.array_info("spatial", "vision", 1)], _tasks(ws, STREAMED, 1), auto=True)
    assert fresh.status == "to derive" and fresh.arrays[0].shape == (N, D) and fresh.todo[0].layer == 1


@pytest.mark.slow
def test_derive_auto_derives_on_first_use_and_never_leaves_the_store_alone(ws):
    logged = []
    plan = {**STREAMED, "probes": [{**STREAMED["probes"][0], "where": "array_row < 40"}]}
    never = run_plan(parse_plan({**plan, "derive": "never"}), ws.path, in_process=True, progress=False,
                     log=logged.append)
    assert ws.rows("SELECT count(*) FROM derived_arrays") == [(0,)] and never.failed == 0
    logged.clear()
    first = run_plan(parse_plan(plan), ws.path, in_process=True, force=True, progress=False, log=logged.append)
    derived_lines = [line for line in logged if "derive: auto" in line]
    assert len(derived_lines) == 2 and all(" derived, 100 x 16 float32 from spatial:vision/" in x for x in derived_lines)
    # The whole array, though the plan selects 40 rows: a later where: reads it too.
    assert ws.rows("SELECT layer, op, shape FROM derived_arrays ORDER BY layer") == [(0, "pool_mean", [N, D]),
                                                                                      (1, "pool_mean", [N, D])]
    assert first.read_bytes * (4 * 2) == never.read_bytes * 4  # its groups read them: d float32, not T = 4 float16
    for c in _source_chunks(ws):
        c.rename(c.with_name("moved-" + c.name))
    logged.clear()
    later = run_plan(parse_plan({**plan, "probes": [{**plan["probes"][0], "where": "array_row >= 40"}]}), ws.path,
                     in_process=True, progress=False, log=logged.append)
    assert later.trained == 24 and later.failed == 0 and not any("derive: auto" in x for x in logged)


@pytest.mark.slow
def test_dry_run_shows_what_each_group_reads_and_writes_nothing(ws, capsys):
    plan_file = ws.path.parent / "plan.yaml"
    # A group of two poolings (layer 0, where: below): no one derived array serves it, it reads the tokens.
    both = {"runs": ["spatial"], "layers": [0], "where": "array_row < 50", "targets": ["truth:flag_1"], "tag": "both",
            "kinds": {"ridge": {"pool": "mean"}, "lda": {"pool": "max"}}}
    plan_file.write_text(yaml.safe_dump({**STREAMED, "probes": [STREAMED["probes"][0], both]}))
    line = re.compile(r"^  (\S+)\s+(?:in-memory|streamed|subsample)\s+(fresh|to derive|to refresh|stale|-)\s+(\d+)"
                      r"\s+(\d+)\s+([\d.]+)\s")

    def groups() -> tuple[list[tuple[str, int, float]], str]:
        assert probes_cli([str(plan_file), "--data", str(ws.path), "--dry-run", "-v"]) == 0
        out = capsys.readouterr().out
        got = [m.groups() for m in map(line.match, out.splitlines()) if m]
        return sorted((status, int(rows), float(mib)) for _, status, _, rows, mib in got), out

    got, out = groups()
    assert ws.rows("SELECT count(*) FROM derived_arrays") == [(0,)]            # the dry run derived nothing
    # The streamed entry's two layers differ only in their layer: one job (probes/trainers/select.py merge_layers).
    assert got == [("-", 50, round(50 * 4 * D * 2 / 2**20, 1)),                  # T = 4 float16 values per feature
                   ("to derive", N, round(2 * N * D * 4 / 2**20, 1))]
    assert f"derive: auto first derives 2 array(s) on this client, reading {2 * N * 4 * D * 2 / 2**20:.1f} MiB" in out
    derive(ws, ws.array_info("spatial", "vision", 0), "mean")
    got, out = groups()
    assert [g[0] for g in got] == ["-", "to derive"] and "first derives 1 array(s)" in out   # layer 1 still is
    path = ws.array_info("spatial", "vision", 0).zarr_path
    with duckdb.connect(str(ws.manifest_path)) as con:    # layer 0's source re-extracted since
        con.execute("UPDATE chunks SET committed_at = now() WHERE zarr_path = ? AND chunk = 0", [path])
    got, out = groups()
    assert [g[0] for g in got] == ["-", "to refresh"] and "first derives 2 array(s)" in out
    plan_file.write_text(yaml.safe_dump({**STREAMED, "derive": "never"}))
    got, out = groups()
    assert [g[0] for g in got] == ["stale"] and "first derives" not in out       # layer 0 stale, layer 1 never derived
    # stale: the tokens, on the fly; a pass per kind (3 parameter sets) over each of the 2 layers
    assert got[0][2] == round(3 * 2 * N * 4 * D * 2 / 2**20, 1)


def test_verify_checks_derived_arrays(ws):
    """store verify: a derived array's chunks are there and read back, its node matches its row;
    a stale one is a note (readers pool on the fly), a missing or damaged one a problem."""
    got = derive(ws, ws.array_info("spatial", "vision", 0), "mean")
    derive(ws, ws.array_info("spatial", "vision", 1), "max")
    rep = ws.verify()
    assert rep.ok and not rep.warnings and rep.derived == 2, (rep.problems, rep.warnings)
    assert rep.bytes_checked >= 2 * N * D * 4
    source = ws.array_info("spatial", "vision", 1)
    with duckdb.connect(str(ws.manifest_path)) as con:   # layer 1 re-extracted since it was derived
        con.execute("UPDATE chunks SET committed_at = now() WHERE zarr_path = ? AND chunk = 1", [source.zarr_path])
    rep = ws.verify()
    assert rep.ok and len(rep.warnings) == 1, (rep.problems, rep.warnings)
    assert "vision.1.resid_post.image.pool_max is stale" in rep.warnings[0]
    assert "python -m probes derive --run spatial --pool max" in rep.warnings[0]
    chunk = ws.zarr_path / got.zarr_path / "c.2.0"
    chunk.write_bytes(chunk.read_bytes()[:100])             # a truncated chunk file
    (ws.zarr_path / got.zarr_path / "c.3.0").unlink()
    rep = ws.verify()
    assert len(rep.problems) == 1 and "chunk 2 (rows 50-74) unreadable" in rep.problems[0], rep.problems
    assert "c.2.0 is 100 bytes, expected 1600" in rep.problems[0]
    with duckdb.connect(str(ws.manifest_path)) as con:
        con.execute("UPDATE derived_arrays SET shape = [99, 16] WHERE op = 'pool_mean'")
    problems = ws.verify().problems
    assert len(problems) == 1 and "its derived_arrays row says (99, 16)" in problems[0], problems
    assert ws.verify(run="other").derived == 0                 # another run's check leaves them out


def test_store_verify_cli_names_derived_arrays(ws, capsys):
    from store.cli import main as store_cli

    derive(ws, ws.array_info("spatial", "vision", 0), "mean")
    assert store_cli(["verify", "--data", str(ws.path)]) == 0
    assert "2 array(s) and 1 derived array(s)" in capsys.readouterr().out
    (ws.zarr_path / "spatial/_derived/vision.0.resid_post.image.pool_mean/c.0.0").unlink()
    assert store_cli(["verify", "--data", str(ws.path)]) == 1
    out = capsys.readouterr().out
    assert "PROBLEM: derived array spatial/_derived/vision.0.resid_post.image.pool_mean: chunk 0 (rows 0-24)" in out


def test_one_token_arrays_are_not_derived(ws):
    """Asserts: a dense array of one token per sample (``last``) is no candidate for a derived array
    (pooling it is the identity; `make demo` derived float32 copies of its float16 last-token arrays),
    while the fixture's image-token arrays are."""
    from dataclasses import replace

    from probes.derived import poolable

    tokens = ws.array_info("spatial", "vision", 0)
    assert poolable(tokens) and tokens.shape[1] > 1
    one = replace(tokens, shape=(tokens.shape[0], 1, tokens.shape[-1]), tokens="last")
    assert not poolable(one)
