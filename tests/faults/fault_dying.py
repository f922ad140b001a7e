"""A probe kind for the KilledWorker test: ``pooled``, except that it kills its own worker process
(SIGKILL, as the nanny does to a worker past its memory limit) while ``AGNOSIA_FAULT_DIE`` is set."""

from __future__ import annotations

import os
import signal

from probes import register_kind
from probes.kinds import PooledProbe


@register_kind("fault_dying")
class FaultDyingProbe(PooledProbe):
    @classmethod
    def evaluate(cls, Xs, jobs):
        if os.environ.get("AGNOSIA_FAULT_DIE"):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().evaluate(Xs, jobs)
