"""Where an array sits along the model's data path: ``activations.depth`` and ``activations.stage``.

The image travels vision blocks 0..V-1 -> the merger's input (``pre_merger``) -> the projector's
input and output -> LLM blocks 0..L-1 -> the logits. :func:`depth_of` numbers those positions
0, 1, 2, ... for a model with V vision and L LLM blocks, so "order by depth" is one ``ORDER BY``
and runs of one model share the axis. An attention map of LLM block l sits at block l's depth.

The layer counts come from the run's config (``layer_counts``, or the logit lens's ``n_layers``)
and otherwise from the deepest stored layer of each tap: extraction manifests usually store
every vision block, and a later extraction that adds a deeper block renumbers the run's arrays.
"""

from __future__ import annotations

import json
from typing import Any

import duckdb

from store.vocab import stack_of

#: Stage names in data-path order (the report draws a band per stage).
STAGES = ("vision", "merger", "projector", "llm", "logits")


def depth_of(tap: str, layer: int, site: str, n_vision: int, n_llm: int) -> tuple[int | None, str]:
    """(depth, stage) of one array; depth None for a tap off the image's path."""
    if tap == "vision":
        return (n_vision, "merger") if site == "pre_merger" else (layer, "vision")
    if tap == "projector":
        return n_vision + (1 if site == "in" else 2), "projector"
    if stack_of(tap) == "llm":
        return n_vision + 3 + layer, "llm"
    if tap == "logits":
        return n_vision + 3 + n_llm, "logits"
    return None, tap


def layer_counts(config: dict[str, Any], arrays: list[tuple[str, int, str]]) -> tuple[int, int]:
    """(vision blocks, LLM blocks) of a run: from its config, else from its deepest stored layer."""
    given = config.get("layer_counts") or {}
    lens = (config.get("logit_lens") or {}).get("n_layers")
    deepest_v = max((layer for tap, layer, _ in arrays if stack_of(tap) == "vision"), default=-1) + 1
    deepest_l = max((layer for tap, layer, _ in arrays if stack_of(tap) == "llm"), default=-1) + 1
    n_vision = int(given.get("vision") or deepest_v)
    n_llm = int(given.get("llm") or lens or deepest_l)
    return n_vision, max(n_llm, deepest_l)


def assign_depths(con: duckdb.DuckDBPyConnection, run: str | None = None) -> int:
    """(Re)compute depth and stage of every array of ``run`` (every run when None), in the
    caller's transaction; returns the arrays updated."""
    runs = [run] if run is not None else [r[0] for r in con.execute("SELECT DISTINCT run FROM activations").fetchall()]
    updated = 0
    for r in runs:
        got = con.execute("SELECT config FROM runs WHERE run = ?", [r]).fetchone()
        config = json.loads(got[0]) if got and got[0] else {}
        arrays = [(t, int(lay), s) for t, lay, s in
                  con.execute("SELECT tap, layer, site FROM activations WHERE run = ?", [r]).fetchall()]
        n_vision, n_llm = layer_counts(config if isinstance(config, dict) else {}, arrays)
        rows = [(t, lay, s, *depth_of(t, lay, s, n_vision, n_llm)) for t, lay, s in dict.fromkeys(arrays)]
        if rows:  # one statement for the run: one UPDATE per array cost ~1 ms apiece
            con.execute(
                "UPDATE activations SET depth = v.depth, stage = v.stage FROM (VALUES "
                + ", ".join(["(?::VARCHAR, ?::INTEGER, ?::VARCHAR, ?::INTEGER, ?::VARCHAR)"] * len(rows))
                + ") v(tap, layer, site, depth, stage) WHERE activations.run = ? AND activations.tap = v.tap"
                " AND activations.layer = v.layer AND activations.site = v.site",
                [x for row in rows for x in row] + [r])
        updated += len(arrays)
    return updated
