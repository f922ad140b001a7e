"""``python -m probes PLAN [PLAN ...]``: train probe plans' probes on Dask and record them in the workspace.

Several plans train one after another in one process (Dask, torch and the workspace are imported
once); each is checked against the workspace before the first one trains."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from probes.plan import Plan

from probes.cluster import AUTO, INLINE, LOCAL, SMALL_PLAN

EPILOG = """\
examples:
  python -m probes manifests/probes-demo.yaml --data data              # small plan: one Dask worker in this process
  python -m probes plan.yaml --scheduler local --workers 2             # a LocalCluster of 2 worker processes
  python -m probes plan.yaml --dry-run                                 # list the probes, train nothing
  python -m probes derive --run RUN --pool mean                        # store pooled features once (derived arrays)
  python -m probes sae manifests/sae-demo.yaml                  # sparse autoencoders, scored against truth
  python -m probes plan.yaml --scheduler tcp://10.0.0.5:8786           # an existing Dask cluster
  DASK_SCHEDULER_ADDRESS=tcp://10.0.0.5:8786 python -m probes plan.yaml

Results go to the workspace's `probes` table (one row per probe, params->>'key' identifies it)
and weights to <workspace>/probes/<key>.safetensors. Re-running a plan skips finished probes.
  python -m store query "SELECT run, tap, target, kind, layer, score, control_score, selectivity FROM v_best_probe"
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m probes", description=__doc__, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("plans", nargs="+", metavar="plan",
                   help="probe plan YAML (see docs/probes.md); several train in order, in one process")
    p.add_argument("--data", default=None, help="workspace folder (default: $AGNOSIA_DATA, else ./data)")
    p.add_argument("--scheduler", default=os.environ.get("DASK_SCHEDULER_ADDRESS") or AUTO, metavar="WHERE",
                   help=f"{INLINE} (one Dask worker in this process: no start-up), {LOCAL} (a LocalCluster of worker"
                        f" processes), {AUTO} ({INLINE} for a plan of at most {SMALL_PLAN} probes to train without"
                        f" --workers, else {LOCAL}), or a scheduler's address (default: $DASK_SCHEDULER_ADDRESS, else"
                        f" {AUTO})")
    p.add_argument("--connect-timeout", type=float, default=10.0, metavar="S",
                   help="seconds to reach the --scheduler before giving up (default 10)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="LocalCluster worker processes, one thread each (default: CPU count)")
    p.add_argument("--memory-limit", default=None, metavar="SIZE",
                   help="memory per worker, e.g. 384MiB (Dask's memory_limit; default: the plan's memory_limit, else"
                        " Dask's share of the machine); every task's planned peak must fit 80%% of it")
    p.add_argument("--block-rows", type=int, default=None, metavar="N",
                   help="samples per read block of streamed kinds (ridge); fewer rows, less memory")
    p.add_argument("--in-process", action="store_true", help="no Dask: run the groups here, one by one (debugging)")
    p.add_argument("--dry-run", action="store_true", help="list the probes and which are done; train nothing")
    p.add_argument("--force", action="store_true", help="retrain probes that are already recorded")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("-v", "--verbose", action="store_true", help="with --dry-run: every probe, not the first 40")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["derive"]:  # python -m probes derive ...: pooled features stored once (probes/derived.py)
        from probes.derived import main as derive

        return derive(argv[1:])
    if argv[:1] == ["sae"]:  # python -m probes sae ...: sparse autoencoders (probes/sae/)
        from probes.sae.cli import main as sae

        return sae(argv[1:])
    args = build_parser().parse_args(argv)
    if args.block_rows is not None and args.block_rows < 1:
        print(f"error: --block-rows must be >= 1, got {args.block_rows}", file=sys.stderr)
        return 2
    if args.workers is not None and args.workers < 1:
        print(f"error: --workers must be >= 1, got {args.workers}", file=sys.stderr)
        return 2
    from probes.errors import ProbeError
    from store.errors import StoreError

    at = args.plans[0]  # the plan being read, checked or trained: a failure names it when there are several
    try:
        if not args.dry_run and args.scheduler not in (AUTO, INLINE, LOCAL) and not args.in_process:
            check_scheduler(args.scheduler, args.connect_timeout)  # an argument: checked before any plan is read
        plans = []
        for at in args.plans:
            plans.append(load_plan_checked(at, args))
        if args.dry_run:
            for at, (plan, _) in zip(args.plans, plans, strict=True):  # noqa: B007 - `at` names a failing plan below
                _dry_run(plan, args)
            return 0
        failed = 0
        for at, (plan, keys) in zip(args.plans, plans, strict=True):  # noqa: B007 - as above
            failed += _train(plan, keys, args)
    except (ProbeError, StoreError) as err:
        where = f"{at}: " if len(args.plans) > 1 and at not in str(err) else ""
        print(f"error: {where}{err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: finished probes are recorded; run the same command to resume", file=sys.stderr)
        return 130
    return 1 if failed else 0


def load_plan_checked(path: str, args: argparse.Namespace) -> tuple[Plan, set[str]]:
    """The plan and its probes' keys, checked against the workspace (runs, taps, layers, SQL) before any trains."""
    from probes.farm import open_workspace, plan_tasks
    from probes.plan import load_plan

    plan = load_plan(path)
    if args.dry_run:  # the dry run does its own check, and names what is wrong in its listing
        return plan, set()
    return plan, {t.key for t in plan_tasks(plan, open_workspace(args.data))}


def _train(plan: Plan, keys: set[str], args: argparse.Namespace) -> int:
    """Train one plan, print its summary; the number of probes that failed."""
    from contextlib import ExitStack

    from probes.farm import open_workspace, plan_tasks, run_plan
    from store.lock import RunLock, check_writable

    started = time.perf_counter()
    ws = open_workspace(args.data)
    # Every probe's row and weights are written at the end of its training: a workspace that
    # cannot take them is refused now, not after the whole plan has trained.
    check_writable(ws.path, "a probe plan records its probes' rows and weights")
    with ExitStack() as held:
        # Held while the plan reads its runs: a drop-run of one of them waits or refuses, instead
        # of deleting arrays under the plan (whose reads then said "missing on disk ... re-extract").
        for run in sorted({t.run for t in plan_tasks(plan, ws)}):
            held.enter_context(RunLock(ws.path, run))
        report = run_plan(plan, args.data, scheduler=args.scheduler, workers=args.workers, in_process=args.in_process,
                          force=args.force, progress=not args.no_progress, memory_limit=args.memory_limit,
                          block_rows=args.block_rows)
    _summary(report, args.data, keys, time.perf_counter() - started)
    return int(report.failed)


async def _identity(address: str, timeout: float) -> object:
    import socket

    from distributed.comm import connect
    from distributed.comm.addressing import parse_address, parse_host_port

    scheme, loc = parse_address(address)
    if scheme in ("tcp", "tls"):  # a plain connect first: a closed port is refused at once, Dask would retry
        socket.create_connection(parse_host_port(loc), timeout=timeout).close()
    comm = await connect(address, timeout=0.8 * timeout)  # its own error (refused) beats the outer timeout
    try:
        await comm.write({"op": "identity", "reply": True})
        return await comm.read()
    finally:
        await comm.close()


def check_scheduler(address: str, timeout: float) -> None:
    """Refuse, within ``timeout`` seconds and in one line, an address where no Dask scheduler answers.

    Dask's client retries for 30 s, then prints a long traceback; a service of another kind on
    the port can make it read a length of exabytes from the reply and fail to allocate it.
    """
    import asyncio
    import logging

    import distributed.comm  # noqa: F401 - imported before the clock starts: it takes seconds

    from probes.errors import ProbeError

    quiet = logging.getLogger("distributed")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # its comm warnings would repeat the one line below
    try:
        info = asyncio.run(asyncio.wait_for(_identity(address, timeout), timeout))
    except Exception as err:  # noqa: BLE001 - refused, timed out, or not speaking Dask: all the same to the user
        raise ProbeError(
            f"cannot reach the Dask scheduler at {address} ({_why(err, timeout)}): check the address and"
            " port (`dask scheduler` prints it), that the scheduler runs and the port is not another service;"
            " raise --connect-timeout for a slow network, or drop --scheduler to start a local cluster"
        ) from None
    finally:
        quiet.setLevel(level)
    kind = info.get("type") if isinstance(info, dict) else type(info).__name__
    if kind != "Scheduler":
        raise ProbeError(f"{address} speaks Dask but is a {kind}, not a scheduler: pass the scheduler's address")


def _why(err: BaseException, timeout: float) -> str:
    import asyncio
    import socket

    if isinstance(err, (asyncio.TimeoutError, TimeoutError)) or "Timed out" in str(err):
        return f"no Dask answer within {timeout:g} s"
    cause = err.__cause__ if isinstance(err, OSError) and err.__cause__ is not None else err
    if isinstance(cause, ConnectionRefusedError):
        return "connection refused: nothing listens on that port"
    if isinstance(cause, socket.gaierror):
        return f"unknown host: {cause.strerror}"
    if isinstance(err, (MemoryError, OverflowError, ValueError, TypeError)) and "scheme" not in str(err):
        return "the service on that port does not speak Dask's protocol"  # it read garbage as a message length
    return f"{type(cause).__name__}: {str(cause).splitlines()[0][:200] if str(cause) else ''}".rstrip(": ")


def _dry_run(plan: Plan, args: argparse.Namespace) -> None:
    """What the run would do, by the run's own rule (probes.farm.triage): done, skipped, to train."""
    from probes.farm import open_workspace, triage
    from probes.plan import group_tasks

    ws = open_workspace(args.data)
    tri = triage(plan, ws, args.force)
    groups = group_tasks(tri.todo, plan.layers_per_task)
    print(f"plan {plan.name} on {ws.path}: {len(tri.tasks)} probes, {len(tri.done)} done,"
          f" {len(tri.todo)} to train in {len(groups)} Dask tasks"
          + (f", {len(tri.empty)} skipped (no samples)" if tri.empty else ""))
    if tri.runs_note:
        print(tri.runs_note)
    if tri.empty:
        print(f"skipped: {len(tri.empty)} probes, {tri.empty_reason()}")
    shown = tri.tasks if args.verbose else tri.tasks[:40]
    print(f"{'key':24}  {'status':7}  run / tap / layer / site / tokens -> target : kind (seed)")
    for t in shown:
        print(f"{t.key}  {tri.status(t):7}  {t.run} / {t.tap} / {t.layer} / {t.site} / {t.tokens} -> {t.record_target}"
              f" : {t.kind} ({t.seed})")
    if len(shown) < len(tri.tasks):
        print(f"... {len(tri.tasks) - len(shown)} more (-v lists all)")
    _memory_plan(ws, plan, groups, args)
    per = Counter((t.kind, t.target) for t in tri.todo)
    for (kind, target), n in sorted(per.items()):
        print(f"  to train: {n:6d}  {kind} -> {target}")


def _memory_plan(ws, plan, groups, args) -> None:
    """Each Dask task's bytes read and planned peak (manifest reads only; refuses what cannot fit)."""
    from probes.farm import parse_bytes, plan_work
    from probes.prepare import JobBuilder

    limit = parse_bytes(args.memory_limit if args.memory_limit is not None else plan.memory_limit)
    prep = JobBuilder(ws, plan)
    prep.prospective = plan.derive == "auto"  # reads what the run will read once it has derived (writes nothing)
    jobs = [prep.job(g) for g in groups if len(prep.samples(g.run, g.where)[0])]
    rows = args.block_rows or plan.block_rows
    work = plan_work(jobs, rows, limit, plan.out_of_core, plan.max_train_rows, check=False)
    cap = f"{limit >> 20} MiB" if limit else "Dask's default"
    print(f"memory plan (worker limit {cap}; a task must fit 80% of it):")
    print(f"  {'group':18} {'path':9} {'derived':10} {'layers':>6} {'rows':>7} {'reads MiB':>10} {'peak MiB':>9}"
          "  peak set by")
    for planned in work[: None if args.verbose else 40]:
        job, mem = planned.job, planned.memory
        path = PATH_NAMES.get(planned.trainer.name, planned.trainer.name)
        reads = _derived_status(prep, jobs, job)
        print(f"  {job.group:18} {path:9} {reads:10} {len(job.arrays):6d} {len(job.rows):7d}"
              f" {mem.read_bytes / 2**20:10.1f} {mem.peak_bytes / 2**20:9.1f}  {mem.what}")
    if work:
        print(f"  total read {sum(p.memory.read_bytes for p in work) / 2**20:.1f} MiB;"
              f" largest peak {max(p.memory.peak_bytes for p in work) / 2**20:.1f} MiB")
    todo = {(s.zarr_path, g.how): s for g in prep.derived.values() for s in g.todo}
    if todo:
        print(f"derive: auto first derives {len(todo)} array(s) on this client, reading"
              f" {sum(s.bytes for s in todo.values()) / 2**20:.1f} MiB of tokens once; later plans read them instead")
    plan_work(jobs, rows, limit, plan.out_of_core, plan.max_train_rows)


#: How the dry run names each trainer's path (a plugin trainer by its own name).
PATH_NAMES = {"in_memory": "in-memory", "streamed": "streamed", "iterative": "subsample"}
_STATUS_ORDER = ("to refresh", "to derive", "stale", "fresh")


def _derived_status(prep: Any, jobs: list[Any], job: Any) -> str:
    """What a dry-run job reads (docs/probes.md, derived arrays). A job of merged layers shows the
    status that costs most among its layers' groups (one to derive makes the job 'to derive')."""
    paths = {a.zarr_path for a in job.arrays}
    statuses = {getattr(prep.derived.get(j.group[:16]), "status", None) for j in jobs
                if any(a.zarr_path in paths for a in j.arrays)}
    return next((s for s in _STATUS_ORDER if s in statuses), "-")


def _summary(report, data, keys, wall: float) -> None:
    from probes.farm import open_workspace

    rate = (f"; {report.probes_per_s:.1f} probes/s, {report.gflops_per_s:.2f} GFLOP/s on {report.workers} worker(s)"
            if report.trained else "")
    print(f"{report.trained} trained, {report.skipped} skipped (done), {report.failed} failed{rate}")
    if report.trained or report.failed:  # the rate above is the training's alone: say where the rest went
        print(f"wall time {wall:.1f} s: {report.startup_seconds:.1f} s starting the workers, {report.seconds:.1f} s"
              f" training, {max(wall - report.startup_seconds - report.seconds, 0.0):.1f} s reading the plan's"
              " rows and labels and recording results")
    if not keys:
        return
    import pyarrow as pa

    ws = open_workspace(data)
    with ws.connect() as con:
        con.register("plan_keys", pa.table({"key": sorted(keys)}))
        rows = con.execute(
            "WITH mine AS (SELECT * FROM probes WHERE params->>'key' IN (SELECT key FROM plan_keys)),"
            " layers AS (SELECT run, tap || '/' || site AS tap, tokens, target, kind, metric, layer, avg(score) AS score,"
            "  avg(control_score) AS ctrl FROM mine GROUP BY ALL)"
            " SELECT * FROM layers QUALIFY row_number() OVER (PARTITION BY run, tap, tokens, target, kind, metric"
            "  ORDER BY score DESC, layer) = 1 ORDER BY run, tap, target, kind LIMIT 40").fetchall()
    if rows:
        print("best layer per probe (mean over seeds):")
        # Columns as wide as their longest value: a run id cut short names no run.
        heads = ("run", "tap/site", "tokens", "target")
        w = [max(len(h), *(len(str(r[i])) for r in rows)) for i, h in enumerate(heads)]
        print(f"{'run':{w[0]}} {'tap/site':{w[1]}} {'tokens':{w[2]}} {'target':{w[3]}} {'kind':14} {'metric':13}"
              f" {'layer':>5} {'score':>6} {'ctrl':>6} {'sel':>6}")
        for r in rows:
            ctrl = "-" if r[8] is None else f"{r[8]:.3f}"
            sel = "-" if r[8] is None else f"{r[7] - r[8]:+.3f}"
            print(f"{r[0]:{w[0]}} {r[1]:{w[1]}} {r[2]:{w[2]}} {r[3]:{w[3]}} {r[4]:14} {r[5]:13} {r[6]:5d} {r[7]:6.3f}"
                  f" {ctrl:>6} {sel:>6}")
