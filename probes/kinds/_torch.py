"""Shared pieces of the small neural probes (conv_spatial, detect): the optimisation loop with
the papers' schedule, feature standardisation, and module <-> safetensors state."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from probes.errors import ProbeError


@dataclass
class TrainInfo:
    iters: int = 0
    best_iter: int = 0
    best_valid: float | None = None
    stopped_early: bool = False
    final_loss: float = float("nan")


def warmup_cosine(total: int, warmup: float, floor: float = 0.0) -> Callable[[int], float]:
    """Linear warmup over ``warmup`` of the steps, then cosine from 1 down to ``floor``."""
    w = int(round(total * warmup))

    def factor(step: int) -> float:
        if w and step < w:
            return (step + 1) / w
        t = (step - w) / max(total - w, 1)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))

    return factor


def train(
    model: torch.nn.Module,
    loss_of: Callable[[torch.Tensor], torch.Tensor],
    n: int,
    *,
    iters: int,
    batch_size: int,
    lr: float,
    weight_decay: float,
    warmup: float,
    clip: float,
    seed: int,
    floor: float = 0.0,
    valid: Callable[[], float] | None = None,
    eval_every: int | None = None,
    patience: int = 3,
) -> TrainInfo:
    """AdamW over shuffled mini-batches of sample indices; ``loss_of(idx)`` gives the batch loss.

    With ``valid`` and ``eval_every`` the best-scoring weights (higher is better) are kept and
    training stops after ``patience`` evaluations without improvement (the G2M recipe)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(iters, warmup, floor))
    info = TrainInfo()
    keeper = _BestWeights(model, patience)
    model.train()
    for step, idx in enumerate(_batches(n, batch_size, iters, seed)):
        loss = loss_of(idx)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        sched.step()
        info.iters = step + 1
        info.final_loss = float(loss.detach())
        if valid is not None and eval_every and (step + 1) % eval_every == 0 and keeper.stop(step + 1, valid, info):
            break
    keeper.restore()
    model.eval()
    return info


def _batches(n: int, batch_size: int, iters: int, seed: int) -> Iterator[torch.Tensor]:
    """``iters`` mini-batches of sample indices: epochs of a seeded permutation, reshuffled when
    the next full batch would run past the end."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(n, generator=gen)
    pos = 0
    for _ in range(iters):
        if pos + min(batch_size, n) > n:
            order, pos = torch.randperm(n, generator=gen), 0
        yield order[pos : pos + batch_size]
        pos += batch_size


class _BestWeights:
    """Early stopping: keeps the best-scoring weights (higher is better) and says when ``patience``
    evaluations in a row have not improved."""

    def __init__(self, model: torch.nn.Module, patience: int) -> None:
        self.model, self.patience = model, patience
        self.state: dict[str, torch.Tensor] | None = None
        self.bad = 0

    def stop(self, step: int, valid: Callable[[], float], info: TrainInfo) -> bool:
        self.model.eval()
        with torch.no_grad():
            score = valid()
        self.model.train()
        if info.best_valid is None or score > info.best_valid:
            info.best_valid, info.best_iter, self.bad = score, step, 0
            self.state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            return False
        self.bad += 1
        info.stopped_early = self.bad >= self.patience
        return info.stopped_early

    def restore(self) -> None:
        if self.state is not None:
            self.model.load_state_dict(self.state)


def stats(X: np.ndarray, standardize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean / std over all samples and tokens of X [n, T, d]."""
    d = X.shape[-1]
    if not standardize:
        return np.zeros(d, np.float32), np.ones(d, np.float32)
    flat = X.reshape(-1, d).astype(np.float64)
    return standardizer(flat.mean(0), flat.var(0), True)


def standardizer(mean: np.ndarray, var: np.ndarray, standardize: bool) -> tuple[np.ndarray, np.ndarray]:
    """(shift, scale) float32 from per-channel moments (population variance, float64): the same
    numbers :func:`stats` makes from the rows, for moments streamed over them (out of core)."""
    if not standardize:
        return np.zeros(len(mean), np.float32), np.ones(len(mean), np.float32)
    std = np.sqrt(np.maximum(var, 0.0))
    std[std < 1e-8] = 1.0
    return mean.astype(np.float32), std.astype(np.float32)


def module_state(model: torch.nn.Module, prefix: str = "net.") -> dict[str, np.ndarray]:
    return {prefix + k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def load_module_state(model: torch.nn.Module, tensors: dict[str, Any], prefix: str = "net.") -> None:
    state = {k[len(prefix):]: torch.from_numpy(np.array(v)) for k, v in tensors.items() if k.startswith(prefix)}
    model.load_state_dict(state)
    model.eval()


def grid_of(n_tokens: int, grid: tuple[int, int] | None, kind: str) -> tuple[int, int]:
    if grid is not None:
        h, w = int(grid[0]), int(grid[1])
        if h * w != n_tokens:
            raise ProbeError(f"{kind}: grid {h}x{w} does not hold the array's {n_tokens} tokens")
        return h, w
    r = math.isqrt(n_tokens)
    if r * r != n_tokens:
        raise ProbeError(f"{kind}: {n_tokens} tokens are not a square grid; pass grid: [h, w] (the farm passes the manifest's)")
    return r, r
