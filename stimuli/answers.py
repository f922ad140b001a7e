"""Answer parsers shared by families: numbers, digit strings, multiple-choice letters, true/false.

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
# Word edges that treat "_" as punctuation, so markdown like "__6__" still reads as 6.
_L, _R = r"(?<![^\W_])", r"(?![^\W_])"
# "no" means zero only as a determiner ("no circles"). Not as an interjection ("No, there are
# 4"), not the abbreviation "No. of circles", and not in idioms that carry no count.
_NO_IDIOMS = ("idea", "clue", "doubt", "way", "longer", "matter", "more", "less", "fewer", "problem", "need")
_UNITS = "one|two|three|four|five|six|seven|eight|nine"
_WORDS = sorted((w for w in NUMBER_WORDS if w != "no"), key=len, reverse=True)
# Whole words only: the MAS code's pattern had no word boundaries, so "not" read as "no" -> 0.
_NUMBER_RE = re.compile(
    # digits, "1,000"-style groups included; never part of a decimal ("3.5") or a name ("Qwen2")
    r"(?<![^\W_])(?<!\.)(\d{1,3}(?:,\d{3})+|\d+)(?![\d.]*\d)"
    r"|" + _L + r"(" + "|".join(sorted(_TENS, key=len, reverse=True)) + r")(?:[\s-]+(" + _UNITS + r"))?" + _R
    + r"|" + _L + r"(" + "|".join(_WORDS) + r")" + _R
    + r"|" + _L + r"(no)(?=\s+(?!(?:" + "|".join(_NO_IDIOMS) + r")\b)[^\W\d_])",
    re.IGNORECASE,
)


def _to_int(digits: str) -> int | None:
    """``int(digits)``, or None past Python's int() string limit (4300 digits by default).

    Such a number is no count anyone asked for; reading it as None (no answer) keeps a runaway
    generation from raising inside scoring.
    """
    try:
        return int(digits)
    except ValueError:
        return None


def parse_number(text: str | None, *, which: str = "first") -> int | None:
    """The first (or ``which="last"``) whole number in ``text``, as digits or English words.

    ``"There are three circles."`` -> 3, ``"I count 12"`` -> 12, ``"not sure"`` -> None,
    ``"twenty-one"`` -> 21, ``"no circles"`` -> 0, ``"No, there are 4"`` -> 4,
    ``"I have no idea"`` -> None, ``"1,000"`` -> 1000, ``"3.5"`` -> None. A chosen number too
    long for ``int()`` gives None rather than another number.
    """
    if which not in ("first", "last"):
        raise ValueError(f"which={which!r}: use 'first' or 'last'")
    if not text:
        return None
    found: list[int | None] = []
    for m in _NUMBER_RE.finditer(text):
        digits, tens, unit, word, no = m.groups()
        if digits is not None:
            found.append(_to_int(digits.replace(",", "")))
        elif tens is not None:
            found.append(_TENS[tens.lower()] + (NUMBER_WORDS[unit.lower()] if unit else 0))
        elif word is not None:
            found.append(NUMBER_WORDS[word.lower()])
        else:
            found.append(0)
        if which == "first":
            break
    if not found:
        return None
    return found[0] if which == "first" else found[-1]


_ASCII_DIGIT = re.compile(r"[0-9]")
# Chat-template and tokenizer markers such as "<|im_end|>", "<|eos|>", "<|extra_0|>".
_SPECIAL_TOKEN = re.compile(r"<\|[^<>|]*\|>")
_ANSWER_PREFIX = re.compile(
    r"^(?:(?:the|your|my)\s+)?(?:correct\s+|final\s+)?(?:answer|choice|option)\s*(?:is)?\s*[:\-]?\s*",
    re.IGNORECASE,
)


def parse_digit_string(text: str | None) -> int | None:
    """The counting lab's answer form: the digit characters of the answer joined into one integer.

    The toy model emits digits as separate tokens (``"4 7"`` -> 47). Returns ``None`` when the
    answer holds no digit (the study's code mapped that to 0, which hides empty answers), or
    more digits than ``int()`` reads (a runaway answer).
    """
    if text is None:
        return None
    # ASCII only: str.isdigit() also accepts "²" or "①", which int() then rejects with a crash.
    # Special tokens go first so a raw decode's "<|extra_0|>" adds no digit.
    digits = "".join(_ASCII_DIGIT.findall(_SPECIAL_TOKEN.sub(" ", text)))
    return _to_int(digits) if digits else None


def parse_choice_letter(text: str | None, letters: str = "ABCD") -> str | None:
    """A strict multiple-choice reading: the answer is exactly one option letter.

    Accepted: ``"B"``, ``" b "``, ``"B."``, ``"B:"``, ``"B: the cat is left of..."``, ``"(B)"``,
    ``"Answer: B"``, ``"The correct answer is B."``, ``"**B**"``, ``"B<|im_end|>"``. Anything
    that names no letter or several (``"A or B"``), or hedges (``"I think B"``), is ``None``.
    """
    if text is None:
        return None
    # Raw decodes keep special tokens and chat models bold their pick; neither is content.
    s = _SPECIAL_TOKEN.sub(" ", text).replace("*", "").strip()
    s = _ANSWER_PREFIX.sub("", s)
    m = re.fullmatch(r"\(?([A-Za-z])\)?\s*(?:[.:)]\s*.*)?", s, flags=re.DOTALL)
    if not m:
        return None
    letter = m.group(1).upper()
    return letter if letter in letters else None


_BOOL = re.compile(r"\b(true|false|yes|no)\b", re.IGNORECASE)


def parse_bool(text: str | None) -> str | None:
    """``"True"``/``"False"`` from the first true/false/yes/no word, else None."""
    m = _BOOL.search(text or "")
    if not m:
        return None
    return "True" if m.group(1).lower() in ("true", "yes") else "False"
