"""Train the toy counter from scratch with the decoupled curriculum: ``python -m lab.train``.

Stage 1 trains the decoder (embeddings, blocks, final norm, LM head) on text only: counting the
'c's of a 121-letter string (0..120) and judging whether two strings hold the same number.
Stage 2 trains vision on boards with at most ``vision_max_count`` black stones, one vision batch
(count or "string vs board: same number?") then one text rehearsal batch per step pair, with a
higher learning rate for the vision tower than for the projector and decoder.

``python -m lab.train --config lab/toy-g2m.yaml`` runs the G2M curriculum instead (``lab.g2m``:
one stage, every parameter, small colour grids); the YAML's ``curriculum`` key picks the recipe,
and the loop (``lab.trainer.Trainer``: ``step``/``run_stage``) is shared.

``extra_loss`` (Python API) adds a term to every step's loss: a callable
``(outputs, batch) -> scalar tensor`` that sees the model outputs including attentions, e.g. the
MAS hinge ``max(0, tau - MAS)`` of a later issue.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from toyvlm.model import ToyCounterForConditionalGeneration
from toyvlm.processor import ToyCounterProcessor, build_processor

from . import DEFAULT_CHECKPOINT
from .config import DEFAULT_TRAIN_YAML, TrainConfig
from .g2m import G2MTrainer, build_g2m_processor
from .trainer import ExtraLoss, StepLog, Trainer, build_model


@dataclass
class TrainResult:
    model: ToyCounterForConditionalGeneration
    processor: ToyCounterProcessor
    seconds: dict[str, float] = field(default_factory=dict)
    log: list[StepLog] = field(default_factory=list)


def curriculum(cfg: TrainConfig) -> tuple[type[Trainer], ToyCounterProcessor, tuple[int, ...]]:
    """(trainer class, fresh processor, default stages) of ``cfg.curriculum``."""
    if cfg.curriculum == "g2m":
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
