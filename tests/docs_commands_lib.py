"""The documented commands of README.md and docs/, and the reduced demo checkout they run in.

The checkout is a reduced `make demo` (the same manifests over 61 Go boards, counts 0, 2, ..,
120, instead of 484: enough for the plans' 5 folds; of the variant runs only the two head
ablations, and no G2M toy: no documented command reads the others), in a folder laid out like a
checkout: `data/`, `sets/`, `manifests/` and `lab/` (linked to the repository's), `.venv/bin/python`
and `python` on PATH (this interpreter). It is built once per test run, under a lock, by whichever
pytest worker asks first, and each test module runs its commands in its own copy, in document
order, each in its own process: tests/test_docs_commands.py the README and the docs up to PART_B,
tests/test_docs_commands_more.py the rest, so the two halves run on two workers at once.

A command that cannot run here is listed in NOT_RUN with why (a GPU, the network or a cluster,
minutes of CPU, or a synopsis with placeholders such as PLAN); one whose text is known to be wrong
is listed in STALE until its doc is fixed. A listing that matches no command fails
`test_every_listing_names_a_documented_command`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from filelock import FileLock

REPO = Path(__file__).resolve().parents[1]
DOCS = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").rglob("*.md"))]
# Labelled shell/python fences; an unlabelled fence counts when each of its lines is a command.
SHELLS = ("bash", "sh", "shell", "console")
COMMAND = re.compile(r"^(\.venv/bin/)?(python|make|duckdb|dask|for |export |[A-Z_]+=\S+ )")
SCRIPTS = {"my_probes.py": ["data"]}  # a python block that is a script, run as its doc says

GPU, NET, SLOW, SYNOPSIS = "needs a GPU", "needs the network or a cluster", "takes minutes", "a synopsis"
NOT_RUN: dict[tuple[str, str], str] = {
    ("README.md", "make demo"): f"{SLOW}: the whole pipeline; this test runs a reduced demo",
    ("README.md", "make test"): f"{SLOW}: the whole test suite, this test included",
    ("docs/reproductions.md", "make demo"): f"{SLOW}: the whole pipeline; this test runs a reduced demo",
    ("docs/adapters.md", "from extract.models import"): f"{GPU}: loads a 2B model on CUDA",
    ("docs/adapters.md", "from collections.abc import"): f"{SYNOPSIS}: a template module for extract/models/",
    ("docs/interventions.md", "python -m lab.mas"): f"{SLOW}: fine-tunes the toy model (and rewrites its checkpoint)",
    ("docs/probes.md", "python -m probes PLAN"): f"{SYNOPSIS}: PLAN stands for a plan file",
    ("docs/probes.md", "DASK_SCHEDULER_ADDRESS="): f"{NET}: a Dask scheduler on another host",
    ("docs/scale.md", "python -m extract MANIFEST"): f"{SYNOPSIS}: MANIFEST stands for a manifest",
    ("docs/scale.md", "python -m extract.dry_run MANIFEST"): f"{SYNOPSIS}: MANIFEST and [options]",
    ("docs/scale.md", "python -m stimuli g2m --out sets/g2m-sweep"): f"{SLOW}: 6400 grids up to 64 x 64",
    ("docs/scale.md", "dask scheduler"): f"{NET}: a Dask cluster on other hosts",
    ("docs/scale.md", "python -m extract manifests/qwen7b-g2m.yaml"): f"{NET}: a cluster of GPU workers and a 7B model",
    ("docs/scale.md", "python -m extract manifests/demo.yaml --dry-run --scheduler tcp"): f"{NET}: a Dask scheduler",
    ("docs/scale.md", "dask worker"): f"{NET}: a Dask cluster on other hosts",
    ("docs/scale.md", "python -m probes manifests/probes-g2m.yaml --data /shared"): f"{NET}: a Dask cluster",
    ("docs/scale.md", "from dask_jobqueue import"): f"{NET}: a SLURM cluster",
    ("docs/scale.md", "from dask_kubernetes.operator"): f"{NET}: a Kubernetes cluster",
    ("docs/scale.md", "for i in 0 1 2 3; do CUDA_VISIBLE_DEVICES"): f"{GPU}: four GPUs and a 7B model",
    ("docs/store.md", "from store import Workspace, RunInfo"): f"{SYNOPSIS}: the extraction loop, with a model's"
                                                               " outputs (lm_head, h12_image) for values",
    ("docs/store.md", "export AWS_ACCESS_KEY_ID"): f"{NET}: an S3 bucket and its credentials",
    ("docs/store.md", "python -m store init --data ws --arrays s3"): f"{NET}: an S3 bucket",
    ("docs/store.md", "python -m extract manifests/demo.yaml --data ws"): f"{NET}: the S3 workspace above",
    ("docs/store.md", "python -m probes manifests/probes-demo.yaml --data ws"): f"{NET}: the S3 workspace above",
    ("docs/toy-lab.md", "python -m lab.train"): f"{SLOW}: trains the toy model (24 min on 2 cores)",
    ("docs/toy-lab.md", "python -m lab.evaluate"): f"{SLOW}: evaluates the checkpoint over every count",
    ("docs/toy-lab.md", "python -m lab.g2m evaluate [CHECKPOINT]"): f"{SYNOPSIS}: [CHECKPOINT] and [options]",
    ("docs/toy-lab.md", "python -m lab.g2m card CHECKPOINT"): f"{SYNOPSIS}: CHECKPOINT stands for a folder",
    ("docs/stimuli/counting-tricks.md", "python -m stimuli counting --out sets/counting-study --n 200"):
        f"{SLOW}: 6400 scenes",
}
STALE: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Command:
    doc: str
    line: int
    lang: str
    text: str

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def _shell_commands(doc: str, start: int, body: str) -> list[Command]:
    """One command per line; backslash continuations joined; comment lines dropped."""
    out, pending, first = [], "", 0
    for i, line in enumerate(body.splitlines()):
        if not pending:
            first = start + i
        pending += line
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        if pending.strip() and not pending.lstrip().startswith("#"):
            out.append(Command(doc, first, "bash", pending.strip()))
        pending = ""
    return out


def fences(text: str) -> list[tuple[int, str, str]]:
    """(first line number, language, body) of every fenced block, opening and closing fences paired."""
    blocks, lang, start, body = [], None, 0, []
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            if lang is None:
                lang, start, body = line[3:].strip(), number + 1, []
            else:
                blocks.append((start, lang, "\n".join(body) + "\n"))
                lang = None
        elif lang is not None:
            body.append(line)
    return blocks


def documented_commands() -> list[Command]:
    found = []
    for doc in DOCS:
        for start, lang, body in fences((REPO / doc).read_text()):
            lines = [line for line in body.splitlines() if line.strip()]
            if lang == "python":
                found.append(Command(doc, start, "python", body))
            elif lang in SHELLS or (not lang and lines and all(COMMAND.match(line) for line in lines)):
                found += _shell_commands(doc, start, body)
    return found


def listing(cmd: Command, table: dict[tuple[str, str], str]) -> str | None:
    for (doc, prefix), reason in table.items():
        if doc == cmd.doc and cmd.text.lstrip().startswith(prefix):
            return reason
    return None


COMMANDS = documented_commands()


def _link(target: Path, link: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)



def _launchers(root: Path) -> None:
    for launcher in (root / ".venv" / "bin" / "python", root / "bin" / "python"):
        # A script, not a link: a linked venv interpreter would not find its venv (pyvenv.cfg).
        launcher.parent.mkdir(parents=True, exist_ok=True)
        launcher.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        launcher.chmod(0o755)


def _env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("AGNOSIA_DATA", "DASK_SCHEDULER_ADDRESS")}
    env.update(PATH=f"{root / 'bin'}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=str(REPO), TQDM_DISABLE="1")
    return env


def build(root: Path) -> None:
    """The reduced demo in ``root``: stimulus sets, one extraction process for the three runs the
    docs read, the demo's probes."""
    for name in ("manifests", "lab"):
        _link(REPO / name, root / name)
    _launchers(root)
    counts = ",".join(str(c) for c in range(0, 121, 2))
    steps = [
        "python -m stimuli all --out sets --seed 0",
        f"python -m stimuli go --preset small --variation mild --counts {counts} --n 1 --seed 1"
        " --out sets/go-toy",
        # the plain run and the two head-ablation variant runs a documented command reads
        "python -m extract manifests/demo.yaml manifests/demo-heads-visual.yaml manifests/demo-heads-text.yaml"
        " --data data --no-progress",
        "python -m probes manifests/probes-demo.yaml --data data --no-progress",
        # docs/scale.md's 6,400-grid sweep (NOT_RUN: minutes) reduced to two grids, for its dry run
        "python -m stimuli g2m --out sets/g2m-sweep --n 1 --grid-sizes 3 64 --colors 3 --seed 0 --no-progress",
    ]
    for step in steps:
        got = subprocess.run(step, shell=True, cwd=root, env=_env(root), capture_output=True, text=True, timeout=900)
        assert got.returncode == 0, f"demo step failed: {step}\n{got.stderr[-3000:]}"


