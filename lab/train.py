"""Train the toy counter from scratch with the decoupled curriculum: ``python -m lab.train``.

Stage 1 trains the decoder (embeddings, blocks, final norm, LM head) on text only: counting the
'c's of a 121-letter string (0..120) and judging whether two strings hold the same number.
Stage 2 trains vision on boards with at most ``vision_max_count`` black stones, one vision batch
(count or "string vs board: same number?") then one text rehearsal batch per step pair, with a
higher learning rate for the vision tower than for the projector and decoder.

``python -m lab.train --config lab/toy-g2m.yaml`` runs the G2M curriculum instead (``lab.g2m``:
one stage, every parameter, small colour grids); the YAML's ``curriculum`` key picks the recipe,
and the loop below (``Trainer.step``/``run_stage``) is shared.

``extra_loss`` (Python API) adds a term to every step's loss: a callable
``(outputs, batch) -> scalar tensor`` that sees the model outputs including attentions, e.g. the
MAS hinge ``max(0, tau - MAS)`` of a later issue.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from toyvlm.config import ToyCounterConfig
from toyvlm.model import ToyCounterForConditionalGeneration, ToyCounterOutput
from toyvlm.processor import ToyCounterProcessor, build_processor

from . import DEFAULT_CHECKPOINT
from .config import DEFAULT_TRAIN_YAML, TrainConfig
from .data import Batch, BatchMaker

ExtraLoss = Callable[[ToyCounterOutput, Batch], torch.Tensor]


@dataclass
class StepLog:
    stage: int
    step: int
    task: str
    loss: float
    exact: float  # teacher-forced answer exact match on the batch == greedy exact match


@dataclass
class TrainResult:
    model: ToyCounterForConditionalGeneration
    processor: ToyCounterProcessor
    seconds: dict[str, float] = field(default_factory=dict)
    log: list[StepLog] = field(default_factory=list)


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


def curriculum(cfg: TrainConfig) -> tuple[type[Trainer], ToyCounterProcessor, tuple[int, ...]]:
    """(trainer class, fresh processor, default stages) of ``cfg.curriculum``."""
    if cfg.curriculum == "g2m":
        from .g2m import G2MTrainer, build_g2m_processor

        return G2MTrainer, build_g2m_processor(cfg), (1,)
    if cfg.curriculum != "counting":
        raise ValueError(f"unknown curriculum {cfg.curriculum!r}; known: counting, g2m")
    return Trainer, build_processor(cfg.board_size * cfg.cell_px, cfg.cell_px), (1, 2)


def train(cfg: TrainConfig, extra_loss: ExtraLoss | None = None, init: str | Path | None = None,
          stages: tuple[int, ...] | None = None) -> TrainResult:
    """Train (every stage of the curriculum by default). ``init`` starts from a saved model folder, e.g. to rerun stage 2."""
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    trainer_cls, processor, default_stages = curriculum(cfg)
    stages = default_stages if stages is None else stages
    if init is not None:
        model = ToyCounterForConditionalGeneration.from_pretrained(init)
    else:
        model = build_model(cfg, processor)
    model.config._attn_implementation = "sdpa" if extra_loss is None else "eager"
    trainer = trainer_cls(cfg, model, processor, extra_loss)
    result = TrainResult(model, processor)
    for stage in stages:
        t0 = time.perf_counter()
        getattr(trainer, f"stage{stage}")()
        result.seconds[f"stage{stage}"] = round(time.perf_counter() - t0, 1)
    model.eval()
    result.log = trainer.log
    return result


def save(result: TrainResult, out: Path, cfg: TrainConfig, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    result.model.config._attn_implementation = "sdpa"
    result.model.save_pretrained(out)
    result.processor.save_pretrained(out)
    summary: dict[str, Any] = {
        "command": command,
        "seconds": result.seconds,
        "threads": cfg.threads,
        "parameters": sum(p.numel() for p in result.model.parameters()),
        "train_config": cfg.to_dict(),
        "torch": torch.__version__,
    }
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    # The loss curve is small enough to keep as plain JSON (every 25th step).
    curve = [vars(s) for s in result.log if s.step % 25 == 0]
    (out / "training_curve.json").write_text(json.dumps(curve) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m lab.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(DEFAULT_TRAIN_YAML), help="training YAML")
    ap.add_argument("--out", default=None,
                    help="model folder to write (default lab/checkpoints/toy-counter, or toy-g2m for a G2M config)")
    ap.add_argument("--init", default=None, help="start from this model folder instead of scratch")
    ap.add_argument("--stages", default=None,
                    help="stages to run, e.g. 1,2 or 2 (with --init); default: all of the curriculum's")
    ap.add_argument("--stage1-steps", type=int, default=None)
    ap.add_argument("--stage2-steps", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (the YAML says 2; on a machine shared with other jobs 1 can be faster)")
    args = ap.parse_args(argv)
    cfg = TrainConfig.load(args.config)
    if args.stage1_steps is not None:
        cfg.stage1.steps = args.stage1_steps
    if args.stage2_steps is not None:
        cfg.stage2.steps = args.stage2_steps
    if args.threads is not None:
        cfg.threads = args.threads
    stages = tuple(int(s) for s in args.stages.split(",")) if args.stages else None
    if args.out is None:
        args.out = str(DEFAULT_CHECKPOINT if cfg.curriculum == "counting"
                       else DEFAULT_CHECKPOINT.with_name(f"toy-{cfg.curriculum}"))
    command = "python -m lab.train " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
    result = train(cfg, init=args.init, stages=stages)
    save(result, Path(args.out), cfg, command.strip())
    print(json.dumps({"out": args.out, "seconds": result.seconds}))


if __name__ == "__main__":
    main()
