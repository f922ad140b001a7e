"""``python -m queries NAME [--param key=value] [--format table|csv|json|parquet]``.

Besides the SQL files of queries/sql, four named queries are Python: ``gap`` (queries/gap.py: a
probe's decodability per depth and group beside the model's accuracy), ``curves`` and
``expressed`` (queries/evidence.py: each probe series per group along depth with bootstrap
intervals and its control; what the model answers per group), and ``lost`` (queries/verdicts.py:
per question and group, whether the target is present and transferable, re-encoded, lost or not
distinguishable, and from which depth).
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from queries import evidence, gap, verdicts
from queries.named import QueryError, available, check_out, run
from queries.render import emit, render_schema
from store import StoreError, Workspace


def _params(pairs: list[str]) -> dict[str, str]:
    """``--param k=v`` pairs as a dict (a bare ``k`` is an empty value)."""
    return dict(p.partition("=")[::2] for p in pairs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m queries", description=__doc__)
    parser.add_argument("name", nargs="?", help="a named query (see --list)")
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="a query parameter")
    parser.add_argument("--format", choices=("table", "csv", "json", "parquet"), default="table")
    parser.add_argument("--out", help="write to this file (required for parquet)")
    parser.add_argument("--data", default=None, help="workspace (default: $AGNOSIA_DATA, else ./data)")
    parser.add_argument("--list", action="store_true", help="list the named queries and their parameters")
    parser.add_argument("--schema", action="store_true", help="print the manifest's tables and views with their columns")
    parser.add_argument("--sql", help="run this ad-hoc SQL instead of a named query (read-only)")
    args = parser.parse_args(argv)
    if args.out and not Path(args.out).absolute().parent.is_dir():  # checked before the query runs
        print(f"error: --out {args.out}: the folder {Path(args.out).absolute().parent} does not exist;"
              " create it first or choose another path", file=sys.stderr)
        return 2
    try:
        if args.list:
            for q in available().values():
                params = ", ".join(f"{p.name}={p.default}" if p.default is not None else p.name for p in q.params)
                print(f"{q.name:<20} {q.description}" + (f"\n{'':<20} params: {params}" if params else ""))
            params = ", ".join(f"{k}={d}" for k, (d, _) in gap.PARAMS.items())
            print(f"{'gap':<20} a probe's decodability per depth and stimulus group beside the model's accuracy"
                  f"\n{'':<20} params: {params}")
            print(f"{'curves':<20} each probe series per group along depth: value, 95% bootstrap interval, control"
                  f"\n{'':<20} params: {params}")
            print(f"{'expressed':<20} what the model answers per group: accuracy, MAE over numbers, runaway share"
                  f"\n{'':<20} params: {params}")
            print(f"{'lost':<20} per question and group: present and transferable, re-encoded, lost or not"
                  f" distinguishable (docs/verdicts.md)\n{'':<20} params: {params}")
            return 0
        if args.out:
            check_out(args.out)
        ws = Workspace.open(args.data, readonly=True)
        if args.schema:
            table = ws.query("SELECT table_name AS \"table\", column_name AS \"column\", data_type AS type"
                             " FROM information_schema.columns WHERE table_schema = 'main'"
                             " ORDER BY table_name, ordinal_position")
            if args.format == "table":
                print(render_schema(table))
                return 0
        elif args.sql:
            table = ws.query(args.sql)
        elif args.name == "gap":
            table = gap.gap(ws, _params(args.param))
        elif args.name in ("curves", "lost"):
            found = evidence.curves(ws, _params(args.param))
            table = evidence.curves_table(found) if args.name == "curves" else \
                verdicts.verdicts_table(verdicts.where_lost(found))
        elif args.name == "expressed":
            given = _params(args.param)
            evidence.curves(ws, given)   # the same selection as curves and lost: one that matches no probe is an error
            table = evidence.expressed_table(evidence.expressed(ws, given, evidence.truths_of(ws, given)))
        elif args.name:
            table = run(ws, args.name, _params(args.param))
        else:
            parser.error("name a query, or pass --list, --schema or --sql")
        return emit(table, args.format, args.out)
    except (QueryError, StoreError, gap.GapError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    # `python -m queries ... | head`: a reader that stops early ends the table quietly, as any Unix
    # tool's, not with a BrokenPipeError traceback (queries only read the store).
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main())
