"""Grid2Matrix grids: rendering as the study draws them, the exact prompt, parser and metrics."""

from __future__ import annotations

import io
import random
import re
import time

import numpy as np
import pytest

from stimuli import StimulusError, get_family
from stimuli.g2m import (
    OUTLINE,
    PALETTE,
    Config,
    _first_list_of_lists,
    cell_boxes,
    cell_centres,
    color_mapping,
    generate,
    line_width,
    make_matrix,
    metrics,
    parse_grid,
    prompt,
    score,
)

RGB = np.array([rgb for _, rgb in PALETTE])


def png_bytes(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def one(grid: int, colors: int = 3, seed: int = 0, strategy: str = "random", image_size: int = 512):
    return next(generate(Config(grid_sizes=(grid,), colors=(colors,), strategy=strategy,
                                image_size=image_size), n=1, seed=seed, split="test"))


def test_same_seed_same_bytes_and_truth_other_seed_differs():
    a, b, c = one(12, seed=7), one(12, seed=7), one(12, seed=8)
    assert png_bytes(a.image) == png_bytes(b.image)
    assert a.truth == b.truth
    assert a.truth != c.truth
    assert png_bytes(a.image) != png_bytes(c.image)


def test_random_matrix_follows_the_study_recipe():
    # default_rng(seed) -> integers -> force every colour once -> shuffle, replayed by hand.
    rng = np.random.default_rng(42)
    flat = rng.integers(0, 4, 36)
    for c in range(4):
        flat[c] = c
    rng.shuffle(flat)
    assert np.array_equal(make_matrix(6, 4, "random", 42), flat.reshape(6, 6))


@pytest.mark.parametrize("grid", [3, 4, 7, 9, 12, 20, 32, 48, 64, 100, 128])
@pytest.mark.parametrize("colors", [3, 10])
def test_every_cell_centre_has_its_palette_colour(grid, colors):
    stim = one(grid, colors, seed=grid)
    matrix = np.array(stim.truth["matrix"])
    assert matrix.shape == (grid, grid)
    if colors <= grid * grid:  # every colour is forced at least once where it fits
        assert set(np.unique(matrix).tolist()) == set(range(colors))
    pixels = np.asarray(stim.image)
    centres = cell_centres(grid, 512)
    assert np.array_equal(pixels[centres[..., 1], centres[..., 0]], RGB[matrix])


@pytest.mark.parametrize(
    ("grid", "expected"), [(3, 8), (4, 6), (5, 5), (8, 3), (10, 2), (64, 2), (128, 2), (129, 0), (200, 0)]
)
def test_line_width_rule_at_512px(grid, expected):
    assert line_width(512 / grid) == expected


def test_grid_lines_are_dark_grey_and_twice_the_width_minus_one_inside():
    stim = one(4, strategy="checkerboard")  # 128 px cells, lw 6
    pixels = np.asarray(stim.image)
    x_line = cell_boxes(4, 512)[0, 1, 0]  # left edge of column 1 == right edge of column 0
    row = pixels[64]  # a scanline through the middle of row 0
    dark = np.all(row == OUTLINE, axis=-1)
    run = np.flatnonzero(dark[x_line - 10 : x_line + 10])
    assert len(run) == 2 * 6 - 1 and run[-1] - run[0] == 2 * 6 - 2
    assert np.all(pixels[0] == OUTLINE) and np.all(pixels[:, 0] == OUTLINE)  # outer border


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [("stripes", [[0, 0, 0], [1, 1, 1], [2, 2, 2]]), ("vertical_stripes", [[0, 1, 2]] * 3),
     ("checkerboard", [[0, 1, 2], [1, 2, 0], [2, 0, 1]])],
)
def test_structured_strategies(strategy, expected):
    assert one(3, strategy=strategy).truth["matrix"] == expected


def test_prompt_is_the_studys_text():
    assert color_mapping(3) == "{White: 0, Red: 1, Blue: 2}"
    text = prompt(6, 6, 4)
    assert text.startswith("You are a precise grid serialization engine.\nTask: Transcribe the 6x6 pixel grid")
    assert "Color Mapping: {White: 0, Red: 1, Blue: 2, Green: 3}.\n\nInstructions:\n" in text
    assert "3. Ensure the output has exactly 6 rows and 6 columns.\n\nOutput Format:\n" in text
    assert text.endswith("Do not use markdown, code blocks, or explanations.")
    stim = one(6, 4)
    assert stim.prompt == text and stim.params["max_new_tokens"] == 4 * 36 + 20 * 6 + 50


def test_ids_are_unique_across_a_sweep():
    stims = list(generate(Config(grid_sizes=(3, 6), colors=(3, 4)), n=3, seed=0, split="test"))
    assert len(stims) == 12 and len({s.id for s in stims}) == 12


