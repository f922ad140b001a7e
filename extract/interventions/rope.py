"""RoPE scaling of the vision tower (docs/studies.md#images-as-text-rope-scaling).

The study multiplies the rotary frequencies of Qwen2-VL's *vision* encoder (not the LLM's M-RoPE)
channel by channel: with ``d/2`` frequencies shared by the row and column axes and
``x_i = 2i/d = i/(d/2)``, ``inv_freq_i <- inv_freq_i * g(x_i)``:

- ``poly``:    ``g(x) = 1 + alpha * x**p`` (alpha 99; p 6, 8 or 10 depending on the study's file);
- ``sigmoid``: ``g(x) = 1 + alpha * sigmoid(k * (x - m))``.

Low-frequency channels (large ``i``) turn faster, so distant patches become distinguishable.
``alpha = 0`` gives ``g = 1`` exactly: the run equals a plain run bit for bit (tested).

Supported: models whose vision tower holds a rotary table with an ``inv_freq`` buffer (Qwen2-VL,
Qwen2.5-VL, Qwen3-VL) and the toy model (``vision.rope_gain``). Towers with learned absolute
positions (CLIP, SigLIP, InternViT) have nothing to scale: a clear error says so.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from extract.models.errors import ModelError


def gain(n_freq: int, form: str = "poly", alpha: float = 99.0, p: float = 8.0, m: float = 0.5,
         k: float = 20.0) -> torch.Tensor:
    """``g(x_i)`` for ``i = 0..n_freq-1``, ``x_i = i / n_freq`` (float32)."""
    x = torch.arange(n_freq, dtype=torch.float64) / n_freq
    if form == "poly":
        g = 1.0 + alpha * x**p
    elif form == "sigmoid":
        g = 1.0 + alpha * torch.sigmoid(k * (x - m))
    else:
        raise ValueError(f"RoPE scaling form must be 'poly' or 'sigmoid', got {form!r}")
    return g.to(torch.float32)


def _vision_root(lm: Any) -> torch.nn.Module:
    path = lm.adapter.vision_layers.rsplit(".", 1)[0]
    return lm.model.get_submodule(path)


@contextmanager
def scaled_vision_rope(lm: Any, spec: Any) -> Iterator[torch.Tensor]:
    """Scale the vision tower's rotary frequencies while the block runs; yields the gain."""
    root = _vision_root(lm)
    params = dict(form=spec.form, alpha=spec.alpha, p=spec.p, m=spec.m, k=spec.k)
    if hasattr(root, "rope_gain"):  # the toy model: frequencies computed per forward, gain applied there
        n_freq = lm.model.config.head_dim // 4
        g = gain(n_freq, **params)
        before = root.rope_gain
        root.rope_gain = g
        try:
            yield g
        finally:
            root.rope_gain = before
        return
    tables = [(name, mod) for name, mod in root.named_modules() if isinstance(getattr(mod, "inv_freq", None), torch.Tensor)]
    if not tables:
        raise ModelError(
            f"{lm.adapter.family}: the vision tower has no rotary position table (no inv_freq buffer), so there"
            " is nothing to scale: RoPE scaling applies to Qwen2-VL, Qwen2.5-VL, Qwen3-VL and the toy model"
        )
    originals = []
    try:
        for _, mod in tables:
            inv = mod.inv_freq
            g = gain(inv.shape[-1], **params).to(inv.device)
            originals.append((mod, inv.detach().clone()))
            with torch.no_grad():
                inv.mul_(g.to(inv.dtype))
        yield g
    finally:
        with torch.no_grad():
            for mod, inv in originals:
                mod.inv_freq.copy_(inv)
