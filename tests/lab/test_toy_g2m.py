"""The G2M curriculum (study g2m in the lab): data, training steps, and the committed toy-g2m checkpoint."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

import lab
from lab.config import G2MTrainConfig, TrainConfig
from lab.g2m import (
    G2M_CHECKPOINT,
    G2MBatchMaker,
    G2MEvalSpec,
    G2MTrainer,
    GridRenderer,
    answer_text,
    build_g2m_processor,
    evaluate,
    grids,
    transcribe,
)
from lab.trainer import build_model
from stimuli import g2m as G
from toyvlm import tokenizer as T
from toyvlm.processor import answer_suffix, build_processor, prompt

CKPT = G2M_CHECKPOINT


def tiny_g2m(**overrides) -> G2MTrainConfig:
    base = dict(grid_sizes=(3, 4), board_size=4, batch_size=16, threads=1,
                model={"hidden_size": 16, "num_attention_heads": 2, "intermediate_size": 32,
                       "vision_layers": 1, "decoder_layers": 1})
    base.update(overrides)
    return G2MTrainConfig(**base)


def test_recipe_yaml_loads_as_g2m():
    cfg = TrainConfig.load(lab.DEFAULT_CHECKPOINT.parents[1] / "toy-g2m.yaml")
    assert isinstance(cfg, G2MTrainConfig) and cfg.curriculum == "g2m"
    assert max(cfg.grid_sizes) < min(n for n in cfg.eval_grid_sizes if n not in cfg.grid_sizes)
    assert type(TrainConfig.load()) is TrainConfig  # the counter's recipe is untouched


def test_counter_vocabulary_and_processor_unchanged():
    # The G2M words come after the counter's vocabulary: every counter id stays where it was.
    base, extended = T.vocabulary(), T.vocabulary(T.G2M_WORDS)
    assert all(extended[w] == i for w, i in base.items()) and len(extended) > len(base)
    proc = build_processor()
    assert not proc.image_processor.variable_size
    committed = AutoProcessor.from_pretrained(lab.DEFAULT_CHECKPOINT)
    # The built tokenizer is the one the counter checkpoint was trained with: same tokens, same ids.
    assert proc.tokenizer.get_vocab() == committed.tokenizer.get_vocab() == base
    assert not committed.image_processor.variable_size
    with pytest.raises(ValueError, match="88x88"):
        proc.image_processor(np.zeros((48, 48, 3), dtype=np.uint8))


@pytest.mark.parametrize("n", [3, 5, 6, 7, 10, 12])
def test_renderer_is_pixel_identical_to_g2m_render(n):
    r = GridRenderer(8, 3)
    for seed in (0, 1):
        m = G.make_matrix(n, 3, "random", seed)
        ref = np.asarray(G.render(m, 8 * n)).transpose(2, 0, 1)
        assert np.array_equal(r.render(torch.from_numpy(m)[None])[0].numpy(), ref)


def test_matrices_follow_make_matrix_law():
    m = GridRenderer(8, 3).matrices(200, 3, torch.Generator().manual_seed(0))
    flat = m.view(200, -1)
    assert flat.min() >= 0 and flat.max() <= 2
    assert all(set(row.tolist()) == {0, 1, 2} for row in flat)  # every colour at least once


def test_training_batches_are_the_processor_inputs():
    cfg = tiny_g2m()
    processor = build_g2m_processor(cfg)
    maker = G2MBatchMaker(processor, 8, 3)
    batch = maker.make(4, 3, torch.Generator().manual_seed(1))
    digit = {processor.tokenizer.convert_tokens_to_ids(str(d)): d for d in range(10)}
    for row in range(3):
        answer = batch.labels[row][batch.labels[row] != -100][:-2]
        matrix = np.array([digit[int(t)] for t in answer]).reshape(4, 4)
        text = prompt(G.prompt(4, 4, 3), image=True) + " " + answer_suffix(answer_text(matrix))
        enc = processor(images=[G.render(matrix, 32)], text=[text])
        assert torch.equal(enc["input_ids"][0], batch.input_ids[row])
        assert torch.allclose(enc["pixel_values"][0], batch.pixel_values[row])
        assert int(batch.image_mask[row].sum()) == 16
    assert (enc["input_ids"] == processor.tokenizer.unk_token_id).sum() == 0


@pytest.mark.slow  # lab/test_model.py trains the counter in the quick loop
def test_training_steps_lower_loss():
    cfg = tiny_g2m()
    torch.manual_seed(0)
    processor = build_g2m_processor(cfg)
    model = build_model(cfg, processor).train()
    trainer = G2MTrainer(cfg, model, processor)
    batches = [trainer.batch(t) for t in ("n3", "n4")]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with torch.no_grad():
        before = sum(float(model(input_ids=b.input_ids, pixel_values=b.pixel_values, labels=b.labels).loss)
                     for b in batches)
    for _ in range(15):
        for b in batches:
            trainer.step(opt, b)
    with torch.no_grad():
        after = sum(float(model(input_ids=b.input_ids, pixel_values=b.pixel_values, labels=b.labels).loss)
                    for b in batches)
    assert after < 0.5 * before


# --- the committed checkpoint ---------------------------------------------------------------

@pytest.fixture(scope="module")
def committed():
    if not (CKPT / "model.safetensors").exists():
        pytest.fail(f"no committed checkpoint at {CKPT}: run make toy-g2m")
    model = AutoModelForImageTextToText.from_pretrained(CKPT).eval()
    return model, AutoProcessor.from_pretrained(CKPT)


@pytest.fixture(scope="module")
def card():
    return json.loads((CKPT / "evaluation.json").read_text())


def test_checkpoint_loads_through_auto_classes(committed):
    model, processor = committed
    assert AutoConfig.from_pretrained(CKPT).model_type == "toy_counter"
    assert isinstance(model, lab.ToyCounterForConditionalGeneration)
    assert isinstance(processor, lab.ToyCounterProcessor)
    assert processor.image_processor.variable_size
    assert processor.image_token_id == model.config.image_token_id
    assert all(processor.tokenizer.convert_tokens_to_ids(w) != processor.tokenizer.unk_token_id
               for w in T.G2M_WORDS)
    assert (CKPT / "model.safetensors").stat().st_size < 1_000_000
    assert (CKPT / "README.md").read_text().count("| end-to-end Cell Accuracy |") == 1


@pytest.mark.parametrize("n", [4, 9])
def test_end_to_end_matches_model_card(committed, card, n):
    # The card's own first 16 test grids of this N (seed 30000..): the cell accuracy of this
    # sub-sample must land within 10 points of the card's value on all of them.
    model, processor = committed
    row = card["per_n"][str(n)]
    spec = G2MEvalSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in card["spec"].items()})
    test = grids(model, n, 16, spec.seed, "test", spec.num_colors)
    texts = transcribe(model, processor, test, 16)
    m = G.metrics([G.score(t, s.truth["matrix"]) for t, s in zip(texts, test, strict=False)])
    assert abs(m.cell_accuracy - row["cell_accuracy"]) <= 0.10
    if row["trained"]:
        assert m.cell_accuracy >= 0.9
    else:
        assert m.cell_accuracy <= 0.5


@pytest.mark.slow
def test_probe_beats_shuffled_control_beyond_training(committed, card):
    # Small re-run of the evaluation at one trained and one untrained N.
    model, processor = committed
    spec = G2MEvalSpec(grid_sizes=(5, 10), per_n=8, probe_grids=8, batch_size=8)
    result = evaluate(model, processor, spec, trained=(3, 4, 5, 6))
    for n in ("5", "10"):
        row = result["per_n"][n]
        assert row["probe_cell_accuracy"] >= 0.9
        assert row["control_cell_accuracy"] <= 0.5
        assert abs(row["probe_cell_accuracy"] - card["per_n"][n]["probe_cell_accuracy"]) <= 0.05
    assert result["per_n"]["10"]["probe_cell_accuracy"] - result["per_n"]["10"]["cell_accuracy"] >= 0.4


def test_eval_grids_are_the_g2m_family_stimuli(committed):
    # lab.g2m.grids builds what g2m.generate yields (generate itself refuses 24 px canvases, N = 3).
    model, _ = committed
    ours = grids(model, 5, 3, 30000, "test", 3)
    ref = list(G.generate(G.Config(grid_sizes=(5,), colors=(3,), image_size=40), 3, 30000, "test"))
    for a, b in zip(ours, ref, strict=False):
        assert (a.id, a.seed, a.prompts, a.answers, a.truth, a.params) == (b.id, b.seed, b.prompts, b.answers,
                                                                            b.truth, b.params)
        assert np.array_equal(np.asarray(a.image), np.asarray(b.image))


def test_variable_size_processor_refuses_misaligned_images():
    proc = build_g2m_processor(tiny_g2m())
    with pytest.raises(ValueError, match="multiple"):
        proc.image_processor(np.zeros((44, 44, 3), dtype=np.uint8))
    enc = proc(images=[np.zeros((56, 56, 3), dtype=np.uint8)], text=[prompt("x", image=True)])
    assert int((enc["input_ids"] == proc.image_token_id).sum()) == 49
