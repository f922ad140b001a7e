"""SAE benchmark: the activation source against ``numpy.fromfile`` on the same bytes, and a TopK SAE
trained from the store (probes/sae/) against SAELens training the same SAE from an in-memory tensor.

The store: one run of 256 samples x 64 image tokens at d = 3,584 (Qwen2.5-VL-7B's width), float16,
16 samples a chunk (7.3 MB chunk files), 117 MB in all.

* ``source``: one epoch of token rows through :class:`probes.sae.ActivationSource` (shuffled across
  chunks, 8,192-row buffer, batches of 1,024 rows, float16 as stored, which the SAE trainer takes,
  and cast to float32) against ``numpy.fromfile`` reading every
  chunk file once, both after a warm-up read (page cache warm: the read rate, not the disk's), best
  of 3; in stored bytes per second (goal: the source >= 0.7x fromfile). fromfile is measured twice:
  dropping each file's array (the allocator hands the next file the same 7.3 MB, still in the L3
  cache: a cache-to-cache copy) and keeping every array, as a reader that hands its rows out must.
* ``train``: a TopK SAE (d_sae 2,048, k 32, batch 1,024, Adam, one torch thread) for 20 steps after
  one warm-up step, each side alone in a fresh process (bench/_sae_worker.py): agnosia from the store
  out of core, SAELens (``TopKTrainingSAE`` + ``SAETrainer``) from a tensor of the same rows in
  memory; rows/s side by side (goal: agnosia >= 0.8x SAELens) and each process's peak RSS, which
  must fit the 1 GiB worker limit the farm checks the plan against.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import record
from store import ArraySpec, RunInfo, TokenSpans, Workspace

PARTS = ("source", "train")
REPO = Path(__file__).resolve().parents[1]
D, T, CHUNK = 3584, 64, 16
LIMIT = 1 << 30


def make_store(path: Path, n: int, seed: int = 0) -> Workspace:
    rng = np.random.default_rng(seed)
    ws = Workspace.open(path)
    rows = [{"id": f"s{i:05d}", "family": "bench", "split": "test", "seed": i, "truth": {}} for i in range(n)]
    with ws.writer(RunInfo(run="bench", model="synthetic", dtype="float32", chunk_samples=CHUNK)) as w:
        w.set_samples(w.register_stimuli(rows, dataset="bench"))
        h = w.array(ArraySpec(tap="llm", layer=0, tokens="image", shape=(T, D)))
        for s in range(0, n, CHUNK):
            x = rng.standard_normal((CHUNK, T, D), dtype=np.float32)
            w.write_batch(s, {h: x}, tokens=[TokenSpans(seq_len=T + 4, image_start=1, image_count=T, last_prompt=T + 3)
                                             for _ in range(CHUNK)])
        w.finish()
    return ws


def chunk_files(ws: Workspace) -> list[Path]:
    from store.arrays import dense_chunk_file

    info = ws.array_info("bench", "llm", 0)
    return [dense_chunk_file(ws.root.local.parent, info.zarr_path, len(info.shape), k) for k in range(info.n_chunks)]


def source_part(ws: Workspace, rounds: int) -> dict[str, Any]:
    from probes.sae import ActivationSource

    files = chunk_files(ws)
    stored = sum(f.stat().st_size for f in files)

    def fromfile() -> None:
        for f in files:
            np.fromfile(f, dtype=np.float16)

    def fromfile_kept() -> None:
        kept = [np.fromfile(f, dtype=np.float16) for f in files]
        del kept

    def source(dtype: str) -> Any:
        src = ActivationSource(ws, "bench", ["llm:0"], batch_size=1024, buffer_rows=8192, dtype=dtype)  # type: ignore[arg-type]

        def epoch() -> None:
            for _ in src.batches(0):
                pass

        return epoch

    best = {}
    for name, fn in (("fromfile", fromfile), ("kept", fromfile_kept), ("source", source("stored")),
                     ("source32", source("float32"))):
        fn()
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        best[name] = stored / min(times)
    return {"source_mb_s": best["source"] / 1e6, "fromfile_mb_s": best["fromfile"] / 1e6,
            "source32_mb_s": best["source32"] / 1e6, "ratio": best["source"] / best["fromfile"], "mb": stored / 1e6,
            "kept_mb_s": best["kept"] / 1e6, "ratio_kept": best["source"] / best["kept"]}


def _worker(cfg: dict[str, Any]) -> dict[str, Any]:
    got = subprocess.run([sys.executable, "-m", "bench._sae_worker", json.dumps(cfg)], cwd=REPO, capture_output=True,
                         text=True, timeout=900)
    if got.returncode:
        raise SystemExit(f"bench._sae_worker {cfg['side']} failed:\n{got.stderr[-3000:]}")
    return json.loads(got.stdout.strip().splitlines()[-1])


def train_part(data: Path, steps: int, d_sae: int) -> dict[str, Any]:
    from probes.sae.farm import WORKER_BASE
    from probes.sae.job import planned_peak
    from probes.sae.plan import SaeTask

    cfg = {"data": str(data), "run": "bench", "array": "llm:0", "d_sae": d_sae, "k": 32, "batch": 1024,
           "steps": steps, "buffer_rows": 8192}
    entry = {"buffer_rows": 8192, "batch_size": 1024}
    planned = WORKER_BASE + planned_peak(SaeTask("bench", "bench", "llm", 0, "resid_post", None, "image", D, d_sae, entry))
    ours = _worker({**cfg, "side": "store"})
    theirs = _worker({**cfg, "side": "saelens"})
    return {"ours": ours, "theirs": theirs, "ratio": ours["rows_per_s"] / theirs["rows_per_s"], "planned": planned}


def main(quick: bool = False, part: str | None = None) -> None:
    n = 32 if quick else 256
    tmp = Path(tempfile.mkdtemp(prefix="bench-sae-"))
    try:
        ws = make_store(tmp / "ws", n)
        setting = f"{n} samples x {T} tokens, d {D:,}, float16, {CHUNK} samples a chunk"
        if part in (None, "source"):
            r = source_part(ws, 1 if quick else 3)
            print(f"source: {r['source_mb_s']:,.0f} MB/s (float16 batches; {r['source32_mb_s']:,.0f} MB/s as float32)"
                  f" vs numpy.fromfile {r['fromfile_mb_s']:,.0f} MB/s ({r['ratio']:.2f}x), {r['kept_mb_s']:,.0f} MB/s"
                  f" keeping its arrays ({r['ratio_kept']:.2f}x), over {r['mb']:.0f} MB")
            s = f"{setting}; 8,192-row buffer, batches of 1,024; page cache warm, best of 3; MB/s of stored bytes"
            record.figure("source", "source (float16 batches)", r["source_mb_s"], "MB/s", setting=s)
            record.figure("source", "source (float32 batches)", r["source32_mb_s"], "MB/s", setting=s)
            record.figure("source", "numpy.fromfile", r["fromfile_mb_s"], "MB/s", setting=s)
            record.figure("source", "source / fromfile", r["ratio"], "x", aim=">= 0.7x", setting=s)
            record.figure("source", "numpy.fromfile, arrays kept", r["kept_mb_s"], "MB/s", setting=s)
            record.figure("source", "source / fromfile kept", r["ratio_kept"], "x", setting=s)
        if part in (None, "train"):
            r = train_part(tmp / "ws", 3 if quick else 20, 512 if quick else 2048)
            o, t = r["ours"], r["theirs"]
            print(f"train: agnosia from the store {o['rows_per_s']:,.0f} rows/s (peak RSS {o['rss_mib']:.0f} MiB),"
                  f" SAELens from memory {t['rows_per_s']:,.0f} rows/s (peak RSS {t['rss_mib']:.0f} MiB):"
                  f" {r['ratio']:.2f}x; planned peak {r['planned'] >> 20} MiB of the {LIMIT >> 20} MiB limit")
            s = (f"{setting}; TopK d_sae {2048 if not quick else 512:,}, k 32, batch 1,024, 20 steps, 1 torch thread,"
                 " each side in a fresh process")
            record.figure("train", "agnosia (store, out of core)", o["rows_per_s"], "rows/s", setting=s)
            record.figure("train", "SAELens (in-memory tensor)", t["rows_per_s"], "rows/s", setting=s)
            record.figure("train", "agnosia / SAELens", r["ratio"], "x", aim=">= 0.8x", setting=s)
            record.figure("train", "agnosia peak RSS", o["rss_mib"], "MiB", aim="<= 1,024 MiB worker limit", setting=s)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
