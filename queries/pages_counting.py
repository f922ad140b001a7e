"""The report's counting-bottleneck page: where along the model the count is lost, what the model
answers past the training edge, and the variant runs (interventions) beside the plain one.

Every builder takes a read-only workspace and the output folder; figures come from the store only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)

from queries import evidence
from queries.figures import Page, Section, figure, lines, panels, stage_bands
from queries.gap import GapError
from queries.named import run as run_named
from queries.verdicts import verdicts_table, where_lost
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
                "Is the count still decodable at each depth (a read-out trained on every count), does the code"
                " learned inside the vision training range (ID, 0-49 stones) extend past it (VE 50-99, FE 100-120),"
                " and what does the model answer there?",
                empty="no run of this study in the workspace: run `make demo` (python -m extract manifests/demo.yaml"
                      " then python -m probes manifests/probes-demo.yaml)")
    page.sections += where_lost_sections(ws, out)
    if not family_runs(ws, "go"):
        return page
    page.sections.append(answers_section(ws, out))
    page.sections += intervention_sections(ws, out)
    return page


def where_lost_sections(ws: Workspace, out: Path) -> list[Section]:
    """The question first: per count target, the three curves per regime along depth (present,
    transferable, expressed), the study's N_H with its Vision and Language Gaps, and the verdicts."""
    sections = []
    for run in family_runs(ws, "go"):
        params = {"run": run, "tokens": "image", "group_by": "coalesce(truth->>'regime', 'all')"}
        for target in COUNT_TARGETS:
            try:
                found = evidence.curves(ws, {**params, "target": f"{target}%", "kind": "pooled"})
            except GapError:
                continue   # no count read-out of this target in this run
            said = evidence.expressed(ws, params, evidence.truths_of(found, ws, {**params, "target": f"{target}%"}))
            sections.append(_three_curves(out, run, target, found, said))
        try:
            n_h = evidence.curves(ws, {**params, "kind": "hidden_number%", "target": "go.intersection%"})
        except GapError:
            continue
        sections.append(_hidden_number(ws, out, run, n_h, params))
    return sections


def _ordered(groups: set[str]) -> list[str]:
    return sorted(groups, key=lambda g: (REGIMES.index(g) if g in REGIMES else 9, g))


def _three_curves(out: Path, run: str, target: str, found: list[evidence.Curve],
                  said: list[evidence.Expressed]) -> Section:
    table = evidence.curves_table(found)
    groups = _ordered({c.group for c in found})
    model = {e.group: e for e in said if e.run == run}
    top = max((p.value.high for c in found for p in c.points), default=1.0)
    top = max([top] + [p.control.high for c in found for p in c.points if p.control and c.role == "present"]) * 1.08
    name = f"lost_{run}_{target}".replace(":", "_").replace(".", "_")

    def draw(ax: Any, group: str) -> None:
        for c in (c for c in found if c.group == group):
            colour = "tab:green" if c.role == evidence.PRESENT else "tab:purple"
            label = "present (trained on every count)" if c.role == evidence.PRESENT else "transferable (trained ≤ 49)"
            _band(ax, c.points, colour, label)
            if c.role == evidence.PRESENT:
                _band(ax, c.points, "grey", "present's shuffled-label control", control=True)
        e = model.get(group)
        if e is not None and e.mae is not None:
            ax.axhline(e.mae.mean, ls="--", lw=1.2, color="black",
                       label=f"model's answers: MAE {e.mae.mean:.3g} over {e.n_numbers} number answers")
            ax.axhspan(e.mae.low, e.mae.high, color="black", alpha=0.08)
        ax.set_ylim(0, top)
        ax.set_title(f"{group}: {_expressed_text(e)}", fontsize=8, pad=12)
        ax.set_ylabel("mean absolute error (stones)")
        stage_bands(ax, [{"depth": p.depth, "stage": p.stage, "tap": p.tap, "layer": p.layer, "site": p.site}
                         for c in found if c.group == group for p in c.points])
        ax.legend(fontsize=6, loc="upper left")

    ns = ", ".join(f"{g} {max(p.value.n for c in found if c.group == g for p in c.points)}" for g in groups)
    seeds = max((p.value.n_seeds for c in found for p in c.points), default=1)
    fig = panels(out, name, groups, draw, table=table, cols=1, size=(7.0, 3.0), caption=(
        f"{run}, {target}: the count read-out (ridge on the mean image token) along depth, one panel per regime,"
        f" one y-axis for all. Green: trained on every count and tested held out (5-fold by board), against its"
        f" shuffled-label control (grey, dotted); purple: trained on in-range boards (≤ 49 stones) and tested on"
        f" the held-out boards of every regime; black dashed: the model's own answers (mean absolute error over the"
        f" answers that are numbers). Bands: 95 % bootstrap intervals over boards and seeds. n = {ns} boards,"
        f" {seeds} seed(s). Command: python -m queries curves --param run={run} --param target={target}%"
        " --param group_by=\"truth->>'regime'\"."))
    verdicts = where_lost(found)
    return Section(
        f"Where is the count lost? {run}, {target}",
        "Verdicts by the stated test of docs/verdicts.md (python -m queries lost --param run=" + run +
        f" --param target={target}% --param group_by=\"truth->>'regime'\"): present = the read-out trained on every"
        " count beats its shuffled-label control; re-encoded = it does, while the in-range read-out steps down.",
        figures=[fig],
        tables=[(f"{name}_verdicts", verdicts_table(verdicts)), (f"{name}_expressed", evidence.expressed_table(said))])


