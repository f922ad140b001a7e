"""The streamed trainer: kinds solved from statistics streamed chunk by chunk (``ridge``,
``hidden_number_ridge``, ``lda``, ``nearest_centroid``).

The client builds each group's specs and plans every task's peak (probes/trainers/stream_specs.py),
submits per layer ``map (partitions of whole chunks) -> tree of merges -> solve -> map over test
rows -> tree of sums`` (probes/stream_layer.py; a small layer as one task), and turns the solved
weights into records (probes/trainers/stream_outcomes.py). Its workers never import torch.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from probes import stream_layer
from probes.rss import peak_rss
from probes.trainers.base import (
    FIT_FRACTION,
    WORKER_BASE,
    DaskRun,
    MiB,
    Planned,
    Settings,
    TrainerDefaults,
    check_fits,
    rows_bytes,
)
from probes.trainers.group import GroupJob, GroupResult, signature, tasks_by_signature
from probes.trainers.stream_outcomes import finish, finish_layer
from probes.trainers.stream_specs import SpecGroup, build_specs, dual_rows, plan_stream

#: What fixes a streamed group over the limit.
FIX = "set --block-rows lower (plan key block_rows), kind ridge's precision: float32 (halves XᵀX),"


def run_local(job: GroupJob, specs: list[SpecGroup]) -> GroupResult:
    """Every layer of the job in this process, cut into the partitions a cluster run would use.

    Parameters
    ----------
    job
        The group.
    specs
        Its specs (:func:`probes.trainers.stream_specs.build_specs`).

    Returns
    -------
    GroupResult
        Its records and weights.
    """
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
    if any(g.spec.ledoit_wolf for g in specs) or rows_bytes(info, len(job.rows)) > FUSE_BYTES:
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
    return dict(client.run(peak_rss))   # each worker's high-water RSS so far


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
    tasks = [t for t in layer.job.tasks if t.layer == layer.info.layer and signature(t) in sigs]
    return replace(layer.job, tasks=tasks, arrays=[layer.info])




class StreamedTrainer(TrainerDefaults):
    """Kinds whose statistics stream: no layer is ever held in memory."""

    name = "streamed"
    needs_torch = False
    merges_layers = True
    suffix = "s"

    def plan(self, job: GroupJob, settings: Settings) -> Planned:
        specs = build_specs(job, settings.block_rows)
        return Planned(job, self, specs, plan_stream(specs, job))

    def check(self, planned: Planned, settings: Settings, fix: str | None) -> None:
        check_fits(planned.memory, settings.limit, planned.job, fix or FIX)

    def run_local(self, planned: Planned) -> GroupResult:
        return run_local(planned.job, planned.spec)

    def finish(self, planned: Planned, computed: Any, seconds: float, worker: str) -> GroupResult:
        sols, scores = computed
        return finish(planned.job, planned.spec, sols, scores, seconds, worker)

    def run_dask(self, run: DaskRun, work: list[Planned]) -> dict[str, int]:
        """Every streamed layer of every job in one pipeline, recorded as each lands."""
        return run_dask(run.client, [(p.job, p.spec) for p in work], run.workers, run.limit, run.take, run.lost)


TRAINER = StreamedTrainer()
