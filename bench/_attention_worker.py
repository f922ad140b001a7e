"""One configuration of ``python -m bench attention``, alone in a fresh process: peak memory and time.

    python -m bench._attention_worker '{"model": "/tmp/m", "tokens": 4096, "mode": "selected", "steps": 4, "rounds": 3}'

``mode``: ``none`` (a plain greedy ``generate``, sdpa, no capture), ``full`` (``capture_generate`` of
attention rows ``last`` + ``answer`` on every layer by the former path: eager over every query row of
each layer) or ``selected`` (the same capture by the row-selective path). The text-only prompt is
``tokens`` tokens long. Memory: for each call after a first (warm-up) one, the peak resident set
(VmHWM, reset through /proc/self/clear_refs before the call) less the resident set at that moment, so
it is what the generate itself adds; the largest over the calls; ru_maxrss where the reset is refused.
Allocations of 1 MiB and more bypass glibc's pools (:func:`_unpooled_malloc`). Time:
the median of the ``rounds`` calls after the warm-up.

With a capture, the time is also paired: ``rounds`` more calls of the capture and of a plain generate
in turn, their order alternating; ``paired_ratio`` is the median of capture / plain.

Prints one JSON line: peak_mb, time_s, paired_ratio, seq_len.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

import torch


def _status_kb(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS: Linux's clear_refs value 5."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def prompt_of(lm: Any, tokens: int) -> tuple[Any, str]:
    """A text-only batch whose prompt is exactly ``tokens`` tokens (the tiny tokenizer is byte-level)."""
    from extract.models import prepare_batch

    filler = "the stones on the board "
    text = (filler * (tokens // len(filler) + 1))[: tokens]
    for _ in range(3):  # the chat template adds a few tokens: trim by the difference
        batch = prepare_batch(lm, [None], [text])
        extra = batch.seq_len - tokens
        if extra == 0:
            return batch, text
        text = text[: len(text) - extra]
    raise RuntimeError(f"could not make a prompt of {tokens} tokens (got {batch.seq_len})")


def _unpooled_malloc() -> None:
    """glibc: allocations of 1 MiB and more mapped on their own and unmapped when freed, and freed heap
    returned to the system past 1 MiB, so that the resident set follows the live tensors instead of what
    the allocator keeps from earlier calls (which made runs differ by a hundred MB here)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 20)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc


def main() -> None:
    _unpooled_malloc()
    spec = json.loads(sys.argv[1])
    mode = spec["mode"]
    if mode == "full":
        os.environ["AGNOSIA_ATTENTION_ROWS"] = "full"  # read when extract.models.compat is imported
    torch.set_num_threads(int(spec.get("threads", 2)))
    from bench._paired import in_turn
    from extract.models import capture_generate, load_model

    lm = load_model(spec["model"], device="cpu")
    batch, _ = prompt_of(lm, int(spec["tokens"]))
    steps = int(spec["steps"])
    gen: dict[str, Any] = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
               suppress_tokens=sorted(lm.tokenizer.added_tokens_decoder))
    taps = {f"attn.{i}": ["last", "answer"] for i in range(lm.adapter.n_layers("attn"))}

    def plain() -> None:
        with torch.inference_mode():
            lm.model.generate(**batch.inputs, **gen)

    def once() -> None:
        if mode == "none":
            plain()
        else:
            out = capture_generate(lm, batch, taps, tokens=("last", "answer"), **gen)
            last = out[("attn", 0, "probs", "last")]
            assert isinstance(last, torch.Tensor) and last.shape[-1] == batch.seq_len

    # the warm-up call's first-time allocations (thread pools, allocator arenas, lazy inits) are not the
    # capture's: the peak is reset after it, where the kernel allows
    warm_started = time.perf_counter()
    once()
    warm_s = time.perf_counter() - warm_started
    times, peaks = [], []
    for _ in range(int(spec["rounds"])):
        reset = _reset_peak()  # each call's own peak over the resident set it starts from
        before_kb = _status_kb("VmRSS") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
        peak_kb = _status_kb("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peaks.append(((peak_kb or 0) - (before_kb or 0)) / 1024)
    # Time against a plain generate in this process, call by call in alternating order: whole runs in
    # separate processes on a shared machine differ by more than the capture costs.
    ratios = []
    if mode != "none":
        for r in range(int(spec["rounds"])):
            took = in_turn({"plain": plain, "capture": once}, flip=r % 2 == 1)
            ratios.append(took["capture"] / took["plain"])
    print(json.dumps({"peak_mb": max(peaks), "peaks_mb": peaks, "time_s": median(times),
                      "times_s": times, "warm_s": warm_s, "seq_len": batch.seq_len, "peak_reset": reset,
                      "paired_ratio": median(ratios) if ratios else 1.0}))


if __name__ == "__main__":
    main()
