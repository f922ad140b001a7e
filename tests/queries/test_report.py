"""The report: figures from hand-built stores, opened in a real headless Chromium."""

from __future__ import annotations

import csv
import html
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from extract.scoring import score_answer
from queries.figures import Answers, bootstrap_ci, n_range, wilson
from queries.named import run as run_named
from queries.pages import depth_third
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
    assert [r["third"] for r in mas] == ["early", "late"]  # two layers: the last is late, not middle
    # every sample attends alike: the bootstrap interval is the mean; 4 of 10 keys are image keys
    assert mas[1]["mas_lo"] == pytest.approx(0.5, abs=1e-3) and mas[1]["mas_hi"] == pytest.approx(0.5, abs=1e-3)
    assert mas[0]["uniform"] == pytest.approx(IMAGE_COUNT / SEQ)


def test_depth_thirds_end_late():
    assert [depth_third(i, 1) for i in range(1)] == ["late"]
    assert [depth_third(i, 2) for i in range(2)] == ["early", "late"]
    assert [depth_third(i, 3) for i in range(3)] == ["early", "middle", "late"]
    assert [depth_third(i, 4) for i in range(4)] == ["early", "middle", "middle", "late"]
    assert [depth_third(i, 6) for i in range(6)] == ["early", "early", "middle", "middle", "late", "late"]


def test_intervals_and_the_usable_rule():
    assert wilson(0, 10)[0] == 0.0 and 0.0 < wilson(0, 10)[1] < 0.35  # all wrong still has an interval
    lo, hi = wilson(5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-3) and hi == pytest.approx(0.7634, abs=1e-3)
    lo, hi = bootstrap_ci([0.0, 1.0] * 50)
    assert 0.38 < lo < 0.5 < hi < 0.62 and bootstrap_ci([0.3]) == (0.3, 0.3)
    assert n_range([4, 8, 6], "scenes per case") == "n = 4–8 scenes per case" and n_range([3, 3], "grids") == "n = 3 grids"
    two_of_ten = Answers("r", "counting", None, n=10, parsed=2, top_unparsed="False")
    assert two_of_ten.usable and not Answers("r", "counting", None, n=10, parsed=1, top_unparsed="False").usable
    assert Answers("r", "counting", None, n=128, parsed=4, top_unparsed="False").note("its accuracy per case") == (
        "r: 124 of 128 answers are no count (answer 'False'), so its accuracy per case is not drawn.")


@pytest.mark.slow
def test_report_tables_show_the_boundary_attractor(report):
    index, out = report, report.parent
    attractors = (out / "attractors.csv").read_text()
    assert '"always49","VE",49,11,1,1,"boundary"' in attractors
    assert "counting_accuracy.png" in index.read_text() and "mas.png" in index.read_text()
    assert "critical_heads.png" in index.read_text()  # head ablations: counting-bottleneck's own variant
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
    detect = list(csv.DictReader((out / "detect_ap.csv").open()))
    assert [r["tap"] for r in detect] == ["vision", "llm"]  # along depth
    assert {r["probe"] for r in detect} == {"counting.boxes (detect, image tokens)"}  # a label, not the series hash
    cases = (out / "counting_cases.csv").read_text()
    assert '"tricks","1A",2,1,' in cases and '"tricks","2A",2,0,' in cases
    spatial = (out / "spatial_accuracy.csv").read_text()
    assert '"scenes","above",2,1,0.25' in spatial and '"scenes","left",2,0.5,0.25' in spatial


def _page(index: str, slug: str) -> str:
    section = index[index.index(f"id='{slug}'"):]
    return section[:section.index("</section>")]


#: The pages built by queries/pages.py and queries/pages_spatial.py, whose captions all name n (the
#: counting-bottleneck page, queries/pages_counting.py, joins this list when its captions do too).
CAPTIONED = ("counting-bottleneck", "g2m", "counting-tricks", "images-as-text", "probes")
NAMES_N = re.compile(r"\bn(_seeds)?\s*=\s*\d")


