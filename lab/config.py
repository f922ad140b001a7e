"""Configuration of the toy counting VLM's training (YAML); the model's own config is toyvlm/config.py."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

DEFAULT_TRAIN_YAML = Path(__file__).with_name("toy.yaml")


@dataclass
class StageConfig:
    steps: int  # stage 1: batches; stage 2: (vision batch, text batch) pairs
    lr: float  # stage 1: decoder; stage 2: decoder + projector
    vision_lr: float = 0.0  # stage 2 only
    warmup: int = 50
    weight_decay: float = 0.01


@dataclass
class TrainConfig:
    """Everything ``python -m lab.train`` needs; the defaults live in ``lab/toy.yaml``."""

    seed: int = 0
    curriculum: str = "counting"  # "counting" (this class, lab/toy.yaml) or "g2m" (G2MTrainConfig)
    threads: int = 2
    batch_size: int = 128
    compile: bool = False
    # Go-board geometry (goboard preset "small": 11x11 cells of 8 px, stones r=3).
    board_size: int = 11
    cell_px: int = 8
    radius: int = 3
    vision_max_count: int = 49  # the decoupled curriculum: vision sees n <= 49 only
    text_max_count: int = 120  # text counts 0..120, so FE labels exist on the text side
    variations: tuple[str, ...] = ("none", "mild", "strong")
    hard_negative_share: float = 0.5  # unequal TF partners within +-hard_negative_span
    hard_negative_span: int = 5
    # Stage 2 leans harder on near misses: a precise comparison (difference of two counts) is
    # the one that can carry over to counts vision never saw.
    hard_negative_share_stage2: float = 0.5
    tf_share_stage1: float = 0.4  # share of stage-1 batches that are text TF batches
    # Unequal partners of the board/string TF task come from the vision range (0..vision_max_count),
    # like the equal ones; otherwise "string count above 49 -> False" solves the training data.
    vision_tf_partners_in_range: bool = True
    tf_every_stage2: int = 3  # stage 2: every n-th step pair is contrastive (board/string TF)
    model: dict[str, Any] = field(default_factory=dict)
    stage1: StageConfig = field(default_factory=lambda: StageConfig(steps=5000, lr=3e-3))
    stage2: StageConfig = field(
        default_factory=lambda: StageConfig(steps=2000, lr=1e-4, vision_lr=2e-3))

    @classmethod
    def load(cls, path: str | Path = DEFAULT_TRAIN_YAML, **overrides: Any) -> TrainConfig:
        """The YAML's recipe; ``curriculum: g2m`` in it gives a :class:`G2MTrainConfig`."""
        raw = yaml.safe_load(Path(path).read_text()) or {}
        raw.update(overrides)
        if cls is TrainConfig and raw.get("curriculum", "counting") != "counting":
            if raw["curriculum"] != "g2m":
                raise ValueError(f"{path}: unknown curriculum {raw['curriculum']!r}; known: counting, g2m")
            return G2MTrainConfig.load(path, **overrides)
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"{path}: unknown training keys {sorted(unknown)}; known: {sorted(known)}")
        for stage in ("stage1", "stage2"):
            if isinstance(raw.get(stage), dict):
                raw[stage] = StageConfig(**raw[stage])
        for key in ("variations", "grid_sizes", "eval_grid_sizes"):
            if key in raw:
                raw[key] = tuple(raw[key])
        return cls(**raw)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key, value in out.items():
            if isinstance(value, tuple):
                out[key] = list(value)
        return out


DEFAULT_G2M_YAML = Path(__file__).with_name("toy-g2m.yaml")


@dataclass
class G2MTrainConfig(TrainConfig):
    """The G2M curriculum (study g2m, ``lab.g2m``): transcribe N x N colour grids, small N only.

    One stage, every parameter: each step is one batch of one grid size, the sizes in turn. An
    N x N grid is drawn at ``N * cell_px`` px, so the ViT gives one token per cell; ``board_size``
    is the largest trained N (the model config's nominal grid). Go-board keys are unused.
    """

    curriculum: str = "g2m"
    grid_sizes: tuple[int, ...] = (3, 4, 5, 6)  # trained N
    num_colors: int = 3
    strategy: str = "random"
    eval_grid_sizes: tuple[int, ...] = (3, 4, 5, 6, 7, 8, 9, 10, 12)
    board_size: int = 6
    stage1: StageConfig = field(default_factory=lambda: StageConfig(steps=3000, lr=3e-3, vision_lr=3e-3))
