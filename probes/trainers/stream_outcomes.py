"""The streamed trainer's finish, on the client: each solved layer's weights, GCV picks and test
sums become the probes table's records, per-sample predictions and safetensors weights, exactly
as the in-memory trainer writes them.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import numpy as np

from probes import stream
from probes.errors import ProbeError
from probes.kinds.base import Outcome, PerSample
from probes.ridge_solve import gcv_pick
from probes.trainers.group import GroupJob, GroupResult, record, tasks_by_signature
from probes.trainers.stream_specs import SpecGroup, where_of


def finish(job: GroupJob, specs: list[SpecGroup], sols: list[stream.Solution], scores: list[stream.Scores],
           seconds: float, worker: str = "stream") -> GroupResult:
    """Records and weights of every probe, from the solved layers (client side)."""
    result = GroupResult(group=job.group, worker=worker, started_at=time.time())
    wanted = tasks_by_signature(job)
    per_probe = seconds / max(len(job.tasks), 1)
    k = 0
    for g in specs:
        for info in job.arrays:
            _add_layer(job, g, info, sols[k], scores[k], wanted, per_probe, result)
            k += 1
    result.seconds = seconds
    return result


def finish_layer(job: GroupJob, g: SpecGroup, info: Any, sol: stream.Solution, sc: stream.Scores, seconds: float,
                 worker: str, wanted: dict[tuple[Any, ...], dict[int, Any]] | None = None) -> GroupResult:
    """Records and weights of one layer's probes of one parameter set; ``seconds`` shared among them."""
    result = GroupResult(group=job.group, worker=worker, started_at=time.time())
    wanted = wanted if wanted is not None else tasks_by_signature(job)
    n = sum(info.layer in wanted[sig] for sig in g.sigs)
    _add_layer(job, g, info, sol, sc, wanted, seconds / max(n, 1), result)
    result.seconds = seconds
    return result


def _add_layer(job: GroupJob, g: SpecGroup, info: Any, sol: stream.Solution, sc: stream.Scores,
               wanted: dict[tuple[Any, ...], dict[int, Any]], per_probe: float, result: GroupResult) -> None:
    result.rss_peak = max(result.rss_peak, sol.rss_peak, sc.rss_peak)
    result.read_bytes += sol.read_bytes + sc.read_bytes
    flops = (sol.flops + sc.flops) / max(len(g.jobs), 1)
    for j, sig in enumerate(g.sigs):
        task = wanted[sig].get(info.layer)
        if task is None:
            continue
        try:
            out = _outcome(g, j, sol, sc, flops)
            result.records.append(record(job, task, out, per_probe, result.worker, result.weights))
            result.flops += out.flops
        except (ProbeError, ValueError) as err:
            result.failures.append((task.key, f"{type(err).__name__}: {err}"))


def _outcome(g: SpecGroup, j: int, sol: stream.Solution, sc: stream.Scores, flops: float) -> Outcome:
    sp, job, where = g.spec, g.jobs[j], where_of(g)[j]
    s, v = where.own
    var = sp.solves[s].variants[v]
    W_all, b_all, gcv = sol.W[s], sol.b[s], sol.gcv[s]
    if W_all is None or b_all is None or gcv is None:
        raise ProbeError(f"{g.kind.name} on {job.target.name}: fewer than 2 labelled training rows; select more rows")
    pick = _pick(gcv[var.start : var.stop])
    by_alpha = _test_scores(sc, s, v, var)
    ctrl, control = None, None
    if where.control is not None:
        cs, cv = where.control
        cvar = sp.solves[cs].variants[cv]
        control_gcv = sol.gcv[cs]
        if sol.W[cs] is not None and control_gcv is not None:
            control = (cs, cv, _pick(control_gcv[cvar.start : cvar.stop]))
            ctrl = float(_test_scores(sc, cs, cv, cvar)[control[2]] if sp.count_class is None
                         else _control_exact(sp, sc, control))
    probe = copy.copy(where.probe)   # the same parameters and seed: no validation per probe
    W, b = W_all[:, var.start : var.stop, pick], b_all[var.start : var.stop, pick]
    regress = var.classes is None
    probe.state_ = {"coef": np.ascontiguousarray(W.T), "intercept": np.ascontiguousarray(b),
                    "classes": np.zeros(0, np.int64) if var.classes is None else var.classes}
    probe.meta_ = {"task": "regress" if regress else "classify"}
    metrics: dict[str, Any] = {"task": probe.meta_["task"], "n_train_rows": int(sol.n_train[s]),
                               "n_test_rows": int(sc.count[s][v]), "streamed": True}
    if sp.method == "ridge":
        probe.meta_["alpha"] = sp.alphas[pick]
        metrics.update(alpha=sp.alphas[pick], alphas=list(sp.alphas), by_alpha=[float(x) for x in by_alpha],
                       solve="dual" if sp.dual else "primal")   # n×n kernel of the rows, or d×d XᵀX
    if sp.count_class is not None:   # hidden_number_ridge: N_H per test board against its count
        return _count_outcome(g, j, sol, sc, (s, v, pick), control, ctrl, metrics, flops, probe)
    return Outcome("r2" if regress else "accuracy", float(by_alpha[pick]), ctrl, where.n_train, where.n_test,
                   metrics, probe, flops, predictions=_samples(sp, sc, (s, v, pick), control, job.target.classes))


