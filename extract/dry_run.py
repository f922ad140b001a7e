"""``python -m extract MANIFEST --dry-run``: what a run will store and cost, before any weight loads.

The model is built on PyTorch's meta device from its ``config.json`` (no weights, no memory), so
layer counts, hidden sizes and parameter counts come from the real module tree. Token counts:

* when the model folder (or hub id) has its processor files, the real processor runs once per
  distinct (image size, prompt, shown strings) of the run, up to :data:`EXACT_PROMPTS` of them:
  exact prompt lengths and image tokens (a stimulus's image tokens depend on its size alone). Past
  that limit, the other prompts are the length of a processed prompt of their image size plus the
  difference of the two texts' token counts: an estimate, and the dry run says so;
* from ``config.json`` alone (a folder holding only config files, such as
  ``manifests/configs/qwen2.5-vl-7b-instruct``), the family adapter's ``config_geometry`` computes the
  image tokens from the config and ``preprocessor_config.json`` if present (Qwen: (H/14)*(W/14)/4
  after the processor's resize; LLaVA-1.5: 576), and the text of the prompt is estimated at
  :data:`CHARS_PER_TOKEN` characters per token plus :data:`TEMPLATE_TOKENS` tokens of chat template.

Answer tokens are what generation fed back: at most the batch's token budget minus one
(``max_new_tokens``, or the largest ``from_stimulus`` budget of the batch; the last generated
token is never fed back). Arrays that hold answer tokens are planned at that bound, and every
array says whether its figure is exact, an upper bound or an estimate. Whether an array is dense or
ragged is :func:`store.vocab.array_layout`, the rule the run stores by; values take the bytes of the
manifest's storage dtype (:func:`store.dtypes.stored_bytes`: float16 by default, `storage.dtype` otherwise),
divided by the codec's measured ratio; dense arrays are chunked as the store chunks them, evened out
so the last chunk pads at most a row per chunk (:func:`store.records.chunk_size`, docs/store.md).

Time (:func:`estimate_time`, docs/scale.md): prefill costs 2·params·tokens FLOPs per sample (vision
blocks x vision tokens, projector x its output tokens, LLM layers x prompt tokens) at
``gpu_tflops``; each decode step of a batch costs the largest of reading the LLM's weights at
``gpu_bandwidth_gbs``, 2·params·batch FLOPs, and transformers' per-step overhead
(``step_ms_per_layer`` x decoder layers, measured on an H200), for as many steps as the longest
answer budget in the batch; the store writes in the background at ``disk_mbps``, so the estimate
is the larger of GPU time and write time. Attention FLOPs and KV-cache reads are left out.

``python -m extract.dry_run MANIFEST [--gpu-tflops F] [--gpu-bandwidth-gbs B] [--step-ms-per-layer S] [--disk-mbps D] [--json]``
takes the hardware assumptions; ``python -m extract MANIFEST --dry-run`` uses the defaults.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from extract.manifest import HeadAblationSpec, Manifest, ManifestError, TokenCompressionSpec, expand_layers, store_policy
from extract.models import TapSpec, adapter_class, prepare_batch
from extract.models.capture import hook_module
from extract.models.layout import ImageGeometry, SampleLayout, extent
from extract.models.loading import LoadedModel, load_config, load_processor, resolve_source
from extract.run import tap_request
from extract.samples import collect_samples
from store.dtypes import stored_bytes, tensor_stored
from store.records import chunk_size
from store.sizing import CODEC_RATIO, array_bytes, human
from store.vocab import HEAD_TAPS, array_layout

CHARS_PER_TOKEN = 4  # text-token estimate without a tokenizer (English BPE: 3.5-4.5 characters per token)
TEMPLATE_TOKENS = 32  # chat template turns, system prompt, image start/end markers (estimate)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
PARAM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# distinct (image size, prompt, strings) the processor runs on; a processor call is milliseconds, so
# this keeps a dry run of a large sweep under a minute while small runs get every prompt exact
EXACT_PROMPTS = 2000
PROCESSOR_BATCH = 64
EXACT, BOUND, ESTIMATE = "exact", "upper bound", "estimate"
QK_NORMS = ("q_norm", "k_norm", "query_norm", "key_norm")


@dataclass(frozen=True)
class Hardware:
    """The assumptions behind the time estimate (docs/scale.md). Defaults: one H100-class GPU."""

    gpu_tflops: float = 400.0  # dense bf16 actually reached in prefill (~40 % of an H100 SXM's 989 peak)
    gpu_bandwidth_gbs: float = 3000.0  # HBM read rate reached when decoding (~90 % of 3.35 TB/s)
    disk_mbps: float = 1000.0  # the store's sustained write rate (docs/store.md: ~0.9 GB/s measured here)
    # transformers' generate launches every kernel of every layer from Python at each step: measured
    # 0.76-1.18 ms per decoder layer per step on an H200, whatever the batch (docs/scale.md)
    step_ms_per_layer: float = 1.0


@dataclass(frozen=True)
class DrySample:
    """What planning needs of one stimulus: its image size (0 x 0: a text-only task), prompt,
    answer budget and the strings its task shows before the question."""

    width: int
    height: int
    prompt: str
    answer_budget: int
    strings: tuple[str, ...] = ()

    @property
    def has_image(self) -> bool:
        return self.width > 0 and self.height > 0


@dataclass(frozen=True)
class ArrayEstimate:
    name: str
    kind: str
    values_per_sample: int  # the largest over samples (exact for fixed-size arrays)
    values: int  # over all samples (answers at their bound)
    ragged: bool
    n_chunks: int
    bytes: int  # stored, uncompressed (a dense array's chunks full-size, evened out as the store does)
    basis: str = EXACT  # EXACT, BOUND (answer tokens at their bound) or ESTIMATE (estimated prompt lengths)

    @property
    def chunk_files(self) -> int:
        return self.n_chunks * (2 if self.ragged else 1)  # ragged: rows + offsets per block

    @property
    def files(self) -> int:
        # + zarr.json per array; a ragged block is a group with two arrays (3 zarr.json)
        return 1 + self.n_chunks * (5 if self.ragged else 1)


@dataclass(frozen=True)
class Params:
    """Parameter counts from the meta model (no weights)."""

    total: int
    vision: int  # vision blocks
    projector: int
    llm: int  # decoder layers
    head: int  # lm_head


@dataclass(frozen=True)
class TimeEstimate:
    prefill_flops: float
    decode_steps: int
    decode_seconds: float
    prefill_seconds: float
    write_seconds: float
    decode_bound: str  # what sets a full batch's step: "per-layer overhead", "weight reads" or "compute"

    @property
    def gpu_seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def seconds(self) -> float:
        return max(self.gpu_seconds, self.write_seconds)


@dataclass
class RunEstimate:
    run: str
    model: str
    model_type: str
    adapter: str
    n_samples: int
    n_sets: int
    batch_size: int
    chunk_samples: int
    codec: str
    dtype: str
    stored_dtype: str  # what the store writes the arrays as (its dtype policy for ``dtype``)
    exact_tokens: bool
    token_source: str
    first_seq: int
    first_image_tokens: int
    max_answer: int  # generated tokens of the largest budget (answer tokens kept: one fewer)
    params: Params
    arrays: list[ArrayEstimate]
    lens_values: int  # unembedding + final norm (run tensors for the logit lens); 0 when off
    lens_bytes: int  # those values as the store writes run tensors
    kv_bytes: int  # KV cache of one full batch at its longest prompt + answer (bf16/fp16 cache)
    hardware: Hardware
    time: TimeEstimate
    # attention rows' working memory at its largest (one requested layer of one batch at a time): rows x keys
    attention_bytes: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def raw_bytes(self) -> int:
        return sum(a.bytes for a in self.arrays)

    @property
    def bytes(self) -> int:
        return int(self.raw_bytes / CODEC_RATIO.get(self.codec, 1.0))

    @property
    def chunk_files(self) -> int:
        return sum(a.chunk_files for a in self.arrays)

    @property
    def files(self) -> int:
        return sum(a.files for a in self.arrays)

    @property
    def weight_bytes(self) -> int:
        return self.params.total * PARAM_BYTES.get(self.dtype, 2)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["arrays"] = [{**asdict(a), "chunk_files": a.chunk_files, "files": a.files} for a in self.arrays]
        out["time"] = {**asdict(self.time), "gpu_seconds": self.time.gpu_seconds, "seconds": self.time.seconds}
        out.update(raw_bytes=self.raw_bytes, bytes=self.bytes, chunk_files=self.chunk_files,
                   files=self.files, weight_bytes=self.weight_bytes)
        return out

    def render(self) -> str:
        p, t, hw = self.params, self.time, self.hardware
        lines = [
            f"run {self.run}: model {self.model} ({self.model_type}, adapter {self.adapter}),"
            f" {self.n_samples} samples from {self.n_sets} set(s), batch {self.batch_size}",
            f"parameters {_count(p.total)} (vision blocks {_count(p.vision)}, projector {_count(p.projector)},"
            f" LLM layers {_count(p.llm)}, lm_head {_count(p.head)}); weights {human(self.weight_bytes)} as {self.dtype}",
            f"GPU memory: weights {human(self.weight_bytes)} + KV cache at batch {min(self.batch_size, self.n_samples)}"
            f" {human(self.kv_bytes)} = {human(self.weight_bytes + self.kv_bytes)} (plus activations)"
            + (f"; attention rows add up to {human(self.attention_bytes)} at once (heads x kept query rows x keys"
               " of one requested layer, not keys x keys)" if self.attention_bytes else ""),
            f"first sample: {self.first_seq} prompt tokens, {self.first_image_tokens} image tokens in the LLM,"
            f" answers up to {self.max_answer} generated tokens",
            self.basis_line(),
            f"time: ~{duration(t.seconds)} = max(GPU ~{duration(t.gpu_seconds)}, writing ~{duration(t.write_seconds)});"
            f" GPU = prefill {_flops(t.prefill_flops)} at {hw.gpu_tflops:g} TFLOP/s ({duration(t.prefill_seconds)})"
            f" + {t.decode_steps:,} decode steps bound by {t.decode_bound} ({duration(t.decode_seconds)});"
            f" {hw.gpu_bandwidth_gbs:g} GB/s, {hw.step_ms_per_layer:g} ms per layer and step, writing at"
            f" {hw.disk_mbps:g} MB/s",
            *[f"note: {n}" for n in self.notes],
            "",
            f"{'array':<28} {'tokens':<7} {'values/sample':>14} {'bytes':>12}  figure",
        ]
        for a in self.arrays:
            size = human(a.bytes)
            lines.append(f"{a.name:<28} {a.kind:<7} {a.values_per_sample:>14,} {size:>12}  {a.basis}")
        lens = f"; plus the unembedding and final norm for the logit lens ({human(self.lens_bytes)})" if self.lens_values else ""
        lines += ["", f"{len(self.arrays)} arrays, {human(self.raw_bytes)} as {self.stored_dtype} ({human(self.bytes)} with codec"
                      f" {self.codec}), {self.chunk_files:,} chunk files ({self.files:,} files with Zarr metadata,"
                      f" chunks of {self.chunk_samples} samples){lens}"]
        return "\n".join(lines)

    def basis_line(self) -> str:
        """Which figures are exact, which are bounds and which are estimates."""
        prompts = "exact" if self.exact_tokens else "estimated"
        return (f"figures: image tokens and 'last' arrays exact; prompt lengths {prompts} ({self.token_source});"
                " answer arrays an upper bound: each answer at its batch's token budget - 1 (the last generated"
                " token is not fed back), fewer where generation ends earlier")


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}" if n < 10 * scale else f"{n / scale:.2f} {unit}"
    return str(n)


def _flops(flops: float) -> str:
    for unit, scale in (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12)):
        if flops >= scale:
            return f"{flops / scale:,.1f} {unit}"
    return f"{flops / 1e9:,.1f} GFLOP"


def duration(seconds: float) -> str:
    """``seconds`` in the unit a reader compares runs in: s, min, h or d."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


