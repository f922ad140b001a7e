"""The package import graph is a DAG with only the edges docs/design.md allows.

Every module's imports are read with ``ast`` (no import runs), function-level ones too, each marked
lazy or not. Modules fold into stages: ``stimuli``, ``extract``, ``store``, ``probes``, ``queries``,
``bench``, ``toyvlm`` (the toy model a checkpoint loads: its config, model, processor, tokenizer) and
``lab`` (data, training, evaluation, the model cards of that toy), which may use the stages like any
other client. An edge not in ``ALLOWED`` fails, naming the importing file and line.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("stimuli", "extract", "store", "probes", "queries", "toyvlm", "lab", "bench")

# stage -> the stages it may import. Lazy-only edges are listed in LAZY_ONLY.
ALLOWED: dict[str, set[str]] = {
    "stimuli": {"store"},
    "store": set(),
    "extract": {"stimuli", "store", "toyvlm"},
    "probes": {"store", "stimuli"},
    "queries": {"store", "probes"},
    "toyvlm": set(),
    "lab": {"toyvlm", "stimuli", "extract", "store"},
    "bench": {"stimuli", "extract", "store", "probes", "queries", "toyvlm", "lab"},
}
# (from, to) -> the only module that may make the edge, and only inside a function.
LAZY_ONLY: dict[tuple[str, str], tuple[str, ...]] = {
    ("extract", "toyvlm"): ("extract.models.adapters.toy",),
    # The first stage validates its options with the one strict-config helper (store/config.py),
    # only when options are checked: `import stimuli` stays free of zarr and duckdb.
    ("stimuli", "store"): ("stimuli.base", "stimuli.cli"),
}


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, e.g. "extract.models.adapters.toy"
    target: str  # the imported module, absolute, e.g. "toyvlm.processor"
    lazy: bool  # inside a function (runs on call, not on import)
    where: str  # "path:line"


def stage(module: str) -> str | None:
    top = module.split(".")[0]
    return top if top in PACKAGES else None


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    if node.level == 0:
        base = node.module or ""
    else:
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([node.module] if node.module else []))
    # ``from . import tokenizer`` imports the submodule; ``from .x import name`` imports .x
    return [f"{base}.{alias.name}" if node.module is None else base for alias in node.names]


def imports_of(path: Path, module: str | None = None) -> list[Import]:
    """Every import in ``path`` that can run (not those under ``if TYPE_CHECKING:``), in source order."""
    module = module or module_name(path)
    label = str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.extend(Import(module, a.name, lazy, f"{label}:{child.lineno}") for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                targets = _absolute(module, is_package, child)
                found.extend(Import(module, t, lazy, f"{label}:{child.lineno}") for t in targets)
            else:
                visit(child, lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text(), filename=label), False)
    return found


@cache
def all_imports() -> tuple[Import, ...]:
    found: list[Import] = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "checkpoints" not in path.parts:
                found.extend(imports_of(path))
    return tuple(found)


def violations(edges: Iterable[Import]) -> list[str]:
    """One line per import that crosses stages along an edge ``ALLOWED`` / ``LAZY_ONLY`` forbid."""
    bad: list[str] = []
    for i in edges:
        src, dst = stage(i.module), stage(i.target)
        if src is None or dst is None or src == dst:
            continue
        if dst not in ALLOWED[src]:
            bad.append(f"{i.where}: {i.module} imports {i.target} ({src} -> {dst} is not allowed)")
        elif (src, dst) in LAZY_ONLY and (i.module not in LAZY_ONLY[src, dst] or not i.lazy):
            bad.append(f"{i.where}: {i.module} imports {i.target}: {src} -> {dst} is allowed only"
                       f" lazily (inside a function) in {', '.join(LAZY_ONLY[src, dst])}")
    return bad


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` as a path that ends where it starts, or None for a DAG."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done

    def walk(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [node, nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := walk(nxt, path + [node])):
                return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := walk(node, [])):
            return found
    return None


def stage_graph(edges: Iterable[Import]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {s: set() for s in ALLOWED}
    for i in edges:
        src, dst = stage(i.module), stage(i.target)
        if src and dst and src != dst:
            graph[src].add(dst)
    return graph


# --- the repository ------------------------------------------------------------------------------

def test_every_package_module_is_read() -> None:
    edges = all_imports()
    assert {stage(i.module) for i in edges} == set(ALLOWED)
    lazy = [i for i in edges if i.module == "extract.models.adapters.toy" and i.target.startswith("toyvlm")]
    assert lazy and all(i.lazy for i in lazy)  # the adapter's toyvlm imports are seen, and seen as lazy


def test_imports_follow_the_allowed_edges() -> None:
    bad = violations(all_imports())
    assert not bad, "forbidden imports (see docs/design.md, architecture):\n" + "\n".join(bad)


def test_stage_graph_is_a_dag() -> None:
    assert cycle(stage_graph(all_imports())) is None
    assert cycle(ALLOWED) is None  # the allowed set itself leaves no room for a cycle


def test_toy_modeling_imports_no_stage() -> None:
    # The checkpoint's own code: loading a toy never needs extract, stimuli, the store or the lab.
    edges = [i for i in all_imports() if stage(i.module) == "toyvlm"]
    assert {i.module for i in edges} >= {"toyvlm", "toyvlm.config", "toyvlm.model", "toyvlm.processor"}
    assert [i for i in edges if stage(i.target) not in (None, "toyvlm")] == []


def test_extract_never_imports_the_lab() -> None:
    # The toy's training tools are a client of extract, never a part of it: not even lazily.
    assert [i.where for i in all_imports() if stage(i.module) == "extract" and stage(i.target) == "lab"] == []


# --- the checker itself, on small examples -----------------------------------------------------

@pytest.mark.parametrize("source, module, want", [
    ("from extract.run import x\n", "store.db", ["store -> extract is not allowed"]),
    ("import probes.plan\n", "stimuli.goboard", ["stimuli -> probes is not allowed"]),
    ("from stimuli import goboard\n", "toyvlm.tokenizer", ["toyvlm -> stimuli is not allowed"]),
    ("from toyvlm.model import M\n", "extract.run", ["allowed only lazily"]),
    ("def f():\n    from toyvlm.model import M\n", "extract.run", ["allowed only lazily"]),
    ("import toyvlm\n", "extract.models.adapters.toy", ["allowed only lazily"]),
    ("def f():\n    import toyvlm\n", "extract.models.adapters.toy", []),
    ("def f():\n    import lab\n", "extract.models.adapters.toy", ["extract -> lab is not allowed"]),
    ("from toyvlm.processor import prompt\n", "lab.train", []),
    ("from .db import x\n", "store.cli", []),
    ("from ..db import x\n", "store.sub.cli", []),
    ("from .. import records\n", "queries.sub.x", []),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import extract\n", "store.db", []),
])
def test_checker_flags_forbidden_edges(tmp_path: Path, source: str, module: str, want: list[str]) -> None:
    path = tmp_path / "m.py"
    path.write_text(source)
    bad = violations(imports_of(path, module))
    assert len(bad) == len(want) and all(w in b for w, b in zip(want, bad, strict=True)), bad


def test_cycle_is_found_in_a_small_graph() -> None:
    assert cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    found = cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}})
    assert found is not None and found[0] == found[-1] and set(found) == {"a", "b", "c"}
    graph = {s: set(t) for s, t in ALLOWED.items()}
    graph["store"].add("probes")  # probes -> store already: store -> probes would close a loop
    assert cycle(graph) is not None


# --- modules: no circle, no private names across modules, few project bases -------------------

def module_graph(edges: Iterable[Import]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (function-level imports included), each import
    resolved to the deepest project module it names."""
    known = {module_name(p) for package in PACKAGES for p in (ROOT / package).rglob("*.py")
             if "checkpoints" not in p.parts}
    graph: dict[str, set[str]] = {m: set() for m in known}
    for i in edges:
        target = i.target
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != i.module and not (i.module + ".").startswith(target + "."):
            graph[i.module].add(target)  # a package's own __init__ is not an edge back to it
    return graph


