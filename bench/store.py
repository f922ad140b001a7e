"""Store benchmark: the store against plain numpy on the same data, in one run.

* write: ``Writer`` (background thread, chunk files fsynced, manifest commits) vs
  ``numpy.save`` + fsync of the same bytes. Goal >= 0.8x (docs/design.md#performance-aims: 0.9x).
* read: the rows an SQL filter selects (a quarter of the samples, scattered), ``ws.read`` (query
  included) vs fancy indexing a memory-mapped ``.npy``. Goal >= 0.5x (the design: 0.8x). Both warm.
* bytes on disk per value for each codec (lossless goal <= 2.0), with write speed and the error
  of the lossy BitRound options.
* hold (``--part hold`` alone): what the promise to plain DuckDB readers costs a run paced like
  an extraction: the writer's manifest connection held 0.4 s at a stretch and the manifest
  compacted at its close, against the old hold (up to 6 s idle, 10 s open, no compaction), with
  the longest wait of a plain read-only client polling meanwhile.

Data: "structured" fp16 activations (rank-64 signal, per-channel scale and offset, 4 outlier
channels near 40, noise), 2048 x 256 x 768 (805 MB), or 256 x 64 x 128 with --quick.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from bench import record
from store import ArraySpec, Generation, RunInfo, TokenSpans, Workspace, db

FAMILIES = ("a", "b", "c", "d")
PARTS = ("hold",)


def make_data(n: int, t: int, d: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    basis = rng.standard_normal((64, d)).astype(np.float32) / 8
    scale = rng.uniform(0.3, 2.0, d).astype(np.float32)
    offset = rng.normal(0, 0.5, d).astype(np.float32)
    outliers = rng.choice(d, 4, replace=False)
    out = np.empty((n, t, d), dtype=np.float16)
    step = 64
    for s in range(0, n, step):
        m = min(step, n - s)
        coef = rng.standard_normal((m * t, 64)).astype(np.float32)
        x = coef @ basis * scale + offset + rng.standard_normal((m * t, d)).astype(np.float32) * 0.3
        x[:, outliers] += 40
        out[s : s + m] = x.reshape(m, t, d).astype(np.float16)
    return out


def stimuli_rows(n: int, seed: int = 1) -> list[dict]:
    fam = np.random.default_rng(seed).choice(len(FAMILIES), n)
    return [{"id": f"s{i:06d}", "family": FAMILIES[fam[i]], "split": "bench", "seed": i, "params": {"i": i}}
            for i in range(n)]


def write_npy(x: np.ndarray, path: Path) -> float:
    started = time.perf_counter()
    with open(path, "wb") as f:
        np.save(f, x)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - started


def write_store(x: np.ndarray, folder: Path, codec: str, batch: int) -> tuple[float, Workspace]:
    ws = Workspace.open(folder)
    with ws.writer(RunInfo(run="bench", model="synthetic", chunk_samples=64)) as w:
        w.set_samples(w.register_stimuli(stimuli_rows(len(x)), dataset="bench"))
        arr = w.array(ArraySpec(tap="llm", layer=0, tokens="image", shape=x.shape[1:], dtype="float16", codec=codec))
        started = time.perf_counter()
        for s in range(0, len(x), batch):
            w.write(arr, s, x[s : s + batch])
        w.finish()
    return time.perf_counter() - started, ws


def _first_read(ws: Workspace, where: str) -> float:
    """A read on a fresh Workspace: the manifest's opens and queries included."""
    fresh = Workspace.open(ws.path, readonly=True)
    started = time.perf_counter()
    fresh.read("bench", "llm", 0, tokens="image", where=where)
    return time.perf_counter() - started


