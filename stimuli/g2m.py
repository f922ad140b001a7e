"""Grid2Matrix colour grids (study g2m), exactly as the study's ``generate_data.py`` draws them.

An N×N grid of C palette colours on a white 512 px canvas; the model transcribes it into a
matrix. What must match the study bit for bit (docs/studies.md#g2m-generator to #g2m-metrics):

- palette RGBs and the colour-name order (White, Red, Blue, Green, …) behind the prompt's
  ``{White: 0, Red: 1, ...}`` mapping;
- float cell size with ``round()`` edges and PIL's inclusive rectangles, so neighbouring cells
  overlap by one pixel and the later cell wins (internal lines ≈ 2·lw−1 px, border lw px);
- outline (60, 60, 60) with width 0 / 2 / clamp(int(0.05·cell), 2, 10);
- ``random`` grids: ``default_rng(seed + i)``, draw, force every colour once, shuffle;
- the parser cascade of ``run_vlm_zeroshot.py`` (list of lists → ``ROW{i}=`` lines → all
  integers) and the metrics' denominators (a failed parse scores 0 cells but still counts all
  H·W cells)."""

from __future__ import annotations

import ast
import re
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from stimuli.base import (
    Family,
    Score,
    Stimulus,
    StimulusError,
    Truth,
    TruthError,
    check_choice,
    check_int_range,
    option,
)

PALETTE: tuple[tuple[str, tuple[int, int, int]], ...] = (
    ("White", (255, 255, 255)),
    ("Red", (205, 78, 78)),
    ("Blue", (72, 105, 200)),
    ("Green", (85, 168, 104)),
    ("Orange", (221, 163, 85)),
    ("Purple", (153, 102, 204)),
    ("Yellow", (235, 215, 90)),
    ("Cyan", (100, 180, 190)),
    ("Pink", (215, 120, 155)),
    ("Brown", (160, 130, 110)),
)
OUTLINE = (60, 60, 60)
STRATEGIES = ("random", "stripes", "vertical_stripes", "checkerboard")
PAPER_GRID_SIZES = (3, 6, 9, 12, 20, 32, 48, 64)
MIN_GRID, MAX_GRID = 3, 128
MIN_COLORS, MAX_COLORS = 3, len(PALETTE)

PROMPT_TEMPLATE = """You are a precise grid serialization engine.
Task: Transcribe the {h}x{w} pixel grid from the image into a numerical matrix.
Color Mapping: {mapping}.

Instructions:
1. Scan the grid row by row, from top to bottom.
2. For each row, map every cell using the color mapping.
3. Ensure the output has exactly {h} rows and {w} columns.

Output Format:
Return ONLY a Python list of lists (e.g., [[0, 1], [2, 0]]). Do not use markdown, code blocks, or explanations."""


@dataclass(frozen=True)
class Config:
    grid_sizes: tuple[int, ...] = option(PAPER_GRID_SIZES, "grid sizes N (N×N cells), each in 3..128")
    colors: tuple[int, ...] = option((3,), "numbers of colours C, each in 3..10")
    strategy: str = option("random", "how cells are coloured", choices=STRATEGIES)
    image_size: int = option(512, "canvas side in pixels")

    def __post_init__(self) -> None:
        if not self.grid_sizes:
            raise StimulusError("grid_sizes is empty: give at least one N, e.g. --grid-sizes 3 6 9")
        for n in self.grid_sizes:
            check_int_range("grid size N", n, MIN_GRID, MAX_GRID, "Use --grid-sizes with values in 3..128.")
        if not self.colors:
            raise StimulusError("colors is empty: give at least one C, e.g. --colors 3")
        for c in self.colors:
            check_int_range("colours C", c, MIN_COLORS, MAX_COLORS,
                            "The palette has 10 named colours; use --colors with values in 3..10.")
        check_choice("strategy", self.strategy, STRATEGIES)
        check_int_range("image_size", self.image_size, 32, 8192)
        for n in self.grid_sizes:
            if self.image_size / n < 1:
                raise StimulusError(
                    f"image_size={self.image_size} is smaller than the grid N={n}: every cell needs at"
                    " least one pixel; raise --image-size or lower --grid-sizes"
                )


