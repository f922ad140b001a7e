"""Pooled features as derived arrays: ``pool(tokens, how)`` computed once per source chunk and stored
(store/derived.py), so plans whose probes pool the same way read ``[n, d]`` float32 instead of the
token arrays, with the same values to the bit (``pool`` of a sample depends on that sample alone).

``python -m probes derive --run RUN --pool mean``, or the farm under the plan's ``derive: auto``
before it dispatches any group, writes them on the client (workers write nothing). The farm reads
a fresh one for every group whose probes all pool one way (:func:`pooling_of`: ``pooled``, and the
streamed statistics kinds on sample targets), and pools on the fly, saying why, when the source
has been re-extracted since (stale) and the plan says ``derive: never``.
"""

from __future__ import annotations

import argparse
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from probes.errors import ProbeError
from probes.features import read_features
from probes.pooling import pool
from store import ArrayInfo, StoreError, Workspace
from store import derived as store_derived
from store.lock import RunLock, WriterLock, check_writable
from store.workspace import resolve_path

POOLS = ("mean", "max", "first", "last")
#: The kinds whose features are ``pool(X, params.pool)`` and nothing else before training.
POOLING_KINDS = ("pooled",)
#: Streamed kinds whose sample-target features are ``pool(X, params.pool)`` (probes/stream.py read_block).
STREAM_SOLVERS = ("ridge", "lda", "centroid")
CODE = "probes.pooling.pool"


def op_name(how: str) -> str:
    return f"pool_{how}"


def derive(ws: Workspace, source: ArrayInfo, how: str) -> store_derived.DerivedInfo:
    """Pool every chunk of ``source`` (``how``: mean / max / first / last) into a derived array."""
    if how not in POOLS:
        raise ProbeError(f"pool {how!r} is not one of {', '.join(POOLS)}")
    if source.layout == "dense" and len(source.shape) < 3:
        raise ProbeError(f"{source.key()} holds one vector per sample already (shape {list(source.shape)}):"
                         " nothing to pool")
    if source.layout == "ragged" and len(source.shape) != 3:
        raise ProbeError(f"{source.key()}: pooled features come from [tokens, d] rows, not {list(source.shape)}")

    def chunk(k: int, rows: range) -> Any:
        import numpy as np

        try:
            return pool(read_features(ws.root, source, np.arange(rows.start, rows.stop), stored=True), how)
        except ProbeError as err:  # e.g. samples with no answer tokens: there is no vector to store for them
            raise ProbeError(f"{source.key()} chunk {k}: {err}. A derived array pools every sample, so this array"
                             " stays pooled on the fly by the plans that select such samples out") from err

    return store_derived.write(ws, source, op_name(how), CODE, chunk)


def pooling_of(tasks: list[Any]) -> str | None:
    """The one ``pool`` every task's features are (``pool(X, how)`` and nothing else before training),
    or None when some task needs the tokens themselves (a token target, a kind that reads tokens) or
    the tasks pool in different ways. ``pooled`` pools always; the streamed statistics kinds
    (``ridge``, ``lda``, ``nearest_centroid``: probes/stream.py ``read_block``) pool for sample targets."""
    from probes.kinds import get_kind
    from probes.targets import get_target

    hows = set()
    for t in tasks:
        kind = get_kind(t.kind)
        params = kind.check_params(t.params)
        how = getattr(params, "pool", None)
        streamed = "streamed" in kind.trains and getattr(kind, "stream_solver", None) in STREAM_SOLVERS
        if how not in POOLS or not (t.kind in POOLING_KINDS or (streamed and get_target(t.target).shape == "sample")):
            return None
        hows.add(how)
    return hows.pop() if len(hows) == 1 else None


@dataclass
class GroupDerived:
    """What a group reads. ``status``: ``fresh`` (``arrays``: its derived arrays), ``to derive`` /
    ``to refresh`` (derive: auto writes the missing / stale ones, ``todo``, before dispatch; ``arrays``
    as they will be), ``stale`` (derive: never: pooling on the fly, ``note`` says why), or None (no
    derived array: the tasks need the tokens, or derive: never and none was derived)."""

    how: str | None = None
    status: str | None = None
    arrays: list[ArrayInfo] | None = None
    note: str | None = None
    todo: list[ArrayInfo] = field(default_factory=list)


