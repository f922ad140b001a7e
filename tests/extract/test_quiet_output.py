"""What a newcomer's terminal shows (issue 21 item 10): `make info` only reads, and `--no-progress`
silences every bar of an extraction, transformers' weight-loading bar included."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from child_env import child_env
from terminal_lib import run_in_terminal

from stimuli import get_family
from stimuli.io import write_set

pytestmark = pytest.mark.slow  # spawns extraction or Dask processes per test

REPO = Path(__file__).resolve().parents[2]


def test_make_info_writes_no_report():
    stamp = os.path.join(os.environ.get("VENV", ".venv"), ".agnosia-installed")
    out = subprocess.run(["make", "-n", "-o", stamp, "-o", "setup", "info"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "-m store info" in out.stdout and "report" not in out.stdout, out.stdout


def test_no_progress_leaves_no_bar_on_a_terminal(tmp_path):
    go = get_family("go")
    write_set(go, go.config(preset="small", variation="mild", counts="0-2"), n=1, seed=1, split="test",
              out=tmp_path / "sets" / "go-toy")
    env = child_env(HF_HUB_OFFLINE="1")

    def extract(data: str, *flags: str) -> str:
        rc, screen = run_in_terminal([sys.executable, "-m", "extract", "manifests/demo-text.yaml", "--data",
                                      str(tmp_path / data), "--stimuli-root", str(tmp_path / "sets"), *flags],
                                     cwd=REPO, env=env, timeout=600)
        assert rc == 0, screen[-3000:]
        return screen

    shown = extract("a")
    assert "extract toy-counter-text: 100%" in shown, shown[-3000:]  # a terminal gets the bars
    quiet = extract("b", "--no-progress")
    assert "%|" not in quiet and "it/s]" not in quiet, quiet[-3000:]
    assert "toy-counter-text" in quiet  # the summary still prints
