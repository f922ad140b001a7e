"""The report's building blocks: pages, sections, captioned figures with their CSV, the plot
helpers every study page shares (depth axis with stage bands, one panel per metric, facets), the
intervals drawn as error bars, and the one rule of when a run's answers are usable.

A figure is a PNG, a caption saying what it shows and over how many samples (n), and the CSV of
exactly the numbers drawn, so a reader can re-plot or cite them. Depth along the model's data path
(``activations.depth``) is the x-axis of every along-the-model plot, with the stages (vision, merger,
projector, LLM) shaded. Every figure draws its baseline (chance, uniform attention, a shuffled
control) so a value can be read against what no signal would give.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display: figures go to files
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.csv as pacsv  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from queries.intervals import mean_interval  # noqa: E402
from store import Workspace  # noqa: E402


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
    #: a table's visible title by its CSV name; a table without one is titled from its name
    titles: dict[str, str] = field(default_factory=dict)

    def title_of(self, name: str) -> str:
        return self.titles.get(name) or name.replace("_", " ").capitalize()


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
                ylim: tuple[float, float] | None = None, ylabel: str = "", spread: str | None = None,
                control_label: str = "shuffled-label control") -> None:
    """One line per value of ``series`` along depth; ``spread`` (e.g. the sd over seeds) as a band
    of ± spread in the line's colour; the control dotted in the same colour, clipped to the panel (a
    shuffled control far below chance would squash every other line), labelled."""
    rows = [r for r in rows if r.get("depth") is not None and r.get(y) is not None]
    low, high = ylim if ylim else (min(0.0, min((r[y] for r in rows), default=0.0)), None)
    controls = bands = False
    keys = sorted({str(r[series]) for r in rows})
    # lines that lie on each other are drawn a little apart along depth (the caption names them)
    hidden = coinciding(series_points(rows, series, y))
    step = 0.08 if hidden else 0.0
    for k, key in enumerate(keys):
        dx = (k - (len(keys) - 1) / 2) * step
        pts = sorted((r["depth"] + dx, r[y], r.get(control) if control else None,
                      (r.get(spread) or 0.0) if spread else 0.0) for r in rows if str(r[series]) == key)
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=key)
        if any(p[3] > 0 for p in pts):
            bands = True
            ax.fill_between([p[0] for p in pts], [p[1] - p[3] for p in pts], [p[1] + p[3] for p in pts],
                            color=line.get_color(), alpha=0.2, lw=0)
        ctl = [(p[0], max(p[2], low)) for p in pts if p[2] is not None]
        if ctl:
            controls = True
            ax.plot([c[0] for c in ctl], [c[1] for c in ctl], ls=":", color=line.get_color())
    if controls:  # one legend entry for every dotted line: the legend stays readable
        ax.plot([], [], ls=":", color="grey", label=f"{control_label} (same colour)")
    if bands:
        ax.fill_between([], [], [], color="grey", alpha=0.2, label="± 1 sd over seeds")
    ax.set_ylim(low, high)
    ax.set_ylabel(ylabel or y)
    stage_bands(ax, rows)
    if rows:
        ax.legend(fontsize=6)


def series_points(rows: list[dict[str, Any]], series: str, y: str) -> dict[str, list[tuple[float, float]]]:
    """(depth, y) of each value of ``series``: what :func:`coinciding` compares."""
    out: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        if r.get("depth") is not None and r.get(y) is not None:
            out.setdefault(str(r[series]), []).append((r["depth"], r[y]))
    return out


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


# --------------------------------------------------------------------------------------------
# intervals, baselines, captions


def bootstrap_ci(values: Sequence[float]) -> tuple[float, float]:
    """The 95 % bootstrap interval of the mean of ``values``: queries/intervals.py's, the one every
    interval agnosia prints comes from (fixed seed: the report is the same every time it is written)."""
    iv = mean_interval(np.asarray(values, dtype=np.float64)[None])
    return (float("nan"), float("nan")) if iv is None else (iv.low, iv.high)


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a proportion k / n (95 % at z = 1.96): unlike the bootstrap it does
    not collapse to a point when every answer is right or every answer wrong."""
    if n <= 0:
        return float("nan"), float("nan")
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def wilson_yerr(counts: Sequence[tuple[int, int]]) -> list[list[float]]:
    """Matplotlib's yerr (below, above) for shares right / n with their Wilson intervals."""
    below, above = [], []
    for right, n in counts:
        share = right / n if n else 0.0
        lo, hi = wilson(right, n)
        below.append(max(share - lo, 0.0))   # rounding can put a bound a hair past the share
        above.append(max(hi - share, 0.0))
    return [below, above]


def n_range(ns: Iterable[int | None], unit: str, name: str = "n") -> str:
    """'n = 4–8 scenes' (or 'n = 4 scenes' when every count is the same): the caption's sample size."""
    values = sorted({int(v) for v in ns if v is not None})
    if not values:
        return f"{name} = 0 {unit}".rstrip()
    text = f"{values[0]}" if len(values) == 1 else f"{values[0]}–{values[-1]}"
    return f"{name} = {text} {unit}".rstrip()


