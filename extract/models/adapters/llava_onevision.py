"""LLaVA-OneVision: SigLIP tower (no CLS) at ``model.vision_tower.encoder.layers.N``,
``model.multi_modal_projector``, Qwen2 LLM; anyres tiling (see ``_anyres``)."""

from __future__ import annotations

from typing import Any

from ..tiny import TINY, init_model
from . import register
from ._anyres import AnyresAdapter
from ._qwen import QWEN_TURNS, QwenAdapter
from .llava import tower_config


@register
class LlavaOnevisionAdapter(AnyresAdapter):
    family = "LLaVA-OneVision"
    model_types = ("llava_onevision",)

    @classmethod
    def build_tiny(cls, seed: int) -> tuple[Any, Any]:
        from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration, LlavaOnevisionProcessor
        from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
            LlavaOnevisionImageProcessorPil,
        )

        from ..tiny import byte_tokenizer, chat_template

        tok = byte_tokenizer(
            {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
            {"image_token": "<image>", "video_token": "<video>"},
            ["<|im_start|>"],
        )
        side = TINY.image // 2  # 56 px views of 4x4 patches: tiling stays cheap
        pinpoints = [[side, side], [side, 2 * side], [2 * side, side], [2 * side, 2 * side]]
        text = QwenAdapter.tiny_text_config(tok)
        text.pop("rope_parameters")
        config = LlavaOnevisionConfig(
            vision_config=tower_config("siglip_vision_model", side),
            text_config=dict(text, model_type="qwen2"),
            image_token_index=tok.image_token_id,
            video_token_index=tok.video_token_id,
            image_grid_pinpoints=pinpoints,
            vision_feature_layer=-1,
            vision_feature_select_strategy="full",
        )
        model = init_model(LlavaOnevisionForConditionalGeneration, config, seed)
        images = LlavaOnevisionImageProcessorPil(size={"height": side, "width": side}, image_grid_pinpoints=pinpoints)
        processor = LlavaOnevisionProcessor(
            image_processor=images, tokenizer=tok, video_processor=None, num_image_tokens=(side // 14) ** 2,
            vision_feature_select_strategy="full", chat_template=chat_template(QWEN_TURNS, "<image>\n"),
        )
        return model, processor
