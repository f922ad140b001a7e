"""Spatial relations: geometry matches the caption, pixels match the objects, the prompt is the study's."""

from __future__ import annotations

import argparse
import io
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from stimuli import get_family
from stimuli.answers import parse_choice_letter
from stimuli.base import Stimulus, StimulusError
from stimuli.cli import add_config_options, config_from_args
from stimuli.io import read_set, write_set
from stimuli.spatial import COLOURS, FAMILY, Config, generate

PHRASE = {
    "left": "is to the left of", "right": "is to the right of", "above": "is above",
    "below": "is below", "front": "is in front of", "behind": "is behind",
}
HEAD = "Please choose the best decription for the image from the following 4 options:\n"


def make(n: int = 24, seed: int = 0, **overrides) -> list[Stimulus]:
    return list(generate(Config(**overrides), n=n, seed=seed, split="test"))


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def noun(obj: dict) -> str:
    return f"{obj['colour']} {obj['shape']}"


def expected_caption(truth: dict, relation: str) -> str:
    s, r = noun(truth["subject"]), noun(truth["reference"])
    art = lambda word: "an" if word[0] in "aeiou" else "a"  # noqa: E731
    return f"{art(s).capitalize()} {s} {PHRASE[relation]} {art(r)} {r}"


def holds_2d(relation: str, s: dict, r: dict) -> bool:
    (sx0, sy0, sx1, sy1), (rx0, ry0, rx1, ry1) = s["bbox"], r["bbox"]
    dx, dy = s["centre"][0] - r["centre"][0], s["centre"][1] - r["centre"][1]
    return {
        "left": sx1 < rx0 and abs(dx) > abs(dy),
        "right": rx1 < sx0 and abs(dx) > abs(dy),
        "above": sy1 < ry0 and abs(dy) > abs(dx),
        "below": ry1 < sy0 and abs(dy) > abs(dx),
    }[relation]


@pytest.mark.parametrize("relation_set", ["planar", "depth"])
def test_truth_agrees_with_pixels_and_geometry(relation_set: str) -> None:
    relations = {"planar": ["left", "right", "above", "below"],
                 "depth": ["left", "right", "front", "behind"]}[relation_set]
    stims = make(relation_set=relation_set)
    assert Counter(s.truth["relation"] for s in stims) == {r: 6 for r in relations}
    for stim in stims:
        t = stim.truth
        px = np.asarray(stim.image)
        assert stim.image.size == (384, 384)
        subject, reference = t["subject"], t["reference"]
        assert subject["colour"] != reference["colour"]
        for obj in (subject, reference):
            x, y = obj["centre"]
            assert tuple(px[y, x]) == COLOURS[obj["colour"]] == tuple(obj["rgb"]), stim.id
            x0, y0, x1, y1 = obj["bbox"]
            assert x1 - x0 + 1 == y1 - y0 + 1 == obj["size"] and x0 <= x <= x1 and y0 <= y <= y1
            # Objects are drawn crisp in distinct colours: the visible area is an exact pixel count.
            assert int(np.all(px == obj["rgb"], axis=-1).sum()) == obj["visible_px"] > 0
        relation = t["relation"]
        if relation in ("front", "behind"):
            front, back = (subject, reference) if relation == "front" else (reference, subject)
            assert front["size"] > 1.25 * back["size"] and front["centre"][1] > back["centre"][1]
            assert t["draw_order"][-1] == ("subject" if relation == "front" else "reference")
            assert t["overlap_px"] > 0 and back["visible_px"] < back["area_px"]
            assert front["visible_px"] == front["area_px"]
        else:
            assert holds_2d(relation, subject, reference), stim.id
            assert t["overlap_px"] == 0
            for other in relations:
                if other != relation and other in ("left", "right", "above", "below"):
                    assert not holds_2d(other, subject, reference)


