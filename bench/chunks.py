"""Bytes per value on disk at 200 and at 6,400 samples: what a dense array's last chunk costs.

Zarr stores an edge chunk full-size, so chunks of ``min(chunk_samples, n)`` (the layout before the
store evened chunks out) stored 256 rows for 200 samples in chunks of 64: 2.56 bytes per float16 value.

* 200 samples: a real extraction (``run_extraction``): the tiny random Qwen2-VL of
  ``python -m extract.tiny``, G2M 112 px, batch 8, ``chunk_samples`` 64 (the manifest default), one
  new token, taps ``llm[0, -1]`` x image/last (dense, float16). Figures from the manifest
  (``v_arrays``) and from the chunk files on disk.
* 6,400 samples: store-only, through the ``Writer`` API (no model: a run that long takes hours on
  two cores, and the layout depends only on the counts): float16 ``[16, 64]`` per sample, batches of 8,
  ``chunk_samples`` 64 and 256, and 200 samples the same way beside it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from bench import record
from store import ArraySpec, RunInfo, Workspace
from store.records import ArrayInfo


def _disk_bytes(ws: Workspace, info: ArrayInfo) -> int:
    folder = ws.zarr_path / info.zarr_path
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and f.name != "zarr.json")


def _padded_before(n: int, chunk_samples: int) -> float:
    """Bytes per float16 value with chunks of min(chunk_samples, n): arithmetic, not a measurement."""
    size = min(chunk_samples, n)
    return 2.0 * -(-n // size) * size / n


def _row(ws: Workspace, info: ArrayInfo, requested: int, label: str) -> float:
    values = info.n_samples * info.values_per_row
    bpv = ws.rows("SELECT bytes_per_value FROM v_arrays WHERE zarr_path = ?", [info.zarr_path])[0][0]
    print(f"   {label:<24} {info.n_samples:>6,} {requested:>6} {info.chunk_samples:>6} x {info.n_chunks:<4}"
          f" {bpv:>10.3f} {_disk_bytes(ws, info) / values:>10.3f} {_padded_before(info.n_samples, requested):>10.3f}")
    return bpv


def _store_only(root: Path, n: int, requested: int) -> tuple[Workspace, ArrayInfo]:
    ws = Workspace.open(root / f"ws-{n}-{requested}")
    rows = [{"id": f"s{i:05d}", "family": "bench"} for i in range(n)]
    x = np.random.default_rng(0).standard_normal((n, 16, 64)).astype(np.float16)
    with ws.writer(RunInfo(run="bench", model="synthetic", chunk_samples=requested, batch_size=8)) as w:
        w.set_samples(w.register_stimuli(rows, dataset="bench"))
        h = w.array(ArraySpec(tap="llm", layer=0, tokens="image", shape=(16, 64), dtype="float16"))
        for s in range(0, n, 8):
            w.write(h, s, x[s : s + 8])
        w.finish()
    return ws, ws.arrays("bench")[0]


def _extraction(root: Path, n: int) -> tuple[Workspace, list[ArrayInfo]]:
    from extract.manifest import parse_manifest
    from extract.models import tiny
    from extract.run import run_extraction
    from stimuli import get_family
    from stimuli.io import write_set

    model = tiny.build("qwen2_vl", root / "tiny-qwen2-vl", seed=0)
    g2m = get_family("g2m")
    stimuli = write_set(g2m, g2m.config(grid_sizes=(4,), colors=(3,), image_size=112), n=n, seed=0, split="test",
                        out=root / "g2m")
    manifest = parse_manifest({
        "run": "chunks", "model": {"path": str(model)}, "stimuli": [{"set": str(stimuli)}],
        "taps": [{"tap": "llm", "layers": [0, -1], "tokens": ["image", "last"]}],
        "generation": {"max_new_tokens": 1}, "batch_size": 8, "chunk_samples": 64,
    })
    run_extraction(manifest, workspace=root / "ws-run", progress=False)
    ws = Workspace.open(root / "ws-run", readonly=True)
    return ws, [a for a in ws.arrays("chunks") if a.layout == "dense"]


def main(quick: bool = False) -> None:
    print(f"   {'what':<24} {'n':>6} {'asked':>6} {'chunks':>13} {'B/value':>10} {'on disk':>10} {'before':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ws, dense = _extraction(root, 200)
        run = max(_row(ws, info, 64, f"run {info.tap}.{info.layer} {info.tokens}") for info in dense)
        layouts = ((200, 64), (200, 256), (6400, 64), (6400, 256))
        api = max(_row(*_store_only(root, n, requested), requested, "Writer API, batch 8") for n, requested in layouts)
    record.figure("", f"largest bytes per value, an extraction's {len(dense)} dense arrays", run, "B",
                  aim="2.000 (float16, no padded row)",
                  setting="tiny Qwen2-VL, 200 G2M samples, batch 8, chunk_samples 64")
    record.figure("", "largest bytes per value, Writer API", api, "B", aim="2.000 (float16, no padded row)",
                  setting="float16 [16, 64] per sample, batches of 8; n 200 and 6,400 x chunk_samples 64 and 256")
    print("   (B/value: the manifest's bytes_per_value; on disk: chunk file bytes / values; before: chunks of"
          " min(asked, n) full-size, computed)")
