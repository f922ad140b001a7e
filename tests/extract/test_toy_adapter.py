"""The toy counting model (lab/) through the extraction adapter, against its own outputs."""

from __future__ import annotations

import torch
from devices import close, cpu
from tiny_cases import TOY_IMAGE, noise_image

from extract.models import capture, prepare_batch, readout

TOL = dict(rtol=1e-4, atol=1e-5)  # fp32; a reduced dtype (AGNOSIA_TEST_DTYPE) gets devices.close's bound


def test_toy_taps_equal_the_models_own_outputs(tiny_lm):
    lm = tiny_lm("toy_counter")
    width, height, _ = TOY_IMAGE
    images = [noise_image(width, height, 1), noise_image(width, height, 2)]
    batch = prepare_batch(lm, images, ["How many black stones are there on the chessboard ?"] * 2,
                          answers=["4 7", "5"])
    taps = ["vision.0", "vision.-1", "projector.0.in", "projector.0.out", "llm.0", "llm.-1", "attn.-1"]
    res = capture(lm, batch, taps, tokens=("image", "last", "answer"))
    with torch.no_grad():
        out = lm.model(**batch.inputs, output_hidden_states=True, output_attentions=True)
        normed_all = [lm.model.vision.norm(h) for h in out.vision_hidden_states[-1]]
    hidden = [cpu(h) for h in out.hidden_states]
    attentions = [cpu(a) for a in out.attentions]
    vision_hidden = [cpu(h) for h in out.vision_hidden_states]
    logits, image_features = cpu(out.logits), cpu(out.image_features)
    n_llm = lm.adapter.n_layers("llm")
    for b, lay in enumerate(batch.layouts):
        assert len(lay.image_positions) == 121  # one token per intersection of the 11x11 board
        assert lay.geometry.llm[0].rows == lay.geometry.llm[0].cols == 11
        for kind in ("image", "last", "answer"):
            pos = torch.as_tensor(lay.positions(kind))
            value = res[("llm", 0, "resid_post", kind)]
            got = value.row(b) if hasattr(value, "row") else value[b]
            close(got, hidden[1][b, pos], **TOL)
            last = res[("llm", n_llm - 1, "resid_post", kind)]
            last = last.row(b) if hasattr(last, "row") else last[b]
            close(readout(lm).logits(last), logits[b, pos], **TOL)
        att = res[("attn", n_llm - 1, "probs", "last")][b]
        close(att[:, 0], attentions[-1][b, :, lay.last_position], **TOL)
        close(res[("vision", 0, "resid_post", "image")][b], vision_hidden[1][b], **TOL)
        close(res[("projector", 0, "out", "image")][b], image_features[b], **TOL)
        # the projector's input is the ViT output after its final norm (the study's probe features)
        close(res[("projector", 0, "in", "image")][b], cpu(normed_all[b]), **TOL)
