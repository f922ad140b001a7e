"""Qwen2-VL: ViT blocks at ``model.visual.blocks.N`` (packed tokens), ``model.visual.merger``
(LayerNorm ``ln_q`` + MLP over 2x2 merge units), Qwen2 LLM at ``model.language_model.layers.N``."""

from __future__ import annotations

from typing import Any

from ..tiny import TINY, init_model
from . import register
from ._qwen import QwenAdapter


@register
class Qwen2VLAdapter(QwenAdapter):
    family = "Qwen2-VL"
    model_types = ("qwen2_vl",)

    @classmethod
    def build_tiny(cls, seed: int) -> tuple[Any, Any]:
        from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        tok = cls.tiny_tokenizer()
        config = Qwen2VLConfig(
            text_config=cls.tiny_text_config(tok),
            vision_config=dict(
                depth=TINY.layers, embed_dim=TINY.hidden, hidden_size=TINY.hidden, num_heads=TINY.heads,
                mlp_ratio=TINY.ff // TINY.hidden, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
            ),
            **cls.tiny_token_ids(tok),
        )
        model = init_model(Qwen2VLForConditionalGeneration, config, seed)
        images = Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2)
        processor = Qwen2VLProcessor(
            image_processor=images, tokenizer=tok, video_processor=None, chat_template=cls.tiny_chat_template()
        )
        return model, processor
