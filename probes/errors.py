"""What goes wrong in the probe farm, as exceptions whose messages say expected vs got and the fix."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class ProbeError(ValueError):
    """A probe, target or plan cannot do what was asked; the message says how to fix it."""


class PlanError(ProbeError):
    """The probe plan is invalid (before any training starts)."""


def did_you_mean(word: str, known: Iterable[str]) -> str:
    known = sorted(known)
    lower = {k.lower(): k for k in known}
    close = difflib.get_close_matches(word.lower(), list(lower), n=1)  # 'c' should find 'C'
    return f" — did you mean {lower[close[0]]!r}?" if close else f"; known: {', '.join(known) or 'none'}"
