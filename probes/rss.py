"""A process's resident memory, as the farm's memory plans are checked against it: now (a
worker's base once warm) and at its peak (a task's high-water mark). Imports nothing heavy:
streamed workers call it.
"""

from __future__ import annotations


def rss_now() -> int:
    """This process's resident set now, in bytes (Linux's VmRSS; elsewhere psutil's, else 0)."""
    return _memory_status("VmRSS")


def peak_rss() -> int:
    """This process's peak resident set so far, in bytes: Linux's VmHWM (the kernel's high-water
    mark, so transient peaks inside a task count; reset at exec, unlike ru_maxrss, which a Dask
    worker would inherit from the client process that spawned it). Elsewhere: current RSS."""
    return _memory_status("VmHWM")


def _memory_status(field: str) -> int:
    """``field`` of /proc/self/status in bytes; where there is none, psutil's current RSS, else 0."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        return 0
