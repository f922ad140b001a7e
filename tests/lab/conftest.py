from __future__ import annotations

import pytest
import torch
from labtest_lib import tiny_config

from lab.trainer import build_model
from toyvlm.processor import build_processor


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


@pytest.fixture
def tiny():
    cfg = tiny_config()
    torch.manual_seed(0)
    processor = build_processor(cfg.board_size * cfg.cell_px, cfg.cell_px)
    model = build_model(cfg, processor)
    return cfg, model, processor
