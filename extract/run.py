"""The one-shot extraction run: a manifest's model over its stimuli, streamed into the store.

Per batch: one greedy ``generate`` with hooks on exactly the requested taps (image and last-prompt
tokens from the prompt pass, answer tokens from the steps that fed them back), the answer parsed
and scored, token spans recorded, and everything handed to the store's background writer. The
model never waits on disk; a crash loses at most the chunks not yet committed, and a re-run of
the same manifest continues where it stopped (the store knows which chunks are durable).

Stored layout per run (arrays addressed by ``(tap, layer, site, tokens)``):

- ``image`` tokens: dense ``[samples, tokens, dim]`` when every image of the run has the same
  size, else ragged (rows = tokens);
- ``last``: dense ``[samples, 1, dim]``; ``answer``: ragged (rows = answer tokens, pads and the
  end-of-sequence token excluded);
- attention (tap ``attn``, site ``probs``): ragged rows of ``[heads]``; for query kind ``last``
  one row per key of the prompt, for ``answer`` one row per (answer query, key) pair over the
  full sequence (keys past the query are 0, and so are keys before a sliding window's start: every
  row is filed under the keys' true positions). ``samples``/token spans give the reshape:
  ``answer_count x seq_len`` rows;
- run tensors ``lm_head.weight`` (+ ``lm_head.bias``), ``final_norm.weight`` (+ bias) and the
  norm's kind/eps/offset in the run config, for an offline logit lens.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from PIL import Image

from extract.generation import answer_length, stop_ids, stop_reason
from extract.interventions import INTERVENTION_FILE
from extract.interventions import describe as describe_intervention
from extract.interventions.rope import scaled_vision_rope
from extract.manifest import (
    GenerationSpec,
    Manifest,
    ManifestError,
    StorageSpec,
    check_codec,
    check_sets,
    expand_layers,
    storage_yaml,
    store_policy,
)
from extract.models import (
    CaptureKey,
    CaptureResult,
    LoadedModel,
    RaggedTokens,
    capture,
    capture_first_token,
    capture_generate,
    forward_answer_blockers,
    load_model,
    prepare_batch,
    readout,
    resolve_points,
)
from extract.models.capture import Point
from extract.models.compat import ATTENTION_ROWS, rows_path
from extract.models.errors import InputError
from extract.models.inputs import Batch, image_size
from extract.models.layout import Grid, SampleLayout
from extract.samples import Sample, by_modality, collect_samples, run_progress
from extract.scoring import score_answer
from store import ArrayHandle, ArraySpec, Generation, RunInfo, TokenSpans, Workspace, Writer, WriterStats
from store.ahead import ManifestAhead
from store.arrays import array_path
from store.dtypes import ArrayOverflowError
from store.errors import DtypeOverflowError, StoreError
from store.heap import tune_malloc
from store.vocab import IMAGE_ONLY_TAPS, array_layout, kinds_for
from store.workspace import MANIFEST, resolve_path


@dataclass(frozen=True)
class RunSummary:
    run: str
    workspace: Path
    samples: int
    computed: int
    seconds: float
    accuracy: float | None       # the run's: every scored row stored, resumed or not
    arrays: int
    new_accuracy: float | None = None  # the rows computed by this call only
    scored: int = 0
    commits: WriterStats | None = None  # the run's writer's counters (a cluster run: its client's)

    def __str__(self) -> str:
        acc = "n/a" if self.accuracy is None else f"{self.accuracy:.1%}"
        rate = self.computed / self.seconds if self.seconds else 0.0
        if self.computed < self.samples and self.scored:  # a resume: the new rows alone are not the run
            new = "" if self.new_accuracy is None else f"; the {self.computed} computed now: {self.new_accuracy:.1%}"
            acc = f"{acc} (of {self.scored} scored rows{new})"
        return (f"run {self.run}: {self.samples} samples ({self.computed} computed now, {rate:.1f}/s),"
                f" {self.arrays} arrays, accuracy {acc} -> {self.workspace}")


# ------------------------------------------------------------------------------------------ stimuli

def image_sizes(samples: list[Sample]) -> dict[tuple[int, int], Sample]:
    """The first sample of each image size. Reads every image's header (not its pixels), so a
    missing, broken or oversized image fails here, before the workspace is touched."""
    sizes: dict[tuple[int, int], Sample] = {}
    for s in samples:
        if s.image is None:
            continue
        try:
            sizes.setdefault(image_size(s.image), s)
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:  # missing, unparsable, a bomb
            raise InputError(
                f"image {str(s.image)!r} of stimulus {s.key} cannot be read ({type(err).__name__}: {err}):"
                " regenerate the set (`python -m stimuli ... --overwrite`) or replace the file, then"
                " re-run the same command"
            ) from err
    return sizes


# Processors that refuse a size are fixed-size ones; sets with many sizes are for processors that
# resize, and checking each would cost a processor call per image. Past this, a batch names the image.
MAX_SIZES_CHECKED = 32


def check_image_sizes(lm: LoadedModel, sizes: dict[tuple[int, int], Sample], checked: Sample | None = None) -> None:
    """One processor call per image size: a size the model's processor refuses fails before any batch.
    The size of ``checked`` is skipped: that sample was prepared already (:func:`array_specs`)."""
    for s in list(sizes.values())[:MAX_SIZES_CHECKED]:
        if s is not checked:
            prepare_one(lm, s)


def prepare_one(lm: LoadedModel, s: Sample, **kwargs: Any) -> Batch:
    """``prepare_batch`` of one sample; a processor that refuses its image names the image, the
    stimulus and the size."""
    try:
        return prepare_batch(lm, [s.image], [s.prompt], strings=[s.strings], **kwargs)
    except InputError as err:
        if s.image is None:
            raise
        with Image.open(s.image) as im:
            width, height = im.size
        raise InputError(f"image {str(s.image)!r} of stimulus {s.key} ({width}x{height} px): {err}") from err


def prepare_group(lm: LoadedModel, group: list[Sample]) -> Batch:
    """``prepare_batch`` of one batch (left-padded for generation); a processor that refuses it is
    asked again image by image, so the error names the image, the stimulus and the size."""
    try:
        return prepare_batch(lm, [s.image for s in group], [s.prompt for s in group],
                             strings=[s.strings for s in group], padding_side="left")
    except InputError as err:
        if any(s.image is not None and str(s.image) in str(err) for s in group):
            raise  # it names its image already (one that cannot be read)
        for s in group:
            prepare_one(lm, s, padding_side="left")
        raise


# ------------------------------------------------------------------------------------------ taps

def tap_request(lm: LoadedModel, manifest: Manifest, with_images: bool = True) -> dict[str, list[str]]:
    """Hook-point name -> token kinds, with layers expanded against the loaded model.

    ``with_images=False`` (every sample text-only) refuses what only an image yields.
    """
    request: dict[str, list[str]] = {}
    if not with_images:
        for i, t in enumerate(manifest.taps):
            if t.tap in IMAGE_ONLY_TAPS or "image" in t.tokens:
                raise ManifestError(
                    f"taps.{i} ({t.tap}, tokens {t.tokens}): every task of this run is text-only, so there are no"
                    " image tokens to keep; drop the vision/projector taps and the 'image' token kind"
                )
    for i, t in enumerate(manifest.taps):
        try:
            layers = expand_layers(t.layers, lm.adapter.n_layers(t.tap))
        except ManifestError as err:
            raise ManifestError(f"taps.{i} ({t.tap}): {err}") from None
        kinds = kinds_for(t.tap, t.tokens)
        site = f".{t.site}" if t.site else ""
        for layer in layers:
            wanted = request.setdefault(f"{t.tap}.{layer}{site}", [])
            wanted += [k for k in kinds if k not in wanted]
    if manifest.attention:
        try:
            layers = expand_layers(manifest.attention.layers, lm.adapter.n_layers("attn"))
        except ManifestError as err:
            raise ManifestError(f"attention: {err}") from None
        for layer in layers:
            request[f"attn.{layer}"] = list(manifest.attention.queries)
    if not request:
        raise ManifestError("the manifest keeps nothing: add taps (or attention) to store activations")
    resolve_points(lm, request, ())  # every name resolved before any forward: a bad tap/site fails here
    return request


def array_specs(lm: LoadedModel, points: list[Point], first: Sample, dense_images: bool,
                dtype: str, codec: str) -> dict[CaptureKey, ArraySpec]:
    """Per-sample shapes from one teacher-forced forward on ``first`` (an image sample if any),
    which also checks every tap and that the processor takes ``first``'s image size."""
    batch = prepare_one(lm, first, answers=[first.answer or "0"])
    specs = specs_of(capture(lm, batch, points, tokens=("image", "last", "answer")), points, dense_images, dtype, codec)
    assert specs is not None, "a teacher-forced forward captures every requested key"
    return specs


