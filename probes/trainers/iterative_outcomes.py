"""The iterative trainer's finish, on the client: each layer task's fits become the probes
table's records, which say how many rows the probe trained on, out of how many, under which
cap (``metrics.subsample``), as the in-memory trainer writes them otherwise.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from probes import subsample
from probes.errors import ProbeError
from probes.kinds.base import Job, Outcome, PerSample
from probes.trainers.group import GroupJob, GroupResult, record, tasks_by_signature


def finish(job: GroupJob, spec: subsample.IterSpec, fits: list[subsample.LayerFit], seconds: float,
           worker: str = "iterative") -> GroupResult:
    """Records and weights of every probe (client side), as the in-memory path writes them."""
    result = GroupResult(group=job.group, worker=worker, started_at=time.time(), seconds=seconds)
    result.rss_peak = max([f.rss_peak for f in fits] + [0])
    result.read_bytes = sum(f.read_bytes for f in fits)
    wanted = tasks_by_signature(job)
    sigs = list(wanted)
    n_probes = max(len(job.tasks), 1)
    for info, fit in zip(job.arrays, fits, strict=True):
        for s, solve in enumerate(spec.solves):
            for c, col in enumerate(solve.columns):
                task = wanted[sigs[col.job]].get(info.layer)
                if col.control or task is None:
                    continue
                try:
                    outcome = _sample_outcome if spec.per_sample else _outcome
                    out = outcome(job, task, spec, fit, s, c, fit.flops / n_probes)
                    result.records.append(record(job, task, out, seconds / n_probes, worker, result.weights))
                    result.flops += out.flops
                except (ProbeError, ValueError) as err:
                    result.failures.append((task.key, f"{type(err).__name__}: {err}"))
    return result


def _outcome(job: GroupJob, task: Any, spec: subsample.IterSpec, fit: subsample.LayerFit, s: int, c: int,
             flops: float) -> Outcome:
    from probes.kinds.linear import per_sample

    solve = spec.solves[s]
    col = solve.columns[c]
    target, fold = job.targets[task.target], job.folds[task.fold_id]
    score = _accuracy(fit, s, c)
    ctrl = next((_accuracy(fit, s, k) for k, o in enumerate(solve.columns) if o.job == col.job and o.control), None)
    probe = spec.kind.build(Job(task.key, target, fold, task.params, grid=job.grid), fold.seed)
    coef, intercept, classes = fit.weights[s][c]
    probe.state_ = {"mean": fit.mean[s], "scale": fit.scale[s], "coef": coef, "intercept": intercept,
                    "classes": classes}
    probe.meta_ = {"n_iter": fit.n_iter[s], "converged": fit.converged[s]}
    te = np.flatnonzero(solve.test)
    y_te = col.labels[te]
    labelled = y_te[y_te >= 0]
    metrics = {"majority": float(np.bincount(labelled).max() / len(labelled)) if len(labelled) else float("nan"),
               "n_train_rows": int(fit.fitted_rows[s][c]), "n_test_rows": int(fit.count[s][c].sum()),
               "n_iter": fit.n_iter[s], "converged": fit.converged[s], "streamed": True,
               "subsample": {"rows": int(solve.pick.sum()), "of": solve.candidates, "max_train_rows": solve.cap,
                             "seed": solve.seed, "draw": "uniform over labelled training units, without replacement"}}
    pred = fit.pred[s]
    control = _control_column(solve, c)
    if pred is not None:
        preds = per_sample(te, pred[c][te], y_te[:, 0], 1, target.classes)
        if control is not None:   # its predicted classes, scored against the real labels
            ctl = per_sample(te, pred[control][te], y_te[:, 0], 1, target.classes)
            preds.control_prediction, preds.control_score = ctl.prediction, ctl.score
    else:
        with np.errstate(invalid="ignore", divide="ignore"):
            preds = PerSample(te, None, None, fit.hits[s][c][te] / fit.count[s][c][te])
            if control is not None:   # its hits on the probe's labelled units, over their count
                preds.control_score = fit.real_hits[s][control][te] / fit.count[s][c][te]
    return Outcome("accuracy", score, ctrl, int((target.labelled() & fold.train).sum()),
                   int((target.labelled() & fold.test).sum()), metrics, probe, flops, predictions=preds)


def _control_column(solve: subsample.IterSolve, c: int) -> int | None:
    """The column of the shuffled-label control of column ``c``'s probe (None: no control)."""
    job = solve.columns[c].job
    return next((k for k, o in enumerate(solve.columns) if o.job == job and o.control), None)


