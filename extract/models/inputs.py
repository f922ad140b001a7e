"""Build model inputs from PIL images + prompts (+ teacher-forced answers) and record positions.

The prompt goes through the model's chat template (one user turn: the image, then the text; an
optional system turn), the processor expands the image placeholder into image tokens, and answer
tokens are appended *after* processing so that their positions are exact (no BPE merge across the
prompt/answer boundary). Each sample gets a :class:`SampleLayout` with its image positions, last
prompt token, answer positions and the patch grids of every tap.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from . import layout
from .errors import InputError
from .layout import SampleLayout
from .loading import LoadedModel

ImageLike = Image.Image | str | os.PathLike[str]


@dataclass(eq=False)
class Batch:
    """Inputs of one forward plus where every sample's tokens are.

    ``inputs`` are the keyword arguments of the model's forward (on the model's device);
    ``texts`` the prompt strings after the chat template; ``answers`` the teacher-forced answers as
    decoded from their tokens; ``aux`` per-batch tensors the hook transforms need (e.g. Qwen
    reorder indices).
    """

    inputs: dict[str, Any]
    layouts: list[SampleLayout]
    texts: list[str]
    answers: list[str] | None = None
    padding_side: str = "right"
    aux: dict[str, Any] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.layouts)

    @property
    def views(self) -> list[int]:
        return [lay.geometry.n_views for lay in self.layouts]

    @property
    def seq_len(self) -> int:
        """Padded length of the sequence (prompt + answers)."""
        return int(self.inputs["input_ids"].shape[1])


def open_image(image: ImageLike) -> Image.Image:
    """An RGB PIL image from a PIL image or a path; InputError says which file and why."""
    if isinstance(image, Image.Image):
        return image if image.mode == "RGB" else image.convert("RGB")
    if isinstance(image, (str, os.PathLike)):
        path = Path(image)
        try:
            with Image.open(path) as im:
                im.load()
                return im.convert("RGB")
        except FileNotFoundError:
            raise InputError(f"image {str(path)!r} does not exist: pass an existing image file or a PIL image") from None
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
            raise InputError(
                f"image {str(path)!r} cannot be read ({type(err).__name__}: {err}): expected a PNG/JPEG/... file"
                " that PIL can open; regenerate or replace it"
            ) from err
    raise InputError(f"expected a PIL image or an image path, got {type(image).__name__}")


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def image_size(path: str | os.PathLike[str]) -> tuple[int, int]:
    """(width, height) of an image file from its header, without its pixels, refused as
    ``Image.open`` refuses it (including ``DecompressionBombError`` past PIL's limit). A PNG's
    chunks are read here up to its image data, as PIL's open reads them: 5-11 us a header, where
    ``Image.open`` took 17-73 us, and an extraction asks this of every image before it starts.
    Other formats go to PIL."""
    with open(path, "rb") as fh:
        size = _png_size(fh) if fh.read(8) == _PNG_SIGNATURE else None
    if size is None:
        with Image.open(path) as im:
            return im.size
    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and size[0] * size[1] > 2 * limit:  # where Image.open refuses one
        raise Image.DecompressionBombError(
            f"Image size ({size[0] * size[1]} pixels) exceeds limit of {2 * limit} pixels, could be"
            " decompression bomb DOS attack."
        )
    return size


def _png_size(fh: IO[bytes]) -> tuple[int, int]:
    """The IHDR size of a PNG whose signature was read, checking each chunk's CRC up to the image
    data; errors and their messages are PIL's."""
    size = None
    while True:
        header = fh.read(8)
        if len(header) < 8:
            raise OSError("Truncated File Read")
        length, kind = struct.unpack(">I4s", header)
        if kind == b"IDAT":
            if size is None:
                raise SyntaxError("broken PNG file (IDAT before IHDR)")
            return size
        data, crc = fh.read(length), fh.read(4)
        if len(data) < length or len(crc) < 4:
            raise OSError("Truncated File Read")
        if zlib.crc32(kind + data) != struct.unpack(">I", crc)[0]:
            raise SyntaxError(f"broken PNG file (bad header checksum in {kind!r})")
        if kind == b"IHDR":
            width, height = struct.unpack(">II", data[:8])
            if not width or not height:
                raise SyntaxError(f"broken PNG file (a {width}x{height} image)")
            size = (int(width), int(height))


def chat_text(lm: LoadedModel, prompt: str, system: str | None = None, *, image: bool = True,
              strings: Sequence[str] = ()) -> str:
    """The prompt string the model sees: chat template with the generation prompt, or the raw prompt.

    ``image=False`` leaves the image out (a text-only task); ``strings`` are shown before the
    question in the family's layout (:meth:`Adapter.user_text`).
    """
    template = getattr(lm.processor, "chat_template", None)
    strings = tuple(strings)
    if not lm.adapter.uses_chat_template or not template:
        return lm.adapter.plain_prompt(lm.processor, prompt, image=image, strings=strings)
    messages: list[dict[str, Any]] = []
    if system is not None:
        messages.append({"role": "system", "content": [{"type": "text", "text": system}]})
    text = {"type": "text", "text": lm.adapter.user_text(prompt, strings)}
    messages.append({"role": "user", "content": [{"type": "image"}, text] if image else [text]})
    return lm.adapter.render_chat(lm.processor, messages)


def prepare_batch(
    lm: LoadedModel,
    images: Sequence[ImageLike | None],
    prompts: Sequence[str],
    answers: Sequence[str] | Sequence[Sequence[int]] | None = None,
    *,
    strings: Sequence[Sequence[str]] | None = None,
    system: str | None = None,
    padding_side: str = "right",
    processor_kwargs: dict[str, Any] | None = None,
) -> Batch:
    """Processor inputs and token layouts for one image + one prompt per sample.

    ``answers`` (teacher forcing) are appended after the generation prompt; their positions become
    the ``answer`` token kind. An answer is a string (tokenised without special tokens) or a list of
    token ids (e.g. generated ids, so no decode/encode round trip). Use ``padding_side="left"`` for
    batched generation. A batch of text-only samples passes ``None`` for every image; ``strings``
    (per sample) are text inputs shown before the question, e.g. a Go board's text twin.
    """
    _check_batch(images, prompts, answers, strings, padding_side)
    with_image = images[0] is not None  # one modality per batch, checked above
    pil = [open_image(im) for im in images if im is not None] if with_image else []
    texts = [chat_text(lm, p, system, image=with_image, strings=strings[i] if strings is not None else ())
             for i, p in enumerate(prompts)]
    tok = lm.processor.tokenizer
    processed = _process(lm, texts, pil, with_image, padding_side, processor_kwargs)
    inputs = lm.adapter.clean_inputs(processed)
    n_prompt = inputs["attention_mask"].sum(1).tolist()
    answer_ids = None
    if answers is not None:
        answer_ids = [
            tok(a, add_special_tokens=False)["input_ids"] if isinstance(a, str) else [int(t) for t in a]
            for a in answers
        ]
        inputs = _append_answers(lm, inputs, answer_ids, padding_side, tok.pad_token_id)
    geometry = lm.adapter.geometry(inputs) if with_image else [layout.ImageGeometry.none() for _ in prompts]
    layouts = _layouts(lm, inputs, geometry, n_prompt, answer_ids)
    aux = lm.adapter.aux(inputs, geometry) if with_image else {}
    moved = {k: _to(v, lm) for k, v in inputs.items()}
    answer_texts = None if answer_ids is None else [tok.decode(a) for a in answer_ids]
    return Batch(moved, layouts, texts, answer_texts, padding_side, aux)


def _check_batch(images: Sequence[ImageLike | None], prompts: Sequence[str], answers: Sequence[Any] | None,
                 strings: Sequence[Sequence[str]] | None, padding_side: str) -> None:
    """One image, prompt (and answer, strings) per sample, one modality per batch: else one line saying so."""
    if len(images) != len(prompts):
        raise InputError(f"expected one prompt per image, got {len(images)} images and {len(prompts)} prompts")
    if answers is not None and len(answers) != len(prompts):
        raise InputError(f"expected one answer per prompt, got {len(prompts)} prompts and {len(answers)} answers")
    if strings is not None and len(strings) != len(prompts):
        raise InputError(f"expected one tuple of strings per prompt, got {len(prompts)} prompts and {len(strings)}")
    if not prompts:
        raise InputError("empty batch: pass at least one image and prompt")
    if padding_side not in ("left", "right"):
        raise InputError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    text_only = [im is None for im in images]
    if any(text_only) and not all(text_only):
        raise InputError(
            "a batch mixes text-only samples (image None) with image samples: the processor takes one or the"
            " other, so split the batch by modality"
        )


def _process(lm: LoadedModel, texts: list[str], pil: list[Any], with_image: bool, padding_side: str,
             processor_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The processor's outputs for ``texts`` (and images), padded on ``padding_side``."""
    tok = lm.processor.tokenizer
    old_side = tok.padding_side
    tok.padding_side = padding_side
    try:
        kwargs: dict[str, Any] = dict(text=texts, return_tensors="pt", padding=True)
        if with_image:
            kwargs["images"] = [[im] for im in pil] if lm.adapter.nested_images else pil
        if tok.bos_token is not None and texts[0].startswith(tok.bos_token):
            # the chat template wrote BOS already (transformers' own apply_chat_template rule)
            kwargs["add_special_tokens"] = False
        processed = dict(lm.processor(**kwargs, **(processor_kwargs or {})))
    except ValueError as err:  # e.g. an image size a fixed-size processor cannot read
        raise InputError(f"the processor refused this batch: {err}") from err
    finally:
        tok.padding_side = old_side
    return processed


def _to(value: Any, lm: LoadedModel) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if value.is_floating_point():
        return value.to(lm.device, lm.dtype)
    return value.to(lm.device)


def _append_answers(
    lm: LoadedModel, inputs: dict[str, Any], answer_ids: list[list[int]], side: str, pad_id: int | None
) -> dict[str, Any]:
    """Append each row's answer tokens after its real prompt tokens and re-pad every per-token tensor."""
    ids = inputs["input_ids"]
    mask = inputs["attention_mask"].bool()
    per_token = [k for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.shape == ids.shape]
    lengths = [int(m.sum()) + len(a) for m, a in zip(mask, answer_ids, strict=False)]
    width = max(lengths)
    out = dict(inputs)
    for key in per_token:
        pad = (pad_id if pad_id is not None else 0) if key == "input_ids" else 0
        fill = lm.adapter.answer_fill(key)
        rows = []
        for b, answer in enumerate(answer_ids):
            real = inputs[key][b][mask[b]]
            extra = torch.tensor(answer if key == "input_ids" else [fill] * len(answer), dtype=real.dtype)
            row = torch.cat([real, extra])
            padding = torch.full((width - row.numel(),), pad, dtype=real.dtype)
            rows.append(torch.cat([row, padding] if side == "right" else [padding, row]))
        out[key] = torch.stack(rows)
    return out


def _layouts(
    lm: LoadedModel,
    inputs: dict[str, Any],
    geometry: list[layout.ImageGeometry],
    n_prompt: list[int],
    answer_ids: list[list[int]] | None,
) -> list[SampleLayout]:
    ids = inputs["input_ids"]
    mask = inputs["attention_mask"].bool()
    if len(geometry) != ids.shape[0]:
        raise InputError(f"{lm.adapter.family}: expected one image per sample, got {len(geometry)} for {ids.shape[0]} samples")
    out = []
    for b in range(ids.shape[0]):
        real = torch.nonzero(mask[b]).flatten()
        first, length = int(real[0]), int(real.numel())
        image_pos = torch.nonzero(ids[b] == lm.adapter.image_token_id).flatten().numpy().astype(np.int64)
        expected = geometry[b].llm_tokens
        if image_pos.size != expected:
            raise InputError(
                f"{lm.adapter.family}: sample {b} has {image_pos.size} image tokens in the sequence but its geometry"
                f" says {expected}; the processor and the adapter disagree (check the processor config)"
            )
        n_ans = len(answer_ids[b]) if answer_ids is not None else 0
        last = first + n_prompt[b] - 1
        out.append(
            SampleLayout(
                geometry=geometry[b],
                image_positions=image_pos,
                last_position=last,
                answer_positions=np.arange(last + 1, last + 1 + n_ans, dtype=np.int64),
                first_position=first,
                length=length,
            )
        )
    return out