def specs_of(res: CaptureResult, points: list[Point], dense_images: bool, dtype: str,
             codec: str) -> dict[CaptureKey, ArraySpec] | None:
    """Per-sample shapes of every requested key, read off one captured batch; None if the batch
    lacks a key whose shape no other kind of the same hook point gives (image taps of a text-only
    batch). A kind the batch did not produce (``answer`` rows of a prompt-only run) takes its row
    width from a sibling: every kind of one hook point has rows of the same width."""
    specs = {}
    for p in points:
        keys = [p.spec.key(kind) for kind in p.kinds]
        have = [k for k in keys if k in res]
        if not have:
            return None
        for key in keys:
            value = res[key if key in res else have[0]]
            row = value.row(0) if isinstance(value, RaggedTokens) else value[0]
            layout = array_layout(key.tap, key.kind, same_size_images=dense_images)
            shape: tuple[int, ...]
            if key.tap == "attn":
                shape = (int(row.shape[0]),)  # captured [heads, queries, keys]: rows are [heads] wide
            elif layout.ragged:
                shape = (int(row.shape[-1]),)
            elif key.kind == "last":
                shape = (1, int(row.shape[-1]))
            elif key in res:
                shape = tuple(int(s) for s in row.shape)
            else:  # a dense image array needs the token count: only an image batch gives it
                return None
            specs[key] = ArraySpec(tap=key.tap, layer=key.layer, site=key.site, tokens=key.kind, shape=shape,
                                   ragged=layout.ragged, dims=layout.dims, dtype=dtype, codec=codec, module=p.path)
    return specs


