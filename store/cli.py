"""``python -m store``: look at, check, size and prune a workspace.

Every subcommand takes ``--data PATH`` (default: $AGNOSIA_DATA, else ./data). Commands other
than ``init`` and ``drop-run`` open the manifest read-only and never change the workspace.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from store.errors import StoreError
from store.lock import live_writers
from store.sizing import human, size_estimate
from store.text import text_table
from store.workspace import ENV_VAR, Workspace, resolve_path


def _table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    return text_table(header, [["" if v is None else str(v) for v in r] for r in rows])


def cmd_init(args: argparse.Namespace) -> int:
    ws = Workspace.open(args.data, arrays_url=args.arrays)
    where = f"; arrays at {ws.root.url}" if ws.root.remote else ""
    print(f"workspace {ws.path} ready (schema v{ws.schema_version()}{where})")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    ws = Workspace.open(args.data, readonly=True)
    runs = ws.runs()
    if args.run:
        runs = [r for r in runs if r["run"] == args.run]
        if not runs:
            raise StoreError(f"no run {args.run!r} in {ws.path}")
    writing = {h.run for h in live_writers(ws.path)}
    for r in runs:
        if r["status"] == "running" and r["run"] not in writing:
            r["status"] = "interrupted"  # marked running, but its writer is gone: resume it
    arrays = ws.query(
        "SELECT run, tap, layer, site, tokens, layout, shape, stored_dtype, codec, chunks_committed, n_chunks, bytes,"
        " bytes_per_value, n_nonfinite, n_clipped FROM v_arrays ORDER BY run, tap, layer, site, tokens"
    ).to_pylist()
    disk = _disk_use(ws)
    if args.json:
        print(json.dumps({"workspace": str(ws.path), "arrays_url": ws.root.url, **disk, "runs": runs,
                          "arrays": arrays}, default=str, indent=2))
        return 0
    total = sum(r["bytes"] for r in runs)
    where = f"  arrays at {ws.root.url}" if ws.root.remote else ""
    print(f"workspace {ws.path}  schema v{ws.schema_version()}  {len(runs)} run(s)  {human(total)}{where}")
    print(_disk_line(disk, ws.root.remote))
    if not runs:
        print("no runs yet")
        return 0
    print()
    print(_table(
        [(r["run"], r["model"], r["status"], r["n_samples"], r["arrays"], f"{r['chunks_committed']}/{r['chunks_expected']}",
          human(r["bytes"]), r["n_nonfinite"] or "", r["n_clipped"] or "") for r in runs],
        ["run", "model", "status", "samples", "arrays", "chunks", "bytes", "nan/inf", "clipped"],
    ))
    chosen = {r["run"] for r in runs}
    if args.run or args.arrays:
        rows = [
            (a["run"], a["tap"], a["layer"], a["site"], a["tokens"], "x".join(str(s) if s >= 0 else "*" for s in a["shape"]),
             a["stored_dtype"], a["codec"], f"{a['chunks_committed']}/{a['n_chunks']}", human(a["bytes"]),
             "" if a["bytes_per_value"] is None else f"{a['bytes_per_value']:.3f}", a["n_nonfinite"] or "")
            for a in arrays if a["run"] in chosen
        ]
        print()
        print(_table(rows, ["run", "tap", "layer", "site", "tokens", "shape", "stored", "codec", "chunks", "bytes",
                            "B/value", "nan/inf"]))
    else:
        summary: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for a in arrays:
            if a["run"] in chosen:
                summary.setdefault((a["run"], a["tap"]), []).append(a)
        print()
        print(_table(
            [(run, tap, len(v), _layers(v), ",".join(sorted({a["tokens"] for a in v})), human(sum(a["bytes"] for a in v)))
             for (run, tap), v in summary.items()],
            ["run", "tap", "arrays", "layers", "tokens", "bytes"],
        ))
        print("\n(--arrays or --run RUN lists every array)")
    return 0


def _disk_use(ws: Workspace) -> dict[str, Any]:
    """What the workspace costs per value it stores: the arrays' chunks alone (as v_arrays
    counts them), and the whole folder, manifest and metadata included. The two differ by the
    manifest (DuckDB allocates it in 256 KiB blocks: docs/store.md, "The manifest's size"), Zarr
    metadata, run tensors and derived arrays; a small workspace's figure is mostly the manifest."""
    array_bytes, values = ws.rows(
        "SELECT coalesce(sum(c.nbytes), 0)::BIGINT, coalesce(sum(c.n_rows * a.values_per_row), 0)::BIGINT"
        " FROM activations a JOIN chunks c ON c.run = a.run AND c.zarr_path = a.zarr_path")[0]
    folder = _folder_bytes(ws.path)
    return {"values": values, "array_bytes": array_bytes, "manifest_bytes": _folder_bytes(ws.manifest_path),
            "folder_bytes": folder, "bytes_per_value": {"arrays": array_bytes / values if values else None,
                                                        "folder": folder / values if values else None}}


