"""Run-length compression of image tokens at prefill (docs/studies.md#images-as-text-compression).

Each image token of the LLM's input (the projector output) is read as its top-1 vocabulary token
through a *visual decoder*: by default the model's own unembedding (``lm_head``, no final norm),
or a ``[vocab, hidden]`` matrix from a safetensors file (the study distils one). In raster order,
consecutive image tokens with the same top-1 token form a run (runs cross row ends); runs whose
token is whitespace or punctuation are dropped; every other run becomes one embedding (its first
member, or the mean). Positions are re-assigned as a plain ``0..T-1`` range, as the study does.
The retained ratio is ``kept / original`` image tokens. Prefill only, one sample at a time.

Implemented for the toy model (1-D positions); other families rebuild M-RoPE / image-slot
positions differently and are refused with a clear error until an adapter provides it.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from extract.models.errors import ModelError

SUPPORTED = ("toy_counter",)


@dataclass(frozen=True)
class Compressed:
    """One prompt with its image tokens compressed: the embeddings the LLM will see."""

    embeds: torch.Tensor  # [1, T', d]
    n_image: int
    n_kept: int
    tokens: torch.Tensor  # [n_image] top-1 token of each image token, raster order

    @property
    def retained_ratio(self) -> float:
        return self.n_kept / self.n_image if self.n_image else 1.0


def run_starts(tokens: torch.Tensor) -> torch.Tensor:
    """Start index of every run of equal consecutive values."""
    if tokens.numel() == 0:
        return tokens.new_zeros(0)
    change = torch.ones_like(tokens, dtype=torch.bool)
    change[1:] = tokens[1:] != tokens[:-1]
    return torch.nonzero(change).flatten()


def merge_runs(tokens: torch.Tensor, embeds: torch.Tensor, dropped: set[int], keep: str = "first") -> torch.Tensor:
    """``embeds`` ``[n, d]`` with each run of equal ``tokens`` made one row (runs of ``dropped``
    tokens removed). No repeats and nothing dropped returns ``embeds`` unchanged."""
    starts = run_starts(tokens).tolist()
    ends = starts[1:] + [int(tokens.numel())]
    out = []
    for lo, hi in zip(starts, ends, strict=False):
        if int(tokens[lo]) in dropped:
            continue
        out.append(embeds[lo] if keep == "first" else embeds[lo:hi].mean(0))
    return torch.stack(out) if out else embeds[:0]


def punctuation_ids(tokenizer: Any) -> set[int]:
    """Vocabulary ids whose text is empty after stripping whitespace and punctuation."""
    junk = set(string.punctuation) | set(string.whitespace) | {"\u2581", "\u0120", "\u010a"}  # SentencePiece/BPE spaces
    out = set()
    for token, idx in tokenizer.get_vocab().items():
        if token in tokenizer.all_special_tokens:
            continue
        if all(ch in junk for ch in token):
            out.add(int(idx))
    return out


def load_decoder(lm: Any, path: str | None) -> torch.Tensor:
    """``[vocab, hidden]``: the model's unembedding, or ``weight`` from a safetensors file."""
    head = lm.model.get_output_embeddings().weight
    if path is None:
        return head.detach()
    from safetensors.torch import load_file

    file = Path(path)
    if not file.is_file():
        raise ModelError(f"visual decoder {path!r} does not exist: give a safetensors file with a 'weight' tensor")
    weight = load_file(str(file)).get("weight")
    if weight is None or tuple(weight.shape) != tuple(head.shape):
        raise ModelError(
            f"visual decoder {path}: expected a 'weight' tensor of shape {list(head.shape)} [vocab, hidden],"
            f" got {None if weight is None else list(weight.shape)}"
        )
    return weight.to(head.device, head.dtype)


def compress(lm: Any, batch: Any, decoder: torch.Tensor, dropped: set[int], keep: str = "first") -> Compressed:
    """The compressed prefill of a one-sample batch built by ``prepare_batch``."""
    if lm.model_type not in SUPPORTED:
        raise ModelError(
            f"token compression is implemented for {', '.join(SUPPORTED)}; {lm.adapter.family} places image"
            " tokens with its own position scheme (e.g. Qwen's M-RoPE), which a compressed prefill must rebuild"
        )
    if batch.size != 1:
        raise ModelError("token compression runs one sample at a time (prefill of variable length)")
    ids = batch.inputs["input_ids"][0]
    embed = lm.model.get_input_embeddings()
    with torch.inference_mode():
        text = embed(ids)
        pixel = batch.inputs.get("pixel_values")
        if pixel is None:
            return Compressed(text[None], 0, 0, ids[:0])
        image = lm.model.get_image_features(pixel)[0]  # [n, d] raster order, the LLM's image inputs
        tokens = (image.float() @ decoder.float().T).argmax(-1)
        kept = merge_runs(tokens, image, dropped, keep)
    slots = torch.nonzero(ids == lm.adapter.image_token_id).flatten()
    lo, hi = int(slots[0]), int(slots[-1]) + 1
    if hi - lo != slots.numel():
        raise ModelError("image tokens are not contiguous in the prompt: cannot splice a compressed run list")
    embeds = torch.cat([text[:lo], kept.to(text.dtype), text[hi:]])[None]
    return Compressed(embeds, int(slots.numel()), int(kept.shape[0]), tokens.cpu())


def greedy(lm: Any, embeds: torch.Tensor, max_new_tokens: int, stop: set[int]) -> list[int]:
    """Greedy decoding from a prefill of embeddings (positions 0..T-1), without a cache: the
    prompts of the models this supports are short."""
    embed = lm.model.get_input_embeddings()
    out: list[int] = []
    seq = embeds
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            logits = lm.model(inputs_embeds=seq, use_cache=False).logits[0, -1]
            nxt = int(logits.argmax())
            if nxt in stop:
                break
            out.append(nxt)
            seq = torch.cat([seq, embed(torch.tensor([[nxt]], device=seq.device))], dim=1)
    return out