@pytest.mark.parametrize("relation_set", ["planar", "depth"])
def test_options_prompt_and_answer(relation_set: str) -> None:
    stims = make(relation_set=relation_set)
    for stim in stims:
        t = stim.truth
        assert t["caption"] == expected_caption(t, t["relation"])
        assert sorted(t["options"]) == sorted(expected_caption(t, r) for r in PHRASE
                                              if (r in ("front", "behind")) == (relation_set == "depth")
                                              or r in ("left", "right"))
        assert len(set(t["options"])) == 4
        assert t["options"][t["correct_index"]] == t["caption"]
        assert stim.answer == "ABCD"[t["correct_index"]]
        assert parse_choice_letter(stim.answer) == stim.answer
        lines = "".join(f" {letter}: {opt}\n" for letter, opt in zip("ABCD", t["options"], strict=False))
        assert stim.prompt == HEAD + lines + "Please answer with A, B, C or D.\nYour answer is:"
    # Shuffled per sample: the correct caption lands on several letters.
    assert len({s.answer for s in stims}) >= 3


def test_llava_prompt_style() -> None:
    stim = make(n=1, prompt_style="llava")[0]
    assert stim.prompt.startswith(HEAD)
    assert stim.prompt.endswith("\n D: " + stim.truth["options"][3] + "\nPlease select the correct"
                                " option and return only the letter of the option.\nYour choice is:")


def test_deterministic_by_seed() -> None:
    for relation_set in ("planar", "depth"):
        a = make(n=8, seed=5, relation_set=relation_set)
        b = make(n=8, seed=5, relation_set=relation_set)
        c = make(n=8, seed=6, relation_set=relation_set)
        assert [png_bytes(s.image) for s in a] == [png_bytes(s.image) for s in b]
        record = lambda stims: [(s.seed, s.truth, s.prompts, s.answers) for s in stims]  # noqa: E731
        assert record(a) == record(b)
        assert [png_bytes(s.image) for s in a] != [png_bytes(s.image) for s in c]
        assert [s.truth for s in a] != [s.truth for s in c]


def test_image_size_and_palette_parameters() -> None:
    stims = make(n=8, image_size=160, shapes=("square",), colours=("red", "blue"))
    for stim in stims:
        assert stim.image.size == (160, 160)
        assert {stim.truth["subject"]["shape"], stim.truth["reference"]["shape"]} == {"square"}
        assert {stim.truth["subject"]["colour"], stim.truth["reference"]["colour"]} == {"red", "blue"}
        assert stim.truth["caption"].startswith(("A red square ", "A blue square "))


def test_article_before_vowel() -> None:
    stims = make(n=8, colours=("orange", "red"), shapes=("circle",))
    captions = [s.truth["caption"] for s in stims]
    assert all(" an orange circle" in c or c.startswith("An orange circle") for c in captions)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(colours=("red",)), "colours"),
        (dict(colours=("red", "red")), "colours"),
        (dict(colours=("red", "teal")), "colours"),
        (dict(shapes=("hexagon",)), "shapes"),
        (dict(shapes=()), "shapes"),
        (dict(image_size=10), "image_size"),
        (dict(max_size=0.5), "max_size"),
        (dict(min_size=0.3, max_size=0.2), "min_size"),
        (dict(relation_set="on_under"), "relation_set"),
        (dict(prompt_style="gpt"), "prompt_style"),
    ],
)
def test_bad_parameters_raise(overrides: dict, message: str) -> None:
    with pytest.raises(StimulusError, match=message):
        generate(Config(**overrides), n=1, seed=0, split="test")


def test_cli_options_build_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_config_options(parser, Config)
    args = parser.parse_args(["--relation-set", "depth", "--colours", "red", "blue",
                              "--shapes", "circle", "--image-size", "256"])
    config = config_from_args(FAMILY, args)
    assert config == Config(relation_set="depth", colours=("red", "blue"), shapes=("circle",), image_size=256)


def test_set_round_trip(tmp_path) -> None:
    assert get_family("spatial") is FAMILY
    config = Config(relation_set="depth")
    out = write_set(FAMILY, config, n=8, seed=2, split="test", out=tmp_path / "spatial")
    stimset = read_set(out)
    assert stimset.family == "spatial" and len(stimset) == 8
    expected = make(n=8, seed=2, relation_set="depth")
    for row, stim in zip(stimset.rows(), expected, strict=False):
        assert row["id"] == stim.id and row["answer"] == stim.answer and row["prompt"] == stim.prompt
        assert row["truth"] == stim.truth and row["params"] == stim.params
        assert np.array_equal(np.asarray(stimset.image(row)), np.asarray(stim.image))
