"""Does the answer's attention land on the objects? (docs/studies.md#counting-tricks-attention)

Per LLM layer with stored ``last``-query attention rows, for every sample whose truth names
objects with boxes (CountingTricks, spatial scenes) and whose image tokens form one grid:

- ``object_share``: the share of the image-key attention (mean over heads) that falls on object
  patches, i.e. patches overlapping any object's box. This is the study's visual fidelity
  Σ_gt / Σ_visual.
- ``iou``: the attention map binarised at the uniform level (a patch is "attended" when it gets
  more than 1/n of the image-key attention), scored against the object patches by IoU. The study
  names an "Attention-adapted IoU" without a threshold in its code; this one is documented here and
  parameter-free.

``python -m queries.attention --run RUN [--where SQL]`` prints the per-layer table.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
import pyarrow as pa

from queries.scene import object_patches, objects_in
from store import Workspace


def agreement(attention: np.ndarray, objects: np.ndarray) -> tuple[float, float]:
    """(object share, IoU) of one image-key attention map ``[n]`` and a boolean object mask ``[n]``."""
    total = float(attention.sum())
    if total <= 0 or not objects.any():
        return float("nan"), float("nan")
    attended = attention > total / attention.size
    union = np.count_nonzero(attended | objects)
    return float(attention[objects].sum() / total), float(np.count_nonzero(attended & objects) / union)


def _image_size(truth: dict[str, Any], params: dict[str, Any]) -> float | None:
    size = truth.get("image_size") or params.get("image_size")
    return float(size) if size else None


def object_masks(ws: Workspace, run: str, rows: list[int] | None = None) -> dict[int, tuple[int, int, np.ndarray]]:
    """Per array row (``rows``, default every sample of the run) whose truth names objects with
    boxes and whose image tokens form one grid: (image_start, image_count, the object patches as a
    boolean mask over the image tokens)."""
    meta = {r[0]: r[1:] for r in ws.rows(
        "SELECT array_row, image_start, image_count, grid_h, grid_w, truth, params FROM v_samples WHERE run = ?", [run])}
    masks: dict[int, tuple[int, int, np.ndarray]] = {}
    for row in (meta if rows is None else rows):
        start, count, gh, gw, truth, params = meta[row]
        truth = json.loads(truth) if isinstance(truth, str) else (truth or {})
        params = json.loads(params) if isinstance(params, str) else (params or {})
        size = _image_size(truth, params)
        objects = objects_in(truth)
        if start is None or not count or not gh or not gw or gh * gw != count or not objects or not size:
            continue
        mask = np.zeros(count, dtype=bool)
        for ob in objects:
            mask[object_patches(ob["bbox"], (size, size), (gh, gw))] = True
        masks[row] = (start, count, mask)
    return masks


def object_agreement(ws: Workspace, run: str, where: str | None = None) -> pa.Table:
    """Per layer: samples scored, mean object share, mean IoU (see the module docstring)."""
    layers = [r[0] for r in ws.rows(
        "SELECT layer FROM activations WHERE run = ? AND tap = 'attn' AND tokens = 'last' ORDER BY layer", [run])]
    sel = ws.select(run, where)
    masks = object_masks(ws, run, sel.rows.tolist())
    out: dict[str, list[Any]] = {"layer": [], "samples": [], "object_share": [], "iou": []}
    for layer in layers:
        rows = ws.read(run, "attn", layer, site="probs", tokens="last", where=where)
        shares, ious = [], []
        for row, keys in zip(sel.rows.tolist(), rows, strict=False):
            if row not in masks:
                continue
            start, count, mask = masks[row]
            a = np.asarray(keys, dtype=np.float64)[start : start + count].mean(-1)
            share, iou = agreement(a, mask)
            if not np.isnan(share):
                shares.append(share)
                ious.append(iou)
        out["layer"].append(layer)
        out["samples"].append(len(shares))
        out["object_share"].append(float(np.mean(shares)) if shares else None)
        out["iou"].append(float(np.mean(ious)) if ious else None)
    return pa.table(out)


def main(argv: list[str] | None = None) -> int:
    from queries.render import table_cli

    return table_cli("python -m queries.attention", __doc__, object_agreement, argv)


if __name__ == "__main__":
    sys.exit(main())
