"""The LLM's readout (final norm + unembedding), exported so a logit lens runs offline.

Probes never load the model, so everything needed to turn a stored residual-stream vector into
logits is written to the store: the LM head matrix (and bias), the final norm's kind, weight, bias,
epsilon and weight offset (Gemma norms scale by ``1 + weight``), and any final logit soft-cap.
The norm's formula is not guessed from its class name: candidates are checked numerically against
the module itself, so a new family with an unusual norm fails loudly instead of silently lensing wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from .errors import ModelError
from .loading import LoadedModel


@dataclass(frozen=True)
class FinalNorm:
    """``rms``: ``x / sqrt(mean(x^2) + eps) * (offset + weight)``;
    ``layer``: ``(x - mean) / sqrt(var + eps) * weight + bias``."""

    kind: Literal["rms", "layer"]
    weight: torch.Tensor
    bias: torch.Tensor | None
    eps: float
    weight_offset: float
    module_path: str
    class_name: str

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if self.kind == "rms":
            y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
            return y * (self.weight_offset + self.weight.float())
        y = (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + self.eps)
        y = y * self.weight.float()
        return y + self.bias.float() if self.bias is not None else y


@dataclass(frozen=True)
class Readout:
    """``logits = softcap(norm(h) @ unembed.T + unembed_bias)``; tensors on the CPU, model dtype."""

    unembed: torch.Tensor  # [vocab, hidden]
    unembed_bias: torch.Tensor | None
    norm: FinalNorm
    logit_softcap: float | None
    unembed_path: str

    def logits(self, hidden: torch.Tensor, *, apply_norm: bool = True) -> torch.Tensor:
        x = self.norm(hidden) if apply_norm else hidden.float()
        out = x @ self.unembed.float().T
        if self.unembed_bias is not None:
            out = out + self.unembed_bias.float()
        if self.logit_softcap:
            out = torch.tanh(out / self.logit_softcap) * self.logit_softcap
        return out


def _eps(module: torch.nn.Module) -> float:
    for name in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    raise ModelError(f"final norm {type(module).__name__} has no eps attribute (variance_epsilon/eps/epsilon)")


def final_norm(lm: LoadedModel) -> FinalNorm:
    path = lm.adapter.final_norm
    module = lm.model.get_submodule(path)
    weight = module.weight.detach().cpu()
    bias = getattr(module, "bias", None)
    bias = bias.detach().cpu() if isinstance(bias, torch.Tensor) else None
    eps = _eps(module)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, weight.numel(), generator=gen) * 3 + 1
    with torch.no_grad():
        ref = module(x.to(module.weight.dtype).to(module.weight.device)).float().cpu()
    candidates = [
        FinalNorm("rms", weight, None, eps, 0.0, path, type(module).__name__),
        FinalNorm("rms", weight, None, eps, 1.0, path, type(module).__name__),
        FinalNorm("layer", weight, bias, eps, 0.0, path, type(module).__name__),
    ]
    tol = 1e-4 if weight.dtype == torch.float32 else 3e-2
    for cand in candidates:
        if torch.allclose(cand(x.to(weight.dtype)), ref, rtol=tol, atol=tol):
            return cand
    raise ModelError(
        f"final norm {path} ({type(module).__name__}) matches none of RMSNorm (weight or 1+weight) or LayerNorm;"
        " teach extract/models/readout.py its formula before exporting a logit lens"
    )


def readout(lm: LoadedModel) -> Readout:
    head = lm.model.get_submodule(lm.adapter.lm_head)
    bias = getattr(head, "bias", None)
    text = lm.model.config.get_text_config()
    return Readout(
        unembed=head.weight.detach().cpu(),
        unembed_bias=bias.detach().cpu() if isinstance(bias, torch.Tensor) else None,
        norm=final_norm(lm),
        logit_softcap=getattr(text, "final_logit_softcapping", None),
        unembed_path=lm.adapter.lm_head,
    )
