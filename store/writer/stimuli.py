"""Stimuli in the manifest: a set's rows, registered block by block.

Stimuli belong to the workspace, not to a run: registering them changes no run (the run is not
marked running), and registering identical rows again is a no-op.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from store import db
from store.errors import SpecMismatchError, StoreError
from store.records import check_name, json_object, to_json
from store.writer.context import RunContext, now

REGISTER_ROWS = 256  # stimuli per registration transaction of a set
STIMULUS_FIELDS = ("family", "split", "seed", "prompt", "answer", "prompts", "answers", "params", "truth", "image")


def register_rows(ctx: RunContext, rows: Iterable[Mapping[str, Any]], *, dataset: str,
                  set_path: str | os.PathLike[str] | None = None) -> list[str]:
    """Add stimuli (rows in the truth.parquet format) to ``stimuli``; returns their keys
    ``<dataset>/<id>`` in input order. Re-registering identical rows is a no-op; a changed row
    with a known key is refused."""
    check_name("dataset", dataset)
    return _register_block(ctx, rows, dataset, set_path, set())


def register_set(ctx: RunContext, path: str | os.PathLike[str], *, dataset: str | None = None) -> list[str]:
    """Register a stimulus set folder (``truth.parquet`` inside); dataset defaults to its name.
    One transaction per block of rows: a set refused part-way keeps its earlier blocks' rows,
    which no run points at (registering the mended set again is then a no-op for them)."""
    folder = Path(path)
    truth = folder / "truth.parquet"
    if not truth.is_file():
        raise StoreError(
            f"{folder} is not a stimulus set (expected {truth}): write one with `python -m stimuli`"
        )
    name = dataset or folder.name
    check_name("dataset", name)
    keys: list[str] = []
    seen: set[str] = set()
    # Block by block: a whole set as Python rows held ~12 KiB per stimulus at once (and the
    # allocators keep it), so the run's peak memory grew with the set. Not read_table: it
    # imports pandas (~0.5 s).
    for block in pq.ParquetFile(truth).iter_batches(batch_size=REGISTER_ROWS):
        keys += _register_block(ctx, block.to_pylist(), name, folder.resolve(), seen)
    return keys


def _register_block(ctx: RunContext, rows: Iterable[Mapping[str, Any]], dataset: str,
                    set_path: str | os.PathLike[str] | None, seen: set[str]) -> list[str]:
    """One transaction of :func:`register_rows`; ``seen``: the keys of the set's earlier blocks."""
    records = []
    set_text = None if set_path is None else str(set_path)
    for r in rows:
        if "id" not in r or r["id"] in (None, ""):
            raise StoreError(f"every stimulus row needs an 'id' (the truth.parquet format), got keys {sorted(r)}")
        encoded = {k: to_json(r.get(k)) for k in ("id", *STIMULUS_FIELDS)}
        records.append(
            {
                "stimulus": f"{dataset}/{r['id']}",
                "dataset": dataset,
                "id": str(r["id"]),
                "family": r.get("family"),
                "split": r.get("split"),
                "seed": None if r.get("seed") is None else int(r["seed"]),
                "prompt": r.get("prompt"),
                "answer": r.get("answer"),
                "prompts": encoded["prompts"],
                "answers": encoded["answers"],
                "params": encoded["params"],
                "truth": encoded["truth"],
                "image": r.get("image"),
                "set_path": set_text,
                # of the row's fields as one canonical JSON object: what a re-registration compares
                "digest": hashlib.sha1(json_object(encoded).encode()).hexdigest(),
            }
        )
    keys = [str(r["stimulus"]) for r in records]
    if len(set(keys)) != len(keys) or not seen.isdisjoint(keys):
        dup = sorted({k for k in keys if keys.count(k) > 1 or k in seen})[:5]
        raise StoreError(f"stimulus ids must be unique within dataset {dataset}, repeated: {dup}")
    seen.update(keys)
    if not records:
        return []
    with ctx.connection() as con:
        db.register_records(con, "new_stimuli", records, {"seed": "int64"})
        changed = con.execute(
            "SELECT n.stimulus FROM new_stimuli n JOIN stimuli s USING (stimulus)"
            " WHERE s.digest <> n.digest LIMIT 5"
        ).fetchall()
        if changed:
            raise SpecMismatchError(
                f"stimuli {[c[0] for c in changed]} are already registered with different content (a set"
                " regenerated in place?). A regenerated set needs a new dataset name (its folder name, or"
                " dataset=...), or drop the runs that use the old one (python -m store drop-run RUN)"
            )
        con.execute(
            "INSERT INTO stimuli SELECT stimulus, dataset, id, family, split, seed, prompt, answer,"
            " prompts::JSON, answers::JSON, params::JSON, truth::JSON, image, set_path, digest, ? FROM new_stimuli"
            " WHERE stimulus NOT IN (SELECT stimulus FROM stimuli)",
            [now()],
        )
        con.unregister("new_stimuli")  # the run's connection outlives this call
    return keys
