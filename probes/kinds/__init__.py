"""Probe kinds, registered by name. Importing this package registers the built-in ones; a new
kind is a new module with a ``@register_kind("name")`` class (see docs/new-probe.md)."""

from probes.kinds import conv_spatial, detect, hidden_number, lda, linear, pooled, ridge  # noqa: F401,E402  (register)
from probes.kinds.base import KINDS, Job, Outcome, Probe, ProbeParams, get_kind, register_kind
from probes.kinds.conv_spatial import ConvSpatialProbe
from probes.kinds.detect import DetectProbe
from probes.kinds.hidden_number import HiddenNumberProbe
from probes.kinds.linear import LinearProbe
from probes.kinds.pooled import PooledProbe
from probes.kinds.ridge import RidgeProbe

__all__ = ["KINDS", "ConvSpatialProbe", "DetectProbe", "HiddenNumberProbe", "Job", "LinearProbe", "Outcome", "PooledProbe",
           "Probe", "ProbeParams", "RidgeProbe", "get_kind", "register_kind"]
