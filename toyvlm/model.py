"""The toy counting VLM of counting-bottleneck as a transformers model.

Module paths (the extraction adapter's contract)::

    vision.patch_embed        Conv2d(3, d, patch, stride=patch): one token per board intersection
    vision.blocks.N           pre-LN ViT blocks, 2-D rotary positions (row, col); .attn inside
    vision.norm               final LayerNorm: the "ViT output tokens" of the hidden-number probe
    projector                 Linear(d, d)
    decoder.embed_tokens      token embedding
    decoder.layers.N          pre-LN causal blocks, 1-D rotary positions; .self_attn inside
    decoder.norm              final LayerNorm
    lm_head                   untied Linear(d, vocab)

The decoder runs over one sequence in which every ``<|image|>`` token is replaced by one
projected patch, in raster order (row-major over the board).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import ModelOutput

from .config import ToyCounterConfig


@dataclass
class ToyCounterOutput(ModelOutput):
    """``hidden_states``: decoder residual stream, (embeddings, after layer 0, ..., after layer L-1),
    no final norm. ``attentions``: per decoder layer ``[batch, heads, queries, keys]``.
    ``vision_hidden_states``: (patch embeddings, after block 0, ...), no final norm;
    ``vision_attentions``: per vision block ``[images, heads, patches, patches]``;
    ``image_features``: projector output ``[images, patches, d]`` (present when images were given).
    """

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: Cache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
    vision_hidden_states: tuple[torch.Tensor, ...] | None = None
    vision_attentions: tuple[torch.Tensor, ...] | None = None
    image_features: torch.Tensor | None = None


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


def rope_1d(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[B, 1, T, head_dim]`` for integer positions ``[B, T]``."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    freqs = positions.float()[..., None] * inv
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    return emb.cos(), emb.sin()


def rope_2d(rows: int, cols: int, head_dim: int, theta: float, device: torch.device,
            gain: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[rows*cols, head_dim]``: half of the rotary pairs turn with the row, half with the column.

    ``gain`` (``[head_dim // 4]``) multiplies the frequencies, as images-as-text's RoPE scaling does to
    Qwen2-VL's vision tower (``extract.interventions.rope``); None leaves them untouched.
    """
    quarter = head_dim // 4
    inv = 1.0 / theta ** (torch.arange(quarter, device=device, dtype=torch.float32) / quarter)
    if gain is not None:
        inv = inv * gain.to(device=device, dtype=torch.float32)
    r = torch.arange(rows, device=device, dtype=torch.float32).repeat_interleave(cols)
    c = torch.arange(cols, device=device, dtype=torch.float32).repeat(rows)
    freqs = torch.cat((r[:, None] * inv, c[:, None] * inv), dim=-1)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain softmax attention that also returns the weights ``[B, H, Tq, Tk]``.

    ``attention_mask`` is additive ``[B, 1, Tq, Tk]``; without one, a causal module masks keys
    after each query itself (queries are the last ``Tq`` of the ``Tk`` positions).
    """
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, :, : key.shape[-2]]
    elif getattr(module, "is_causal", False) and query.shape[2] > 1:
        tq, tk = query.shape[2], key.shape[2]
        future = torch.ones(tq, tk, dtype=torch.bool, device=query.device).triu(tk - tq + 1)
        scores = scores.masked_fill(future, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(weights, value).transpose(1, 2).contiguous()
    return out, weights


class Attention(nn.Module):
    """Bias-free q/k/v (as in the study), rotary positions, any transformers attention backend."""

    def __init__(self, config: ToyCounterConfig, layer_idx: int, is_causal: bool) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.is_causal = is_causal
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.num_key_value_groups = 1
        self.scaling = self.head_dim ** -0.5
        d = config.hidden_size
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention_mask: torch.Tensor | None = None, cache: Cache | None = None,
                output_attentions: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        b, t, _ = x.shape
        shape = (b, t, self.num_heads, self.head_dim)
        q = apply_rotary(self.q_proj(x).view(shape).transpose(1, 2), cos, sin)
        k = apply_rotary(self.k_proj(x).view(shape).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        impl = self.config._attn_implementation or "eager"
        # sdpa/flash return no weights: a call that asks for them runs this file's eager code.
        if output_attentions and impl not in ("eager", "capture"):
            impl = "eager"
        fn: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager_attention_forward)
        out, weights = fn(self, q, k, v, attention_mask, scaling=self.scaling, dropout=0.0)
        return self.o_proj(out.reshape(b, t, -1)), weights


class MLP(nn.Module):
    def __init__(self, config: ToyCounterConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-LN transformer block; the attention submodule is ``attn`` (vision) / ``self_attn`` (decoder)."""

    def __init__(self, config: ToyCounterConfig, layer_idx: int, is_causal: bool, attn_name: str) -> None:
        super().__init__()
        eps = config.layer_norm_eps
        self.attn_name = attn_name
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.add_module(attn_name, Attention(config, layer_idx, is_causal))
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention_mask: torch.Tensor | None = None, cache: Cache | None = None,
                output_attentions: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        attn = getattr(self, self.attn_name)
        a, weights = attn(self.norm1(x), cos, sin, attention_mask, cache, output_attentions)
        x = x + a
        x = x + self.mlp(self.norm2(x))
        return x, weights


