"""The walk a reader takes through the code of one real run, and how often it goes back to a file.

Two walks (docs/design.md, "The walk"): ``python -m probes PLAN`` to its workers (a plan of a
pooled and a ridge probe, inline scheduler, a small synthetic workspace) and ``run_extraction`` to
the store (tiny Qwen2-VL, 8 G2M samples, two LLM layers, one attention layer, two new tokens).

Every project function is read once, at its first call, on the thread that called it; a function
that called no other project function is a leaf, read by its name and not walked into. The walk
is the sequence of the modules of the functions walked into, repeats in a row merged, one sequence
per thread. A *return* is a step into a module the walk has already left. Printed and recorded:
returns in all, and returns within the walk's own stage (probes/; extract/ with the store's writer).
"""

from __future__ import annotations

import contextlib
import io
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from bench import record

PROJECT = ("stimuli", "extract", "store", "probes", "queries", "lab", "toyvlm")


def _merged(rooms: list[str]) -> list[str]:
    """``rooms`` with repeats in a row merged: staying in a module is one room."""
    return [m for i, m in enumerate(rooms) if i == 0 or m != rooms[i - 1]]


@dataclass
class Walk:
    """Per thread, the modules walked into, in order, repeats in a row merged."""

    threads: dict[str, list[str]] = field(default_factory=dict)

    def within(self, prefixes: tuple[str, ...]) -> Walk:
        """The same walk seen only in the modules under ``prefixes``."""
        return Walk({name: _merged([m for m in rooms if m.startswith(prefixes)]) for name, rooms in self.threads.items()})

    def coarse(self) -> Walk:
        """The same walk with each subpackage one room (``store.writer.pipeline`` -> ``store.writer``):
        a reader who enters a package through its front (``Writer``, ``Trainer``) sees one room."""
        return Walk({name: _merged([".".join(m.split(".")[:2]) for m in rooms]) for name, rooms in self.threads.items()})

    @property
    def returns(self) -> int:
        return sum(len(steps) for steps in self.back_to().values())

    def back_to(self) -> dict[str, list[str]]:
        """Per thread, each return as "left -> returned to"."""
        out: dict[str, list[str]] = {}
        for name, rooms in self.threads.items():
            left: set[str] = set()
            for i, room in enumerate(rooms):
                if room in left:
                    out.setdefault(name, []).append(f"{rooms[i - 1]} -> {room}")
                if i:
                    left.add(rooms[i - 1])
        return out


def _importing(frame: FrameType | None) -> bool:
    """Whether ``frame`` runs under a project module's body: an import's registrations, not the run."""
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__", "").split(".")[0] in PROJECT:
            return True
        frame = frame.f_back
    return False


def walk(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Walk, Any]:
    """Run ``fn(*args, **kwargs)``; return the walk its first calls took (threads it starts included)."""
    first: list[tuple[str, Any, str]] = []  # (thread, code, module) of each function's first call
    seen: set[Any] = set()
    callers: set[Any] = set()  # functions that called a project function: not leaves

    def profile(frame: FrameType, event: str, _arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        if code.co_name.startswith("<") or not code.co_filename.endswith(".py"):
            return  # module bodies, lambdas, comprehensions; a dataclass's generated methods
        module = frame.f_globals.get("__name__", "")
        if module.split(".")[0] not in PROJECT:
            return
        if frame.f_back is not None:
            callers.add(frame.f_back.f_code)
        if code in seen or _importing(frame):
            return
        seen.add(code)
        first.append((threading.current_thread().name, code, module))

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        out = fn(*args, **kwargs)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    steps: dict[str, list[str]] = {}
    for thread, code, module in first:
        if code in callers:
            steps.setdefault(thread, []).append(module)
    return Walk({name: _merged(rooms) for name, rooms in steps.items()}), out


def probe_walk(root: Path) -> Walk:
    from bench.probes import make_workspace
    from probes.cli import main as probes_main

    make_workspace(root / "ws", n=96, d=16, layers=2, targets=1)
    plan = root / "plan.yaml"
    plan.write_text("name: walk\nprobes:\n"
                    "  - {runs: [bench], taps: [llm], layers: all, tokens: [last], targets: ['truth:t00'],"
                    " kinds: {pooled: {pool: last}}}\n"
                    "  - {runs: [bench], taps: [llm], layers: all, tokens: [last], targets: ['truth:t00'],"
                    " kinds: {ridge: {pool: last}}}\n")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        found, rc = walk(probes_main, [str(plan), "--data", str(root / "ws"), "--scheduler", "inline", "--no-progress"])
    if rc != 0:
        raise SystemExit(f"the probe walk's plan failed (exit {rc})")
    return found


def extraction_walk(root: Path) -> Walk:
    from extract.manifest import parse_manifest
    from extract.models import tiny
    from extract.run import run_extraction
    from stimuli import get_family
    from stimuli.io import write_set

    model = tiny.build("qwen2_vl", root / "tiny-qwen2-vl", seed=0)
    g2m = get_family("g2m")
    stimuli = write_set(g2m, g2m.config(grid_sizes=(4,), colors=(3,), image_size=112), n=8, seed=0, split="test",
                        out=root / "g2m")
    manifest = parse_manifest({
        "run": "walk", "model": {"path": str(model)}, "stimuli": [{"set": str(stimuli)}],
        "taps": [{"tap": "llm", "layers": [0, -1], "tokens": ["image", "last"]}],
        "attention": {"layers": [0], "queries": ["last"]},
        "generation": {"max_new_tokens": 2}, "batch_size": 4, "chunk_samples": 4,
    })
    found, _ = walk(run_extraction, manifest, workspace=root / "ws-run", progress=False)
    return found


def main(quick: bool = False) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        walks = {"python -m probes PLAN to its workers": (probe_walk(Path(tmp) / "p"), ("probes",)),
                 "run_extraction to the store": (extraction_walk(Path(tmp) / "e"),
                                                 ("extract", "store.writer", "store.workspace"))}
    for name, (found, own) in walks.items():
        mine = found.within(own)
        print(f"   {name}: {found.returns} returns ({mine.returns} within {', '.join(own)}; {found.coarse().returns}"
              f" with each subpackage one room); {sum(map(len, found.threads.values()))} steps on"
              f" {len(found.threads)} thread(s)")
        for thread, rooms in mine.threads.items():
            if rooms:
                print(f"     {thread}: {' > '.join(rooms)}")
        record.figure("", f"{name}: returns", found.returns, "", aim="<= 10 (issue 41)",
                      setting="first calls, leaves left out, modules as rooms")
        record.figure("", f"{name}: returns within {', '.join(own)}", mine.returns, "")
        record.figure("", f"{name}: returns, each subpackage one room", found.coarse().returns, "")
