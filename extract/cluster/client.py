"""The client of a cluster run: plans, declares, submits, and is the only writer of the manifest.

First every worker is checked against every run (:mod:`extract.cluster.facts`). Then per run,
runs of one model next to each other (:func:`by_model`): the client reads the stimulus sets, a
worker plans the run (:func:`extract.cluster.worker.plan_run`), and the client declares the run and
its arrays (the run tensors of a logit lens too) through a :class:`store.Writer`, exactly as a
single process would, and submits one task per chunk still missing, at a lower priority than the
runs before, so the workers stay busy across runs. Results are committed run by run through that
run's writer (a result of a later run waits in memory until the runs before it are done: a client
killed then loses it, and a re-run computes those chunks again). A task whose worker dies is run
again by Dask on another worker; a chunk written twice is committed once
(:meth:`store.Writer.commit_written`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import CancelledError
from dataclasses import dataclass, field
from typing import Any

from extract.cluster.errors import ClusterError
from extract.cluster.facts import WorkerFacts, check_workers
from extract.cluster.scheduler import GPU, connect, gpu_workers
from extract.cluster.tasks import GroupDone, GroupTask, RunPlan, RunRequest
from extract.cluster.worker import PLUGIN, ModelHolder, extract_group, facts_of, plan_run
from extract.manifest import Manifest, ManifestError, check_codec, check_sets
from extract.models import CaptureKey
from extract.run import RunSummary, overflow_fix, overflow_in, settle_run, store_lens
from extract.samples import Sample, collect_samples, run_progress
from store import ArraySpec, Workspace, Writer
from store.dtypes import DtypeOverflowError
from store.records import RunInfo


@dataclass
class ClusterRun:
    """One run of a cluster extraction, as its client follows it."""

    manifest: Manifest
    ws: Workspace
    samples: list[Sample]
    info: RunInfo
    specs: dict[CaptureKey, ArraySpec]
    tasks: list[GroupTask]
    started: float
    done: list[GroupDone] = field(default_factory=list)  # results not yet committed
    returned: int = 0  # tasks whose result arrived
    computed: int = 0
    scored: int = 0
    correct: int = 0


def run_cluster(loaded: list[tuple[str, Manifest]], *, scheduler: str, workers: int | None = None,
                data: str | None = None, codec: str = "none", progress: bool = True,
                log: Callable[[str], None] = print) -> list[RunSummary]:
    """Extract (or resume) every manifest of ``loaded`` (file, manifest) on the Dask cluster ``scheduler``."""
    for path, manifest in loaded:
        _check_supported(path, manifest)
        check_codec(codec, manifest.storage.dtype)
        check_sets(manifest)
    client, cluster = connect(scheduler, workers, log)
    # A lost scheduler is reported once, by ClusterError below: not also by the client's reconnect traceback.
    quiet = logging.getLogger("distributed.client")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        addresses = gpu_workers(client)
        held = client.run(lambda dask_worker: PLUGIN in dask_worker.plugins, workers=list(addresses))
        if not all(held.values()):
            # Registered once per cluster: a scheduler that outlives this command keeps each worker's
            # model loaded for the next one (registering again would replace the plugins, models and all).
            client.register_plugin(ModelHolder(), name=PLUGIN)
        facts = []
        for path, manifest in loaded:  # every run's workers checked before any run's work
            found = client.run(facts_of, manifest, workers=list(addresses))
            facts.append(check_workers({addresses[a]: f for a, f in found.items()}, manifest, path))
        owner: dict[Any, ClusterRun] = {}
        runs: list[ClusterRun] = []
        for order in by_model(loaded):
            path, manifest = loaded[order]
            run = _prepare(client, path, manifest, facts[order], data, codec, len(runs))
            # Submitted at once: its tasks run while the next run is planned and declared.
            owner.update((_submit(client, extract_group, task, len(runs)), run) for task in run.tasks)
            runs.append(run)
        return _commit(client, runs, owner, progress)
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
        quiet.setLevel(level)


def by_model(loaded: list[tuple[str, Manifest]]) -> list[int]:
    """The order the runs go in: runs of one model next to each other, else as given. Earlier runs'
    tasks take priority, so a worker moves to the next model once, when the runs before are done."""
    first: dict[str, int] = {}
    for i, (_, manifest) in enumerate(loaded):
        first.setdefault(manifest.model.model_dump_json(), i)
    return sorted(range(len(loaded)), key=lambda i: (first[loaded[i][1].model.model_dump_json()], i))


def _check_supported(path: str, manifest: Manifest) -> None:
    if manifest.shard is not None:
        raise ManifestError(f"{path}: shard and --scheduler both split the run; drop the shard (the cluster spreads"
                            " the chunks over its workers)")
    kind = manifest.intervention.kind if manifest.intervention else None
    if kind in ("head_ablation", "token_compression"):
        raise ManifestError(f"{path}: intervention {kind} writes variant runs of its own, which the cluster path does"
                            " not run yet: extract this manifest without --scheduler")
    if manifest.storage.overflow == "store_float32":
        raise ManifestError(f"{path}: storage.overflow store_float32 re-extracts a run when an array overflows, which"
                            " the cluster path does not do yet: set storage.dtype: float32, or run without --scheduler")


def _submit(client: Any, fn: Callable[..., Any], arg: Any, order: int) -> Any:
    # Earlier runs first; within a run Dask keeps submission order.
    return client.submit(fn, arg, resources={GPU: 1}, pure=False, priority=-order)


def _prepare(client: Any, path: str, manifest: Manifest, facts: WorkerFacts, data: str | None, codec: str,
             order: int) -> ClusterRun:
    """Plan the run on a worker, declare it in the workspace, and build its tasks."""
    started = time.perf_counter()
    sets, samples = collect_samples(manifest)
    if not samples:
        raise ManifestError(f"{path}: the stimulus sets hold no samples (check limit)")
    plan: RunPlan = result(_submit(client, plan_run, RunRequest(manifest, samples, codec, os.getcwd()), order),
                           manifest.run)
    ws = Workspace.open(data or manifest.workspace)
    settled = settle_run(ws, manifest, plan.specs, None, lambda route: plan.routed if route else plan.unrouted,
                         plan.chosen)
    with ws.writer(settled.info) as w:
        for folder, dataset in sets:
            w.register_stimulus_set(folder, dataset=dataset)
        w.set_samples([s.key for s in samples])
        handles = dict(zip(settled.specs, w.arrays(list(settled.specs.values())), strict=True))
        if plan.lens is not None:
            store_lens(w, plan.lens, plan.dtype, manifest.storage)
        todo = w.todo()
        sizes = {h.info.chunk_samples for h in handles.values()}
        if len(sizes) > 1:
            raise ManifestError(f"{path}: run {manifest.run}'s arrays have chunks of {sorted(sizes)} samples; a cluster"
                                " task is one chunk of every array: resume this run without --scheduler")
        site = w.site()
        if not todo:
            w.finish()
    size = sizes.pop()
    arrays = {key: h.info for key, h in handles.items()}
    capture_via = plan.chosen[0] if settled.routed else "generate"
    tasks = [
        GroupTask(manifest=manifest, samples=samples[k : min(k + size, rows.stop)], start=k, request=plan.request,
                  specs=settled.specs, arrays=arrays, info=settled.info, site=site, capture_via=capture_via,
                  facts=facts, cwd=os.getcwd())
        for rows in todo for k in range(rows.start, rows.stop, size)
    ]
    return ClusterRun(manifest, ws, samples, settled.info, settled.specs, tasks, started)


def _commit(client: Any, runs: list[ClusterRun], owner: dict[Any, ClusterRun], progress: bool) -> list[RunSummary]:
    """Commit the results of the runs' tasks (``owner``: future -> its run) run by run, finishing each run."""
    from dask.distributed import as_completed

    bar = run_progress(sum(len(t.samples) for r in runs for t in r.tasks), " + ".join(r.manifest.run for r in runs),
                       progress)
    commits = InOrder(runs)
    failed = True
    try:
        commits.take()  # runs complete already are finished at once
        for future in as_completed(list(owner), loop=client.loop):  # the client is not the default one
            run = owner.pop(future)
            try:
                done: GroupDone = result(future, run.manifest.run)
            except DtypeOverflowError as err:
                over = overflow_in(err)
                if over is None:
                    raise
                raise DtypeOverflowError(overflow_fix(run.manifest, over, run.ws.path)) from err
            run.done.append(done)
            run.returned += 1
            bar.update(len(done.rows))
            commits.take()
        failed = False
    finally:
        client.cancel(list(owner))
        bar.close()
        try:
            commits.close()
        except Exception:
            if not failed:
                raise  # else the failure that stopped the run is the one to report
    return commits.summaries