@pytest.mark.parametrize(
    "kwargs",
    [dict(grid_sizes=(0,)), dict(grid_sizes=(2,)), dict(grid_sizes=(129,)), dict(colors=(11,)),
     dict(colors=(2,)), dict(strategy="diagonal"), dict(grid_sizes=()), dict(image_size=64, grid_sizes=(128,))],
)
def test_bad_parameters_are_refused_with_the_fix(kwargs):
    with pytest.raises(StimulusError) as err:
        Config(**kwargs)
    assert any(word in str(err.value) for word in ("expected", "not one of", "give at least", "raise"))


GT = [[0, 1, 2], [2, 1, 0], [1, 1, 1]]


@pytest.mark.parametrize(
    "text",
    [
        "[[0, 1, 2], [2, 1, 0], [1, 1, 1]]",
        "```python\n[[0,1,2],\n [2,1,0],\n [1,1,1]]\n```",
        "Sure! Here is the matrix:\n[[0, 1, 2], [2, 1, 0], [1, 1, 1]]\nLet me know if you need more.",
        "ROW1=[0, 1, 2]\nROW2=[2, 1, 0]\nROW3=[1, 1, 1]",
        "0 1 2\n2 1 0\n1 1 1",
        # A wrongly shaped list falls through to the integer count, which has 9 values.
        "[[0, 1, 2, 2, 1, 0, 1, 1, 1]]",
    ],
)
def test_parser_reads_realistic_outputs(text):
    parsed = parse_grid(text, 3, 3)
    assert parsed is not None and parsed.tolist() == GT


@pytest.mark.parametrize(
    "text",
    ["", None, "I cannot see the image.", "[[0, 1], [2, 1]]", "[[0, 1, 2], [2, 1, 0]]",
     "ROW1=[0, 1, 2]\nROW2=[2, 1]\nROW3=[1, 1, 1] and 4 more"],
)
def test_parser_refuses_what_is_not_a_3x3_matrix(text):
    assert parse_grid(text, 3, 3) is None


def test_first_list_wins_even_if_a_later_one_is_right():
    # The study takes the first list-of-lists match; a wrong first list falls through to digits.
    text = "[[9, 9, 9], [9, 9, 9], [9, 9, 9]] no wait: [[0, 1, 2], [2, 1, 0], [1, 1, 1]]"
    assert parse_grid(text, 3, 3).tolist() == [[9, 9, 9]] * 3


def test_metrics_use_the_papers_denominators():
    perfect = score("[[0, 1, 2], [2, 1, 0], [1, 1, 1]]", GT)
    one_off = score("[[0, 1, 2], [2, 1, 0], [1, 1, 2]]", GT)
    failed = score("no idea", GT)
    assert (perfect.exact, perfect.cells_correct) == (True, 9)
    assert (one_off.exact, one_off.cells_correct) == (False, 8)
    assert (failed.parse_ok, failed.cells_correct, failed.cells_total) == (False, 0, 9)
    m = metrics([perfect, one_off, failed])
    assert m.exact_match == pytest.approx(1 / 3)
    assert m.cell_accuracy == pytest.approx(17 / 27)  # the failed parse still adds 9 cells
    assert m.parse_failures == 1


def test_family_is_registered():
    assert get_family("g2m").config is Config


