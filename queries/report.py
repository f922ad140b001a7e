"""``python -m queries.report``: one static HTML page of a workspace's headline figures.

Everything comes from the store on read-only connections: the named queries for tables, the
stored attention rows for the modality attention share. Each figure is a PNG with the CSV table
behind it, so a reader can re-plot or cite the numbers.
"""

from __future__ import annotations

import argparse
import html
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: figures go to files
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.csv as pacsv  # noqa: E402

from queries import gap  # noqa: E402
from queries.named import run as run_named  # noqa: E402
from queries.render import format_cell  # noqa: E402
from store import StoreError, Workspace  # noqa: E402


@dataclass
class Section:
    title: str
    note: str = ""
    figures: list[str] = field(default_factory=list)
    tables: list[tuple[str, pa.Table]] = field(default_factory=list)


def modality_attention_share(ws: Workspace, run: str) -> pa.Table:
    """MAS per LLM layer: the image-key share of the last prompt token's attention, mean over heads
    and samples (CountingTricks' MAS_l at the query that produces the first answer token)."""
    infos = [a for a in ws.arrays(run) if a.tap == "attn" and a.tokens == "last"]
    spans = ws.rows("SELECT array_row, image_start, image_count FROM samples WHERE run = ? ORDER BY array_row", [run])
    layers, shares = [], []
    for info in sorted(infos, key=lambda a: a.layer):
        att = ws.read(run, "attn", info.layer, site=info.site, tokens="last")
        per_sample = []
        for row, start, count in spans:
            if start is None or not count:
                continue
            keys = att[row].astype(np.float64)  # [keys, heads]
            total = keys.sum(0)
            per_sample.append(float(np.mean(keys[start : start + count].sum(0) / np.where(total > 0, total, 1))))
        if per_sample:
            layers.append(info.layer)
            shares.append(float(np.mean(per_sample)))
    n = len(layers)
    third = ["early" if i < n / 3 else "middle" if i < 2 * n / 3 else "late" for i in range(n)]
    return pa.table({"layer": layers, "mas": shares, "third": third})


def _save_table(out: Path, name: str, table: pa.Table) -> str:
    # CSV has no nested types: lists and structs are written as their text.
    flat = {c: (pa.array([None if v is None else str(v) for v in table[c].to_pylist()], pa.string())
                if pa.types.is_nested(table[c].type) else table[c]) for c in table.column_names}
    pacsv.write_csv(pa.table(flat), out / f"{name}.csv")
    return f"{name}.csv"


def _figure(out: Path, name: str, draw) -> str:
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    draw(ax)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / f"{name}.png")
    plt.close(fig)
    return f"{name}.png"


