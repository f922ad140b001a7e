"""Go boards for the counting lab (study counting-bottleneck: "visual counting bottleneck", Russellpang/semproj).

Each sample is a board with exactly ``count`` black stones and a random number of white
distractors, rendered as in the study's ``draw_board`` (background ``#DEB887``, black grid
lines of width 2 at ``k*cell + cell//2 - 1``, filled stones centred on the intersections, no
outline), plus the study's text twins and contrastive strings and its four questions.

Two geometry presets:

- ``paper``: 19x19 board, 14 px cells, stone radius 5 -> 266x266 px; one 14-px ViT patch per
  intersection, exactly the toy VLM's input.
- ``small``: 11x11 board, 8 px cells, radius 3 -> 88x88 px; still one stone per (8-px) patch and
  room for 0..120 black stones, so the toy model trains on CPUs.

``board_size``, ``cell_px`` and ``radius`` override a preset one by one.

The white count follows the study: ``min(U[max(0, n-R), n+R], cells - n)`` with R = 30 on the
19x19 board. On other boards R scales with the number of intersections,
``R = round(30 * board**2 / 361)`` (10 on 11x11, 3 on 6x6), so the distractor spread stays the
same fraction of the board; ``white_range`` sets R explicitly.

With the study's clean rendering every black-stone patch is one of a handful of exact pixel
patterns, so a per-token probe learns nothing by separating them. ``variation`` ("mild",
"strong") renders at 4x and downsamples (anti-aliasing), varies stone radius, sub-cell centre
and shade, board tint, and adds pixel noise; ``"none"`` (default) is pixel-exact to the study.
Every stone still covers its own intersection's centre pixel and stays inside its cell, so the
per-intersection labels remain the exact truth.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from stimuli.answers import parse_bool, parse_digit_string
from stimuli.base import (
    Family,
    Score,
    Stimulus,
    StimulusError,
    TaskInputs,
    Truth,
    check_choice,
    check_int_range,
    compare,
    derive_seed,
    exact_match,
    option,
    parse_int_ranges,
)

NAME = "go"

PRESETS: dict[str, dict[str, int]] = {
    "paper": {"board_size": 19, "cell_px": 14, "radius": 5},
    "small": {"board_size": 11, "cell_px": 8, "radius": 3},
}
BOARD_RGB = (0xDE, 0xB8, 0x87)  # "#DEB887" (burlywood), the study's board colour
LINE_WIDTH = 2
PAPER_WHITE_RANGE = 30
PAPER_CELLS = 19 * 19

BLACK, WHITE, EMPTY = 0, 1, 2
BOARD_CHARS = "XO."  # the study's str_c alphabet, indexed by label
# The study's Qwen text version maps X -> c, O -> b, . -> a; the target letter is always 'c'.
TEXT_CHARS = "cba"
TARGET = "c"

QUESTIONS = {
    "multimodal_num": "How many black stones are there on the chessboard ?",
    "text_only_num": "How many c letters are there in the given string ?",
    "multimodal_tf": (
        "Is the number of c letters in the given string the same as the number of black stones"
        " on the chessboard ?"
    ),
    "text_only_tf": "Are the number of c letters in both input strings the same ?",
}

# The study's domains: vision is trained on counts <= 49, text on <= 99.
REGIMES = ((49, "ID"), (99, "VE"))
FULL_EXTRAPOLATION = "FE"

SUPERSAMPLE = 4
MAX_ATTEMPTS = 10_000
# Each board's attempts must succeed with probability >= this, so MAX_ATTEMPTS all fail with
# probability <= (1 - 0.0025) ** 10_000 ~ 1e-11.
MIN_DRAW_SUCCESS = 0.0025


@dataclass(frozen=True)
class Variation:
    """How far a rendering may depart from the study's clean board."""

    radius_scale: tuple[float, float]  # stone radius = radius * U[lo, hi]
    jitter: float  # centre offset per axis up to this fraction of the drawn radius
    black_shade: int  # black stones are grey U[0, black_shade]
    white_shade: int  # white stones are grey U[255 - white_shade, 255]
    board_shift: int  # board colour: one brightness offset U[-shift, shift] ...
    board_tint: int  # ... plus a per-channel offset U[-tint, tint]
    noise_sigma: float  # Gaussian pixel noise, per channel, after downsampling


