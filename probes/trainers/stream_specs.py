"""The streamed trainer's plan of a group (``ridge`` and the kinds solving from its statistics):
one :class:`probes.stream.StreamSpec` per parameter set (labels, masks and classes only), and
every task's peak bytes from the array's shape before anything runs.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from probes import stream
from probes.errors import ProbeError
from probes.kinds.base import Job, params_json
from probes.kinds.ridge import RidgeProbe, classifiable, one_hot, regresses
from probes.ridge_dual import chooses_dual
from probes.splits import control_permutation
from probes.trainers.base import WORKER_BASE, MemoryPlan, MiB, default_block_rows, rows_bytes
from probes.trainers.group import GroupJob, probe_job, signature


@dataclass
class SpecGroup:
    """One parameter set's streamed probes of a group: their spec, signatures and kind Jobs."""

    spec: stream.StreamSpec
    sigs: list[tuple[Any, ...]]             # task signatures, one per Job (all layers share it)
    jobs: list[Job]
    kind: type[RidgeProbe] = RidgeProbe     # ridge, or a kind solving from ridge's statistics (lda, centroid)
    where: list[Where] | None = field(default=None, repr=False)   # per Job, built once (:func:`where_of`)


@dataclass
class Where:
    """What every layer's outcome of one Job shares: its columns and its labelled row counts."""

    own: tuple[int, int]                    # (Solve, Variant) of the probe
    control: tuple[int, int] | None         # ... of its shuffled-label control
    n_train: int
    n_test: int
    probe: RidgeProbe                       # built once; each layer's probe is a copy with its own weights


def where_of(g: SpecGroup) -> list[Where]:
    """Each Job's columns, found in one pass over the variants (not one per probe and layer)."""
    if g.where is None:
        found: list[dict[bool, tuple[int, int]]] = [{} for _ in g.jobs]
        for s, solve in enumerate(g.spec.solves):
            for v, var in enumerate(solve.variants):
                found[var.job][var.control] = (s, v)
        g.where = []
        for job, at in zip(g.jobs, found, strict=True):
            labelled = job.target.labelled()
            g.where.append(Where(at[False], at.get(True), int((labelled & job.fold.train).sum()),
                                  int((labelled & job.fold.test).sum()), g.kind.build(job, job.fold.seed)))
    return g.where


def build_specs(job: GroupJob, block_rows: int | None = None) -> list[SpecGroup]:
    """One StreamSpec per parameter set of the group's streamed tasks."""
    wanted: dict[tuple[Any, ...], Any] = {}
    for t in job.tasks:
        wanted.setdefault(signature(t), t)
    by_params: dict[tuple[str, str], list[tuple[Any, ...]]] = defaultdict(list)
    for sig, t in wanted.items():
        by_params[(t.kind, params_json(t.params))].append(sig)
    out = []
    for (kind_name, _), sigs in by_params.items():
        first = [wanted[s] for s in sigs]
        jobs = [probe_job(job, t) for t in first]
        kind = job.kinds[kind_name]
        if not issubclass(kind, RidgeProbe):   # streamed kinds solve from ridge's statistics
            raise ProbeError(f"kind {kind_name} is marked streaming but does not solve from probes/stream.py's statistics")
        params = kind.check_params(jobs[0].params)
        levels: set[Literal["token", "sample"]] = {"token" if j.target.shape == "token" else "sample" for j in jobs}
        for level in sorted(levels):  # token and sample targets read different units: two specs
            idx = [i for i, j in enumerate(jobs) if ("token" if j.target.shape == "token" else "sample") == level]
            spec = _spec(job, [jobs[i] for i in idx], kind, params, level, block_rows)
            out.append(SpecGroup(spec, [sigs[i] for i in idx], [jobs[i] for i in idx], kind))
    return out