def group_status(ws: Workspace, sources: list[ArrayInfo], tasks: list[Any], auto: bool = False) -> GroupDerived:
    """Whether a group of ``tasks`` over ``sources`` (one per layer) reads derived arrays.
    ``auto``: a missing or stale derivation counts as one to derive (the plan's ``derive: auto``)."""
    how = pooling_of(tasks) if tasks else None
    if how is None or not all(poolable(s) for s in sources):
        return GroupDerived()
    out, todo, stale, damaged = [], [], None, None
    for source in sources:
        got = store_derived.find(ws, source, op_name(how))
        if got is not None and store_derived.is_fresh(ws, got, source):
            problems = _damage(ws, got)
            if not problems:
                out.append(got.array_info())
                continue
            damaged = damaged or f"derived array {got.zarr_path}: {problems[0]}"
        elif got is not None and stale is None:
            stale = (got, source)
        todo.append(source)
        out.append(store_derived.planned(source, op_name(how), _pooled_shape(source)).array_info())
    if not todo:
        return GroupDerived(how, "fresh", out)
    if auto:
        return GroupDerived(how, "to refresh" if stale or damaged else "to derive", out, todo=todo)
    if damaged is not None:  # never read as data: the tokens are still there to pool
        return GroupDerived(how, "stale", None,
                            f"{damaged}: pooling on the fly instead of reading it; derive it again with python -m"
                            f" probes derive --run {sources[0].run} --pool {how}")
    if stale is None:
        return GroupDerived(how)
    return GroupDerived(how, "stale", None,
                        f"derived array {stale[0].zarr_path} is stale (its source {stale[1].key()} was re-extracted"
                        f" since): pooling on the fly; refresh it with python -m probes derive --run {stale[1].run}"
                        f" --pool {how}, or leave the plan's derive: auto (the default) to refresh it")


# What each derived array's chunks looked like when this process last checked them, per workspace
# object (a plan opens its own): a plan of many groups over one array reads its bytes once.
_CHECKED: weakref.WeakKeyDictionary[Workspace, dict[tuple[str, tuple[int, ...] | None], list[str]]] = (
    weakref.WeakKeyDictionary())


def _damage(ws: Workspace, info: store_derived.DerivedInfo) -> list[str]:
    """Why ``info``'s bytes cannot be read as data (store.derived.damaged_chunks), checked once per plan."""
    seen = _CHECKED.setdefault(ws, {})
    key = (info.zarr_path, info.chunk_crc32c)
    if key not in seen:
        try:
            seen[key] = store_derived.damaged_chunks(ws, info)
        except Exception as err:  # noqa: BLE001 - unreadable is damaged: pool the tokens instead
            seen[key] = [f"unreadable ({type(err).__name__}: {err})"]
    return seen[key]


def for_group(ws: Workspace, sources: list[ArrayInfo], tasks: list[Any]) -> tuple[list[ArrayInfo] | None, str | None]:
    """The derived arrays to read instead of ``sources`` when every task pools the same way and a
    fresh derivation exists for every layer; else None, with a note when one exists but is stale."""
    got = group_status(ws, sources, tasks)
    return (got.arrays if got.status == "fresh" else None), got.note


def derive_for_plan(ws: Workspace, groups: list[tuple[list[ArrayInfo], list[Any]]],
                    log: Callable[[str], None]) -> int:
    """``derive: auto``: before any group is dispatched, derive (on this client: workers write
    nothing) every array that a pooling group selects and that has no fresh derivation of that pool.
    An array that cannot be derived (a sample without tokens) is one line in the log, and its groups
    pool on the fly. Returns how many arrays were derived."""
    wanted: dict[tuple[str, str], tuple[ArrayInfo, str]] = {}
    for sources, tasks in groups:
        got = group_status(ws, sources, tasks, auto=True)
        for s in got.todo:
            wanted.setdefault((s.zarr_path, str(got.how)), (s, str(got.how)))
    if not wanted:
        return 0
    lock = WriterLock(ws.path / "writer.lock", run="probes derive")
    try:
        lock.acquire()  # derived rows and files change under the same lock as a run's (drop-run waits)
    except (StoreError, OSError) as err:
        log(f"derive: auto: not deriving now ({err}); pooling on the fly")
        return 0
    try:
        return _derive_wanted(ws, list(wanted.values()), log)
    finally:
        lock.release()


def _derive_wanted(ws: Workspace, wanted: list[tuple[ArrayInfo, str]], log: Callable[[str], None]) -> int:
    made = 0
    for source, how in wanted:
        old = store_derived.find(ws, source, op_name(how))
        if old is not None and store_derived.is_fresh(ws, old, source) and not _damage(ws, old):
            continue
        try:
            info = derive(ws, source, how)
        except (ProbeError, StoreError, OSError) as err:
            log(f"derive: auto: {_one_line(err)}; pooling on the fly")
            continue
        made += 1
        why = "refreshed (its source was re-extracted)" if old is not None else "derived"
        log(f"derive: auto: {info.zarr_path} {why}, {info.shape[0]} x {info.shape[1]} float32 from {source.key()}"
            " (once: later plans read it instead of the tokens)")
    return made