# ------------------------------------------------------------------------------------------ the model

def has_processor_files(source: str) -> bool:
    """Whether ``source`` can give a processor: a hub id (assumed), or a folder with a tokenizer."""
    path = Path(source)
    return not path.is_dir() or any((path / name).is_file() for name in TOKENIZER_FILES)


def meta_model(manifest: Manifest) -> LoadedModel:
    """The manifest's model on the meta device; ``processor`` is None for a config-only folder."""
    from transformers import AutoModelForImageTextToText

    m = manifest.model
    src = resolve_source(m.path)
    from extract.models.adapters import registry

    registry()
    config = load_config(src, revision=m.revision, trust_remote_code=m.trust_remote_code)
    adapter_cls = adapter_class(config.model_type)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config, trust_remote_code=m.trust_remote_code)
    processor = None
    if has_processor_files(src):
        processor = load_processor(src, adapter_cls, revision=m.revision, trust_remote_code=m.trust_remote_code)
    return LoadedModel(model=model.eval(), processor=processor, adapter=adapter_cls(model), source=src,
                       dtype=torch.float32, device=torch.device("meta"), attn_implementation="sdpa",
                       revision=m.revision)


def image_processor_settings(source: str | Path) -> tuple[dict[str, Any], str]:
    """The image processor's saved settings in a model folder, as a dict, and which file held them:
    ``preprocessor_config.json`` (hub checkpoints), else ``processor_config.json``'s
    ``image_processor`` (what transformers 5 saves), else ``{}`` (the processor's defaults)."""
    folder = Path(source)
    path = folder / "preprocessor_config.json"
    if path.is_file():
        return json.loads(path.read_text()), "config.json + preprocessor_config.json"
    path = folder / "processor_config.json"
    if path.is_file():
        saved = json.loads(path.read_text()).get("image_processor")
        if isinstance(saved, dict):
            return saved, "config.json + processor_config.json"
    return {}, "config.json (no preprocessor_config.json: the image processor's defaults)"


