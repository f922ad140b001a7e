"""The report's counting-bottleneck page: where along the model the count is lost, what the model
answers past the training edge, and the variant runs (interventions) beside the plain one.

Every builder takes a read-only workspace and the output folder; figures come from the store only.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pyarrow as pa

from queries import evidence
from queries.figures import Figure, Page, Section, chance_line, figure, n_range, panels, stage_bands, wilson, wilson_yerr
from queries.gap import GapError
from queries.intervals import Interval
from queries.named import run as run_named
from queries.verdicts import Verdict, where_lost
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
    contrastive = contrastive_section(ws, out)
    if contrastive:
        page.sections.append(contrastive)
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
            said = evidence.expressed(ws, params, evidence.truths_of(ws, {**params, "target": f"{target}%"}))
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
    top = max([top] + [p.control.high for c in found for p in c.points if p.control and c.role == "present"]) * 1.5
    lows = [p.value.low for c in found for p in c.points if p.value.low > 0]
    lows += [e.mae.low for e in said if e.mae is not None and e.mae.low > 0]
    bottom = max(min(lows, default=0.1) / 2, 1e-3)
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
        # Log scale: errors of 0.2 and 1 stone (in range, present) stay apart under a control at 35.
        ax.set_yscale("log")
        ax.set_ylim(bottom, top)
        ax.set_title(f"{group}: {_expressed_text(e)}", fontsize=8, pad=12)
        ax.set_ylabel("mean absolute error (stones)")
        stage_bands(ax, [{"depth": p.depth, "stage": p.stage, "tap": p.tap, "layer": p.layer, "site": p.site}
                         for c in found if c.group == group for p in c.points])
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))   # beside the panel: no line under it

    ns = ", ".join(f"{max(p.value.n for c in found if c.group == g for p in c.points)} {g}" for g in groups)
    seeds = max((p.value.n_seeds for c in found for p in c.points), default=1)
    fig = panels(out, name, groups, draw, table=table, cols=1, size=(9.0, 3.0), caption=(
        f"{run}, {target}: the count read-out (ridge on the mean image token) along depth, one panel per regime,"
        f" one log y-axis for all. Green: trained on every count and tested held out (5-fold by board), against its"
        f" shuffled-label control (grey, dotted); purple: trained on in-range boards (≤ 49 stones) and tested on"
        f" the held-out boards of every regime; black dashed: the model's own answers (mean absolute error over the"
        f" answers that are numbers). Bands: 95 % bootstrap intervals over boards and seeds. n = {ns} boards,"
        f" n_seeds = {seeds}. Command: python -m queries curves --param run={run} --param target={target}%"
        " --param group_by=\"truth->>'regime'\"."))
    verdicts = where_lost(found)
    return Section(
        f"Where is the count lost? {run}, {target}",
        "Verdicts by the stated test of docs/verdicts.md (python -m queries lost --param run=" + run +
        f" --param target={target}% --param group_by=\"truth->>'regime'\" prints them with every number as a"
        " column): present = the read-out trained on every count beats its shuffled-label control; re-encoded ="
        " it does, while the in-range read-out steps down.\n" + _reasons(verdicts),
        figures=[fig],
        tables=[(f"{name}_verdicts", verdicts_display(verdicts)), (f"{name}_expressed", evidence.expressed_table(said))],
        titles={f"{name}_verdicts": "Verdicts per regime, every number with its 95 % interval and n (lost)",
                f"{name}_expressed": "What the model answers per regime, with 95 % intervals (expressed)"})


def verdicts_display(verdicts: list[Verdict]) -> pa.Table:
    """The verdicts as a reader scans them: one row per group, each number beside its interval (the
    numeric columns and the reasons: python -m queries lost, and the section's note)."""
    def cell(iv: Interval | None) -> str | None:
        return None if iv is None else f"{iv.mean:.3g} [{iv.low:.3g}, {iv.high:.3g}]"

    rows = []
    for v in sorted(verdicts, key=lambda v: (REGIMES.index(v.group) if v.group in REGIMES else 9, v.group)):
        p, t, b = v.point, v.transfer_point, v.transfer_before
        rows.append({"group": v.group, "verdict": v.verdict, "at": v.at, "n": p.value.n if p else (t.value.n if t else None),
                     "seeds": p.value.n_seeds if p else (t.value.n_seeds if t else None),
                     "present": cell(p.value if p else None), "its control": cell(p.control if p else None),
                     "in-range before": cell(b.value if b else None), "in-range": cell(t.value if t else None)})
    return pa.Table.from_pylist(rows)


def _reasons(verdicts: list[Verdict]) -> str:
    return "\n".join(f"{v.group}: {v.reason.strip()}" for v in verdicts)


def _expressed_text(e: evidence.Expressed | None) -> str:
    if e is None or e.accuracy is None:
        return "no model answers"
    runaway = f", runaway {e.runaway.mean:.0%}" if e.runaway and e.runaway.mean > 0 else ""
    return (f"model accuracy {e.accuracy.mean:.0%} [{e.accuracy.low:.0%}, {e.accuracy.high:.0%}]"
            f" (n={e.n}){runaway}, {e.n_numbers} number answers")


def _band(ax: Any, points: list[evidence.Point], colour: str, label: str, control: bool = False) -> None:
    pts = [(p.depth, iv) for p in points if (iv := p.control if control else p.value) is not None]
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

    ns = ", ".join(f"{max(p.value.n for c in found if c.group == g for p in c.points)} {g}" for g in groups)
    fig = panels(out, name, groups, draw, table=table, cols=1, size=(7.0, 2.8), caption=(
        f"{run}: the study's hidden number N_H (tokens a black/white/empty probe trained on in-range boards calls"
        " black) at every depth, one panel per regime: Vision Gap |N_H − N_G| (blue, against the shuffled-label"
        " control's, grey) and Language Gap |N_H − N_P| over the boards whose answer is a number (red). Bands: 95 %"
        f" bootstrap intervals over boards. n = {ns} boards. Command: python -m queries curves --param run={run}"
        " --param kind=hidden_number --param group_by=\"truth->>'regime'\"."))
    verdicts = where_lost(found)
    return Section(f"The hidden number N_H along depth: {run}",
                   "counting-bottleneck's own estimator, which extrapolates because it counts tokens: where N_H"
                   " leaves the true count (Vision Gap), the tokens themselves stop saying black.\n" + _reasons(verdicts),
                   figures=[fig], tables=[(f"{name}_verdicts", verdicts_display(verdicts))],
                   titles={f"{name}_verdicts": "N_H's verdicts per regime (an in-range estimator: it cannot tell a"
                                               " loss from a re-encoding alone)"})


def answers_section(ws: Workspace, out: Path) -> Section:
    """What the model answers per regime (right, a wrong number, a word, nothing, a runaway string),
    and accuracy along the count: the visual run and its text twin on one axis (the study's paradox),
    the variant runs beside the plain one."""
    kinds = ws.query(
        "SELECT s.run, s.truth->>'regime' AS regime, CASE WHEN s.correct THEN 'right'"
        " WHEN s.answer_kind = 'digits' THEN 'wrong number' ELSE coalesce(s.answer_kind, 'unknown') END AS answer,"
        " count(*) AS n FROM v_samples s JOIN runs r USING (run) WHERE s.family = 'go' AND s.generated IS NOT NULL"
        " AND NOT ends_with(coalesce(r.config->'stimuli'->0->>'task', ''), '_tf') GROUP BY ALL ORDER BY 1, 2, 3")
    per_bin = ws.query(
        "SELECT s.run, coalesce(r.intervention->>'kind', 'none') AS intervention, r.config->'stimuli'->0->>'task' AS task,"
        f" (floor((s.truth->>'count')::INTEGER / {COUNT_BIN}) * {COUNT_BIN})::INTEGER AS bin,"
        " count(*) FILTER (WHERE s.correct) AS right, count(*) AS n FROM v_samples s JOIN runs r USING (run)"
        " WHERE s.family = 'go' AND s.generated IS NOT NULL"
        " AND NOT ends_with(coalesce(r.config->'stimuli'->0->>'task', ''), '_tf') GROUP BY ALL ORDER BY 1, 4")
    sec = Section("Counting lab: what the model answers",
                  "ID 0–49 (seen in vision training), VE 50–99 (text only), FE 100–120 (never seen). A runaway"
                  " answer is a string of digits still running at the generation cap: wrong, and no number.",
                  tables=[("counting_regimes", run_named(ws, "counting_regimes")),
                          ("attractors", run_named(ws, "attractors"))],
                  titles={"counting_regimes": "Accuracy and answer kinds per regime (counting_regimes)",
                          "attractors": "Wrong answers that draw far more than chance (attractors: share and lift)"})
    runs = sorted(set(kinds.column("run").to_pylist()))
    if runs:
        ns = [r["n"] for r in _regime_totals(kinds)]
        sec.figures.append(panels(out, "counting_answers", runs[:8], partial(_answer_bars, table=kinds),
                                  table=kinds, cols=2, sharex=False, size=(6.4, 2.6), caption=(
            "What each run answers per regime, as shares of its boards: right, a wrong number, a word (e.g. False),"
            " nothing, or a runaway string of digits cut at the generation cap; one panel per run, one 0–1 axis."
            f" {n_range(ns, 'boards per bar')}.")))
        sec.figures.append(_accuracy_along_count(out, per_bin))
    gaps = run_named(ws, "counting_gaps")
    if gaps.num_rows:
        sec.tables.append(("counting_gaps", gaps))
        sec.titles["counting_gaps"] = "The study's Vision and Language Gaps per depth and regime (counting_gaps)"
    return sec


def contrastive_section(ws: Workspace, out: Path) -> Section | None:
    """The study's contrastive question (task *_tf: is the string's count the board's?) per regime,
    split by pair kind: a model that answers False to everything scores 1/2 overall and 0 on the
    equal pairs, which one overall accuracy hides."""
    table = ws.query(
        "SELECT s.run, r.config->'stimuli'->0->>'task' AS task, s.truth->>'regime' AS regime,"
        " CASE WHEN s.truth->>'tf_pair' = 'eq' THEN 'equal counts' ELSE 'unequal counts' END AS pair,"
        " count(*) AS n, count(*) FILTER (WHERE s.correct) AS right, mode(trim(s.generated)) AS top_answer"
        " FROM v_samples s JOIN runs r USING (run) WHERE s.family = 'go' AND s.generated IS NOT NULL"
        " AND r.config->'stimuli'->0->>'task' LIKE '%_tf' GROUP BY ALL ORDER BY 1, 3, 4")
    if not table.num_rows:
        return None
    rows = table.to_pylist()
    runs = sorted({r["run"] for r in rows})

    def draw(ax: Any, run: str) -> None:
        mine = [r for r in rows if r["run"] == run]
        regimes = [g for g in REGIMES if any(r["regime"] == g for r in mine)]
        for offset, pair, colour in ((-0.2, "equal counts", "tab:green"), (0.2, "unequal counts", "tab:orange")):
            pts = [(i, r) for i, g in enumerate(regimes) for r in mine if r["regime"] == g and r["pair"] == pair]
            ax.bar([i + offset for i, _ in pts], [r["right"] / r["n"] for _, r in pts], width=0.38, color=colour,
                   label=pair, capsize=3, yerr=wilson_yerr([(r["right"], r["n"]) for _, r in pts]))
        chance_line(ax, 0.5, "chance (1/2)")
        ax.set_xticks(range(len(regimes)), regimes)
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("accuracy")
        ax.set_title(run, fontsize=8)
        ax.legend(fontsize=6, loc="lower left")

    return Section(
        "Contrastive counting: is the string's count the board's?",
        "The study's true/false task: the board beside a string of c letters whose count is equal (even boards)"
        " or not (odd boards).",
        figures=[panels(out, "contrastive", runs[:4], draw, table=table, cols=1, size=(6.4, 2.8), caption=(
            "Accuracy per regime on equal-count and unequal-count pairs with 95 % Wilson intervals, chance 1/2"
            f" dotted, one panel per run. {n_range([r['n'] for r in rows], 'boards per bar')}."))],
        tables=[("contrastive", table)], titles={"contrastive": "Contrastive accuracy per regime and pair kind"})


#: Boards per accuracy point along the count: bins of this many stones (4 boards a count on the demo).
COUNT_BIN = 10
ANSWER_KINDS = {"right": "tab:green", "wrong number": "tab:orange", "word": "tab:purple", "empty": "tab:grey",
                "runaway": "tab:red", "unknown": "black"}


def _regime_totals(table: pa.Table) -> list[dict[str, Any]]:
    totals: dict[tuple[str, str], int] = {}
    for r in table.to_pylist():
        totals[(r["run"], r["regime"])] = totals.get((r["run"], r["regime"]), 0) + r["n"]
    return [{"run": k[0], "regime": k[1], "n": n} for k, n in totals.items()]


def _answer_bars(ax: Any, run: str, table: pa.Table) -> None:
    rows = [r for r in table.to_pylist() if r["run"] == run]
    regimes = [g for g in REGIMES if any(r["regime"] == g for r in rows)]
    totals = {g: sum(r["n"] for r in rows if r["regime"] == g) for g in regimes}
    bottom = [0.0] * len(regimes)
    for kind, colour in ANSWER_KINDS.items():
        share = [sum(r["n"] for r in rows if r["regime"] == g and r["answer"] == kind) / totals[g] for g in regimes]
        if any(share):
            ax.bar(range(len(regimes)), share, bottom=bottom, color=colour, label=kind, width=0.6)
            bottom = [b + v for b, v in zip(bottom, share, strict=True)]
    ax.set_xticks(range(len(regimes)), [f"{g}\nn={totals[g]}" for g in regimes], fontsize=7)
    ax.set_ylim(0, 1.0)
    ax.set_ylabel("share of boards")
    ax.set_title(run, fontsize=8)
    ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))


