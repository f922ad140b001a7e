"""Run a command with stderr on a pseudo-terminal, as a user at a shell sees it (progress bars included)."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import termios
import time
from collections.abc import Sequence
from pathlib import Path


def run_in_terminal(argv: Sequence[str], *, cwd: str | Path | None = None, env: dict[str, str] | None = None,
                    timeout: float = 300) -> tuple[int, str]:
    """(exit code, everything written to the terminal): stdout and stderr both on one 120-column pty."""
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a pty starts 0 columns wide
    env = {k: v for k, v in (env or os.environ).items() if not k.startswith("TQDM_")}
    proc = subprocess.Popen(list(argv), cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=secondary,
                            stderr=secondary)
    os.close(secondary)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not select.select([primary], [], [], 1.0)[0]:
                continue
            try:
                data = os.read(primary, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        os.close(primary)
        if proc.poll() is None:
            proc.kill()
    return rc, b"".join(chunks).decode(errors="replace")
