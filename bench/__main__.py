"""``python -m bench [TOPIC ...] [--quick]``: run the benchmarks and print their figures."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import time

import bench


def topics() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(bench.__path__) if not m.name.startswith("_"))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("topics", nargs="*", help=f"which benchmarks (default: all of {', '.join(topics())})")
    parser.add_argument("--quick", action="store_true", help="smaller sizes: a smoke run, not figures to report")
    args = parser.parse_args()
    chosen = args.topics or topics()
    unknown = set(chosen) - set(topics())
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(sorted(unknown))}: choose from {', '.join(topics())}")
    for name in chosen:
        print(f"\n== {name} ==")
        started = time.perf_counter()
        importlib.import_module(f"bench.{name}").main(quick=args.quick)
        print(f"   ({time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
