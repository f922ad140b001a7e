"""The workspace as a whole: creation, schema versions, read-only access, integrity, the CLI."""

from __future__ import annotations

import json
import shutil

import duckdb
import numpy as np
import pytest
from storetest_lib import python, write_run

from store import (
    ArraySpec,
    ProbeResult,
    RunInfo,
    SchemaVersionError,
    StoreError,
    Workspace,
    WorkspaceError,
    resolve_path,
    size_estimate,
)
from store import schema as schema_mod
from store.cli import main as cli


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """One finished run, copied per test that damages it."""
    path = tmp_path_factory.mktemp("store") / "ws"
    write_run(Workspace.open(path), n=24, chunk=8)
    return path


def _copy(written, tmp_path):
    dest = tmp_path / "ws"
    shutil.copytree(written, dest)
    return Workspace.open(dest)


def test_open_creates_a_workspace_and_honours_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("AGNOSIA_DATA", str(tmp_path / "from-env"))
    assert resolve_path() == tmp_path / "from-env" and resolve_path(tmp_path / "flag") == tmp_path / "flag"
    monkeypatch.delenv("AGNOSIA_DATA")
    assert str(resolve_path()) == "data"
    ws = Workspace.open(tmp_path / "new" / "ws")
    assert ws.manifest_path.is_file() and (ws.zarr_path / "zarr.json").is_file()
    assert ws.schema_version() == schema_mod.latest_version()
    with pytest.raises(WorkspaceError, match="no workspace"):
        Workspace.open(tmp_path / "missing", readonly=True)


def test_older_schema_is_migrated_newer_is_refused(tmp_path):
    # A workspace made at v1 is brought up to date step by step when opened for writing.
    ws = Workspace.open(tmp_path / "ws", migrations=schema_mod.MIGRATIONS[:1])
    latest = schema_mod.latest_version()
    with pytest.raises(SchemaVersionError, match="Open it once for writing"):
        Workspace.open(ws.path, readonly=True)
    Workspace.open(ws.path)
    assert ws.rows("SELECT version FROM schema_version ORDER BY version") == [(v,) for v in range(1, latest + 1)]
    assert "intervention" in ws.query("SELECT * FROM runs").column_names
    # A step this agnosia does not know: applied by a newer agnosia, refused by this one.
    step = schema_mod.Migration(latest + 1, "add runs.note",
                                lambda con: con.execute("ALTER TABLE runs ADD COLUMN note VARCHAR"))
    Workspace.open(ws.path, migrations=[*schema_mod.MIGRATIONS, step])
    assert "note" in ws.query("SELECT * FROM runs").column_names
    with pytest.raises(SchemaVersionError, match="newer than this agnosia reads"):
        Workspace.open(ws.path)


def _v2_workspace(path):
    """A workspace as agnosia wrote it at schema v2: a vision, a projector and an LLM array, and probes
    whose identity and per-sample predictions lived in params JSON."""
    ws = Workspace.open(path, migrations=schema_mod.MIGRATIONS[:2])
    with duckdb.connect(str(ws.manifest_path)) as con:
        con.execute("INSERT INTO runs (run, model, config, chunk_samples, bf16_policy, overflow_policy, status,"
                    " created_at) VALUES ('r1', 'm', '{}', 8, 'fp16', 'error', 'finished', now())")
        for tap, layer, site in [("vision", 0, "resid_post"), ("vision", 1, "resid_post"), ("projector", 0, "out"),
                                 ("llm", 0, "resid_post"), ("llm", 1, "resid_post"), ("attn", 1, "probs")]:
            con.execute("INSERT INTO activations (run, tap, layer, site, tokens, zarr_path, layout, shape, dims,"
                        " chunk_samples, n_chunks, dtype, stored_dtype, codec, values_per_row, created_at) VALUES"
                        " ('r1', ?, ?, ?, 'image', ?, 'dense', [8, 4], ['s', 'd'], 8, 1, 'float32', 'float16',"
                        " 'none', 4, now())", [tap, layer, site, f"r1/{tap}/{layer}/{site}/image"])
        probes = [  # two farm probes that differ only in C (replaced each other then: one survived) and a hand-made one
            ("vision", 0, "linear", {"key": "k-c1", "kind_params": {"C": 1.0}, "split": {"by": "hash", "seed": 0}}),
            ("llm", 1, "hidden_number", {"key": "k-hn", "kind_params": {}, "predictions": {"array_row": [3, 5],
                                                                                        "value": [7.0, 9.0]}}),
            ("llm", 0, "linear", None),
        ]
        for tap, layer, kind, params in probes:
            con.execute("INSERT INTO probes VALUES ('r1', ?, ?, 'resid_post', 'image', 'count', ?, 0, 6, 2, 'accuracy',"
                        " 0.5, 0.25, NULL, ?, now())", [tap, layer, kind, None if params is None else json.dumps(params)])
    return ws


