"""`python -m extract M --shard i/k`: k real processes fill one run of one workspace at once, and
the store they leave equals what one unsharded process stores, row for row."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from child_env import child_env
from clustertest_lib import assert_same, everything

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
    assert_same(everything(ws_path, "sharded"), everything(ref_path, "sharded"))


def test_shard_flag_is_validated(setup):
    root, manifest, _ = setup
    from extract.__main__ import main

    assert main([str(manifest), "--data", str(root / "bad"), "--shard", "2/2"]) == 2
    assert not (root / "bad").exists()  # refused before anything was created
