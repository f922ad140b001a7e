"""Two process-wide adjustments to transformers, each applied once and idempotent.

1. No video processors: the PyPI torchvision wheel crashes on import with CPU torch, so transformers
   has no video processors there, and processors that declare a ``video_processor`` attribute cannot
   be built, saved or loaded. Dropping that attribute from ``ProcessorMixin.get_attributes`` lets
   every VLM processor work on images (docs/design.md#torchvision-and-video-processors). Applied with
   or without torchvision: agnosia feeds images only, the tiny-model recipes build processors with
   ``video_processor=None`` (which transformers refuses when torchvision is importable, as on CUDA
   machines), and one processor layout on every machine keeps CPU and GPU runs alike.
2. The ``"capture"`` attention implementation: every module's output comes from the model's usual
   kernel (sdpa), and for the modules whose maps are requested the weights of just the query rows
   the active recorder keeps (``extract.models.capture``: ``last``, ``answer``, image rows) are
   computed beside it by the module's own eager function over those rows, so they match
   ``output_attentions`` (same scaling, soft-capping, GQA mapping, masks) while memory grows as
   rows x keys, not keys x keys. Eager/sdpa alone cannot do this: sdpa returns no maps, and Qwen
   vision blocks discard eager weights. ``attention_rows("full")`` (or the environment variable
   ``AGNOSIA_ATTENTION_ROWS=full``) selects the former path, eager over every query row of a
   requested module: kept for comparison (``python -m bench attention``) and as the fallback of a
   module whose eager function needs the whole query (:data:`FULL_QUERY_EAGER`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Literal, Protocol

import torch
from torch import nn

CAPTURE_ATTN = "capture"


class AttentionSink(Protocol):
    base_implementation: str

    def wants(self, module: nn.Module) -> bool: ...

    def query_rows(self, module: nn.Module, q_len: int) -> torch.Tensor | None:
        """The sorted query indices (of this call's ``q_len``) whose weights ``record`` needs: ``[R]`` for the
        whole batch or ``[B, R]`` per sample; None: all."""
        ...

    def record(self, module: nn.Module, weights: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """``weights`` ``[B, H, R, K]`` of the query indices ``rows`` (None: every query, ``R == q_len``)."""
        ...


# The recorder of the capture in progress in this context (None outside a capture).
ACTIVE_SINK: ContextVar[AttentionSink | None] = ContextVar("agnosia_attention_sink", default=None)

AttentionRows = Literal["selected", "full"]
# "selected": the requested query rows only, beside the model's kernel; "full": eager over every query row
# (the path before row selection). The environment variable sets the default of a process (the bench's
# workers); tests and callers switch it per context.
ATTENTION_ROWS: ContextVar[AttentionRows] = ContextVar(
    "agnosia_attention_rows", default="full" if os.environ.get("AGNOSIA_ATTENTION_ROWS") == "full" else "selected")

# Modeling modules whose eager function cannot run on a subset of query rows (its weights of one row
# would depend on the others), so their requested modules run eager over every row: none of the families
# agnosia supports (every one is a row-wise softmax over scaled, optionally soft-capped scores plus the mask).
FULL_QUERY_EAGER: frozenset[str] = frozenset()


@contextmanager
def attention_rows(mode: AttentionRows) -> Iterator[None]:
    """Within the block, attention maps are computed for the ``"selected"`` query rows or ``"full"``."""
    if mode not in ("selected", "full"):
        raise ValueError(f"attention rows are 'selected' or 'full', got {mode!r}")
    token = ATTENTION_ROWS.set(mode)
    try:
        yield
    finally:
        ATTENTION_ROWS.reset(token)


def rows_path(module: nn.Module) -> AttentionRows:
    """The path a requested attention module takes under the current setting."""
    if ATTENTION_ROWS.get() == "full" or type(module).__module__ in FULL_QUERY_EAGER:
        return "full"
    return "selected"

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


def _take_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x[:, :, rows]`` of a ``[B, H, T, ...]`` tensor: ``rows`` ``[R]`` shared by the batch, or ``[B, R]``
    one list per sample (a batch dimension of 1 is broadcast)."""
    if rows.dim() == 1:
        return x.index_select(2, rows)
    batch = torch.arange(rows.shape[0], device=rows.device)[:, None]
    return x.expand(rows.shape[0], *x.shape[1:])[batch, :, rows].transpose(1, 2)  # [B, R, H, ...] -> [B, H, R, ...]


def _mask_rows(attention_mask: torch.Tensor | None, rows: torch.Tensor, q_len: int) -> torch.Tensor | None:
    """The mask's rows of the query indices ``rows`` (a mask broadcast over queries stays as it is)."""
    if attention_mask is None or attention_mask.dim() < 4 or attention_mask.shape[-2] != q_len:
        return attention_mask
    return _take_rows(attention_mask, rows)


def _skipped_mask_rows(module: nn.Module, rows: torch.Tensor, q_len: int, n_keys: int,
                       is_causal: bool | None) -> torch.Tensor | None:
    """The mask rows of a forward whose mask transformers skipped (no padding, no window in reach, no
    bidirectional blocks: :func:`_capture_mask`), as sdpa then applies it: ``is_causal`` over several
    queries (upper-left: query ``i`` sees keys ``0..i``), nothing over one query (a decode step sees every
    key). Eager code would have built this mask; building its rows only keeps the kernel's causal path."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if q_len == 1 or not causal:
        return None
    keys = torch.arange(n_keys, device=rows.device)
    allowed = keys <= rows[..., None]  # [R, K] or [B, R, K]
    return allowed[None, None] if rows.dim() == 1 else allowed[:, None]  # [1 or B, 1, R, K]


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask (True: attend) as the additive float mask eager functions add to their scores, with
    the values transformers' ``eager_mask`` gives it (0 and the dtype's minimum)."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask, torch.zeros((), device=mask.device, dtype=dtype), torch.finfo(dtype).min)


def _eager_mask(module: nn.Module, attention_mask: torch.Tensor | None, rows: torch.Tensor | None,
                query: torch.Tensor, n_keys: int, is_causal: bool | None) -> torch.Tensor | None:
    """The additive mask eager code adds to the scores of the query indices ``rows`` (None: every query):
    the forward's mask rows, or, where transformers skipped the mask for sdpa's causal kernel, the causal
    rows it stands for (:func:`_skipped_mask_rows`)."""
    q_len = query.shape[-2]
    if attention_mask is not None:
        mask = attention_mask if rows is None else _mask_rows(attention_mask, rows, q_len)
    else:
        every = rows if rows is not None else torch.arange(q_len, device=query.device)
        mask = _skipped_mask_rows(module, every, q_len, n_keys, is_causal)
    return _additive(mask, query.dtype)


def _selected_weights(module: nn.Module, rows: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None, **kwargs: Any) -> torch.Tensor:
    """The module's own eager weights ``[B, H, R, K]`` of the query rows ``rows`` only: ``[R]`` shared by
    the batch or ``[B, R]`` per sample; None: every row.

    Every family's eager function is row-wise (scores of one query row, scaled, soft-capped, masked and
    softmaxed over keys), so running it on ``R`` query rows and their mask rows gives exactly those rows of
    the full ``[B, H, T, K]`` map, at ``R x K`` memory. Its output over the rows is not wanted (the layer's
    output comes from the base kernel), so it gets values of width 0.
    """
    if rows is None:
        rows = torch.arange(query.shape[-2], device=query.device)
    q = _take_rows(query, rows)
    mask = _eager_mask(module, attention_mask, rows, query, key.shape[-2], kwargs.get("is_causal"))
    kwargs = {**kwargs, "dropout": 0.0}
    # values of width 0: the function's output over these rows is discarded, so its weights x values
    # product (and GQA's copy of the values) costs nothing; the weights are computed as they are
    _, weights = _eager_for(module)(module, q, key, value[..., :0], mask, **kwargs)
    return weights


def _base_attention(base: str, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if base == "eager":  # a model loaded eager: its modules add the mask to the scores
        return _eager_for(module)(module, query, key, value, _additive(attention_mask, query.dtype), **kwargs)
    return ALL_ATTENTION_FUNCTIONS[base](module, query, key, value, attention_mask, **kwargs)


def _capture_attention(module: nn.Module, query, key, value, attention_mask, **kwargs):  # noqa: ANN001
    sink = ACTIVE_SINK.get()
    base = sink.base_implementation if sink is not None else "sdpa"
    if sink is None or not sink.wants(module):
        return _base_attention(base, module, query, key, value, attention_mask, **kwargs)
    if rows_path(module) == "full":
        mask = _eager_mask(module, attention_mask, None, query, key.shape[-2], kwargs.get("is_causal"))
        out, weights = _eager_for(module)(module, query, key, value, mask, **kwargs)
        sink.record(module, weights)
        return out, None
    rows = sink.query_rows(module, query.shape[-2])
    if rows is None or rows.numel():  # none: nothing is kept at this step (a decode step of prompt-only taps)
        sink.record(module, _selected_weights(module, rows, query, key, value, attention_mask, **kwargs), rows)
    out, _ = _base_attention(base, module, query, key, value, attention_mask, **kwargs)
    return out, None


def register_capture_attention() -> None:
    if _patched.get("attention"):
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(CAPTURE_ATTN, _capture_attention)
    AttentionMaskInterface.register(CAPTURE_ATTN, _capture_mask)
    _patched["attention"] = True


def _capture_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """The mask a plain sdpa forward gets (``sdpa_mask``): boolean, one byte per query x key
    (``[B, 1, T, K]``, once per forward and mask type), and skipped where sdpa skips it (``is_causal``: no
    padding, no sliding window in reach, no bidirectional image blocks), so that the layers keep sdpa's
    causal kernel; requested modules then build the causal rows they need (:func:`_skipped_mask_rows`).
    Where the modules run eager code (a model loaded eager, or no capture in progress) it is always built,
    as eager attention needs it; eager code gets its rows as an additive float mask (:func:`_additive`)."""
    from transformers.masking_utils import sdpa_mask

    kwargs.pop("dtype", None)
    sink = ACTIVE_SINK.get()
    if sink is None or sink.base_implementation == "eager":
        kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def set_attention(model: Any, implementation: str) -> None:
    """Select an attention implementation on the model and every sub-config."""
    register_capture_attention()
    model.set_attn_implementation(implementation)
