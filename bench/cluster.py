"""Extraction on a Dask cluster: 1 vs 2 GPU-resource workers (CPU standing in for GPUs), and what
the client's commits cost.

A tiny Qwen2-VL (random weights, built here) over 800 G2M grids at 112 px (80 with ``--quick``;
``--samples N``), in chunks of 20 samples (one task each), batches of 4, one greedy token (the
prompt-forward path), keeping the last vision layer and LLM layers 0 and -1 at image and last
tokens. Each configuration is a ``LocalCluster`` of worker processes with ``GPU=1`` and one thread
each (the nanny's OMP_NUM_THREADS=1), started before the clock starts; the clock covers
``run_cluster`` from planning to the last commit, into a fresh workspace: first on new workers
(each imports torch and loads the model in the run), then again, warm (the workers keep the model
between commands). The speed-up is the 1-worker wall over the 2-worker wall (aim ≥ 1.8× on 2 cores). The
commit cost is the client writer's CPU in its manifest transactions per chunk row committed
(``WriterStats.commit_cpu_s``), in the 2-worker run.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

import yaml

from bench import record

CHUNK, BATCH = 20, 4


def _setup(root: Path, n: int) -> Path:
    from extract.models import tiny
    from stimuli import get_family
    from stimuli.io import write_set

    model = tiny.build("qwen2_vl", root / "model", seed=0)
    family = get_family("g2m")
    sets = write_set(family, family.config(grid_sizes=(3, 4), colors=(3,), image_size=112), n=-(-n // 2), seed=0,
                     split="test", out=root / "g2m")
    manifest = {
        "run": "bench-cluster", "model": {"path": str(model), "device": "cpu", "dtype": "float32"},
        "stimuli": [{"set": str(sets), "limit": n}],
        "taps": [{"tap": "vision", "layers": [-1]}, {"tap": "llm", "layers": [0, -1], "tokens": ["image", "last"]}],
        "generation": {"max_new_tokens": 1}, "batch_size": BATCH, "chunk_samples": CHUNK,
    }
    path = root / "manifest.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


def _run(path: Path, workers: int, data: Path) -> tuple[float, float, float, int]:
    """(cold wall seconds, warm wall seconds, client commit CPU seconds, chunk rows committed) of a
    cluster run into a fresh workspace: cold on new workers, then warm (imports done, model loaded)."""
    from dask.distributed import LocalCluster

    from extract.cluster.client import run_cluster
    from extract.cluster.scheduler import GPU
    from extract.manifest import load_manifest
    from store import Workspace

    with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, resources={GPU: 1},
                      dashboard_address=":0", silence_logs=logging.ERROR, memory_limit=0) as cluster:
        walls = []
        for where in (data.with_name(f"{data.name}-cold"), data):
            started = time.perf_counter()
            (summary,) = run_cluster([(str(path), load_manifest(path))], scheduler=cluster.scheduler_address,
                                     data=str(where), progress=False, log=lambda _: None)
            walls.append(time.perf_counter() - started)
    chunks = Workspace.open(data, readonly=True).rows("SELECT count(*) FROM chunks")[0][0]
    assert summary.commits is not None
    return walls[0], walls[1], summary.commits.commit_cpu_s, int(chunks)


def main(quick: bool = False, samples: int | None = None) -> None:
    n = samples or (80 if quick else 800)
    with tempfile.TemporaryDirectory(prefix="agnosia-bench-cluster-") as tmp:
        root = Path(tmp)
        path = _setup(root, n)
        cold1, one, _, _ = _run(path, 1, root / "one")
        cold2, two, cpu, chunks = _run(path, 2, root / "two")
    setting = (f"tiny Qwen2-VL, {n} G2M samples at 112 px, {n // CHUNK} tasks of {CHUNK}, batch {BATCH}, one token;"
               " LocalCluster workers with GPU=1, 1 thread each, on this machine's CPUs")
    print(f"   {n} samples, warm workers: 1 worker {one:.1f} s ({n / one:.1f}/s), 2 workers {two:.1f} s"
          f" ({n / two:.1f}/s): {one / two:.2f}x; new workers: {cold1:.1f} s and {cold2:.1f} s ({cold1 / cold2:.2f}x);"
          f" client commits {cpu / chunks * 1e3:.2f} ms CPU per chunk row ({chunks} rows)")
    record.figure("1 vs 2 workers", "1 worker, wall", one, "s", setting=setting + "; warm workers")
    record.figure("1 vs 2 workers", "2 workers, wall", two, "s", setting=setting + "; warm workers")
    record.figure("1 vs 2 workers", "speed-up", one / two, "x", aim="≥ 1.8× on 2 cores", setting=setting + "; warm workers")
    record.figure("1 vs 2 workers", "speed-up, new workers", cold1 / cold2, "x",
                  setting=f"{cold1:.1f} s and {cold2:.1f} s: each worker imports torch and loads the model in the run")
    record.figure("client commits", "CPU per chunk row", cpu / chunks * 1e3, "ms",
                  setting=f"the 2-worker run: {chunks} chunk rows, committed by the client's writer")
