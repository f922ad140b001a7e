"""The toy counting VLM as a transformers model: its config, model, processor and tokenizer.

The model code alone, apart from the lab that trains it (lab/) and the stage that extracts from
it (extract/models/adapters/toy.py): both import this package, and it imports neither. Importing
``toyvlm`` registers the model with the transformers Auto classes, so a checkpoint folder loads
with ``AutoModelForImageTextToText`` / ``AutoModelForCausalLM`` / ``AutoProcessor``.
"""

from __future__ import annotations

from .config import MODEL_TYPE, ToyCounterConfig
from .model import ToyCounterForConditionalGeneration
from .processor import ToyCounterImageProcessor, ToyCounterProcessor


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

__all__ = ["MODEL_TYPE", "ToyCounterConfig", "ToyCounterForConditionalGeneration", "ToyCounterImageProcessor",
           "ToyCounterProcessor"]
