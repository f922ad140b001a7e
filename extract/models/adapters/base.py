"""What an architecture family tells the rest of the code: module paths, geometry, tiny model.

An adapter is a small class. Its class attributes name the modules behind each tap (dotted paths
as in ``model.named_modules()``); its methods say how the image is tokenised (``geometry``) and
how a hooked tensor becomes per-sample, raster-ordered tokens. Most families only declare paths
and geometry: the default methods cover towers that run one batch row per image view,
``[views, tokens, channels]``. ``build_tiny`` makes a random-init model of the family for tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from store.vocab import stack_of

from ..layout import ImageGeometry
from ..taps import FAMILY_SITES, SITES


class Adapter:
    """Base adapter. Subclasses set the class attributes and implement :meth:`geometry`."""

    # --- identity -------------------------------------------------------------------------
    family: ClassVar[str] = ""  # human-readable name, e.g. "Qwen2-VL"
    model_types: ClassVar[tuple[str, ...]] = ()  # config.model_type values this adapter serves
    # --- module paths ---------------------------------------------------------------------
    vision_layers: ClassVar[str] = ""  # nn.ModuleList of vision blocks
    vision_attention: ClassVar[str] = ""  # attention submodule inside a vision block
    projector: ClassVar[str] = ""  # connector module
    llm_layers: ClassVar[str] = "model.language_model.layers"
    llm_attention: ClassVar[str] = "self_attn"  # attention submodule inside an LLM block
    final_norm: ClassVar[str] = "model.language_model.norm"
    lm_head: ClassVar[str] = "lm_head"
    # --- tokenisation ---------------------------------------------------------------------
    vision_prefix_tokens: ClassVar[int] = 0  # CLS-like tokens before the patches of each view
    nested_images: ClassVar[bool] = False  # processor wants one list of images per sample
    uses_chat_template: ClassVar[bool] = True  # False: prompts go to the processor verbatim
    extra_sites: ClassVar[Mapping[str, tuple[str, ...]]] = {}  # family-only sites, e.g. pre_merger

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        # transformers configs are dynamic attribute bags: Any, not nn.Module's Tensor | Module.
        self.config: Any = model.config

    # --- sizes ----------------------------------------------------------------------------
    def module(self, path: str) -> nn.Module:
        return self.model.get_submodule(path)

    def n_layers(self, tap: str) -> int:
        """How many layers ``tap`` (or a stack, "vision" or "llm") indexes."""
        stack = stack_of(tap)
        if stack == "vision":
            return len(self._layer_list(self.vision_layers))
        if stack == "llm":
            return len(self._layer_list(self.llm_layers))
        return 1  # projector, logits: one module

    def _layer_list(self, path: str) -> nn.ModuleList:
        layers = self.module(path)
        if not isinstance(layers, nn.ModuleList):
            raise TypeError(f"{type(self).__name__}: {path!r} is a {type(layers).__name__}, not a ModuleList of blocks")
        return layers

    def sites(self, tap: str) -> tuple[str, ...]:
        base = tuple(s for s in SITES[tap] if s not in FAMILY_SITES)
        return base + tuple(self.extra_sites.get(tap, ()))

    @property
    def image_token_id(self) -> int:
        cfg = self.config  # older configs name it image_token_index
        value = getattr(cfg, "image_token_id", None)
        return int(value if value is not None else cfg.image_token_index)

    # --- geometry -------------------------------------------------------------------------
    def geometry(self, inputs: Mapping[str, Any]) -> list[ImageGeometry]:
        """One ImageGeometry per sample, from the processor's outputs (before the forward)."""
        raise NotImplementedError

    def config_geometry(self, width: int, height: int, image_processor: Mapping[str, Any]) -> ImageGeometry:
        """The geometry the family's processor would give one ``width`` x ``height`` image, from the
        config and the image processor's settings alone (``preprocessor_config.json`` as a dict, ``{}``
        when the folder has none): no tokenizer, no processor, no weights.

        ``python -m extract MANIFEST --dry-run`` uses it for a model folder that holds only config
        files (e.g. ``manifests/configs/*``). Implementations build the processor's outputs that
        :meth:`geometry` reads (``image_grid_thw``, a ``pixel_values`` shape, image-token ids) and call
        it, so the two cannot drift apart; the tests check each against the real processor.
        """
        from ..errors import ConfigGeometryError

        raise ConfigGeometryError(
            f"{self.family}: image geometry from config.json alone is not implemented for this family (its image"
            " tokens depend on the processor's tiling); put the tokenizer and processor files in the model"
            " folder (or use the hub id) and the dry run runs the real processor on the first stimulus"
        )

    def aux(self, inputs: Mapping[str, Any], geometry: list[ImageGeometry]) -> dict[str, Any]:
        """Per-batch tensors that the hook transforms need (e.g. reorder indices)."""
        return {}

    # --- hooked tensor -> per-sample tokens ---------------------------------------------------
    # ``views`` is the number of vision-tower rows per sample (from the geometry).
    def split_views(self, x: torch.Tensor, views: list[int], prefix: int = 0) -> list[torch.Tensor]:
        """[sum(views), T, C] -> per sample [views_b * (T - prefix), C]."""
        if x.dim() != 3 or x.shape[0] != sum(views):
            raise RuntimeError(
                f"{self.family}: expected a [{sum(views)} views, tokens, channels] tensor, got {tuple(x.shape)};"
                " the adapter's geometry does not match the model's inputs"
            )
        out, start = [], 0
        for n in views:
            out.append(x[start : start + n, prefix:].reshape(-1, x.shape[-1]))
            start += n
        return out

    def vision_tokens(self, x: torch.Tensor, views: list[int], aux: dict) -> list[torch.Tensor]:
        return self.split_views(x, views, self.vision_prefix_tokens)

    def projector_in_tokens(self, x: torch.Tensor, views: list[int], aux: dict) -> list[torch.Tensor]:
        return self.split_views(x, views)

    def projector_out_tokens(self, x: torch.Tensor, views: list[int], aux: dict) -> list[torch.Tensor]:
        return self.split_views(x, views)

    def pre_merger_tokens(self, x: torch.Tensor, views: list[int], aux: dict) -> list[torch.Tensor]:
        raise NotImplementedError  # only families with a 'pre_merger' extra site

    # --- inputs ---------------------------------------------------------------------------
    def answer_fill(self, key: str) -> int:
        """Value that extends a per-token input (``key``) over appended answer tokens."""
        return 1 if key == "attention_mask" else 0

    def clean_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """Drop processor outputs the forward must not see (e.g. PaliGemma's labels)."""
        return inputs

    def user_text(self, question: str, strings: tuple[str, ...] = ()) -> str:
        """The user's text: strings to read (one character each, as counting-bottleneck gave Qwen3-VL), then
        the question. Families that were trained on another layout override it."""
        shown = [f"{list(s)!r}, String length: {len(s)}." for s in strings]
        return " ".join([*shown, question])

    def plain_prompt(self, processor: Any, prompt: str, *, image: bool = True, strings: tuple[str, ...] = ()) -> str:
        """The prompt text for models without a chat template."""
        return self.user_text(prompt, strings)

    def render_chat(self, processor: Any, messages: list[dict[str, Any]]) -> str:
        """The chat-templated prompt text, ending with the generation prompt."""
        return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    @classmethod
    def register_auto_classes(cls) -> None:
        """Register with the transformers Auto classes a family transformers does not ship (the toy).

        Called once by ``registry()``, before any config is read; a family transformers knows needs nothing.
        """

    @classmethod
    def load_processor(cls, source: str, **kwargs: Any) -> Any:
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(source, **kwargs)

    # --- tiny model -------------------------------------------------------------------------
    @classmethod
    def build_tiny(cls, seed: int) -> tuple[nn.Module, Any]:
        """A tiny random-init model of this family and its processor (see extract.models.tiny)."""
        raise NotImplementedError(f"{cls.family} has no tiny-model recipe")
