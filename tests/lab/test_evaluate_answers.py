"""The card's visual answers: ended or cut at the cap, and classified by what they are (shared with the store)."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoModelForImageTextToText, AutoProcessor

import lab
from lab.card import cap_note
from lab.evaluate import MAX_NEW_TOKENS, EvalSpec, attractors, boards, generate_answers, markdown
from store.records import answer_kind

CKPT = lab.DEFAULT_CHECKPOINT


@pytest.fixture(scope="module")
def committed():
    model = AutoModelForImageTextToText.from_pretrained(CKPT).eval()
    return model, AutoProcessor.from_pretrained(CKPT)


def test_visual_answers_record_how_they_ended(committed):
    model, processor = committed
    spec = EvalSpec()
    assert spec.max_new_tokens == MAX_NEW_TOKENS == 10  # the counting-bottleneck study's cap
    stimuli = boards(model, spec, "40-99", 1, spec.seed, "test")
    got = generate_answers(model, processor, stimuli, "multimodal_num", 64)
    counts = [s.truth["count"] for s in stimuli]
    kinds = [answer_kind(t, why) for t, why in got]
    # in range the model answers a number and stops
    assert all(k == "digits" and why == "eos" for c, k, (_, why) in zip(counts, kinds, got, strict=False) if c < 50)
    # past it some answers are the word False (not empty), and some never end within the cap
    assert any(t == "False" and k == "word" for (t, _), k in zip(got, kinds, strict=False))
    runaway = [t for (t, why), k in zip(got, kinds, strict=False) if k == "runaway" and why == "cap"]
    assert runaway and all(len(t.split()) == MAX_NEW_TOKENS for t in runaway)  # one digit token per step
    assert "empty" not in kinds
    # with the cap of the old card (6) the same answers are cut sooner: more of them run away
    short = generate_answers(model, processor, stimuli, "multimodal_num", 64, max_new_tokens=6)
    assert sum(why == "cap" for _, why in short) > len(runaway)


def test_attractor_labels_name_the_outcome():
    regimes = np.array(["VE"] * 5 + ["FE"])
    kinds = np.array(["digits", "word", "empty", "runaway", "runaway", "runaway"])
    texts = ["4 9", "False", "", "1 1 0 1", "1 1 0 1", "1 1 1 0"]
    got = attractors(regimes, kinds, texts, [49, None, None, None, None, None])
    assert dict(got["VE"]) == {"runaway: 1101": 0.4, "49": 0.2, "False": 0.2, "empty": 0.2}
    assert got["FE"] == [("runaway: 1110", 1.0)]


def test_the_cap_stands_beside_the_figures():
    assert cap_note({"max_new_tokens": 10}).startswith("max_new_tokens = 10 (the counting-bottleneck study's cap)")
    assert cap_note({}).startswith("max_new_tokens = 6;")  # evaluations from before the cap was recorded
    row = {"boards": 1, **dict.fromkeys(["multimodal_num", "text_only_num", "multimodal_tf", "text_only_tf"], 0.0),
           "visual_digits": 0.0, "visual_runaway": 1.0, "visual_word": 0.0, "visual_empty": 0.0, "visual_mae": None,
           "probe_exact": 1.0, "probe_token_acc": 1.0, "control_exact": 0.0, "control_token_acc": 0.5,
           "random_init_exact": 1.0, "vision_gap": 0.0, "language_gap": None}
    table = markdown({"spec": {"max_new_tokens": 10}, "regimes": {"FE": row}, "attractors": {}})
    assert "| visual answers: runaway (no EOS within 10 tokens) | 100.0% |" in table
    assert "| visual mean abs error (number answers) | n/a |" in table
