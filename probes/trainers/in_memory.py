"""The in-memory trainer: what a Dask worker runs for kinds that fit on a group's features in memory.

The worker gets paths, array descriptions, row indices and small label arrays, never
activations: it reads only the Zarr chunks holding its rows, straight from the workspace folder
or the object store, and never opens the DuckDB manifest (the farm's client is its only writer
and does all manifest reads). It trains every probe of the group, batched per kind where the
kind can (:meth:`probes.kinds.base.Probe.evaluate`), and returns small result records plus each
probe's weights as safetensors bytes, which the client writes: a worker writes nothing, so it
needs no access to the workspace folder when the arrays are in a bucket.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from collections import defaultdict
from typing import Any

from probes.features import read_features
from probes.trainers.base import (
    WORKER_BASE_TORCH,
    DaskRun,
    MemoryPlan,
    MiB,
    Planned,
    Settings,
    TrainerDefaults,
    check_fits,
    rows_bytes,
)
from probes.trainers.group import GroupJob, GroupResult, probe_job, record, tasks_by_signature
from store.heap import tune_malloc

#: What fixes an in-memory group over the limit when neither its kinds nor another trainer say.
DEFAULT_FIX = "use kind ridge (streams chunk by chunk), select fewer rows (where:) or layers_per_task: 1,"


def run_group(job: GroupJob) -> GroupResult:
    """Train and score every probe of ``job`` (one BLAS/torch thread: parallelism is across workers).

    Parameters
    ----------
    job
        The group: its arrays are read whole, every selected row of every layer.

    Returns
    -------
    GroupResult
        A record and weights per probe; a probe whose kind raised is a failure, the others stand.
    """
    import torch
    from threadpoolctl import threadpool_limits

    tune_malloc()

    started = time.perf_counter()
    result = GroupResult(group=job.group, worker=f"{socket.gethostname()}:{os.getpid()}", started_at=time.time())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with threadpool_limits(1):
            Xs = [read_features(job.root, info, job.rows, job.dense_tokens) for info in job.arrays]
            result.read_seconds = time.perf_counter() - started
            _train_all(job, Xs, result)
    finally:
        torch.set_num_threads(threads)
    result.seconds = time.perf_counter() - started
    return result


def _train_all(job: GroupJob, Xs: list[Any], result: GroupResult) -> None:
    layer_index = {info.layer: g for g, info in enumerate(job.arrays)}
    # Probes over the same features that differ only in layer become one job over all layers.
    wanted = tasks_by_signature(job)
    batches: dict[tuple[str, str], list[tuple[Any, ...]]] = defaultdict(list)
    for sig in wanted:
        batches[(sig[1], sig[3])].append(sig)
    for (kind, _), sigs in batches.items():
        cls = job.kinds[kind]
        jobs = [probe_job(job, next(iter(wanted[s].values()))) for s in sigs]
        t0 = time.perf_counter()
        try:
            outcomes = cls.evaluate(Xs, jobs)
        except Exception as err:  # one bad batch must not sink the group's other probes
            msg = f"{type(err).__name__}: {err}"
            detail = traceback.format_exc(limit=6)
            for s in sigs:
                for t in wanted[s].values():
                    result.failures.append((t.key, msg if isinstance(err, ValueError) else f"{msg}\n{detail}"))
            continue
        per_probe = (time.perf_counter() - t0) / max(sum(len(wanted[s]) for s in sigs), 1)
        for j, sig in enumerate(sigs):
            for layer, task in wanted[sig].items():
                out = outcomes[layer_index[layer]][j]
                try:
                    result.records.append(record(job, task, out, per_probe, result.worker, result.weights))
                    result.flops += out.flops
                except Exception as err:
                    result.failures.append((task.key, f"{type(err).__name__}: {err}"))


def plan_in_memory(job: GroupJob) -> MemoryPlan:
    """The peak of an in-memory group: every selected row of its layers as float32, then copied
    (stacking, train/test split, standardising): about 3x.

    Parameters
    ----------
    job
        The group.

    Returns
    -------
    MemoryPlan
        Its reads and planned peak over a worker that imported torch and every kind.
    """
    info = job.arrays[0]
    feats = len(job.arrays) * len(job.rows) * info.values_per_row * 4
    return MemoryPlan(len(job.arrays) * rows_bytes(info, len(job.rows)), WORKER_BASE_TORCH + 3 * feats,
                      f"in-memory features ({feats / MiB:.0f} MiB float32)", WORKER_BASE_TORCH)


class InMemoryTrainer(TrainerDefaults):
    """Kinds trained on the group's features read whole (every kind's default)."""

    name = "in_memory"
    needs_torch = True
    merges_layers = False

    def plan(self, job: GroupJob, settings: Settings) -> Planned:
        return Planned(job, self, None, plan_in_memory(job))

    def check(self, planned: Planned, settings: Settings, fix: str | None) -> None:
        check_fits(planned.memory, settings.limit, planned.job, fix or DEFAULT_FIX)

    def run_local(self, planned: Planned) -> GroupResult:
        return run_group(planned.job)

    def finish(self, planned: Planned, computed: Any, seconds: float, worker: str) -> GroupResult:
        return computed   # the worker recorded its probes itself (run_group)

    def run_dask(self, run: DaskRun, work: list[Planned]) -> dict[str, int]:
        """At most ``run.window`` groups in flight (three per worker by default: every worker
        busy while the next one queues, and only a few groups' labels in the scheduler's memory),
        each taken as it completes."""
        from dask.distributed import as_completed

        client = run.client
        pending = iter(planned.job for planned in work)
        by_key: dict[str, GroupJob] = {}
        ac = as_completed(loop=client.loop)  # the farm's client is not the default one

        def submit_next() -> bool:
            job = next(pending, None)
            if job is None:
                return False
            fut = client.submit(run_group, job, key=f"probes-{job.group}", pure=False, retries=1)
            by_key[fut.key] = job
            ac.add(fut)
            return True

        for _ in range(run.window or max(3 * run.workers, 4)):
            if not submit_next():
                break
        for fut in ac:
            job = by_key.pop(fut.key)
            try:
                run.take(fut.result())
            except Exception as err:
                run.lost(job, err)
            fut.release()
            submit_next()
        return {}


TRAINER = InMemoryTrainer()
