"""Arrays in an object store vs in the workspace folder, side by side in one run.

A moto S3 server (its own process, on loopback) stands in for the object store, so the figures
show agnosia's overhead (staging, upload at commit, ranged reads, request count), not a real
network's: loopback has no latency, and moto is a slow Python server. Same run both ways: fp16
activations, uncompressed, chunks of 64 samples; then a full read, and a probe-like read of 10 %
of the rows scattered over every chunk.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import record


def _server() -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("moto server did not start") from None
            time.sleep(0.1)


def _write(ws, n: int, tokens: int, dim: int, chunk: int) -> float:
    from store import ArraySpec, RunInfo

    rng = np.random.default_rng(0)
    block = rng.standard_normal((chunk, tokens, dim)).astype(np.float16)
    started = time.perf_counter()
    with ws.writer(RunInfo(run="r", model="bench", dtype="float16", chunk_samples=chunk)) as w:
        w.set_samples(w.register_stimuli([{"id": f"s{i}", "family": "go"} for i in range(n)], dataset="set"))
        h = w.array(ArraySpec(tap="llm", layer=0, tokens="image", shape=(tokens, dim), dtype="float16"))
        for start in range(0, n, chunk):
            w.write_batch(start, {h: block[: min(chunk, n - start)]})
        w.finish()
    return time.perf_counter() - started


def main(quick: bool) -> None:
    from store import Workspace

    n, tokens, dim, chunk = (256, 64, 256, 64) if quick else (2048, 64, 512, 64)
    mb = n * tokens * dim * 2 / 1e6
    proc, endpoint = _server()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_ENDPOINT_URL=endpoint,
                      AWS_DEFAULT_REGION="us-east-1")
    try:
        import s3fs

        s3fs.S3FileSystem(endpoint_url=endpoint).mkdir("bench")
        with tempfile.TemporaryDirectory() as tmp:
            local = Workspace.open(Path(tmp) / "local")
            remote = Workspace.open(Path(tmp) / "remote", arrays_url="s3://bench/ws")
            t_wl, t_wr = _write(local, n, tokens, dim, chunk), _write(remote, n, tokens, dim, chunk)
            rows = np.sort(np.random.default_rng(1).choice(n, n // 10, replace=False))
            times = {}
            for name, ws in (("local", local), ("s3", remote)):
                ws = Workspace.open(ws.path, readonly=True)
                t0 = time.perf_counter()
                full = ws.read("r", "llm", 0, tokens="image")
                t1 = time.perf_counter()
                some = ws.read("r", "llm", 0, tokens="image", rows=rows)
                t2 = time.perf_counter()
                times[name] = (t1 - t0, t2 - t1, full, some)
            assert np.array_equal(times["local"][2], times["s3"][2]) and np.array_equal(times["local"][3], times["s3"][3])
    finally:
        proc.terminate()
        proc.wait(10)
    print(f"   {n} samples x {tokens} tokens x {dim} fp16 = {mb:.0f} MB, chunks of {chunk} samples")
    print(f"   write+commit: local {t_wl:.2f} s ({mb / t_wl:.0f} MB/s), s3 {t_wr:.2f} s ({mb / t_wr:.0f} MB/s),"
          f" ratio s3/local {t_wr / t_wl:.1f}x")
    (fl, sl, _, _), (fr, sr, _, _) = times["local"], times["s3"]
    print(f"   full read: local {fl:.3f} s, s3 {fr:.3f} s ({mb / fr:.0f} MB/s), ratio {fr / fl:.1f}x")
    print(f"   {len(rows)} scattered rows (10 %, every chunk): local {sl * 1e3:.1f} ms, s3 {sr * 1e3:.1f} ms,"
          f" ratio {sr / sl:.1f}x; selected {len(rows) * tokens * dim * 2 / 1e6:.1f} MB of {mb:.0f} MB"
          " (ranges < 1 MiB apart share one GET)")
    setting = f"{n} samples x {tokens} tokens x {dim} fp16 ({mb:.0f} MB), chunks of {chunk}, moto S3 server on loopback"
    record.figure("", "write+commit, s3 / local", t_wr / t_wl, "x", setting=setting)
    record.figure("", "full read, s3 / local", fr / fl, "x", setting=setting)
    record.figure("", "10 % scattered rows, s3 / local", sr / sl, "x", setting=setting)