# ------------------------------------------------------------------------------------------ per batch

def _segments(grid: Grid | None) -> list[dict[str, Any]] | None:
    if not grid:
        return None
    return [{"start": s.start, "rows": s.rows, "cols": s.cols, "row_stride": s.row_stride, "view": s.view}
            for s in grid]


def token_spans(lay: SampleLayout, prompt_pad_len: int, n_answer: int) -> TokenSpans:
    first = lay.first_position
    image = lay.image_positions - first
    llm = lay.geometry.llm
    single = len(llm) == 1 and llm[0].row_stride == llm[0].cols and llm[0].n_tokens == len(image)
    contiguous = len(image) > 0 and bool(np.all(np.diff(image) == 1))
    return TokenSpans(
        seq_len=prompt_pad_len - first + n_answer,
        image_start=int(image[0]) if contiguous else None,
        image_count=int(len(image)),
        grid_h=llm[0].rows if single else None,
        grid_w=llm[0].cols if single else None,
        last_prompt=int(lay.last_position - first),
        answer_start=prompt_pad_len - first,
        answer_count=n_answer,
        extra={
            "image_positions": None if contiguous else image.tolist(),
            "vision_grid": _segments(lay.geometry.vision),
            "projector_in_grid": _segments(lay.geometry.projector_in),
            "projector_out_grid": _segments(lay.geometry.projector_out),
            "llm_grid": _segments(llm),
        },
    )


def sample_values(key: CaptureKey, value: Any, b: int, first: int, pad_len: int, n_answer: int) -> torch.Tensor:
    """One sample's stored value for ``key`` (pads and unused generation steps removed)."""
    row = value.row(b) if isinstance(value, RaggedTokens) else value[b]
    if key.tap == "attn":
        keys = torch.cat([torch.arange(first, pad_len), torch.arange(pad_len, pad_len + n_answer)])
        if key.kind == "last":  # [heads, 1, keys]
            return row[:, 0, first:pad_len].T.contiguous()
        # every step's row spans the whole sequence (windowed layers included): no key is out of range
        q = row[:, :n_answer][:, :, keys]  # [heads, n, L]
        return q.permute(1, 2, 0).reshape(-1, q.shape[0]).contiguous()
    if key.kind == "answer":
        return row[:n_answer]
    return row


# ------------------------------------------------------------------------------------------ the run

def run_extraction(manifest: Manifest, *, workspace: str | Path | None = None,
                   progress: bool = True, codec: str = "none",
                   on_batch: Callable[[int], None] | None = None) -> RunSummary:
    """Run (or resume) a manifest. ``on_batch(rows_done)`` is called after each batch is computed; it is
    queued to the writer then, or on CUDA after the next batch's forward (its host copy overlaps it)."""
    started = time.perf_counter()
    tune_malloc()  # the writer frees each batch's captures: keep glibc from trimming the heap between batches
    check_codec(codec, manifest.storage.dtype)
    check_sets(manifest)
    sets, samples = collect_samples(manifest)
    if not samples:
        raise ManifestError("the stimulus sets hold no samples (check limit)")
    m = manifest.model
    where = workspace or manifest.workspace
    kind = manifest.intervention.kind if manifest.intervention else None
    variant = kind in ("head_ablation", "token_compression")   # extract/variants.py opens its own workspace
    new_workspace = not variant and not (resolve_path(where) / MANIFEST).exists()
    # A new workspace's manifest is built while the model loads; it lands only once the run is valid.
    with ManifestAhead() if new_workspace else nullcontext() as ahead:
        lm = load_model(m.path, dtype=m.dtype, device=m.device, device_map=m.device_map, revision=m.revision,
                        trust_remote_code=m.trust_remote_code)
        if variant:
            from extract.variants import run_variant

            ws, computed, accuracy = run_variant(lm, manifest, sets, samples, where, run_info(lm, manifest, None),
                                                 progress=progress)
            done = Extracted(ws, computed, accuracy, 0, _run_totals(ws.rows, manifest.run))
        else:
            scaled = scaled_vision_rope(lm, manifest.intervention) if kind == "rope_scaling" else nullcontext()
            with scaled:
                done = _extract_stored(lm, manifest, sets, samples, where, progress, codec, on_batch, ahead)
    scored, correct = done.totals
    return RunSummary(run=manifest.run, workspace=done.ws.path, samples=len(samples), computed=done.computed,
                      seconds=time.perf_counter() - started, accuracy=correct / scored if scored else None,
                      arrays=done.arrays, new_accuracy=done.accuracy, scored=scored, commits=done.stats)


