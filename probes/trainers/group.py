"""A group of probes that share features: the job every trainer takes (:class:`GroupJob`, small
enough to travel inline with a Dask task: paths, array descriptions, row indices and labels, never
activations), its result, and the probes table's record of each probe, the same for every trainer.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from probes import artifacts
from probes.errors import ProbeError
from probes.kinds.base import Job, Outcome, PerSample, Probe, params_json
from probes.plan import ProbeTask
from probes.splits import Fold
from probes.targets import TargetValues
from store import ArrayInfo, ProbeResult
from store.location import ArrayRoot
from store.maintenance import PREDICTION_COLUMNS
from store.schema import series_of, series_rule


@dataclass
class GroupJob:
    """Everything one group needs, small enough to travel inline with the task."""

    workspace: str
    root: ArrayRoot                         # where the arrays live: the workspace's folder or an object store
    group: str
    arrays: list[ArrayInfo]                 # one per layer, in ``layers`` order
    rows: np.ndarray                        # array rows, ascending
    tasks: list[ProbeTask]
    kinds: dict[str, type[Probe]]           # kind classes travel by (cloud)pickle: plugin kinds work too
    targets: dict[str, TargetValues]
    folds: dict[str, Fold]                  # ProbeTask.fold_id -> fold (train_where applied)
    grid: tuple[int, int] | None = None
    plan: str = "probes"
    save: bool = True
    dense_tokens: int | None = None         # a ragged image array whose selected samples all have this many tokens


@dataclass
class GroupResult:
    """What a job gave: records and weights of its probes, failures, and what it cost."""

    group: str
    records: list[ProbeResult] = field(default_factory=list)
    failures: list[tuple[str, str]] = field(default_factory=list)   # (probe key, error)
    weights: dict[str, bytes] = field(default_factory=dict)          # probe key -> safetensors bytes, for the client to write
    seconds: float = 0.0
    read_seconds: float = 0.0
    flops: float = 0.0
    worker: str = ""
    started_at: float = 0.0                 # time.time() on the worker: a timeline for diagnostics
    rss_peak: int = 0                       # streamed kinds: the largest worker RSS their tasks saw
    read_bytes: int = 0                     # streamed kinds: stored feature bytes read
    worker_peaks: dict[str, int] = field(default_factory=dict)   # streamed on Dask: peak RSS per worker


def probe_job(job: GroupJob, task: ProbeTask) -> Job:
    """What a kind is given to train ``task``: its labels, fold, parameters, control and grid.

    Parameters
    ----------
    job
        The task's group.
    task
        One probe of it.

    Returns
    -------
    Job
        The kind's view of the probe.
    """
    return Job(key=task.key, target=job.targets[task.target], fold=job.folds[task.fold_id], params=task.params,
               control=task.control == "shuffle", grid=job.grid)


def signature(t: ProbeTask) -> tuple[Any, ...]:
    """What a probe is, but for its layer: probes that share it train as one job over the layers."""
    return (t.target, t.kind, t.seed, params_json(t.params), t.fold_id, t.control, t.tag)


def tasks_by_signature(job: GroupJob) -> dict[tuple[Any, ...], dict[int, ProbeTask]]:
    """The job's tasks by signature, then layer: probes that differ only in layer share a signature."""
    got: dict[tuple[Any, ...], dict[int, ProbeTask]] = defaultdict(dict)
    for t in job.tasks:
        got[signature(t)][t.layer] = t
    return got


def record(job: GroupJob, task: ProbeTask, out: Outcome, seconds: float, worker: str,
           weights: dict[str, bytes]) -> ProbeResult:
    """The probes table's row of one probe's outcome, every trainer's alike.

    Parameters
    ----------
    job
        The probe's group.
    task
        The probe.
    out
        What it scored (and its fitted model, saved when ``job.save``).
    seconds
        Its share of the training time.
    worker
        Where it trained.
    weights
        Probe key -> safetensors bytes; the probe's weights are added here for the client to write.

    Returns
    -------
    ProbeResult
        The row, its per-sample predictions included.

    Raises
    ------
    ProbeError
        A NaN score, with what to select to get a number.
    """
    fold = job.folds[task.fold_id]
    if _nan(out.score):
        if not out.n_test:
            raise ProbeError(f"{task.kind} on {task.target} scored NaN: no labelled test rows; select more rows")
        which = f" (fold {task.fold} of {task.folds}: lower folds:)" if task.split == "kfold" else ""
        raise ProbeError(f"{task.kind} on {task.target} scored NaN on its {out.n_test} labelled test row(s){which}: a"
                         f" metric such as R² needs at least 2 with different values; select more rows")
    artifact = None
    if job.save and out.probe is not None:
        artifact = artifacts.artifact_name(task.key)  # checks the key; the client writes the file
        weights[task.key] = out.probe.dumps(extra={"key": task.key, "task": task.identity(), "split": fold.rule,
                                                   "train_where": task.train_where})
    control = out.control_score
    rule = json.dumps(fold.rule, sort_keys=True)
    params = {
        "key": task.key,
        "plan": job.plan,
        "kind_params": task.params,
        "where": task.where,
        "train_where": task.train_where,
        "split": fold.rule,
        "control": task.control,
        "selectivity": None if control is None or _nan(control) or _nan(out.score) else out.score - control,
        "metrics": out.metrics,
        "seconds": seconds,
        "flops": out.flops,
        "tag": task.tag,
        "worker": worker,
    }
    return ProbeResult(
        run=task.run, tap=task.tap, layer=task.layer, target=task.record_target, kind=task.kind,
        score=float(out.score), site=task.site, tokens=task.tokens, seed=task.seed,
        n_train=out.n_train, n_test=out.n_test, metric=out.metric,
        control_score=None if control is None or _nan(control) else float(control), artifact=artifact, params=params,
        key=task.key, kind_params=task.params, split=rule, train_where=task.train_where,
        test_fraction=task.test_fraction if task.split in ("hash", "kfold") else None, fold=task.fold,
        series=series_of(task.tokens, task.record_target, task.kind, task.params, task.where, task.train_where,
                         series_rule(fold.rule), task.control),
        predictions=_predictions(job.rows, out.predictions),
    )


def _predictions(rows: np.ndarray, got: PerSample | tuple[Any, Any] | None) -> dict[str, list[Any]] | None:
    """A kind's per-test-sample output by array row (the probe_predictions table)."""
    if got is None:
        return None
    if not isinstance(got, PerSample):  # (positions, values): a one-number prediction per sample
        got = PerSample(np.asarray(got[0]), np.asarray(got[1]))
    out = {"array_row": rows[np.asarray(got.positions, dtype=np.int64)].tolist()}
    for name in PREDICTION_COLUMNS:
        values = getattr(got, name)
        if values is not None:
            out[name] = np.asarray(values, dtype=np.float64).reshape(len(out["array_row"])).tolist()
    return out


def _nan(x: float) -> bool:
    return x is None or bool(np.isnan(x))
