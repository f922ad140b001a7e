"""Go boards: the study's rendering pixel for pixel, exact counts, text twins, uniqueness."""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from PIL import Image, ImageDraw

from stimuli import get_family
from stimuli.answers import parse_digit_string
from stimuli.base import Stimulus, StimulusError
from stimuli.cli import add_config_options, config_from_args
from stimuli.goboard import (
    BOARD_RGB,
    FAMILY,
    QUESTIONS,
    VARIATIONS,
    Config,
    board_layout,
    draw_sample,
    generate,
    pool,
    regime,
    reliable_limit,
    white_counts,
)
from stimuli.io import read_set, write_set

SMALL = dict(preset="small", counts="0,1,7,49,50,99,100,120")


def make(n: int = 2, seed: int = 0, **overrides) -> list[Stimulus]:
    return list(generate(Config(**overrides), n=n, seed=seed, split="test"))


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def study_draw_board(board: list[list[str]], stone_radius_px: int, cell_size_px: int) -> Image.Image:
    """The study's ``draw_board`` (semproj data.py), kept verbatim as the reference."""
    rows, cols = len(board), len(board[0])
    w, h = cell_size_px * cols, cell_size_px * rows
    img = Image.new("RGB", (w, h), "#DEB887")
    draw = ImageDraw.Draw(img)
    for i in range(rows):
        offset = i * cell_size_px + cell_size_px // 2 - 1
        draw.line([(0, offset), (w, offset)], fill="black", width=2)
    for i in range(cols):
        offset = i * cell_size_px + cell_size_px // 2 - 1
        draw.line([(offset, 0), (offset, h)], fill="black", width=2)
    for r in range(rows):
        for c in range(cols):
            piece = board[r][c]
            if piece in ("X", "O"):
                cx, cy = c * cell_size_px + cell_size_px // 2, r * cell_size_px + cell_size_px // 2
                rad = stone_radius_px
                bbox = [(cx - rad, cy - rad), (cx + rad, cy + rad)]
                draw.ellipse(bbox, fill="black" if piece == "X" else "white", outline=None)
    return img


@pytest.mark.parametrize("preset", ["paper", "small"])
def test_clean_rendering_is_the_studys_draw_board(preset: str) -> None:
    for stim in make(n=2, preset=preset, counts="0,30,99"):
        p = stim.params
        size = p["board_size"]
        board_str = stim.truth["board_str"]
        board = [list(board_str[r * size:(r + 1) * size]) for r in range(size)]
        expected = study_draw_board(board, p["radius"], p["cell_px"])
        assert stim.image.size == expected.size == (size * p["cell_px"],) * 2
        assert np.array_equal(np.asarray(stim.image), np.asarray(expected)), stim.id


def test_paper_preset_geometry() -> None:
    stim = make(n=1, counts="5")[0]
    assert stim.image.size == (266, 266)
    assert (stim.params["board_size"], stim.params["cell_px"], stim.params["radius"]) == (19, 14, 5)
    assert len(stim.truth["labels"]) == 361


@pytest.mark.parametrize("preset", ["paper", "small"])
def test_pixels_agree_with_labels(preset: str) -> None:
    for stim in make(n=2, preset=preset, counts="0,3,60,110"):
        px = np.asarray(stim.image)
        size, cell = stim.params["board_size"], stim.params["cell_px"]
        for index, label in enumerate(stim.truth["labels"]):
            row, col = divmod(index, size)
            cx, cy = col * cell + cell // 2, row * cell + cell // 2
            # The intersection centre lies on both grid lines, so an empty one reads as line
            # (black); (cx+2, cy+2) is off the lines but still inside a stone.
            centre, probe = tuple(px[cy, cx]), tuple(px[cy + 2, cx + 2])
            if label == 0:
                assert centre == probe == (0, 0, 0), (stim.id, index)
            elif label == 1:
                assert centre == probe == (255, 255, 255), (stim.id, index)
            else:
                assert centre == (0, 0, 0) and probe == BOARD_RGB, (stim.id, index)


