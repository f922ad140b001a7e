"""Variant runs on the page of the study they test: accuracy of each intervention run beside the
plain run over the same boards, with Wilson intervals (RoPE scaling and token compression on
images-as-text, the MAS fine-tune on counting-tricks, head ablations on counting-bottleneck)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from queries.figures import Section, figure, n_range, wilson_yerr
from store import Workspace

#: Which study each intervention kind belongs to (docs/interventions.md).
STUDY_OF = {"rope_scaling": "images-as-text", "token_compression": "images-as-text",
            "mas_finetune": "counting-tricks", "head_ablation": "counting-bottleneck"}


_PAIRS = """
WITH runs_ AS (
    SELECT run, coalesce(intervention->>'kind', 'none') AS kind, config->'stimuli'->0->>'task' AS task,
           intervention->>'retained_ratio' AS kept
    FROM runs
)
SELECT v.run AS variant, v.kind AS intervention, p.run AS plain, count(*) AS n,
       count(*) FILTER (WHERE gv.correct) AS variant_right, count(*) FILTER (WHERE gp.correct) AS plain_right,
       avg((gv.metrics->>'retained_ratio')::DOUBLE) AS retained_ratio
FROM runs_ v
JOIN runs_ p ON p.kind = 'none' AND p.task = v.task
JOIN generations gv ON gv.run = v.run
JOIN generations gp ON gp.run = p.run AND gp.stimulus = gv.stimulus
WHERE v.kind IN (SELECT unnest($kinds))
GROUP BY ALL
ORDER BY 1, 3
"""


def variants_section(ws: Workspace, out: Path, study: str) -> Section | None:
    """Each of the study's variant runs beside every plain run of the same task on exactly the
    stimuli both answered; None when the workspace holds no variant run of the study."""
    kinds = sorted(k for k, s in STUDY_OF.items() if s == study)
    pairs = ws.query(_PAIRS, {"kinds": kinds})
    if not pairs.num_rows:
        return None
    name = f"variants_{study.replace('-', '_')}"
    rows = pairs.to_pylist()
    return Section(
        f"Variant runs: {', '.join(kinds)}",
        "Each variant run beside the plain run of the same task, on exactly the stimuli both answered (a variant"
        " with limit: covers the first boards only).",
        figures=[figure(out, name, lambda ax: _bars(ax, rows), table=pairs, size=(6.4, 3.2), caption=(
            "Accuracy of each variant run (blue) beside the plain run (grey) on the same stimuli, with 95 % Wilson"
            " intervals; token compression also gives the share of image tokens it kept."
            f" {n_range([r['n'] for r in rows], 'stimuli per pair')}. Command: python -m queries interventions."))],
        tables=[(name, pairs)], titles={name: "Variant and plain runs on the same stimuli"})


def _bars(ax: Any, rows: list[dict[str, Any]]) -> None:
    for i, r in enumerate(rows):
        for offset, right, colour in ((-0.2, r["plain_right"], "tab:grey"), (0.2, r["variant_right"], "tab:blue")):
            ax.bar(i + offset, right / r["n"], width=0.38, color=colour, alpha=0.85, capsize=3,
                   yerr=wilson_yerr([(right, r["n"])]))
        if r["retained_ratio"] is not None:
            ax.text(i + 0.2, 1.02, f"kept {r['retained_ratio']:.0%}", ha="center", va="bottom", fontsize=7)
    ax.bar([], [], color="tab:grey", label="plain run")
    ax.bar([], [], color="tab:blue", label="variant run")
    ax.set_xticks(range(len(rows)), [f"{r['variant']} ({r['intervention']})\nvs {r['plain']}, n={r['n']}"
                                     for r in rows], fontsize=6)
    ax.set_ylim(0, 1.15)
    ax.set_ylabel("accuracy")
    ax.legend(fontsize=6, loc="upper right")