HUGE = 11111111111111111111  # >= 2**63: int64 refuses it, the study's np.array keeps it
# What the study's parser (run_vlm_zeroshot.py, parse_output) returns for a 3x3 grid, worked
# out by hand from its three steps; None is its parse error.
STUDY_TABLE = [
    ("clean", "[[0, 1, 2], [2, 1, 0], [1, 1, 1]]", GT),
    ("fenced python", "```python\n[[0,1,2],[2,1,0],[1,1,1]]\n```", GT),
    ("fenced plain", "```\n[[0, 1, 2],\n [2, 1, 0],\n [1, 1, 1]]\n```", GT),
    ("prose around", "Here it is: [[0, 1, 2], [2, 1, 0], [1, 1, 1]] Hope this helps.", GT),
    ("numbers in the prose, list wins", "The 3x3 grid: [[0, 1, 2], [2, 1, 0], [1, 1, 1]]", GT),
    ("wrong size 2x3", "[[0, 1, 2], [2, 1, 0]]", None),
    ("wrong size 4x3", "[[0, 1, 2], [2, 1, 0], [1, 1, 1], [0, 0, 0]]", None),
    # ragged: np.array(..., dtype=int) raises, the 9 integers then fill the grid row-major
    ("ragged", "[[0, 1, 2], [2, 1], [0, 1, 1, 1]]", GT),
    ("flat list", "[0, 1, 2, 2, 1, 0, 1, 1, 1]", GT),
    ("one row of nine", "[[0, 1, 2, 2, 1, 0, 1, 1, 1]]", GT),
    ("truncated list", "[[0, 1, 2], [2, 1, 0], [1, 1", None),
    ("first list closes early", "[[0, 1, 2]] and [[2, 1, 0], [1, 1, 1]]", GT),
    ("three levels", "[[[0, 1, 2], [2, 1, 0], [1, 1, 1]]]", GT),
    ("floats truncate", "[[0.0, 1.9, 2.0], [2.0, 1.0, 0.0], [1.0, 1.0, 1.0]]", GT),
    ("quoted digits", "[['0', '1', '2'], ['2', '1', '0'], ['1', '1', '1']]", GT),
    ("negative", "[[0, -1, 2], [2, 1, 0], [1, 1, 1]]", [[0, -1, 2], [2, 1, 0], [1, 1, 1]]),
    ("huge integer", f"[[0, 1, 2], [2, 1, 0], [1, 1, {HUGE}]]", [[0, 1, 2], [2, 1, 0], [1, 1, HUGE]]),
    ("arabic-indic digits", "[[٠, ١, ٢], [٢, ١, ٠], [١, ١, ١]]", GT),
    ("ROW with commas", "ROW1=[0, 1, 2]\nROW2=[2, 1, 0]\nROW3=[1, 1, 1]", GT),
    # spaces are deleted before the comma split: "012" is one value, and the row labels'
    # digits make 12 integers for step 3
    ("ROW without commas", "ROW1=[0 1 2]\nROW2=[2 1 0]\nROW3=[1 1 1]", None),
    ("ROW mixed", "ROW1=[0, 1, 2]\nROW2=[2 1 0]\nROW3=[1, 1, 1]", None),
    ("ROW with a tab", "ROW1=[0\t1\t2]\nROW2=[2, 1, 0]\nROW3=[1, 1, 1]", None),
    ("ROW with newlines", "ROW1=[0,\n1,\n2]\nROW2=[2, 1, 0]\nROW3=[1, 1, 1]", GT),
    ("ROW negative", "ROW1=[0, -1, 2]\nROW2=[2, 1, 0]\nROW3=[1, 1, 1]", [[0, -1, 2], [2, 1, 0], [1, 1, 1]]),
    ("ROW missing a row", "ROW1=[0, 1, 2]\nROW3=[1, 1, 1]", None),
    ("ROW short row", "ROW1=[0, 1, 2]\nROW2=[2, 1]\nROW3=[1, 1, 1]", None),
    ("ROW trailing comma", "ROW1=[0, 1, 2,]\nROW2=[2, 1, 0]\nROW3=[1, 1, 1]", GT),
    ("ROW spaced equals", "ROW1 = [0, 1, 2]\nROW2 = [2, 1, 0]\nROW3 = [1, 1, 1]", None),
    ("nine loose integers", "0 1 2\n2 1 0\n1 1 1", GT),
    ("garbage", "I cannot see the image.", None),
    ("empty", "", None),
    ("none", None, None),
]


@pytest.mark.parametrize(("text", "expected"), [row[1:] for row in STUDY_TABLE], ids=[row[0] for row in STUDY_TABLE])
def test_parser_matches_the_study_on_malformed_outputs(text, expected):
    parsed = parse_grid(text, 3, 3)
    assert (None if parsed is None else parsed.tolist()) == expected


def test_row_step_splits_on_commas_only():
    # The study reads "0 1" as the single value 1: a 3x1 grid parses, a 1x2 grid does not.
    assert parse_grid("ROW1=[0 1]\nROW2=[1]\nROW3=[2]", 3, 1).tolist() == [[1], [1], [2]]
    assert parse_grid("ROW1=[0 1]", 1, 2) is None
    assert parse_grid("ROW1=[0, 1]", 1, 2).tolist() == [[0, 1]]


def test_huge_integers_score_as_wrong_cells():
    s = score(f"[[0, 1, 2], [2, 1, 0], [1, 1, {HUGE}]]", GT)
    assert (s.parse_ok, s.exact, s.cells_correct, s.cells_total) == (True, False, 8, 9)


def test_list_matcher_equals_the_studys_regex():
    # The study's pattern backtracks exponentially on unclosed lists, so compare on short texts.
    pattern = re.compile(r"\[\s*\[.*?\]\s*(?:,\s*\[.*?\]\s*)*\]", re.DOTALL)
    rng = random.Random(7)
    for _ in range(20_000):
        text = "".join(rng.choice("[[[]]], ,\n1x\u2003") for _ in range(rng.randint(0, 14)))
        m = pattern.search(text)
        assert _first_list_of_lists(text) == (m.group(0) if m else None), repr(text)


def test_a_long_unclosed_list_parses_in_linear_time():
    # 40 rows cut off by the token cap: the study's regex would backtrack for hours here.
    text = "[[" + "], [".join(", ".join("1" for _ in range(64)) for _ in range(40)) + ", 2"
    start = time.perf_counter()
    assert parse_grid(text, 64, 64) is None
    assert time.perf_counter() - start < 5.0
