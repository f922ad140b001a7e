"""MAS fine-tuning (docs/studies.md#counting-tricks-mas): pull answer-query attention toward the image.

The Modality Attention Share of one sample is the image-key share of the attention its answer
queries pay, averaged over heads, then queries, then layers::

    MAS_b = mean_l mean_q mean_h  sum_{k in image} A_l[b, h, q, k] / sum_k A_l[b, h, q, k]

(queries: positions with a label, i.e. the answer tokens). The loss adds
``lam * mean_b(max(0, tau - MAS_b) * 1[wrong_b])`` to the LM loss, where a sample is wrong when
any teacher-forced answer token is mispredicted. Defaults: tau 0.4 (the study's recommendation),
lam 0.1. ``python -m lab.mas`` fine-tunes the toy model's decoder and projector with it and writes
a normal model folder (plus ``agnosia_intervention.json``) that any manifest extracts as a
variant run.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from extract.interventions import INTERVENTION_FILE
from toyvlm.model import ToyCounterOutput

from . import DEFAULT_CHECKPOINT
from .config import DEFAULT_TRAIN_YAML, TrainConfig
from .data import IGNORE, Batch


def modality_attention_share(attentions: Sequence[torch.Tensor], image_keys: torch.Tensor,
                             queries: torch.Tensor) -> torch.Tensor:
    """MAS per sample ``[B]``: ``attentions`` per layer ``[B, H, T, T]``; ``image_keys`` and
    ``queries`` ``[B, T]`` booleans. Rows without queries give 0."""
    if not attentions:
        raise ValueError("modality_attention_share needs the attention maps of at least one layer")
    img = image_keys.to(attentions[0].dtype)
    q = queries.to(attentions[0].dtype)
    per_layer = []
    for a in attentions:
        share = (a * img[:, None, None, :]).sum(-1) / a.sum(-1).clamp_min(torch.finfo(a.dtype).tiny)  # [B, H, T]
        per_query = share.mean(1)  # heads
        per_layer.append((per_query * q).sum(-1) / q.sum(-1).clamp_min(1))  # queries
    return torch.stack(per_layer).mean(0)  # layers


def mas_hinge(mas: torch.Tensor, wrong: torch.Tensor, tau: float = 0.4, lam: float = 0.1) -> torch.Tensor:
    """``lam * mean_b(max(0, tau - MAS_b) * 1[wrong_b])``."""
    return lam * (torch.relu(tau - mas) * wrong.to(mas.dtype)).mean()


def answer_wrong(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``[B]``: any labelled token mispredicted (logits at p - 1 predict the label at p)."""
    pred = logits[:, :-1].argmax(-1)
    target = labels[:, 1:]
    mask = target != IGNORE
    return ((pred != target) & mask).any(-1)


@dataclass(frozen=True)
class MasLoss:
    """The extra loss term for :func:`lab.train.train` (image batches only)."""

    tau: float = 0.4
    lam: float = 0.1

    def __call__(self, out: ToyCounterOutput, batch: Batch) -> torch.Tensor:
        logits = out.logits
        if logits is None:
            raise ValueError("the MAS loss needs the model's logits")
        if batch.pixel_values is None or not out.attentions:
            return logits.new_zeros(())
        mas = modality_attention_share(out.attentions, batch.image_mask, batch.labels != IGNORE)
        return mas_hinge(mas, answer_wrong(logits.detach(), batch.labels), self.tau, self.lam)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m lab.mas", description=__doc__.split("\n\n")[0])
    ap.add_argument("--init", default=str(DEFAULT_CHECKPOINT), help="model folder to fine-tune")
    ap.add_argument("--out", required=True, help="model folder to write (e.g. models/toy-counter-mas)")
    ap.add_argument("--steps", type=int, default=300, help="(vision batch, text batch) pairs")
    ap.add_argument("--lr", type=float, default=1e-4, help="decoder + projector learning rate (vision frozen)")
    ap.add_argument("--tau", type=float, default=0.4)
    ap.add_argument("--lam", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    from .train import save, train

    cfg = TrainConfig.load(DEFAULT_TRAIN_YAML)
    cfg.stage2.steps, cfg.stage2.lr, cfg.stage2.vision_lr, cfg.stage2.warmup = args.steps, args.lr, 0.0, 10
    cfg.compile = False  # attention maps come from the eager path
    if args.threads is not None:
        cfg.threads = args.threads
    t0 = time.perf_counter()
    result = train(cfg, extra_loss=MasLoss(args.tau, args.lam), init=args.init, stages=(2,))
    out = Path(args.out)
    command = "python -m lab.mas " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
    save(result, out, cfg, command.strip())
    base = Path(args.init).resolve()
    base_name = str(base.relative_to(Path.cwd())) if base.is_relative_to(Path.cwd()) else str(base)
    record = {"kind": "mas_finetune", "base": base_name, "tau": args.tau, "lam": args.lam, "steps": args.steps,
              "lr": args.lr, "seconds": round(time.perf_counter() - t0, 1)}
    (out / INTERVENTION_FILE).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({"out": str(out), **record}))


if __name__ == "__main__":
    main()
