"""A stimulus set on disk: PNG images plus one ground-truth table (Parquet) and a ``set.json``.

Layout of a set folder::

    set.json            family, config, n, seed, split, count, versions
    truth.parquet       one row per stimulus: id, family, split, seed, image, prompt, answer,
                        prompts{...}, answers{...}, params{...}, truth{...}, <extra image columns>
    images/<id>.png     the RGB stimulus
    <extra>/<id>.png    extra images (e.g. ``masks/`` for CountingTricks object masks)

A set is written into a temporary folder beside the target and renamed into place only when
complete, so an interrupted run never leaves a half-written set, and an existing set is never
replaced unless the caller asks for it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from stimuli.base import Family, Stimulus, StimulusError, config_dict
from stimuli.progress import progress_bar

SET_FORMAT_VERSION = 1
TRUTH_FILE = "truth.parquet"
SET_FILE = "set.json"


def stimulus_row(stim: Stimulus, image_path: str | None, extra_paths: dict[str, str]) -> dict[str, Any]:
    return {
        "id": stim.id,
        "family": stim.family,
        "split": stim.split,
        "seed": stim.seed,
        "image": image_path,
        "prompt": stim.prompt,
        "answer": stim.answer,
        "prompts": dict(stim.prompts),
        "answers": dict(stim.answers),
        "params": stim.params,
        "truth": stim.truth,
        **extra_paths,
    }


def write_set(
    family: Family,
    config: Any,
    n: int,
    seed: int,
    split: str,
    out: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    progress: bool = False,
) -> Path:
    """Generate ``family`` with ``config`` and write it as a set folder at ``out`` (``progress``: a bar on stderr)."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise StimulusError(
            f"{out} already exists: choose another --out, or pass --overwrite to replace it"
        )
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        started = time.perf_counter()
        stimuli = family.generate(config, n=n, seed=seed, split=split)  # checks the config first
        total = family.set_size(config, n) if family.cells else None
        with progress_bar(total, unit="stimulus", desc=family.name, enabled=progress, iterable=stimuli) as bar:
            count = _write_samples(family, bar, tmp)
        meta = {
            "format_version": SET_FORMAT_VERSION,
            "family": family.name,
            "config": config_dict(config),
            "n": n,
            "seed": seed,
            "split": split,
            "count": count,
            "seconds": round(time.perf_counter() - started, 3),
        }
        (tmp / SET_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_samples(family: Family, stimuli: Iterable[Stimulus], folder: Path) -> int:
    rows = []
    made_dirs: set[str] = set()
    for stim in stimuli:
        # A generator that drifts from its own truth schema fails here, before any set is written,
        # not later in scoring or in a probe target.
        family.read_truth(stim.truth, stim.id)
        image_path = None
        if stim.image is not None:
            image_path = _save_png(stim.image, folder, "images", stim.id, made_dirs)
        extra = {
            _extra_column(name): _save_png(img, folder, name, stim.id, made_dirs)
            for name, img in stim.extra_images.items()
        }
        rows.append(stimulus_row(stim, image_path, extra))
    if not rows:
        raise StimulusError("the configuration produced no stimuli: raise --n or widen the parameters")
    pq.write_table(pa.Table.from_pylist(rows), folder / TRUTH_FILE, compression="zstd")
    return len(rows)


def _extra_column(name: str) -> str:
    # "masks" -> "mask": the column names one file, the folder holds many.
    return name[:-1] if name.endswith("s") else name


def _save_png(img: Image.Image, folder: Path, sub: str, stim_id: str, made: set[str]) -> str:
    if sub not in made:
        (folder / sub).mkdir(exist_ok=True)
        made.add(sub)
    rel = f"{sub}/{stim_id}.png"
    # compress_level 1: PNG is lossless at any level; level 6 costs ~3x the time for ~10% bytes.
    img.save(folder / rel, format="PNG", compress_level=1)
    return rel


# Columns of truth.parquet that name files of the set: the image and the extra images (masks/).
PATH_COLUMNS = ("image", "mask")


def check_member(rel: object, folder: Path, what: str) -> str:
    """``rel`` if it is a relative path inside the set ``folder`` (no absolute path, no ``..``)."""
    text = rel if isinstance(rel, str) else ""
    parts = PurePosixPath(text).parts if text else ()
    if not parts or text.startswith(("/", "~")) or "\\" in text or ".." in parts or ":" in parts[0]:
        raise StimulusError(
            f"{what} is {rel!r}: image paths in a stimulus set are relative to its folder {folder} and stay inside"
            " it (e.g. 'images/<id>.png'); the set was edited or is not from `python -m stimuli`. Regenerate it"
        )
    return text


@dataclass(frozen=True)
class StimulusSet:
    """A set folder opened for reading."""

    path: Path
    meta: dict[str, Any]
    table: pa.Table

    @property
    def family(self) -> str:
        return self.meta["family"]

    def __len__(self) -> int:
        return self.table.num_rows

    def rows(self) -> list[dict[str, Any]]:
        return self.table.to_pylist()

    def image(self, row: dict[str, Any], column: str = "image") -> Image.Image:
        """Load the image a row points to (``column`` names an extra image, e.g. ``mask``)."""
        rel = row[column]
        if rel is None:
            raise StimulusError(f"stimulus {row['id']} has no {column}")
        path = self.path / check_member(rel, self.path, f"{column} of stimulus {row['id']}")
        try:
            with Image.open(path) as img:
                img.load()
                return img.copy()
        except (OSError, SyntaxError, Image.DecompressionBombError) as err:
            raise StimulusError(
                f"cannot read {column} of stimulus {row['id']} at {path}: {err}."
                " Regenerate the set with `python -m stimuli`."
            ) from err


def read_set(path: str | os.PathLike[str]) -> StimulusSet:
    """Open a set folder written by :func:`write_set`."""
    path = Path(path)
    meta_file, truth_file = path / SET_FILE, path / TRUTH_FILE
    if not meta_file.is_file() or not truth_file.is_file():
        raise StimulusError(
            f"{path} is not a stimulus set (expected {SET_FILE} and {TRUTH_FILE}):"
            " write one with `python -m stimuli FAMILY --out PATH`"
        )
    meta = _read_meta(meta_file)
    table = _read_truth(truth_file)
    for column in (c for c in table.column_names if c in PATH_COLUMNS):
        for i, rel in enumerate(table.column(column).to_pylist()):
            if rel is not None:
                check_member(rel, path, f"{column} of row {i} of {truth_file}")
    if meta.get("format_version", 0) > SET_FORMAT_VERSION:
        raise StimulusError(
            f"{path} was written by a newer agnosia (set format {meta['format_version']},"
            f" this one reads {SET_FORMAT_VERSION}): upgrade agnosia"
        )
    return StimulusSet(path=path, meta=meta, table=table)


# Columns every reader of a set relies on (extraction builds its samples from them).
REQUIRED_COLUMNS = ("id", "family", "image", "prompts", "answers", "params", "truth")
_REGENERATE = "regenerate the set with `python -m stimuli FAMILY --out PATH --overwrite`"


def _read_meta(meta_file: Path) -> dict[str, Any]:
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise StimulusError(f"{meta_file} is not readable JSON ({err}): {_REGENERATE}") from err
    if not isinstance(meta, dict):
        raise StimulusError(f"{meta_file} holds a JSON {type(meta).__name__}, expected an object: {_REGENERATE}")
    return meta


def _read_truth(truth_file: Path) -> pa.Table:
    try:
        table = pq.ParquetFile(truth_file).read()  # read_table would import pyarrow.dataset and pandas (~0.5 s)
    except (OSError, pa.ArrowException) as err:
        raise StimulusError(
            f"{truth_file} cannot be read ({err}): the file is truncated or damaged; {_REGENERATE}"
        ) from err
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise StimulusError(
            f"{truth_file} has no column {', '.join(map(repr, missing))} (it has {', '.join(table.column_names)}):"
            f" it was edited or is not from `python -m stimuli`; {_REGENERATE}"
        )
    if table.num_rows == 0:
        raise StimulusError(f"{truth_file} holds no stimuli (0 rows): {_REGENERATE} with --n of at least 1")
    _check_values(truth_file, table)
    return table


def _check_values(truth_file: Path, table: pa.Table) -> None:
    """Values every reader takes as given: a null, empty or repeated ``id``, a null ``image``, or a
    seed that is not a whole number (NaN, 1.5), were tracebacks deep in the extraction (a TypeError
    joining a path, a ValueError converting NaN) after the model had loaded, or a refusal after the
    run's row was written."""
    ids = table.column("id").to_pylist()
    empty = [i for i, v in enumerate(ids) if v is not None and str(v) == ""]
    if empty:
        raise StimulusError(f"{truth_file}: {len(empty)} row(s) have an empty id, e.g. row {empty[0]}; every stimulus"
                            f" has one: the file was edited or is damaged; {_REGENERATE}")
    counts = Counter(str(v) for v in ids if v is not None)
    repeated = sorted(k for k, n in counts.items() if n > 1)
    if repeated:
        # Stimulus keys are '<set folder>/<id>': a repeated id would make two stimuli one.
        raise StimulusError(f"{truth_file}: stimulus ids must be unique within a set, repeated: {repeated[:5]}; the"
                            f" file was edited or is damaged; {_REGENERATE}")
    for column in ("id", "image"):
        nulls = [i for i, v in enumerate(table.column(column).to_pylist()) if v is None]
        if nulls:
            raise StimulusError(
                f"{truth_file}: {len(nulls)} row(s) have no {column} (null), e.g. row {nulls[0]}"
                + (f" (id {ids[nulls[0]]!r})" if column != "id" else "")
                + f"; every stimulus has one: the file was edited or is damaged; {_REGENERATE}"
            )
    if "seed" in table.column_names:
        for i, seed in enumerate(table.column("seed").to_pylist()):
            whole = seed is None or (isinstance(seed, int) and not isinstance(seed, bool)) or (
                isinstance(seed, float) and math.isfinite(seed) and seed.is_integer())
            if not whole:
                raise StimulusError(
                    f"{truth_file}: row {i} (id {ids[i]!r}) has seed {seed!r}, not a whole number; a stimulus's seed"
                    f" is an integer (or null when unknown): the file was edited or is damaged; {_REGENERATE}"
                )