class VisionTower(nn.Module):
    """Patch-conv ViT: one token per board intersection, no CLS, no learned positions."""

    def __init__(self, config: ToyCounterConfig) -> None:
        super().__init__()
        self.config = config
        p = config.patch_size
        self.patch_embed = nn.Conv2d(config.num_channels, config.hidden_size, p, stride=p)
        self.blocks = nn.ModuleList(
            [Block(config, i, is_causal=False, attn_name="attn") for i in range(config.vision_layers)])
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        # Set by an intervention, never saved: a plain attribute, so dtype casts leave it alone.
        self.rope_gain: torch.Tensor | None = None

    def forward(self, pixel_values: torch.Tensor, output_hidden_states: bool = False,
                output_attentions: bool = False) -> tuple[torch.Tensor, tuple, tuple]:
        x = self.patch_embed(pixel_values)  # [N, d, rows, cols]
        rows, cols = x.shape[-2:]
        x = x.flatten(2).transpose(1, 2)  # raster order: index = row * cols + col
        cos, sin = rope_2d(rows, cols, self.config.head_dim, self.config.vision_rope_theta, x.device, self.rope_gain)
        hidden, attns = [x], []
        for block in self.blocks:
            x, w = block(x, cos.to(x.dtype), sin.to(x.dtype), output_attentions=output_attentions)
            hidden.append(x)
            attns.append(w)
        return (self.norm(x), tuple(hidden) if output_hidden_states else (),
                tuple(attns) if output_attentions else ())


class Decoder(nn.Module):
    def __init__(self, config: ToyCounterConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [Block(config, i, is_causal=True, attn_name="self_attn") for i in range(config.decoder_layers)])
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class ToyCounterPreTrainedModel(PreTrainedModel):
    config_class = ToyCounterConfig
    base_model_prefix = "toy_counter"
    main_input_name = "input_ids"
    input_modalities = ["image", "text"]
    _supports_sdpa = True
    _supports_attention_backend = True
    _no_split_modules = ["Block"]

    def _init_weights(self, module: nn.Module) -> None:
        # Fresh models keep PyTorch's default initialisation, which trains this small net
        # faster than N(0, 0.02); loaded models get every tensor from the checkpoint.
        return


