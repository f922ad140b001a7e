"""How the farm picks a trainer for each job: from the kinds' preferences (``Probe.trains``),
never from their types.

A job whose kinds want different first trainers becomes one job per trainer; jobs of trainers
that merge layers become one job per layer set; then each job's first common trainer plans it,
and a later one in the kinds' preferences may take it over (the iterative trainer, when the
in-memory plan does not fit the worker limit).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from probes.errors import ProbeError
from probes.trainers.base import Planned, Settings, Trainer
from probes.trainers.group import GroupJob, signature
from stimuli.registry import Registry

#: The trainers by the name kinds give in ``trains``; the order is the order the farm runs them
#: on Dask (streamed layers first, in one pipeline; then out-of-core groups; then in-memory ones).
TRAINERS: Registry[Trainer] = Registry("trainer", error=ProbeError)
for _name in ("streamed", "iterative", "in_memory"):
    TRAINERS.add_lazy(_name, f"probes.trainers.{_name}:TRAINER")


def trainer(name: str) -> Trainer:
    """The trainer registered as ``name`` (a ProbeError listing the known ones otherwise).

    Parameters
    ----------
    name
        As a kind's ``trains`` gives it.

    Returns
    -------
    Trainer
        The trainer.
    """
    return TRAINERS.get(name)


def preferences(job: GroupJob) -> list[Trainer]:
    """The trainers every kind of ``job`` accepts, in the first task's kind's order of preference.

    Parameters
    ----------
    job
        A job whose kinds share their first trainer (:func:`split_by_trainer`).

    Returns
    -------
    list[Trainer]
        At least one; a ProbeError when the kinds share none.
    """
    kinds = list(dict.fromkeys(job.kinds[t.kind] for t in job.tasks))
    names = kinds[0].trains if kinds else ("in_memory",)
    got = [trainer(n) for n in names if all(n in k.trains for k in kinds)]
    got = [t for t in got if all(t.accepts(k) for k in kinds)]
    if not got:
        raise ProbeError(f"group {job.group}: kinds {', '.join(sorted(k.name for k in kinds))} share no trainer;"
                         " put them in separate plan entries")
    return got


def split_by_trainer(job: GroupJob) -> list[GroupJob]:
    """The job's tasks as one job per first-preferred trainer (a streamed part's group gets its
    trainer's suffix), in the trainers' order; a job whose kinds agree stays whole.

    Parameters
    ----------
    job
        One group of the plan.

    Returns
    -------
    list[GroupJob]
        One job per trainer.
    """
    firsts = {t.key: job.kinds[t.kind].trains[0] for t in job.tasks}
    order = TRAINERS.names()
    names = sorted(set(firsts.values()), key=lambda n: (order.index(n) if n in order else len(order), n))
    if len(names) <= 1:
        return [job]
    return [replace(job, tasks=[t for t in job.tasks if firsts[t.key] == n],
                    group=f"{job.group}{trainer(n).suffix}") for n in names]


def plan_work(jobs: list[GroupJob], block_rows: int | None = None, limit: int | None = None,
              out_of_core: str = "auto", max_train_rows: int | None = None, check: bool = True) -> list[Planned]:
    """Each job planned by the trainer its kinds prefer; a ProbeError before training if one
    cannot fit ``settings.limit`` (``check``).

    Parameters
    ----------
    jobs
        The plan's groups.
    block_rows, limit, out_of_core, max_train_rows
        The plan's :class:`probes.trainers.base.Settings`.
    check
        Refuse what cannot fit (the dry run shows it instead).

    Returns
    -------
    list[Planned]
        One per job, after splitting by trainer and merging layers.
    """
    settings = Settings(block_rows, limit, out_of_core, max_train_rows)
    work: list[Planned] = []
    parts = [part for whole in jobs for part in split_by_trainer(whole)]
    # Streamed groups that differ only in their layers run as one: each layer is its own
    # map-reduce anyway, so one spec serves them all and their layers pipeline on the cluster.
    for job in merge_layers(parts, lambda j: preferences(j)[0].merges_layers):
        first, *rest = preferences(job)
        planned = first.plan(job, settings)
        for other in rest:
            if other.takes_over(planned, settings):
                planned = other.plan(job, settings)
                break
        if check:
            planned.trainer.check(planned, settings, _fix(job, planned, rest))
        work.append(planned)
    return work


def _fix(job: GroupJob, planned: Planned, rest: list[Trainer]) -> str | None:
    """What fixes a plan over the limit before more memory: a kind's own word, else the remedy of
    a trainer the kinds also accept that did not take the job."""
    kinds = {job.kinds[t.kind] for t in job.tasks}
    said = next((k.memory_fix for k in sorted(kinds, key=lambda k: k.name) if k.memory_fix), None)
    if said:
        return said
    # A trainer that would take this job, were the plan to let it (out_of_core: always).
    return next((t.remedy for t in rest if t is not planned.trainer and t.remedy and t.takes_over(
        planned, Settings(out_of_core="always"))), None)


def merge_layers(jobs: list[GroupJob], merges: Callable[[GroupJob], bool]) -> list[GroupJob]:
    """Jobs that differ only in their layers (same rows, arrays of one shape, the same probes per
    layer) become one job, in the place of the first: one spec built and sent for all its layers,
    and the layers pipelined (the streamed trainer's run_dask).

    Parameters
    ----------
    jobs
        The plan's jobs, in order.
    merges
        ``merges(job) -> bool``: whether the job's trainer merges layers; other jobs stay as they are.

    Returns
    -------
    list[GroupJob]
        The jobs, merged ones in the place of their first.
    """
    out: list[GroupJob] = []
    merged: dict[tuple[Any, ...], int] = {}
    for job in jobs:
        key = _merge_key(job) if merges(job) else None
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
    if not job.tasks:
        return None
    shapes = {(a.run, a.tap, a.site, a.tokens, a.layout, tuple(a.shape), a.stored_dtype, a.chunk_samples,
               a.values_per_row) for a in job.arrays}
    if len(shapes) != 1 or len({a.layer for a in job.arrays}) != len(job.arrays):
        return None
    return (job.workspace, id(job.rows), shapes.pop(), frozenset(signature(t) for t in job.tasks),
            tuple(sorted((k, id(v)) for k, v in job.targets.items())),
            tuple(sorted((k, id(v)) for k, v in job.folds.items())),
            tuple(sorted((k, id(v)) for k, v in job.kinds.items())), job.grid, job.dense_tokens, job.plan, job.save)

