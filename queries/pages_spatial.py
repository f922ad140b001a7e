"""The report's pages of the two spatial studies: g2m (grids written out as digits) and
images-as-text (relations between objects, the logit lens over image tokens)."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from queries import gap
from queries.figures import Figure, Page, Section, figure, lines, panels
from queries.g2m import alignment_table, bias_table, error_maps
from queries.named import run as run_named
from store import StoreError, Workspace

# --------------------------------------------------------------------------------------------
# g2m


def g2m_page(ws: Workspace, out: Path) -> Page:
    page = Page("g2m", "g2m: does the grid survive to the answer?",
                "Per grid size N, the cell accuracy a spatial probe reads from the image tokens beside the"
                " model's own cell accuracy: where they part, the grid is encoded but not written out.",
                empty="no run of this study in the workspace: run `make g2m` (python -m extract"
                      " manifests/demo-g2m.yaml,"
                      " python -m probes manifests/probes-demo-g2m.yaml)")
    runs = [r[0] for r in ws.rows("SELECT DISTINCT run FROM v_samples WHERE family = 'g2m' AND generated IS NOT NULL"
                                  " ORDER BY 1")]
    if not runs:
        return page
    curve = pa.concat_tables([g2m_curve(ws, r) for r in runs], promote_options="default")
    page.sections.append(Section("Probe vs model cell accuracy per N", figures=[panels(
        out, "g2m_gap_curve", runs[:4], lambda ax, r: _g2m_curve_lines(ax, curve, r), table=curve, caption=(
            "Cell accuracy per grid size N: the model's transcription (black) and each spatial probe on the"
            " stored image tokens (one line per tap.layer/site), one panel per run. Model: queries/g2m.py;"
            " probes: python -m queries gap --param kind=conv_spatial"
            " --param group_by=\"(params->>'grid_size')::INT\"."))],
        tables=[("g2m_metrics", run_named(ws, "g2m_metrics")), ("g2m_gap", run_named(ws, "g2m_gap"))]))
    page.sections.append(g2m_errors_section(ws, out, runs))
    return page


def g2m_curve(ws: Workspace, run: str) -> pa.Table:
    """Long table (run, grid_size, source, cell_accuracy): the model's, then each probe position's."""
    rows = [{"run": run, "grid_size": r["grid_size"], "source": "model", "cell_accuracy": r["cell_accuracy"],
             "n": r["grids"]} for r in bias_table(ws, run).to_pylist() if "grid_size" in r]
    probes = gap.gap(ws, {"run": run, "kind": "conv_spatial", "group_by": "(params->>'grid_size')::INTEGER"})
    for r in probes.to_pylist():
        rows.append({"run": run, "grid_size": int(r["group"]), "source": f"probe {r['tap']}.{r['layer']}/{r['site']}",
                     "cell_accuracy": r["probe_accuracy"], "n": r["n"]})
    return pa.Table.from_pylist(rows, schema=pa.schema([("run", pa.string()), ("grid_size", pa.int64()),
                                                        ("source", pa.string()), ("cell_accuracy", pa.float64()),
                                                        ("n", pa.int64())]))


def _g2m_curve_lines(ax: Any, table: pa.Table, run: str) -> None:
    rows = [r for r in table.to_pylist() if r["run"] == run and r["cell_accuracy"] is not None]
    for source in sorted({r["source"] for r in rows}, key=lambda s: (s != "model", s)):
        pts = sorted((r["grid_size"], r["cell_accuracy"]) for r in rows if r["source"] == source)
        style = {"color": "black", "lw": 2.5} if source == "model" else {"ls": "--"}
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=source, **style)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("grid size N")
    ax.set_ylabel("cell accuracy")
    ax.set_title(run, fontsize=8)
    ax.legend(fontsize=6)


def g2m_errors_section(ws: Workspace, out: Path, runs: list[str]) -> Section:
    """Where G2M errors fall: per-cell error maps per N with the patch grid, the best spatial probe's
    map beside the model's, the positional-bias scalars per N and patch-aligned vs misaligned grids."""
    bias = pa.concat_tables([bias_table(ws, r) for r in runs], promote_options="default")
    align = [t for t in (alignment_table(ws, r) for r in runs) if t.num_rows]
    sec = Section("G2M: where the errors are",
                  "Positional-bias scalars per N (entropy 1 = errors spread evenly; spectral non-uniformity 0 ="
                  " flat; slopes > 0 = more errors toward the bottom / right).", tables=[("g2m_positional_bias", bias)])
    if align:
        sec.tables.append(("g2m_patch_alignment", pa.concat_tables(align)))
    for run in runs[:4]:
        maps = {n: m for n, (m, _) in error_maps(ws, run).items()}
        if not maps:
            continue
        patch = ws.rows("SELECT median((params->>'image_size')::DOUBLE / grid_w) FROM v_samples WHERE run = ?"
                        " AND family = 'g2m' AND grid_w > 0", [run])[0][0]
        cells = pa.Table.from_pylist([{"run": run, "grid_size": n, "row": i, "col": j, "error_rate": float(m[i, j])}
                                      for n, m in maps.items() for i in range(n) for j in range(n)])
        sec.figures.append(panels(
            out, f"g2m_errors_{len(sec.figures)}", sorted(maps), partial(_model_heatmap, ws, run, maps, patch),
            table=cells, cols=min(3, len(maps)), sharex=False,
            size=(6.4, 3.4), caption=f"{run}: the model's error rate per cell, one panel per grid size N (white"
                                     " lines: the model's patch grid)."))
        with_errors = [n for n, m in maps.items() if m.sum() > 0]
        probe = _probe_error_map(ws, run, max(with_errors)) if with_errors else None
        if probe is not None:
            label, pm, n = probe[0], probe[1], max(with_errors)
            px = _image_px(ws, run, n)
            sec.figures.append(figure(
                out, f"g2m_errors_{len(sec.figures)}", partial(_heatmap, errors=pm, n=n, patch_px=patch, image_px=px,
                                                               run=label),
                table=pa.Table.from_pylist([{"grid_size": n, "row": i, "col": j, "error_rate": float(pm[i, j])}
                                            for i in range(n) for j in range(n)]),
                caption=f"{label}: the best spatial probe's error rate per cell at N = {n}, beside the model's."))
    return sec


