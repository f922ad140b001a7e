"""The report's counting-tricks page and the page of every probe along depth (the counting-bottleneck
page is queries/pages_counting.py, the two spatial studies queries/pages_spatial.py).

Every builder takes a read-only workspace and the output folder and returns a :class:`Page`;
a study the workspace holds no run of gets a page whose one line says what to run, never an
error. Figures come from the store only (named queries, the gap primitive, stored arrays).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from queries import evidence
from queries.figures import (
    Page,
    Section,
    answers,
    bootstrap_ci,
    coincide_note,
    coinciding,
    depth_lines,
    integer_ticks,
    n_range,
    panels,
    series_points,
    wilson_yerr,
)
from queries.gap import GapError
from queries.named import run as run_named
from queries.pages_variants import variants_section
from queries.verdicts import verdicts_table, where_lost
from store import Workspace

# --------------------------------------------------------------------------------------------
# probe series: mean and spread over seeds

_SERIES_SQL = """
WITH per_seed AS (  -- folds (when a split has them) first within a seed, then mean and spread over seeds
    SELECT run, tap, layer, site, tokens, target, kind, metric, series, test_fraction, seed,
           avg(score) AS score, avg(control_score) AS control_score, sum(n_test) AS n_test,
           any_value(kind_params::VARCHAR) AS kind_params
    FROM probes GROUP BY run, tap, layer, site, tokens, target, kind, metric, series, test_fraction, seed
)
SELECT p.run, p.tap, p.layer, p.site, p.tokens, p.target, p.kind, p.metric, p.series, p.test_fraction,
       any_value(a.depth) AS depth, any_value(a.stage) AS stage,
       avg(p.score) AS score, stddev_samp(p.score) AS score_sd, avg(p.control_score) AS control_score,
       count(*) AS n_seeds, min(p.n_test) AS n_test_min, max(p.n_test) AS n_test_max,
       any_value(p.kind_params) AS kind_params
FROM per_seed p
LEFT JOIN activations a ON a.run = p.run AND a.tap = p.tap AND a.layer = p.layer AND a.site = p.site
                       AND a.tokens = p.tokens
