"""The small value types the store takes and returns, and the name rules they share.

Everything here is plain data: the writer and reader validate against these at the edge, so the
rest of the store can trust them.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii
from typing import Any, Literal

import numpy as np

from store.errors import StoreError
from store.vocab import HEAD_TAPS

# Names become Zarr path segments and SQL literals: keep them boring.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")

# The tap and token words are store/vocab.py's table; an array here takes any name that passes the
# name rule, so a tool may store arrays of its own next to extraction's.

Bf16Policy = Literal["fp16", "bits"]
OverflowPolicy = Literal["error", "clip"]
SOURCE_DTYPES = ("float32", "float16", "bfloat16")
STORED_DTYPES = ("float32", "float16", "bfloat16")


def check_name(kind: str, value: str) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise StoreError(
            f"{kind} must be 1-128 characters of letters, digits, '_', '.', '-' starting with a letter"
            f" or digit (it becomes a Zarr path segment), got {value!r}"
        )
    return value


def chunk_size(n_samples: int, requested: int, batch: int = 1) -> int:
    """Samples per chunk of an array of ``n_samples`` rows when ``requested`` is asked for.

    Zarr stores a dense array's last chunk full-size, so 200 samples in chunks of 64 would take
    256 rows on disk (2.56 bytes per float16 value). The store keeps the number of chunks
    ``requested`` needs and evens them out instead: ``ceil(n / ceil(n / requested))``, never more
    than ``requested``, at most one padded row per chunk (200 in chunks of 64: four of 50).

    With ``batch`` > 1 (the rows a producer hands over at once) and ``requested`` a multiple of it,
    the size stays a multiple of ``batch``, so batches never straddle chunks and a resumed run,
    which restarts at a chunk, batches its rows as the first run did (a sample's values depend on
    the batch it shares). Of the sizes that give between the fewest and twice the fewest chunks, the
    one with the least padding wins, then the fewest chunks (200 in chunks of 64, batches of 8:
    five of 40). Padding is then under one batch in all.
    """
    n = max(int(n_samples), 1)
    if requested >= n:
        return n
    if batch <= 1 or requested % batch:
        chunks = -(-n // requested)
        return -(-n // chunks)
    units = -(-n // batch)
    fewest = -(-units // (requested // batch))
    best = min(range(fewest, min(2 * fewest, units) + 1), key=lambda k: (k * -(-units // k) - units, k))
    return batch * -(-units // best)


def to_json(value: Any) -> str | None:
    """Canonical JSON (sorted keys) of plain or numpy values; None stays SQL NULL."""
    if value is None:
        return None
    if isinstance(value, str):  # the encoder's own fast paths, without its per-call set-up
        return encode_basestring_ascii(value)
    if type(value) is int:
        return int.__repr__(value)
    return _ENCODER.encode(value)


def json_object(encoded: Mapping[str, str | None]) -> str:
    """What :func:`to_json` gives for the dict whose values ``encoded`` holds already encoded
    (None: a null value), byte for byte: a record's fields encoded once serve both their own
    columns and the digest of the whole record (registering a set encoded each field twice)."""
    return "{" + ", ".join(f"{encode_basestring_ascii(k)}: {'null' if v is None else v}"
                           for k, v in sorted(encoded.items())) + "}"


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    raise TypeError(f"cannot store {type(obj).__name__} as JSON: convert it to plain lists/dicts/numbers")


# One encoder for every call: json.dumps with these options builds a new one each time.
_ENCODER = json.JSONEncoder(sort_keys=True, default=_json_default, allow_nan=True)


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count``: the writer that fills chunks ``c`` with ``c % count == index``.

    k processes (k GPUs) fill one run of one workspace, each its own chunks, so no row is written
    twice and none is left out; a chunk is the unit of resume, so it is the unit of sharing too.
    """

    index: int
    count: int

    def __post_init__(self) -> None:
        if not (isinstance(self.count, int) and isinstance(self.index, int) and self.count >= 1
                and 0 <= self.index < self.count):
            raise StoreError(
                f"a shard is i/k with k >= 1 and 0 <= i < k (shard 0/2 and 1/2 split a run in two),"
                f" got {self.index}/{self.count}"
            )

    @classmethod
    def parse(cls, text: str) -> Shard:
        """``"i/k"`` -> Shard(i, k)."""
        parts = str(text).strip().split("/")
        try:
            if len(parts) != 2:
                raise ValueError
            index, count = int(parts[0]), int(parts[1])
        except ValueError:
            raise StoreError(f"a shard is written i/k (e.g. 0/4 for the first of four), got {text!r}") from None
        return cls(index, count)

    def owns(self, chunk: int) -> bool:
        return chunk % self.count == self.index

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


