"""Attention–object agreement on a store whose attention is known."""

from __future__ import annotations

import numpy as np
import pytest

from queries.attention import agreement, object_agreement
from store import ArraySpec, RunInfo, TokenSpans, Workspace

GRID, START, HEADS = 4, 2, 2
SEQ = START + GRID * GRID + 3


def test_agreement():
    mask = np.array([True, True, False, False])
    assert agreement(np.array([0.5, 0.5, 0, 0]), mask) == (1.0, 1.0)
    share, iou = agreement(np.array([0.5, 0.1, 0.3, 0.1]), mask)
    assert share == pytest.approx(0.6) and iou == pytest.approx(1 / 3)  # attended {0, 2} vs {0, 1}
    assert np.isnan(agreement(np.zeros(4), mask)[0])


@pytest.fixture
def ws(tmp_path):
    """Sample 0: attention only on its object's patches (layer 0), spread evenly (layer 1).
    One object in the top-left quarter of a 64 px image over a 4x4 grid: patches 0, 1, 4, 5."""
    ws = Workspace.open(tmp_path / "ws")
    truth = {"image_size": 64, "objects": [{"index": 0, "bbox": [0.0, 0.0, 31.0, 31.0]}]}
    rows = [{"id": "c0", "family": "counting", "prompts": {"s": "q"}, "answers": {"s": "1"}, "truth": truth}]
    on_object = np.zeros((SEQ, HEADS), np.float32)
    on_object[[START + i for i in (0, 1, 4, 5)]] = 0.25
    even = np.full((SEQ, HEADS), 1 / SEQ, np.float32)
    with ws.writer(RunInfo(run="r", model="m")) as w:
        w.set_samples(w.register_stimuli(rows, dataset="set"))
        for layer, rows_ in ((0, on_object), (1, even)):
            h = w.array(ArraySpec(tap="attn", layer=layer, site="probs", tokens="last", shape=(HEADS,), ragged=True))
            w.write_ragged(h, 0, [rows_])
        w.record_tokens(0, [TokenSpans(seq_len=SEQ, image_start=START, image_count=GRID * GRID, grid_h=GRID,
                                       grid_w=GRID, last_prompt=SEQ - 1, answer_start=SEQ, answer_count=0)])
        w.finish()
    return ws


def test_object_agreement_per_layer(ws):
    rows = {r["layer"]: r for r in object_agreement(ws, "r").to_pylist()}
    assert rows[0]["samples"] == 1
    assert rows[0]["object_share"] == pytest.approx(1.0) and rows[0]["iou"] == pytest.approx(1.0)
    # even attention: 4 of 16 patches are the object; nothing is above the uniform level
    assert rows[1]["object_share"] == pytest.approx(0.25) and rows[1]["iou"] == pytest.approx(0.0)


@pytest.mark.slow
def test_report_section(ws, tmp_path):
    from queries.report import write_report

    index = write_report(ws.path, tmp_path / "report").read_text()
    assert "object_attention.png" in index and "Attention on objects" in index


def test_the_section_draws_the_object_share_per_layer_and_writes_its_numbers(ws, tmp_path):
    from queries.pages_spatial import object_attention_sections

    (sec,) = object_attention_sections(ws, tmp_path)
    (fig,) = sec.figures
    assert (fig.png, fig.csv) == ("object_attention.png", "object_attention.csv")
    csv = (tmp_path / "object_attention.csv").read_text().splitlines()
    assert csv[0].startswith('"run","layer"') and len(csv) == 3  # run r, layers 0 and 1