WHERE {where}
GROUP BY p.run, p.tap, p.layer, p.site, p.tokens, p.target, p.kind, p.metric, p.series, p.test_fraction
ORDER BY p.run, p.target, depth, p.tap, p.layer
"""


def probe_series(ws: Workspace, where: str = "true") -> pa.Table:
    """Per probe position along depth (``where``: SQL over the probes' columns, prefixed ``p.``):
    the score and control averaged over seeds, the score's sd over seeds (NULL with one seed),
    n_seeds and the test samples per seed, and ``probe``, the label a legend shows."""
    table = ws.query(_SERIES_SQL.format(where=f"({where}) AND a.depth IS NOT NULL"))
    labels = series_labels(table.to_pylist())
    return table.append_column("probe", pa.array([labels[r["series"]] for r in table.to_pylist()], pa.string()))


def series_labels(rows: list[dict[str, Any]]) -> dict[Any, str]:
    """A label per probe series that a reader can tell apart, never the series hash: target, kind,
    tokens; series that share those are told apart by their test fraction or kind parameters,
    else numbered."""
    base: dict[Any, str] = {}
    detail: dict[Any, tuple[Any, Any]] = {}
    for r in rows:
        base[r["series"]] = f"{r['target']} ({r['kind']}, {r['tokens']} tokens)"
        detail[r["series"]] = (r.get("test_fraction"), r.get("kind_params"))
    labels = {}
    for label in set(base.values()):
        same = sorted((s for s in base if base[s] == label), key=str)
        for i, s in enumerate(same):
            if len(same) == 1:
                labels[s] = label
            elif len({detail[x][0] for x in same}) == len(same):
                labels[s] = f"{label}, test {detail[s][0]}"
            elif len({detail[x][1] for x in same}) == len(same):
                labels[s] = f"{label}, {detail[s][1]}"
            else:
                labels[s] = f"{label} #{i + 1}"
    return labels


def seeds_caption(rows: list[dict[str, Any]], unit: str) -> str:
    """'mean over n_seeds = 3 seeds (band: ± 1 sd over seeds), n = 33 test images per seed'."""
    seeds = n_range((r["n_seeds"] for r in rows), "", name="n_seeds")
    counts = [n for r in rows for n in (r["n_test_min"], r["n_test_max"]) if n]  # 0: not recorded
    tests = n_range(counts, f"test {unit} per seed") if counts else f"the probes' test {unit} are not recorded"
    band = " (band: ± 1 sd over seeds)" if any((r["n_seeds"] or 0) > 1 for r in rows) else \
        " (one seed: no spread to draw)"
    return f"Mean over {seeds}{band}; {tests}."


def hidden_lines(rows: list[dict[str, Any]], panel: list[Any]) -> str:
    """The caption's note of probe lines that lie on each other within a panel (``panel``: each
    row's panel key); depth_lines draws them a little apart."""
    pairs = []
    for key in sorted(set(panel), key=str):
        mine = [r for r, k in zip(rows, panel, strict=True) if k == key]
        pairs += coinciding(series_points(mine, "probe", "score"))
    return coincide_note(pairs) + (" They are drawn 0.08 depth apart." if pairs else "")


# --------------------------------------------------------------------------------------------
# all probes along the model

def probes_section(ws: Workspace, out: Path) -> Section | None:
    """Every probe series along depth: one panel per (run, metric), mean over seeds with its spread,
    controls clipped and labelled."""
    probes = probe_series(ws)
    if not probes.num_rows:
        return None
    rows = probes.to_pylist()
    keys = sorted({(r["run"], r["metric"]) for r in rows})

    def draw(ax: Any, key: tuple[str, str]) -> None:
        depth_lines(ax, [r for r in rows if (r["run"], r["metric"]) == key], "probe", "score", "control_score",
                    ylim=(0.0, 1.05), ylabel=key[1], spread="score_sd")
        ax.set_title(f"{key[0]}: {key[1]}", fontsize=8, pad=12)  # above the stage names

    table = probes.drop_columns(["series", "kind_params"])
    return Section("Probes along the model", figures=[panels(out, "probes", keys, draw, table=table, cols=2,
                                                             sharex=False, size=(6.4, 3.4), caption=(
        "Test score (solid) and shuffled-label control (dotted, same colour; clipped at 0 where it falls"
        " below: the control is each probe's chance level) per depth along the data path, one panel per run and"
        " metric, y from 0 to 1 in every panel (stage bands: vision, merger, projector, LLM). "
        + seeds_caption(rows, "samples") + hidden_lines(rows, [(r["run"], r["metric"]) for r in rows])))],
        tables=[("probe_leaderboard", run_named(ws, "probe_leaderboard"))],
        titles={"probe_leaderboard": "Best depth of every probe series (probe_leaderboard)"})


# --------------------------------------------------------------------------------------------
# modality attention share


def depth_third(index: int, layers: int) -> str:
    """Early, middle or late for the ``index``-th of ``layers`` stored layers: a third of them
    (rounded, at least one) are late, as many from the start early, the rest middle; so the last
    layer is always late, one layer is late, and two are early and late."""
    k = max(1, round(layers / 3))
    if index >= layers - k:
        return "late"
    return "early" if index < min(k, layers - k) else "middle"


def modality_attention_share(ws: Workspace, run: str, by_correct: bool = False) -> pa.Table:
    """MAS per LLM layer: the image-key share of the last prompt token's attention, mean over heads
    and samples (CountingTricks' MAS_l at the query that produces the first answer token), with a
    bootstrap 95 % interval over samples (``mas_lo``, ``mas_hi``) and ``uniform``, the share a
    query attending evenly over its keys would give the image (image keys / keys, mean over the
    same samples): the baseline MAS is read against. ``by_correct`` splits it by whether the
    model's answer was right."""
    infos = [a for a in ws.arrays(run) if a.tap == "attn" and a.tokens == "last"]
    spans = ws.rows("SELECT array_row, image_start, image_count, coalesce(correct, false) FROM v_samples"
                    " WHERE run = ? ORDER BY array_row", [run])
    out: dict[str, list[Any]] = {"layer": [], "mas": [], "correct": [], "n": [], "mas_lo": [], "mas_hi": [],
                                 "uniform": []}
    for info in sorted(infos, key=lambda a: a.layer):
        att = ws.read(run, "attn", info.layer, site=info.site, tokens="last")
        groups: dict[Any, list[tuple[float, float]]] = {}
        for row, start, count, correct in spans:
            if start is None or not count:
                continue
            keys = att[row].astype(np.float64)  # [keys, heads]
            total = keys.sum(0)
            share = float(np.mean(keys[start: start + count].sum(0) / np.where(total > 0, total, 1)))
            groups.setdefault(bool(correct) if by_correct else None, []).append((share, count / keys.shape[0]))
        for group, pairs in sorted(groups.items(), key=lambda g: str(g[0])):
            shares = [p[0] for p in pairs]
            lo, hi = bootstrap_ci(shares)
            out["layer"].append(info.layer)
            out["mas"].append(float(np.mean(shares)))
            out["correct"].append(group)
            out["n"].append(len(shares))
            out["mas_lo"].append(lo)
            out["mas_hi"].append(hi)
            out["uniform"].append(float(np.mean([p[1] for p in pairs])))
    order = sorted(set(out["layer"]))
    out["third"] = [depth_third(order.index(x), len(order)) for x in out["layer"]]
    table = pa.table({k: out[k] for k in ("layer", "mas", "correct", "n", "third", "mas_lo", "mas_hi", "uniform")})
    return table if by_correct else table.drop_columns(["correct"])


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
    usable = {a.run: a for a in answers(ws, "counting")}
    cases = run_named(ws, "counting_cases")
    if cases.num_rows:
        page.sections.append(cases_section(out, cases, usable))
    detect = probe_series(ws, "p.kind = 'detect'")
    if detect.num_rows:
        rows = detect.to_pylist()
        runs = sorted({r["run"] for r in rows})

        def draw(ax: Any, run: str) -> None:
            depth_lines(ax, [r for r in rows if r["run"] == run], "probe", "score", "control_score", ylim=(0.0, 1.05),
                        ylabel="AP@50", spread="score_sd", control_label="shuffled-box control")
            ax.set_title(run, fontsize=8, pad=12)  # above the stage names

        page.sections.append(Section("Can the objects be found along depth?", figures=[panels(
            out, "detect_ap", runs, draw, table=detect.drop_columns(["series", "kind_params"]), caption=(
                "Detection probe AP@50 on test images per depth along the data path (the study reports it high in"
                " the vision encoder and lower in the LLM; the verdicts below say whether this run shows a step),"
                " the shuffled-box control dotted in the same colour (the AP boxes reach by chance), one panel per"
                " run, y from 0 to 1. " + seeds_caption(rows, "images")
                + hidden_lines(rows, [r["run"] for r in rows])))],
            tables=_detect_verdicts(ws), titles={"detect_verdicts": "Verdicts along depth (python -m queries lost"
                                                                    " --param kind=detect), 95 % bootstrap intervals"}))
    page.sections += mas_sections(ws, out)
    variants = variants_section(ws, out, "counting-tricks")   # the MAS fine-tune
    if variants:
        page.sections.append(variants)
    return page


def cases_section(out: Path, cases: pa.Table, usable: dict[str, Any]) -> Section:
    """Accuracy per case with Wilson intervals, one panel per run whose answers are usable; the
    others named in one line each."""
    runs = sorted(set(cases.column("run").to_pylist()))
    drawn = [r for r in runs if r not in usable or usable[r].usable]
    notes = [usable[r].note("its accuracy per case") for r in runs if r not in drawn]
    sec = Section("Accuracy per case", "\n".join(notes), tables=[("counting_cases", cases)],
                  titles={"counting_cases": "Accuracy per CountingTricks case (counting_cases)"})
    if drawn:
        ns = [r["n"] for r in cases.to_pylist() if r["run"] in drawn[:4]]
        sec.figures.append(panels(
            out, "counting_cases", drawn[:4], lambda ax, r: _case_bars(ax, cases, r), csv="counting_cases.csv",
            sharex=False, caption=(
                "Share of correct counts per CountingTricks case (1A, 2A, …), one panel per run, with Wilson 95 %"
                f" intervals over scenes; {n_range(ns, 'scenes per case')}. No chance line: a count has no fixed"
                " set of options to guess from.")))
    return sec


def _case_bars(ax: Any, table: pa.Table, run: str) -> None:
    rows = [r for r in table.to_pylist() if r["run"] == run]
    acc = [r["accuracy"] or 0.0 for r in rows]
    err = wilson_yerr([(int(r["n_correct"]), int(r["n"])) for r in rows])
    ax.bar(range(len(rows)), acc, color="tab:green", alpha=0.8, yerr=err, ecolor="#333", capsize=2)
    ax.set_xticks(range(len(rows)), [r["case_id"] for r in rows], rotation=90, fontsize=6)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("accuracy")
    ax.set_title(run, fontsize=8)


def _detect_verdicts(ws: Workspace) -> list[tuple[str, pa.Table]]:
    """The detection probes' verdicts along depth (queries/verdicts.py), where they stored per-image AP."""
    try:
        found = evidence.curves(ws, {"kind": "detect"})
    except GapError:
        return []   # probes recorded without per-image scores: the figure alone
    return [("detect_verdicts", verdicts_table(where_lost(found)))]


def mas_sections(ws: Workspace, out: Path) -> list[Section]:
    """MAS per LLM layer with its bootstrap interval and the uniform-attention share, split by right
    and wrong answers where the run's answers are usable (else over all its samples)."""
    usable = {a.run: a for a in answers(ws, None)}
    runs = [r[0] for r in ws.rows("SELECT DISTINCT run FROM activations WHERE tap = 'attn' AND tokens = 'last'"
                                  " ORDER BY 1")]
    rows: list[dict[str, Any]] = []
    pooled = []
    for run in runs:
        split = run not in usable or usable[run].usable
        if not split:
            pooled.append(usable[run].note("its MAS split by right and wrong answers")
                          + " Its MAS is drawn over all its samples.")
        table = modality_attention_share(ws, run, by_correct=split)
        if not split:
            table = table.add_column(2, "correct", pa.array([None] * table.num_rows, pa.bool_()))
        rows += [{"run": run, **r} for r in table.to_pylist()]
    if not rows:
        return []
    mas = pa.Table.from_pylist(rows)
    keys = sorted({r["run"] for r in rows})[:8]
    curves: dict[str, dict[str, list[tuple[float, float]]]] = {}  # per panel: lines that could hide each other

    def group_name(correct: bool | None) -> str:
        return {True: "correct", False: "wrong", None: "all answers"}[correct]

    def draw(ax: Any, run: str) -> None:
        mine = [r for r in rows if r["run"] == run]
        styles = {True: ("tab:green", "o", "-", -0.08), False: ("tab:red", "s", "--", 0.08),
                  None: ("tab:blue", "o", "-", 0.0)}
        for correct, (colour, marker, ls, dx) in styles.items():
            pts = sorted((r["layer"], r["mas"], r["mas_lo"], r["mas_hi"], r["n"]) for r in mine if r["correct"] is correct)
            if not pts:
                continue
            curves.setdefault(run, {})[f"{run} {group_name(correct)}"] = [(p[0], p[1]) for p in pts]
            # the two groups sit 0.08 layer apart: equal MAS must not hide one line under the other
            label = f"{group_name(correct)} ({n_range([p[4] for p in pts], 'samples')})"
            ax.errorbar([p[0] + dx for p in pts], [p[1] for p in pts], yerr=[[p[1] - p[2] for p in pts],
                        [p[3] - p[1] for p in pts]], marker=marker, ls=ls, color=colour, capsize=2, ms=4,
                        mfc="none" if correct is False else colour, label=label)
        layers = sorted({r["layer"] for r in mine})
        uniform = [(layer, float(np.average([r["uniform"] for r in mine if r["layer"] == layer],
                                            weights=[r["n"] for r in mine if r["layer"] == layer]))) for layer in layers]
        curves.setdefault(run, {})[f"{run} uniform share"] = uniform
        ax.plot([u[0] for u in uniform], [u[1] for u in uniform], ls=":", color="grey", lw=1.5,
                label="uniform attention (image keys / keys)")
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("LLM layer")
        integer_ticks(ax, layers)
        ax.set_ylabel("MAS")
        ax.set_title(run, fontsize=8)
        ax.legend(fontsize=6)

    fig = panels(out, "mas", keys, draw, table=mas, cols=2, sharex=False, caption="")
    fig.caption = (
        "Image-key share of the last prompt token's attention per LLM layer (mean over heads and samples), split"
        " by whether the model's answer was right, with bootstrap 95 % intervals over samples (2,000 resamples;"
        " right and wrong drawn 0.08 layer apart), one panel per run with last-query attention, y from 0 to 1."
        " Dotted grey: the share a query attending evenly over its keys would give the image (image keys /"
        f" keys), the baseline MAS is read against; {n_range(mas.column('n').to_pylist(), 'samples per group')}"
        " (in the legend per run)." + coincide_note([pair for c in curves.values() for pair in coinciding(c)]))
    return [Section("Modality attention share: correct vs wrong answers", "\n".join(pooled), figures=[fig])]