def build_sections(ws: Workspace, out: Path) -> list[Section]:
    runs = ws.query("SELECT run, model, status, n_samples, arrays, bytes FROM v_runs ORDER BY run")
    sections = [Section("Runs", "What the workspace holds.", tables=[("runs", runs)])]
    sections.append(Section("Accuracy", "Per run and stimulus family; a failed parse counts as wrong.",
                            tables=[("accuracy", run_named(ws, "accuracy"))]))

    sections += where_lost_sections(ws, out)

    regimes = run_named(ws, "counting_regimes")
    if regimes.num_rows:
        sec = Section("Counting lab: regimes and attractors",
                      "ID 0–49 (seen in vision training), VE 50–99 (text only), FE 100–120 (never seen).",
                      tables=[("counting_regimes", regimes)])
        per_count = ws.query(
            "SELECT g.run, (st.truth->>'count')::INTEGER AS count, avg(g.correct::INTEGER) AS accuracy"
            " FROM generations g JOIN stimuli st USING (stimulus) WHERE st.family = 'go' GROUP BY ALL ORDER BY 1, 2")
        sec.figures.append(_figure(out, "counting_accuracy", lambda ax: _lines(
            ax, per_count, "count", "accuracy", "black stones", "visual accuracy", spans=((49.5, "training edge"),))))
        answers = ws.query(
            # a runaway answer's digits were cut at the cap, not answered: it goes to the no-number bar
            "SELECT g.run, st.truth->>'regime' AS regime, CASE WHEN g.answer_kind = 'digits'"
            " THEN TRY_CAST(g.prediction AS BIGINT) END AS prediction, count(*) AS n"
            " FROM generations g JOIN stimuli st USING (stimulus) WHERE st.family = 'go'"
            " AND st.truth->>'regime' IN ('VE', 'FE') GROUP BY ALL ORDER BY 1, 2, 3")
        sec.figures.append(_figure(out, "counting_answers", lambda ax: _answer_histogram(ax, answers)))
        sec.tables.append(("attractors", run_named(ws, "attractors")))
        gaps = run_named(ws, "counting_gaps")
        if gaps.num_rows:
            sec.tables.append(("counting_gaps", gaps))
        sections.append(sec)

    g2m = run_named(ws, "g2m_metrics")
    if g2m.num_rows:
        sections.append(Section("G2M: end-to-end transcription", "Exact Match and Cell Accuracy over grid size N.",
                                figures=[_figure(out, "g2m_cell_accuracy", lambda ax: _lines(
                                    ax, g2m, "grid_size", "cell_accuracy", "grid size N", "cell accuracy"))],
                                tables=[("g2m_metrics", g2m)]))

    sections += g2m_position_sections(ws, out)

    cases = run_named(ws, "counting_cases")
    if cases.num_rows:
        sections.append(Section("CountingTricks: accuracy per case", tables=[("counting_cases", cases)]))

    mas_rows = []
    for (run,) in ws.rows("SELECT DISTINCT run FROM activations WHERE tap = 'attn' AND tokens = 'last' ORDER BY 1"):
        t = modality_attention_share(ws, run)
        mas_rows += [{"run": run, **r} for r in t.to_pylist()]
    if mas_rows:
        mas = pa.Table.from_pylist(mas_rows)
        sections.append(Section("Modality attention share per layer",
                                "Image-key share of the last prompt token's attention, mean over heads and samples.",
                                figures=[_figure(out, "mas", lambda ax: _lines(ax, mas, "layer", "mas", "LLM layer",
                                                                                "MAS"))],
                                tables=[("mas", mas)]))

    sections += intervention_sections(ws, out)
    sections += lens_sections(ws, out)
    sections += object_attention_sections(ws, out)

    probes = ws.query("SELECT run, tap, site, tokens, target, kind, metric, series, layer, depth, stage, score,"
                      " control_score, selectivity FROM v_probe_layers ORDER BY run, target, depth, tap, layer")
    if probes.num_rows:
        metrics = sorted({r for r in probes.column("metric").to_pylist()})
        sections.append(Section(
            "Probes along the model", "Score (solid) and shuffled-label control (dotted, clipped to the panel) per"
            " depth along the data path (stage bands: vision, merger, projector, LLM), one panel per metric."
            " CSV: probe_leaderboard.csv; per depth: python -m queries --sql 'SELECT * FROM v_probe_layers'.",
            figures=[_panels(out, "probes", metrics, lambda ax, m: _probe_lines(ax, probes, m))],
            tables=[("probe_leaderboard", run_named(ws, "probe_leaderboard"))]))
    sections.append(Section("Storage", tables=[("storage", run_named(ws, "storage"))]))
    return sections


#: Read-outs of a count: targets whose per-sample predictions are numbers of stones or objects.
COUNT_TARGETS = ("truth:count", "go.count", "counting.count")


def where_lost_sections(ws: Workspace, out: Path) -> list[Section]:
    """The question first: per count read-out along depth, its error per regime, and where it is lost."""
    sections = []
    marks = ", ".join("?" for _ in COUNT_TARGETS)
    found = ws.rows(f"SELECT DISTINCT p.run, p.target FROM probes p JOIN probe_predictions pp USING (key)"
                    f" WHERE p.target IN ({marks}) AND pp.prediction IS NOT NULL ORDER BY 1, 2", list(COUNT_TARGETS))
    for run, target in found:
        params = {"run": run, "target": target, "tokens": "image", "group_by": "coalesce(truth->>'regime', 'all')"}
        table = gap.gap(ws, params)
        if not table.num_rows or all(v is None for v in table.column("depth").to_pylist()):
            continue
        lost = gap.where_lost(table)
        name = f"lost_{run}_{target}".replace(":", "_").replace(".", "_")
        sections.append(Section(
            f"Where is the count lost? {run}, {target}",
            "Mean absolute error of the count read-out on test stimuli per depth along the data path, one line per"
            " regime (ID seen in vision training, VE/FE past it); the dashed line of each regime's colour is the"
            " model's own answer error where it is on the panel. The table says at which depth each regime's error"
            f" rose most. CSV: {name}.csv, {name}_curve.csv (python -m queries gap --param run={run}"
            f" --param target={target} --param group_by=\"truth->>'regime'\").",
            figures=[_figure(out, name, lambda ax, t=table: _gap_lines(ax, t))],
            tables=[(name, lost), (f"{name}_curve", table.select(
                ["depth", "stage", "tap", "layer", "site", "group", "n", "probe_mae", "probe_r2", "mean_prediction",
                 "model_accuracy", "model_mae", "gap_mae", "selectivity"]))]))
    return sections