def _sample_outcome(job: GroupJob, task: Any, spec: subsample.IterSpec, fit: subsample.LayerFit, s: int, c: int,
                    flops: float) -> Outcome:
    """A per-sample kind's probe: its model rebuilt from the worker's state, scored from the
    predictions over every test sample it has a label for (its control's the same way)."""
    solve = spec.solves[s]
    col = solve.columns[c]
    target, fold = job.targets[task.target], job.folds[task.fold_id]
    probe, score, metrics, preds = _scored(spec, fit, s, c)
    control = _control_column(solve, c)
    ctrl = None if control is None else _control_score(spec, fit, s, control)
    if control is not None:   # the control on the probe's test samples, scored against their real labels
        _, _, _, ctl = _scored(spec, fit, s, control, against=c)
        preds.control_prediction, preds.control_score = ctl.prediction, ctl.score
    at = np.flatnonzero(solve.pick)
    metrics.update({"n_train_samples": int(subsample.labelled_of(col)[at].sum()),
                    "n_test_samples": len(preds.positions), "streamed": True,
                    "subsample": {"rows": len(at), "of": solve.candidates, "max_train_rows": solve.cap,
                                  "seed": solve.seed,
                                  "draw": "uniform over labelled training samples, without replacement"}})
    return Outcome(spec.kind.metric, score, ctrl, int((target.labelled() & fold.train).sum()),
                   int((target.labelled() & fold.test).sum()), metrics, probe, flops, predictions=preds)


def _control_score(spec: subsample.IterSpec, fit: subsample.LayerFit, s: int, c: int) -> float:
    """NaN (no control score recorded, as in memory) when the shuffled labels leave no test sample."""
    if not (spec.solves[s].test & subsample.labelled_of(spec.solves[s].columns[c])).any():
        return float("nan")
    return _scored(spec, fit, s, c)[1]


def _scored(spec: subsample.IterSpec, fit: subsample.LayerFit, s: int, c: int, against: int | None = None
            ) -> tuple[Any, float, dict[str, Any], PerSample]:
    """Column ``c``'s probe scored on the test samples column ``against`` (default: ``c``) has
    labels for, against those labels."""
    solve = spec.solves[s]
    col = solve.columns[c if against is None else against]
    probe = spec.kind(random_state=solve.seed, **solve.params)
    probe.load_state(*fit.states[s][c])
    te = np.flatnonzero(solve.test & subsample.labelled_of(col))
    if not len(te):
        raise ProbeError(f"{spec.kind.name}: no labelled test sample; select more rows")
    blocks = fit.tested[s][c]
    # conv_spatial predicts a grid array per block, detect a list of (boxes, scores) per sample
    pred: Any = np.concatenate(blocks) if isinstance(blocks[0], np.ndarray) else [p for b in blocks for p in b]
    # The column was predicted on more samples than these where it is a control (subsample.predicted).
    keep = subsample.labelled_of(col)[np.flatnonzero(solve.test & subsample.predicted(solve, c))]
    pred = pred[keep] if isinstance(pred, np.ndarray) else [p for p, k in zip(pred, keep, strict=True) if k]
    y = col.labels[te]
    score, metrics, (p, truth, per) = probe.scored(pred, y if y.dtype == object else y.astype(np.int64))
    return probe, score, metrics, PerSample(te, p, truth, per)


def _accuracy(fit: subsample.LayerFit, s: int, c: int) -> float:
    n = int(fit.count[s][c].sum())
    return float(fit.hits[s][c].sum() / n) if n else float("nan")
