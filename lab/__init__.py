"""The counting lab (study counting-bottleneck): trains the toy VLM (toyvlm/) on Go boards with the
decoupled curriculum, evaluates it and writes its model cards.

Importing ``lab`` imports ``toyvlm``, which registers the model with the transformers Auto classes,
so a checkpoint folder loads with ``AutoModelForImageTextToText`` / ``AutoModelForCausalLM`` /
``AutoProcessor`` after either import.
"""

from __future__ import annotations

from pathlib import Path

from toyvlm import ToyCounterConfig, ToyCounterForConditionalGeneration, ToyCounterImageProcessor, ToyCounterProcessor

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent / "checkpoints" / "toy-counter"

__all__ = ["DEFAULT_CHECKPOINT", "ToyCounterConfig", "ToyCounterForConditionalGeneration",
           "ToyCounterImageProcessor", "ToyCounterProcessor"]
