"""Procedurally generated stimuli with exact ground truth: the inputs of every later stage.

The families and what each draws: ``python -m stimuli --help``, and docs/stimuli/.
Each family is one module exposing ``FAMILY`` (a :class:`~stimuli.base.Family`: its
generator, truth schema, answer scorer and small-set size), listed once in ``FAMILIES`` below.
Nothing else names a family: the CLI, the scorer and the probe targets look it up here.
"""

from __future__ import annotations

from stimuli.base import Family, Score, Stimulus, StimulusError, TaskInputs, Truth, TruthError
from stimuli.registry import Registry


def _check_family(name: str, family: object) -> None:
    if not isinstance(family, Family) or family.name != name:
        module = FAMILIES.target(name).partition(":")[0]
        got = f"a Family named {family.name!r}" if isinstance(family, Family) else repr(family)[:60]
        raise StimulusError(
            f"stimulus family {name!r}: module {module} must define FAMILY = Family(name={name!r}, ...), found {got}"
        )


# The one list of families: name -> the module exposing FAMILY. A module is imported the first time
# its family is asked for, so reading a set of one family never pays for the others' imports.
FAMILIES: Registry[Family] = Registry("stimulus family", error=StimulusError, check=_check_family)
for _name, _module in {"g2m": "stimuli.g2m", "go": "stimuli.goboard", "counting": "stimuli.counting_tricks",
                       "spatial": "stimuli.spatial"}.items():
    FAMILIES.add_lazy(_name, f"{_module}:FAMILY")


def family_names() -> list[str]:
    """The registered families' names, the repository's first.

    Returns
    -------
    list[str]
        Names :func:`get_family` accepts, in registration order.
    """
    return FAMILIES.names()


def register_family(name: str, module: str) -> None:
    """Add family ``name``, defined by ``FAMILY`` in the importable ``module`` (imported lazily).

    The repository's families are registered the same way, above; this is the one line for a family
    that lives in a user's own module.

    Parameters
    ----------
    name
        The family's name, as sets, manifests and the CLI give it.
    module
        An importable module defining ``FAMILY = Family(name=name, ...)``; imported on the first
        :func:`get_family` of ``name``.

    Raises
    ------
    StimulusError
        ``name`` is already registered to another module.
    """
    FAMILIES.add_lazy(name, f"{module}:FAMILY")


def get_family(name: str) -> Family:
    """The registered family called ``name``.

    Parameters
    ----------
    name
        One of :func:`family_names`.

    Returns
    -------
    Family
        Its generator, truth schema, answer scorer and small-set size.

    Raises
    ------
    StimulusError
        No family has that name, or its module does not define a matching ``FAMILY``.
    """
    return FAMILIES.get(name)


__all__ = ["FAMILIES", "Family", "Score", "Stimulus", "StimulusError", "TaskInputs", "Truth", "TruthError",
           "family_names", "get_family", "register_family"]
