"""Where a cluster run's tasks run: ``--scheduler auto | inline | local | ADDRESS``.

* ``inline``: one Dask worker thread in this process with a ``GPU`` resource: the cluster path's
  tasks and commits without starting processes (the model loads in this process, once).
* ``local``: a ``LocalCluster`` of ``--workers`` worker processes, each with ``GPU=1`` and the
  machine's cores shared between them. On a GPU machine it suits one GPU; for several, start
  one ``dask worker`` per card (docs/scale.md): worker processes of a LocalCluster all see every card.
* ``auto``: ``local`` when ``--workers`` is given, else ``inline``.
* anything else: the address of a running scheduler whose workers were started with
  ``--resources GPU=1``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from extract.cluster.errors import ClusterError

AUTO, INLINE, LOCAL = "auto", "inline", "local"
#: The resource a worker must hold to run extraction tasks (``dask worker --resources GPU=1``): one
#: task at a time per card, whatever the worker's thread count.
GPU = "GPU"


def resolve(scheduler: str, workers: int | None) -> str:
    """``inline``, ``local`` or a scheduler address."""
    if scheduler != AUTO:
        return scheduler
    return LOCAL if workers is not None else INLINE


def connect(scheduler: str, workers: int | None, log: Callable[[str], None]) -> tuple[Any, Any]:
    """(client, cluster or None) for ``scheduler`` (see :func:`resolve`)."""
    from dask.distributed import Client, LocalCluster

    mode = resolve(scheduler, workers)
    cores = os.cpu_count() or 1
    if mode == INLINE:
        log("starting an in-process Dask worker with one GPU slot…")
        cluster = LocalCluster(n_workers=1, threads_per_worker=cores, processes=False, dashboard_address=":0",
                               silence_logs=logging.ERROR, memory_limit=0, resources={GPU: 1})
        return Client(cluster, set_as_default=False), cluster
    if mode == LOCAL:
        n = workers or 1
        log(f"starting a Dask LocalCluster ({n} worker process{'es' if n > 1 else ''}, one GPU slot each)…")
        cluster = LocalCluster(n_workers=n, threads_per_worker=max(1, cores // n), processes=True,
                               dashboard_address=":0", silence_logs=logging.ERROR, memory_limit=0, resources={GPU: 1})
        return Client(cluster, set_as_default=False), cluster
    log(f"connecting to the Dask scheduler at {mode}…")
    try:
        client = Client(mode, timeout="30s", set_as_default=False)
    except (OSError, TimeoutError) as err:
        raise ClusterError(f"cannot reach the Dask scheduler at {mode} ({type(err).__name__}: {err}): start it with"
                           " `dask scheduler`, or check the address (tcp://HOST:8786)") from None
    try:
        gpu_workers(client, wait=60.0)
    except BaseException:
        client.close()
        raise
    return client, None


def gpu_workers(client: Any, wait: float = 0.0) -> dict[str, str]:
    """The workers holding a GPU resource, address -> name as an error names it (waiting up to ``wait``
    seconds for a first one)."""
    import time

    deadline = time.monotonic() + wait
    while True:
        info = client.scheduler_info(n_workers=-1).get("workers", {})
        found = {a: f"{w.get('name', a)} ({a})" for a, w in sorted(info.items())
                 if (w.get("resources") or {}).get(GPU, 0) >= 1}
        if found or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    if not found:
        others = f" ({len(info)} worker(s) without one)" if info else ""
        raise ClusterError(f"the cluster has no worker with a {GPU} resource{others}: start one per GPU with"
                           f" `dask worker ADDRESS --resources {GPU}=1 --nthreads 1`")
    return found