def test_a_v2_workspace_migrates_keeping_every_probe_and_moving_predictions(tmp_path):
    ws = _v2_workspace(tmp_path / "ws")
    Workspace.open(ws.path)  # opened for writing: migrated
    got = ws.query("SELECT key, tap, layer, kind, kind_params, split, params FROM probes ORDER BY tap, layer").to_pylist()
    assert [(r["tap"], r["layer"], r["kind"]) for r in got] == [("llm", 0, "linear"), ("llm", 1, "hidden_number"),
                                                                ("vision", 0, "linear")]
    assert got[1]["key"] == "k-hn" and got[2]["key"] == "k-c1" and got[0]["key"]  # a hand-made row gets a hashed key
    assert json.loads(got[2]["kind_params"]) == {"C": 1.0} and json.loads(got[2]["split"])["by"] == "hash"
    assert "predictions" not in json.loads(got[1]["params"])
    assert ws.rows("SELECT key, array_row, prediction FROM probe_predictions ORDER BY array_row") == [
        ("k-hn", 3, 7.0), ("k-hn", 5, 9.0)]
    # Every array has its place along the data path: vision blocks, projector, LLM blocks (attn beside its block).
    depth = ws.rows("SELECT tap, layer, depth, stage FROM activations ORDER BY depth, tap")
    assert depth == [("vision", 0, 0, "vision"), ("vision", 1, 1, "vision"), ("projector", 0, 4, "projector"),
                     ("llm", 0, 5, "llm"), ("attn", 1, 6, "llm"), ("llm", 1, 6, "llm")]
    # A new probe differing only in kind parameters adds a row now, and the views keep working.
    ws.record_probes([ProbeResult(run="r1", tap="vision", layer=0, target="count", kind="linear", score=0.7,
                                  key="k-c10", kind_params={"C": 10.0})])
    assert ws.rows("SELECT count(*) FROM probes WHERE tap = 'vision'") == [(2,)]
    assert ws.rows("SELECT depth, n_seeds FROM v_probe_layers WHERE tap = 'llm' ORDER BY depth") == [(5, 1), (6, 1)]


def test_read_only_connections_refuse_writes(written):
    ws = Workspace.open(written, readonly=True)
    before = ws.rows("SELECT count(*) FROM chunks")
    with pytest.raises(StoreError, match="read-only"):
        ws.query("DELETE FROM chunks")
    with pytest.raises(StoreError, match="read-only"):
        ws.query("INSERT INTO runs (run, model, chunk_samples, bf16_policy, overflow_policy, status, created_at)"
                 " VALUES ('x', 'm', 1, 'fp16', 'error', 'running', now())")
    with ws.connect() as con, pytest.raises(duckdb.Error, match="read-only"):
        con.execute("DROP TABLE chunks")
    assert ws.rows("SELECT count(*) FROM chunks") == before


def test_truncated_manifest_and_missing_array_give_clear_errors(written, tmp_path):
    ws = _copy(written, tmp_path)
    shutil.rmtree(ws.zarr_path / "r1" / "llm" / "3" / "resid_post" / "image")
    with pytest.raises(WorkspaceError, match=r"missing on disk .* verify"):
        ws.read("r1", "llm", 3, tokens="image")
    rep = ws.verify()
    assert not rep.ok and any("array missing on disk" in p for p in rep.problems)
    with open(ws.manifest_path, "r+b") as f:
        f.truncate(4096)
    with pytest.raises(WorkspaceError, match="not a readable DuckDB database.*truncated or corrupted"):
        Workspace.open(ws.path, readonly=True)
    assert cli(["verify", "--data", str(ws.path)]) == 2  # an error message, not a traceback


