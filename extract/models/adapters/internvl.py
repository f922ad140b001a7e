"""InternVL (transformers-native, e.g. OpenGVLab/InternVL3-*-hf): InternViT at
``model.vision_tower.encoder.layer.N`` (singular ``layer``; a CLS token, then the patches),
pixel shuffle (2x2 patches -> one token of 4x channels) *before* ``model.multi_modal_projector``,
Qwen2 LLM. An image may be cut into tiles plus a thumbnail; each is a vision batch row. The
processor does not return the tile arrangement, so tiles are recorded as views in order
(``tile0..``, then ``thumbnail``) without their position in the mosaic.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import layout
from ..layout import ImageGeometry
from ..tiny import TINY, byte_tokenizer, chat_template, init_model
from . import register
from ._qwen import QWEN_TURNS, QwenAdapter
from .base import Adapter


def _pair(v: Any) -> tuple[int, int]:
    return (int(v[0]), int(v[1])) if isinstance(v, (list, tuple)) else (int(v), int(v))


@register
class InternVLAdapter(Adapter):
    family = "InternVL"
    model_types = ("internvl",)
    vision_layers = "model.vision_tower.encoder.layer"
    vision_attention = "attention"
    projector = "model.multi_modal_projector"
    vision_prefix_tokens = 1  # CLS

    def geometry(self, inputs: Mapping[str, Any]) -> list[ImageGeometry]:
        vc = self.config.vision_config
        (ih, iw), (ph, pw) = _pair(vc.image_size), _pair(vc.patch_size)
        rows, cols = ih // ph, iw // pw
        shuffle = round(1 / self.config.downsample_ratio)
        per_view = (rows // shuffle) * (cols // shuffle)
        out = []
        for ids in inputs["input_ids"]:
            n = int((ids == self.image_token_id).sum()) // per_view
            names = [f"tile{i}" for i in range(n - 1)] + ["thumbnail"] if n > 1 else ["image"]
            patches = layout.views(n, rows, cols, names)
            shuffled = layout.views(n, rows // shuffle, cols // shuffle, names)
            out.append(ImageGeometry(patches, shuffled, shuffled, shuffled, n_views=n))
        return out

    def config_geometry(self, width: int, height: int, image_processor: Mapping[str, Any]) -> ImageGeometry:
        """The processor's best tiling of ``image_size`` tiles (transformers' ``get_optimal_tiled_canvas``)
        plus a thumbnail when it cuts more than one tile; 256 tokens per tile for 448 px, 14 px patches
        and pixel shuffle 0.5. InternVLProcessor crops to patches by default whatever the saved image
        processor says, and the extraction runs it with its defaults, so the plan tiles too."""
        import torch

        vc = self.config.vision_config
        (ih, iw), (ph, pw) = _pair(vc.image_size), _pair(vc.patch_size)
        shuffle = round(1 / self.config.downsample_ratio)
        per_view = (ih // ph // shuffle) * (iw // pw // shuffle)
        views = 1
        max_patches = int(image_processor.get("max_patches", 12))
        if max_patches > 1:
            from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas

            size = image_processor.get("size") or {"height": ih, "width": iw}
            cols, rows = get_optimal_tiled_canvas(
                (height, width), (size["height"], size["width"]), int(image_processor.get("min_patches", 1)), max_patches
            )
            views += cols * rows if cols * rows > 1 else 0
        ids = torch.full((1, views * per_view), self.image_token_id)
        return self.geometry({"input_ids": ids})[0]

    @classmethod
    def build_tiny(cls, seed: int) -> tuple[Any, Any]:
        from transformers import GotOcr2ImageProcessorPil, InternVLConfig, InternVLForConditionalGeneration, InternVLProcessor

        tok = byte_tokenizer(
            {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
            {
                "start_image_token": "<img>",
                "end_image_token": "</img>",
                "context_image_token": "<IMG_CONTEXT>",
                "video_token": "<video>",
            },
            ["<|im_start|>"],
        )
        size = TINY.image
        text = QwenAdapter.tiny_text_config(tok)
        text.pop("rope_parameters")
        config = InternVLConfig(
            vision_config=dict(
                hidden_size=TINY.hidden, intermediate_size=TINY.ff, num_hidden_layers=TINY.layers,
                num_attention_heads=TINY.heads, image_size=[size, size], patch_size=[14, 14],
            ),
            text_config=dict(text, model_type="qwen2"),
            image_token_id=tok.context_image_token_id,
            image_seq_length=(size // 28) ** 2,
        )
        model = init_model(InternVLForConditionalGeneration, config, seed)
        images = GotOcr2ImageProcessorPil(size={"height": size, "width": size}, crop_to_patches=False)
        processor = InternVLProcessor(
            image_processor=images, tokenizer=tok, video_processor=None, image_seq_length=(size // 28) ** 2,
            chat_template=chat_template(QWEN_TURNS, "<IMG_CONTEXT>\n"),
        )
        return model, processor