def _extract_stored(lm: LoadedModel, manifest: Manifest, sets: list[tuple[Path, str]], samples: list[Sample],
                    where: str | Path | None, progress: bool, codec: str, on_batch: Callable[[int], None] | None,
                    ahead: ManifestAhead | None) -> Extracted:
    """:func:`_extract` under the manifest's storage: an overflow is refused naming the manifest keys
    that fix it, or (``overflow: store_float32``) the run is dropped and extracted again with the
    overflowing array stored as float32 (a Zarr array has one dtype, so its float16 chunks cannot stay)."""
    wider: set[str] = set()
    while True:
        try:
            return _extract(lm, manifest, sets, samples, where, progress, codec, on_batch, ahead, wider)
        except StoreError as err:  # the writer's failure (WriterError) chains the overflow
            over = overflow_in(err)
            if over is None:
                raise
            if manifest.storage.overflow != "store_float32":
                raise DtypeOverflowError(overflow_fix(manifest, over, resolve_path(where))) from err
            if over.array is None or over.array in wider:  # pragma: no cover - float32 holds every source value
                raise
            wider.add(over.array)
            print(f"storage.overflow store_float32: {over.problem}; extracting run {manifest.run} again with"
                  f" {over.array} stored as float32", file=sys.stderr)
            Workspace.open(where).drop_run(manifest.run)
            ahead = None  # the workspace exists now


def overflow_in(err: BaseException) -> ArrayOverflowError | None:
    """The store's overflow error behind ``err`` (the background writer's failure chains it), or None."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, ArrayOverflowError):
            return seen
        seen = seen.__cause__
    return None


def overflow_fix(manifest: Manifest, over: ArrayOverflowError, where: Path) -> str:
    """The overflow refusal of an extraction: what overflowed, and the manifest YAML that stores it."""
    ways = []
    if manifest.model.dtype == "bfloat16":
        ways.append("storage: {dtype: bfloat16}           # bit for bit, 2 bytes a value")
    ways += ["storage: {dtype: float32}            # exact, 4 bytes a value",
             "storage: {overflow: store_float32}   # float32 for the arrays that overflow, float16 for the rest",
             "storage: {overflow: clip}            # saturate to +-65504, counted in chunks.n_clipped"]
    listed = "".join(f"\n    {w}" for w in ways)
    return (f"{over.problem}. float16 cannot hold these values (storage.overflow: refuse). Add one of these to"
            f" the manifest:{listed}\nthen remove what this run stored (`python -m store drop-run {manifest.run}"
            f" --data {where} --yes`; a run resumes only with the storage it started with) or give it a new run"
            " id, and run the manifest again")


def stored_as(specs: dict[CaptureKey, ArraySpec], run: str, storage: StorageSpec,
              wider: set[str]) -> dict[CaptureKey, ArraySpec]:
    """The specs with the manifest's storage dtype; the arrays in ``wider`` (zarr paths) as float32."""
    def dtype_of(spec: ArraySpec) -> str:
        return "float32" if array_path(run, spec.tap, spec.layer, spec.site, spec.tokens) in wider else storage.dtype

    return {key: dataclasses.replace(spec, stored_dtype=dtype_of(spec)) for key, spec in specs.items()}


def widened(ws: Workspace, manifest: Manifest) -> set[str]:
    """Zarr paths of this run's arrays already stored as float32 under ``overflow: store_float32``
    (a resumed run declares them as they are)."""
    if manifest.storage.overflow != "store_float32" or ws.created:
        return set()
    rows = ws.rows("SELECT zarr_path FROM activations WHERE run = ? AND stored_dtype = 'float32'", [manifest.run])
    return {str(r[0]) for r in rows}


def check_same_storage(manifest: Manifest, stored_config: dict[str, Any], where: Path) -> None:
    """A resume keeps the storage its run started with: a stored array holds one dtype, and its
    float16 chunks were written under the run's overflow choice. Runs stored before the manifest
    had ``storage`` stored the defaults."""
    stored = StorageSpec.model_validate(stored_config.get("storage") or {})
    if stored != manifest.storage:
        raise ManifestError(
            f"run {manifest.run} was stored with {storage_yaml(stored)}; this manifest asks for"
            f" {storage_yaml(manifest.storage)}. A run resumes only with the storage it started with (each"
            f" array holds one dtype): set {storage_yaml(stored)} to resume it, or give the run a new id, or"
            f" remove it (`python -m store drop-run {manifest.run} --data {where} --yes`) to extract it again"
        )


#: Manifest settings added after runs were already stored, at their defaults: a resumed run whose
#: stored config lacks one ran as the default says (generation.path: the prompt-only shortcut stores
#: the same values as generate, tests/extract/test_capture_path.py), so its absence is no change.
ADDED_DEFAULTS: dict[str, Any] = {"generation": {"path": GenerationSpec().path}}


def as_stored(config: dict[str, Any], stored: dict[str, Any], added: dict[str, Any]) -> dict[str, Any]:
    """``config`` without the ``added`` settings that ``stored`` (the run's config as an older agnosia
    wrote it) lacks and ``config`` holds at their default; nested sections alike."""
    out = {}
    for key, value in config.items():
        if key not in stored and key in added and added[key] == value:
            continue
        if isinstance(value, dict) and isinstance(stored.get(key), dict) and isinstance(added.get(key), dict):
            value = as_stored(value, stored[key], added[key])
        out[key] = value
    return out


