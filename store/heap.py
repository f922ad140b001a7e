"""glibc heap thresholds for a process that allocates and frees the same large buffers over and over.

glibc returns the heap's free top to the OS once it exceeds a trim threshold, and serves blocks
over an mmap threshold with a fresh mapping each time; both thresholds adapt by default. A
returned page is zeroed and page-faulted in again at its next use, so a loop whose buffers fall
just on the wrong side of either threshold pays the kernel for its memory on every step:

- **A probe-farm worker.** Dask's nanny sets ``MALLOC_TRIM_THRESHOLD_=65536`` so workers hand
  freed memory back. Setting it also freezes the mmap threshold at 128 KiB, so every solver
  temporary (an [n, P] float32 block is ~1 MB) was mmap'd, faulted in and unmapped on each of ~40
  L-BFGS evaluations: measured 1.5x slower than the same group in a plain process.
- **An extraction.** The writer thread frees a batch's captured tensors after the main thread
  has moved on, so the main heap's top swings by a few MiB between batches: glibc trimmed ~3.7
  MiB off it every other batch of 1 and the next batch's image processing faulted it back in
  (docs/benchmarks.md, "Run F": 95,000-159,000 page faults in 200 samples of tiny Qwen2-VL
  against 12,000-15,000 for a bare forward of the same batches; 17,000-19,000 once tuned).

Thresholds of 16 / 32 MiB keep such buffers on the heap while big arrays are mmap'd and go back
to the OS when freed. Not higher: at 64 / 128 MiB a streamed per-token layer's XᵀX (49 MiB at
d = 3,584) came from the heap and its freed copies stayed resident, so a farm worker capped at
384 MiB peaked at 301-365 MiB (365: Dask restarted it) where 16 / 32 MiB gave 243-299 MiB, 10 %
faster.
"""

from __future__ import annotations

import sys

MMAP_THRESHOLD = 16 << 20
TRIM_THRESHOLD = 32 << 20
_TUNED = False


def tune_malloc() -> None:
    """Set the process's glibc mmap / trim thresholds to 16 / 32 MiB, once (Linux/glibc only;
    elsewhere, and with another C library, nothing happens)."""
    global _TUNED
    if _TUNED or not sys.platform.startswith("linux"):
        return
    _TUNED = True
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, MMAP_THRESHOLD)   # M_MMAP_THRESHOLD
        libc.mallopt(-1, TRIM_THRESHOLD)   # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc
