"""``python -m bench --device``: refused, before any work, by a benchmark or part that runs on the CPU only."""

from __future__ import annotations

import subprocess
import sys

from child_env import REPO, child_env


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=REPO, env=child_env(), capture_output=True,
                          text=True, timeout=120)


def test_a_cpu_only_benchmark_refuses_a_device():
    out = _bench("probes", "--device", "cuda")
    assert out.returncode == 2
    assert "--device cuda: benchmark(s) probes run on the CPU only; choose extract" in out.stderr


def test_a_cpu_only_part_of_extract_refuses_a_device():
    out = _bench("extract", "--part", "memory", "--device", "cuda")
    assert out.returncode != 0
    assert "only the parts overhead, capture, warm run on another device; pass --part" in out.stderr
    assert "(1) overhead" not in out.stdout  # refused before any part ran
