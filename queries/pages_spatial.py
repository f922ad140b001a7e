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
import pyarrow.compute  # noqa: F401  (pa.compute)
from matplotlib.ticker import MaxNLocator

from queries.figures import (
    Answers,
    Figure,
    Page,
    Section,
    answers,
    bootstrap_ci,
    chance_line,
    coincide_note,
    coinciding,
    figure,
    integer_ticks,
    lines,
    n_range,
    panels,
    wilson_yerr,
)
from queries.g2m import alignment_table, bias_table, cell_errors, error_maps
from queries.named import run as run_named
from queries.pages_variants import variants_section
from store import StoreError, Workspace

# --------------------------------------------------------------------------------------------
# g2m

GRID_SIZE = "(params->>'grid_size')::INTEGER"


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
    per_n = answers(ws, "g2m", GRID_SIZE)
    # a run's curve is a result as long as some N parse: the N that do not are drawn as 0 and named
    model_runs = [r for r in runs if any(a.usable for a in per_n if a.run == r)]
    notes = [a.note("its cell accuracy") + " The probes' curves are." for a in answers(ws, "g2m")
             if a.run not in model_runs]
    curve = pa.concat_tables([g2m_curve(ws, r, model=r in model_runs) for r in runs], promote_options="default")
    drawn = runs[:4]
    sec = Section("Probe vs model cell accuracy per N", "\n".join(notes), tables=[
        ("g2m_metrics", run_named(ws, "g2m_metrics")), ("g2m_gap", run_named(ws, "g2m_gap"))], titles={
        "g2m_metrics": "Model: exact match and cell accuracy per N and C (g2m_metrics)",
        "g2m_gap": "Probe vs model cell accuracy per N, pooled over seeds (g2m_gap)"})
    if curve.num_rows:
        colours = _colours(ws, drawn)
        sec.figures.append(panels(
            out, "g2m_gap_curve", drawn, partial(_g2m_curve_lines, curve, colours), table=curve,
            caption=_g2m_caption(curve.to_pylist(), per_n, [r for r in model_runs if r in drawn],
                                 any(colours.values()))))
    page.sections.append(sec)
    page.sections.append(g2m_errors_section(ws, out, runs))
    return page


def _g2m_caption(rows: list[dict[str, Any]], per_n: list[Answers], model_runs: list[str], chance: bool) -> str:
    model = [r for r in rows if r["source"] == "model"]
    probes = [r for r in rows if r["source"] != "model"]
    unparsed = "; ".join(
        f"{run}: N = " + ", ".join(f"{a.group} ({a.unparsed} of {a.n})" for a in per_n if a.run == run and a.unparsed)
        for run in model_runs if any(a.unparsed for a in per_n if a.run == run))
    text = ("Cell accuracy per grid size N, one panel per run, y from 0 to 1: the model's transcription (black, with a"
            " bootstrap 95 % interval over grids, 2,000 resamples) and each spatial probe on the stored image tokens"
            " (dashed, one line per tap.layer/site, mean over seeds with ± 1 sd over seeds where there are several); "
            + ("dotted grey: chance 1/C, a guess among the grid's C colours. " if chance else
               "no chance line: the grids' number of colours C is not recorded. "))
    if model:
        text += f"Model: {n_range((r['n'] for r in model), 'grids per N')}"
        text += f"; answers that did not parse count as 0 ({unparsed}). " if unparsed else "; every answer parsed. "
    if probes:
        text += (f"Probes: {n_range((r['n'] for r in probes), 'test grids per N and seed')},"
                 f" {n_range((r['n_seeds'] for r in probes), '', name='n_seeds')}. ")
    return text + ("Model: queries/g2m.py; probes: python -m queries gap --param kind=conv_spatial"
                   " --param group_by=\"(params->>'grid_size')::INT\"." + coincide_note([
                       pair for run in sorted({r["run"] for r in rows}) for pair in coinciding({
                           f"{run} {r['source']}": [(x["grid_size"], x["cell_accuracy"]) for x in rows
                                                    if (x["run"], x["source"]) == (run, r["source"])]
                           for r in rows if r["run"] == run})]))


