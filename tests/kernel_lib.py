"""Tests of a C kernel run twice: on the kernel, and on the numpy passes that stand in where no
compiler built it (the kernels are optional builds: setup.py)."""

from __future__ import annotations

from typing import Any

import pytest

PATHS = ["kernel", "numpy"]


def kernel_or_numpy(request: Any, monkeypatch: pytest.MonkeyPatch, owner: Any, attr: str, name: str) -> str:
    """The body of a fixture parametrized over :data:`PATHS`: ``owner.attr`` is the kernel's module
    (None where it was not built), ``name`` its import name for the skip message."""
    if request.param == "numpy":
        monkeypatch.setattr(owner, attr, None)
    elif getattr(owner, attr) is None:
        pytest.skip(f"{name} was not built (no C compiler at install)")
    return str(request.param)
