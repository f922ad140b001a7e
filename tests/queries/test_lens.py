"""The offline logit lens on a hand-built store whose token maps are known."""

from __future__ import annotations

import numpy as np
import pytest

from queries.lens import Lens, layer_table, matches, run_length_ratio, token_map
from queries.scene import object_patches
from store import ArraySpec, RunInfo, TokenSpans, Workspace

VOCAB = ["red", " circle", ".", "blue", " square"]
GRID = 4  # 4 x 4 patches over a 64 px image


def _hidden(tokens: list[int]) -> np.ndarray:
    """Hidden states whose top-1 token through the identity unembedding is ``tokens``."""
    x = np.full((len(tokens), len(VOCAB)), -1.0, np.float32)
    x[np.arange(len(tokens)), tokens] = 4.0
    return x


@pytest.fixture
def ws(tmp_path):
    ws = Workspace.open(tmp_path / "ws")
    # Sample 0: a red circle covering the top-left 2x2 patches, everything else '.'.
    # Layer 0 reads 'red' on the object; layer 1 (the last: normed first) reads ' circle' there.
    obj = [0, 1, 4, 5]
    layer0 = [0 if i in obj else 2 for i in range(16)]
    layer1 = [1 if i in obj else 2 for i in range(16)]
    truth = {"subject": {"shape": "circle", "colour": "red", "bbox": [0, 0, 31, 31]},
             "reference": {"shape": "square", "colour": "blue", "bbox": [40, 40, 63, 63]}}
    rows = [{"id": "s0", "family": "spatial", "prompts": {"c": "q"}, "answers": {"c": "A"}, "truth": truth,
             "params": {"image_size": 64}}]
    lens_cfg = {"norm": "rms", "eps": 1e-6, "weight_offset": 0.0, "n_layers": 2}
    with ws.writer(RunInfo(run="r", model="m", config={"logit_lens": lens_cfg})) as w:
        w.set_samples(w.register_stimuli(rows, dataset="set"))
        for layer, toks in ((0, layer0), (1, layer1)):
            h = w.array(ArraySpec(tap="llm", layer=layer, tokens="image", shape=(16, len(VOCAB))))
            w.write(h, 0, _hidden(toks)[None])
        w.record_tokens(0, [TokenSpans(seq_len=20, image_start=1, image_count=16, grid_h=GRID, grid_w=GRID,
                                       last_prompt=19, answer_start=20, answer_count=0)])
        w.write_tensor("lm_head.weight", np.eye(len(VOCAB), dtype=np.float32))
        w.write_tensor("final_norm.weight", np.ones(len(VOCAB), np.float32))
        w.finish()
    ws.record_vocab("r", VOCAB)
    return ws


@pytest.mark.slow
def test_token_map_reads_the_stored_states(ws):
    m0, m1 = token_map(ws, "r", 0, 0), token_map(ws, "r", 1, 0)
    assert m0[0][:2] == ["red", "red"] and m0[1][:2] == ["red", "red"] and m0[3][3] == "."
    assert m1[0][0] == " circle" and m1[2][2] == "."


@pytest.mark.slow
def test_layer_table(ws):
    rows = {r["layer"]: r for r in layer_table(ws, "r").to_pylist()}
    # raster runs: layer 0 = red red . . red red . . . ... -> runs: [rr][..][rr][.........] = 4 / 16
    assert rows[0]["retained_ratio"] == pytest.approx(4 / 16)
    # subject patches (2x2 + the bbox edge rounding): all 'red' at layer 0, ' circle' at layer 1;
    # reference (bottom-right 2x2 incl. edges): all '.'; shares averaged over the two objects.
    assert rows[0]["attribute_share"] == pytest.approx(0.5) and rows[0]["object_share"] == pytest.approx(0.0)
    assert rows[1]["attribute_share"] == pytest.approx(0.0) and rows[1]["object_share"] == pytest.approx(0.5)


def test_last_layer_is_normed_first(ws):
    lens = Lens.load(ws, "r")
    assert lens.last_layer == 1
    x = np.array([[3.0, 4.0, 0, 0, 0]], np.float32)
    np.testing.assert_allclose(lens.normed(x), x / np.sqrt((x * x).mean() + 1e-6), rtol=1e-6)


def test_helpers():
    assert run_length_ratio(np.array([1, 1, 2, 2, 2, 1])) == pytest.approx(3 / 6)
    assert run_length_ratio(np.array([])) == 1.0
    assert matches(" circle", "circle") and matches("Red", "red")
    assert matches("circ", "a circle x")  # a word's prefix matches, as in the study
    assert not matches(".", "red") and not matches("  ", "red")
    assert sorted(object_patches([0, 0, 31, 31], (64, 64), (4, 4)).tolist()) == [0, 1, 4, 5]


@pytest.mark.slow
def test_the_report_section_draws_the_lens_per_layer_of_each_run(ws, tmp_path):
    from queries.pages_spatial import lens_sections

    (sec,) = lens_sections(ws, tmp_path)
    assert sec.title == "Logit lens over image tokens"
    (name, table), = sec.tables
    assert name == "logit_lens" and set(table.column("run").to_pylist()) == {"r"}
    assert sorted(table.column("layer").to_pylist()) == [0, 1]
    per_layer = sec.figures[-1]
    # the numbers are the section's table (logit_lens.csv), not a second copy beside the figure
    assert (per_layer.png, per_layer.csv) == ("logit_lens.png", "logit_lens.csv")
    assert (tmp_path / "logit_lens.png").stat().st_size > 0 and not (tmp_path / "logit_lens.csv").exists()
