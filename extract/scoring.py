"""Parse and score a generated answer against a stimulus' truth, the way each study does.

One entry point, :func:`score_answer`, picks the parser by family and task:

| family   | task            | parser                          | correct when                      |
|----------|-----------------|---------------------------------|-----------------------------------|
| g2m      | transcribe      | ``g2m.parse_grid`` cascade      | the whole grid matches (EM); cells |
| go       | *_num           | ``parse_digit_string``          | the joined digits equal the count |
| go       | *_tf            | first True/False (yes/no) word  | it equals the reference           |
| counting | standard, conflict | ``parse_number`` (first)     | it equals the drawn count         |
| spatial  | choice          | ``parse_choice_letter`` (strict)| the letter is the shuffled answer |

Anything else falls back to an exact match of the stripped text. A failed parse is wrong.
"""

from __future__ import annotations

import re
from typing import Any

from extract.stimuli import g2m
from extract.stimuli.answers import parse_choice_letter, parse_digit_string, parse_number
from store import Generation

_BOOL = re.compile(r"\b(true|false|yes|no)\b", re.IGNORECASE)


def parse_bool(text: str | None) -> str | None:
    """``"True"``/``"False"`` from the first true/false/yes/no word, else None."""
    m = _BOOL.search(text or "")
    if not m:
        return None
    return "True" if m.group(1).lower() in ("true", "yes") else "False"


def score_answer(family: str, task: str, text: str, answer: str, truth: dict[str, Any],
                 n_tokens: int | None = None) -> Generation:
    if family == "g2m":
        s = g2m.score(text, truth["matrix"])
        return Generation(
            text=text,
            prediction=None if s.parsed is None else s.parsed.tolist(),
            parse_ok=s.parse_ok,
            correct=s.exact,
            score=s.cells_correct / s.cells_total,
            metrics={"cells_correct": s.cells_correct, "cells_total": s.cells_total},
            n_tokens=n_tokens,
        )
    if family == "go" and task.endswith("_num"):
        return _compare(text, parse_digit_string(text), truth["count"], n_tokens)
    if family == "go" and task.endswith("_tf"):
        return _compare(text, parse_bool(text), answer, n_tokens)
    if family == "counting":
        return _compare(text, parse_number(text), truth["count"], n_tokens)
    if family == "spatial":
        return _compare(text, parse_choice_letter(text), answer, n_tokens)
    return _compare(text, text.strip() or None, answer.strip(), n_tokens)


def _compare(text: str, parsed: Any, expected: Any, n_tokens: int | None) -> Generation:
    ok = parsed is not None
    correct = ok and parsed == expected
    return Generation(text=text, prediction=parsed, parse_ok=ok, correct=correct,
                      score=float(correct), n_tokens=n_tokens)
