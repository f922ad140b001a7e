"""Pooled features as derived arrays: ``pool(tokens, how)`` computed once per source chunk and stored
(store/derived.py), so plans whose probes pool the same way read ``[n, d]`` float32 instead of the
token arrays, with the same values to the bit (``pool`` of a sample depends on that sample alone).

``python -m probes derive --run RUN --pool mean`` writes them on the client (workers write nothing);
the farm then reads a fresh one for every group whose probes are all ``pooled`` with that ``pool``,
and pools on the fly, saying why, when the source has been re-extracted since (stale).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from probes.errors import ProbeError
from probes.features import read_features
from probes.pooling import pool
from store import ArrayInfo, StoreError, Workspace
from store import derived as store_derived

POOLS = ("mean", "max", "first", "last")
#: The kinds whose features are ``pool(X, params.pool)`` and nothing else before training.
POOLING_KINDS = ("pooled",)
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
            return pool(read_features(ws.root, source, np.arange(rows.start, rows.stop)), how)
        except ProbeError as err:  # e.g. samples with no answer tokens: there is no vector to store for them
            raise ProbeError(f"{source.key()} chunk {k}: {err}. A derived array pools every sample, so this array"
                             " stays pooled on the fly by the plans that select such samples out") from err

    return store_derived.write(ws, source, op_name(how), CODE, chunk)


def for_group(ws: Workspace, sources: list[ArrayInfo], tasks: list[Any]) -> tuple[list[ArrayInfo] | None, str | None]:
    """The derived arrays to read instead of ``sources`` when every task pools the same way and a
    fresh derivation exists for every layer; else None, with a note when one exists but is stale."""
    from probes.kinds import get_kind

    if not tasks or any(t.kind not in POOLING_KINDS for t in tasks):
        return None, None
    hows = {get_kind(t.kind).check_params(t.params).pool for t in tasks}
    if len(hows) != 1:
        return None, None
    how = hows.pop()
    out = []
    for source in sources:
        got = store_derived.find(ws, source, op_name(how))
        if got is None:
            return None, None
        if not store_derived.is_fresh(ws, got, source):
            return None, (f"derived array {got.zarr_path} is stale (its source {source.key()} was re-extracted since):"
                          f" pooling on the fly; refresh it with python -m probes derive --run {source.run}"
                          f" --pool {how}")
        out.append(got.array_info())
    return out, None


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
        ws = Workspace.open(args.data)
        sources = [a for a in ws.arrays(args.run) if _wanted(a, args)]
        if not sources:
            raise ProbeError(f"run {args.run} has no token array matching --tap/--layer/--site/--tokens in {ws.path}:"
                             f" list them with python -m store query \"SELECT * FROM v_arrays WHERE run = '{args.run}'\"")
        failed = sum(not _derive_one(ws, source, args.pool) for source in sources)
    except (ProbeError, StoreError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 2 if failed else 0


def _derive_one(ws: Workspace, source: ArrayInfo, how: str) -> bool:
    """Derive one array (or say it is up to date); an array that cannot be pooled is one error line,
    and the others still get theirs."""
    try:
        old = store_derived.find(ws, source, op_name(how))
        if old is not None and store_derived.is_fresh(ws, old, source):
            print(f"{old.zarr_path}: up to date")
            return True
        got = derive(ws, source, how)
    except (ProbeError, StoreError) as err:
        print(f"error: {err}", file=sys.stderr)
        return False
    why = "recomputed: its source was re-extracted" if old is not None else "derived"
    print(f"{got.zarr_path}: {why} ({got.shape[0]} x {got.shape[1]} float32 from {source.key()})")
    return True


def _wanted(a: ArrayInfo, args: argparse.Namespace) -> bool:
    poolable = (a.layout == "dense" and len(a.shape) >= 3) or (a.layout == "ragged" and len(a.shape) == 3)
    poolable &= a.tap != "attn" or args.tap == "attn"  # attention maps are [query, key], not tokens x features
    return poolable and all(want is None or got == want for got, want in
                            ((a.tap, args.tap), (a.layer, args.layer), (a.site, args.site), (a.tokens, args.tokens)))