def chance_line(ax: Any, y: float, label: str) -> None:
    """A baseline across the panel, dotted and named in the legend."""
    ax.axhline(y, color="grey", ls=":", lw=1.5, label=label, zorder=1)


def integer_ticks(ax: Any, values: Iterable[int], axis: str = "x") -> None:
    """Only whole numbers on an axis that counts (grid size N, LLM layer, objects): a tick at each
    of a few ``values`` with half a step of margin (one layer alone still gets a readable axis),
    else whole-number ticks chosen by matplotlib."""
    ticks = sorted({int(v) for v in values})
    if 0 < len(ticks) <= 24:
        (ax.set_xticks if axis == "x" else ax.set_yticks)(ticks)
        (ax.set_xlim if axis == "x" else ax.set_ylim)(ticks[0] - 0.5, ticks[-1] + 0.5)
    else:
        (ax.xaxis if axis == "x" else ax.yaxis).set_major_locator(MaxNLocator(integer=True))


def coinciding(curves: Mapping[str, Sequence[tuple[float, float]]], tol: float = 0.01) -> list[tuple[str, str]]:
    """Pairs of curves of one panel that lie on each other (same x, y within ``tol`` everywhere):
    the caption names them, since one line drawn over another hides it."""
    names = sorted(k for k, v in curves.items() if v)
    out = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            pa_, pb = dict(curves[a]), dict(curves[b])
            if pa_.keys() == pb.keys() and all(abs(pa_[x] - pb[x]) <= tol for x in pa_):
                out.append((a, b))
    return out


def coincide_note(pairs: Sequence[tuple[str, str]]) -> str:
    """The caption's sentence naming lines that lie on each other, grouped: 'a = b = c; d = e'."""
    groups: list[set[str]] = []
    for a, b in pairs:
        joined = [g for g in groups if a in g or b in g]
        merged = {a, b}.union(*joined)
        groups = [g for g in groups if g not in joined] + [merged]
    if not groups:
        return ""
    return " Lines that lie on each other (within 0.01): " + "; ".join(
        " = ".join(sorted(g)) for g in sorted(groups, key=min)) + "."


# --------------------------------------------------------------------------------------------
# usable answers

#: The least share of a run's answers in a family (or a group of them) that must parse as an
#: answer of the task's kind (``parse_ok``: a count, a choice letter, a grid) for accuracy to be
#: drawn. Below it the accuracy figure would only show that the model does not answer the task
#: (e.g. the toy counter says "False" to CountingTricks scenes), so the page says that in one line.
MIN_USABLE_SHARE = 0.2


@dataclass(frozen=True)
class Answers:
    """How many of a run's answers in a family (one group of them, e.g. one grid size) parse."""

    run: str
    family: str
    group: Any
    n: int
    parsed: int
    top_unparsed: str | None  # the most frequent answer that did not parse, as the model wrote it

    @property
    def usable(self) -> bool:
        return self.n > 0 and self.parsed >= max(1, math.ceil(MIN_USABLE_SHARE * self.n))

    @property
    def unparsed(self) -> int:
        return self.n - self.parsed

    def note(self, drawn: str, what: str | None = None) -> str:
        """The one line a page prints instead of a figure of unusable answers; ``what`` an answer
        of the task is (default: by the family, e.g. 'count')."""
        what = what or TASK_ANSWER.get(self.family, "answer the task reads")
        said = f" (answer {self.top_unparsed!r})" if self.top_unparsed is not None else ""
        return f"{self.run}: {self.unparsed} of {self.n} answers are no {what}{said}, so {drawn} is not drawn."


#: What an answer of each family's task is, for the one-line note ("... answers are no count").
TASK_ANSWER = {"go": "count", "counting": "count", "spatial": "choice", "g2m": "grid"}


def answers(ws: Workspace, family: str | None, group: str | None = None) -> list[Answers]:
    """Parsed answers per run of ``family`` (None: all of a run's families together, ``family``
    then lists them) and per ``group``, a SQL expression over v_samples; samples the model never
    answered are not counted."""
    by = group or "NULL"
    rows = ws.rows(
        f"SELECT run, string_agg(DISTINCT family, ',' ORDER BY family) AS families, {by} AS grp, count(*) AS n,"
        " count(*) FILTER (WHERE parse_ok) AS parsed,"
        " mode(trim(generated)) FILTER (WHERE NOT coalesce(parse_ok, FALSE)) AS top FROM v_samples"
        " WHERE (family = $1 OR $1 IS NULL) AND generated IS NOT NULL GROUP BY run, grp ORDER BY 1, 3", [family])
    return [Answers(run, families, grp, int(n), int(parsed), None if top is None else str(top)[:24])
            for run, families, grp, n, parsed, top in rows]
