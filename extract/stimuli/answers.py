"""Answer parsers shared by families: numbers, digit strings, multiple-choice letters.

Each parser returns ``None`` when the text holds no answer of its kind; callers count that as
wrong (never as a silent default), matching the studies' denominators.
"""

from __future__ import annotations

import re

NUMBER_WORDS = {
    "zero": 0, "no": 0, "none": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5,
    "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12,
    "thirteen": 13, "fourteen": 14, "fifteen": 15, "sixteen": 16, "seventeen": 17,
    "eighteen": 18, "nineteen": 19, "twenty": 20,
}
_TENS = {"twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70,
         "eighty": 80, "ninety": 90}
# Whole words only: the MAS code's pattern had no word boundaries, so "not" read as "no" -> 0.
_NUMBER_RE = re.compile(
    r"(?<![\w.])(\d+)(?![\d.]*\d)"
    r"|\b(" + "|".join(sorted(_TENS, key=len, reverse=True)) + r")(?:[\s-]+(one|two|three|four|five|six|seven|eight|nine))?\b"
    r"|\b(" + "|".join(sorted(NUMBER_WORDS, key=len, reverse=True)) + r")\b",
    re.IGNORECASE,
)


def parse_number(text: str | None, *, which: str = "first") -> int | None:
    """The first (or ``which="last"``) whole number in ``text``, as digits or English words.

    ``"There are three circles."`` -> 3, ``"I count 12"`` -> 12, ``"not sure"`` -> None,
    ``"twenty-one"`` -> 21, ``"no circles"`` -> 0.
    """
    if not text:
        return None
    found = []
    for m in _NUMBER_RE.finditer(text):
        digits, tens, unit, word = m.groups()
        if digits is not None:
            found.append(int(digits))
        elif tens is not None:
            found.append(_TENS[tens.lower()] + (NUMBER_WORDS[unit.lower()] if unit else 0))
        else:
            found.append(NUMBER_WORDS[word.lower()])
        if which == "first":
            break
    if not found:
        return None
    return found[0] if which == "first" else found[-1]


def parse_digit_string(text: str | None) -> int | None:
    """The counting lab's answer form: the digit characters of the answer joined into one integer.

    The toy model emits digits as separate tokens (``"4 7"`` -> 47). Returns ``None`` when the
    answer holds no digit (the study's code mapped that to 0, which hides empty answers).
    """
    if text is None:
        return None
    digits = "".join(ch for ch in text if ch.isdigit())
    return int(digits) if digits else None


def parse_choice_letter(text: str | None, letters: str = "ABCD") -> str | None:
    """A strict multiple-choice reading: the answer is exactly one option letter.

    Accepted: ``"B"``, ``" b "``, ``"B."``, ``"B:"``, ``"B: the cat is left of..."``, ``"(B)"``,
    ``"Answer: B"``. Anything that names no letter or several (``"A or B"``) is ``None``.
    """
    if text is None:
        return None
    s = text.strip()
    s = re.sub(r"^(?:the\s+)?(?:answer|choice|option)\s*(?:is)?\s*[:\-]?\s*", "", s, flags=re.IGNORECASE)
    m = re.fullmatch(r"\(?([A-Za-z])\)?\s*(?:[.:)]\s*.*)?", s, flags=re.DOTALL)
    if not m:
        return None
    letter = m.group(1).upper()
    return letter if letter in letters else None
