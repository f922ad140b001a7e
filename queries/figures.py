"""The report's building blocks: pages, sections, captioned figures with their CSV, and the plot
helpers every study page shares (depth axis with stage bands, one panel per metric, facets).

A figure is a PNG, a caption saying what it shows, and the CSV of exactly the numbers drawn, so a
reader can re-plot or cite them. Depth along the model's data path (``activations.depth``) is the
x-axis of every along-the-model plot, with the stages (vision, merger, projector, LLM) shaded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display: figures go to files
import matplotlib.pyplot as plt  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.csv as pacsv  # noqa: E402


@dataclass
class Figure:
    png: str
    caption: str
    csv: str | None = None


@dataclass
class Section:
    title: str
    note: str = ""
    figures: list[Figure] = field(default_factory=list)
    tables: list[tuple[str, pa.Table]] = field(default_factory=list)


@dataclass
class Page:
    """One study (or the workspace overview): its anchor, its question and its sections."""

    slug: str
    title: str
    question: str
    sections: list[Section] = field(default_factory=list)
    empty: str = ""  # the one line shown when the workspace holds no run of the study


def save_table(out: Path, name: str, table: pa.Table) -> str:
    # CSV has no nested types: lists and structs are written as their text.
    flat = {c: (pa.array([None if v is None else str(v) for v in table[c].to_pylist()], pa.string())
                if pa.types.is_nested(table[c].type) else table[c]) for c in table.column_names}
    pacsv.write_csv(pa.table(flat), out / f"{name}.csv")
    return f"{name}.csv"


def figure(out: Path, name: str, draw: Callable[[Any], None], caption: str, table: pa.Table | None = None,
           csv: str | None = None, size: tuple[float, float] = (6.4, 3.6)) -> Figure:
    """One axes drawn by ``draw``; ``table`` (the numbers drawn) is written beside it as name.csv."""
    return panels(out, name, [None], lambda ax, _: draw(ax), caption, table, csv, size=size)


def panels(out: Path, name: str, keys: Sequence[Any], draw: Callable[[Any, Any], None], caption: str,
           table: pa.Table | None = None, csv: str | None = None, sharex: bool = True, cols: int = 1,
           size: tuple[float, float] = (6.4, 2.8)) -> Figure:
    """One panel per key (a metric, a run, a grid size), ``cols`` per row: facets, never spaghetti."""
    rows = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(size[0] * (1 if cols == 1 else 0.55 * cols), size[1] * rows),
                             dpi=100, squeeze=False, sharex=sharex)
    flat = list(axes.ravel())
    for ax, key in zip(flat, keys, strict=False):
        draw(ax, key)
        ax.grid(alpha=0.3)
    for ax in flat[len(keys):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(out / f"{name}.png")
    plt.close(fig)
    if table is not None:
        csv = save_table(out, name, table)
    return Figure(f"{name}.png", caption, csv)


STAGE_COLOURS = {"vision": "#e8f0fb", "merger": "#f3e8fb", "projector": "#fbf3e0", "llm": "#e6f5e6",
                 "logits": "#f0f0f0"}


def stage_bands(ax: Any, rows: list[dict[str, Any]]) -> None:
    """Shade each stage's depth range and label the ticks tap.layer/site."""
    ticks = sorted({(r["depth"], f"{r['tap']}.{r['layer']}" + ("" if r["site"] == "resid_post" else f"/{r['site']}"))
                    for r in rows if r.get("depth") is not None})
    stages: dict[str, list[int]] = {}
    for r in rows:
        if r.get("depth") is not None and r.get("stage"):
            stages.setdefault(r["stage"], []).append(r["depth"])
    for stage, depths in stages.items():
        ax.axvspan(min(depths) - 0.5, max(depths) + 0.5, color=STAGE_COLOURS.get(stage, "#f4f4f4"), zorder=0)
        ax.text((min(depths) + max(depths)) / 2, 1.0, stage, transform=ax.get_xaxis_transform(), ha="center",
                va="bottom", fontsize=7, color="#555")
    labels: dict[int, str] = {}
    for d, label in ticks:
        labels.setdefault(d, label)
    ax.set_xticks(list(labels), list(labels.values()), rotation=45, ha="right", fontsize=7)
    ax.set_xlabel("depth along the data path")


def depth_lines(ax: Any, rows: list[dict[str, Any]], series: str, y: str, control: str | None = None,
                ylim: tuple[float, float] | None = None, ylabel: str = "") -> None:
    """One line per value of ``series`` along depth; the control dotted in the same colour, clipped
    to the panel (a shuffled control far below chance would squash every other line), labelled."""
    rows = [r for r in rows if r.get("depth") is not None and r.get(y) is not None]
    low, high = ylim if ylim else (min(0.0, min((r[y] for r in rows), default=0.0)), None)
    controls = False
    for key in sorted({str(r[series]) for r in rows}):
        pts = sorted((r["depth"], r[y], r.get(control) if control else None) for r in rows if str(r[series]) == key)
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=key)
        ctl = [(p[0], max(p[2], low)) for p in pts if p[2] is not None]
        if ctl:
            controls = True
            ax.plot([c[0] for c in ctl], [c[1] for c in ctl], ls=":", color=line.get_color())
    if controls:  # one legend entry for every dotted line: the legend stays readable
        ax.plot([], [], ls=":", color="grey", label="shuffled-label control (same colour)")
    ax.set_ylim(low, high)
    ax.set_ylabel(ylabel or y)
    stage_bands(ax, rows)
    if rows:
        ax.legend(fontsize=6)


def lines(ax: Any, table: pa.Table, x: str, y: str, xlabel: str, ylabel: str,
          spans: Sequence[tuple[float, str]] = (), series: str = "run") -> None:
    rows = table.to_pylist()
    for key in sorted({r[series] for r in rows}):
        pts = [(r[x], r[y]) for r in rows if r[series] == key and r[y] is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=key)
    for at, label in spans:
        ax.axvline(at, color="grey", ls="--", lw=1)
        ax.text(at, ax.get_ylim()[1], f" {label}", va="top", fontsize=8, color="grey")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
