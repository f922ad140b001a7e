"""Gemma3: SigLIP tower at ``model.vision_tower.encoder.layers.N`` (no CLS),
``model.multi_modal_projector`` (average-pools the patch grid to ``mm_tokens_per_image`` tokens,
RMS-norms and projects them), Gemma3 LLM at ``model.language_model.layers.N`` with bidirectional
attention among the image tokens. Pan-and-scan crops are extra views after the image."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .. import layout
from ..layout import ImageGeometry
from ..tiny import TINY, byte_tokenizer, chat_template, init_model
from . import register
from .base import Adapter
from .llava import tower_config

GEMMA_TURNS = {
    "system": ("<start_of_turn>user\n", "\n"),  # Gemma folds a system prompt into the first user turn
    "user": ("<start_of_turn>user\n", "<end_of_turn>\n"),
    "assistant": ("<start_of_turn>model\n", "<end_of_turn>\n"),
}


def gemma_tokenizer(named: dict[str, str]) -> Any:
    return byte_tokenizer(
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"},
        named,
        ["<start_of_turn>", "<end_of_turn>"],
    )


@register
class Gemma3Adapter(Adapter):
    family = "Gemma3"
    model_types = ("gemma3",)
    vision_layers = "model.vision_tower.encoder.layers"
    vision_attention = "self_attn"
    projector = "model.multi_modal_projector"
    nested_images = True

    def geometry(self, inputs: Mapping[str, Any]) -> list[ImageGeometry]:
        vc = self.config.vision_config
        side = vc.image_size // vc.patch_size
        pooled = math.isqrt(self.config.mm_tokens_per_image)
        out = []
        for ids in inputs["input_ids"]:
            n = int((ids == self.image_token_id).sum()) // (pooled * pooled)
            names = ["image"] + [f"crop{i}" for i in range(n - 1)]
            patches = layout.views(n, side, side, names)
            tokens = layout.views(n, pooled, pooled, names)
            out.append(ImageGeometry(patches, patches, tokens, tokens, n_views=n))
        return out

    def config_geometry(self, width: int, height: int, image_processor: Mapping[str, Any]) -> ImageGeometry:
        """One view at the tower's size pooled to ``mm_tokens_per_image`` tokens (256 in the released
        models). Pan-and-scan crops depend on the processor's crop rule and are not planned."""
        import torch

        if image_processor.get("do_pan_and_scan"):
            return super().config_geometry(width, height, image_processor)
        ids = torch.full((1, int(self.config.mm_tokens_per_image)), self.image_token_id)
        return self.geometry({"input_ids": ids})[0]

    @classmethod
    def build_tiny(cls, seed: int) -> tuple[Any, Any]:
        from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil, Gemma3Processor

        tok = gemma_tokenizer(
            {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"}
        )
        size = TINY.image
        tokens = 16  # 8x8 patches pooled 2x2 -> 4x4
        config = Gemma3Config(
            text_config=dict(
                vocab_size=len(tok), hidden_size=TINY.hidden, intermediate_size=TINY.ff,
                num_hidden_layers=TINY.layers, num_attention_heads=TINY.heads, num_key_value_heads=1,
                head_dim=TINY.hidden // TINY.heads, query_pre_attn_scalar=TINY.hidden // TINY.heads,
                # layer 0 slides, layer 1 is global (the real models: 5 of 6 slide, windows 512-1024); a
                # window shorter than any prompt makes every test of the tiny model cross it
                sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                max_position_embeddings=4096, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                bos_token_id=tok.bos_token_id,
            ),
            vision_config=tower_config("siglip_vision_model", size),
            mm_tokens_per_image=tokens,
            boi_token_index=tok.boi_token_id,
            eoi_token_index=tok.eoi_token_id,
            image_token_index=tok.image_token_id,
        )
        model = init_model(Gemma3ForConditionalGeneration, config, seed)
        images = Gemma3ImageProcessorPil(size={"height": size, "width": size})
        processor = Gemma3Processor(
            image_processor=images, tokenizer=tok, image_seq_length=tokens,
            chat_template=chat_template(GEMMA_TURNS, "<start_of_image>", prefix="<bos>"),
        )
        return model, processor