def main(argv: list[str]) -> int:
    """``python -m probes derive --run RUN --pool mean [--tap T] [--layer L] [--site S] [--tokens K]``."""
    p = argparse.ArgumentParser(prog="python -m probes derive", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=None, help="workspace folder (default: $AGNOSIA_DATA, else ./data)")
    p.add_argument("--run", required=True, help="the run whose token arrays to pool")
    p.add_argument("--pool", default="mean", choices=POOLS, help="how tokens become one vector (default mean)")
    p.add_argument("--tap", default=None, help="only this tap (vision, projector, llm, ...)")
    p.add_argument("--layer", type=int, default=None, help="only this layer")
    p.add_argument("--site", default=None, help="only this site")
    p.add_argument("--tokens", default=None, help="only this token kind (image, answer, ...)")
    args = p.parse_args(argv)
    try:
        path = resolve_path(args.data).absolute()
        if not (path / "manifest.duckdb").is_file():
            Workspace.open(path, readonly=True)  # its error names the missing workspace; derive creates none
        check_writable(path, "probes derive writes derived arrays and their rows")  # before any token is read
        ws = Workspace.open(path)  # read-write: migrates an older manifest
        # The writer lock: a drop-run or an extraction never interleaves with the rows and files
        # written here (a dropped run's derived rows used to outlive it); the run's readers' lock
        # as a plan takes it, so the run cannot be dropped between listing and reading it.
        with WriterLock(ws.path / "writer.lock", run=f"probes derive {args.run}"), RunLock(ws.path, args.run):
            sources = [a for a in ws.arrays(args.run) if _wanted(a, args)]
            if not sources:
                raise ProbeError(f"run {args.run} has no token array matching --tap/--layer/--site/--tokens in"
                                 f" {ws.path}: list them with python -m store query"
                                 f" \"SELECT * FROM v_arrays WHERE run = '{args.run}'\"")
            failed = sum(not _derive_one(ws, source, args.pool) for source in sources)
    except (ProbeError, StoreError, OSError) as err:
        print(f"error: {_one_line(err)}", file=sys.stderr)
        return 2
    return 2 if failed else 0


def _one_line(err: BaseException) -> str:
    """An error as the one line a user reads; an OSError names its file and what to do."""
    if not isinstance(err, OSError):
        return str(err)
    what = f"{err.filename}: " if err.filename else ""
    return (f"{what}{err.strerror or err} while deriving: fix that (space, permissions, the path), then run the same"
            " command again (a derived array is registered only once whole, so nothing half-written is read)")


def _derive_one(ws: Workspace, source: ArrayInfo, how: str) -> bool:
    """Derive one array (or say it is up to date); an array that cannot be pooled is one error line,
    and the others still get theirs."""
    try:
        old = store_derived.find(ws, source, op_name(how))
        fresh = old is not None and store_derived.is_fresh(ws, old, source)
        damage = _damage(ws, old) if old is not None and fresh else []
        if old is not None and fresh and not damage:
            print(f"{old.zarr_path}: up to date")
            return True
        got = derive(ws, source, how)
    except (ProbeError, StoreError) as err:
        print(f"error: {err}", file=sys.stderr)
        return False
    why = ("recomputed: its source was re-extracted" if not fresh else f"recomputed: {damage[0]}") \
        if old is not None else "derived"
    print(f"{got.zarr_path}: {why} ({got.shape[0]} x {got.shape[1]} float32 from {source.key()})")
    return True


def poolable(a: ArrayInfo) -> bool:
    """Whether ``a`` holds tokens x features per sample (what ``pool`` reduces). A dense array of one
    token per sample (``last``) is not: pooling it is the identity, and a float32 copy of it would
    only double a float16 store's bytes."""
    return (a.layout == "dense" and len(a.shape) == 3 and a.shape[1] > 1) or (a.layout == "ragged" and len(a.shape) == 3)


def _pooled_shape(source: ArrayInfo) -> tuple[int, ...]:
    return (source.n_samples, source.shape[-1])


def _wanted(a: ArrayInfo, args: argparse.Namespace) -> bool:
    ok = poolable(a) and (a.tap != "attn" or args.tap == "attn")  # attention maps are [query, key], not tokens x d
    return ok and all(want is None or got == want for got, want in
                            ((a.tap, args.tap), (a.layer, args.layer), (a.site, args.site), (a.tokens, args.tokens)))
