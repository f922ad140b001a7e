"""No answer text, however malformed, may stop scoring: every family's parser returns or says None.

Random and adversarial strings (huge integers, non-ASCII digits, NaN, nested and unclosed
brackets, 10k-character texts, control characters, empty) go through ``score_answer`` for all
four families and through each parser directly, with warnings as errors, so the guard in
``score_answer`` (which records a raising parser as unparsable) is never what saves a case.
"""

from __future__ import annotations

import random
import time
import warnings

import pytest

from extract.scoring import score_answer
from stimuli import StimulusError
from stimuli.answers import (
    parse_bool,
    parse_choice_letter,
    parse_digit_string,
    parse_number,
)
from stimuli.base import exact_match
from stimuli.g2m import parse_grid

HUGE = "1" * 20  # >= 2**63
OVER_INT_LIMIT = "7" * 5000  # more digits than Python's int() reads from a string
ADVERSARIAL = [
    "", " ", "\x00", "\x1b[31m\x07\x08", "\ufeff", "\u200b", "\r\n\t\v\f",
    HUGE, f"[[1, {HUGE}]]", f"[[{HUGE}, 0], [1, 0]]", f"ROW1=[{HUGE}, 1]\nROW2=[0, 1]",
    f"-{HUGE}", f"{HUGE} {HUGE} {HUGE} {HUGE}", OVER_INT_LIMIT, f"[[{OVER_INT_LIMIT}]]",
    f"{OVER_INT_LIMIT} 1 0 1", f"ROW1=[{OVER_INT_LIMIT}, 1]\nROW2=[0, 1]", "1," * 4000,
    "١٢", "[[١, ٢], [٣, ٤]]", "١ ٢ ٣ ٤", "５", "²", "①②", "Ⅻ", "𝟙𝟚", "٣٣٣٣٣٣٣٣٣٣" * 500,
    "NaN", "nan", "inf", "-inf", "[[nan, 1], [1, 1]]", "[[1e999, 0], [0, 0]]", "[[1e20, 0], [0, 0]]",
    "[[1.5, 2], [3, 4]]", "[[True, None], [1, 1]]", "[[1j, 1], [1, 1]]", "[['a', 'b'], [1, 1]]",
    "[[{1}, 1], [1, 1]]", "[[b'1', 1], [1, 1]]", "[['\\d', 1], [1, 1]]", "[[[[[[[]]]]]]]",
    "[" * 5000 + "]" * 5000, "[[" * 5000, "[[1]," * 2000, "[[1] ," * 2000, "[[]" * 3300,
    "[[0, 1, 2], [2, 1, 0], [1, 1" + ", 1" * 3000, "ROW1=" * 2000, "ROW1=[" + "1," * 4000,
    "ROW1=[0\t1]\nROW2=[1, 0]", "ROW1=[-]\nROW2=[1,0]", "ROW1=[1-2, 1]\nROW2=[1,0]",
    "```python\n```", "```", "``````python", "<|im_end|>" * 100, "<|" * 3000, "no " * 3000,
    "twenty-" * 2000, "1.1." * 2500, "1,000," * 1500, "(A)" * 1000, "Answer: " * 1000,
    "True False " * 500, "x" * 10_000, "\x00" * 10_000, " " * 10_000, "\n" * 10_000,
    "\ud800", "\udfff lone surrogates \ud800",
]
ALPHABET = "0123456789[](),.-+ \n\t=ROWabcTrueFalse٣５²eE'\"`\\\x00|<>_*:"
GO = {"labels": [0, 2, 2, 1], "regime": "ID"}
CASES = [
    ("g2m", "transcribe", "", {"matrix": [[0, 1], [1, 0]]}),
    ("g2m", "transcribe", "", {"matrix": [[0, 1, 2], [2, 1, 0], [1, 1, 1]]}),
    ("go", "multimodal_num", "47", {"count": 47, **GO}),
    ("go", "text_only_tf", "True", {"count": 3, **GO}),
    ("counting", "standard", "5", {"count": 5, "objects": [], "image_size": 448, "patch_size": 14}),
    ("spatial", "choice", "B", {"relation": "left"}),
]
PARSERS = [parse_digit_string, parse_number, parse_choice_letter, parse_bool,
           lambda t: exact_match("free", t, "cat", None),  # type: ignore[arg-type]
           lambda t: parse_grid(t, 2, 2), lambda t: parse_grid(t, 3, 3), lambda t: parse_grid(t, 1, 2)]


