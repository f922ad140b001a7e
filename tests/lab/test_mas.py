"""The MAS loss (counting-tricks): share, hinge and gradient against hand computations, and the
fine-tuning hook on a real (tiny) training run."""

from __future__ import annotations

import pytest
import torch
from labtest_lib import tiny_config

from lab.data import BatchMaker
from lab.mas import MasLoss, answer_wrong, mas_hinge, modality_attention_share
from lab.train import train


def _attention() -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Two layers, two samples, two heads, three positions; key 0 is the image, query 2 the answer."""
    rows = torch.tensor([
        # layer 0: sample 0 heads 0, 1; sample 1 heads 0, 1 (only query row 2 matters)
        [[[0.5, 0.25, 0.25], [0.1, 0.6, 0.3]], [[0.9, 0.05, 0.05], [0.7, 0.2, 0.1]]],
        # layer 1
        [[[0.2, 0.4, 0.4], [0.6, 0.3, 0.1]], [[0.8, 0.1, 0.1], [0.6, 0.2, 0.2]]],
    ])
    layers = []
    for layer in rows:
        a = torch.full((2, 2, 3, 3), 1 / 3)
        a[:, :, 2] = layer
        layers.append(a.clone().requires_grad_(True))
    image = torch.tensor([[True, False, False]] * 2)
    queries = torch.tensor([[False, False, True]] * 2)
    return layers, image, queries


def test_share_and_hinge_match_hand_computation():
    layers, image, queries = _attention()
    mas = modality_attention_share(layers, image, queries).detach()
    # sample 0: layer 0 (0.5 + 0.1) / 2 = 0.3, layer 1 (0.2 + 0.6) / 2 = 0.4 -> 0.35
    # sample 1: layer 0 (0.9 + 0.7) / 2 = 0.8, layer 1 (0.8 + 0.6) / 2 = 0.7 -> 0.75
    torch.testing.assert_close(mas, torch.tensor([0.35, 0.75]))
    wrong = torch.tensor([True, True])
    # only sample 0 is under tau = 0.4: 0.1 * (0.4 - 0.35) / 2 samples
    assert float(mas_hinge(mas, wrong, tau=0.4, lam=0.1)) == pytest.approx(0.0025)
    assert float(mas_hinge(mas, torch.tensor([False, True]), tau=0.4, lam=0.1)) == 0.0  # right answers: no term


def test_gradient_matches_hand_derivative():
    layers, image, queries = _attention()
    loss = mas_hinge(modality_attention_share(layers, image, queries), torch.tensor([True, True]), 0.4, 0.1)
    loss.backward()
    # d loss / d A[l, b=0, h, q=2, k] = -lam / B * dMAS/dA; dMAS/dA = (1[k image] - share) / (L * H * Q * rowsum)
    for layer in layers:
        g = layer.grad
        share = layer.detach()[0, :, 2, 0]  # per head (rows sum to 1)
        for h in range(2):
            expect = torch.stack([1 - share[h], -share[h], -share[h]]) / (2 * 2 * 1) * (-0.1 / 2)
            torch.testing.assert_close(g[0, h, 2], expect)
        assert torch.count_nonzero(g[1]) == 0  # sample 1 is above tau
        assert torch.count_nonzero(g[0, :, :2]) == 0  # non-answer queries carry no gradient


def test_answer_wrong_reads_shifted_logits():
    labels = torch.tensor([[-100, 4, 5, -100]])
    logits = torch.zeros(1, 4, 8)
    logits[0, 0, 4] = logits[0, 1, 5] = 1  # predicts 4 then 5: right
    assert not bool(answer_wrong(logits, labels)[0])
    logits[0, 1, 5], logits[0, 1, 6] = 0, 1
    assert bool(answer_wrong(logits, labels)[0])


def test_mas_loss_in_a_training_step(tiny):
    cfg, model, processor = tiny
    model.config._attn_implementation = "eager"
    maker = BatchMaker(processor, cfg.board_size, cfg.cell_px, cfg.radius)
    gen = torch.Generator().manual_seed(0)
    loss = MasLoss(tau=1.0, lam=1.0)  # tau 1: every wrong sample is penalised
    vision = maker.make("multimodal_num", torch.tensor([1, 2, 3, 4]), gen)
    out = model(input_ids=vision.input_ids, pixel_values=vision.pixel_values, labels=vision.labels,
                output_attentions=True)
    value = loss(out, vision)
    mas = modality_attention_share(out.attentions, vision.image_mask, vision.labels != -100).detach()
    wrong = answer_wrong(out.logits, vision.labels)
    assert float(value.detach()) == pytest.approx(float(((1 - mas) * wrong).mean()), rel=1e-5)
    value.backward()
    assert model.decoder.layers[0].self_attn.q_proj.weight.grad is not None
    text = maker.make("text_only_num", torch.tensor([1, 2]), gen)
    out = model(input_ids=text.input_ids, labels=text.labels, output_attentions=True)
    assert float(loss(out, text)) == 0.0  # no image keys: nothing to share


@pytest.mark.slow
def test_fine_tuning_with_the_hook_raises_mas(tmp_path):
    """A few steps with a strong MAS term move answer attention toward the image."""
    cfg = tiny_config(batch_size=16)
    cfg.stage1.steps, cfg.stage1.warmup = 40, 1
    cfg.stage2.steps, cfg.stage2.lr, cfg.stage2.vision_lr, cfg.stage2.warmup = 30, 3e-3, 0.0, 1
    base = train(cfg, stages=(1,))  # a few steps from scratch: a weak model, wrong often
    base.model.save_pretrained(tmp_path / "base")
    maker = BatchMaker(base.processor, cfg.board_size, cfg.cell_px, cfg.radius)
    probe = maker.make("multimodal_num", torch.arange(6), torch.Generator().manual_seed(1))

    def mas_of(model):
        model.config._attn_implementation = "eager"
        with torch.no_grad():
            out = model(input_ids=probe.input_ids, pixel_values=probe.pixel_values, output_attentions=True)
        return float(modality_attention_share(out.attentions, probe.image_mask, probe.labels != -100).mean())

    before = mas_of(base.model)
    tuned = train(cfg, extra_loss=MasLoss(tau=1.0, lam=5.0), init=tmp_path / "base", stages=(2,))
    assert mas_of(tuned.model) > before + 0.05