def _spec(job: GroupJob, jobs: list[Job], kind: type[RidgeProbe], params: Any, level: Literal["token", "sample"],
          block_rows: int | None) -> stream.StreamSpec:
    n = len(job.rows)
    designs: dict[tuple[bytes, bytes], dict[str, Any]] = {}
    for j, jb in enumerate(jobs):
        if kind.stream_solver != "ridge" and not classifiable(jb.target):
            raise ProbeError(f"kind {kind.name} classifies; target {jb.target.name} holds numbers: use kind ridge")
        regress = kind.stream_solver == "ridge" and regresses(params, jb.target)
        fold = jb.fold
        variants = [(False, jb.target)]
        if jb.control:
            variants.append((True, jb.target.permuted(control_permutation(n, fold.seed))))
        for is_control, tv in variants:
            if regress:
                y = np.asarray(tv.as_numeric() if tv.shape == "sample" else tv.values, dtype=np.float64)
                y = y.reshape(n, -1)
                labelled = ~np.isnan(y)
            else:
                y = np.asarray(tv.values).reshape(n, -1).astype(np.int64)
                labelled = y >= 0
            train, test = kind.stream_units(y, labelled, fold, params, fold.seed)
            d = designs.setdefault((train.tobytes(), test.tobytes()), {"train": train, "test": test, "cols": [], "codes": [],
                                                                       "variants": []})
            start = sum(c.shape[-1] for c in d["cols"])
            cols: np.ndarray
            classes: np.ndarray | None
            codes: np.ndarray
            if regress:
                cols, classes, codes = np.nan_to_num(y)[..., None], None, np.full(y.shape, -1, np.int64)
            else:
                classes = np.unique(y[train]).astype(np.int64)
                cols, codes = one_hot(y, classes if len(classes) else np.zeros(1, np.int64)), y
            d["cols"].append(cols)
            d["codes"].append(codes)
            d["variants"].append(stream.Variant(j, is_control, start, start + cols.shape[-1], classes))
    solves = [stream.Solve(d["train"], d["test"], np.concatenate(d["cols"], -1), np.stack(d["codes"], -1), d["variants"])
              for d in designs.values()]
    info = job.arrays[0]
    rows = block_rows or default_block_rows(info, params.precision)
    lw = getattr(params, "shrinkage", None) == "auto"      # lda: per-class moments, nothing shared
    alphas = kind.stream_alphas(params)
    dual = kind.stream_solver == "ridge" and solves_dual(solves, info.item_shape[-1], len(alphas))
    return stream.StreamSpec(job.root, job.rows, level, params.pool, alphas,
                             bool(getattr(params, "standardize", False)), params.precision, int(rows), solves,
                             job.dense_tokens, kind.stream_solver,
                             kind.stream_solver != "centroid" and not lw and not dual and shares_pass(solves),
                             kind.stream_count_class(params), lw, dual)


def solves_dual(solves: list[stream.Solve], d: int, alphas: int) -> bool:
    """Whether ridge keeps its rows (training and test) and solves in its dual form
    (probes/ridge_dual.py): fewer rows than features, and fewer flops than XᵀX and its factors."""
    held = int(stream.gathered(solves).sum()) if solves else 0
    return chooses_dual([float(s.train.sum()) for s in solves], held, d, [s.Y.shape[-1] for s in solves], alphas)


#: Share one pass between Solves when it accumulates at most this share of the rows that one
#: pass per Solve would (rows cost XᵀX updates: d² each).
SHARE_BELOW = 0.8


def shares_pass(solves: list[stream.Solve]) -> bool:
    """Whether Solves that differ in their split (seeds) accumulate the union of their training
    units once plus each one's left-out units, rather than each its own training units."""
    if len(solves) < 2:
        return False
    union = np.logical_or.reduce([s.train for s in solves])
    own = sum(int(s.train.sum()) for s in solves)
    shared = int(union.sum()) + sum(int((union & ~s.train).sum()) for s in solves)
    return shared <= SHARE_BELOW * own



def plan_stream(specs: list[SpecGroup], job: GroupJob) -> MemoryPlan:
    """Each streamed task's peak from shapes alone: Gram matrices, one block, the solve's factor."""
    info = job.arrays[0]
    peaks = [peak for g in specs for peak in task_peaks(g.spec, info)]
    read = len(specs) * len(job.arrays) * rows_bytes(info, len(job.rows))
    peak, what = max(peaks)
    return MemoryPlan(read, WORKER_BASE + peak, what)