def _model_heatmap(ws: Workspace, run: str, maps: dict[int, np.ndarray], patch: float | None, ax: Any, n: int) -> None:
    _heatmap(ax, maps[n], n, patch, _image_px(ws, run, n), run)


def _image_px(ws: Workspace, run: str, n: int) -> float | None:
    return ws.rows("SELECT median((params->>'image_size')::DOUBLE) FROM v_samples WHERE run = ? AND family = 'g2m'"
                   " AND (params->>'grid_size')::INTEGER = ?", [run, n])[0][0]


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


def _heatmap(ax: Any, errors: np.ndarray, n: int, patch_px: float | None, image_px: float | None, run: str) -> None:
    im = ax.imshow(errors, cmap="magma", vmin=0, vmax=1, extent=(0, n, n, 0))
    if patch_px and image_px:
        step = patch_px / (image_px / n)  # patch edges in cell units
        for k in np.arange(step, n, step):
            ax.axhline(k, color="white", lw=0.5, alpha=0.6)
            ax.axvline(k, color="white", lw=0.5, alpha=0.6)
    ax.set_title(f"{run}: N = {n}", fontsize=8)
    ax.figure.colorbar(im, ax=ax, label="error rate")


# --------------------------------------------------------------------------------------------
# images-as-text

LENS_SAMPLES = 200  # the logit-lens figures read the first rows of a run, not all of it


