"""``python -m queries.report``: one static HTML file of a workspace, one page per study.

Each study page (counting-bottleneck, g2m, counting-tricks, images-as-text) opens with the figure
that answers its question; a study the workspace holds no run of says what to run, and a run whose
answers are not usable (queries.figures.MIN_USABLE_SHARE) is named in one line instead of drawn.
Every figure is a PNG with a caption naming its n and the CSV of the numbers drawn, so a reader can
re-plot or cite them. The report opens with its provenance: the commit of the code that wrote it,
the runs and models it shows, their samples, and when it was written. Everything comes from the
store on read-only connections; the page needs no network.
"""

from __future__ import annotations

import argparse
import html
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa

from queries.figures import Figure, Page, Section, save_table
from queries.named import run as run_named
from queries.pages import modality_attention_share, probes_section, tricks_page
from queries.pages_counting import COUNT_TARGETS, counting_page, where_lost_sections
from queries.pages_sae import sae_page
from queries.pages_spatial import g2m_page, images_page, probe_error_map
from queries.render import format_cell
from store import StoreError, Workspace
from store.errors import is_disk_full

__all__ = ["COUNT_TARGETS", "Figure", "Page", "Section", "probe_error_map", "build_sections",
           "modality_attention_share", "where_lost_sections", "write_report"]


def build_sections(ws: Workspace, out: Path) -> list[Page]:
    """The report's pages in order: the four studies, every probe along depth, the workspace."""
    pages = [counting_page(ws, out), g2m_page(ws, out), tricks_page(ws, out), images_page(ws, out)]
    probes = probes_section(ws, out)
    pages.append(Page("probes", "Probes along the model", "Every stored probe series along depth.",
                      [probes] if probes else [], empty="no probes in the workspace: run python -m probes PLAN"))
    pages.append(sae_page(ws, out))
    runs = ws.query("SELECT run, model, status, n_samples, arrays, bytes FROM v_runs ORDER BY run")
    pages.append(Page("workspace", "Workspace", "What the workspace holds, and accuracy per run and family.", [
        Section("Runs", tables=[("runs", runs)], titles={"runs": "Runs: model, status, samples and arrays stored"}),
        Section("Accuracy", "Per run and stimulus family; a failed parse counts as wrong.",
                tables=[("accuracy", run_named(ws, "accuracy"))],
                titles={"accuracy": "Accuracy, parse rate and mean score per run and family (accuracy)"}),
        Section("Storage", tables=[("storage", run_named(ws, "storage"))],
                titles={"storage": "Bytes stored per run and tap (storage)"})]))
    return pages


STYLE = (
    "body{font-family:sans-serif;max-width:1100px;margin:0 auto 2em;color:#222}"
    "nav{position:sticky;top:0;background:#fff;border-bottom:1px solid #ccc;padding:.5em 0;z-index:1}"
    "nav a{margin-right:1.2em}section.page{border-top:3px solid #446;margin-top:2em}"
    "table{border-collapse:collapse;font-size:12px;margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 6px}"
    "figure{margin:1em 0}img{max-width:100%;border:1px solid #eee}figcaption,.note{color:#555;font-size:13px}"
    ".empty,.unusable{background:#fff6e0;padding:.5em}h4{margin:1em 0 .2em;font-size:14px}"
    "header.provenance{background:#f4f6fa;padding:.5em 1em;font-size:13px}"
)
# The page checks itself: a test (or a reader) sees data-images-ok / data-errors on <body>.
SELF_CHECK = (
    "<script>window.agnosiaErrors=[];window.onerror=function(m){window.agnosiaErrors.push(String(m));};"
    "window.addEventListener('load',function(){var imgs=[].slice.call(document.images);"
    "document.body.dataset.imagesOk=String(imgs.every(function(i){return i.complete&&i.naturalWidth>0;}));"
    "document.body.dataset.images=String(imgs.length);"
    "document.body.dataset.errors=String(window.agnosiaErrors.length);});</script>"
)


def commit() -> str:
    """The git commit of the checkout this package runs from (short hash, '+ uncommitted changes'
    when its files differ from it), or 'unknown' outside a git checkout or without git."""
    repo = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0 or not head.stdout.strip():
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head.stdout.strip() + (" + uncommitted changes" if dirty.stdout.strip() else "")


