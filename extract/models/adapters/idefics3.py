"""Idefics3 and SmolVLM: SigLIP-like tower at ``model.vision_model.encoder.layers.N`` (no CLS),
``model.connector`` (pixel shuffle: each ``scale_factor`` x ``scale_factor`` block of patches
becomes one token, then a linear map), Llama LLM at ``model.text_model.layers.N``.

With image splitting an image becomes tiles plus a global view, each a vision batch row; the
adapter records views in order (``tile0..``, ``global``) but not the mosaic arrangement. All-zero
pixel views are dropped by the model as padding, so a uniform image whose normalised pixels are
all 0 (mid-grey with mean=std=0.5) vanishes: avoid such stimuli.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import layout
from ..layout import ImageGeometry
from ..tiny import TINY, byte_tokenizer, chat_template, init_model
from . import register
from .base import Adapter
from .llava import llama_text_config, tower_config

IDEFICS_TURNS = {
    "system": ("System:", "<end_of_utterance>\n"),
    "user": ("User:", "<end_of_utterance>\n"),
    "assistant": ("Assistant:", "<end_of_utterance>\n"),
}


@register
class Idefics3Adapter(Adapter):
    family = "Idefics3"
    model_types = ("idefics3",)
    vision_layers = "model.vision_model.encoder.layers"
    vision_attention = "self_attn"
    projector = "model.connector"
    llm_layers = "model.text_model.layers"
    final_norm = "model.text_model.norm"
    nested_images = True

    def geometry(self, inputs: Mapping[str, Any]) -> list[ImageGeometry]:
        patch = self.config.vision_config.patch_size
        s = self.config.scale_factor
        height, width = inputs["pixel_values"].shape[-2:]
        rows, cols = height // patch, width // patch
        per_view = (rows // s) * (cols // s)
        out = []
        for ids in inputs["input_ids"]:
            n = int((ids == self.image_token_id).sum()) // per_view
            names = [f"tile{i}" for i in range(n - 1)] + ["global"] if n > 1 else ["image"]
            patches = layout.views(n, rows, cols, names)
            shuffled = layout.views(n, rows // s, cols // s, names)
            out.append(ImageGeometry(patches, patches, shuffled, shuffled, n_views=n))
        return out

    @classmethod
    def _tiny(cls, seed: int, smol: bool) -> tuple[Any, Any]:
        import transformers as tf

        tok = byte_tokenizer(
            {"bos_token": "<|begin_of_text|>", "eos_token": "<end_of_utterance>", "pad_token": "<pad>",
             "unk_token": "<unk>"},
            {"image_token": "<image>", "fake_image_token": "<fake_token_around_image>",
             "global_image_token": "<global-img>"},
            ["<end_of_utterance>"] + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)],
        )
        size = TINY.image
        seq = (size // 14 // 2) ** 2
        name = "SmolVLM" if smol else "Idefics3"
        config = getattr(tf, f"{name}Config")(
            vision_config=tower_config(f"{name.lower()}_vision", size),
            text_config=llama_text_config(tok),
            image_token_id=tok.image_token_id,
            scale_factor=2,
        )
        model = init_model(getattr(tf, f"{name}ForConditionalGeneration"), config, seed)
        images = getattr(tf, f"{name}ImageProcessorPil")(
            size={"longest_edge": size}, max_image_size={"longest_edge": size}, do_image_splitting=False
        )
        template = chat_template(IDEFICS_TURNS, "<image>", prefix="<|begin_of_text|>")
        processor: Any
        if smol:
            processor = tf.SmolVLMProcessor(
                image_processor=images, tokenizer=tok, video_processor=None, image_seq_len=seq, chat_template=template
            )
        else:
            processor = tf.Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=seq, chat_template=template)
        return model, processor

    @classmethod
    def build_tiny(cls, seed: int) -> tuple[Any, Any]:
        return cls._tiny(seed, smol=False)


@register
class SmolVLMAdapter(Idefics3Adapter):
    family = "SmolVLM"
    model_types = ("smolvlm",)

    def render_chat(self, processor: Any, messages: list[dict[str, Any]]) -> str:
        # SmolVLMProcessor.apply_chat_template reads video-processor settings even for images
        return processor.tokenizer.apply_chat_template(
            messages, chat_template=processor.chat_template, add_generation_prompt=True, tokenize=False
        )

    @classmethod
    def load_processor(cls, source: str, **kwargs: Any) -> Any:
        import json
        from pathlib import Path

        from transformers import AutoImageProcessor, AutoTokenizer, SmolVLMProcessor
        from transformers.utils import cached_file

        def text(name: str) -> str | None:
            path = cached_file(source, name, _raise_exceptions_for_missing_entries=False,
                               revision=kwargs.get("revision"))
            return Path(path).read_text() if path else None

        # SmolVLMProcessor.__init__ insists on a video processor, which needs torchvision: build it by hand
        extra = json.loads(text("processor_config.json") or "{}")
        tok = AutoTokenizer.from_pretrained(source, **kwargs)
        return SmolVLMProcessor(
            image_processor=AutoImageProcessor.from_pretrained(source, **kwargs),
            tokenizer=tok,
            video_processor=None,
            image_seq_len=extra.get("image_seq_len", 169),
            chat_template=text("chat_template.jinja") or getattr(tok, "chat_template", None),
        )

    @classmethod
    def build_tiny(cls, seed: int) -> tuple[Any, Any]:
        return cls._tiny(seed, smol=True)
