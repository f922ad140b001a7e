"""The farm's side of streamed statistics kinds (``ridge``): specs, memory plans, the Dask graph.

For each group of streamed probes the client builds one :class:`probes.stream.StreamSpec` per
parameter set (labels, masks and classes only), plans every task's peak bytes from the array
shape before anything runs, submits per layer ``map (partitions of whole chunks) -> tree of
merges -> solve -> map over test rows -> tree of sums``, and turns the solved weights into the
probes table's records and safetensors files, exactly as for in-memory kinds.
"""

from __future__ import annotations

import copy
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np

from probes import stream, stream_layer
from probes.errors import ProbeError
from probes.kinds.base import Job, Outcome, PerSample, params_json
from probes.kinds.ridge import RidgeProbe, classifiable, gcv_pick, one_hot, regresses
from probes.ridge_dual import chooses_dual
from probes.splits import control_permutation
from probes.worker import GroupJob, GroupResult, _record, _signature, tasks_by_signature

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
    where: list[_Where] | None = field(default=None, repr=False)   # per Job, built once (:func:`_where`)


@dataclass
class _Where:
    """What every layer's outcome of one Job shares: its columns and its labelled row counts."""

    own: tuple[int, int]                    # (Solve, Variant) of the probe
    control: tuple[int, int] | None         # ... of its shuffled-label control
    n_train: int
    n_test: int
    probe: RidgeProbe                       # built once; each layer's probe is a copy with its own weights


def _where(g: SpecGroup) -> list[_Where]:
    """Each Job's columns, found in one pass over the variants (not one per probe and layer)."""
    if g.where is None:
        found: list[dict[bool, tuple[int, int]]] = [{} for _ in g.jobs]
        for s, solve in enumerate(g.spec.solves):
            for v, var in enumerate(solve.variants):
                found[var.job][var.control] = (s, v)
        g.where = []
        for job, at in zip(g.jobs, found, strict=True):
            labelled = job.target.labelled()
            g.where.append(_Where(at[False], at.get(True), int((labelled & job.fold.train).sum()),
                                  int((labelled & job.fold.test).sum()), g.kind.build(job, job.fold.seed)))
    return g.where


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


# ----------------------------------------------------------------------------- memory plan


@dataclass
class MemoryPlan:
    read_bytes: int          # feature bytes one run of the group reads (all layers)
    peak_bytes: int          # the largest task's planned peak, worker base included
    what: str                # which task sets the peak
    base: int = WORKER_BASE  # the idle worker's RSS the peak assumed (checked once workers are up: check_base)


def plan_stream(specs: list[SpecGroup], job: GroupJob) -> MemoryPlan:
    """Each streamed task's peak from shapes alone: Gram matrices, one block, the solve's factor."""
    info = job.arrays[0]
    peaks = [peak for g in specs for peak in task_peaks(g.spec, info)]
    read = len(specs) * len(job.arrays) * _rows_bytes(info, len(job.rows))
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


def plan_in_memory(job: GroupJob) -> MemoryPlan:
    """In-memory kinds read every selected row of the group's layers as float32, then copy them
    (stacking, train/test split, standardising): about 3x."""
    info = job.arrays[0]
    feats = len(job.arrays) * len(job.rows) * info.values_per_row * 4
    return MemoryPlan(len(job.arrays) * _rows_bytes(info, len(job.rows)), WORKER_BASE_TORCH + 3 * feats,
                      f"in-memory features ({feats / MiB:.0f} MiB float32)", WORKER_BASE_TORCH)


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


def check_base(work: list[tuple[GroupJob, Any, MemoryPlan]], measured: int, limit: int | None) -> int | None:
    """Once the workers are up and warm: a ProbeError when their measured RSS (``measured``, the
    largest), above the base a group's plan assumed, takes that group past the limit; else the
    limit left to streamed tasks (their base is WORKER_BASE). Workers hold more than planned when
    they import more: Dask starts each worker by re-running the imports of the client's main
    script, so a script that imports torch at its top level puts ~160 MiB more into every worker
    (320 MiB at rest instead of 160, measured)."""
    if limit is None:
        return limit
    for job, _, mem in work:
        extra = measured - mem.base
        if extra > 0 and mem.peak_bytes + extra > FIT_FRACTION * limit:
            need = (mem.peak_bytes + extra) / FIT_FRACTION / MiB
            raise ProbeError(
                f"the workers hold {measured / MiB:.0f} MiB each once started, {extra / MiB:.0f} MiB more than group"
                f" {job.group}'s plan assumed ({mem.base / MiB:.0f} MiB), which takes its peak ({mem.what}) to"
                f" {(mem.peak_bytes + extra) / MiB:.0f} MiB, over {FIT_FRACTION:.0%} of the {limit / MiB:.0f} MiB worker"
                " memory limit. Dask starts each worker by re-running the imports of the main script: move a script's"
                " imports of torch and of the farm (run_plan) into a function or under `if __name__ == \"__main__\":`,"
                f" or raise --memory-limit to at least {need:.0f}MiB")
    return limit - max(measured - WORKER_BASE, 0)