def _colours(ws: Workspace, runs: list[str]) -> dict[str, list[int]]:
    """The numbers of colours C of each run's grids (chance 1/C per cell)."""
    return {run: [r[0] for r in ws.rows("SELECT DISTINCT (params->>'num_colors')::INTEGER FROM v_samples"
                                        " WHERE run = ? AND family = 'g2m' AND params->>'num_colors' IS NOT NULL"
                                        " ORDER BY 1", [run])] for run in runs}


CURVE_SCHEMA = pa.schema([("run", pa.string()), ("grid_size", pa.int64()), ("source", pa.string()),
                          ("cell_accuracy", pa.float64()), ("n", pa.int64()), ("lo", pa.float64()),
                          ("hi", pa.float64()), ("interval", pa.string()), ("n_seeds", pa.int64()),
                          ("unparsed", pa.int64())])


def g2m_curve(ws: Workspace, run: str, model: bool = True) -> pa.Table:
    """Long table (run, grid_size, source, cell_accuracy, n, lo, hi, ...): the model's per N (a
    bootstrap interval over grids; an answer that did not parse scores 0 on every cell), then each
    probe position's (mean over seeds, ± 1 sd over seeds). ``model`` False leaves the model out."""
    rows: list[dict[str, Any]] = []
    if model:
        grids: dict[int, list[float]] = {}
        unparsed: dict[int, int] = {}
        for n, truth, pred, ok in ws.rows(f"SELECT {GRID_SIZE}, truth->>'matrix', prediction, parse_ok FROM v_samples"
                                          " WHERE run = ? AND family = 'g2m' AND generated IS NOT NULL", [run]):
            grids.setdefault(n, []).append(1.0 - float(cell_errors(truth, pred).mean()))
            unparsed[n] = unparsed.get(n, 0) + (not ok)
        for n in sorted(grids):
            lo, hi = bootstrap_ci(grids[n])
            rows.append({"run": run, "grid_size": n, "source": "model", "cell_accuracy": float(np.mean(grids[n])),
                         "n": len(grids[n]), "lo": lo, "hi": hi, "interval": "bootstrap 95 % over grids",
                         "n_seeds": None, "unparsed": unparsed[n]})
    seeds: dict[tuple[str, int], list[tuple[float, int]]] = {}
    for tap, layer, site, _, n, acc, count in ws.rows(
            f"SELECT p.tap, p.layer, p.site, p.seed, {GRID_SIZE.replace('params', 's.params')}, avg(pp.score),"
            " count(DISTINCT pp.array_row) FROM probes p JOIN probe_predictions pp USING (key)"
            " JOIN v_samples s ON s.run = p.run AND s.array_row = pp.array_row"
            " WHERE p.run = ? AND p.kind = 'conv_spatial' AND pp.score IS NOT NULL GROUP BY ALL ORDER BY ALL", [run]):
        seeds.setdefault((f"probe {tap}.{layer}/{site}", n), []).append((float(acc), int(count)))
    for (source, n), per_seed in sorted(seeds.items()):
        accs = [a for a, _ in per_seed]
        mean, sd = float(np.mean(accs)), (float(np.std(accs, ddof=1)) if len(accs) > 1 else None)
        rows.append({"run": run, "grid_size": n, "source": source, "cell_accuracy": mean,
                     "n": max(c for _, c in per_seed), "lo": None if sd is None else mean - sd,
                     "hi": None if sd is None else mean + sd, "interval": "± 1 sd over seeds",
                     "n_seeds": len(accs), "unparsed": None})
    return pa.Table.from_pylist(rows, schema=CURVE_SCHEMA)