@pytest.mark.slow
def test_every_figure_caption_names_its_n(report):
    index = report.read_text()
    for slug in CAPTIONED:
        figures = re.findall(r"<figure[^>]*>.*?</figure>", _page(index, slug), re.S)
        assert figures, slug
        for fig in figures:
            caption = re.search(r"<figcaption>(.*?)</figcaption>", fig, re.S)
            assert caption and NAMES_N.search(caption.group(1)), f"{slug}: a caption without its n: {fig[:300]}"


@pytest.mark.slow
def test_the_report_opens_with_its_provenance_and_titles_every_table(report, workspace):
    index = report.read_text()
    header = index[index.index("<header class='provenance'>"):index.index("</header>")]
    commit = re.search(r"at commit <code>([^<]+)</code>", header)
    assert commit and re.fullmatch(r"[0-9a-f]{7,}( \+ uncommitted changes)?|unknown", commit.group(1))
    runs = [r[0] for r in workspace.rows("SELECT run FROM runs ORDER BY run")]
    assert all(f"<td>{run}</td>" in header for run in runs) and f"{len(runs)} runs of 1 model" in header
    samples = workspace.rows("SELECT sum(n_samples) FROM v_runs")[0][0]
    assert f"{samples} samples" in header and re.search(r"Written \d{4}-\d\d-\d\d \d\d:\d\d UTC", header)
    body = index[index.index("</header>"):]
    assert body.count("<table>") == len(re.findall(r"<h4>[^<]+</h4><table>", body))  # every table has a title
    for (series,) in workspace.rows("SELECT DISTINCT series FROM probes WHERE series IS NOT NULL"):
        assert series[:8] not in index  # a legend or table names target, kind and tokens, never the hash


@pytest.fixture(scope="module")
def mute(tmp_path_factory) -> tuple[Workspace, str]:
    """Runs whose model answers 'False' to every CountingTricks and spatial scene, and a G2M run
    that transcribes N = 2 grids and gives no grid at N = 3; and the report of them."""
    root = tmp_path_factory.mktemp("mute")
    ws = Workspace.open(root / "data")
    scenes = [{"id": f"c{i}", "family": "counting", "truth": {"case": case, "count": 3}}
              for i, case in enumerate(("10A", "2A", "1A") * 2)]
    pairs = [{"id": f"s{i}", "family": "spatial", "truth": {"relation": "left", "options": ["a", "b", "c", "d"]}}
             for i in range(4)]
    false = Generation(text="False", prediction=None, parse_ok=False, correct=False)
    for run, stimuli, dataset in (("mute-count", scenes, "counting"), ("mute-choice", pairs, "spatial")):
        with ws.writer(RunInfo(run=run, model="hand-built")) as w:
            w.set_samples(w.register_stimuli(stimuli, dataset=dataset))
            w.record_generations(0, [false] * len(stimuli))
    grids = [{"id": f"g{n}-{i}", "family": "g2m", "params": {"grid_size": n, "image_size": 8 * n, "num_colors": 3},
              "truth": {"matrix": np.eye(n, dtype=int).tolist()}} for n in (2, 3) for i in range(2)]
    with ws.writer(RunInfo(run="half-grids", model="hand-built")) as w:
        w.set_samples(w.register_stimuli(grids, dataset="g2m"))
        w.record_generations(0, [Generation(text="x", prediction=g["truth"]["matrix"], parse_ok=True, correct=True)
                                 if g["params"]["grid_size"] == 2 else false for g in grids])
    ro = Workspace.open(root / "data", readonly=True)
    return ro, write_report(ro.path, root / "report").read_text()