@pytest.fixture(scope="session")
def built_checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reduced demo, built once per test run: pytest-xdist's workers share it (one builds under
    a lock, the others wait for it); the modules copy it before they write into it."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    shared = tmp_path_factory.getbasetemp().parent / f"docs-checkout-{run}" if run else \
        tmp_path_factory.mktemp("docs-checkout")
    shared.mkdir(parents=True, exist_ok=True)
    root = shared / "built"
    with FileLock(str(shared / "build.lock")):
        if not (shared / "done").exists():
            shutil.rmtree(root, ignore_errors=True)
            build(root)
            (shared / "done").touch()
    return root


@pytest.fixture(scope="module")
def checkout(built_checkout: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """This module's own copy of the reduced demo checkout, and the environment to run in it."""
    root = tmp_path_factory.mktemp("newcomer") / "checkout"
    shutil.copytree(built_checkout, root, symlinks=True)  # the launchers come along: they name this interpreter
    return root, _env(root)


def run_documented(cmd: Command, checkout: tuple[Path, dict[str, str]]) -> None:
    """Run one documented command in the checkout, or skip it with its listing's reason."""
    reason = listing(cmd, NOT_RUN)
    if reason:
        pytest.skip(f"{cmd.id}: {reason}")
    stale = listing(cmd, STALE)
    if stale:
        pytest.skip(f"{cmd.id} is stale, to be fixed in the doc: {stale}")
    root, env = checkout
    if cmd.lang == "python":
        script = re.match(r'"""(\w+\.py):', cmd.text)
        if script:
            (root / script[1]).write_text(cmd.text)
            argv = [sys.executable, script[1], *SCRIPTS[script[1]]]
        else:
            argv = [sys.executable, "-c", cmd.text]
    else:
        argv = ["bash", "-o", "pipefail", "-c", cmd.text]
    got = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, f"{cmd.id}: `{cmd.text[:200]}` exited {got.returncode}\n{got.stderr[-3000:]}"
    assert "Traceback" not in got.stderr, got.stderr[-3000:]


# Where the second module's half begins (docs/ sorted by path): the halves take about as long.
PART_B = "docs/reproductions.md"
FIRST_HALF = [c for c in COMMANDS if c.doc == "README.md" or (c.doc != "README.md" and c.doc < PART_B)]
SECOND_HALF = [c for c in COMMANDS if c not in FIRST_HALF]
