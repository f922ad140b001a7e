"""What the extraction bench's workers share: the bare forward every comparison is against, and
steps timed back to back in alternating order (a pair's difference cancels the drift that makes
whole runs here differ by 5-10 % between rounds)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch


def bare_forward(lm: Any, inputs: Mapping[str, Any]) -> None:
    """A forward with no hooks and no store, whose one new token is the argmax of the last logits,
    as ``generate`` with one new token picks it."""
    with torch.inference_mode():
        out = lm.model(**inputs, use_cache=False, logits_to_keep=1)
        out.logits[:, -1].float().argmax(-1).tolist()


def in_turn(steps: Mapping[str, Callable[[], object]], flip: bool) -> dict[str, float]:
    """Seconds of each step, run one after another in the mapping's order, or reversed if ``flip``."""
    took = {}
    for name in reversed(list(steps)) if flip else steps:
        started = time.perf_counter()
        steps[name]()
        took[name] = time.perf_counter() - started
    return took
