"""Errors raised by the model side of extraction.

Every message says what was expected, what was found and how to fix it, because these errors
are read by someone launching a long extraction who must not have to open the source.
"""

from __future__ import annotations


class ModelError(Exception):
    """Base class: anything wrong with a model, its inputs or a requested tap."""


class ModelNotFoundError(ModelError, FileNotFoundError):
    """The model folder (or Hugging Face id) cannot be found or read."""


class UnknownArchitectureError(ModelError, ValueError):
    """The model's ``config.model_type`` has no adapter."""


class TapError(ModelError, ValueError):
    """A requested tap, layer, site or token kind does not exist for this model."""


class InputError(ModelError, ValueError):
    """An image or prompt cannot be turned into model inputs."""


class NonFiniteActivationError(ModelError, FloatingPointError):
    """A captured activation holds NaN or inf."""


class ConfigGeometryError(ModelError, NotImplementedError):
    """The adapter cannot give an image's geometry from ``config.json`` alone (its image tokens need
    the processor files), so a dry run cannot size this model without them."""


class UntrustedCodeError(ModelError, ValueError):
    """The model ships its own Python code and the manifest did not set ``trust_remote_code``."""


class WeightsError(ModelError, ValueError):
    """The model's weight files are damaged, or hold a pickle that the safe loader refuses."""


class DeviceError(ModelError, ValueError):
    """The requested device does not exist on this machine (e.g. ``cuda`` without a GPU)."""
