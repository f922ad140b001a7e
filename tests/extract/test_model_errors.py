"""Bad inputs fail early with messages that say what was expected, what was found and the fix."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_cases import IMAGE, noise_image

from extract.models import (
    InputError,
    ModelNotFoundError,
    NonFiniteActivationError,
    TapError,
    TapSpec,
    UnknownArchitectureError,
    capture,
    load_model,
    prepare_batch,
    supported,
)

W, H, _ = IMAGE["llava"]


def test_missing_model_folder(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist.*config.json"):
        load_model(tmp_path / "nope")
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load_model("./models/nope")
    # a hub id while offline: the cache is all there is
    with pytest.raises(ModelNotFoundError, match="(?s)cannot read the config of 'someorg/not-a-model'.*HF_HUB_OFFLINE"):
        load_model("someorg/not-a-model")


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        load_model(tmp_path)


def test_unknown_architecture_names_supported_ones_before_loading_weights(tmp_path):
    # a config alone: the adapter check must come before any weight is read
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 32}))
    with pytest.raises(UnknownArchitectureError) as err:
        load_model(tmp_path)
    message = str(err.value)
    assert "'bert'" in message and "docs/adapters.md" in message
    for model_type in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "llava_onevision", "internvl", "idefics3",
                       "smolvlm", "gemma3", "paligemma"):
        assert model_type in supported() and model_type in message


def test_unreadable_and_missing_images(tiny_lm, tmp_path):
    lm = tiny_lm("llava")
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n this is not a png")
    with pytest.raises(InputError, match="broken.png.*cannot be read"):
        prepare_batch(lm, [broken], ["What?"])
    with pytest.raises(InputError, match="does not exist"):
        prepare_batch(lm, [tmp_path / "missing.png"], ["What?"])
    with pytest.raises(InputError, match="PIL image or an image path"):
        prepare_batch(lm, [42], ["What?"])
    with pytest.raises(InputError, match="one prompt per image"):
        prepare_batch(lm, [noise_image(W, H, 0)], ["a", "b"])


def test_image_paths_load_like_pil_images(tiny_lm, tmp_path):
    lm = tiny_lm("llava")
    image = noise_image(W, H, 0)
    image.save(tmp_path / "x.png")
    a = prepare_batch(lm, [tmp_path / "x.png"], ["What?"])
    b = prepare_batch(lm, [image], ["What?"])
    assert torch.equal(a.inputs["pixel_values"], b.inputs["pixel_values"])


def test_tap_names():
    assert TapSpec.parse("llm.3") == TapSpec("llm", 3, "resid_post")
    assert TapSpec.parse("projector.0.in").site == "in"
    assert TapSpec.parse("logits") == TapSpec("logits", -1, "out")
    assert TapSpec("vision", -1, "pre_merger").name == "vision.-1.pre_merger"
    with pytest.raises(TapError, match="unknown tap 'mlp'.*vision, projector, llm, attn, logits"):
        TapSpec("mlp", 0)
    with pytest.raises(TapError, match="no site 'in'.*resid_post"):
        TapSpec("llm", 0, "in")
    with pytest.raises(TapError, match="not an integer"):
        TapSpec.parse("llm.last")


def _forward_counter(lm):
    calls = []
    handle = lm.model.register_forward_pre_hook(lambda m, a: calls.append(1))
    return calls, handle


def test_bad_taps_fail_before_the_forward(tiny_lm):
    lm = tiny_lm("llava")
    batch = prepare_batch(lm, [noise_image(W, H, 0)], ["What?"])
    calls, handle = _forward_counter(lm)
    try:
        with pytest.raises(TapError, match=r"no llm layer 7: valid layers are 0\.\.1 \(or -2\.\.-1\)"):
            capture(lm, batch, ["llm.0", "llm.7"])
        with pytest.raises(TapError, match="no vision layer -3"):
            capture(lm, batch, ["vision.-3"])
        with pytest.raises(TapError, match="no site 'pre_merger'.*resid_post"):
            capture(lm, batch, ["vision.-1.pre_merger"])  # Qwen only
        with pytest.raises(TapError, match="no projector layer 1: the only layer is 0"):
            capture(lm, batch, ["projector.1"])
        with pytest.raises(TapError, match="unknown token kind.*'cls'"):
            capture(lm, batch, ["llm.0"], tokens=("cls",))
        with pytest.raises(TapError, match="'answer' needs answer tokens"):
            capture(lm, batch, ["llm.0"], tokens=("answer",))
        with pytest.raises(TapError, match="no taps requested"):
            capture(lm, batch, [])
    finally:
        handle.remove()
    assert not calls


def test_per_tap_token_kinds(tiny_lm):
    lm = tiny_lm("llava")
    batch = prepare_batch(lm, [noise_image(W, H, 0)], ["What?"], answers=["A."])
    res = capture(lm, batch, {"vision.0": ["image"], "llm.1": ["image", "last"], "attn.1": ["answer"], "llm.-1": ["answer"]})
    assert sorted(k.name for k in res.keys()) == [
        "attn.1.probs/answer", "llm.1.resid_post/answer", "llm.1.resid_post/image", "llm.1.resid_post/last",
        "vision.0.resid_post/image",
    ]
    with pytest.raises(TapError, match="image tokens only"):
        capture(lm, batch, {"vision.0": ["last"]})


def test_pre_merger_only_after_the_last_block(tiny_lm):
    lm = tiny_lm("qwen2_vl")
    batch = prepare_batch(lm, [noise_image(*IMAGE["qwen2_vl"][:2], 0)], ["What?"])
    with pytest.raises(TapError, match="use layer -1"):
        capture(lm, batch, ["vision.0.pre_merger"])


def test_nonfinite_activations_raise_or_flag(tiny_lm):
    lm = tiny_lm("llava")
    batch = prepare_batch(lm, [noise_image(W, H, 0)], ["What?"])
    layer = lm.model.get_submodule(f"{lm.adapter.llm_layers}.0")

    def poison(module, args, output):
        out = output[0] if isinstance(output, tuple) else output
        out = out.clone()
        out[..., 0] = float("nan")
        return (out, *output[1:]) if isinstance(output, tuple) else out

    handle = layer.register_forward_hook(poison)
    try:
        with pytest.raises(NonFiniteActivationError, match=r"llm\.0\.resid_post/last.*on_nonfinite='flag'"):
            capture(lm, batch, ["vision.0", "llm.0"])
        res = capture(lm, batch, ["vision.0", "llm.0"], on_nonfinite="flag")
    finally:
        handle.remove()
    assert set(k.name for k in res.nonfinite) == {"llm.0.resid_post/image", "llm.0.resid_post/last"}
    assert torch.isnan(res[("llm", 0, "resid_post", "last")]).any()


def test_hooks_and_attention_mode_are_restored(tiny_lm):
    lm = tiny_lm("qwen2_5_vl")
    batch = prepare_batch(lm, [noise_image(*IMAGE["qwen2_5_vl"][:2], 0)], ["What?"])

    def hooks():
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in lm.model.modules())

    before, impl = hooks(), lm.model.config._attn_implementation
    capture(lm, batch, ["vision.0", "projector.0.in", "projector.0.out", "llm.1", "attn.0"])
    with pytest.raises(TapError):
        capture(lm, batch, ["llm.0"], tokens=("answer",))
    assert hooks() == before
    assert lm.model.config._attn_implementation == impl
    assert lm.model.config.vision_config._attn_implementation == impl
