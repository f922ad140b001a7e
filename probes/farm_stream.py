"""The farm's side of streamed statistics kinds (``ridge``): specs, memory plans, the Dask graph.

For each group of streamed probes the client builds one :class:`probes.stream.StreamSpec` per
parameter set (labels, masks and classes only), plans every task's peak bytes from the array
shape before anything runs, submits per layer ``map (partitions of whole chunks) -> tree of
merges -> solve -> map over test rows -> tree of sums``, and turns the solved weights into the
probes table's records and safetensors files, exactly as for in-memory kinds.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from probes import stream
from probes.errors import ProbeError
from probes.kinds.base import Job, Outcome, params_json
from probes.kinds.ridge import RidgeParams, RidgeProbe, gcv_pick, one_hot, regresses
from probes.splits import control_permutation
from probes.worker import GroupJob, GroupResult, _record, _signature

MiB = 1 << 20
#: RSS of an idle farm worker that imported numpy, scipy, zarr and the store reader (no torch):
#: 132 MiB measured on a LocalCluster worker here (python -m bench probes prints it); rounded up.
WORKER_BASE = 160 * MiB
#: The same with torch and every kind imported (in-memory kinds): 322 MiB measured; rounded up.
WORKER_BASE_TORCH = 340 * MiB
#: A plan must fit below this share of the worker limit: headroom for what the plan does not see
#: (allocator slack, Python objects); Dask restarts a worker past 95 % (probes/cluster.py).
FIT_FRACTION = 0.8
#: Default block: this many bytes of float32 features per read.
BLOCK_BYTES = 32 * MiB


@dataclass
class SpecGroup:
    spec: stream.StreamSpec
    sigs: list[tuple[Any, ...]]             # task signatures, one per Job (all layers share it)
    jobs: list[Job]
    kind: type[RidgeProbe] = RidgeProbe     # ridge, or a kind solving from ridge's statistics (lda, centroid)


def is_streaming(kind_cls: type) -> bool:
    return bool(getattr(kind_cls, "streaming", False))


def default_block_rows(info: Any, precision: str, block_bytes: int = BLOCK_BYTES) -> int:
    per = info.values_per_row * (np.dtype(info.stored_dtype).itemsize + 4 + np.dtype(precision).itemsize)
    return int(max(1, min(info.chunk_samples, block_bytes // max(per, 1))))


def build_specs(job: GroupJob, block_rows: int | None = None) -> list[SpecGroup]:
    """One StreamSpec per parameter set of the group's streamed tasks."""
    wanted: dict[tuple[Any, ...], Any] = {}
    for t in job.tasks:
        wanted.setdefault(_signature(t), t)
    by_params: dict[tuple[str, str], list[tuple[Any, ...]]] = defaultdict(list)
    for sig, t in wanted.items():
        by_params[(t.kind, params_json(t.params))].append(sig)
    out = []
    for (kind_name, _), sigs in by_params.items():
        first = [wanted[s] for s in sigs]
        jobs = [Job(key=t.key, target=job.targets[t.target], fold=job.folds[t.fold_id], params=t.params,
                    control=t.control == "shuffle", grid=job.grid) for t in first]
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
        if kind.stream_solver != "ridge" and regresses(RidgeParams(), jb.target):
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
    return stream.StreamSpec(job.root, job.rows, level, params.pool, kind.stream_alphas(params),
                             bool(getattr(params, "standardize", False)), params.precision, int(rows), solves,
                             job.dense_tokens, kind.stream_solver,
                             kind.stream_solver != "centroid" and not lw and shares_pass(solves),   # no XᵀX to share
                             kind.stream_count_class(params), lw)


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


# ----------------------------------------------------------------------------- memory plan


@dataclass
class MemoryPlan:
    read_bytes: int          # feature bytes one run of the group reads (all layers)
    peak_bytes: int          # the largest task's planned peak, worker base included
    what: str                # which task sets the peak