def test_verify_finds_a_corrupted_chunk_and_the_cli_exits_non_zero(written, tmp_path, capsys):
    ws = _copy(written, tmp_path)
    assert cli(["verify", "--data", str(ws.path)]) == 0
    chunk = ws.zarr_path / "r1" / "llm" / "3" / "resid_post" / "image" / "c.1.0.0"
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0xFF
    chunk.write_bytes(bytes(data))
    block = ws.zarr_path / "r1" / "llm" / "3" / "resid_post" / "answer" / "b2" / "rows" / "c.0.0"
    block.unlink()
    capsys.readouterr()
    assert cli(["verify", "--data", str(ws.path)]) == 1
    out = capsys.readouterr().out
    assert "chunk 1 (rows 8-15) checksum mismatch" in out and "c.1.0.0" in out
    assert "chunk 2 unreadable" in out and "2 problem(s)" in out


def test_probes_and_views_answer_common_questions(written, tmp_path):
    ws = _copy(written, tmp_path)
    ws.record_probes([
        ProbeResult(run="r1", tap="llm", layer=layer, target="count", kind="linear", seed=seed,
                    score=0.5 + 0.1 * layer - 0.01 * seed, control_score=0.3, n_train=16, n_test=8)
        for layer in (1, 2, 3) for seed in (0, 1)
    ])
    ws.record_probes([ProbeResult(run="r1", tap="llm", layer=3, target="count", kind="linear", seed=0, score=0.2)])
    assert ws.rows("SELECT count(*) FROM probes") == [(6,)]  # same identity: replaced, not duplicated
    assert ws.rows("SELECT depth, stage FROM activations WHERE tokens = 'image'") == [(6, "llm")]  # 0 vision blocks + 3
    best = ws.query("SELECT layer, n_seeds FROM v_best_probe").to_pylist()
    assert best == [{"layer": 2, "n_seeds": 2}]
    arrays = ws.query("SELECT tokens, chunks_committed, n_chunks, bytes_per_value FROM v_arrays ORDER BY tokens").to_pylist()
    assert arrays[1] == {"tokens": "image", "chunks_committed": 3, "n_chunks": 3, "bytes_per_value": 2.0}
    runs = ws.query("SELECT status, arrays, chunks_committed, chunks_expected FROM v_runs").to_pylist()
    assert runs == [{"status": "finished", "arrays": 2, "chunks_committed": 6, "chunks_expected": 6}]


@pytest.mark.slow
def test_drop_run_removes_arrays_and_rows_atomically(written, tmp_path):
    ws = _copy(written, tmp_path)
    write_run(ws, run="r2", n=8)
    assert cli(["drop-run", "r1", "--data", str(ws.path)]) == 2  # without --yes: only says what it would do
    assert cli(["drop-run", "r1", "--yes", "--data", str(ws.path)]) == 0
    assert ws.rows("SELECT DISTINCT run FROM activations") == [("r2",)]
    assert ws.rows("SELECT count(*) FROM samples WHERE run = 'r1'") == [(0,)]
    assert not (ws.zarr_path / "r1").exists() and not (ws.path / ".trash").exists()
    assert ws.verify().ok
    assert ws.rows("SELECT count(*) FROM stimuli") == [(24,)]  # stimuli outlive runs


def test_size_estimate_counts_bytes_before_running():
    p = size_estimate(samples=2048, layers=28, tokens=256, dim=1536, taps=2, models=1)
    assert p.values == 2048 * 28 * 256 * 1536 * 2 and p.bytes == p.values * 2
    assert size_estimate(samples=10, layers=1, tokens=1, dim=10, codec="bitround7").bytes < 200
    with pytest.raises(StoreError, match="--samples must be a positive integer"):
        size_estimate(samples=0, layers=1, tokens=1, dim=1)


def test_size_estimate_equals_the_bytes_the_store_writes(tmp_path):
    """The store pads a dense array's last chunk: 10 samples in chunks of 4 take 12 samples' bytes, and
    the estimate says so (it is the dry run's byte planner too)."""
    ws = Workspace.open(tmp_path / "ws")
    write_run(ws, n=10, chunk=4)
    image = next(a for a in ws.arrays("r1") if a.tokens == "image")
    est = size_estimate(samples=10, layers=1, tokens=image.item_shape[0], dim=image.item_shape[1],
                        dtype=image.stored_dtype, chunk_samples=4)
    assert est.raw_bytes == image.bytes == 12 * image.item_shape[0] * image.item_shape[1] * 2