VARIATIONS: dict[str, Variation] = {
    "mild": Variation((0.85, 1.0), 0.2, 40, 40, 10, 3, 3.0),
    "strong": Variation((0.6, 1.0), 0.5, 80, 80, 20, 6, 8.0),
}


@dataclass(frozen=True)
class Config:
    preset: str = option("paper", "geometry preset: paper = 19x19, 14 px cells, r=5 (266 px);"
                         " small = 11x11, 8 px cells, r=3 (88 px)", choices=tuple(PRESETS))
    board_size: int = option(0, "intersections per side; 0 = from the preset")
    cell_px: int = option(0, "pixels per cell (one ViT patch per intersection); 0 = from the preset")
    radius: int = option(0, "stone radius in px (the stone spans 2*radius+1 px); 0 = from the preset")
    counts: str = option("0-120", "black-stone counts, e.g. 0-49,60,100-120; --n boards per count")
    white_range: int = option(-1, "R: white count = min(U[max(0,n-R), n+R], free cells);"
                              " -1 = 30 scaled by board area (30 on 19x19, 10 on 11x11)")
    variation: str = option("none", "appearance variation: none = pixel-exact study rendering;"
                            " mild / strong = anti-aliased, jittered, shaded, noisy",
                            choices=("none", *VARIATIONS))
    answer_format: str = option("plain", "count answers: plain = str(n) (expresses 0..120);"
                                " two_digit = the study's f'{n:02d}' (counts <= 99 only)",
                                choices=("plain", "two_digit"))


@dataclass(frozen=True)
class BoardLayout:
    """A validated config: the geometry and count list every sample is drawn from."""

    preset: str
    board_size: int
    cell_px: int
    radius: int
    white_range: int
    variation: str
    answer_format: str
    counts: tuple[int, ...]

    @property
    def cells(self) -> int:
        return self.board_size * self.board_size

    @property
    def image_px(self) -> int:
        return self.board_size * self.cell_px


def scaled_white_range(board_size: int) -> int:
    """The study's R = 30 on 19x19, scaled by intersection count for other boards."""
    return max(1, round(PAPER_WHITE_RANGE * board_size * board_size / PAPER_CELLS))


def regime(count: int) -> str:
    """ID (0-49, vision-trained), VE (50-99, text-only labels), FE (100+, never trained)."""
    for upper, name in REGIMES:
        if count <= upper:
            return name
    return FULL_EXTRAPOLATION


def format_count(count: int, answer_format: str) -> str:
    if answer_format == "two_digit":
        if not 0 <= count <= 99:
            raise StimulusError(
                f"answer_format='two_digit' cannot express {count}: use answer_format='plain'"
                " or counts within 0-99"
            )
        return f"{count:02d}"
    return str(count)


def board_layout(config: Config) -> BoardLayout:
    """Resolve the preset and overrides and reject impossible parameters, naming the fix."""
    check_choice("preset", config.preset, tuple(PRESETS))
    check_choice("variation", config.variation, ("none", *VARIATIONS))
    check_choice("answer_format", config.answer_format, ("plain", "two_digit"))
    base = PRESETS[config.preset]
    check_int_range("board_size", config.board_size, 0, 64, "use 0 for the preset's size")
    check_int_range("cell_px", config.cell_px, 0, 256, "use 0 for the preset's cell size")
    check_int_range("radius", config.radius, 0, 127, "use 0 for the preset's radius")
    check_int_range("white_range", config.white_range, -1, None, "use -1 for the scaled default")
    board = config.board_size or base["board_size"]
    cell = config.cell_px or base["cell_px"]
    radius = config.radius or base["radius"]
    if board < 2:
        raise StimulusError(f"board_size={board} is too small: use a board of at least 2x2")
    if cell < LINE_WIDTH + 2:
        raise StimulusError(f"cell_px={cell} leaves no room for a stone: use cell_px >= 4")
    if 2 * radius + 1 > cell:
        raise StimulusError(
            f"radius={radius} does not fit a {cell} px cell (a stone spans 2*radius+1 ="
            f" {2 * radius + 1} px): use radius <= {(cell - 1) // 2} or cell_px >= {2 * radius + 1}"
        )
    counts = parse_int_ranges(config.counts)
    if not counts:
        raise StimulusError(f"counts={config.counts!r} names no count: write e.g. 0-120")
    if counts[0] < 0:
        raise StimulusError(
            f"counts={config.counts!r} contains {counts[0]}: black-stone counts must be >= 0"
        )
    # A full board leaves no two distinct text twins (and only one board): keep one cell free.
    if counts[-1] >= board * board:
        raise StimulusError(
            f"count {counts[-1]} does not fit a {board}x{board} board ({board * board}"
            f" intersections, at most {board * board - 1} black stones): lower counts or raise"
            f" board_size to >= {math.isqrt(counts[-1]) + 1}"
        )
    if config.answer_format == "two_digit" and counts[-1] > 99:
        raise StimulusError(
            f"answer_format='two_digit' cannot express count {counts[-1]}: use"
            " answer_format='plain' or counts within 0-99"
        )
    white_range = scaled_white_range(board) if config.white_range < 0 else config.white_range
    return BoardLayout(config.preset, board, cell, radius, white_range, config.variation,
                config.answer_format, counts)