def test_counts_white_rule_and_text_twins() -> None:
    stims = make(n=4, **SMALL)
    assert Counter(s.truth["count"] for s in stims) == {c: 4 for c in (0, 1, 7, 49, 50, 99, 100, 120)}
    for stim in stims:
        t, cells = stim.truth, 121
        n = t["count"]
        labels = t["labels"]
        assert len(labels) == cells and set(labels) <= {0, 1, 2}
        assert labels.count(0) == n
        assert labels.count(1) == t["n_white"] and labels.count(2) == t["n_empty"]
        assert t["n_white"] in white_counts(n, cells, stim.params["white_range"])
        assert stim.params["white_range"] == 10  # 30 scaled by 121/361
        assert t["board_str"] == "".join("XO."[v] for v in labels)
        assert t["text_board"] == "".join("cba"[v] for v in labels)
        for key in ("text_c", "text_eq"):
            assert len(t[key]) == cells and set(t[key]) <= set("abc")
            assert t[key].count("c") == n
        assert t["text_c"] != t["text_eq"]
        assert t["ie_count"] != n and 0 <= t["ie_count"] < cells
        assert t["text_ie"].count("c") == t["ie_count"] and len(t["text_ie"]) == cells
        assert len(t["stones"]) == n + t["n_white"]


def test_prompts_answers_and_regimes() -> None:
    stims = make(n=2, **SMALL)
    for stim in stims:
        n = stim.truth["count"]
        assert list(stim.prompts) == ["multimodal_num", "text_only_num", "multimodal_tf", "text_only_tf"]
        assert stim.prompts == QUESTIONS
        assert stim.prompt == "How many black stones are there on the chessboard ?"
        assert stim.answers["multimodal_num"] == stim.answers["text_only_num"] == str(n)
        assert parse_digit_string(" ".join(stim.answer)) == n
        tf = "True" if stim.truth["tf_pair"] == "eq" else "False"
        assert stim.answers["multimodal_tf"] == stim.answers["text_only_tf"] == tf
        assert stim.truth["regime"] == regime(n)
    assert Counter(s.truth["tf_pair"] for s in stims) == {"eq": 8, "ie": 8}
    assert [regime(c) for c in (0, 49, 50, 99, 100, 120)] == ["ID", "ID", "VE", "VE", "FE", "FE"]


def test_two_digit_answers() -> None:
    stims = make(n=1, preset="small", counts="0,7,42", answer_format="two_digit")
    assert [s.answer for s in stims] == ["00", "07", "42"]
    with pytest.raises(StimulusError, match="two_digit"):
        make(n=1, preset="small", counts="0-120", answer_format="two_digit")


def test_deterministic_by_seed() -> None:
    for variation in ("none", "strong"):
        a = make(n=2, seed=3, variation=variation, **SMALL)
        b = make(n=2, seed=3, variation=variation, **SMALL)
        c = make(n=2, seed=4, variation=variation, **SMALL)
        assert [png_bytes(s.image) for s in a] == [png_bytes(s.image) for s in b]
        record = lambda stims: [(s.id, s.seed, s.truth, s.params) for s in stims]  # noqa: E731
        assert record(a) == record(b)
        assert [s.truth["labels"] for s in a] != [s.truth["labels"] for s in c]
        assert [png_bytes(s.image) for s in a] != [png_bytes(s.image) for s in c]


def test_boards_unique_per_count_with_recorded_retries() -> None:
    # A 2x2 board holds only 28 distinct one-black boards (and 16 text pairs): 12 boards per
    # count forces collisions, which must be retried, recorded and reproducible.
    config = Config(board_size=2, cell_px=8, radius=3, counts="1")
    stims = list(generate(config, n=12, seed=0, split="test"))
    assert len({tuple(s.truth["labels"]) for s in stims}) == 12
    strings = [s.truth[k] for s in stims for k in ("text_c", "text_eq")]
    assert len(set(strings)) == 24
    assert max(s.params["attempt"] for s in stims) > 0
    layout = board_layout(config)
    for stim in stims:
        redrawn = draw_sample(np.random.default_rng(stim.seed), layout, 1)
        assert redrawn.labels.tolist() == stim.truth["labels"]
        assert redrawn.text_c == stim.truth["text_c"]
    with pytest.raises(StimulusError, match="--n=17"):
        list(generate(config, n=17, seed=0, split="test"))


