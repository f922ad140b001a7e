"""Two-object spatial relations as 4-way multiple choice (study images-as-text: "Reading Images Like Texts").

A WhatsUp-style controlled stimulus: a *subject* and a *reference* object (shape x colour, always
two different colours) stand in one relation, and the model picks the true caption
("A red circle is to the left of a blue square") among the captions of the same pair under the
other three relations of the set:

- ``planar``: left / right / above / below (2-D layout; the objects never overlap).
- ``depth``: left / right / in front of / behind, as in WhatsUp subset B. Depth is drawn the
  way a camera shows it: the front object is larger, lower in the image and painted over the
  back one (they always overlap by a visible amount; the back object's centre stays visible).

The prompt is the study's (vlm_interp ``Controlled_Images_collate_function``), including its
"decription" typo, with the options shuffled per sample from the sample's own seed; answers
are one letter, read back with :func:`stimuli.answers.parse_choice_letter`. Relations
cycle through the set by sample index, so any ``n`` divisible by 4 is exactly balanced.
Objects are drawn without anti-aliasing: every pixel of an object is exactly its colour.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from stimuli.answers import parse_choice_letter
from stimuli.base import (
    Family,
    Score,
    Stimulus,
    StimulusError,
    Truth,
    check_choice,
    check_int_range,
    compare,
    derive_seed,
    option,
)

NAME = "spatial"
LETTERS = "ABCD"

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 160, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 30),
    "purple": (140, 60, 180),
    "orange": (245, 130, 30),
    "gray": (128, 128, 128),
}
SHAPES = ("circle", "square", "triangle")
BACKGROUND = (255, 255, 255)

RELATION_SETS: dict[str, tuple[str, ...]] = {
    "planar": ("left", "right", "above", "below"),
    "depth": ("left", "right", "front", "behind"),
}
PHRASES = {
    "left": "is to the left of",
    "right": "is to the right of",
    "above": "is above",
    "below": "is below",
    "front": "is in front of",
    "behind": "is behind",
}
PROMPT_HEAD = "Please choose the best decription for the image from the following 4 options:\n"
SUFFIXES = {
    "qwen": "Please answer with A, B, C or D.\nYour answer is:",
    "llava": "Please select the correct option and return only the letter of the option.\nYour choice is:",
}

# Geometry, as fractions of the image or of object sizes. A relation is only drawn when it
# is unambiguous: the objects are separated by GAP along the relation's axis and that axis
# dominates the other by DOMINANCE.
MARGIN = 0.04
GAP = 0.04
DOMINANCE = 2.0
DEPTH_SCALE = (1.3, 1.6)  # front object's size / back object's size
DEPTH_TOP = (0.1, 0.4)  # front's top edge below the back's centre, in back-object sizes
DEPTH_DX = 0.35  # front's horizontal offset from the back, in back-object sizes
MIN_OCCLUDED = 0.03  # front covers at least this fraction of the back object
MAX_TRIES = 1000


@dataclass(frozen=True)
class Config:
    image_size: int = option(384, "image width and height in px")
    relation_set: str = option("planar", "planar = left/right/above/below; depth ="
                               " left/right/front/behind (WhatsUp subset B)",
                               choices=tuple(RELATION_SETS))
    shapes: tuple[str, ...] = option(SHAPES, f"object shapes, from {', '.join(SHAPES)}")
    colours: tuple[str, ...] = option(("red", "green", "blue", "yellow"),
                                      f"object colours (two differ per image), from {', '.join(COLOURS)}")
    min_size: float = option(0.14, "smallest object size (bounding-box side) as a fraction of the image")
    max_size: float = option(0.24, "largest object size as a fraction of the image")
    prompt_style: str = option("qwen", "answer instruction after the options: the study's Qwen or"
                               " LLaVA wording", choices=tuple(SUFFIXES))


@dataclass(frozen=True)
class Obj:
    """One placed object; ``bbox`` is inclusive pixel coordinates (x0, y0, x1, y1)."""

    shape: str
    colour: str
    cx: int
    cy: int
    size: int

    @property
    def bbox(self) -> tuple[int, int, int, int]:
        x0, y0 = self.cx - self.size // 2, self.cy - self.size // 2
        return x0, y0, x0 + self.size - 1, y0 + self.size - 1

    @property
    def noun(self) -> str:
        return f"{self.colour} {self.shape}"


def validate(config: Config) -> None:
    check_int_range("image_size", config.image_size, 64, 4096)
    check_choice("relation_set", config.relation_set, tuple(RELATION_SETS))
    check_choice("prompt_style", config.prompt_style, tuple(SUFFIXES))
    for shape in config.shapes:
        check_choice("shapes", shape, SHAPES)
    for colour in config.colours:
        check_choice("colours", colour, tuple(COLOURS))
    if not config.shapes:
        raise StimulusError(f"shapes is empty: name at least one of {', '.join(SHAPES)}")
    if len(set(config.colours)) < 2:
        raise StimulusError(
            f"colours={config.colours!r}: the two objects always differ in colour, name at least two"
        )
    if not 0.05 <= config.min_size <= config.max_size:
        raise StimulusError(
            f"min_size={config.min_size}, max_size={config.max_size}: need 0.05 <= min_size <= max_size"
        )
    # Depth scenes stack a front object up to 1.6x a back one vertically with overlap; planar
    # scenes put two objects and a gap side by side. Both must fit inside the margins.
    span = config.max_size * (1 + DEPTH_SCALE[1]) + GAP + 2 * MARGIN
    if span > 1.0:
        raise StimulusError(
            f"max_size={config.max_size} leaves no room for two related objects:"
            f" use max_size <= {(1 - GAP - 2 * MARGIN) / (1 + DEPTH_SCALE[1]):.2f}"
        )


def caption(subject: Obj, relation: str, reference: Obj) -> str:
    head = f"{_article(subject.noun).capitalize()} {subject.noun}"
    return f"{head} {PHRASES[relation]} {_article(reference.noun)} {reference.noun}"


def _article(noun: str) -> str:
    return "an" if noun[0] in "aeiou" else "a"


def build_prompt(options: list[str], style: str) -> str:
    lines = "".join(f" {letter}: {text}\n" for letter, text in zip(LETTERS, options, strict=False))
    return PROMPT_HEAD + lines + SUFFIXES[style]


def relation_holds(relation: str, subject: Obj, reference: Obj, image_size: int) -> bool:
    """Whether the 2-D layout shows ``relation`` unambiguously (depth cues are checked apart)."""
    gap = GAP * image_size
    sx0, sy0, sx1, sy1 = subject.bbox
    rx0, ry0, rx1, ry1 = reference.bbox
    dx, dy = abs(subject.cx - reference.cx), abs(subject.cy - reference.cy)
    if relation == "left":
        return sx1 + gap <= rx0 and dx >= DOMINANCE * dy
    if relation == "right":
        return rx1 + gap <= sx0 and dx >= DOMINANCE * dy
    if relation == "above":
        return sy1 + gap <= ry0 and dy >= DOMINANCE * dx
    if relation == "below":
        return ry1 + gap <= sy0 and dy >= DOMINANCE * dx
    raise ValueError(f"not a 2-D relation: {relation}")


def _random_object(rng: np.random.Generator, config: Config, colour_pool: list[str],
                   size: int) -> Obj:
    lo = int(MARGIN * config.image_size) + size // 2
    hi = config.image_size - int(MARGIN * config.image_size) - size + size // 2
    return Obj(
        shape=str(rng.choice(list(config.shapes))),
        colour=str(rng.choice(colour_pool)),
        cx=int(rng.integers(lo, hi + 1)),
        cy=int(rng.integers(lo, hi + 1)),
        size=size,
    )


def _sizes(rng: np.random.Generator, config: Config) -> int:
    return int(round(rng.uniform(config.min_size, config.max_size) * config.image_size))


def place_planar(rng: np.random.Generator, config: Config, relation: str) -> tuple[Obj, Obj]:
    """Subject and reference showing a left/right/above/below relation, without overlap."""
    colours = list(dict.fromkeys(config.colours))
    for _ in range(MAX_TRIES):
        subject = _random_object(rng, config, colours, _sizes(rng, config))
        others = [c for c in colours if c != subject.colour]
        size = _sizes(rng, config)
        if config.relation_set == "depth":
            # Side by side at one depth: equal sizes, so size gives no false depth cue.
            size = subject.size
        reference = _random_object(rng, config, others, size)
        if relation_holds(relation, subject, reference, config.image_size):
            return subject, reference
    raise StimulusError(
        f"could not place a {relation!r} pair in {MAX_TRIES} tries: lower max_size or raise image_size"
    )


def place_depth(rng: np.random.Generator, config: Config) -> tuple[Obj, Obj]:
    """(front, back): the front object larger, lower, overlapping the back one's lower half."""
    colours = list(dict.fromkeys(config.colours))
    w = config.image_size
    margin = int(MARGIN * w)
    for _ in range(MAX_TRIES):
        back_size = _sizes(rng, config)
        back = _random_object(rng, config, colours, back_size)
        front_size = int(round(back_size * rng.uniform(*DEPTH_SCALE)))
        top = back.cy + back_size * rng.uniform(*DEPTH_TOP)
        cy = int(round(top)) + front_size // 2
        cx = back.cx + int(round(back_size * rng.uniform(-DEPTH_DX, DEPTH_DX)))
        front = Obj(str(rng.choice(list(config.shapes))),
                    str(rng.choice([c for c in colours if c != back.colour])), cx, cy, front_size)
        x0, y0, x1, y1 = front.bbox
        if x0 < margin or y0 < margin or x1 > w - 1 - margin or y1 > w - 1 - margin:
            continue
        if (mask(back, w) & mask(front, w)).sum() >= MIN_OCCLUDED * mask(back, w).sum():
            return front, back
    raise StimulusError(
        f"could not place a front/behind pair in {MAX_TRIES} tries: lower max_size or raise image_size"
    )