def images_page(ws: Workspace, out: Path) -> Page:
    page = Page("images-as-text", "images-as-text: do image tokens read as words, and is the relation kept?",
                "Spatial accuracy of two-object scenes, the logit lens over image tokens (what vocabulary token"
                " each patch reads as, per LLM layer) and how much a run-length compression of those tokens keeps.",
                empty="no run of this study in the workspace: run `make demo` (python -m extract"
                      " manifests/demo-spatial.yaml;"
                      " python -m extract manifests/demo-compression.yaml)")
    spatial = ws.query("SELECT run, truth->>'relation' AS relation, count(*) AS n, avg(correct::INTEGER) AS accuracy,"
                       " avg(1.0 / json_array_length(truth->'options')) AS chance FROM v_samples"
                       " WHERE family = 'spatial' AND generated IS NOT NULL GROUP BY ALL ORDER BY 1, 2")
    if spatial.num_rows:
        runs = sorted(set(spatial.column("run").to_pylist()))
        page.sections.append(Section("Spatial accuracy", figures=[panels(
            out, "spatial_accuracy", runs[:4], lambda ax, r: _relation_bars(ax, spatial, r), table=spatial,
            sharex=False, caption="Share of right answers per relation of the two-object scenes (the study's"
                                  " multiple choice), one panel per run; dashed: chance (1 / options).")]))
    page.sections += lens_sections(ws, out)
    page.sections += object_attention_sections(ws, out)
    return page


def _relation_bars(ax: Any, table: pa.Table, run: str) -> None:
    rows = [r for r in table.to_pylist() if r["run"] == run]
    ax.bar(range(len(rows)), [r["accuracy"] or 0.0 for r in rows], color="tab:purple", alpha=0.8)
    chance = [r["chance"] for r in rows if r["chance"]]
    if chance:
        ax.axhline(float(np.mean(chance)), color="grey", ls="--", lw=1, label="chance")
        ax.legend(fontsize=6)
    ax.set_xticks(range(len(rows)), [f"{r['relation']}\n(n={r['n']})" for r in rows], fontsize=7)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("accuracy")
    ax.set_title(run, fontsize=8)


def lens_sections(ws: Workspace, out: Path) -> list[Section]:
    """Logit lens per LLM layer for runs that stored image-token states and a vocabulary."""
    from queries.lens import layer_table

    def lens_rows(run: str) -> list[dict[str, Any]]:
        try:
            return layer_table(ws, run, where=f"array_row < {LENS_SAMPLES}").to_pylist()
        except StoreError:
            return []  # a run stored without its logit lens: nothing to read through

    runs, lens = _per_run_table(ws, "SELECT DISTINCT a.run FROM activations a WHERE a.tap = 'llm'"
                                " AND a.tokens = 'image' AND EXISTS (SELECT 1 FROM vocab v WHERE v.run = a.run)"
                                " ORDER BY 1", lens_rows)
    if lens is None:
        return []
    sec = Section("Logit lens over image tokens", tables=[("logit_lens", lens)])
    token_fig = token_map_figure(ws, out, runs)
    if token_fig is not None:
        sec.figures.append(token_fig)
    sec.figures.append(_per_layer_figure(
        out, "logit_lens", lens, "retained_ratio", "run-length retained ratio", csv="logit_lens.csv",
        caption="Share of image tokens a run-length compression of their top-1 tokens would keep, per LLM layer"
                " (no final norm except at the last layer), one line per run; the table adds, over object patches,"
                f" the share naming the object's colour or shape. First {LENS_SAMPLES} samples per run."))
    return [sec]


def _per_run_table(ws: Workspace, runs_sql: str,
                   rows_of: Callable[[str], list[dict[str, Any]]]) -> tuple[list[str], pa.Table | None]:
    """The runs ``runs_sql`` selects, and one table of ``rows_of(run)`` over them with a ``run``
    column first (None: no run gave a row)."""
    runs = [r[0] for r in ws.rows(runs_sql)]
    rows = [{"run": run, **r} for run in runs for r in rows_of(run)]
    return runs, pa.Table.from_pylist(rows) if rows else None