def provenance(ws: Workspace) -> str:
    """What the report was written from: the code's commit, the workspace, its runs with their
    models and samples, and the date; so a reader can tell which evidence a page shows."""
    runs = ws.rows("SELECT run, model, status, n_samples, intervention FROM v_runs ORDER BY run")
    stimuli = ws.rows("SELECT count(DISTINCT stimulus) FROM v_samples")[0][0]
    written = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    rows = "".join(f"<tr><td>{html.escape(str(run))}</td><td>{html.escape(str(model))}</td>"
                   f"<td>{html.escape(str(status))}</td><td>{n or 0}</td>"
                   f"<td>{html.escape(format_cell(intervention) or 'none')}</td></tr>"
                   for run, model, status, n, intervention in runs)
    models = sorted({str(r[1]) for r in runs})
    table = ("<table><tr><th>run</th><th>model</th><th>status</th><th>samples</th><th>intervention</th></tr>"
             f"{rows}</table>") if runs else ""
    return (f"<header class='provenance'><p>Written {written} by agnosia at commit"
            f" <code>{html.escape(commit())}</code> from the workspace <code>{html.escape(str(ws.path))}</code>:"
            f" {len(runs)} run{'s' if len(runs) != 1 else ''} of {len(models)} model{'s' if len(models) != 1 else ''},"
            f" {sum(r[3] or 0 for r in runs)} samples over {stimuli} stimuli.</p>{table}</header>")


def render_html(ws: Workspace, pages: list[Page], out: Path) -> Path:
    nav = "".join(f"<a href='#{p.slug}'>{p.slug}</a>" for p in pages)
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>agnosia report</title>",
             f"<style>{STYLE}</style>", SELF_CHECK, "</head><body>", f"<nav>{nav}</nav>",
             "<h1>agnosia report</h1>", provenance(ws)]
    for page in pages:
        figures = sum(len(s.figures) for s in page.sections)
        parts.append(f"<section class='page' id='{page.slug}' data-figures='{figures}'>"
                     f"<h2>{html.escape(page.title)}</h2><p class='note'>{html.escape(page.question)}</p>")
        if not page.sections:
            parts.append(f"<p class='empty'>{html.escape(page.empty)}</p>")
        parts += [_render_section(sec, out) for sec in page.sections]
        parts.append("</section>")
    parts.append("</body></html>")
    index = out / "index.html"
    index.write_text("\n".join(parts))
    return index


def _render_section(sec: Section, out: Path) -> str:
    parts = [f"<h3>{html.escape(sec.title)}</h3>"]
    if sec.note:  # one line per note: a run whose answers are not drawn gets its own
        parts.append("<p class='note'>" + "<br>".join(html.escape(line) for line in sec.note.splitlines()) + "</p>")
    # tables first: a figure may count its rows from a section table's CSV
    tables = [(sec.title_of(name), table, save_table(out, name, table)) for name, table in sec.tables]
    for fig in sec.figures:
        rows = _csv_rows(out / fig.csv) if fig.csv else 0
        link = f" CSV: <a href='{fig.csv}'>{fig.csv}</a>" if fig.csv else ""
        parts.append(f"<figure data-rows='{rows}'><img src='{fig.png}' alt='{html.escape(fig.caption)}'>"
                     f"<figcaption>{html.escape(fig.caption)}{link}</figcaption></figure>")
    parts += [f"<h4>{html.escape(title)}</h4>{_html_table(table)}<p class='note'>CSV: <a href='{csv}'>{csv}</a></p>"
              for title, table, csv in tables]
    return "\n".join(parts)


def _csv_rows(path: Path) -> int:
    """Data rows behind a figure (the CSV may be a section table written after the figure)."""
    return max(0, len(path.read_text().splitlines()) - 1) if path.exists() else 0


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
    except OSError as err:  # the report's own files: a full disk, a read-only or missing --out
        where = err.filename or args.out
        if is_disk_full(err):
            print(f"error: the report: disk full / file too large while writing {where} ({err.strerror}): free space"
                  " on that file system or choose another --out, then run it again (the workspace is unchanged)",
                  file=sys.stderr)
        else:
            print(f"error: the report cannot write {where} ({err.strerror or err}): choose a --out folder you can"
                  " write to (the workspace is unchanged)", file=sys.stderr)
        return 2
    print(f"report -> {index}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
