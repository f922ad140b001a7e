"""Named queries: one documented ``queries/sql/<name>.sql`` file per question, and the instances of
the gap primitive (``queries.gap.INSTANCES``: the gap with its parameters fixed, e.g. ``counting_gaps``).

A file's leading ``--`` comment is its description; lines ``-- param: NAME  text (default X)``
declare its parameters, which the SQL uses as DuckDB named parameters (``$NAME``). Every query
runs on a read-only connection, so a query can never change the store.

A parameter whose text names a run (``a run id``, ``the first run``) is checked against the
``runs`` table when it is given: a run id (or LIKE pattern) that matches no run is an error with
the nearest run ids, not an empty table that looks like an answer.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from queries import gap
from store import StoreError, Workspace
from store.arrays import ZARR_DIR
from store.workspace import MANIFEST

SQL_DIR = Path(__file__).with_name("sql")
# What a workspace folder holds besides its manifest files (store/workspace.py): never an output.
_WORKSPACE_FOLDERS = (ZARR_DIR, "locks", ".trash")
_PARAM = re.compile(r"^--\s*param:\s*(\w+)\s+(.*?)(?:\(default\s+(.*)\))?\s*$")
_NAMES_RUN = re.compile(r"\brun\b")


class QueryError(ValueError):
    """A named query or its parameters are wrong; the message says which and the fix."""


@dataclass(frozen=True)
class Param:
    name: str
    help: str
    default: str | None

    @property
    def names_run(self) -> bool:
        return bool(_NAMES_RUN.search(self.help))


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


_RUN = Param("run", "a run id, or '%' for every run", "'%'")


def available() -> dict[str, NamedQuery]:
    """Every named query: the ``.sql`` files of queries/sql/ and the gap queries of queries/gap.py.

    Returns
    -------
    dict[str, NamedQuery]
        Name -> query, sorted by name.
    """
    queries = {p.stem: parse(p) for p in SQL_DIR.glob("*.sql")}
    queries |= {i.name: NamedQuery(i.name, Path(gap.__file__), i.description, (_RUN,), i.sql()) for i in gap.INSTANCES}
    return dict(sorted(queries.items()))


def get(name: str) -> NamedQuery:
    """The named query ``name``.

    Parameters
    ----------
    name
        A name of :func:`available` (``python -m queries --list``).

    Returns
    -------
    NamedQuery
        Its SQL, parameters and description.

    Raises
    ------
    QueryError
        No query has that name; the message lists those that exist.
    """
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
    """Run a named query on a read-only connection of ``ws``.

    Parameters
    ----------
    ws
        The workspace whose manifest the query reads.
    name
        The query's name (:func:`available`).
    params
        Values of the query's ``$parameters``, as text; omitted ones take their defaults. A
        parameter naming a run must match one of the workspace's runs (SQL ``LIKE``).

    Returns
    -------
    pyarrow.Table
        The query's result.

    Raises
    ------
    QueryError
        An unknown query or parameter, a run parameter matching no run, or SQL that fails.
    """
    query = get(name)
    bound = query.bind(params or {})
    given = [p for p in query.params if p.names_run and p.name in (params or {})]
    if given:
        runs = [r[0] for r in ws.rows("SELECT run FROM runs ORDER BY run")]
        for p in given:
            check_run_param(p.name, str(bound[p.name]), runs, ws)
    try:
        return ws.query(query.sql, bound)
    except StoreError as err:
        raise QueryError(f"query {name} failed on {ws.path}: {err}") from err


def check_run_param(name: str, value: str, runs: list[str], ws: Workspace) -> None:
    """Refuse a run parameter that matches no run (LIKE semantics, as the SQL uses it)."""
    pattern = re.compile("^" + "".join(".*" if c == "%" else "." if c == "_" else re.escape(c) for c in value) + "$",
                         re.DOTALL)
    if any(pattern.match(r) for r in runs):
        return
    if not runs:
        raise QueryError(f"--param {name}={value} names no run: the workspace {ws.path} holds no runs yet")
    parts = [t for t in re.split(r"[-_.%]+", value.lower()) if t]
    near = difflib.get_close_matches(value, runs, n=3, cutoff=0.5)
    near += [r for r in runs if parts and all(t in r.lower() for t in parts) and r not in near]
    hint = f"did you mean {' or '.join(near[:3])}?" if near else f"its runs: {', '.join(runs[:8])}"
    more = ""
    if len(runs) > 8 and not near:
        more = f" (python -m queries --sql 'SELECT run FROM runs' lists all {len(runs)})"
    raise QueryError(f"--param {name}={value} names no run in {ws.path}: {hint}{more}")
