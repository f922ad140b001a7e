"""Adapter registry: ``config.model_type`` -> the adapter class of that family.

``ADAPTERS`` is a :class:`stimuli.registry.Registry`, the one style of every named extension.
Adding a family is one file in this folder that defines an :class:`Adapter` subclass decorated with
:func:`register`, plus its module's name in ``FAMILY_MODULES`` below (see docs/adapters.md). An
adapter defined in a user's own module registers itself the same way when that module is imported.
"""

from __future__ import annotations

from stimuli.registry import Registry

from ..errors import UnknownArchitectureError
from .base import Adapter

# The repository's families. Each module registers its class under every model type it serves, so
# the names are known only once it is imported: all are imported on the registry's first lookup.
FAMILY_MODULES = (
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "llava",
    "llava_next",
    "llava_onevision",
    "internvl",
    "idefics3",
    "gemma3",
    "paligemma",
    "toy",
)

ADAPTERS: Registry[type[Adapter]] = Registry(
    "model adapter", error=UnknownArchitectureError,
    hint="To add one, write a small Adapter subclass (see docs/adapters.md) and decorate it with @register")
ADAPTERS.import_on_lookup(*(f"{__name__}.{name}" for name in FAMILY_MODULES))

# Adapter classes whose transformers Auto classes are registered (once each, on the first lookup
# that finds them: a family of transformers' own registers nothing, the toy registers its model).
_auto_registered: set[type[Adapter]] = set()


def register(cls: type[Adapter]) -> type[Adapter]:
    """Class decorator: serve every ``cls.model_types`` with ``cls``."""
    if not cls.model_types:
        raise TypeError(f"{cls.__name__}: set model_types before registering")
    for model_type in cls.model_types:
        try:
            ADAPTERS.add(model_type, cls)
        except UnknownArchitectureError as err:
            # two classes claiming one model type is a programming error, not an unknown architecture
            raise TypeError(f"{cls.__name__}: {err}") from None
    return cls


def registry() -> dict[str, type[Adapter]]:
    """Every registered model type -> its adapter class (importing the family modules the first time)."""
    found = dict(ADAPTERS.items())
    for cls in dict.fromkeys(found.values()):
        if cls not in _auto_registered:
            cls.register_auto_classes()
            _auto_registered.add(cls)
    return found


def supported() -> list[str]:
    """The model types an adapter serves, sorted."""
    return sorted(registry())


def adapter_class(model_type: str) -> type[Adapter]:
    """The adapter class serving ``model_type``; an unknown one raises :class:`UnknownArchitectureError`."""
    reg = registry()
    if model_type not in reg:
        raise UnknownArchitectureError(
            f"no adapter for model_type {model_type!r}: supported model types are {', '.join(sorted(reg))}."
            " To add one, write a small Adapter subclass in extract/models/adapters/ (module paths,"
            " geometry, optional tiny-model recipe) and register it; see docs/adapters.md"
        )
    return reg[model_type]


def adapter_for(model) -> Adapter:  # noqa: ANN001 - any transformers PreTrainedModel
    """The adapter of a loaded model, chosen by its ``config.model_type``."""
    return adapter_class(model.config.model_type)(model)


__all__ = ["ADAPTERS", "FAMILY_MODULES", "Adapter", "adapter_class", "adapter_for", "register", "registry",
           "supported"]
