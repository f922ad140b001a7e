"""A Dask worker preload for the cluster tests (``dask worker --preload tests/extract/cluster_preload.py``).

Every batch a worker computes first writes a marker file ``<pid>-<start row>-<n>`` (its n-th batch) into
``$AGNOSIA_TEST_MARKERS`` (so a test knows which worker process is mid-task, and how far the run
got), then sleeps ``$AGNOSIA_TEST_BATCH_SLEEP`` seconds (so a kill lands mid-task, not between tasks).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any


def dask_setup(worker: Any) -> None:
    import extract.cluster.worker as cluster_worker

    real = cluster_worker.run_batch
    markers = Path(os.environ["AGNOSIA_TEST_MARKERS"])
    pause = float(os.environ.get("AGNOSIA_TEST_BATCH_SLEEP", "0"))

    count = [0]

    def marked(*args: Any, start: int = 0, **kwargs: Any) -> Any:
        count[0] += 1
        (markers / f"{os.getpid()}-{start}-{count[0]}").touch()
        time.sleep(pause)
        return real(*args, start=start, **kwargs)

    cluster_worker.run_batch = marked
