"""Image processor and processor of the toy VLM, loadable with AutoProcessor after ``import toyvlm``.

The image processor only scales to [0, 1] and normalises with ImageNet mean/std, as the study
does; it never resizes, because one patch must cover exactly one board intersection. The
processor expands each ``<|image|>`` placeholder in the text into one token per patch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import BatchFeature, ProcessorMixin
from transformers.image_processing_utils import BaseImageProcessor

from . import tokenizer as T

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class ToyCounterImageProcessor(BaseImageProcessor):
    model_input_names = ["pixel_values"]

    def __init__(self, image_size: int = 88, patch_size: int = 8,
                 image_mean: Sequence[float] = IMAGENET_MEAN,
                 image_std: Sequence[float] = IMAGENET_STD, variable_size: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.image_size = image_size
        self.patch_size = patch_size
        self.image_mean = list(image_mean)
        self.image_std = list(image_std)
        # G2M (``lab.g2m``): any square image whose side is a multiple of the patch, one token per
        # grid cell, so an N x N grid drawn at N * patch px is N**2 tokens. Off for the counter,
        # whose boards are always ``image_size`` px.
        self.variable_size = bool(variable_size)

    def side_of(self, image: Any) -> int:
        """Patches per side of one image (``image_size // patch_size`` unless ``variable_size``)."""
        if not self.variable_size:
            return self.image_size // self.patch_size
        h, w = (image.size[1], image.size[0]) if isinstance(image, Image.Image) else np.asarray(image).shape[:2]
        return h // self.patch_size

    @property
    def grid(self) -> tuple[int, int]:
        """Patch grid (rows, cols) of every image: one image token per cell, raster order."""
        side = self.image_size // self.patch_size
        return side, side

    def normalize_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8-range ``[N, 3, H, W]`` -> normalised float32 (training renders call this too)."""
        mean = torch.tensor(self.image_mean, dtype=torch.float32, device=pixels.device)[:, None, None]
        std = torch.tensor(self.image_std, dtype=torch.float32, device=pixels.device)[:, None, None]
        return (pixels.float() / 255.0 - mean) / std

    def preprocess(self, images: Any, return_tensors: str | None = "pt", **kwargs: Any) -> BatchFeature:
        if isinstance(images, (Image.Image, np.ndarray)):
            images = [images]
        arrays: list[np.ndarray] = []
        for img in images:
            arr = np.asarray(img.convert("RGB") if isinstance(img, Image.Image) else img)
            if self.variable_size:
                h, w = arr.shape[:2]
                if h != w or h % self.patch_size:
                    raise ValueError(
                        f"image is {w}x{h} px; this model reads square images whose side is a multiple"
                        f" of {self.patch_size} px (one patch per grid cell): draw an N x N grid at"
                        f" N*{self.patch_size} px, resizing would misalign patches")
                if arrays and arrays[0].shape != arr.shape:
                    raise ValueError(f"images of {arrays[0].shape[1]} and {w} px in one call: batch one"
                                     " grid size at a time (pixel_values is one tensor)")
            elif arr.shape[:2] != (self.image_size, self.image_size):
                raise ValueError(
                    f"image is {arr.shape[1]}x{arr.shape[0]} px but the model reads"
                    f" {self.image_size}x{self.image_size} (one {self.patch_size}-px patch per"
                    " intersection); render the board at that size, resizing would misalign patches")
            arrays.append(arr)
        pixels = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2)
        return BatchFeature({"pixel_values": self.normalize_pixels(pixels)}, tensor_type=return_tensors)


class ToyCounterProcessor(ProcessorMixin):
    """``processor(images=..., text=...)`` -> input_ids, attention_mask, pixel_values."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None,
                 chat_template: str | None = None, **kwargs: Any) -> None:
        self.image_token = T.IMAGE
        super().__init__(image_processor, tokenizer, chat_template=chat_template)
        self.image_token_id = tokenizer.convert_tokens_to_ids(T.IMAGE)

    @property
    def image_seq_length(self) -> int:
        rows, cols = self.image_processor.grid
        return rows * cols

    def expand(self, text: str, tokens: Sequence[int] | int | None = None) -> str:
        """Each ``<|image|>`` -> one token per patch (``tokens``: per placeholder, default the fixed grid)."""
        if tokens is None:
            return text.replace(T.IMAGE, " ".join([T.IMAGE] * self.image_seq_length))
        counts = [tokens] * text.count(T.IMAGE) if isinstance(tokens, int) else list(tokens)
        parts = text.split(T.IMAGE)
        if len(counts) != len(parts) - 1:
            raise ValueError(f"{len(parts) - 1} <|image|> placeholders but {len(counts)} token counts")
        out = parts[0]
        for n, part in zip(counts, parts[1:], strict=False):
            out += " ".join([T.IMAGE] * n) + part
        return out

    def __call__(self, images: Any = None, text: str | list[str] | None = None,
                 return_tensors: str | None = "pt", padding: bool | str = True,
                 **kwargs: Any) -> BatchFeature:
        if text is None:
            raise ValueError("text is required: the prompt holds one <|image|> per image")
        texts = [text] if isinstance(text, str) else list(text)
        n_images = sum(t.count(T.IMAGE) for t in texts)
        data: dict[str, Any] = {}
        expanded = None
        if images is not None:
            if isinstance(images, (Image.Image, np.ndarray)):
                images = [images]
            images = [im for group in images for im in (group if isinstance(group, list) else [group])]
            if len(images) != n_images:
                raise ValueError(f"{len(images)} images for {n_images} <|image|> placeholders")
            data.update(self.image_processor(images, return_tensors=return_tensors))
            if getattr(self.image_processor, "variable_size", False):
                sides = iter([self.image_processor.side_of(im) ** 2 for im in images])
                expanded = [self.expand(t, [next(sides) for _ in range(t.count(T.IMAGE))]) for t in texts]
        elif n_images:
            raise ValueError(f"text has {n_images} <|image|> placeholders but no images were given")
        if expanded is None:
            expanded = [self.expand(t) for t in texts]
        enc = self.tokenizer(expanded, add_special_tokens=False,
                             padding=padding, return_tensors=return_tensors,
                             **{k: v for k, v in kwargs.items() if k in ("padding_side", "truncation")})
        data.update(enc)
        return BatchFeature(data, tensor_type=return_tensors)

    def batch_decode(self, *args: Any, **kwargs: Any) -> list[str]:
        return self.tokenizer.batch_decode(*args, **kwargs)

    def decode(self, *args: Any, **kwargs: Any) -> str:
        return self.tokenizer.decode(*args, **kwargs)


