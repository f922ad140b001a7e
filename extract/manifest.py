"""Extraction manifests: one YAML file says which model runs over which stimuli and what is kept.

```yaml
run: demo-g2m                     # run id in the workspace (letters, digits, - _ .)
model:
  path: models/toy-counter        # a local model folder or a Hugging Face id
  dtype: float32                  # float32 | float16 | bfloat16
  device: cpu
stimuli:
  - set: sets/g2m              # a folder written by `python -m stimuli`
    task: transcribe              # which of the set's prompts to ask (default: the first)
taps:
  - {tap: vision, layers: all, tokens: [image]}
  - {tap: llm, layers: [0, -1], tokens: [image, last]}
attention: {layers: [-1], queries: [last]}
generation: {max_new_tokens: 16}
batch_size: 8
storage: {dtype: float16, overflow: refuse}   # the defaults; see StorageSpec
```

Validation happens before any model loads; every message names the key, what was expected and
what was found, with a "did you mean" for typos.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from store.config import StrictModel, check_mapping, read_yaml, validate
from store.errors import StoreError
from store.vocab import array_layout, check_tap


class ManifestError(ValueError):
    """The manifest is invalid; the message says where and how to fix it."""


_Strict = StrictModel


Layers = Annotated[Literal["all"] | list[int] | int | str, Field(description="'all', an index, a list, or a range '0-3'")]


def expand_layers(spec: Any, n_layers: int) -> list[int]:
    """``'all'``, ``3``, ``[0, -1]`` or ``'2-5'`` -> sorted, unique, non-negative layer indices.

    Negative indices count from the end (``-1`` is the last layer); anything outside
    ``-n_layers..n_layers-1`` is an error that names the valid range.
    """
    if spec == "all":
        return list(range(n_layers))
    if isinstance(spec, str):
        m = re.fullmatch(r"\s*(-?\d+)\s*-\s*(-?\d+)\s*", spec)
        if not m:
            raise ManifestError(f"layers {spec!r}: expected 'all', an integer, a list, or a range like '0-3'")
        values = list(range(int(m[1]), int(m[2]) + 1))
    elif isinstance(spec, int):
        values = [spec]
    else:
        values = list(spec)
    out = set()
    for v in values:
        if not -n_layers <= v < n_layers:
            raise ManifestError(
                f"layer {v} does not exist: this tap has {n_layers} layers (0..{n_layers - 1}, or -1 for the last)")
        out.add(v % n_layers)
    return sorted(out)


class ModelSpec(_Strict):
    path: str
    revision: str | None = None
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    device: str = "cpu"
    device_map: str | None = None  # e.g. "auto": spread a model too large for one GPU (device is then ignored)
    trust_remote_code: bool = False


class StimulusSpec(_Strict):
    set: str
    task: str | None = None
    limit: int | None = Field(default=None, ge=1)


class TapRequest(_Strict):
    """One ``taps:`` entry: a tap word, its layers, a site and the token kinds to keep (the words of
    store/vocab.py; an unknown one fails here, with a did-you-mean)."""

    tap: str
    layers: Layers = "all"
    site: str | None = None  # the tap's default: resid_post (vision, llm), out (projector)
    tokens: list[str] = ["image"]

    @field_validator("tap")
    @classmethod
    def _known_tap(cls, v: str) -> str:
        _vocab(check_tap, v, listed=True)
        return v

    @field_validator("site")
    @classmethod
    def _known_site(cls, v: str | None, info: ValidationInfo) -> str | None:
        tap = info.data.get("tap")
        if v is not None and tap is not None:
            _vocab(check_tap, tap, v)
        return v

    @field_validator("tokens")
    @classmethod
    def _known_tokens(cls, v: list[str], info: ValidationInfo) -> list[str]:
        if not v:
            raise ValueError("tokens is empty: keep at least one of image, last, answer")
        tap = info.data.get("tap")
        for kind in v:  # the layout rule knows every (tap, kind) pair a run can store
            if tap is not None:
                _vocab(array_layout, tap, kind, same_size_images=True)
        return list(dict.fromkeys(v))


def _vocab(check: Callable[..., object], *args: Any, **kwargs: Any) -> None:
    """Run one of store/vocab.py's checks; its StoreError becomes the ValueError pydantic files under the key."""
    try:
        check(*args, **kwargs)
    except StoreError as err:
        raise ValueError(str(err)) from None


class AttentionSpec(_Strict):
    layers: Layers = "all"
    queries: list[str] = ["last"]

    @field_validator("queries")
    @classmethod
    def _known_queries(cls, v: list[str]) -> list[str]:
        for kind in v:
            _vocab(array_layout, "attn", kind, same_size_images=True)
        return v


