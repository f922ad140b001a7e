"""The pipeline with its arrays in an object store: `python -m store init --arrays s3://...`, a real
`python -m extract` process writing the toy counting VLM's activations into the bucket, and a
real Dask LocalCluster (worker processes) training probes that read them back from it. Both
must give what the same pipeline gives on a local workspace."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from child_env import child_env

from probes.farm import run_plan
from probes.plan import load_plan
from store import Workspace

pytestmark = pytest.mark.slow  # a real object store and Dask workers per test

REPO = Path(__file__).resolve().parents[2]
TOY = REPO / "lab" / "checkpoints" / "toy-counter"


def _env(extra: dict[str, str]) -> dict[str, str]:
    return child_env(**{"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **extra})


def _python(*args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _ok(proc: subprocess.Popen[str], timeout: float = 300) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    _ok(_python("-m", "stimuli", "go", "--out", str(root / "go"), "--preset", "small", "--variation", "mild",
                "--counts", "0-23", "--n", "1", "--seed", "4", env=_env({})))
    manifest = root / "extract.yaml"
    manifest.write_text(yaml.safe_dump({
        "run": "toy",
        "model": {"path": str(TOY), "dtype": "float32", "device": "cpu"},
        "stimuli": [{"set": str(root / "go"), "task": "multimodal_num"}],
        "taps": [{"tap": "vision", "layers": [-1]}, {"tap": "llm", "layers": [0, -1], "tokens": ["image", "last"]}],
        "generation": {"max_new_tokens": 4},
        "batch_size": 4,
        "chunk_samples": 8,
    }))
    plan = root / "probes.yaml"
    plan.write_text(yaml.safe_dump({
        "name": "remote",
        "defaults": {"seeds": [0, 1], "test_fraction": 0.25},
        "probes": [
            {"taps": ["vision", "llm"], "tokens": ["image"], "targets": ["go.intersection"], "kinds": ["linear"]},
            {"taps": ["llm"], "tokens": ["last"], "targets": ["truth:regime"], "kinds": {"pooled": {"pool": "mean"}}},
        ],
    }))
    return root, manifest, plan


def test_extraction_writes_to_the_bucket_and_dask_workers_read_it(files, s3, tmp_path):
    root, manifest, plan = files
    remote, local = tmp_path / "remote", tmp_path / "local"
    env = _env(s3.env)
    init = _python("-m", "store", "init", "--data", str(remote), "--arrays", s3.url("pipeline"), env=env)
    assert "arrays at s3://" in _ok(init)
    # Both extractions at once, as real processes: one into the bucket, one into a local folder.
    runs = [_python("-m", "extract", str(manifest), "--data", str(d), "--no-progress", env=env) for d in (remote, local)]
    for proc in runs:
        assert "24 samples (24 computed now" in _ok(proc)

    ws_r, ws_l = Workspace.open(remote, readonly=True), Workspace.open(local, readonly=True)
    assert ws_r.root.url == s3.url("pipeline") and not ws_l.root.remote
    assert {p.name for p in (remote / "arrays").rglob("*") if p.is_file()} == {"zarr.json"}
    assert len(s3.fs.find(f"{s3.bucket}/pipeline/toy")) > len(ws_r.arrays("toy"))
    rep = ws_r.verify()
    assert rep.ok and not rep.warnings, (rep.problems, rep.warnings)
    assert (ws_r.rows("SELECT zarr_path, chunk, crc32c FROM chunks ORDER BY ALL")
            == ws_l.rows("SELECT zarr_path, chunk, crc32c FROM chunks ORDER BY ALL"))
    for a in ws_l.arrays("toy"):
        np.testing.assert_array_equal(ws_r.read("toy", a.tap, a.layer, a.site, a.tokens),
                                      ws_l.read("toy", a.tap, a.layer, a.site, a.tokens), err_msg=a.zarr_path)

    # The farm: a LocalCluster of 2 worker processes, each fetching its rows from the bucket.
    out = _ok(_python("-m", "probes", str(plan), "--data", str(remote), "--workers", "2", "--no-progress", env=env))
    assert "10 trained, 0 skipped (done), 0 failed" in out and "on 2 worker(s)" in out, out
    run_plan(load_plan(plan), local, in_process=True, progress=False)
    sql = ("SELECT tap, layer, tokens, target, kind, seed, n_train, n_test, score, control_score FROM probes"
           " ORDER BY tap, layer, tokens, target, kind, seed")
    got, want = ws_r.rows(sql), ws_l.rows(sql)
    assert len(want) == 2 * (1 + 2 + 2)  # seeds x (vision 1 layer; llm 2 layers at image, 2 at last)
    assert [g[:8] for g in got] == [w[:8] for w in want]
    np.testing.assert_allclose([g[8:] for g in got], [w[8:] for w in want], rtol=0, atol=1e-6)