def test_no_module_circle_even_through_function_level_imports() -> None:
    found = cycle(module_graph(all_imports()))
    assert found is None, "import circle: " + " -> ".join(found or [])


def private_imports(path: Path, module: str | None = None) -> list[str]:
    """``from x import _name`` where ``_name`` belongs to another module: what the module exposes
    as its own business. A package's private submodules (a C extension such as store._halfcast) are
    its own modules' to import."""
    module = module or module_name(path)
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        for alias, target in zip(node.names, _absolute(module, path.name == "__init__.py", node), strict=True):
            name = alias.name
            if not name.startswith("_") or name.startswith("__") or target.split(".")[0] not in PACKAGES:
                continue
            submodule = (ROOT / target.replace(".", "/")).glob(f"{name}.*")
            if node.module is None or any(submodule):
                if target.split(".")[0] == module.split(".")[0]:
                    continue  # a private submodule of the same package
            out.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{node.lineno}:"
                       f" {module} imports {name} from {target}")
    return out


def test_no_module_imports_a_private_name_of_another() -> None:
    bad = [line for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))
           if "checkpoints" not in p.parts for line in private_imports(p)]
    assert not bad, "private names imported across modules (make them public or move them):\n" + "\n".join(bad)


def project_bases() -> dict[str, list[str]]:
    """Each project class -> its bases that are project classes (by name), read with ``ast``."""
    classes: dict[str, list[str]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    bases = [ast.unparse(b).split(".")[-1].split("[")[0] for b in node.bases]
                    classes[f"{module_name(path)}.{node.name}"] = bases
    names = {qual.rpartition(".")[2] for qual in classes}
    return {qual: [b for b in bases if b in names] for qual, bases in classes.items()}


def test_no_class_has_more_than_three_project_bases() -> None:
    wide = {qual: bases for qual, bases in project_bases().items() if len(bases) > 3}
    assert not wide, f"classes built of more than 3 project classes (compose them instead): {wide}"


def test_no_class_is_over_400_lines() -> None:
    long = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef) and (node.end_lineno or 0) - node.lineno + 1 > 400:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not long, f"classes over 400 lines: {long}"


@pytest.mark.parametrize("source, module, bad", [
    ("from store.db import _attach\n", "bench.x", True),
    ("from .worker import _record\n", "probes.farm", True),
    ("from probes import _halfpool\n", "probes.pooling", False),  # the package's own C extension
    ("from store import _halfcast\n", "bench.x", True),  # another package's private module
    ("from .worker import record\n", "probes.farm", False),
    ("def f():\n    from extract.run import _progress\n", "extract.variants", True),
])
def test_private_import_check(tmp_path: Path, source: str, module: str, bad: bool) -> None:
    path = tmp_path / "m.py"
    path.write_text(source)
    assert bool(private_imports(path, module)) is bad


def test_circle_check_sees_function_level_imports() -> None:
    edges = [Import("extract.run", "extract.variants", False, "a:1"),
             Import("extract.variants", "extract.run", True, "b:1")]
    graph = module_graph(edges)
    assert cycle({m: graph[m] for m in ("extract.run", "extract.variants")}) is not None