@pytest.mark.slow
def test_a_count_at_its_distinct_limit_is_refused_up_front(tmp_path) -> None:
    # Count 120 on 11x11 has 121 boards (one white stone) and 242 strings: drawing all of them
    # at random starved at board 117. The refusal names how many draw reliably, before drawing.
    out = tmp_path / "go"
    got = subprocess.run([sys.executable, "-m", "stimuli", "go", "--preset", "small", "--counts", "120",
                          "--n", "121", "--out", str(out)], capture_output=True, text=True, timeout=120, check=False)
    assert got.returncode == 2
    assert got.stderr.strip().splitlines() == [(
        "error: count 120 on the 11x11 board has 121 distinct boards/text pairs, but random draws reach"
        " only 105 of them reliably, fewer than --n=121: lower --n to 105, drop that count, or use a larger board"
    )]
    assert not out.exists()
    with pytest.raises(StimulusError, match="lower --n to 105"):
        generate(Config(preset="small", counts="0,120"), n=106, seed=0, split="test")


@pytest.mark.slow
def test_the_reliable_limit_is_drawn_in_full() -> None:
    stims = make(n=105, preset="small", counts="120")
    assert len({tuple(s.truth["labels"]) for s in stims}) == 105
    assert len({s.truth[k] for s in stims for k in ("text_c", "text_eq")}) == 210
    # Tiny pools, several seeds: every count's limit draws without running out of attempts.
    for count in range(4):
        config = Config(board_size=2, cell_px=8, radius=3, counts=str(count))
        limit = reliable_limit(pool(board_layout(config), count))
        assert 4 <= limit <= pool(board_layout(config), count).capacity
        for seed in range(3):
            boards = {tuple(s.truth["labels"]) for s in generate(config, n=limit, seed=seed, split="test")}
            assert len(boards) == limit


def test_default_set_boards_are_unique() -> None:
    stims = make(n=16, preset="small", counts="0,1,119,120")
    for count in (0, 1, 119, 120):
        boards = [tuple(s.truth["labels"]) for s in stims if s.truth["count"] == count]
        assert len(set(boards)) == 16


def covered_mean(px: np.ndarray, x: float, y: float, rho: float) -> np.ndarray:
    """Mean colour of the pixels a stone drawn at (x, y) with radius rho covers entirely."""
    x0, y0 = int(x - rho), int(y - rho)
    window = px[y0:int(y + rho) + 2, x0:int(x + rho) + 2]
    ys, xs = np.mgrid[0:window.shape[0], 0:window.shape[1]]
    # The disc's edge is rho + 0.5 from the centre; a pixel's corner is <= 0.71 from its centre.
    inside = np.hypot(xs + x0 - x, ys + y0 - y) <= rho - 0.25
    assert inside.any()
    return window[inside].mean(axis=0)


