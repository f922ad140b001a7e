"""Shared helpers of the lab tests (not a conftest: `from conftest import` would find another
folder's conftest when the suite runs in one process)."""

from __future__ import annotations

from lab.config import TrainConfig


def tiny_config(**overrides) -> TrainConfig:
    """A 4x4 board, 16-d model, 1+1 blocks: a training step takes milliseconds."""
    base = dict(board_size=4, cell_px=8, radius=3, vision_max_count=5, text_max_count=15,
                batch_size=16, variations=("none", "mild", "strong"), threads=1,
                model={"hidden_size": 16, "num_attention_heads": 2, "intermediate_size": 32,
                       "vision_layers": 1, "decoder_layers": 1})
    base.update(overrides)
    return TrainConfig(**base)
