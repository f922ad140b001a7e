"""The report: figures from hand-built stores, opened in a real headless Chromium."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import numpy as np
import pytest

from extract.scoring import score_answer
from queries.report import modality_attention_share, write_report
from stimuli import get_family
from stimuli.io import read_set, write_set
from store import ArraySpec, RunInfo, TokenSpans, Workspace

SEQ, IMAGE_START, IMAGE_COUNT, HEADS = 10, 2, 4, 2


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A Go run whose model always answers 49, with attention that falls only on image keys at
    layer 0 and half on them at layer 1."""
    root = tmp_path_factory.mktemp("report")
    go = get_family("go")
    set_path = write_set(go, go.config(preset="small", counts="40-60"), n=1, seed=0, split="test", out=root / "go")
    rows = read_set(set_path).rows()
    n = len(rows)
    on_image = np.zeros((SEQ, HEADS), np.float32)
    on_image[IMAGE_START:IMAGE_START + IMAGE_COUNT] = 1 / IMAGE_COUNT
    half = np.full((SEQ, HEADS), 0.5 / (SEQ - IMAGE_COUNT), np.float32)
    half[IMAGE_START:IMAGE_START + IMAGE_COUNT] = 0.5 / IMAGE_COUNT
    ws = Workspace.open(root / "data")
    with ws.writer(RunInfo(run="always49", model="hand-built", chunk_samples=8)) as w:
        w.set_samples(w.register_stimulus_set(set_path))
        layers = [w.array(ArraySpec(tap="attn", layer=i, site="probs", tokens="last", shape=(HEADS,), ragged=True))
                  for i in range(2)]
        spans = [TokenSpans(seq_len=SEQ, image_start=IMAGE_START, image_count=IMAGE_COUNT, last_prompt=SEQ - 1)] * n
        gens = [score_answer("go", "multimodal_num", "4 9", r["answer"], r["truth"]) for r in rows]
        w.write_batch(0, {layers[0]: [on_image] * n, layers[1]: [half] * n}, tokens=spans, generations=gens)
        w.finish()
    # Two head-ablation variants over the same boards: head 0 critical in both, head 1 in one only.
    for run, second in (("heads-visual", True), ("heads-text", False)):
        with ws.writer(RunInfo(run=run, model="hand-built", intervention={"kind": "head_ablation"})) as w:
            keys = w.register_stimulus_set(set_path)
            w.set_samples(keys)
            w.record_generations(0, gens)
            w.finish()
        ws.record_head_ablations(run, [
            {"stimulus": k, "tap": "llm", "layer": 0, "head": h, "n_positions": 2, "n_flipped": int(flip),
             "flipped": flip, "flip_mask": int(flip), "logit_drop": 1.0}
            for k in keys for h, flip in ((0, True), (1, second))])
    return Workspace.open(root / "data", readonly=True)


@pytest.mark.slow
def test_modality_attention_share_of_known_attention(workspace):
    mas = modality_attention_share(workspace, "always49").to_pylist()
    assert [r["layer"] for r in mas] == [0, 1]
    assert mas[0]["mas"] == pytest.approx(1.0, abs=1e-3) and mas[1]["mas"] == pytest.approx(0.5, abs=1e-3)


@pytest.mark.slow
def test_report_tables_show_the_boundary_attractor(workspace, tmp_path):
    index = write_report(workspace.path, tmp_path / "report")
    attractors = (tmp_path / "report" / "attractors.csv").read_text()
    assert '"always49","VE",49,11,1,1,"boundary"' in attractors
    assert "counting_accuracy.png" in index.read_text() and "mas.png" in index.read_text()
    assert "interventions.png" in index.read_text() and "critical_heads.png" in index.read_text()
    overlap = (tmp_path / "report" / "head_overlap.csv").read_text().splitlines()
    assert overlap[1].startswith('"heads-text","heads-visual",21,0,1,0.5')  # every board differs at head 1


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        if os.geteuid() != 0 and not os.environ.get("CI"):
            # A user without root cannot install Debian's Chromium, and no browser build can be
            # downloaded here: say so, rather than fail every non-root `make test`.
            pytest.skip("no headless Chromium and not root: `sudo apt-get install chromium` (or `sudo make browser`)"
                        " runs this test")
        pytest.fail("headless Chromium is needed for the report test: `make test` installs Debian's chromium"
                    " (apt-get install chromium)")
    return path


@pytest.mark.browser
def test_report_loads_in_headless_chromium(workspace, tmp_path):
    index = write_report(workspace.path, tmp_path / "report")
    pngs = sorted(p.name for p in index.parent.glob("*.png"))
    dom = subprocess.run(
        [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'chrome'}", "--virtual-time-budget=5000", "--dump-dom", index.as_uri()],
        capture_output=True, text=True, timeout=120,
    ).stdout
    body = re.search(r"<body[^>]*>", dom)
    assert body, "Chromium returned no page"
    assert 'data-images-ok="true"' in body.group(0), body.group(0)
    assert f'data-images="{len(pngs)}"' in body.group(0) and 'data-errors="0"' in body.group(0)
    for png in pngs:
        assert f"src=\"{png}\"" in dom
