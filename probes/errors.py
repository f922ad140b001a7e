"""What goes wrong in the probe farm, as exceptions whose messages say expected vs got and the fix."""

from __future__ import annotations

from store.config import did_you_mean

__all__ = ["PlanError", "ProbeError", "did_you_mean"]


class ProbeError(ValueError):
    """A probe, target or plan cannot do what was asked; the message says how to fix it."""


class PlanError(ProbeError):
    """The probe plan is invalid (before any training starts)."""
