"""`python -m extract M --shard i/k`: k real processes fill one run of one workspace at once, and
the store they leave equals what one unsharded process stores, row for row."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from child_env import child_env

from stimuli import get_family
from stimuli.io import write_set
from store import Workspace

pytestmark = pytest.mark.slow  # spawns extraction or Dask processes per test

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def setup(tiny_dir, tmp_path_factory):
    family = get_family("g2m")
    root = tmp_path_factory.mktemp("shards")
    stimuli = write_set(family, family.config(grid_sizes=(3, 4), colors=(3,), image_size=112),
                        n=5, seed=3, split="test", out=root / "g2m")  # 10 samples: 5 chunks of 2
    data = {
        "run": "sharded",
        "model": {"path": str(tiny_dir("qwen2_vl")), "device": "cpu", "dtype": "float32"},
        "stimuli": [{"set": str(stimuli)}],
        "taps": [{"tap": "vision", "layers": [-1]}, {"tap": "llm", "layers": [0, -1], "tokens": ["image", "last", "answer"]}],
        "attention": {"layers": [-1], "queries": ["last", "answer"]},
        "generation": {"max_new_tokens": 4},
        "batch_size": 2,
        "chunk_samples": 2,
    }
    path = root / "manifest.yaml"
    path.write_text(yaml.safe_dump(data))
    return root, path, data


def _everything(ws: Workspace, run: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for a in ws.arrays(run):
        values = ws.read(run, tap=a.tap, layer=a.layer, site=a.site, tokens=a.tokens)
        out[a.zarr_path] = values if isinstance(values, np.ndarray) else [v.tolist() for v in values]
    out["chunks"] = ws.rows("SELECT zarr_path, chunk, n_rows, crc32c FROM chunks WHERE run = ? ORDER BY ALL", [run])
    out["samples"] = ws.rows("SELECT * EXCLUDE (recorded_at) FROM samples WHERE run = ? ORDER BY array_row", [run])
    out["generations"] = ws.rows("SELECT stimulus, array_row, text, prediction, correct, n_tokens FROM generations"
                                 " WHERE run = ? ORDER BY array_row", [run])
    out["tensors"] = ws.rows("SELECT name, shape, crc32c FROM tensors WHERE run = ? ORDER BY name", [run])
    return out


def test_two_shard_processes_equal_one_run(setup):
    root, manifest, data = setup
    ws_path = root / "ws"
    env = child_env(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", "extract", str(manifest), "--data", str(ws_path), "--shard",
                               f"{i}/2", "--no-progress"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    # Shard 0 owns chunks 0, 2, 4 (6 samples), shard 1 chunks 1, 3 (4 samples).
    assert "(6 computed now" in outs[0][0] and "(4 computed now" in outs[1][0], outs

    ws = Workspace.open(ws_path, readonly=True)
    assert ws.rows("SELECT status FROM runs WHERE run = 'sharded'") == [("finished",)]
    rep = ws.verify()
    assert rep.ok and not rep.warnings, (rep.problems, rep.warnings)
    assert ws.rows("SELECT count(*) = count(DISTINCT (zarr_path, chunk)) FROM chunks") == [(True,)]

    # The reference runs as a process with the same thread count: fp32 sums in another order round apart.
    ref_path = root / "ref"
    ref = subprocess.run([sys.executable, "-m", "extract", str(manifest), "--data", str(ref_path), "--no-progress"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr[-2000:]
    assert "(10 computed now" in ref.stdout
    got, want = _everything(ws, "sharded"), _everything(Workspace.open(ref_path, readonly=True), "sharded")
    assert got.keys() == want.keys()
    for key in want:
        if isinstance(want[key], np.ndarray):
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
        else:
            assert got[key] == want[key], key


def test_shard_flag_is_validated(setup):
    root, manifest, _ = setup
    from extract.__main__ import main

    assert main([str(manifest), "--data", str(root / "bad"), "--shard", "2/2"]) == 2
    assert not (root / "bad").exists()  # refused before anything was created
