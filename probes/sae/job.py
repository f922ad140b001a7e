"""One SAE of a plan as one farm task: split, train out of core, evaluate, score; runs on a worker.

The worker reads the store itself (only the chunks its rows live in) and hands back a small
:class:`SaeResult` (metrics, feature scores, the sparse test activations); the client records it,
as the probe farm's client is the manifest's only writer. Weights go straight to
``<workspace>/sae/<key>/`` in SAELens's layout; a checkpoint there lets a rerun resume.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from probes.sae.plan import SaeTask
from probes.sae.source import ActivationSource
from probes.splits import hash_fold
from store import Workspace

SAE_DIR = "sae"
FLOAT = 4


@dataclass
class SaeResult:
    """What one SAE task hands back to the client."""

    key: str
    model: dict[str, Any]
    scores: list[dict[str, Any]] = field(default_factory=list)
    activations: dict[str, np.ndarray] = field(default_factory=dict)


def sae_folder(workspace: str | Path, key: str) -> Path:
    """Where the SAE ``key`` is saved: ``<workspace>/sae/<key>/`` (cfg.json + sae_weights.safetensors)."""
    return Path(workspace) / SAE_DIR / key


def planned_peak(task: SaeTask) -> int:
    """Bytes one task holds at most beside the worker's base: the source's buffer (read, then its
    permuted copy), a batch through forward and backward, the weights with their gradients and Adam's
    two moments, and the copy safetensors makes of the weights while it writes a checkpoint."""
    e = task.entry
    d_out = task.d_in  # a transcoder's output has the input's width in every stored pair here
    width = task.d_in + (d_out if task.out_site else 0)
    buffer = 2 * e["buffer_rows"] * width * FLOAT
    batch = 3 * e["batch_size"] * (width + 3 * task.d_sae) * FLOAT
    params = 4 * (task.d_in * task.d_sae + task.d_sae * d_out + task.d_sae + d_out) * FLOAT
    saving = (task.d_in * task.d_sae + task.d_sae * d_out) * FLOAT   # safetensors' copy while a checkpoint is written
    return buffer + batch + params + saving


def _sources(ws: Workspace, task: SaeTask) -> tuple[ActivationSource, ActivationSource, np.ndarray]:
    e = task.entry
    sel = ws.select(task.run, e["where"])
    fold = hash_fold(list(sel.stimuli), task.seed, e["test_fraction"])
    arrays = [f"{task.tap}:{task.layer}:{task.site}:{task.tokens}"]
    if task.out_site:
        arrays.append(f"{task.tap}:{task.layer}:{task.out_site}:{task.tokens}")
    common = {"arrays": arrays, "where": e["where"], "rows": e["rows"], "buffer_rows": e["buffer_rows"]}
    train = ActivationSource(ws, task.run, train_where=e["train_where"], batch_size=e["batch_size"], seed=task.seed,
                             only_rows=sel.rows[fold.train], dtype="stored", **common)
    test = ActivationSource(ws, task.run, batch_size=max(e["batch_size"], 4096), seed=task.seed,
                            only_rows=sel.rows[fold.test], with_ids=True, **common)
    return train, test, sel.rows[fold.test]


def run_task(data: str, task: SaeTask, threads: int = 1) -> SaeResult:
    """Train, evaluate and score one SAE (a Dask task; also callable here).

    Parameters
    ----------
    data : str
        The workspace folder.
    task : SaeTask
        The SAE to train.
    threads : int
        Torch threads (the farm's workers run one each).

    Returns
    -------
    SaeResult
        The record for ``sae_models``, feature scores and sparse test activations.
    """
    from probes.sae.score import score_features
    from probes.sae.train import TrainSettings, evaluate, train

    started = time.perf_counter()
    ws = Workspace.open(data, readonly=True)
    e = task.entry
    train_src, test_src, test_rows = _sources(ws, task)
    settings = TrainSettings(architecture=e["architecture"], d_sae=task.d_sae, k=e["k"], l1=e["l1"], lr=e["lr"],
                             epochs=e["epochs"], batch_size=e["batch_size"], buffer_rows=e["buffer_rows"],
                             seed=task.seed, checkpoint_every=e["checkpoint_every"], threads=threads)
    folder = sae_folder(data, task.key)
    meta = {"hook_name": f"agnosia:{task.run}/{task.tap}/{task.layer}/{task.site}/{task.tokens}",
            "model_name": ws.rows("SELECT model FROM runs WHERE run = ?", [task.run])[0][0],
            "agnosia_key": task.key, "agnosia_rows": e["rows"]}
    sae, out = train(train_src, settings, folder, metadata=meta)
    out = evaluate(sae, test_src, out)
    scores, acts = score_features(ws, task, sae, test_src, test_rows) if e["targets"] else ([], {})
    model = {
        "key": task.key, "plan": task.plan, "run": task.run, "tap": task.tap, "layer": task.layer, "site": task.site,
        "tokens": task.tokens, "out_site": task.out_site, "rows": e["rows"], "architecture": e["architecture"],
        "d_in": task.d_in, "d_sae": task.d_sae, "k": e["k"] if e["architecture"] == "topk" else None,
        "l1": None if e["architecture"] == "topk" else e["l1"], "seed": task.seed, "test_fraction": e["test_fraction"],
        "where_sql": e["where"], "train_where": e["train_where"], "n_train": train_src.n_rows, "n_test": out.n_test,
        "epochs": e["epochs"], "steps": out.steps, "mse": out.mse, "explained_variance": out.explained_variance,
        "l0": out.l0, "dead_share": out.dead_share, "rows_per_s": out.rows_per_s,
        "seconds": time.perf_counter() - started, "path": str(Path(SAE_DIR) / task.key),
        "params": {**task.identity(), "resumed_at_step": out.resumed_at, "train_seconds": out.seconds},
    }
    return SaeResult(task.key, model, scores, acts)
