"""``python -m extract M --scheduler ADDRESS``: runs as tasks on Dask workers holding a GPU resource
(CPU standing in for GPUs), the client the only writer of the manifest. Started the way
docs/scale.md's plain-Dask recipe starts them (``dask scheduler``, ``dask worker --resources GPU=1
--nthreads 1``), with arrays on a shared folder and in an object store; every manifest row and
value equals a single process's run, and survives kill -9 of a worker, the client or the scheduler."""

from __future__ import annotations

import os
import signal

import pytest
import yaml
from clustertest_lib import Cluster, assert_same, everything, extract
from waiting import wait_for

from extract.cluster.facts import WorkerFacts, check_workers
from extract.manifest import ManifestError, parse_manifest
from stimuli import get_family
from stimuli.io import write_set
from store import Workspace

pytestmark = pytest.mark.slow  # Dask processes and a tiny model per test


@pytest.fixture(scope="module")
def setup(tiny_dir, tmp_path_factory):
    """(root, manifest path, reference snapshot): a tiny Qwen2-VL run of 10 samples in 5 chunks of 2,
    with attention rows, answers and a logit lens; the reference extracted by one process."""
    family = get_family("g2m")
    root = tmp_path_factory.mktemp("cluster")
    stimuli = write_set(family, family.config(grid_sizes=(3, 4), colors=(3,), image_size=112),
                        n=5, seed=3, split="test", out=root / "g2m")
    data = {
        "run": "clustered",
        "model": {"path": str(tiny_dir("qwen2_vl")), "device": "cpu", "dtype": "float32"},
        "stimuli": [{"set": str(stimuli)}],
        "taps": [{"tap": "vision", "layers": [-1]}, {"tap": "llm", "layers": [0, -1], "tokens": ["image", "last", "answer"]}],
        "attention": {"layers": [-1], "queries": ["last", "answer"]},
        "generation": {"max_new_tokens": 4}, "batch_size": 2, "chunk_samples": 2, "logit_lens": True,
    }
    path = root / "manifest.yaml"
    path.write_text(yaml.safe_dump(data))
    ref = extract(str(path), "--data", str(root / "reference"))
    assert ref.returncode == 0, ref.stderr[-2000:]
    return root, path, everything(root / "reference", "clustered")


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path / "cluster").start()
    yield c
    c.stop()


def _loads(cluster: Cluster) -> dict[str, int]:
    return cluster.worker_facts(lambda dask_worker: dask_worker.plugins["agnosia-models"].loads)


def _clean(ws_path) -> None:
    ws = Workspace.open(ws_path, readonly=True)
    rep = ws.verify()
    assert rep.ok and not rep.warnings, (rep.problems, rep.warnings)
    assert ws.rows("SELECT count(*) = count(DISTINCT (zarr_path, chunk)) FROM chunks") == [(True,)]
    assert {r[0] for r in ws.rows("SELECT status FROM runs")} == {"finished"}


