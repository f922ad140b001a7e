"""``python -m stimuli FAMILY [options]``: write a stimulus set.

Every family's options come from its ``Config`` dataclass, so ``--help`` is always complete
and a new config field is a new option with no CLI code.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from pathlib import Path
from typing import Any

from stimuli import family_names, get_family
from stimuli.base import Family, StimulusError
from stimuli.io import write_set


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_config_options(parser: argparse.ArgumentParser, config_cls: type) -> None:
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        help_text = f.metadata.get("help", "")
        kind = hints[f.name]
        origin, args = typing.get_origin(kind), typing.get_args(kind)
        default: Any = f.default
        if kind is bool:
            parser.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction,
                                default=default, help=f"{help_text} (default: {default})")
        elif origin is tuple:
            elem = args[0]
            parser.add_argument(_flag(f.name), nargs="+", type=elem, default=default,
                                metavar=elem.__name__.upper(),
                                help=f"{help_text} (default: {' '.join(map(str, default))})")
        else:
            choices = f.metadata.get("choices")
            parser.add_argument(_flag(f.name), type=kind if kind in (int, float, str) else str,
                                default=default, choices=choices,
                                help=f"{help_text} (default: {default})")


def config_from_args(family: Family, args: argparse.Namespace) -> Any:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(family.config)}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return family.make_config(**values)


def _unknown_options(parser: argparse.ArgumentParser, family: str | None, extra: list[str]) -> str:
    """One line for options argparse did not recognise, each with the closest option of ``family``."""
    from store.config import did_you_mean  # only on this error path: generating needs no store

    sub = _subparser(parser, family)
    known = [o for a in (sub or parser)._actions for o in a.option_strings if o.startswith("--")]
    words = [w for w in extra if w.startswith("-")] or extra
    hints = [f"{w.split('=')[0]!r}{did_you_mean(w.split('=')[0], known, 'known options')}" for w in words]
    where = f"python -m stimuli {family}" if family else "python -m stimuli"
    return f"{where}: unknown option " + "; unknown option ".join(hints)


def _subparser(parser: argparse.ArgumentParser, name: str | None) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]
    return None


def _add_run_options(parser: argparse.ArgumentParser, *, out_help: str, default_n: int | None) -> None:
    parser.add_argument("--out", type=Path, required=True, help=out_help)
    parser.add_argument("--n", type=int, default=default_n,
                        help="samples to write (per sweep cell where the family sweeps, e.g. per grid size)"
                        + (f" (default: {default_n})" if default_n is not None
                           else " (default: each family's small_set_n: "
                           + ", ".join(f"{n} {get_family(n).small_set_n}" for n in family_names()) + ")"))
    parser.add_argument("--seed", type=int, default=0, help="base seed; sample i uses a seed derived from it (default: 0)")
    parser.add_argument("--split", default="test", help="split name recorded with every sample (default: test)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing set at --out")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m stimuli",
        description="Write a stimulus set (PNG images + truth.parquet + set.json) for one family, or all.",
    )
    sub = parser.add_subparsers(dest="family", required=True, metavar="FAMILY")
    for name in family_names():
        family = get_family(name)
        p = sub.add_parser(name, help=family.description, description=family.description)
        _add_run_options(p, out_help="the set folder to create", default_n=family.small_set_n)
        add_config_options(p, family.config)
    p_all = sub.add_parser("all", help="a small set of every family with default parameters, in OUT/<family>"
                           " (replaces sets already there)")
    _add_run_options(p_all, out_help="folder that receives one set folder per family", default_n=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        print(f"error: {_unknown_options(parser, args.family, extra)}", file=sys.stderr)
        return 2
    try:
        if args.family == "all":
            jobs = [(get_family(name), get_family(name).config(), args.out / name) for name in family_names()]
        else:
            family = get_family(args.family)
            jobs = [(family, config_from_args(family, args), args.out)]
        for family, config, out in jobs:
            n = args.n if args.n is not None else family.small_set_n
            if n < 1:
                raise StimulusError(f"--n={n}: ask for at least one sample")
            path = write_set(family, config, n=n, seed=args.seed, split=args.split, out=out,
                             overwrite=args.overwrite or args.family == "all", progress=not args.no_progress)
            meta = json.loads((path / "set.json").read_text())
            print(f"{family.name:>9}: {meta['count']:>5} stimuli in {meta['seconds']:6.2f} s -> {path}")
    except StimulusError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
