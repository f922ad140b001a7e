"""Shared test data: which families are tested and the stimulus size each keeps unresampled."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import pytest
from PIL import Image

# arch -> (width, height, patch px) of a stimulus the processor keeps at its size (no resampling),
# so that a pixel patch maps onto exactly one vision token. Non-square where the family allows it.
IMAGE = {
    "qwen2_vl": (112, 84, 14),
    "qwen2_5_vl": (112, 84, 14),
    "qwen3_vl": (128, 96, 16),
    "llava": (112, 112, 14),
    "llava_next": (56, 56, 14),
    "llava_onevision": (56, 56, 14),
    "internvl": (112, 112, 14),
    "idefics3": (112, 112, 14),
    "smolvlm": (112, 112, 14),
    "gemma3": (112, 112, 14),
    "paligemma": (112, 112, 14),
}
ARCHS = sorted(IMAGE)
# The project's own toy model (lab/): one 8-px patch per intersection of an 11x11 board.
TOY_IMAGE = (88, 88, 8)
IMAGE_ALL = {**IMAGE, "toy_counter": TOY_IMAGE}
# the spatial run (conftest.spatial_run): max_new_tokens (so at most 3 answer tokens are fed back), batch size
SPATIAL_STEPS = 4
SPATIAL_BATCH = 2


def noise_image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def quick(values: Iterable[Any], *fast: Any) -> list[Any]:
    """Parametrize cases with all but ``fast`` marked slow: `make test-fast` runs a representative few, each
    family's first use builds its tiny model (seconds); `make test` runs them all."""
    values = list(values)
    assert set(fast) <= set(values), f"quick(): {set(fast) - set(values)} not among the cases"
    return [v if v in fast else pytest.param(v, marks=pytest.mark.slow) for v in values]