def _g2m_curve_lines(table: pa.Table, colours: dict[str, list[int]], ax: Any, run: str) -> None:
    rows = [r for r in table.to_pylist() if r["run"] == run and r["cell_accuracy"] is not None]
    for source in sorted({r["source"] for r in rows}, key=lambda s: (s != "model", s)):
        pts = sorted((r["grid_size"], r["cell_accuracy"], r["lo"], r["hi"]) for r in rows if r["source"] == source)
        style = {"color": "black", "lw": 2.5, "zorder": 3} if source == "model" else {"ls": "--", "mfc": "none"}
        err = None
        if any(p[2] is not None for p in pts):
            err = [[p[1] - (p[2] if p[2] is not None else p[1]) for p in pts],
                   [(p[3] if p[3] is not None else p[1]) - p[1] for p in pts]]
        ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=err, marker="o", capsize=3, label=source, **style)
    for c in colours.get(run, []):
        chance_line(ax, 1 / c, f"chance 1/C = 1/{c}")
    ax.set_ylim(0, 1.05)
    ax.set_xticks(sorted({r["grid_size"] for r in rows}))
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
                  " flat; slopes > 0 = more errors toward the bottom / right).", tables=[("g2m_positional_bias", bias)],
                  titles={"g2m_positional_bias": "Positional bias of the model's errors per N (g2m_positional_bias)",
                          "g2m_patch_alignment": "Cell accuracy of grids aligned and misaligned with the patch grid"
                                                 " (g2m_patch_alignment)"})
    if align:
        sec.tables.append(("g2m_patch_alignment", pa.concat_tables(align)))
    for run in runs[:4]:
        found = error_maps(ws, run)
        maps = {n: m for n, (m, _) in found.items()}
        if not maps:
            continue
        patch = ws.rows("SELECT median((params->>'image_size')::DOUBLE / grid_w) FROM v_samples WHERE run = ?"
                        " AND family = 'g2m' AND grid_w > 0", [run])[0][0]
        cells = pa.Table.from_pylist([{"run": run, "grid_size": n, "row": i, "col": j, "error_rate": float(m[i, j]),
                                       "grids": found[n][1]}
                                      for n, m in maps.items() for i in range(n) for j in range(n)])
        sec.figures.append(panels(
            out, f"g2m_errors_{len(sec.figures)}", sorted(maps), partial(_model_heatmap, ws, run, maps, patch),
            table=cells, cols=min(3, len(maps)), sharex=False,
            size=(6.4, 3.4), caption=f"{run}: the model's error rate per cell (colour scale 0 to 1 in every panel;"
                                     " an answer that did not parse counts every cell wrong), one panel per grid size"
                                     " N (white lines: the model's patch grid);"
                                     f" {n_range((c for _, c in found.values()), 'grids per N')}."))
        with_errors = [n for n, m in maps.items() if m.sum() > 0]
        probe = probe_error_map(ws, run, max(with_errors)) if with_errors else None
        if probe is not None:
            label, pm, n = probe[0], probe[1], max(with_errors)
            px = _image_px(ws, run, n)
            sec.figures.append(figure(
                out, f"g2m_errors_{len(sec.figures)}", partial(_heatmap, errors=pm, n=n, patch_px=patch, image_px=px,
                                                               run=label),
                table=pa.Table.from_pylist([{"grid_size": n, "row": i, "col": j, "error_rate": float(pm[i, j])}
                                            for i in range(n) for j in range(n)]),
                caption=f"{label}: the best spatial probe's error rate per cell at N = {n} (colour scale 0 to 1),"
                        f" mean over seeds, beside the model's; {_probe_map_n(ws, run, n)}."))
    return sec


def _probe_map_n(ws: Workspace, run: str, n: int) -> str:
    """The sample size behind the best probe's error map at size ``n``: its seeds and test grids."""
    best = _best_spatial_probe(ws, run, n)
    if best is None:
        return "n unknown"
    tap, layer, site, _ = best
    seeds, grids = ws.rows(
        f"SELECT count(DISTINCT p.seed), count(DISTINCT pp.array_row) FILTER (WHERE {GRID_SIZE.replace('params', 's.params')}"
        " = ?) FROM probes p LEFT JOIN probe_predictions pp USING (key)"
        " LEFT JOIN v_samples s ON s.run = p.run AND s.array_row = pp.array_row"
        " WHERE p.run = ? AND p.kind = 'conv_spatial' AND p.tap = ? AND p.layer = ? AND p.site = ?",
        [n, run, tap, layer, site])[0]
    seeds_text = n_range([seeds], "", name="n_seeds")
    if not grids:
        return f"{seeds_text}; the probe's test grids at N = {n} are not stored, so their n is unknown"
    return f"n = {grids} test grids, {seeds_text}"


def _model_heatmap(ws: Workspace, run: str, maps: dict[int, np.ndarray], patch: float | None, ax: Any, n: int) -> None:
    _heatmap(ax, maps[n], n, patch, _image_px(ws, run, n), run)


