"""The environment of a Python process a test starts: this checkout first on its import path.

The PYTHONPATH the tests were given stays behind it: bench/gpu_check.sh runs the tests on a GPU
machine with the store's packages in a ``pip install --target`` folder reached only through
PYTHONPATH, and a child that loses it cannot import them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child_env(*dirs: Path | str, **extra: str) -> dict[str, str]:
    """``os.environ`` with PYTHONPATH = this checkout, then ``dirs`` (e.g. a test folder whose helper
    modules the child imports), then the inherited PYTHONPATH; ``extra`` variables set last."""
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    path = os.pathsep.join([str(REPO), *map(str, dirs), *inherited])
    return {**os.environ, "PYTHONPATH": path, **extra}


def dask_cli(*args: str) -> list[str]:
    """The `dask` console script of this interpreter's environment, with ``args``."""
    exe = Path(sys.executable).parent / "dask"
    return [str(exe), *args] if exe.exists() else [sys.executable, "-m", "dask", *args]
