"""Benchmark figures as data: every run of ``python -m bench`` writes one JSON file to bench/results/.

A benchmark prints its figures for the reader and hands the headline ones to :func:`figure`; the
run's file holds them with what a figure rests on: the commit (and whether the tree had changes),
the machine (CPU, cores, memory, accelerator), the load average at the start and end of each
topic, and the command line. ``python -m bench table`` rebuilds the current-figures table of
docs/benchmarks.md from the newest file that holds each figure, so the reference page never
carries a figure no file backs.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Figure:
    """One measured figure: ``topic``/``part``/``name`` identify it across runs.

    Parameters
    ----------
    value
        The figure, in ``unit``.
    aim
        The issue's aim for it, as text ("<= 1.05", ">= 0.8x"), or "" where it has none.
    setting
        What it was measured on: sizes, model, rounds, caps. A figure describes this setting.
    """

    topic: str
    part: str
    name: str
    value: float
    unit: str
    aim: str = ""
    setting: str = ""


@dataclass
class Run:
    """One ``python -m bench`` invocation: its figures and the conditions they were measured in."""

    started: str
    command: list[str]
    commit: str
    dirty: bool
    machine: dict[str, Any]
    loads: dict[str, list[float]] = field(default_factory=dict)  # topic -> 1-min load at start, end
    figures: list[Figure] = field(default_factory=list)
    note: str = ""  # e.g. where a run's figures were transcribed from, when no file was written then


_current: Run | None = None
_topic = ""


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def machine() -> dict[str, Any]:
    """The machine a figure was measured on: CPU model, cores, memory, and a CUDA device if any."""
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    gpu = ""
    if "torch" in sys.modules:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem / 2**30, 1), "gpu": gpu,
            "python": platform.python_version(), "node": platform.node()}


def start(command: list[str]) -> Run:
    """Begin recording a run (``python -m bench`` calls this once)."""
    global _current
    _current = Run(started=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), command=command,
                   commit=_git("rev-parse", "HEAD"), dirty=bool(_git("status", "--porcelain", "--untracked-files=no")),
                   machine=machine())
    return _current


def topic(name: str) -> None:
    """The figures that follow belong to benchmark ``name``; notes the load average at its start."""
    global _topic
    _topic = name
    if _current is not None:
        _current.loads.setdefault(name, []).append(round(os.getloadavg()[0], 2))


def end_topic() -> None:
    if _current is not None and _topic:
        _current.loads.setdefault(_topic, []).append(round(os.getloadavg()[0], 2))


def figure(part: str, name: str, value: float, unit: str, *, aim: str = "", setting: str = "") -> None:
    """Record one headline figure of the current topic (a no-op when no run is being recorded,
    as when a benchmark function is called from a notebook)."""
    if _current is not None:
        _current.figures.append(Figure(_topic, part, name, float(value), unit, aim, setting))


def finish(results: Path = RESULTS) -> Path | None:
    """Write the run's file, ``<started>-<topics>.json``; nothing when it recorded no figure."""
    global _current
    run, _current = _current, None
    if run is None or not run.figures:
        return None
    results.mkdir(parents=True, exist_ok=True)
    topics = "-".join(dict.fromkeys(f.topic for f in run.figures))
    path = results / f"{run.started.replace(':', '')}-{topics}.json"
    path.write_text(json.dumps(asdict(run), indent=1) + "\n")
    return path


def load_runs(results: Path = RESULTS) -> list[Run]:
    """Every recorded run, oldest first."""
    runs = []
    for path in sorted(results.glob("*.json")):
        raw = json.loads(path.read_text())
        raw["figures"] = [Figure(**f) for f in raw["figures"]]
        runs.append(Run(**raw))
    return sorted(runs, key=lambda r: r.started)


def latest(runs: list[Run]) -> list[tuple[Figure, Run]]:
    """The figures of each benchmark part (topic, part) from the newest run that measured it, in
    first-seen order: a figure a benchmark no longer records does not linger from an older run."""
    newest: dict[tuple[str, str], Run] = {}
    for run in runs:
        for fig in run.figures:
            newest[(fig.topic, fig.part)] = run
    return [(fig, run) for (topic, part), run in newest.items()
            for fig in run.figures if (fig.topic, fig.part) == (topic, part)]


def _value(fig: Figure) -> str:
    v = fig.value
    text = f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}" if abs(v) >= 0.01 or v == 0 else f"{v:.2e}"
    return f"{text} {fig.unit}".strip()


def table(runs: list[Run]) -> str:
    """The current figures as markdown: one row per benchmark part, from the newest run that
    measured it, then one line per run cited (date, commit, machine, load, note)."""
    rows: dict[tuple[str, str, str], list[Figure]] = {}
    for fig, run in latest(runs):
        rows.setdefault((fig.topic, fig.part, run.started), []).append(fig)
    cited = sorted({started for _, _, started in rows})
    label = {started: f"R{i + 1}" for i, started in enumerate(cited)}
    lines = ["| benchmark | figures | aim | setting | run |", "|---|---|---|---|---|"]
    for (topic, part, started), figs in rows.items():
        values = "; ".join(f"{f.name} **{_value(f)}**" for f in figs)
        aims = "; ".join(dict.fromkeys(f.aim for f in figs if f.aim))
        settings = "; ".join(dict.fromkeys(c for f in figs for c in f.setting.split("; ") if c))  # shared clauses once
        lines.append(f"| {topic}{f' · {part}' if part else ''} | {values} | {aims} | {settings} | {label[started]} |")
    by_start = {run.started: run for run in runs}
    lines.append("")
    groups: dict[tuple[str, bool, str, str], list[str]] = {}  # runs of one commit and machine: one line
    for started in cited:
        run = by_start[started]
        machine = f"{run.machine.get('cores')} cores, {run.machine.get('cpu') or '?'}" + (
            f", {run.machine['gpu']}" if run.machine.get("gpu") else "")
        loads = ", ".join(f"{t} {'→'.join(f'{x:.1f}' for x in v)}" for t, v in run.loads.items())
        groups.setdefault((run.commit[:7] or "?", run.dirty, machine, run.note), []).append(
            f"{label[started]} {started[:16].replace('T', ' ')} UTC `{' '.join(run.command[3:]) or 'all'}`"
            f" (load {loads})")
    for (commit, dirty, machine, note), entries in groups.items():
        lines.append(f"- commit {commit}{' with uncommitted changes' if dirty else ''}, {machine}"
                     + (f" ({note})" if note else "") + ": " + "; ".join(entries))
    return "\n".join(lines)


BEGIN, END = "<!-- figures: generated by `python -m bench table` -->", "<!-- /figures -->"


def write_table(doc: Path, results: Path = RESULTS) -> None:
    """Replace the table between the markers of ``doc`` with the current figures."""
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc}: no {BEGIN} ... {END} markers to put the table between")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{BEGIN}\n{table(load_runs(results))}\n{END}{tail}")