def _image_px(ws: Workspace, run: str, n: int) -> float | None:
    return ws.rows("SELECT median((params->>'image_size')::DOUBLE) FROM v_samples WHERE run = ? AND family = 'g2m'"
                   " AND (params->>'grid_size')::INTEGER = ?", [run, n])[0][0]


def _best_spatial_probe(ws: Workspace, run: str, n: int) -> tuple[str, int, str, list[Any]] | None:
    """(tap, layer, site, its seeds' error maps at ``n``) of the best-scoring spatial probe that
    recorded an error map at grid size ``n``."""
    rows = ws.rows(
        "SELECT tap, layer, site, avg(score) AS s, list(params->'metrics'->'error_maps'->?) AS maps FROM probes"
        " WHERE run = ? AND kind = 'conv_spatial' AND (params->'metrics'->'error_maps'->?) IS NOT NULL"
        " GROUP BY ALL ORDER BY s DESC LIMIT 1", [str(n), run, str(n)])
    if not rows:
        return None
    tap, layer, site, _, maps = rows[0]
    return tap, layer, site, maps


def probe_error_map(ws: Workspace, run: str, n: int) -> tuple[str, np.ndarray] | None:
    """The best-scoring spatial probe's per-cell error rate at grid size ``n`` (its recorded
    metrics), averaged over seeds, with a label naming its tap and layer."""
    best = _best_spatial_probe(ws, run, n)
    if best is None:
        return None
    tap, layer, site, maps = best
    mean = np.mean([np.asarray(json.loads(m) if isinstance(m, str) else m, dtype=np.float64) for m in maps], axis=0)
    return f"{run}: probe on {tap}.{layer} ({site})", mean


def _heatmap(ax: Any, errors: np.ndarray, n: int, patch_px: float | None, image_px: float | None, run: str) -> None:
    im = ax.imshow(errors, cmap="magma", vmin=0, vmax=1, extent=(0, n, n, 0))
    if patch_px and image_px:
        step = patch_px / (image_px / n)  # patch edges in cell units
        for k in np.arange(step, n, step):
            ax.axhline(k, color="white", lw=0.5, alpha=0.6)
            ax.axvline(k, color="white", lw=0.5, alpha=0.6)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # cell edges
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
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
                       " avg(1.0 / json_array_length(truth->'options')) AS chance,"
                       " sum(coalesce(correct, FALSE)::INTEGER) AS n_correct FROM v_samples"
                       " WHERE family = 'spatial' AND generated IS NOT NULL GROUP BY ALL ORDER BY 1, 2")
    if spatial.num_rows:
        page.sections.append(spatial_section(ws, out, spatial))
    page.sections += lens_sections(ws, out)
    page.sections += object_attention_sections(ws, out)
    variants = variants_section(ws, out, "images-as-text")   # RoPE scaling, token compression
    if variants:
        page.sections.append(variants)
    return page


def spatial_section(ws: Workspace, out: Path, spatial: pa.Table) -> Section:
    """Accuracy per relation with Wilson intervals and chance, one panel per run whose answers are
    usable; the others named in one line each."""
    usable = {a.run: a for a in answers(ws, "spatial")}
    runs = sorted(set(spatial.column("run").to_pylist()))
    drawn = [r for r in runs if r not in usable or usable[r].usable][:4]
    notes = [usable[r].note("its spatial accuracy") for r in runs if r in usable and not usable[r].usable]
    sec = Section("Spatial accuracy", "\n".join(notes))
    if drawn:
        shown = spatial.filter(pa.compute.is_in(spatial["run"], pa.array(drawn)))
        options = sorted({round(1 / r["chance"]) for r in shown.to_pylist() if r["chance"]})
        sec.figures.append(panels(
            out, "spatial_accuracy", drawn, lambda ax, r: _relation_bars(ax, shown, r), table=shown, sharex=False,
            caption="Share of right answers per relation of the two-object scenes (the study's multiple choice), one"
                    " panel per run, with Wilson 95 % intervals over scenes, y from 0 to 1; dotted grey: chance, 1 /"
                    f" options ({', '.join(f'1/{k}' for k in options) or 'options unknown'}: a guess among the"
                    f" shuffled choices); {n_range(shown.column('n').to_pylist(), 'scenes per relation')}."))
    return sec