STAGE_COLOURS = {"vision": "#e8f0fb", "merger": "#f3e8fb", "projector": "#fbf3e0", "llm": "#e6f5e6",
                 "logits": "#f0f0f0"}


def _stage_bands(ax, rows: list[dict]) -> None:
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


def _gap_lines(ax, table: pa.Table) -> None:
    rows = [r for r in table.to_pylist() if r["depth"] is not None]
    colours = {"ID": "tab:blue", "VE": "tab:orange", "FE": "tab:red"}
    top = max((r["probe_mae"] or 0) for r in rows) * 1.15 or 1.0
    for group in sorted({r["group"] for r in rows}, key=lambda g: ("ID", "VE", "FE").index(g) if g in colours else 9):
        pts = sorted((r["depth"], r["probe_mae"], r["model_mae"]) for r in rows if r["group"] == group)
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{group} read-out",
                        color=colours.get(group))
        model = pts[-1][2]
        if model is not None and model <= top:
            ax.axhline(model, ls="--", lw=1, color=line.get_color(), label=f"{group} model answer")
    ax.set_ylim(0, top)
    ax.set_ylabel("mean absolute error (stones)")
    _stage_bands(ax, rows)
    ax.legend(fontsize=7)


def _panels(out: Path, name: str, keys: list[str], draw) -> str:
    fig, axes = plt.subplots(len(keys), 1, figsize=(6.4, 2.8 * len(keys)), dpi=100, squeeze=False, sharex=True)
    for ax, key in zip(axes[:, 0], keys, strict=True):
        draw(ax, key)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / f"{name}.png")
    plt.close(fig)
    return f"{name}.png"


def intervention_sections(ws: Workspace, out: Path) -> list[Section]:
    """Variant runs beside the plain ones: accuracy and retained ratio per run, critical heads and
    the critical-head overlap of every two head-ablation runs over the same stimuli."""
    sections = []
    variants = run_named(ws, "interventions", {})
    if any(v != "none" for v in variants.column("intervention").to_pylist()):
        sections.append(Section(
            "Interventions: variant runs",
            "Accuracy of each run beside its intervention (none = a plain run); token compression also"
            " gives the share of image tokens it kept.",
            figures=[_figure(out, "interventions", lambda ax: _variant_bars(ax, variants))],
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
            "Interventions: critical heads",
            "Share of stimuli whose teacher-forced answer flips when one head is zeroed; overlap: how often"
            " two runs over the same stimuli (e.g. the visual and the text count) need the same heads.",
            figures=[_figure(out, "critical_heads", lambda ax: _head_bars(ax, heads))],
            tables=tables))
    return sections