# ----------------------------------------------------------------------------- running


def run_local(job: GroupJob, specs: list[SpecGroup]) -> GroupResult:
    t0 = time.perf_counter()
    sols, scores = [], []
    for g in specs:
        for info in job.arrays:
            # Two partitions: the in-process path runs the same merges as the cluster does.
            sol, sc = stream_layer.run_layer(g.spec, info, 2, job.rows)
            sols.append(sol)
            scores.append(sc)
    return finish(job, specs, sols, scores, time.perf_counter() - t0)


def layers_in_flight(specs: list[SpecGroup], job: GroupJob, limit: int | None) -> int:
    """How many layers' statistics may be in flight at once: one when a layer's Gram matrices are
    large (then a worker holds at most what plan_stream planned), more when they are small (the
    latency of one solve per layer then no longer idles the workers)."""
    room = (FIT_FRACTION * limit - WORKER_BASE) if limit else 256 * MiB
    return int(max(1, min(8, room // _held_bytes(specs, job))))


def _held_bytes(specs: list[SpecGroup], job: GroupJob) -> int:
    """Statistics bytes one layer in flight keeps on the workers (2 copies: a merge's operands)."""
    d = job.arrays[0].item_shape[-1]
    held = sum(2 * (dual_rows(g.spec, d)[1] if g.spec.dual else
                    (len(g.spec.solves) + g.spec.shared) * d * d * np.dtype(g.spec.precision).itemsize)
               for g in specs if g.spec.method != "centroid")
    held += sum(6 * d * d * 8 * len(v.classes if v.classes is not None else []) for g in specs if g.spec.ledoit_wolf
                for s in g.spec.solves for v in s.variants)
    return held or 1


#: A layer whose selected rows hold at most this many stored bytes (and whose statistics are as
#: small) runs as one Dask task rather than a graph of maps, merges, a solve and test maps: at
#: the 1,000-probe bench's size (2,000 x 256 float32 = 2 MiB a layer) the ~7 task round trips
#: per layer, not the arithmetic, set the pace. Larger layers keep their partitions on all workers.
FUSE_BYTES = 64 * MiB


def fuses(specs: list[SpecGroup], job: GroupJob, parts: int, limit: int | None) -> bool:
    """Whether the group's layers each run as one task (:func:`probes.stream_layer.run_layer`).
    That task holds all ``parts`` partitions' statistics at once, so it must fit beside the plan."""
    info = job.arrays[0]
    if any(g.spec.ledoit_wolf for g in specs) or _rows_bytes(info, len(job.rows)) > FUSE_BYTES:
        return False
    stats = parts * _held_bytes(specs, job) // 2
    if stats > FUSE_BYTES:
        return False
    return limit is None or plan_stream(specs, job).peak_bytes + stats <= FIT_FRACTION * limit


@dataclass
class _Layer:
    """One (parameter set, layer) of a streamed group on its way through the cluster."""

    job: GroupJob
    group: SpecGroup
    info: Any
    wanted: dict[tuple[Any, ...], dict[int, Any]]   # the job's tasks by signature and layer
    fused: bool
    cap: int                        # how many layers may be in flight while this one is
    spec: Any = None                # the scattered spec's future
    sol: Any = None                 # the solution's future (graph only)
    done: Any = None                # the scores' future (fused: solution and scores)


def run_dask(client: Any, work: list[tuple[GroupJob, list[SpecGroup]]], parts: int, limit: int | None,
             take: Callable[[GroupResult], None], lost: Callable[[GroupJob, BaseException], None]) -> dict[str, int]:
    """Every layer of every streamed group in one pipeline: small layers as one task each
    (:func:`fuses`), large ones as maps on every worker, merges, a solve and test maps; a bounded
    number in flight (:func:`layers_in_flight`); each layer's probes recorded as it lands while
    the workers go on. Specs travel to the workers once per group (scatter). Returns each
    worker's peak RSS."""
    from dask.distributed import as_completed

    layers: list[_Layer] = []
    for job, specs in work:
        fused, wanted = fuses(specs, job, parts, limit), tasks_by_signature(job)
        cap = max(8, 2 * parts) if fused else layers_in_flight(specs, job, limit)
        layers += [_Layer(job, g, info, wanted, fused, cap) for g in specs for info in job.arrays]
    scattered: dict[int, Any] = {}
    remaining = Counter(id(x.group) for x in layers)
    ac = as_completed(loop=client.loop)   # the farm's client is not the default one
    by_key: dict[str, tuple[_Layer, bool]] = {}   # future key -> (layer, whether it ends the layer)
    todo = iter(layers)
    nxt, in_flight, last = next(todo, None), 0, time.perf_counter()
    while nxt is not None or by_key:
        while nxt is not None and (in_flight == 0 or in_flight < nxt.cap):
            _submit(client, nxt, parts, scattered)
            if not nxt.fused:   # a graph's layer leaves the bound once solved; its test maps may still run
                by_key[nxt.sol.key] = (nxt, False)
                ac.add(nxt.sol)
            by_key[nxt.done.key] = (nxt, True)
            ac.add(nxt.done)
            nxt, in_flight = next(todo, None), in_flight + 1
        layer, ends = by_key.pop(next(ac).key)
        if layer.fused or not ends:
            in_flight -= 1
        if not ends:
            continue
        try:
            sol, sc = layer.done.result() if layer.fused else client.gather([layer.sol, layer.done])
            now = time.perf_counter()
            take(finish_layer(layer.job, layer.group, layer.info, sol, sc, now - last, f"dask:{parts}", layer.wanted))
            last = now
        except Exception as err:
            lost(_layer_job(layer), err)
        remaining[id(layer.group)] -= 1
        if not remaining[id(layer.group)]:
            scattered.pop(id(layer.group), None)   # its last layer landed: the workers may drop the spec
        layer.sol = layer.done = layer.spec = None
    return client.run(stream._rss)   # each worker's high-water RSS so far


def _submit(client: Any, layer: _Layer, parts: int, scattered: dict[int, Any]) -> None:
    def call(fn: Callable[..., Any], *args: Any) -> Any:
        return client.submit(fn, *args, pure=False, retries=1)

    if id(layer.group) not in scattered:
        scattered[id(layer.group)] = client.scatter(layer.group.spec, hash=False)
    layer.spec = spec = scattered[id(layer.group)]
    rows = layer.job.rows
    if layer.fused:
        layer.done = call(stream_layer.run_layer, spec, layer.info, parts, rows)
    else:
        layer.sol = stream_layer.fit_layer(call, spec, layer.info, parts, rows)
        layer.done = stream_layer.score_layer(call, spec, layer.info, parts, layer.sol, rows, layer.group.spec.dual)


def _layer_job(layer: _Layer) -> GroupJob:
    """The job of one layer's probes of one parameter set (what a failed layer loses)."""
    sigs = set(layer.group.sigs)
    tasks = [t for t in layer.job.tasks if t.layer == layer.info.layer and _signature(t) in sigs]
    return replace(layer.job, tasks=tasks, arrays=[layer.info])


def merge_layers(jobs: list[GroupJob]) -> list[GroupJob]:
    """Streamed jobs that differ only in their layers (same rows, arrays of one shape, the same
    probes per layer) become one job, in the place of the first: one spec built and sent for all
    its layers, and the layers pipelined (:func:`run_dask`). Other jobs stay as they are."""
    out: list[GroupJob] = []
    merged: dict[tuple[Any, ...], int] = {}
    for job in jobs:
        key = _merge_key(job)
        if key is None or key not in merged:
            if key is not None:
                merged[key] = len(out)
            out.append(job)
            continue
        first = out[merged[key]]
        out[merged[key]] = replace(first, arrays=first.arrays + job.arrays, tasks=first.tasks + job.tasks,
                                   group=first.group.split("+")[0] + f"+{len(first.arrays) + len(job.arrays) - 1}")
    return out


def _merge_key(job: GroupJob) -> tuple[Any, ...] | None:
    if not job.tasks or not all(is_streaming(job.kinds[t.kind]) for t in job.tasks):
        return None
    shapes = {(a.run, a.tap, a.site, a.tokens, a.layout, tuple(a.shape), a.stored_dtype, a.chunk_samples,
               a.values_per_row) for a in job.arrays}
    if len(shapes) != 1 or len({a.layer for a in job.arrays}) != len(job.arrays):
        return None
    return (job.workspace, id(job.rows), shapes.pop(), frozenset(_signature(t) for t in job.tasks),
            tuple(sorted((k, id(v)) for k, v in job.targets.items())),
            tuple(sorted((k, id(v)) for k, v in job.folds.items())),
            tuple(sorted((k, id(v)) for k, v in job.kinds.items())), job.grid, job.dense_tokens, job.plan, job.save)


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
            result.records.append(_record(job, task, out, per_probe, result.worker, result.weights))
            result.flops += out.flops
        except (ProbeError, ValueError) as err:
            result.failures.append((task.key, f"{type(err).__name__}: {err}"))


def _outcome(g: SpecGroup, j: int, sol: stream.Solution, sc: stream.Scores, flops: float) -> Outcome:
    sp, job, where = g.spec, g.jobs[j], _where(g)[j]
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