class ToyCounterForConditionalGeneration(ToyCounterPreTrainedModel, GenerationMixin):
    """Image (optional) + text in, next-token logits out; ``generate`` works as for any causal LM."""

    def __init__(self, config: ToyCounterConfig) -> None:
        super().__init__(config)
        self.vision = VisionTower(config)
        self.projector = nn.Linear(config.hidden_size, config.hidden_size)
        self.decoder = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.decoder.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        if not isinstance(value, nn.Embedding):
            raise TypeError(f"the toy decoder's input embeddings are an nn.Embedding, got {type(value).__name__}")
        self.decoder.embed_tokens = value

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def get_image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Projected image tokens ``[images, board_size**2, d]``, raster order."""
        return self.projector(self.vision(pixel_values)[0])

    def _mask(self, attention_mask: torch.Tensor | None, t: int, past: int,
              dtype: torch.dtype) -> torch.Tensor | None:
        """Additive ``[B, 1, T, past+T]`` mask, or None when causality alone is the mask."""
        if attention_mask is None or (bool(attention_mask.all()) and (past == 0 or t == 1)):
            return None
        k = past + t
        keep = attention_mask[:, None, None, :k].bool()
        causal = torch.ones(t, k, dtype=torch.bool, device=attention_mask.device).tril(past)
        keep = keep & causal
        # Fully padded query rows (left padding) get finfo.min everywhere: uniform, never NaN.
        mask = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
        return mask.masked_fill(~keep, torch.finfo(dtype).min)

    def _merge_images(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor,
                      pixel_values: torch.Tensor, output_hidden_states: bool, output_attentions: bool,
                      ) -> tuple[torch.Tensor, torch.Tensor, Any, Any]:
        """The text embeddings with each ``<|image|>`` slot replaced by its projected patch, in
        raster order; also the image features and the ViT's hidden states and attentions (or None)."""
        feats, vh, va = self.vision(pixel_values.to(inputs_embeds.dtype), output_hidden_states, output_attentions)
        image_features = self.projector(feats)
        if input_ids is None:
            raise ValueError("pixel_values need input_ids with <|image|> placeholders")
        slots = input_ids == self.config.image_token_id
        if int(slots.sum()) != image_features.shape[0] * image_features.shape[1]:
            raise ValueError(
                f"{int(slots.sum())} <|image|> tokens but {image_features.shape[0]} images x"
                f" {image_features.shape[1]} patches: expand the placeholder with the processor")
        return inputs_embeds.masked_scatter(slots[..., None], image_features), image_features, vh or None, va or None

    def _rope(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor | None,
              attention_mask: torch.Tensor | None, past: int) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE cos/sin of each new token: given positions, else counted over the unpadded tokens
        (left padding starts every row at 0), else ``past .. past+T``."""
        b, t, _ = inputs_embeds.shape
        positions: torch.Tensor
        if position_ids is not None:
            positions = position_ids
        elif attention_mask is not None:
            positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -t:]
        else:
            positions = torch.arange(past, past + t, device=inputs_embeds.device)[None].expand(b, t)
        cos, sin = rope_1d(positions, self.config.head_dim, self.config.rope_theta)
        return cos.to(inputs_embeds.dtype), sin.to(inputs_embeds.dtype)

    def _decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache: Cache | None, output_attentions: bool) -> tuple[torch.Tensor, list[Any], list[Any]]:
        """The decoder blocks then the final norm; every block's input/output and attention weights."""
        hidden, attns = [x], []
        for layer in self.decoder.layers:
            x, w = layer(x, cos, sin, mask, cache, output_attentions)
            hidden.append(x)
            attns.append(w)
        return self.decoder.norm(x), hidden, attns

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        pixel_values: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        logits_to_keep: int = 0,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> ToyCounterOutput:
        output_attentions = bool(output_attentions if output_attentions is not None
                                 else self.config.output_attentions)
        output_hidden_states = bool(output_hidden_states if output_hidden_states is not None
                                    else self.config.output_hidden_states)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.decoder.embed_tokens(input_ids)
        vision_hidden, vision_attns, image_features = None, None, None
        if pixel_values is not None:
            inputs_embeds, image_features, vision_hidden, vision_attns = self._merge_images(
                input_ids, inputs_embeds, pixel_values, output_hidden_states, output_attentions)

        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        past = cache.get_seq_length() if cache is not None else 0
        t = inputs_embeds.shape[1]
        cos, sin = self._rope(inputs_embeds, position_ids, attention_mask, past)
        mask = self._mask(attention_mask, t, past, inputs_embeds.dtype)
        x, hidden, attns = self._decode(inputs_embeds, cos, sin, mask, cache, output_attentions)
        keep = slice(-logits_to_keep, None) if logits_to_keep else slice(None)
        logits = self.lm_head(x[:, keep])

        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                   ignore_index=-100)
        return ToyCounterOutput(
            loss=loss,
            logits=logits,
            cache=cache if use_cache else None,
            hidden_states=tuple(hidden) if output_hidden_states else None,
            attentions=tuple(attns) if output_attentions else None,
            vision_hidden_states=vision_hidden,
            vision_attentions=vision_attns,
            image_features=image_features,
        )
