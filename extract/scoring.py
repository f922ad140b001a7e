"""Parse and score a generated answer against a stimulus' truth, the way each study does.

One entry point, :func:`score_answer`: it looks the family up in the registry
(:mod:`stimuli`), reads the truth through the family's :class:`~stimuli.Truth`
schema and calls the family's ``score``. The parsers live with their families: each family
module's ``score_answer`` says which parser it uses and when an answer is right (e.g. g2m: the
``parse_grid`` cascade, right when the whole grid matches; go ``*_num``: the joined digits equal
the count); the shared parsers are in :mod:`stimuli.answers`.

A family without a ``score`` of its own is scored by exact match of the stripped text, which
its ``Family`` declares (``exact_match``, the default); an unregistered family fails loudly.
A failed parse is wrong. No answer text aborts scoring: every parser returns a value or None on
any string, and a scorer that raises anyway is recorded as unparsable (see :func:`score_answer`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from stimuli import Score, get_family
from stimuli.answers import parse_bool
from store import Generation

__all__ = ["parse_bool", "score_answer"]


def score_answer(family: str, task: str, text: str, answer: str, truth: dict[str, Any],
                 n_tokens: int | None = None) -> Generation:
    """The parsed, scored generation; never raises on the answer text.

    A scorer that raises anyway (a bug) does not abort the run: the answer is recorded as
    unparsable, with ``metrics["parse_error"]`` naming the exception, and a RuntimeWarning says
    so. The family and its truth are read outside that guard, so an unknown family or a truth
    without a key the family's schema declares still fails loudly (:class:`~stimuli.TruthError`).
    """
    fam = get_family(family)
    typed = fam.read_truth(truth)
    return _guarded(family, task, text, n_tokens, lambda: fam.score(task, text, answer, typed))


def _guarded(family: str, task: str, text: str, n_tokens: int | None, scored: Callable[[], Score]) -> Generation:
    try:
        s = scored()
        return Generation(text=text, prediction=s.prediction, parse_ok=s.parse_ok, correct=s.correct,
                          score=s.score, metrics=s.metrics, n_tokens=n_tokens)
    except Exception as err:  # noqa: BLE001 - one answer must not abort an extraction; recorded below
        reason = f"{type(err).__name__}: {err}"[:500]
        warnings.warn(f"{family}/{task}: the answer parser raised {reason}; recorded as unparsable",
                      RuntimeWarning, stacklevel=3)
        return Generation(text=text, prediction=None, parse_ok=False, correct=False, score=0.0,
                          metrics={"parse_error": reason}, n_tokens=n_tokens)
