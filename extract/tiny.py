"""Build a tiny random-init VLM of a supported family as a normal model folder, offline.

    python -m extract.tiny qwen2_vl --out models/tiny-qwen2-vl [--seed 0]
    python -m extract.tiny --list

The folder (safetensors weights, config, byte-level tokenizer, processor, chat template) loads
with ``extract.models.load_model`` or plain ``AutoModelForImageTextToText``/``AutoProcessor``.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m extract.tiny", description=__doc__.split("\n\n")[0])
    parser.add_argument("arch", nargs="?", help="family (config model_type), see --list")
    parser.add_argument("--out", help="folder to write (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="weights seed (same seed, same weights)")
    parser.add_argument("--list", action="store_true", help="list the families that have a tiny recipe")
    args = parser.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from extract.models import tiny

    if args.list:
        print("\n".join(tiny.architectures()))
        return 0
    if not args.arch or not args.out:
        parser.error("give ARCH and --out DIR (or --list)")
    if args.arch not in tiny.architectures():
        parser.error(f"unknown ARCH {args.arch!r}: expected one of {', '.join(tiny.architectures())}")
    path = tiny.build(args.arch, args.out, seed=args.seed)
    print(f"wrote tiny {args.arch} (seed {args.seed}) to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