def _relation_bars(ax: Any, table: pa.Table, run: str) -> None:
    rows = [r for r in table.to_pylist() if r["run"] == run]
    acc = [r["accuracy"] or 0.0 for r in rows]
    err = wilson_yerr([(int(r["n_correct"]), int(r["n"])) for r in rows])
    ax.bar(range(len(rows)), acc, color="tab:purple", alpha=0.8, yerr=err, ecolor="#333", capsize=3)
    chance = [r["chance"] for r in rows if r["chance"]]
    if chance:
        c = float(np.mean(chance))
        chance_line(ax, c, f"chance 1/{round(1 / c)}")
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
    drawn = sorted(set(lens.column("run").to_pylist()))
    samples = [ws.rows("SELECT count(*) FROM v_samples WHERE run = ? AND array_row < ?", [r, LENS_SAMPLES])[0][0]
               for r in drawn]
    sec = Section("Logit lens over image tokens", tables=[("logit_lens", lens)],
                  titles={"logit_lens": "Logit lens per LLM layer: retained ratio and object naming (logit_lens)"})
    token_fig = token_map_figure(ws, out, runs)
    if token_fig is not None:
        sec.figures.append(token_fig)
    sec.figures.append(_per_layer_figure(
        out, "logit_lens", lens, "retained_ratio", "run-length retained ratio", csv="logit_lens.csv",
        baseline=(1.0, "1: no two neighbours read alike"), caption=(
            "Share of image tokens a run-length compression of their top-1 tokens would keep, per LLM layer"
            " (no final norm except at the last layer), one line per run; dotted grey: 1, what a map whose"
            " neighbouring patches never read as the same token keeps. The table adds, over object patches, the"
            f" share naming the object's colour or shape. First {LENS_SAMPLES} samples per run:"
            f" {n_range(samples, 'samples per run')}." + coincide_note(coinciding({
                run: [(r["layer"], r["retained_ratio"]) for r in lens.to_pylist()
                      if r["run"] == run and r["retained_ratio"] is not None] for run in drawn})))))
    return [sec]


def _per_run_table(ws: Workspace, runs_sql: str,
                   rows_of: Callable[[str], list[dict[str, Any]]]) -> tuple[list[str], pa.Table | None]:
    """The runs ``runs_sql`` selects, and one table of ``rows_of(run)`` over them with a ``run``
    column first (None: no run gave a row)."""
    runs = [r[0] for r in ws.rows(runs_sql)]
    rows = [{"run": run, **r} for run in runs for r in rows_of(run)]
    return runs, pa.Table.from_pylist(rows) if rows else None


def _per_layer_figure(out: Path, name: str, table: pa.Table, y: str, ylabel: str, caption: str,
                      csv: str | None = None, baseline: tuple[float, str] | None = None) -> Figure:
    """``y`` per LLM layer, one line per run, with an optional ``baseline`` (value, legend label);
    ``table`` beside it as name.csv unless ``csv`` names a section table already written."""
    def draw(ax: Any) -> None:
        lines(ax, table, "layer", y, "LLM layer", ylabel)
        if baseline is not None:
            chance_line(ax, *baseline)
            ax.legend(fontsize=7)
        integer_ticks(ax, table.column("layer").to_pylist())

    return figure(out, name, draw, caption, table=None if csv else table, csv=csv)


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
                  cols=1, sharex=False, size=(7.0, 4.6), caption=(
                      f"Logit lens token map of {run}, sample {row} (n = 1 sample: an example, not a summary):"
                      " each image token's top-1 vocabulary token as a letter on the patch of the image it covers"
                      " (the legend spells each letter's token and how many patches read as it), one panel per LLM"
                      " layer."))


def _load_image(set_path: str | None, image: str | None) -> np.ndarray | None:
    if not set_path or not image:
        return None
    try:
        from PIL import Image

        with Image.open(Path(set_path) / image) as im:
            return np.asarray(im.convert("RGB"))
    except OSError:
        return None  # the set folder moved: the tokens are drawn on an empty grid


#: Distinct tokens a token map names in its legend; the rest share one code.
MAP_TOKENS = 12