def color_mapping(num_colors: int) -> str:
    """``{White: 0, Red: 1, Blue: 2}`` for C=3: the study's mapping string, unquoted names."""
    return "{" + ", ".join(f"{name}: {i}" for i, (name, _) in enumerate(PALETTE[:num_colors])) + "}"


def prompt(h: int, w: int, num_colors: int) -> str:
    return PROMPT_TEMPLATE.format(h=h, w=w, mapping=color_mapping(num_colors))


def max_new_tokens(h: int, w: int) -> int:
    """The study's generation budget for an h×w grid."""
    return min(4 * h * w + 20 * h + 50, 2048)


def make_matrix(n: int, num_colors: int, strategy: str, seed: int) -> np.ndarray:
    """The N×N colour-index matrix; ``seed`` matters only for ``random``."""
    i, j = np.indices((n, n))
    if strategy == "stripes":
        return (i % num_colors).astype(np.int64)
    if strategy == "vertical_stripes":
        return (j % num_colors).astype(np.int64)
    if strategy == "checkerboard":
        return ((i + j) % num_colors).astype(np.int64)
    rng = np.random.default_rng(seed)
    flat = rng.integers(0, num_colors, n * n)
    if num_colors <= n * n:
        # Every colour appears at least once; the shuffle scatters the forced cells.
        flat[:num_colors] = np.arange(num_colors)
        rng.shuffle(flat)
    return flat.reshape(n, n)


def line_width(cell: float) -> int:
    if cell < 4:
        return 0
    if cell < 20:
        return 2
    return max(2, min(int(0.05 * cell), 10))


def cell_boxes(n: int, image_size: int) -> np.ndarray:
    """``[n, n, 4]`` inclusive pixel boxes (x1, y1, x2, y2) exactly as the study rounds them."""
    cell = image_size / n
    # Python's round() on floats, as the study does: ties go to even (e.g. 2.5 -> 2).
    edges = np.array([round(k * cell) for k in range(n + 1)])
    boxes = np.empty((n, n, 4), dtype=np.int64)
    boxes[..., 0] = edges[None, :-1]
    boxes[..., 1] = edges[:-1, None]
    boxes[..., 2] = edges[None, 1:]
    boxes[..., 3] = edges[1:, None]
    return boxes


