"""LLaVA-NeXT (1.6): CLIP tower (CLS dropped), ``model.multi_modal_projector``, Llama/Mistral LLM;
anyres tiling (see ``_anyres``)."""

from __future__ import annotations

from typing import Any

from ..tiny import TINY, chat_template, init_model
from . import register
from ._anyres import AnyresAdapter
from .llava import LLAVA_TURNS, llama_text_config, llama_tokenizer, tower_config


@register
class LlavaNextAdapter(AnyresAdapter):
    family = "LLaVA-NeXT"
    model_types = ("llava_next",)

    @classmethod
    def build_tiny(cls, seed: int) -> tuple[Any, Any]:
        from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextProcessor
        from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

        tok = llama_tokenizer()
        side = TINY.image // 2
        pinpoints = [[side, side], [side, 2 * side], [2 * side, side], [2 * side, 2 * side]]
        config = LlavaNextConfig(
            vision_config=tower_config("clip_vision_model", side),
            text_config=llama_text_config(tok),
            image_token_index=tok.image_token_id,
            image_grid_pinpoints=pinpoints,
            vision_feature_layer=-2,
            vision_feature_select_strategy="default",
            image_seq_length=(side // 14) ** 2,
        )
        model = init_model(LlavaNextForConditionalGeneration, config, seed)
        images = LlavaNextImageProcessorPil(
            size={"shortest_edge": side}, crop_size={"height": side, "width": side}, image_grid_pinpoints=pinpoints
        )
        processor = LlavaNextProcessor(
            image_processor=images, tokenizer=tok, patch_size=14, vision_feature_select_strategy="default",
            num_additional_image_tokens=1, chat_template=chat_template(LLAVA_TURNS, "<image>\n", "ASSISTANT:"),
        )
        return model, processor