def _draw(draw: ImageDraw.ImageDraw, obj: Obj, fill: int | tuple[int, int, int]) -> None:
    x0, y0, x1, y1 = obj.bbox
    if obj.shape == "circle":
        draw.ellipse([x0, y0, x1, y1], fill=fill)
    elif obj.shape == "square":
        draw.rectangle([x0, y0, x1, y1], fill=fill)
    else:
        draw.polygon([((x0 + x1) / 2, y0), (x0, y1), (x1, y1)], fill=fill)


def mask(obj: Obj, image_size: int) -> np.ndarray:
    """The object's pixels (as drawn alone) as a boolean array."""
    img = Image.new("L", (image_size, image_size), 0)
    _draw(ImageDraw.Draw(img), obj, 255)
    return np.asarray(img) > 0


def render(objects: list[Obj], image_size: int) -> Image.Image:
    """Draw ``objects`` in order: later ones paint over earlier ones."""
    img = Image.new("RGB", (image_size, image_size), BACKGROUND)
    draw = ImageDraw.Draw(img)
    for obj in objects:
        _draw(draw, obj, COLOURS[obj.colour])
    return img


def layout(rng: np.random.Generator, config: Config, relation: str) -> tuple[Obj, Obj, list[str]]:
    """(subject, reference, draw order as role names) for ``relation``."""
    if relation == "front":
        subject, reference = place_depth(rng, config)
        return subject, reference, ["reference", "subject"]
    if relation == "behind":
        reference, subject = place_depth(rng, config)
        return subject, reference, ["subject", "reference"]
    subject, reference = place_planar(rng, config, relation)
    return subject, reference, ["reference", "subject"]


