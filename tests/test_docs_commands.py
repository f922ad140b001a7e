"""Every fenced shell and python command of README.md and docs/ runs, as written, against a fresh
demo checkout (tests/docs_commands_lib.py): the README and the docs before ``PART_B``, and the
checks of the listings and of the documented stimulus sets."""

from __future__ import annotations

import re

import pytest
from docs_commands_lib import (
    COMMANDS,
    DOCS,
    FIRST_HALF,
    NOT_RUN,
    REPO,
    STALE,
    Command,
    built_checkout,  # noqa: F401 - a fixture `checkout` uses
    checkout,  # noqa: F401 - the fixture the test takes
    run_documented,
)


@pytest.mark.slow
@pytest.mark.parametrize("cmd", FIRST_HALF, ids=[c.id for c in FIRST_HALF])
def test_documented_command_runs(cmd: Command, checkout: tuple) -> None:  # noqa: F811
    run_documented(cmd, checkout)


def test_every_listing_names_a_documented_command() -> None:
    for table in (NOT_RUN, STALE):
        for doc, prefix in table:
            assert any(c.doc == doc and c.text.lstrip().startswith(prefix) for c in COMMANDS), (doc, prefix)
    assert len(COMMANDS) >= 40  # the extraction itself found the fences


STIMULI_RUN = re.compile(r"(?:\.venv/bin/)?python -m stimuli \S+[^`#;|&]*")


def _makefile_stimuli() -> list[tuple[str, str]]:
    """The Makefile's `python -m stimuli` lines with $(STIMULI) at its default, loops expanded."""
    found, lines = [], (REPO / "Makefile").read_text().splitlines()
    for number, line in enumerate(lines, 1):
        if "-m stimuli" not in line:
            continue
        for more in lines[number:]:  # continuation lines
            if not line.endswith("\\"):
                break
            line = line[:-1] + more
        line = line.replace("$(PY)", "python").replace("$(STIMULI_ARGS)", "").replace("$(STIMULI)", "sets")
        loop = re.search(r"for n in ([\d ]+); do", line)
        for n in loop[1].split() if loop else [""]:
            found.append((f"Makefile:{number}", line.replace("$$n", n)))
    return found


def stimulus_writes() -> list[tuple[str, str, str, bool]]:
    """(where, folder written, command without --overwrite, overwrites) of every `python -m stimuli` of the
    docs (fenced or inline) and of the Makefile."""
    from stimuli import family_names

    lines = [(f"{d}:{n}", line) for d in DOCS for n, line in enumerate((REPO / d).read_text().splitlines(), 1)]
    writes = []
    for where, line in lines + _makefile_stimuli():
        for match in STIMULI_RUN.finditer(line):
            argv = match[0].replace(".venv/bin/", "").split()
            if "--out" not in argv:  # --help, a synopsis
                continue
            family, out = argv[3], argv[argv.index("--out") + 1]
            command = " ".join(a for a in argv if a != "--overwrite")
            overwrites = "--overwrite" in argv or family == "all"  # `all` replaces the sets it writes
            for folder in [f"{out}/{f}" for f in family_names()] if family == "all" else [out]:
                writes.append((where, folder.rstrip("/"), command, overwrites))
    return writes


def test_documented_stimulus_sets_do_not_collide() -> None:
    """Two different documented commands writing one set folder: the second stops at `already exists`
    (the README's 3-colour G2M set and docs/scale.md's full sweep did), or, worse, a later command
    reads the wrong set. Each folder has one writer, or every writer says --overwrite."""
    writes = stimulus_writes()
    assert len(writes) >= 10 and any(w[0].startswith("Makefile") for w in writes)  # the parsing found them
    clashes = []
    for folder in sorted({w[1] for w in writes}):
        writers = [w for w in writes if w[1] == folder]
        if len({w[2] for w in writers}) > 1 and not all(w[3] for w in writers):
            clashes.append(f"{folder}: " + "; ".join(f"{w[0]} `{w[2]}`" for w in writers))
    assert not clashes, "\n".join(clashes)
