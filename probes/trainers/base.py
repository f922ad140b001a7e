"""What every trainer of the farm provides (:class:`Trainer`), and what they share: the memory
plan of one job, the plan's settings, and the worker footprints plans are checked against.

A trainer takes a group of probes that share features (:class:`probes.trainers.group.GroupJob`)
and turns it into results: it plans the job's peak bytes from shapes before anything runs,
trains it here (:meth:`Trainer.run_local`) or on Dask (:meth:`Trainer.run_dask`), and turns what
its workers computed into the probes table's records (:meth:`Trainer.finish`). A probe kind says
which trainers may train it, in order of preference, in one class attribute,
:attr:`probes.kinds.base.Probe.trains`; the farm picks among them (probes/trainers/select.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from probes.errors import ProbeError

if TYPE_CHECKING:
    from probes.kinds.base import Probe
    from probes.trainers.group import GroupJob, GroupResult

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
class MemoryPlan:
    """One job's planned memory on a worker, from shapes alone."""

    read_bytes: int          # feature bytes one run of the group reads (all layers)
    peak_bytes: int          # the largest task's planned peak, worker base included
    what: str                # which task sets the peak
    base: int = WORKER_BASE  # the idle worker's RSS the peak assumed (checked once workers are up: check_base)


@dataclass(frozen=True)
class Settings:
    """What a plan says about how its jobs are trained (plan keys, or the command line's)."""

    block_rows: int | None = None     # samples per read block (None: ~BLOCK_BYTES of features)
    limit: int | None = None          # bytes per worker every task's peak is checked against
    out_of_core: str = "auto"         # iterative kinds: auto | always | never
    max_train_rows: int | None = None  # iterative kinds out of core: the subsample's cap


@dataclass
class Planned:
    """A job, the trainer that will train it, the trainer's own spec of the work and its memory plan."""

    job: GroupJob
    trainer: Trainer
    spec: Any
    memory: MemoryPlan


@dataclass
class DaskRun:
    """What a trainer needs to run its jobs on a Dask cluster."""

    client: Any
    workers: int                                  # workers the cluster has (at least 1)
    limit: int | None                             # streamed tasks' limit, after the workers' measured base
    window: int | None                            # in-memory groups in flight (None: three per worker)
    take: Callable[[GroupResult], None]           # each result, as it lands
    lost: Callable[[GroupJob, BaseException], None]   # a job whose task failed


class Trainer(Protocol):
    """One way of training a group of probes; the farm knows its trainers only through this."""

    #: the name kinds give in :attr:`probes.kinds.base.Probe.trains`
    name: str
    #: whether its workers import torch (the farm then warms them with every kind imported)
    needs_torch: bool
    #: whether jobs that differ only in their layers may become one job (one spec, layers pipelined)
    merges_layers: bool
    #: the group-name suffix of its part of a job whose kinds want different trainers
    suffix: str
    #: what a user changes to have this trainer take a job that another could not fit in memory
    remedy: str | None

    def accepts(self, kind: type[Probe]) -> bool:
        """Whether this trainer can train probes of ``kind`` at all."""
        ...

    def takes_over(self, planned: Planned, settings: Settings) -> bool:
        """Whether this trainer, listed after ``planned.trainer`` in the kinds' preferences, trains
        the job instead (the iterative trainer, when the in-memory plan does not fit)."""
        ...

    def plan(self, job: GroupJob, settings: Settings) -> Planned:
        """The job's spec and memory plan; a ProbeError when the job cannot be built."""
        ...

    def check(self, planned: Planned, settings: Settings, fix: str | None) -> None:
        """A ProbeError naming what fixes a plan whose peak cannot fit ``settings.limit``
        (``fix``: another trainer's or the kinds' remedy, said before more memory)."""
        ...

    def run_local(self, planned: Planned) -> GroupResult:
        """The whole job in this process."""
        ...

    def run_dask(self, run: DaskRun, work: list[Planned]) -> dict[str, int]:
        """Every job of ``work`` on the cluster, each result handed to ``run.take`` (or its loss to
        ``run.lost``); returns each worker's peak RSS where the trainer measures it (else {})."""
        ...

    def finish(self, planned: Planned, computed: Any, seconds: float, worker: str) -> GroupResult:
        """The probes table's records and weights of a job, from what its tasks ``computed``."""
        ...