def white_counts(count: int, cells: int, white_range: int) -> set[int]:
    """Every white count the study's rule can produce for ``count`` black stones."""
    lo, hi = max(0, count - white_range), count + white_range
    return {min(w, cells - count) for w in range(lo, hi + 1)}


@dataclass(frozen=True)
class Pool:
    """What one count can draw from: boards grouped by white count, and the text strings."""

    groups: tuple[tuple[int, int], ...]  # per white count w': (draws of the 2R+1 giving w', boards)
    draws: int  # 2R+1, or fewer where n - R < 0
    strings: int  # strings of the board's length with n target letters

    @property
    def capacity(self) -> int:
        """Distinct boards with their text pairs: text_c and text_eq take 2 strings each."""
        return min(sum(size for _, size in self.groups), self.strings // 2)


def pool(layout: BoardLayout, count: int) -> Pool:
    cells = layout.cells
    lo, hi = max(0, count - layout.white_range), count + layout.white_range
    draws: dict[int, int] = {}
    for w in range(lo, hi + 1):
        draws[min(w, cells - count)] = draws.get(min(w, cells - count), 0) + 1
    placements = math.comb(cells, count)
    groups = tuple((k, placements * math.comb(cells - count, w)) for w, k in draws.items())
    return Pool(groups, hi - lo + 1, placements * 2 ** (cells - count))


def draw_success(pool: Pool, drawn: int) -> float:
    """A lower bound on the chance that one attempt finds a new board and strings after ``drawn``.

    The board is new unless it is one of the ``drawn`` taken, and those weigh at most as much as
    the ``drawn`` likeliest boards (a white count w' is drawn with probability #w/(2R+1), then
    one of its boards uniformly). text_c and text_eq are uniform over the strings, 2·drawn of
    them taken. Only int / int divisions: board counts exceed the float range.
    """
    taken, left = 0.0, drawn
    for k, size in sorted(pool.groups, key=lambda g: g[0] / (pool.draws * g[1]), reverse=True):
        take = min(left, size)
        taken, left = taken + (k * take) / (pool.draws * size), left - take
    free = pool.strings - 2 * drawn
    return max(1.0 - taken, 0.0) * (max(free, 0) / pool.strings) * (max(free - 1, 0) / pool.strings)


def reliable_limit(pool: Pool) -> int:
    """The most boards rejection sampling draws from ``pool`` without running out of attempts:
    the last board still succeeds with probability >= MIN_DRAW_SUCCESS per attempt."""
    lo, hi = 1, pool.capacity
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if draw_success(pool, mid - 1) >= MIN_DRAW_SUCCESS:
            lo = mid
        else:
            hi = mid - 1
    return lo


def check_capacity(layout: BoardLayout, n: int) -> None:
    """Fail before drawing when a count cannot give ``n`` distinct boards and text pairs, or
    could only by luck (rejection sampling starves on a count's last few boards)."""
    for count in layout.counts:
        p = pool(layout, count)
        where = f"count {count} on the {layout.board_size}x{layout.board_size} board"
        if n > p.capacity:
            raise StimulusError(
                f"{where} has only {p.capacity} distinct boards/text pairs, fewer than --n={n}:"
                " lower --n, drop that count, or use a larger board"
            )
        if draw_success(p, n - 1) < MIN_DRAW_SUCCESS:
            limit = reliable_limit(p)
            raise StimulusError(
                f"{where} has {p.capacity} distinct boards/text pairs, but random draws reach only"
                f" {limit} of them reliably, fewer than --n={n}: lower --n to {limit}, drop that"
                " count, or use a larger board"
            )


def draw_board(rng: np.random.Generator, count: int, cells: int, white_range: int) -> np.ndarray:
    """Per-intersection labels (0 black / 1 white / 2 empty), row-major, black placed first."""
    white = min(int(rng.integers(max(0, count - white_range), count + white_range + 1)),
                cells - count)
    slots = rng.permutation(cells)[: count + white]
    labels = np.full(cells, EMPTY, dtype=np.int8)
    labels[slots[:count]] = BLACK
    labels[slots[count:]] = WHITE
    return labels


def draw_string(rng: np.random.Generator, length: int, count: int) -> str:
    """``length`` letters with exactly ``count`` target 'c's; the rest uniformly 'a' or 'b'."""
    letters = np.where(rng.random(length) < 0.5, ord("a"), ord("b")).astype(np.uint8)
    letters[rng.permutation(length)[:count]] = ord(TARGET)
    return letters.tobytes().decode("ascii")


def draw_unequal_count(rng: np.random.Generator, length: int, count: int) -> int:
    """The study's ``randrange(length)`` redrawn until it differs from ``count``, in one draw."""
    if count >= length:
        return int(rng.integers(0, length))
    other = int(rng.integers(0, length - 1))
    return other + (other >= count)


def _grid_lines(draw: ImageDraw.ImageDraw, layout: BoardLayout, scale: int) -> None:
    # The study draws width-2 lines at k*cell + cell//2 - 1; PIL puts such a line on pixel rows
    # offset and offset+1, which these rectangles reproduce exactly at any integer scale.
    size = layout.image_px * scale
    for k in range(layout.board_size):
        offset = (k * layout.cell_px + layout.cell_px // 2 - 1) * scale
        draw.rectangle([0, offset, size - 1, offset + LINE_WIDTH * scale - 1], fill=(0, 0, 0))
        draw.rectangle([offset, 0, offset + LINE_WIDTH * scale - 1, size - 1], fill=(0, 0, 0))


def _centre(layout: BoardLayout, index: int) -> tuple[int, int]:
    row, col = divmod(index, layout.board_size)
    half = layout.cell_px // 2
    return col * layout.cell_px + half, row * layout.cell_px + half


def render_clean(layout: BoardLayout, labels: np.ndarray) -> tuple[Image.Image, list[dict]]:
    """The study's ``draw_board``, pixel for pixel."""
    img = Image.new("RGB", (layout.image_px, layout.image_px), BOARD_RGB)
    draw = ImageDraw.Draw(img)
    _grid_lines(draw, layout, 1)
    stones = []
    r = layout.radius
    for index in np.flatnonzero(labels != EMPTY):
        cx, cy = _centre(layout, int(index))
        shade = 0 if labels[index] == BLACK else 255
        draw.ellipse([(cx - r, cy - r), (cx + r, cy + r)], fill=(shade,) * 3)
        stones.append(_stone(layout, int(index), int(labels[index]), cx, cy, r, shade))
    return img, stones


def render_varied(layout: BoardLayout, labels: np.ndarray, rng: np.random.Generator,
                  style: Variation) -> tuple[Image.Image, list[dict], tuple[int, int, int]]:
    """Supersampled rendering with per-stone radius, offset and shade, board tint and noise."""
    s = SUPERSAMPLE
    shift = int(rng.integers(-style.board_shift, style.board_shift + 1))
    tint = rng.integers(-style.board_tint, style.board_tint + 1, size=3)
    red, green, blue = (int(np.clip(c + shift + t, 0, 255)) for c, t in zip(BOARD_RGB, tint, strict=True))
    board = (red, green, blue)
    img = Image.new("RGB", (layout.image_px * s,) * 2, board)
    draw = ImageDraw.Draw(img)
    _grid_lines(draw, layout, s)
    half, stones = layout.cell_px // 2, []
    for index in np.flatnonzero(labels != EMPTY):
        label = int(labels[index])
        rho = layout.radius * float(rng.uniform(*style.radius_scale))
        # Pixel-index coordinates: the clean stone spans pixels cx-r..cx+r, i.e. its edge lies
        # rho+0.5 from the centre. Offsets keep that disc inside the cell and within
        # jitter*rho of the intersection, so the centre pixel stays fully covered.
        reach = style.jitter * rho
        lo, hi = max(rho - half, -reach), min(layout.cell_px - half - rho - 1, reach)
        jx, jy = (float(rng.uniform(lo, hi)) for _ in range(2))
        if label == BLACK:
            shade = int(rng.integers(0, style.black_shade + 1))
        else:
            shade = int(rng.integers(255 - style.white_shade, 256))
        cx, cy = _centre(layout, int(index))
        x, y = cx + jx, cy + jy
        box = [round((x - rho) * s), round((y - rho) * s),
               round((x + rho + 1) * s) - 1, round((y + rho + 1) * s) - 1]
        draw.ellipse(box, fill=(shade,) * 3)
        stones.append(_stone(layout, int(index), label, x, y, rho, shade))
    small = np.asarray(img.reduce(s), dtype=np.float32)
    small = small + rng.normal(0.0, style.noise_sigma, size=small.shape).astype(np.float32)
    out = Image.fromarray(np.clip(np.rint(small), 0, 255).astype(np.uint8), "RGB")
    return out, stones, board


def _stone(layout: BoardLayout, index: int, label: int, x: float, y: float, radius: float,
           shade: int) -> dict:
    row, col = divmod(index, layout.board_size)
    return {"row": row, "col": col, "label": label, "cx": float(x), "cy": float(y),
            "radius": float(radius), "shade": shade}


@dataclass(frozen=True)
class Draw:
    """One accepted board with its strings, before rendering."""

    labels: np.ndarray
    text_c: str
    text_eq: str
    text_ie: str
    ie_count: int


def draw_sample(rng: np.random.Generator, layout: BoardLayout, count: int) -> Draw:
    cells = layout.cells
    labels = draw_board(rng, count, cells, layout.white_range)
    text_c, text_eq = draw_string(rng, cells, count), draw_string(rng, cells, count)
    ie_count = draw_unequal_count(rng, cells, count)
    return Draw(labels, text_c, text_eq, draw_string(rng, cells, ie_count), ie_count)


def generate(config: Config, n: int, seed: int, split: str) -> Iterator[Stimulus]:
    """``n`` unique boards for every count in ``config.counts``, in count order."""
    layout = board_layout(config)
    check_int_range("n", n, 1, None, "ask for at least one board per count")
    check_int_range("seed", seed, 0, None, "use a non-negative seed")
    check_capacity(layout, n)
    return _generate(layout, n, seed, split)


def _generate(layout: BoardLayout, n: int, seed: int, split: str) -> Iterator[Stimulus]:
    for count in layout.counts:
        seen_boards: set[bytes] = set()
        seen_strings: set[str] = set()
        for index in range(n):
            sample_seed, attempt, rng, drawn = _unique_draw(layout, seed, count, index,
                                                            seen_boards, seen_strings)
            yield _stimulus(layout, drawn, rng, count, index, attempt, sample_seed, split)


def _unique_draw(layout: BoardLayout, seed: int, count: int, index: int, seen_boards: set[bytes],
                 seen_strings: set[str]) -> tuple[int, int, np.random.Generator, Draw]:
    # Each attempt has its own derived seed, so a sample is reproducible from the recorded
    # seed alone and one count's retries never shift another count's boards.
    for attempt in range(MAX_ATTEMPTS):
        sample_seed = derive_seed(seed, count, index, attempt)
        rng = np.random.default_rng(sample_seed)
        drawn = draw_sample(rng, layout, count)
        key = drawn.labels.tobytes()
        if (key in seen_boards or drawn.text_c == drawn.text_eq
                or drawn.text_c in seen_strings or drawn.text_eq in seen_strings):
            continue
        seen_boards.add(key)
        seen_strings.update((drawn.text_c, drawn.text_eq))
        return sample_seed, attempt, rng, drawn
    raise StimulusError(
        f"count {count}: no new unique board after {MAX_ATTEMPTS} attempts (board {index}):"
        " lower --n or use a larger board"
    )


def _stimulus(layout: BoardLayout, drawn: Draw, rng: np.random.Generator, count: int, index: int,
              attempt: int, sample_seed: int, split: str) -> Stimulus:
    if layout.variation == "none":
        image, stones = render_clean(layout, drawn.labels)
        board_rgb = BOARD_RGB
    else:
        image, stones, board_rgb = render_varied(layout, drawn.labels, rng, VARIATIONS[layout.variation])
    labels = drawn.labels.tolist()
    # The TF tasks alternate equal / unequal pairs by board index, as in the study's training.
    equal = index % 2 == 0
    number = format_count(count, layout.answer_format)
    truth_value = "True" if equal else "False"
    answers = {"multimodal_num": number, "text_only_num": number,
               "multimodal_tf": truth_value, "text_only_tf": truth_value}
    truth = {
        "count": count,
        "n_white": labels.count(WHITE),
        "n_empty": labels.count(EMPTY),
        "regime": regime(count),
        "labels": labels,
        "board_str": "".join(BOARD_CHARS[v] for v in labels),
        "text_board": "".join(TEXT_CHARS[v] for v in labels),
        "text_c": drawn.text_c,
        "text_eq": drawn.text_eq,
        "text_ie": drawn.text_ie,
        "ie_count": drawn.ie_count,
        "tf_pair": "eq" if equal else "ie",
        "board_rgb": list(board_rgb),
        "stones": stones,
    }
    params = {
        "preset": layout.preset,
        "board_size": layout.board_size,
        "cell_px": layout.cell_px,
        "radius": layout.radius,
        "white_range": layout.white_range,
        "variation": layout.variation,
        "answer_format": layout.answer_format,
        "attempt": attempt,
    }
    return Stimulus(
        id=f"go_{count:03d}_{index:05d}",
        family=NAME,
        split=split,
        seed=sample_seed,
        image=image,
        prompts=dict(QUESTIONS),
        answers=answers,
        truth=truth,
        params=params,
    )


def task_inputs(truth: Mapping[str, Any], task: str) -> TaskInputs:
    """The study's inputs per task: the board and/or its text twin, and the contrastive partner
    string (equal or unequal count, alternating by board)."""
    partner = truth["text_eq"] if truth["tf_pair"] == "eq" else truth["text_ie"]
    if task == "multimodal_num":
        return TaskInputs(image=True)
    if task == "text_only_num":
        return TaskInputs(image=False, strings=(truth["text_c"],))
    if task == "multimodal_tf":
        return TaskInputs(image=True, strings=(partner,))
    if task == "text_only_tf":
        return TaskInputs(image=False, strings=(truth["text_c"], partner))
    raise StimulusError(f"unknown Go task {task!r}: choose one of {', '.join(QUESTIONS)}")


@dataclass(frozen=True)
class GoTruth(Truth):
    """``count``: black stones; ``labels``: BLACK / WHITE / EMPTY per intersection, row by row;
    ``regime``: ID / VE / FE by count. The text twins and stone geometry are descriptive keys."""

    count: int
    labels: list[int]
    regime: str


def score_answer(task: str, text: str, answer: str, truth: GoTruth) -> Score:
    """``*_num``: the joined digits equal the count; ``*_tf``: the first true/false (yes/no) word
    equals the reference."""
    if task.endswith("_num"):
        return compare(parse_digit_string(text), truth.count)
    if task.endswith("_tf"):
        return compare(parse_bool(text), answer)
    return exact_match(task, text, answer, truth)


FAMILY = Family(
    name=NAME,
    description="Go boards with exact black-stone counts, text twins and contrastive pairs (counting-bottleneck)",
    config=Config,
    generate=generate,
    cells=lambda config: len(board_layout(config).counts),  # one per black-stone count
    truth=GoTruth,
    score=score_answer,
    small_set_n=2,  # per count: 2 x 121 counts of the default sweep
    task_inputs=task_inputs,
)
