"""The one progress bar of every stage: stimulus sets, extraction, the probe farm, the toy lab.

It lives in ``stimuli`` because that is the first stage: every later one may import it, and the
import is cheap (no model, no store). Every command shows it the same way: tqdm on stderr, off
with ``--no-progress``, and off by itself when stderr is not a terminal (a log file, a pipe, CI),
where a redrawn bar is only noise.
"""

from __future__ import annotations

import sys
from typing import Any


def progress_bar(total: int | None, *, unit: str, enabled: bool = True, desc: str | None = None, **options: Any) -> Any:
    """A tqdm bar over ``total`` items (None: a counter without an end), or a silent one."""
    from tqdm.auto import tqdm

    # disable=None: tqdm turns itself off when its file is not a TTY; notebooks still get their widget.
    return tqdm(total=total, unit=unit, desc=desc, disable=None if enabled else True, file=sys.stderr,
                dynamic_ncols=True, **options)
