"""G2M error maps, positional-bias scalars and patch alignment on stores whose answers are known."""

from __future__ import annotations

import json

import numpy as np
import pytest

from queries.g2m import aligned, alignment_table, bias_table, cell_errors, error_maps, positional_bias
from store import Generation, RunInfo, TokenSpans, Workspace


def test_scalars_of_known_maps():
    flat = positional_bias(np.full((4, 4), 0.5))
    assert flat["error_entropy"] == pytest.approx(1.0) and flat["spectral_nonuniformity"] == pytest.approx(0.0)
    assert flat["row_slope"] == pytest.approx(0.0)
    one = np.zeros((4, 4))
    one[0, 0] = 1
    corner = positional_bias(one)
    assert corner["error_entropy"] == pytest.approx(0.0) and corner["spectral_nonuniformity"] > 0.9
    bottom = np.zeros((4, 4))
    bottom[3] = 1.0  # only the last row is wrong: errors grow downward
    b = positional_bias(bottom)
    assert b["row_slope"] > 0.5 and b["col_slope"] == pytest.approx(0.0)
    assert positional_bias(np.zeros((3, 3)))["error_entropy"] is None


def test_cell_errors_count_failed_parses_as_all_wrong():
    assert cell_errors("[[1, 2], [3, 4]]", None).all()
    assert cell_errors([[1, 2], [3, 4]], [[1, 2], [3]]).all()  # wrong shape: unparsed
    assert cell_errors([[1, 2], [3, 4]], "[[1, 0], [3, 4]]").tolist() == [[False, True], [False, False]]


def test_alignment():
    assert aligned(4, 448, 28)  # 112 px cells = 4 patches
    assert aligned(16, 448, 28)  # 28 px cells = 1 patch
    assert not aligned(5, 448, 28)  # 89.6 px cells
    assert aligned(3, 512, 512 / 16) is False  # 170.67 px cells over 32 px patches


@pytest.fixture
def ws(tmp_path):
    """A model that transcribes 4x4 grids perfectly except the bottom-right cell, and fails 5x5 grids
    entirely (unparsed); patches of 28 px over 448 px images (grid_w 16)."""
    ws = Workspace.open(tmp_path / "ws")
    rows, gens = [], []
    rng = np.random.default_rng(0)
    for i in range(6):
        n = 4 if i < 4 else 5
        m = rng.integers(0, 3, (n, n))
        rows.append({"id": f"g{i}", "family": "g2m", "prompts": {"t": "q"}, "answers": {"t": "a"},
                     "truth": {"matrix": json.dumps(m.tolist())}, "params": {"grid_size": n, "image_size": 448}})
        if n == 4:
            pred = m.copy()
            pred[3, 3] = (pred[3, 3] + 1) % 3
            gens.append(Generation(text="x", prediction=pred.tolist(), parse_ok=True, correct=False))
        else:
            gens.append(Generation(text="?", prediction=None, parse_ok=False, correct=False))
    with ws.writer(RunInfo(run="r", model="m")) as w:
        w.set_samples(w.register_stimuli(rows, dataset="g2m"))
        w.record_tokens(0, [TokenSpans(seq_len=300, image_start=1, image_count=256, grid_h=16, grid_w=16,
                                       last_prompt=299, answer_start=300, answer_count=0)] * 6)
        w.record_generations(0, gens)
        w.finish()
    return ws


def test_error_maps_and_bias_table(ws):
    maps = error_maps(ws, "r")
    err4, count4 = maps[4]
    assert count4 == 4 and err4[3, 3] == 1.0 and err4.sum() == 1.0
    assert (maps[5][0] == 1.0).all()
    rows = {r["grid_size"]: r for r in bias_table(ws, "r").to_pylist()}
    assert rows[4]["cell_accuracy"] == pytest.approx(15 / 16) and rows[4]["error_entropy"] == pytest.approx(0.0)
    assert rows[5]["cell_accuracy"] == 0.0 and rows[5]["error_entropy"] == pytest.approx(1.0)


def test_alignment_table(ws):
    rows = {r["aligned"]: r for r in alignment_table(ws, "r").to_pylist()}
    assert rows[True]["grids"] == 4 and rows[True]["cell_accuracy"] == pytest.approx(15 / 16)
    assert rows[False]["grids"] == 2 and rows[False]["cell_accuracy"] == 0.0


@pytest.mark.slow
def test_report_draws_the_error_map(ws, tmp_path):
    from queries.report import write_report

    index = write_report(ws.path, tmp_path / "report").read_text()
    assert "g2m_errors_0.png" in index and (tmp_path / "report" / "g2m_errors_0.png").stat().st_size > 1000
    bias = (tmp_path / "report" / "g2m_positional_bias.csv").read_text()
    assert bias.splitlines()[1].startswith('"r",4,4,0.9375,')


@pytest.mark.slow
def test_report_draws_the_probe_map_beside_the_models(ws, tmp_path):
    from queries.report import probe_error_map, write_report
    from store import ProbeResult

    # The model fails every 5x5 grid (the largest N with errors): the probe's 5x5 map goes beside it.
    good = [[0.0] * 5 for _ in range(5)]
    bad = [[0.0] * 5 for _ in range(4)] + [[0.0, 0.0, 0.0, 0.0, 1.0]]
    ws.record_probes([
        ProbeResult(run="r", tap="vision", layer=layer, target="g2m.matrix", kind="conv_spatial", score=score,
                    seed=0, metric="cell_accuracy", params={"metrics": {"error_maps": {"5": m}}})
        for layer, score, m in ((0, 0.9, bad), (1, 0.99, good))])
    assert probe_error_map(ws, "r", 4) is None
    label, mean = probe_error_map(ws, "r", 5)
    assert label == "r: probe on vision.1 (resid_post)" and mean.sum() == 0.0  # the best layer's map
    index = write_report(ws.path, tmp_path / "report").read_text()
    assert "g2m_errors_0.png" in index and "g2m_errors_1.png" in index
