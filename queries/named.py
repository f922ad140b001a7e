"""Named queries: one documented ``queries/sql/<name>.sql`` file per question.

A file's leading ``--`` comment is its description; lines ``-- param: NAME  text (default X)``
declare its parameters, which the SQL uses as DuckDB named parameters (``$NAME``). Every query
runs on a read-only connection, so a query can never change the store.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from store import StoreError, Workspace
from store.arrays import ZARR_DIR
from store.workspace import MANIFEST

SQL_DIR = Path(__file__).with_name("sql")
# What a workspace folder holds besides its manifest files (store/workspace.py): never an output.
_WORKSPACE_FOLDERS = (ZARR_DIR, "locks", ".trash")
_PARAM = re.compile(r"^--\s*param:\s*(\w+)\s+(.*?)(?:\(default\s+(.*)\))?\s*$")


class QueryError(ValueError):
    """A named query or its parameters are wrong; the message says which and the fix."""


@dataclass(frozen=True)
class Param:
    name: str
    help: str
    default: str | None


@dataclass(frozen=True)
class NamedQuery:
    name: str
    path: Path
    description: str
    params: tuple[Param, ...]
    sql: str

    def bind(self, values: dict[str, str]) -> dict[str, Any]:
        known = {p.name for p in self.params}
        unknown = set(values) - known
        if unknown:
            raise QueryError(
                f"query {self.name} has no parameter {', '.join(sorted(unknown))}; its parameters:"
                f" {', '.join(sorted(known)) or 'none'}"
            )
        bound = {}
        for p in self.params:
            raw = values.get(p.name, p.default)
            if raw is None:
                raise QueryError(f"query {self.name} needs --param {p.name}=VALUE ({p.help})")
            bound[p.name] = _literal(raw)
        return bound


def _literal(raw: str) -> Any:
    raw = raw.strip()
    if len(raw) >= 2 and raw[0] == raw[-1] == "'":
        return raw[1:-1]
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


def parse(path: Path) -> NamedQuery:
    text = path.read_text()
    description, params = [], []
    for line in text.splitlines():
        if not line.startswith("--"):
            break
        m = _PARAM.match(line)
        if m:
            params.append(Param(m[1], m[2].strip(), None if m[3] is None else m[3].strip()))
        else:
            description.append(line.removeprefix("--").strip())
    return NamedQuery(path.stem, path, " ".join(d for d in description if d), tuple(params), text)


def available() -> dict[str, NamedQuery]:
    return {p.stem: parse(p) for p in sorted(SQL_DIR.glob("*.sql"))}


def get(name: str) -> NamedQuery:
    queries = available()
    if name not in queries:
        raise QueryError(f"no named query {name!r}: choose one of {', '.join(queries)} (python -m queries --list)")
    return queries[name]


def check_out(out: str | Path) -> Path:
    """Refuse an ``--out`` file that would overwrite a workspace's own files (its manifest, the
    writer lock, anything under arrays/) or whose folder does not exist; returns the path."""
    path = Path(out)
    folder = path.parent
    if not folder.is_dir():
        raise QueryError(f"--out {out}: folder {folder} does not exist; create it first (mkdir -p {folder})")
    if path.is_dir():
        raise QueryError(f"--out {out} is a folder; name a file in it, e.g. {path / 'result.csv'}")
    real = path.resolve()  # through symlinks: a link to the manifest is the manifest
    for ws in real.parents:
        if not (ws / MANIFEST).is_file():
            continue
        top = real.relative_to(ws).parts[0]
        if top.startswith((MANIFEST, f".{MANIFEST}", "writer.lock")) or top in _WORKSPACE_FOLDERS:
            raise QueryError(
                f"--out {out} would overwrite {real}, a file of the workspace {ws} (its manifest, locks or arrays):"
                " write the result outside those files"
            )
    return path


def run(ws: Workspace, name: str, params: dict[str, str] | None = None) -> pa.Table:
    """Run a named query on a read-only connection of ``ws``."""
    query = get(name)
    bound = query.bind(params or {})
    try:
        return ws.query(query.sql, bound)
    except StoreError as err:
        raise QueryError(f"query {name} failed on {ws.path}: {err}") from err