def _folder_bytes(path: Path) -> int:
    """Bytes of every file under ``path`` (their sizes, as ``du -b`` counts them); ``path`` itself
    if it is a file. A file removed while we walk (a writer's staging) no longer counts."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                pass
    return total


def _disk_line(disk: dict[str, Any], remote: bool) -> str:
    per = disk["bytes_per_value"]
    if per["arrays"] is None:
        return f"bytes/value: no values stored yet; folder {human(disk['folder_bytes'])}"
    note = " (the arrays live in the object store: the folder holds the manifest and metadata)" if remote else ""
    return (f"bytes/value: arrays {per['arrays']:.3f}, whole folder {per['folder']:.3f}"
            f" ({human(disk['folder_bytes'])} for {disk['values']:,} values; manifest"
            f" {human(disk['manifest_bytes'])}){note}")


def _layers(arrays: list[dict[str, Any]]) -> str:
    layers = sorted({a["layer"] for a in arrays})
    return f"{layers[0]}-{layers[-1]}" if len(layers) > 2 else ",".join(map(str, layers))


def cmd_verify(args: argparse.Namespace) -> int:
    ws = Workspace.open(args.data, readonly=True)
    rep = ws.verify(run=args.run, checksums=not args.no_checksums)
    if args.json:
        print(json.dumps({"ok": rep.ok, "problems": rep.problems, "warnings": rep.warnings, "runs": rep.runs,
                          "arrays": rep.arrays, "derived": rep.derived, "chunks": rep.chunks,
                          "bytes_checked": rep.bytes_checked}, indent=2))
    else:
        derived = f" and {rep.derived} derived array(s)" if rep.derived else ""
        print(f"checked {rep.runs} run(s), {rep.arrays} array(s){derived}, {rep.chunks} chunk(s),"
              f" {human(rep.bytes_checked)} in {rep.seconds:.1f} s")
        for w in rep.warnings:
            print(f"warning: {w}")
        for p in rep.problems:
            print(f"PROBLEM: {p}")
        print("ok" if rep.ok else f"{len(rep.problems)} problem(s)")
    return 0 if rep.ok else 1


def cmd_size(args: argparse.Namespace) -> int:
    p = size_estimate(samples=args.samples, layers=args.layers, tokens=args.tokens, dim=args.dim, dtype=args.dtype,
                      models=args.models, taps=args.taps, codec=args.codec, chunk_samples=args.chunk_samples,
                      data=resolve_path(args.data), batch_size=args.batch_size)
    if args.json:
        print(json.dumps({**p.__dict__, "fits": p.fits}, indent=2))
        return 0
    print(f"{p.models} model(s) x {p.samples} samples x {p.taps} tap(s) x {p.layers} layer(s) x {p.tokens} tokens"
          f" x {p.dim} dim x {p.dtype}")
    print(f"  values       {p.values:,}")
    print(f"  uncompressed {human(p.raw_bytes)} ({p.raw_bytes:,} bytes)")
    if p.codec != "none":
        print(f"  with {p.codec}: ~{human(p.bytes)} (measured ratio; lossy codecs round values)")
    print(f"  arrays       {p.arrays} ({p.chunk_files:,} chunk files of {p.chunk_samples} samples)")
    if p.free_bytes is not None:
        verdict = "fits" if p.fits else "DOES NOT FIT"
        print(f"  free disk    {human(p.free_bytes)} at {resolve_path(args.data)}: {verdict}")
    return 0 if p.fits is not False else 1


def cmd_drop_run(args: argparse.Namespace) -> int:
    ws = Workspace.open(args.data, readonly=True)
    if not args.yes:
        info = [r for r in ws.runs() if r["run"] == args.run]
        if not info:
            raise StoreError(f"no run {args.run!r} in {ws.path}")
        print(f"would remove run {args.run}: {info[0]['arrays']} array(s), {human(info[0]['bytes'])}; add --yes to do it")
        return 2
    counts = ws.drop_run(args.run, timeout=args.wait)
    print(f"dropped run {args.run}: " + ", ".join(f"{v} {k}" for k, v in counts.items() if v))
    return 0


def cmd_query(args: argparse.Namespace) -> int:
    ws = Workspace.open(args.data, readonly=True)
    table = ws.query(args.sql)
    rows = table.to_pylist()
    if args.json:
        print(json.dumps(rows, default=str, indent=2))
    elif table.num_columns:
        print(_table([tuple(r.values()) for r in rows], table.column_names))
    return 0


def parser() -> argparse.ArgumentParser:
    data_help = f"workspace folder (default: ${ENV_VAR}, else ./data)"
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--data", metavar="PATH", default=argparse.SUPPRESS, help=data_help)
    p = argparse.ArgumentParser(
        prog="python -m store",
        description="The agnosia activation store: Zarr v3 arrays + a DuckDB manifest in one workspace folder.",
    )
    p.add_argument("--data", metavar="PATH", default=None, help=data_help)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("init", parents=[common], help="create (or migrate) a workspace")
    s.add_argument("--arrays", metavar="URL", default=None,
                   help="keep the arrays in an object store, e.g. s3://bucket/prefix (credentials and endpoint from"
                        " the environment: AWS_* or $AGNOSIA_STORAGE_OPTIONS); the manifest stays in --data")
    s.set_defaults(fn=cmd_init)

    s = sub.add_parser("info", parents=[common], help="runs, arrays and sizes")
    s.add_argument("--run", help="list every array of this run")
    s.add_argument("--arrays", action="store_true", help="list every array of every run")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(fn=cmd_info)

    s = sub.add_parser("verify", parents=[common], help="check every committed chunk; exit 1 listing problems")
    s.add_argument("--run", help="only this run")
    s.add_argument("--no-checksums", action="store_true", help="check presence and shapes only (no data read)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(fn=cmd_verify)

    s = sub.add_parser("size", parents=[common], help="bytes an extraction would write, before running it")
    s.add_argument("--samples", type=int, required=True, help="stimuli per model")
    s.add_argument("--layers", type=int, required=True, help="layers stored per tap")
    s.add_argument("--tokens", type=int, required=True, help="token positions stored per sample")
    s.add_argument("--dim", type=int, required=True, help="hidden size")
    s.add_argument("--models", type=int, default=1, help="models (runs), default 1")
    s.add_argument("--taps", type=int, default=1, help="taps (or tap x site x token-kind arrays) per layer, default 1")
    s.add_argument("--dtype", default="float16", help="stored dtype: float16 (default), bfloat16, float32")
    s.add_argument("--codec", default="none", help="none (default), zstd, bitround8, bitround7")
    s.add_argument("--chunk-samples", type=int, default=64,
                   help="largest samples per chunk (default 64); chunks are evened out below it")
    s.add_argument("--batch-size", type=int, default=1,
                   help="samples per write (an extraction's batch_size): chunks stay multiples of it (default 1)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(fn=cmd_size)

    s = sub.add_parser("drop-run", parents=[common], help="remove a run and its arrays atomically")
    s.add_argument("run")
    s.add_argument("--yes", action="store_true", help="really remove it (without: show what would go)")
    s.add_argument("--wait", type=float, default=0.0, help="seconds to wait for a running writer (default 0)")
    s.set_defaults(fn=cmd_drop_run)

    s = sub.add_parser("query", parents=[common], help="run read-only SQL on the manifest")
    s.add_argument("sql", help="e.g. \"SELECT tap, layer, count(*) FROM activations GROUP BY ALL\"")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(fn=cmd_query)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except StoreError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