def main(quick: bool, part: str | None = None) -> None:
    if part == "hold":
        bench_hold(quick)
        return
    n, t, d = (256, 64, 128) if quick else (2048, 256, 768)
    reps = 2 if quick else 7
    batch = 32
    x = make_data(n, t, d)
    tmp = Path(tempfile.mkdtemp(prefix="agnosia-bench-store-"))
    try:
        print(f"data {n}x{t}x{d} fp16 = {x.nbytes / 1e6:.0f} MB; producer batches of {batch}; chunks of 64 samples;"
              f" tmp {tmp}")
        np_t, st_t, ws = bench_write(x, tmp, reps, batch)
        bench_read(ws, tmp / "x.npy", n)
        bench_codecs(x, tmp, ws, np_t, st_t, batch)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def bench_write(x: np.ndarray, tmp: Path, reps: int, batch: int) -> tuple[float, float, Workspace]:
    """Median seconds of numpy.save + fsync and of the store writer, and the last store written
    (its x.npy twin is left in ``tmp`` for the read benchmark)."""
    # Back-to-back pairs, order alternating, so the shared disk's noise (it swings 2-4x within a
    # minute here) falls on both alike; the figure is the median pair ratio.
    mb = x.nbytes / 1e6
    np_times, st_times = [], []
    for r in range(reps):
        folder = tmp / f"ws-none-{r}"
        if r % 2 == 0:
            np_times.append(write_npy(x, tmp / "x.npy"))
            st, ws = write_store(x, folder, "none", batch)
        else:
            st, ws = write_store(x, folder, "none", batch)
            np_times.append(write_npy(x, tmp / "x.npy"))
        st_times.append(st)
        if r < reps - 1:
            os.remove(tmp / "x.npy")
            shutil.rmtree(folder)
    pairs = [a / b for a, b in zip(np_times, st_times, strict=False)]
    np_med, st_med = statistics.median(np_times), statistics.median(st_times)
    print(f"\nwrite incl. fsync, {reps} back-to-back pairs      median MB/s   best MB/s")
    print(f"  numpy.save + fsync                      {mb / np_med:8.0f}    {mb / min(np_times):8.0f}")
    print(f"  store writer (codec none)               {mb / st_med:8.0f}    {mb / min(st_times):8.0f}")
    print(f"  store / numpy: median of pair ratios {statistics.median(pairs):.2f}x (pairs {min(pairs):.2f}-"
          f"{max(pairs):.2f}x; best vs best {min(np_times) / min(st_times):.2f}x)   (goal >= 0.8x)")
    record.figure("write", "store writer / numpy.save + fsync", statistics.median(pairs), "x", aim=">= 0.8x",
                  setting=f"{x.shape[0]}x{x.shape[1]}x{x.shape[2]} fp16 ({mb:.0f} MB), median of {reps} alternating pairs")
    return np_med, st_med, ws


def _runs(fn: Callable[[], Any], k: int) -> tuple[list[float], Any]:
    """Seconds of each of ``k`` calls of ``fn``, and what the last one returned."""
    times, out = [], None
    for _ in range(k):
        s = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - s)
    return times, out


def _best(fn: Callable[[], Any], k: int = 5) -> tuple[float, Any]:
    times, out = _runs(fn, k)
    return min(times), out


def bench_read(ws: Workspace, npy: Path, n: int) -> None:
    """Read a SQL-selected quarter of the rows: the store against a memory-mapped .npy."""
    where = "family = 'a'"
    idx = ws.select("bench", where=where).rows
    mm = np.load(npy, mmap_mode="r")
    mm[idx]  # populate this mapping's page tables
    # Each reader opens its file for the read (fresh mapping, page cache warm for both); the
    # second baseline keeps one mapping open, so its page tables are warm too.
    t_mm, ref = _best(lambda: np.load(npy, mmap_mode="r")[idx])
    t_warm, _ = _best(partial(mm.__getitem__, idx))  # bound now: the mapping is deleted below
    t_st, got = _best(lambda: ws.read("bench", "llm", 0, tokens="image", where=where))
    assert np.array_equal(ref, got), "store read differs from the numpy reference"
    t_first = _first_read(ws, where)
    sel_mb = ref.nbytes / 1e6
    t_mm1, ref1 = _best(lambda: np.load(npy, mmap_mode="r")[idx, 0, :])
    t_st1, got1 = _best(lambda: ws.read("bench", "llm", 0, tokens="image", where=where, index=(0,)))
    assert np.array_equal(ref1, got1)
    t_lazy, got2 = _best(
        lambda: ws.read("bench", "llm", 0, tokens="image", where=where, lazy=True).compute(scheduler="threads"))
    assert np.array_equal(ref, got2)
    print(f"\nread {len(idx)} of {n} rows selected by SQL ({where}), {sel_mb:.0f} MB, page cache warm   MB/s     ratio")
    print(f"  np.load(mmap_mode='r')[rows]              {sel_mb / t_mm:8.0f}")
    print(f"  ws.read(where=...)                        {sel_mb / t_st:8.0f}   {t_mm / t_st:5.2f}x   (goal >= 0.5x)")
    print(f"  ws.read, first call (manifest query)      {sel_mb / t_first:8.0f}   {t_mm / t_first:5.2f}x")
    print(f"  ws.read(lazy=True).compute()              {sel_mb / t_lazy:8.0f}   {t_mm / t_lazy:5.2f}x")
    print(f"  one mapping kept open, mm[rows]           {sel_mb / t_warm:8.0f}   ({t_warm / t_st:4.2f}x of it)")
    print(f"  token 0 only: np.load mmap {t_mm1 * 1e3:.1f} ms, ws.read(index=(0,)) {t_st1 * 1e3:.1f} ms"
          f"   {t_mm1 / t_st1:5.2f}x")
    # Open and read one token of every sample, a fresh Workspace each time: what a script or a probe
    # worker pays per array; mostly the manifest's opens (store/db.py), not the bytes.
    opened, _ = _runs(lambda: Workspace.open(ws.path, readonly=True).read("bench", "llm", 0, tokens="image",
                                                                         index=(0,)), 15)
    warm, _ = _runs(lambda: ws.read("bench", "llm", 0, tokens="image", index=(0,)), 15)
    setting = f"{len(idx)} of {n} rows selected by SQL, {sel_mb:.0f} MB, page cache warm, best of 5"
    record.figure("read", "ws.read / memory-mapped .npy", t_mm / t_st, "x", aim=">= 0.5x", setting=setting)
    record.figure("read", "ws.read(lazy=True) / memory-mapped .npy", t_mm / t_lazy, "x", setting=setting)
    print(f"  Workspace.open + read(index=(0,)), fresh each time: {statistics.median(opened) * 1e3:.1f} ms"
          f" (the read alone on an open workspace {statistics.median(warm) * 1e3:.1f} ms; medians of 15)")
    del mm


