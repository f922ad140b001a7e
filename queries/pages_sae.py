"""The report's SAE page: per truth variable, the best SAE feature's score along depth beside the
best linear probe for it (the ``sae_features`` named query drawn)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from queries.figures import Page, Section, depth_lines, panels
from queries.named import run as run_named
from store import Workspace

QUESTION = ("Which stored features track each truth variable without being told it, and where along depth do"
            " they stop existing? Every SAE feature scored against the exact truth, beside the best probe.")


def sae_page(ws: Workspace, out: Path) -> Page:
    """One panel per (run, target, class, metric): the best feature (solid) with its shuffled-truth
    control (dotted) along depth, and the best probe of that target at the same arrays."""
    table = run_named(ws, "sae_features")
    empty = "no SAEs in the workspace: run python -m probes sae PLAN (docs/probes.md, SAE features)"
    if not table.num_rows:
        return Page("sae", "SAE features", QUESTION, [], empty=empty)
    rows = table.to_pylist()
    lines: list[dict[str, Any]] = []
    for r in rows:
        base = {k: r[k] for k in ("run", "tap", "layer", "site", "depth", "stage", "target", "class", "metric")}
        lines.append({**base, "series": f"best SAE feature ({r['architecture']})", "score": r["score"],
                      "control": r["control"]})
        if r["probe_score"] is not None:
            lines.append({**base, "series": f"best probe ({r['probe_kind']}, {r['probe_metric']})",
                          "score": r["probe_score"], "control": r["probe_control"]})
    keys = sorted({(r["run"], r["target"], r["class"], r["metric"]) for r in rows})

    def draw(ax: Any, key: tuple[str, str, str, str]) -> None:
        depth_lines(ax, [r for r in lines if (r["run"], r["target"], r["class"], r["metric"]) == key], "series",
                    "score", "control", ylabel=key[3], control_label="shuffled control")
        name = key[1] + (f" = {key[2]}" if key[2] else "")
        ax.set_title(f"{key[0]}: {name}", fontsize=8, pad=12)

    n = sorted({r["n"] for r in rows if r["n"] is not None})
    fig = panels(out, "sae_features", keys, draw, table=table, cols=2, sharex=False, size=(6.4, 3.4), caption=(
        "Per truth variable, the best SAE feature's score along depth (solid: AUROC for a class, Spearman's rho"
        " for an ordinal variable, IoU with the token mask for a per-token variable) and the same feature against"
        " the truth shuffled across samples (dotted, same colour), beside the best probe of that variable at the"
        f" same arrays where one was trained. Held-out samples per SAE: n = {n[0]}"
        + (f" to {n[-1]}" if len(n) > 1 else "") + " (tokens for IoU); intervals, q-values (Benjamini-Hochberg)"
        " and the number of features that track each variable are in the table."))
    return Page("sae", "SAE features", QUESTION, [Section(
        "Features that track each truth variable, per depth", figures=[fig],
        tables=[("sae_features", table)], titles={"sae_features": "Best feature per truth variable and SAE (sae_features)"})])