def attention_rows_note(lm: LoadedModel, manifest: Manifest) -> dict[str, str] | None:
    """Provenance of a run whose attention maps took the full path (eager over every query row of a
    requested layer) instead of the selected rows; None when it has no attention taps or took the
    selected path (the default, left out so that runs stored before row selection resume)."""
    if not (manifest.attention or any(t.tap == "attn" for t in manifest.taps)):
        return None
    ad = lm.adapter
    module = lm.model.get_submodule(f"{ad.llm_layers}.0.{ad.llm_attention}")
    if rows_path(module) == "selected":
        return None
    why = (f"{type(module).__module__}'s eager attention needs every query row" if ATTENTION_ROWS.get() == "selected"
           else "attention rows set to 'full' (AGNOSIA_ATTENTION_ROWS=full or compat.attention_rows)")
    return {"path": "full", "why": why}


def run_info(lm: LoadedModel, manifest: Manifest, lens: Any, path: tuple[str, str] | None = None) -> RunInfo:
    """The run's provenance: model, adapter, dtype, versions, the manifest and its intervention
    (or the one a model folder made by an intervention records, e.g. MAS fine-tuning), and which
    capture ``path`` ran, with why (see :func:`capture_path`)."""
    # Shards of one run share its identity. The default storage is left out: runs stored before the
    # manifest had the key resume as they are.
    config = manifest.model_dump(exclude={"workspace", "shard"}
                                 | ({"storage"} if manifest.storage == StorageSpec() else set()))
    if path is not None:
        config["capture"] = {"path": path[0], "why": path[1]}
    rows = attention_rows_note(lm, manifest)
    if rows is not None:
        config["attention_rows"] = rows
    if lens is not None:
        config["logit_lens"] = {"norm": lens.norm.kind, "eps": lens.norm.eps, "weight_offset": lens.norm.weight_offset,
                                "logit_softcap": lens.logit_softcap, "norm_module": lens.norm.module_path,
                                "unembed_module": lens.unembed_path, "n_layers": lm.adapter.n_layers("llm")}
    intervention = describe_intervention(manifest.intervention)
    made_by = Path(manifest.model.path) / INTERVENTION_FILE
    if intervention is None and made_by.is_file():
        intervention = json.loads(made_by.read_text())
    describe = lm.describe()
    bf16, overflow = store_policy(manifest.storage)
    return RunInfo(run=manifest.run, model=describe["model"], revision=manifest.model.revision,
                   adapter=describe["adapter"], dtype=describe["dtype"],
                   attn_implementation=describe["attn_implementation"], versions=describe["versions"],
                   config=config, chunk_samples=manifest.chunk_samples, intervention=intervention,
                   batch_size=manifest.batch_size, bf16=bf16, overflow=overflow)


@dataclass(frozen=True)
class Extracted:
    """What one call of the activation run did."""

    ws: Workspace
    computed: int                 # samples computed by this call
    accuracy: float | None        # of those samples
    arrays: int
    totals: tuple[int, int]       # (scored, correct) over the whole run, resumed rows included
    stats: WriterStats | None = None


@dataclass(frozen=True)
class ModelSetup:
    """What a run needs of the loaded model before its first batch (:func:`model_setup`)."""

    request: dict[str, list[str]]  # hook point -> token kinds (:func:`tap_request`)
    points: list[Point]
    sizes: dict[tuple[int, int], Sample]  # the first sample of each image size
    dense_images: bool  # every sample has an image, all of one size: image arrays are dense
    dtype: str  # the model's, as the store names it
    first: Sample  # the sample whose teacher-forced forward gives the arrays' shapes (an image one if any)
    lens: Any  # the logit lens's readout, None without ``logit_lens``
    chosen: tuple[str, str]  # the capture path and why (:func:`capture_path`)
    stop: set[int]  # token ids that end an answer


def model_setup(lm: LoadedModel, manifest: Manifest, samples: list[Sample]) -> ModelSetup:
    """Resolve the manifest's taps against ``lm`` and read every image's size: a bad tap, a missing
    image or an unreadable one fails here, before any forward."""
    with_images = [s for s in samples if s.image is not None]
    request = tap_request(lm, manifest, with_images=bool(with_images))
    sizes = image_sizes(samples)
    return ModelSetup(
        request=request, points=resolve_points(lm, request, ()),  # once per run, not per batch
        sizes=sizes, dense_images=len(sizes) == 1 and len(with_images) == len(samples),
        dtype=str(lm.dtype).removeprefix("torch."), first=(with_images or samples)[0],
        lens=readout(lm) if manifest.logit_lens else None, chosen=capture_path(lm, manifest, samples),
        stop=stop_ids(lm),
    )


