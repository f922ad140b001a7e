"""The toy counting VLM's transformers config (``model_type: toy_counter``)."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedConfig

# The name every toy checkpoint's config.json carries: the Auto classes find the toy by it.
MODEL_TYPE = "toy_counter"


class ToyCounterConfig(PreTrainedConfig):
    """One flat config for both towers: the model is tiny and never mixes with other families.

    ``board_size`` x ``board_size`` patches of ``patch_size`` px: one image token per
    intersection, so ``image_seq_length = board_size**2``.
    """

    model_type = MODEL_TYPE

    def __init__(
        self,
        vocab_size: int = 76,
        hidden_size: int = 32,
        num_attention_heads: int = 2,
        intermediate_size: int = 64,
        vision_layers: int = 2,
        decoder_layers: int = 2,
        board_size: int = 11,
        patch_size: int = 8,
        num_channels: int = 3,
        vision_rope_theta: float = 100.0,
        rope_theta: float = 10000.0,
        layer_norm_eps: float = 1e-5,
        image_token_id: int = 8,
        bos_token_id: int = 1,
        eos_token_id: int = 2,
        pad_token_id: int = 0,
        initializer_range: float = 0.02,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.vision_layers = vision_layers
        self.decoder_layers = decoder_layers
        # transformers' cache and generation utilities read this name.
        self.num_hidden_layers = decoder_layers
        self.board_size = board_size
        self.patch_size = patch_size
        self.num_channels = num_channels
        self.vision_rope_theta = vision_rope_theta
        self.rope_theta = rope_theta
        self.layer_norm_eps = layer_norm_eps
        self.image_token_id = image_token_id
        self.initializer_range = initializer_range
        kwargs.pop("num_hidden_layers", None)
        kwargs.setdefault("tie_word_embeddings", False)
        # token ids reach PreTrainedConfig through **kwargs (its typed signature does not list them)
        kwargs.update(bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
        super().__init__(**kwargs)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def image_size(self) -> int:
        return self.board_size * self.patch_size

    @property
    def image_seq_length(self) -> int:
        return self.board_size * self.board_size
