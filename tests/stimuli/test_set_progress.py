"""`python -m stimuli` shows a progress bar while it writes a set (a full sweep takes minutes), on stderr,
only on a terminal, and never with --no-progress (issue 21 item 5)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from child_env import child_env
from terminal_lib import run_in_terminal

from stimuli import family_names, get_family
from stimuli.base import Family, StimulusError

G2M = ["-m", "stimuli", "g2m", "--n", "3", "--grid-sizes", "3", "4", "--colors", "3", "--image-size", "32"]


def _env() -> dict[str, str]:
    return child_env()


def test_a_terminal_sees_a_bar_with_the_sets_total(tmp_path: Path) -> None:
    rc, screen = run_in_terminal([sys.executable, *G2M, "--out", str(tmp_path / "set")], env=_env())
    assert rc == 0, screen
    assert "g2m: 100%" in screen and "6/6" in screen, screen  # the total is known before the first grid
    assert "6 stimuli in" in screen


@pytest.mark.slow  # two more stimulus processes
def test_no_progress_and_a_pipe_show_no_bar(tmp_path: Path) -> None:
    rc, screen = run_in_terminal([sys.executable, *G2M, "--out", str(tmp_path / "a"), "--no-progress"], env=_env())
    assert rc == 0 and "%|" not in screen and "6 stimuli in" in screen, screen
    piped = subprocess.run([sys.executable, *G2M, "--out", str(tmp_path / "b")], env=_env(), capture_output=True,
                           text=True, timeout=300)
    assert piped.returncode == 0 and piped.stderr == "", piped.stderr  # a log file gets no redrawn bar
    assert "6 stimuli in" in piped.stdout


@pytest.mark.parametrize("name", family_names())
def test_each_familys_count_is_what_it_generates(name: str) -> None:
    family = get_family(name)
    small = {"g2m": {"grid_sizes": (3, 5), "colors": (3, 4), "image_size": 32},
             "go": {"counts": "0-3,7", "preset": "small"},
             "counting": {"cases": ("1A", "2B", "9A")},
             "spatial": {}}[name]
    config = family.config(**small)
    assert family.set_size(config, 2) == sum(1 for _ in family.generate(config, n=2, seed=0, split="test"))


def test_a_family_declares_its_cells_and_family_multiplies_by_n() -> None:
    """The "n per sweep cell" rule lives in Family.set_size alone; a family gives only its cells."""
    g2m = get_family("g2m")
    swept = Family(name="swept", description="", config=g2m.config, generate=g2m.generate,
                   cells=lambda config: len(config.grid_sizes) + 1)
    assert swept.set_size(g2m.config(grid_sizes=(3, 4, 5)), 7) == 28
    silent = Family(name="silent", description="", config=g2m.config, generate=g2m.generate)
    with pytest.raises(StimulusError, match=r"silent does not say how many cells.*Family\(cells=...\)"):
        silent.set_size(g2m.config(), 2)