def _norm_dim(module: nn.Module) -> int | None:
    for name, p in module.named_parameters():
        # a block's norms are as wide as its residual stream, except the per-head query/key norms
        # inside attention (Gemma3, Qwen3: head_dim wide, and Gemma3 lists them first)
        owner = name.rsplit(".", 2)[-2] if name.count(".") else ""
        if p.ndim == 1 and "norm" in name and owner not in QK_NORMS:
            return int(p.shape[0])
    return None


def _linears(module: nn.Module) -> list[nn.Linear]:
    return [m for m in module.modules() if isinstance(m, nn.Linear)]


def hidden_size(lm: LoadedModel, spec: TapSpec) -> int:
    """The width of what a tap reads, from the hooked module's weights.

    The merger input (``pre_merger``, projector ``in``) is as wide as the vision blocks' output
    (InternVL's pixel shuffle widens it 4x before ``mlp1``; the estimate does not model that).
    """
    if spec.tap == "vision" or (spec.tap == "projector" and spec.site == "in"):
        last = lm.adapter.n_layers("vision") - 1
        spec = TapSpec("vision", last if spec.tap == "projector" or spec.site != "resid_post" else spec.layer)
    path, side = hook_module(lm, spec)
    module = lm.model.get_submodule(path)
    if spec.tap == "projector":
        return _linears(module)[-1].out_features
    dim = _norm_dim(module)
    return dim if dim is not None else _linears(module)[0].in_features


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def count_params(lm: LoadedModel) -> Params:
    a = lm.adapter
    return Params(
        total=_numel(lm.model),
        vision=_numel(a.module(a.vision_layers)),
        projector=_numel(a.module(a.projector)),
        llm=_numel(a.module(a.llm_layers)),
        head=_numel(a.module(a.lm_head)),
    )


