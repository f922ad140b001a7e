"""Qwen2.5-VL: as Qwen2-VL, but most vision blocks attend within windows, and the tower permutes
merge units into window order before block 0 and back only after the merger. Block outputs and
the hooked merger output are therefore in window order; the adapter undoes it with
transformers' own ``get_vision_window_index``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..tiny import TINY, init_model
from . import register
from ._qwen import QwenAdapter


@register
class Qwen2_5_VLAdapter(QwenAdapter):
    family = "Qwen2.5-VL"
    model_types = ("qwen2_5_vl",)

    def _unit_order(self, inputs: Mapping[str, Any]) -> torch.Tensor:
        from transformers.vision_utils import get_vision_window_index

        vc = self.config.vision_config
        window_index, _ = get_vision_window_index(
            inputs["image_grid_thw"].cpu(),
            spatial_merge_size=vc.spatial_merge_size,
            window_size=vc.window_size,
            patch_size=vc.patch_size,
        )
        # packed slot p holds unit window_index[p]; so unit u sits at slot argsort(window_index)[u]
        return torch.argsort(window_index)

    @classmethod
    def build_tiny(cls, seed: int) -> tuple[Any, Any]:
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        tok = cls.tiny_tokenizer()
        config = Qwen2_5_VLConfig(
            text_config=cls.tiny_text_config(tok),
            vision_config=dict(
                depth=TINY.layers, hidden_size=TINY.hidden, out_hidden_size=TINY.hidden, intermediate_size=TINY.ff,
                num_heads=TINY.heads, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                # 56 px windows = 2x2 merge units, so a small image still spans several windows;
                # block 0 windowed, block 1 full, as in the real model's mix
                window_size=56, fullatt_block_indexes=[TINY.layers - 1],
            ),
            **cls.tiny_token_ids(tok),
        )
        model = init_model(Qwen2_5_VLForConditionalGeneration, config, seed)
        images = Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2)
        processor = Qwen2_5_VLProcessor(
            image_processor=images, tokenizer=tok, video_processor=None, chat_template=cls.tiny_chat_template()
        )
        return model, processor
