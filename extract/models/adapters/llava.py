"""LLaVA-1.5: CLIP tower at ``model.vision_tower.encoder.layers.N`` (a CLS token, then the patches),
``model.multi_modal_projector`` (2-layer MLP), Llama at ``model.language_model.layers.N``.

The LLM reads vision layer ``config.vision_feature_layer`` (-2 in the released models: the last
vision block never reaches the LLM) with the CLS token dropped (``vision_feature_select_strategy``
"default"; "full" keeps it as the first image token).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import layout
from ..layout import GridSegment, ImageGeometry
from ..tiny import TINY, byte_tokenizer, chat_template, init_model
from . import register
from .base import Adapter

LLAVA_TURNS = {"system": ("", " "), "user": ("USER: ", " "), "assistant": ("ASSISTANT: ", "</s>")}


def vision_prefix(vision_config: Any) -> int:
    """CLS-like tokens in front of the patches: CLIP has one, SigLIP none."""
    return 1 if vision_config.model_type in ("clip_vision_model", "clip") else 0


def llama_text_config(tok: Any, **extra: Any) -> dict[str, Any]:
    return dict(
        model_type="llama", vocab_size=len(tok), hidden_size=TINY.hidden, intermediate_size=TINY.ff,
        num_hidden_layers=TINY.layers, num_attention_heads=TINY.heads, num_key_value_heads=1,
        max_position_embeddings=4096, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, **extra,
    )


def tower_config(model_type: str, image_size: int, patch: int = 14) -> dict[str, Any]:
    return dict(
        model_type=model_type, hidden_size=TINY.hidden, intermediate_size=TINY.ff, num_hidden_layers=TINY.layers,
        num_attention_heads=TINY.heads, image_size=image_size, patch_size=patch,
    )


def llama_tokenizer() -> Any:
    return byte_tokenizer(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"},
        {"image_token": "<image>"},
    )


class ClipTowerAdapter(Adapter):
    """The LLaVA family's module paths: a CLIP/SigLIP tower and a multi-modal projector."""

    vision_layers = "model.vision_tower.encoder.layers"
    vision_attention = "self_attn"
    projector = "model.multi_modal_projector"

    @property
    def vision_prefix_tokens(self) -> int:  # type: ignore[override]
        return vision_prefix(self.config.vision_config)


@register
class LlavaAdapter(ClipTowerAdapter):
    family = "LLaVA"
    model_types = ("llava",)

    def geometry(self, inputs: Mapping[str, Any]) -> list[ImageGeometry]:
        patch = self.config.vision_config.patch_size
        n, _, height, width = inputs["pixel_values"].shape
        patches = layout.single(height // patch, width // patch)
        fed = patches
        if self.config.vision_feature_select_strategy == "full" and self.vision_prefix_tokens:
            # the CLS token goes to the LLM too, in front of the patch grid
            fed = (GridSegment(self.vision_prefix_tokens, height // patch, width // patch),)
        return [ImageGeometry(vision=patches, projector_in=fed, projector_out=fed, llm=fed) for _ in range(n)]

    def config_geometry(self, width: int, height: int, image_processor: Mapping[str, Any]) -> ImageGeometry:
        """CLIP's processor resizes and centre-crops every image to the tower's ``image_size``:
        (336/14)^2 = 576 image tokens for LLaVA-1.5, whatever the stimulus size."""
        import torch

        side = int(self.config.vision_config.image_size)
        return self.geometry({"pixel_values": torch.empty(1, 3, side, side, device="meta")})[0]

    @classmethod
    def build_tiny(cls, seed: int) -> tuple[Any, Any]:
        from transformers import CLIPImageProcessorPil, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

        tok = llama_tokenizer()
        size = TINY.image
        config = LlavaConfig(
            vision_config=tower_config("clip_vision_model", size),
            text_config=llama_text_config(tok),
            image_token_index=tok.image_token_id,
            vision_feature_layer=-2,
            vision_feature_select_strategy="default",
            image_seq_length=(size // 14) ** 2,
        )
        model = init_model(LlavaForConditionalGeneration, config, seed)
        images = CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
        processor = LlavaProcessor(
            image_processor=images, tokenizer=tok, patch_size=14, vision_feature_select_strategy="default",
            num_additional_image_tokens=1, chat_template=chat_template(LLAVA_TURNS, "<image>\n", "ASSISTANT:"),
        )
        return model, processor
