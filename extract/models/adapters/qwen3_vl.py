"""Qwen3-VL: 16 px patches with an interpolated learned position embedding, ``model.visual.merger``
with a LayerNorm ``norm`` before the 2x2 shuffle, and DeepStack: ``model.visual.deepstack_merger_list.K``
turn the outputs of a few early vision blocks into extra features added to the image positions of
the first LLM layers (after those layers' outputs, so ``llm`` taps still equal ``output_hidden_states``)."""

from __future__ import annotations

from typing import Any

from ..tiny import TINY, init_model
from . import register
from ._qwen import QwenAdapter


@register
class Qwen3VLAdapter(QwenAdapter):
    family = "Qwen3-VL"
    model_types = ("qwen3_vl",)
    merger_norm = "model.visual.merger.norm"

    @classmethod
    def build_tiny(cls, seed: int) -> tuple[Any, Any]:
        from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        tok = cls.tiny_tokenizer()
        text = cls.tiny_text_config(tok)
        text.update(head_dim=TINY.hidden // TINY.heads)
        text["rope_parameters"]["mrope_interleaved"] = True
        config = Qwen3VLConfig(
            text_config=text,
            vision_config=dict(
                depth=TINY.layers, hidden_size=TINY.hidden, out_hidden_size=TINY.hidden, intermediate_size=TINY.ff,
                num_heads=TINY.heads, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                num_position_embeddings=64, deepstack_visual_indexes=[0],
            ),
            **cls.tiny_token_ids(tok),
        )
        model = init_model(Qwen3VLForConditionalGeneration, config, seed)
        images = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2)
        processor = Qwen3VLProcessor(
            image_processor=images, tokenizer=tok, video_processor=None, chat_template=cls.tiny_chat_template()
        )
        return model, processor
