"""What LLaVA-NeXT and LLaVA-OneVision share: "anyres" tiling.

An image becomes a base view (the whole image at the tower's size) plus tiles of a best-fit
resolution; the tower sees every view as a batch row. The LLM then gets the base grid followed by
the tile mosaic, unpadded to the image's aspect ratio, with an ``image_newline`` token closing each
mosaic row (OneVision may also shrink a large mosaic bilinearly). Rather than re-deriving that,
the adapter runs the model's own ``pack_image_features`` on a tensor of vision-token indices: the
result says, for each LLM image token, which vision token it came from (-1: newline).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .. import layout
from ..layout import GridSegment, ImageGeometry
from .llava import ClipTowerAdapter


class AnyresAdapter(ClipTowerAdapter):
    """The anyres geometry over the LLaVA family's tower and projector (see the module docstring)."""

    def _n_views(self, size: Any) -> int:
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        vc = self.config.vision_config
        return int(image_size_to_num_patches(size, self.config.image_grid_pinpoints, vc.image_size))

    def _trace(self, n_views: int, side: int, size: torch.Tensor) -> np.ndarray:
        """The model's packing applied to token indices -> LLM token -> vision token (or -1)."""
        inner: Any = self.model.model  # the family's inner model; pack_image_features is its method
        feats = torch.arange(n_views * side * side, dtype=torch.float32).view(n_views, side * side, 1)
        newline = torch.tensor([-1.0])
        pack = inner.pack_image_features
        kwargs: dict[str, Any] = {"image_newline": newline}
        if "vision_feature_select_strategy" in inspect.signature(pack).parameters:
            kwargs["vision_feature_select_strategy"] = self.config.vision_feature_select_strategy
        if "vision_aspect_ratio" in inspect.signature(pack).parameters:
            kwargs["vision_aspect_ratio"] = self.config.vision_aspect_ratio
        packed, _ = pack([feats], size.view(1, 2), **kwargs)
        values = (torch.cat(packed) if isinstance(packed, (list, tuple)) else packed).flatten().numpy()
        exact = np.round(values)
        # a mosaic shrunk by interpolation no longer maps one-to-one onto vision tokens
        return np.where(np.abs(values - exact) < 1e-4, exact, -2).astype(np.int64)

    def geometry(self, inputs: Mapping[str, Any]) -> list[ImageGeometry]:
        vc = self.config.vision_config
        side = vc.image_size // vc.patch_size
        out = []
        for size in inputs["image_sizes"].cpu():
            n = self._n_views(size.tolist())
            source = self._trace(n, side, size)
            names = ["base"] + [f"tile{i}" for i in range(n - 1)] if n > 1 else ["image"]
            per_view = layout.views(n, side, side, names)
            base = GridSegment(0, side, side, view=names[0])
            rest = source[side * side :]
            newlines = int((rest == -1).sum())
            llm: tuple[GridSegment, ...]
            if n > 1 and newlines:
                stride = rest.size // newlines
                llm = (base, GridSegment(side * side, newlines, stride - 1, stride, view="tiles"))
            else:
                llm = (base,)
            out.append(
                ImageGeometry(
                    vision=per_view, projector_in=per_view, projector_out=per_view, llm=llm, n_views=n,
                    llm_tokens=int(source.size), llm_source=source,
                )
            )
        return out