@dataclass(frozen=True)
class Settled:
    """A run's arrays and provenance once the workspace has said what it already holds."""

    specs: dict[CaptureKey, ArraySpec]
    info: RunInfo
    routed: bool  # False: a run stored before capture paths were recorded, resumed the way it ran (generate)


def settle_run(ws: Workspace, manifest: Manifest, specs: dict[CaptureKey, ArraySpec], wider: set[str] | None,
               info_of: Callable[[tuple[str, str] | None], RunInfo], chosen: tuple[str, str]) -> Settled:
    """The specs with their stored dtypes and the run's RunInfo, checked against a stored run of the
    same id: its storage must be the manifest's, and a run an older agnosia stored keeps its recorded
    settings (``info_of(route)`` gives the RunInfo that records ``route``, or no route)."""
    # A manifest made just now holds no run: skip the query (its own DuckDB instance: ~12 ms).
    stored = [] if ws.created else ws.rows("SELECT config FROM runs WHERE run = ?", [manifest.run])
    config = json.loads(stored[0][0] or "{}") if stored else {}
    if stored:
        check_same_storage(manifest, config, ws.path)
    routed = not (stored and "capture" not in config)  # an old run ran generate: resume it as it was
    specs = stored_as(specs, manifest.run, manifest.storage, set(wider or ()) | widened(ws, manifest))
    info = info_of(chosen if routed else None)
    if stored:  # a run an older agnosia stored lacks the settings added since, at their defaults
        info = dataclasses.replace(info, config=as_stored(dict(info.config), config, ADDED_DEFAULTS))
    return Settled(specs, info, routed)


def _extract(lm: LoadedModel, manifest: Manifest, sets: list[tuple[Path, str]], samples: list[Sample],
             where: str | Path | None, progress: bool, codec: str,
             on_batch: Callable[[int], None] | None, ahead: ManifestAhead | None = None,
             wider: set[str] | None = None) -> Extracted:
    """The activation run proper (``ahead``: a new workspace's manifest, built while the model loaded;
    ``wider``: zarr paths of arrays stored as float32 after a float16 overflow)."""
    setup = model_setup(lm, manifest, samples)
    points, dtype, lens, stop = setup.points, setup.dtype, setup.lens, setup.stop
    # A new workspace's first batch is computed now: its captures give the arrays' shapes, with no
    # forward of their own (a shard or a resume starts elsewhere, so it runs the shapes forward).
    early: dict[int, BatchDone] = {}
    specs = None
    if manifest.shard is None and not (resolve_path(where) / MANIFEST).exists():
        size = min(manifest.batch_size, len(samples))
        offset, group = by_modality(samples[:size])[0]
        done = run_batch(lm, group, points, manifest, stop, setup.chosen[0], start=offset)
        specs = specs_of(done.res, points, setup.dense_images, dtype, codec)
        early[offset] = done
    if specs is None:
        specs = array_specs(lm, points, setup.first, setup.dense_images, dtype, codec)
    check_image_sizes(lm, setup.sizes, checked=setup.first)
    ws = Workspace.open(where, ahead=ahead)  # only now: a bad manifest leaves no workspace behind
    if not ws.created:
        early.clear()  # another process made it meanwhile: resume as it says
    settled = settle_run(ws, manifest, specs, wider, lambda route: run_info(lm, manifest, lens, route), setup.chosen)
    specs, info = settled.specs, settled.info
    capture_via = setup.chosen[0] if settled.routed else "generate"
    computed, correct, scored = 0, 0, 0
    with ws.writer(info, shard=manifest.shard) as w:
        for path, dataset in sets:
            w.register_stimulus_set(path, dataset=dataset)
        w.set_samples([s.key for s in samples])
        handles = dict(zip(specs, w.arrays(list(specs.values())), strict=True))  # one manifest transaction
        if lens is not None and (w.shard is None or w.shard.index == 0):
            write_lens(w, lm, lens, dtype, manifest.storage)
        todo = w.todo()
        total = sum(len(r) for r in todo)
        warning = one_chunk_warning(manifest, len(samples)) if total else None
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
        bar = run_progress(total, manifest.run, progress)
        pending: list[BatchDone] = []  # on CUDA: the last batch, its host copy still running
        try:
            for rows in todo:
                for start in range(rows.start, rows.stop, manifest.batch_size):
                    batch_samples = samples[start : min(start + manifest.batch_size, rows.stop)]
                    for offset, group in by_modality(batch_samples):
                        at = start + offset
                        done = early.pop(at) if at in early else run_batch(
                            lm, group, points, manifest, stop, capture_via, start=at)
                        if done.ready is None:
                            done.write(w, handles, specs)
                        else:  # the previous batch's copy ran beside this batch's forward: it is done by now
                            _write_pending(pending, w, handles, specs)
                            pending.append(done)
                        scored += sum(g.correct is not None for g in done.gens)
                        correct += sum(bool(g.correct) for g in done.gens)
                    computed += len(batch_samples)
                    bar.update(len(batch_samples))
                    if on_batch is not None:
                        on_batch(computed)
        except BaseException:
            # A computed batch whose copy was still pending is kept: a crash loses only the batch it
            # interrupted. If the device or the writer is what failed, this fails too, and the first
            # failure is the one raised.
            with suppress(Exception):
                _write_pending(pending, w, handles, specs)
            raise
        _write_pending(pending, w, handles, specs)
        bar.close()
        w.finish()
        totals = _run_totals(w.rows, manifest.run)  # on the writer's connection: no second open
    return Extracted(ws, computed, correct / scored if scored else None, len(handles), totals, w.stats)