def _random_texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        length = rng.choice([1, 3, 8, 30, 200, 2000])
        parts = [rng.choice(ALPHABET) for _ in range(length)]
        if rng.random() < 0.3:
            parts.insert(rng.randrange(len(parts) + 1), rng.choice(ADVERSARIAL[:40]))
        if rng.random() < 0.2:
            parts.insert(0, "[[")
        texts.append("".join(parts))
    return texts


TEXTS = ADVERSARIAL + _random_texts(0, 300)


@pytest.mark.parametrize(("family", "task", "answer", "truth"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_score_answer_never_raises(family, task, answer, truth):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a parser error caught by the guard would warn: fail instead
        for text in TEXTS:
            g = score_answer(family, task, text, answer, truth, n_tokens=3)
            assert g.text == text and g.n_tokens == 3
            assert isinstance(g.parse_ok, bool) and isinstance(g.correct, bool)
            assert 0.0 <= g.score <= 1.0
            assert g.parse_ok or (g.prediction is None and not g.correct)
            assert not (g.metrics or {}).get("parse_error")


@pytest.mark.parametrize("parser", PARSERS)
def test_every_parser_returns_quickly_on_adversarial_text(parser):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for text in ADVERSARIAL:
            start = time.perf_counter()
            parser(text)
            # The study's regex takes hours on a cut-off list of lists; ours is linear.
            assert time.perf_counter() - start < 5.0, f"{text[:40]!r}... took too long"


def test_the_issue_example_is_scored():
    g = score_answer("g2m", "transcribe", "[[1, 11111111111111111111]]", "", {"matrix": [[0, 1], [1, 0]]})
    # Step 1 refuses int64 overflow, step 3 finds 2 integers for 4 cells: a failed parse, 0 of 4.
    assert (g.parse_ok, g.correct, g.score, g.metrics) == (False, False, 0.0, {"cells_correct": 0, "cells_total": 4})


def test_a_huge_integer_is_a_wrong_cell_where_the_study_scores_it():
    g = score_answer("g2m", "transcribe", "[[1, 11111111111111111111]]", "", {"matrix": [[1, 0]]})
    assert g.parse_ok and g.prediction == [[1, 11111111111111111111]]
    assert (g.correct, g.metrics) == (False, {"cells_correct": 1, "cells_total": 2})


def test_a_number_too_long_to_read_is_no_answer():
    assert parse_digit_string(OVER_INT_LIMIT) is None
    assert parse_number(f"I count {OVER_INT_LIMIT} and 4") is None
    assert parse_number(f"4 or {OVER_INT_LIMIT}", which="last") is None
    assert parse_number(f"{OVER_INT_LIMIT} or 4", which="last") == 4
    assert parse_grid(f"{OVER_INT_LIMIT} 1 0 1", 2, 2) is None


def test_a_raising_parser_is_recorded_as_unparsable_not_raised():
    # A text that is not a str makes the real digit parser raise: the guard's job, loudly.
    with pytest.warns(RuntimeWarning, match="go/multimodal_num: the answer parser raised TypeError"):
        g = score_answer("go", "multimodal_num", 12345, "12", {"count": 12, **GO})  # type: ignore[arg-type]
    assert (g.parse_ok, g.correct, g.score, g.prediction) == (False, False, 0.0, None)
    assert g.metrics["parse_error"].startswith("TypeError")


def test_a_missing_truth_is_not_hidden_by_the_guard():
    with pytest.raises(KeyError, match="no key 'matrix'"):
        score_answer("g2m", "transcribe", "[[0]]", "", {})
    with pytest.raises(KeyError, match="no key 'count'"):
        score_answer("counting", "standard", "3", "3", {})


def test_an_unregistered_family_is_not_scored_by_a_silent_fallback():
    # The scorer used to fall back to exact match for any family it did not know.
    with pytest.raises(StimulusError, match="unknown stimulus family 'unknown'"):
        score_answer("unknown", "free", "cat", "cat", {})