def g2m_position_sections(ws: Workspace, out: Path) -> list[Section]:
    """Where G2M errors fall: a per-cell error heatmap (largest N with errors) with the patch grid,
    the positional-bias scalars per N, and accuracy on patch-aligned vs misaligned grids."""
    from queries.g2m import alignment_table, bias_table, error_maps

    runs = [r[0] for r in ws.rows("SELECT DISTINCT run FROM v_samples WHERE family = 'g2m' AND generated IS NOT NULL"
                                  " ORDER BY 1")]
    if not runs:
        return []  # the gap curve needs the model's answers too
    bias = pa.concat_tables([bias_table(ws, r) for r in runs], promote_options="default")
    align = [t for t in (alignment_table(ws, r) for r in runs) if t.num_rows]
    figures: list[str] = []
    for run in runs[:4]:
        maps = {n: m for n, (m, _) in error_maps(ws, run).items() if m.sum() > 0}
        if not maps:
            continue
        n = max(maps)
        spans = ws.rows("SELECT median((params->>'image_size')::DOUBLE / grid_w) FROM v_samples WHERE run = ?"
                        " AND family = 'g2m' AND grid_w > 0", [run])
        patch = spans[0][0] if spans and spans[0][0] else None
        size = ws.rows("SELECT median((params->>'image_size')::DOUBLE) FROM v_samples WHERE run = ? AND family = 'g2m'"
                       " AND (params->>'grid_size')::INTEGER = ?", [run, n])[0][0]
        figures.append(_figure(out, f"g2m_errors_{len(figures)}",
                               lambda ax, m=maps[n], n=n, p=patch, s=size, run=run: _heatmap(ax, m, n, p, s, run)))
        probe = _probe_error_map(ws, run, n)
        if probe is not None:
            label, pm = probe
            figures.append(_figure(out, f"g2m_errors_{len(figures)}",
                                   lambda ax, m=pm, n=n, p=patch, s=size, t=label: _heatmap(ax, m, n, p, s, t)))
    tables = [("g2m_positional_bias", bias)]
    if align:
        tables.append(("g2m_patch_alignment", pa.concat_tables(align)))
    gap = run_named(ws, "g2m_gap")
    if gap.num_rows:
        tables.append(("g2m_gap", gap))
        curve = pa.table({"run": [f"{r['run']} {r['tap']}.{r['layer']}" for r in gap.to_pylist()],
                          "grid_size": gap["grid_size"], "gap": gap["gap"]})
        figures.append(_figure(out, "g2m_gap", lambda ax: _lines(ax, curve, "grid_size", "gap", "grid size N",
                                                                 "probe CA - end-to-end CA")))
    return [Section("G2M: where the errors are",
                    "Per-cell error rate at the largest grid size with errors (white lines: the model's patch grid),"
                    " and per N the positional-bias scalars (entropy 1 = errors spread evenly; spectral"
                    " non-uniformity 0 = flat; slopes > 0 = more errors toward the bottom / right).",
                    figures=figures, tables=tables)]


def _probe_error_map(ws: Workspace, run: str, n: int) -> tuple[str, np.ndarray] | None:
    """The best-scoring spatial probe's per-cell error rate at grid size ``n`` (its recorded
    metrics), averaged over seeds, with a label naming its tap and layer."""
    rows = ws.rows(
        "SELECT tap, layer, site, avg(score) AS s, list(params->'metrics'->'error_maps'->?) AS maps FROM probes"
        " WHERE run = ? AND kind = 'conv_spatial' AND (params->'metrics'->'error_maps'->?) IS NOT NULL"
        " GROUP BY ALL ORDER BY s DESC LIMIT 1", [str(n), run, str(n)])
    if not rows:
        return None
    tap, layer, site, _, maps = rows[0]
    mean = np.mean([np.asarray(json.loads(m) if isinstance(m, str) else m, dtype=np.float64) for m in maps], axis=0)
    return f"{run}: probe on {tap}.{layer} ({site})", mean


def _heatmap(ax, errors: np.ndarray, n: int, patch_px: float | None, image_px: float | None, run: str) -> None:
    im = ax.imshow(errors, cmap="magma", vmin=0, vmax=1, extent=(0, n, n, 0))
    if patch_px and image_px:
        step = patch_px / (image_px / n)  # patch edges in cell units
        for k in np.arange(step, n, step):
            ax.axhline(k, color="white", lw=0.5, alpha=0.6)
            ax.axvline(k, color="white", lw=0.5, alpha=0.6)
    ax.set_title(f"{run}: N = {n}", fontsize=9)
    ax.figure.colorbar(im, ax=ax, label="error rate")