@pytest.mark.parametrize("variation", sorted(VARIATIONS))
@pytest.mark.parametrize("preset", [pytest.param("paper", marks=pytest.mark.slow), "small"])
def test_variation_keeps_labels_true(variation: str, preset: str) -> None:
    stims = make(n=2, preset=preset, variation=variation, counts="5,60,110")
    clean = make(n=2, preset=preset, counts="5,60,110")
    for stim, plain in zip(stims, clean, strict=False):
        assert stim.truth["labels"] == plain.truth["labels"]  # variation changes pixels only
        assert not np.array_equal(np.asarray(stim.image), np.asarray(plain.image))
        px = np.asarray(stim.image).astype(int)
        cell, size = stim.params["cell_px"], stim.params["board_size"]
        assert len(np.unique(px.reshape(-1, 3), axis=0)) > 50  # noise + anti-aliasing
        dark = 0
        for stone in stim.truth["stones"]:
            col, row = stone["col"], stone["row"]
            x, y, rho = stone["cx"], stone["cy"], stone["radius"]
            assert col * cell <= x - rho and x + rho + 1 <= (col + 1) * cell  # inside its cell
            assert row * cell <= y - rho and y + rho + 1 <= (row + 1) * cell
            centre = px[row * cell + cell // 2, col * cell + cell // 2].mean()
            r, g, b = covered_mean(px, x, y, rho)
            if stone["label"] == 0:
                assert centre < 128 and (r + g + b) / 3 < 100, stim.id
                dark += 1
            else:
                assert centre > 128 and (r + g + b) / 3 > 150 and abs(r - b) < 30, stim.id
        assert dark == stim.truth["count"]
        for index, label in enumerate(stim.truth["labels"]):
            if label == 2:
                row, col = divmod(index, size)
                y, x = row * cell + cell // 2 + 2, col * cell + cell // 2 + 2
                r, g, b = px[y:y + 2, x:x + 2].reshape(-1, 3).mean(axis=0)
                assert r - b > 45 and (r + g + b) / 3 > 130, (stim.id, index)  # board, not stone


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(counts="-3"), "counts"),
        (dict(counts="5-1"), "backwards"),
        (dict(counts="x"), "cannot read"),
        (dict(preset="small", counts="0-121"), "board_size"),
        (dict(board_size=5, counts="30"), "board_size"),
        (dict(radius=7), "radius=7"),
        (dict(preset="small", radius=4), "radius"),
        (dict(cell_px=3), "cell_px"),
        (dict(board_size=-1), "board_size"),
        (dict(board_size=1), "board_size"),
        (dict(white_range=-2), "white_range"),
        (dict(preset="huge"), "preset"),
        (dict(variation="wild"), "variation"),
        (dict(answer_format="words"), "answer_format"),
    ],
)
def test_bad_parameters_raise(overrides: dict, message: str) -> None:
    with pytest.raises(StimulusError, match=message):
        generate(Config(**overrides), n=1, seed=0, split="test")


def test_bad_run_arguments_raise() -> None:
    with pytest.raises(StimulusError, match="seed"):
        generate(Config(), n=1, seed=-1, split="test")
    with pytest.raises(StimulusError, match="n"):
        generate(Config(), n=0, seed=0, split="test")


def test_cli_options_build_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_config_options(parser, Config)
    args = parser.parse_args(["--preset", "small", "--counts", "0-5", "--variation", "mild",
                              "--white-range", "4", "--answer-format", "two_digit"])
    config = config_from_args(FAMILY, args)
    assert config == Config(preset="small", counts="0-5", variation="mild", white_range=4,
                            answer_format="two_digit")
    with pytest.raises(SystemExit):
        parser.parse_args(["--preset", "huge"])


def test_set_round_trip(tmp_path) -> None:
    assert get_family("go") is FAMILY
    config = Config(preset="small", counts="0,50,120", variation="mild")
    out = write_set(FAMILY, config, n=2, seed=1, split="train", out=tmp_path / "go")
    stimset = read_set(out)
    assert stimset.family == "go" and len(stimset) == 6
    rows = stimset.rows()
    expected = list(generate(config, n=2, seed=1, split="train"))
    for row, stim in zip(rows, expected, strict=False):
        assert row["id"] == stim.id and row["seed"] == stim.seed and row["split"] == "train"
        assert row["answer"] == stim.answer and row["prompts"] == stim.prompts
        assert row["truth"]["labels"] == stim.truth["labels"]
        assert row["truth"]["text_ie"] == stim.truth["text_ie"]
        assert row["truth"]["stones"] == stim.truth["stones"]
        assert row["params"] == stim.params
        assert np.array_equal(np.asarray(stimset.image(row)), np.asarray(stim.image))
