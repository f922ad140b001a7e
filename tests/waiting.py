"""Waiting for a condition in a test, with a deadline instead of a fixed sleep."""

from __future__ import annotations

import time
from typing import Any


def wait_for(predicate: Any, timeout: float = 30, step: float = 0.1) -> Any:
    """``predicate()``'s first truthy value, polled every ``step`` s; AssertionError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout} s waiting for {predicate}")