def _token_grid(ax: Any, tokens: list[list[str]], picture: np.ndarray | None, layer: int) -> None:
    """Each patch's top-1 token as a short code on the image, the codes spelled out in a legend:
    tokens such as <|assistant_end|> cut to fit a cell read alike and say nothing."""
    h, w = len(tokens), len(tokens[0]) if tokens else 0
    if picture is not None:
        ax.imshow(picture, extent=(0, w, h, 0), alpha=0.55)
    counts: dict[str, int] = {}
    for line in tokens:
        for tok in line:
            counts[tok] = counts.get(tok, 0) + 1
    ranked = sorted(counts, key=lambda t: (-counts[t], t))
    codes = {tok: chr(ord("A") + k) for k, tok in enumerate(ranked[:MAP_TOKENS])}
    for i in range(h):
        for j in range(w):
            ax.text(j + 0.5, i + 0.5, codes.get(tokens[i][j], "·"), ha="center", va="center", fontsize=7,
                    fontweight="bold", color="black")
    for tok in ranked[:MAP_TOKENS]:
        ax.plot([], [], " ", label=f"{codes[tok]}  {tok!r} ({counts[tok]})")
    if len(ranked) > MAP_TOKENS:
        ax.plot([], [], " ", label=f"·  {len(ranked) - MAP_TOKENS} other tokens")
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), handlelength=0, frameon=False)
    ax.set_xlim(0, w)
    ax.set_ylim(h, 0)
    ax.set_xticks(range(w + 1), [""] * (w + 1))
    ax.set_yticks(range(h + 1), [""] * (h + 1))
    ax.grid(color="white", lw=0.5)
    ax.set_title(f"LLM layer {layer}", fontsize=8)


def object_attention_sections(ws: Workspace, out: Path) -> list[Section]:
    """Attention–object agreement per layer for runs with last-query attention over scenes with
    objects, beside the object-area share: what attention spread evenly over the image would give."""
    from queries.attention import object_agreement

    def rows_of(run: str) -> list[dict[str, Any]]:
        area = object_area_share(ws, run)
        return [{**r, "object_area": area} for r in object_agreement(ws, run).to_pylist() if r["samples"]]

    _, table = _per_run_table(
        ws, "SELECT DISTINCT a.run FROM activations a JOIN v_samples s USING (run) WHERE a.tap = 'attn'"
            " AND a.tokens = 'last' AND s.family IN ('counting', 'spatial') ORDER BY 1", rows_of)
    if table is None:
        return []
    samples = table.column("samples").to_pylist()
    return [Section("Attention on objects", figures=[figure(
        out, "object_attention", partial(_object_lines, table), table=table, caption=(
            "Share of the last prompt token's image attention on object patches per LLM layer, one line per run, y"
            " from 0 to 1; dotted, same colour: the object-area share (object patches / image patches, mean over"
            " the same samples), what attention spread evenly over the image would put on the objects. The CSV adds"
            " the IoU of the patches attended above the uniform level with the object patches;"
            f" {n_range(samples, 'samples per layer')}." + coincide_note(coinciding({
                f"{run} {col}": [(r["layer"], r[col]) for r in table.to_pylist() if r["run"] == run
                                 and r[col] is not None]
                for run in set(table.column("run").to_pylist()) for col in ("object_share", "object_area")}))))])]


def _object_lines(table: pa.Table, ax: Any) -> None:
    rows = table.to_pylist()
    for run in sorted({r["run"] for r in rows}):
        pts = sorted((r["layer"], r["object_share"], r["object_area"]) for r in rows
                     if r["run"] == run and r["object_share"] is not None)
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=run)
        if pts and pts[0][2] is not None:
            ax.plot([p[0] for p in pts], [p[2] for p in pts], ls=":", lw=1.5, color=line.get_color(),
                    label=f"{run}: object-area share")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("LLM layer")
    ax.set_ylabel("attention on objects")
    integer_ticks(ax, [r["layer"] for r in rows])
    ax.legend(fontsize=7)


def object_area_share(ws: Workspace, run: str) -> float | None:
    """Mean share of a sample's image patches that cover an object, over the samples whose objects
    and patch grid are known (the samples queries.attention.object_agreement scores)."""
    from queries.attention import object_masks

    shares = [float(mask.mean()) for _, _, mask in object_masks(ws, run).values()]
    return float(np.mean(shares)) if shares else None
