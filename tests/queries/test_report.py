"""The report: figures from hand-built stores, opened in a real headless Chromium."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from extract.scoring import score_answer
from queries.report import modality_attention_share, write_report
from stimuli import get_family
from stimuli.io import read_set, write_set
from store import ArraySpec, Generation, ProbeResult, RunInfo, TokenSpans, Workspace

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
    _add_study_runs(ws)
    return Workspace.open(root / "data", readonly=True)


@pytest.fixture(scope="module")
def report(workspace, tmp_path_factory) -> Path:
    """The report of the workspace, written once (the figures take seconds): its index.html."""
    return write_report(workspace.path, tmp_path_factory.mktemp("report") / "report")


STUDIES = ("counting-bottleneck", "g2m", "counting-tricks", "images-as-text")


def _add_study_runs(ws: Workspace) -> None:
    """One small run of each other study, so every study page of the report has data: G2M grids
    (right at N = 2, wrong at N = 3) with a spatial probe, CountingTricks scenes (right on case 1A,
    wrong on 2A) with last-query attention and detection probes at two depths, spatial scenes."""
    grids = [{"id": f"g{n}-{i}", "family": "g2m", "params": {"grid_size": n, "image_size": 8 * n},
              "truth": {"matrix": np.eye(n, dtype=int).tolist()}} for n in (2, 3) for i in range(2)]
    with ws.writer(RunInfo(run="grids", model="hand-built")) as w:
        w.set_samples(w.register_stimuli(grids, dataset="g2m"))
        w.array(ArraySpec(tap="vision", layer=0, tokens="image", shape=(4, 2)))
        w.record_generations(0, [Generation(text="x", prediction=g["truth"]["matrix"] if g["params"]["grid_size"] == 2
                                            else None, parse_ok=True, correct=g["params"]["grid_size"] == 2)
                                 for g in grids])
    ws.record_probes([ProbeResult(run="grids", tap="vision", layer=0, target="g2m.matrix", kind="conv_spatial",
                                  score=0.9, metric="cell_accuracy",
                                  predictions={"array_row": [0, 1, 2, 3], "score": [1.0, 1.0, 0.8, 0.8]})])
    scenes = [{"id": f"c{i}", "family": "counting", "truth": {"case": "1A" if i < 2 else "2A", "count": 3}}
              for i in range(4)]
    with ws.writer(RunInfo(run="tricks", model="hand-built")) as w:
        w.set_samples(w.register_stimuli(scenes, dataset="counting"))
        for tap in ("vision", "llm"):
            w.array(ArraySpec(tap=tap, layer=0, tokens="image", shape=(4, 2)))
        attn = w.array(ArraySpec(tap="attn", layer=0, site="probs", tokens="last", shape=(HEADS,), ragged=True))
        on_image = np.full((SEQ, HEADS), 1 / SEQ, np.float32)
        gens = [Generation(text="3" if i < 2 else "5", prediction=3 if i < 2 else 5, parse_ok=True, correct=i < 2)
                for i in range(4)]
        spans = [TokenSpans(seq_len=SEQ, image_start=IMAGE_START, image_count=IMAGE_COUNT, last_prompt=SEQ - 1)] * 4
        w.write_batch(0, {attn: [on_image] * 4}, tokens=spans, generations=gens)
    ws.record_probes([ProbeResult(run="tricks", tap=tap, layer=0, target="counting.boxes", kind="detect", score=score,
                                  control_score=0.05, metric="ap50")
                      for tap, score in (("vision", 0.55), ("llm", 0.28))])
    pairs = [{"id": f"s{i}", "family": "spatial", "truth": {"relation": "left" if i % 2 else "above",
                                                            "options": ["a", "b", "c", "d"]}} for i in range(4)]
    with ws.writer(RunInfo(run="scenes", model="hand-built")) as w:
        w.set_samples(w.register_stimuli(pairs, dataset="spatial"))
        w.record_generations(0, [Generation(text="A", prediction="A", parse_ok=True, correct=i < 3) for i in range(4)])


@pytest.mark.slow
def test_modality_attention_share_of_known_attention(workspace):
    mas = modality_attention_share(workspace, "always49").to_pylist()
    assert [r["layer"] for r in mas] == [0, 1]
    assert mas[0]["mas"] == pytest.approx(1.0, abs=1e-3) and mas[1]["mas"] == pytest.approx(0.5, abs=1e-3)


@pytest.mark.slow
def test_report_tables_show_the_boundary_attractor(report):
    index, out = report, report.parent
    attractors = (out / "attractors.csv").read_text()
    assert '"always49","VE",49,11,1,1,"boundary"' in attractors
    assert "counting_accuracy.png" in index.read_text() and "mas.png" in index.read_text()
    assert "interventions.png" in index.read_text() and "critical_heads.png" in index.read_text()
    overlap = (out / "head_overlap.csv").read_text().splitlines()
    assert overlap[1].startswith('"heads-text","heads-visual",21,0,1,0.5')  # every board differs at head 1


@pytest.mark.slow
def test_every_study_page_opens_with_a_figure_with_data(report):
    page, out = report.read_text(), report.parent
    for slug in STUDIES:
        section = page[page.index(f"id='{slug}'"):]
        section = section[:section.index("</section>")]
        rows = [int(n) for n in re.findall(r"<figure data-rows='(\d+)'", section)]
        assert rows and rows[0] > 0, f"{slug}: {rows}"
    g2m = (out / "g2m_gap_curve.csv").read_text()
    assert '"grids",2,"model",1,2' in g2m and '"grids",3,"probe vision.0/resid_post",0.8,2' in g2m
    mas = (out / "mas.csv").read_text()
    assert '"tricks",0,0.4,true,2' in mas and '"tricks",0,0.4,false,2' in mas  # 4 of 10 keys are image keys
    detect = (out / "detect_ap.csv").read_text().splitlines()
    assert [line.split(",")[2] for line in detect[1:]] == ['"vision"', '"llm"']  # along depth
    cases = (out / "counting_cases.csv").read_text()
    assert '"tricks","1A",2,1,' in cases and '"tricks","2A",2,0,' in cases
    spatial = (out / "spatial_accuracy.csv").read_text()
    assert '"scenes","above",2,1,0.25' in spatial and '"scenes","left",2,0.5,0.25' in spatial


def test_an_empty_workspace_gets_one_line_per_study(tmp_path):
    Workspace.open(tmp_path / "data")
    page = write_report(tmp_path / "data", tmp_path / "report").read_text()
    assert page.count("no run of this study in the workspace: run") == 4 and "<img" not in page


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
def test_report_loads_in_headless_chromium(report, tmp_path):
    index = report
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
    for slug in STUDIES:  # every study page opens with a drawn figure that has rows behind it
        section = re.search(rf'<section class="page" id="{slug}" data-figures="(\d+)">(.*?)</section>', dom, re.S)
        assert section and int(section.group(1)) > 0, slug
        assert re.search(r'<figure data-rows="[1-9]\d*"><img src="[^"]+\.png"', section.group(2)), slug
    # kept as a CI artifact: what a reader sees, from this demo-like workspace
    shot = Path(__file__).resolve().parents[2] / "report" / "screenshot.png"
    shot.parent.mkdir(exist_ok=True)
    subprocess.run(
        [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
         f"--user-data-dir={tmp_path / 'chrome-shot'}", "--window-size=1200,6000", "--virtual-time-budget=5000",
         f"--screenshot={shot}", index.as_uri()], capture_output=True, text=True, timeout=120)
    assert shot.stat().st_size > 10_000
