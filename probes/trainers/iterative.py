"""The iterative trainer: iterative kinds out of core (``linear``, ``pooled`` classification): when a
group's in-memory features would not fit the worker limit (or the plan says ``out_of_core:
always``), each layer becomes one task of probes/subsample.py, trained on a recorded,
deterministic subsample of at most ``max_train_rows`` labelled training units per probe batch
(default: as many as the worker limit holds), whitened with statistics streamed over every
training unit, and scored on every test unit.

``conv_spatial`` and ``detect`` go the same way with the whole sample (its token grid) as the
unit: a subsample of training samples, one model per probe and per control
(:func:`probes.subsample.fit_samples`), scored from predictions made block by block.

The client draws the subsample (uniform without replacement over the labelled units of the
training samples, seeded with the split's seed, so a re-run draws the same rows and the split
stays by stimulus), plans the task's peak bytes from shapes before anything runs, and turns the
layer results into the probes table's records, which say how many rows the probe trained on,
out of how many, under which cap (``metrics.subsample``).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import numpy as np

from probes import subsample
from probes.errors import ProbeError
from probes.kinds.base import Job, params_json
from probes.splits import control_permutation
from probes.trainers.base import (
    FIT_FRACTION,
    DaskRun,
    MemoryPlan,
    MiB,
    Planned,
    Settings,
    TrainerDefaults,
    default_block_rows,
)
from probes.trainers.group import GroupJob, GroupResult, probe_job, signature
from probes.trainers.iterative_outcomes import finish

if TYPE_CHECKING:
    from probes.kinds.base import Probe

#: RSS of an idle, warmed LocalCluster worker that imported torch and every kind: 390 MiB
#: measured here (2026-12-01, the out-of-core test's worker_peaks of the idle worker); rounded up.
WORKER_BASE_ITERATIVE = 400 * MiB
#: Fewer training rows per probe batch than this is no probe worth recording: refuse the plan.
MIN_TRAIN_ROWS = 256
#: The same for kinds trained on whole samples (conv_spatial, detect): fewer grids than this.
MIN_TRAIN_SAMPLES = 32
MODES = ("auto", "always", "never")
#: What a kind trained per sample out of core provides (probes/kinds/conv_spatial.py, detect.py).
PER_SAMPLE_PROTOCOL = ("fit_scaled", "standardizes", "scored", "train_bytes")


def eligible(job: GroupJob) -> bool:
    """Whether every task of the group is of a kind this trainer takes (batched logistic, or per
    sample), on a target it classifies.

    Parameters
    ----------
    job
        The group.

    Returns
    -------
    bool
        False where a kind does not list ``"iterative"`` in its ``trains``, lacks the per-sample
        protocol, or (pooled) regresses its target: pooled regression is ridge's, streamed.
    """
    from probes.kinds.pooled import PooledProbe, regresses_values

    for t in job.tasks:
        kind = job.kinds[t.kind]
        if not TRAINER.accepts(kind):
            return False
        if issubclass(kind, PooledProbe):
            target = job.targets[t.target]
            if regresses_values(kind.check_params(t.params), None, target.numeric) or target.classes is None:
                return False
    return True


def build_spec(job: GroupJob, block_rows: int | None, max_train_rows: int | None,
               limit: int | None) -> tuple[subsample.IterSpec, MemoryPlan]:
    """The group's spec, its subsample drawn under the cap (given, else the most the limit holds)."""
    wanted: dict[tuple[Any, ...], Any] = {}
    for t in job.tasks:
        wanted.setdefault(signature(t), t)
    first = list(wanted.values())
    kind = job.kinds[first[0].kind]
    if any(job.kinds[t.kind] is not kind for t in first):
        raise ProbeError(f"group {job.group}: out of core trains one kind per group; put {sorted(job.kinds)} in"
                         " separate plan entries or set out_of_core: never")
    jobs = [probe_job(job, t) for t in first]
    info = job.arrays[0]
    per_sample = not _batched(kind)
    R = 1 if kind.accepts == ("sample",) else _tokens(job)
    solves = _sample_solves(kind, jobs) if per_sample else _solves(kind, jobs, len(job.rows), R)
    rows = int(block_rows or default_block_rows(info, "float64"))
    spec = subsample.IterSpec(job.root, job.rows, kind, R, rows, solves, job.dense_tokens, per_sample)
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


