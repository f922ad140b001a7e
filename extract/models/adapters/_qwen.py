"""What Qwen2-VL, Qwen2.5-VL and Qwen3-VL share.

The vision tower packs all images of a batch into one ``[n_patches, C]`` sequence with no batch
dimension. The processor orders each image's patches 2x2-block-major (the four patches of one
merge unit are adjacent), so the vision tokens are reordered to raster with ``image_grid_thw``.
The merger's output has one token per merge unit, raster over the ``(h/2, w/2)`` grid; that is
also the order of the ``<|image_pad|>`` tokens in the LLM sequence.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from .. import layout
from ..layout import ImageGeometry
from ..tiny import TINY, byte_tokenizer, chat_template
from .base import Adapter

QWEN_TURNS = {
    "system": ("<|im_start|>system\n", "<|im_end|>\n"),
    "user": ("<|im_start|>user\n", "<|im_end|>\n"),
    "assistant": ("<|im_start|>assistant\n", "<|im_end|>\n"),
}
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


class QwenAdapter(Adapter):
    vision_layers = "model.visual.blocks"
    vision_attention = "attn"
    projector = "model.visual.merger"
    extra_sites: ClassVar[Mapping[str, tuple[str, ...]]] = {"vision": ("pre_merger",)}
    merger_norm: ClassVar[str] = "model.visual.merger.ln_q"  # the merger's pre-norm

    @property
    def merge(self) -> int:
        return int(self.config.vision_config.spatial_merge_size)

    def _grids(self, inputs: Mapping[str, Any]) -> list[tuple[int, int, int]]:
        thw = inputs["image_grid_thw"]
        return [(int(t), int(h), int(w)) for t, h, w in thw.tolist()]

    def geometry(self, inputs: Mapping[str, Any]) -> list[ImageGeometry]:
        out = []
        for t, h, w in self._grids(inputs):
            m = self.merge
            # a still image is one temporal patch; frames would be further views
            patch = layout.views(t, h, w)
            merged = layout.views(t, h // m, w // m)
            out.append(ImageGeometry(vision=patch, projector_in=patch, projector_out=merged, llm=merged, n_views=t))
        return out

    def config_geometry(self, width: int, height: int, image_processor: Mapping[str, Any]) -> ImageGeometry:
        """Qwen's processor resizes to multiples of ``patch * merge`` within [min_pixels, max_pixels]
        (transformers' own ``smart_resize``), then cuts ``patch`` px patches: (H/14)*(W/14)/4 LLM
        tokens for the released 14 px models."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        vc = self.config.vision_config
        patch = int(image_processor.get("patch_size") or vc.patch_size)
        merge = int(image_processor.get("merge_size") or vc.spatial_merge_size)
        size = image_processor.get("size") or {}
        # min_pixels / max_pixels override size, as in the processor; else transformers' defaults
        lo = image_processor.get("min_pixels") or size.get("shortest_edge") or 56 * 56
        hi = image_processor.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280
        h, w = smart_resize(height, width, factor=patch * merge, min_pixels=lo, max_pixels=hi)
        return self.geometry({"image_grid_thw": torch.tensor([[1, h // patch, w // patch]])})[0]

    # --- reorder indices ---------------------------------------------------------------------
    def _unit_order(self, inputs: Mapping[str, Any]) -> torch.Tensor | None:
        """Packed position of each merge unit (raster over the batch), or None if already raster."""
        return None

    def aux(self, inputs: Mapping[str, Any], geometry: list[ImageGeometry]) -> dict[str, Any]:
        m = self.merge
        unit_pos = self._unit_order(inputs)
        patch_idx, unit_idx, patch_counts, unit_counts = [], [], [], []
        patch_off = unit_off = 0
        for t, h, w in self._grids(inputs):
            # raster (f, r, c) -> merge unit (f, r//m, c//m) and slot (r%m, c%m) inside it
            f, r, c = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
            unit = unit_off + (f * (h // m) + r // m) * (w // m) + c // m
            slot = (r % m) * m + c % m
            upos = unit if unit_pos is None else unit_pos[unit]
            patch_idx.append((upos * m * m + slot).flatten())
            n_units = t * (h // m) * (w // m)
            units = torch.arange(unit_off, unit_off + n_units)
            unit_idx.append(units if unit_pos is None else unit_pos[units])
            patch_counts.append(t * h * w)
            unit_counts.append(n_units)
            patch_off += t * h * w
            unit_off += n_units
        return {
            "patch_index": torch.cat(patch_idx),  # packed row of each raster patch
            "unit_index": torch.cat(unit_idx),  # merger-output row of each raster merge unit
            "patch_counts": patch_counts,
            "unit_counts": unit_counts,
        }

    def _unpack(self, x: torch.Tensor, index: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
        if x.dim() != 2 or x.shape[0] != index.numel():
            raise RuntimeError(
                f"{self.family}: expected packed [{index.numel()}, C] vision tokens, got {tuple(x.shape)};"
                " the batch's image_grid_thw does not match the model's inputs"
            )
        return list(x.index_select(0, index.to(x.device)).split(counts))

    def vision_tokens(self, x: torch.Tensor, views: list[int], aux: dict) -> list[torch.Tensor]:
        return self._unpack(x, aux["patch_index"], aux["patch_counts"])

    def projector_in_tokens(self, x: torch.Tensor, views: list[int], aux: dict) -> list[torch.Tensor]:
        return self._unpack(x, aux["patch_index"], aux["patch_counts"])

    def pre_merger_tokens(self, x: torch.Tensor, views: list[int], aux: dict) -> list[torch.Tensor]:
        # G2M's vision tap: merger input after the merger's own pre-norm, raster-ordered
        return self._unpack(self.module(self.merger_norm)(x), aux["patch_index"], aux["patch_counts"])

    def projector_out_tokens(self, x: torch.Tensor, views: list[int], aux: dict) -> list[torch.Tensor]:
        return self._unpack(x, aux["unit_index"], aux["unit_counts"])

    # --- tiny model -------------------------------------------------------------------------
    @staticmethod
    def tiny_tokenizer() -> Any:
        return byte_tokenizer(
            {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
            {
                "image_token": "<|image_pad|>",
                "video_token": "<|video_pad|>",
                "vision_start_token": "<|vision_start|>",
                "vision_end_token": "<|vision_end|>",
            },
            ["<|im_start|>"],
        )

    @staticmethod
    def tiny_text_config(tok: Any) -> dict[str, Any]:
        head_dim = TINY.hidden // TINY.heads
        # M-RoPE sections (t, h, w) must sum to head_dim / 2
        sec = [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16]
        return dict(
            vocab_size=len(tok),
            hidden_size=TINY.hidden,
            intermediate_size=TINY.ff,
            num_hidden_layers=TINY.layers,
            num_attention_heads=TINY.heads,
            num_key_value_heads=1,  # grouped-query attention, as in the real models
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": sec},
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            bos_token_id=None,
        )

    @staticmethod
    def tiny_token_ids(tok: Any) -> dict[str, Any]:
        return dict(
            image_token_id=tok.image_token_id,
            video_token_id=tok.video_token_id,
            vision_start_token_id=tok.vision_start_token_id,
            vision_end_token_id=tok.vision_end_token_id,
        )

    @staticmethod
    def tiny_chat_template() -> str:
        return chat_template(QWEN_TURNS, QWEN_IMAGE)
