"""CountingTricks: geometry per case, drawing vs truth, determinism, prompts, errors, set I/O."""

from __future__ import annotations

import argparse
import io
import math
from itertools import combinations
from typing import Any

import numpy as np
import pytest
from scipy import ndimage

from stimuli import get_family
from stimuli.answers import parse_number
from stimuli.base import Stimulus, StimulusError
from stimuli.cli import add_config_options, config_from_args
from stimuli.counting_tricks import (
    ALL_CASES,
    CASES,
    FAMILY,
    GROUP_CLEARANCE_PATCHES,
    Config,
    box_gap,
    circle_gap,
    generate,
    prompts,
    requested_count,
)
from stimuli.io import read_set, write_set

RED = (255, 0, 0)


def _make(n: int = 1, seed: int = 0, **overrides: Any) -> list[Stimulus]:
    return list(generate(Config(**overrides), n=n, seed=seed))


def _arrays(stim: Stimulus) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(stim.image), np.asarray(stim.extra_images["masks"])


def _png(img: Any) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _objects(stim: Stimulus) -> list[dict[str, Any]]:
    return stim.truth["objects"]


# --- the case table -------------------------------------------------------------------------

def test_case_table_has_the_32_cases() -> None:
    expected = [f"{k}{c}" for k in range(1, 5) for c in "ABCD"]
    expected += ["5A", "6A", "7A", "8A", "9A", "9B", "10A", "10B", "11A", "11B", "12A", "12B",
                 "13A", "13B", "14A", "15A"]
    assert list(ALL_CASES) == expected
    assert Config().cases == ALL_CASES
    assert get_family("counting") is FAMILY
    assert [CASES[c].min_gap for c in ("5A", "6A", "7A", "8A")] == [3, 4, 3, 5]


# --- determinism ----------------------------------------------------------------------------

def test_same_seed_same_bytes_other_seed_differs() -> None:
    cfg = dict(cases=("1D", "11B", "12A"), count_min=3, count_max=6)
    a, b = _make(2, seed=7, **cfg), _make(2, seed=7, **cfg)
    assert [s.id for s in a] == [s.id for s in b]
    for x, y in zip(a, b, strict=False):
        assert _png(x.image) == _png(y.image)
        assert _png(x.extra_images["masks"]) == _png(y.extra_images["masks"])
        assert x.truth == y.truth and x.prompts == y.prompts
    c = _make(2, seed=8, **cfg)
    assert any(_png(x.image) != _png(z.image) for x, z in zip(a, c, strict=False))


def test_sample_does_not_depend_on_n_or_other_cases() -> None:
    few = _make(2, seed=3, cases=("9A",))
    many = _make(5, seed=3, cases=("2B", "9A"))
    assert few[1].id == "counting-9A-00001"
    match = next(s for s in many if s.id == few[1].id)
    assert _png(match.image) == _png(few[1].image) and match.truth == few[1].truth


def test_counts_are_balanced_per_block() -> None:
    cfg = Config(count_min=3, count_max=7)
    for block in range(3):
        counts = [requested_count(cfg, 11, block * 5 + k) for k in range(5)]
        assert sorted(counts) == [3, 4, 5, 6, 7]


# --- cases 1-8: centres against the patch grid, exactly as the MAS code --------------------

ON_GRID = {  # (x mod P, y mod P) of the anchor per placement number, "c" = cell centre
    "1": ("c", "c"), "2": (0, "c"), "3": ("c", 0), "4": (0, 0),
}


