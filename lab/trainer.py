"""The training loop of the toy VLM: one optimiser step, the learning-rate schedule, the progress bar
and the ``extra_loss`` hook (:class:`Trainer`), with the counting curriculum's two stages.

Other curricula subclass :class:`Trainer` and swap its batches and stages (``lab.g2m.G2MTrainer``);
``lab.train`` picks the trainer of a YAML's curriculum and runs it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from toyvlm.config import ToyCounterConfig
from toyvlm.model import ToyCounterForConditionalGeneration, ToyCounterOutput
from toyvlm.processor import ToyCounterProcessor

from .config import TrainConfig
from .data import Batch, BatchMaker

ExtraLoss = Callable[[ToyCounterOutput, Batch], torch.Tensor]


@dataclass
class StepLog:
    stage: int
    step: int
    task: str
    loss: float
    exact: float  # teacher-forced answer exact match on the batch == greedy exact match


def build_model(cfg: TrainConfig, processor: ToyCounterProcessor) -> ToyCounterForConditionalGeneration:
    model_cfg = ToyCounterConfig(
        vocab_size=len(processor.tokenizer),
        image_token_id=processor.image_token_id,
        board_size=cfg.board_size,
        patch_size=cfg.cell_px,
        **cfg.model,
    )
    return ToyCounterForConditionalGeneration(model_cfg)


def schedule(step: int, total: int, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10% (multiplier of the base lr)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def answer_exact(logits: torch.Tensor, labels: torch.Tensor) -> float:
    pred = logits[:, :-1].argmax(-1)
    target = labels[:, 1:]
    mask = target != -100
    ok = ((pred == target) | ~mask).all(1)
    return float(ok.float().mean())


class Trainer:
    def __init__(self, cfg: TrainConfig, model: ToyCounterForConditionalGeneration,
                 processor: ToyCounterProcessor, extra_loss: ExtraLoss | None = None) -> None:
        self.cfg = cfg
        self.model = model
        self.extra_loss = extra_loss
        self.data = self.make_data(processor)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.forward = torch.compile(model) if cfg.compile else model
        self.log: list[StepLog] = []

    def make_data(self, processor: ToyCounterProcessor) -> Any:
        """The batch source of this curriculum (a subclass, e.g. ``lab.g2m.G2MTrainer``, swaps it)."""
        cfg = self.cfg
        return BatchMaker(processor, cfg.board_size, cfg.cell_px, cfg.radius, cfg.variations,
                          cfg.hard_negative_share, cfg.hard_negative_span)

    def batch(self, task: str) -> Batch:
        cfg, b = self.cfg, self.cfg.batch_size
        top = cfg.vision_max_count if task.startswith("multimodal") else cfg.text_max_count
        counts = torch.randint(0, top + 1, (b,), generator=self.gen)
        partner_top = cfg.text_max_count
        if task == "multimodal_tf" and cfg.vision_tf_partners_in_range:
            partner_top = cfg.vision_max_count
        return self.data.make(task, counts, self.gen, max_partner=partner_top)

    def step(self, opt: torch.optim.Optimizer, batch: Batch) -> tuple[float, float]:
        want_attn = self.extra_loss is not None
        out = self.forward(input_ids=batch.input_ids, pixel_values=batch.pixel_values,
                           labels=batch.labels, output_attentions=want_attn)
        loss = out.loss
        if self.extra_loss is not None:
            loss = loss + self.extra_loss(out, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        opt.step()
        return float(loss.detach()), answer_exact(out.logits.detach(), batch.labels)

    def run_stage(self, stage: int, opt: torch.optim.Optimizer, tasks: Iterator[list[str]],
                  steps: int, warmup: int) -> None:
        bases = [g["lr"] for g in opt.param_groups]
        bar = tqdm(range(steps), desc=f"stage {stage}", mininterval=5.0, dynamic_ncols=True)
        recent: dict[str, float] = {}
        for i in bar:
            scale = schedule(i, steps, warmup)
            for g, base in zip(opt.param_groups, bases, strict=False):
                g["lr"] = base * scale
            for task in next(tasks):
                loss, exact = self.step(opt, self.batch(task))
                self.log.append(StepLog(stage, i, task, loss, exact))
                recent[task] = 0.9 * recent.get(task, exact) + 0.1 * exact
            if i % 25 == 0:
                bar.set_postfix({k.replace("_only", "").replace("multimodal", "mm"): f"{v:.2f}"
                                 for k, v in recent.items()}, refresh=False)

    def stage1(self) -> None:
        s = self.cfg.stage1
        params = [p for n, p in self.model.named_parameters() if n.startswith(("decoder.", "lm_head."))]
        opt = torch.optim.AdamW(params, lr=s.lr, weight_decay=s.weight_decay)
        # A fixed 5-step pattern keeps the task mix exact at any step count (0.2 -> step 1 of 5).
        n_tf = round(5 * self.cfg.tf_share_stage1)
        slots = (1, 3, 0, 2, 4)[:n_tf]
        pattern = ["text_only_tf" if k in slots else "text_only_num" for k in range(5)]

        def tasks() -> Iterator[list[str]]:
            i = 0
            while True:
                yield [pattern[i % 5]]
                i += 1

        self.model.train()
        self.run_stage(1, opt, tasks(), s.steps, s.warmup)

    def stage2(self) -> None:
        s = self.cfg.stage2
        self.data.hard_share = self.cfg.hard_negative_share_stage2
        vision = [p for n, p in self.model.named_parameters() if n.startswith("vision.")]
        rest = [p for n, p in self.model.named_parameters() if not n.startswith("vision.")]
        opt = torch.optim.AdamW([{"params": vision, "lr": s.vision_lr}, {"params": rest, "lr": s.lr}],
                                weight_decay=s.weight_decay)

        # 1:1 vision and text batches; within each modality the contrastive task takes every
        # ``tf_every``-th pair (3: counting gets two thirds of the vision steps).
        tf_every = self.cfg.tf_every_stage2

        def tasks() -> Iterator[list[str]]:
            i = 0
            while True:
                if i % tf_every == tf_every - 1:
                    yield ["multimodal_tf", "text_only_tf"]
                else:
                    yield ["multimodal_num", "text_only_num"]
                i += 1

        self.model.train()
        self.run_stage(2, opt, tasks(), s.steps, s.warmup)