def _per_layer_figure(out: Path, name: str, table: pa.Table, y: str, ylabel: str, caption: str,
                      csv: str | None = None) -> Figure:
    """``y`` per LLM layer, one line per run; ``table`` beside it as name.csv unless ``csv`` names a
    section table already written."""
    return figure(out, name, lambda ax: lines(ax, table, "layer", y, "LLM layer", ylabel), caption,
                  table=None if csv else table, csv=csv)


def token_map_figure(ws: Workspace, out: Path, runs: list[str]) -> Any:
    """One sample's top-1 tokens drawn on its image's patch grid, one panel per LLM layer (a run with
    scene objects first: the spatial runs)."""
    from queries.lens import token_map

    pick = ws.rows("SELECT run, array_row, set_path, image, grid_h FROM v_samples WHERE grid_h > 0 AND run IN"
                   f" ({', '.join('?' for _ in runs)}) ORDER BY family = 'spatial' DESC, run, array_row LIMIT 1", runs)
    if not pick:
        return None
    run, row, set_path, image, _ = pick[0]
    layers = [r[0] for r in ws.rows("SELECT layer FROM activations WHERE run = ? AND tap = 'llm' AND tokens = 'image'"
                                    " ORDER BY layer", [run])]
    maps = {layer: token_map(ws, run, layer, row) for layer in layers}
    picture = _load_image(set_path, image)
    cells = pa.Table.from_pylist([{"run": run, "array_row": row, "layer": layer, "row": i, "col": j, "token": tok}
                                  for layer, m in maps.items() for i, line in enumerate(m)
                                  for j, tok in enumerate(line)])
    return panels(out, "token_map", layers, lambda ax, layer: _token_grid(ax, maps[layer], picture, layer), table=cells,
                  cols=min(2, len(layers)), sharex=False, size=(6.4, 6.0), caption=(
                      f"Logit lens token map of {run}, sample {row}: each image token's top-1 vocabulary token,"
                      " written on the patch of the image it covers, one panel per LLM layer."))


def _load_image(set_path: str | None, image: str | None) -> np.ndarray | None:
    if not set_path or not image:
        return None
    try:
        from PIL import Image

        with Image.open(Path(set_path) / image) as im:
            return np.asarray(im.convert("RGB"))
    except OSError:
        return None  # the set folder moved: the tokens are drawn on an empty grid


def _token_grid(ax: Any, tokens: list[list[str]], picture: np.ndarray | None, layer: int) -> None:
    h, w = len(tokens), len(tokens[0]) if tokens else 0
    if picture is not None:
        ax.imshow(picture, extent=(0, w, h, 0), alpha=0.55)
    for i in range(h):
        for j in range(w):
            ax.text(j + 0.5, i + 0.5, tokens[i][j][:6], ha="center", va="center", fontsize=5)
    ax.set_xlim(0, w)
    ax.set_ylim(h, 0)
    ax.set_xticks(range(w + 1), [""] * (w + 1))
    ax.set_yticks(range(h + 1), [""] * (h + 1))
    ax.set_title(f"LLM layer {layer}", fontsize=8)


def object_attention_sections(ws: Workspace, out: Path) -> list[Section]:
    """Attention–object agreement per layer for runs with last-query attention over scenes with objects."""
    from queries.attention import object_agreement

    _, table = _per_run_table(
        ws, "SELECT DISTINCT a.run FROM activations a JOIN v_samples s USING (run) WHERE a.tap = 'attn'"
            " AND a.tokens = 'last' AND s.family IN ('counting', 'spatial') ORDER BY 1",
        lambda run: [r for r in object_agreement(ws, run).to_pylist() if r["samples"]])
    if table is None:
        return []
    return [Section("Attention on objects", figures=[_per_layer_figure(
        out, "object_attention", table, "object_share", "attention on objects", caption=(
            "Share of the last prompt token's image attention on object patches per LLM layer, one line per run;"
            " the CSV adds the IoU of the patches attended above the uniform level with the object patches."))])]
