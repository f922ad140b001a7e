"""PaliGemma: SigLIP tower at ``model.vision_tower.encoder.layers.N`` (no CLS),
``model.multi_modal_projector`` (one linear map), Gemma LLM at ``model.language_model.layers.N``.

No chat template: the processor writes ``<image>``x N + ``<bos>`` + prompt + ``\\n``. The prompt
(prefix, ``token_type_ids`` 0) attends bidirectionally, the answer (suffix, 1) causally, so
appended answer tokens get type 1. The processor's ``labels`` are dropped (no loss is wanted).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import layout
from ..layout import ImageGeometry
from ..tiny import TINY, init_model
from . import register
from .base import Adapter
from .gemma3 import gemma_tokenizer
from .llava import tower_config


@register
class PaliGemmaAdapter(Adapter):
    family = "PaliGemma"
    model_types = ("paligemma",)
    vision_layers = "model.vision_tower.encoder.layers"
    vision_attention = "self_attn"
    projector = "model.multi_modal_projector"
    uses_chat_template = False

    def geometry(self, inputs: Mapping[str, Any]) -> list[ImageGeometry]:
        patch = self.config.vision_config.patch_size
        height, width = inputs["pixel_values"].shape[-2:]
        grid = layout.single(height // patch, width // patch)
        return [ImageGeometry(grid, grid, grid, grid) for _ in range(inputs["pixel_values"].shape[0])]

    def config_geometry(self, width: int, height: int, image_processor: Mapping[str, Any]) -> ImageGeometry:
        """SigLIP's processor resizes every image to the tower's ``image_size`` (no crop, no tiles)."""
        import torch

        side = int(self.config.vision_config.image_size)
        return self.geometry({"pixel_values": torch.empty(1, 3, side, side, device="meta")})[0]

    def plain_prompt(self, processor: Any, prompt: str, *, image: bool = True, strings: tuple[str, ...] = ()) -> str:
        # the processor adds <bos> after the image tokens, and "\n"
        return (processor.image_token if image else "") + self.user_text(prompt, strings)

    def answer_fill(self, key: str) -> int:
        return 1 if key in ("attention_mask", "token_type_ids") else 0

    def clean_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in inputs.items() if k != "labels"}

    @classmethod
    def build_tiny(cls, seed: int) -> tuple[Any, Any]:
        from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration, PaliGemmaProcessor, SiglipImageProcessorPil

        tok = gemma_tokenizer({"image_token": "<image>"})
        size = TINY.image
        images = SiglipImageProcessorPil(size={"height": size, "width": size})
        images.image_seq_length = (size // 14) ** 2  # type: ignore[attr-defined]  # read by PaliGemmaProcessor
        processor = PaliGemmaProcessor(image_processor=images, tokenizer=tok)  # adds the <loc>/<seg> tokens
        config = PaliGemmaConfig(
            vision_config=dict(tower_config("siglip_vision_model", size), projection_dim=TINY.hidden),
            text_config=dict(
                model_type="gemma", vocab_size=len(tok), hidden_size=TINY.hidden, intermediate_size=TINY.ff,
                num_hidden_layers=TINY.layers, num_attention_heads=TINY.heads, num_key_value_heads=1,
                head_dim=TINY.hidden // TINY.heads, max_position_embeddings=4096, pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
            ),
            image_token_index=tok.image_token_id,
            projection_dim=TINY.hidden,
            hidden_size=TINY.hidden,
            vocab_size=len(tok),
        )
        model = init_model(PaliGemmaForConditionalGeneration, config, seed)
        return model, processor
