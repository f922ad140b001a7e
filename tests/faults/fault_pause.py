"""Run ``python -m store ARGS`` and stop it at one exact point, for a kill -9 there.

Usage: ``python fault_pause.py FOLDER before|after ARGS...``. When the command renames FOLDER
(``os.replace(FOLDER, ...)``, e.g. drop-run moving a run's arrays into ``.trash``), the process
prints ``paused`` on stdout and sleeps, ``before`` or ``after`` the rename, until the test kills
it. Exit code 3 if the command ends without ever reaching the point.
"""

from __future__ import annotations

import os
import sys
import time

from store.cli import main

real_replace = os.replace


def _pause() -> None:
    print("paused", flush=True)
    time.sleep(600)


def _replace(src: str, dst: str, **kw: object) -> None:
    hit = os.path.abspath(os.fspath(src)) == os.path.abspath(sys.argv[1])
    if hit and sys.argv[2] == "before":
        _pause()
    real_replace(src, dst, **kw)
    if hit:
        _pause()


if __name__ == "__main__":
    os.replace = _replace
    main(sys.argv[3:])
    sys.exit(3)
