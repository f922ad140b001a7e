"""The counting lab (study counting-bottleneck): a toy VLM trained on Go boards with the decoupled curriculum.

Importing ``lab`` registers the model with the transformers Auto classes, so a checkpoint folder
loads with ``AutoModelForImageTextToText`` / ``AutoModelForCausalLM`` / ``AutoProcessor``.
"""

from __future__ import annotations

from pathlib import Path

from .config import MODEL_TYPE, ToyCounterConfig
from .model import ToyCounterForConditionalGeneration
from .processor import ToyCounterImageProcessor, ToyCounterProcessor

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent / "checkpoints" / "toy-counter"


def _register() -> None:
    from transformers import (
        AutoConfig,
        AutoImageProcessor,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoProcessor,
    )

    AutoConfig.register(MODEL_TYPE, ToyCounterConfig, exist_ok=True)
    AutoModelForImageTextToText.register(ToyCounterConfig, ToyCounterForConditionalGeneration, exist_ok=True)
    AutoModelForCausalLM.register(ToyCounterConfig, ToyCounterForConditionalGeneration, exist_ok=True)
    AutoImageProcessor.register(ToyCounterConfig, slow_image_processor_class=ToyCounterImageProcessor,
                                exist_ok=True)
    AutoProcessor.register(ToyCounterConfig, ToyCounterProcessor, exist_ok=True)


_register()

__all__ = ["DEFAULT_CHECKPOINT", "ToyCounterConfig", "ToyCounterForConditionalGeneration",
           "ToyCounterImageProcessor", "ToyCounterProcessor"]
