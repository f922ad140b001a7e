"""Running an SAE plan on the probe farm's Dask workers: ``python -m probes sae PLAN``.

Each SAE is one Dask task (probes/sae/job.py). Before anything starts, every task's planned peak
is checked against the worker memory limit (``--memory-limit`` or the plan's ``memory_limit``);
SAEs already in ``sae_models`` are skipped unless forced; the client records each result as it
arrives. The workers are those of the probe farm (probes/cluster.py: ``inline``, ``local`` or an
address).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from probes.errors import ProbeError
from probes.farm import parse_bytes
from probes.sae.job import SaeResult, planned_peak, run_task
from probes.sae.plan import SaePlan, SaeTask, expand_sae_plan
from probes.sae.records import done_keys, record
from store import Workspace

#: What a worker holds before its task: Python, numpy, torch, the store (measured 281 MiB after the
#: imports and ~335 MiB with a workspace open, on this machine).
WORKER_BASE = 352 << 20


@dataclass
class SaeReport:
    """What a run of an SAE plan did."""

    trained: int = 0
    skipped: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    seconds: float = 0.0
    workers: int = 0


def check_memory(tasks: list[SaeTask], limit: int | None) -> None:
    """Refuse, before any training, a task whose planned peak does not fit the worker limit."""
    if not limit:
        return
    for t in tasks:
        need = WORKER_BASE + planned_peak(t)
        if need > limit:
            raise ProbeError(
                f"SAE {t.tap}:{t.layer} of run {t.run} (d_in {t.d_in}, d_sae {t.d_sae}) plans {need >> 20} MiB, over the"
                f" worker limit of {limit >> 20} MiB: lower buffer_rows ({t.entry['buffer_rows']}), batch_size"
                f" ({t.entry['batch_size']}) or expansion, or raise --memory-limit"
            )


def run_sae_plan(plan: SaePlan, data: str | Path, *, force: bool = False, scheduler: str | None = None,
                 workers: int | None = None, memory_limit: str | int | None = None, in_process: bool = False,
                 log: Callable[[str], None] = print) -> SaeReport:
    """Train, evaluate and score every SAE of ``plan`` on ``data``; record them in the manifest.

    Parameters
    ----------
    plan : SaePlan
        A checked plan (:func:`probes.sae.plan.load_sae_plan`).
    data : str or Path
        The workspace folder.
    force : bool
        Retrain SAEs already recorded.
    scheduler : str or None
        ``auto``, ``inline``, ``local`` or a Dask scheduler address (as the probe farm's).
    workers : int or None
        Worker processes for ``local``.
    memory_limit : str, int or None
        Worker memory limit (e.g. ``"1GiB"``); every task's planned peak is checked against it.
    in_process : bool
        No Dask: the tasks run here, one by one.
    log : callable
        Where progress lines go.

    Returns
    -------
    SaeReport
        Counts, keys and errors.
    """
    started = time.perf_counter()
    report = SaeReport()
    data = str(Path(data).absolute())
    ws = Workspace.open(data)
    tasks = expand_sae_plan(plan, ws)
    done = set() if force else done_keys(ws)
    todo = [t for t in tasks if t.key not in done]
    report.skipped = len(tasks) - len(todo)
    limit = parse_bytes(memory_limit if memory_limit is not None else plan.memory_limit)
    check_memory(todo, limit)
    log(f"sae plan {plan.name}: {len(tasks)} SAE(s), {report.skipped} already recorded, {len(todo)} to train")

    def take(res: SaeResult) -> None:
        record(ws, res)
        report.trained += 1
        report.keys.append(res.key)
        m = res.model
        log(f"  {m['run']} {m['tap']}:{m['layer']} {m['architecture']} d_sae={m['d_sae']}: EV {m['explained_variance']:.3f},"
            f" L0 {m['l0']:.1f}, dead {m['dead_share']:.0%}, {m['rows_per_s']:.0f} rows/s")

    def lost(t: SaeTask, err: BaseException) -> None:
        report.failed += 1
        report.errors.append(f"{t.run} {t.tap}:{t.layer}: {type(err).__name__}: {err}")

    if in_process or not todo:
        for t in todo:
            try:
                take(run_task(data, t))
            except Exception as err:  # one SAE's failure is reported; the rest of the plan still runs
                lost(t, err)
    else:
        _on_dask(todo, data, scheduler, workers, limit, report, take, lost, log)
    report.seconds = time.perf_counter() - started
    return report


def _on_dask(todo: list[SaeTask], data: str, scheduler: str | None, workers: int | None, limit: int | None,
             report: SaeReport, take: Callable[[SaeResult], None], lost: Callable[[SaeTask, BaseException], None],
             log: Callable[[str], None]) -> None:
    from probes.cluster import start

    client, cluster = start(scheduler, workers, len(todo), len(todo), limit, report, log)
    try:
        futures: dict[Any, SaeTask] = {client.submit(run_task, data, t, pure=False): t for t in todo}
        for fut, t in futures.items():  # in plan order: the client records one result while the rest train
            try:
                take(fut.result())
            except Exception as err:
                lost(t, err)
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