def generate(config: Config, n: int, seed: int, split: str) -> Iterator[Stimulus]:
    """``n`` images; sample ``i`` shows relation ``i mod 4`` of the configured set."""
    validate(config)
    check_int_range("n", n, 1, None)
    check_int_range("seed", seed, 0, None, "use a non-negative seed")
    return (_sample(config, index, seed, split) for index in range(n))


def _sample(config: Config, index: int, seed: int, split: str) -> Stimulus:
    relations = RELATION_SETS[config.relation_set]
    relation = relations[index % len(relations)]
    sample_seed = derive_seed(seed, index)
    rng = np.random.default_rng(sample_seed)
    subject, reference, order = layout(rng, config, relation)
    roles = {"subject": subject, "reference": reference}
    image = render([roles[r] for r in order], config.image_size)
    true_caption = caption(subject, relation, reference)
    distractors = [caption(subject, r, reference) for r in relations if r != relation]
    options = [true_caption, *distractors]
    options = [options[i] for i in rng.permutation(len(options))]
    correct = options.index(true_caption)
    size = config.image_size
    overlap = int((mask(subject, size) & mask(reference, size)).sum())
    truth = {
        "relation": relation,
        "relation_set": config.relation_set,
        "caption": true_caption,
        "options": options,
        "correct_index": correct,
        "subject": _object_truth(subject, roles, order, "subject", size),
        "reference": _object_truth(reference, roles, order, "reference", size),
        "draw_order": order,
        "overlap_px": overlap,
    }
    params = {"image_size": size, "relation_set": config.relation_set,
              "prompt_style": config.prompt_style}
    return Stimulus(
        id=f"spatial_{index:05d}",
        family=NAME,
        split=split,
        seed=sample_seed,
        image=image,
        prompts={"choice": build_prompt(options, config.prompt_style)},
        answers={"choice": LETTERS[correct]},
        truth=truth,
        params=params,
    )


def _object_truth(obj: Obj, roles: dict[str, Obj], order: list[str], role: str,
                  image_size: int) -> dict:
    own = mask(obj, image_size)
    above = order[order.index(role) + 1:]
    covered = np.zeros_like(own)
    for other in above:
        covered |= mask(roles[other], image_size)
    return {
        "shape": obj.shape,
        "colour": obj.colour,
        "rgb": list(COLOURS[obj.colour]),
        "centre": [obj.cx, obj.cy],
        "size": obj.size,
        "bbox": list(obj.bbox),
        "area_px": int(own.sum()),
        "visible_px": int((own & ~covered).sum()),
    }


@dataclass(frozen=True)
class SpatialTruth(Truth):
    """``relation``: where the subject is relative to the reference (left, right, above, ...).
    The caption, options, correct index and per-object geometry are descriptive keys."""

    relation: str


def score_answer(task: str, text: str, answer: str, truth: SpatialTruth) -> Score:
    """The strictly parsed option letter equals the shuffled answer's letter."""
    return compare(parse_choice_letter(text), answer)


FAMILY = Family(
    name=NAME,
    description="two objects left/right/above/below or front/behind, 4-way multiple choice (images-as-text)",
    config=Config,
    generate=generate,
    cells=lambda config: 1,  # no sweep: n in all
    truth=SpatialTruth,
    score=score_answer,
    small_set_n=64,  # in all: 16 of each relation
)
