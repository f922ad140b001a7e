"""The report's counting-bottleneck page: where along the model the count is lost, what the model
answers past the training edge, and the variant runs (interventions) beside the plain one.

Every builder takes a read-only workspace and the output folder; figures come from the store only.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)

from queries import gap
from queries.figures import Page, Section, figure, lines, panels, stage_bands
from queries.named import run as run_named
from store import Workspace

#: Read-outs of a count: targets whose per-sample predictions are numbers of stones or objects.
COUNT_TARGETS = ("truth:count", "go.count", "counting.count")
REGIMES = ("ID", "VE", "FE")
REGIME_COLOURS = {"ID": "tab:blue", "VE": "tab:orange", "FE": "tab:red"}
TRAINING_EDGE = 49.5  # the toy's vision curriculum: boards of 0-49 stones


def family_runs(ws: Workspace, family: str) -> list[str]:
    return [r[0] for r in ws.rows("SELECT DISTINCT run FROM v_samples WHERE family = ? ORDER BY 1", [family])]



def counting_page(ws: Workspace, out: Path) -> Page:
    page = Page("counting-bottleneck", "counting-bottleneck: where is the count lost?",
                "A count read-out trained on boards inside the vision training range (ID, 0-49 stones), tested"
                " past it (VE 50-99, FE 100-120): at which depth does its error rise, and what does the model"
                " answer there?",
                empty="no run of this study in the workspace: run `make demo` (python -m extract manifests/demo.yaml"
                      " then python -m probes manifests/probes-demo.yaml)")
    page.sections += where_lost_sections(ws, out)
    if not family_runs(ws, "go"):
        return page
    page.sections.append(answers_section(ws, out))
    page.sections += intervention_sections(ws, out)
    return page


def where_lost_sections(ws: Workspace, out: Path) -> list[Section]:
    """The question first: per count read-out along depth, its error per regime, and where it is lost."""
    sections = []
    marks = ", ".join("?" for _ in COUNT_TARGETS)
    found = ws.rows(f"SELECT DISTINCT p.run, p.target FROM probes p JOIN probe_predictions pp USING (key)"
                    f" JOIN v_samples s ON s.run = p.run AND s.array_row = pp.array_row"
                    f" WHERE p.target IN ({marks}) AND pp.prediction IS NOT NULL AND s.family IS DISTINCT FROM"
                    f" 'counting' ORDER BY 1, 2", list(COUNT_TARGETS))
    for run, target in found:
        params = {"run": run, "target": target, "tokens": "image", "group_by": "coalesce(truth->>'regime', 'all')"}
        table = gap.gap(ws, params)
        if not table.num_rows or all(v is None for v in table.column("depth").to_pylist()):
            continue
        name = f"lost_{run}_{target}".replace(":", "_").replace(".", "_")
        curve = table.select(["depth", "stage", "tap", "layer", "site", "group", "n", "probe_mae", "probe_r2",
                              "mean_prediction", "model_accuracy", "model_mae", "gap_mae", "selectivity"])
        fig = figure(out, name, partial(_gap_lines, table=table), csv=f"{name}_curve.csv", caption=(
            f"Mean absolute error of the count read-out ({target}, ridge on the mean image token) on test stimuli"
            " per depth along the data path, one line per regime (ID seen in vision training, VE/FE past it); the"
            " dashed line of each regime's colour is the model's own answer error where it is on the panel."
            f" Command: python -m queries gap --param run={run} --param target={target}"
            " --param group_by=\"truth->>'regime'\"."))
        sections.append(Section(f"Where is the count lost? {run}, {target}",
                                "The table says at which depth each regime's error rose most (python -m queries"
                                f" lost --param run={run} --param target={target} --param"
                                " group_by=\"truth->>'regime'\").", figures=[fig],
                                tables=[(name, gap.where_lost(table)), (f"{name}_curve", curve)]))
    return sections


def _gap_lines(ax: Any, table: pa.Table) -> None:
    rows = [r for r in table.to_pylist() if r["depth"] is not None]
    top = max((r["probe_mae"] or 0) for r in rows) * 1.15 or 1.0
    for group in sorted({r["group"] for r in rows}, key=lambda g: REGIMES.index(g) if g in REGIMES else 9):
        pts = sorted((r["depth"], r["probe_mae"], r["model_mae"]) for r in rows if r["group"] == group)
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{group} read-out",
                        color=REGIME_COLOURS.get(group))
        model = pts[-1][2]
        if model is not None and model <= top:
            ax.axhline(model, ls="--", lw=1, color=line.get_color(), label=f"{group} model answer")
    ax.set_ylim(0, top)
    ax.set_ylabel("mean absolute error (stones)")
    stage_bands(ax, rows)
    ax.legend(fontsize=7)


def answers_section(ws: Workspace, out: Path) -> Section:
    """What the model answers past the training edge, and accuracy per count of each run (facets:
    the visual run beside its text twin and variants)."""
    answers = ws.query(
        # a runaway answer's digits were cut at the cap, not answered: it goes to the no-number bar
        "SELECT g.run, st.truth->>'regime' AS regime, CASE WHEN g.answer_kind = 'digits'"
        " THEN TRY_CAST(g.prediction AS BIGINT) END AS prediction, count(*) AS n"
        " FROM generations g JOIN stimuli st USING (stimulus) WHERE st.family = 'go'"
        " AND st.truth->>'regime' IN ('VE', 'FE') GROUP BY ALL ORDER BY 1, 2, 3")
    per_count = ws.query(
        "SELECT g.run, (st.truth->>'count')::INTEGER AS count, avg(g.correct::INTEGER) AS accuracy, count(*) AS n"
        " FROM generations g JOIN stimuli st USING (stimulus) WHERE st.family = 'go' GROUP BY ALL ORDER BY 1, 2")
    runs = sorted(set(answers.column("run").to_pylist())) or ["(none)"]
    sec = Section("Counting lab: answers past the training edge",
                  "ID 0–49 (seen in vision training), VE 50–99 (text only), FE 100–120 (never seen).",
                  tables=[("counting_regimes", run_named(ws, "counting_regimes")),
                          ("attractors", run_named(ws, "attractors"))])
    sec.figures.append(panels(out, "counting_answers", runs[:6], lambda ax, r: _answer_histogram(ax, answers, r),
                              table=answers, cols=2, sharex=False, caption=(
                                  "Histogram of the answered count on boards past the training edge (VE orange, FE"
                                  " red), one panel per run; the dashed line is the training edge (49 stones).")))
    count_runs = sorted(set(per_count.column("run").to_pylist()))
    sec.figures.append(panels(out, "counting_accuracy", count_runs[:8], lambda ax, r: lines(
        ax, per_count.filter(pa.compute.equal(per_count["run"], r)), "count", "accuracy", "stones", "accuracy",
        spans=((TRAINING_EDGE, "training edge"),)), table=per_count, cols=2, caption=(
        "Accuracy per number of black stones, one panel per run: the visual run beside its text twin"
        " (the same boards as strings) and the variant runs.")))
    gaps = run_named(ws, "counting_gaps")
    if gaps.num_rows:
        sec.tables.append(("counting_gaps", gaps))
    return sec


ANSWER_CAP = 130  # answers above the largest count (e.g. "910") share one bar


def _answer_histogram(ax: Any, table: pa.Table, run: str) -> None:
    rows = [r for r in table.to_pylist() if r["run"] == run]
    for regime in ("VE", "FE"):
        bins: dict[int, int] = {}
        for r in rows:
            if r["regime"] == regime:
                x = -1 if r["prediction"] is None else min(r["prediction"], ANSWER_CAP)
                bins[x] = bins.get(x, 0) + r["n"]
        if bins:
            ax.bar(list(bins), list(bins.values()), width=1.0, color=REGIME_COLOURS[regime], alpha=0.6,
                   label=f"{regime} answers")
    ax.axvline(TRAINING_EDGE, color="grey", ls="--", lw=1)
    ax.set_xlim(-3, ANSWER_CAP + 3)
    ax.set_title(run, fontsize=8)
    ax.set_xlabel(f"answered count (-1: no number; {ANSWER_CAP}: larger)", fontsize=7)
    ax.set_ylabel("answers")
    if rows:
        ax.legend(fontsize=6)


def intervention_sections(ws: Workspace, out: Path) -> list[Section]:
    """Variant runs beside the plain ones: accuracy and retained ratio per run, critical heads and
    the critical-head overlap of every two head-ablation runs over the same stimuli."""
    sections = []
    variants = run_named(ws, "interventions", {})
    if any(v != "none" for v in variants.column("intervention").to_pylist()):
        sections.append(Section(
            "Interventions: variant runs", figures=[figure(out, "interventions", lambda ax: _variant_bars(
                ax, variants), csv="interventions.csv", caption=(
                "Accuracy of each run beside its intervention (none = a plain run); token compression also"
                " gives the share of image tokens it kept."))],
            tables=[("interventions", variants)]))
    heads = run_named(ws, "critical_heads", {})
    if heads.num_rows:
        runs = sorted(set(heads.column("run").to_pylist()))
        overlap = []
        for i, a in enumerate(runs):
            for b in runs[i + 1:]:
                row = run_named(ws, "head_overlap", {"a": a, "b": b}).to_pylist()[0]
                if row["stimuli"]:
                    overlap.append({"a": a, "b": b, **row})
        tables = [("critical_heads", heads)]
        if overlap:
            tables.append(("head_overlap", pa.Table.from_pylist(overlap)))
        sections.append(Section(
            "Interventions: critical heads", figures=[figure(out, "critical_heads", lambda ax: _head_bars(
                ax, heads), csv="critical_heads.csv", caption=(
                "Share of stimuli whose teacher-forced answer flips when one head is zeroed, per run; overlap"
                " (table): how often two runs over the same stimuli (the visual and the text count) need the"
                " same heads."))],
            tables=tables))
    return sections


def _variant_bars(ax: Any, table: pa.Table) -> None:
    rows = table.to_pylist()
    if any(r["regime"] == "ID" for r in rows):  # one regime, so every bar is over comparable boards
        rows = [r for r in rows if r["regime"] == "ID"]
        ax.set_title("Go boards in the training range (ID)", fontsize=9)
    labels = [f"{r['run']}\n({r['intervention']})" for r in rows]
    bars = ax.bar(range(len(rows)), [r["accuracy"] or 0.0 for r in rows], color="tab:blue", alpha=0.7)
    for bar, r in zip(bars, rows, strict=False):
        if r["retained_ratio"] is not None:
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"kept {r['retained_ratio']:.0%}",
                    ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(rows)), labels, fontsize=6)
    ax.set_ylabel("accuracy")


def _head_bars(ax: Any, table: pa.Table) -> None:
    rows = table.to_pylist()
    runs = sorted({r["run"] for r in rows})
    heads = sorted({(r["tap"], r["layer"], r["head"]) for r in rows})
    width = 0.8 / len(runs)
    for k, run in enumerate(runs):
        share = {(r["tap"], r["layer"], r["head"]): r["critical_share"] for r in rows if r["run"] == run}
        ax.bar([i + k * width for i in range(len(heads))], [share.get(h, 0.0) for h in heads], width=width, label=run)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(heads))],
                  [f"{t} L{layer}H{h}" for t, layer, h in heads], fontsize=7)
    ax.set_ylabel("critical share")
    ax.legend(fontsize=7)


