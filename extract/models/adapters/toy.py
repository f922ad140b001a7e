"""The counting lab's toy VLM (``toyvlm/``, model_type ``toy_counter``).

``vision.blocks.N`` (pre-LN ViT, one token per board intersection, raster order), ``projector``
(its input is ``vision.norm``'s output: the "ViT output tokens" the study probes),
``decoder.layers.N``, ``decoder.norm``, ``lm_head``. Prompts use the study's own template
(``<|bos|> <|user_start|> <|image_start|> <|image|> <|image_end|> <|question_start|> Q ...``),
not a chat template.

``toyvlm`` is imported only inside methods: the toy's code lives outside extract, and extract reaches
it through this adapter alone (tests/test_import_graph.py), so importing extract never loads it.
Extract never imports ``lab`` (the toy's training tools).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import layout
from ..layout import ImageGeometry
from . import register
from .base import Adapter


@register
class ToyCounterAdapter(Adapter):
    family = "toy counter (agnosia lab)"
    model_types = ("toy_counter",)
    vision_layers = "vision.blocks"
    vision_attention = "attn"
    projector = "projector"
    llm_layers = "decoder.layers"
    llm_attention = "self_attn"
    final_norm = "decoder.norm"
    lm_head = "lm_head"
    uses_chat_template = False

    @classmethod
    def register_auto_classes(cls) -> None:
        import toyvlm  # noqa: F401  (importing toyvlm registers the toy model with the transformers Auto classes)

    def geometry(self, inputs: Mapping[str, Any]) -> list[ImageGeometry]:
        # One patch per board intersection (or grid cell): the counter's boards are always
        # board_size patches wide, the G2M toy's grids are drawn at N patches for any N.
        side = inputs["pixel_values"].shape[-1] // self.config.patch_size
        grid = layout.single(side, side)
        n = inputs["pixel_values"].shape[0]
        return [ImageGeometry(vision=grid, projector_in=grid, projector_out=grid, llm=grid) for _ in range(n)]

    def config_geometry(self, width: int, height: int, image_processor: Mapping[str, Any]) -> ImageGeometry:
        """One token per patch: board intersections for the counter, grid cells for the G2M toy."""
        import torch

        return self.geometry({"pixel_values": torch.empty(1, 3, height, width, device="meta")})[0]

    def plain_prompt(self, processor: Any, prompt: str, *, image: bool = True, strings: tuple[str, ...] = ()) -> str:
        from toyvlm.processor import prompt as study_prompt

        return study_prompt(prompt, strings, image=image)  # strings as the study wrote them, one letter per token

    @classmethod
    def build_tiny(cls, seed: int) -> tuple[Any, Any]:
        import torch

        from toyvlm.config import ToyCounterConfig
        from toyvlm.model import ToyCounterForConditionalGeneration
        from toyvlm.processor import build_processor

        torch.manual_seed(seed)
        return ToyCounterForConditionalGeneration(ToyCounterConfig()).eval(), build_processor()