def _write_pending(pending: list[BatchDone], w: Writer, handles: dict[CaptureKey, ArrayHandle],
                   specs: dict[CaptureKey, ArraySpec]) -> None:
    """Hand ``pending``'s batches to the writer, each taken off the list first: one that failed is not retried."""
    while pending:
        pending.pop(0).write(w, handles, specs)


def _run_totals(rows: Callable[..., list[tuple[Any, ...]]], run: str) -> tuple[int, int]:
    """(scored, correct) over every stored generation of the run, resumed rows included."""
    scored, correct = rows("SELECT count(correct), count(*) FILTER (WHERE correct) FROM generations WHERE run = ?",
                           [run])[0]
    return int(scored), int(correct)


@dataclass(frozen=True)
class LensTensors:
    """The run tensors an offline logit lens needs (on the CPU), their module paths and the vocabulary."""

    values: dict[str, torch.Tensor]
    modules: dict[str, str | None]
    vocab: list[str]


def lens_tensors(lm: LoadedModel, lens: Any) -> LensTensors:
    """The unembedding and final norm of ``lens`` (a :func:`readout`) and ``lm``'s vocabulary."""
    tensors = {"lm_head.weight": (lens.unembed, lens.unembed_path), "lm_head.bias": (lens.unembed_bias, lens.unembed_path),
               "final_norm.weight": (lens.norm.weight, lens.norm.module_path),
               "final_norm.bias": (lens.norm.bias, lens.norm.module_path)}
    present = {name: t for name, t in tensors.items() if t[0] is not None}
    return LensTensors({name: v.detach().cpu() for name, (v, _) in present.items()},
                       {name: module for name, (_, module) in present.items()},
                       vocabulary(lm, int(lens.unembed.shape[0])))


def write_lens(w: Writer, lm: LoadedModel, lens: Any, dtype: str, storage: StorageSpec | None = None) -> None:
    """The run tensors an offline logit lens needs (unembedding, final norm) and the vocabulary."""
    store_lens(w, lens_tensors(lm, lens), dtype, storage)


def store_lens(w: Writer, lens: LensTensors, dtype: str, storage: StorageSpec | None = None) -> None:
    """Store ``lens``'s tensors and vocabulary in ``w``'s run.

    They keep the store's rule (float32 stays float32, bfloat16 follows the run's bf16 policy);
    ``storage.dtype: float32`` stores them float32 too, and under ``overflow: store_float32`` tensors
    that overflow float16 are stored as float32."""
    storage = storage or StorageSpec()
    stored = "float32" if storage.dtype == "float32" else None
    try:
        w.write_tensors(lens.values, dtype=dtype, modules=lens.modules, stored_dtype=stored)
    except DtypeOverflowError:
        if storage.overflow != "store_float32":
            raise
        w.write_tensors(lens.values, dtype=dtype, modules=lens.modules, stored_dtype="float32")
    w.record_vocab(lens.vocab)


def one_chunk_warning(manifest: Manifest, n_samples: int) -> str | None:
    """Why a run whose one chunk holds every sample should change its ``chunk_samples``, or None.

    A chunk is committed only once all its rows are written, so such a run keeps nothing if it
    stops before its end (one such run lost 16 minutes). A run of one batch is exempt: it writes
    every row at once, and no chunk size could commit any of them sooner.
    """
    if manifest.chunk_samples < n_samples or n_samples <= manifest.batch_size:
        return None
    quarter = n_samples // 4 // manifest.batch_size * manifest.batch_size  # whole batches fill whole chunks
    return (f"chunk_samples {manifest.chunk_samples} >= {n_samples} samples: nothing is committed until the run ends;"
            f" set chunk_samples below {n_samples} in the manifest (e.g. {max(quarter, manifest.batch_size)})"
            " to commit as you go")


def vocabulary(lm: LoadedModel, size: int) -> list[str]:
    """Every unembedding row's token as decoded alone (ids the tokenizer lacks: '')."""
    tok = lm.tokenizer
    n = min(len(tok), size)
    # One batch_decode, not one decode per id: a 152k-token vocabulary is 152k calls otherwise.
    return [*tok.batch_decode([[i] for i in range(n)]), *[""] * (size - n)]


