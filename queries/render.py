"""Plain-text rendering of query results (the CLI's table format, also used by the report)."""

from __future__ import annotations

import io
import json
import sys
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from store.text import text_table


def render_table(table: pa.Table, max_rows: int = 200) -> str:
    """Every cell in full (a column is as wide as its widest value: run ids are never cut)."""
    rows = [[format_cell(v) for v in r.values()] for r in table.slice(0, max_rows).to_pylist()]
    return text_table(table.column_names, rows, total=table.num_rows)


def render_schema(table: pa.Table) -> str:
    lines: list[str] = []
    current = None
    for row in table.to_pylist():
        if row["table"] != current:
            current = row["table"]
            lines.append(("" if not lines else "\n") + current)
        lines.append(f"  {row['column']:<16} {row['type']}")
    return "\n".join(lines)


def format_cell(v) -> str:
    """A value as a table shows it: empty for NULL, 4 significant digits for floats."""
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, pa.MonthDayNano):
        return format_interval(v)
    return str(v)


def format_interval(v: pa.MonthDayNano) -> str:
    """An INTERVAL as DuckDB prints it: ``2 months 3 days 00:01:18.5``."""
    parts = [f"{n} {unit}{'s' if abs(n) != 1 else ''}" for n, unit in ((v.months, "month"), (v.days, "day")) if n]
    if v.nanoseconds or not parts:
        sign, ns = ("-" if v.nanoseconds < 0 else ""), abs(v.nanoseconds)
        seconds, frac = divmod(ns, 1_000_000_000)
        clock = f"{sign}{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
        parts.append(clock + (f".{frac:09d}".rstrip("0") if frac else ""))
    return " ".join(parts)


def readable(table: pa.Table) -> pa.Table:
    """INTERVAL columns as text: Arrow's month_day_nano type has no CSV or Parquet form and
    prints as ``MonthDayNano(...)`` in JSON."""
    for i, field in enumerate(table.schema):
        if pa.types.is_interval(field.type):
            text = pa.array([None if v is None else format_interval(v) for v in table.column(i).to_pylist()],
                            pa.string())
            table = table.set_column(i, pa.field(field.name, pa.string()), text)
    return table


def emit(table: pa.Table, fmt: str, out: str | None) -> int:
    """Write ``table`` as a table, CSV, JSON or Parquet to ``out`` (stdout for text formats)."""
    table = readable(table)
    if fmt == "parquet":
        if not out:
            print("error: --format parquet needs --out FILE", file=sys.stderr)
            return 2
        pq.write_table(table, out)
        return 0
    if fmt == "csv":
        buf = io.BytesIO()
        pacsv.write_csv(table, buf)
        text = buf.getvalue().decode()
    elif fmt == "json":
        text = json.dumps(table.to_pylist(), default=str, indent=1)
    else:
        text = render_table(table)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


def table_cli(prog: str, doc: str, build: Any, argv: list[str] | None = None) -> int:
    """The command line of a per-run analysis: ``build(ws, run, where) -> pa.Table`` printed or written."""
    import argparse

    from store import StoreError, Workspace

    ap = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    ap.add_argument("--data", default=None, help="workspace (default ./data or $AGNOSIA_DATA)")
    ap.add_argument("--run", required=True)
    ap.add_argument("--where", default=None, help="SQL over v_samples selecting the samples")
    ap.add_argument("--format", default="table", choices=("table", "csv", "json", "parquet"))
    ap.add_argument("--out", default=None, help="write to this file (needed for parquet)")
    args = ap.parse_args(argv)
    try:
        ws = Workspace.open(args.data, readonly=True)
        return emit(build(ws, args.run, args.where), args.format, args.out)
    except StoreError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