# ------------------------------------------------------------------------------------------ token layouts

def estimate_prompt_tokens(prompt: str, image_tokens: int) -> int:
    """Prompt length without a tokenizer: image tokens + text at CHARS_PER_TOKEN + the template."""
    return image_tokens + math.ceil(len(prompt) / CHARS_PER_TOKEN) + TEMPLATE_TOKENS


def estimated_layout(lm: LoadedModel, sample: DrySample, settings: dict[str, Any]) -> SampleLayout:
    """A SampleLayout from config alone: the adapter's planned geometry, estimated text around it."""
    geometry = (lm.adapter.config_geometry(sample.width, sample.height, settings) if sample.has_image
                else ImageGeometry.none())
    seq = estimate_prompt_tokens(" ".join((*sample.strings, sample.prompt)), geometry.llm_tokens)
    start = TEMPLATE_TOKENS // 2  # where the image sits does not change any size
    return SampleLayout(geometry=geometry, image_positions=np.arange(start, start + geometry.llm_tokens),
                        last_position=seq - 1, length=seq)


def sample_layouts(lm: LoadedModel, samples: Sequence[DrySample], images: Sequence[Path | None] | None = None,
                   limit: int = EXACT_PROMPTS) -> tuple[list[SampleLayout], bool, str]:
    """One layout per sample, whether every one is exact, and how they were made.

    With a processor (``images`` needed), it runs on each distinct (image size, prompt, strings), up
    to ``limit`` of them, one image per size; past the limit a prompt is estimated from a processed
    one of its size (see :func:`_shifted`). Without one, the adapter's planned geometry and
    estimated text (:func:`estimated_layout`).
    """
    if lm.processor is None or images is None:
        settings, where = image_processor_settings(lm.source)
        planned: dict[DrySample, SampleLayout] = {}
        for s in samples:
            if s not in planned:
                planned[s] = estimated_layout(lm, s, settings)
        source = (f"image tokens from {where}, no tokenizer: text at ~{CHARS_PER_TOKEN} characters per token"
                  f" + {TEMPLATE_TOKENS} template tokens")
        return [planned[s] for s in samples], False, source
    keys = [(s.width, s.height, s.prompt, s.strings) for s in samples]
    first: dict[tuple, int] = {}
    for i, key in enumerate(keys):
        first.setdefault(key, i)
    # the first prompt of every image size is always processed: each estimated prompt leans on one
    anchor: dict[tuple[int, int], tuple] = {}
    for key in first:
        anchor.setdefault(key[:2], key)
    order = list(anchor.values()) + [k for k in first if anchor[k[:2]] != k]
    chosen = order[: max(limit, len(anchor))]
    processed = _processed_layouts(lm, [samples[first[k]] for k in chosen], [images[first[k]] for k in chosen])
    layouts = dict(zip(chosen, processed, strict=False))
    estimated = order[len(chosen):]
    if estimated:
        for key in estimated:
            base = anchor[key[:2]]
            layouts[key] = _shifted(lm, layouts[base], samples[first[base]], samples[first[key]])
        source = (f"the model's processor on {len(chosen):,} of {len(first):,} distinct prompts; the others"
                  " estimated from their token count")
    else:
        source = f"the model's processor on every distinct prompt ({len(first):,})"
    return [layouts[k] for k in keys], not estimated, source


