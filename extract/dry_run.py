"""``python -m extract MANIFEST --dry-run``: what a run will store, before any weight loads.

The model is built on PyTorch's meta device from its ``config.json`` (no weights, no memory),
so layer counts and hidden sizes come from the real module tree; token counts come from running
the real processor on the first stimulus. Answer tokens are counted at ``max_new_tokens`` (an
upper bound), values at 2 bytes (the store's float16 default) divided by the codec's measured ratio.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from extract.manifest import Manifest
from extract.models import TapSpec, adapter_class, prepare_batch
from extract.models.capture import hook_module
from extract.models.layout import extent
from extract.models.loading import LoadedModel, load_config, load_processor, resolve_source
from extract.run import collect_samples, tap_request
from store.plan import CODEC_RATIO, human

STORED_BYTES = 2  # float16, the store's default for float32/float16/bfloat16 sources


@dataclass(frozen=True)
class PlannedArray:
    name: str
    kind: str
    values_per_sample: int


def meta_model(manifest: Manifest) -> LoadedModel:
    from transformers import AutoModelForImageTextToText

    m = manifest.model
    src = resolve_source(m.path)
    from extract.models.adapters import registry

    registry()
    config = load_config(src, revision=m.revision, trust_remote_code=m.trust_remote_code)
    adapter_cls = adapter_class(config.model_type)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config, trust_remote_code=m.trust_remote_code)
    processor = load_processor(src, adapter_cls, revision=m.revision, trust_remote_code=m.trust_remote_code)
    return LoadedModel(model=model.eval(), processor=processor, adapter=adapter_cls(model), source=src,
                       dtype=torch.float32, device=torch.device("meta"), attn_implementation="sdpa",
                       revision=m.revision)


def _norm_dim(module: nn.Module) -> int | None:
    for name, p in module.named_parameters():
        if p.ndim == 1 and "norm" in name:
            return int(p.shape[0])
    return None


def _linears(module: nn.Module) -> list[nn.Linear]:
    return [m for m in module.modules() if isinstance(m, nn.Linear)]


def hidden_size(lm: LoadedModel, spec: TapSpec) -> int:
    """The width of what a tap reads, from the hooked module's weights.

    The merger input (``pre_merger``, projector ``in``) is as wide as the vision blocks' output
    (InternVL's pixel shuffle widens it 4x before ``mlp1``; the plan does not model that).
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


def dry_run(manifest: Manifest, *, codec: str = "none") -> str:
    sets, samples = collect_samples(manifest)
    lm = meta_model(manifest)
    request = tap_request(lm, manifest)
    first = samples[0]
    layout = prepare_batch(lm, [first.image], [first.prompt]).layouts[0]
    seq = layout.length
    max_new = manifest.generation.max_new_tokens
    answer = max(int(s.params.get("max_new_tokens", 32)) for s in samples) if max_new == "from_stimulus" else max_new
    heads = lm.model.config.get_text_config().num_attention_heads
    planned = []
    for name, kinds in request.items():
        spec = TapSpec.parse(name)
        spec = TapSpec(spec.tap, spec.layer % lm.adapter.n_layers(spec.tap), spec.site)
        for kind in kinds:
            if spec.tap == "attn":
                per = heads * (seq if kind == "last" else answer * (seq + answer))
            else:
                dim = hidden_size(lm, spec)
                grid = layout.grid(spec.tap, spec.site) if spec.tap in ("vision", "projector") else None
                tokens = {"image": extent(grid) if grid else len(layout.image_positions), "last": 1,
                          "answer": answer}[kind]
                per = tokens * dim
            planned.append(PlannedArray(spec.name, kind, per))
    n = len(samples)
    raw = sum(a.values_per_sample for a in planned) * n * STORED_BYTES
    lines = [
        f"run {manifest.run}: model {lm.source} ({lm.model_type}, adapter {type(lm.adapter).__name__}),"
        f" {n} samples from {len(sets)} set(s), batch {manifest.batch_size}",
        f"first sample: {seq} prompt tokens, {len(layout.image_positions)} image tokens in the LLM,"
        f" answers up to {answer} tokens",
        "",
        f"{'array':<28} {'tokens':<7} {'values/sample':>14} {'bytes':>12}",
    ]
    for a in planned:
        lines.append(f"{a.name:<28} {a.kind:<7} {a.values_per_sample:>14,} {human(a.values_per_sample * n * STORED_BYTES):>12}")
    ratio = CODEC_RATIO.get(codec, 1.0)
    lens = "; plus the unembedding and final norm for the logit lens" if manifest.logit_lens else ""
    lines += ["", f"{len(planned)} arrays, {human(raw)} as float16 ({human(raw / ratio)} with codec {codec}){lens}"]
    return "\n".join(lines)
