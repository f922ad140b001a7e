from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor

import lab  # noqa: F401
from lab.trainer import Trainer
from stimuli import goboard as G
from toyvlm.processor import prompt


def _inputs(model, processor, count=3, seed=0):
    cfg = G.Config(preset="small", board_size=model.config.board_size, counts=str(count),
                   variation="mild")
    s = next(G.generate(cfg, 1, seed, "t"))
    return processor(images=[s.image, s.image], text=[prompt(s.prompts["multimodal_num"], image=True)] * 2)


def test_forward_contract(tiny):
    cfg, model, processor = tiny
    inputs = _inputs(model, processor)
    n_img = int((inputs["input_ids"] == model.config.image_token_id).sum(1)[0])
    assert n_img == cfg.board_size ** 2  # one token per intersection
    with torch.no_grad():
        out = model(**inputs, output_attentions=True, output_hidden_states=True)
    b, t = inputs["input_ids"].shape
    assert out.logits.shape == (b, t, model.config.vocab_size)
    assert len(out.attentions) == model.config.decoder_layers
    assert out.attentions[0].shape == (b, model.config.num_attention_heads, t, t)
    assert out.vision_attentions[0].shape == (b, 2, n_img, n_img)
    assert len(out.hidden_states) == model.config.decoder_layers + 1
    # causal: no weight on future keys
    assert float(out.attentions[0][0, :, 0, 1:].abs().max()) == 0.0
    names = dict(model.named_modules())
    for path in ("vision.blocks.0", "vision.blocks.0.attn", "vision.norm", "projector",
                 "decoder.layers.0", "decoder.layers.0.self_attn", "decoder.norm", "lm_head"):
        assert path in names


def test_sdpa_matches_eager(tiny):
    _, model, processor = tiny
    inputs = _inputs(model, processor)
    model.config._attn_implementation = "sdpa"
    a = model(**inputs).logits
    model.config._attn_implementation = "eager"
    b = model(**inputs).logits
    assert torch.allclose(a, b, atol=1e-5)


def test_generate_matches_greedy_without_cache(tiny):
    _, model, processor = tiny
    model.eval()
    inputs = _inputs(model, processor)
    seq = model.generate(**inputs, max_new_tokens=4, do_sample=False, eos_token_id=None)
    ids = inputs["input_ids"]
    for _ in range(4):  # recompute the whole sequence each step: no cache involved
        logits = model(input_ids=ids, pixel_values=inputs["pixel_values"]).logits
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(seq, ids)


def test_save_load_identical_logits(tiny, tmp_path):
    _, model, processor = tiny
    model.eval()
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path).eval()
    proc2 = AutoProcessor.from_pretrained(tmp_path)
    inputs = _inputs(model, processor)
    inputs2 = _inputs(loaded, proc2)
    assert torch.equal(inputs["input_ids"], inputs2["input_ids"])
    assert torch.equal(inputs["pixel_values"], inputs2["pixel_values"])
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, loaded(**inputs2).logits)
    causal = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(causal) is type(model)


def test_training_steps_lower_loss(tiny):
    cfg, model, processor = tiny
    model.train()
    trainer = Trainer(cfg, model, processor)
    batches = [trainer.batch(t) for t in ("text_only_num", "multimodal_num", "multimodal_tf")]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with torch.no_grad():
        before = sum(float(model(input_ids=b.input_ids, pixel_values=b.pixel_values,
                                 labels=b.labels).loss) for b in batches)
    for _ in range(15):
        for b in batches:
            trainer.step(opt, b)
    with torch.no_grad():
        after = sum(float(model(input_ids=b.input_ids, pixel_values=b.pixel_values,
                                labels=b.labels).loss) for b in batches)
    assert after < 0.7 * before


def test_extra_loss_hook_sees_attentions(tiny):
    cfg, model, processor = tiny
    model.config._attn_implementation = "eager"
    seen = {}

    def image_share(outputs, batch):
        # The MAS shape: attention mass on image keys from answer queries, averaged.
        attn = torch.stack(outputs.attentions)  # [L, B, H, T, T]
        share = (attn * batch.image_mask[None, :, None, None, :]).sum(-1)  # [L, B, H, T]
        q = batch.answer_mask.roll(-1, dims=1)  # the positions that predict answer tokens
        seen["share"] = float(share.mean(2)[:, q].mean().detach())
        return torch.relu(0.5 - share.mean(2)[:, q].mean())

    trainer = Trainer(cfg, model, processor, extra_loss=image_share)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer.step(opt, trainer.batch("multimodal_num"))
    assert 0.0 < seen["share"] < 1.0