def bench_codecs(x: np.ndarray, tmp: Path, ws: Workspace, np_t: float, st_t: float, batch: int) -> None:
    """Bytes on disk per value for each codec, with write speed and the lossy codecs' error."""
    mb = x.nbytes / 1e6
    print("\ncodec        bytes/value  ratio  write MB/s  max rel. error (|x|>=1)")
    size_npy = (tmp / "x.npy").stat().st_size
    print(f"  .npy       {size_npy / x.size:11.3f}  {x.size * 2 / size_npy:5.2f}  {mb / np_t:10.0f}  0")
    big = np.abs(x.astype(np.float32)) >= 1
    for codec in ("none", "zstd", "bitround8", "bitround7"):
        folder = tmp / f"ws-{codec}"
        if codec == "none":
            secs, ws_c = st_t, ws
        else:
            secs, ws_c = write_store(x, folder, codec, batch)
        row = ws_c.query("SELECT bytes, bytes_per_value FROM v_arrays WHERE run = 'bench'").to_pylist()[0]
        err = 0.0
        if codec.startswith("bitround"):
            y = ws_c.read("bench", "llm", 0, tokens="image").astype(np.float32)
            xf = x.astype(np.float32)
            err = float(np.max(np.abs(y[big] - xf[big]) / np.abs(xf[big])))
        bpv = row["bytes_per_value"]
        print(f"  {codec:<10} {bpv:11.3f}  {2 / bpv:5.2f}  {mb / secs:10.0f}  {err:.2e}")
        record.figure("codecs", f"bytes per value, {codec}", bpv, "B", aim="<= 2.0" if codec in ("none", "zstd") else "",
                      setting=f"{x.shape[0]}x{x.shape[1]}x{x.shape[2]} fp16 random activations"
                      + (f"; max rel. error {err:.1e} at |x| >= 1" if err else ""))
        if codec != "none":
            shutil.rmtree(folder)
    print("  (lossless goal <= 2.0 bytes/value; bitround<k> keeps k mantissa bits, error <= 2^-(k+1))")


# A plain read-only DuckDB client, as a dashboard would poll: it prints how long each read
# waited for the file (retrying every 10 ms, giving up after 30 s).
_POLLER = """
import json, os, sys, time
import duckdb
path, stop = sys.argv[1], sys.argv[2]
print("ready", flush=True)
while not os.path.exists(stop):
    started = time.monotonic()
    while time.monotonic() - started < 30:
        try:
            con = duckdb.connect(path, read_only=True)
        except duckdb.IOException:
            time.sleep(0.01)
            continue
        con.execute("SELECT count(*) FROM chunks").fetchone()
        con.close()
        break
    print(json.dumps(time.monotonic() - started), flush=True)
    time.sleep(0.05)
"""