@pytest.mark.slow
def test_cli_help_info_size_query(written, tmp_path, capsys):
    out = python("-m", "store", "--help")
    assert out.returncode == 0 and all(c in out.stdout for c in ("info", "verify", "size", "drop-run"))
    assert cli(["info", "--data", str(written)]) == 0
    text = capsys.readouterr().out
    assert "r1" in text and "finished" in text and "6/6" in text
    assert cli(["info", "--run", "r1", "--json", "--data", str(written)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {a["tokens"] for a in info["arrays"]} == {"image", "answer"}
    assert cli(["size", "--samples", "100", "--layers", "2", "--tokens", "4", "--dim", "8", "--json",
                "--data", str(tmp_path / "none")]) == 0
    assert json.loads(capsys.readouterr().out)["bytes"] == 100 * 2 * 4 * 8 * 2  # two chunks of 50, none padded
    assert cli(["query", "SELECT tap, layer, count(*) AS n FROM activations GROUP BY ALL", "--json",
                "--data", str(written)]) == 0
    assert json.loads(capsys.readouterr().out) == [{"tap": "llm", "layer": 3, "n": 2}]
    assert cli(["info", "--data", str(tmp_path / "nothing")]) == 2


def test_run_level_tensors(tmp_path):
    from store import RunInfo

    ws = Workspace.open(tmp_path / "ws")
    unembed = np.random.default_rng(0).standard_normal((50, 8)).astype(np.float32)
    with ws.writer(RunInfo(run="r", model="m")) as w:
        w.write_tensor("unembed", unembed, module="lm_head")
    assert np.array_equal(ws.read_tensor("r", "unembed"), unembed)
    assert ws.verify().ok


def test_run_tensors_written_together_share_one_fsync_pass_and_a_resume_rewrites_only_a_changed_one(
        tmp_path, monkeypatch):
    from store import RunInfo
    from store import arrays as layout

    ws = Workspace.open(tmp_path / "ws")
    info = RunInfo(run="r", model="m")
    rng = np.random.default_rng(0)
    weight, norm = rng.standard_normal((50, 8)).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    passes: list[list[str]] = []
    real = layout.fsync_node_chains

    def counted(workspace, zarr_paths, pool=None, files=()):
        passes.append(list(zarr_paths))
        return real(workspace, zarr_paths, pool, files)

    monkeypatch.setattr(layout, "fsync_node_chains", counted)
    with ws.writer(info) as w:
        w.write_tensors({"lm_head.weight": weight, "final_norm.weight": norm},
                        modules={"lm_head.weight": "lm_head", "final_norm.weight": "model.norm"})
    assert [p for p in passes if "_tensors" in p[0]] == [["r/_tensors/lm_head.weight", "r/_tensors/final_norm.weight"]]
    assert ws.rows("SELECT name, module, shape FROM tensors ORDER BY name") == [
        ("final_norm.weight", "model.norm", [8]), ("lm_head.weight", "lm_head", [50, 8])]
    kept = ws.zarr_path / "r/_tensors/lm_head.weight/c.0.0"
    stat = kept.stat()
    with ws.writer(info) as w:  # a resume: the weight is the same, the norm changed
        w.write_tensors({"lm_head.weight": weight, "final_norm.weight": norm * 2},
                        modules={"lm_head.weight": "lm_head", "final_norm.weight": "model.norm"})
    assert (kept.stat().st_ino, kept.stat().st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)
    assert np.array_equal(ws.read_tensor("r", "lm_head.weight"), weight)
    assert np.array_equal(ws.read_tensor("r", "final_norm.weight"), norm * 2)
    assert ws.rows("SELECT count(*) FROM tensors") == [(2,)]
    assert ws.verify().ok


def test_run_tensors_written_together_land_together(tmp_path, monkeypatch):
    """A writer killed while writing the second of two tensors' files leaves neither row; the next
    writer writes both."""
    from store import RunInfo
    from store.writer.tensors import RunTensors

    ws = Workspace.open(tmp_path / "ws")
    info = RunInfo(run="r", model="m")
    weight, norm = np.ones((6, 4), dtype=np.float32), np.full(4, 2.0, dtype=np.float32)
    real = RunTensors._write_tensor_files

    def dies_on_the_norm(self, t):
        if t.name == "final_norm.weight":
            raise KeyboardInterrupt("killed while writing the second tensor")
        return real(self, t)

    monkeypatch.setattr(RunTensors, "_write_tensor_files", dies_on_the_norm)
    with pytest.raises(KeyboardInterrupt), ws.writer(info) as w:
        w.write_tensors({"lm_head.weight": weight, "final_norm.weight": norm})
    assert ws.rows("SELECT count(*) FROM tensors") == [(0,)]
    assert ws.verify().ok
    monkeypatch.setattr(RunTensors, "_write_tensor_files", real)
    with ws.writer(info) as w:
        w.write_tensors({"lm_head.weight": weight, "final_norm.weight": norm})
    assert np.array_equal(ws.read_tensor("r", "final_norm.weight"), norm)
    assert ws.rows("SELECT count(*) FROM tensors") == [(2,)]


def test_resume_ignores_keys_added_later_with_no_value(tmp_path):
    """A run written before the manifest grew a key (stored config lacks it) resumes when the new
    key is null, and is still refused when a real setting differs."""
    from store import RunInfo, SpecMismatchError

    ws = Workspace.open(tmp_path / "ws")
    old = RunInfo(run="r1", model="m", config={"model": {"path": "x"}, "batch_size": 2})
    ws.writer(old).close()
    newer = RunInfo(run="r1", model="m", config={"model": {"path": "x", "device_map": None}, "batch_size": 2,
                                                 "intervention": None})
    ws.writer(newer).close()
    changed = RunInfo(run="r1", model="m", config={"model": {"path": "y"}, "batch_size": 2})
    with pytest.raises(SpecMismatchError, match="config"):
        ws.writer(changed)


def test_a_new_file_takes_every_step_at_once_and_an_upgrade_keeps_the_steps_it_finished():
    def broken(con):
        raise RuntimeError("step 3 fails")

    steps = [*schema_mod.MIGRATIONS[:2], schema_mod.Migration(3, "fails", broken)]
    con = duckdb.connect()
    with pytest.raises(RuntimeError, match="step 3 fails"):
        schema_mod.migrate(con, steps)
    assert schema_mod.current_version(con) == 0   # a new file: nothing half-made is kept
    assert schema_mod.migrate(con, steps[:1]) == [1]
    with pytest.raises(RuntimeError, match="step 3 fails"):
        schema_mod.migrate(con, steps)
    assert schema_mod.current_version(con) == 2   # an upgrade: step 2 stays applied


def test_a_manifest_built_ahead_lands_only_in_a_new_workspace_and_leaves_no_temporary_files(tmp_path):
    from store.ahead import ManifestAhead

    with ManifestAhead() as ahead:
        built = ahead.take()
        assert built is not None and built.is_file()
        ws = Workspace.open(tmp_path / "new", ahead=ahead)
        assert ws.created and ws.rows("SELECT max(version) FROM schema_version") == [
            (schema_mod.latest_version(),)]
        with ws.writer(RunInfo(run="r", model="m")) as w:   # a working manifest: a run starts and finishes
            w.set_samples(w.register_stimuli([{"id": "a"}], dataset="s"))
            w.finish(partial_ok=True)
        before = (ws.manifest_path.stat().st_ino, ws.manifest_path.read_bytes())
        again = Workspace.open(ws.path, ahead=ahead)          # not new: the file built ahead is not used
        assert not again.created and (ws.manifest_path.stat().st_ino, ws.manifest_path.read_bytes()) == before
        assert again.rows("SELECT status FROM runs") == [("finished",)]
    assert not built.parent.exists()
    assert sorted(p.name for p in ws.path.iterdir()) == ["arrays", "manifest.duckdb", "writer.lock"]


def test_declaring_many_arrays_writes_every_row_and_depth_in_one_statement_each(tmp_path):
    """Asserts: 60 arrays over 3 token kinds per hook point, declared in one call, get one manifest
    row each with its shape, dims and depth (every kind of a hook point at the same depth), and a
    deeper layer declared later renumbers the run's arrays."""
    ws = Workspace.open(tmp_path / "ws")
    with ws.writer(RunInfo(run="r", model="m", chunk_samples=4)) as w:
        w.set_samples(w.register_stimuli([{"id": str(i)} for i in range(8)], dataset="s"))
        specs = [ArraySpec(tap=tap, layer=layer, tokens=kind, shape=(3, 5) if kind == "image" else (1, 5))
                 for tap in ("vision", "llm") for layer in range(10) for kind in ("image", "last", "answer")
                 if not (tap == "vision" and kind != "image")]
        w.arrays(specs)
        got = w.rows("SELECT tap, layer, tokens, shape, dims, depth, stage FROM activations ORDER BY ALL")
        assert len(got) == len(specs) == 40
        assert ("llm", 3, "last", [8, 1, 5], ["sample", "last_token", "dim"], 10 + 3 + 3, "llm") in got
        assert all(d == (layer if tap == "vision" else 13 + layer) for tap, layer, _, _, _, d, _ in got)
        w.array(ArraySpec(tap="vision", layer=11, tokens="image", shape=(3, 5)))  # 12 vision blocks now
        assert w.rows("SELECT depth FROM activations WHERE tap = 'llm' AND layer = 0") == [(15,)] * 3
        w.finish(partial_ok=True)


def test_array_bytes_are_the_sum_of_their_chunks_and_a_retried_commit_adds_nothing(written, tmp_path):
    from datetime import datetime

    from store import db
    from store.writer.committer import _insert_chunks

    ws = _copy(written, tmp_path)
    totals = ws.rows("SELECT a.zarr_path, a.bytes, sum(c.nbytes) FROM activations a JOIN chunks c USING (run, zarr_path)"
                     " GROUP BY ALL ORDER BY 1")
    assert len(totals) == 2 and all(b == s > 0 for _, b, s in totals)
    # A commit retried after its first COMMIT landed: the same chunk rows again, plus one new one.
    (path, bytes_before, _), run = totals[0], "r1"
    rows = ws.rows("SELECT chunk, row_start, row_stop, n_rows, nbytes FROM chunks WHERE zarr_path = ?", [path])
    handle = type("H", (), {"info": type("I", (), {"zarr_path": path})()})()
    chunks = [type("C", (), {"handle": handle, "chunk": c, "row_start": a, "row_stop": b, "n_rows": n, "nbytes": nb})()
              for c, a, b, n, nb in rows]
    chunks.append(type("C", (), {"handle": handle, "chunk": 99, "row_start": 0, "row_stop": 1, "n_rows": 1,
                                 "nbytes": 1234})())
    with db.connect(ws.manifest_path, read_only=False) as con:
        # A writer whose commits all succeeded inserts without the conflict check: a row that is
        # there fails its insert (which is why a failed commit turns the check back on).
        with pytest.raises(duckdb.ConstraintException):
            _insert_chunks(con, run, chunks, [(0, 0, 0, None)] * len(chunks), datetime.now(), may_exist=False)
        _insert_chunks(con, run, chunks, [(0, 0, 0, None)] * len(chunks), datetime.now())
    after = dict(ws.rows("SELECT zarr_path, bytes FROM activations"))
    assert after[path] == bytes_before + 1234
    assert after[totals[1][0]] == totals[1][1]


@pytest.mark.parametrize("row", [
    {"id": "a", "prompt": "Ü \"q\"\n", "prompts": {"b": "x", "a": ["y", None]}, "params": {"n": np.int64(3), "f": 0.1},
     "truth": {"matrix": [[1, 2], [3, 4]], "nan": float("nan"), "set": {3, 1}}, "seed": None},
    {"id": "b"},
])
def test_a_stimulus_digest_is_the_sha1_of_its_fields_canonical_json(tmp_path, row):
    """The digest a re-registration compares: its bytes must not change with how they are built."""
    import hashlib
    import json

    from store.records import _json_default
    from store.writer.stimuli import STIMULUS_FIELDS

    content = {k: row.get(k) for k in ("id", *STIMULUS_FIELDS)}
    ws = Workspace.open(tmp_path / "ws")
    with ws.writer(RunInfo(run="r", model="none")) as w:
        w.register_stimuli([row], dataset="d")
        w.finish(partial_ok=True)
    # The formula of the first stores, spelled out: a workspace registered then must still match.
    canonical = json.dumps(content, sort_keys=True, default=_json_default, allow_nan=True)
    assert ws.rows("SELECT digest FROM stimuli") == [(hashlib.sha1(canonical.encode()).hexdigest(),)]


@pytest.mark.parametrize("value", [
    "Ü \"q\"\n\t", "", 3, 10**30, -2.5, np.int64(7), float("inf"), True, None, np.float32(0.1), np.arange(3),
    {"b": 1, "a": {"d": [1, None], "c": "ß"}}, [{"z": 1, "y": 2}], {"set": {3, 1}},
])
def test_to_json_is_canonical_json_dumps(value):
    """to_json keeps one encoder and fast paths for strings and integers; its bytes stay json.dumps's."""
    import json

    from store.records import _json_default, json_object, to_json

    def dumps(v):
        return json.dumps(v, sort_keys=True, default=_json_default, allow_nan=True)

    assert to_json(value) == (None if value is None else dumps(value))
    record = {"value": value, "a": "x", "z": None}
    assert json_object({k: to_json(v) for k, v in record.items()}) == dumps(record)
