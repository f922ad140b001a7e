"""The report's study pages: one per study, each opening with the figure that answers it.

Every builder takes a read-only workspace and the output folder and returns a :class:`Page`;
a study the workspace holds no run of gets a page whose one line says what to run, never an
error. Figures come from the store only (named queries, the gap primitive, stored arrays).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from queries import gap
from queries.figures import Page, Section, depth_lines, figure, lines, panels, stage_bands
from queries.named import run as run_named
from store import Workspace

#: Read-outs of a count: targets whose per-sample predictions are numbers of stones or objects.
COUNT_TARGETS = ("truth:count", "go.count", "counting.count")
REGIMES = ("ID", "VE", "FE")
REGIME_COLOURS = {"ID": "tab:blue", "VE": "tab:orange", "FE": "tab:red"}
TRAINING_EDGE = 49.5  # the toy's vision curriculum: boards of 0-49 stones


def family_runs(ws: Workspace, family: str) -> list[str]:
    return [r[0] for r in ws.rows("SELECT DISTINCT run FROM v_samples WHERE family = ? ORDER BY 1", [family])]


# --------------------------------------------------------------------------------------------
# counting-bottleneck

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


# --------------------------------------------------------------------------------------------
# all probes along the model

def probes_section(ws: Workspace, out: Path) -> Section | None:
    """Every probe series along depth: one panel per (run, metric), controls clipped and labelled."""
    probes = ws.query("SELECT run, tap, site, tokens, target, kind, metric, series, layer, depth, stage, score,"
                      " control_score, selectivity FROM v_probe_layers WHERE depth IS NOT NULL"
                      " ORDER BY run, target, depth, tap, layer")
    if not probes.num_rows:
        return None
    # the series column is a hash of the probe's settings: the label names what a reader can tell apart
    rows = [{**r, "probe": f"{r['target']} ({r['kind']}, {r['tokens']} tokens)"} for r in probes.to_pylist()]
    keys = sorted({(r["run"], r["metric"]) for r in rows})

    def draw(ax: Any, key: tuple[str, str]) -> None:
        depth_lines(ax, [r for r in rows if (r["run"], r["metric"]) == key], "probe", "score", "control_score",
                    ylim=(0.0, 1.05), ylabel=key[1])
        ax.set_title(f"{key[0]}: {key[1]}", fontsize=8)

    return Section("Probes along the model", figures=[panels(out, "probes", keys, draw, table=probes, cols=2,
                                                             sharex=False, size=(6.4, 3.4), caption=(
        "Test score (solid) and shuffled-label control (dotted, same colour; clipped at 0 where it falls"
        " below) per depth along the data path, one panel per run and metric (stage bands: vision, merger,"
        " projector, LLM)."))], tables=[("probe_leaderboard", run_named(ws, "probe_leaderboard"))])


def modality_attention_share(ws: Workspace, run: str, by_correct: bool = False) -> pa.Table:
    """MAS per LLM layer: the image-key share of the last prompt token's attention, mean over heads
    and samples (CountingTricks' MAS_l at the query that produces the first answer token);
    ``by_correct`` splits it by whether the model's answer was right."""
    infos = [a for a in ws.arrays(run) if a.tap == "attn" and a.tokens == "last"]
    spans = ws.rows("SELECT array_row, image_start, image_count, coalesce(correct, false) FROM v_samples"
                    " WHERE run = ? ORDER BY array_row", [run])
    out: dict[str, list[Any]] = {"layer": [], "mas": [], "correct": [], "n": []}
    for info in sorted(infos, key=lambda a: a.layer):
        att = ws.read(run, "attn", info.layer, site=info.site, tokens="last")
        groups: dict[Any, list[float]] = {}
        for row, start, count, correct in spans:
            if start is None or not count:
                continue
            keys = att[row].astype(np.float64)  # [keys, heads]
            total = keys.sum(0)
            share = float(np.mean(keys[start: start + count].sum(0) / np.where(total > 0, total, 1)))
            groups.setdefault(bool(correct) if by_correct else None, []).append(share)
        for group, shares in sorted(groups.items(), key=lambda g: str(g[0])):
            out["layer"].append(info.layer)
            out["mas"].append(float(np.mean(shares)))
            out["correct"].append(group)
            out["n"].append(len(shares))
    n = len(set(out["layer"]))
    order = sorted(set(out["layer"]))
    out["third"] = ["early" if order.index(x) < n / 3 else "middle" if order.index(x) < 2 * n / 3 else "late"
                    for x in out["layer"]]
    table = pa.table(out)
    return table if by_correct else table.drop_columns(["correct", "n"])


# --------------------------------------------------------------------------------------------
# counting-tricks

def tricks_page(ws: Workspace, out: Path) -> Page:
    page = Page("counting-tricks", "counting-tricks: which placements break counting, and where?",
                "Accuracy per case (objects moved against the patch grid), whether the objects can still be"
                " found along depth (detection probe, AP@50), and how much the answer attends to the image when"
                " it is right vs wrong (MAS).",
                empty="no run of this study in the workspace: run `make demo` (python -m extract"
                      " manifests/demo-counting-tricks.yaml, python -m probes"
                      " manifests/probes-demo-counting-tricks.yaml)")
    cases = run_named(ws, "counting_cases")
    if cases.num_rows:
        runs = sorted(set(cases.column("run").to_pylist()))
        page.sections.append(Section("Accuracy per case", figures=[panels(
            out, "counting_cases", runs[:4], lambda ax, r: _case_bars(ax, cases, r), csv="counting_cases.csv",
            sharex=False, caption="Share of correct counts per CountingTricks case (1A-15A), one panel per run;"
                                  " n per case in the table.")], tables=[("counting_cases", cases)]))
    detect = ws.query("SELECT run, series, tap, layer, site, tokens, depth, stage, score, control_score, n_seeds"
                      " FROM v_probe_layers WHERE kind = 'detect' AND depth IS NOT NULL ORDER BY run, series, depth")
    if detect.num_rows:
        rows = [{**r, "probe": f"counting.boxes, probe {(r['series'] or '')[:8]}"} for r in detect.to_pylist()]
        runs = sorted({r["run"] for r in rows})

        def draw(ax: Any, run: str) -> None:
            depth_lines(ax, [r for r in rows if r["run"] == run], "probe", "score", "control_score", ylim=(0.0, 1.05),
                        ylabel="AP@50")
            ax.set_title(run, fontsize=8)

        page.sections.append(Section("Can the objects be found along depth?", figures=[panels(
            out, "detect_ap", runs, draw, table=detect, caption=(
                "Detection probe AP@50 on test images per depth along the data path (the study's shape: high in"
                " the vision encoder, lower in the LLM), shuffled-box control dotted, one panel per run."))]))
    page.sections += mas_sections(ws, out)
    return page


def _case_bars(ax: Any, table: pa.Table, run: str) -> None:
    rows = [r for r in table.to_pylist() if r["run"] == run]
    ax.bar(range(len(rows)), [r["accuracy"] or 0.0 for r in rows], color="tab:green", alpha=0.8)
    ax.set_xticks(range(len(rows)), [r["case_id"] for r in rows], rotation=90, fontsize=6)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("accuracy")
    ax.set_title(run, fontsize=8)


def mas_sections(ws: Workspace, out: Path) -> list[Section]:
    runs = [r[0] for r in ws.rows("SELECT DISTINCT run FROM activations WHERE tap = 'attn' AND tokens = 'last'"
                                  " ORDER BY 1")]
    rows: list[dict[str, Any]] = []
    for run in runs:
        rows += [{"run": run, **r} for r in modality_attention_share(ws, run, by_correct=True).to_pylist()]
    if not rows:
        return []
    mas = pa.Table.from_pylist(rows)
    keys = sorted({r["run"] for r in rows})

    def draw(ax: Any, run: str) -> None:
        for correct, colour in ((True, "tab:green"), (False, "tab:red")):
            pts = [(r["layer"], r["mas"], r["n"]) for r in rows if r["run"] == run and r["correct"] is correct]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=colour,
                        label=f"{'correct' if correct else 'wrong'} (n={pts[0][2]})")
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("LLM layer")
        ax.set_ylabel("MAS")
        ax.set_title(run, fontsize=8)
        ax.legend(fontsize=6)

    return [Section("Modality attention share: correct vs wrong answers", figures=[panels(
        out, "mas", keys[:8], draw, table=mas, cols=2, sharex=False, caption=(
            "Image-key share of the last prompt token's attention per LLM layer (mean over heads and samples),"
            " split by whether the model's answer was right, one panel per run with last-query attention."))])]
