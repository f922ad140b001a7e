"""The farm's side of iterative kinds out of core (``linear``, ``pooled`` classification): when a
group's in-memory features would not fit the worker limit (or the plan says ``out_of_core:
always``), each layer becomes one task of probes/subsample.py, trained on a recorded,
deterministic subsample of at most ``max_train_rows`` labelled training units per probe batch
(default: as many as the worker limit holds), whitened with statistics streamed over every
training unit, and scored on every test unit.

The client draws the subsample (uniform without replacement over the labelled units of the
training samples, seeded with the split's seed, so a re-run draws the same rows and the split
stays by stimulus), plans the task's peak bytes from shapes before anything runs, and turns the
layer results into the probes table's records, which say how many rows the probe trained on,
out of how many, under which cap (``metrics.subsample``).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import numpy as np

from probes import subsample
from probes.errors import ProbeError
from probes.farm_stream import FIT_FRACTION, MemoryPlan, MiB, default_block_rows
from probes.kinds.base import Job, Outcome, PerSample, params_json
from probes.splits import control_permutation
from probes.worker import GroupJob, GroupResult, _record, _signature

#: RSS of an idle, warmed LocalCluster worker that imported torch and every kind: 390 MiB
#: measured here (2026-12-01, the out-of-core test's worker_peaks of the idle worker); rounded up.
WORKER_BASE_ITERATIVE = 400 * MiB
#: Fewer training rows per probe batch than this is no probe worth recording: refuse the plan.
MIN_TRAIN_ROWS = 256
MODES = ("auto", "always", "never")


def eligible(job: GroupJob) -> bool:
    """Whether every task of the group is a batched logistic probe this path trains."""
    from probes.kinds.pooled import PooledProbe, _regress

    for t in job.tasks:
        kind = job.kinds[t.kind]
        if not kind.__dict__.get("out_of_core", False):
            return False
        if issubclass(kind, PooledProbe):
            target = job.targets[t.target]
            if _regress(kind.check_params(t.params), None, target.numeric) or target.classes is None:
                return False   # pooled regression is ridge: kind ridge streams it
    return True


def chosen(job: GroupJob, mode: str, in_memory: MemoryPlan, limit: int | None) -> bool:
    """Out of core when the plan says always, or (auto) when the in-memory plan exceeds the limit."""
    if mode == "never" or not eligible(job):
        return False
    return mode == "always" or (limit is not None and in_memory.peak_bytes > FIT_FRACTION * limit)


def build_spec(job: GroupJob, block_rows: int | None, max_train_rows: int | None,
               limit: int | None) -> tuple[subsample.IterSpec, MemoryPlan]:
    """The group's spec, its subsample drawn under the cap (given, else the most the limit holds)."""
    wanted: dict[tuple[Any, ...], Any] = {}
    for t in job.tasks:
        wanted.setdefault(_signature(t), t)
    first = list(wanted.values())
    kind = job.kinds[first[0].kind]
    if any(job.kinds[t.kind] is not kind for t in first):
        raise ProbeError(f"group {job.group}: out of core trains one kind per group; put {sorted(job.kinds)} in"
                         " separate plan entries or set out_of_core: never")
    jobs = [Job(key=t.key, target=job.targets[t.target], fold=job.folds[t.fold_id], params=t.params,
                control=t.control == "shuffle", grid=job.grid) for t in first]
    info = job.arrays[0]
    R = 1 if kind.accepts == ("sample",) else _tokens(job)
    solves = _solves(kind, jobs, len(job.rows), R)
    rows = int(block_rows or default_block_rows(info, "float64"))
    spec = subsample.IterSpec(job.root, job.rows, kind, R, rows, solves, job.dense_tokens)
    cap = max_train_rows if max_train_rows is not None else default_cap(spec, job, limit)
    for s in solves:
        _draw(s, cap)
    return spec, plan_memory(spec, job, "max_train_rows" if max_train_rows is not None else None)


def _tokens(job: GroupJob) -> int:
    info = job.arrays[0]
    if job.dense_tokens:
        return int(job.dense_tokens)
    if info.layout != "dense" or len(info.shape) < 3:
        raise ProbeError(f"{info.key()}: a per-token probe reads a dense token array [n, T, d]")
    return int(info.shape[1])