@pytest.mark.slow
def test_a_run_without_usable_answers_gets_one_line_not_a_figure(mute):
    ws, index = mute
    for slug, line in (("counting-tricks", "mute-count: 6 of 6 answers are no count (answer 'False'), so its accuracy"
                                           " per case is not drawn."),
                       ("images-as-text", "mute-choice: 4 of 4 answers are no choice (answer 'False'), so its spatial"
                                          " accuracy is not drawn.")):
        page = _page(index, slug)
        assert "data-figures='0'" in index[index.index(f"id='{slug}'"):][:80] and "<figure" not in page, slug
        assert html.escape(line) in page and page.count(html.escape(line)) == 1
    # the numbers stay in the table, cases in natural order
    assert [r["case_id"] for r in run_named(ws, "counting_cases").to_pylist()] == ["1A", "2A", "10A"]


@pytest.mark.slow
def test_a_g2m_curve_draws_unparsed_sizes_as_zero_and_says_how_many(mute):
    _, index = mute
    page = _page(index, "g2m")
    (caption,) = [c for c in re.findall(r"<figcaption>(.*?)</figcaption>", page, re.S) if "Cell accuracy per grid" in c]
    assert "answers that did not parse count as 0 (half-grids: N = 3 (2 of 2))" in caption
    assert "dotted grey: chance 1/C" in caption and "n = 2 grids per N" in caption


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
    # kept as CI artifacts: what a reader sees of every page, from this demo-like workspace
    shots = Path(__file__).resolve().parents[2] / "report"
    shots.mkdir(exist_ok=True)
    for slug in re.findall(r"<section class='page' id='([^']+)'", index.read_text()):
        shot = screenshot_page(index, slug, shots / f"screenshot-{slug}.png", tmp_path / f"chrome-{slug}")
        assert shot.stat().st_size > 10_000, f"{slug}: {shot} is {shot.stat().st_size} bytes, not a drawn page"


def screenshot_page(index: Path, slug: str, shot: Path, profile: Path) -> Path:
    """One page of the report as a PNG of its full height: a copy of index.html beside it that shows
    only that page (headless Chromium draws nothing when told to scroll to an anchor)."""
    text = index.read_text()
    page = text[text.index(f"id='{slug}'"):]
    page = page[:page.index("</section>")]
    # tall enough for the page: its figures, table rows and lines of text
    height = min(16_000, 500 + 950 * page.count("<img") + 22 * page.count("<tr>") + 20 * page.count("<p"))
    alone = index.with_name(f"_screenshot-{slug}.html")
    alone.write_text(text.replace("</head>", f"<style>section.page{{display:none}}#{slug}{{display:block}}</style></head>"))
    try:
        subprocess.run(
            [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
             f"--user-data-dir={profile}", f"--window-size=1200,{height}", "--virtual-time-budget=5000",
             f"--screenshot={shot}", alone.as_uri()], capture_output=True, text=True, timeout=120)
    finally:
        alone.unlink()
    return shot


@pytest.mark.slow
def test_a_full_disk_while_writing_the_report_is_one_line(workspace, tmp_path):
    """Injects (issue 40, item 10): a file-size limit below one figure (EFBIG, as a full disk fails
    writes with ENOSPC) for a real `python -m queries.report`. Asserts: exit 2, one `error:` line
    naming the file and the fix, no traceback (was a traceback)."""
    import sys

    from child_env import child_env

    code = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN);"
            " resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048));"
            "from queries.report import main; sys.exit(main(sys.argv[1:]))")
    got = subprocess.run([sys.executable, "-c", code, "--data", str(workspace.path), "--out", str(tmp_path / "r")],
                         capture_output=True, text=True, timeout=300, env=child_env())
    lines = got.stderr.strip().splitlines()
    assert got.returncode == 2 and "Traceback" not in got.stderr, got.stderr[-2000:]
    assert lines[-1].startswith("error: the report: disk full / file too large while writing")
    assert str(tmp_path / "r") in lines[-1] and "choose another --out" in lines[-1]