def task_peaks(sp: stream.StreamSpec, info: Any) -> list[tuple[int, str]]:
    """(bytes, which task) of each kind of task of one spec over a layer shaped as ``info``."""
    vpr = info.values_per_row
    item = np.dtype(info.stored_dtype).itemsize
    d = info.item_shape[-1]
    p = np.dtype(sp.precision).itemsize
    A = len(sp.alphas)
    cols = sum(s.Y.shape[-1] for s in sp.solves)
    xx = 0 if sp.method == "centroid" or sp.ledoit_wolf else d * d * p   # class means need no XᵀX (stream._designs)
    gram = sum(xx + d * s.Y.shape[-1] * 8 for s in sp.solves) + (xx + d * cols * 8 if sp.shared else 0)
    if sp.ledoit_wolf:   # 3 float64 d×d moments per class per variant (probes/moments.py)
        gram += sum(3 * d * d * 8 * len(v.classes if v.classes is not None else []) for s in sp.solves
                    for v in s.variants)
    # The reader decodes whole stored chunks: one chunk's values sit beside the block being read.
    chunk = min(info.chunk_samples, len(sp.rows)) * vpr * item
    block = sp.block_rows * vpr * (item + 4 + p) + chunk
    # Scores.per_sample: one float64 per selected sample, variant and alpha (a sum holds two).
    per_sample = len(sp.rows) * sum(len(s.variants) for s in sp.solves) * A * 8
    moving = 8 * d * d * 8 if sp.ledoit_wolf else 0   # Moments.moved's d×d temporaries (merge, solve)
    held = (f"lda shrinkage auto's per-class moments, {gram / MiB:.0f} MiB (a fixed shrinkage needs one XᵀX)"
            if sp.ledoit_wolf else f"{gram / MiB:.0f} MiB of statistics")
    if sp.dual:   # no test pass: the solve scores the rows it holds
        return dual_peaks(sp, d, block, 2 * d * cols * A * 8 + 2 * per_sample)
    return [(2 * gram + block, f"map (2 x {held}, block of {sp.block_rows} rows)"),
            (2 * gram + moving, f"merge (2 x {held})"),
            (gram + (2 if sp.shared else 1) * xx + 2 * d * cols * A * 8 + moving,
             "solve (statistics + one factor" + (", + one Solve's XᵀX copy)" if sp.shared else ")")),
            (sp.block_rows * vpr * (item + 4 + 8) + chunk + 2 * d * cols * A * 8 + 2 * per_sample,
             "score (a block of test rows, per-sample sums)")]


def dual_rows(sp: stream.StreamSpec, d: int) -> tuple[int, int]:
    """(units a dual spec keeps, training and test, and their bytes: features in its precision + unit ids)."""
    n = int(stream.gathered(sp.solves).sum()) if sp.solves else 0
    return n, n * (d * np.dtype(sp.precision).itemsize + 8)


def dual_peaks(sp: stream.StreamSpec, d: int, block: int, scored: int) -> list[tuple[int, str]]:
    """Peaks of a dual spec's tasks (probes/ridge_dual.py): the rows in place of XᵀX. The map fills
    its share of them; a merge holds both operands and their concatenation; the solve one Solve's
    rows again and their float64 centred copy (or, scoring, the test rows' float64 copy), the n×n
    Gram matrix and its eigenvectors, and ``scored`` (weights, predictions' sums)."""
    n, rows = dual_rows(sp, d)
    held = f"{rows / MiB:.0f} MiB of training and test rows ({n} x {d}, dual ridge)"
    solve = rows + n * d * (np.dtype(sp.precision).itemsize + 8) + 2 * n * n * 8 + scored
    return [(rows + block, f"map ({held}, block of {sp.block_rows} rows)"),
            (2 * rows, f"merge (2 x {held})"),
            (solve, f"solve ({held} + a float64 copy + the {n} x {n} Gram matrix)")]