def test_plain_dask_recipe_on_a_shared_folder_equals_one_process(setup, cluster, tmp_path):
    """Two runs in one command: both on the same two workers, each worker loading the model once."""
    root, manifest, reference = setup
    second = yaml.safe_load(manifest.read_text()) | {"run": "second", "taps": [{"tap": "llm", "layers": [1]}],
                                                       "attention": None, "logit_lens": False}
    (tmp_path / "second.yaml").write_text(yaml.safe_dump(second))
    done = extract(str(manifest), str(tmp_path / "second.yaml"), "--data", str(tmp_path / "ws"),
                   "--scheduler", cluster.address)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "run clustered: 10 samples (10 computed now" in done.stdout
    assert "run second: 10 samples (10 computed now" in done.stdout
    assert_same(everything(tmp_path / "ws", "clustered"), reference)
    _clean(tmp_path / "ws")
    starts = sorted(int(m.name.split("-")[1]) for m in cluster.markers.iterdir())
    assert starts == [0, 0, 2, 2, 4, 4, 6, 6, 8, 8]  # each batch of each run computed once, by whichever worker
    assert len({m.name.split("-")[0] for m in cluster.markers.iterdir()}) == 2  # both workers took tasks
    assert sorted(_loads(cluster).values()) == [1, 1]  # each loaded the model once and kept it for both runs
    one = extract(str(tmp_path / "second.yaml"), "--data", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr[-2000:]
    assert_same(everything(tmp_path / "ws", "second"), everything(tmp_path / "one", "second"))
    again = extract(str(manifest), "--data", str(tmp_path / "ws"), "--scheduler", cluster.address)
    assert again.returncode == 0 and "(0 computed now" in again.stdout, again.stderr[-2000:]
    assert sorted(_loads(cluster).values()) == [1, 1]  # the next command found the model still loaded
    plan = extract(str(manifest), "--dry-run", "--scheduler", cluster.address)
    assert plan.returncode == 0 and "cluster: 2 GPU worker(s), 5 tasks of 2 samples" in plan.stdout, plan.stderr[-2000:]


def test_relative_paths_are_the_clients(setup, cluster, tmp_path):
    """A manifest's relative model and set paths name what they name from the client's folder, though
    the workers were started elsewhere (a shared file system: the client's folder exists on them)."""
    root, manifest, reference = setup
    data = yaml.safe_load(manifest.read_text())
    data["model"]["path"] = os.path.relpath(data["model"]["path"], root)
    data["stimuli"] = [{"set": "g2m", "limit": 4}]
    (root / "relative.yaml").write_text(yaml.safe_dump(data | {"run": "relative"}))
    done = extract("relative.yaml", "--data", str(tmp_path / "ws"), "--scheduler", cluster.address, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "run relative: 4 samples (4 computed now" in done.stdout
    ws = Workspace.open(tmp_path / "ws", readonly=True)
    assert ws.rows("SELECT model FROM runs") == [(data["model"]["path"],)]  # recorded as the manifest names it


def test_arrays_in_an_object_store(setup, s3, tmp_path):
    root, manifest, reference = setup
    Workspace.open(tmp_path / "ws", arrays_url=s3.url("c"))  # `python -m store init --arrays s3://...`
    c = Cluster(tmp_path / "cluster", extra_env={k: v for k, v in os.environ.items() if k.startswith("AWS_")}).start()
    try:
        done = extract(str(manifest), "--data", str(tmp_path / "ws"), "--scheduler", c.address)
    finally:
        c.stop()
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same(everything(tmp_path / "ws", "clustered"), reference)
    _clean(tmp_path / "ws")
    local = [p for p in (tmp_path / "ws" / "arrays" / "clustered").rglob("c.*") if "sample" not in p.parts]
    assert local == []  # chunk data lives in the bucket only


def test_kill_9_of_a_worker_mid_task_runs_the_task_again(setup, tmp_path):
    root, manifest, reference = setup
    c = Cluster(tmp_path / "cluster", pause=1.0).start()
    try:
        run = extract(str(manifest), "--data", str(tmp_path / "ws"), "--scheduler", c.address, wait=False)
        os.kill(c.busy_worker_pid(), signal.SIGKILL)  # mid-batch: the preload sleeps before computing it
        out, err = run.communicate(timeout=300)
    finally:
        c.stop()
    assert run.returncode == 0, err[-3000:]
    assert_same(everything(tmp_path / "ws", "clustered"), reference)
    _clean(tmp_path / "ws")


@pytest.mark.parametrize("victim", ["client", "scheduler"])
def test_kill_9_mid_run_then_rerun_commits_every_chunk_once(setup, tmp_path, victim):
    root, manifest, reference = setup
    c = Cluster(tmp_path / "cluster", pause=1.0).start()
    ws = tmp_path / "ws"
    try:
        run = extract(str(manifest), "--data", str(ws), "--scheduler", c.address, wait=False)
        wait_for(lambda: len(list(c.markers.iterdir())) >= 3, 180)  # some chunks done, others in flight
        if victim == "client":
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(10)
        else:
            c.kill_scheduler()
            out, err = run.communicate(timeout=120)
            assert run.returncode == 2, err[-2000:]
            assert "re-run the same command to resume" in err
            assert "Traceback" not in err
        c.stop()
        c = Cluster(tmp_path / "again").start()
        again = extract(str(manifest), "--data", str(ws), "--scheduler", c.address)
    finally:
        c.stop()
    assert again.returncode == 0, again.stderr[-3000:]
    assert "(10 computed now" not in again.stdout  # what was committed before the kill was kept
    assert_same(everything(ws, "clustered"), reference)
    _clean(ws)


def test_workers_that_cannot_run_the_manifest_are_refused_before_any_work(setup, cluster, tmp_path):
    root, manifest, reference = setup
    cuda = yaml.safe_load(manifest.read_text())
    cuda["model"]["device"] = "cuda"
    (tmp_path / "cuda.yaml").write_text(yaml.safe_dump(cuda))
    done = extract(str(tmp_path / "cuda.yaml"), "--data", str(tmp_path / "ws"), "--scheduler", cluster.address)
    assert done.returncode == 2
    assert "see no CUDA device" in done.stderr and "gpu0" in done.stderr and "gpu1" in done.stderr
    assert not (tmp_path / "ws").exists()  # refused before the workspace was touched
    assert list(cluster.markers.iterdir()) == []


def test_inline_scheduler_equals_one_process(setup, tmp_path):
    """The cluster path in one process (``--scheduler inline``): the same rows and values."""
    root, manifest, reference = setup
    done = extract(str(manifest), "--data", str(tmp_path / "ws"), "--scheduler", "inline")
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same(everything(tmp_path / "ws", "clustered"), reference)


def test_dry_run_plans_for_the_workers(setup, capsys):
    from extract.__main__ import main

    root, manifest, reference = setup
    lines = {}
    for n in (1, 2, 8):
        assert main([str(manifest), "--dry-run", "--workers", str(n)]) == 0
        lines[n] = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("cluster:"))
    assert "5 tasks of 2 samples (1 busy at once)" in lines[1]
    assert "(2 busy at once)" in lines[2] and "(5 busy at once)" in lines[8]  # 5 chunks: 3 workers idle


def test_runs_of_one_model_go_next_to_each_other():
    from extract.cluster.client import by_model

    def m(run, path):
        return ("f.yaml", parse_manifest({"run": run, "model": {"path": path}, "stimuli": [{"set": "s"}],
                                          "taps": [{"tap": "llm"}]}))

    assert by_model([m("a", "x"), m("b", "y"), m("c", "x"), m("d", "z"), m("e", "y")]) == [0, 2, 1, 4, 3]


def _facts(device="cuda", gpu="NVIDIA H100 80GB HBM3", bf16=True, cuda=True):
    return WorkerFacts(device, gpu, "2.13.0", bf16, cuda)


def test_check_workers_names_the_mismatch():
    m = parse_manifest({"run": "r", "model": {"path": "m", "device": "cuda", "dtype": "bfloat16"},
                        "stimuli": [{"set": "s"}], "taps": [{"tap": "llm"}]})
    assert check_workers({"a": _facts(), "b": _facts()}, m, "m.yaml") == _facts()
    with pytest.raises(ManifestError, match=r"different hardware.*A100.*: b"):
        check_workers({"a": _facts(), "b": _facts(gpu="NVIDIA A100-SXM4-40GB")}, m, "m.yaml")
    with pytest.raises(ManifestError, match="worker\\(s\\) b see no CUDA device"):
        check_workers({"a": _facts(), "b": _facts("cpu", None, True, False)}, m, "m.yaml")
    with pytest.raises(ManifestError, match=r"a \(Tesla V100\) do not compute in bfloat16"):
        check_workers({"a": _facts(gpu="Tesla V100", bf16=False)}, m, "m.yaml")
    with pytest.raises(ManifestError, match="no worker with a GPU resource"):
        check_workers({}, m, "m.yaml")
