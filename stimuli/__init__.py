"""Procedurally generated stimuli with exact ground truth: the inputs of every later stage.

The families and what each draws: ``python -m stimuli --help``, and docs/stimuli/.
Each family is one module exposing ``FAMILY`` (a :class:`~stimuli.base.Family`: its
generator, truth schema, answer scorer and small-set size), listed once in ``FAMILIES`` below.
Nothing else names a family: the CLI, the scorer and the probe targets look it up here.
"""

from __future__ import annotations

import importlib

from stimuli.base import Family, Score, Stimulus, StimulusError, TaskInputs, Truth, TruthError

# The one list of families: name -> module exposing FAMILY. A module is imported the first time
# its family is asked for, so reading a set of one family never pays for the others' imports.
FAMILIES = {
    "g2m": "stimuli.g2m",
    "go": "stimuli.goboard",
    "counting": "stimuli.counting_tricks",
    "spatial": "stimuli.spatial",
}


def family_names() -> list[str]:
    return list(FAMILIES)


def register_family(name: str, module: str) -> None:
    """Add family ``name``, defined by ``FAMILY`` in the importable ``module`` (imported lazily).

    The repository's families are the ``FAMILIES`` entries; this is the same line for a family
    that lives in a user's own module.
    """
    if FAMILIES.get(name, module) != module:
        raise StimulusError(f"stimulus family {name!r} is already registered to {FAMILIES[name]}: pick another name")
    FAMILIES[name] = module


def get_family(name: str) -> Family:
    """The registered family called ``name``."""
    if name not in FAMILIES:
        raise StimulusError(f"unknown stimulus family {name!r}: choose one of {', '.join(FAMILIES)}")
    family = getattr(importlib.import_module(FAMILIES[name]), "FAMILY", None)
    if not isinstance(family, Family) or family.name != name:
        got = f"a Family named {family.name!r}" if isinstance(family, Family) else repr(family)[:60]
        raise StimulusError(
            f"stimulus family {name!r}: module {FAMILIES[name]} must define FAMILY = Family(name={name!r}, ...),"
            f" found {got}"
        )
    return family


__all__ = ["FAMILIES", "Family", "Score", "Stimulus", "StimulusError", "TaskInputs", "Truth", "TruthError",
           "family_names", "get_family", "register_family"]
