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

from queries.figures import Page, Section, depth_lines, panels
from queries.named import run as run_named
from store import Workspace

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