def paced_run(folder: Path, n: int, pace: float, old_hold: bool) -> dict[str, float]:
    """One run paced like an extraction (a forward pass of ``pace`` s per batch of 8; two arrays,
    token spans and generations), a plain client polling the manifest meanwhile. ``old_hold``:
    the writer's connection held as before issue 40 (let go after 6 s idle or 10 s open, no
    compaction at its close)."""
    ws = Workspace.open(folder)
    stop = folder / "stop-polling"
    poller = subprocess.Popen([sys.executable, "-c", _POLLER, str(ws.manifest_path), str(stop)],
                              stdout=subprocess.PIPE, text=True)
    assert poller.stdout is not None and poller.stdout.readline().strip() == "ready"
    x = make_data(n, 16, 64)
    settings = db.COMPACT_MAX_BYTES, db.HOLD_S, db.MAX_HOLD_S
    cpu, wall = time.process_time(), time.perf_counter()
    try:
        if old_hold:  # no rewrite at the close; let go after 6 s idle or 10 s held, as before
            db.COMPACT_MAX_BYTES, db.HOLD_S, db.MAX_HOLD_S = 0, 6.0, 10.0
        w = ws.writer(RunInfo(run="hold", model="synthetic", chunk_samples=64, batch_size=8))
        with w:
            w.set_samples(w.register_stimuli(stimuli_rows(n), dataset="bench"))
            arrays = w.arrays([ArraySpec(tap="llm", layer=k, tokens="image", shape=x.shape[1:], dtype="float16")
                               for k in range(2)])
            for s in range(0, n, 8):
                time.sleep(pace)
                e = min(s + 8, n)
                w.write_batch(s, {a: x[s:e] for a in arrays},
                              tokens=[TokenSpans(seq_len=24, image_start=2, image_count=16, last_prompt=20,
                                                 answer_start=21, answer_count=2) for _ in range(s, e)],
                              generations=[Generation(text="3", prediction=3, parse_ok=True, correct=True)
                                           for _ in range(s, e)])
            w.finish()
            closing = time.perf_counter()
        closed = time.perf_counter()
    finally:
        db.COMPACT_MAX_BYTES, db.HOLD_S, db.MAX_HOLD_S = settings
        stop.touch()
        out, _ = poller.communicate(timeout=60)
    waits = [json.loads(line) for line in out.splitlines()]
    return {"wall": closed - wall, "cpu": time.process_time() - cpu, "close": closed - closing,
            "opens": w.manifest_opens, "commits": w.stats.commits, "wait": max(waits),
            "manifest": ws.manifest_path.stat().st_size}


def bench_hold(quick: bool) -> None:
    """The hold against the old one, runs alternating so the machine's noise falls on both."""
    n, rounds, pace = (96, 2, 0.05) if quick else (480, 5, 0.05)
    tmp = Path(tempfile.mkdtemp(prefix="agnosia-bench-hold-"))
    got: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    try:
        for r in range(rounds):
            for old in ((True, False) if r % 2 == 0 else (False, True)):
                got[old].append(paced_run(tmp / f"{r}-{int(old)}", n, pace, old))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\nhold: {n} samples in batches of 8, {pace * 1e3:.0f} ms a batch, 2 arrays + spans + generations;"
          f" {rounds} runs each, alternating; medians (min-max)")
    print("                       wall s            CPU s             close ms        opens  commits"
          "  plain reader's longest wait s  manifest bytes")
    for old, label in ((True, "old (6 s / 10 s)"), (False, "0.4 s + compact")):
        rows = got[old]

        def col(key: str, scale: float = 1.0, fmt: str = ".2f", rows: list[dict[str, float]] = rows) -> str:
            v = [row[key] * scale for row in rows]
            return f"{statistics.median(v):{fmt}} ({min(v):{fmt}}-{max(v):{fmt}})"

        print(f"  {label:<18} {col('wall'):<17} {col('cpu'):<17} {col('close', 1e3, '.0f'):<15}"
              f" {col('opens', fmt='.0f'):<6} {col('commits', fmt='.0f'):<8} {col('wait'):<30}"
              f" {sorted({int(row['manifest']) for row in rows})}")
    pairs = [b["cpu"] - a["cpu"] for a, b in zip(got[True], got[False], strict=True)]
    print(f"  CPU per run, new - old: median {statistics.median(pairs):+.3f} s"
          f" ({min(pairs):+.3f} to {max(pairs):+.3f})")
    setting = (f"{n} samples in batches of 8, {pace * 1e3:.0f} ms a batch, 2 arrays, chunks of 64;"
               f" a plain client polling every 10 ms; median of {rounds} runs")
    record.figure("hold", "plain client's longest wait", statistics.median(r["wait"] for r in got[False]), "s",
                  aim="< 1 s", setting=setting)
    record.figure("hold", "CPU per run, 0.4 s holds - old hold", statistics.median(pairs), "s",
                  setting=setting + "; paired, runs alternating")