@dataclass(frozen=True)
class RunInfo:
    """What a run is: provenance recorded in ``runs``, and the storage policy of its arrays.

    ``chunk_samples`` is the default largest number of samples per chunk; resume works in chunks,
    so a crash re-computes at most that many samples per unfinished chunk. An array's chunks are
    evened out below it so its last chunk wastes no space (:func:`chunk_size`), and kept multiples
    of ``batch_size`` (the rows handed over per ``write``) when ``chunk_samples`` is one. A resumed
    run keeps the chunk size its arrays were created with.
    """

    run: str
    model: str
    revision: str | None = None
    adapter: str | None = None
    dtype: str | None = None
    attn_implementation: str | None = None
    versions: Mapping[str, str] = field(default_factory=dict)
    config: Mapping[str, Any] = field(default_factory=dict)
    chunk_samples: int = 64
    bf16: Bf16Policy = "fp16"
    overflow: OverflowPolicy = "error"
    #: How the model was made to run differently (``{"kind": "rope_scaling", "alpha": 99, ...}``); None: plain.
    intervention: Mapping[str, Any] | None = None
    #: Rows per producer batch: chunk sizes stay multiples of it (see :func:`chunk_size`). Not part of
    #: the run's identity: an existing array keeps the chunk size it has.
    batch_size: int = 1

    def __post_init__(self) -> None:
        check_name("run", self.run)
        if self.intervention is not None and not (isinstance(self.intervention, Mapping) and self.intervention.get("kind")):
            raise StoreError(f"RunInfo.intervention must be a mapping with a 'kind', got {self.intervention!r}")
        if not self.model:
            raise StoreError("RunInfo.model must name the model (a local folder or a hub id), got ''")
        if not isinstance(self.chunk_samples, int) or not 1 <= self.chunk_samples <= 1 << 20:
            raise StoreError(f"chunk_samples must be an int in 1..1048576, got {self.chunk_samples!r}")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise StoreError(f"batch_size must be an int >= 1 (rows per write), got {self.batch_size!r}")
        if self.bf16 not in ("fp16", "bits"):
            raise StoreError(f"bf16 policy must be 'fp16' or 'bits', got {self.bf16!r}")
        if self.overflow not in ("error", "clip"):
            raise StoreError(f"overflow policy must be 'error' or 'clip', got {self.overflow!r}")

    def identity(self) -> dict[str, Any]:
        """The fields a resumed run must match (versions may legitimately differ)."""
        return {
            "model": self.model,
            "revision": self.revision,
            "adapter": self.adapter,
            "dtype": self.dtype,
            "attn_implementation": self.attn_implementation,
            "config": json.loads(to_json(dict(self.config)) or "{}"),
            "chunk_samples": self.chunk_samples,
            "intervention": json.loads(to_json(dict(self.intervention)) or "null") if self.intervention else None,
            "bf16": self.bf16,
            "overflow": self.overflow,
        }