def _processed_layouts(lm: LoadedModel, samples: Sequence[DrySample], images: Sequence[Path | None]
                       ) -> list[SampleLayout]:
    """The processor's layouts of ``samples``, in batches of one modality, one decoded image per size."""
    from PIL import Image

    pictures: dict[tuple[int, int], Any] = {}
    for s, path in zip(samples, images, strict=True):
        if path is not None and s.has_image and (s.width, s.height) not in pictures:
            with Image.open(path) as im:
                pictures[(s.width, s.height)] = im.convert("RGB")
    out: list[SampleLayout] = []
    start = 0
    while start < len(samples):
        stop = start + 1
        while (stop < len(samples) and stop - start < PROCESSOR_BATCH
               and samples[stop].has_image == samples[start].has_image):
            stop += 1
        part = samples[start:stop]
        pics = [pictures[(s.width, s.height)] if s.has_image else None for s in part]
        out += prepare_batch(lm, pics, [s.prompt for s in part], strings=[s.strings for s in part]).layouts
        start = stop
    return out


def _shifted(lm: LoadedModel, base: SampleLayout, base_sample: DrySample, sample: DrySample) -> SampleLayout:
    """An estimated layout: ``base`` (same image size) lengthened by the difference of the two texts'
    token counts (exact up to tokens merging across the template's boundaries)."""
    tok = lm.processor.tokenizer

    def count(s: DrySample) -> int:
        return len(tok(" ".join((*s.strings, s.prompt)), add_special_tokens=False)["input_ids"])

    delta = count(sample) - count(base_sample)
    return SampleLayout(geometry=base.geometry, image_positions=base.image_positions,
                        last_position=base.last_position + delta, length=base.length + delta,
                        first_position=base.first_position)


# ------------------------------------------------------------------------------------------ the estimate

def kv_cache_bytes(lm: LoadedModel, tokens: int, batch: int, dtype: str) -> int:
    """Keys and values of every LLM layer for ``batch`` sequences of ``tokens`` tokens."""
    tc = lm.model.config.get_text_config()
    heads = tc.num_attention_heads
    kv_heads = getattr(tc, "num_key_value_heads", None) or heads
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // heads
    return 2 * lm.adapter.n_layers("llm") * kv_heads * head_dim * PARAM_BYTES.get(dtype, 2) * tokens * batch


ATTENTION_ROW_BYTES = 16  # per (head, kept query row, key): eager's scores, scaled and masked, and fp32 weights


def attention_rows_bytes(lm: LoadedModel, request: dict[str, list[str]], layouts: Sequence[SampleLayout],
                         answers: np.ndarray, batch: int) -> int:
    """The most memory attention taps take at once: a requested layer computes its kept query rows' weights
    (``[batch, heads, rows, keys]``, a few transient tensors of at most 4 bytes a value) beside the model's
    kernel, one layer at a time; the rows are a sample's kept positions (image tokens and the last token at
    the prompt pass, one row per decode step). Grows as rows x keys, not keys x keys (docs/adapters.md#attention)."""
    kinds = {k for name, ks in request.items() if TapSpec.parse(name).tap == "attn" for k in ks}
    if not kinds or not layouts:
        return 0
    heads = lm.model.config.get_text_config().num_attention_heads
    per_sample = [(len(lay.image_positions) if "image" in kinds else 0) + ("last" in kinds) for lay in layouts]
    rows = max(max(per_sample), 1)  # each sample its own rows (never their union over the batch)
    keys = max(int(lay.length) for lay in layouts) + int(answers.max(initial=0))
    return ATTENTION_ROW_BYTES * batch * heads * rows * keys


def dry_samples(manifest: Manifest) -> tuple[int, list[DrySample], list[Path | None]]:
    """(number of sets, one DrySample per stimulus, their image paths) from the manifest's sets."""
    from PIL import Image

    sets, samples = collect_samples(manifest)
    max_new = manifest.generation.max_new_tokens
    out = []
    for s in samples:
        width = height = 0  # a text-only task
        if s.image is not None:
            with Image.open(s.image) as im:  # reads the header only
                width, height = im.size
        budget = int(s.params.get("max_new_tokens", 32)) if max_new == "from_stimulus" else int(max_new)
        out.append(DrySample(width, height, s.prompt, budget, tuple(s.strings)))
    return len(sets), out, [s.image for s in samples]


