"""The probe farm: a plan's probes trained on Dask workers, results written to the manifest.

::

    client (this process)                         workers (Dask, one thread each)
    ─────────────────────                         ───────────────────────────────
    expand the plan against the workspace
    skip probes whose key is in `probes`
    per group: rows, labels, splits (DuckDB) ──►  read the group's Zarr chunks
                                                  train every probe (batched where it can)
    record results in batches (one short     ◄──  small ProbeResult records
    DuckDB transaction each: the only writer)     weights -> <workspace>/probes/<key>.safetensors

A probe's key hashes everything that defines it (probes/plan.py: kind parameters, split,
train_where ... included) and is the ``probes`` table's primary key, so plans that differ only
in a parameter add rows; a re-run skips the keys already there, so a killed farm resumes where
it stopped and never writes a probe twice. Each probe's per-sample test predictions go to
``probe_predictions`` in the same transaction. A worker that dies takes only its in-flight group
with it; Dask runs that group again
elsewhere, and its results reach the manifest once, because only completed groups are
recorded.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from probes import artifacts, derived, stream
from probes.cluster import start as cluster_start
from probes.errors import ProbeError
from probes.plan import ArrayRow, Plan, ProbeTask, expand, group_tasks
from probes.prepare import JobBuilder
from probes.rss import rss_now
from probes.trainers.base import DaskRun, Planned, check_base
from probes.trainers.group import GroupJob, GroupResult
from probes.trainers.select import TRAINERS, plan_work
from stimuli.progress import progress_bar
from store import ProbeResult, Workspace
from store.db import HeldConnection
from store.errors import ManifestBusyError

ENV_SCHEDULER = "DASK_SCHEDULER_ADDRESS"


@dataclass
class FarmReport:
    """What a farm run did. ``seconds`` is the training phase (cluster start excluded)."""

    plan: str
    workspace: str
    tasks: int = 0
    skipped: int = 0
    empty: int = 0
    trained: int = 0
    failed: int = 0
    groups: int = 0
    workers: int = 0
    seconds: float = 0.0
    startup_seconds: float = 0.0
    flops: float = 0.0
    dashboard: str | None = None
    memory_limit: int | None = None       # bytes per worker the plan was checked against
    rss_peak: int = 0                     # streamed kinds: the largest worker RSS their tasks measured
    worker_base: int = 0                  # on Dask: the largest worker RSS once started and warmed up
    read_bytes: int = 0                   # streamed kinds: stored feature bytes read
    worker_peaks: dict[str, int] = field(default_factory=dict)   # streamed on Dask: peak RSS per worker
    failures: list[tuple[str, str]] = field(default_factory=list)

    @property
    def probes_per_s(self) -> float:
        return self.trained / self.seconds if self.seconds > 0 else float("nan")

    @property
    def gflops_per_s(self) -> float:
        return self.flops / self.seconds / 1e9 if self.seconds > 0 else float("nan")


# ----------------------------------------------------------------------------- manifest side


def open_workspace(data: str | os.PathLike[str] | None) -> Workspace:
    return Workspace.open(data, readonly=True)


def plan_tasks(plan: Plan, ws: Workspace) -> list[ProbeTask]:
    arrays = [ArrayRow(a.run, a.tap, a.layer, a.site, a.tokens, a.layout) for a in ws.arrays()]
    if not arrays:
        raise ProbeError(f"the workspace {ws.path} holds no arrays yet: run an extraction first (python -m extract MANIFEST)")
    return expand(plan, arrays)


def done_keys(ws: Workspace, runs: Sequence[str]) -> set[str]:
    """Keys of probes already in the manifest (the probes table's primary key)."""
    if not runs:
        return set()
    marks = ", ".join("?" for _ in runs)
    rows = ws.rows(f"SELECT key FROM probes WHERE run IN ({marks})", list(runs))
    return {r[0] for r in rows}


@dataclass
class Triage:
    """What a plan would do now, decided once for the run and its dry run alike: every probe, and
    which are skipped (recorded already, or their where: selects no samples of their run)."""

    tasks: list[ProbeTask]
    done: list[ProbeTask]
    empty: list[ProbeTask]
    todo: list[ProbeTask]
    no_samples: list[tuple[str, str | None]]   # (run, where) pairs that select no sample
    runs_note: str | None = None                # what `runs: all` expanded to, and which runs are new

    def empty_reason(self) -> str:
        return "their where selects no samples in: " + "; ".join(f"{r} ({w})" for r, w in self.no_samples)

    def status(self, task: ProbeTask) -> str:
        if not hasattr(self, "_status"):
            self._status = {**{t.key: "skipped" for t in self.empty}, **{t.key: "done" for t in self.done}}
        return self._status.get(task.key, "todo")


def triage(plan: Plan, ws: Workspace, force: bool = False, prep: JobBuilder | None = None) -> Triage:
    """Expand ``plan`` and sort its probes into done, empty (no samples) and to-do."""
    tasks = plan_tasks(plan, ws)
    recorded = set() if force else done_keys(ws, sorted({t.run for t in tasks}))
    rest = [t for t in tasks if t.key not in recorded]
    prep = prep or JobBuilder(ws, plan)
    pairs = sorted({(t.run, t.where) for t in rest}, key=lambda p: (p[0], p[1] or ""))
    no_samples = [p for p in pairs if len(prep.samples(*p)[0]) == 0]  # e.g. runs: all with a where for some runs
    empty = [t for t in rest if (t.run, t.where) in no_samples]
    todo = [t for t in rest if (t.run, t.where) not in no_samples]
    return Triage(tasks, [t for t in tasks if t.key in recorded], empty, todo, no_samples, runs_all_note(plan, ws))


def runs_all_note(plan: Plan, ws: Workspace) -> str | None:
    """``runs: all → 3 runs (1 new since the last training of this plan: x)``: a plan that names no
    runs grows with the workspace, so a re-run after a new extraction trains more; say which."""
    if not any(entry.runs == "all" for entry in plan.probes):
        return None
    runs = sorted({a.run for a in ws.arrays()})
    last = ws.rows("SELECT max(created_at) FROM probes WHERE params->>'plan' = ?", [plan.name])[0][0]
    head = f"runs: all → {len(runs)} run{'s' if len(runs) != 1 else ''} ({', '.join(runs)})"
    if last is None:
        return head + "; this plan has not been trained in this workspace yet"
    trained = {r[0] for r in ws.rows("SELECT DISTINCT run FROM probes WHERE params->>'plan' = ?", [plan.name])}
    created = dict(ws.rows("SELECT run, created_at FROM runs"))
    new = [r for r in runs if r not in trained and created.get(r) is not None and created[r] > last]
    if not new:
        return head + "; none new since the last training of this plan"
    return head + f"; {len(new)} new since the last training of this plan: {', '.join(new)}"


def _recover_weights(ws: Workspace, plan: Plan, log: Callable[[str], None]) -> None:
    published, deleted = artifacts.recover(ws.path, {r[0] for r in ws.rows("SELECT params->>'key' FROM probes")})
    if published or deleted:
        log(f"plan {plan.name}: a farm client died before: {published} weight file(s) of recorded probes put in place,"
            f" {deleted} of unrecorded probes deleted")


# ----------------------------------------------------------------------------- running


class _Recorder:
    """Buffers results and writes them in short transactions (DuckDB has one writer: us), over one
    held connection (store/db.py HeldConnection: an open + close costs ~0.1 s, a transaction of
    500 rows less; the connection still lets go whenever another process asks for the file)."""

    def __init__(self, ws: Workspace, every: float, size: int, on_record: Callable[[list[ProbeResult]], None] | None):
        self.ws, self.every, self.size, self.on_record = ws, every, size, on_record
        self.held = HeldConnection(ws.manifest_path)
        self.buffer: list[ProbeResult] = []
        self.pending: dict[str, str] = {}       # probe key -> its weight file, until the row commits
        self.last = time.monotonic()
        self.written = 0

    def add(self, records: list[ProbeResult], pending: dict[str, str] | None = None) -> None:
        self.buffer.extend(records)
        self.pending.update(pending or {})
        if len(self.buffer) >= self.size or time.monotonic() - self.last >= self.every:
            self.flush(final=False)

    def flush(self, final: bool = True) -> None:
        try:
            self._flush(final)
        finally:
            if final:
                self.held.close()

    def _flush(self, final: bool) -> None:
        if not self.buffer:
            return
        try:
            self.ws.record_probes(self.buffer, self.held)
        except ManifestBusyError:
            if final:
                raise
            return  # someone holds the manifest; keep the buffer and try at the next result
        for r in self.buffer:
            path = self.pending.pop(str((r.params or {}).get("key")), None)
            if path is not None:
                artifacts.publish(path)
        if self.on_record is not None:
            self.on_record(list(self.buffer))
        self.written += len(self.buffer)
        self.buffer = []
        self.last = time.monotonic()


def run_plan(
    plan: Plan,
    data: str | os.PathLike[str] | None = None,
    *,
    scheduler: str | None = None,
    workers: int | None = None,
    in_process: bool = False,
    force: bool = False,
    progress: bool = True,
    flush_every: float = 2.0,
    flush_size: int = 500,
    window: int | None = None,
    log: Callable[[str], None] | None = None,
    on_record: Callable[[list[ProbeResult]], None] | None = None,
    memory_limit: str | int | None = None,
    block_rows: int | None = None,
) -> FarmReport:
    """Train every probe of ``plan`` not yet in the workspace's ``probes`` table.

    Parameters
    ----------
    plan
        A validated plan (:func:`load_plan`).
    data
        The workspace (``None``: ``$AGNOSIA_DATA``, else ``./data``).
    scheduler
        ``auto``, ``inline``, ``local`` or a Dask scheduler address (default:
        ``$DASK_SCHEDULER_ADDRESS``, else a new LocalCluster of ``workers`` processes with one
        thread each).
    workers
        Processes of a LocalCluster this call starts.
    in_process
        Run the groups here, one after another, without Dask (tests, debugging).
    force
        Retrain probes already done.
    progress
        Show a progress bar.
    flush_every, flush_size
        Write finished probes' rows to the manifest every so many seconds or rows.
    window
        How many tasks the client keeps submitted at a time (default: a few per worker).
    log
        Where progress lines go (default: stderr).
    on_record
        Called with each batch of results as it is written.
    memory_limit
        Bytes or "384MiB" per worker (default: the plan's); every task's planned peak is checked
        against it before any training.
    block_rows
        Samples per read block of streamed kinds (default: the plan's, else ~32 MiB of features).

    Returns
    -------
    FarmReport
        Probes trained, skipped and failed, seconds, workers and peak memory.

    Raises
    ------
    ProbeError
        A plan that cannot fit its memory limit, a workspace without the plan's arrays, or a
        cluster lost mid-run (what was trained is kept).
    """
    log = log or _log
    ws = open_workspace(data)
    report = FarmReport(plan=plan.name, workspace=str(ws.path))
    _recover_weights(ws, plan, log)
    jobs = _jobs_to_train(plan, ws, force, report, log)
    if not jobs:
        return report
    limit = parse_bytes(memory_limit if memory_limit is not None else plan.memory_limit)
    report.memory_limit = limit
    # refuses a plan that cannot fit, before training
    work = plan_work(jobs, block_rows or plan.block_rows, limit, plan.out_of_core, plan.max_train_rows)
    n_todo = sum(len(j.tasks) for j in jobs)
    log(f"plan {plan.name}: {n_todo} probes to train in {len(jobs)} groups ({report.skipped} already done)")
    sink = _Collector(ws, report, _Recorder(ws, flush_every, flush_size, on_record), _progress(n_todo, progress))
    try:
        if in_process:
            _run_here(work, report, sink)
        else:
            _run_dask(work, report, sink.take, sink.lost, scheduler or os.environ.get(ENV_SCHEDULER) or None, workers,
                      window, log, plan.plugins, limit, drain=sink.recorder.flush)
    finally:
        sink.bar.close()
        sink.recorder.flush()
    log(f"plan {plan.name}: trained {report.trained} probes in {report.seconds:.1f} s ({report.probes_per_s:.1f} probes/s)"
        f" on {report.workers} worker(s), after {report.startup_seconds:.1f} s starting them; {report.failed} failed;"
        f" {report.skipped} skipped as done")
    for key, msg in report.failures[:5]:
        log(f"  failed {key}: {msg.splitlines()[0]}")
    return report


def _jobs_to_train(plan: Plan, ws: Workspace, force: bool, report: FarmReport,
                   log: Callable[[str], None]) -> list[GroupJob]:
    """The triage, said in the log and counted in ``report``; the group jobs left to train (every
    manifest read happens here, before any training)."""
    prep = JobBuilder(ws, plan)
    tri = triage(plan, ws, force, prep)
    report.tasks, report.skipped, report.empty = len(tri.tasks), len(tri.done), len(tri.empty)
    report.groups = len(group_tasks(tri.todo + tri.empty, plan.layers_per_task))
    if tri.runs_note:
        log(f"plan {plan.name}: {tri.runs_note}")
    if not tri.todo and not tri.empty:
        log(f"plan {plan.name}: all {len(tri.tasks)} probes are already in {ws.manifest_path.name}; nothing to train")
        return []
    if tri.empty:
        log(f"plan {plan.name}: {report.empty} probes skipped, {tri.empty_reason()}")
        if not tri.todo and not report.skipped:
            raise ProbeError(f"plan {plan.name}: no probe has samples to train on; check the where: filters")
    if not tri.todo:
        log(f"plan {plan.name}: nothing left to train ({report.skipped} done)")
        return []
    groups = group_tasks(tri.todo, plan.layers_per_task)
    if plan.derive == "auto":  # the client derives what pooling groups read, before any is dispatched
        derived.derive_for_plan(ws, [([prep.array(g.run, g.tap, layer, g.site, g.tokens) for layer in g.layers],
                                      g.tasks) for g in groups], lambda line: log(f"plan {plan.name}: {line}"))
    jobs = [prep.job(g) for g in groups]
    for note in dict.fromkeys(prep.notes):
        log(f"plan {plan.name}: {note}")
    return jobs


@dataclass
class _Collector:
    """Takes each group's results (or its loss) into the report, the recorder and the progress bar."""

    ws: Workspace
    report: FarmReport
    recorder: _Recorder
    bar: Any

    def take(self, res: GroupResult) -> None:
        report = self.report
        report.rss_peak = max(report.rss_peak, res.rss_peak)
        report.read_bytes += res.read_bytes
        for w, peak in res.worker_peaks.items():
            report.worker_peaks[w] = max(report.worker_peaks.get(w, 0), peak)
        # The weights first, each whole, under a pending name; the recorder renames each into
        # place once its row is committed. A client killed in between leaves only pending files,
        # which the next run publishes (row committed) or deletes (no row): artifacts.recover.
        self.recorder.add(res.records, artifacts.write_pending(self.ws.path, res.weights))
        report.trained += len(res.records)
        report.flops += res.flops
        report.failed += len(res.failures)
        report.failures += res.failures
        self.bar.update(len(res.records) + len(res.failures))

    def lost(self, job: GroupJob, err: BaseException) -> None:
        msg = killed_worker_message(err, self.report.memory_limit) or f"{type(err).__name__}: {err}"
        self.report.failed += len(job.tasks)
        self.report.failures += [(t.key, msg) for t in job.tasks]
        self.bar.update(len(job.tasks))


def killed_worker_message(err: BaseException, limit: int | None) -> str | None:
    """Dask's KilledWorker, with its likely cause and the fix; None for any other error.

    Dask says only that every worker that ran the task died. The usual cause here is a task past
    its worker's memory limit (the nanny restarts a worker at 95 % of it), which its text never
    names, so users read it as a crash of agnosia."""
    if type(err).__name__ != "KilledWorker":
        return None
    cap = f"{limit >> 20} MiB per worker" if limit else "Dask's default share of the machine per worker"
    more = f"e.g. --memory-limit {2 * limit >> 20}MiB" if limit else "e.g. --memory-limit 4GiB"
    task = getattr(err, "task", None) or "a task"
    tries = getattr(err, "allowed_failures", None)
    died = f"{tries + 1} worker{'s' if tries else ''}" if isinstance(tries, int) else "its workers"
    return (f"KilledWorker: {died} died running {task!r}, most likely past their memory limit ({cap}; Dask restarts a"
            f" worker at 95% of it): raise the plan's memory_limit: or --memory-limit ({more}), or lower block_rows:"
            " or layers_per_task:; if memory is not the cause, the workers' logs say what killed them")


def _run_here(work: list[Planned], report: FarmReport, sink: _Collector) -> None:
    """Every group in this process, one after another (tests, debugging)."""
    report.workers = 1
    t0 = time.perf_counter()
    for planned in work:
        try:
            sink.take(planned.trainer.run_local(planned))
        except Exception as err:
            sink.lost(planned.job, err)
    sink.recorder.flush()   # the last rows and weights belong to the timed phase
    report.seconds = time.perf_counter() - t0


def _log(line: str) -> None:
    from tqdm import tqdm

    tqdm.write(line, file=sys.stderr)  # above the bar, which a plain print would break in two


def _progress(total: int, enabled: bool) -> Any:
    return progress_bar(total, unit="probe", enabled=enabled, smoothing=0.1)


def parse_bytes(value: str | int | None) -> int | None:
    """``384MiB`` / ``2GB`` / an int -> bytes; None stays None."""
    if value is None or isinstance(value, int):
        return value
    from dask.utils import parse_bytes as dask_bytes

    try:
        return int(dask_bytes(str(value)))
    except (ValueError, TypeError):
        raise ProbeError(f"memory limit {value!r} is not a size: write e.g. 384MiB, 2GiB or a number of bytes") from None


def _run_dask(work: list[Planned], report: FarmReport, take: Callable[[GroupResult], None],
              lost: Callable[[GroupJob, BaseException], None], scheduler: str | None, workers: int | None,
              window: int | None, log: Callable[[str], None], plugins: Sequence[str] = (),
              memory_limit: int | None = None, drain: Callable[[], None] | None = None) -> None:
    """Every group on Dask, by trainer in the registry's order (streamed layers in one pipeline,
    then out-of-core groups, then in-memory groups in a bounded window). ``drain`` (the recorder's
    last flush) ends the timed phase."""
    started = time.perf_counter()
    n_probes = sum(len(p.job.tasks) for p in work)
    client, cluster = cluster_start(scheduler, workers, len(work), n_probes, memory_limit, report, log)
    watch = _SchedulerWatch(client, report).start()
    try:
        _run_dask_with(client, work, report, take, lost, window, log, plugins, memory_limit, drain, started)
    finally:
        watch.stop()
        if watch.lost:
            # Closing cancels its reconnect, which it logs as a traceback: the one error line says it all.
            logging.getLogger("distributed.client").setLevel(logging.CRITICAL)
            client.close(timeout=2)  # else it waits out its whole connect timeout (30 s) for a dead scheduler
        else:
            client.close()
        if cluster is not None:
            cluster.close()


def _run_dask_with(client: Any, work: list[Planned], report: FarmReport, take: Callable[[GroupResult], None],
                   lost: Callable[[GroupJob, BaseException], None], window: int | None, log: Callable[[str], None],
                   plugins: Sequence[str], memory_limit: int | None, drain: Callable[[], None] | None,
                   started: float) -> None:
    report.dashboard = client.dashboard_link
    light = not any(p.trainer.needs_torch for p in work)  # streamed only: workers never import torch
    # Imports and first-call costs belong to start-up, not to the probes. Streamed-only plans warm
    # through probes.stream: unpickling a function of this module would import torch there.
    based = client.run(stream.warm) if light else client.run(warm_worker, list(plugins))
    report.worker_base = max(based.values(), default=0)
    report.startup_seconds = time.perf_counter() - started
    log(f"dask: {report.workers} worker(s) at {client.scheduler.address} ready in {report.startup_seconds:.1f} s,"
        f" {report.worker_base / 2**20:.0f} MiB each at rest; dashboard {report.dashboard}"
        + ("" if _has_bokeh() else " (pip install bokeh for its plots)"))
    t0 = time.perf_counter()
    try:
        # The plans assumed an idle worker's RSS: check the measured one, before any training.
        run = DaskRun(client, max(report.workers, 1), check_base(work, report.worker_base, memory_limit), window,
                      take, lost)
        for name in TRAINERS.names():
            mine = [p for p in work if p.trainer.name == name]
            if mine:
                for w, peak in mine[0].trainer.run_dask(run, mine).items():
                    report.worker_peaks[w] = max(report.worker_peaks.get(w, 0), peak)
        if drain is not None:
            drain()
    finally:
        report.seconds = time.perf_counter() - t0


#: Seconds a client may go without its scheduler before the plan stops. Dask's client retries for
#: its connect timeout (30 s), then closes itself and leaves every wait on its futures hanging: one
#: killed scheduler kept a plan's client running for minutes after "closing client".
SCHEDULER_GRACE_S = 10.0


class SchedulerLostError(ProbeError):
    """The Dask scheduler went away mid-plan; what was recorded before stays recorded."""


class _SchedulerWatch:
    """Watches ``client.status`` from a thread; once the scheduler has been unreachable for
    :data:`SCHEDULER_GRACE_S` (or the client gave up on it), interrupts the plan in the main thread
    with a :class:`SchedulerLostError`, wherever it waits (the farm's own loops, and the streamed
    and out-of-core paths' gathers alike). A real signal, not a flag: it also wakes a thread blocked
    in a lock wait. Off the main thread (a farm run from a thread) no signal can be handled, so
    there is no watch: such a caller bounds its own waits."""

    SIGNAL = signal.SIGUSR2

    def __init__(self, client: Any, report: FarmReport, grace: float = SCHEDULER_GRACE_S) -> None:
        self.client, self.report, self.grace = client, report, grace
        self.lost: str | None = None
        self._active = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._previous: Any = None

    def start(self) -> _SchedulerWatch:
        if threading.current_thread() is not threading.main_thread():
            return self
        self._previous = signal.signal(self.SIGNAL, self._interrupt)
        self._active = True
        self._thread = threading.Thread(target=self._watch, name="agnosia-scheduler-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._active = False
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            signal.signal(self.SIGNAL, self._previous)  # delivered by now: a late one finds _active False

    def _watch(self) -> None:
        down_since: float | None = None
        address = getattr(getattr(self.client, "scheduler", None), "address", None) or "?"
        while not self._stop.wait(0.5):
            status = str(self.client.status)
            if status == "running":
                down_since = None
                continue
            down_since = down_since or time.monotonic()
            if status in ("closing", "closed", "failed") or time.monotonic() - down_since > self.grace:
                self.lost = (f"lost the Dask scheduler at {address} mid-plan (client {status} for"
                             f" {time.monotonic() - down_since:.0f} s): the {self.report.trained} probe(s) finished"
                             " before are recorded and kept; restart the scheduler and its workers, then run the same"
                             " command to train the rest")
                if self._active:
                    signal.pthread_kill(threading.main_thread().ident or 0, self.SIGNAL)
                return

    def _interrupt(self, signum: int, frame: Any) -> None:
        if self._active and self.lost is not None:
            self._active = False  # once: cleanup code that follows must not be interrupted again
            raise SchedulerLostError(self.lost)


def warm_worker(plugins: Sequence[str] = ()) -> int:
    """Import the kinds, the reader and the plan's plugins and run one tiny batched fit, so a
    worker's first group runs warm (imports cost seconds on a busy 2-core machine). Returns the
    worker's RSS after it (probes/trainers/base.py check_base)."""
    import importlib

    import torch
    import zarr  # noqa: F401

    import store.reader  # noqa: F401
    from store.heap import tune_malloc

    tune_malloc()

    import probes.kinds  # noqa: F401
    from probes.logreg import fit_logistic

    for name in plugins:
        importlib.import_module(name)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fit_logistic(torch.randn(1, 8, 2), np.array([[0], [1]] * 4), [2], max_iter=2)
    finally:
        torch.set_num_threads(threads)
    return rss_now()


def _has_bokeh() -> bool:
    import importlib.util

    return importlib.util.find_spec("bokeh") is not None


def load_probe(data: str | os.PathLike[str] | None, key: str) -> Any:
    """The fitted probe saved for ``key`` (see the ``artifact`` column).

    Parameters
    ----------
    data
        The workspace (``None``: ``$AGNOSIA_DATA``, else ``./data``).
    key
        The probe's key in the ``probes`` table.

    Returns
    -------
    Probe
        The probe of its kind, weights loaded from safetensors; ``predict`` and ``score`` work on new rows.
    """
    from probes.artifacts import artifact_path
    from probes.kinds.base import Probe

    return Probe.load(artifact_path(open_workspace(data).path, key))
