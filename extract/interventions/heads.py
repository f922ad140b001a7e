"""Head ablation ("counting heads": docs/studies.md#counting-bottleneck-heads).

One attention head is zeroed at a time: its slice of the attention output, the input of the
output projection (``o_proj`` / ``out_proj`` / ``proj``), is set to 0, so the projection sees the
other heads only. Teacher-forced on the reference answer, a head is *critical* for a stimulus when
the argmax at any answer position changes. One forward per head covers a whole batch of stimuli,
so ``layers x heads x batches`` forwards ablate a set, not ``layers x heads x stimuli``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from extract.models.errors import ModelError

_OUT_NAMES = ("o_proj", "out_proj", "proj", "dense", "wo", "projection_layer")


@dataclass(frozen=True)
class HeadSite:
    """One attention module whose heads can be zeroed."""

    tap: str  # llm | vision
    layer: int
    path: str  # attention module
    out_proj: str  # its output projection, whose input holds the heads side by side
    n_heads: int
    head_dim: int


def head_site(lm: Any, tap: str, layer: int) -> HeadSite:
    ad = lm.adapter
    layers, attn = (ad.llm_layers, ad.llm_attention) if tap == "llm" else (ad.vision_layers, ad.vision_attention)
    path = f"{layers}.{layer}.{attn}"
    module = lm.model.get_submodule(path)
    out_name = next((n for n in _OUT_NAMES if isinstance(getattr(module, n, None), nn.Linear)), None)
    if out_name is None:
        raise ModelError(
            f"{ad.family}: attention module {path} has no output projection named one of {_OUT_NAMES};"
            " name it in extract/interventions/heads.py to ablate its heads"
        )
    width = getattr(module, out_name).in_features
    cfg = getattr(module, "config", None)
    n_heads = (getattr(module, "num_heads", None) or getattr(module, "num_attention_heads", None)
               or getattr(cfg, "num_attention_heads", None))
    head_dim = getattr(module, "head_dim", None)
    if head_dim:
        n_heads = width // head_dim
    if not n_heads or width % n_heads:
        raise ModelError(f"{ad.family}: cannot tell the heads of {path} apart (width {width}, heads {n_heads})")
    return HeadSite(tap, layer, path, f"{path}.{out_name}", int(n_heads), width // int(n_heads))


@contextmanager
def zeroed(lm: Any, site: HeadSite, head: int) -> Iterator[None]:
    """Zero ``head`` of ``site`` while the block runs."""
    if not 0 <= head < site.n_heads:
        raise ModelError(f"{site.path} has heads 0..{site.n_heads - 1}, got head {head}")
    lo, hi = head * site.head_dim, (head + 1) * site.head_dim

    def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0].clone()
        x[..., lo:hi] = 0
        return (x, *args[1:])

    handle = lm.model.get_submodule(site.out_proj).register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@dataclass(frozen=True)
class AnswerScores:
    """Per sample: argmax and log-probability of the reference token at each answer position."""

    argmax: list[torch.Tensor]
    logprob: list[torch.Tensor]


def answer_scores(lm: Any, batch: Any) -> AnswerScores:
    """One teacher-forced forward; answer position p is predicted by the logits at p - 1."""
    with torch.inference_mode():
        logits = lm.model(**batch.inputs, use_cache=False).logits.float()
    ids = batch.inputs["input_ids"]
    argmax, logprob = [], []
    for b, lay in enumerate(batch.layouts):
        pos = torch.as_tensor(lay.answer_positions, device=logits.device)
        rows = logits[b, pos - 1]
        argmax.append(rows.argmax(-1).cpu())
        logprob.append(rows.log_softmax(-1).gather(-1, ids[b, pos][:, None].to(rows.device))[:, 0].cpu())
    return AnswerScores(argmax, logprob)


def ablate(lm: Any, batch: Any, sites: Sequence[HeadSite], heads: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """Rows ``{sample, tap, layer, head, n_positions, n_flipped, flipped, flip_mask, logit_drop}``
    for every head of every site over one teacher-forced batch (``flip_mask`` bit p: answer
    position p flipped)."""
    base = answer_scores(lm, batch)
    rows = []
    for site in sites:
        for head in (range(site.n_heads) if heads is None else heads):
            with zeroed(lm, site, head):
                got = answer_scores(lm, batch)
            for b in range(batch.size):
                n = int(base.argmax[b].numel())
                changed = (got.argmax[b] != base.argmax[b]).tolist()
                drop = float((base.logprob[b] - got.logprob[b]).mean()) if n else None
                rows.append({"sample": b, "tap": site.tap, "layer": site.layer, "head": int(head),
                             "n_positions": n, "n_flipped": sum(changed), "flipped": any(changed),
                             "flip_mask": sum(1 << p for p, c in enumerate(changed) if c), "logit_drop": drop})
    return rows
