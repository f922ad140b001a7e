"""The repository stands alone: every link and cited doc resolves, and nothing cites material a
user who clones it does not have (the design card, the studies' fact sheets, the platform notes)
or names a study by its old number instead of its slug (``seed`` means an RNG seed here)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import unicodedata
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve()

# Outputs and environments a run leaves in a checkout (when there is no git to list what is tracked).
_SKIP_DIRS = {"data", "report", "models", "build", "dist", "__pycache__", "node_modules"}
_TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sql", ".toml", ".jinja", ".sh", ".txt", ".cfg", ".ini"}


def _tracked() -> list[Path] | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return [ROOT / name for name in out.stdout.decode().split("\0") if name]


def _walk() -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in _SKIP_DIRS)
        out += [Path(dirpath) / f for f in sorted(filenames)]
    ci = ROOT / ".ci" / "run"  # the one file in a dot-folder that is ours
    return out + ([ci] if ci.is_file() else [])


@cache
def text_files() -> tuple[Path, ...]:
    """What a user clones: git's tracked files, or the tree without run outputs."""
    files = _tracked() or _walk()
    return tuple(p for p in files if p.is_file() and (p.suffix in _TEXT_SUFFIXES or p.name in ("Makefile", "run")))


def markdown_docs() -> list[Path]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return docs + sorted((ROOT / "lab" / "checkpoints").glob("*/README.md"))


def rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


# ----------------------------------------------------------------------------- markdown parsing

_FENCE = re.compile(r"^\s{0,3}(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_INLINE_LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\(\s*(<[^>]*>|[^\s)]+)(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ANCHOR = re.compile(r"<a\s+[^>]*(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code spans blanked."""
    out, fenced = [], False
    for i, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((i, _CODE_SPAN.sub(" ", line)))
    return out


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: rendered text, lower case, punctuation dropped, spaces -> '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images keep their text
    text = text.replace("`", "").lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return kept.replace(" ", "-")


@cache
def html_anchors(path: Path) -> frozenset[str]:
    return frozenset(a for _, line in prose_lines(path.read_text(encoding="utf-8")) for a in _HTML_ANCHOR.findall(line))


def _raw_headings(path: Path) -> list[str]:
    # Anchors are computed on the raw heading (code spans included), not on prose_lines' blanked copy.
    out, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced and (m := _HEADING.match(line)):
            out.append(m.group(2))
    return out


def links(path: Path) -> list[tuple[int, str]]:
    out = []
    for i, line in prose_lines(path.read_text(encoding="utf-8")):
        out += [(i, m.group(2).strip("<>")) for m in _INLINE_LINK.finditer(line)]
        if m := _REF_DEF.match(line):
            out.append((i, m.group(1).strip("<>")))
    return out


@cache
def heading_anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    found = set(html_anchors(path))
    for heading in _raw_headings(path):
        slug = github_slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return frozenset(found)


def resolve(source: Path, target: str, base: Path | None = None) -> str | None:
    """None when ``target`` (relative to ``base``, default the source's folder) exists with its
    anchor; else what is missing."""
    path_part, _, anchor = target.partition("#")
    dest = source if not path_part else ((base or source.parent) / path_part).resolve()
    if not dest.exists():
        return f"{path_part}: no such file"
    if ROOT not in dest.parents and dest != ROOT:
        return f"{path_part}: outside the repository"
    if anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest):
        return f"#{anchor}: no such heading in {rel(dest)}"
    return None


# ----------------------------------------------------------------------------- the checks


def test_slugs_follow_github() -> None:
    assert github_slug("Measured (`python -m bench store`, 2048×256×768 fp16 = 805 MB, this shared 2-core machine)") \
        == "measured-python--m-bench-store-2048256768-fp16--805-mb-this-shared-2-core-machine"
    assert github_slug("g2m: parser") == "g2m-parser"
    assert github_slug("DuckDB: one writer or many readers") == "duckdb-one-writer-or-many-readers"


@pytest.mark.parametrize("doc", markdown_docs(), ids=rel)
def test_relative_links_resolve(doc: Path) -> None:
    broken = []
    for line, target in links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
            continue
        if (why := resolve(doc, target)) is not None:
            broken.append(f"{rel(doc)}:{line}: ({target}) {why}")
    assert not broken, "broken links:\n" + "\n".join(broken)


# A repo-relative doc path as code, comments and docs cite it ("see docs/store.md#arrays").
_CITED_DOC = re.compile(r"(?<![\w/.-])docs/[\w./-]*?\.md(?:#[\w-]+)?")


def test_cited_docs_exist() -> None:
    missing = []
    for path in text_files():
        for i, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            for cited in _CITED_DOC.findall(line):
                if (why := resolve(path, cited, base=ROOT)) is not None:
                    missing.append(f"{rel(path)}:{i}: {cited}: {why}")
    assert not missing, "cited docs that do not exist:\n" + "\n".join(missing)


_CITED_TEST = re.compile(r"((?:tests/)?[\w/]+\.py)::(test_\w+)")


def _test_functions(path: Path) -> set[str]:
    return {n.name for n in ast.parse(path.read_text(encoding="utf-8")).body if isinstance(n, ast.FunctionDef)}


def test_cited_tests_exist() -> None:
    """A doc that gives a test as the evidence for a claim (``file.py::test_name``; a bare file name is
    looked up under tests/) names a test function of that file, so renaming a test cannot strand the doc."""
    by_name = {p.name: p for p in (ROOT / "tests").rglob("test_*.py")}
    missing = []
    for doc in markdown_docs():
        for i, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for file, name in _CITED_TEST.findall(line):
                path = ROOT / file if "/" in file else by_name.get(file)
                if path is None or not path.is_file() or name not in _test_functions(path):
                    missing.append(f"{rel(doc)}:{i}: {file}::{name}")
    assert not missing, "docs cite tests that do not exist:\n" + "\n".join(missing)


# What a clone does not have, and study names that collide with the RNG's `seed`.
_FORBIDDEN = {
    "cites a folder outside the repository": re.compile(r"\.\./shared"),
    "cites the design card (use docs/design.md)": re.compile(r"\bDESIGN(?:\.md)?\b"),
    "cites the studies' fact sheet (use docs/studies.md)": re.compile(r"seed-code-facts|code facts", re.IGNORECASE),
    "cites the platform notes file (use docs/design.md#platform-notes)":
        re.compile(r"platform[- ]notes(?:\.md)?\s*§|platform-notes\.md", re.IGNORECASE),
    "cites a section of a document the repository lacks": re.compile(r"§\s*\d"),
    "names a study by number (use its slug: g2m, counting-bottleneck, images-as-text, counting-tricks)":
        re.compile(r"\bseeds?[ _-]?00[0-3]\b", re.IGNORECASE),
}


def test_nothing_cites_material_outside_the_repository() -> None:
    hits = []
    for path in text_files():
        if path == THIS:
            continue
        for i, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            hits += [f"{rel(path)}:{i}: {why}: {line.strip()[:100]}"
                     for why, rx in _FORBIDDEN.items() if rx.search(line)]
    assert not hits, "\n".join(hits)


def test_design_and_studies_are_linked_from_the_readme() -> None:
    targets = {t.partition("#")[0] for _, t in links(ROOT / "README.md")}
    assert {"docs/design.md", "docs/studies.md"} <= targets
