"""Part 10's split of a run into the model's forward calls and the rest (bench/extract.py,
bench/_warm_worker.py), and the call timer it shares with part 4 (bench/_extract_worker.py)."""

from __future__ import annotations

import inspect
import time
from types import SimpleNamespace

from bench._extract_worker import time_calls
from bench.extract import _split


def test_time_calls_adds_each_call_to_the_total_and_passes_results_and_errors_through():
    def slow(x: int) -> int:
        time.sleep(0.01)
        if x < 0:
            raise ValueError("negative")
        return 2 * x

    owner = SimpleNamespace(slow=slow)
    steps: dict[str, list[float]] = {}
    time_calls(owner, "slow", "slow", steps)
    assert owner.slow(3) == 6
    try:
        owner.slow(-1)
    except ValueError:
        pass
    else:
        raise AssertionError("the error did not pass through")
    assert 0.02 <= steps["slow"][0] < 0.5  # both calls counted, the failed one too
    assert steps["slow"][1] == 2


def test_time_calls_keeps_the_signature_generate_checks_its_inputs_against():
    def forward(input_ids: int, pixel_values: int | None = None) -> int:
        return input_ids

    owner = SimpleNamespace(forward=forward)
    time_calls(owner, "forward", "forward", {})
    assert list(inspect.signature(owner.forward).parameters) == ["input_ids", "pixel_values"]


def test_split_gives_the_forward_ratio_and_the_rest_as_medians_of_rounds():
    # rounds: (agnosia, bare) whole runs, and the seconds of each spent in the model's forward
    pairs = [[3.0, 2.5], [3.2, 2.6], [2.9, 2.4]]
    forward = [[2.0, 1.9], [2.2, 2.0], [1.95, 1.9]]
    text = _split(pairs, forward)
    # forward ratios 1.0526, 1.1, 1.0263 -> median 1.053; rest (1.0 - 0.6, 1.0 - 0.6, 0.95 - 0.5) -> +0.400 s
    assert "in the model's forward 1.053x (median 2.00 s vs 1.90 s" in text
    assert "the rest +0.400 s (median 1.00 s vs 0.60 s" in text