def _solves(kind: Any, jobs: list[Job], n: int, R: int) -> list[subsample.IterSolve]:
    """Jobs with the same params and split share one Solve (as in probes/kinds/linear.py)."""
    by: dict[tuple[str, bytes, bytes], list[int]] = defaultdict(list)
    for j, jb in enumerate(jobs):
        by[(params_json(jb.params), jb.fold.train.tobytes(), jb.fold.test.tobytes())].append(j)
    out = []
    for idx in by.values():
        params = kind.check_params(jobs[idx[0]].params)
        fold = jobs[idx[0]].fold
        cols = []
        for j in idx:
            variants = [(False, jobs[j].target.values)]
            if jobs[j].control:
                variants.append((True, jobs[j].target.permuted(control_permutation(n, fold.seed)).values))
            cols += [subsample.Column(j, c, kind.sample_labels(y, R)) for c, y in variants]
        labelled = np.logical_or.reduce([c.labels >= 0 for c in cols]) & fold.train[:, None]
        out.append(subsample.IterSolve(params, fold.train.copy(), fold.test.copy(), labelled, cols,
                                       int(labelled.sum()), None, int(fold.seed)))
    return out


def _draw(solve: subsample.IterSolve, cap: int | None) -> None:
    """Keep ``cap`` of the labelled training units, uniformly without replacement (seeded)."""
    solve.cap = cap
    if cap is None or solve.candidates <= cap:
        return
    flat = np.flatnonzero(solve.pick.reshape(-1))
    keep = np.random.default_rng([solve.seed, cap]).choice(flat, cap, replace=False)
    pick = np.zeros(solve.pick.size, bool)
    pick[keep] = True
    solve.pick = pick.reshape(solve.pick.shape)


# ----------------------------------------------------------------------------- memory plan


def _shape_costs(spec: subsample.IterSpec, job: GroupJob) -> tuple[int, int, int, int]:
    """(fixed bytes, bytes per picked row held through the pass, per row of the largest solve,
    the test block) of one layer task, from shapes alone."""
    from probes.logreg import MAX_PRECONDITION_DIM

    info = job.arrays[0]
    d = info.item_shape[-1]
    vpr = info.values_per_row
    gram = d * d * 8 if d <= MAX_PRECONDITION_DIM else d * 8
    item = np.dtype(info.stored_dtype).itemsize
    # The reader decodes whole stored chunks: one chunk's values sit beside a block of rows (a
    # fixed ~94 MiB over the idle worker measured whatever the cap, until this term was added).
    block = spec.block_rows * vpr * (item + 4 + 4 + 8) + min(info.chunk_samples, len(spec.rows)) * vpr * item
    held = sum(len(s.columns) * 8 + d * 4 for s in spec.solves)
    widest = max(len(s.columns) * _classes(s) for s in spec.solves)
    # The solve: X - mu, its whitened copy Z, Zᵀ and the allocator's slack (4 float32 copies of
    # the rows beside the subsample), per-row logits; the covariance's eigendecomposition ~5 d x d
    # float64.
    solve_row = 4 * d * 4 + 12 * widest * 4
    fixed = WORKER_BASE_ITERATIVE + len(spec.solves) * gram + 5 * gram + block
    return fixed, held, solve_row, spec.block_rows * spec.units * (2 * d * 4 + widest * 8)


def _classes(solve: subsample.IterSolve) -> int:
    k = max(int(c.labels.max()) + 1 for c in solve.columns)
    return k if k > 2 else 1    # binary columns share one logit