def capture_path(lm: LoadedModel, manifest: Manifest, samples: list[Sample]) -> tuple[str, str]:
    """("forward" | "generate", why) for the whole run.

    With greedy decoding and one new token, ``generate`` is a single prompt forward whose answer is the
    argmax of its last logits: nothing is fed back, so there are no ``answer`` rows. One forward with the
    same hooks stores the same values at half the cost, unless the model's generation config adds a logits
    processor (repetition penalty, suppressed or forced tokens, ...) that could move that token.
    """
    g = manifest.generation
    if g.path == "generate":
        return "generate", "the manifest asks for it (generation.path: generate)"
    if g.max_new_tokens == "from_stimulus":
        budgets = {int(s.params.get("max_new_tokens", 32)) for s in samples}
    else:
        budgets = {g.max_new_tokens}
    if budgets != {1}:
        return "generate", f"answers of up to {max(budgets)} tokens need decode steps"
    blockers = forward_answer_blockers(lm)
    if blockers:
        return "generate", f"the model's generation config adds logits processors ({', '.join(blockers)})"
    return "forward", "one new token, greedy: the argmax of the prompt forward's last logits"


class BatchSink(Protocol):
    """Where a computed batch goes: the run's :class:`store.Writer`, or a worker's chunk writer
    (:class:`store.writer.chunk_writer.ChunkWriter`) on a cluster."""

    def write_batch(self, start: int, arrays: Mapping[ArrayHandle, Any], *, tokens: Sequence[TokenSpans] | None = None,
                    generations: Sequence[Generation] | None = None) -> None: ...


@dataclass
class BatchDone:
    """One computed batch, ready to hand to the writer once its host copy (CUDA only) has landed."""

    start: int
    gens: list[Generation]
    spans: list[TokenSpans]
    res: CaptureResult
    values: Callable[[dict[CaptureKey, ArraySpec]], dict[CaptureKey, Any]]  # the store's values, given the specs
    ready: Callable[[], None] | None

    def write(self, w: BatchSink, handles: dict[CaptureKey, ArrayHandle], specs: dict[CaptureKey, ArraySpec]) -> None:
        if self.ready is not None:
            self.ready()
        w.write_batch(self.start, {handles[k]: v for k, v in self.values(specs).items()}, tokens=self.spans,
                      generations=self.gens)


def batch_values(res: CaptureResult, specs: dict[CaptureKey, ArraySpec], dtype: torch.dtype, text_only: bool,
                 firsts: list[int], pad_len: int, n_keep: list[int]) -> dict[CaptureKey, Any]:
    """The store's values of one batch: a dense tap whose samples keep their whole captured row is handed
    over as captured (on the CPU the store reads the hook's own copy: no other); other keys per sample."""
    out: dict[CaptureKey, Any] = {}
    for key, spec in specs.items():
        if (text_only and key.tap in IMAGE_ONLY_TAPS) or (key.kind == "answer" and key not in res):
            # no image, no image tokens; one new token, nothing fed back: no answer rows
            rows = [torch.zeros((0, *spec.shape), dtype=dtype) for _ in n_keep]
        elif not spec.ragged and key.tap != "attn" and key.kind != "answer" and isinstance(res[key], torch.Tensor):
            out[key] = res[key]  # what sample_values would slice row by row, whole
            continue
        else:
            rows = [sample_values(key, res[key], b, firsts[b], pad_len, n) for b, n in enumerate(n_keep)]
        out[key] = rows if spec.ragged else torch.stack(rows)
    return out


def run_batch(lm: LoadedModel, batch_samples: list[Sample], request: list[Point], manifest: Manifest,
               stop: set[int], path: str = "generate", *, start: int = 0) -> BatchDone:
    batch = prepare_group(lm, batch_samples)
    text_only = batch_samples[0].image is None
    budget = manifest.generation.max_new_tokens
    max_new = (max(int(s.params.get("max_new_tokens", 32)) for s in batch_samples) if budget == "from_stimulus"
               else int(budget))
    if path == "forward":
        res = capture_first_token(lm, batch, request, tokens=("image", "last", "answer"), on_nonfinite="raise",
                                  host_copy="async")
    else:
        res = capture_generate(lm, batch, request, tokens=("image", "last", "answer"), max_new_tokens=max_new,
                               on_nonfinite="raise", host_copy="async")
    generated = res.generated
    assert generated is not None, "both capture paths return the generated ids"
    n_fed = max(generated.shape[1] - 1, 0)
    pad_len = batch.seq_len
    gens, spans, keep = [], [], []
    for b, s in enumerate(batch_samples):
        n_keep, n_text = answer_length(generated[b], stop, n_fed)
        ids = generated[b][:n_text]
        # the capture decoded every generated id already: reuse it unless the answer stops short
        text = res.texts[b] if res.texts is not None and n_text == generated.shape[1] else lm.tokenizer.decode(
            ids, skip_special_tokens=True)
        g = score_answer(s.family, s.task, text, s.answer, s.truth, n_tokens=n_text)
        gens.append(dataclasses.replace(g, stop_reason=stop_reason(generated[b], n_text)))
        spans.append(token_spans(res.layouts[b], pad_len, n_keep))
        keep.append(n_keep)
    firsts = [lay.first_position for lay in res.layouts]
    return BatchDone(start, gens, spans, res,
                 lambda specs: batch_values(res, specs, lm.dtype, text_only, firsts, pad_len, keep), res.ready)