# The study's template (semproj tokenizer.py), space-joined.
CHAT_TEMPLATE = (
    "{{ '<|bos|> <|user_start|>' }}"
    "{% for message in messages %}{% if message['role'] == 'user' %}"
    "{% for item in (message['content'] if message['content'] is not string"
    " else [{'type': 'text', 'text': message['content']}]) %}"
    "{% if item['type'] == 'image' %}{{ ' <|image_start|> <|image|> <|image_end|>' }}"
    "{% else %}{{ ' ' + item['text'] }}{% endif %}{% endfor %}{% endif %}{% endfor %}"
    "{{ ' <|user_end|>' }}{% if add_generation_prompt %}{{ ' <|assistant_start|>' }}{% endif %}"
)


def prompt(question: str, strings: Sequence[str] = (), image: bool = False) -> str:
    """The study's prompt up to and including ``<|assistant_start|>``; the answer comes next.

    ``<|bos|> <|user_start|> [<|image_start|> <|image|> <|image_end|>]
    [<|str_start|> s <|str_end|>]* <|question_start|> Q <|question_end|> <|user_end|>
    <|assistant_start|>``, strings written one letter per token.
    """
    parts = [T.BOS, T.USER_START]
    if image:
        parts += [T.IMAGE_START, T.IMAGE, T.IMAGE_END]
    for s in strings:
        parts += [T.STR_START, " ".join(s), T.STR_END]
    parts += [T.QUESTION_START, question, T.QUESTION_END, T.USER_END, T.ASSISTANT_START]
    return " ".join(parts)


def answer_suffix(answer: str) -> str:
    """What follows ``<|assistant_start|>`` in a training sequence (digits split by the tokenizer)."""
    return f"{answer} {T.ASSISTANT_END} {T.EOS}"


def build_processor(image_size: int = 88, patch_size: int = 8, extra_words: Sequence[str] = (),
                    variable_size: bool = False) -> ToyCounterProcessor:
    """The counter's processor; ``extra_words``/``variable_size`` build the G2M variant (``lab.g2m``)."""
    tok = T.build_tokenizer(tuple(extra_words))
    tok.padding_side = "left"  # generation continues every row from its last column
    return ToyCounterProcessor(ToyCounterImageProcessor(image_size, patch_size, variable_size=variable_size),
                               tok, chat_template=CHAT_TEMPLATE)