@pytest.mark.parametrize("patch", [27, 14])
def test_grid_cases_put_centres_where_the_case_says(patch: int) -> None:
    cases = tuple(c for c in ALL_CASES if len(c) == 2 and c[0] in "1234")
    cfg = Config(cases=cases, patch_size=patch, count_min=4, count_max=9)
    r0, size = patch // 2, cfg.image_size
    lo, hi = patch + r0, size - patch - r0  # the code's jitter clamp
    seen = 0
    for stim in generate(cfg, n=2, seed=1):
        case = CASES[stim.truth["case"]]
        for o in _objects(stim):
            seen += 1
            for axis, want in zip("xy", ON_GRID[case.id[0]], strict=False):
                a = o[f"anchor_{axis}"]
                assert a % patch == (patch // 2 if want == "c" else 0), (stim.id, axis, a)
                v = o[axis]
                if axis in case.jitter_axes:
                    assert abs(v - a) <= 0.75 * r0 + 1 or v in (lo, hi), (stim.id, axis, v, a)
                    assert v == int(v)  # the code truncates jittered centres to ints
                else:
                    assert v == a
            if case.size == "fixed":
                assert o["size"] == r0
            else:
                assert 0.3 * r0 <= o["size"] <= 1.2 * r0
            # the edge rule: nothing closer than P//2 to any edge
            assert o["bbox"][0] >= patch // 2 and o["bbox"][2] <= size - patch // 2
            assert o["bbox"][1] >= patch // 2 and o["bbox"][3] <= size - patch // 2
    assert seen > 50
    if patch == 14:
        # even P: a cell centre is exactly i+0.5 patches and banker's rounding picks the even line
        four_a = [o for s in _make(3, seed=2, cases=("4A",), patch_size=14, count_min=9, count_max=9)
                  for o in _objects(s)]
        assert four_a and all((o["x"] / 14) % 2 == 0 and (o["y"] / 14) % 2 == 0 for o in four_a)


def test_same_index_shares_the_scene_across_grid_cases() -> None:
    one, two = _make(1, seed=5, cases=("1A", "2A"), count_min=6, count_max=6)
    assert one.truth["requested_count"] == two.truth["requested_count"] == 6
    assert [o["x"] - 27 // 2 for o in _objects(one)] == [o["x"] for o in _objects(two)]
    assert [o["y"] for o in _objects(one)] == [o["y"] for o in _objects(two)]


def test_dilated_cases_sizes_and_min_gap() -> None:
    p = 27
    for stim in _make(2, seed=4, cases=("5A", "6A", "7A", "8A"), count_min=6, count_max=8):
        case = CASES[stim.truth["case"]]
        objs = _objects(stim)
        assert objs, stim.id
        for o in objs:
            assert o["size"] == case.diameter_patches * p / 2
            assert o["x"] % p == p // 2 and o["y"] % p == p // 2
        for a, b in combinations(objs, 2):  # min_gap+1 cells apart along one axis at least
            cells = max(abs(a["x"] // p - b["x"] // p), abs(a["y"] // p - b["y"] // p))
            assert cells >= case.min_gap + 1
            assert circle_gap(a["x"], a["y"], a["size"], b["x"], b["y"], b["size"]) > 0


# --- drawing agrees with the truth ----------------------------------------------------------

@pytest.mark.parametrize("shape", ["circle", "square", "triangle"])
def test_drawn_objects_match_truth(shape: str) -> None:
    cases = ALL_CASES if shape == "circle" else ("1B", "4D", "6A", "10B", "11A", "12B")
    cfg = Config(cases=cases, shape=shape, count_min=2, count_max=10)
    for stim in generate(cfg, n=1, seed=9):
        image, mask = _arrays(stim)
        objs, count = _objects(stim), stim.truth["count"]
        assert len(objs) == count <= stim.truth["requested_count"]
        assert stim.answers == {"standard": str(count), "conflict": str(count)}
        # every object is drawn, and only objects are red
        assert set(np.unique(mask)) - {0} == set(range(1, count + 1)), stim.id
        assert np.array_equal(mask > 0, np.all(image == RED, axis=-1)), stim.id
        for k, o in enumerate(objs):
            cx, cy = math.floor(o["x"] + 0.5), math.floor(o["y"] + 0.5)
            assert mask[cy, cx] == k + 1 and tuple(image[cy, cx]) == RED
            ys, xs = np.nonzero(mask == k + 1)
            assert o["pixels"] == xs.size
            ids = sorted({int(v) for v in (ys // 27) * stim.truth["grid_size"] + xs // 27})
            assert o["patch_ids"] == ids
            x0, y0, x1, y1 = o["bbox"]
            assert xs.min() >= math.floor(x0) and xs.max() <= math.ceil(x1)
            assert ys.min() >= math.floor(y0) and ys.max() <= math.ceil(y1)
            if shape == "circle":  # every labelled pixel (but the forced centre) is inside the disc
                inside = (xs - o["x"]) ** 2 + (ys - o["y"]) ** 2 <= o["size"] ** 2 + 1e-6
                assert np.all(inside | ((xs == cx) & (ys == cy)))
        assert stim.truth["patch_ids"] == sorted({i for o in objs for i in o["patch_ids"]})
        if not CASES[stim.truth["case"]].adjacency:
            _, components = ndimage.label(mask > 0)
            assert components == count, stim.id


def test_zero_count_is_a_blank_image() -> None:
    (stim,) = _make(1, cases=("3C",), count_min=0, count_max=0)
    image, mask = _arrays(stim)
    assert stim.truth["count"] == 0 and stim.truth["objects"] == []
    assert not mask.any() and np.all(image == 255)
    assert stim.truth["distractor"] in (1, 2)


def test_colour_and_grid_options() -> None:
    (stim,) = _make(1, cases=("1A",), colour="#0000ff", background="black", draw_grid=True,
                    count_min=3, count_max=3)
    image, mask = _arrays(stim)
    assert np.array_equal(mask > 0, np.all(image == (0, 0, 255), axis=-1))
    assert tuple(image[5, 27]) == (211, 211, 211) and tuple(image[5, 26]) == (0, 0, 0)


# --- cases 9-15: adjacency -------------------------------------------------------------------

def _gap(shape: str, a: dict[str, Any], b: dict[str, Any]) -> float:
    fn = circle_gap if shape == "circle" else box_gap
    return fn(a["x"], a["y"], a["size"], b["x"], b["y"], b["size"])


@pytest.mark.parametrize("shape", ["circle", "square"])
def test_adjacency_gaps_are_in_the_documented_range(shape: str) -> None:
    cases = tuple(c for c in ALL_CASES if CASES[c].adjacency)
    p, r0 = 27, 27 // 2
    for stim in generate(Config(cases=cases, shape=shape, count_min=3, count_max=10), n=2, seed=6):
        case, g = CASES[stim.truth["case"]], stim.truth["gap_px"]
        objs = _objects(stim)
        assert objs and stim.truth["count"] == stim.truth["requested_count"], stim.id
        assert (g == 0.0) if case.size == "patch" else (0.0 <= g <= 0.25 * 2 * r0)
        for a, b in combinations(objs, 2):
            gap = _gap(shape, a, b)
            if a["group"] == b["group"]:
                assert gap >= g - 1e-6, stim.id
            else:
                assert gap >= GROUP_CLEARANCE_PATCHES * p - 1e-6, stim.id
        for a in objs:
            mates = [b for b in objs if b is not a and b["group"] == a["group"]]
            if mates:  # touching or nearly: the nearest neighbour sits at exactly the gap
                assert min(_gap(shape, a, b) for b in mates) == pytest.approx(g, abs=1e-6), stim.id
                assert a["nearest_gap"] == pytest.approx(g, abs=1e-6)
        groups: dict[int, list[dict[str, Any]]] = {}
        for o in objs:
            groups.setdefault(o["group"], []).append(o)
        sizes = sorted(len(v) for v in groups.values())
        if case.placement == "pairs":
            assert sizes[-1] == 2 and sizes.count(1) <= 1
        if case.placement in ("rows", "patch_row", "boundary_row"):
            assert all(len({o["y"] for o in v}) == 1 for v in groups.values())
        if case.placement == "columns":
            assert all(len({o["x"] for o in v}) == 1 for v in groups.values())
        if case.placement in ("ring", "cluster"):
            assert len(groups) == 1
        if case.placement == "ring" and case.size == "fixed" and shape == "circle" and len(objs) >= 3:
            cx, cy = np.mean([o["x"] for o in objs]), np.mean([o["y"] for o in objs])
            radii = [math.hypot(o["x"] - cx, o["y"] - cy) for o in objs]
            assert max(radii) - min(radii) < 1e-6  # one circle, evenly spaced
        if case.size == "patch":
            centre = 0 if case.placement == "boundary_row" else p // 2
            assert all(o["x"] % p == centre and o["y"] % p == p // 2 and o["size"] == p / 2 for o in objs)


def test_adjacency_gap_option() -> None:
    for stim in _make(1, cases=("9A", "12B"), adjacency_gap=(0.1, 0.1), count_min=4, count_max=4):
        assert stim.truth["gap_px"] == pytest.approx(0.1 * 2 * 13)
        assert all(o["nearest_gap"] == pytest.approx(0.1 * 26) for o in _objects(stim))


# --- prompts --------------------------------------------------------------------------------

def test_prompts_and_distractor() -> None:
    stims = _make(4, cases=("1A",), shape="triangle", count_min=1, count_max=4)
    for stim in stims:
        n, d = stim.truth["count"], stim.truth["distractor"]
        assert stim.prompts["standard"] == (
            "How many triangles are there in the image? Respond concisely with shape counts using the"
            " following format: triangles: {number}")
        assert abs(d - n) in (1, 2) and d >= 1 and d - n == stim.truth["distractor_offset"]
        assert stim.prompts["conflict"].endswith(stim.prompts["standard"])
        assert parse_number(stim.prompts["conflict"]) == d
        assert parse_number(stim.answers["standard"]) == n
    assert {s.truth["count"] for s in stims} == {1, 2, 3, 4}
    assert prompts("circle", 3, 1)["conflict"].startswith("The caption says the image contains 1 circle. How")
    assert prompts("circle", 3, 5)["conflict"].startswith("The caption says the image contains 5 circles. How")


# --- bad parameters -------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"count_min": -1}, "count_min"),
        ({"count_min": 6, "count_max": 3}, "count_min <= count_max"),
        ({"patch_size": 100}, "patch_size"),
        ({"cases": ("16A",)}, "16A"),
        ({"cases": ()}, "cases"),
        ({"shape": "hexagon"}, "shape"),
        ({"colour": "notacolour"}, "colour"),
        ({"colour": "white"}, "background"),
        ({"adjacency_gap": (0.3, 0.1)}, "adjacency_gap"),
        ({"adjacency_gap": (0.1,)}, "adjacency_gap"),
        ({"varied_radius": (0.0, 1.2)}, "varied_radius"),
    ],
)
def test_bad_parameters_raise_clear_errors(overrides: dict[str, Any], named: str) -> None:
    with pytest.raises(StimulusError, match=named):
        list(generate(Config(**overrides), n=1, seed=0))


def test_bad_run_arguments() -> None:
    with pytest.raises(StimulusError, match="n="):
        generate(Config(), n=0, seed=0)
    with pytest.raises(StimulusError, match="seed"):
        generate(Config(), n=1, seed=-1)


# --- CLI options and the set on disk ----------------------------------------------------------

def test_config_fields_become_cli_options() -> None:
    parser = argparse.ArgumentParser()
    add_config_options(parser, Config)
    args = parser.parse_args(["--cases", "1A", "9B", "--shape", "square", "--adjacency-gap", "0", "0.1",
                              "--count-max", "5", "--draw-grid"])
    cfg = config_from_args(FAMILY, args)
    assert cfg == Config(cases=("1A", "9B"), shape="square", adjacency_gap=(0.0, 0.1), count_max=5,
                         draw_grid=True)


def test_set_round_trip(tmp_path: Any) -> None:
    cfg = Config(cases=("2D", "11A"), count_min=2, count_max=5)
    out = write_set(FAMILY, cfg, n=2, seed=0, split="test", out=tmp_path / "counting")
    loaded = read_set(out)
    assert len(loaded) == 4 and loaded.family == "counting"
    assert {"mask", "truth", "params", "prompts", "answers"} <= set(loaded.table.column_names)
    fresh = {s.id: s for s in generate(cfg, n=2, seed=0)}
    for row in loaded.rows():
        stim = fresh[row["id"]]
        assert row["truth"]["count"] == stim.truth["count"] and row["answer"] == str(stim.truth["count"])
        assert row["truth"]["objects"][0]["patch_ids"] == stim.truth["objects"][0]["patch_ids"]
        assert row["params"]["case"] == stim.truth["case"]
        image, mask = loaded.image(row), loaded.image(row, "mask")
        assert image.mode == "RGB" and image.size == (384, 384) and mask.mode == "L"
        assert np.array_equal(np.asarray(mask), np.asarray(stim.extra_images["masks"]))