def object_attention_sections(ws: Workspace, out: Path) -> list[Section]:
    """Attention–object agreement per layer for runs with last-query attention over scenes with objects."""
    from queries.attention import object_agreement

    runs = [r[0] for r in ws.rows(
        "SELECT DISTINCT a.run FROM activations a JOIN v_samples s USING (run) WHERE a.tap = 'attn'"
        " AND a.tokens = 'last' AND s.family IN ('counting', 'spatial') ORDER BY 1")]
    rows = []
    for run in runs:
        rows += [{"run": run, **r} for r in object_agreement(ws, run).to_pylist() if r["samples"]]
    if not rows:
        return []
    table = pa.Table.from_pylist(rows)
    return [Section("Attention on objects",
                    "Share of the last prompt token's image attention on object patches, and the IoU of the"
                    " patches attended above the uniform level with the object patches, per LLM layer.",
                    figures=[_figure(out, "object_attention", lambda ax: _lines(ax, table, "layer", "object_share",
                                                                                "LLM layer", "attention on objects"))],
                    tables=[("object_attention", table)])]


LENS_SAMPLES = 200  # the logit-lens figures read the first rows of a run, not all of it


def lens_sections(ws: Workspace, out: Path) -> list[Section]:
    """Logit lens per LLM layer for runs that stored image-token states and a vocabulary."""
    from queries.lens import layer_table

    runs = [r[0] for r in ws.rows(
        "SELECT DISTINCT a.run FROM activations a WHERE a.tap = 'llm' AND a.tokens = 'image'"
        " AND EXISTS (SELECT 1 FROM vocab v WHERE v.run = a.run) ORDER BY 1")]
    rows = []
    for run in runs:
        table = layer_table(ws, run, where=f"array_row < {LENS_SAMPLES}")
        rows += [{"run": run, **r} for r in table.to_pylist()]
    if not rows:
        return []
    lens = pa.Table.from_pylist(rows)
    return [Section(
        "Logit lens over image tokens",
        "Top-1 vocabulary token of every image token per LLM layer (no final norm except at the last layer):"
        " the share of runs a run-length compression would keep, and over object patches the share of tokens"
        f" naming the object's colour (attribute) or shape (object). First {LENS_SAMPLES} samples per run.",
        figures=[_figure(out, "logit_lens", lambda ax: _lines(ax, lens, "layer", "retained_ratio", "LLM layer",
                                                             "run-length retained ratio"))],
        tables=[("logit_lens", lens)])]


def _variant_bars(ax, table: pa.Table) -> None:
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


def _head_bars(ax, table: pa.Table) -> None:
    rows = table.to_pylist()
    runs = sorted({r["run"] for r in rows})
    heads = sorted({(r["tap"], r["layer"], r["head"]) for r in rows})
    width = 0.8 / len(runs)
    for k, run in enumerate(runs):
        share = {(r["tap"], r["layer"], r["head"]): r["critical_share"] for r in rows if r["run"] == run}
        ax.bar([i + k * width for i in range(len(heads))], [share.get(h, 0.0) for h in heads], width=width, label=run)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(heads))], [f"{t} L{layer}H{h}" for t, layer, h in heads], fontsize=7)
    ax.set_ylabel("critical share")
    ax.legend(fontsize=7)


def _lines(ax, table: pa.Table, x: str, y: str, xlabel: str, ylabel: str, spans=()) -> None:
    rows = table.to_pylist()
    for run in sorted({r["run"] for r in rows}):
        pts = [(r[x], r[y]) for r in rows if r["run"] == run and r[y] is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=run)
    for at, label in spans:
        ax.axvline(at, color="grey", ls="--", lw=1)
        ax.text(at, ax.get_ylim()[1], f" {label}", va="top", fontsize=8, color="grey")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)


ANSWER_CAP = 130  # answers above the largest count (e.g. "910") share one bar


def _answer_histogram(ax, table: pa.Table) -> None:
    rows = table.to_pylist()
    for regime, colour in (("VE", "tab:orange"), ("FE", "tab:red")):
        bins: dict[int, int] = {}
        for r in rows:
            if r["regime"] == regime:
                x = -1 if r["prediction"] is None else min(r["prediction"], ANSWER_CAP)
                bins[x] = bins.get(x, 0) + r["n"]
        if bins:
            ax.bar(list(bins), list(bins.values()), width=1.0, color=colour, alpha=0.6, label=f"{regime} answers")
    ax.axvline(49.5, color="grey", ls="--", lw=1)
    ax.set_xlim(-3, ANSWER_CAP + 3)
    ax.set_xlabel(f"answered count (-1: no number: a word, empty or runaway; {ANSWER_CAP}: anything larger)")
    ax.set_ylabel("answers")
    ax.legend(fontsize=7)


