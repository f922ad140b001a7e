"""parse_number on the kind of text VLMs actually write back to a counting question."""

from __future__ import annotations

import pytest

from stimuli.answers import parse_number


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("There are 5 red circles.", 5),
        ("I see no circles", 0),
        ("There are no red circles in the image.", 0),
        ("I'm not sure, maybe three", 3),  # "not" must not read as "no" (the MAS code's bug)
        ("**Answer:** 7", 7),
        ("The answer is: **8**", 8),
        ("__6__", 6),
        ("circles: 12", 12),
        ("circles: 07", 7),
        ("twenty-one", 21),
        ("Twenty Two circles", 22),
        ("seventy", 70),
        ("sixteen circles", 16),  # not "six"
        ("There are ten.", 10),
        ("12.", 12),
        ("0", 0),
        ("None of them are red.", 0),
        ("No, there are 4 circles.", 4),  # interjection, not a count
        ("No. of circles: 5", 5),  # abbreviation of "number"
        ("no more than 5", 5),
        ("There are 1,000 dots", 1000),
        ("Qwen2.5-VL says 4", 4),  # digits inside a name are not the answer
        ("There are ５ circles", 5),  # full-width digit
    ],
)
def test_parse_number_reads_messy_answers(text: str, expected: int) -> None:
    assert parse_number(text) == expected


@pytest.mark.parametrize(
    "text",
    [None, "", "I have no idea.", "Nothing here", "not sure", "3.5", "tenth", "often", "someone", "nothing"],
)
def test_parse_number_finds_nothing(text: str | None) -> None:
    assert parse_number(text) is None


def test_parse_number_last() -> None:
    assert parse_number("I first thought 3, but the answer is circles: 4", which="last") == 4
    assert parse_number("No, 4 circles... no wait, five", which="last") == 5
    assert parse_number("I count 1,2,3", which="last") == 3
    assert parse_number("I count 1,2,3") == 1


def test_parse_number_rejects_unknown_which() -> None:
    with pytest.raises(ValueError, match="which"):
        parse_number("3", which="middle")
