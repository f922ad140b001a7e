from __future__ import annotations

import pytest
import torch

from lab.config import TrainConfig
from lab.processor import build_processor
from lab.train import build_model


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def tiny_config(**overrides) -> TrainConfig:
    """A 4x4 board, 16-d model, 1+1 blocks: a training step takes milliseconds."""
    base = dict(board_size=4, cell_px=8, radius=3, vision_max_count=5, text_max_count=15,
                batch_size=16, variations=("none", "mild", "strong"), threads=1,
                model={"hidden_size": 16, "num_attention_heads": 2, "intermediate_size": 32,
                       "vision_layers": 1, "decoder_layers": 1})
    base.update(overrides)
    return TrainConfig(**base)


@pytest.fixture
def tiny():
    cfg = tiny_config()
    torch.manual_seed(0)
    processor = build_processor(cfg.board_size * cfg.cell_px, cfg.cell_px)
    model = build_model(cfg, processor)
    return cfg, model, processor
