"""Where the probe farm's Dask tasks run: ``--scheduler auto | inline | local | ADDRESS``.

* ``local``: a ``LocalCluster`` of worker processes, one thread each (``--workers``, default one
  per core). Its start-up is seconds to a minute on a busy 2-core machine: every worker process
  imports torch and warms its solver before the first probe trains.
* ``inline``: one Dask worker thread in this process (``LocalCluster(processes=False)``): the
  same tasks through the same Dask calls, so the same rows, without starting or warming
  processes. It trains one group at a time, so it only suits small plans.
* ``auto`` (the default): ``inline`` for a plan of at most :data:`SMALL_PLAN` probes to train
  when ``--workers`` is not given, else ``local``.
* anything else: the address of a running scheduler.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from probes.errors import ProbeError

AUTO, INLINE, LOCAL = "auto", "inline", "local"
# `python -m probes manifests/probes-demo.yaml` on a loaded 2-core machine once spent ~45 s starting
# and warming a LocalCluster, then 7.5 s training its 14 probes on 2 workers (about twice that on one
# thread). Up to this many probes the start-up is most of the wall time, so one thread here finishes first.
SMALL_PLAN = 64


def resolve(scheduler: str | None, workers: int | None, n_probes: int) -> str:
    """``inline``, ``local`` or a scheduler address, for a plan of ``n_probes`` probes to train."""
    choice = scheduler or AUTO
    if choice != AUTO:
        return choice
    return INLINE if workers is None and n_probes <= SMALL_PLAN else LOCAL


def start(scheduler: str | None, workers: int | None, n_jobs: int, n_probes: int, limit: int | None,
          report: Any, log: Callable[[str], None]) -> tuple[Any, Any]:
    """(client, cluster or None) for ``scheduler`` (see :func:`resolve`); ``report.workers`` set."""
    import dask
    from dask.distributed import Client, LocalCluster

    # Not the process's default client: the farm names its client in every call, and a default
    # one rewrites dask's global scheduler setting, which a caller's own client (or a farm run in a
    # thread beside it) then restores out of order, leaving later dask work asking for a closed client.
    mode = resolve(scheduler, workers, n_probes)
    if mode == INLINE:
        why = "" if scheduler == INLINE else f" (auto: {n_probes} probes; --scheduler local for worker processes)"
        log(f"starting an in-process Dask worker{why}…")
        # No memory limit: in this process Dask would measure the client's memory as the worker's
        # and pause it; every task's planned peak was already checked against the plan's limit.
        cluster = LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0",
                               silence_logs=logging.ERROR, memory_limit=0)
        report.workers = 1
        return Client(cluster, set_as_default=False), cluster
    if mode == LOCAL:
        n = workers or max(1, min(os.cpu_count() or 1, n_jobs))
        log(f"starting a Dask LocalCluster ({n} worker process{'es' if n > 1 else ''})…")
        # No pausing at 80 % of the limit: the farm's memory plan admits only tasks that fit, and a
        # worker's RSS does not fall once its task ends (freed pages stay with the allocator), so a
        # paused worker never resumed and a plan that fitted stalled. Dask still restarts a worker
        # that passes 95 % of its limit.
        with dask.config.set({"distributed.worker.memory.pause": False}):
            cluster = LocalCluster(n_workers=n, threads_per_worker=1, processes=True, dashboard_address=":0",
                                   silence_logs=logging.ERROR, memory_limit=limit if limit else "auto")
        report.workers = n
        return Client(cluster, set_as_default=False), cluster
    log(f"connecting to the Dask scheduler at {mode}…")
    return _connect(mode, limit, report), None


def _connect(address: str, limit: int | None, report: Any) -> Any:
    from dask.distributed import Client

    client = Client(address, timeout="30s", set_as_default=False)
    if not client.scheduler_info().get("workers"):
        client.wait_for_workers(1, timeout=60)
    info = client.scheduler_info().get("workers", {})
    report.workers = len(info)
    limits: list[int] = [int(w.get("memory_limit") or 0) for w in info.values()]
    if limit and limits and min(limits) and min(limits) < limit:
        client.close()
        raise ProbeError(f"the cluster's workers have {min(limits) >> 20} MiB of memory limit, the plan was checked"
                         f" against {limit >> 20} MiB: start them with `dask worker --memory-limit {limit >> 20}MiB`")
    return client