def answer_bounds(samples: Sequence[DrySample], batch_size: int) -> np.ndarray:
    """The most answer tokens each sample can keep: generation runs its batch to the batch's largest
    budget, and the last generated token is never fed back (so it has no activations)."""
    out = np.zeros(len(samples), dtype=np.int64)
    for start in range(0, len(samples), batch_size):
        batch = samples[start:start + batch_size]
        out[start:start + len(batch)] = max(max(s.answer_budget for s in batch) - 1, 0)
    return out


def estimate_time(lm: LoadedModel, params: Params, layouts: Sequence[SampleLayout], samples: Sequence[DrySample],
                  batch_size: int, dtype: str, stored_bytes: int, hardware: Hardware) -> TimeEstimate:
    """GPU time (prefill FLOPs at ``gpu_tflops``; per decode step the largest of reading the LLM's
    weights, 2·params·batch FLOPs and generate's per-layer overhead) and the time to write
    ``stored_bytes``; see docs/scale.md."""
    flops_s = hardware.gpu_tflops * 1e12
    prefix = lm.adapter.vision_prefix_tokens
    prefill = 0.0
    for lay in layouts:
        g = lay.geometry
        vision_tokens = extent(g.vision) + prefix * g.n_views
        prefill += 2.0 * (params.vision * vision_tokens + params.projector * extent(g.projector_out)
                          + params.llm * lay.length + params.head)
    decoder = params.llm + params.head
    step_read = decoder * PARAM_BYTES.get(dtype, 2) / (hardware.gpu_bandwidth_gbs * 1e9)
    step_overhead = hardware.step_ms_per_layer * 1e-3 * lm.adapter.n_layers("llm")
    steps, decode_s = 0, 0.0
    for start in range(0, len(samples), batch_size):
        batch = samples[start:start + batch_size]
        n_steps = max(s.answer_budget for s in batch)
        steps += n_steps
        decode_s += n_steps * max(step_read, 2.0 * decoder * len(batch) / flops_s, step_overhead)
    full = {"per-layer overhead": step_overhead, "weight reads": step_read,
            "compute": 2.0 * decoder * min(batch_size, len(samples)) / flops_s}
    return TimeEstimate(prefill_flops=prefill, decode_steps=steps, decode_seconds=decode_s,
                        prefill_seconds=prefill / flops_s, write_seconds=stored_bytes / (hardware.disk_mbps * 1e6),
                        decode_bound=max(full, key=lambda name: full[name]))