class GenerationSpec(_Strict):
    max_new_tokens: int | Literal["from_stimulus"] = 16
    do_sample: Literal[False] = False
    # "auto": one forward and no generate when every answer is one token (same values, half the work);
    # "generate": always generate (to compare the two, or to rule the shortcut out)
    path: Literal["auto", "generate"] = "auto"

    @field_validator("max_new_tokens", mode="before")
    @classmethod
    def _at_least_one(cls, v: Any) -> Any:
        # before the union: one message, not one per member of int | 'from_stimulus'
        if isinstance(v, int) and not isinstance(v, bool) and v < 1:
            raise ValueError("must be at least 1: the most tokens to generate per answer, or 'from_stimulus'")
        return v


class RopeScalingSpec(_Strict):
    """images-as-text's vision RoPE scaling: frequency i of d/2 multiplied by g(x_i), x_i = 2i/d.

    ``poly``: g = 1 + alpha * x**p; ``sigmoid``: g = 1 + alpha * sigmoid(k * (x - m)).
    The study's defaults: alpha 99, p 6 (model file) / 8 (evaluation patch) / 10 (training script).
    """

    kind: Literal["rope_scaling"]
    form: Literal["poly", "sigmoid"] = "poly"
    alpha: float = Field(default=99.0, ge=0)
    p: float = Field(default=8.0, gt=0)
    m: float = 0.5
    k: float = 20.0


class HeadAblationSpec(_Strict):
    """counting-bottleneck's counting heads: zero one attention head at a time, teacher-forced on the
    reference answer, and record whether any answer token's argmax flips."""

    kind: Literal["head_ablation"]
    tap: Literal["llm", "vision"] = "llm"
    layers: Layers = "all"
    heads: Literal["all"] | list[int] = "all"


class TokenCompressionSpec(_Strict):
    """images-as-text's run-length compression of image tokens at prefill: each image token's top-1
    vocabulary token (through ``decoder``, default the model's own unembedding of the projector
    output), runs of one token merged into one embedding, punctuation/whitespace runs dropped."""

    kind: Literal["token_compression"]
    keep: Literal["first", "mean"] = "first"
    drop_punctuation: bool = True
    decoder: str | None = None  # safetensors file holding "weight" [vocab, hidden]


StorageDtype = Literal["float16", "bfloat16", "float32"]
OverflowChoice = Literal["refuse", "clip", "store_float32"]


class StorageSpec(_Strict):
    """How the run's activations land on disk (docs/store.md, "The dtype policy").

    ``dtype``: ``float16`` (2 bytes a value; exact for bfloat16 values within +-65504), ``bfloat16``
    (2 bytes, bit for bit: a bfloat16 model only) or ``float32`` (4 bytes, exact for every model).
    ``overflow``, for float16 only: a finite value beyond +-65504 is refused (``refuse``: the run
    stops and says which keys to set), saturated and counted (``clip``), or its array is stored as
    float32 instead (``store_float32``: the run starts again with that array wider, once per such array).
    """

    dtype: StorageDtype = "float16"
    overflow: OverflowChoice = "refuse"

    @model_validator(mode="after")
    def _overflow_needs_float16(self) -> StorageSpec:
        if self.overflow != "refuse" and self.dtype != "float16":
            raise ValueError(
                f"overflow: {self.overflow} is what float16 storage does with values beyond +-65504; {self.dtype}"
                " holds them already: remove storage.overflow (or store float16)"
            )
        return self


def store_policy(storage: StorageSpec) -> tuple[Literal["fp16", "bits"], Literal["error", "clip"]]:
    """The store's run policies (``RunInfo.bf16``, ``RunInfo.overflow``) for ``storage``.

    ``store_float32`` runs with the store's ``error``: the extraction catches the overflow and stores
    that array as float32 (extract/run.py)."""
    return ("bits" if storage.dtype == "bfloat16" else "fp16"), ("clip" if storage.overflow == "clip" else "error")


def storage_yaml(storage: StorageSpec) -> str:
    """``storage`` as the one-line YAML a manifest holds, defaults included."""
    return f"storage: {{dtype: {storage.dtype}, overflow: {storage.overflow}}}"


Intervention = Annotated[RopeScalingSpec | HeadAblationSpec | TokenCompressionSpec, Field(discriminator="kind")]


