"""A probe kind for the Dask fault test: ``pooled``, made slow (``AGNOSIA_FAULT_SLOW_S`` seconds
per group, default 1) while the file named by ``AGNOSIA_FAULT_SLOW_FLAG`` exists, so a worker and
the farm's client can be killed mid-plan; without the file it is exactly ``pooled``."""

from __future__ import annotations

import os
import time

from probes import register_kind
from probes.kinds import PooledProbe


@register_kind("fault_pooled")
class FaultPooledProbe(PooledProbe):
    @classmethod
    def evaluate(cls, Xs, jobs):
        flag = os.environ.get("AGNOSIA_FAULT_SLOW_FLAG")
        if flag and os.path.exists(flag):
            time.sleep(float(os.environ.get("AGNOSIA_FAULT_SLOW_S", "1.0")))
        return super().evaluate(Xs, jobs)
