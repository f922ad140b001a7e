"""The logit lens over stored hidden states (docs/studies.md#images-as-text-logit-lens), with no model.

Every image token's hidden state at an LLM layer is read through the run's stored unembedding
(``lm_head.weight``) as its top-1 vocabulary token. The study reads intermediate layers with no
final norm, and we follow it. The last layer's stored state is the decoder's output before the
final norm, so there the stored final norm (its kind, eps and offset from
``runs.config.logit_lens``) is applied first. That is what the model's own logits see. The
vocabulary comes from the ``vocab`` table. A *token map* is a sample's top-1 tokens on its patch
grid (raster order).

Three measures per layer:

- ``retained_ratio``: runs of equal consecutive tokens in raster order / tokens. It is the share
  that images-as-text's run-length compression would keep, before dropping punctuation.
- ``attribute_share`` / ``object_share``: over the tokens of the patches that overlap a scene
  object's box, the share that name its colour (an attribute) or its shape (the object's class).
  A token matches a word when ``" " + token`` is a substring of ``" " + word`` (the study's rule),
  after stripping and lower-casing. This needs scene objects (the spatial family's truth).

``python -m queries.lens --run RUN [--where SQL] [--format table|csv|json]`` prints the per-layer
table.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from queries.scene import object_patches, objects_in
from store import StoreError, Workspace


@dataclass(frozen=True)
class Lens:
    """A run's unembedding, final norm and vocabulary, read from the store."""

    unembed: np.ndarray  # [vocab, hidden] float32
    bias: np.ndarray | None
    norm_kind: str  # "rms" | "layer"
    norm_weight: np.ndarray
    norm_bias: np.ndarray | None
    eps: float
    weight_offset: float
    vocab: list[str]
    last_layer: int

    @classmethod
    def load(cls, ws: Workspace, run: str) -> Lens:
        rows = ws.rows("SELECT config->'logit_lens' FROM runs WHERE run = ?", [run])
        if not rows:
            raise StoreError(f"no run {run!r} in {ws.path}; `python -m store info` lists the runs")
        if rows[0][0] is None:
            raise StoreError(f"run {run} stored no logit lens (manifest logit_lens: false): re-extract with it on")
        cfg = json.loads(rows[0][0])
        names = {r[0] for r in ws.rows("SELECT name FROM tensors WHERE run = ?", [run])}
        vocab = ws.vocab(run)
        if not vocab:
            raise StoreError(f"run {run} has no vocabulary in the store (extracted before it was stored): re-extract it")
        return cls(
            unembed=ws.read_tensor(run, "lm_head.weight").astype(np.float32),
            bias=ws.read_tensor(run, "lm_head.bias").astype(np.float32) if "lm_head.bias" in names else None,
            norm_kind=str(cfg["norm"]),
            norm_weight=ws.read_tensor(run, "final_norm.weight").astype(np.float32),
            norm_bias=ws.read_tensor(run, "final_norm.bias").astype(np.float32) if "final_norm.bias" in names else None,
            eps=float(cfg["eps"]),
            weight_offset=float(cfg.get("weight_offset") or 0.0),
            vocab=vocab,
            last_layer=int(cfg["n_layers"]) - 1 if cfg.get("n_layers") else -1,  # unknown: never normed
        )

    def normed(self, x: np.ndarray) -> np.ndarray:
        """The final norm, as the model applies it before its LM head."""
        x = x.astype(np.float32)
        if self.norm_kind == "rms":
            y = x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps)
        else:
            y = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + self.eps)
        y = y * (self.norm_weight + self.weight_offset)
        return y + self.norm_bias if self.norm_bias is not None else y

    def top1(self, hidden: np.ndarray, layer: int) -> np.ndarray:
        """Top-1 token id per row of ``hidden`` ``[tokens, dim]`` stored at ``layer``."""
        x = self.normed(hidden) if layer == self.last_layer else hidden.astype(np.float32)
        logits = x @ self.unembed.T
        if self.bias is not None:
            logits = logits + self.bias
        return logits.argmax(-1)