def _probe_lines(ax, table: pa.Table, metric: str) -> None:
    """One line per probe series (run, target, kind) along depth; controls clipped to the panel."""
    rows = [r for r in table.to_pylist() if r["metric"] == metric and r["depth"] is not None]
    keys = sorted({(r["run"], r["target"], r["kind"], r["tokens"], r["series"] or "") for r in rows})
    scores = [r["score"] for r in rows]
    low = min(0.0, min(scores, default=0.0))
    for key in keys[:10]:
        pts = sorted((r["depth"], r["score"], r["control_score"]) for r in rows
                     if (r["run"], r["target"], r["kind"], r["tokens"], r["series"] or "") == key)
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".",
                        label=f"{key[0]} {key[1]} ({key[2]}, {key[3]})")
        ctl = [(p[0], max(p[2], low)) for p in pts if p[2] is not None]
        if ctl:
            ax.plot([c[0] for c in ctl], [c[1] for c in ctl], ls=":", color=line.get_color())
    ax.set_ylim(low, 1.05)
    ax.set_ylabel(metric)
    _stage_bands(ax, rows)
    ax.legend(fontsize=6)


def render_html(ws: Workspace, sections: list[Section], out: Path) -> Path:
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>agnosia report</title>",
        "<style>body{font-family:sans-serif;max-width:1000px;margin:2em auto;color:#222}"
        "table{border-collapse:collapse;font-size:12px;margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 6px}"
        "img{max-width:100%;border:1px solid #eee}.note{color:#555}</style>",
        # The page checks itself: a test (or a reader) sees data-images-ok / data-errors on <body>.
        "<script>window.agnosiaErrors=[];window.onerror=function(m){window.agnosiaErrors.push(String(m));};"
        "window.addEventListener('load',function(){var imgs=[].slice.call(document.images);"
        "document.body.dataset.imagesOk=String(imgs.every(function(i){return i.complete&&i.naturalWidth>0;}));"
        "document.body.dataset.images=String(imgs.length);"
        "document.body.dataset.errors=String(window.agnosiaErrors.length);});</script>",
        "</head><body>",
        f"<h1>agnosia report</h1><p class='note'>workspace <code>{html.escape(str(ws.path))}</code></p>",
    ]
    for sec in sections:
        parts.append(f"<h2>{html.escape(sec.title)}</h2>")
        if sec.note:
            parts.append(f"<p class='note'>{html.escape(sec.note)}</p>")
        for fig in sec.figures:
            parts.append(f"<p><img src='{fig}' alt='{html.escape(fig)}'></p>")
        for name, table in sec.tables:
            csv = _save_table(out, name, table)
            parts.append(_html_table(table) + f"<p class='note'><a href='{csv}'>{csv}</a></p>")
    parts.append("</body></html>")
    index = out / "index.html"
    index.write_text("\n".join(parts))
    return index


def _html_table(table: pa.Table, max_rows: int = 60) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in table.column_names)
    body = []
    for row in table.slice(0, max_rows).to_pylist():
        cells = "".join(f"<td>{html.escape(format_cell(v))}</td>" for v in row.values())
        body.append(f"<tr>{cells}</tr>")
    more = f"<tr><td colspan='{table.num_columns}'>… {table.num_rows - max_rows} more rows in the CSV</td></tr>" \
        if table.num_rows > max_rows else ""
    return f"<table><tr>{head}</tr>{''.join(body)}{more}</table>"


def write_report(data: str | Path | None, out: str | Path) -> Path:
    ws = Workspace.open(data, readonly=True)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return render_html(ws, build_sections(ws, out), out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m queries.report", description=__doc__)
    parser.add_argument("--data", default=None, help="workspace (default: $AGNOSIA_DATA, else ./data)")
    parser.add_argument("--out", default="report", help="folder for index.html, PNGs and CSVs (default: report)")
    args = parser.parse_args(argv)
    try:
        index = write_report(args.data, args.out)
    except StoreError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"report -> {index}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