def _accuracy_along_count(out: Path, table: pa.Table) -> Figure:
    """Two panels on one 0-1 axis: the plain visual run beside its text twin, then every variant run
    beside the plain visual run; Wilson intervals per bin of COUNT_BIN stones."""
    rows = table.to_pylist()
    plain = sorted({r["run"] for r in rows if r["intervention"] == "none"})
    visual = [r for r in plain if any(x["run"] == r and not (x["task"] or "").startswith("text") for x in rows)]
    variants = sorted({r["run"] for r in rows if r["intervention"] != "none"})
    keys = ["visual beside its text twin"] + (["variants beside the plain visual run"] if variants else [])

    def draw(ax: Any, key: str) -> None:
        shown = plain if key == keys[0] else visual[:1] + variants
        for run in shown:
            pts = sorted((r["bin"], r["right"], r["n"]) for r in rows if r["run"] == run)
            xs = [b + COUNT_BIN / 2 for b, _, _ in pts]
            lows, highs = zip(*(wilson(k, n) for _, k, n in pts), strict=True)
            task = next(r["task"] or "" for r in rows if r["run"] == run)
            line, = ax.plot(xs, [k / n for _, k, n in pts], marker="o", ms=3,
                            label=f"{run} ({'text' if task.startswith('text') else 'image'})")
            ax.fill_between(xs, lows, highs, color=line.get_color(), alpha=0.15, lw=0)
        ax.axvline(TRAINING_EDGE, color="grey", ls="--", lw=1)
        ax.text(TRAINING_EDGE, 1.02, " training edge", fontsize=7, color="grey")
        ax.set_ylim(0, 1.05)
        ax.set_xlabel(f"black stones (bins of {COUNT_BIN})")
        ax.set_ylabel("accuracy")
        ax.set_title(key, fontsize=8)
        ax.legend(fontsize=6)

    ns = [r["n"] for r in rows]
    return panels(out, "counting_accuracy", keys, draw, table=table, cols=1, size=(6.4, 2.8), caption=(
        f"Accuracy per bin of {COUNT_BIN} black stones with 95 % Wilson intervals, on one 0–1 axis: the visual run"
        " beside its text twin (the same boards as strings: the study's paradox), then the variant runs beside the"
        f" plain visual run. {n_range(ns, 'boards per bin')}."))


def intervention_sections(ws: Workspace, out: Path) -> list[Section]:
    """The head-ablation runs: critical heads per run and the critical-head overlap of every two runs
    over the same stimuli (the other variant runs are on their studies' pages, queries/pages_variants.py)."""
    sections = []
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
                f" same heads. {n_range(heads.column('stimuli').to_pylist(), 'stimuli per run')}."))],
            tables=tables))
    return sections


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


