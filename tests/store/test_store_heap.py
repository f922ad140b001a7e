"""store.heap.tune_malloc: a buffer freed and allocated again stays on the heap, not page-faulted in afresh."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc thresholds: Linux only")

# 40 rounds of a 2 MiB buffer, allocated, touched and freed: page faults counted over the loop (numpy asks
# for huge pages from 4 MiB on, which would fault 2 MiB at a time).
_LOOP = textwrap.dedent("""
    import resource, sys
    import numpy as np
    from store.heap import tune_malloc
    if sys.argv[1] == "tuned":
        tune_malloc()
    np.ones(2 << 18, dtype=np.float32)  # once before counting: the heap grows to hold it
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(40):
        np.ones(2 << 18, dtype=np.float32)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def _faults(mode: str) -> int:
    # Dask's nanny sets this for its workers; it freezes glibc's mmap threshold at 128 KiB.
    env = dict(os.environ, MALLOC_TRIM_THRESHOLD_="65536")
    out = subprocess.run([sys.executable, "-c", _LOOP, mode], capture_output=True, text=True, env=env, check=True)
    return int(out.stdout.strip())


def test_tuned_heap_keeps_a_reused_buffer() -> None:
    untuned, tuned = _faults("plain"), _faults("tuned")
    pages = 40 * (2 << 20) // 4096
    assert untuned > pages // 2, f"the untuned loop should map and fault each buffer afresh: {untuned} faults"
    assert tuned < pages // 20, f"tuned, the buffer should stay on the heap: {tuned} faults for {pages} pages"
