"""`make demo STIMULI=/elsewhere`: the demo manifests name `sets/...` sets, and
`python -m extract M --stimuli-root DIR` reads them from DIR (issue: the variable did nothing but
break the demo, whose manifests hard-code `sets/`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from extract.manifest import load_manifest, parse_manifest, with_stimuli_root
from stimuli import get_family
from stimuli.io import write_set
from store import Workspace

pytestmark = pytest.mark.slow  # spawns extraction or Dask processes per test

REPO = Path(__file__).resolve().parents[2]


def test_only_sets_under_the_sets_folder_move():
    m = parse_manifest({"run": "r", "model": {"path": "m"}, "stimuli": [
        {"set": "sets/go-toy"}, {"set": "/abs/sets/g2m"}, {"set": "other/set"}, {"set": "sets"}]})
    moved = [s.set for s in with_stimuli_root(m, "/elsewhere").stimuli]
    assert moved == ["/elsewhere/go-toy", "/abs/sets/g2m", "other/set", "sets"]
    assert [s.set for s in with_stimuli_root(m, "sets").stimuli] == [s.set for s in m.stimuli]  # the default


def test_make_passes_stimuli_to_every_extraction_of_the_demo():
    stamp = os.path.join(os.environ.get("VENV", ".venv"), ".agnosia-installed")
    out = subprocess.run(["make", "-n", "-o", stamp, "-o", "setup", "demo", "STIMULI=/elsewhere"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    # a call may name several manifests (one process for all), its options on a continuation line
    text = out.stdout.replace("\\\n", " ")
    calls = [line for line in text.splitlines() if re.search(r"-m extract manifests/\S+\.yaml", line)]
    manifests = [m for line in calls for m in re.findall(r"manifests/\S+\.yaml", line)]
    assert len(manifests) >= 10  # the plain run, six variants, the G2M toy, CountingTricks and spatial
    for line in calls:
        assert "--stimuli-root /elsewhere" in line, line
    for name in manifests:
        manifest = load_manifest(REPO / name)
        assert all(s.set.startswith("sets/") for s in manifest.stimuli), name  # so the root applies
    writes = [line for line in out.stdout.splitlines() if "-m stimuli" in line]
    assert writes and all("--out /elsewhere" in line for line in writes)


def test_an_extraction_reads_its_sets_from_the_stimuli_root(tmp_path):
    go = get_family("go")
    write_set(go, go.config(preset="small", variation="mild", counts="0-2"), n=1, seed=1, split="test",
              out=tmp_path / "elsewhere" / "go-toy")
    got = subprocess.run([sys.executable, "-m", "extract", "manifests/demo-text.yaml", "--data", str(tmp_path / "data"),
                          "--stimuli-root", str(tmp_path / "elsewhere"), "--no-progress"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, got.stderr
    ws = Workspace.open(tmp_path / "data", readonly=True)
    rows = ws.rows("SELECT stimulus, set_path FROM v_samples WHERE run = 'toy-counter-text' ORDER BY array_row")
    assert [r[0] for r in rows] == ["go-toy/go_000_00000", "go-toy/go_001_00000", "go-toy/go_002_00000"]
    assert {Path(r[1]) for r in rows} == {(tmp_path / "elsewhere" / "go-toy").resolve()}
