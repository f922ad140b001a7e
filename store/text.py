"""The one plain-text table of the command lines (``python -m store info``/``query``, ``python -m
queries``): left-aligned columns as wide as their widest cell, so run ids are never cut."""

from __future__ import annotations

from collections.abc import Sequence


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]], total: int | None = None) -> str:
    """``rows`` of cells already formatted as text under ``header``; ``total`` rows in all when only
    the first of them are shown (a last line says how many more, and how to get them)."""
    cells = [[str(h) for h in header]] + [list(r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if total is not None and total > len(rows):
        lines.append(f"... {total - len(rows)} more rows (use --format csv)")
    return "\n".join(lines)
