"""The two strict answer readers: the counting lab's digit strings and multiple-choice letters."""

from __future__ import annotations

import pytest

from stimuli.answers import parse_choice_letter, parse_digit_string


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("47", 47),
        ("4 7", 47),  # the toy model's digits arrive as separate tokens
        ("4 7 <|assistant_end|> <|eos|>", 47),
        ("0 7", 7),  # the study's two-digit form
        ("07", 7),
        ("1 2 0", 120),  # FE counts need three digits
        (" 9\n", 9),
        ("", None),
        ("<|eos|>", None),  # an empty generation is no answer, not 0
        ("<|assistant_end|>", None),
        ("no idea", None),
        (None, None),
        ("<|extra_0|> 3", 3),  # digits inside special tokens are not the answer
        ("²", None),  # str.isdigit() is true here, int() is not: must not crash
        ("1²3", 13),
    ],
)
def test_parse_digit_string(text: str | None, expected: int | None) -> None:
    assert parse_digit_string(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("B", "B"),
        ("b.", "B"),
        (" c ", "C"),
        ("(C)", "C"),
        ("C)", "C"),
        ("D:", "D"),
        ("Answer: D", "D"),
        ("answer - a", "A"),
        ("The answer is C: a red circle is to the left of a blue square", "C"),
        ("The correct answer is B.", "B"),
        ("Your answer is: C", "C"),
        ("Your choice is: (D)", "D"),
        ("(A) A red circle is above a green square", "A"),
        ("**B**", "B"),
        ("B<|im_end|>", "B"),
        ("A\n", "A"),
        ("A or B", None),
        ("A, B", None),
        ("Bob", None),
        ("I think B", None),
        ("A red circle is to the left of a blue square", None),  # caption, not a letter
        ("E", None),
        ("E.", None),
        ("", None),
        ("   ", None),
        ("<|im_end|>", None),
        ("Answer:", None),
        (None, None),
    ],
)
def test_parse_choice_letter(text: str | None, expected: str | None) -> None:
    assert parse_choice_letter(text) == expected


def test_parse_choice_letter_respects_the_letter_set() -> None:
    assert parse_choice_letter("E", letters="ABCDE") == "E"
    assert parse_choice_letter("D", letters="ABC") is None
