"""``python -m bench [TOPIC ...] [--quick] [--samples N] [--rounds R] [--part P] [--device D]``: run the
benchmarks, print their figures and record the headline ones in bench/results/ (a --quick run is a
smoke test and records nothing). ``python -m bench table`` rebuilds docs/benchmarks.md's table of
current figures from those files."""

from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
import sys
import time
from pathlib import Path

import bench
from bench import record

NOT_TOPICS = {"record"}  # modules of bench/ that are not benchmarks
DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


def topics() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(bench.__path__)
                  if not m.name.startswith("_") and m.name not in NOT_TOPICS)


def main() -> None:
    if sys.argv[1:] == ["table"]:
        record.write_table(DOC)
        print(f"wrote the current figures of {len(record.load_runs())} recorded runs into {DOC}")
        return
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("topics", nargs="*", help=f"which benchmarks (default: all of {', '.join(topics())})")
    parser.add_argument("--quick", action="store_true", help="smaller sizes: a smoke run, not figures to report")
    parser.add_argument("--samples", type=int, help="stimuli per run, for the benchmarks that take it (extract)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds, for the benchmarks that take it (extract)")
    parser.add_argument("--part", help="one part of a benchmark that has parts"
                        " (probes: logistic, a, b, c, d; extract: overhead, memory, connects, steps, steady, cast,"
                        " arrays, capture, interference, warm)")
    parser.add_argument("--device", help="where the model runs, for the benchmarks that take it (extract's overhead,"
                        " capture and warm parts: cuda runs them in bfloat16; default cpu)")
    args = parser.parse_args()
    for flag in ("samples", "rounds"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    chosen = args.topics or topics()
    unknown = set(chosen) - set(topics())
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(sorted(unknown))}: choose from {', '.join(topics())}")
    for name in chosen if args.part is not None else ():
        parts = getattr(importlib.import_module(f"bench.{name}"), "PARTS", ())
        if args.part not in parts:
            parser.error(f"--part {args.part}: benchmark {name} has " + (f"parts {', '.join(parts)}" if parts else "no parts"))
    if args.device is not None:
        refused = [n for n in chosen if "device" not in inspect.signature(importlib.import_module(f"bench.{n}").main).parameters]
        if refused:
            parser.error(f"--device {args.device}: benchmark(s) {', '.join(refused)} run on the CPU only; choose extract")
    if not args.quick:
        record.start(["python", "-m", "bench", *sys.argv[1:]])
    for name in chosen:
        print(f"\n== {name} ==")
        started = time.perf_counter()
        run = importlib.import_module(f"bench.{name}").main
        takes = inspect.signature(run).parameters
        extra = {k: getattr(args, k) for k in ("samples", "rounds", "part", "device")
                 if k in takes and getattr(args, k) is not None}
        record.topic(name)
        run(quick=args.quick, **extra)
        record.end_topic()
        print(f"   ({time.perf_counter() - started:.1f} s)")
    written = record.finish()
    if written is not None:
        print(f"\nfigures recorded in {written.relative_to(Path.cwd()) if written.is_relative_to(Path.cwd()) else written}")


if __name__ == "__main__":
    main()
