"""`python -m lab.evaluate` runs minutes on 2 cores: it shows a bar whose total is exact, so its
ETA means something (issue 21 item 10)."""

from __future__ import annotations

import io
import sys

import pytest
from child_env import child_env
from terminal_lib import run_in_terminal
from tqdm import tqdm
from transformers import AutoModelForImageTextToText, AutoProcessor

import lab
from lab.evaluate import EvalSpec, evaluate, steps

SMALL = ["--per-count", "1", "--counts", "0,60,110", "--probe-boards", "1"]


@pytest.mark.slow
def test_the_bar_ends_exactly_at_its_total() -> None:
    model = AutoModelForImageTextToText.from_pretrained(lab.DEFAULT_CHECKPOINT).eval()
    processor = AutoProcessor.from_pretrained(lab.DEFAULT_CHECKPOINT)
    spec = EvalSpec(per_count=1, counts="0,60,110", probe_boards=1)
    total = steps(model, spec)
    assert total == 7 * 3 + 3 * 49  # 3 test boards, 49 probe boards (counts 1-49)
    with tqdm(total=total, file=io.StringIO()) as bar:
        result = evaluate(model, processor, spec, bar)
        assert bar.n == total
    assert [r["boards"] for r in result["regimes"].values()] == [1, 1, 1]


@pytest.mark.slow
def test_a_terminal_sees_the_bar_and_no_progress_hides_it() -> None:
    env = child_env()
    rc, screen = run_in_terminal([sys.executable, "-m", "lab.evaluate", *SMALL], env=env)
    assert rc == 0, screen[-2000:]
    assert "evaluate: 100%" in screen and "168/168" in screen, screen[-2000:]
    assert "| visual count accuracy |" in screen
    rc, screen = run_in_terminal([sys.executable, "-m", "lab.evaluate", "--help"], env=env)
    assert rc == 0 and "--no-progress" in screen