def result(future: Any, run: str) -> Any:
    """``future``'s result; a lost scheduler or a task that killed its workers as a ClusterError that
    says how to resume (the task's own error, e.g. a refused manifest, as it was raised)."""
    from distributed.comm.core import CommClosedError
    from distributed.scheduler import KilledWorker

    try:
        return future.result()
    except (CancelledError, CommClosedError, TimeoutError) as err:  # a task's own OSError is its own
        raise ClusterError(f"lost the Dask scheduler or its workers mid-run ({type(err).__name__}: {err}): the"
                           " chunks committed so far are kept; re-run the same command to resume") from err
    except KilledWorker as err:
        raise ClusterError(f"a task of run {run} was running on every worker that died ({err}): it may kill its"
                           " worker (out of GPU or host memory?); see the workers' logs. The chunks committed so far"
                           " are kept; re-run the same command to resume") from err


class InOrder:
    """Commits the runs' results run by run, through one writer at a time (the workspace has one writer)."""

    def __init__(self, runs: list[ClusterRun]) -> None:
        self.runs = runs
        self.summaries: list[RunSummary] = []
        self._current = 0
        self._writer: Writer | None = None

    def take(self) -> None:
        """Commit what the current run has returned; once all its tasks have, finish it and go on to the next."""
        while self._current < len(self.runs):
            run = self.runs[self._current]
            if not run.done and run.returned < len(run.tasks):
                return
            w = self._writer
            if w is None:
                # The run's tasks are out: the files its workers are writing are .partial, and stay.
                w = self._writer = run.ws.writer(run.info, workers_writing=True)
                w.arrays(list(run.specs.values()))  # the handles its commits name
            while run.done:
                done = run.done.pop(0)
                w.commit_written(done.written)
                run.computed += len(done.rows)
                run.scored += done.scored
                run.correct += done.correct
            if run.returned < len(run.tasks):
                return
            w.finish()
            scored, correct = w.rows("SELECT count(correct), count(*) FILTER (WHERE correct) FROM generations"
                                     " WHERE run = ?", [run.info.run])[0]
            self._writer = None
            w.close()
            self.summaries.append(RunSummary(
                run=run.info.run, workspace=run.ws.path, samples=len(run.samples), computed=run.computed,
                seconds=time.perf_counter() - run.started, accuracy=correct / scored if scored else None,
                arrays=len(run.specs), new_accuracy=run.correct / run.scored if run.scored else None, scored=int(scored),
                commits=w.stats))
            self._current += 1

    def close(self) -> None:
        """Commit what the open writer holds and let the workspace go (a run left unfinished resumes)."""
        if self._writer is not None:
            w, self._writer = self._writer, None
            w.close()
