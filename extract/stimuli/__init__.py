"""Procedurally generated stimuli with exact ground truth: the inputs of every later stage.

Families (``python -m extract.stimuli --help``):

- ``g2m``      Grid2Matrix colour grids (study g2m)
- ``go``       Go boards for the counting lab, with text twins and contrastive pairs (study counting-bottleneck)
- ``counting`` CountingTricks: 32 cases of objects vs the patch grid (study counting-tricks)
- ``spatial``  two-object spatial relations, 4-way multiple choice (study images-as-text)

Each family is one module exposing ``FAMILY`` (a :class:`~extract.stimuli.base.Family`).
"""

from __future__ import annotations

import importlib

from extract.stimuli.base import Family, Stimulus, StimulusError, TaskInputs

# name -> module; imported lazily so one family's import cost never lands on another's user.
_MODULES = {
    "g2m": "extract.stimuli.g2m",
    "go": "extract.stimuli.goboard",
    "counting": "extract.stimuli.counting_tricks",
    "spatial": "extract.stimuli.spatial",
}


def family_names() -> list[str]:
    return list(_MODULES)


def get_family(name: str) -> Family:
    """The registered family called ``name``."""
    if name not in _MODULES:
        raise StimulusError(f"unknown stimulus family {name!r}: choose one of {', '.join(_MODULES)}")
    return importlib.import_module(_MODULES[name]).FAMILY


__all__ = ["Family", "Stimulus", "StimulusError", "TaskInputs", "family_names", "get_family"]
