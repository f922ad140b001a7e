"""Every public function of the packages' ``__init__`` surfaces has a docstring a tool can render:
numpydoc sections (as scikit-learn and xarray write them) naming each parameter and what it returns."""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable
from typing import Any

import pytest

PACKAGES = ("stimuli", "extract", "store", "probes", "queries", "lab")


def _sections(doc: str) -> dict[str, str]:
    """numpydoc sections: a title line underlined with dashes, then its body up to the next title."""
    parts = re.split(r"^\s*(\w[\w ]*)\n\s*-{3,}\s*$", doc, flags=re.MULTILINE)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def problems(fn: Callable[..., Any]) -> list[str]:
    """What ``fn``'s docstring lacks: a summary, each parameter under Parameters, a Returns section."""
    doc = inspect.getdoc(fn) or ""
    if not doc.strip():
        return ["no docstring"]
    sections, out = _sections(doc), []
    signature = inspect.signature(fn)
    names = [p.name for p in signature.parameters.values() if p.name not in ("self", "cls")]
    if names:
        heads = re.findall(r"^\**(\w+(?:\s*,\s*\**\w+)*)", sections.get("Parameters", ""), flags=re.MULTILINE)
        listed = {name.strip(" *") for head in heads for name in head.split(",")}  # "a, b : int" names two
        out += [f"parameter {n!r} not under Parameters" for n in names if n not in listed]
    returns = signature.return_annotation
    if returns not in (None, "None", inspect.Signature.empty) and not {"Returns", "Yields"} & set(sections):
        out.append("no Returns section")
    return out


def surface() -> list[tuple[str, str, Callable[..., Any]]]:
    found = []
    for package in PACKAGES:
        module = importlib.import_module(package)
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if inspect.isfunction(obj):
                found.append((package, name, obj))
    return found


@pytest.mark.parametrize("package, name, fn", surface(), ids=lambda x: x if isinstance(x, str) else "")
def test_public_functions_have_numpydoc_sections(package: str, name: str, fn: Callable[..., Any]) -> None:
    missing = problems(fn)
    assert not missing, f"{package}.{name}: " + "; ".join(missing)


def test_the_check_flags_what_is_missing() -> None:
    def bare(a: int, b: int = 0) -> int:
        """Add."""
        return a + b

    def documented(a: int, *, b: int = 0, c: int = 0) -> int:
        """Add.

        Parameters
        ----------
        a
            One.
        b, c : int
            The others.

        Returns
        -------
        int
        """
        return a + b + c

    def quiet(a: int) -> None:
        """Nothing back.

        Parameters
        ----------
        a
            Ignored.
        """

    assert problems(bare) == ["parameter 'a' not under Parameters", "parameter 'b' not under Parameters",
                              "no Returns section"]
    assert problems(documented) == [] and problems(quiet) == []
    assert problems(lambda x: x) == ["no docstring"]