def cell_centres(n: int, image_size: int) -> np.ndarray:
    """``[n, n, 2]`` integer (x, y) pixel centres, always inside the cell's fill."""
    boxes = cell_boxes(n, image_size)
    return np.stack([(boxes[..., 0] + boxes[..., 2]) // 2, (boxes[..., 1] + boxes[..., 3]) // 2], axis=-1)


def render(matrix: np.ndarray, image_size: int) -> Image.Image:
    n = matrix.shape[0]
    lw = line_width(image_size / n)
    img = Image.new("RGB", (image_size, image_size), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    boxes = cell_boxes(n, image_size)
    colours = [rgb for _, rgb in PALETTE]
    for i in range(n):
        for j in range(n):
            x1, y1, x2, y2 = boxes[i, j].tolist()
            draw.rectangle([x1, y1, x2, y2], fill=colours[matrix[i, j]], outline=OUTLINE, width=lw)
    return img


def generate(config: Config, n: int, seed: int, split: str) -> Iterator[Stimulus]:
    """``n`` grids per (N, C) pair; sample i of every pair uses seed ``seed + i``, as the study does."""
    for grid in config.grid_sizes:
        for num_colors in config.colors:
            for i in range(n):
                sample_seed = seed + i
                matrix = make_matrix(grid, num_colors, config.strategy, sample_seed)
                text = prompt(grid, grid, num_colors)
                yield Stimulus(
                    id=f"g2m-n{grid:03d}-c{num_colors:02d}-{config.strategy}-{i:05d}",
                    family="g2m",
                    split=split,
                    seed=sample_seed,
                    image=render(matrix, config.image_size),
                    prompts={"transcribe": text},
                    answers={"transcribe": str(matrix.tolist())},
                    truth={"matrix": matrix.tolist()},
                    params={
                        "grid_size": grid,
                        "num_colors": num_colors,
                        "strategy": config.strategy,
                        "image_size": config.image_size,
                        "cell_px": config.image_size / grid,
                        "line_width": line_width(config.image_size / grid),
                        "max_new_tokens": max_new_tokens(grid, grid),
                    },
                )


# --- parsing and metrics -----------------------------------------------------------------

# The study's step-1 pattern. Python's backtracking engine needs exponential time on it when the
# closing "]" is missing, e.g. a long list cut off by the token cap, so it is documented here
# and matched by ``_first_list_of_lists``, which returns the same match in linear time.
LIST_OF_LISTS_PATTERN = r"\[\s*\[.*?\]\s*(?:,\s*\[.*?\]\s*)*\]"
_ROW_VALUES = r"\[([0-9,\s-]+)\]"
_NO_MATCH = -1


def _first_list_of_lists(s: str) -> str | None:
    """``re.search(LIST_OF_LISTS_PATTERN, s, re.DOTALL)``'s match text, found in linear time.

    The regex's backtracking order decides which text it returns: the leftmost ``[``, then the
    shortest first element, then as many further elements as can still be closed by ``]``, each
    as short as possible. Whether (and where) the rest of a match closes depends only on the
    position it continues from, so one right-to-left pass computes, for every position, the
    match end the regex would reach from there (``after_elem``: continue after an element; ``from_close``: the
    first ``]`` at or after a position whose continuation closes).
    """
    n = len(s)
    skip_ws = [n] * (n + 1)  # first non-whitespace index >= i (re's \s is str.isspace)
    for i in range(n - 1, -1, -1):
        skip_ws[i] = skip_ws[i + 1] if s[i].isspace() else i
    after_elem = [_NO_MATCH] * (n + 1)
    from_close = [_NO_MATCH] * (n + 1)
    for i in range(n - 1, -1, -1):
        if s[i] == "]":
            # lazy ".*?\]" tries this "]" first, then the later ones
            here = after_elem[skip_ws[i + 1]]
            from_close[i] = here if here != _NO_MATCH else from_close[i + 1]
        else:
            from_close[i] = from_close[i + 1]
        # greedy "(?:,\s*\[.*?\]\s*)*": one more element first, else close with "]"
        if s[i] == ",":
            y = skip_ws[i + 1]
            if y < n and s[y] == "[":
                after_elem[i] = from_close[y + 1]
        elif s[i] == "]":
            after_elem[i] = i + 1
    for p in range(n):
        if s[p] == "[":
            q = skip_ws[p + 1]
            if q < n and s[q] == "[" and from_close[q + 1] != _NO_MATCH:
                return s[p:from_close[q + 1]]
    return None


def _int_matrix(values: list, h: int, w: int) -> np.ndarray:
    """An h×w matrix of ``values``; ints beyond int64 stay Python ints (an object array).

    The study's ``np.array`` turns such values into float64 or object arrays and scores them;
    they are never a colour index, so the cell is wrong either way.
    """
    try:
        arr = np.array(values, dtype=np.int64)
    except OverflowError:
        arr = np.array(values, dtype=object)
    return arr.reshape(h, w)


def _literal_matrix(s: str, h: int, w: int) -> np.ndarray | None:
    """Step 1: the first list of lists, ``ast.literal_eval``-ed, if it is an h×w int64 array."""
    found = _first_list_of_lists(s)
    if found is None:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # literal_eval warns on odd escapes inside strings
            arr = np.array(ast.literal_eval(found), dtype=np.int64)
    except Exception:  # noqa: BLE001 - the study's bare except: whatever literal_eval or int64 refuses
        return None
    return arr if arr.shape == (h, w) else None


def _row_matrix(s: str, h: int, w: int) -> np.ndarray | None:
    r"""Step 2: ``ROW{i}=[a, b, ...]`` lines, split on commas after deleting spaces, as the study does.

    ``ROW1=[0 1]`` reads as the single value 1 (not two), and any piece ``int()`` refuses
    (``0\t1``, ``1-2``, a bare ``-``) abandons the whole step.
    """
    rows = []
    for i in range(1, h + 1):
        m = re.search(rf"ROW{i}={_ROW_VALUES}", s)
        if m is None:
            return None
        try:
            values = [int(x) for x in m.group(1).replace(" ", "").split(",") if x]
        except ValueError:
            return None
        if len(values) != w:
            return None
        rows.append(values)
    return _int_matrix(rows, h, w)


def parse_grid(text: str | None, h: int, w: int) -> np.ndarray | None:
    """The study's three-step cascade; ``None`` when no step yields an h×w integer matrix.

    Never raises: every text, however malformed, parses or is ``None``.
    """
    if text is None:
        return None
    s = text.strip().replace("```python", "").replace("```", "").strip()
    arr = _literal_matrix(s, h, w)
    if arr is not None:
        return arr
    if "ROW1=" in s:
        arr = _row_matrix(s, h, w)
        if arr is not None:
            return arr
    numbers = re.findall(r"\d+", s)
    if len(numbers) != h * w:
        return None
    try:
        values = [int(v) for v in numbers]
    except ValueError:
        # A number over Python's 4300-digit int() limit: the study's code raises here; we count
        # the transcription as unparsed (wrong, all H·W cells in the denominator).
        return None
    return _int_matrix(values, h, w)


@dataclass(frozen=True)
class GridScore:
    """One transcription scored against its truth."""

    parsed: np.ndarray | None
    exact: bool
    cells_correct: int
    cells_total: int

    @property
    def parse_ok(self) -> bool:
        return self.parsed is not None


def score(text: str | None, truth: Sequence[Sequence[int]] | np.ndarray) -> GridScore:
    gt = np.asarray(truth, dtype=np.int64)
    parsed = parse_grid(text, *gt.shape)
    if parsed is None:
        return GridScore(None, False, 0, gt.size)
    correct = int(np.count_nonzero(parsed == gt))
    return GridScore(parsed, correct == gt.size, correct, gt.size)


@dataclass(frozen=True)
class GridMetrics:
    exact_match: float
    cell_accuracy: float
    samples: int
    parse_failures: int


def metrics(scores: Sequence[GridScore]) -> GridMetrics:
    """Exact Match over samples and Cell Accuracy over all ground-truth cells (paper denominators)."""
    if not scores:
        raise ValueError("metrics of an empty list: score at least one transcription")
    return GridMetrics(
        exact_match=sum(s.exact for s in scores) / len(scores),
        cell_accuracy=sum(s.cells_correct for s in scores) / sum(s.cells_total for s in scores),
        samples=len(scores),
        parse_failures=sum(not s.parse_ok for s in scores),
    )


@dataclass(frozen=True)
class G2MTruth(Truth):
    """``matrix``: the N x N colour indices, row by row (what a transcription must equal)."""

    matrix: list[list[int]]

    def __post_init__(self) -> None:
        widths = {len(row) if isinstance(row, list) else -1 for row in self.matrix}
        if not self.matrix or len(widths) != 1 or -1 in widths:
            raise TruthError(
                f"g2m truth 'matrix' must be a non-empty list of equal-length rows, got {str(self.matrix)[:60]}"
            )


def score_answer(task: str, text: str, answer: str, truth: G2MTruth) -> Score:
    """The study's parse cascade; right when the whole grid matches (EM), scored by cells right."""
    s = score(text, truth.matrix)
    return Score(
        prediction=None if s.parsed is None else s.parsed.tolist(),
        parse_ok=s.parse_ok,
        correct=s.exact,
        score=s.cells_correct / s.cells_total,
        metrics={"cells_correct": s.cells_correct, "cells_total": s.cells_total},
    )


FAMILY = Family(
    name="g2m",
    description="Grid2Matrix colour grids: N×N cells of C palette colours to transcribe (study g2m)",
    config=Config,
    generate=generate,
    cells=lambda config: len(config.grid_sizes) * len(config.colors),
    truth=G2MTruth,
    score=score_answer,
    small_set_n=8,  # per (grid size, colour count) cell
)