@dataclass(frozen=True)
class ArraySpec:
    """One stored array of a run: ``(tap, layer, site, tokens)`` plus its per-sample layout.

    ``shape`` is the shape of one sample (dense: e.g. ``(256, 768)`` image tokens or
    ``(heads, query_rows, keys)`` attention rows) or of one token row when ``ragged`` (e.g.
    ``(768,)``: each sample then holds a variable number of such rows).
    ``dtype`` is what the producer hands over; ``stored_dtype`` defaults to float16 (bfloat16
    sources follow the run's bf16 policy); ``codec`` is ``none``, ``zstd`` (lossless) or
    ``bitround<k>`` (lossy: k mantissa bits kept, then zstd).
    """

    tap: str
    layer: int
    tokens: str
    shape: tuple[int, ...]
    site: str = "resid_post"
    ragged: bool = False
    dtype: str = "float32"
    stored_dtype: str | None = None
    codec: str = "none"
    module: str | None = None
    dims: tuple[str, ...] | None = None
    chunk_samples: int | None = None

    def __post_init__(self) -> None:
        check_name("tap", self.tap)
        check_name("site", self.site)
        check_name("tokens", self.tokens)
        if self.tokens == "sample":  # each site group's stimulus-id coordinate (store/arrays.py)
            raise StoreError("tokens 'sample' is reserved for the stimulus-id coordinate: name the kind otherwise")
        if not isinstance(self.layer, (int, np.integer)) or isinstance(self.layer, bool) or self.layer < 0:
            raise StoreError(
                f"layer must be the block index >= 0 (use 0 for taps without layers; -1 is a read-time"
                f" alias only), got {self.layer!r}"
            )
        shape = tuple(int(s) for s in self.shape)
        if not shape or any(s < 1 for s in shape):
            raise StoreError(f"shape is the per-sample shape, all dims >= 1, e.g. (256, 768); got {self.shape!r}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "layer", int(self.layer))
        if self.dtype not in SOURCE_DTYPES:
            raise StoreError(f"dtype must be one of {SOURCE_DTYPES} (what the model produces), got {self.dtype!r}")
        if self.stored_dtype is not None and self.stored_dtype not in STORED_DTYPES:
            raise StoreError(f"stored_dtype must be one of {STORED_DTYPES} or None, got {self.stored_dtype!r}")
        if self.dims is not None and len(self.dims) != len(shape):
            raise StoreError(f"dims names the per-sample dims: expected {len(shape)} names for shape {shape}, got {self.dims!r}")
        if self.chunk_samples is not None and not 1 <= self.chunk_samples <= 1 << 20:
            raise StoreError(f"chunk_samples must be in 1..1048576 or None, got {self.chunk_samples!r}")

    def default_dims(self) -> tuple[str, ...]:
        if self.dims is not None:
            return tuple(self.dims)
        if self.ragged:
            return ("row",) + (("dim",) if len(self.shape) == 1 else tuple(f"dim{i}" for i in range(len(self.shape))))
        if len(self.shape) == 1:
            return ("dim",)
        if len(self.shape) == 2:
            return ("token", "dim")
        if len(self.shape) == 3 and self.tap in HEAD_TAPS:
            return ("head", "query", "key")
        return tuple(f"dim{i}" for i in range(len(self.shape)))


@dataclass(frozen=True)
class ArrayInfo:
    """An array as the manifest records it (one ``activations`` row)."""

    run: str
    tap: str
    layer: int
    site: str
    tokens: str
    module: str | None
    zarr_path: str
    layout: Literal["dense", "ragged"]
    shape: tuple[int, ...]
    dims: tuple[str, ...]
    chunk_samples: int
    n_chunks: int
    dtype: str
    stored_dtype: str
    codec: str
    values_per_row: int
    bytes: int

    @property
    def n_samples(self) -> int:
        return self.shape[0]

    @property
    def item_shape(self) -> tuple[int, ...]:
        """Per-sample shape (dense) or per-row shape (ragged; shape holds -1 for the row count)."""
        return self.shape[2:] if self.layout == "ragged" else self.shape[1:]

    def chunk_rows(self, chunk: int) -> range:
        start = chunk * self.chunk_samples
        return range(start, min(start + self.chunk_samples, self.n_samples))

    def key(self) -> str:
        return f"{self.run}:{self.tap}/{self.layer}/{self.site}/{self.tokens}"


# The columns of an ``activations`` row, in the order :func:`array_info_of_row` reads them.
ARRAY_COLUMNS = (
    "run, tap, layer, site, tokens, module, zarr_path, layout, shape, dims, chunk_samples, n_chunks,"
    " dtype, stored_dtype, codec, values_per_row, bytes"
)


def array_info_of_row(row: Sequence[Any]) -> ArrayInfo:
    """The :class:`ArrayInfo` of an ``activations`` row selected as :data:`ARRAY_COLUMNS`."""
    return ArrayInfo(
        run=row[0], tap=row[1], layer=int(row[2]), site=row[3], tokens=row[4], module=row[5], zarr_path=row[6],
        layout=row[7], shape=tuple(int(s) for s in row[8]), dims=tuple(row[9]), chunk_samples=int(row[10]),
        n_chunks=int(row[11]), dtype=row[12], stored_dtype=row[13], codec=row[14], values_per_row=int(row[15]),
        bytes=int(row[16]),
    )


@dataclass(frozen=True)
class TokenSpans:
    """Where the token kinds sit in one sample's sequence (0-based positions).

    Image tokens are ``image_count`` consecutive positions from ``image_start`` forming a
    ``grid_h x grid_w`` patch grid in raster order; answer tokens are ``answer_count``
    consecutive positions from ``answer_start``. ``extra`` holds any other named spans (JSON).
    """

    seq_len: int
    image_start: int | None = None
    image_count: int | None = None
    grid_h: int | None = None
    grid_w: int | None = None
    last_prompt: int | None = None
    answer_start: int | None = None
    answer_count: int | None = None
    extra: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.seq_len < 0:
            raise StoreError(f"seq_len must be >= 0, got {self.seq_len}")
        if self.grid_h is not None and self.grid_w is not None and self.image_count is not None:
            if self.grid_h * self.grid_w != self.image_count:
                raise StoreError(
                    f"the patch grid must cover the image tokens in raster order: grid {self.grid_h}x{self.grid_w}"
                    f" = {self.grid_h * self.grid_w} != image_count {self.image_count}"
                )
        for name, start, count in (
            ("image", self.image_start, self.image_count),
            ("answer", self.answer_start, self.answer_count),
        ):
            if start is not None and count is not None and not 0 <= start <= start + count <= self.seq_len:
                raise StoreError(
                    f"{name} span [{start}, {start + count}) must lie inside the sequence [0, {self.seq_len})"
                )
        if self.last_prompt is not None and not 0 <= self.last_prompt < max(self.seq_len, 1):
            raise StoreError(f"last_prompt {self.last_prompt} must lie inside the sequence [0, {self.seq_len})")


#: Why a generation stopped: the model wrote an end-of-sequence id ("eos"), or it ran into the
#: token cap without one ("cap"). NULL in the manifest for rows recorded before this was kept.
STOP_REASONS = ("eos", "cap")
#: What an answer is, whatever the task: see :func:`answer_kind`.
ANSWER_KINDS = ("empty", "word", "digits", "runaway")
_DIGIT = re.compile(r"[0-9]")


def answer_kind(text: str | None, stop_reason: str | None) -> str:
    """What an answer is before any task reads it, the one classification the store, the queries
    and the lab share.

    ``runaway``: no end-of-sequence id within the cap, so the text is a cut, not an answer (it
    takes precedence: digits cut at the cap are not a number the model gave). Otherwise
    ``empty`` (nothing but whitespace), ``digits`` (holds a digit 0-9: what the counting studies'
    parsers read) or ``word`` (text without a digit, e.g. ``False``). ``stop_reason`` None (not
    recorded) classifies by the text alone.
    """
    if stop_reason == "cap":
        return "runaway"
    if not text or not text.strip():
        return "empty"
    return "digits" if _DIGIT.search(text) else "word"


@dataclass(frozen=True)
class Generation:
    """What the model said about one stimulus, parsed and scored.

    ``metrics`` holds extra numbers (e.g. ``{"cells_correct": 7, "cells_total": 9}``) as JSON.
    ``stop_reason`` is one of :data:`STOP_REASONS` (None: not known).
    """

    text: str
    prediction: Any = None
    parse_ok: bool | None = None
    correct: bool | None = None
    score: float | None = None
    metrics: Mapping[str, Any] | None = None
    n_tokens: int | None = None
    stop_reason: str | None = None

    def __post_init__(self) -> None:
        if self.stop_reason is not None and self.stop_reason not in STOP_REASONS:
            raise StoreError(f"stop_reason must be one of {STOP_REASONS} or None, got {self.stop_reason!r}")

    @property
    def kind(self) -> str:
        """:func:`answer_kind` of this generation."""
        return answer_kind(self.text, self.stop_reason)


@dataclass(frozen=True)
class ProbeResult:
    """One trained probe, as the probe farm reports it (one ``probes`` row)."""

    run: str
    tap: str
    layer: int
    target: str
    kind: str
    score: float
    site: str = "resid_post"
    tokens: str = "image"
    seed: int = 0
    n_train: int | None = None
    n_test: int | None = None
    metric: str = "accuracy"
    control_score: float | None = None
    artifact: str | None = None
    params: Mapping[str, Any] | None = None
    # The probe's identity (probes/plan.py's key); None: derived from the fields above, so a
    # hand-made result recorded twice replaces itself.
    key: str | None = None
    series: str | None = None              # the key without tap/layer/site/seed: one curve along depth
    kind_params: Mapping[str, Any] | None = None
    split: str | None = None
    test_fraction: float | None = None
    train_where: str | None = None
    # Per test sample (``probe_predictions`` rows): equal-length sequences under "array_row" and
    # any of "prediction", "truth", "score", and the shuffled-label control's "control_prediction"
    # and "control_score" (missing or NaN entries are stored as NULL).
    predictions: Mapping[str, Any] | None = None
    # Which of k folds this probe tested (split kfold: the k probes of one seed test every sample
    # once); None for a hash or column split.
    fold: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.score, (int, float)) or math.isnan(float(self.score)):
            raise StoreError(f"probe score must be a number, got {self.score!r}")
        if self.predictions is not None:
            n = len(self.predictions.get("array_row", ()))
            bad = [k for k, v in self.predictions.items() if len(v) != n]
            if "array_row" not in self.predictions or bad:
                raise StoreError(f"probe predictions need array_row and equal-length columns; {bad or 'array_row'} differ")
        rule = (self.params or {}).get("split")
        if isinstance(rule, dict):  # a result that carries its split only in params (older callers, migrations)
            if self.split is None:
                object.__setattr__(self, "split", json.dumps(rule, sort_keys=True))
            if self.test_fraction is None and rule.get("test_fraction") is not None:
                object.__setattr__(self, "test_fraction", float(rule["test_fraction"]))

    def probe_key(self) -> str:
        """The primary key: the plan's key when given, else a hash of the identity fields."""
        if self.key:
            return self.key
        if self.params and self.params.get("key"):
            return str(self.params["key"])
        ident = [self.run, self.tap, int(self.layer), self.site, self.tokens, self.target, self.kind, int(self.seed),
                 self.kind_params, self.split, self.test_fraction, self.train_where]
        if self.fold is not None:  # keys of results without a fold stay what they were
            ident.append(int(self.fold))
        return "h" + hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:23]


@dataclass(frozen=True)
class Selection:
    """Rows of one run picked by a manifest query, ascending, with their stimulus keys."""

    run: str
    rows: np.ndarray
    stimuli: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.rows)


@dataclass(frozen=True)
class Ragged:
    """Variable-length rows per sample: ``values[offsets[i]:offsets[i+1]]`` belongs to sample i."""

    values: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i] : self.offsets[i + 1]]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def split(self) -> list[np.ndarray]:
        return [self[i] for i in range(len(self))]
