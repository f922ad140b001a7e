"""The read-only CLIs end quietly when the reader of their output stops early (`... | head`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from child_env import child_env

from store import Workspace

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv", [
    ["-m", "queries", "--sql", "SELECT range AS n FROM range(200000)"],
    ["-m", "store", "query", "SELECT range AS n FROM range(200000)"],
])
def test_a_reader_that_stops_early_gets_no_traceback(argv, tmp_path):
    """Asserts: the first lines arrive and the CLI's stderr holds no BrokenPipeError traceback
    once the pipe's reader has gone (before: a traceback after every `| head`)."""
    ws = Workspace.open(tmp_path / "ws")
    proc = subprocess.Popen([sys.executable, *argv, "--data", str(ws.path)], cwd=REPO, env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()   # what `head -1` does
    err = proc.stderr.read()
    proc.wait(timeout=60)
    assert first.strip() and "Traceback" not in err and "BrokenPipeError" not in err, err[-2000:]