def default_cap(spec: subsample.IterSpec, job: GroupJob, limit: int | None) -> int | None:
    """The most training rows per Solve the worker limit holds (None: no limit, every row)."""
    if limit is None:
        return None
    fixed, held, solve_row, test = _shape_costs(spec, job)
    room = FIT_FRACTION * limit - fixed - test
    return max(int(room // (held + solve_row)), 0)


def plan_memory(spec: subsample.IterSpec, job: GroupJob, capped_by: str | None = None) -> MemoryPlan:
    """One layer task's planned peak: moments, every Solve's subsample, the largest solve's
    temporaries (whitened copy, its transpose, per-row logits) and a block of rows."""
    fixed, held, solve_row, test = _shape_costs(spec, job)
    m = [int(s.pick.sum()) for s in spec.solves]
    peak = fixed + test + sum(m) * held // max(len(spec.solves), 1) + max(m) * solve_row
    info = job.arrays[0]
    reads = len(job.arrays) * len(job.rows) * info.values_per_row * np.dtype(info.stored_dtype).itemsize
    cap = spec.solves[0].cap
    what = (f"out-of-core L-BFGS ({max(m)} training rows per batch{'' if cap is None else f', cap {cap}'},"
            f" {len(spec.solves)} batch(es), block of {spec.block_rows} rows)")
    if min(m) < min(MIN_TRAIN_ROWS, min(s.candidates for s in spec.solves)):
        what += f"; under {MIN_TRAIN_ROWS} training rows"
        peak = max(peak, fixed + test + MIN_TRAIN_ROWS * (held + solve_row))
    return MemoryPlan(reads, int(peak), what)


def check_fits(plan: MemoryPlan, limit: int | None, job: GroupJob) -> None:
    """A ProbeError naming the settings that fix an out-of-core plan that cannot fit."""
    if limit is None or plan.peak_bytes <= FIT_FRACTION * limit:
        return
    need = plan.peak_bytes / FIT_FRACTION / MiB
    raise ProbeError(
        f"group {job.group} ({job.arrays[0].key()}) needs {plan.peak_bytes / MiB:.0f} MiB per worker at its peak"
        f" ({plan.what}), over {FIT_FRACTION:.0%} of the {limit / MiB:.0f} MiB worker memory limit: set max_train_rows"
        f" lower (plan key), --block-rows lower, fewer seeds or parameter sets per plan entry, or raise --memory-limit"
        f" to at least {need:.0f}MiB"
    )


# ----------------------------------------------------------------------------- running


def run_local(job: GroupJob, spec: subsample.IterSpec) -> GroupResult:
    t0 = time.perf_counter()
    fits = [subsample.fit_layer(spec, info) for info in job.arrays]
    return finish(job, spec, fits, time.perf_counter() - t0)


def run_dask(client: Any, job: GroupJob, spec: subsample.IterSpec) -> GroupResult:
    """One task per layer (the spec travels once); the client gathers and records."""
    t0 = time.perf_counter()
    shared = client.scatter(spec, hash=False)
    futures = [client.submit(subsample.fit_layer, shared, info, pure=False, retries=1) for info in job.arrays]
    fits = client.gather(futures)
    from probes.stream import _rss

    result = finish(job, spec, fits, time.perf_counter() - t0, worker="dask:iterative")
    result.worker_peaks = client.run(_rss)
    return result


def finish(job: GroupJob, spec: subsample.IterSpec, fits: list[subsample.LayerFit], seconds: float,
           worker: str = "iterative") -> GroupResult:
    """Records and weights of every probe (client side), as the in-memory path writes them."""
    result = GroupResult(group=job.group, worker=worker, started_at=time.time(), seconds=seconds)
    result.rss_peak = max([f.rss_peak for f in fits] + [0])
    result.read_bytes = sum(f.read_bytes for f in fits)
    wanted: dict[tuple[Any, ...], dict[int, Any]] = defaultdict(dict)
    for t in job.tasks:
        wanted[_signature(t)][t.layer] = t
    sigs = list(wanted)
    n_probes = max(len(job.tasks), 1)
    for info, fit in zip(job.arrays, fits, strict=True):
        for s, solve in enumerate(spec.solves):
            for c, col in enumerate(solve.columns):
                task = wanted[sigs[col.job]].get(info.layer)
                if col.control or task is None:
                    continue
                try:
                    out = _outcome(job, task, spec, fit, s, c, fit.flops / n_probes)
                    result.records.append(_record(job, task, out, seconds / n_probes, worker, result.weights))
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
    if pred is not None:
        preds = per_sample(te, pred[c][te], y_te[:, 0], 1, target.classes)
    else:
        with np.errstate(invalid="ignore", divide="ignore"):
            preds = PerSample(te, None, None, fit.hits[s][c][te] / fit.count[s][c][te])
    return Outcome("accuracy", score, ctrl, int((target.labelled() & fold.train).sum()),
                   int((target.labelled() & fold.test).sum()), metrics, probe, flops, predictions=preds)


def _accuracy(fit: subsample.LayerFit, s: int, c: int) -> float:
    n = int(fit.count[s][c].sum())
    return float(fit.hits[s][c].sum() / n) if n else float("nan")