class Manifest(_Strict):
    run: str
    model: ModelSpec
    stimuli: list[StimulusSpec]
    taps: list[TapRequest] = []
    attention: AttentionSpec | None = None
    generation: GenerationSpec = GenerationSpec()
    batch_size: int = Field(default=8, ge=1)
    chunk_samples: int = Field(default=64, ge=1)
    workspace: str | None = None
    logit_lens: bool = True
    shard: str | None = None  # "i/k": this process fills chunk i of every k (`--shard` overrides)
    intervention: Intervention | None = None  # a variant run: see extract/interventions/
    storage: StorageSpec = StorageSpec()

    @field_validator("run")
    @classmethod
    def _run_id(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", v):
            raise ValueError("run ids use letters, digits, '-', '_' and '.', start with a letter or digit, at most 64 characters")
        return v

    @field_validator("shard")
    @classmethod
    def _shard(cls, v: str | None) -> str | None:
        if v is None:
            return v
        m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(v))
        if not m or not 0 <= int(m[1]) < int(m[2]):
            raise ValueError("a shard is i/k with 0 <= i < k, e.g. 0/4 for the first of four processes")
        return f"{int(m[1])}/{int(m[2])}"

    @model_validator(mode="after")
    def _something_to_do(self) -> Manifest:
        if not self.stimuli:
            raise ValueError("stimuli is empty: list at least one stimulus set")
        kind = self.intervention.kind if self.intervention else None
        if kind in ("head_ablation", "token_compression") and (self.taps or self.attention):
            raise ValueError(
                f"a {kind} run records its own results (head_ablations rows / generations with retained"
                " ratios), not activations: remove taps and attention, and extract activations in a plain run"
            )
        if kind in ("head_ablation", "token_compression") and self.shard:
            raise ValueError(f"a {kind} run is not sharded: remove shard")
        self._check_storage()
        return self

    def _check_storage(self) -> None:
        if self.storage.dtype == "bfloat16" and self.model.dtype != "bfloat16":
            raise ValueError(
                f"storage.dtype: bfloat16 keeps a bfloat16 model's values bit for bit; model.dtype is"
                f" {self.model.dtype}, whose values bfloat16 would round: store float32 (exact) or float16,"
                " or run the model in bfloat16 (model.dtype: bfloat16)"
            )
        if self.storage.overflow == "store_float32" and self.shard:
            # The run restarts without the overflowing array's float16 chunks, which a peer shard may be writing.
            raise ValueError(
                "storage.overflow: store_float32 starts the run again when an array overflows, which a sharded"
                " run cannot do while other shards write it: use storage: {dtype: float32} or {overflow: clip}"
            )


def parse_manifest(data: Any, source: str = "manifest") -> Manifest:
    check_mapping(data, source, ManifestError)
    manifest = validate(Manifest, data, f"{source} is not a valid extraction manifest", ManifestError)
    check_sets(manifest, source)
    return manifest


def check_sets(manifest: Manifest, source: str = "manifest") -> None:
    """Each stimulus once per run: the same set listed twice, or two sets whose folders share a
    name, would give two rows one key ('<set folder name>/<id>'). Checked here, so the refusal
    comes before a model loads or the workspace is touched."""
    seen: dict[str, tuple[int, Path]] = {}
    for i, spec in enumerate(manifest.stimuli):
        folder = Path(spec.set).expanduser().resolve()
        if folder.name not in seen:
            seen[folder.name] = (i, folder)
            continue
        j, other = seen[folder.name]
        if other == folder:
            raise ManifestError(
                f"{source}: stimuli.{i}: set {spec.set} is already listed as stimuli.{j}; a run holds each stimulus"
                " once, so list the set once (to ask another of its tasks, extract it as a second run)"
            )
        raise ManifestError(
            f"{source}: stimuli.{i}: sets {other} and {folder} are both named {folder.name!r}; stimulus keys are"
            " '<set folder name>/<id>', so rename one folder"
        )


def check_codec(codec: str, stored: str = "float16") -> None:
    """Refuse an unknown ``--codec`` before anything loads or is written (the storage dtype's
    mantissa bounds bitround<k>)."""
    from store.arrays import parse_codec  # here: validating a manifest alone needs no Zarr import
    from store.errors import StoreError

    try:
        parse_codec(codec, stored)
    except StoreError as err:
        raise ManifestError(f"--codec {codec}: {err}") from None


def load_manifest(path: str | Path) -> Manifest:
    """Read and validate a manifest file; relative paths inside it stay relative to the caller's cwd."""
    data = read_yaml(path, ManifestError, "manifest", "manifests/demo.yaml")
    return parse_manifest(data, str(path))


STIMULI_DIR = "sets"  # the folder `make stimuli` writes and the repository's manifests name


def with_stimuli_root(manifest: Manifest, root: str | Path) -> Manifest:
    """The manifest with each relative set path under ``sets/`` read from ``root`` instead
    (``python -m extract M --stimuli-root DIR``, ``make demo STIMULI=DIR``); other paths unchanged.
    Stimulus keys are ``<set folder name>/<id>``, so the run's rows keep their keys."""
    moved = []
    for spec in manifest.stimuli:
        parts = Path(spec.set).parts
        if not Path(spec.set).is_absolute() and len(parts) > 1 and parts[0] == STIMULI_DIR:
            spec = spec.model_copy(update={"set": str(Path(root, *parts[1:]))})
        moved.append(spec)
    return manifest.model_copy(update={"stimuli": moved})