def array_estimates(lm: LoadedModel, request: dict[str, list[str]], samples: Sequence[DrySample],
                   layouts: Sequence[SampleLayout], answers: np.ndarray, exact: bool, chunk_samples: int,
                   value_bytes: int) -> list[ArrayEstimate]:
    """One ArrayEstimate per requested (hook point, token kind), laid out as the run lays it out."""
    heads = lm.model.config.get_text_config().num_attention_heads
    n = len(samples)
    n_chunks = -(-n // chunk_samples)
    # image tokens are dense when every sample has an image and all have one size (as the run decides)
    uniform = all(s.has_image for s in samples) and len({(s.width, s.height) for s in samples}) == 1
    seqs = np.array([lay.length for lay in layouts], dtype=np.int64)
    prompt_basis = EXACT if exact else ESTIMATE
    arrays = []
    for name, kinds in request.items():
        spec = TapSpec.parse(name)
        spec = TapSpec(spec.tap, spec.layer % lm.adapter.n_layers(spec.tap), spec.site)
        dim = 0 if spec.tap in HEAD_TAPS else hidden_size(lm, spec)  # attention rows have no hidden width
        for kind in kinds:
            layout = array_layout(spec.tap, kind, same_size_images=uniform)
            if spec.tap in HEAD_TAPS:  # one [heads] row per key of the prompt (last) or per answer query x key
                per = heads * (seqs if kind == "last" else answers * (seqs + answers))
                basis = prompt_basis if kind == "last" else (BOUND if exact else ESTIMATE)
            elif kind == "image":  # its size decides an image's tokens: the processor's or config_geometry's
                per = np.array([(extent(g) if (g := lay.grid(spec.tap, spec.site_name)) else len(lay.image_positions))
                                for lay in layouts], dtype=np.int64) * dim
                basis = EXACT
            elif kind == "last":
                per, basis = np.full(n, dim, dtype=np.int64), EXACT
            else:  # answer: one row per answer token
                per, basis = answers * dim, BOUND
            stored = array_bytes([int(v) for v in per], ragged=layout.ragged, chunk_samples=chunk_samples,
                                 value_bytes=value_bytes)
            arrays.append(ArrayEstimate(spec.name, kind, int(per.max()), int(per.sum()), layout.ragged, n_chunks,
                                       stored, basis))
    return arrays


def estimate_run(manifest: Manifest, lm: LoadedModel, samples: Sequence[DrySample], *, n_sets: int = 1,
             images: Sequence[Path | None] | None = None, codec: str = "none", hardware: Hardware = Hardware()
             ) -> RunEstimate:
    """The arrays, bytes, files and time of ``manifest`` over ``samples`` with the (meta) model ``lm``."""
    if not samples:
        raise ManifestError("the stimulus sets hold no samples (check limit)")
    request = tap_request(lm, manifest)
    layouts, exact, source = sample_layouts(lm, samples, images)
    n = len(samples)
    cs = chunk_size(n, manifest.chunk_samples, manifest.batch_size)  # as the run's store chooses it
    dtype = manifest.model.dtype
    stored = manifest.storage.dtype  # what the run declares every array with (extract/run.py stored_as)
    bf16, _ = store_policy(manifest.storage)
    lens_stored = "float32" if stored == "float32" else tensor_stored(dtype, bf16)  # as write_lens stores them
    budgets = np.array([s.answer_budget for s in samples], dtype=np.int64)
    seqs = np.array([lay.length for lay in layouts], dtype=np.int64)
    arrays = array_estimates(lm, request, samples, layouts, answer_bounds(samples, manifest.batch_size), exact, cs,
                            stored_bytes(dtype, stored=stored))
    lens = 0
    if manifest.logit_lens:
        a = lm.adapter
        lens = _numel(a.module(a.lm_head)) + _numel(a.module(a.final_norm))
    params = count_params(lm)
    est = RunEstimate(
        run=manifest.run, model=lm.source, model_type=lm.model_type, adapter=type(lm.adapter).__name__,
        n_samples=n, n_sets=n_sets, batch_size=manifest.batch_size, chunk_samples=cs, codec=codec, dtype=dtype,
        stored_dtype=stored, exact_tokens=exact, token_source=source, first_seq=int(layouts[0].length),
        first_image_tokens=len(layouts[0].image_positions), max_answer=int(budgets.max()), params=params,
        arrays=arrays, lens_values=lens,
        lens_bytes=lens * stored_bytes(dtype, stored=lens_stored),
        kv_bytes=kv_cache_bytes(lm, int((seqs + budgets).max()), min(manifest.batch_size, n), dtype),
        hardware=hardware, time=TimeEstimate(0.0, 0, 0.0, 0.0, 0.0, ""),
        attention_bytes=attention_rows_bytes(lm, request, layouts, answer_bounds(samples, manifest.batch_size),
                                             min(manifest.batch_size, n)),
    )
    est.time = estimate_time(lm, params, layouts, samples, manifest.batch_size, dtype, est.bytes + est.lens_bytes,
                              hardware)
    if manifest.storage.overflow == "store_float32":
        est.notes.append("storage.overflow is store_float32: an array that overflows float16 is stored as float32,"
                         " twice its bytes here, and the run starts again once per such array")
    if dtype == "float32" and params.total > 1e9:
        est.notes.append(f"model.dtype is float32: {human(est.weight_bytes)} of weights and twice the decode time"
                          " of bfloat16 (set model.dtype: bfloat16 for a real model)")
    return est


def estimate_manifest(manifest: Manifest, *, codec: str = "none", hardware: Hardware = Hardware()) -> RunEstimate:
    n_sets, samples, images = dry_samples(manifest)
    lm = meta_model(manifest)
    return estimate_run(manifest, lm, samples, n_sets=n_sets, images=images, codec=codec, hardware=hardware)


def describe_variant(manifest: Manifest) -> str:
    """What a head-ablation or token-compression run will do (it stores results, not activations)."""
    n_sets, samples, _ = dry_samples(manifest)
    lm = meta_model(manifest)
    spec = manifest.intervention
    n = len(samples)
    head = f"run {manifest.run}: model {lm.source} ({lm.model_type}), {n} samples from {n_sets} set(s)"
    if isinstance(spec, HeadAblationSpec):
        from extract.interventions.heads import head_site

        layers = expand_layers(spec.layers, lm.adapter.n_layers(spec.tap))
        heads = head_site(lm, spec.tap, layers[0]).n_heads if spec.heads == "all" else len(spec.heads)
        batches = -(-n // manifest.batch_size)
        per_batch = 1 + len(layers) * heads
        return "\n".join([
            head,
            f"intervention head_ablation: {spec.tap} layers {layers}, {heads} heads each, zeroed one at a time,"
            " teacher-forced on the reference answer",
            f"{batches} batches x ({per_batch} teacher-forced forwards + 1 greedy generate) = {batches * per_batch:,}"
            f" forwards; {n * len(layers) * heads:,} head_ablations rows, {n} generations; no activations",
        ])
    if not isinstance(spec, TokenCompressionSpec):
        raise ManifestError(f"run {manifest.run}: no head_ablation or token_compression block to describe")
    return "\n".join([
        head,
        f"intervention token_compression: keep {spec.keep}, drop punctuation {spec.drop_punctuation}, decoder"
        f" {spec.decoder or 'the model unembedding'}",
        f"{n} single-sample prefills + greedy decoding; {n} generations with retained ratios; no activations",
    ])


def cluster_line(est: RunEstimate, workers: int) -> str:
    """What ``workers`` GPU workers of a cluster run (one task per chunk, docs/scale.md) make of ``est``:
    the wall time, and the write rate the store must absorb meanwhile."""
    n_chunks = -(-est.n_samples // est.chunk_samples)
    t = est.time
    rounds = -(-n_chunks // workers)  # a chunk is one task: the last round may leave workers idle
    gpu = t.gpu_seconds / n_chunks * rounds
    stored = est.bytes + est.lens_bytes
    wall = max(gpu, t.write_seconds)
    rate = stored / gpu / 1e6 if gpu else 0.0
    bound = "writing" if t.write_seconds > gpu else "the GPUs"
    busy = min(workers, n_chunks)
    return (f"cluster: {workers} GPU worker(s), {n_chunks:,} tasks of {est.chunk_samples} samples ({busy} busy at once):"
            f" ~{duration(wall)} (GPU ~{duration(gpu)}, {bound} bound); the store must absorb ~{rate:,.0f} MB/s"
            f" ({rate / busy:,.0f} MB/s per worker) against {est.hardware.disk_mbps:g} MB/s assumed (--disk-mbps);"
            f" the client commits {n_chunks * len(est.arrays):,} chunk rows, plus each worker's model load")


def dry_run(manifest: Manifest, *, codec: str = "none", hardware: Hardware = Hardware(), workers: int | None = None) -> str:
    """The dry run's report of ``manifest``; with ``workers``, what a cluster of that many GPU workers makes of it."""
    spec = manifest.intervention
    if spec is not None and spec.kind in ("head_ablation", "token_compression"):
        return describe_variant(manifest)
    est = estimate_manifest(manifest, codec=codec, hardware=hardware)
    text = est.render() + (f"\n{cluster_line(est, workers)}" if workers else "")
    if spec is not None:  # rope_scaling: a normal run under a changed forward
        params = ", ".join(f"{k} {v}" for k, v in spec.model_dump().items() if k != "kind")
        text = f"intervention {spec.kind}: {params} (vision rotary frequencies scaled during the run)\n" + text
    return text


def main(argv: list[str] | None = None) -> int:
    d = Hardware()
    parser = argparse.ArgumentParser(prog="python -m extract.dry_run", description=__doc__.split("\n\n")[0])
    parser.add_argument("manifest", help="extraction manifest (YAML)")
    parser.add_argument("--codec", default="none", help="none (default), zstd, bitround8, bitround7")
    parser.add_argument("--gpu-tflops", type=float, default=d.gpu_tflops,
                        help=f"dense TFLOP/s reached in prefill (default {d.gpu_tflops:g})")
    parser.add_argument("--gpu-bandwidth-gbs", type=float, default=d.gpu_bandwidth_gbs,
                        help=f"GPU memory read rate in GB/s reached when decoding (default {d.gpu_bandwidth_gbs:g})")
    parser.add_argument("--disk-mbps", type=float, default=d.disk_mbps,
                        help=f"the store's write rate in MB/s (default {d.disk_mbps:g})")
    parser.add_argument("--step-ms-per-layer", type=float, default=d.step_ms_per_layer,
                        help=f"generate's overhead per decoder layer and step in ms (default {d.step_ms_per_layer:g};"
                             " 0 for an engine that replays CUDA graphs)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    from extract.manifest import ManifestError, load_manifest
    from extract.models.errors import ModelError
    from store import StoreError

    if args.codec not in CODEC_RATIO:
        parser.error(f"--codec must be one of {', '.join(CODEC_RATIO)}")
    hardware = Hardware(args.gpu_tflops, args.gpu_bandwidth_gbs, args.disk_mbps, args.step_ms_per_layer)
    try:
        est = estimate_manifest(load_manifest(args.manifest), codec=args.codec, hardware=hardware)
    except (ManifestError, ModelError, StoreError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(est.as_dict(), indent=2, default=str) if args.json else est.render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