def _batched(kind: Any) -> bool:
    """The batched logistic kinds (linear, pooled); the others (conv_spatial, detect) fit one
    model per probe on whole samples (``fit_scaled``, ``scored``)."""
    from probes.kinds.linear import LinearProbe

    return issubclass(kind, LinearProbe)


def _by_params_and_split(jobs: list[Job]) -> list[list[int]]:
    """Jobs with the same params and split share one Solve (as in probes/kinds/linear.py)."""
    by: dict[tuple[str, bytes, bytes], list[int]] = defaultdict(list)
    for j, jb in enumerate(jobs):
        by[(params_json(jb.params), jb.fold.train.tobytes(), jb.fold.test.tobytes())].append(j)
    return list(by.values())


def _sample_solves(kind: Any, jobs: list[Job]) -> list[subsample.IterSolve]:
    """Per-sample kinds: a Solve's columns (each probe and its control, one model each) share the
    subsample of training samples, drawn among those any of them has a label for."""
    out = []
    for idx in _by_params_and_split(jobs):
        fold = jobs[idx[0]].fold
        params = kind.build(jobs[idx[0]], fold.seed).params.model_dump()   # the farm's grid filled in
        cols = []
        for j in idx:
            variants = [(False, jobs[j].target)]
            if jobs[j].control:
                variants.append((True, jobs[j].target.permuted(control_permutation(len(fold.train), fold.seed))))
            cols += [subsample.Column(j, c, t.values, t.labelled()) for c, t in variants]
        pick = np.logical_or.reduce([subsample.labelled_of(c) for c in cols]) & fold.train
        out.append(subsample.IterSolve(params, fold.train.copy(), fold.test.copy(), pick, cols, int(pick.sum()),
                                       None, int(fold.seed)))
    return out


def _solves(kind: Any, jobs: list[Job], n: int, R: int) -> list[subsample.IterSolve]:
    """Batched logistic kinds: one L-BFGS problem per Solve, every column in it."""
    out = []
    for idx in _by_params_and_split(jobs):
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
    if spec.per_sample:
        return _sample_costs(spec, vpr, block)
    held = sum(len(s.columns) * 8 + d * 4 for s in spec.solves)
    widest = max(len(s.columns) * _classes(s) for s in spec.solves)
    # The solve: X - mu, its whitened copy Z, Zᵀ and the allocator's slack (4 float32 copies of
    # the rows beside the subsample), per-row logits; the covariance's eigendecomposition ~5 d x d
    # float64.
    solve_row = 4 * d * 4 + 12 * widest * 4
    fixed = WORKER_BASE_ITERATIVE + len(spec.solves) * gram + 5 * gram + block
    return fixed, held, solve_row, spec.block_rows * spec.units * (2 * d * 4 + widest * 8)