def _expressed_text(e: evidence.Expressed | None) -> str:
    if e is None or e.accuracy is None:
        return "no model answers"
    runaway = f", runaway {e.runaway.mean:.0%}" if e.runaway and e.runaway.mean > 0 else ""
    return (f"model accuracy {e.accuracy.mean:.0%} [{e.accuracy.low:.0%}, {e.accuracy.high:.0%}]"
            f" (n={e.n}){runaway}, {e.n_numbers} number answers")


def _band(ax: Any, points: list[evidence.Point], colour: str, label: str, control: bool = False) -> None:
    pts = [(p.depth, p.control if control else p.value) for p in points]
    pts = [(d, iv) for d, iv in pts if iv is not None]
    if not pts:
        return
    xs = [d for d, _ in pts]
    ax.plot(xs, [iv.mean for _, iv in pts], marker="o", ms=3, color=colour, ls=":" if control else "-", label=label)
    ax.fill_between(xs, [iv.low for _, iv in pts], [iv.high for _, iv in pts], color=colour, alpha=0.18, lw=0)


def _hidden_number(ws: Workspace, out: Path, run: str, found: list[evidence.Curve], params: dict[str, str]) -> Section:
    """counting-bottleneck's estimator along depth: Vision Gap |N_H - N_G| and Language Gap |N_H - N_P| per regime."""
    language = evidence.answer_gaps(ws, {**params, "kind": "hidden_number%", "target": "go.intersection%"})
    groups = _ordered({c.group for c in found})
    name = f"hidden_number_{run}"
    rows = []
    for c in found:
        for p in c.points:
            lg = language.get((c.group, p.depth))
            rows.append({"run": run, "regime": c.group, "depth": p.depth, "at": p.at, "boards": p.value.n,
                         "vision_gap": p.value.mean, "vision_gap_low": p.value.low, "vision_gap_high": p.value.high,
                         "control": p.control.mean if p.control else None,
                         "language_gap": lg.mean if lg else None, "language_gap_low": lg.low if lg else None,
                         "language_gap_high": lg.high if lg else None, "number_answers": lg.n if lg else 0})
    table = pa.Table.from_pylist(rows)

    def draw(ax: Any, group: str) -> None:
        for c in (c for c in found if c.group == group):
            _band(ax, c.points, "tab:blue", "Vision Gap |N_H − N_G|")
            _band(ax, c.points, "grey", "control's |N_H − N_G|", control=True)
            pts = sorted((d, iv) for (g, d), iv in language.items() if g == group)
            if pts:
                xs = [d for d, _ in pts]
                # dashed with open markers: where both gaps are 0 (ID) the Vision Gap still shows beneath
                ax.plot(xs, [iv.mean for _, iv in pts], marker="s", ms=5, mfc="none", ls="--", color="tab:red",
                        label=f"Language Gap |N_H − N_P| ({pts[0][1].n} number answers)")
                ax.fill_between(xs, [iv.low for _, iv in pts], [iv.high for _, iv in pts], color="tab:red", alpha=0.15)
            stage_bands(ax, [{"depth": p.depth, "stage": p.stage, "tap": p.tap, "layer": p.layer, "site": p.site}
                             for p in c.points])
        ax.set_title(group, fontsize=8, pad=12)
        ax.set_ylabel("stones")
        ax.legend(fontsize=6, loc="upper left")

    ns = ", ".join(f"{g} {max(p.value.n for c in found if c.group == g for p in c.points)}" for g in groups)
    fig = panels(out, name, groups, draw, table=table, cols=1, size=(7.0, 2.8), caption=(
        f"{run}: the study's hidden number N_H (tokens a black/white/empty probe trained on in-range boards calls"
        " black) at every depth, one panel per regime: Vision Gap |N_H − N_G| (blue, against the shuffled-label"
        " control's, grey) and Language Gap |N_H − N_P| over the boards whose answer is a number (red). Bands: 95 %"
        f" bootstrap intervals over boards. n = {ns} boards. Command: python -m queries curves --param run={run}"
        " --param kind=hidden_number --param group_by=\"truth->>'regime'\"."))
    return Section(f"The hidden number N_H along depth: {run}",
                   "counting-bottleneck's own estimator, which extrapolates because it counts tokens: where N_H"
                   " leaves the true count (Vision Gap), the tokens themselves stop saying black.",
                   figures=[fig], tables=[(f"{name}_verdicts", verdicts_table(where_lost(found)))])


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