def plan_stream(specs: list[SpecGroup], job: GroupJob) -> MemoryPlan:
    """Each streamed task's peak from shapes alone: Gram matrices, one block, the solve's factor."""
    info = job.arrays[0]
    vpr = info.values_per_row
    item = np.dtype(info.stored_dtype).itemsize
    peaks: list[tuple[int, str]] = []
    read = 0
    for g in specs:
        sp = g.spec
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
        counts = len(sp.rows) * sum(len(s.variants) for s in sp.solves) * A * 8 if sp.count_class is not None else 0
        moving = 8 * d * d * 8 if sp.ledoit_wolf else 0   # Moments.moved's d×d temporaries (merge, solve)
        held = (f"lda shrinkage auto's per-class moments, {gram / MiB:.0f} MiB (a fixed shrinkage needs one XᵀX)"
                if sp.ledoit_wolf else f"{gram / MiB:.0f} MiB of statistics")
        peaks += [(2 * gram + block, f"map (2 x {held}, block of {sp.block_rows} rows)"),
                  (2 * gram + moving, f"merge (2 x {held})"),
                  (gram + (2 if sp.shared else 1) * xx + 2 * d * cols * A * 8 + moving,
                   "solve (statistics + one factor" + (", + one Solve's XᵀX copy)" if sp.shared else ")")),
                  (sp.block_rows * vpr * (item + 4 + 8) + chunk + 2 * d * cols * A * 8 + 2 * counts,
                   "score (a block of test rows)")]
        read += len(job.arrays) * _rows_bytes(info, len(sp.rows))
    peak, what = max(peaks)
    return MemoryPlan(read, WORKER_BASE + peak, what)


def plan_in_memory(job: GroupJob) -> MemoryPlan:
    """In-memory kinds read every selected row of the group's layers as float32, then copy them
    (stacking, train/test split, standardising): about 3x."""
    info = job.arrays[0]
    feats = len(job.arrays) * len(job.rows) * info.values_per_row * 4
    return MemoryPlan(len(job.arrays) * _rows_bytes(info, len(job.rows)), WORKER_BASE_TORCH + 3 * feats,
                      f"in-memory features ({feats / MiB:.0f} MiB float32)")


def _rows_bytes(info: Any, n: int) -> int:
    if info.layout == "dense":
        return n * info.values_per_row * np.dtype(info.stored_dtype).itemsize
    return int(info.bytes * n / max(info.n_samples, 1))


def check_fits(plan: MemoryPlan, limit: int | None, job: GroupJob, streamed: bool, fix: str | None = None) -> None:
    """A ProbeError naming the setting that fixes a plan whose task cannot fit the worker limit
    (``fix``: the kinds' own remedy, said before more memory)."""
    if limit is None or plan.peak_bytes <= FIT_FRACTION * limit:
        return
    need = plan.peak_bytes / FIT_FRACTION / MiB
    fix = fix or ("set --block-rows lower (plan key block_rows), kind ridge's precision: float32 (halves XᵀX),"
                  if streamed else "use kind ridge (streams chunk by chunk), select fewer rows (where:) or"
                  " layers_per_task: 1,")
    raise ProbeError(
        f"group {job.group} ({job.arrays[0].key()}, {len(job.arrays)} layer(s)) needs {plan.peak_bytes / MiB:.0f} MiB per"
        f" worker at its peak ({plan.what}), over {FIT_FRACTION:.0%} of the {limit / MiB:.0f} MiB worker memory limit:"
        f" {fix} or raise --memory-limit to at least {need:.0f}MiB"
    )


# ----------------------------------------------------------------------------- running


def fit_layer(call: Callable[..., Any], spec: Any, info: Any, parts: int, rows: np.ndarray) -> Any:
    """map (partitions of whole chunks) -> tree of merges -> solve. ``call(fn, *args)`` runs a
    task here, or submits it to Dask and returns its future."""
    cuts = stream.partitions(rows, info.chunk_samples, parts)
    maps = [call(stream.accumulate, spec, info, lo, hi) for lo, hi in cuts]
    return call(stream.solve, spec, stream.tree_reduce(maps, lambda a, b: call(stream.merge, a, b)))


def score_layer(call: Callable[..., Any], spec: Any, info: Any, parts: int, sol: Any, rows: np.ndarray) -> Any:
    """map over the test rows -> tree of sums."""
    cuts = stream.partitions(rows, info.chunk_samples, parts)
    tested = [call(stream.score, spec, info, lo, hi, sol) for lo, hi in cuts]
    return stream.tree_reduce(tested, lambda a, b: call(stream.add_scores, a, b))


def run_local(job: GroupJob, specs: list[SpecGroup]) -> GroupResult:
    t0 = time.perf_counter()
    sols, scores = [], []
    for g in specs:
        for info in job.arrays:
            # Two partitions: the in-process path runs the same merges as the cluster does.
            sols.append(fit_layer(lambda fn, *a: fn(*a), g.spec, info, 2, job.rows))
            scores.append(score_layer(lambda fn, *a: fn(*a), g.spec, info, 2, sols[-1], job.rows))
    return finish(job, specs, sols, scores, time.perf_counter() - t0)


