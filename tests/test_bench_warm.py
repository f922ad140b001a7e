"""Part 10's split of a run into the model's forward calls and the rest (bench/extract.py, bench/_warm_worker.py)."""

from __future__ import annotations

import time

from bench._warm_worker import _timed
from bench.extract import _split


def test_timed_adds_each_call_to_the_total_and_passes_results_and_errors_through():
    total = [0.0]

    def slow(x: int) -> int:
        time.sleep(0.01)
        if x < 0:
            raise ValueError("negative")
        return 2 * x

    timed = _timed(slow, total)
    assert timed(3) == 6
    try:
        timed(-1)
    except ValueError:
        pass
    else:
        raise AssertionError("the error did not pass through")
    assert 0.02 <= total[0] < 0.5  # both calls counted, the failed one too


def test_split_gives_the_forward_ratio_and_the_rest_as_medians_of_rounds():
    # rounds: (agnosia, bare) whole runs, and the seconds of each spent in the model's forward
    pairs = [[3.0, 2.5], [3.2, 2.6], [2.9, 2.4]]
    forward = [[2.0, 1.9], [2.2, 2.0], [1.95, 1.9]]
    text = _split(pairs, forward)
    # forward ratios 1.0526, 1.1, 1.0263 -> median 1.053; rest (1.0 - 0.6, 1.0 - 0.6, 0.95 - 0.5) -> +0.400 s
    assert "in the model's forward 1.053x (median 2.00 s vs 1.90 s" in text
    assert "the rest +0.400 s (median 1.00 s vs 0.60 s" in text


def test_timed_keeps_the_signature_generate_checks_its_inputs_against():
    import inspect

    def forward(input_ids: int, pixel_values: int | None = None) -> int:
        return input_ids

    assert list(inspect.signature(_timed(forward, [0.0])).parameters) == ["input_ids", "pixel_values"]
