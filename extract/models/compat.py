"""Two process-wide adjustments to transformers, each applied once and idempotent.

1. No video processors: the PyPI torchvision wheel crashes on import with CPU torch, so transformers
   has no video processors there, and processors that declare a ``video_processor`` attribute cannot
   be built, saved or loaded. Dropping that attribute from ``ProcessorMixin.get_attributes`` lets
   every VLM processor work on images (docs/design.md#torchvision-and-video-processors). Applied with
   or without torchvision: agnosia feeds images only, the tiny-model recipes build processors with
   ``video_processor=None`` (which transformers refuses when torchvision is importable, as on CUDA
   machines), and one processor layout on every machine keeps CPU and GPU runs alike.
2. The ``"capture"`` attention implementation: eager attention for the modules whose maps are
   requested (exactly the model's own eager code, so values match ``output_attentions``), the
   model's usual kernel for every other module. Eager/sdpa alone cannot do this: sdpa returns no
   maps, and Qwen vision blocks discard eager weights. Weights go to the active recorder
   (``extract.models.capture``), which keeps only the requested query rows.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, Protocol

import torch
from torch import nn

CAPTURE_ATTN = "capture"


class AttentionSink(Protocol):
    base_implementation: str

    def wants(self, module: nn.Module) -> bool: ...

    def record(self, module: nn.Module, weights: torch.Tensor) -> None: ...


# The recorder of the capture in progress in this context (None outside a capture).
ACTIVE_SINK: ContextVar[AttentionSink | None] = ContextVar("agnosia_attention_sink", default=None)

_patched: dict[str, bool] = {}


def patch_processors_without_torchvision() -> None:
    """Processors without their ``video_processor`` attribute, whether torchvision imports or not
    (before: only without it, so the tiny recipes' ``video_processor=None`` failed on a GPU machine)."""
    if _patched.get("processors"):
        return
    from transformers import ProcessorMixin

    original = ProcessorMixin.__dict__["get_attributes"].__func__  # the function behind the classmethod

    def get_attributes(cls: type) -> list[str]:
        return [a for a in original(cls) if a != "video_processor"]

    setattr(ProcessorMixin, "get_attributes", classmethod(get_attributes))  # noqa: B010 (mypy: no method-assign)
    _patched["processors"] = True


def _generic_eager(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention for modules whose modeling file has no ``eager_attention_forward``."""
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask[:, :, :, : key.shape[-2]]
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(weights, value).transpose(1, 2).contiguous()
    return out, weights


def _eager_for(module: nn.Module) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    # The module's own file defines the eager function its model uses (softcapping, sinks, ...).
    return getattr(sys.modules[type(module).__module__], "eager_attention_forward", _generic_eager)


def _capture_attention(module: nn.Module, query, key, value, attention_mask, **kwargs):  # noqa: ANN001
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sink = ACTIVE_SINK.get()
    if sink is not None and sink.wants(module):
        out, weights = _eager_for(module)(module, query, key, value, attention_mask, **kwargs)
        sink.record(module, weights)
        return out, None
    base = sink.base_implementation if sink is not None else "sdpa"
    if base == "eager":
        return _eager_for(module)(module, query, key, value, attention_mask, **kwargs)
    return ALL_ATTENTION_FUNCTIONS[base](module, query, key, value, attention_mask, **kwargs)


def register_capture_attention() -> None:
    if _patched.get("attention"):
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(CAPTURE_ATTN, _capture_attention)
    # Additive float masks work for both the eager modules and the sdpa ones.
    AttentionMaskInterface.register(CAPTURE_ATTN, eager_mask)
    _patched["attention"] = True


def set_attention(model: Any, implementation: str) -> None:
    """Select an attention implementation on the model and every sub-config."""
    register_capture_attention()
    model.set_attn_implementation(implementation)
