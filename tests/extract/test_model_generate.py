"""Capture during generate: the prompt pass and every fed-back token, equal to a teacher-forced run."""

from __future__ import annotations

import pytest
import torch
from devices import close
from tiny_cases import IMAGE, noise_image, quick

from extract.models import capture, capture_generate, prepare_batch
from extract.models.errors import TapError

pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")  # PaliGemma's processor
STEPS = 4
TOL = dict(rtol=1e-4, atol=1e-4)  # KV-cache decoding vs one full forward: float rounding only (bf16: devices.close)


@pytest.mark.parametrize("arch", quick(["qwen2_vl", "llava_onevision", "gemma3", "paligemma"], "qwen2_vl"))
def test_generate_capture_equals_teacher_forcing(arch, tiny_lm):
    lm = tiny_lm(arch)
    width, height, _ = IMAGE[arch]
    images = [noise_image(width, height, 7), noise_image(width, height, 8)]
    prompts = ["Count.", "How many stones are on the board?"]  # different lengths: left padding matters
    batch = prepare_batch(lm, images, prompts, padding_side="left")
    taps = ["llm.0", "llm.-1", "attn.-1", "logits"]
    # min_new_tokens keeps EOS away so every row generates STEPS real tokens; a random model may pick an
    # image token, which the teacher-forced batch refuses (more image tokens than its image has)
    suppressed = sorted(lm.tokenizer.added_tokens_decoder)
    gen = capture_generate(lm, batch, taps, tokens=("last", "answer"), max_new_tokens=STEPS, min_new_tokens=STEPS,
                           suppress_tokens=suppressed)
    assert gen.generated.shape == (2, STEPS) and len(gen.texts) == 2
    assert gen[("llm", 0, "resid_post", "answer")].shape == (2, STEPS - 1, 64)

    # the same sequences, teacher-forced: answers = generated ids except the last (never fed back)
    forced = prepare_batch(lm, images, prompts, answers=gen.generated[:, :-1].tolist(), padding_side="left")
    ref = capture(lm, forced, taps, tokens=("last", "answer"))
    for key in ref.keys():
        mine, want = gen[key], ref[key]
        if key.tap == "attn" and key.kind == "last":
            # the prompt pass has only the prompt's keys; later (answer) keys are masked for it anyway
            n_keys = mine.shape[-1]
            assert n_keys == batch.seq_len and not want[..., n_keys:].any()
            want = want[..., :n_keys]
        # answer attention rows are zero-padded to the final key length: the forced run's length
        close(mine, want, **TOL, msg=key.name)
    for b in range(2):
        assert gen.layouts[b].answer_positions.tolist() == forced.layouts[b].answer_positions.tolist()
    # greedy: the logits at the last prompt token pick the first generated token (among those allowed)
    logits = gen[("logits", 0, "out", "last")][:, 0].clone()
    logits[:, suppressed] = -torch.inf
    assert logits.argmax(-1).tolist() == gen.generated[:, 0].tolist()


def test_generate_needs_left_padding(tiny_lm):
    lm = tiny_lm("qwen2_vl")
    width, height, _ = IMAGE["qwen2_vl"]
    batch = prepare_batch(lm, [noise_image(width, height, 1)] * 2, ["a", "bb"])
    with pytest.raises(TapError, match="left padding"):
        capture_generate(lm, batch, ["llm.0"], max_new_tokens=2)


def test_generate_logits_only_at_last_and_answer(tiny_lm):
    lm = tiny_lm("qwen2_vl")
    width, height, _ = IMAGE["qwen2_vl"]
    batch = prepare_batch(lm, [noise_image(width, height, 1)], ["a"], padding_side="left")
    with pytest.raises(TapError, match="logits exist only for the last prompt token"):
        capture_generate(lm, batch, ["logits"], tokens=("image",), max_new_tokens=2)


def test_generate_under_capture_is_never_compiled(tiny_lm, monkeypatch):
    """On CUDA, generate() compiles a static cache's forward into CUDA graphs, whose replays overwrite
    the tensors the hooks kept from the step before (seen on an H200 with Gemma3). The capture turns
    that off: here the model asks to be compiled on every device, and generate() still declines."""
    from transformers import CompileConfig

    lm = tiny_lm("gemma3")
    width, height, _ = IMAGE["gemma3"]
    batch = prepare_batch(lm, [noise_image(width, height, 7)], ["Count."], padding_side="left")
    everywhere = CompileConfig()
    everywhere._compile_all_devices = True  # transformers' switch to compile off CUDA too
    asked = []
    would = type(lm.model)._valid_auto_compile_criteria

    def criteria(self, model_kwargs, generation_config):
        asked.append(would(self, model_kwargs, generation_config))
        return False  # whatever the answer: this test does not compile

    monkeypatch.setattr(type(lm.model), "_valid_auto_compile_criteria", criteria)
    gen = capture_generate(lm, batch, ["llm.0"], tokens=("answer",), max_new_tokens=2, min_new_tokens=2,
                           cache_implementation="static", compile_config=everywhere)
    assert gen.generated.shape == (1, 2)
    assert asked == [False]
    lm.model.generate(**batch.inputs, max_new_tokens=1, cache_implementation="static", compile_config=everywhere)
    assert asked == [False, True]  # the same call without the capture would compile