def _pick(gcv: np.ndarray) -> int:
    """gcv_pick, without its NaN-aware sums when there is one alpha to pick from."""
    return 0 if gcv.shape[-1] == 1 else gcv_pick(gcv)


def _samples(sp: stream.StreamSpec, sc: stream.Scores, own: tuple[int, int, int],
             control: tuple[int, int, int] | None, classes: tuple[Any, ...] | None) -> PerSample | None:
    """A streamed probe's test samples and, beside them, its control's on the same samples, both
    against the real target: a sample regression's values, a sample classifier's classes (as
    numbers where the target's classes are numbers, as linear.per_sample gives them) and 1/0
    correct, a token classifier's accuracy over each sample's labelled tokens. A token regression
    has no one number per sample: None."""
    s, v, pick = own
    solve, var = sp.solves[s], sp.solves[s].variants[v]
    tested = np.flatnonzero(solve.test.any(1))
    got = sc.per_sample[s][tested, v, pick]
    ctl = None if control is None else sc.per_sample[control[0]][tested, control[1], control[2]]
    if var.classes is None:
        if sp.level != "sample":
            return None
        return PerSample(tested, got, solve.Y[tested, 0, var.start], control_prediction=ctl)
    if sp.level == "token":
        units = solve.test[tested].sum(1)
        return PerSample(tested, score=got / units, control_score=None if ctl is None else ctl / units)
    codes = solve.codes[tested, 0, v].astype(np.float64)
    numbers = class_numbers(classes)

    def named(c: np.ndarray | None) -> np.ndarray | None:
        return None if numbers is None or c is None else numbers[c.astype(np.int64)]

    return PerSample(tested, named(got), named(codes), (got == codes).astype(np.float64), named(ctl),
                     None if ctl is None else (ctl == codes).astype(np.float64))


def class_numbers(classes: tuple[Any, ...] | None) -> np.ndarray | None:
    """The classes as float64 where every one is a number (a count's values), else None: codes of
    a categorical target are no numbers to average."""
    if not classes or not all(isinstance(c, int | float | np.integer | np.floating)
                              and not isinstance(c, bool | np.bool_) for c in classes):
        return None
    return np.asarray(classes, dtype=np.float64)


def _counts(sp: stream.StreamSpec, sc: stream.Scores, s: int, v: int, pick: int) -> tuple[np.ndarray, ...]:
    """(positions, predicted counts, true counts) of a probe's test samples."""
    solve = sp.solves[s]
    tested = np.flatnonzero(solve.test.any(1))
    truth = (solve.codes[tested, :, v] == sp.count_class).sum(1)
    return tested, sc.per_sample[s][tested, v, pick], truth.astype(np.float64)


def _control_exact(sp: stream.StreamSpec, sc: stream.Scores, control: tuple[int, int, int]) -> float:
    """A counting control's exact match on its own test samples against its own (shuffled) labels."""
    cs, cv, pick = control
    tested = int(sp.solves[cs].test.any(1).sum())
    return float(sc.exact[cs][cv, pick] / tested) if tested else float("nan")


def _exact(n_h: np.ndarray, n_g: np.ndarray) -> float:
    return float((n_h == n_g).mean()) if len(n_g) else float("nan")


def _count_outcome(g: SpecGroup, j: int, sol: stream.Solution, sc: stream.Scores, at: tuple[int, int, int],
                   control: tuple[int, int, int] | None, ctrl: float | None, metrics: dict[str, Any], flops: float,
                   probe: Any) -> Outcome:
    """The score of a counting kind: exact match of each test sample's count of predicted units;
    per sample N_H, and the control's N_H on the same boards, against their real count."""
    from probes.kinds.hidden_number import count_metrics

    s, v, pick = at
    tested, n_h, n_g = _counts(g.spec, sc, s, v, pick)
    var = g.spec.solves[s].variants[v]
    metrics |= count_metrics(n_h, n_g) | {"token_accuracy": float(_test_scores(sc, s, v, var)[pick])}
    job = g.jobs[j]
    boards = int((job.target.labelled() & job.fold.train).sum())
    samples = PerSample(tested, n_h, n_g, (n_h == n_g).astype(np.float64))
    if control is not None:
        samples.control_prediction = sc.per_sample[control[0]][tested, control[1], control[2]]
        samples.control_score = (samples.control_prediction == n_g).astype(np.float64)
    return Outcome(g.kind.metric, _exact(n_h, n_g), ctrl, boards, len(tested), metrics, probe, flops,
                   predictions=samples)


def _test_scores(sc: stream.Scores, s: int, v: int, var: stream.Variant) -> np.ndarray:
    if var.classes is not None:
        return sc.hits[s][v] / sc.count[s][v] if sc.count[s][v] else np.full(sc.hits[s].shape[1], np.nan)
    n = sc.count[s][v]
    ss = sc.syy[s][v] - sc.sy[s][v] ** 2 / n if n else 0.0
    return 1.0 - sc.sse[s][v] / ss if ss > 0 else np.full(sc.sse[s].shape[1], np.nan)