def layers_in_flight(specs: list[SpecGroup], job: GroupJob, limit: int | None) -> int:
    """How many layers' statistics may be in flight at once: one when a layer's Gram matrices are
    large (then a worker holds at most what plan_stream planned), more when they are small (the
    latency of one solve per layer then no longer idles the workers)."""
    d = job.arrays[0].item_shape[-1]
    held = sum(2 * (len(g.spec.solves) + g.spec.shared) * d * d * np.dtype(g.spec.precision).itemsize
               for g in specs if g.spec.method != "centroid")
    held += sum(6 * d * d * 8 * len(v.classes if v.classes is not None else []) for g in specs if g.spec.ledoit_wolf
                for s in g.spec.solves for v in s.variants)
    held = held or 1
    room = (FIT_FRACTION * limit - WORKER_BASE) if limit else 256 * MiB
    return int(max(1, min(8, room // held)))


def run_dask(client: Any, job: GroupJob, specs: list[SpecGroup], parts: int, limit: int | None = None) -> GroupResult:
    """Each layer: maps on every worker, merges, one solve, then the score maps; a bounded number
    of layers in flight (:func:`layers_in_flight`). Specs travel to the workers once (scatter)."""
    t0 = time.perf_counter()

    def call(fn: Callable[..., Any], *args: Any) -> Any:
        return client.submit(fn, *args, pure=False, retries=1)

    scattered = [client.scatter(g.spec, hash=False) for g in specs]
    todo = [(scattered[i], info) for i in range(len(specs)) for info in job.arrays]
    k = layers_in_flight(specs, job, limit)
    sols: list[Any] = [None] * len(todo)
    scores: list[Any] = [None] * len(todo)
    for i, (spec, info) in enumerate(todo[:k]):
        sols[i] = fit_layer(call, spec, info, parts, job.rows)
    for i, (spec, info) in enumerate(todo):
        sols[i].exception()  # blocks until layer i is solved (or failed: gather raises it below)
        if i + k < len(todo):
            nspec, ninfo = todo[i + k]
            sols[i + k] = fit_layer(call, nspec, ninfo, parts, job.rows)
        scores[i] = score_layer(call, spec, info, parts, sols[i], job.rows)
    got_sols, got_scores = client.gather(sols), client.gather(scores)
    result = finish(job, specs, got_sols, got_scores, time.perf_counter() - t0, worker=f"dask:{parts}")
    result.worker_peaks = client.run(stream._rss)   # each worker's high-water RSS so far
    return result


def finish(job: GroupJob, specs: list[SpecGroup], sols: list[stream.Solution], scores: list[stream.Scores],
           seconds: float, worker: str = "stream") -> GroupResult:
    """Records and weights of every probe, from the solved layers (client side)."""
    import os
    import socket

    result = GroupResult(group=job.group, worker=worker or f"{socket.gethostname()}:{os.getpid()}", started_at=time.time())
    result.rss_peak = max([x.rss_peak for x in sols] + [x.rss_peak for x in scores] + [0])
    result.read_bytes = sum(x.read_bytes for x in scores) + sum(x.read_bytes for x in sols)
    wanted: dict[tuple[Any, ...], dict[int, Any]] = defaultdict(dict)
    for t in job.tasks:
        wanted[_signature(t)][t.layer] = t
    k = 0
    n_probes = max(len(job.tasks), 1)
    for g in specs:
        for info in job.arrays:
            sol, sc = sols[k], scores[k]
            k += 1
            flops = (sol.flops + sc.flops) / max(len(g.jobs), 1)
            for j, sig in enumerate(g.sigs):
                task = wanted[sig].get(info.layer)
                if task is None:
                    continue
                try:
                    out = _outcome(g, j, sol, sc, flops)
                    result.records.append(_record(job, task, out, seconds / n_probes, result.worker, result.weights))
                    result.flops += out.flops
                except (ProbeError, ValueError) as err:
                    result.failures.append((task.key, f"{type(err).__name__}: {err}"))
    result.seconds = seconds
    return result


def _outcome(g: SpecGroup, j: int, sol: stream.Solution, sc: stream.Scores, flops: float) -> Outcome:
    sp, job = g.spec, g.jobs[j]
    found: dict[bool, tuple[int, int]] = {}
    for s, solve in enumerate(sp.solves):
        for v, var in enumerate(solve.variants):
            if var.job == j:
                found[var.control] = (s, v)
    s, v = found[False]
    var = sp.solves[s].variants[v]
    W_all, b_all, gcv = sol.W[s], sol.b[s], sol.gcv[s]
    if W_all is None or b_all is None or gcv is None:
        raise ProbeError(f"{g.kind.name} on {job.target.name}: fewer than 2 labelled training rows; select more rows")
    pick = gcv_pick(gcv[var.start : var.stop])
    by_alpha = _test_scores(sc, s, v, var)
    ctrl = None
    if True in found:
        cs, cv = found[True]
        cvar = sp.solves[cs].variants[cv]
        control_gcv = sol.gcv[cs]
        if sol.W[cs] is not None and control_gcv is not None:
            cpick = gcv_pick(control_gcv[cvar.start : cvar.stop])
            ctrl = float(_test_scores(sc, cs, cv, cvar)[cpick] if sp.count_class is None
                         else _exact(*_counts(sp, sc, cs, cv, cpick)[1:]))
    probe = g.kind.build(job, job.fold.seed)
    W, b = W_all[:, var.start : var.stop, pick], b_all[var.start : var.stop, pick]
    regress = var.classes is None
    probe.state_ = {"coef": np.ascontiguousarray(W.T), "intercept": np.ascontiguousarray(b),
                    "classes": np.zeros(0, np.int64) if var.classes is None else var.classes}
    probe.meta_ = {"task": "regress" if regress else "classify"}
    metrics: dict[str, Any] = {"task": probe.meta_["task"], "n_train_rows": int(sol.n_train[s]),
                               "n_test_rows": int(sc.count[s][v]), "streamed": True}
    if sp.method == "ridge":
        probe.meta_["alpha"] = sp.alphas[pick]
        metrics.update(alpha=sp.alphas[pick], alphas=list(sp.alphas), by_alpha=[float(x) for x in by_alpha])
    if sp.count_class is not None:   # hidden_number_ridge: N_H per test board against its count
        return _count_outcome(g, j, sol, sc, (s, v, pick), ctrl, metrics, flops, probe)
    return Outcome("r2" if regress else "accuracy", float(by_alpha[pick]), ctrl,
                   int((job.target.labelled() & job.fold.train).sum()), int((job.target.labelled() & job.fold.test).sum()),
                   metrics, probe, flops)


def _counts(sp: stream.StreamSpec, sc: stream.Scores, s: int, v: int, pick: int) -> tuple[np.ndarray, ...]:
    """(positions, predicted counts, true counts) of a variant's test samples."""
    solve = sp.solves[s]
    tested = np.flatnonzero(solve.test.any(1))
    truth = (solve.codes[tested, :, v] == sp.count_class).sum(1)
    return tested, sc.per_sample[s][tested, v, pick], truth.astype(np.float64)


def _exact(n_h: np.ndarray, n_g: np.ndarray) -> float:
    return float((n_h == n_g).mean()) if len(n_g) else float("nan")


def _count_outcome(g: SpecGroup, j: int, sol: stream.Solution, sc: stream.Scores, at: tuple[int, int, int],
                   ctrl: float | None, metrics: dict[str, Any], flops: float, probe: Any) -> Outcome:
    """The score of a counting kind: exact match of each test sample's count of predicted units."""
    from probes.kinds.base import PerSample
    from probes.kinds.hidden_number import count_metrics

    s, v, pick = at
    tested, n_h, n_g = _counts(g.spec, sc, s, v, pick)
    var = g.spec.solves[s].variants[v]
    metrics |= count_metrics(n_h, n_g) | {"token_accuracy": float(_test_scores(sc, s, v, var)[pick])}
    job = g.jobs[j]
    boards = int((job.target.labelled() & job.fold.train).sum())
    return Outcome(g.kind.metric, _exact(n_h, n_g), ctrl, boards, len(tested), metrics, probe, flops,
                   predictions=PerSample(tested, n_h, n_g, (n_h == n_g).astype(np.float64)))


def _test_scores(sc: stream.Scores, s: int, v: int, var: stream.Variant) -> np.ndarray:
    if var.classes is not None:
        return sc.hits[s][v] / sc.count[s][v] if sc.count[s][v] else np.full(sc.hits[s].shape[1], np.nan)
    n = sc.count[s][v]
    ss = sc.syy[s][v] - sc.sy[s][v] ** 2 / n if n else 0.0
    return 1.0 - sc.sse[s][v] / ss if ss > 0 else np.full(sc.sse[s].shape[1], np.nan)
