"""A plugin kind for the Dask tests: pooled, made slow enough that a worker can be killed mid-plan."""

from __future__ import annotations

import time

from probes import register_kind
from probes.kinds import PooledProbe


@register_kind("slow_pooled")
class SlowPooledProbe(PooledProbe):
    @classmethod
    def evaluate(cls, Xs, jobs):
        time.sleep(0.4)
        return super().evaluate(Xs, jobs)
