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
No answer text aborts scoring: every parser returns a value or None on any string.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from extract.stimuli import g2m
from extract.stimuli.answers import (
    parse_choice_letter,
    parse_digit_string,
    parse_number,
)
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
    """The parsed, scored generation; never raises on the answer text.

    A parser that raises anyway (a bug) does not abort the run: the answer is recorded as
    unparsable, with ``metrics["parse_error"]`` naming the exception, and a RuntimeWarning says
    so. The truth is read outside that guard, so a stimulus without its truth still fails loudly.
    """
    if family == "g2m":
        gt = np.asarray(truth["matrix"], dtype=np.int64)
        return _guarded(family, task, text, n_tokens, lambda: _score_grid(text, gt, n_tokens))
    read, expected = _reader(family, task, answer, truth)
    return _guarded(family, task, text, n_tokens, lambda: _compare(text, read(text), expected, n_tokens))


def _reader(family: str, task: str, answer: str, truth: dict[str, Any]) -> tuple[Callable[[str], Any], Any]:
    """The answer parser of a (family, task) and the value a correct answer parses to."""
    if family == "go" and task.endswith("_num"):
        return parse_digit_string, truth["count"]
    if family == "go" and task.endswith("_tf"):
        return parse_bool, answer
    if family == "counting":
        return parse_number, truth["count"]
    if family == "spatial":
        return parse_choice_letter, answer
    return (lambda text: text.strip() or None), answer.strip()


def _guarded(family: str, task: str, text: str, n_tokens: int | None,
             scored: Callable[[], Generation]) -> Generation:
    try:
        return scored()
    except Exception as err:  # noqa: BLE001 - one answer must not abort an extraction; recorded below
        reason = f"{type(err).__name__}: {err}"[:500]
        warnings.warn(f"{family}/{task}: the answer parser raised {reason}; recorded as unparsable",
                      RuntimeWarning, stacklevel=3)
        return Generation(text=text, prediction=None, parse_ok=False, correct=False, score=0.0,
                          metrics={"parse_error": reason}, n_tokens=n_tokens)


def _score_grid(text: str, gt: np.ndarray, n_tokens: int | None) -> Generation:
    s = g2m.score(text, gt)
    return Generation(
        text=text,
        prediction=None if s.parsed is None else s.parsed.tolist(),
        parse_ok=s.parse_ok,
        correct=s.exact,
        score=s.cells_correct / s.cells_total,
        metrics={"cells_correct": s.cells_correct, "cells_total": s.cells_total},
        n_tokens=n_tokens,
    )


def _compare(text: str, parsed: Any, expected: Any, n_tokens: int | None) -> Generation:
    ok = parsed is not None
    correct = ok and parsed == expected
    return Generation(text=text, prediction=parsed, parse_ok=ok, correct=correct,
                      score=float(correct), n_tokens=n_tokens)