class TrainerDefaults:
    """What most trainers share: a kind is accepted when it lists the trainer's name in
    ``Probe.trains``, and no job planned by another trainer is taken over."""

    name = ""
    needs_torch = True
    merges_layers = False
    suffix = ""
    remedy: str | None = None

    def accepts(self, kind: type[Probe]) -> bool:
        return self.name in kind.trains

    def takes_over(self, planned: Planned, settings: Settings) -> bool:
        return False


def check_fits(memory: MemoryPlan, limit: int | None, job: GroupJob, fix: str) -> None:
    """Refuse a job whose planned peak exceeds :data:`FIT_FRACTION` of the worker limit.

    Parameters
    ----------
    memory
        The job's memory plan.
    limit
        Bytes per worker (None: no limit, nothing refused).
    job
        The job, named in the message.
    fix
        What to change, said before raising the limit.

    Raises
    ------
    ProbeError
        The peak, what sets it, the limit and the least limit that would fit.
    """
    if limit is None or memory.peak_bytes <= FIT_FRACTION * limit:
        return
    need = memory.peak_bytes / FIT_FRACTION / MiB
    raise ProbeError(
        f"group {job.group} ({job.arrays[0].key()}, {len(job.arrays)} layer(s)) needs {memory.peak_bytes / MiB:.0f} MiB"
        f" per worker at its peak ({memory.what}), over {FIT_FRACTION:.0%} of the {limit / MiB:.0f} MiB worker memory"
        f" limit: {fix} or raise --memory-limit to at least {need:.0f}MiB"
    )


def check_base(work: list[Planned], measured: int, limit: int | None) -> int | None:
    """Check the workers' measured RSS at rest against the base each job's plan assumed.

    Workers hold more than planned when they import more: Dask starts each worker by re-running
    the imports of the client's main script, so a script that imports torch at its top level puts
    ~160 MiB more into every worker (320 MiB at rest instead of 160, measured).

    Parameters
    ----------
    work
        The planned jobs.
    measured
        The largest worker RSS once started and warmed up.
    limit
        Bytes per worker (None: nothing to check).

    Returns
    -------
    int or None
        The limit left to streamed tasks (their base is :data:`WORKER_BASE`); None without a limit.

    Raises
    ------
    ProbeError
        When the extra RSS takes a job's planned peak past the limit.
    """
    if limit is None:
        return limit
    for planned in work:
        mem, job = planned.memory, planned.job
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


def default_block_rows(info: Any, precision: str, block_bytes: int = BLOCK_BYTES) -> int:
    """Samples per read block: about ``block_bytes`` of stored, float32 and ``precision`` values.

    Parameters
    ----------
    info
        The array read (``values_per_row``, ``stored_dtype``, ``chunk_samples``).
    precision
        The dtype the block is computed in.
    block_bytes
        The block's target size.

    Returns
    -------
    int
        Between 1 and one stored chunk of samples.
    """
    per = info.values_per_row * (np.dtype(info.stored_dtype).itemsize + 4 + np.dtype(precision).itemsize)
    return int(max(1, min(info.chunk_samples, block_bytes // max(per, 1))))


def rows_bytes(info: Any, n: int) -> int:
    """Stored bytes of ``n`` selected rows of the array ``info`` describes.

    Parameters
    ----------
    info
        The array (its layout, shape, dtype and, ragged, its total bytes).
    n
        Rows selected.

    Returns
    -------
    int
        Exact for a dense array, the average row's share for a ragged one.
    """
    if info.layout == "dense":
        return n * info.values_per_row * np.dtype(info.stored_dtype).itemsize
    return int(info.bytes * n / max(info.n_samples, 1))