def _sample_costs(spec: subsample.IterSpec, vpr: int, block: int) -> tuple[int, int, int, int]:
    """Per-sample kinds: the buffer holds vpr float32 per picked sample and Solve; the fit of one
    column adds the kind's training bytes per sample (its standardised copy, ...), the column's
    own copy when it lacks labels for some picked samples, and the labels; a test block is read,
    selected and standardised (3 copies) beside every column's predictions over the test split."""
    d = vpr // spec.units
    widest = max(spec.solves, key=lambda s: len(s.columns))
    label = max(np.asarray(c.labels[0]).size * 8 if c.labels.dtype != object else 64 for c in widest.columns)
    cells = max(label // 8, 1)
    step, per = spec.kind.train_bytes(widest.params, spec.units, d, cells)
    n_test = max(int(s.test.sum()) for s in spec.solves)
    preds = sum(len(s.columns) for s in spec.solves) * n_test * label
    fixed = WORKER_BASE_ITERATIVE + block + step + preds
    return fixed, len(spec.solves) * vpr * 4, per + vpr * 4 + 2 * label, spec.block_rows * vpr * 4 * 3


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
    unit, least = ("samples", MIN_TRAIN_SAMPLES) if spec.per_sample else ("rows", MIN_TRAIN_ROWS)
    how = spec.kind.name if spec.per_sample else "L-BFGS"
    what = (f"out-of-core {how} ({max(m)} training {unit} per batch{'' if cap is None else f', cap {cap}'},"
            f" {len(spec.solves)} batch(es), block of {spec.block_rows} rows)")
    if min(m) < min(least, min(s.candidates for s in spec.solves)):
        what += f"; under {least} training {unit}"
        peak = max(peak, fixed + test + least * (held + solve_row))
    return MemoryPlan(reads, int(peak), what, WORKER_BASE_ITERATIVE)


def check_fits(plan: MemoryPlan, limit: int | None, job: GroupJob) -> None:
    """Refuse an out-of-core plan that cannot fit, naming the settings that fix it.

    Parameters
    ----------
    plan
        The job's memory plan.
    limit
        Bytes per worker (None: nothing refused).
    job
        The job, named in the message.

    Raises
    ------
    ProbeError
        Its peak over FIT_FRACTION of ``limit``.
    """
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
    """Every layer of the job in this process (:func:`probes.subsample.fit_layer`), then its records.

    Parameters
    ----------
    job
        The group.
    spec
        Its spec (:func:`build_spec`).

    Returns
    -------
    GroupResult
        Its records and weights.
    """
    t0 = time.perf_counter()
    fits = [subsample.fit_layer(spec, info) for info in job.arrays]
    return finish(job, spec, fits, time.perf_counter() - t0)


def run_dask(client: Any, job: GroupJob, spec: subsample.IterSpec) -> GroupResult:
    """One task per layer (the spec travels once); the client gathers and records.

    Parameters
    ----------
    client
        The farm's Dask client.
    job
        The group.
    spec
        Its spec (:func:`build_spec`).

    Returns
    -------
    GroupResult
        Its records and weights, with each worker's peak RSS.
    """
    from probes.rss import peak_rss

    t0 = time.perf_counter()
    shared = client.scatter(spec, hash=False)
    futures = [client.submit(subsample.fit_layer, shared, info, pure=False, retries=1) for info in job.arrays]
    fits = client.gather(futures)
    result = finish(job, spec, fits, time.perf_counter() - t0, worker="dask:iterative")
    result.worker_peaks = client.run(peak_rss)
    return result


class IterativeTrainer(TrainerDefaults):
    """Iterative kinds out of core: a capped, recorded subsample of the training units, one task
    per layer. It takes a job the in-memory trainer planned when the plan's ``out_of_core`` says
    always, or (auto) when the in-memory plan exceeds the worker limit."""

    name = "iterative"
    needs_torch = True
    merges_layers = False
    suffix = ""
    remedy: str | None = ("set plan key out_of_core: auto (a capped training subsample), select fewer rows (where:) or"
                          " layers_per_task: 1,")

    def accepts(self, kind: type[Probe]) -> bool:
        return self.name in kind.trains and (_batched(kind) or all(hasattr(kind, m) for m in PER_SAMPLE_PROTOCOL))

    def takes_over(self, planned: Planned, settings: Settings) -> bool:
        if settings.out_of_core == "never" or not eligible(planned.job):
            return False
        limit = settings.limit
        return settings.out_of_core == "always" or (limit is not None
                                                    and planned.memory.peak_bytes > FIT_FRACTION * limit)

    def plan(self, job: GroupJob, settings: Settings) -> Planned:
        spec, memory = build_spec(job, settings.block_rows, settings.max_train_rows, settings.limit)
        return Planned(job, self, spec, memory)

    def check(self, planned: Planned, settings: Settings, fix: str | None) -> None:
        check_fits(planned.memory, settings.limit, planned.job)

    def run_local(self, planned: Planned) -> GroupResult:
        return run_local(planned.job, planned.spec)

    def finish(self, planned: Planned, computed: Any, seconds: float, worker: str) -> GroupResult:
        return finish(planned.job, planned.spec, computed, seconds, worker)

    def run_dask(self, run: DaskRun, work: list[Planned]) -> dict[str, int]:
        """The jobs one after another, each one task per layer."""
        for planned in work:
            try:
                run.take(run_dask(run.client, planned.job, planned.spec))
            except Exception as err:
                run.lost(planned.job, err)
        return {}


TRAINER = IterativeTrainer()
