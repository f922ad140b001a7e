"""The errors of a cluster run that are neither the manifest's nor the store's."""

from __future__ import annotations


class ClusterError(Exception):
    """The cluster cannot run the extraction (no scheduler, no GPU worker, the scheduler lost)."""
