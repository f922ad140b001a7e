"""The committed checkpoint loads through the Auto classes and still scores as its model card says."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

import lab
from lab.evaluate import EvalSpec, answer, boards, correct

CKPT = lab.DEFAULT_CHECKPOINT


@pytest.fixture(scope="module")
def committed():
    if not (CKPT / "model.safetensors").exists():
        pytest.fail(f"no committed checkpoint at {CKPT}: run python -m lab.train")
    model = AutoModelForImageTextToText.from_pretrained(CKPT).eval()
    return model, AutoProcessor.from_pretrained(CKPT)


def test_loads_through_auto_classes(committed):
    model, processor = committed
    assert AutoConfig.from_pretrained(CKPT).model_type == "toy_counter"
    assert isinstance(model, lab.ToyCounterForConditionalGeneration)
    assert isinstance(processor, lab.ToyCounterProcessor)
    assert processor.image_token_id == model.config.image_token_id
    assert sum(p.numel() for p in model.parameters()) < 100_000
    assert (CKPT / "model.safetensors").stat().st_size < 1_000_000


def rescore(committed, task: str, counts: str, regime: str) -> tuple[float, float]:
    """(accuracy now, accuracy on the card) of ``task`` on the card's own sample of ``regime``.

    EvalSpec defaults are the card's: seed, 4 boards per count, mild variation.
    """
    model, processor = committed
    torch.set_num_threads(1)
    card = json.loads((CKPT / "evaluation.json").read_text())["regimes"][regime][task]
    spec = EvalSpec()
    stimuli = boards(model, spec, counts, spec.per_count, spec.seed, "test")
    texts = answer(model, processor, stimuli, task, 100)
    return float(np.mean([correct(s, task, t) for s, t in zip(stimuli, texts, strict=False)])), card


@pytest.mark.parametrize("counts, regime", [("0-49", "ID"), pytest.param("50-99", "VE", marks=pytest.mark.slow)])
def test_visual_accuracy_matches_model_card(committed, counts, regime):
    # Within 5 points of the card (ID 96.5%, VE 0%), and the targets (ID >= 95%, VE <= 5%).
    acc, card = rescore(committed, "multimodal_num", counts, regime)
    assert abs(acc - card) <= 0.05
    if regime == "ID":
        assert acc >= 0.95
    else:
        assert acc <= 0.05


@pytest.mark.parametrize("counts, regime", [("0-49", "ID"), ("50-99", "VE")])
@pytest.mark.slow
def test_contrastive_accuracy_matches_model_card(committed, counts, regime):
    # Board vs string "same number?": near perfect in range; past it the card records chance.
    acc, card = rescore(committed, "multimodal_tf", counts, regime)
    assert abs(acc - card) <= 0.05
    if regime == "ID":
        assert acc >= 0.95


def test_text_counting_matches_model_card(committed):
    model, processor = committed
    spec = EvalSpec(variation="mild")
    stimuli = boards(model, spec, "0-99", 1, 778, "test")[::2]
    texts = answer(model, processor, stimuli, "text_only_num", 64)
    acc = float(np.mean([correct(s, "text_only_num", t) for s, t in zip(stimuli, texts, strict=False)]))
    assert acc >= 0.85


def test_committed_weights_come_from_the_committed_recipe():
    """`make toy-model` (lab/toy.yaml) is the recipe the checkpoint's training record names."""
    from lab.config import TrainConfig

    recorded = json.loads((CKPT / "training.json").read_text())["train_config"]
    assert TrainConfig.load().to_dict() == recorded
