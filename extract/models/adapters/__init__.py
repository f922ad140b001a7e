"""Adapter registry: ``config.model_type`` -> the adapter class of that family.

Adding a family is one file in this folder that defines an :class:`Adapter` subclass decorated with
:func:`register`, plus its import in ``_FAMILY_MODULES`` below (see docs/adapters.md).
"""

from __future__ import annotations

import importlib

from ..errors import UnknownArchitectureError
from .base import Adapter

_REGISTRY: dict[str, type[Adapter]] = {}
_FAMILY_MODULES = (
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
_loaded = False


def register(cls: type[Adapter]) -> type[Adapter]:
    """Class decorator: serve every ``cls.model_types`` with ``cls``."""
    if not cls.model_types:
        raise TypeError(f"{cls.__name__}: set model_types before registering")
    for model_type in cls.model_types:
        if model_type in _REGISTRY and _REGISTRY[model_type] is not cls:
            raise TypeError(f"model_type {model_type!r} is served by both {_REGISTRY[model_type].__name__} and {cls.__name__}")
        _REGISTRY[model_type] = cls
    return cls


def registry() -> dict[str, type[Adapter]]:
    global _loaded
    if not _loaded:
        for name in _FAMILY_MODULES:
            importlib.import_module(f"{__name__}.{name}")
        for cls in set(_REGISTRY.values()):
            cls.register_auto_classes()
        _loaded = True
    return dict(_REGISTRY)


def supported() -> list[str]:
    return sorted(registry())


def adapter_class(model_type: str) -> type[Adapter]:
    reg = registry()
    if model_type not in reg:
        raise UnknownArchitectureError(
            f"no adapter for model_type {model_type!r}: supported model types are {', '.join(sorted(reg))}."
            " To add one, write a small Adapter subclass in extract/models/adapters/ (module paths,"
            " geometry, optional tiny-model recipe) and register it; see docs/adapters.md"
        )
    return reg[model_type]


def adapter_for(model) -> Adapter:  # noqa: ANN001 - any transformers PreTrainedModel
    return adapter_class(model.config.model_type)(model)


__all__ = ["Adapter", "adapter_class", "adapter_for", "register", "registry", "supported"]