def run_length_ratio(ids: np.ndarray) -> float:
    """Runs of equal consecutive values / values (1.0 for an empty row)."""
    ids = np.asarray(ids).ravel()
    if ids.size == 0:
        return 1.0
    return float(1 + np.count_nonzero(ids[1:] != ids[:-1])) / ids.size


def matches(token: str, word: str) -> bool:
    """The study's rule: ``" " + token`` inside ``" " + word`` (stripped, lower-case, non-empty)."""
    t = token.strip().lower()
    return bool(t) and f" {t}" in f" {word.lower()}"


def layer_table(ws: Workspace, run: str, where: str | None = None) -> pa.Table:
    """Per LLM layer with image tokens: retained ratio, and attribute / object shares where the
    samples' truth names objects (``subject`` / ``reference`` with colour, shape and bbox)."""
    lens = Lens.load(ws, run)
    layers = [r[0] for r in ws.rows(
        "SELECT layer FROM activations WHERE run = ? AND tap = 'llm' AND tokens = 'image' ORDER BY layer", [run])]
    sel = ws.select(run, where)
    meta = {r[0]: r[1:] for r in ws.rows(
        "SELECT array_row, grid_h, grid_w, truth, params FROM v_samples WHERE run = ?", [run])}
    out: dict[str, list[Any]] = {"layer": [], "samples": [], "retained_ratio": [], "attribute_share": [],
                                 "object_share": []}
    for layer in layers:
        hidden = ws.read(run, "llm", layer, tokens="image", where=where)
        ratios, attr, obj = [], [], []
        for row, h in zip(sel.rows.tolist(), hidden, strict=False):
            ids = lens.top1(np.asarray(h), layer)
            ratios.append(run_length_ratio(ids))
            grid_h, grid_w, truth, params = meta[row]
            for a, o in _object_shares(lens, ids, grid_h, grid_w, truth, params):
                attr.append(a)
                obj.append(o)
        out["layer"].append(layer)
        out["samples"].append(len(ratios))
        out["retained_ratio"].append(float(np.mean(ratios)) if ratios else None)
        out["attribute_share"].append(float(np.mean(attr)) if attr else None)
        out["object_share"].append(float(np.mean(obj)) if obj else None)
    return pa.table(out)


def _object_shares(lens: Lens, ids: np.ndarray, grid_h: int | None, grid_w: int | None, truth: Any,
                   params: Any) -> list[tuple[float, float]]:
    truth = json.loads(truth) if isinstance(truth, str) else (truth or {})
    params = json.loads(params) if isinstance(params, str) else (params or {})
    objects = [o for o in objects_in(truth) if "colour" in o and "shape" in o]
    if not objects or not grid_h or not grid_w or "image_size" not in params:
        return []
    size = int(params["image_size"])
    out = []
    for ob in objects:
        patches = object_patches(ob["bbox"], (size, size), (grid_h, grid_w))
        tokens = [lens.vocab[i] for i in ids[patches[patches < ids.size]]]
        if tokens:
            out.append((float(np.mean([matches(t, ob["colour"]) for t in tokens])),
                        float(np.mean([matches(t, ob["shape"]) for t in tokens]))))
    return out


def token_map(ws: Workspace, run: str, layer: int, row: int) -> list[list[str]]:
    """One sample's top-1 tokens at ``layer`` on its patch grid (raster order)."""
    lens = Lens.load(ws, run)
    grid = ws.rows("SELECT grid_h, grid_w FROM samples WHERE run = ? AND array_row = ?", [run, row])
    if not grid or grid[0][0] is None:
        raise StoreError(f"run {run} row {row} has no single patch grid (grid_h/grid_w): no token map")
    hidden = ws.read(run, "llm", layer, tokens="image", where=f"array_row = {int(row)}")
    ids = lens.top1(np.asarray(hidden[0]), layer)
    h, w = grid[0]
    return [[lens.vocab[i] for i in ids[r * w:(r + 1) * w]] for r in range(h)]


def main(argv: list[str] | None = None) -> int:
    from queries.render import table_cli

    return table_cli("python -m queries.lens", __doc__, layer_table, argv)


if __name__ == "__main__":
    sys.exit(main())
