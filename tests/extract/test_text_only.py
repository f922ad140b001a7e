"""Text-only tasks (a Go board's text twin) and tasks that show strings beside the image: the
prompt the model sees, the batches, and a run that mixes both modalities in one store."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from devices import allclose, close, load, model_config

from extract.manifest import ManifestError, parse_manifest
from extract.models import capture, prepare_batch
from extract.models.errors import InputError
from extract.run import run_extraction
from stimuli import get_family
from stimuli.goboard import task_inputs
from stimuli.io import write_set
from store import Workspace

TOY = "lab/checkpoints/toy-counter"


@pytest.fixture(scope="module")
def toy():
    return load(TOY)  # AGNOSIA_TEST_DEVICE / AGNOSIA_TEST_DTYPE (devices.py)


@pytest.fixture(scope="module")
def go_sets(tmp_path_factory):
    family = get_family("go")
    root = tmp_path_factory.mktemp("go")
    cfg = family.config(preset="small", counts="3,20,40", variation="mild")
    # Two folders of the same boards: one asked visually, one as text (a run maps each stimulus once).
    return [write_set(family, cfg, n=1, seed=5, split="test", out=root / name) for name in ("boards", "strings")]


def test_go_tasks_show_what_the_study_showed():
    truth = {"text_c": "acb", "text_eq": "bca", "text_ie": "ccc", "tf_pair": "ie"}
    assert task_inputs(truth, "multimodal_num").image and not task_inputs(truth, "multimodal_num").strings
    assert task_inputs(truth, "text_only_num") == task_inputs(truth, "text_only_num").__class__(False, ("acb",))
    assert task_inputs(truth, "multimodal_tf").strings == ("ccc",)
    assert task_inputs(truth, "text_only_tf").strings == ("acb", "ccc")
    assert not task_inputs(truth, "text_only_tf").image


def test_text_only_batch_has_the_string_and_no_image_tokens(toy):
    batch = prepare_batch(toy, [None], ["How many c letters are there in the given string ?"], strings=[("acbc",)])
    assert "<|str_start|> a c b c <|str_end|>" in batch.texts[0]
    assert "<|image|>" not in batch.texts[0] and "pixel_values" not in batch.inputs
    assert batch.layouts[0].image_positions.size == 0
    res = capture(toy, batch, ["llm.0", "vision.0"], tokens=("last",))
    with torch.no_grad():
        hidden = toy.model(**batch.inputs, output_hidden_states=True).hidden_states
    close(res[("llm", 0, "resid_post", "last")][0, 0], hidden[1][0, batch.layouts[0].last_position])


def test_a_batch_cannot_mix_modalities(toy, go_sets):
    image = next(go_sets[0].glob("images/*.png"))
    with pytest.raises(InputError, match="split the batch by modality"):
        prepare_batch(toy, [image, None], ["a", "b"])


def test_text_only_run_refuses_image_taps(go_sets, tmp_path):
    manifest = parse_manifest({
        "run": "t", "model": {"path": TOY}, "stimuli": [{"set": str(go_sets[1]), "task": "text_only_num"}],
        "taps": [{"tap": "vision", "layers": [0]}],
    })
    with pytest.raises(ManifestError, match="text-only"):
        run_extraction(manifest, workspace=tmp_path / "ws", progress=False)


@pytest.mark.slow
def test_a_run_mixing_boards_and_text_twins(toy, go_sets, tmp_path):
    boards, strings = go_sets
    manifest = parse_manifest({
        "run": "mixed", "model": {"path": TOY, **model_config()},
        "stimuli": [{"set": str(boards), "task": "multimodal_num"}, {"set": str(strings), "task": "text_only_num"}],
        "taps": [{"tap": "vision", "layers": [-1]}, {"tap": "llm", "layers": [1], "tokens": ["image", "last"]}],
        "generation": {"max_new_tokens": 4}, "batch_size": 4, "chunk_samples": 2,
    })
    summary = run_extraction(manifest, workspace=tmp_path / "ws", progress=False)
    assert summary.samples == 6
    ws = Workspace.open(tmp_path / "ws", readonly=True)
    assert ws.verify().ok
    rows = ws.rows("SELECT array_row, dataset, image_count, correct FROM v_samples ORDER BY array_row")
    assert [r[1] for r in rows] == ["boards"] * 3 + ["strings"] * 3
    assert [r[2] for r in rows] == [121] * 3 + [0] * 3
    vision = ws.read("mixed", "vision", toy.adapter.n_layers("vision") - 1, tokens="image")
    assert [v.shape for v in vision] == [(121, 32)] * 3 + [(0, 32)] * 3  # ragged: text rows hold no tokens
    # The text rows hold what a text-only forward gives, and the model counts letters: its trained task.
    last = ws.read("mixed", "llm", 1, tokens="last")
    for row in (3, 4, 5):
        stim = ws.rows("SELECT v.truth->>'text_c', st.prompts->>'text_only_num' FROM v_samples v JOIN stimuli st USING (stimulus)"
                        " WHERE array_row = ?", [row])[0]
        batch = prepare_batch(toy, [None], [stim[1]], strings=[(stim[0],)])
        ref = capture(toy, batch, ["llm.1"], tokens=("last",))[("llm", 1, "resid_post", "last")][0]
        allclose(last[row], ref.float().numpy().astype(np.float16), rtol=1e-3, atol=1e-3)
    # The text rows are scored like the board rows ("2 0" is the toy's way of writing 20), and the
    # model counts letters, its trained task (97.5 % on its card): at most one slip in three.
    scored = ws.rows("SELECT TRY_CAST(prediction AS INTEGER), CAST(truth->>'count' AS INTEGER), correct FROM v_samples"
                     " WHERE array_row >= 3 ORDER BY array_row")
    assert all(correct == (prediction == count) for prediction, count, correct in scored)
    assert sum(correct for *_, correct in scored) >= 2
